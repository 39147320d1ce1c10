import Testing

@testable import EntitlementsCache

@Suite("frequency sketch")
struct FrequencySketchTests {
    /// Distinct, well-spread 32-bit hashes, as the cache's index makes them.
    static func hashes(_ count: Int, seed: UInt64) -> [UInt32] {
        var state = seed
        return (0..<count).map { _ in
            state = state &* 6_364_136_223_846_793_005 &+ 1_442_695_040_888_963_407
            return UInt32(truncatingIfNeeded: state >> 29)
        }
    }

    @Test("a key's estimate counts its recordings up to 15, and is 0 for a key never recorded in a sparse sketch")
    func counts() {
        var sketch = FrequencySketch(words: 4_096)
        let keys = Self.hashes(20, seed: 1)
        for (index, hash) in keys.enumerated() {
            for _ in 0..<index {
                sketch.record(hash)
            }
        }
        for (index, hash) in keys.enumerated() {
            #expect(sketch.frequency(hash) == min(index, 15))
        }
        let unseen = Self.hashes(1_000, seed: 2).filter { sketch.frequency($0) > 0 }.count
        #expect(unseen <= 5)
    }

    @Test("never an underestimate, however crowded: collisions only raise counters")
    func neverUnder() {
        // 16 blocks for 400 keys: about 25 keys share each block, so most of a key's
        // counters are shared. 800 recordings, fewer than the sample size (1,280): no halving.
        var sketch = FrequencySketch(words: 128)
        let keys = Self.hashes(400, seed: 3)
        for (index, hash) in keys.enumerated() {
            for _ in 0..<(index % 5) {
                sketch.record(hash)
            }
        }
        var over = 0
        for (index, hash) in keys.enumerated() {
            #expect(sketch.frequency(hash) >= index % 5)
            over += sketch.frequency(hash) > index % 5 ? 1 : 0
        }
        // Crowded indeed: some estimates are over (else this would test nothing).
        #expect(over > 0)
    }

    @Test("after sampleSize recordings every counter is halved, so old popularity fades")
    func aging() {
        var sketch = FrequencySketch(words: 512)
        let old = Self.hashes(1, seed: 4)[0]
        for _ in 0..<12 {
            sketch.record(old)
        }
        #expect(sketch.frequency(old) == 12)
        // Other keys until just before the halving: 12 of the sample are already spent.
        let others = Self.hashes(sketch.sampleSize, seed: 5)
        for hash in others.prefix(sketch.sampleSize - 13) {
            sketch.record(hash)
        }
        #expect(sketch.frequency(old) >= 12)
        sketch.record(others.last!)
        #expect(sketch.frequency(old) >= 6 && sketch.frequency(old) < 12)
    }

    @Test("a copy counts on its own and keeps the original's counts (its blocks' start is fixed, not recomputed from where its copy lives)")
    func copies() {
        var original = FrequencySketch(words: 512)
        let keys = Self.hashes(100, seed: 6)
        for (index, hash) in keys.enumerated() {
            for _ in 0..<(index % 7) {
                original.record(hash)
            }
        }
        let counts = keys.map(original.frequency)
        var copy = original
        copy.record(keys[0])  // the copy gets storage of its own here
        #expect(keys.map(original.frequency) == counts)
        #expect(keys.dropFirst().map(copy.frequency) == Array(counts.dropFirst()))
        #expect(copy.frequency(keys[0]) == counts[0] + 1)
    }

    @Test("sized for the cache's entries: a word each, at least 512, a power of two; halved every ten words' worth")
    func sizing() {
        // One block more, for alignment to a cache line.
        #expect(FrequencySketch(entries: 0).tableBytes == (512 + 8) * 8)
        #expect(FrequencySketch(entries: 80_000).tableBytes == (131_072 + 8) * 8)
        #expect(FrequencySketch(entries: 131_072).tableBytes == (131_072 + 8) * 8)
        #expect(FrequencySketch(entries: 80_000).sampleSize == 1_310_720)
    }
}
