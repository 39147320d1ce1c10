public import EntitlementsMessages
import EntitlementsResolver
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
}

/// What a resolver made of a query.
enum CheckOutcome: Sendable {
    /// The answer; `customerId` is nil for an unknown user.
    case answer(CachedAnswer, customerId: String?, fromCache: Bool)
    /// The user id is an alias of a customer another resolver owns: ask it by the
    /// customer id. (It reads the record itself: a record read here could be older than
    /// a write the owner has already been told about.)
    case forward(shard: Int, customerId: String)
    /// The deadline passed before the work started.
    case deadlineExceeded
    /// The snapshot could not be read (corruption): INTERNAL, with the reason.
    case failed(String)
    /// Not run: the server stopped without finishing its drain, or the connection that
    /// asked has closed (see ``ConnectionScope``). UNAVAILABLE, if anyone still reads it.
    case stopping
}

extension CheckOutcome {
    var isForward: Bool {
        if case .forward = self { true } else { false }
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

    init(shard: Int, shardCount: Int, eventLoop: any EventLoop, store: CustomerStore, resolver: EntitlementResolver, cache: LRUCache) {
        self.eventLoop = eventLoop
        self.core = .makeBoxSendingValue(
            ResolverCore(shard: shard, shardCount: shardCount, store: store, resolver: resolver, cache: cache),
            eventLoop: eventLoop
        )
    }

    /// The cache's counters.
    public var cacheStatistics: LRUCache.Statistics { self.core.value.cache.statistics }

    /// This resolver's customers by last use, for a new snapshot's hot list.
    func recency() -> [(customerId: String, lastUsed: Int64)] {
        self.core.value.cache.recency()
    }
}

/// A resolver's cache shard, alias memory and rules: confined to its resolver's event loop.
final class ResolverCore {
    let shard: Int
    let shardCount: Int
    private let store: CustomerStore
    private let resolver: EntitlementResolver
    private(set) var cache: LRUCache
    /// alias -> canonical id, learnt from store reads, so that a repeated alias check
    /// costs no store read. Bounded: cleared when it reaches `aliasLimit`. A write that
    /// moves or removes an alias makes every resolver forget it before it is acknowledged.
    private var aliases: [String: String] = [:]
    private let aliasLimit = 100_000

    init(shard: Int, shardCount: Int, store: CustomerStore, resolver: EntitlementResolver, cache: LRUCache) {
        self.shard = shard
        self.shardCount = shardCount
        self.store = store
        self.resolver = resolver
        self.cache = cache
    }

    func check(_ query: CheckQuery) -> CheckOutcome {
        if let deadline = query.deadline, NIODeadline.now() >= deadline {
            return .deadlineExceeded
        }
        let canonical = self.aliases[query.userId] ?? query.userId
        let owner = LRUCache.shardIndex(for: canonical, shardCount: self.shardCount)
        if owner == self.shard {
            let key = CacheKey(customerId: canonical, environment: query.environment, entitlementIds: query.entitlementIds)
            if let answer = self.cache.answer(for: key, at: query.instant) {
                return .answer(answer, customerId: canonical, fromCache: true)
            }
        } else {
            // An alias learnt earlier, of another resolver's customer: no store read here.
            return .forward(shard: owner, customerId: canonical)
        }
        let record: CustomerRecord?
        let sequence: UInt64
        do {
            (record, sequence) = try self.store.customerRead(for: query.userId)
        } catch {
            return .failed("\(error)")
        }
        guard let record, let customerId = record.id else {
            return self.unknownUser(query, sequence: sequence)
        }
        if customerId != query.userId {
            if self.aliases.count >= self.aliasLimit {
                self.aliases.removeAll(keepingCapacity: true)
            }
            self.aliases[query.userId] = customerId
        }
        let recordOwner = LRUCache.shardIndex(for: customerId, shardCount: self.shardCount)
        guard recordOwner == self.shard else {
            return .forward(shard: recordOwner, customerId: customerId)
        }
        if customerId == query.userId {
            // The cache was asked above, under this very key.
            return self.resolveAndCache(record, sequence: sequence, customerId: customerId, query)
        }
        return self.answer(for: record, sequence: sequence, customerId: customerId, query)
    }

    /// The answer for this resolver's customer `customerId`, asked for by an alias another
    /// resolver knows.
    func check(_ query: CheckQuery, customerId: String) -> CheckOutcome {
        if let deadline = query.deadline, NIODeadline.now() >= deadline {
            return .deadlineExceeded
        }
        let key = CacheKey(customerId: customerId, environment: query.environment, entitlementIds: query.entitlementIds)
        if let answer = self.cache.answer(for: key, at: query.instant) {
            return .answer(answer, customerId: customerId, fromCache: true)
        }
        let record: CustomerRecord?
        let sequence: UInt64
        do {
            (record, sequence) = try self.store.customerRead(for: customerId)
        } catch {
            return .failed("\(error)")
        }
        guard let record else {
            return self.unknownUser(query, sequence: sequence)
        }
        return self.resolveAndCache(record, sequence: sequence, customerId: customerId, query)
    }

    /// Forgets what a write changed, before the write is acknowledged: the cached answers
    /// of `customerIds` (those this resolver owns) and the learnt `aliases`.
    func invalidate(customerIds: some Sequence<String>, aliases: some Sequence<String>) {
        for id in customerIds {
            self.cache.removeAll(customerId: id)
        }
        for alias in aliases {
            self.aliases[alias] = nil
        }
    }

    /// The cached answer for the customer, or a freshly resolved one.
    private func answer(for record: CustomerRecord, sequence: UInt64, customerId: String, _ query: CheckQuery) -> CheckOutcome {
        let key = CacheKey(customerId: customerId, environment: query.environment, entitlementIds: query.entitlementIds)
        if let answer = self.cache.answer(for: key, at: query.instant) {
            return .answer(answer, customerId: customerId, fromCache: true)
        }
        return self.resolveAndCache(record, sequence: sequence, customerId: customerId, query)
    }

    /// Resolves, encodes and caches an answer the cache does not have (each miss is asked
    /// of the cache once, so its statistics count it once).
    private func resolveAndCache(_ record: CustomerRecord, sequence: UInt64, customerId: String, _ query: CheckQuery) -> CheckOutcome {
        let key = CacheKey(customerId: customerId, environment: query.environment, entitlementIds: query.entitlementIds)
        let resolution = self.resolver.resolve(record, at: query.instant, environment: query.environment, entitlementIds: query.entitlementIds)
        do {
            let answer = try CachedAnswer(resolution, resolvedAt: query.instant, logSequence: sequence)
            self.cache.insert(answer, for: key, at: query.instant)
            return .answer(answer, customerId: customerId, fromCache: false)
        } catch {
            return .failed("cannot encode the answer for \(customerId): \(error)")
        }
    }

    /// Unknown users get an empty answer, valid forever (until a write creates them).
    /// Not cached: ids that do not exist are unbounded, and the index says "absent" fast.
    private func unknownUser(_ query: CheckQuery, sequence: UInt64) -> CheckOutcome {
        .answer(CachedAnswer.empty(resolvedAt: query.instant, logSequence: sequence), customerId: nil, fromCache: false)
    }
}

/// Whether the connection a check came from is still open. Work queued on another loop for
/// a connection that has closed is skipped (answered ``CheckOutcome/stopping``, which
/// nobody reads): a client that times out and goes away does not leave its checks behind.
public final class ConnectionScope: Sendable {
    private let closed = Atomic<Bool>(false)
    /// Who the caller is (its address, or `unix`), for logs.
    public let peer: String

    public init(peer: String = "") {
        self.peer = peer
    }

    public var isClosed: Bool { self.closed.load(ordering: .relaxed) }

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

    /// Creates `count` resolvers over `store`, each with `cacheBytes / count` of cache,
    /// and warms their caches from the snapshot's hot list at `instant`.
    public init(
        count: Int,
        eventLoops: [any EventLoop],
        store: CustomerStore,
        cacheBytes: Int,
        warmAt instant: Int64
    ) throws {
        precondition(count > 0 && !eventLoops.isEmpty)
        let resolver = EntitlementResolver(catalog: store.catalog)
        var shards = (0..<count).map { _ in LRUCache(budgetBytes: cacheBytes / count) }
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
                shard: index,
                shardCount: count,
                eventLoop: eventLoops[index % eventLoops.count],
                store: store,
                resolver: resolver,
                cache: cache
            )
        }
        self.store = store
        self.resolver = resolver
    }

    /// What warm-up did at start.
    public let warmup: CacheWarmer.Report

    /// The resolver that first handles `userId` (the owner of the customer if it is a
    /// customer id; an alias is forwarded once its customer is known).
    func resolver(for userId: String) -> ResolverActor {
        self.resolvers[LRUCache.shardIndex(for: userId, shardCount: self.resolvers.count)]
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
            case .forward(let shard, let customerId):
                self.check(query, owner: shard, customerId: customerId, for: scope, completing: promise)
            default:
                promise.succeed(outcome)
            }
        }
    }

    /// Asks resolver `owner` about its own customer `customerId` (a forwarded alias); it
    /// never forwards again, so an alias costs at most one extra hop.
    func check(
        _ query: CheckQuery,
        owner: Int,
        customerId: String,
        for scope: ConnectionScope? = nil,
        completing promise: EventLoopPromise<CheckOutcome>
    ) {
        let resolver = self.resolvers[owner]
        Self.onLoop(of: resolver) {
            guard !self.skips(scope) else {
                promise.succeed(.stopping)
                return
            }
            promise.succeed(resolver.core.value.check(query, customerId: customerId))
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
            byShard[LRUCache.shardIndex(for: query.userId, shardCount: self.resolvers.count)].append(index)
        }
        // Shares for other loops go first, so that they run while this loop does its own.
        let nonEmpty = byShard.enumerated().filter { !$0.element.isEmpty }
        let shares = nonEmpty.filter { self.resolvers[$0.offset].eventLoop !== loop } + nonEmpty.filter { self.resolvers[$0.offset].eventLoop === loop }
        let parts = shares.map { shard, indices -> EventLoopFuture<[CheckOutcome]> in
            let part = loop.makePromise(of: [CheckOutcome].self)
            let resolver = self.resolvers[shard]
            Self.onLoop(of: resolver) {
                guard !self.skips(scope) else {
                    part.succeed(Array(repeating: .stopping, count: indices.count))
                    return
                }
                let core = resolver.core.value
                part.succeed(indices.map { core.check(queries[$0]) })
            }
            return part.futureResult
        }
        EventLoopFuture.whenAllSucceed(parts, on: loop).assumeIsolated().whenSuccess { results in
            var outcomes = [CheckOutcome](repeating: .stopping, count: queries.count)
            var forwards: [EventLoopFuture<(Int, CheckOutcome)>] = []
            for (share, outcomesOfShare) in zip(shares, results) {
                for (index, outcome) in zip(share.element, outcomesOfShare) {
                    if case .forward(let owner, let customerId) = outcome {
                        let forwarded = loop.makePromise(of: CheckOutcome.self)
                        self.check(queries[index], owner: owner, customerId: customerId, for: scope, completing: forwarded)
                        forwards.append(forwarded.futureResult.map { (index, $0) })
                    } else {
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

    /// Makes every resolver forget what `write` changed; the future completes when all
    /// have (the write may then be acknowledged).
    func invalidate(after write: CustomerStore.CommittedWrite, on eventLoop: any EventLoop) -> EventLoopFuture<Void> {
        let customerIds = Array(write.effect.records.keys)
        let aliases = Array(write.effect.aliases.keys)
        let done = self.resolvers.map { resolver in
            let promise = eventLoop.makePromise(of: Void.self)
            Self.onLoop(of: resolver) {
                resolver.core.value.invalidate(customerIds: customerIds, aliases: aliases)
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

/// A check the resolvers could not answer.
public struct CheckFailure: Error, CustomStringConvertible {
    public enum Reason: Sendable {
        /// The request breaks a rule the server enforces (INVALID_ARGUMENT there).
        case invalidArgument
        /// The snapshot could not be read or the answer encoded (INTERNAL there).
        case internalError
        /// The server is stopping without finishing its drain (UNAVAILABLE there).
        case unavailable
    }

    public var reason: Reason
    public var description: String
}

extension ResolverPool {
    /// Answers one CheckEntitlements with these resolvers and caches, exactly as the server
    /// does (the same validation; an alias of another resolver's customer is forwarded), and
    /// returns the encoded CheckEntitlementsResponse; a request the server would refuse with
    /// INVALID_ARGUMENT throws ``CheckFailure`` with the same message. For serving the resolvers over another transport: the
    /// gRPC peer in benchmarks/ uses it, so that only the transport differs.
    public func checkResponse(
        userId: String,
        environment: Environment = .production,
        entitlementIds: [String] = [],
        at instant: Int64
    ) async throws -> ByteBuffer {
        if let problem = Validation.problem(userId: userId, field: "user_id") ?? Validation.problem(entitlementIds: entitlementIds) {
            throw CheckFailure(reason: .invalidArgument, description: problem)
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
        case .failed(let reason):
            throw CheckFailure(reason: .internalError, description: reason)
        case .stopping:
            throw CheckFailure(reason: .unavailable, description: "the server stopped before this check ran")
        case .deadlineExceeded, .forward:
            throw CheckFailure(reason: .internalError, description: "the check was not answered")
        }
    }
}
