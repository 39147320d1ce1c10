public import EntitlementsMessages
import EntitlementsResolver
public import EntitlementsCache
public import EntitlementsStore
public import NIOCore
import Synchronization

/// One check, as a resolver needs it: the requested user id (a customer id or an alias)
/// and the request's shape.
struct CheckQuery: Sendable {
    var userId: String
    var environment: Environment
    var entitlementIds: [String]
    /// The evaluation instant (Unix milliseconds).
    var instant: Int64
    /// Work not started by then is abandoned.
    var deadline: NIODeadline?

    /// The cache key of this query for `customerId` (the canonical id, or the id as asked).
    func key(customerId: String) -> CacheKey {
        CacheKey(customerId: customerId, environment: self.environment, entitlementIds: self.entitlementIds)
    }
}

/// Where a check's answer came from.
public enum AnswerSource: UInt8, Sendable {
    /// The answer cache.
    case cache
    /// Resolved from the customer's record, read on the resolver's loop (in memory).
    case memory
    /// Resolved from the customer's record, read from the disk on a cold-read thread.
    case disk
}

/// What a resolver made of a query.
enum CheckOutcome: Sendable {
    /// The answer; `customerId` is nil for an unknown user.
    case answer(CachedAnswer, customerId: String?, source: AnswerSource)
    /// The user id is an alias of a customer another resolver owns: ask it. The alias
    /// named `customerId` at every log sequence in `named` (as far as the asker knows):
    /// the owner answers from its cache only an answer read within those sequences, or
    /// else reads the alias again (``ResolverCore/check(_:customerId:named:)``).
    case forward(shard: Int, customerId: String, named: ClosedRange<UInt64>)
    /// Not in the cache, nor in memory: the customer must be read from the disk
    /// (``ResolverPool/readCold(_:customerId:on:completing:)``, on the cold-read threads).
    /// Never returned when there are no cold-read threads.
    case cold
    /// The cold-read queue is full: RESOURCE_EXHAUSTED, with the reason.
    case busy(String)
    /// The deadline passed before the work started.
    case deadlineExceeded
    /// The snapshot could not be read (corruption): INTERNAL, with the reason.
    case failed(String)
    /// Not run: the server stopped without finishing its drain, or the connection that
    /// asked has closed (see ``ConnectionScope``). UNAVAILABLE, if anyone still reads it.
    case stopping
}

extension CheckOutcome {
    /// Whether another step must run first: a forward to the customer's resolver, or a
    /// cold read.
    var isUnfinished: Bool {
        switch self {
        case .forward, .cold: true
        default: false
        }
    }
}

/// A resolver: owns one cache shard and answers the checks of the customers that hash
/// to it (docs/architecture.md). Its executor is an event loop, and its state lives in a
/// ``ResolverCore`` bound to that loop: the server calls the core synchronously when already
/// on that loop, and with one `EventLoop.execute` hop otherwise: no Task, no extra thread
/// hop per request. (Not through `Actor.assumeIsolated`: that cost two heap allocations per
/// call, measured with benchmarks/mallocs.sh.)
///
/// Checks run one at a time on the loop, and a miss reads the snapshot and resolves without
/// suspending, so concurrent misses for one customer are computed once: the second finds
/// the first's answer in the cache.
public actor ResolverActor {
    /// The event loop this actor runs on.
    public nonisolated let eventLoop: any EventLoop
    public nonisolated var unownedExecutor: UnownedSerialExecutor {
        self.eventLoop.executor.asUnownedSerialExecutor()
    }

    /// The state and the rules, usable only on `eventLoop` (checked on each access).
    nonisolated let core: NIOLoopBoundBox<ResolverCore>

    init(reader: ColdReader, inline: Bool, eventLoop: any EventLoop, cache: AnswerCache, told: UInt64) {
        self.eventLoop = eventLoop
        self.core = .makeBoxSendingValue(
            ResolverCore(reader: reader, inline: inline, cache: cache, told: told),
            eventLoop: eventLoop
        )
    }

    /// The cache's counters.
    public var cacheStatistics: AnswerCache.Statistics { self.core.value.cache.statistics }

    /// This resolver's customers by last use, for a new snapshot's hot list.
    func recency() -> [(customerId: String, lastUsed: Int64)] {
        self.core.value.cache.recency()
    }
}

/// A resolver's cache shard, alias memory and cold reads under way: confined to its
/// resolver's event loop.
///
/// A miss is read here with reads that do not wait for the disk; one that would wait is read
/// on the cold-read threads instead (docs/architecture.md, "Cold reads"), unless reads are
/// `inline`. Either way what the read found comes back here (``absorb(_:for:current:)``) to
/// be cached and learnt, and checks for the same key that arrive while a cold read is
/// under way wait for it instead of reading again.
final class ResolverCore {
    let reader: ColdReader
    var shard: Int { self.reader.shard }
    var shardCount: Int { self.reader.shardCount }
    /// Misses are read on this loop, waiting for the disk if need be (no cold-read threads).
    let inline: Bool
    private(set) var cache: AnswerCache
    /// What a store read taught: the alias named `customerId` at log sequence `since`.
    struct LearntAlias {
        var customerId: String
        var since: UInt64
    }

    /// alias -> canonical id, learnt from store reads, so that a repeated alias check
    /// costs no store read. Bounded: cleared when it reaches `aliasLimit`. A write that
    /// moves or removes an alias makes every resolver forget it before it is acknowledged.
    private var aliases: [String: LearntAlias] = [:]
    private let aliasLimit = 100_000
    /// Counts the writes this resolver was told of: a cold read that started in an earlier
    /// epoch may hold a record older than an acknowledged write.
    private(set) var epoch: UInt64 = 0
    /// The log sequence of the last write this resolver was told of (writes are told in
    /// order). A read at a later sequence is answered but neither cached nor learnt from:
    /// the resolver has not yet forgotten what the writes between changed, so keeping it
    /// would mix what it reflects with what it does not. Hence every answer cached here
    /// holds from its `logSequence` through `told`, and every learnt alias from its
    /// `since` through `told`: what lets a forwarded alias be answered from the cache.
    private(set) var told: UInt64
    /// Cold reads under way, by the key they were asked under.
    var pendingReads: [CacheKey: PendingRead] = [:]

    init(reader: ColdReader, inline: Bool, cache: AnswerCache, told: UInt64) {
        self.reader = reader
        self.inline = inline
        self.cache = cache
        self.told = told
    }

    func check(_ query: CheckQuery) -> CheckOutcome {
        let learnt = self.learnt(query.userId)
        let canonical = learnt?.customerId ?? query.userId
        if let elsewhere = self.unanswerable(query, canonical: canonical, since: learnt?.since) {
            return elsewhere
        }
        let key = query.key(customerId: canonical)
        return self.lookUp(query, canonical: canonical, key: key, hash: AnswerCache.hash(of: key))
    }

    /// Checks `queries` at `indices` (a batch's share), in that order, as ``check(_:)``
    /// would one by one; `cold` is called at once with the index of each that must be read
    /// on the cold-read threads (so that a later check of the same key waits for that read).
    /// Each key is made and hashed once, and the memory all the lookups will read is
    /// prefetched before the first (``AnswerCache/prefetch(hashes:)``), so that the batch's
    /// memory misses overlap.
    func check(_ queries: [CheckQuery], at indices: [Int], cold: (Int) -> Void) -> [CheckOutcome] {
        let keys = indices.map { index in
            let canonical = self.learnt(queries[index].userId)?.customerId ?? queries[index].userId
            return (canonical: canonical, key: queries[index].key(customerId: canonical))
        }
        return withUnsafeTemporaryAllocation(of: UInt32.self, capacity: keys.count) { hashes in
            for (position, entry) in keys.enumerated() {
                hashes.initializeElement(at: position, to: AnswerCache.hash(of: entry.key))
            }
            self.cache.prefetch(hashes: UnsafeBufferPointer(hashes))
            return indices.indices.map { position in
                let query = queries[indices[position]]
                var (canonical, key, hash) = (keys[position].canonical, keys[position].key, hashes[position])
                let learnt = self.learnt(query.userId)
                if canonical == query.userId, let learnt {
                    // An alias that a read earlier in this share taught: asked by its
                    // customer, as a check after that read would be.
                    canonical = learnt.customerId
                    key = query.key(customerId: canonical)
                    hash = AnswerCache.hash(of: key)
                }
                let outcome = self.unanswerable(query, canonical: canonical, since: learnt?.since) ?? self.lookUp(query, canonical: canonical, key: key, hash: hash)
                if case .cold = outcome {
                    cold(indices[position])
                }
                return outcome
            }
        }
    }

    /// What a read taught about `userId` if it is an alias. (With no alias learnt, as when
    /// every check asks by customer id, the id is not even hashed.)
    private func learnt(_ userId: String) -> LearntAlias? {
        self.aliases.isEmpty ? nil : self.aliases[userId]
    }

    /// What a check gets before any lookup: deadline exceeded, or a forward for an alias
    /// (learnt at `since`) of another resolver's customer; nil if this resolver answers it.
    private func unanswerable(_ query: CheckQuery, canonical: String, since: UInt64?) -> CheckOutcome? {
        if let deadline = query.deadline, NIODeadline.now() >= deadline {
            return .deadlineExceeded
        }
        let owner = AnswerCache.shardIndex(for: canonical, shardCount: self.shardCount)
        guard owner == self.shard else {
            // An alias learnt earlier, of another resolver's customer: no store read here.
            // It has named that customer from `since` through every write told here.
            let since = since ?? self.told
            return .forward(shard: owner, customerId: canonical, named: since...max(since, self.told))
        }
        return nil
    }

    /// The cache's answer for `key` (whose hash is `hash`), or a read by the id as asked,
    /// alias or not (so that an alias that moved is followed).
    private func lookUp(_ query: CheckQuery, canonical: String, key: CacheKey, hash: UInt32) -> CheckOutcome {
        if let answer = self.cache.answer(for: key, hash: hash, at: query.instant) {
            return .answer(answer, customerId: canonical, source: .cache)
        }
        return self.readHere(query)
    }

    /// The prefetch of ``check(_:at:cold:)`` for single checks, from their encoded requests:
    /// those of this resolver's shard. Allocates nothing.
    func prefetch(_ peeks: UnsafeBufferPointer<CachePeek>) {
        withUnsafeTemporaryAllocation(of: UInt32.self, capacity: peeks.count) { hashes in
            var mine = 0
            for peek in peeks where Int(peek.shardHash % UInt64(self.shardCount)) == self.shard {
                hashes.initializeElement(at: mine, to: peek.hash)
                mine += 1
            }
            self.cache.prefetch(hashes: UnsafeBufferPointer(rebasing: hashes[..<mine]))
        }
    }

    /// The answer for this resolver's customer `customerId`, asked for by an alias that
    /// named it at every log sequence in `named` (what another resolver knew).
    ///
    /// The cached answer of `customerId` holds from its sequence through the last write
    /// told here; if that span meets `named`, the alias named the customer when the answer
    /// was read, and the answer is served. Otherwise the alias is read again: it may have
    /// moved, and a record read now with an alias memory from before would mix two moments
    /// (an answer naming a customer that no longer held the alias at the answer's sequence).
    func check(_ query: CheckQuery, customerId: String, named: ClosedRange<UInt64>) -> CheckOutcome {
        if let deadline = query.deadline, NIODeadline.now() >= deadline {
            return .deadlineExceeded
        }
        let key = query.key(customerId: customerId)
        if let answer = self.cache.answer(for: key, hash: AnswerCache.hash(of: key), at: query.instant),
            query.userId == customerId || (answer.logSequence <= named.upperBound && named.lowerBound <= self.told)
        {
            return .answer(answer, customerId: customerId, source: .cache)
        }
        return self.readHere(query)
    }

    /// A miss read on this loop, by the id as asked: at once if the snapshot's pages are in
    /// memory (or if there are no cold-read threads, waiting for them); else `.cold`. A read
    /// of the same id already under way on the threads is waited for rather than raced.
    private func readHere(_ query: CheckQuery) -> CheckOutcome {
        if !self.pendingReads.isEmpty, self.pendingReads[query.key(customerId: query.userId)] != nil {
            return .cold
        }
        guard let read = self.reader.read(query, mayWait: self.inline) else {
            return .cold
        }
        self.absorb(read, for: query, current: true)
        return self.outcome(of: read, for: query)
    }

    /// Takes in what a cold read of `query` found: learns the alias and caches the answer,
    /// unless the read is not `current` (a write may have changed the customer since it
    /// started) or was made at a sequence past the last write told here (see ``told``).
    func absorb(_ read: ColdRead, for query: CheckQuery, current: Bool) {
        guard current else {
            return
        }
        let customerId: String
        let sequence: UInt64
        switch read {
        case .resolved(let answer, let id):
            (customerId, sequence) = (id, answer.logSequence)
        case .elsewhere(_, let id, let at):
            (customerId, sequence) = (id, at)
        case .unknown, .failed, .abandoned:
            // Unknown users are not cached: ids that do not exist are unbounded, and the
            // index says "absent" fast.
            return
        }
        guard sequence <= self.told else {
            return
        }
        if customerId != query.userId {
            if self.aliases.count >= self.aliasLimit {
                self.aliases.removeAll(keepingCapacity: true)
            }
            self.aliases[query.userId] = LearntAlias(customerId: customerId, since: sequence)
        }
        if case .resolved(let answer, _) = read {
            self.cache.insert(answer, for: query.key(customerId: customerId), at: query.instant)
        }
    }

    /// What `read` answers `query`: the check that started it or one that waited for it.
    func outcome(of read: ColdRead, for query: CheckQuery) -> CheckOutcome {
        switch read {
        case .unknown(let sequence):
            // Empty, valid forever (until a write creates the user).
            return .answer(CachedAnswer.empty(resolvedAt: query.instant, logSequence: sequence), customerId: nil, source: .memory)
        case .elsewhere(let owner, let customerId, let sequence):
            return .forward(shard: owner, customerId: customerId, named: sequence...sequence)
        case .resolved(let answer, let customerId):
            guard answer.isValid(at: query.instant) else {
                // A waiter asking about another instant than the answer holds for: it asks
                // again, as a forward to this very resolver.
                return .forward(shard: self.shard, customerId: customerId, named: answer.logSequence...answer.logSequence)
            }
            return .answer(answer, customerId: customerId, source: .memory)
        case .failed(let reason):
            return .failed(reason)
        case .abandoned:
            return .stopping
        }
    }

    /// Forgets what a write changed, before the write is acknowledged: the cached answers
    /// of `customerIds` (those this resolver owns) and the learnt `aliases`, by the write at
    /// log sequence `sequence`. Cold reads under way are not joined any more, nor cached
    /// when they finish: they may have read the records before the write.
    func invalidate(customerIds: some Sequence<String>, aliases: some Sequence<String>, sequence: UInt64) {
        self.told = max(self.told, sequence)
        for id in customerIds {
            self.cache.removeAll(customerId: id)
        }
        for alias in aliases {
            self.aliases[alias] = nil
        }
        self.epoch &+= 1
        if !self.pendingReads.isEmpty {
            self.pendingReads.removeAll()
        }
    }
}

/// Whether the connection a check came from is still open. Work queued on another loop for
/// a connection that has closed is skipped (answered ``CheckOutcome/stopping``, which
/// nobody reads): a client that times out and goes away does not leave its checks behind.
///
/// A scope may belong to another (one call's, within its connection's): it is closed when
/// either is, so that a call its client cancels is skipped like one whose connection closed.
public final class ConnectionScope: Sendable {
    private let closed = Atomic<Bool>(false)
    private let parent: ConnectionScope?
    /// Who the caller is (its address, or `unix`), for logs.
    public let peer: String

    public init(peer: String = "") {
        self.peer = peer
        self.parent = nil
    }

    /// One call's scope within `parent`'s.
    public init(within parent: ConnectionScope) {
        self.peer = parent.peer
        self.parent = parent
    }

    public var isClosed: Bool { self.closed.load(ordering: .relaxed) || self.parent?.isClosed == true }

    /// The caller has gone: work still queued for it is skipped.
    public func close() {
        self.closed.store(true, ordering: .relaxed)
    }
}

/// The resolvers, one per event loop of the server's group (or more, round-robin over
/// the loops), and the routing of a customer to its resolver.
public final class ResolverPool: Sendable {
    /// The resolvers, indexed by shard.
    public let resolvers: [ResolverActor]
    /// The customers every resolver reads.
    public let store: CustomerStore
    /// The entitlement rules, over the snapshot's catalog.
    let resolver: EntitlementResolver
    /// Set when the server stops without finishing its drain: checks still queued on a
    /// loop are then answered ``CheckOutcome/stopping`` instead of resolved, so that the
    /// loops empty at once rather than after seconds of work nobody will read.
    private let abandoned = Atomic<Bool>(false)
    /// The threads that read misses, and the bound on their queue.
    let coldReads: ColdReads

    /// Creates `count` resolvers over `store`, each with `cacheBytes / count` of cache
    /// kept by `cachePolicy`, and warms their caches from the snapshot's hot list at
    /// `instant`. Misses are read as `coldReads` says; call ``shutdown()`` when done if it
    /// has threads.
    public init(
        count: Int,
        eventLoops: [any EventLoop],
        store: CustomerStore,
        cacheBytes: Int,
        cachePolicy: AnswerCache.Policy = .tinyLFU,
        warmAt instant: Int64,
        coldReads: ColdReadSettings = .inline
    ) throws {
        precondition(count > 0 && !eventLoops.isEmpty)
        let resolver = EntitlementResolver(catalog: store.catalog)
        var shards = (0..<count).map { _ in AnswerCache(budgetBytes: cacheBytes / count, policy: cachePolicy) }
        // Before the server listens: no write can land while the caches warm.
        self.warmup = try CacheWarmer.warm(
            &shards,
            hotList: store.snapshot.hotList,
            lookup: store.customer(for:),
            resolver: resolver,
            at: instant,
            logSequence: store.committedSequence
        )
        self.resolvers = shards.enumerated().map { index, cache in
            ResolverActor(
                reader: ColdReader(shard: index, shardCount: count, store: store, resolver: resolver, disk: coldReads.disk),
                inline: coldReads.threads == 0,
                eventLoop: eventLoops[index % eventLoops.count],
                cache: cache,
                told: store.committedSequence
            )
        }
        self.store = store
        self.resolver = resolver
        self.coldReads = ColdReads(coldReads)
    }

    /// Stops the cold-read threads (after the reads they hold).
    public func shutdown() async {
        await self.coldReads.shutdown()
    }

    /// What warm-up did at start.
    public let warmup: CacheWarmer.Report

    /// The resolver that first handles `userId` (the owner of the customer if it is a
    /// customer id; an alias is forwarded once its customer is known).
    func resolver(for userId: String) -> ResolverActor {
        self.resolvers[AnswerCache.shardIndex(for: userId, shardCount: self.resolvers.count)]
    }

    /// Runs `query` on its resolver and, for an alias of another resolver's customer, on
    /// that one too; completes `promise` with the outcome.
    func check(_ query: CheckQuery, for scope: ConnectionScope? = nil, completing promise: EventLoopPromise<CheckOutcome>) {
        let first = self.resolver(for: query.userId)
        Self.onLoop(of: first) {
            guard !self.skips(scope) else {
                promise.succeed(.stopping)
                return
            }
            let outcome = first.core.value.check(query)
            switch outcome {
            case .forward(let shard, let customerId, let named):
                self.check(query, owner: shard, customerId: customerId, named: named, for: scope, completing: promise)
            case .cold:
                self.readCold(query, on: first, completing: promise)
            default:
                promise.succeed(outcome)
            }
        }
    }

    /// Asks resolver `owner` about its own customer `customerId` (a forwarded alias that
    /// named it at the sequences `named`). An alias costs one extra hop, and one more each
    /// time it is found to have moved to another resolver's customer meanwhile.
    func check(
        _ query: CheckQuery,
        owner: Int,
        customerId: String,
        named: ClosedRange<UInt64>,
        for scope: ConnectionScope? = nil,
        completing promise: EventLoopPromise<CheckOutcome>
    ) {
        let resolver = self.resolvers[owner]
        Self.onLoop(of: resolver) {
            guard !self.skips(scope) else {
                promise.succeed(.stopping)
                return
            }
            switch resolver.core.value.check(query, customerId: customerId, named: named) {
            case .cold:
                self.readCold(query, on: resolver, completing: promise)
            case .forward(let owner, let customerId, let named):
                self.check(query, owner: owner, customerId: customerId, named: named, for: scope, completing: promise)
            case let outcome:
                promise.succeed(outcome)
            }
        }
    }

    /// Reads a miss of `resolver` (on its loop) on a cold-read thread, and completes
    /// `promise` when it is read and resolved: the hits this loop answers meanwhile do not
    /// wait for it. A read of the same key already under way is joined, not repeated.
    func readCold(_ query: CheckQuery, on resolver: ResolverActor, completing promise: EventLoopPromise<CheckOutcome>) {
        resolver.eventLoop.preconditionInEventLoop()
        let core = resolver.core.value
        let key = query.key(customerId: query.userId)
        if let pending = core.pendingReads[key] {
            pending.waiters.append((query, promise))
            return
        }
        guard self.coldReads.reserve() else {
            promise.succeed(.busy(self.coldReads.queueFullMessage))
            return
        }
        let pending = PendingRead(epoch: core.epoch, first: query, promise: promise)
        core.pendingReads[key] = pending
        let reader = core.reader
        let bound = NIOLoopBound(pending, eventLoop: resolver.eventLoop)
        self.coldReads.run(
            { self.abandoned.load(ordering: .relaxed) ? .abandoned : reader.read(query)! },
            thenOn: resolver.eventLoop
        ) { read in
            let pending = bound.value
            let core = resolver.core.value
            if core.pendingReads[key] === pending {
                core.pendingReads[key] = nil
            }
            core.absorb(read, for: query, current: core.epoch == pending.epoch)
            for (waiting, promise) in pending.waiters {
                switch core.outcome(of: read, for: waiting) {
                case .forward(let owner, let customerId, let named):
                    self.check(waiting, owner: owner, customerId: customerId, named: named, completing: promise)
                case .answer(let answer, let customerId, _):
                    promise.succeed(.answer(answer, customerId: customerId, source: .disk))
                case let outcome:
                    promise.succeed(outcome)
                }
            }
        }
    }

    /// Answers every check not yet run, and every later one, ``CheckOutcome/stopping``:
    /// for a server that closes its connections without finishing the drain.
    func abandonQueuedChecks() {
        self.abandoned.store(true, ordering: .relaxed)
    }

    /// Whether a check about to run is not worth running: the server stopped without its
    /// drain, or the connection that asked has closed.
    private func skips(_ scope: ConnectionScope?) -> Bool {
        self.abandoned.load(ordering: .relaxed) || scope?.isClosed == true
    }

    /// Runs a batch's queries with one task per resolver involved, not one per user, and
    /// completes `promise` (on `loop`) with the outcomes in the queries' order. A resolver
    /// on `loop` itself runs its share at once; an alias owned by another resolver costs
    /// that user one more hop.
    func checkBatch(
        _ queries: [CheckQuery],
        for scope: ConnectionScope? = nil,
        on loop: any EventLoop,
        completing promise: EventLoopPromise<[CheckOutcome]>
    ) {
        var byShard = [[Int]](repeating: [], count: self.resolvers.count)
        for (index, query) in queries.enumerated() {
            byShard[AnswerCache.shardIndex(for: query.userId, shardCount: self.resolvers.count)].append(index)
        }
        // Shares for other loops go first, so that they run while this loop does its own.
        let nonEmpty = byShard.enumerated().filter { !$0.element.isEmpty }
        let shares = nonEmpty.filter { self.resolvers[$0.offset].eventLoop !== loop } + nonEmpty.filter { self.resolvers[$0.offset].eventLoop === loop }
        // Each share's outcomes, and the cold reads it started (their answers come later).
        typealias Share = (outcomes: [CheckOutcome], cold: [EventLoopFuture<(Int, CheckOutcome)>])
        let parts = shares.map { shard, indices -> EventLoopFuture<Share> in
            let part = loop.makePromise(of: Share.self)
            let resolver = self.resolvers[shard]
            Self.onLoop(of: resolver) {
                guard !self.skips(scope) else {
                    part.succeed((Array(repeating: .stopping, count: indices.count), []))
                    return
                }
                var cold: [EventLoopFuture<(Int, CheckOutcome)>] = []
                let outcomes = resolver.core.value.check(queries, at: indices) { index in
                    let read = loop.makePromise(of: CheckOutcome.self)
                    self.readCold(queries[index], on: resolver, completing: read)
                    cold.append(read.futureResult.map { (index, $0) })
                }
                part.succeed((outcomes, cold))
            }
            return part.futureResult
        }
        EventLoopFuture.whenAllSucceed(parts, on: loop).assumeIsolated().whenSuccess { results in
            var outcomes = [CheckOutcome](repeating: .stopping, count: queries.count)
            var forwards: [EventLoopFuture<(Int, CheckOutcome)>] = []
            for (share, result) in zip(shares, results) {
                forwards += result.cold
                for (index, outcome) in zip(share.element, result.outcomes) {
                    switch outcome {
                    case .forward(let owner, let customerId, let named):
                        let forwarded = loop.makePromise(of: CheckOutcome.self)
                        self.check(queries[index], owner: owner, customerId: customerId, named: named, for: scope, completing: forwarded)
                        forwards.append(forwarded.futureResult.map { (index, $0) })
                    case .cold:
                        break  // being read: among `forwards`
                    default:
                        outcomes[index] = outcome
                    }
                }
            }
            guard !forwards.isEmpty else {
                promise.succeed(outcomes)
                return
            }
            EventLoopFuture.whenAllSucceed(forwards, on: loop).assumeIsolated().whenSuccess { answered in
                for (index, outcome) in answered {
                    outcomes[index] = outcome
                }
                promise.succeed(outcomes)
            }
        }
    }

    /// Prefetches the cache entries of checks about to run on the current event loop, in
    /// the shards of the resolvers on it: the others' caches belong to their loops.
    func prefetch(_ peeks: UnsafeBufferPointer<CachePeek>) {
        for resolver in self.resolvers where resolver.eventLoop.inEventLoop {
            resolver.core.value.prefetch(peeks)
        }
    }

    /// Makes every resolver forget what `write` changed; the future completes when all
    /// have (the write may then be acknowledged).
    func invalidate(after write: CustomerStore.CommittedWrite, on eventLoop: any EventLoop) -> EventLoopFuture<Void> {
        let customerIds = Array(write.effect.records.keys)
        let aliases = Array(write.effect.aliases.keys)
        let done = self.resolvers.map { resolver in
            let promise = eventLoop.makePromise(of: Void.self)
            Self.onLoop(of: resolver) {
                resolver.core.value.invalidate(customerIds: customerIds, aliases: aliases, sequence: write.sequence)
                promise.succeed()
            }
            return promise.futureResult
        }
        return EventLoopFuture.andAllSucceed(done, on: eventLoop)
    }

    /// Every resolver's customers by last use, merged: a new snapshot's hot list.
    func hotList(limit: Int = 1_000_000) async -> [String] {
        var recencies: [[(customerId: String, lastUsed: Int64)]] = []
        for resolver in self.resolvers {
            recencies.append(await resolver.recency())
        }
        return CacheWarmer.hotList(merging: recencies, limit: limit)
    }

    /// Runs `body` on the resolver's event loop: now if already there, else one hop.
    static func onLoop(of resolver: ResolverActor, _ body: @escaping @Sendable () -> Void) {
        if resolver.eventLoop.inEventLoop {
            body()
        } else {
            resolver.eventLoop.execute(body)
        }
    }
}

extension ResolverPool {
    /// Answers one CheckEntitlements with these resolvers and caches, exactly as the server
    /// does (the same validation; an alias of another resolver's customer is forwarded), and
    /// returns the encoded CheckEntitlementsResponse; a request the server would refuse with
    /// INVALID_ARGUMENT throws the same ``ServiceError`` (status and message), as does any
    /// other failure. For serving the resolvers over another transport: the
    /// gRPC peer in benchmarks/ uses it, so that only the transport differs.
    public func checkResponse(
        userId: String,
        environment: Environment = .production,
        entitlementIds: [String] = [],
        at instant: Int64
    ) async throws -> ByteBuffer {
        if let problem = Validation.problem(userId: userId, field: "user_id") ?? Validation.problem(entitlementIds: entitlementIds) {
            throw ServiceError(.invalidArgument, problem)
        }
        let promise = self.resolver(for: userId).eventLoop.makePromise(of: CheckOutcome.self)
        self.check(
            CheckQuery(userId: userId, environment: environment, entitlementIds: entitlementIds, instant: instant, deadline: nil),
            completing: promise
        )
        switch try await promise.futureResult.get() {
        case .answer(let answer, let customerId, _):
            var buffer = ByteBuffer()
            answer.writeResponse(userId: userId, customerId: customerId, requestDate: instant, into: &buffer)
            return buffer
        case let outcome:
            throw outcome.failure(userId: nil, batch: false)
        }
    }
}
