// StoreProbe: open a snapshot, warm a cache of a given budget, serve a spread of lookups
// (Zipf over every customer, read-through on a miss) and report resident memory and the
// cost of hits and misses.
//
//   StoreProbe SNAPSHOT CACHE_BYTES LOOKUPS [ZIPF_EXPONENT] [SHARDS] [tinylfu|lru]
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsCache
import EntitlementsServer
import EntitlementsStore
import Foundation
import NIOCore

func residentBytes() -> Int {
    let status = (try? String(contentsOfFile: "/proc/self/status", encoding: .utf8)) ?? ""
    for line in status.split(separator: "\n") where line.hasPrefix("VmRSS:") {
        let kilobytes = line.split(separator: " ").compactMap { Int($0) }.first ?? 0
        return kilobytes * 1_024
    }
    return 0
}

func mib(_ bytes: Int) -> String {
    String(format: "%.1f MiB", Double(bytes) / 1_048_576)
}

/// Zipf(s) over 1...n by rejection-inversion (Hörmann and Derflinger), without a table.
struct ZipfSampler {
    let n: Double
    let s: Double
    let hIntegralX1: Double
    let hIntegralN: Double
    let threshold: Double

    init(n: Int, exponent: Double) {
        self.n = Double(n)
        self.s = exponent
        self.hIntegralX1 = Self.hIntegral(1.5, exponent) - 1
        self.hIntegralN = Self.hIntegral(Double(n) + 0.5, exponent)
        self.threshold = 2 - Self.hIntegralInverse(Self.hIntegral(2.5, exponent) - Self.h(2, exponent), exponent)
    }

    static func h(_ x: Double, _ s: Double) -> Double { exp(-s * log(x)) }
    static func hIntegral(_ x: Double, _ s: Double) -> Double {
        let logX = log(x)
        return helper2((1 - s) * logX) * logX
    }
    static func hIntegralInverse(_ x: Double, _ s: Double) -> Double {
        var t = x * (1 - s)
        if t < -1 { t = -1 }
        return exp(helper1(t) * x)
    }
    static func helper1(_ x: Double) -> Double { abs(x) > 1e-8 ? log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - 0.25 * x)) }
    static func helper2(_ x: Double) -> Double { abs(x) > 1e-8 ? expm1(x) / x : 1 + x * 0.5 * (1 + x * (1.0 / 3) * (1 + 0.25 * x)) }

    func next(using random: inout some RandomNumberGenerator) -> Int {
        while true {
            let u = self.hIntegralN + Double.random(in: 0..<1, using: &random) * (self.hIntegralX1 - self.hIntegralN)
            let x = Self.hIntegralInverse(u, self.s)
            var k = (x + 0.5).rounded(.down)
            if k < 1 { k = 1 } else if k > self.n { k = self.n }
            if k - x <= self.threshold || u >= Self.hIntegral(k + 0.5, self.s) - Self.h(k, self.s) {
                return Int(k)
            }
        }
    }
}

struct SplitMix: RandomNumberGenerator {
    var state: UInt64
    mutating func next() -> UInt64 {
        self.state &+= 0x9E37_79B9_7F4A_7C15
        var z = self.state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

let arguments = CommandLine.arguments
guard arguments.count >= 4, let budget = Int(arguments[2]), let lookups = Int(arguments[3]) else {
    print("usage: StoreProbe SNAPSHOT CACHE_BYTES LOOKUPS [ZIPF_EXPONENT] [SHARDS] [tinylfu|lru]")
    exit(2)
}
let exponent = arguments.count > 4 ? Double(arguments[4]) ?? 0.99 : 0.99
let shardCount = arguments.count > 5 ? Int(arguments[5]) ?? 2 : 2
guard let policy = AnswerCache.Policy(rawValue: arguments.count > 6 ? arguments[6] : "tinylfu") else {
    print("StoreProbe: the cache policy is tinylfu or lru")
    exit(2)
}

let baseline = residentBytes()
let clock = ContinuousClock()
var start = clock.now
let reader = try SnapshotReader(path: arguments[1])
let openTime = start.duration(to: clock.now)
let afterOpen = residentBytes()
let customers = Int(reader.header.recordCount)
let resolver = EntitlementResolver(catalog: reader.catalog)
let instant = Int64(Date().timeIntervalSince1970 * 1_000)
var shards = (0..<shardCount).map { _ in AnswerCache(budgetBytes: budget / shardCount, policy: policy) }

start = clock.now
let warm = try CacheWarmer.warm(&shards, from: reader, resolver: resolver, at: instant)
let warmTime = start.duration(to: clock.now)
let afterWarm = residentBytes()

var random = SplitMix(state: 42)
let zipf = ZipfSampler(n: customers, exponent: exponent)
var hitTime = Duration.zero
var missTime = Duration.zero
var hits = 0
var misses = 0
var buffer = ByteBuffer()
buffer.reserveCapacity(4_096)
start = clock.now
for _ in 0..<lookups {
    let id = "user-\(zipf.next(using: &random) - 1)"
    let shard = AnswerCache.shardIndex(for: id, shardCount: shardCount)
    let key = CacheKey(customerId: id)
    let began = clock.now
    buffer.clear()
    if let answer = shards[shard].answer(for: key, at: instant) {
        answer.writeResponse(userId: id, customerId: id, requestDate: instant, into: &buffer)
        hitTime += began.duration(to: clock.now)
        hits += 1
    } else {
        let record = try reader.customer(for: id)
        let answer = try CachedAnswer(resolver.resolve(record, at: instant), resolvedAt: instant)
        shards[shard].insert(answer, for: key, at: instant)
        answer.writeResponse(userId: id, customerId: id, requestDate: instant, into: &buffer)
        missTime += began.duration(to: clock.now)
        misses += 1
    }
}
let serveTime = start.duration(to: clock.now)
let afterServe = residentBytes()
let bytes = shards.reduce(0) { $0 + $1.statistics.bytes }
let entries = shards.reduce(0) { $0 + $1.statistics.entries }
let evictions = shards.reduce(0) { $0 + $1.statistics.evictions }
let rejections = shards.reduce(0) { $0 + $1.statistics.rejections }

func nanoseconds(_ duration: Duration, _ count: Int) -> String {
    guard count > 0 else { return "-" }
    let (seconds, attoseconds) = duration.components
    return String(format: "%.0f ns", (Double(seconds) * 1e9 + Double(attoseconds) / 1e9) / Double(count))
}

print("""
    snapshot        \(arguments[1]): \(customers) customers, \(reader.fileSize) bytes
    open            \(openTime)
    warm-up         \(warm.customersCached) customers cached in \(warmTime) (stopped full: \(warm.stoppedFull))
    lookups         \(lookups), Zipf s=\(exponent), \(shardCount) shards, \(policy.rawValue), in \(serveTime)
    hits / misses   \(hits) / \(misses) (hit rate \(String(format: "%.1f", 100 * Double(hits) / Double(max(1, lookups))))%), \(evictions) evictions, \(rejections) rejections
    hit cost        \(nanoseconds(hitTime, hits)) (lookup + response assembly)
    miss cost       \(nanoseconds(missTime, misses)) (index + record pread, decode, resolve, encode, insert)
    cache           \(entries) entries, \(mib(bytes)) accounted of \(mib(budget)) budget
    resident        baseline \(mib(baseline)), after open \(mib(afterOpen)), after warm-up \(mib(afterWarm)), after lookups \(mib(afterServe))
    over budget     \(mib(afterServe - budget)) (resident after lookups minus the cache budget)
    """)
