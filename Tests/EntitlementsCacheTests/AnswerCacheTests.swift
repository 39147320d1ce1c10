import EntitlementsMessages
import EntitlementsResolver
import EntitlementsStore
import EntitlementsTools
import NIOCore
import PropertyBased
import Testing

@testable import EntitlementsCache

/// An answer whose encoded form is `size` bytes, valid from `resolvedAt` to `validUntil`.
func answer(size: Int = 100, resolvedAt: Int64 = now, validUntil: Int64? = nil) -> CachedAnswer {
    CachedAnswer(encodedEntitlements: [UInt8](repeating: 7, count: size), resolvedAt: resolvedAt, validUntil: validUntil)
}

func key(_ id: String) -> CacheKey {
    CacheKey(customerId: id)
}

@Suite("answer cache")
struct AnswerCacheTests {
    /// The cost of one 100-byte answer for a 2-character id.
    static let unit = AnswerCache.cost(of: key("c0"), answer())

    @Test("lru: the least recently used entry is evicted first; a lookup makes an entry recent")
    func evictionOrder() {
        var cache = AnswerCache(budgetBytes: 3 * Self.unit, policy: .lru)
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
        var cache = AnswerCache(budgetBytes: 1 << 20)
        let small = answer(size: 10)
        let large = answer(size: 5_000)
        let filtered = CacheKey(customerId: "customer-with-a-long-id", environment: .sandbox, entitlementIds: ["pro", "premium"])
        cache.insert(small, for: key("a"), at: now)
        cache.insert(large, for: filtered, at: now)
        let expected = (1 + 10 + AnswerCache.entryOverhead) + (23 + 3 + 16 + 7 + 16 + 5_000 + AnswerCache.entryOverhead)
        #expect(cache.statistics.bytes == expected)
        #expect(cache.statistics.entries == 2)
        // Replacing an entry replaces its cost.
        cache.insert(answer(size: 20), for: key("a"), at: now)
        #expect(cache.statistics.bytes == expected + 10)
        cache.removeAll(customerId: "customer-with-a-long-id")
        #expect(cache.statistics.bytes == 1 + 20 + AnswerCache.entryOverhead)
        #expect(cache.statistics.entries == 1)
    }

    @Test("the budget is never exceeded, whatever the sizes", arguments: AnswerCache.Policy.allCases)
    func budgetHolds(policy: AnswerCache.Policy) {
        var cache = AnswerCache(budgetBytes: 50_000, policy: policy)
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
        var cache = AnswerCache(budgetBytes: 1_000)
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
        var cache = AnswerCache(budgetBytes: 1 << 20)
        cache.insert(answer(validUntil: now + day), for: key("a"), at: now)
        let found = cache.answer(for: key("a"), at: instant)
        #expect((found != nil) == served)
        #expect(cache.statistics.expirations == (served ? 0 : 1))
        #expect(cache.statistics.entries == (served ? 1 : 0))
    }

    @Test("a question about an instant before the answer was resolved misses, and keeps the entry")
    func pastInstant() {
        var cache = AnswerCache(budgetBytes: 1 << 20)
        cache.insert(answer(resolvedAt: now), for: key("a"), at: now)
        let before = cache.answer(for: key("a"), at: now - 1)
        #expect(before == nil)
        let after = cache.answer(for: key("a"), at: now)
        #expect(after != nil)
        #expect(cache.statistics.hits == 1 && cache.statistics.misses == 1)
    }

    @Test("keys: different request shapes never share an entry; equivalent ones do")
    func keys() {
        var cache = AnswerCache(budgetBytes: 1 << 20)
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
        var cache = AnswerCache(budgetBytes: 1 << 20)
        for index in 0..<50 {
            // Sizes from none (the shared empty storage) to several cache lines.
            cache.insert(answer(size: index * 37), for: key("user-\(index)"), at: now)
        }
        let before = (cache.keysByRecency, cache.statistics)
        let keys = (0..<80).map { key("user-\($0 * 7 % 90)") } + [CacheKey(customerId: "user-3", environment: .sandbox)]
        let hashes = keys.map(AnswerCache.hash(of:))
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
        let unit = AnswerCache.cost(of: key("user-0000"), answer(size: 100))
        var cache = AnswerCache(budgetBytes: 300 * unit, policy: .lru)
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

}
