import CEntitlementsShim

/// A least-recently-used cache of answers, bounded by bytes. O(1) lookup, insertion and
/// eviction: an open-addressing index from key to slot (``SlotIndex``), and a doubly
/// linked list threaded through an array of slots by index (no per-entry objects, no
/// reference counting on the list).
///
/// A value type with no locks: each resolver actor owns one shard (see
/// ``shardIndex(for:shardCount:)``), so a shard is only ever touched by its owner.
///
/// An entry is served only while it is exact: for instants in [resolvedAt, validUntil).
/// A lookup at or after validUntil removes the entry (an expiration) and misses.
public struct LRUCache: Sendable {
    /// What the cache has done since it was created.
    public struct Statistics: Sendable, Hashable {
        /// Lookups answered from the cache.
        public var hits: UInt64 = 0
        /// Lookups not answered (absent, expired, or asked for an instant before resolution).
        public var misses: UInt64 = 0
        /// Entries removed because their validUntil had passed.
        public var expirations: UInt64 = 0
        /// Entries removed to make room.
        public var evictions: UInt64 = 0
        /// Entries inserted or replaced.
        public var insertions: UInt64 = 0
        /// Entries whose memory ``LRUCache/prefetch(hashes:)`` asked the CPU to load.
        public var prefetched: UInt64 = 0
        /// Bytes accounted to current entries (see ``LRUCache/entryOverhead``).
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
            sum.insertions += b.insertions
            sum.prefetched += b.prefetched
            sum.bytes += b.bytes
            sum.entries += b.entries
            return sum
        }
    }

    /// Bytes charged per entry on top of its strings and encoded answer: the index slot,
    /// the list node, and the heap headers of the key's and the answer's storage.
    /// Measured, not guessed: see docs/snapshot-format.md, "Cache memory".
    public static let entryOverhead = 192

    private struct Node {
        var key: CacheKey
        var answer: CachedAnswer
        var cost: Int
        var lastUsed: Int64
        var previous: Int32
        var next: Int32
        /// The next entry of the same customer (another request shape); -1 at the end.
        var nextOfCustomer: Int32 = -1
        /// The key's hash in ``SlotIndex`` (kept to find the entry again on removal).
        var hash: UInt32 = 0
        /// The answer's byte count, for ``LRUCache/prefetch(hashes:)``.
        var answerBytes: Int32 = 0
    }

    /// Where in an entry the reference to its answer's byte storage is.
    private static let answerStorageOffset = MemoryLayout<Node>.offset(of: \Node.answer)! + MemoryLayout<CachedAnswer>.offset(of: \CachedAnswer.encodedEntitlements)!

    /// Where in an entry its recency links are.
    private static let linksOffset = MemoryLayout<Node>.offset(of: \Node.previous)!

    /// The most bytes the entries may account for.
    public let budgetBytes: Int
    public private(set) var statistics = Statistics()

    private var slots = SlotIndex()
    private var nodes: [Node] = []
    private var freeSlots: [Int32] = []
    /// Each cached customer's first entry; the rest follow through `nextOfCustomer`. Lets
    /// a write remove a customer's entries without scanning the cache.
    private var firstOfCustomer: [String: Int32] = [:]
    /// Most recently used; -1 when empty.
    private var head: Int32 = -1
    /// Least recently used; -1 when empty.
    private var tail: Int32 = -1

    /// Creates an empty cache that holds at most `budgetBytes` of entries.
    public init(budgetBytes: Int) {
        precondition(budgetBytes >= 0)
        self.budgetBytes = budgetBytes
    }

    /// The shard that owns `customerId` among `shardCount` shards: stable across runs, so
    /// that a customer always goes to the same resolver actor.
    public static func shardIndex(for customerId: String, shardCount: Int) -> Int {
        precondition(shardCount > 0)
        // One shard owns everything: no need to hash (`serve --resolvers 1`, every check).
        return shardCount == 1 ? 0 : Int(KeyHash.hash(customerId) % UInt64(shardCount))
    }

    /// The hash a lookup of `key` files it under: for a caller that looks a key up more
    /// than once (``prefetch(hashes:)`` then ``answer(for:hash:at:)``) and hashes it once.
    public static func hash(of key: CacheKey) -> UInt32 {
        SlotIndex.hash(key)
    }

    /// What an entry for `key` and `answer` costs against the budget.
    public static func cost(of key: CacheKey, _ answer: CachedAnswer) -> Int {
        key.byteCount + answer.encodedEntitlements.count + Self.entryOverhead
    }

    /// The answer for `key` if it is exact at `instant`; marks it most recently used.
    public mutating func answer(for key: CacheKey, at instant: Int64) -> CachedAnswer? {
        self.answer(for: key, hash: SlotIndex.hash(key), at: instant)
    }

    /// ``answer(for:at:)`` for a key already hashed: `hash` must be ``hash(of:)`` of `key`.
    public mutating func answer(for key: CacheKey, hash: UInt32, at instant: Int64) -> CachedAnswer? {
        guard let slot = self.slot(of: key, hash: hash) else {
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
        self.moveToFront(slot)
        self.statistics.hits += 1
        return answer
    }

    /// Starts loading, for every key hashed in `hashes` (``hash(of:)``, or
    /// ``CachePeek/hash``), the memory its lookup will read (the index bucket, the entry,
    /// the answer's bytes, the links of the entry's neighbours in the recency list, which a
    /// hit writes), without waiting: a batch calls this before looking its keys up one by
    /// one, so that their memory misses overlap instead of coming one after another.
    /// Changes nothing; a lookup after it answers exactly as without it. Allocates nothing.
    public mutating func prefetch(hashes: UnsafeBufferPointer<UInt32>) {
        guard hashes.count > 1, !self.nodes.isEmpty else {
            return
        }
        // Each pass reads what the one before it brought in, and starts the next misses.
        for hash in hashes {
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
                    // Every cache line the entry spans (it is not aligned to them).
                    let entry = UnsafeRawPointer(nodes.baseAddress! + Int(slot))
                    ent_prefetch(entry)
                    ent_prefetch(entry + 64)
                    ent_prefetch(entry + MemoryLayout<Node>.size - 1)
                }
                // The neighbours' links, then the answer's bytes. Their storage's address is
                // read as a word from the entry, so that no retain is made (a write to that
                // storage, which would wait for it); the addresses are only prefetched, never
                // read, so a wrong guess about the array's layout costs speed, not safety.
                for slot in candidates[..<found] {
                    let node = nodes.baseAddress! + Int(slot)
                    Self.prefetchNeighbours(of: node, in: nodes)
                    let entry = UnsafeRawPointer(node)
                    guard let storage = UnsafeRawPointer(bitPattern: entry.load(fromByteOffset: Self.answerStorageOffset, as: UInt.self)) else {
                        continue
                    }
                    let end = Self.arrayHeaderBytes + min(Int(nodes[Int(slot)].answerBytes), 4_096)
                    for line in stride(from: 0, to: end, by: 64) {
                        ent_prefetch(storage + line)
                    }
                }
            }
        }
        self.statistics.prefetched += UInt64(found)
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
    private static let arrayHeaderBytes = 32

    /// Stores `answer` for `key` (replacing any entry) as the most recently used, evicting
    /// the least recently used entries until it fits. Returns false, storing nothing, if
    /// the entry alone exceeds the budget.
    @discardableResult
    public mutating func insert(_ answer: CachedAnswer, for key: CacheKey, at instant: Int64) -> Bool {
        self.insert(answer, for: key, at: instant, evicting: true, asLeastRecent: false)
    }

    /// Stores `answer` only if it fits without evicting anything, as the least recently
    /// used entry: warm-up inserts the hot list hottest first this way, so that the cache's
    /// recency order is the hot list's. Returns whether it was stored.
    @discardableResult
    public mutating func insertIfRoom(_ answer: CachedAnswer, for key: CacheKey, at instant: Int64) -> Bool {
        self.insert(answer, for: key, at: instant, evicting: false, asLeastRecent: true)
    }

    /// Whether an entry of `cost` bytes fits without evicting anything.
    public func hasRoom(for cost: Int) -> Bool {
        self.statistics.bytes + cost <= self.budgetBytes
    }

    /// Removes every entry of `customerId` (all request shapes), e.g. after a write:
    /// O(the customer's entries).
    public mutating func removeAll(customerId: String) {
        while let slot = self.firstOfCustomer[customerId] {
            self.remove(slot: slot)
        }
    }

    /// Customer ids from most to least recently used, each once, with the instant of its
    /// last use: what a new snapshot's hot list is made of.
    public func recency() -> [(customerId: String, lastUsed: Int64)] {
        var seen = Set<String>()
        var result: [(String, Int64)] = []
        var slot = self.head
        while slot >= 0 {
            let node = self.nodes[Int(slot)]
            if seen.insert(node.key.customerId).inserted {
                result.append((node.key.customerId, node.lastUsed))
            }
            slot = node.next
        }
        return result
    }

    /// Keys from most to least recently used.
    public var keysByRecency: [CacheKey] {
        var keys: [CacheKey] = []
        var slot = self.head
        while slot >= 0 {
            keys.append(self.nodes[Int(slot)].key)
            slot = self.nodes[Int(slot)].next
        }
        return keys
    }

    // MARK: The list

    /// The slot holding `key`, whose ``SlotIndex/hash(_:)`` is `hash`.
    private func slot(of key: CacheKey, hash: UInt32) -> Int32? {
        self.slots.first(hash: hash) { self.nodes[Int($0)].key == key }
    }

    private mutating func insert(_ answer: CachedAnswer, for key: CacheKey, at instant: Int64, evicting: Bool, asLeastRecent: Bool) -> Bool {
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
            self.remove(slot: existing)
        }
        while !self.hasRoom(for: cost), self.tail >= 0 {
            self.remove(slot: self.tail)
            self.statistics.evictions += 1
        }
        let node = Node(
            key: key, answer: answer, cost: cost, lastUsed: instant, previous: -1, next: -1,
            hash: hash, answerBytes: Int32(clamping: answer.encodedEntitlements.count)
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
        if asLeastRecent {
            self.linkAtBack(slot)
        } else {
            self.linkAtFront(slot)
        }
        self.statistics.bytes += cost
        self.statistics.entries += 1
        self.statistics.insertions += 1
        return true
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
        self.nodes[Int(slot)].answer = CachedAnswer.empty(resolvedAt: 0)
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

    private mutating func moveToFront(_ slot: Int32) {
        guard self.head != slot else {
            return
        }
        self.unlink(slot)
        self.linkAtFront(slot)
    }

    private mutating func linkAtFront(_ slot: Int32) {
        self.nodes[Int(slot)].previous = -1
        self.nodes[Int(slot)].next = self.head
        if self.head >= 0 {
            self.nodes[Int(self.head)].previous = slot
        }
        self.head = slot
        if self.tail < 0 {
            self.tail = slot
        }
    }

    private mutating func linkAtBack(_ slot: Int32) {
        self.nodes[Int(slot)].next = -1
        self.nodes[Int(slot)].previous = self.tail
        if self.tail >= 0 {
            self.nodes[Int(self.tail)].next = slot
        }
        self.tail = slot
        if self.head < 0 {
            self.head = slot
        }
    }

    private mutating func unlink(_ slot: Int32) {
        let previous = self.nodes[Int(slot)].previous
        let next = self.nodes[Int(slot)].next
        if previous >= 0 {
            self.nodes[Int(previous)].next = next
        } else {
            self.head = next
        }
        if next >= 0 {
            self.nodes[Int(next)].previous = previous
        } else {
            self.tail = previous
        }
        self.nodes[Int(slot)].previous = -1
        self.nodes[Int(slot)].next = -1
    }
}

extension CachedAnswer {
    init(encodedEntitlements: [UInt8], resolvedAt: Int64, validUntil: Int64?, logSequence: UInt64 = 0) {
        self.encodedEntitlements = encodedEntitlements
        self.resolvedAt = resolvedAt
        self.validUntil = validUntil
        self.logSequence = logSequence
    }
}
