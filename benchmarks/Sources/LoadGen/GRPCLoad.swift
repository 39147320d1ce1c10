import Dispatch
import EntitlementsMessages
import GRPCCheckService
import GRPCCore
import GRPCNIOTransportHTTP2Posix
import Histogram
import NIOCore
import NIOPosix

/// `--target grpc`: the gRPC peer (GRPCPeer) through a grpc-swift-2 client. Each connection
/// is one GRPCClient, so one HTTP/2 connection; "in flight" is concurrent unary calls (HTTP/2
/// streams) on it. The keys, the request bytes, the window and the histogram are those of the
/// other targets; the client runs on one event loop, as theirs does.
enum GRPCLoad {
    static func run(group: MultiThreadedEventLoopGroup) {
        let done = DispatchSemaphore(value: 0)
        Task {
            do {
                try await Self.load(group: group)
            } catch {
                print("error: gRPC load: \(error)")
                exit(1)
            }
            done.signal()
        }
        done.wait()
    }

    private static func load(group: MultiThreadedEventLoopGroup) async throws {
        let settings = Settings.current
        let clients = try (0..<settings.connections).map { _ in
            GRPCClient(
                transport: try HTTP2ClientTransport.Posix(
                    target: .ipv4(address: settings.host, port: settings.port),
                    transportSecurity: .plaintext,
                    eventLoopGroup: group
                )
            )
        }
        try await withThrowingTaskGroup(of: Void.self) { connections in
            for client in clients {
                connections.addTask { try await client.runConnections() }
            }
            if let rate = settings.rate {
                await Self.openLoop(clients, interval: .nanoseconds(Int64(1e9 / rate)))
            } else {
                await withDiscardingTaskGroup { load in
                    for client in clients {
                        for _ in 0..<settings.inFlight {
                            load.addTask { await Self.closedLoop(client) }
                        }
                    }
                }
            }
            for client in clients {
                client.beginGracefulShutdown()
            }
            try await connections.waitForAll()
        }
    }

    /// One call slot: the next request goes as soon as the previous answer is in.
    private static func closedLoop(_ client: GRPCClient<HTTP2ClientTransport.Posix>) async {
        var keys = KeyPicker()
        var histogram = Histogram<UInt64>(lowestDiscernibleValue: 1, highestTrackableValue: 60_000_000, numberOfSignificantValueDigits: .three)
        var errors = 0
        while true {
            let start = NIODeadline.now()
            guard start < Window.end else { break }
            let ok = await Self.call(client, customer: keys.next())
            if start >= Window.measureFrom {
                _ = histogram.record(max(1, (NIODeadline.now() - start).nanoseconds / 1_000).magnitude)
                if !ok { errors += 1 }
            }
        }
        let finished = histogram
        let failed = errors
        Window.results.histogram.withLockedValue { $0.add(finished) }
        Window.results.errors.withLockedValue { $0 += failed }
    }

    /// Calls sent on a fixed schedule over all connections in turn; latency from each call's
    /// scheduled time. One scheduler for all connections: a sleep per connection would wake
    /// late by the timer's leeway, which grows with the interval, and that lateness would be
    /// charged to gRPC.
    private static func openLoop(_ clients: [GRPCClient<HTTP2ClientTransport.Posix>], interval: TimeAmount) async {
        var keys = KeyPicker()
        var next = NIODeadline.now()
        var index = 0
        await withDiscardingTaskGroup { calls in
            while next < Window.end {
                let now = NIODeadline.now()
                if next > now {
                    try? await Task.sleep(nanoseconds: UInt64((next - now).nanoseconds))
                    continue
                }
                while next <= now, next < Window.end {
                    let intended = next
                    let customer = keys.next()
                    let client = clients[index % clients.count]
                    index += 1
                    calls.addTask {
                        let ok = await Self.call(client, customer: customer)
                        guard intended >= Window.measureFrom else { return }
                        let micros = max(1, (NIODeadline.now() - intended).nanoseconds / 1_000).magnitude
                        Window.results.histogram.withLockedValue { _ = $0.record(micros) }
                        if !ok { Window.results.errors.withLockedValue { $0 += 1 } }
                    }
                    next = next + interval
                }
            }
        }
    }

    /// One CheckEntitlements: true if answered OK (the answer's bytes are counted, not decoded,
    /// as for the other targets).
    private static func call(_ client: GRPCClient<HTTP2ClientTransport.Posix>, customer: Int) async -> Bool {
        do {
            let size = try await client.unary(
                request: ClientRequest(message: CheckEntitlementsRequest(userId: "user-\(customer)")),
                descriptor: CheckEntitlementsRPC.descriptor,
                serializer: CheckRequestSerializer(),
                deserializer: ResponseSizeDeserializer(),
                options: .defaults
            ) { response in
                try response.message
            }
            return size > 0
        } catch {
            return false
        }
    }
}
