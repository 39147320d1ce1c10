import CEntitlementsShim

/// The cache's index from key to slot: open addressing with linear probing over one array
/// of 64-bit entries, each the key's 32-bit hash and its slot. A lookup reads one entry (a
/// cache line holds eight) and then the slot's node, where the key is compared; a
/// `Dictionary<CacheKey, Int32>` read a 32-byte key and a value from two arrays, two cache
/// lines where this reads one, and its bucket cannot be prefetched from the hash alone as
/// this one's can (``AnswerCache/prefetch(hashes:)``). Removal shifts the entries after it back
/// (no tombstones), so a probe never walks past what is gone.
///
/// The index does not hold keys: the caller confirms a candidate slot with `matches`.
/// Hashes are Swift's `Hasher` (SipHash, seeded per process), so clients choosing user ids
/// cannot aim them at one bucket.
struct SlotIndex {
    /// `hash << 32 | (slot + 1)`; 0 is an empty bucket.
    private var buckets: [UInt64] = []
    private var count = 0

    /// The hash of `key`, as the index files it.
    static func hash(_ key: CacheKey) -> UInt32 {
        var hasher = Hasher()
        key.hash(into: &hasher)
        return UInt32(truncatingIfNeeded: hasher.finalize())
    }

    /// The first slot filed under `hash` for which `matches` holds.
    func first(hash: UInt32, matches: (Int32) -> Bool) -> Int32? {
        guard !self.buckets.isEmpty else {
            return nil
        }
        let mask = self.buckets.count - 1
        var bucket = Int(hash) & mask
        while true {
            let entry = self.buckets[bucket]
            if entry == 0 {
                return nil
            }
            if UInt32(truncatingIfNeeded: entry >> 32) == hash {
                let slot = Int32(truncatingIfNeeded: entry) - 1
                if matches(slot) {
                    return slot
                }
            }
            bucket = (bucket + 1) & mask
        }
    }

    /// Starts loading the bucket where a probe for `hash` begins.
    func prefetch(hash: UInt32) {
        guard !self.buckets.isEmpty else {
            return
        }
        self.buckets.withUnsafeBufferPointer { ent_prefetch($0.baseAddress! + (Int(hash) & ($0.count - 1))) }
    }

    /// Files `slot` under `hash` (the caller has made sure its key is not filed already).
    mutating func insert(_ slot: Int32, hash: UInt32) {
        precondition(slot >= 0)
        if (self.count + 1) * 2 > self.buckets.count {
            self.grow()
        }
        self.place(UInt64(hash) << 32 | UInt64(slot + 1))
        self.count += 1
    }

    /// Removes `slot`, filed under `hash`.
    mutating func remove(_ slot: Int32, hash: UInt32) {
        let wanted = UInt64(hash) << 32 | UInt64(slot + 1)
        let mask = self.buckets.count - 1
        var hole = Int(hash) & mask
        while self.buckets[hole] != wanted {
            precondition(self.buckets[hole] != 0, "slot \(slot) is not in the cache's index")
            hole = (hole + 1) & mask
        }
        // Backward shift: an entry after the hole moves into it unless its own bucket lies
        // cyclically in (hole, here], where a probe for it starts after the hole anyway.
        var here = hole
        while true {
            here = (here + 1) & mask
            let entry = self.buckets[here]
            if entry == 0 {
                break
            }
            let home = Int(truncatingIfNeeded: entry >> 32) & mask
            let stays = hole <= here ? (hole < home && home <= here) : (hole < home || home <= here)
            if !stays {
                self.buckets[hole] = entry
                hole = here
            }
        }
        self.buckets[hole] = 0
        self.count -= 1
    }

    private mutating func place(_ entry: UInt64) {
        let mask = self.buckets.count - 1
        var bucket = Int(truncatingIfNeeded: entry >> 32) & mask
        while self.buckets[bucket] != 0 {
            bucket = (bucket + 1) & mask
        }
        self.buckets[bucket] = entry
    }

    /// Doubles the buckets (at most half of them are used), refiling every entry by its hash.
    private mutating func grow() {
        let old = self.buckets
        self.buckets = [UInt64](repeating: 0, count: max(16, old.count * 2))
        for entry in old where entry != 0 {
            self.place(entry)
        }
    }
}
