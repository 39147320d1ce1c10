import Dispatch
import EntitlementsMessages
import GRPCCheckService
import GRPCCore
import GRPCNIOTransportHTTP2Posix
import Histogram
import NIOConcurrencyHelpers
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
                await Self.openLoop(clients, interval: .nanoseconds(Int64(1e9 / rate)), on: group.next())
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
    /// scheduled time. The schedule runs on the client's event loop (NIO timers, as for the
    /// other targets), and each due call starts a task. A `Task.sleep` per connection woke
    /// up to 14 ms late (the timer leeway grows with the interval), and one sleeping task for
    /// all connections cost the client so much CPU that it fell behind its own schedule:
    /// either way the client's lateness was charged to gRPC.
    private static func openLoop(_ clients: [GRPCClient<HTTP2ClientTransport.Posix>], interval: TimeAmount, on loop: any EventLoop) async {
        // Calls in flight, and whether `finished` was completed (once, by whoever sees the
        // window over with nothing in flight).
        let state = NIOLockedValueBox((outstanding: 0, done: false))
        let finished = loop.makePromise(of: Void.self)
        @Sendable func finishIfIdle() {
            let finish = state.withLockedValue { state in
                guard state.outstanding == 0, !state.done, NIODeadline.now() >= Window.end else { return false }
                state.done = true
                return true
            }
            if finish { finished.succeed() }
        }
        loop.execute {
            var keys = KeyPicker()
            var next = NIODeadline.now()
            var index = 0
            func tick() {
                let now = NIODeadline.now()
                while next <= now, next < Window.end {
                    let intended = next
                    let customer = keys.next()
                    let client = clients[index % clients.count]
                    index += 1
                    next = next + interval
                    state.withLockedValue { $0.outstanding += 1 }
                    Task {
                        let ok = await Self.call(client, customer: customer)
                        if intended >= Window.measureFrom {
                            let micros = max(1, (NIODeadline.now() - intended).nanoseconds / 1_000).magnitude
                            Window.results.histogram.withLockedValue { _ = $0.record(micros) }
                            if !ok { Window.results.errors.withLockedValue { $0 += 1 } }
                        }
                        state.withLockedValue { $0.outstanding -= 1 }
                        finishIfIdle()
                    }
                }
                if next < Window.end {
                    loop.assumeIsolated().scheduleTask(deadline: next) { tick() }
                } else {
                    loop.assumeIsolated().scheduleTask(deadline: Window.end) { finishIfIdle() }
                }
            }
            tick()
        }
        try? await finished.futureResult.get()
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
