import AsyncHTTPClient
import Dispatch
import Glibc
import EntitlementsMessages
import EntitlementsSecurity
public import EntitlementsStore
public import Logging
public import CoreMetrics
import Metrics
import NIOCore
import NIOHTTP1
public import ServiceLifecycle
import Synchronization

/// Outbound events, end to end (docs/events.md): derives the events of each committed write
/// and of time passing, keeps them in the ``Outbox``, and POSTs them, signed, to each
/// destination that wants them, retrying with backoff. A `Service`: `run()` delivers until
/// the service group shuts down, then makes the outbox durable.
///
/// Wiring, in this order: ``open(configuration:directory:logger:now:)`` before the store
/// opens; its ``replayed(_:)`` as the store's `Options.replayed`; ``attach(to:)`` once the
/// store is open (before the server takes writes); then run it.
public final class OutboundEvents: Service, Sendable {
    public let configuration: EventsConfiguration
    public let outbox: Outbox
    let logger: Logger
    let metrics: EventMetrics
    /// Set by ``attach(to:)``.
    private let attached = Mutex<(store: CustomerStore, factory: EventFactory)?>(nil)
    /// The writes the store replayed that the outbox had not made durable.
    private let replay: EventReplay
    /// What time events are derived from, under one lock that a write's derivation, the
    /// time loop and the start-up scan each hold while they derive and append a customer's
    /// events: so a customer's time events and write events reach the outbox in the order
    /// they happened.
    struct TimeState {
        var schedule = TimeSchedule()
        /// Until the start-up scan has read every customer: the instant from which it
        /// derives what time changed while the server was down, and the customers that a
        /// write reached first (the write derived their time events; the scan skips them).
        var scanFrom: Int64?
        var handled: Set<String> = []
        var scanned = false
        /// The instant of each customer's last time event, for a while: a write received
        /// before it but made visible after it is read at that instant, so that its events
        /// follow from what the time event said.
        var lastTimeEvent: [String: Int64] = [:]
        /// The earliest instant a customer's read failed at (its time events wait): the
        /// outbox's cursor stays before it.
        var failedAt: Int64?
    }

    private let time = Mutex(TimeState())
    /// Set when the service stops: the start-up scan (on a thread of its own) stops too.
    private let stopping = StopFlag()

    final class StopFlag: Sendable {
        private let value = Atomic<Bool>(false)
        var isSet: Bool { self.value.load(ordering: .relaxed) }
        func set() { self.value.store(true, ordering: .relaxed) }
    }
    /// Whether the outbox was created by this start: the writes the log replays are older
    /// than the events, and not derived.
    /// Fleet mode: who shares with whom, and who delivers, and this server's name in the
    /// lease (set by ``attach(to:coordinator:holder:)``; nil: this server delivers).
    private let coordination = Mutex<(coordinator: any EventCoordinator, holder: String)?>(nil)
    private var coordinator: (any EventCoordinator)? { self.coordination.withLock { $0?.coordinator } }
    var holder: String { self.coordination.withLock { $0?.holder } ?? "" }
    /// Until when (uptime milliseconds) this server may send: its lease, less a margin.
    /// Without a coordinator, always.
    private let mayDeliverUntil = Atomic<Int64>(0)
    /// Derived here, not yet shared; outcomes and requests not yet recorded.
    private let unshared = Mutex<[SharedEvent]>([])
    private let unrecorded = Mutex<[SharedDelivery]>([])
    /// Delivery states read from the fleet for events this server has not derived yet (its
    /// tailer is behind): applied when the event arrives. Bounded by ``parkedLimit``.
    private let parked = Mutex<[String: (states: [SharedDelivery], since: Int64)]>([:])
    static let parkedLimit = 100_000
    /// How long a lease lasts, and how often its holder renews it.
    public static let leaseDuration: Duration = .seconds(10)
    static let leaseRenewal: Duration = .seconds(2)

    /// Opens the outbox in `replay`'s directory (`DATA-DIR/events`), once `store` is open
    /// (and holds its data directory's lock). A new outbox starts after the store's last
    /// write: earlier writes send nothing.
    public static func open(
        configuration: EventsConfiguration,
        replay: EventReplay,
        store: CustomerStore,
        logger: Logger,
        metrics factory: any MetricsFactory,
        now: Int64
    ) throws -> OutboundEvents {
        let (outbox, opened) = try Outbox.open(
            directory: replay.directory,
            destinations: configuration.destinations.map(\.name),
            policy: configuration.policy,
            startingAfter: store.committedSequence,
            now: now
        )
        if opened.tornBytes > 0 {
            logger.notice("events: cut a torn last line of \(opened.tornBytes) bytes from \(outbox.path); its writes' events are derived again from the log")
        }
        if let aside = opened.setAside {
            logger.error("events: the outbox had derived writes past the store's last (\(store.committedSequence)): the data directory holds another history (seeded anew, or a new fleet epoch); it is set aside as \(aside) and its events are not sent; a new outbox starts")
        }
        return OutboundEvents(
            configuration: configuration,
            outbox: outbox,
            replay: replay,
            logger: logger,
            metrics: EventMetrics(destinations: configuration.destinations.map(\.name), factory: factory)
        )
    }

    init(configuration: EventsConfiguration, outbox: Outbox, replay: EventReplay, logger: Logger, metrics: EventMetrics) {
        self.configuration = configuration
        self.outbox = outbox
        self.replay = replay
        self.logger = logger
        self.metrics = metrics
    }

    /// Whether this server sends now: always on its own; in a fleet, while it holds the
    /// lease (with a margin before it runs out).
    public var isDelivering: Bool {
        self.mayDeliverUntil.load(ordering: .relaxed) > Self.uptime()
    }

    /// Milliseconds on the monotonic clock since the process first asked (a lease's end is
    /// kept on it, so that a change of the wall clock cannot stretch it).
    static func uptime() -> Int64 {
        let elapsed = ContinuousClock.now - Self.origin
        return elapsed.components.seconds * 1000 + elapsed.components.attoseconds / 1_000_000_000_000_000
    }

    private static let origin = ContinuousClock.now

    /// The events' own client, for one run: a refused connection fails the attempt at once
    /// (the process-wide client retries connecting until the request's deadline, which
    /// would make every attempt at a destination that is down last the whole timeout); no
    /// redirects.
    private static func makeClient() -> HTTPClient {
        var http = HTTPClient.Configuration()
        http.connectionPool.retryConnectionEstablishment = false
        http.timeout.connect = .seconds(5)
        http.redirectConfiguration = .disallow
        return HTTPClient(eventLoopGroupProvider: .singleton, configuration: http)
    }

    // MARK: Deriving

    /// Starts deriving from `store`: the replayed writes first, then every commit (before it
    /// is acknowledged), and makes the outbox durable before a compaction drops log records.
    /// In a fleet, `coordinator` shares the events and the delivery with the other servers,
    /// and `holder` names this one in the lease; without one this server delivers
    /// everything itself.
    public func attach(to store: CustomerStore, coordinator: (any EventCoordinator)? = nil, holder: String = "") {
        if let coordinator {
            self.coordination.withLock { $0 = (coordinator, holder) }
        } else {
            self.mayDeliverUntil.store(.max, ordering: .relaxed)
        }
        let factory = EventFactory(catalog: store.catalog)
        // What time changed while events were off, or the server down, is derived from the
        // outbox's cursor (by the start-up scan, or by a write that reaches a customer
        // first), but never from more than the retry horizon ago: older changes would only
        // be given up.
        let now = WallClock.unixMilliseconds()
        self.time.withLock { $0.scanFrom = max(self.outbox.timeCursor, now - self.configuration.policy.horizon) }
        self.attached.withLock { $0 = (store, factory) }
        for write in self.replay.take() where write.sequence > self.outbox.derivedThrough {
            self.derive(write, factory: factory, now: write.recordedDate)
        }
        store.observeCommits { [self] write in
            self.derive(write, factory: factory, now: WallClock.unixMilliseconds())
        }
        store.beforeCompacting { [self] sequence in
            // Every write up to `sequence` is visible; its observer call may still be
            // running on the writer thread: wait for it (microseconds).
            let patience = ContinuousClock.now + .seconds(10)
            while self.outbox.derivedThrough < sequence, ContinuousClock.now < patience {
                usleep(100)
            }
            try self.outbox.sync(through: min(sequence, self.outbox.derivedThrough))
            if self.outbox.derivedThrough < sequence {
                throw OutboxError(path: self.outbox.path, reason: "the events of writes up to \(sequence) are not all derived yet; compaction waits")
            }
        }
    }

    /// Derives `write`'s events (and first, for each customer it changed, the time events
    /// due before it), and appends them.
    private func derive(_ write: CustomerStore.CommittedWrite, factory: EventFactory, now: Int64) {
        self.time.withLock { time in
            var events: [OutboundEvent] = []
            var instants: [String: Int64] = [:]
            for (customerId, before) in write.before {
                var due = time.schedule.next(of: customerId)
                if let from = time.scanFrom, !time.scanned, time.handled.insert(customerId).inserted, let before {
                    // The scan has not read this customer yet: what time changed since the
                    // cursor comes first.
                    due = factory.nextChange(of: before, after: from)
                }
                // In a fleet only the deliverer derives what time did: every server would
                // derive it at its own moment, from what its tailer had applied by then.
                if let before, let first = due, first <= write.recordedDate, self.derivesTime {
                    let found = self.timeEvents(of: before, from: first, until: write.recordedDate, factory: factory, logSequence: write.sequence &- 1).events
                    events += found
                    if let last = found.last?.occurredAt {
                        time.lastTimeEvent[customerId] = last
                    }
                }
                if self.coordinator == nil, let last = time.lastTimeEvent[customerId], last > write.recordedDate {
                    instants[customerId] = last
                }
            }
            let derived = factory.events(of: write, at: instants)
            events += derived.events
            self.keep(events, through: write.sequence, now: now)
            for (customerId, next) in derived.nextChange {
                time.schedule.set(customerId, at: next)
            }
        }
    }

    /// The time events of `record` at each change from `first` up to `until` (inclusive),
    /// and its next change after.
    private func timeEvents(of record: CustomerRecord, from first: Int64, until: Int64, factory: EventFactory, logSequence: UInt64) -> (events: [OutboundEvent], next: Int64?) {
        var events: [OutboundEvent] = []
        var instant: Int64? = first
        var steps = 0
        while let at = instant, at <= until, steps < 1_000 {
            let (found, next) = factory.timeEvents(of: record, at: at, logSequence: logSequence)
            events += found
            instant = next
            steps += 1
        }
        return (events, instant)
    }

    /// Whether this server derives time events now: on its own, always; in a fleet, while
    /// it delivers (so every copy of an event is the deliverer's).
    private var derivesTime: Bool {
        self.coordinator == nil || self.isDelivering
    }

    private func destinations(for event: OutboundEvent) -> [String] {
        self.configuration.destinations.filter { $0.wants(event) }.map(\.name)
    }

    /// Appends derived events to the outbox (those held already are skipped) and, in a
    /// fleet, queues the new ones to be shared.
    private func keep(_ events: [OutboundEvent], through: UInt64?, now: Int64) {
        let added = self.outbox.append(events, destinations: self.destinations(for:), through: through, now: now)
        self.metrics.derived(added.count)
        if self.coordinator != nil, !added.isEmpty {
            self.unshared.withLock { $0 += added }
            self.unpark(added)
        }
    }

    /// Applies the delivery states that waited for `events`.
    private func unpark(_ events: [SharedEvent]) {
        let waiting = self.parked.withLock { parked -> [SharedDelivery] in
            guard !parked.isEmpty else { return [] }
            return events.flatMap { parked.removeValue(forKey: $0.summary.id)?.states ?? [] }
        }
        if !waiting.isEmpty {
            self.apply(waiting)
        }
    }

    // MARK: Running

    public func run() async throws {
        let client = Self.makeClient()
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.scanTimeChanges() }
            group.addTask { await self.timeLoop() }
            group.addTask { await self.maintenanceLoop() }
            if let coordinator = self.coordinator {
                group.addTask { await self.coordinationLoop(coordinator) }
            }
            for destination in self.configuration.destinations {
                group.addTask { await self.deliveryLoop(destination, client: client) }
            }
            try? await gracefulShutdown()
            self.stopping.set()
            group.cancelAll()
        }
        try? await client.shutdown()
        if let coordinator = self.coordinator {
            let held = self.isDelivering
            self.mayDeliverUntil.store(0, ordering: .relaxed)
            try? await self.flush(coordinator)
            if held {
                try? await coordinator.release(holder: self.holder)
            }
        }
        do {
            try self.outbox.sync()
        } catch {
            self.logger.error("events: cannot make the outbox durable at shutdown: \(error); its events are derived again from the log at the next start")
        }
    }

    /// Every customer's next time change, read once at start (off the cooperative pool):
    /// the events time caused while the server was down (after the outbox's time cursor)
    /// are derived now, in each customer's order.
    private func scanTimeChanges() async {
        guard let (store, factory) = self.attached.withLock({ $0 }) else {
            return
        }
        let started = WallClock.unixMilliseconds()
        let cursor = self.time.withLock { $0.scanFrom } ?? started
        let stopping = self.stopping
        // In a fleet the scan only schedules each customer's first change since the cursor:
        // the deliverer's time loop derives them (it may be another server by then).
        let derives = self.coordinator == nil
        let outcome: Result<(customers: Int, complete: Bool), any Error> = await withCheckedContinuation { continuation in
            DispatchQueue(label: "entitlements.events.scan").async {
                var customers = 0
                var complete = true
                let result = Result {
                    try store.forEachCustomer { record in
                        guard let id = record.id else { return true }
                        customers += 1
                        self.time.withLock { time in
                            // A customer a write reached first had its time events derived by it.
                            guard !time.handled.contains(id) else { return }
                            let first = factory.nextChange(of: record, after: cursor)
                            var next = first
                            if derives {
                                let (events, after) = self.timeEvents(of: record, from: first ?? .max, until: started, factory: factory, logSequence: store.committedSequence)
                                if !events.isEmpty {
                                    self.keep(events, through: nil, now: started)
                                }
                                next = after
                            }
                            if time.schedule.next(of: id) == nil {
                                time.schedule.set(id, at: next)
                            }
                        }
                        if stopping.isSet {
                            complete = false
                            return false
                        }
                        return true
                    }
                    return (customers: customers, complete: complete)
                }
                continuation.resume(returning: result)
            }
        }
        switch outcome {
        case .success(let (customers, true)):
            self.time.withLock { time in
                time.scanned = true
                time.handled = []
            }
            self.outbox.timeDerived(through: started)
            self.logger.info("events: read the time changes of \(customers) customers in \(WallClock.unixMilliseconds() - started) ms")
        case .success:
            // Stopped before the end: the cursor stays, and the next start reads them all.
            break
        case .failure(let error):
            // The cursor stays where it was (the time loop does not move it): the next
            // start derives from there.
            self.logger.error("events: cannot read the customers' time changes: \(error); time events are derived only for customers written from now on, until a restart")
        }
    }

    /// Fires time changes as they come due.
    private func timeLoop() async {
        while !Task.isCancelled {
            let now = WallClock.unixMilliseconds()
            if let (store, factory) = self.attached.withLock({ $0 }), self.derivesTime {
                // In a fleet, a change at an instant is derived once this server has applied
                // every write committed before it (its tailer's last complete poll).
                let horizon = self.coordinator == nil ? now : min(now, store.lastUpstreamContact ?? now)
                // One customer at a time under the lock: a write to it waits, or goes first.
                while let failure = self.time.withLock({ time -> String?? in
                    guard let (customerId, at) = time.schedule.takeDue(now: horizon, limit: 1).first else {
                        return nil
                    }
                    let record: CustomerRecord?
                    do {
                        record = try store.customer(for: customerId)
                    } catch {
                        time.schedule.set(customerId, at: at)  // tried again at the next tick
                        time.failedAt = min(time.failedAt ?? at, at)
                        return .some("events: cannot read customer \(customerId) for its time events: \(error); trying again")
                    }
                    guard let record, record.id == customerId else {
                        return .some(nil)  // deleted (or its id is now an alias): nothing by time
                    }
                    let (found, next) = self.timeEvents(of: record, from: at, until: horizon, factory: factory, logSequence: store.committedSequence)
                    if !found.isEmpty {
                        self.keep(found, through: nil, now: now)
                        time.lastTimeEvent[customerId] = found.last?.occurredAt
                    }
                    time.schedule.set(customerId, at: next)
                    return .some(nil)
                }) {
                    if let failure {
                        self.logger.warning("\(failure)")
                        break
                    }
                }
                self.time.withLock { time in
                    time.lastTimeEvent = time.lastTimeEvent.filter { now - $0.value < 60_000 }
                    if let failed = time.failedAt, time.schedule.earliestIsAfter(failed) {
                        time.failedAt = nil  // read at last
                    }
                    if time.scanned {
                        self.outbox.timeDerived(through: min(horizon, (time.failedAt ?? .max) - 1))
                    }
                }
            }
            try? await Task.sleep(for: .milliseconds(50))
        }
    }

    /// Once a second: fsync, compact and bound the outbox, refresh the metrics, and warn of
    /// destinations that fall behind (at most once a minute each).
    private func maintenanceLoop() async {
        var warned: [String: Int64] = [:]
        while !Task.isCancelled {
            try? await Task.sleep(for: .seconds(1))
            let now = WallClock.unixMilliseconds()
            do {
                try self.outbox.sync()
                try self.outbox.compact(now: now)
            } catch {
                if warned["outbox"].map({ now - $0 >= 60_000 }) ?? true {
                    warned["outbox"] = now
                    self.logger.error("events: the outbox cannot be written: \(error); no new events are kept until a restart, which derives them again from the log")
                }
            }
            let dropped = self.outbox.enforce(limit: self.configuration.outboxLimit, now: now)
            if !dropped.isEmpty {
                self.metrics.dropped(dropped.count)
                self.logger.error("events: the outbox reached --event-outbox-limit (\(self.configuration.outboxLimit) bytes): dropped the \(dropped.count) oldest undelivered events, from \(dropped.first ?? "") to \(dropped.last ?? ""); raise the limit or bring the destination back")
            }
            for destination in self.configuration.destinations {
                let (waiting, oldest, disabled) = self.outbox.withLedger { ledger in
                    (ledger.unsettledCount(destination.name), ledger.oldestUnsettled(destination.name), ledger.disabledReason(destination.name))
                }
                let lag = oldest.map { max(0, now - $0) } ?? 0
                self.metrics.refresh(destination.name, waiting: waiting, lagMilliseconds: lag, disabled: disabled != nil, outboxBytes: self.outbox.sizes.file)
                let behind = disabled != nil || lag > 60_000
                if behind, warned[destination.name].map({ now - $0 >= 60_000 }) ?? true {
                    warned[destination.name] = now
                    if let disabled {
                        self.logger.error("events: destination \(destination.name) is disabled (\(disabled)); \(waiting) events wait for it; fix the URL and restart the server")
                    } else {
                        self.logger.warning("events: destination \(destination.name) is behind: \(waiting) events wait, the oldest for \(lag / 1000) s; `entitlements events list --failed` shows the failures")
                    }
                }
            }
        }
    }

    /// Fleet mode, four times a second: shares what was derived here, records the outcomes
    /// (and redelivery requests) made here, reads back what the others shared and
    /// recorded, and every 2 s takes or renews the lease. The lease is only taken right
    /// after a read, so that a new holder knows what its predecessor delivered; a holder
    /// that cannot renew stops sending before its lease runs out.
    private func coordinationLoop(_ coordinator: any EventCoordinator) async {
        // Where this server stopped reading last time (kept in the outbox at each sync).
        var (eventCursor, deliveryCursor) = self.outbox.coordinationCursors
        var nextLease = ContinuousClock.now
        var nextPrune = ContinuousClock.now + .seconds(60)
        var failing = false
        while !Task.isCancelled {
            do {
                try await self.flush(coordinator)
                // A few pages a round at most, so that the lease is renewed on time even
                // while a backlog is read.
                for _ in 0..<4 {
                    let (deliveries, cursor) = try await coordinator.deliveries(after: deliveryCursor, limit: 1_000)
                    deliveryCursor = cursor
                    self.apply(deliveries)
                    if deliveries.count < 1_000 { break }
                }
                for _ in 0..<4 {
                    let (events, cursor) = try await coordinator.events(after: eventCursor, limit: 500)
                    eventCursor = cursor
                    if !events.isEmpty {
                        let added = self.outbox.append(events, now: WallClock.unixMilliseconds())
                        self.unpark(added)
                        // What became of the events new here, however long ago it was recorded.
                        if !added.isEmpty {
                            self.apply(try await coordinator.deliveries(of: added.map(\.summary.id)))
                        }
                    }
                    if events.count < 500 { break }
                }
                self.outbox.coordinationCursors = (eventCursor, deliveryCursor)
                if ContinuousClock.now >= nextLease {
                    nextLease = ContinuousClock.now + Self.leaseRenewal
                    let asked = Self.uptime()
                    // A server whose outbox cannot be written keeps no new event: it must
                    // not deliver for the fleet.
                    let held: Bool
                    if self.outbox.failure == nil {
                        held = try await coordinator.lease(holder: self.holder, for: Self.leaseDuration)
                    } else {
                        if self.isDelivering {
                            try await coordinator.release(holder: self.holder)
                        }
                        held = false
                    }
                    let was = self.isDelivering
                    let margin = Self.leaseRenewal.components.seconds * 1000
                    self.mayDeliverUntil.store(held ? asked + Self.leaseDuration.components.seconds * 1000 - margin : 0, ordering: .relaxed)
                    if held != was {
                        self.logger.notice(held ? "events: this server delivers the fleet's events (it holds the lease, \(self.holder))" : "events: another server delivers the fleet's events")
                    }
                }
                if self.isDelivering, ContinuousClock.now >= nextPrune {
                    nextPrune = ContinuousClock.now + .seconds(60)
                    try await coordinator.prune(deliveredBefore: .seconds(7 * 86_400))
                }
                if failing {
                    failing = false
                    self.logger.notice("events: PostgreSQL answers again; sharing and recording resumed")
                }
            } catch {
                if !failing {
                    failing = true
                    self.logger.warning("events: cannot share with the fleet (\(error)); what was derived and delivered here waits, and the lease runs out if this server holds it")
                }
            }
            try? await Task.sleep(for: .milliseconds(250))
        }
    }

    /// Shares the events derived here and records the outcomes made here; what fails stays
    /// queued.
    private func flush(_ coordinator: any EventCoordinator) async throws {
        let events = self.unshared.withLock { queue in
            defer { queue.removeAll() }
            return queue
        }
        do {
            for start in stride(from: 0, to: events.count, by: 200) {
                try await coordinator.share(Array(events[start..<min(start + 200, events.count)]))
            }
        } catch {
            self.unshared.withLock { $0.insert(contentsOf: events, at: 0) }
            throw error
        }
        let deliveries = self.unrecorded.withLock { queue in
            defer { queue.removeAll() }
            return queue
        }
        do {
            if !deliveries.isEmpty {
                try await coordinator.record(deliveries)
            }
        } catch {
            self.unrecorded.withLock { $0.insert(contentsOf: deliveries, at: 0) }
            throw error
        }
    }

    /// Applies delivery states another server (or this one) recorded; those of events not
    /// derived here yet wait for them.
    private func apply(_ deliveries: [SharedDelivery]) {
        let now = WallClock.unixMilliseconds()
        let unknown = self.outbox.withLedger { ledger in deliveries.filter { ledger.entries[$0.eventId] == nil } }
            .filter { !self.outbox.isForgotten($0.eventId) }
        if !unknown.isEmpty {
            self.parked.withLock { parked in
                // A state waits ten minutes at most for its event (this server derives it
                // when its tailer gets there); older ones are of events it will not see
                // (from before its start): when it reads such an event, it reads its state.
                if parked.count + unknown.count > Self.parkedLimit {
                    parked = parked.filter { now - $0.value.since < 600_000 }
                }
                for shared in unknown where parked.count < Self.parkedLimit || parked[shared.eventId] != nil {
                    parked[shared.eventId, default: ([], now)].states.append(shared)
                }
            }
        }
        let unknownIds = Set(unknown.map(\.eventId))
        for shared in deliveries where !unknownIds.contains(shared.eventId) {
            if shared.redeliver {
                _ = self.outbox.redeliver(shared.eventId, now: now)
            } else {
                _ = self.outbox.record(shared.eventId, destination: shared.destination) { ledger in
                    ledger.restore(shared.eventId, destination: shared.destination, delivery: shared.delivery, now: now)
                }
            }
        }
    }

    /// Sends `destination`'s due events, up to the configured concurrency at once (each to
    /// a different customer: the ledger hands out one event per customer at a time).
    private func deliveryLoop(_ destination: EventDestination, client: HTTPClient) async {
        final class Counter: Sendable {
            let value = Mutex(0)
        }
        let inFlight = Counter()
        await withDiscardingTaskGroup { group in
            while !Task.isCancelled {
                let free = self.configuration.concurrency - inFlight.value.withLock { $0 }
                if free > 0, self.isDelivering {
                    let now = WallClock.unixMilliseconds()
                    let due = self.outbox.withLedger { $0.due(for: destination.name, now: now, limit: free) }
                    inFlight.value.withLock { $0 += due.count }
                    for entry in due {
                        group.addTask {
                            await self.send(entry, to: destination, client: client)
                            inFlight.value.withLock { $0 -= 1 }
                        }
                    }
                }
                try? await Task.sleep(for: .milliseconds(20))
            }
        }
    }

    /// POSTs one event and records the outcome.
    private func send(_ entry: EventLedger.Entry, to destination: EventDestination, client: HTTPClient) async {
        let id = entry.summary.id
        let result: (delivered: Bool, gone: Bool, description: String)
        do {
            let body = try self.outbox.body(of: id)
            let timestamp = WallClock.unixMilliseconds() / 1000
            var request = HTTPClientRequest(url: destination.url)
            request.method = .POST
            request.headers.add(name: "content-type", value: "application/json")
            request.headers.add(name: "user-agent", value: "entitlements-events/1")
            request.headers.add(name: "entitlements-event-id", value: id)
            request.headers.add(name: "entitlements-event-type", value: entry.summary.type)
            request.headers.add(name: "entitlements-signature", value: WebhookSignature.header(body: body, timestamp: timestamp, secrets: destination.secrets))
            request.body = .bytes(ByteBuffer(bytes: body))
            // In a fleet, no answer is waited for past this server's lease: another may
            // deliver from then on.
            var timeout = TimeAmount(self.configuration.requestTimeout)
            if self.coordinator != nil {
                timeout = min(timeout, .milliseconds(self.mayDeliverUntil.load(ordering: .relaxed) - Self.uptime()))
            }
            let response = try await client.execute(request, timeout: timeout)
            _ = try? await response.body.collect(upTo: 64 << 10)
            let status = Int(response.status.code)
            result = ((200..<300).contains(status), status == 410, "HTTP \(status)")
        } catch {
            guard !Task.isCancelled else {
                // Stopping before the answer came: the outcome is unknown, and the event is
                // sent again at the next start (with the same id).
                return
            }
            result = (false, false, Self.describe(error))
        }
        let now = WallClock.unixMilliseconds()
        let interval = self.configuration.policy.interval(afterFailures: (entry.deliveries[destination.name]?.attempts ?? 0) + 1)
        let jitter = -Int64.random(in: 0...(interval / 2))
        let delivery = self.outbox.record(id, destination: destination.name) { ledger in
            if result.gone {
                ledger.disable(destination.name, reason: "it answered 410 Gone to \(id) at \(now)")
            }
            return ledger.attempted(id, destination: destination.name, delivered: result.delivered, result: result.description, now: now, jitter: jitter)
        }
        if self.coordinator != nil, let delivery {
            self.unrecorded.withLock { $0.append(SharedDelivery(eventId: id, destination: destination.name, delivery: delivery)) }
        }
        if result.gone {
            self.logger.error("events: destination \(destination.name) answered 410 Gone: it is disabled, nothing more is sent to it until the server restarts; its events are kept")
        }
        self.metrics.attempted(destination.name, delivery: delivery)
    }

    static func describe(_ error: any Error) -> String {
        if let error = error as? HTTPClientError {
            switch error {
            case .deadlineExceeded, .readTimeout, .connectTimeout: return "timeout"
            default: return "\(error)"
            }
        }
        return "\(error)"
    }

    // MARK: Listing and redelivering

    /// One held event and each destination's delivery of it.
    public struct Listing: Sendable {
        public var summary: EventSummary
        public var deliveries: [(destination: String, delivery: EventLedger.Delivery)]
    }

    /// The held events, oldest first: all, or (`failedOnly`) those whose last attempt failed
    /// for some destination (retrying or given up); of `customerId` only, if given.
    public func list(failedOnly: Bool, customerId: String?, limit: Int) -> [Listing] {
        self.outbox.withLedger { ledger in
            var out: [Listing] = []
            for entry in ledger.ordered {
                guard out.count < limit else { break }
                if let customerId, entry.summary.customerId != customerId { continue }
                let deliveries = entry.destinations.compactMap { name in entry.deliveries[name].map { (name, $0) } }
                if failedOnly, !deliveries.contains(where: { $0.1.status == .retrying || $0.1.status == .givenUp }) { continue }
                out.append(Listing(summary: entry.summary, deliveries: deliveries))
            }
            return out
        }
    }

    /// Sends event `id` again to each destination that wanted it; false if it is not held.
    public func redeliver(id: String) -> Bool {
        let now = WallClock.unixMilliseconds()
        guard let destinations = self.outbox.redeliver(id, now: now) else {
            return false
        }
        if self.coordinator != nil {
            self.unrecorded.withLock { queue in
                queue += destinations.map { SharedDelivery(eventId: id, destination: $0, delivery: EventLedger.Delivery(), redeliver: true) }
            }
        }
        return true
    }

    /// Sends again every held event that occurred at or after `since` whose last attempt
    /// failed somewhere; returns how many.
    public func redeliverFailed(since: Int64) -> Int {
        let now = WallClock.unixMilliseconds()
        let failed = self.outbox.withLedger { ledger in
            ledger.ordered.filter { entry in
                entry.summary.occurredAt >= since && entry.deliveries.values.contains { $0.status == .retrying || $0.status == .givenUp }
            }
        }
        return failed.filter { self.outbox.redeliver($0.summary.id, now: now) != nil }.map { entry in
            if self.coordinator != nil {
                self.unrecorded.withLock { queue in
                    queue += entry.destinations.map { SharedDelivery(eventId: entry.summary.id, destination: $0, delivery: EventLedger.Delivery(), redeliver: true) }
                }
            }
            return entry
        }.count
    }

    /// The customer id `userId` names now (an alias's customer), if attached and known.
    public func customerId(of userId: String) -> String? {
        guard let store = self.attached.withLock({ $0?.store }) else { return nil }
        return (try? store.customer(for: userId))?.id ?? nil
    }
}

/// The events' metrics (docs/events.md, "Watching it"), per destination.
struct EventMetrics: Sendable {
    let derivedCounter: Counter
    let droppedCounter: Counter
    let delivered: [String: Counter]
    let retried: [String: Counter]
    let givenUp: [String: Counter]
    let waiting: [String: Gauge]
    let lag: [String: Gauge]
    let disabled: [String: Gauge]
    let outboxBytes: Gauge

    init(destinations: [String], factory: any MetricsFactory) {
        func each<M>(_ make: (String) -> M) -> [String: M] {
            Dictionary(uniqueKeysWithValues: destinations.map { ($0, make($0)) })
        }
        self.derivedCounter = Counter(label: "entitlements_events_derived_total", factory: factory)
        self.droppedCounter = Counter(label: "entitlements_events_dropped_total", factory: factory)
        self.outboxBytes = Gauge(label: "entitlements_events_outbox_bytes", factory: factory)
        self.delivered = each { Counter(label: "entitlements_events_delivered_total", dimensions: [("destination", $0)], factory: factory) }
        self.retried = each { Counter(label: "entitlements_events_retried_total", dimensions: [("destination", $0)], factory: factory) }
        self.givenUp = each { Counter(label: "entitlements_events_given_up_total", dimensions: [("destination", $0)], factory: factory) }
        self.waiting = each { Gauge(label: "entitlements_events_waiting", dimensions: [("destination", $0)], factory: factory) }
        self.lag = each { Gauge(label: "entitlements_events_lag_seconds", dimensions: [("destination", $0)], factory: factory) }
        self.disabled = each { Gauge(label: "entitlements_events_destination_disabled", dimensions: [("destination", $0)], factory: factory) }
    }

    func derived(_ count: Int) {
        if count > 0 {
            self.derivedCounter.increment(by: count)
        }
    }

    func dropped(_ count: Int) {
        self.droppedCounter.increment(by: count)
    }

    func attempted(_ destination: String, delivery: EventLedger.Delivery?) {
        switch delivery?.status {
        case .delivered: self.delivered[destination]?.increment()
        case .retrying: self.retried[destination]?.increment()
        case .givenUp: self.givenUp[destination]?.increment()
        case .pending, nil: break
        }
    }

    func refresh(_ destination: String, waiting: Int, lagMilliseconds: Int64, disabled: Bool, outboxBytes: UInt64) {
        self.waiting[destination]?.record(waiting)
        self.lag[destination]?.record(Double(lagMilliseconds) / 1000)
        self.disabled[destination]?.record(disabled ? 1 : 0)
        self.outboxBytes.record(Int64(clamping: outboxBytes))
    }
}

/// The writes a store replays at opening that the outbox (in `directory`) had not yet made
/// durable: made before the store opens, as its `Options.replayed`, and read once the
/// outbox is open (``OutboundEvents/open(configuration:replay:store:logger:metrics:now:)``).
/// It peeks at the outbox without changing it (the store has not locked the data
/// directory yet); with no outbox there, nothing is kept (a new outbox starts after the
/// store's last write).
public final class EventReplay: Sendable {
    public let directory: String
    private let peek: Outbox.Peek
    private let writes = Mutex<[CustomerStore.CommittedWrite]>([])

    public init(directory: String) {
        self.directory = directory
        self.peek = Outbox.peek(directory: directory)
    }

    /// As `CustomerStore.Options.replayed` takes it. (An outbox that cannot say how far it
    /// derived keeps every replayed write: the outbox, once open, says.)
    public var observer: @Sendable (CustomerStore.CommittedWrite) -> Void {
        { [self] write in
            switch self.peek {
            case .absent:
                return
            case .present(let after?) where write.sequence <= after:
                return
            case .present:
                self.writes.withLock { $0.append(write) }
            }
        }
    }

    func take() -> [CustomerStore.CommittedWrite] {
        self.writes.withLock { writes in
            defer { writes = [] }
            return writes
        }
    }
}
