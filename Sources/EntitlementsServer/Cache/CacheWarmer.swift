public import EntitlementsCache
public import EntitlementsMessages
public import EntitlementsResolver
public import EntitlementsStore

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

    /// Resolves the hot-list customers at `instant`, hottest first, and caches
    /// each answer for the default request shape (production, all entitlements) in its
    /// shard, until the hot list or the shards' room runs out. Nothing is evicted: the
    /// hottest customers are the ones that stay, in hot-list recency order.
    public static func warm(
        _ shards: inout [AnswerCache],
        from snapshot: SnapshotReader,
        resolver: EntitlementResolver,
        at instant: Int64
    ) throws -> Report {
        try Self.warm(&shards, hotList: snapshot.hotList, lookup: { try snapshot.customer(for: $0) }, resolver: resolver, at: instant)
    }

    /// Warms `shards` from `hotList`, reading each customer's current record with `lookup`
    /// (the snapshot with the log's writes applied, for a server with a data directory).
    public static func warm(
        _ shards: inout [AnswerCache],
        hotList: [String],
        lookup: (String) throws -> CustomerRecord?,
        resolver: EntitlementResolver,
        at instant: Int64,
        logSequence: UInt64 = 0
    ) throws -> Report {
        var report = Report()
        var full = [Bool](repeating: false, count: shards.count)
        var fullCount = 0
        for id in hotList {
            if fullCount == shards.count {
                report.stoppedFull = true
                break
            }
            let shard = AnswerCache.shardIndex(for: id, shardCount: shards.count)
            guard !full[shard] else {
                report.customersSkipped += 1
                continue
            }
            guard let record = try lookup(id), let customerId = record.id else {
                report.customersMissing += 1
                continue
            }
            let answer = try CachedAnswer(resolver.resolve(record, at: instant), resolvedAt: instant, logSequence: logSequence)
            let key = CacheKey(customerId: customerId)
            if shards[shard].insertIfRoom(answer, for: key, at: instant) {
                report.customersCached += 1
                // No entry is smaller than the overhead: a shard with less room is full.
                if !shards[shard].hasRoom(for: AnswerCache.entryOverhead) {
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
    public static func hotList(of shards: [AnswerCache], limit: Int = 1_000_000) -> [String] {
        Self.hotList(merging: shards.map { $0.recency() }, limit: limit)
    }

    /// Merges the shards' ``AnswerCache/recency()`` lists into one hot list.
    public static func hotList(merging recencies: [[(customerId: String, lastUsed: Int64)]], limit: Int = 1_000_000) -> [String] {
        var merged = recencies.flatMap { $0 }
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
