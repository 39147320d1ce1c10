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
    /// Replayed writes past the outbox, kept until ``attach(to:)`` can derive them (the
    /// factory needs the store's catalog). Nil once attached.
    private let replay = Mutex<[CustomerStore.CommittedWrite]?>([])
    private let schedule = Mutex(TimeSchedule())
    /// Whether the start-up scan of every customer's time changes has finished (until then
    /// the outbox's time cursor stays where it was).
    private let scanned = Atomic<Bool>(false)
    /// Whether the outbox was created by this start: the writes the log replays are older
    /// than the events, and not derived.
    private let fresh: Bool

    /// Opens the outbox in `directory` (`DATA-DIR/events`).
    public static func open(configuration: EventsConfiguration, directory: String, logger: Logger, metrics factory: any MetricsFactory, now: Int64) throws -> OutboundEvents {
        let (outbox, opened) = try Outbox.open(directory: directory, destinations: configuration.destinations.map(\.name), policy: configuration.policy, now: now)
        if opened.tornBytes > 0 {
            logger.notice("events: cut a torn last line of \(opened.tornBytes) bytes from \(outbox.path); its writes' events are derived again from the log")
        }
        return OutboundEvents(configuration: configuration, outbox: outbox, fresh: opened.created, logger: logger, metrics: EventMetrics(destinations: configuration.destinations.map(\.name), factory: factory))
    }

    init(configuration: EventsConfiguration, outbox: Outbox, fresh: Bool, logger: Logger, metrics: EventMetrics) {
        self.configuration = configuration
        self.outbox = outbox
        self.fresh = fresh
        self.logger = logger
        self.metrics = metrics
    }

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

    /// The store's replay of its log at opening: writes the outbox had not made durable are
    /// derived again once attached.
    public func replayed(_ write: CustomerStore.CommittedWrite) {
        guard !self.fresh, write.sequence > self.outbox.derivedThrough else {
            return
        }
        self.replay.withLock { $0?.append(write) }
    }

    /// ``replayed(_:)``, as `CustomerStore.Options.replayed` takes it.
    public var replayObserver: @Sendable (CustomerStore.CommittedWrite) -> Void {
        { [self] write in self.replayed(write) }
    }

    /// Starts deriving from `store`: the replayed writes first, then every commit (before it
    /// is acknowledged), and makes the outbox durable before a compaction drops log records.
    public func attach(to store: CustomerStore) {
        let factory = EventFactory(catalog: store.catalog)
        self.attached.withLock { $0 = (store, factory) }
        let pending = self.replay.withLock { pending -> [CustomerStore.CommittedWrite] in
            defer { pending = nil }
            return pending ?? []
        }
        for write in pending {
            self.derive(write, factory: factory, now: write.recordedDate)
        }
        if self.fresh {
            try? self.outbox.sync(through: store.committedSequence)
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
        var events: [OutboundEvent] = []
        for (customerId, before) in write.before {
            guard let before, let due = self.schedule.withLock({ $0.next(of: customerId) }), due <= write.recordedDate else {
                continue
            }
            events += self.timeEvents(of: before, from: due, until: write.recordedDate, factory: factory, logSequence: write.sequence &- 1).events
        }
        let derived = factory.events(of: write)
        events += derived.events
        let added = self.outbox.append(events, destinations: self.destinations(for:), through: write.sequence, now: now)
        self.metrics.derived(added)
        self.schedule.withLock { schedule in
            for (customerId, next) in derived.nextChange {
                schedule.set(customerId, at: next)
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

    private func destinations(for event: OutboundEvent) -> [String] {
        self.configuration.destinations.filter { $0.wants(event) }.map(\.name)
    }

    // MARK: Running

    public func run() async throws {
        let client = Self.makeClient()
        await withTaskGroup(of: Void.self) { group in
            group.addTask { await self.scanTimeChanges() }
            group.addTask { await self.timeLoop() }
            group.addTask { await self.maintenanceLoop() }
            for destination in self.configuration.destinations {
                group.addTask { await self.deliveryLoop(destination, client: client) }
            }
            try? await gracefulShutdown()
            group.cancelAll()
        }
        try? await client.shutdown()
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
        let cursor = self.outbox.timeCursor
        let started = WallClock.unixMilliseconds()
        let outcome: Result<Int, any Error> = await withCheckedContinuation { continuation in
            DispatchQueue(label: "entitlements.events.scan").async {
                var customers = 0
                let result = Result {
                    try store.forEachCustomer { record in
                        guard let id = record.id else { return true }
                        customers += 1
                        let first = factory.nextChange(of: record, after: cursor)
                        let (events, next) = self.timeEvents(of: record, from: first ?? .max, until: started, factory: factory, logSequence: store.committedSequence)
                        if !events.isEmpty {
                            self.metrics.derived(self.outbox.append(events, destinations: self.destinations(for:), through: nil, now: started))
                        }
                        self.schedule.withLock { schedule in
                            if schedule.next(of: id) == nil {
                                schedule.set(id, at: next)
                            }
                        }
                        return !Task.isCancelled
                    }
                    return customers
                }
                continuation.resume(returning: result)
            }
        }
        switch outcome {
        case .success(let customers):
            self.outbox.timeDerived(through: started)
            self.scanned.store(true, ordering: .releasing)
            self.logger.info("events: read the time changes of \(customers) customers in \(WallClock.unixMilliseconds() - started) ms")
        case .failure(let error):
            self.logger.error("events: cannot read the customers' time changes: \(error); time events are derived only for customers written from now on")
            self.scanned.store(true, ordering: .releasing)
        }
    }

    /// Fires time changes as they come due.
    private func timeLoop() async {
        while !Task.isCancelled {
            let now = WallClock.unixMilliseconds()
            if let (store, factory) = self.attached.withLock({ $0 }) {
                let due = self.schedule.withLock { $0.takeDue(now: now) }
                var events: [OutboundEvent] = []
                for (customerId, at) in due {
                    guard let record = try? store.customer(for: customerId), record.id == customerId else {
                        continue
                    }
                    let (found, next) = self.timeEvents(of: record, from: at, until: now, factory: factory, logSequence: store.committedSequence)
                    events += found
                    self.schedule.withLock { schedule in
                        if schedule.next(of: customerId) == nil {
                            schedule.set(customerId, at: next)
                        }
                    }
                }
                if !events.isEmpty {
                    self.metrics.derived(self.outbox.append(events, destinations: self.destinations(for:), through: nil, now: now))
                }
                if self.scanned.load(ordering: .acquiring) {
                    self.outbox.timeDerived(through: now)
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
                if free > 0 {
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
            let body = try self.outbox.body(of: entry)
            let timestamp = WallClock.unixMilliseconds() / 1000
            var request = HTTPClientRequest(url: destination.url)
            request.method = .POST
            request.headers.add(name: "content-type", value: "application/json")
            request.headers.add(name: "user-agent", value: "entitlements-events/1")
            request.headers.add(name: "entitlements-event-id", value: id)
            request.headers.add(name: "entitlements-event-type", value: entry.summary.type)
            request.headers.add(name: "entitlements-signature", value: WebhookSignature.header(body: body, timestamp: timestamp, secrets: destination.secrets))
            request.body = .bytes(ByteBuffer(bytes: body))
            let response = try await client.execute(request, timeout: TimeAmount(self.configuration.requestTimeout))
            _ = try? await response.body.collect(upTo: 64 << 10)
            let status = Int(response.status.code)
            result = ((200..<300).contains(status), status == 410, "HTTP \(status)")
        } catch {
            result = (false, false, Self.describe(error))
        }
        guard !Task.isCancelled else {
            // Stopping: the outcome is unknown, and the event is sent again at the next
            // start (with the same id).
            return
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
        return self.outbox.withLedger { $0.redeliver(id, now: now) }
    }

    /// Sends again every held event that occurred at or after `since` whose last attempt
    /// failed somewhere; returns how many.
    public func redeliverFailed(since: Int64) -> Int {
        let now = WallClock.unixMilliseconds()
        return self.outbox.withLedger { ledger in
            let failed = ledger.ordered.filter { entry in
                entry.summary.occurredAt >= since && entry.deliveries.values.contains { $0.status == .retrying || $0.status == .givenUp }
            }
            for entry in failed {
                _ = ledger.redeliver(entry.summary.id, now: now)
            }
            return failed.count
        }
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

    func derived(_ events: [OutboundEvent]) {
        if !events.isEmpty {
            self.derivedCounter.increment(by: events.count)
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
