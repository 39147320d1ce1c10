import EntitlementsMessages
import EntitlementsResolver
import EntitlementsTools
import NIOCore
import PropertyBased
import Testing

@testable import EntitlementsStore

/// An answer whose encoded form is `size` bytes, valid from `resolvedAt` to `validUntil`.
func answer(size: Int = 100, resolvedAt: Int64 = now, validUntil: Int64? = nil) -> CachedAnswer {
    CachedAnswer(encodedEntitlements: [UInt8](repeating: 7, count: size), resolvedAt: resolvedAt, validUntil: validUntil)
}

func key(_ id: String) -> CacheKey {
    CacheKey(customerId: id)
}

@Suite("LRU cache")
struct LRUCacheTests {
    /// The cost of one 100-byte answer for a 2-character id.
    static let unit = LRUCache.cost(of: key("c0"), answer())

    @Test("lru: the least recently used entry is evicted first; a lookup makes an entry recent")
    func evictionOrder() {
        var cache = LRUCache(budgetBytes: 3 * Self.unit, policy: .lru)
        cache.insert(answer(), for: key("c1"), at: now)
        cache.insert(answer(), for: key("c2"), at: now)
        cache.insert(answer(), for: key("c3"), at: now)
        let recent = cache.answer(for: key("c1"), at: now)
        #expect(recent != nil)  // c1 is now most recent
        cache.insert(answer(), for: key("c4"), at: now)  // evicts c2, the least recent
        #expect(cache.keysByRecency.map(\.customerId) == ["c4", "c1", "c3"])
        let evicted = cache.answer(for: key("c2"), at: now)
        #expect(evicted == nil)
        #expect(cache.statistics.evictions == 1)
        cache.insert(answer(), for: key("c5"), at: now)  // evicts c3
        #expect(cache.keysByRecency.map(\.customerId) == ["c5", "c4", "c1"])
    }

    @Test("bytes are accounted exactly: key, answer and overhead, and freed on removal")
    func byteAccounting() {
        var cache = LRUCache(budgetBytes: 1 << 20)
        let small = answer(size: 10)
        let large = answer(size: 5_000)
        let filtered = CacheKey(customerId: "customer-with-a-long-id", environment: .sandbox, entitlementIds: ["pro", "premium"])
        cache.insert(small, for: key("a"), at: now)
        cache.insert(large, for: filtered, at: now)
        let expected = (1 + 10 + LRUCache.entryOverhead) + (23 + 3 + 16 + 7 + 16 + 5_000 + LRUCache.entryOverhead)
        #expect(cache.statistics.bytes == expected)
        #expect(cache.statistics.entries == 2)
        // Replacing an entry replaces its cost.
        cache.insert(answer(size: 20), for: key("a"), at: now)
        #expect(cache.statistics.bytes == expected + 10)
        cache.removeAll(customerId: "customer-with-a-long-id")
        #expect(cache.statistics.bytes == 1 + 20 + LRUCache.entryOverhead)
        #expect(cache.statistics.entries == 1)
    }

    @Test("the budget is never exceeded, whatever the sizes", arguments: LRUCache.Policy.allCases)
    func budgetHolds(policy: LRUCache.Policy) {
        var cache = LRUCache(budgetBytes: 50_000, policy: policy)
        var state: UInt64 = 9
        for index in 0..<5_000 {
            state = state &* 6_364_136_223_846_793_005 &+ 1_442_695_040_888_963_407
            let size = Int(state >> 33) % 3_000
            _ = cache.answer(for: key("c\(index % 700)"), at: now)
            cache.insert(answer(size: size), for: key("c\(index % 700)"), at: now)
            #expect(cache.statistics.bytes <= 50_000)
        }
        #expect(cache.statistics.evictions + cache.statistics.rejections > 0)
        #expect(cache.statistics.entries == cache.keysByRecency.count)
    }

    @Test("an entry too large for the whole budget is refused, not stored")
    func tooLarge() {
        var cache = LRUCache(budgetBytes: 1_000)
        cache.insert(answer(size: 10), for: key("a"), at: now)
        let stored = cache.insert(answer(size: 2_000), for: key("b"), at: now)
        #expect(!stored)
        #expect(cache.statistics.entries == 1)
    }

    @Test("an entry past its validUntil is never served, and is dropped", arguments: [
        (now + day - 1, true),
        (now + day, false),
        (now + 2 * day, false),
    ])
    func expiry(instant: Int64, served: Bool) {
        var cache = LRUCache(budgetBytes: 1 << 20)
        cache.insert(answer(validUntil: now + day), for: key("a"), at: now)
        let found = cache.answer(for: key("a"), at: instant)
        #expect((found != nil) == served)
        #expect(cache.statistics.expirations == (served ? 0 : 1))
        #expect(cache.statistics.entries == (served ? 1 : 0))
    }

    @Test("a question about an instant before the answer was resolved misses, and keeps the entry")
    func pastInstant() {
        var cache = LRUCache(budgetBytes: 1 << 20)
        cache.insert(answer(resolvedAt: now), for: key("a"), at: now)
        let before = cache.answer(for: key("a"), at: now - 1)
        #expect(before == nil)
        let after = cache.answer(for: key("a"), at: now)
        #expect(after != nil)
        #expect(cache.statistics.hits == 1 && cache.statistics.misses == 1)
    }

    @Test("keys: different request shapes never share an entry; equivalent ones do")
    func keys() {
        var cache = LRUCache(budgetBytes: 1 << 20)
        cache.insert(answer(size: 1), for: CacheKey(customerId: "a"), at: now)
        cache.insert(answer(size: 2), for: CacheKey(customerId: "a", environment: .sandbox), at: now)
        cache.insert(answer(size: 3), for: CacheKey(customerId: "a", entitlementIds: ["pro"]), at: now)
        cache.insert(answer(size: 4), for: CacheKey(customerId: "a", entitlementIds: ["pro", "premium"]), at: now)
        #expect(cache.statistics.entries == 4)
        let production = cache.answer(for: CacheKey(customerId: "a", environment: .unspecified), at: now)
        #expect(production?.encodedEntitlements.count == 1)
        let sandbox = cache.answer(for: CacheKey(customerId: "a", environment: .sandbox), at: now)
        #expect(sandbox?.encodedEntitlements.count == 2)
        let filtered = cache.answer(for: CacheKey(customerId: "a", entitlementIds: ["premium", "pro", "pro"]), at: now)
        #expect(filtered?.encodedEntitlements.count == 4)
        // An id that contains what a naive string key would use as a separator is its own key.
        let lookalike = cache.answer(for: CacheKey(customerId: "a|pro"), at: now)
        #expect(lookalike == nil)
        // Ids are told apart by their bytes, as the store does: é as one scalar and as e
        // with a combining accent are two customers, though Swift's == deems them equal.
        cache.insert(answer(size: 5), for: CacheKey(customerId: "caf\u{E9}"), at: now)
        let decomposed = cache.answer(for: CacheKey(customerId: "cafe\u{301}"), at: now)
        #expect(decomposed == nil)
        #expect(CacheKey(customerId: "caf\u{E9}") != CacheKey(customerId: "cafe\u{301}"))
    }

    @Test("the index finds every filed slot after any order of removals, colliding hashes and wrap-around included")
    func slotIndexCollisions() {
        var generator = SystemRandomNumberGenerator()
        for round in 0..<50 {
            var index = SlotIndex()
            // Few distinct hashes, some at the top of any table size (their probes wrap to
            // bucket 0), so runs of colliding entries form, cross the end and interleave.
            let hashes: [UInt32] = [0, 1, 0xFFFF_FFFF, 0xFFFF_FFFE, UInt32(round)]
            var filed: [Int32: UInt32] = [:]
            for slot in Int32(0)..<200 {
                let hash = hashes.randomElement(using: &generator)!
                index.insert(slot, hash: hash)
                filed[slot] = hash
            }
            for slot in filed.keys.shuffled(using: &generator) {
                let hash = filed[slot]!
                index.remove(slot, hash: hash)
                filed[slot] = nil
                // Every remaining slot is still found; the removed one is gone.
                for (other, hash) in filed {
                    #expect(index.first(hash: hash) { $0 == other } == other)
                }
                #expect(index.first(hash: hash) { $0 == slot } == nil)
            }
        }
    }

    @Test("prefetching a batch's keys changes nothing: the same answers, counters and recency order")
    func prefetchChangesNothing() {
        var cache = LRUCache(budgetBytes: 1 << 20)
        for index in 0..<50 {
            // Sizes from none (the shared empty storage) to several cache lines.
            cache.insert(answer(size: index * 37), for: key("user-\(index)"), at: now)
        }
        let before = (cache.keysByRecency, cache.statistics)
        let keys = (0..<80).map { key("user-\($0 * 7 % 90)") } + [CacheKey(customerId: "user-3", environment: .sandbox)]
        let hashes = keys.map(LRUCache.hash(of:))
        hashes.withUnsafeBufferPointer { cache.prefetch(hashes: $0) }
        #expect(cache.keysByRecency == before.0)
        var statistics = cache.statistics
        #expect(statistics.prefetched == UInt64(keys.filter { $0.environment == .production && Int($0.customerId.dropFirst(5))! < 50 }.count))
        statistics.prefetched = 0
        #expect(statistics == before.1)
        for index in 0..<90 {
            #expect(cache.answer(for: key("user-\(index)"), at: now)?.encodedEntitlements.count == (index < 50 ? index * 37 : nil))
        }
    }

    @Test("lru against a plain model: random inserts, lookups, replacements and removals agree, eviction order included")
    func modelCheck() {
        var generator = SystemRandomNumberGenerator()
        let unit = LRUCache.cost(of: key("user-0000"), answer(size: 100))
        var cache = LRUCache(budgetBytes: 300 * unit, policy: .lru)
        var order: [CacheKey] = []  // most recent first
        for _ in 0..<20_000 {
            let id = "user-\(String(Int.random(in: 0..<1_000, using: &generator) + 1_000))"
            // Two request shapes per customer, so that a customer has a chain of entries.
            let shape = CacheKey(customerId: id, environment: Bool.random(using: &generator) ? .production : .sandbox)
            switch Int.random(in: 0..<10, using: &generator) {
            case 0..<4:
                cache.insert(answer(size: 100), for: shape, at: now)
                order.removeAll { $0 == shape }
                order.insert(shape, at: 0)
                if order.count > 300 {
                    order.removeLast()
                }
            case 4:
                cache.removeAll(customerId: id)
                order.removeAll { $0.customerId == id }
            default:
                let found = cache.answer(for: shape, at: now) != nil
                #expect(found == order.contains(shape))
                if found {
                    order.removeAll { $0 == shape }
                    order.insert(shape, at: 0)
                }
            }
        }
        #expect(cache.keysByRecency == order)
        #expect(cache.statistics.entries == order.count)
        for shape in order {
            #expect(cache.answer(for: shape, at: now) != nil)
        }
    }

    @Test("shards: every customer has one stable shard in range")
    func shards() {
        for count in [1, 2, 7, 16] {
            for index in 0..<200 {
                let shard = LRUCache.shardIndex(for: "user-\(index)", shardCount: count)
                #expect((0..<count).contains(shard))
                #expect(shard == LRUCache.shardIndex(for: "user-\(index)", shardCount: count))
            }
        }
        // The hash is fixed by the file format: the same on every machine and run.
        #expect(KeyHash.hash("user-1") == 0x41A2_FCA5_C684_01C5)
    }
}

@Suite("cached answers")
struct CachedAnswerTests {
    @Test("a response assembled from a cached answer is byte-for-byte the encoded message")
    func assembledResponse() throws {
        let resolver = EntitlementResolver(catalog: SyntheticData.catalog)
        let data = SyntheticData(seed: 5, now: now)
        for index in 0..<300 {
            let record = data.customer(index)
            let resolution = resolver.resolve(record, at: now)
            let cached = try CachedAnswer(resolution, resolvedAt: now)
            var assembled = ByteBuffer()
            cached.writeResponse(userId: "$anon:x", customerId: record.id!, requestDate: now + 5, into: &assembled)
            let whole = try CheckEntitlementsResponse(
                userId: "$anon:x",
                customerId: record.id,
                requestDate: now + 5,
                validUntil: resolution.validUntil,
                entitlements: resolution.entitlements
            ).serializedBytes()
            #expect(Array(assembled.readableBytesView) == whole)
        }
    }

    @Test("negative dates encode as protobuf-c encodes them")
    func negativeDates() throws {
        let cached = CachedAnswer(encodedEntitlements: [], resolvedAt: -5, validUntil: -1)
        var assembled = ByteBuffer()
        cached.writeResponse(userId: "u", customerId: "c", requestDate: -5, into: &assembled)
        let whole = try CheckEntitlementsResponse(userId: "u", customerId: "c", requestDate: -5, validUntil: -1).serializedBytes()
        #expect(Array(assembled.readableBytesView) == whole)
    }
}

@Suite("cache warm-up")
struct CacheWarmerTests {
    static func snapshot(in scratch: borrowing ScratchDirectory, hotList: [String]) throws -> SnapshotReader {
        let path = scratch.file("data.snap")
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
        let scratch = try ScratchDirectory()
        let hot = ["user-42", "user-7", "ghost", "user-3", "user-90"]
        let reader = try Self.snapshot(in: scratch, hotList: hot)
        let resolver = EntitlementResolver(catalog: reader.catalog)
        // A budget for exactly the first two customers.
        let cost = { (id: String) in
            LRUCache.cost(of: CacheKey(customerId: id), try! CachedAnswer(resolver.resolve(try! reader.customer(for: id), at: now), resolvedAt: now))
        }
        var shards = [LRUCache(budgetBytes: cost("user-42") + cost("user-7"))]
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
        let scratch = try ScratchDirectory()
        let hot = ["user-1", "ghost", "user-2", "user-3"]
        let reader = try Self.snapshot(in: scratch, hotList: hot)
        var shards = (0..<3).map { _ in LRUCache(budgetBytes: 1 << 20) }
        let report = try CacheWarmer.warm(&shards, from: reader, resolver: EntitlementResolver(catalog: reader.catalog), at: now)
        #expect(report.customersCached == 3 && report.customersMissing == 1 && !report.stoppedFull)
        for id in ["user-1", "user-2", "user-3"] {
            let shard = LRUCache.shardIndex(for: id, shardCount: 3)
            let recent1 = shards[shard].answer(for: CacheKey(customerId: id), at: now)
            #expect(recent1 != nil)
        }
    }

    @Test("the hot list of a new snapshot reflects what was actually used, most recent first")
    func hotListFromUse() {
        var shards = (0..<2).map { _ in LRUCache(budgetBytes: 1 << 20) }
        for (offset, id) in ["a", "b", "c", "d"].enumerated() {
            let shard = LRUCache.shardIndex(for: id, shardCount: 2)
            shards[shard].insert(answer(), for: CacheKey(customerId: id), at: now + Int64(offset))
        }
        let shardOfB = LRUCache.shardIndex(for: "b", shardCount: 2)
        _ = shards[shardOfB].answer(for: CacheKey(customerId: "b"), at: now + 10)
        #expect(CacheWarmer.hotList(of: shards) == ["b", "d", "c", "a"])
    }
}

@Suite("cache peek: a check request's cache key, read from its bytes")
struct CachePeekTests {
    static func peek(_ bytes: [UInt8]) -> CachePeek? {
        bytes.withUnsafeBytes { CachePeek(checkRequest: $0, longestUserId: 256) }
    }

    @Test("the peeked hashes are the ones the cache and the shards use for the decoded request", arguments: [
        CheckEntitlementsRequest(userId: "user-1"),
        CheckEntitlementsRequest(userId: "a-much-longer-customer-id-0123456789abcdef", at: 1_700_000_000_000),
        CheckEntitlementsRequest(userId: "user-2", environment: .sandbox, minLogSequence: 42),
        CheckEntitlementsRequest(userId: "user-3", environment: .production),
        CheckEntitlementsRequest(userId: "caf\u{E9}", at: -5),
    ])
    func matchesTheKey(request: CheckEntitlementsRequest) throws {
        let peek = try #require(Self.peek(try request.serializedBytes()))
        let key = CacheKey(customerId: request.userId!, environment: request.environment)
        #expect(peek.hash == SlotIndex.hash(key))
        #expect(peek.shardHash == KeyHash.hash(request.userId!))
    }

    @Test("a filter, no user id, an unknown environment or bytes that do not parse give no peek")
    func refuses() throws {
        #expect(Self.peek(try CheckEntitlementsRequest(userId: "user-1", entitlementIds: ["pro"]).serializedBytes()) == nil)
        #expect(Self.peek(try CheckEntitlementsRequest(at: 5).serializedBytes()) == nil)
        #expect(Self.peek([0x0A, 0x06] + Array("user-1".utf8) + [0x20, 0x63]) == nil)  // environment 99
        #expect(Self.peek([0x0A, 0x10, 0x61]) == nil)  // a length past the end
        #expect(Self.peek([0x0A, 0x01, 0x61, 0xFF]) == nil)  // a varint cut short
        #expect(Self.peek([0x0D, 0, 0, 0, 0]) == nil)  // a wire type the message does not use
        #expect(Self.peek([]) == nil)
        #expect(Self.peek(try CheckEntitlementsRequest(userId: String(repeating: "x", count: 257)).serializedBytes()) == nil)
        #expect(Self.peek(try CheckEntitlementsRequest(userId: String(repeating: "x", count: 256)).serializedBytes()) != nil)
    }

    @Test("random messages: whenever the decoder accepts one, the peek names its key or declines; random bytes never crash it")
    func randomMessages() throws {
        var generator = SystemRandomNumberGenerator()
        func varint(_ value: UInt64) -> [UInt8] {
            var value = value
            var bytes: [UInt8] = []
            while value >= 0x80 {
                bytes.append(UInt8(truncatingIfNeeded: value) | 0x80)
                value >>= 7
            }
            return bytes + [UInt8(value)]
        }
        var compared = 0
        for _ in 0..<20_000 {
            // Fragments: user ids (repeated: the last wins), at, environment (known and not),
            // min_log_sequence, unknown fields, a filter, and now and then a random byte.
            var bytes: [UInt8] = []
            for _ in 0..<Int.random(in: 0..<6, using: &generator) {
                switch Int.random(in: 0..<8, using: &generator) {
                case 0, 1:
                    let id = Array("user-\(Int.random(in: 0..<1_000, using: &generator))".utf8)
                    bytes += [0x0A] + varint(UInt64(id.count)) + id
                case 2: bytes += [0x18] + varint(UInt64.random(in: 0...UInt64.max, using: &generator))
                case 3: bytes += [0x20] + varint(UInt64.random(in: 0..<4, using: &generator))
                case 4: bytes += [0x28] + varint(UInt64.random(in: 0..<1_000, using: &generator))
                case 5: bytes += [0x32, 0x02, 0x61, 0x62]  // field 6, unknown
                case 6: bytes += [0x12, 0x03] + Array("pro".utf8)
                default: bytes.append(UInt8.random(in: 0...255, using: &generator))
                }
            }
            let peek = Self.peek(bytes)
            guard let request = try? bytes.withUnsafeBytes({ try CheckEntitlementsRequest(serializedBytes: $0) }) else {
                continue
            }
            guard let peek else {
                continue  // declining is always allowed: it is a hint
            }
            #expect(request.entitlementIds.isEmpty)
            let userId = try #require(request.userId)
            #expect(peek.hash == SlotIndex.hash(CacheKey(customerId: userId, environment: request.environment)), "\(bytes)")
            compared += 1
        }
        #expect(compared > 1_000)
    }
}

@Suite("cache policy: Window TinyLFU")
struct TinyLFUTests {
    @Test("a scan of customers asked for once does not flush those asked for often (with lru it does)", arguments: LRUCache.Policy.allCases)
    func scanResistance(policy: LRUCache.Policy) {
        let unit = LRUCache.cost(of: key("scan-00000"), answer())
        var cache = LRUCache(budgetBytes: 3_000 * unit, policy: policy)
        // As the server does: a lookup, and on a miss an insert.
        func check(_ id: String) {
            if cache.answer(for: key(id), at: now) == nil {
                cache.insert(answer(), for: key(id), at: now)
            }
        }
        // Two thirds of the cache: past half full, where the sketch starts counting.
        for _ in 0..<15 {
            for index in 0..<2_000 {
                check("hot-\(index)")
            }
        }
        for index in 0..<5_000 {
            check("scan-\(index)")
        }
        let kept = (0..<2_000).filter { cache.answer(for: key("hot-\($0)"), at: now) != nil }.count
        switch policy {
        case .tinyLFU:
            // Every one: the hot keys' counts are saturated (15), and a scanned key can at
            // most tie with them (if its four counters all collide with hot keys'), which
            // keeps the incumbent. Admitting every newcomer would lose the ~30 hot keys the
            // window let go onto probation when the scan began.
            #expect(kept == 2_000)
            #expect(cache.statistics.rejections > 0)
        case .lru:
            #expect(kept == 0)
            #expect(cache.statistics.rejections == 0)
        }
    }

    @Test("the frequency sketch is made when the entries first account for half the budget, never with lru", arguments: LRUCache.Policy.allCases)
    func lazySketch(policy: LRUCache.Policy) {
        let unit = LRUCache.cost(of: key("c00"), answer())
        var cache = LRUCache(budgetBytes: 100 * unit, policy: policy)
        for index in 0..<49 {
            cache.insert(answer(), for: key("c\(index + 10)"), at: now)
        }
        #expect(cache.sketchBytes == 0)
        cache.insert(answer(), for: key("c99"), at: now)
        #expect(cache.sketchBytes == (policy == .tinyLFU ? (512 + 8) * 8 : 0))
    }

    @Test("after a warm-up to the full budget, newcomers asked for once displace no warmed entry")
    func warmedEntriesHold() {
        let unit = LRUCache.cost(of: key("warm-000"), answer())
        var cache = LRUCache(budgetBytes: 400 * unit, policy: .tinyLFU)
        var warmed = 0
        while cache.insertIfRoom(answer(), for: key("warm-\(String(warmed + 100))"), at: now) {
            warmed += 1
        }
        #expect(warmed == 400)
        for index in 0..<200 {
            let newcomer = key("new-\(String(index + 100))")
            #expect(cache.answer(for: newcomer, at: now) == nil)
            cache.insert(answer(), for: newcomer, at: now)
        }
        // Every newcomer lost its tie with a warmed entry once it left the window.
        let kept = (0..<400).filter { cache.answer(for: key("warm-\(String($0 + 100))"), at: now) != nil }.count
        #expect(kept == 400 - cache.statistics.evictions)
        #expect(cache.statistics.evictions <= 20 && cache.statistics.rejections >= 180)
    }

    @Test("the hot list takes each customer's latest use, whichever list its entries are on")
    func hotListLatestUse() {
        let unit = LRUCache.cost(of: key("c00"), answer())
        var cache = LRUCache(budgetBytes: 200 * unit, policy: .tinyLFU)
        for index in 0..<150 {
            cache.insert(answer(), for: key("c\(index + 100)"), at: now + Int64(index))
        }
        // c100's production entry moves to protected at now + 500; its sandbox entry,
        // newer, stays in the window.
        _ = cache.answer(for: key("c100"), at: now + 500)
        cache.insert(answer(), for: CacheKey(customerId: "c100", environment: .sandbox), at: now + 600)
        let recency = cache.recency()
        #expect(recency.filter { $0.customerId == "c100" }.map(\.lastUsed) == [now + 600])
        #expect(CacheWarmer.hotList(of: [cache]).prefix(2) == ["c100", "c249"])
    }

    @Test("against a plain model: random lookups, inserts and removals agree, segments, admissions and eviction order included")
    func modelCheck() {
        // Seeded, and the seed is in every failure: Xoshiro(seed: seed) runs it again.
        var generator = Xoshiro()
        let seed = generator.currentState
        let unit = LRUCache.cost(of: key("user-0000"), answer(size: 100))
        let budget = 300 * unit
        var cache = LRUCache(budgetBytes: budget, policy: .tinyLFU)
        var model = TinyLFUModel(budget: budget)
        for _ in 0..<30_000 {
            // Skewed, so that admission goes both ways: low ids are asked for far more often.
            let draw = Double.random(in: 0..<1, using: &generator)
            let id = "user-\(String(Int(draw * draw * 1_000) + 1_000))"
            let shape = CacheKey(customerId: id, environment: Bool.random(using: &generator) ? .production : .sandbox)
            switch Int.random(in: 0..<20, using: &generator) {
            case 0:
                cache.removeAll(customerId: id)
                model.removeAll(customerId: id)
            case 1:
                // Warm-up's insert: only with room, at the back of probation.
                let cost = LRUCache.cost(of: shape, answer(size: 60))
                #expect(cache.insertIfRoom(answer(size: 60), for: shape, at: now) == model.insertIfRoom(shape, cost: cost), "seed \(seed)")
            case 2:
                // Prefetching changes nothing, the sketch's block included.
                let hashes = (0..<8).map { _ in LRUCache.hash(of: CacheKey(customerId: "user-\(Int.random(in: 1_000..<2_000, using: &generator))")) }
                hashes.withUnsafeBufferPointer { cache.prefetch(hashes: $0) }
            case 3..<9:
                // Of several sizes, so that byte budgets, not counts, decide.
                let size = [40, 100, 100, 260][Int.random(in: 0..<4, using: &generator)]
                cache.insert(answer(size: size), for: shape, at: now)
                model.insert(shape, cost: LRUCache.cost(of: shape, answer(size: size)))
            default:
                let found = cache.answer(for: shape, at: now) != nil
                #expect(found == model.lookUp(shape), "seed \(seed)")
            }
        }
        #expect(cache.keysByRecency == model.keysByRecency, "seed \(seed)")
        #expect(cache.statistics.bytes == model.bytes)
        #expect(cache.statistics.bytes <= budget)
        #expect(cache.statistics.evictions == model.evictions && cache.statistics.rejections == model.rejections)
        #expect(model.rejections > 0 && model.evictions > 0)
    }
}

/// Window TinyLFU written plainly, for ``TinyLFUTests/modelCheck()``: three arrays, most
/// recent first, and a sketch of its own fed the same hashes in the same order as the
/// cache's (so the frequencies agree; FrequencySketchTests test the sketch itself).
struct TinyLFUModel {
    typealias Entry = (key: CacheKey, cost: Int)
    var window: [Entry] = []
    var probation: [Entry] = []
    var protected: [Entry] = []
    /// Made when the entries first account for half the budget, as the cache makes its own.
    var sketch: FrequencySketch?
    let budget: Int
    let windowBudget: Int
    let protectedBudget: Int
    var evictions: UInt64 = 0
    var rejections: UInt64 = 0

    init(budget: Int) {
        self.budget = budget
        self.windowBudget = max(budget / 100, min(budget / 10, 4_096))
        self.protectedBudget = (budget - self.windowBudget) / 10 * 8
    }

    static func bytes(_ list: [Entry]) -> Int { list.reduce(0) { $0 + $1.cost } }
    var bytes: Int { Self.bytes(self.window) + Self.bytes(self.probation) + Self.bytes(self.protected) }
    var keysByRecency: [CacheKey] { (self.protected + self.probation + self.window).map(\.key) }
    func frequency(_ key: CacheKey) -> Int { self.sketch?.frequency(LRUCache.hash(of: key)) ?? 0 }

    mutating func lookUp(_ key: CacheKey) -> Bool {
        self.sketch?.record(LRUCache.hash(of: key))
        if let index = self.window.firstIndex(where: { $0.key == key }) {
            self.window.insert(self.window.remove(at: index), at: 0)
        } else if let index = self.protected.firstIndex(where: { $0.key == key }) {
            self.protected.insert(self.protected.remove(at: index), at: 0)
        } else if let index = self.probation.firstIndex(where: { $0.key == key }) {
            self.protected.insert(self.probation.remove(at: index), at: 0)
            while Self.bytes(self.protected) > self.protectedBudget, self.protected.last!.key != key {
                self.probation.insert(self.protected.removeLast(), at: 0)
            }
        } else {
            return false
        }
        return true
    }

    mutating func remove(where matches: (Entry) -> Bool) {
        self.window.removeAll(where: matches)
        self.probation.removeAll(where: matches)
        self.protected.removeAll(where: matches)
    }

    mutating func removeAll(customerId: String) {
        self.remove { $0.key.customerId.utf8.elementsEqual(customerId.utf8) }
    }

    /// The main part's next victim: probation's least recent other than the candidate at
    /// its front, else the protected segment's least recent.
    func victim() -> Entry? {
        self.probation.count > 1 ? self.probation.last : self.protected.last
    }

    /// Once the entries account for half the budget: a sketch that has counted each once.
    mutating func makeSketchIfHalfFull() {
        guard self.sketch == nil, self.bytes >= self.budget / 2 else {
            return
        }
        var sketch = FrequencySketch(entries: 2 * (self.window.count + self.probation.count + self.protected.count))
        for entry in self.protected + self.probation + self.window {
            sketch.record(LRUCache.hash(of: entry.key))
        }
        self.sketch = sketch
    }

    mutating func insertIfRoom(_ key: CacheKey, cost: Int) -> Bool {
        let all = self.window + self.probation + self.protected
        let replaced = all.first { $0.key == key }?.cost ?? 0
        guard self.bytes - replaced + cost <= self.budget else {
            return false
        }
        self.remove { $0.key == key }
        self.probation.append((key, cost))
        self.sketch?.record(LRUCache.hash(of: key))
        self.makeSketchIfHalfFull()
        return true
    }

    mutating func insert(_ key: CacheKey, cost: Int) {
        self.remove { $0.key == key }
        self.window.insert((key, cost), at: 0)
        self.makeSketchIfHalfFull()
        while Self.bytes(self.window) > self.windowBudget, let candidate = self.window.popLast() {
            self.probation.insert(candidate, at: 0)
            while self.bytes > self.budget, let victim = self.victim() {
                guard self.frequency(candidate.key) > self.frequency(victim.key) else {
                    self.probation.removeFirst()
                    self.rejections += 1
                    break
                }
                self.remove { $0.key == victim.key }
                self.evictions += 1
            }
        }
        while self.bytes > self.budget {
            let victim = self.probation.last ?? self.protected.last ?? self.window.last!
            self.remove { $0.key == victim.key }
            self.evictions += 1
        }
    }
}

