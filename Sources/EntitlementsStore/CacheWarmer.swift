import EntitlementsMessages
public import EntitlementsResolver

/// Fills the cache shards from a snapshot's hot list before the server reports ready.
public enum CacheWarmer {
    /// What a warm-up did.
    public struct Report: Sendable, Hashable {
        /// Hot-list customers resolved and cached.
        public var customersCached = 0
        /// Hot-list ids the snapshot no longer has (e.g. deleted customers).
        public var customersMissing = 0
        /// Hot-list customers not cached because their shard was full.
        public var customersSkipped = 0
        /// Bytes accounted to the shards afterwards.
        public var bytes = 0
        /// Whether warm-up stopped because every shard was full (otherwise: list exhausted).
        public var stoppedFull = false
    }

    /// Resolves the snapshot's hot-list customers at `instant`, hottest first, and caches
    /// each answer for the default request shape (production, all entitlements) in its
    /// shard, until the hot list or the shards' room runs out. Nothing is evicted: the
    /// hottest customers are the ones that stay, in hot-list recency order.
    public static func warm(
        _ shards: inout [LRUCache],
        from snapshot: SnapshotReader,
        resolver: EntitlementResolver,
        at instant: Int64
    ) throws -> Report {
        var report = Report()
        var full = [Bool](repeating: false, count: shards.count)
        var fullCount = 0
        for id in snapshot.hotList {
            if fullCount == shards.count {
                report.stoppedFull = true
                break
            }
            let shard = LRUCache.shardIndex(for: id, shardCount: shards.count)
            guard !full[shard] else {
                report.customersSkipped += 1
                continue
            }
            guard let record = try snapshot.customer(for: id), let customerId = record.id else {
                report.customersMissing += 1
                continue
            }
            let answer = try CachedAnswer(resolver.resolve(record, at: instant), resolvedAt: instant)
            let key = CacheKey(customerId: customerId)
            if shards[shard].insertIfRoom(answer, for: key, at: instant) {
                report.customersCached += 1
                // No entry is smaller than the overhead: a shard with less room is full.
                if !shards[shard].hasRoom(for: LRUCache.entryOverhead) {
                    full[shard] = true
                    fullCount += 1
                }
            } else {
                report.customersSkipped += 1
                full[shard] = true
                fullCount += 1
            }
        }
        if fullCount == shards.count {
            report.stoppedFull = true
        }
        report.bytes = shards.reduce(0) { $0 + $1.statistics.bytes }
        return report
    }

    /// The hot list for a new snapshot: customers of all shards by their last use, most
    /// recent first, each once.
    public static func hotList(of shards: [LRUCache], limit: Int = 1_000_000) -> [String] {
        var merged = shards.flatMap { $0.recency() }
        merged.sort { $0.lastUsed > $1.lastUsed }
        var seen = Set<String>()
        var ids: [String] = []
        for entry in merged where seen.insert(entry.customerId).inserted {
            ids.append(entry.customerId)
            if ids.count == limit { break }
        }
        return ids
    }
}
