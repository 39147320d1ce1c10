// QuickLoad: closed-loop load against `entitlements serve`.
//
//   QuickLoad HOST PORT CONNECTIONS IN_FLIGHT SECONDS CUSTOMERS [THREADS] [WRITE_PERCENT]
//
// Each connection keeps IN_FLIGHT CheckEntitlements requests outstanding (uniform random
// customers user-0 ... user-(CUSTOMERS-1)) for SECONDS after a one-second warm-up, and
// records each request's latency from send to answer. Prints throughput and percentiles.
// WRITE_PERCENT of the requests are GrantEntitlement writes instead, each with a new
// grant id (so each changes the customer and is logged); 100 measures writes alone.
import EntitlementsMessages
import EntitlementsWire
import Foundation
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix

let arguments = CommandLine.arguments
guard arguments.count >= 7, let port = Int(arguments[2]), let connections = Int(arguments[3]),
    let inFlight = Int(arguments[4]), let seconds = Double(arguments[5]), let customers = Int(arguments[6])
else {
    print("usage: QuickLoad HOST PORT CONNECTIONS IN_FLIGHT SECONDS CUSTOMERS [THREADS]")
    exit(2)
}
let threads = arguments.count > 7 ? Int(arguments[7]) ?? 1 : 1
let writePercent = arguments.count > 8 ? Int(arguments[8]) ?? 0 : 0
let host = arguments[1]

/// Pre-encoded request payloads, one per customer (so encoding is not measured).
let payloads: [ByteBuffer] = (0..<min(customers, 100_000)).map { index in
    ByteBuffer(bytes: try! CheckEntitlementsRequest(userId: "user-\(index)").serializedBytes())
}

final class Results: Sendable {
    let latencies = NIOLockedValueBox<[UInt64]>([])
    let errors = NIOLockedValueBox(0)
}

let results = Results()
let warmupEnd = NIODeadline.now() + .seconds(1)
let end = warmupEnd + .nanoseconds(Int64(seconds * 1e9))

final class LoadHandler: ChannelInboundHandler {
    typealias InboundIn = Frame
    typealias OutboundOut = ByteBuffer
    var nextID: UInt64 = 1
    var sentAt: [UInt64: UInt64] = [:]
    var latencies: [UInt64] = []
    var errors = 0
    var random = SystemRandomNumberGenerator()
    let done: EventLoopPromise<Void>
    let inFlight: Int

    init(done: EventLoopPromise<Void>, inFlight: Int) {
        self.done = done
        self.inFlight = inFlight
    }

    func channelActive(context: ChannelHandlerContext) {
        for _ in 0..<self.inFlight {
            self.send(context: context, flush: false)
        }
        context.flush()
    }

    func send(context: ChannelHandlerContext, flush: Bool) {
        let id = self.nextID
        self.nextID += 1
        let customer = Int.random(in: 0..<payloads.count, using: &self.random)
        var payload = payloads[customer]
        var method = MethodID.checkEntitlements
        if writePercent > 0, Int.random(in: 0..<100, using: &self.random) < writePercent {
            let grant = Grant(grantId: "load-\(ObjectIdentifier(self).hashValue)-\(id)", entitlementId: "bench")
            payload = ByteBuffer(bytes: try! GrantEntitlementRequest(userId: "user-\(customer)", grant: grant).serializedBytes())
            method = .grantEntitlement
        }
        var buffer = context.channel.allocator.buffer(capacity: Frame.headerSize + payload.readableBytes)
        buffer.writeFrameHeader(type: .request, method: method, requestID: id, payloadLength: UInt32(payload.readableBytes))
        buffer.writeImmutableBuffer(payload)
        self.sentAt[id] = DispatchTime.now().uptimeNanoseconds
        context.write(self.wrapOutboundOut(buffer), promise: nil)
        if flush { context.flush() }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = self.unwrapInboundIn(data)
        guard let started = self.sentAt.removeValue(forKey: frame.requestID) else { return }
        let now = NIODeadline.now()
        if now > warmupEnd {
            self.latencies.append(DispatchTime.now().uptimeNanoseconds - started)
            if frame.status != .ok { self.errors += 1 }
        }
        if now < end {
            self.send(context: context, flush: false)
        } else if self.sentAt.isEmpty {
            let mine = self.latencies
            let errors = self.errors
            results.latencies.withLockedValue { $0.append(contentsOf: mine) }
            results.errors.withLockedValue { $0 += errors }
            self.done.succeed(())
            context.close(promise: nil)
        }
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        context.flush()
    }
}

let group = MultiThreadedEventLoopGroup(numberOfThreads: threads)
var futures: [EventLoopFuture<Void>] = []
for _ in 0..<connections {
    let loop = group.next()
    let done = loop.makePromise(of: Void.self)
    futures.append(done.futureResult)
    _ = try ClientBootstrap(group: loop)
        .channelOption(.socketOption(.tcp_nodelay), value: 1)
        .channelInitializer { channel in
            channel.eventLoop.makeCompletedFuture {
                try channel.pipeline.syncOperations.addHandlers(ByteToMessageHandler(FrameDecoder()), LoadHandler(done: done, inFlight: inFlight))
            }
        }
        .connect(host: host, port: port).wait()
}
try EventLoopFuture.andAllSucceed(futures, on: group.next()).wait()
let latencies = results.latencies.withLockedValue { $0 }.sorted()
func percentile(_ p: Double) -> String {
    guard !latencies.isEmpty else { return "-" }
    let value = latencies[min(latencies.count - 1, Int(Double(latencies.count) * p))]
    return String(format: "%.1f us", Double(value) / 1_000)
}
print(String(
    format: "%d connections x %d in flight, %.0f s: %.0f requests/s, p50 %@, p90 %@, p99 %@, p99.9 %@, max %@, errors %d",
    connections, inFlight, seconds, Double(latencies.count) / seconds,
    percentile(0.5), percentile(0.9), percentile(0.99), percentile(0.999), percentile(1.0), results.errors.withLockedValue { $0 }
))
try group.syncShutdownGracefully()
