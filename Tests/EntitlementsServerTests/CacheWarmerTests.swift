import EntitlementsCache
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import Foundation
import Testing

@Suite("cache warm-up")
struct CacheWarmerTests {
    /// A snapshot of 100 synthetic customers with `hotList`, in a file removed when the
    /// reader is no longer needed (the reader keeps it open).
    static func snapshot(hotList: [String]) throws -> SnapshotReader {
        let path = FileManager.default.temporaryDirectory.appendingPathComponent("cache-warmer-\(UUID().uuidString).snap").path
        defer { try? FileManager.default.removeItem(atPath: path) }
        var writer = try SnapshotWriter(path: path, catalog: SyntheticData.catalog, createdDate: now)
        let data = SyntheticData(seed: 11, now: now)
        for index in 0..<100 {
            try writer.append(data.customer(index))
        }
        try writer.finish(hotList: hotList)
        return try SnapshotReader(path: path)
    }

    @Test("warm-up fills the hot set first, hottest first, and evicts nothing")
    func hotSetFirst() throws {
        let hot = ["user-42", "user-7", "ghost", "user-3", "user-90"]
        let reader = try Self.snapshot(hotList: hot)
        let resolver = EntitlementResolver(catalog: reader.catalog)
        // A budget for exactly the first two customers.
        let cost = { (id: String) in
            AnswerCache.cost(of: CacheKey(customerId: id), try! CachedAnswer(resolver.resolve(try! reader.customer(for: id), at: now), resolvedAt: now))
        }
        var shards = [AnswerCache(budgetBytes: cost("user-42") + cost("user-7"))]
        let report = try CacheWarmer.warm(&shards, from: reader, resolver: resolver, at: now)
        #expect(report.customersCached == 2)
        #expect(report.customersMissing == 0)  // warm-up stopped before reaching "ghost"
        #expect(report.stoppedFull)
        #expect(shards[0].keysByRecency.map(\.customerId) == ["user-42", "user-7"])
        #expect(shards[0].statistics.evictions == 0)
        #expect(CacheWarmer.hotList(of: shards) == ["user-42", "user-7"])
        // The cached answer is the resolver's.
        let recent0 = shards[0].answer(for: CacheKey(customerId: "user-7"), at: now)
        let cached = try #require(recent0)
        #expect(try cached.response(userId: "user-7", customerId: "user-7", requestDate: now).entitlements
            == resolver.resolve(try reader.customer(for: "user-7"), at: now).entitlements)
    }

    @Test("with room for all, every hot customer is cached and missing ones are counted")
    func wholeList() throws {
        let hot = ["user-1", "ghost", "user-2", "user-3"]
        let reader = try Self.snapshot(hotList: hot)
        var shards = (0..<3).map { _ in AnswerCache(budgetBytes: 1 << 20) }
        let report = try CacheWarmer.warm(&shards, from: reader, resolver: EntitlementResolver(catalog: reader.catalog), at: now)
        #expect(report.customersCached == 3 && report.customersMissing == 1 && !report.stoppedFull)
        for id in ["user-1", "user-2", "user-3"] {
            let shard = AnswerCache.shardIndex(for: id, shardCount: 3)
            let recent1 = shards[shard].answer(for: CacheKey(customerId: id), at: now)
            #expect(recent1 != nil)
        }
    }

    @Test("the hot list of a new snapshot reflects what was actually used, most recent first")
    func hotListFromUse() {
        var shards = (0..<2).map { _ in AnswerCache(budgetBytes: 1 << 20) }
        for (offset, id) in ["a", "b", "c", "d"].enumerated() {
            let shard = AnswerCache.shardIndex(for: id, shardCount: 2)
            shards[shard].insert(.empty(resolvedAt: now), for: CacheKey(customerId: id), at: now + Int64(offset))
        }
        let shardOfB = AnswerCache.shardIndex(for: "b", shardCount: 2)
        _ = shards[shardOfB].answer(for: CacheKey(customerId: "b"), at: now + 10)
        #expect(CacheWarmer.hotList(of: shards) == ["b", "d", "c", "a"])
    }

    @Test("shards: every customer has one stable shard in range")
    func shards() {
        for count in [1, 2, 7, 16] {
            for index in 0..<200 {
                let shard = AnswerCache.shardIndex(for: "user-\(index)", shardCount: count)
                #expect((0..<count).contains(shard))
                #expect(shard == AnswerCache.shardIndex(for: "user-\(index)", shardCount: count))
            }
        }
        // The hash is fixed by the file format: the same on every machine and run.
        #expect(KeyHash.hash("user-1") == 0x41A2_FCA5_C684_01C5)
    }
}
