import CEntitlementsShim

/// How the process allocates, set once at start-up by `serve`.
public enum ProcessMemory {
    /// Makes every thread allocate from one malloc arena (glibc), unless the environment
    /// sets `MALLOC_ARENA_MAX`; returns whether it did. Call it before other threads start.
    ///
    /// The cache's answers are made on one thread (warm-up, cold-read threads) and evicted
    /// on another (the resolver's loop). With glibc's arena per thread, a freed answer goes
    /// back to the arena it came from, which the freeing thread never allocates from, so
    /// both arenas keep their high-water mark: measured at p5 (5M customers, 64 MiB cache),
    /// a peak of 144 MiB with an arena per thread, 103 MiB with one (benchmarks/README.md).
    /// The per-thread caches of small blocks (glibc's tcache) still spare the arena's lock
    /// on most allocations.
    @discardableResult
    public static func useOneMallocArena() -> Bool {
        ent_use_one_malloc_arena() == 1
    }
}
