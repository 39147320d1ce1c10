import CEntitlementsShim

/// How often keys were asked for, approximately and in little memory: the frequency
/// estimate behind the cache's admission policy (``AnswerCache/Policy/tinyLFU``).
///
/// A count-min sketch of 4-bit counters (TinyLFU: Einziger, Friedman and Manes, "TinyLFU:
/// A Highly Efficient Cache Admission Policy", ACM Transactions on Storage, 2017). A key
/// has four counters, all in one 64-byte block of the table, aligned to a cache line, so
/// that recording it or estimating it touches one cache line; its estimate is the least of
/// the four (others' collisions only ever raise a counter). Counters stop at 15. After `sampleSize`
/// recordings every counter is halved, so that what was popular long ago fades and a
/// newly popular key can win against it.
///
/// Keys come in as the cache index's 32-bit hash (``SlotIndex/hash(_:)``, seeded per
/// process), so a client cannot choose ids that collide in the sketch on purpose.
struct FrequencySketch {
    /// 16 counters of 4 bits per word; 8 words (64 bytes) per block. One block more than
    /// the blocks in use: they start at word `start`, the first on a 64-byte boundary when
    /// the table was made (fixed then: a copy of the table elsewhere is only misaligned).
    private var table: [UInt64]
    private let start: Int
    private let blockMask: UInt64
    /// Recordings since the last halving.
    private var additions = 0
    /// Recordings between halvings: ten per word of the table, as many as the keys it is
    /// sized for (the paper's "sample" of W accesses, about ten times the cache's entries).
    let sampleSize: Int

    /// A sketch of `words` 64-bit words, rounded up to a power of two and to one block.
    init(words: Int) {
        var count = 8
        while count < words {
            count <<= 1
        }
        self.table = [UInt64](repeating: 0, count: count + 8)
        self.start = self.table.withUnsafeBufferPointer { table in
            (8 - (Int(bitPattern: table.baseAddress!) >> 3) & 7) & 7
        }
        self.blockMask = UInt64(count / 8 - 1)
        self.sampleSize = 10 * count
    }

    /// The sketch for a cache of about `entries` entries: a word (16 counters, four keys'
    /// worth) per entry, at least 512 words (4 KiB), as Caffeine sizes its own: few enough
    /// keys share all four counters with a popular one for its estimates to hold.
    init(entries: Int) {
        self.init(words: min(max(entries, 512), 1 << 24))
    }

    /// Bytes the table takes (its spare block for alignment included).
    var tableBytes: Int {
        self.table.count * MemoryLayout<UInt64>.size
    }

    /// Notes one request for the key hashed `hash`.
    mutating func record(_ hash: UInt32) {
        let (block, spread) = self.place(hash)
        var added = false
        self.table.withUnsafeMutableBufferPointer { table in
            let block = self.start + block
            for row in 0..<4 {
                let (word, shift) = Self.counter(row, block: block, spread: spread)
                if (table[word] >> shift) & 0xF < 15 {
                    table[word] += 1 << shift
                    added = true
                }
            }
        }
        guard added else {
            return
        }
        self.additions += 1
        if self.additions >= self.sampleSize {
            self.halve()
        }
    }

    /// How many requests for the key hashed `hash` were noted (since halvings, halved),
    /// never fewer than there were; at most 15.
    func frequency(_ hash: UInt32) -> Int {
        let (block, spread) = self.place(hash)
        return self.table.withUnsafeBufferPointer { table in
            let block = self.start + block
            var least: UInt64 = 15
            for row in 0..<4 {
                let (word, shift) = Self.counter(row, block: block, spread: spread)
                least = min(least, (table[word] >> shift) & 0xF)
            }
            return Int(least)
        }
    }

    /// Starts loading the key's block into the CPU's cache, without waiting: for a batch
    /// that records several keys (``AnswerCache/prefetch(hashes:)``).
    func prefetch(_ hash: UInt32) {
        self.table.withUnsafeBufferPointer { table in
            ent_prefetch(UnsafeRawPointer(table.baseAddress! + self.start + self.place(hash).block))
        }
    }

    /// Every counter halved (rounded down), and the count of additions with them.
    private mutating func halve() {
        self.table.withUnsafeMutableBufferPointer { table in
            for index in table.indices {
                table[index] = (table[index] >> 1) & 0x7777_7777_7777_7777
            }
        }
        self.additions /= 2
    }

    /// The key's block (the index of its first word) and the bits that choose its counters
    /// in it. The hash is spread by a multiplication so that its every bit moves the block.
    private func place(_ hash: UInt32) -> (block: Int, spread: UInt64) {
        let spread = (UInt64(hash) | UInt64(hash) << 32) &* 0x9E37_79B9_7F4A_7C15
        return (Int((spread >> 32) & self.blockMask) << 3, spread)
    }

    /// Counter `row` (0 to 3) of a key: in word 2 row or 2 row + 1 of its block (one bit of
    /// `spread` says which), at one of the word's 16 nibbles (four more bits).
    private static func counter(_ row: Int, block: Int, spread: UInt64) -> (word: Int, shift: UInt64) {
        let bits = spread >> UInt64(5 * row)
        return (block + 2 * row + Int(bits & 1), ((bits >> 1) & 0xF) << 2)
    }
}
