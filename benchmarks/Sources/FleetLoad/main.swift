// FleetLoad: the fleet profile (benchmarks/README.md, "Fleet"). Writes GrantEntitlement
// through server A from N concurrent callers for a while, and watches every customer on
// server B; reports acknowledged writes per second and the propagation lag from each
// write's acknowledgement on A to its watch event on B (p50, p99, max), as one JSON line.
import EntitlementsClient
import EntitlementsMessages
import Foundation
import NIOPosix
import Synchronization

struct Options {
    var writer = (host: "127.0.0.1", port: 7500)
    var watcher = (host: "127.0.0.1", port: 7501)
    var callers = 16
    /// Writes per second in all, spread evenly over the callers; 0: as fast as they go.
    var rate = 0.0
    var seconds = 5.0
    var customers = 10_000
    var label = "fleet"

    init(_ arguments: [String]) {
        var index = 1
        func value() -> String {
            index += 1
            guard index < arguments.count else { fatalError("FleetLoad: \(arguments[index - 1]) needs a value") }
            return arguments[index]
        }
        func address(_ text: String) -> (host: String, port: Int) {
            let parts = text.split(separator: ":")
            guard parts.count == 2, let port = Int(parts[1]) else { fatalError("FleetLoad: \(text) is not HOST:PORT") }
            return (String(parts[0]), port)
        }
        while index < arguments.count {
            switch arguments[index] {
            case "--writer": self.writer = address(value())
            case "--watcher": self.watcher = address(value())
            case "--callers": self.callers = Int(value())!
            case "--rate": self.rate = Double(value())!
            case "--seconds": self.seconds = Double(value())!
            case "--customers": self.customers = Int(value())!
            case "--label": self.label = value()
            default: fatalError("FleetLoad: unknown argument \(arguments[index])")
            }
            index += 1
        }
    }
}

/// Monotonic nanoseconds.
func now() -> UInt64 {
    var time = timespec()
    clock_gettime(CLOCK_MONOTONIC, &time)
    return UInt64(time.tv_sec) * 1_000_000_000 + UInt64(time.tv_nsec)
}

let options = Options(CommandLine.arguments)
let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
let writer = EntitlementsClient(
    configuration: .init(server: .tcp(host: options.writer.host, port: options.writer.port), connections: 4),
    eventLoopGroup: group
)
let watcher = EntitlementsClient(
    configuration: .init(server: .tcp(host: options.watcher.host, port: options.watcher.port)),
    eventLoopGroup: group
)
/// Sequence -> when A acknowledged it, and when B's watch saw it.
let acknowledged = Mutex<[UInt64: UInt64]>([:])
let seen = Mutex<[UInt64: UInt64]>([:])

let events = try await watcher.watch(WatchEntitlementsRequest(allCustomers: true))
let watching = Task {
    do {
        for try await event in events where event.cause == .write && event.logSequence > 0 {
            let at = now()
            seen.withLock { $0[event.logSequence] = at }
        }
    } catch {
        if !Task.isCancelled { print("FleetLoad: the watch on B ended: \(error)") }
    }
}

let start = now()
let deadline = start + UInt64(options.seconds * 1e9)
let failures = Atomic<Int>(0)
await withTaskGroup(of: Void.self) { tasks in
    for caller in 0..<options.callers {
        tasks.addTask {
            var count = 0
            var random = SystemRandomNumberGenerator()
            // With --rate, each caller sends on its own schedule (callers / rate seconds
            // apart, staggered): the lag is then measured below saturation.
            let interval = options.rate > 0 ? Double(options.callers) / options.rate * 1e9 : 0
            let offset = interval * Double(caller) / Double(options.callers)
            while now() < deadline {
                count += 1
                if interval > 0 {
                    let due = start + UInt64(offset + interval * Double(count - 1))
                    let current = now()
                    if due > current {
                        try? await Task.sleep(for: .nanoseconds(Int64(due - current)))
                    }
                    if now() >= deadline { break }
                }
                let request = GrantEntitlementRequest(
                    userId: "user-\(Int.random(in: 0..<options.customers, using: &random))",
                    grant: Grant(grantId: "bench-\(caller)-\(count)", entitlementId: "premium")
                )
                do {
                    let response: WriteResponse = try await writer.call(.grantEntitlement, request)
                    let at = now()
                    acknowledged.withLock { $0[response.logSequence] = at }
                } catch {
                    failures.add(1, ordering: .relaxed)
                }
            }
        }
    }
}
let elapsed = Double(now() - start) / 1e9
// Let B catch up with the last writes (at most 5 s) before counting lags.
let last = acknowledged.withLock { $0.keys.max() ?? 0 }
let waitUntil = now() + 5_000_000_000
while seen.withLock({ $0[last] == nil }), now() < waitUntil {
    try await Task.sleep(for: .milliseconds(5))
}
watching.cancel()

let acks = acknowledged.withLock { $0 }
let sightings = seen.withLock { $0 }
// B may show a write before A answers it (A answers once it has applied it too): lag 0.
let lags: [Double] = acks.compactMap { sequence, ackAt in
    sightings[sequence].map { seenAt in seenAt > ackAt ? Double(seenAt - ackAt) / 1e6 : 0 }
}.sorted()
func percentile(_ p: Double) -> Double {
    lags.isEmpty ? .nan : lags[min(lags.count - 1, Int((Double(lags.count) * p).rounded(.down)))]
}
let summary: [String: Any] = [
    "label": options.label,
    "callers": options.callers,
    "rate": options.rate,
    "seconds": elapsed,
    "writes": acks.count,
    "writes_per_second": Double(acks.count) / elapsed,
    "failures": failures.load(ordering: .relaxed),
    "lag_samples": lags.count,
    "lag_missing": acks.count - lags.count,
    "lag_p50_ms": percentile(0.50),
    "lag_p99_ms": percentile(0.99),
    "lag_max_ms": lags.last ?? .nan,
]
let json = try JSONSerialization.data(withJSONObject: summary, options: [.sortedKeys])
print(String(decoding: json, as: UTF8.self))
await writer.close()
await watcher.close()
try await group.shutdownGracefully()
