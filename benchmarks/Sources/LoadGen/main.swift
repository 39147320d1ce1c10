// LoadGen: the load generator of benchmarks/run.sh, on SwiftNIO.
//
//   LoadGen run --target entitlements|redis|grpc --host H --port P [--unix PATH]
//               [--connections C] [--in-flight D] [--rate R] [--duration S] [--warmup S]
//               [--customers N] [--keys uniform|zipf] [--zipf-s 0.99] [--write-percent W]
//               [--batch B] [--json FILE] [--distribution FILE] [--label TEXT] [--server-pid PID]
//               [--tls-ca CA.pem [--tls-server-name NAME]] [--token TOKEN]
//   LoadGen load-redis --port P --snapshot FILE [--at UNIX_MS]
//   LoadGen export-answers --snapshot FILE --output FILE [--at UNIX_MS]
//
// Closed loop (default): each of C connections keeps D requests in flight. Open loop
// (--rate R requests/s over all connections): requests are sent on a fixed schedule
// whatever the answers do, and latency is measured from the *scheduled* send time, so a
// stall is charged to every request it delays (coordinated omission corrected, as wrk2).
// Keys: customer ids user-0 ... user-(N-1), uniform or Zipf (the continuous power-law
// approximation, exponent --zipf-s). With --batch B, each request asks about B customers:
// a BatchCheckEntitlements of B users, or a Redis MGET of B keys; "requests" are then
// batches, and the JSON adds usersPerSecond. Latencies go to an HdrHistogram (1 µs to 60 s, 3
// significant digits). --target grpc speaks gRPC on raw HTTP/2 frames (H2Client.swift).
//
// load-redis SETs each customer's answer (the bytes `serve` sends for it) in Redis;
// export-answers writes the same answers to a file for the gRPC peers in peers/ (records
// of a 4-byte big-endian key length, the key, a 4-byte value length, the value).
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsCache
import EntitlementsStore
import EntitlementsWire
import Foundation
import Histogram
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import NIOSSL

// MARK: Arguments

enum Target: String, Sendable {
    case entitlements, redis, grpc
}

/// The command line, parsed once (a type's static constant: readable from any thread).
struct Settings: Sendable {
    var command: String
    var options: [String: String]

    static let current: Settings = {
        var arguments = Array(CommandLine.arguments.dropFirst())
        guard let command = arguments.first else {
            print("usage: LoadGen run ... | LoadGen load-redis ... (see the comment at the top of main.swift)")
            exit(2)
        }
        arguments.removeFirst()
        var options: [String: String] = [:]
        var index = 0
        while index < arguments.count {
            let name = arguments[index]
            guard name.hasPrefix("--"), index + 1 < arguments.count else {
                print("error: expected --name value, got \(name)")
                exit(2)
            }
            options[String(name.dropFirst(2))] = arguments[index + 1]
            index += 2
        }
        return Settings(command: command, options: options)
    }()

    func text(_ name: String, _ fallback: String) -> String { self.options[name] ?? fallback }

    func number(_ name: String, _ fallback: Double) -> Double {
        guard let text = self.options[name] else { return fallback }
        guard let value = Double(text) else {
            print("error: --\(name) \"\(text)\" is not a number")
            exit(2)
        }
        return value
    }

    var target: Target {
        guard let target = Target(rawValue: self.text("target", "entitlements")) else {
            print("error: --target must be entitlements, redis or grpc")
            exit(2)
        }
        return target
    }
    var host: String { self.text("host", "127.0.0.1") }
    var port: Int { Int(self.number("port", [.redis: 6379, .grpc: 7493][self.target] ?? 7420)) }
    var unixPath: String? { self.options["unix"] }
    var connections: Int { Int(self.number("connections", 1)) }
    var inFlight: Int { Int(self.number("in-flight", 1)) }
    var rate: Double? { self.options["rate"].map { _ in self.number("rate", 0) } }
    var duration: Double { self.number("duration", 5) }
    var warmup: Double { self.number("warmup", 1) }
    var customers: Int { Int(self.number("customers", 100_000)) }
    var zipf: Bool { self.text("keys", "uniform") == "zipf" }
    var zipfS: Double { self.number("zipf-s", 0.99) }
    var writePercent: Int { Int(self.number("write-percent", 0)) }
    var batch: Int { Int(self.number("batch", 1)) }
}

let settings = Settings.current
let command = settings.command
let options = settings.options
func option(_ name: String, _ fallback: String) -> String { Settings.current.text(name, fallback) }
func number(_ name: String, _ fallback: Double) -> Double { Settings.current.number(name, fallback) }

// MARK: load-redis, export-answers

/// Each customer of the snapshot with the bytes `serve` answers it for the default request
/// shape at `at`: what every peer serves.
func forEachAnswer(snapshot path: String, at: Int64, _ body: (String, ByteBuffer) throws -> Void) throws {
    let reader = try SnapshotReader(path: path)
    let resolver = EntitlementResolver(catalog: reader.catalog)
    try reader.forEachRecord { record, _ in
        guard let id = record.id else { return }
        let answer = try CachedAnswer(resolver.resolve(record, at: at), resolvedAt: at)
        var value = ByteBuffer()
        answer.writeResponse(userId: id, customerId: id, requestDate: at, into: &value)
        try body(id, value)
    }
}

if command == "load-redis" || command == "export-answers" {
    guard let path = options["snapshot"] else {
        print("error: \(command) needs --snapshot FILE")
        exit(2)
    }
    let at = Int64(number("at", Double(Int64(Date().timeIntervalSince1970 * 1000))))
    if command == "export-answers" {
        guard let output = options["output"], FileManager.default.createFile(atPath: output, contents: nil),
            let file = FileHandle(forWritingAtPath: output)
        else {
            print("error: export-answers needs --output FILE, writable")
            exit(2)
        }
        var chunk = ByteBuffer()
        var count = 0
        try forEachAnswer(snapshot: path, at: at) { id, value in
            chunk.writeInteger(UInt32(id.utf8.count))
            chunk.writeString(id)
            chunk.writeInteger(UInt32(value.readableBytes))
            chunk.writeImmutableBuffer(value)
            count += 1
            if chunk.readableBytes > 1 << 20 {
                file.write(Data(chunk.readableBytesView))
                chunk.clear()
            }
        }
        file.write(Data(chunk.readableBytesView))
        try file.close()
        print("exported \(count) answers to \(output)")
        exit(0)
    }
    let port = Int(number("port", 6379))
    let socket = try BlockingSocket(host: "127.0.0.1", port: port)
    var batch = ByteBuffer()
    var pending = 0
    var loaded = 0
    try forEachAnswer(snapshot: path, at: at) { id, value in
        batch.writeString("*3\r\n$3\r\nSET\r\n$\(id.utf8.count)\r\n\(id)\r\n$\(value.readableBytes)\r\n")
        batch.writeImmutableBuffer(value)
        batch.writeString("\r\n")
        pending += 1
        if pending == 1_000 {
            try socket.send(&batch)
            try socket.expect(replies: pending)
            loaded += pending
            pending = 0
        }
    }
    try socket.send(&batch)
    try socket.expect(replies: pending)
    loaded += pending
    print("loaded \(loaded) customers into redis on port \(port)")
    exit(0)
}

guard command == "run" else {
    print("error: unknown command \(command); use run, load-redis or export-answers")
    exit(2)
}

let target = settings.target
let host = settings.host
let port = settings.port
let unixPath = settings.unixPath
let connections = settings.connections
let rate = settings.rate
let duration = settings.duration
let writePercent = settings.writePercent
if target != .entitlements, writePercent > 0 {
    print("error: --write-percent is for --target entitlements")
    exit(2)
}
if settings.batch < 1 || (settings.batch > 1 && (target == .grpc || writePercent > 0)) {
    print("error: --batch is 1 or more, for --target entitlements or redis, without --write-percent")
    exit(2)
}
if target == .grpc, unixPath != nil || options["tls-ca"] != nil || options["token"] != nil {
    print("error: --unix, --tls-ca and --token are for --target entitlements")
    exit(2)
}

// MARK: Keys

/// The settings the per-request path reads, parsed once (`Settings`' properties parse
/// their text on every read).
enum Load {
    static let target = Settings.current.target
    static let customers = Settings.current.customers
    static let zipf = Settings.current.zipf
    static let zipfExponent = 1 - Settings.current.zipfS
    static let batch = Settings.current.batch
    static let writePercent = Settings.current.writePercent
}

/// xoshiro256** seeded once from the system generator. `SystemRandomNumberGenerator` makes a
/// `getrandom` system call per number: a quarter of the load generator's CPU at 100 keys a
/// request, time the load generator then could not spend loading the server.
struct FastRandom: RandomNumberGenerator {
    private var state: (UInt64, UInt64, UInt64, UInt64)

    init() {
        var system = SystemRandomNumberGenerator()
        self.state = (system.next(), system.next(), system.next(), system.next() | 1)
    }

    mutating func next() -> UInt64 {
        func rotate(_ x: UInt64, _ k: UInt64) -> UInt64 { (x << k) | (x >> (64 - k)) }
        let result = rotate(self.state.1 &* 5, 7) &* 9
        let t = self.state.1 << 17
        self.state.2 ^= self.state.0
        self.state.3 ^= self.state.1
        self.state.1 ^= self.state.2
        self.state.0 ^= self.state.3
        self.state.2 ^= t
        self.state.3 = rotate(self.state.3, 45)
        return result
    }
}

/// Customer indices, uniform or Zipf-distributed (hot customers are the low indices).
struct KeyPicker {
    var random = FastRandom()

    mutating func next() -> Int {
        let u = Double.random(in: 0..<1, using: &self.random)
        let customers = Load.customers
        guard Load.zipf else {
            return Int(u * Double(customers))
        }
        // Inverse CDF of the continuous density x^-s on [1, N+1).
        let n = Double(customers) + 1
        let exponent = Load.zipfExponent
        let x = exponent == 0 ? pow(n, u) : pow((pow(n, exponent) - 1) * u + 1, 1 / exponent)
        return min(customers - 1, max(0, Int(x) - 1))
    }
}

// MARK: Results

final class Results: Sendable {
    let histogram = NIOLockedValueBox(Histogram<UInt64>(lowestDiscernibleValue: 1, highestTrackableValue: 60_000_000, numberOfSignificantValueDigits: .three))
    let errors = NIOLockedValueBox(0)
}

/// The run's clock: warm-up, then the measured window.
enum Window {
    static let results = Results()
    static let start = NIODeadline.now()
    static let measureFrom = start + .nanoseconds(Int64(Settings.current.warmup * 1e9))
    static let end = measureFrom + .nanoseconds(Int64(Settings.current.duration * 1e9))
}
let results = Window.results
_ = Window.end

// MARK: CPU use

/// CPU time (user + system, seconds) a process has used, from /proc/<pid>/stat.
@Sendable func cpuSeconds(pid: String) -> Double? {
    guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
        let end = stat.lastIndex(of: ")")
    else { return nil }
    // After "pid (comm) ": state is field 3; utime and stime are fields 14 and 15.
    let fields = stat[stat.index(after: end)...].split(separator: " ")
    guard fields.count > 12, let user = Double(fields[11]), let system = Double(fields[12]) else { return nil }
    return (user + system) / Double(sysconf(Int32(_SC_CLK_TCK)))
}

/// The share of one core the server (`--server-pid`) and this load generator used during
/// the measured window: shows which side was the limit.
final class CPUSampler: Sendable {
    let usage = NIOLockedValueBox<(server: Double?, client: Double?)>((nil, nil))
    let done = DispatchSemaphore(value: 0)

    func start() {
        let serverPID = Settings.current.options["server-pid"]
        let thread = Thread {
            func sleep(until deadline: NIODeadline) {
                let now = NIODeadline.now()
                if deadline > now { usleep(UInt32((deadline - now).nanoseconds / 1_000)) }
            }
            sleep(until: Window.measureFrom)
            let server0 = serverPID.flatMap(cpuSeconds(pid:))
            let client0 = cpuSeconds(pid: "self")
            sleep(until: Window.end)
            let server1 = serverPID.flatMap(cpuSeconds(pid:))
            let client1 = cpuSeconds(pid: "self")
            let seconds = Settings.current.duration
            self.usage.withLockedValue {
                $0.server = server0.flatMap { start in server1.map { 100 * ($0 - start) / seconds } }
                $0.client = client0.flatMap { start in client1.map { 100 * ($0 - start) / seconds } }
            }
            self.done.signal()
        }
        thread.start()
    }
}
let cpu = CPUSampler()
cpu.start()

// MARK: The connection

final class LoadHandler: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private var keys = KeyPicker()
    private var decoder = FrameDecoder()
    private var buffer = ByteBuffer()
    /// Request id -> intended send time (ns); redis answers in order, so a FIFO there.
    private var sentAt: [UInt64: UInt64] = [:]
    private var fifo: [UInt64] = []
    private var fifoHead = 0
    private var nextID: UInt64 = 1
    private var histogram = Histogram<UInt64>(lowestDiscernibleValue: 1, highestTrackableValue: 60_000_000, numberOfSignificantValueDigits: .three)
    private var errors = 0
    private var finished = false
    private let done: EventLoopPromise<Void>
    private let interval: TimeAmount?
    private var nextScheduled: NIODeadline
    /// `--target grpc`: the HTTP/2 connection's state; request ids are stream ids.
    private var h2: H2Client?
    private var finishedStreams: [(UInt32, Bool)] = []

    init(done: EventLoopPromise<Void>, interval: TimeAmount?) {
        self.done = done
        self.interval = interval
        self.nextScheduled = NIODeadline.now()
        if Load.target == .grpc {
            self.h2 = H2Client(authority: "\(Settings.current.host):\(Settings.current.port)")
        }
    }

    func channelActive(context: ChannelHandlerContext) {
        if let h2 = self.h2 {
            var out = context.channel.allocator.buffer(capacity: 64)
            h2.preface(into: &out)
            context.write(self.wrapOutboundOut(out), promise: nil)
        }
        if let token = Settings.current.options["token"] {
            // Authenticate first (docs/PROTOCOL.md): its answer has no send time, so it is
            // not measured; the checks pipelined after it have its permissions.
            let payload = ByteBuffer(bytes: try! AuthenticateRequest(token: token).serializedBytes())
            var out = context.channel.allocator.buffer(capacity: 64)
            out.writeFrameHeader(type: .request, method: .authenticate, requestID: self.nextID, payloadLength: UInt32(payload.readableBytes))
            out.writeImmutableBuffer(payload)
            self.nextID += 1
            context.write(self.wrapOutboundOut(out), promise: nil)
        }
        if let interval = self.interval {
            // Open loop: each send is scheduled for its intended time.
            self.nextScheduled = NIODeadline.now()
            self.sendDue(context: context, interval: interval)
        } else {
            for _ in 0..<Settings.current.inFlight {
                self.send(context: context, intended: NIODeadline.now())
            }
            context.flush()
        }
    }

    private func sendDue(context: ChannelHandlerContext, interval: TimeAmount) {
        let now = NIODeadline.now()
        if now >= Window.end {
            self.finishIfIdle(context: context)
            return
        }
        while self.nextScheduled <= now {
            self.send(context: context, intended: self.nextScheduled)
            self.nextScheduled = self.nextScheduled + interval
        }
        context.flush()
        context.eventLoop.assumeIsolated().scheduleTask(deadline: self.nextScheduled) {
            self.sendDue(context: context, interval: interval)
        }
    }

    private func send(context: ChannelHandlerContext, intended: NIODeadline) {
        let customer = self.keys.next()
        var out = context.channel.allocator.buffer(capacity: 64)
        let stamp = intended.uptimeNanoseconds
        switch Load.target {
        case .redis where Load.batch > 1:
            let batch = Load.batch
            out.writeString("*\(batch + 1)\r\n$4\r\nMGET\r\n")
            for index in 0..<batch {
                let key = "user-\(index == 0 ? customer : self.keys.next())"
                out.writeString("$\(key.utf8.count)\r\n\(key)\r\n")
            }
            self.fifo.append(stamp)
        case .redis:
            let key = "user-\(customer)"
            out.writeString("*2\r\n$3\r\nGET\r\n$\(key.utf8.count)\r\n\(key)\r\n")
            self.fifo.append(stamp)
        case .grpc:
            guard self.h2!.canSend else {
                print("error: the gRPC server's connection window is exhausted (no WINDOW_UPDATE): the run is not valid")
                exit(1)
            }
            let stream = self.h2!.request(user: "user-\(customer)", into: &out)
            self.sentAt[UInt64(stream)] = stamp
        case .entitlements:
            let id = self.nextID
            self.nextID += 1
            if Load.writePercent > 0, Int.random(in: 0..<100, using: &self.keys.random) < Load.writePercent {
                let grant = Grant(grantId: "load-\(ObjectIdentifier(self).hashValue)-\(id)", entitlementId: "bench")
                let payload = ByteBuffer(bytes: try! GrantEntitlementRequest(userId: "user-\(customer)", grant: grant).serializedBytes())
                out.writeFrameHeader(type: .request, method: .grantEntitlement, requestID: id, payloadLength: UInt32(payload.readableBytes))
                out.writeImmutableBuffer(payload)
            } else if Load.batch > 1 {
                let users = [customer] + (1..<Load.batch).map { _ in self.keys.next() }
                let payload = ByteBuffer(bytes: try! BatchCheckEntitlementsRequest(userIds: users.map { "user-\($0)" }).serializedBytes())
                out.writeFrameHeader(type: .request, method: .batchCheckEntitlements, requestID: id, payloadLength: UInt32(payload.readableBytes))
                out.writeImmutableBuffer(payload)
            } else {
                // CheckEntitlementsRequest{user_id}: field 1, length-delimited.
                let user = "user-\(customer)"
                let length = user.utf8.count
                out.writeFrameHeader(type: .request, method: .checkEntitlements, requestID: id, payloadLength: UInt32(2 + length))
                out.writeInteger(UInt8(0x0A))
                out.writeInteger(UInt8(length))
                out.writeString(user)
            }
            self.sentAt[id] = stamp
        }
        context.write(self.wrapOutboundOut(out), promise: nil)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var incoming = self.unwrapInboundIn(data)
        self.buffer.writeBuffer(&incoming)
        do {
            switch Load.target {
            case .grpc:
                var reply = context.channel.allocator.buffer(capacity: 0)
                var finished = self.finishedStreams
                self.finishedStreams = []
                try self.h2!.read(&self.buffer, reply: &reply) { finished.append(($0, $1)) }
                if reply.readableBytes > 0 {
                    context.write(self.wrapOutboundOut(reply), promise: nil)
                }
                for (stream, ok) in finished {
                    guard let stamp = self.sentAt.removeValue(forKey: UInt64(stream)) else { continue }
                    self.answered(context: context, stamp: stamp, ok: ok)
                }
                finished.removeAll(keepingCapacity: true)
                self.finishedStreams = finished
            case .entitlements:
                while let frame = try self.decoder.decode(buffer: &self.buffer) {
                    guard let stamp = self.sentAt.removeValue(forKey: frame.requestID) else { continue }
                    self.answered(context: context, stamp: stamp, ok: frame.status == .ok)
                }
            case .redis:
                while let ok = Self.readRedisReply(&self.buffer) {
                    let stamp = self.fifo[self.fifoHead]
                    self.fifoHead += 1
                    if self.fifoHead > 4_096 {
                        self.fifo.removeFirst(self.fifoHead)
                        self.fifoHead = 0
                    }
                    self.answered(context: context, stamp: stamp, ok: ok)
                }
            }
        } catch {
            print("error: \(error)")
            context.close(promise: nil)
        }
        self.buffer.discardReadBytes()
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        context.flush()
    }

    private func answered(context: ChannelHandlerContext, stamp: UInt64, ok: Bool) {
        let now = NIODeadline.now()
        if NIODeadline.uptimeNanoseconds(stamp) >= Window.measureFrom, now <= Window.end + .seconds(60) {
            _ = self.histogram.record(max(1, (now.uptimeNanoseconds - stamp) / 1_000))
            if !ok { self.errors += 1 }
        }
        if self.interval == nil {
            if now < Window.end {
                self.send(context: context, intended: now)
            } else {
                self.finishIfIdle(context: context)
            }
        } else if now >= Window.end {
            self.finishIfIdle(context: context)
        }
    }

    private func finishIfIdle(context: ChannelHandlerContext) {
        let outstanding = Load.target == .redis ? self.fifo.count - self.fifoHead : self.sentAt.count
        guard outstanding == 0, !self.finished else { return }
        self.finished = true
        let histogram = self.histogram
        let errors = self.errors
        Window.results.histogram.withLockedValue { $0.add(histogram) }
        Window.results.errors.withLockedValue { $0 += errors }
        self.done.succeed(())
        context.close(promise: nil)
    }

    /// One RESP reply if complete: true for a bulk string (a hit), false for a nil or an
    /// error; nil when more bytes are needed.
    static func readRedisReply(_ buffer: inout ByteBuffer) -> Bool? {
        let parsed = buffer.withUnsafeReadableBytes { bytes -> (ok: Bool, length: Int)? in
            var offset = 0
            return Self.parseReply(bytes, &offset).map { ($0, offset) }
        }
        guard let parsed else { return nil }
        buffer.moveReaderIndex(forwardBy: parsed.length)
        return parsed.ok
    }

    /// One reply at `offset`, read in place (no strings: at an MGET of 100 keys the
    /// parsing must not become the load generator's limit); moves `offset` past it.
    private static func parseReply(_ bytes: UnsafeRawBufferPointer, _ offset: inout Int) -> Bool? {
        guard offset < bytes.count else { return nil }
        let kind = bytes[offset]
        var end = offset + 1
        while end < bytes.count, bytes[end] != UInt8(ascii: "\n") { end += 1 }
        guard end < bytes.count else { return nil }
        var position = offset + 1
        let negative = position < end && bytes[position] == UInt8(ascii: "-")
        if negative { position += 1 }
        var value = 0
        while position < end, bytes[position] >= UInt8(ascii: "0"), bytes[position] <= UInt8(ascii: "9") {
            value = value * 10 + Int(bytes[position] - UInt8(ascii: "0"))
            position += 1
        }
        if negative { value = -value }
        offset = end + 1
        switch kind {
        case UInt8(ascii: "*"):
            // An MGET's array: complete once every element is; true if all are hits.
            var allHits = value >= 0
            for _ in 0..<max(0, value) {
                guard let hit = Self.parseReply(bytes, &offset) else { return nil }
                allHits = allHits && hit
            }
            return allHits
        case UInt8(ascii: "$"):
            if value < 0 { return false }  // nil: a miss
            guard offset + value + 2 <= bytes.count else { return nil }
            offset += value + 2
            return true
        default:
            return kind == UInt8(ascii: "+")
        }
    }
}

// MARK: Run

let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
let perConnectionInterval = rate.map { TimeAmount.nanoseconds(Int64(1e9 * Double(connections) / $0)) }
var futures: [EventLoopFuture<Void>] = []
// --tls-ca: the framed connections speak TLS (the server's --tls-cert), trusting that CA.
let tlsContext: NIOSSLContext? = try options["tls-ca"].map { path in
    var tls = TLSConfiguration.makeClientConfiguration()
    tls.trustRoots = .certificates(try NIOSSLCertificate.fromPEMFile(path))
    return try NIOSSLContext(configuration: tls)
}
let tlsServerName = options["tls-server-name"]
for _ in 0..<connections {
    let loop = group.next()
    let done = loop.makePromise(of: Void.self)
    futures.append(done.futureResult)
    let bootstrap = ClientBootstrap(group: loop)
        .channelOption(.socketOption(.tcp_nodelay), value: 1)
        .channelInitializer { channel in
            channel.eventLoop.makeCompletedFuture {
                if let tlsContext {
                    try channel.pipeline.syncOperations.addHandler(try NIOSSLClientHandler(context: tlsContext, serverHostname: tlsServerName))
                }
                try channel.pipeline.syncOperations.addHandler(LoadHandler(done: done, interval: perConnectionInterval))
            }
        }
    if let unixPath {
        _ = try bootstrap.connect(unixDomainSocketPath: unixPath).wait()
    } else {
        _ = try bootstrap.connect(host: host, port: port).wait()
    }
}
try EventLoopFuture.andAllSucceed(futures, on: group.next()).wait()
try group.syncShutdownGracefully()

let histogram = results.histogram.withLockedValue { $0 }
let errors = results.errors.withLockedValue { $0 }
let throughput = Double(histogram.totalCount) / duration
func microseconds(_ percentile: Double) -> UInt64 { histogram.valueAtPercentile(percentile) }
_ = cpu.done.wait(timeout: .now() + 2)  // the window's last sample
let usage = cpu.usage.withLockedValue { $0 }
let label = option("label", "\(target.rawValue) \(connections)x\(rate.map { "rate \(Int($0))/s" } ?? "\(settings.inFlight)")")
print(String(
    format: "%@: %.0f requests/s, p50 %llu us, p90 %llu us, p99 %llu us, p99.9 %llu us, max %llu us, errors %d, CPU server %@ client %@",
    label, throughput, microseconds(50), microseconds(90), microseconds(99), microseconds(99.9), histogram.max, errors,
    usage.server.map { String(format: "%.0f%%", $0) } ?? "-", usage.client.map { String(format: "%.0f%%", $0) } ?? "-"
))
if let path = options["json"] {
    let summary: [String: Any] = [
        "label": label, "target": target.rawValue, "connections": connections, "inFlight": settings.inFlight,
        "rate": rate ?? 0, "durationSeconds": duration, "customers": settings.customers, "keys": settings.zipf ? "zipf" : "uniform",
        "writePercent": writePercent, "requests": histogram.totalCount, "errors": errors,
        "throughput": throughput.rounded(), "batch": settings.batch, "usersPerSecond": (throughput * Double(settings.batch)).rounded(),
        "latencyMicroseconds": ["p50": microseconds(50), "p90": microseconds(90), "p99": microseconds(99), "p99.9": microseconds(99.9), "max": histogram.max],
        "cpuPercent": ["server": usage.server.map { $0.rounded() } ?? -1, "client": usage.client.map { $0.rounded() } ?? -1],
    ]
    let data = try JSONSerialization.data(withJSONObject: summary, options: [.prettyPrinted, .sortedKeys])
    try data.write(to: URL(fileURLWithPath: path))
}
if let path = options["distribution"] {
    var text = ""
    histogram.outputPercentileDistribution(to: &text, outputValueUnitScalingRatio: 1.0)
    try text.write(toFile: path, atomically: true, encoding: .utf8)
}

/// A blocking TCP socket, for loading Redis.
final class BlockingSocket {
    let fd: Int32
    private var received: [UInt8] = []

    init(host: String, port: Int) throws {
        self.fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr(host)
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(self.fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard result == 0 else {
            throw NSError(domain: "LoadGen", code: Int(errno), userInfo: [NSLocalizedDescriptionKey: "cannot connect to \(host):\(port)"])
        }
    }

    deinit { close(self.fd) }

    func send(_ buffer: inout ByteBuffer) throws {
        while buffer.readableBytes > 0 {
            let written = buffer.withUnsafeReadableBytes { Glibc.send(self.fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
            guard written > 0 else { throw NSError(domain: "LoadGen", code: Int(errno)) }
            buffer.moveReaderIndex(forwardBy: written)
        }
        buffer.clear()
    }

    /// Reads `replies` lines (+OK), failing on an error reply.
    func expect(replies: Int) throws {
        var lines = 0
        var chunk = [UInt8](repeating: 0, count: 65_536)
        while lines < replies {
            let count = recv(self.fd, &chunk, chunk.count, 0)
            guard count > 0 else { throw NSError(domain: "LoadGen", code: Int(errno)) }
            for byte in chunk[0..<count] {
                if byte == UInt8(ascii: "-") && self.received.isEmpty {
                    throw NSError(domain: "LoadGen", code: 1, userInfo: [NSLocalizedDescriptionKey: "redis refused a SET"])
                }
                if byte == UInt8(ascii: "\n") {
                    lines += 1
                    self.received.removeAll(keepingCapacity: true)
                } else {
                    self.received.append(byte)
                }
            }
        }
    }
}
