// NearCacheLoad: the Swift client's near-cache (docs/server.md, "The near-cache") against a
// server it starts itself, in three phases (benchmarks/README.md, "Near-cache"):
//
//   NearCacheLoad --entitlements BIN --snapshot SNAP --data-dir DIR --port P
//                 [--server-cpu N] [--tasks 50] [--duration 10] [--warmup 2]
//                 [--budget-mib 32] [--zipf-s 0.99] [--customers N] [--writes 200]
//                 [--json FILE]
//
// 1. Zipf: TASKS tasks check Zipf-distributed customers (the p5 keys: user-0 is the hottest)
//    through one near-cache client, closed loop, for DURATION after WARMUP: the share of
//    checks answered locally, checks/s, and each check's latency p50/p99.
// 2. Lag: while that load goes on, WRITES grants, each to a customer the near-cache keeps
//    (one of the 100 hottest), from a second client; a task checks that customer through
//    the near-cache without pause from before the write: the lag is from the write's
//    acknowledgment to the first check that shows the grant (0 when one did before the
//    acknowledgment arrived). p50 and p99.
// 3. Server down: the server is killed (SIGKILL, by the pid this tool started), and a
//    client with staleIfErrorFor checks the customers it kept: the cost of a check
//    answered stale (median and p99, ns), and the share of such checks answered.
//
// Prints a summary and writes the figures as JSON.
import CoreMetrics
import EntitlementsClient
import EntitlementsMessages
import Foundation
import ServerHarness
import NIOCore
import NIOPosix
import Synchronization

let settings = ToolSettings(tool: "NearCacheLoad")
let dataDirectory = settings.text("data-dir")
let port = Int(settings.number("port", 7498))
let tasks = Int(settings.number("tasks", 50))
let duration = settings.number("duration", 10)
let warmup = settings.number("warmup", 2)
let budget = Int(settings.number("budget-mib", 32)) << 20
let zipfS = settings.number("zipf-s", 0.99)
let customers = Int(settings.number("customers", 100_000))
let writes = Int(settings.number("writes", 200))

func nowNanoseconds() -> UInt64 { DispatchTime.now().uptimeNanoseconds }

func percentile(_ sorted: [UInt64], _ p: Double) -> UInt64 {
    sorted.isEmpty ? 0 : sorted[min(sorted.count - 1, Int(Double(sorted.count) * p))]
}

/// Zipf over user-0 ... user-(customers-1), as LoadGen draws p5's keys.
struct Zipf {
    var generator = SystemRandomNumberGenerator()
    mutating func next() -> Int {
        let u = Double.random(in: 0..<1, using: &self.generator)
        let n = Double(customers) + 1
        let exponent = 1 - zipfS
        let x = exponent == 0 ? pow(n, u) : pow((pow(n, exponent) - 1) * u + 1, 1 / exponent)
        return min(customers - 1, max(0, Int(x) - 1))
    }
}

// MARK: Metrics

/// Counters that count (an atomic add each), so that a hit pays what it would with a real
/// backend; swift-metrics' default does nothing.
final class AtomicCounter: CounterHandler, Sendable {
    let value = Atomic<Int64>(0)
    func increment(by amount: Int64) { self.value.add(amount, ordering: .relaxed) }
    func reset() { self.value.store(0, ordering: .relaxed) }
}
struct CountingMetrics: MetricsFactory {
    func makeCounter(label: String, dimensions: [(String, String)]) -> any CounterHandler { AtomicCounter() }
    func makeRecorder(label: String, dimensions: [(String, String)], aggregate: Bool) -> any RecorderHandler { NOOPMetricsHandler.instance }
    func makeTimer(label: String, dimensions: [(String, String)]) -> any TimerHandler { NOOPMetricsHandler.instance }
    func destroyCounter(_ handler: any CounterHandler) {}
    func destroyRecorder(_ handler: any RecorderHandler) {}
    func destroyTimer(_ handler: any TimerHandler) {}
}
MetricsSystem.bootstrap(CountingMetrics())

// MARK: The server

let server = try await startServer(settings, dataDirectory: dataDirectory, port: port)
defer { if server.isRunning { kill(server.processIdentifier, SIGKILL) } }

let address = EntitlementsServerAddress.tcp(host: "127.0.0.1", port: port)
let plain = EntitlementsClient(configuration: .init(server: address))

let client = EntitlementsClient(configuration: .init(
    server: address,
    connections: 4,
    nearCache: NearCacheConfiguration(budgetBytes: budget, staleIfErrorFor: .seconds(600))
))

// MARK: 0: a hit's cost, against a plain dictionary of the same answers

/// One task, no other load: a check of a kept answer through the client's public call (of
/// the hottest customers, up to 1,000), and
/// the same answers looked up in a `[String: CheckEntitlementsResponse]` and copied with
/// the instant asked for (the floor for any cache of decoded answers).
// As many as the budget surely holds (an answer is charged about 3 KiB), at most 1,000.
let hot = (0..<max(100, min(1_000, budget / 8_192))).map { CheckEntitlementsRequest(userId: "user-\($0)") }
var dictionary: [String: CheckEntitlementsResponse] = [:]
for request in hot {
    dictionary[request.userId!] = try await client.checkEntitlements(request)
}
for _ in 0..<500 where client.nearCacheStatistics?.watching != true {
    try await Task.sleep(for: .milliseconds(10))
}
let hitRounds = 1_000_000
func timePerCheck(_ body: () async throws -> Void) async rethrows -> Double {
    let start = nowNanoseconds()
    try await body()
    return Double(nowNanoseconds() - start) / Double(hitRounds)
}
let hitsBefore = client.nearCacheStatistics?.hits ?? 0
// Off the main actor (top-level code runs on it, and each call would hop off and back).
let frozenDictionary = dictionary
let (hitCosts, dictionaryCosts) = try await Task.detached { () async throws -> ([Double], [Double]) in
    var hitCosts: [Double] = []
    var dictionaryCosts: [Double] = []
    for _ in 0..<3 {
        hitCosts.append(try await timePerCheck {
            for round in 0..<hitRounds {
                let answer = try await client.checkEntitlements(hot[round % hot.count])
                precondition(answer.userId != nil)
            }
        })
        var sink: Int64 = 0
        dictionaryCosts.append(await timePerCheck {
            let instant = Int64(Date().timeIntervalSince1970 * 1000)
            for round in 0..<hitRounds {
                if var answer = frozenDictionary[hot[round % hot.count].userId!] {
                    // The copy with the instant asked for, used: the compiler may not drop it.
                    answer.requestDate = instant &+ Int64(round)
                    sink &+= answer.requestDate! &+ Int64(answer.entitlements.count)
                }
            }
        })
        precondition(sink != 42)
    }
    return (hitCosts, dictionaryCosts)
}.value
let hitCost = hitCosts.sorted()[1]
let dictionaryCost = dictionaryCosts.sorted()[1]
let allHits = (client.nearCacheStatistics?.hits ?? 0) - hitsBefore == UInt64(3 * hitRounds)

// MARK: 1 and 2: Zipf load, and the lag of writes beneath it

// The lag first with no other load: the watch's delivery and one round trip.
let quietMeasured = try await Task.detached {
    try await measureLag(max(20, writes / 4), over: 1, until: .max, label: "quiet")
}.value
let quietLags = quietMeasured.map(\.fromAck).sorted()
let quietLagsFromSend = quietMeasured.map(\.fromSend).sorted()

final class Recorder: Sendable {
    let latencies = Mutex<[UInt64]>([])
    let errors = Atomic<Int>(0)
}
let recorder = Recorder()
let measureFrom = nowNanoseconds() + UInt64(warmup * 1e9)
let measureUntil = measureFrom + UInt64(duration * 1e9)

let statisticsAtStart = Mutex<NearCacheStatistics?>(nil)
async let loadDone: Void = withThrowingTaskGroup(of: Void.self) { group in
    for _ in 0..<tasks {
        group.addTask {
            var zipf = Zipf()
            var mine: [UInt64] = []
            mine.reserveCapacity(1 << 20)
            while true {
                let start = nowNanoseconds()
                if start >= measureUntil { break }
                let request = CheckEntitlementsRequest(userId: "user-\(zipf.next())")
                do {
                    _ = try await client.checkEntitlements(request, timeout: .seconds(5))
                } catch {
                    recorder.errors.add(1, ordering: .relaxed)
                }
                let end = nowNanoseconds()
                if start >= measureFrom {
                    mine.append(end - start)
                }
                // A hit does not suspend: let the other tasks (and the lag probe) run.
                await Task.yield()
            }
            recorder.latencies.withLock { $0 += mine }
        }
    }
    group.addTask {
        while nowNanoseconds() < measureFrom { try await Task.sleep(for: .milliseconds(5)) }
        statisticsAtStart.withLock { $0 = client.nearCacheStatistics }
    }
    try await group.waitForAll()
}

/// The lag of `count` grants, spaced over `seconds`, until `until` (ns).
/// Each lag twice: from the write's acknowledgment (as the writer's task saw it: late when
/// the client's core is busy, so this understates) and from its send (the write's own
/// round trip and fsync included, so this overstates).
@Sendable func measureLag(_ count: Int, over seconds: Double, until: UInt64, label: String) async throws -> [(fromAck: UInt64, fromSend: UInt64)] {
    var lags: [(fromAck: UInt64, fromSend: UInt64)] = []
    var generator = SystemRandomNumberGenerator()
    let spacing = max(0.002, seconds / Double(count))
    for index in 0..<count {
        guard nowNanoseconds() < until else { break }
        let user = "user-\(Int.random(in: 0..<100, using: &generator))"
        let grant = "nc-lag-\(label)-\(index)"
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: user))  // kept
        let acknowledged = Atomic<UInt64>(0)
        async let probe: UInt64 = {
            while true {
                let answer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: user))
                if answer.entitlements.contains(where: { $0.id == grant && $0.isActive }) {
                    return nowNanoseconds()
                }
                await Task.yield()
            }
        }()
        let request = GrantEntitlementRequest(userId: user, grant: Grant(grantId: grant, entitlementId: grant, grantedDate: Int64(Date().timeIntervalSince1970 * 1000) - 1000))
        let sent = nowNanoseconds()
        let _: WriteResponse = try await plain.call(.grantEntitlement, request, timeout: .seconds(5))
        acknowledged.store(nowNanoseconds(), ordering: .relaxed)
        let seen = try await probe
        let ack = acknowledged.load(ordering: .relaxed)
        lags.append((seen > ack ? seen - ack : 0, seen - sent))
        try await Task.sleep(for: .milliseconds(Int(spacing * 1000)))
    }
    return lags
}
let loadMeasured = try await Task.detached {
    while nowNanoseconds() < measureFrom { try await Task.sleep(for: .milliseconds(5)) }
    return try await measureLag(writes, over: duration * 0.8, until: measureUntil - 500_000_000, label: "load")
}.value
let lags = loadMeasured.map(\.fromAck).sorted()
let lagsFromSend = loadMeasured.map(\.fromSend).sorted()
try await loadDone
let statisticsEnd = client.nearCacheStatistics ?? NearCacheStatistics()
let statisticsStart = statisticsAtStart.withLock { $0 } ?? NearCacheStatistics()
let latencies = recorder.latencies.withLock { $0 }.sorted()
let hits = statisticsEnd.hits - statisticsStart.hits
let misses = statisticsEnd.misses - statisticsStart.misses
let localShare = Double(hits) / Double(max(1, hits + misses))
let throughput = Double(latencies.count) / duration

// MARK: 3: the server down

kill(server.processIdentifier, SIGKILL)
server.waitUntilExit()
// The customers the near-cache keeps: the hottest ones.
let kept = (0..<100).map { "user-\($0)" }
let downRequests = kept.map { CheckEntitlementsRequest(userId: $0) }
let (unsortedStaleCosts, answered) = await Task.detached { () async -> ([UInt64], Int) in
    var costs: [UInt64] = []
    var answered = 0
    let downUntil = nowNanoseconds() + UInt64(min(duration, 3) * 1e9)
    var index = 0
    while nowNanoseconds() < downUntil {
        let start = nowNanoseconds()
        if let answer = try? await client.checkEntitlements(downRequests[index % downRequests.count], timeout: .seconds(1)), answer.staleForMs > 0 {
            answered += 1
        }
        costs.append(nowNanoseconds() - start)
        index += 1
    }
    return (costs, answered)
}.value
let staleCosts = unsortedStaleCosts.sorted()

await client.close()
await plain.close()

let figures: [String: Any] = [
    "hitNs": hitCost, "dictionaryNs": dictionaryCost, "allHits": allHits,
    "tasks": tasks, "durationSeconds": duration, "customers": customers, "zipfS": zipfS, "budgetBytes": budget,
    "checks": latencies.count, "checksPerSecond": throughput, "errors": recorder.errors.load(ordering: .relaxed),
    "localShare": localShare, "latencyP50Ns": percentile(latencies, 0.5), "latencyP99Ns": percentile(latencies, 0.99),
    "nearCacheEntries": statisticsEnd.entries, "nearCacheBytes": statisticsEnd.bytes, "invalidations": statisticsEnd.invalidations,
    "quietLagP50Ns": percentile(quietLags, 0.5), "quietLagP99Ns": percentile(quietLags, 0.99),
    "quietLagFromSendP50Ns": percentile(quietLagsFromSend, 0.5), "quietLagFromSendP99Ns": percentile(quietLagsFromSend, 0.99),
    "lagFromSendP50Ns": percentile(lagsFromSend, 0.5), "lagFromSendP99Ns": percentile(lagsFromSend, 0.99),
    "lagWrites": lags.count, "lagP50Ns": percentile(lags, 0.5), "lagP99Ns": percentile(lags, 0.99), "lagMaxNs": lags.last ?? 0,
    "downChecks": staleCosts.count, "downAnsweredShare": Double(answered) / Double(max(1, staleCosts.count)),
    "downCostP50Ns": percentile(staleCosts, 0.5), "downCostP99Ns": percentile(staleCosts, 0.99),
]
print(String(format: "near-cache: a hit through checkEntitlements %.0f ns, a dictionary lookup and copy of the same answers %.0f ns (median of 3 x %d)", hitCost, dictionaryCost, hitRounds)
    + (allHits ? "" : "; NOT every check was a hit"))
print(String(format: "near-cache: %d tasks, Zipf s=%.2f over %d customers, %d MiB: %.0f checks/s, %.1f%% answered locally, p50 %.1f us, p99 %.1f us",
             tasks, zipfS, customers, budget >> 20, throughput, localShare * 100, Double(percentile(latencies, 0.5)) / 1000, Double(percentile(latencies, 0.99)) / 1000))
print(String(format: "near-cache: write-to-invalidation lag, no other load, over %d writes: p50 %.1f us, p99 %.1f us (from the write's send: %.1f, %.1f)",
             quietLags.count, Double(percentile(quietLags, 0.5)) / 1000, Double(percentile(quietLags, 0.99)) / 1000,
             Double(percentile(quietLagsFromSend, 0.5)) / 1000, Double(percentile(quietLagsFromSend, 0.99)) / 1000))
print(String(format: "near-cache: write-to-invalidation lag under the load over %d writes: p50 %.1f us, p99 %.1f us, max %.1f us (from the write's send: %.1f, %.1f)",
             lags.count, Double(percentile(lags, 0.5)) / 1000, Double(percentile(lags, 0.99)) / 1000, Double(lags.last ?? 0) / 1000,
             Double(percentile(lagsFromSend, 0.5)) / 1000, Double(percentile(lagsFromSend, 0.99)) / 1000))
print(String(format: "near-cache: server down, stale-if-error: %d checks, %.1f%% answered stale, p50 %.0f ns, p99 %.0f ns",
             staleCosts.count, Double(answered) * 100 / Double(max(1, staleCosts.count)), Double(percentile(staleCosts, 0.5)), Double(percentile(staleCosts, 0.99))))
if let path = settings.values["json"] {
    let data = try JSONSerialization.data(withJSONObject: figures, options: [.sortedKeys, .prettyPrinted])
    try data.write(to: URL(fileURLWithPath: path))
}
