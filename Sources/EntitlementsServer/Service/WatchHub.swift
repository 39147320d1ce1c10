import EntitlementsMessages
import EntitlementsResolver
import EntitlementsStore
public import EntitlementsWire
public import NIOCore
import Synchronization

/// The open WatchEntitlements streams and who watches which customer.
///
/// Writes reach it once the resolvers' caches have dropped what they changed, on the first
/// resolver's event loop (``publish(_:)``); each interested watch
/// gets the new record on its own connection's event loop, where it resolves, compares with
/// what it last sent, and sends an event if the answer changed. Producers never wait for a
/// watcher: a watcher that cannot keep up overflows its bounded buffer and is ended with
/// RESOURCE_EXHAUSTED (see ``WatchStream``).
final class WatchHub: Sendable {
    private struct State {
        var watches: [Int: WatchStream] = [:]
        var byCustomer: [String: Set<Int>] = [:]
        var everyCustomer: Set<Int> = []
        var nextID = 0
    }

    private let state = Mutex(State())
    let maximumWatches: Int
    private let metrics: ServerMetrics

    init(maximumWatches: Int, metrics: ServerMetrics) {
        self.maximumWatches = maximumWatches
        self.metrics = metrics
    }

    var count: Int { self.state.withLock { $0.watches.count } }

    /// Registers `watch`; false when the server already has its maximum.
    func add(_ watch: WatchStream) -> Bool {
        self.state.withLock { state in
            guard state.watches.count < self.maximumWatches else {
                return false
            }
            state.nextID += 1
            watch.hubID = state.nextID
            state.watches[state.nextID] = watch
            if watch.everyCustomer {
                state.everyCustomer.insert(state.nextID)
            }
            for id in watch.customerIds {
                state.byCustomer[id, default: []].insert(state.nextID)
            }
            self.metrics.watchers.increment()
            return true
        }
    }

    func remove(_ watch: WatchStream) {
        self.state.withLock { state in
            let id = watch.hubID
            guard state.watches.removeValue(forKey: id) != nil else {
                return
            }
            self.metrics.watchers.decrement()
            state.everyCustomer.remove(id)
            for customerId in watch.customerIds {
                state.byCustomer[customerId]?.remove(id)
                if state.byCustomer[customerId]?.isEmpty == true {
                    state.byCustomer[customerId] = nil
                }
            }
        }
    }

    /// Tells the watches of the customers `write` changed (any thread; does not block).
    func publish(_ write: CustomerStore.CommittedWrite) {
        let deliveries = self.state.withLock { state -> [(WatchStream, String)] in
            guard !state.watches.isEmpty else {
                return []
            }
            var deliveries: [(WatchStream, String)] = []
            for customerId in write.effect.records.keys {
                var ids = state.everyCustomer
                if let watching = state.byCustomer[customerId] {
                    ids.formUnion(watching)
                }
                for id in ids {
                    if let watch = state.watches[id] {
                        deliveries.append((watch, customerId))
                    }
                }
            }
            return deliveries
        }
        for (watch, customerId) in deliveries {
            let before = write.before[customerId] ?? nil
            let after = write.effect.records[customerId] ?? nil
            watch.eventLoop.execute {
                watch.written(customerId: customerId, before: before, after: after, sequence: write.sequence)
            }
        }
    }
}

/// Where a watch stream's events go: a transport's stream (a framed request id, a gRPC
/// stream). Called on the stream's event loop only.
public struct WatchSink {
    /// Sends one encoded EntitlementsChangedEvent; returns whether the transport can take
    /// more now (false: the socket is full, and the stream holds events until
    /// ``WatchStream/resume()``).
    public var send: (ByteBuffer) -> Bool
    /// Ends the stream with a status and a message (empty for OK); called once, last.
    public var end: (StatusCode, String) -> Void

    public init(send: @escaping (ByteBuffer) -> Bool, end: @escaping (StatusCode, String) -> Void) {
        self.send = send
        self.end = end
    }
}

/// One WatchEntitlements stream. Created on and confined to its caller's event loop,
/// except for the immutable fields the hub reads.
public final class WatchStream: @unchecked Sendable {
    // @unchecked: `hubID` is written once, under the hub's lock, before the watch is
    // shared; every other mutable field is only touched on `eventLoop`.

    /// What the watch last sent (or found at subscription) for one customer.
    private struct Known {
        var encoded: [UInt8]
        var states: [String: EntitlementState]
        var validUntil: Int64?
        /// The last write this answer reflects: an older write's event is stale.
        var sequence: UInt64 = 0
    }

    let eventLoop: any EventLoop
    let everyCustomer: Bool
    let customerIds: [String]
    fileprivate(set) var hubID = 0

    private let environment: Environment
    private let entitlementIds: [String]
    /// WatchEntitlementsRequest.after_log_sequence: catch up from there at start.
    private let afterLogSequence: UInt64?
    private let resolver: EntitlementResolver
    private let store: CustomerStore
    private let bufferLimit: Int
    private let sink: WatchSink
    /// Called once when the stream ends (overflow, cancel, close).
    private let ended: (WatchStream) -> Void

    private var known: [String: Known] = [:]
    /// When the answers in `known` expire, earliest first; an entry is current while its
    /// customer's answer still has its instant as `validUntil` (``setKnown(_:for:)``).
    private var expiries = ExpiryHeap()
    /// Events held while the socket is full (bounded by `bufferLimit`).
    private var buffered = CircularBuffer<ByteBuffer>()
    private var socketFull = false
    private var timer: Scheduled<Void>?
    private var timerDeadline: Int64?
    /// The stream's own timeout (the call's deadline), cancelled when it ends otherwise.
    var deadlineTimer: Scheduled<Void>?
    private var finished = false

    /// The most customers an every-customer watch tracks for time changes.
    static let trackedLimit = 100_000

    init(
        eventLoop: any EventLoop,
        request: WatchEntitlementsRequest,
        customerIds: [String],
        resolver: EntitlementResolver,
        store: CustomerStore,
        bufferLimit: Int,
        sink: WatchSink,
        ended: @escaping (WatchStream) -> Void
    ) {
        self.eventLoop = eventLoop
        self.everyCustomer = request.allCustomers == true
        self.customerIds = customerIds
        self.environment = request.environment
        self.entitlementIds = request.entitlementIds
        self.afterLogSequence = request.afterLogSequence.map { UInt64(max(0, $0)) }
        self.resolver = resolver
        self.store = store
        self.bufferLimit = bufferLimit
        self.sink = sink
        self.ended = ended
    }

    /// Resolves the watched customers now, so that later changes are told against it, and
    /// arms the timer for the first time change.
    ///
    /// With `after_log_sequence` S, each watched customer that may have changed after S
    /// (`CustomerStore.lastChange(of:)`) gets a RESUMED event with its answer now: the
    /// client's answer at S, plus these events, plus the later ones, miss no change. An
    /// every-customer watch resumes from the overlay, which knows every customer written
    /// since the snapshot; from before the snapshot it cannot, and says so.
    func start(now: Int64) throws {
        var resumed: [String] = []
        if self.everyCustomer, let after = self.afterLogSequence {
            guard let changed = self.store.customersChanged(after: after) else {
                self.finish(
                    .failedPrecondition,
                    "after_log_sequence \(after) is older than the snapshot, which folded the writes before it; check again and watch from the new answer's log_sequence"
                )
                return
            }
            resumed = changed
        }
        for customerId in self.customerIds where !self.finished {
            let (record, sequence) = try self.store.customerAndSequence(for: customerId)
            // Read after the record: a write between the two then counts as a change (an
            // event too many at worst); read before, it could be in the record unannounced.
            let lastChange = self.store.lastChange(of: customerId)
            var (known, response) = self.resolve(record, at: now)
            known.sequence = sequence
            self.setKnown(known, for: customerId)
            if let after = self.afterLogSequence, lastChange > after {
                response.logSequence = sequence
                self.emit(Self.resumed(customerId, record, response, sequence), customerId: customerId)
            }
        }
        for customerId in resumed.sorted() where !self.finished {
            let (record, sequence) = try self.store.customerAndSequence(for: customerId)
            var (known, response) = self.resolve(record, at: now)
            known.sequence = sequence
            if self.known.count < Self.trackedLimit {
                self.setKnown(known, for: customerId)
            }
            response.logSequence = sequence
            self.emit(Self.resumed(customerId, record, response, sequence), customerId: customerId)
        }
        if !self.finished {
            self.armTimer(now: now)
        }
    }

    /// A RESUMED event. It names in `aliases_changed` every alias the customer has now: any
    /// of them may have been linked to it after the watch's sequence, and a write the event
    /// already folds in sends no event of its own (a client cache forgets what they name).
    private static func resumed(_ customerId: String, _ record: CustomerRecord?, _ response: CheckEntitlementsResponse, _ sequence: UInt64) -> EntitlementsChangedEvent {
        EntitlementsChangedEvent(customerId: customerId, cause: .resumed, current: response, logSequence: sequence, aliasesChanged: (record?.aliases ?? []).sorted())
    }

    // MARK: Changes

    /// A write changed `customerId`'s record (on `eventLoop`).
    func written(customerId: String, before: CustomerRecord?, after: CustomerRecord?, sequence: UInt64) {
        guard !self.finished else {
            return
        }
        if let known = self.known[customerId], known.sequence >= sequence {
            return  // the answer we hold was read after this write already
        }
        let now = WallClock.unixMilliseconds()
        let old = self.known[customerId] ?? self.resolve(before, at: now).known
        var (new, response) = self.resolve(after, at: now)
        new.sequence = sequence
        let aliasesBefore = Set(before?.aliases ?? [])
        let aliasesAfter = Set(after?.aliases ?? [])
        let aliasesChanged = aliasesBefore.symmetricDifference(aliasesAfter).sorted()
        self.update(customerId: customerId, old: old, new: new, response: response, cause: .write, sequence: sequence, aliasesChanged: aliasesChanged)
        if !self.finished {
            self.armTimer(now: now)
        }
    }

    /// The earliest validUntil passed: re-resolve the customers whose answers expired.
    private func timeChanged() {
        guard !self.finished else {
            return
        }
        let now = WallClock.unixMilliseconds()
        var due: [(customerId: String, old: Known)] = []
        while let entry = self.expiries.first, entry.instant <= now {
            self.expiries.removeFirst()
            if let known = self.known[entry.customerId], known.validUntil == entry.instant {
                due.append((entry.customerId, known))
            }
        }
        due.sort { $0.customerId < $1.customerId }
        for (index, (customerId, old)) in due.enumerated() {
            if index > 0, due[index - 1].customerId == customerId {
                continue  // the same answer kept twice (a write that left its validUntil)
            }
            let record: CustomerRecord?
            do {
                record = try self.store.customer(for: customerId)
            } catch {
                self.finish(.internalError, "cannot read customer \(customerId): \(error)")
                return
            }
            var (new, response) = self.resolve(record, at: now)
            // A write not yet told to this watch may be in it too: the answer keeps the
            // sequence of the last write told, so that write's own event still comes (sent
            // if it changed the aliases, or what this event showed).
            new.sequence = old.sequence
            self.update(customerId: customerId, old: old, new: new, response: response, cause: .time, sequence: nil)
            if self.finished {
                return
            }
        }
        self.armTimer(now: now)
    }

    private func update(
        customerId: String,
        old: Known,
        new: Known,
        response: CheckEntitlementsResponse,
        cause: ChangeCause,
        sequence: UInt64?,
        aliasesChanged: [String] = []
    ) {
        if self.everyCustomer, self.known[customerId] == nil, self.known.count >= Self.trackedLimit {
            // Bounded: an untracked customer still gets write events, not time events.
        } else {
            self.setKnown(new, for: customerId)
        }
        guard new.encoded != old.encoded || !aliasesChanged.isEmpty else {
            return
        }
        var changes: [EntitlementChange] = []
        for id in Set(old.states.keys).union(new.states.keys).sorted() where old.states[id] != new.states[id] {
            changes.append(EntitlementChange(entitlementId: id, before: old.states[id], after: new.states[id]))
        }
        var current = response
        current.logSequence = new.sequence
        let event = EntitlementsChangedEvent(
            customerId: customerId,
            cause: cause,
            changes: changes,
            current: current,
            logSequence: sequence ?? 0,
            aliasesChanged: aliasesChanged
        )
        self.emit(event, customerId: customerId)
    }

    /// Encodes `event` and delivers it; an event larger than a client accepts
    /// (``AnswerLimit``, as for a RESPONSE) ends the stream instead: a client would take the
    /// frame for a connection error and lose its other calls.
    private func emit(_ event: EntitlementsChangedEvent, customerId: String) {
        guard !self.finished else {
            return  // after its END_OF_STREAM nothing more goes out for the call
        }
        var buffer = ByteBuffer()
        do {
            try event.serialize(into: &buffer)
        } catch {
            self.finish(.internalError, "cannot encode the event for \(customerId): \(error)")
            return
        }
        guard buffer.readableBytes <= AnswerLimit.maximumBytes else {
            self.finish(
                .resourceExhausted,
                "the event for \(customerId) is \(buffer.readableBytes) bytes; an event carries at most \(AnswerLimit.maximumBytes) (watch fewer entitlements, or check that customer instead)"
            )
            return
        }
        self.deliver(buffer)
    }

    private func resolve(_ record: CustomerRecord?, at now: Int64) -> (known: Known, response: CheckEntitlementsResponse) {
        let resolution = self.resolver.resolve(record, at: now, environment: self.environment, entitlementIds: self.entitlementIds)
        var states: [String: EntitlementState] = [:]
        for entitlement in resolution.entitlements {
            if let id = entitlement.id {
                states[id] = EntitlementState(isActive: entitlement.isActive, renewState: entitlement.renewState)
            }
        }
        // The entitlements and until when they hold: a write that moves only validUntil (a
        // grant that starts next week beside an expired purchase) is a change too, or a
        // client keeping the answer until its validUntil would keep it too long.
        // Whether the customer exists is part of it: a customer created or deleted by a write
        // that changes nothing in this environment still changes the answer's customer_id.
        let encoded = (try? CheckEntitlementsResponse(customerId: record?.id, validUntil: resolution.validUntil, entitlements: resolution.entitlements).serializedBytes()) ?? []
        let response = resolution.response(userId: record?.id ?? "", customerId: record?.id, requestDate: now)
        return (Known(encoded: encoded, states: states, validUntil: resolution.validUntil), response)
    }

    /// Keeps `known` as `customerId`'s answer, and when it expires.
    private func setKnown(_ known: Known, for customerId: String) {
        self.known[customerId] = known
        guard let validUntil = known.validUntil else {
            return
        }
        self.expiries.push(validUntil, customerId)
        // Entries of answers since replaced are skipped when they come up; when they
        // outnumber the current ones, the heap is made again from these (amortized: at least
        // as many pushes as the current entries come between two rebuilds).
        if self.expiries.count > 2 * self.known.count + 1_024 {
            self.expiries.rebuild(self.known.compactMap { customerId, known in
                known.validUntil.map { ExpiryHeap.Entry(instant: $0, customerId: customerId) }
            })
        }
    }

    /// The earliest validUntil of the watched answers, dropping entries of replaced ones.
    private func earliestExpiry() -> Int64? {
        while let entry = self.expiries.first, self.known[entry.customerId]?.validUntil != entry.instant {
            self.expiries.removeFirst()
        }
        return self.expiries.first?.instant
    }

    /// One timer, at the earliest validUntil of the watched answers.
    private func armTimer(now: Int64) {
        let earliest = self.earliestExpiry()
        guard earliest != self.timerDeadline else {
            return
        }
        self.timer?.cancel()
        self.timer = nil
        self.timerDeadline = earliest
        guard let earliest else {
            return
        }
        let delay = TimeAmount.milliseconds(max(0, earliest - now))
        self.timer = self.eventLoop.assumeIsolated().scheduleTask(in: delay) {
            self.timerDeadline = nil
            self.timeChanged()
        }
    }

    // MARK: Delivery

    /// Sends `event`, or holds it while the socket is full; too many held ends the stream.
    private func deliver(_ event: ByteBuffer) {
        guard self.socketFull else {
            self.socketFull = !self.sink.send(event)
            return
        }
        self.buffered.append(event)
        if self.buffered.count > self.bufferLimit {
            self.buffered.removeAll()
            self.socketFull = false  // the END_OF_STREAM goes out behind what was sent
            self.finish(
                .resourceExhausted,
                "the watcher fell more than \(self.bufferLimit) events behind; read faster and resubscribe"
            )
        }
    }

    /// The transport can take writes again: send what was held, while it can.
    public func resume() {
        self.socketFull = false
        while !self.buffered.isEmpty, !self.socketFull {
            self.socketFull = !self.sink.send(self.buffered.removeFirst())
        }
    }

    /// Whether the stream has ended.
    public var isFinished: Bool { self.finished }

    /// The caller cancelled the stream: it ends with CANCELLED.
    public func cancel() {
        self.finish(.cancelled, "cancelled by the client")
    }

    /// Ends the stream through the sink with `status` (once).
    public func finish(_ status: StatusCode, _ message: String) {
        guard !self.finished else {
            return
        }
        self.finished = true
        self.timer?.cancel()
        self.timer = nil
        self.deadlineTimer?.cancel()
        self.deadlineTimer = nil
        self.buffered.removeAll()
        self.sink.end(status, status == .ok ? "" : message)
        self.ended(self)
    }

    /// The caller went away: stop without sending anything.
    public func abandon() {
        guard !self.finished else {
            return
        }
        self.finished = true
        self.timer?.cancel()
        self.timer = nil
        self.deadlineTimer?.cancel()
        self.deadlineTimer = nil
        self.ended(self)
    }
}
