import Benchmark
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsCache
import EntitlementsStore
import EntitlementsTools
import Foundation
import NIOCore

let now: Int64 = 1_795_305_600_000  // 2026-11-22
let customers = 100_000

let benchmarks: @Sendable () -> Void = {
    Benchmark.defaultConfiguration = .init(
        metrics: [.wallClock, .mallocCountTotal, .throughput],
        timeUnits: .nanoseconds,
        warmupIterations: 10,
        scalingFactor: .kilo,
        maxDuration: .seconds(3),
        maxIterations: 100_000
    )

    // A 100k-customer synthetic snapshot in the temporary directory (page-cached, as a
    // serving snapshot is).
    let path = FileManager.default.temporaryDirectory.appendingPathComponent("store-benchmarks-\(getpid()).snap").path
    _ = try! SnapshotTools.generate(count: customers, seed: 1, now: now, outputPath: path)
    let reader = try! SnapshotReader(path: path)
    try? FileManager.default.removeItem(atPath: path)  // the open descriptor keeps it readable
    let resolver = EntitlementResolver(catalog: reader.catalog)
    let ids = (0..<4_096).map { "user-\(($0 &* 7_919) % customers)" }
    let keys = ids.map { CacheKey(customerId: $0) }

    // 4,096 entries, all resident: the cost of the hit path itself.
    var warmCache = AnswerCache(budgetBytes: 256 << 20)
    for id in ids {
        warmCache.insert(try! CachedAnswer(resolver.resolve(try! reader.customer(for: id), at: now), resolvedAt: now), for: CacheKey(customerId: id), at: now)
    }
    let cache = warmCache

    Benchmark("cache-hit.lookup+response") { benchmark in
        var cache = cache
        var buffer = ByteBuffer()
        buffer.reserveCapacity(4_096)
        var index = 0
        for _ in benchmark.scaledIterations {
            index = (index + 1) & 4_095
            buffer.clear()
            if let answer = cache.answer(for: keys[index], at: now) {
                answer.writeResponse(userId: ids[index], customerId: ids[index], requestDate: now, into: &buffer)
            }
            blackHole(buffer)
        }
    }

    // The client's near-cache (docs/server.md, "The near-cache"): a hit is a lookup of the
    // decoded answer and a copy with the instant asked for, by the same Window TinyLFU
    // cache; beside it, the same copy from a plain dictionary of the same answers (the
    // floor any cache of decoded answers has). Both must allocate nothing.
    let answers = ids.map { id in
        var response = try! CachedAnswer(resolver.resolve(try! reader.customer(for: id), at: now), resolvedAt: now)
            .response(userId: id, customerId: id, requestDate: now)
        response.logSequence = 1
        return response
    }
    var warmNear = ResponseCache(budgetBytes: 256 << 20)
    var dictionary: [CacheKey: CheckEntitlementsResponse] = [:]
    for (key, answer) in zip(keys, answers) {
        warmNear.insert(KeptResponse(answer, keptAt: now, encodedBytes: (try! answer.serializedBytes()).count), for: key, at: now)
        dictionary[key] = answer
    }
    // In a box, mutated in place: a copy per sample (`var near = near`) would copy the whole
    // cache at its first lookup, and count that copy's allocations against the hit.
    let near = NearBox(warmNear)

    Benchmark("near-cache.hit") { benchmark in
        var index = 0
        for _ in benchmark.scaledIterations {
            index = (index + 1) & 4_095
            if var response = near.cache.response(for: keys[index], at: now)?.response {
                response.requestDate = now
                blackHole(response)
            }
        }
    }

    Benchmark("near-cache.dictionary-baseline") { benchmark in
        var index = 0
        for _ in benchmark.scaledIterations {
            index = (index + 1) & 4_095
            if var response = dictionary[keys[index]] {
                response.requestDate = now
                blackHole(response)
            }
        }
    }

    Benchmark("miss.snapshot+resolve+encode+insert") { benchmark in
        // Small: most lookups miss and evict. LRU, so that every insert evicts: with the
        // default policy and no lookups to count, newcomers would be dropped on a tie instead.
        var cache = AnswerCache(budgetBytes: 1 << 20, policy: .lru)
        var buffer = ByteBuffer()
        buffer.reserveCapacity(4_096)
        var index = 0
        for _ in benchmark.scaledIterations {
            index = (index &+ 7_919) % customers
            let id = "user-\(index)"
            buffer.clear()
            let record = try reader.customer(for: id)
            let answer = try CachedAnswer(resolver.resolve(record, at: now), resolvedAt: now)
            cache.insert(answer, for: CacheKey(customerId: id), at: now)
            answer.writeResponse(userId: id, customerId: id, requestDate: now, into: &buffer)
            blackHole(buffer)
        }
    }

    Benchmark("snapshot.lookup") { benchmark in
        var index = 0
        for _ in benchmark.scaledIterations {
            index = (index &+ 7_919) % customers
            blackHole(try reader.customer(for: "user-\(index)"))
        }
    }
}

/// The near-cache benchmark's cache, shared by its samples and mutated in place (one
/// benchmark runs at a time).
final class NearBox: @unchecked Sendable {
    var cache: ResponseCache
    init(_ cache: ResponseCache) { self.cache = cache }
}
