import CEntitlementsShim

/// What the cache has done since it was created.
public struct CacheStatistics: Sendable, Hashable {
    /// Lookups answered from the cache.
    public var hits: UInt64 = 0
    /// Lookups not answered (absent, expired, or asked for an instant before resolution).
    public var misses: UInt64 = 0
    /// Entries removed because their validUntil had passed.
    public var expirations: UInt64 = 0
    /// Entries removed to make room.
    public var evictions: UInt64 = 0
    /// Entries that left the window of a ``Policy/tinyLFU`` cache and were not admitted
    /// to its main part: asked for no more often than the entry they would have evicted.
    public var rejections: UInt64 = 0
    /// Entries inserted or replaced.
    public var insertions: UInt64 = 0
    /// Entries whose memory ``AnswerCache/prefetch(hashes:)`` asked the CPU to load.
    public var prefetched: UInt64 = 0
    /// Bytes accounted to current entries (see ``AnswerCache/entryOverhead``).
    public var bytes: Int = 0
    /// Current entries.
    public var entries: Int = 0

    /// All zero.
    public init() {}

    /// The sum of two shards' statistics.
    public static func + (a: Self, b: Self) -> Self {
        var sum = a
        sum.hits += b.hits
        sum.misses += b.misses
        sum.expirations += b.expirations
        sum.evictions += b.evictions
        sum.rejections += b.rejections
        sum.insertions += b.insertions
        sum.prefetched += b.prefetched
        sum.bytes += b.bytes
        sum.entries += b.entries
        return sum
    }
}

/// Which entries a full cache keeps.
public enum CachePolicy: String, Sendable, CaseIterable {
    /// Least recently used: every new answer is stored, and the entry used longest ago
    /// makes room for it.
    case lru
    /// Window TinyLFU (Einziger, Friedman and Manes, ACM Transactions on Storage, 2017):
    /// a new answer enters a small least-recently-used window (1% of the budget, at least
    /// 4 KiB). When it leaves the window of a full cache it stays only if it was asked
    /// for more often
    /// (``FrequencySketch``) than the main part's least valuable entry, which then makes
    /// room; else it is dropped. The main part is segmented: an entry asked for again
    /// moves from probation to the protected segment (80% of the main part), whose
    /// least recent entries go back to probation.
    case tinyLFU = "tinylfu"
}

/// What an entry of an ``EntryCache`` holds: a value exact for instants in
/// [`resolvedAt`, `validUntil`), and what it costs.
public protocol CacheEntry: Sendable {
    /// The instant the value was resolved at; it is exact from there.
    var resolvedAt: Int64 { get }
    /// The instant from which it may be wrong; nil if never.
    var validUntil: Int64? { get }
    /// Its bytes, charged against the budget with its key's and the entry's overhead.
    var byteCount: Int { get }
    /// A value that holds no storage: what a removed entry's slot keeps.
    static var vacant: Self { get }
    /// Where in the value the reference to its byte storage is, for
    /// ``EntryCache/prefetch(hashes:)``; nil when it has none worth loading ahead.
    static var storageOffset: Int? { get }
}


/// The cache behind ``AnswerCache`` (the server's answers, encoded) and ``ResponseCache``
/// (a client's near-cache, decoded answers): one structure and one policy for any
/// ``CacheEntry``. Internal and generic, so that each public wrapper gets it specialized
/// for its own entry type within this module.
///
/// A cache of answers, bounded by bytes. O(1) lookup, insertion and eviction: an
/// open-addressing index from key to slot (``SlotIndex``), and doubly linked recency lists
/// threaded through an array of slots by index (no per-entry objects, no reference
/// counting on the lists).
///
/// What it keeps when full is its ``Policy``: least recently used (``Policy/lru``), or
/// Window TinyLFU (``Policy/tinyLFU``, the default), which keeps the answers asked for
/// most often: under a skewed load it hits more often in the same bytes, and a scan of
/// customers asked for once cannot flush the popular ones out.
///
/// A value type with no locks: each resolver actor owns one shard (see
/// `AnswerCache.shardIndex(for:shardCount:)` in EntitlementsServer), so a shard is only ever touched by its owner.
///
/// An entry is served only while it is exact: for instants in [resolvedAt, validUntil).
/// A lookup at or after validUntil removes the entry (an expiration) and misses.
struct EntryCache<Entry: CacheEntry>: Sendable {
    typealias Statistics = CacheStatistics
    typealias Policy = CachePolicy

    /// Bytes charged per entry on top of its strings and encoded answer: the index slot,
    /// the list node, and the heap headers of the key's and the answer's storage.
    /// Measured, not guessed: see docs/snapshot-format.md, "Cache memory".
    static var entryOverhead: Int { 192 }

    /// The recency list an entry is on.
    private enum Segment: UInt8 {
        /// New entries (with ``Policy/lru``: every entry).
        case window
        /// The main part's entries not asked for since they entered it: evicted first.
        case probation
        /// The main part's entries asked for again.
        case protected
    }

    /// One recency list: most recent at `head`.
    private struct RecencyList {
        /// Most recently used; -1 when empty.
        var head: Int32 = -1
        /// Least recently used; -1 when empty.
        var tail: Int32 = -1
        /// What its entries cost.
        var bytes = 0
    }

    private struct Node {
        var key: CacheKey
        var answer: Entry
        var cost: Int
        var lastUsed: Int64
        var previous: Int32
        var next: Int32
        /// The next entry of the same customer (another request shape); -1 at the end.
        var nextOfCustomer: Int32 = -1
        /// The key's hash in ``SlotIndex`` (kept to find the entry again on removal).
        var hash: UInt32 = 0
        /// The answer's byte count, for ``AnswerCache/prefetch(hashes:)``.
        var answerBytes: Int32 = 0
        /// The list the entry is on.
        var segment: Segment = .window
    }

    /// Where in an entry the reference to its answer's byte storage is.
    private static var answerStorageOffset: Int? { Entry.storageOffset.map { MemoryLayout<Node>.offset(of: \Node.answer)! + $0 } }

    /// Where in an entry its recency links are.
    private static var linksOffset: Int { MemoryLayout<Node>.offset(of: \Node.previous)! }

    /// The most bytes the entries may account for.
    let budgetBytes: Int
    /// What the cache keeps when full.
    let policy: Policy
    private(set) var statistics = Statistics()

    /// The most bytes the window may hold before its least recent entries leave it: the
    /// whole budget with ``Policy/lru`` (nothing else), 1% with ``Policy/tinyLFU`` (at least
    /// 4 KiB, or a tenth of a budget under 40 KiB).
    private let windowBudget: Int
    /// The most bytes the protected segment may hold before its least recent entries go
    /// back to probation.
    private let protectedBudget: Int
    /// How often keys were asked for; nil with ``Policy/lru``, and until the entries first
    /// account for half the budget (as Caffeine does): before that nothing is evicted, so
    /// nothing needs counting, and a cache that holds everything (the hot profiles) never
    /// pays for it.
    private var sketch: FrequencySketch?
    private var window = RecencyList()
    private var probation = RecencyList()
    private var protected = RecencyList()

    private var slots = SlotIndex()
    private var nodes: [Node] = []
    private var freeSlots: [Int32] = []
    /// Each cached customer's first entry; the rest follow through `nextOfCustomer`. Lets
    /// a write remove a customer's entries without scanning the cache.
    private var firstOfCustomer: [String: Int32] = [:]

    /// Creates an empty cache that holds at most `budgetBytes` of entries, keeping what
    /// `policy` says when full. A ``Policy/tinyLFU`` cache also has a ``FrequencySketch``,
    /// outside the budget, from the time its entries first account for half the budget:
    /// 8 to 16 bytes per entry the full cache would hold (a power of two of 8-byte words).
    init(budgetBytes: Int, policy: Policy = .tinyLFU) {
        precondition(budgetBytes >= 0)
        self.budgetBytes = budgetBytes
        self.policy = policy
        switch policy {
        case .lru:
            self.windowBudget = budgetBytes
            self.protectedBudget = 0
        case .tinyLFU:
            // At least 4 KiB (a few answers), or a tenth of a budget under 40 KiB: a window
            // smaller than one answer would send every new one straight to the admission test.
            self.windowBudget = max(budgetBytes / 100, min(budgetBytes / 10, 4_096))
            self.protectedBudget = (budgetBytes - self.windowBudget) / 10 * 8
        }
    }

    /// Bytes the frequency sketch takes (0 with ``Policy/lru``, and until the cache is half
    /// full), on top of the budget.
    var sketchBytes: Int {
        self.sketch?.tableBytes ?? 0
    }

    /// The hash a lookup of `key` files it under: for a caller that looks a key up more
    /// than once (``prefetch(hashes:)`` then ``answer(for:hash:at:)``) and hashes it once.
    static func hash(of key: CacheKey) -> UInt32 {
        SlotIndex.hash(key)
    }

    /// What an entry for `key` and `answer` costs against the budget.
    static func cost(of key: CacheKey, _ answer: Entry) -> Int {
        key.byteCount + answer.byteCount + Self.entryOverhead
    }

    /// The answer for `key` if it is exact at `instant`; marks it most recently used.
    mutating func answer(for key: CacheKey, at instant: Int64) -> Entry? {
        self.answer(for: key, hash: SlotIndex.hash(key), at: instant)
    }

    /// ``answer(for:at:)`` for a key already hashed: `hash` must be ``hash(of:)`` of `key`.
    mutating func answer(for key: CacheKey, hash: UInt32, at instant: Int64) -> Entry? {
        // The lookup's memory misses overlap rather than come one after another: the sketch's
        // block loads while the index and the entry are read, and the entry's neighbours'
        // links and its answer's bytes (which a hit writes and reads) together after.
        self.sketch?.prefetch(hash)
        let found = self.slot(of: key, hash: hash)
        if let found {
            self.prefetchHit(found)
        }
        // Hits and misses alike: a miss's answer is usually inserted next, and competes with
        // what it would evict by how often it was asked for.
        self.sketch?.record(hash)
        guard let slot = found else {
            self.statistics.misses += 1
            return nil
        }
        let answer = self.nodes[Int(slot)].answer
        if let validUntil = answer.validUntil, instant >= validUntil {
            self.remove(slot: slot)
            self.statistics.expirations += 1
            self.statistics.misses += 1
            return nil
        }
        guard instant >= answer.resolvedAt else {
            // A question about the past: the entry may not hold then. Keep it for others.
            self.statistics.misses += 1
            return nil
        }
        self.nodes[Int(slot)].lastUsed = max(self.nodes[Int(slot)].lastUsed, instant)
        self.touch(slot)
        self.statistics.hits += 1
        return answer
    }

    /// Starts loading, for every key hashed in `hashes` (``hash(of:)``, or
    /// ``CachePeek/hash``), the memory its lookup will read (the frequency sketch's block,
    /// the index bucket, the entry, the answer's bytes, the links of the entry's neighbours
    /// in the recency list, which a hit writes), without waiting: a batch calls this before
    /// looking its keys up one by one, so that their memory misses overlap instead of
    /// coming one after another.
    /// Changes nothing; a lookup after it answers exactly as without it. Allocates nothing.
    mutating func prefetch(hashes: UnsafeBufferPointer<UInt32>) {
        guard hashes.count > 1, !self.nodes.isEmpty else {
            return
        }
        // Each pass reads what the one before it brought in, and starts the next misses.
        for hash in hashes {
            self.sketch?.prefetch(hash)
            self.slots.prefetch(hash: hash)
        }
        var found = 0
        withUnsafeTemporaryAllocation(of: Int32.self, capacity: hashes.count) { candidates in
            self.nodes.withUnsafeBufferPointer { nodes in
                for hash in hashes {
                    // The first slot filed under the hash: almost always the key's own.
                    guard let slot = self.slots.first(hash: hash, matches: { _ in true }) else {
                        continue
                    }
                    candidates.initializeElement(at: found, to: slot)
                    found += 1
                    Self.prefetchEntry(slot, in: nodes)
                }
                for slot in candidates[..<found] {
                    Self.prefetchHit(nodes.baseAddress! + Int(slot), in: nodes)
                }
            }
        }
        self.statistics.prefetched += UInt64(found)
    }

    /// Starts loading every cache line the entry in `slot` spans (it is not aligned to them).
    private static func prefetchEntry(_ slot: Int32, in nodes: UnsafeBufferPointer<Node>) {
        let entry = UnsafeRawPointer(nodes.baseAddress! + Int(slot))
        ent_prefetch(entry)
        ent_prefetch(entry + 64)
        ent_prefetch(entry + MemoryLayout<Node>.size - 1)
    }

    /// Starts loading what a hit on `slot` goes on to read and write, without waiting.
    private func prefetchHit(_ slot: Int32) {
        self.nodes.withUnsafeBufferPointer { nodes in
            Self.prefetchHit(nodes.baseAddress! + Int(slot), in: nodes)
        }
    }

    /// The neighbours' links, then the answer's bytes, of an entry already loaded. The
    /// storage's address is read as a word from the entry, so that no retain is made (a
    /// write to that storage, which would wait for it); the addresses are only prefetched,
    /// never read, so a wrong guess about the array's layout costs speed, not safety.
    private static func prefetchHit(_ node: UnsafePointer<Node>, in nodes: UnsafeBufferPointer<Node>) {
        Self.prefetchNeighbours(of: node, in: nodes)
        guard let offset = Self.answerStorageOffset,
            let storage = UnsafeRawPointer(bitPattern: UnsafeRawPointer(node).load(fromByteOffset: offset, as: UInt.self))
        else {
            return
        }
        let end = Self.arrayHeaderBytes + min(Int(node.pointee.answerBytes), 4_096)
        for line in stride(from: 0, to: end, by: 64) {
            ent_prefetch(storage + line)
        }
    }

    /// Starts loading the recency links of `node`'s neighbours in the list, which moving
    /// it to the front writes: two entries anywhere in memory (the old head, also written,
    /// is usually in the CPU's cache already).
    private static func prefetchNeighbours(of node: UnsafePointer<Node>, in nodes: UnsafeBufferPointer<Node>) {
        let previous = node.pointee.previous
        let next = node.pointee.next
        if previous >= 0 {
            ent_prefetch(UnsafeRawPointer(nodes.baseAddress! + Int(previous)) + Self.linksOffset)
        }
        if next >= 0 {
            ent_prefetch(UnsafeRawPointer(nodes.baseAddress! + Int(next)) + Self.linksOffset)
        }
    }

    /// A Swift array's storage object: a 16-byte object header, the count, the capacity,
    /// then the elements.
    private static var arrayHeaderBytes: Int { 32 }

    /// Stores `answer` for `key` (replacing any entry) as the most recently used, making
    /// room as the ``policy`` says: with ``Policy/lru`` the least recently used entries are
    /// evicted; with ``Policy/tinyLFU`` the answer enters the window, and what leaves the
    /// window stays only if it was asked for more often than what it would evict (so a
    /// stored answer may leave again at once). Returns false, storing nothing, if the entry
    /// alone exceeds the budget.
    @discardableResult
    mutating func insert(_ answer: Entry, for key: CacheKey, at instant: Int64) -> Bool {
        self.insert(answer, for: key, at: instant, evicting: true, asLeastRecent: false)
    }

    /// Stores `answer` only if it fits without evicting anything, as the least recently
    /// used entry (of the main part, with ``Policy/tinyLFU``): warm-up inserts the hot list
    /// hottest first this way, so that the cache's recency order is the hot list's.
    /// Returns whether it was stored.
    @discardableResult
    mutating func insertIfRoom(_ answer: Entry, for key: CacheKey, at instant: Int64) -> Bool {
        self.insert(answer, for: key, at: instant, evicting: false, asLeastRecent: true)
    }

    /// Whether an entry of `cost` bytes fits without evicting anything.
    func hasRoom(for cost: Int) -> Bool {
        self.statistics.bytes + cost <= self.budgetBytes
    }

    /// Removes every entry of `customerId` (all request shapes), e.g. after a write:
    /// O(the customer's entries).
    mutating func removeAll(customerId: String) {
        while let slot = self.firstOfCustomer[customerId] {
            self.remove(slot: slot)
        }
    }

    /// The cached customer ids, each once, with the instant of its last use (the latest of
    /// its entries'): what a new snapshot's hot list is made of, most recent first
    /// (``CacheWarmer/hotList(of:limit:)``). In ``keysByRecency``'s order.
    func recency() -> [(customerId: String, lastUsed: Int64)] {
        var position: [String: Int] = [:]
        var result: [(customerId: String, lastUsed: Int64)] = []
        self.forEachByRecency { node in
            if let index = position[node.key.customerId] {
                result[index].lastUsed = max(result[index].lastUsed, node.lastUsed)
            } else {
                position[node.key.customerId] = result.count
                result.append((node.key.customerId, node.lastUsed))
            }
        }
        return result
    }

    /// Calls `body` with each entry's key and value (most recently used first), touching
    /// no recency.
    func forEachEntry(_ body: (CacheKey, Entry) -> Void) {
        self.forEachByRecency { body($0.key, $0.answer) }
    }

    /// Keys from most to least recently used; with ``Policy/tinyLFU`` list by list: the
    /// protected segment (asked for again), then probation, then the window (new).
    var keysByRecency: [CacheKey] {
        var keys: [CacheKey] = []
        self.forEachByRecency { keys.append($0.key) }
        return keys
    }

    private func forEachByRecency(_ body: (Node) -> Void) {
        for list in [self.protected, self.probation, self.window] {
            var slot = list.head
            while slot >= 0 {
                body(self.nodes[Int(slot)])
                slot = self.nodes[Int(slot)].next
            }
        }
    }

    // MARK: The lists

    /// The slot holding `key`, whose ``SlotIndex/hash(_:)`` is `hash`.
    private func slot(of key: CacheKey, hash: UInt32) -> Int32? {
        self.slots.first(hash: hash) { self.nodes[Int($0)].key == key }
    }

    private mutating func insert(_ answer: Entry, for key: CacheKey, at instant: Int64, evicting: Bool, asLeastRecent: Bool) -> Bool {
        let cost = Self.cost(of: key, answer)
        guard cost <= self.budgetBytes else {
            return false
        }
        let hash = SlotIndex.hash(key)
        let existing = self.slot(of: key, hash: hash)
        if !evicting {
            let replaced = existing.map { self.nodes[Int($0)].cost } ?? 0
            guard self.statistics.bytes - replaced + cost <= self.budgetBytes else {
                return false
            }
        }
        if let existing {
            // The new answer starts over in the window. A key is replaced only when a check
            // asked about an instant before its cached answer's (the read's answer replaces
            // it): too rare to carry its segment over.
            self.remove(slot: existing)
        }
        let node = Node(
            key: key, answer: answer, cost: cost, lastUsed: instant, previous: -1, next: -1,
            hash: hash, answerBytes: Int32(clamping: answer.byteCount)
        )
        let slot: Int32
        if let reused = self.freeSlots.popLast() {
            slot = reused
            self.nodes[Int(slot)] = node
        } else {
            slot = Int32(self.nodes.count)
            self.nodes.append(node)
        }
        self.slots.insert(slot, hash: hash)
        self.nodes[Int(slot)].nextOfCustomer = self.firstOfCustomer[key.customerId] ?? -1
        self.firstOfCustomer[key.customerId] = slot
        self.statistics.bytes += cost
        self.statistics.entries += 1
        self.statistics.insertions += 1
        if asLeastRecent {
            self.linkAtBack(slot, self.policy == .lru ? .window : .probation)
            // A warmed entry counts as asked for once, as those warmed before the sketch was
            // made do (below): a newcomer asked for once ties with it and does not displace it.
            self.sketch?.record(hash)
        } else {
            self.linkAtFront(slot, .window)
        }
        if self.policy == .tinyLFU, self.sketch == nil, self.statistics.bytes >= self.budgetBytes / 2 {
            // Sized for the entries a full cache of answers like these would hold. Each entry
            // so far was asked for at least once (a warmed one, by the hot list's account):
            // counted once, it keeps its place against a newcomer asked for once.
            var sketch = FrequencySketch(entries: 2 * self.statistics.entries)
            self.forEachByRecency { sketch.record($0.hash) }
            self.sketch = sketch
        }
        self.makeRoom()
        return true
    }

    /// Brings the window and then the whole cache back within their budgets.
    private mutating func makeRoom() {
        // What leaves the window competes with the main part's next victim: the one asked
        // for more often stays (a tie keeps the incumbent, as the paper does).
        while self.policy == .tinyLFU, self.window.bytes > self.windowBudget, self.window.tail >= 0 {
            let candidate = self.window.tail
            self.unlink(candidate)
            self.linkAtFront(candidate, .probation)
            let frequency = self.frequency(of: candidate)
            while self.statistics.bytes > self.budgetBytes, let victim = self.mainVictim(sparing: candidate) {
                guard frequency > self.frequency(of: victim) else {
                    self.remove(slot: candidate)
                    self.statistics.rejections += 1
                    break
                }
                self.remove(slot: victim)
                self.statistics.evictions += 1
            }
        }
        while self.statistics.bytes > self.budgetBytes {
            let victim = self.mainVictim(sparing: -1) ?? self.window.tail
            guard victim >= 0 else {
                break
            }
            self.remove(slot: victim)
            self.statistics.evictions += 1
        }
    }

    /// How often the sketch says the entry in `slot` was asked for.
    private func frequency(of slot: Int32) -> Int {
        self.sketch?.frequency(self.nodes[Int(slot)].hash) ?? 0
    }

    /// The main part's least valuable entry other than `spared`: probation's least recent,
    /// else the protected segment's; nil if there is none.
    private func mainVictim(sparing spared: Int32) -> Int32? {
        var victim = self.probation.tail
        if victim >= 0, victim == spared {
            victim = self.nodes[Int(victim)].previous
        }
        if victim < 0 {
            victim = self.protected.tail
        }
        return victim >= 0 ? victim : nil
    }

    /// A hit on `slot`: most recent on its list; with ``Policy/tinyLFU`` an entry on
    /// probation is promoted to the protected segment, whose least recent entries go back
    /// to probation while it is over its budget.
    private mutating func touch(_ slot: Int32) {
        let segment = self.nodes[Int(slot)].segment
        guard segment == .probation else {
            if self[segment].head != slot {
                self.unlink(slot)
                self.linkAtFront(slot, segment)
            }
            return
        }
        self.unlink(slot)
        self.linkAtFront(slot, .protected)
        while self.protected.bytes > self.protectedBudget, self.protected.tail != slot {
            let demoted = self.protected.tail
            self.unlink(demoted)
            self.linkAtFront(demoted, .probation)
        }
    }

    private subscript(segment: Segment) -> RecencyList {
        get {
            switch segment {
            case .window: self.window
            case .probation: self.probation
            case .protected: self.protected
            }
        }
        set {
            switch segment {
            case .window: self.window = newValue
            case .probation: self.probation = newValue
            case .protected: self.protected = newValue
            }
        }
    }

    private mutating func remove(slot: Int32) {
        self.unlink(slot)
        let node = self.nodes[Int(slot)]
        self.slots.remove(slot, hash: node.hash)
        self.unlinkFromCustomer(slot, customerId: node.key.customerId, next: node.nextOfCustomer)
        self.statistics.bytes -= node.cost
        self.statistics.entries -= 1
        // Drop the key's and answer's storage now, not when the slot is reused.
        self.nodes[Int(slot)].key = CacheKey(customerId: "")
        self.nodes[Int(slot)].answer = Entry.vacant
        self.freeSlots.append(slot)
    }

    private mutating func unlinkFromCustomer(_ slot: Int32, customerId: String, next: Int32) {
        guard let first = self.firstOfCustomer[customerId] else {
            return
        }
        if first == slot {
            self.firstOfCustomer[customerId] = next >= 0 ? next : nil
            return
        }
        // A customer has few request shapes: walk to the predecessor.
        var previous = first
        while self.nodes[Int(previous)].nextOfCustomer >= 0 {
            if self.nodes[Int(previous)].nextOfCustomer == slot {
                self.nodes[Int(previous)].nextOfCustomer = next
                return
            }
            previous = self.nodes[Int(previous)].nextOfCustomer
        }
    }

    private mutating func linkAtFront(_ slot: Int32, _ segment: Segment) {
        var list = self[segment]
        self.nodes[Int(slot)].segment = segment
        self.nodes[Int(slot)].previous = -1
        self.nodes[Int(slot)].next = list.head
        if list.head >= 0 {
            self.nodes[Int(list.head)].previous = slot
        }
        list.head = slot
        if list.tail < 0 {
            list.tail = slot
        }
        list.bytes += self.nodes[Int(slot)].cost
        self[segment] = list
    }

    private mutating func linkAtBack(_ slot: Int32, _ segment: Segment) {
        var list = self[segment]
        self.nodes[Int(slot)].segment = segment
        self.nodes[Int(slot)].next = -1
        self.nodes[Int(slot)].previous = list.tail
        if list.tail >= 0 {
            self.nodes[Int(list.tail)].next = slot
        }
        list.tail = slot
        if list.head < 0 {
            list.head = slot
        }
        list.bytes += self.nodes[Int(slot)].cost
        self[segment] = list
    }

    private mutating func unlink(_ slot: Int32) {
        let segment = self.nodes[Int(slot)].segment
        var list = self[segment]
        let previous = self.nodes[Int(slot)].previous
        let next = self.nodes[Int(slot)].next
        if previous >= 0 {
            self.nodes[Int(previous)].next = next
        } else {
            list.head = next
        }
        if next >= 0 {
            self.nodes[Int(next)].previous = previous
        } else {
            list.tail = previous
        }
        list.bytes -= self.nodes[Int(slot)].cost
        self[segment] = list
        self.nodes[Int(slot)].previous = -1
        self.nodes[Int(slot)].next = -1
    }
}

/// A cache of the server's answers in their wire form (``CachedAnswer``): see
/// ``EntryCache``, which it is, for ``CachedAnswer`` entries.
public struct AnswerCache: Sendable {
    public typealias Statistics = CacheStatistics
    public typealias Policy = CachePolicy

    /// Bytes charged per entry on top of its strings and encoded answer: the index slot,
    /// the list node, and the heap headers of the key's and the answer's storage.
    /// Measured, not guessed: see docs/snapshot-format.md, "Cache memory".
    public static let entryOverhead = EntryCache<CachedAnswer>.entryOverhead

    private var core: EntryCache<CachedAnswer>

    /// Creates an empty cache that holds at most `budgetBytes` of entries, keeping what
    /// `policy` says when full (``EntryCache/init(budgetBytes:policy:)``).
    public init(budgetBytes: Int, policy: Policy = .tinyLFU) {
        self.core = EntryCache(budgetBytes: budgetBytes, policy: policy)
    }

    /// The most bytes the entries may account for.
    public var budgetBytes: Int { self.core.budgetBytes }
    /// What the cache keeps when full.
    public var policy: Policy { self.core.policy }
    public var statistics: Statistics { self.core.statistics }
    /// Bytes the frequency sketch takes, on top of the budget.
    public var sketchBytes: Int { self.core.sketchBytes }


    /// The hash a lookup of `key` files it under (``EntryCache/hash(of:)``).
    public static func hash(of key: CacheKey) -> UInt32 {
        EntryCache<CachedAnswer>.hash(of: key)
    }

    /// What an entry for `key` and `answer` costs against the budget.
    public static func cost(of key: CacheKey, _ answer: CachedAnswer) -> Int {
        EntryCache<CachedAnswer>.cost(of: key, answer)
    }

    /// The answer for `key` if it is exact at `instant`; marks it most recently used.
    public mutating func answer(for key: CacheKey, at instant: Int64) -> CachedAnswer? {
        self.core.answer(for: key, at: instant)
    }

    /// ``answer(for:at:)`` for a key already hashed: `hash` must be ``hash(of:)`` of `key`.
    public mutating func answer(for key: CacheKey, hash: UInt32, at instant: Int64) -> CachedAnswer? {
        self.core.answer(for: key, hash: hash, at: instant)
    }

    /// Starts loading the memory the lookups of `hashes` will read (``EntryCache/prefetch(hashes:)``).
    public mutating func prefetch(hashes: UnsafeBufferPointer<UInt32>) {
        self.core.prefetch(hashes: hashes)
    }

    /// Stores `answer` for `key` as the policy says (``EntryCache/insert(_:for:at:)``).
    @discardableResult
    public mutating func insert(_ answer: CachedAnswer, for key: CacheKey, at instant: Int64) -> Bool {
        self.core.insert(answer, for: key, at: instant)
    }

    /// Stores `answer` only if it fits without evicting anything, as the least recently used.
    @discardableResult
    public mutating func insertIfRoom(_ answer: CachedAnswer, for key: CacheKey, at instant: Int64) -> Bool {
        self.core.insertIfRoom(answer, for: key, at: instant)
    }

    /// Whether an entry of `cost` bytes fits without evicting anything.
    public func hasRoom(for cost: Int) -> Bool {
        self.core.hasRoom(for: cost)
    }

    /// Removes every entry of `customerId` (all request shapes).
    public mutating func removeAll(customerId: String) {
        self.core.removeAll(customerId: customerId)
    }

    /// The cached customer ids, each once, with the instant of its last use, most recent first.
    public func recency() -> [(customerId: String, lastUsed: Int64)] {
        self.core.recency()
    }

    /// Keys from most to least recently used.
    public var keysByRecency: [CacheKey] {
        self.core.keysByRecency
    }
}

extension CachedAnswer: CacheEntry {
    public var byteCount: Int { self.encodedEntitlements.count }
    public static var vacant: CachedAnswer { .empty(resolvedAt: 0) }
    public static var storageOffset: Int? { MemoryLayout<CachedAnswer>.offset(of: \CachedAnswer.encodedEntitlements) }

    init(encodedEntitlements: [UInt8], resolvedAt: Int64, validUntil: Int64?, logSequence: UInt64 = 0) {
        self.encodedEntitlements = encodedEntitlements
        self.resolvedAt = resolvedAt
        self.validUntil = validUntil
        self.logSequence = logSequence
    }
}
