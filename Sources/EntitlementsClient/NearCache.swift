import EntitlementsCache
import EntitlementsMessages
import Metrics
import NIOCore
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The near-cache of ``EntitlementsClient`` (``EntitlementsClient/Configuration/nearCache``):
/// answers kept in the client and served without a round trip, by the rules of
/// docs/PROTOCOL.md, "Keeping answers".
public struct NearCacheConfiguration: Sendable {
    /// What the kept answers may take, in bytes (each charged about four times its size on
    /// the wire, plus the cache's per-entry overhead).
    public var budgetBytes: Int
    /// Stale-if-error: when the server cannot be reached (UNAVAILABLE or
    /// DEADLINE_EXCEEDED, which also count as a lost watch), answer from a kept answer,
    /// still before its validUntil, marked with `stale_for_ms` (how long since the
    /// near-cache lost its watch), for at most this long after the watch was lost; past it,
    /// the call fails as it would without the cache. nil (the default): never.
    public var staleIfErrorFor: Duration?
    /// How often the watch's connection is PINGed, and how long its PONG may take: a PONG
    /// not back within it counts as a lost watch. A connection can die without either
    /// side's kernel noticing (a partition, a server that hangs), and a watch on it then
    /// tells nothing while looking connected; with this, no kept answer is served more than
    /// about twice this after the server was last heard from. Default 1 s (a 24-byte frame
    /// each way a second). A PONG not back in time also closes that connection (its calls
    /// fail UNAVAILABLE; the next opens a new one). nil, or not positive: no PING, and only
    /// a closed connection or a failed check shows the watch lost.
    public var watchLiveness: Duration?

    public init(budgetBytes: Int = 32 << 20, staleIfErrorFor: Duration? = nil, watchLiveness: Duration? = .seconds(1)) {
        self.budgetBytes = budgetBytes
        self.staleIfErrorFor = staleIfErrorFor
        self.watchLiveness = watchLiveness
    }
}

/// What the near-cache has done since the client was made.
public struct NearCacheStatistics: Sendable, Hashable {
    /// Checks answered from kept answers.
    public var hits: UInt64 = 0
    /// Checks of production answers that went to the server (nothing kept, past
    /// validUntil, the watch down, a min_log_sequence the kept answer does not reach).
    public var misses: UInt64 = 0
    /// Kept answers forgotten because a watch event named them, or because a new watch
    /// started after the old one was lost.
    public var invalidations: UInt64 = 0
    /// Checks answered from a kept answer, marked stale, because the server could not be
    /// reached (``NearCacheConfiguration/staleIfErrorFor``).
    public var staleAnswers: UInt64 = 0
    /// Watches started (the first, and one after each loss).
    public var watchesStarted: UInt64 = 0
    /// Answers kept now, and what they are charged.
    public var entries: Int = 0
    public var bytes: Int = 0
    /// Whether the watch that keeps them current is connected.
    public var watching: Bool = false

    public init() {}
}

/// The near-cache: a ``ResponseCache`` (the server's Window TinyLFU, for decoded answers)
/// behind a lock, and one WatchEntitlements stream of every production customer that
/// forgets what changed. Safe to share across tasks; a hit takes the lock once and
/// allocates nothing.
///
/// Production answers only: a sandbox check always goes to the server (an all-customers
/// watch follows one environment, and sandbox traffic is test traffic).
///
/// Why an answer it keeps is current (docs/PROTOCOL.md, "Keeping answers"): the watch
/// starts from S, the `log_sequence` of the first answer kept in its epoch, so every write
/// after S reaches it. An answer is kept only if it was served after S (its own
/// `log_sequence` is at least S, or its request left after the answer that set S arrived),
/// and if no event that names its user id or customer arrived while its request was in
/// flight (a ring of the names recent events carried; an answer whose flight outlasted the
/// ring is not kept). When the watch is lost (it ends, or its connection does not answer a
/// PING within ``NearCacheConfiguration/watchLiveness``) nothing is served; the next answer
/// from the server forgets everything kept and starts a new epoch with a new watch.
final class NearCache: Sendable {
    /// Taken before a request leaves: where the near-cache stood, to judge its answer by.
    struct Ticket: Sendable {
        let epoch: UInt64
        /// Whether this epoch's watch had its start S then (the answer is served after S).
        let watchStarted: Bool
        /// Events applied before the request left.
        let events: UInt64
    }

    private struct State {
        var cache: ResponseCache
        /// customer id -> the other user ids (aliases) whose answers are kept for it.
        var aliasKeys: [String: Set<String>] = [:]
        /// Bumped each time everything kept is forgotten for a new watch.
        var epoch: UInt64 = 0
        /// S, where this epoch's watch starts; nil: none yet (nothing kept).
        var watchFrom: UInt64?
        /// The watch has sent its request: kept answers may be served.
        var live = false
        /// The watch ended: nothing is served, and the next answer from the server forgets
        /// everything and starts a new epoch.
        var lost = false
        /// When the kept answers' watch was lost (monotonic ns); nil while it holds.
        var lostAt: UInt64?
        /// A watch from below this was refused (FAILED_PRECONDITION: older than the
        /// server's snapshot): the next starts from a later answer.
        var lowestStart: UInt64 = 0
        /// Watches in a row that ended within a second, and when the next may start
        /// (monotonic ns): a server that refuses watches is not asked again per check.
        var shortWatches = 0
        var nextWatchAt: UInt64 = 0
        var watchStartedAt: UInt64 = 0
        /// The names (customer ids and aliases) the last events carried, as hashes, with
        /// the count of events applied when each arrived.
        var ringHashes = [Int](repeating: 0, count: NearCache.ringCapacity)
        var ringEvents = [UInt64](repeating: 0, count: NearCache.ringCapacity)
        var ringWritten = 0
        var events: UInt64 = 0
        var statistics = NearCacheStatistics()
        var watchTask: Task<Void, Never>?
        var closed = false
    }

    static let ringCapacity = 4096

    let configuration: NearCacheConfiguration
    private let state: Mutex<State>
    private let hitCounter = Counter(label: "entitlements_client_near_cache_hits_total")
    private let missCounter = Counter(label: "entitlements_client_near_cache_misses_total")
    private let invalidationCounter = Counter(label: "entitlements_client_near_cache_invalidations_total")
    private let staleCounter = Counter(label: "entitlements_client_near_cache_stale_answers_total")

    init(configuration: NearCacheConfiguration) {
        self.configuration = configuration
        self.state = Mutex(State(cache: ResponseCache(budgetBytes: configuration.budgetBytes)))
    }

    /// The client's clock, in Unix milliseconds (what validUntil is compared with): the
    /// server's `WallClock`, which lives in EntitlementsStore, a module the client does
    /// not link.
    static func now() -> Int64 {
        var time = timespec()
        clock_gettime(CLOCK_REALTIME, &time)
        return Int64(time.tv_sec) * 1000 + Int64(time.tv_nsec) / 1_000_000
    }

    /// A clock that only moves forward, in nanoseconds (what stale-if-error's bound is
    /// measured with: a wall clock set back must not extend it).
    static func monotonic() -> UInt64 {
        NIODeadline.now().uptimeNanoseconds
    }

    /// Whether `request` may be answered from kept answers: a production check of now, not
    /// explained.
    /// (An id the server would refuse goes to it, for its INVALID_ARGUMENT.)
    static func accepts(_ request: CheckEntitlementsRequest) -> Bool {
        request.at == nil && !request.explain && request.userId != nil
            && (request.environment == .production || request.environment == .unspecified)
            && request.entitlementIds.allSatisfy { IdRule.problem($0) == nil }
    }

    private static func key(_ userId: String) -> CacheKey {
        CacheKey(customerId: userId, environment: .production)
    }

    /// The kept answer to `request` at `now`, if it may be served: the watch is connected,
    /// the answer is before its validUntil and at least as fresh as `min_log_sequence`.
    func lookup(_ request: CheckEntitlementsRequest, now: Int64) -> CheckEntitlementsResponse? {
        let key = Self.key(request.userId ?? "")
        let kept = self.state.withLock { state -> CheckEntitlementsResponse? in
            guard state.live, !state.lost, let kept = state.cache.response(for: key, at: now), request.minLogSequence <= kept.logSequence else {
                state.statistics.misses += 1
                return nil
            }
            state.statistics.hits += 1
            return kept.response
        }
        guard var response = kept else {
            self.missCounter.increment()
            return nil
        }
        self.hitCounter.increment()
        response.requestDate = now
        Self.filter(&response, request.entitlementIds)
        return response
    }

    /// Where the near-cache stands as a request leaves.
    func ticket() -> Ticket {
        self.state.withLock { state in
            Ticket(epoch: state.epoch, watchStarted: state.watchFrom != nil && !state.lost, events: state.events)
        }
    }

    /// The server could not be reached: the watch cannot be trusted either (it may not have
    /// seen its connection go), so nothing is served until a new one starts.
    func serverUnreachable() {
        let clock = Self.monotonic()
        self.state.withLock { state in
            Self.markLost(&state, epoch: state.epoch, at: clock)
        }
    }

    /// A kept answer marked stale, when the server cannot be reached and the watch is lost:
    /// within the bound, before its validUntil; nil otherwise.
    func stale(_ request: CheckEntitlementsRequest, now: Int64) -> CheckEntitlementsResponse? {
        guard let bound = self.configuration.staleIfErrorFor else { return nil }
        let (seconds, attoseconds) = bound.components
        let boundNanoseconds = UInt64(max(0, seconds)) * 1_000_000_000 + UInt64(max(0, attoseconds / 1_000_000_000))
        let key = Self.key(request.userId ?? "")
        let elapsed = Self.monotonic()
        let found = self.state.withLock { state -> (CheckEntitlementsResponse, UInt64)? in
            guard let lostAt = state.lostAt else { return nil }
            let staleFor = elapsed &- lostAt
            guard staleFor <= boundNanoseconds, let kept = state.cache.response(for: key, at: now), request.minLogSequence <= kept.logSequence else {
                return nil
            }
            state.statistics.staleAnswers += 1
            return (kept.response, staleFor)
        }
        guard let (kept, staleFor) = found else { return nil }
        var response = kept
        self.staleCounter.increment()
        response.requestDate = now
        response.staleForMs = max(1, staleFor / 1_000_000)
        Self.filter(&response, request.entitlementIds)
        return response
    }

    /// Keeps the server's whole answer for `userId` (asked with no filter, after `ticket`)
    /// if it is provably current; starts a watch (and a new epoch, after a lost one) when
    /// none covers it.
    func keep(_ response: CheckEntitlementsResponse, userId: String, encodedBytes: Int, now: Int64, ticket: Ticket, client: EntitlementsClient) {
        // A fleet server's answer past its --max-staleness: it is behind, and its watch does
        // not say so, so nothing kept can be trusted either: the watch counts as lost.
        guard response.staleForMs == 0 else {
            self.serverUnreachable()
            return
        }
        let sequence = response.logSequence
        let clock = Self.monotonic()
        var previousWatch: Task<Void, Never>?
        self.state.withLock { state in
            guard !state.closed else { return }
            if state.lost {
                // The server answers again: what was kept under the lost watch cannot be
                // proven current. Forget it all; a new watch starts from this answer.
                guard clock >= state.nextWatchAt else { return }
                state.statistics.invalidations += UInt64(state.cache.statistics.entries)
                state.cache.removeAll()
                state.aliasKeys = [:]
                state.epoch += 1
                state.watchFrom = nil
                state.lost = false
                state.live = false
                state.lostAt = nil
                previousWatch = state.watchTask
                state.watchTask = nil
            }
            if state.watchFrom == nil {
                guard sequence >= state.lowestStart, clock >= state.nextWatchAt else { return }
                state.watchFrom = sequence
                state.watchStartedAt = clock
                state.statistics.watchesStarted += 1
                // Made and registered under the lock: a close() after it finds the task.
                state.watchTask = self.watchTask(client: client, epoch: state.epoch, from: sequence)
            }
            let servedAfterStart = sequence >= state.watchFrom! || (ticket.epoch == state.epoch && ticket.watchStarted)
            let customer = response.customerId ?? userId
            guard servedAfterStart, Self.noEventNamed(userId, customer, since: ticket.events, in: state) else { return }
            let kept = KeptResponse(response, keptAt: now, encodedBytes: encodedBytes)
            guard state.cache.insert(kept, for: Self.key(userId), at: now) else { return }
            if customer != userId {
                state.aliasKeys[customer, default: []].insert(userId)
                if state.aliasKeys.count > max(1024, 2 * state.cache.statistics.entries) {
                    Self.rebuildAliasKeys(&state)
                }
            }
        }
        previousWatch?.cancel()
    }

    /// Whether no event applied after `events` named `userId` or `customer`; false when
    /// the ring no longer reaches back that far.
    private static func noEventNamed(_ userId: String, _ customer: String, since events: UInt64, in state: State) -> Bool {
        guard state.events > events else { return true }
        let userHash = userId.hashValue
        let customerHash = customer.hashValue
        var position = state.ringWritten
        var scanned = 0
        while position > 0 {
            let index = (position - 1) % Self.ringCapacity
            if state.ringEvents[index] <= events {
                return true
            }
            if state.ringHashes[index] == userHash || state.ringHashes[index] == customerHash {
                return false
            }
            position -= 1
            scanned += 1
            if scanned == Self.ringCapacity {
                return false
            }
        }
        return true
    }

    /// The alias table again from what is kept now (entries the cache evicted leave it).
    private static func rebuildAliasKeys(_ state: inout State) {
        var aliasKeys: [String: Set<String>] = [:]
        state.cache.forEachKept { userId, kept in
            if let customer = kept.response.customerId, customer != userId {
                aliasKeys[customer, default: []].insert(userId)
            }
        }
        state.aliasKeys = aliasKeys
    }

    /// The answer to a filtered request from the whole customer's answer: the same
    /// entitlements the server would send, in its order (validUntil is the whole
    /// customer's either way).
    static func filter(_ response: inout CheckEntitlementsResponse, _ entitlementIds: [String]) {
        guard !entitlementIds.isEmpty else { return }
        response.entitlements = response.entitlements.filter { entitlementIds.contains($0.id ?? "") }
    }

    var statistics: NearCacheStatistics {
        self.state.withLock { state in
            var statistics = state.statistics
            statistics.entries = state.cache.statistics.entries
            statistics.bytes = state.cache.statistics.bytes
            statistics.watching = state.live && !state.lost
            return statistics
        }
    }

    /// Stops the watch and waits for its task to end (and for one registered meanwhile by a
    /// keep() that raced the close).
    func close() async {
        while let task = self.state.withLock({ state -> Task<Void, Never>? in
            state.closed = true
            state.live = false
            defer { state.watchTask = nil }
            return state.watchTask
        }) {
            task.cancel()
            await task.value
        }
    }

    // MARK: The watch

    /// The task of one watch (epoch `epoch`, from `sequence`), until it ends or the epoch
    /// does. Neither the near-cache nor the client is kept alive by it: it holds the client
    /// only while it opens the stream, and opens none once the cache is closed.
    private func watchTask(client: EntitlementsClient, epoch: UInt64, from sequence: UInt64) -> Task<Void, Never> {
        let liveness = self.configuration.watchLiveness.flatMap { $0 > .zero ? $0 : nil }
        return Task.detached { [weak client, weak self] () -> Void in
            let request = WatchEntitlementsRequest(allCustomers: true, environment: .production, afterLogSequence: Int64(sequence))
            let watch: EntitlementsClient.OpenWatch
            do {
                guard self?.isCurrent(epoch) == true, let opened = try await client?.openWatch(request) else { return }
                watch = opened
            } catch let error as EntitlementsClientError {
                self?.ended(epoch: epoch, from: sequence, refused: error.code == .failedPrecondition)
                return
            } catch {
                self?.ended(epoch: epoch, from: sequence, refused: false)
                return
            }
            self?.connected(epoch: epoch)
            await withTaskGroup(of: Bool.self) { group in
                // Each child returns whether the watch was refused; the first to end ends
                // the watch (the events: the stream ended, failed or the epoch is over; the
                // PINGs: a PONG not back in time), at once: the other may still be waiting.
                group.addTask { [weak self] in
                    do {
                        for try await event in watch.events {
                            guard let self, self.apply(event, epoch: epoch) else { return false }
                        }
                        return false
                    } catch let error as EntitlementsClientError {
                        return error.code == .failedPrecondition
                    } catch {
                        return false
                    }
                }
                if let liveness {
                    group.addTask { [weak self] in
                        // Ends when a PONG does not come back in time (or the cache is gone).
                        while self != nil {
                            do {
                                try await Task.sleep(for: liveness)
                                try await watch.ping(TimeAmount(liveness))
                            } catch {
                                return false
                            }
                        }
                        return false
                    }
                }
                let refused = await group.next() ?? false
                self?.ended(epoch: epoch, from: sequence, refused: refused)
                group.cancelAll()
            }
        }
    }

    private func isCurrent(_ epoch: UInt64) -> Bool {
        self.state.withLock { $0.epoch == epoch && !$0.closed && !Task.isCancelled }
    }

    private func connected(epoch: UInt64) {
        self.state.withLock { state in
            if state.epoch == epoch, !state.closed, !state.lost {
                state.live = true
            }
        }
    }

    /// The watch ended (the server closed it, the connection dropped, or it was refused).
    private func ended(epoch: UInt64, from sequence: UInt64, refused: Bool) {
        let clock = Self.monotonic()
        self.state.withLock { state in
            guard state.epoch == epoch, !state.closed else { return }
            if refused {
                state.lowestStart = max(state.lowestStart, sequence + 1)
            }
            Self.markLost(&state, epoch: epoch, at: clock)
        }
    }

    /// Nothing kept is served until a new watch; a watch lost within a second of its start
    /// (refused, or a server that times out every check) delays the next: 50 ms, doubling
    /// to 3.2 s, so that a struggling server is not sent a new watch and its RESUMED burst
    /// on every miss.
    private static func markLost(_ state: inout State, epoch: UInt64, at clock: UInt64) {
        guard state.epoch == epoch, state.watchFrom != nil, !state.lost else { return }
        if clock &- state.watchStartedAt < 1_000_000_000 {
            state.shortWatches = min(state.shortWatches + 1, 7)
            state.nextWatchAt = clock + UInt64(50_000_000) << UInt64(state.shortWatches - 1)
        } else {
            state.shortWatches = 0
        }
        state.live = false
        state.lost = true
        if state.lostAt == nil {
            state.lostAt = clock
        }
    }

    /// A watch event of `epoch`: forget what it names (the customer, the answers kept for
    /// its aliases and the aliases it moved), whatever its cause (a TIME event may carry a
    /// write the server applied while computing it), and note the names in the ring.
    /// Returns false once the epoch is over.
    func apply(_ event: EntitlementsChangedEvent, epoch: UInt64) -> Bool {
        let forgotten = self.state.withLock { state -> Int? in
            guard state.epoch == epoch, !state.closed else { return nil }
            guard let customerId = event.customerId else { return 0 }
            state.events += 1
            var forgotten = Self.remove(customerId, from: &state)
            for alias in state.aliasKeys.removeValue(forKey: customerId) ?? [] {
                forgotten += Self.remove(alias, from: &state)
            }
            Self.note(customerId, in: &state)
            for alias in event.aliasesChanged {
                forgotten += Self.remove(alias, from: &state)
                Self.note(alias, in: &state)
            }
            state.statistics.invalidations += UInt64(forgotten)
            return forgotten
        }
        guard let forgotten else { return false }
        if forgotten > 0 {
            self.invalidationCounter.increment(by: forgotten)
        }
        return true
    }

    /// Forgets the answer kept for the user id `userId`; returns how many were.
    private static func remove(_ userId: String, from state: inout State) -> Int {
        let before = state.cache.statistics.entries
        state.cache.removeAll(userId: userId)
        return before - state.cache.statistics.entries
    }

    private static func note(_ name: String, in state: inout State) {
        let index = state.ringWritten % Self.ringCapacity
        state.ringHashes[index] = name.hashValue
        state.ringEvents[index] = state.events
        state.ringWritten += 1
    }
}
