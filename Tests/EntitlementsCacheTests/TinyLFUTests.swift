import EntitlementsMessages
import EntitlementsResolver
import EntitlementsStore
import EntitlementsTools
import NIOCore
import PropertyBased
import Testing

@testable import EntitlementsCache

@Suite("cache policy: Window TinyLFU")
struct TinyLFUTests {
    @Test("a scan of customers asked for once does not flush those asked for often (with lru it does)", arguments: AnswerCache.Policy.allCases)
    func scanResistance(policy: AnswerCache.Policy) {
        let unit = AnswerCache.cost(of: key("scan-00000"), answer())
        var cache = AnswerCache(budgetBytes: 3_000 * unit, policy: policy)
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

    @Test("the frequency sketch is made when the entries first account for half the budget, never with lru", arguments: AnswerCache.Policy.allCases)
    func lazySketch(policy: AnswerCache.Policy) {
        let unit = AnswerCache.cost(of: key("c00"), answer())
        var cache = AnswerCache(budgetBytes: 100 * unit, policy: policy)
        for index in 0..<49 {
            cache.insert(answer(), for: key("c\(index + 10)"), at: now)
        }
        #expect(cache.sketchBytes == 0)
        cache.insert(answer(), for: key("c99"), at: now)
        #expect(cache.sketchBytes == (policy == .tinyLFU ? (512 + 8) * 8 : 0))
    }

    @Test("after a warm-up to the full budget, newcomers asked for once displace no warmed entry")
    func warmedEntriesHold() {
        let unit = AnswerCache.cost(of: key("warm-000"), answer())
        var cache = AnswerCache(budgetBytes: 400 * unit, policy: .tinyLFU)
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
        let unit = AnswerCache.cost(of: key("c00"), answer())
        var cache = AnswerCache(budgetBytes: 200 * unit, policy: .tinyLFU)
        for index in 0..<150 {
            cache.insert(answer(), for: key("c\(index + 100)"), at: now + Int64(index))
        }
        // c100's production entry moves to protected at now + 500; its sandbox entry,
        // newer, stays in the window.
        _ = cache.answer(for: key("c100"), at: now + 500)
        cache.insert(answer(), for: CacheKey(customerId: "c100", environment: .sandbox), at: now + 600)
        let recency = cache.recency()
        #expect(recency.filter { $0.customerId == "c100" }.map(\.lastUsed) == [now + 600])
        #expect(recency.sorted { $0.lastUsed > $1.lastUsed }.prefix(2).map(\.customerId) == ["c100", "c249"])
    }

    @Test("against a plain model: random lookups, inserts and removals agree, segments, admissions and eviction order included")
    func modelCheck() {
        // Seeded, and the seed is in every failure: Xoshiro(seed: seed) runs it again.
        var generator = Xoshiro()
        let seed = generator.currentState
        let unit = AnswerCache.cost(of: key("user-0000"), answer(size: 100))
        let budget = 300 * unit
        var cache = AnswerCache(budgetBytes: budget, policy: .tinyLFU)
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
                let cost = AnswerCache.cost(of: shape, answer(size: 60))
                #expect(cache.insertIfRoom(answer(size: 60), for: shape, at: now) == model.insertIfRoom(shape, cost: cost), "seed \(seed)")
            case 2:
                // Prefetching changes nothing, the sketch's block included.
                let hashes = (0..<8).map { _ in AnswerCache.hash(of: CacheKey(customerId: "user-\(Int.random(in: 1_000..<2_000, using: &generator))")) }
                hashes.withUnsafeBufferPointer { cache.prefetch(hashes: $0) }
            case 3..<9:
                // Of several sizes, so that byte budgets, not counts, decide.
                let size = [40, 100, 100, 260][Int.random(in: 0..<4, using: &generator)]
                cache.insert(answer(size: size), for: shape, at: now)
                model.insert(shape, cost: AnswerCache.cost(of: shape, answer(size: size)))
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
    func frequency(_ key: CacheKey) -> Int { self.sketch?.frequency(AnswerCache.hash(of: key)) ?? 0 }

    mutating func lookUp(_ key: CacheKey) -> Bool {
        self.sketch?.record(AnswerCache.hash(of: key))
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
            sketch.record(AnswerCache.hash(of: entry.key))
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
        self.sketch?.record(AnswerCache.hash(of: key))
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

