public import NIOCore

/// Where each event stands with each destination, and what to send next: pure state, no
/// I/O (the ``Outbox`` persists its changes; ``EventDelivery`` sends). docs/events.md,
/// "Delivery promises".
///
/// Per destination, a customer's events form a queue sent one at a time, in the order
/// they were derived (log order): the next is sent once the one before is delivered or
/// given up. Customers are independent: one failing or slow customer holds up only its own
/// queue. Customers ready to send wait in a heap by the instant of their next attempt.
public struct EventLedger: Sendable {
    public enum Status: String, Sendable, Codable {
        /// Not yet sent, or sent and not yet answered.
        case pending
        /// Its last attempt failed; another comes at `nextAttemptAt`.
        case retrying
        case delivered
        /// Retried until the horizon passed (or dropped when the outbox was full).
        case givenUp = "given_up"
    }

    /// One event's delivery to one destination.
    public struct Delivery: Sendable, Hashable, Codable {
        public var status: Status = .pending
        public var attempts = 0
        public var firstAttemptAt: Int64?
        public var lastAttemptAt: Int64?
        public var nextAttemptAt: Int64?
        /// What the last attempt got: `HTTP 500`, `timeout` ...
        public var lastResult: String?

        var isSettled: Bool { self.status == .delivered || self.status == .givenUp }
    }

    /// An event the outbox holds.
    public struct Entry: Sendable {
        public var summary: EventSummary
        /// The destinations that want it (decided when it was derived), in order.
        public var destinations: [String]
        public var deliveries: [String: Delivery]
        /// Where its body is in the outbox file.
        public var bodyOffset: UInt64
        public var bodyLength: Int
        /// Its place in the order of derivation.
        var serial: Int

        public var isSettled: Bool { self.destinations.allSatisfy { self.deliveries[$0]?.isSettled ?? true } }
    }

    /// One destination's queues.
    struct Lane: Sendable {
        /// Each customer's unsettled events, oldest first.
        var queues: [String: CircularBuffer<String>] = [:]
        /// (instant of the next attempt, customer, generation): customers whose first event
        /// may be sent then. An entry whose generation is not the customer's current one is
        /// stale and skipped.
        var ready = Heap<ReadyCustomer>()
        var generations: [String: UInt64] = [:]
        /// Generations are drawn from one counter, so that a customer's entry made stale
        /// before its queue emptied can never match a later one.
        var nextGeneration: UInt64 = 0
        var inFlight: Set<String> = []
        /// Answered 410 Gone: nothing more is sent to it until a restart.
        var disabled: String?
        var unsettled = 0
    }

    struct ReadyCustomer: Comparable, Sendable {
        var at: Int64
        var customerId: String
        var generation: UInt64
        static func < (lhs: Self, rhs: Self) -> Bool { (lhs.at, lhs.customerId) < (rhs.at, rhs.customerId) }
    }

    /// How retries are spaced.
    public struct RetryPolicy: Sendable, Hashable {
        /// The first retry waits this long (milliseconds); each next one twice as long.
        public var initialInterval: Int64 = 1_000
        /// No retry waits longer than this.
        public var maxInterval: Int64 = 600_000
        /// An event still failing this long after its first attempt is given up.
        public var horizon: Int64 = 72 * 3_600_000

        public init(initialInterval: Int64 = 1_000, maxInterval: Int64 = 600_000, horizon: Int64 = 72 * 3_600_000) {
            self.initialInterval = initialInterval
            self.maxInterval = maxInterval
            self.horizon = horizon
        }

        /// The wait before attempt `attempts + 1` after `attempts` failures, before jitter.
        public func interval(afterFailures attempts: Int) -> Int64 {
            let doublings = min(max(attempts - 1, 0), 40)
            return min(self.maxInterval, self.initialInterval << doublings)
        }
    }

    public private(set) var entries: [String: Entry] = [:]
    /// Ids in the order of derivation (ids of events dropped since are skipped).
    private(set) var order: [String] = []
    private var lanes: [String: Lane] = [:]
    private var nextSerial = 0
    public let policy: RetryPolicy

    public init(destinations: [String], policy: RetryPolicy = RetryPolicy()) {
        self.policy = policy
        for name in destinations {
            self.lanes[name] = Lane()
        }
    }

    /// Adds a derived event, queued to each of `destinations` this ledger delivers to.
    /// Returns false (and changes nothing) if an event with its id is held already.
    @discardableResult
    public mutating func add(_ summary: EventSummary, destinations: [String], bodyOffset: UInt64, bodyLength: Int, now: Int64) -> Bool {
        guard self.entries[summary.id] == nil else {
            return false
        }
        let wanted = destinations.filter { self.lanes[$0] != nil }
        var entry = Entry(summary: summary, destinations: wanted, deliveries: [:], bodyOffset: bodyOffset, bodyLength: bodyLength, serial: self.nextSerial)
        self.nextSerial += 1
        for name in wanted {
            entry.deliveries[name] = Delivery()
            self.enqueue(summary.id, customer: summary.customerId, lane: name, now: now)
        }
        self.entries[summary.id] = entry
        self.order.append(summary.id)
        return true
    }

    /// Changes lane `name` in place. (Not through a copy: changing a copy of a lane would
    /// copy its dictionaries, whose size is the backlog, at every event.)
    @discardableResult
    private mutating func withLane<T>(_ name: String, _ body: (inout Lane) -> T) -> T? {
        guard self.lanes[name] != nil else {
            return nil
        }
        return body(&self.lanes[name]!)
    }

    private mutating func enqueue(_ id: String, customer: String, lane name: String, now: Int64) {
        let wasEmpty = self.withLane(name) { lane in
            let wasEmpty = lane.queues[customer]?.isEmpty ?? true
            lane.queues[customer, default: []].append(id)
            lane.unsettled += 1
            return wasEmpty
        }
        if wasEmpty == true {
            self.makeReady(customer, lane: name, at: now)
        }
    }

    private mutating func makeReady(_ customer: String, lane name: String, at instant: Int64) {
        self.withLane(name) { lane in
            lane.nextGeneration &+= 1
            let generation = lane.nextGeneration
            lane.generations[customer] = generation
            lane.ready.append(ReadyCustomer(at: instant, customerId: customer, generation: generation))
        }
    }

    /// Up to `limit` events to send to `destination` now (each the first unsettled event of
    /// its customer, due by `now`), marked in flight; nothing while it is disabled.
    public mutating func due(for destination: String, now: Int64, limit: Int) -> [Entry] {
        let ids = self.withLane(destination) { lane -> [String] in
            guard lane.disabled == nil else {
                return []
            }
            var ids: [String] = []
            while ids.count < limit, let top = lane.ready.min, top.at <= now {
                _ = lane.ready.removeMin()
                guard lane.generations[top.customerId] == top.generation, !lane.inFlight.contains(top.customerId),
                    let id = lane.queues[top.customerId]?.first
                else {
                    continue
                }
                lane.inFlight.insert(top.customerId)
                ids.append(id)
            }
            return ids
        } ?? []
        return ids.compactMap { self.entries[$0] }
    }

    /// The outcome of sending event `id` to `destination` at `now`: delivered, or failed
    /// with `result` (then retried after the policy's interval plus `jitter` milliseconds,
    /// or given up past the horizon). Returns the delivery's new state.
    @discardableResult
    public mutating func attempted(_ id: String, destination: String, delivered: Bool, result: String, now: Int64, jitter: Int64 = 0) -> Delivery? {
        guard var entry = self.entries[id], var delivery = entry.deliveries[destination], !delivery.isSettled else {
            // Settled meanwhile (another fleet server recorded it): the send changes nothing.
            return nil
        }
        delivery.attempts += 1
        delivery.firstAttemptAt = delivery.firstAttemptAt ?? now
        delivery.lastAttemptAt = now
        delivery.lastResult = result
        if delivered {
            delivery.status = .delivered
            delivery.nextAttemptAt = nil
        } else {
            let next = now + self.policy.interval(afterFailures: delivery.attempts) + jitter
            if next - (delivery.firstAttemptAt ?? now) > self.policy.horizon {
                delivery.status = .givenUp
                delivery.nextAttemptAt = nil
            } else {
                delivery.status = .retrying
                delivery.nextAttemptAt = next
            }
        }
        entry.deliveries[destination] = delivery
        self.entries[id] = entry
        self.noteIfDelivered(entry)
        self.afterAttempt(entry, delivery, destination: destination, now: now)
        return delivery
    }

    /// The events delivered to every destination that wanted them: what the outbox may
    /// forget (kept as a set, so that finding them does not read every event held).
    public private(set) var deliveredEverywhere: Set<String> = []

    private mutating func noteIfDelivered(_ entry: Entry) {
        if entry.destinations.allSatisfy({ entry.deliveries[$0]?.status == .delivered }) {
            self.deliveredEverywhere.insert(entry.summary.id)
        }
    }

    /// Replays a recorded delivery state (the outbox's journal at opening, or an outcome
    /// another server of a fleet recorded): ignored for an event settled here, or older
    /// than what is known here. Returns the state applied.
    /// (`replaying`: the outbox's own journal, in order, where a later line always wins.)
    @discardableResult
    public mutating func restore(_ id: String, destination: String, delivery: Delivery, now: Int64, replaying: Bool = false) -> Delivery? {
        guard var entry = self.entries[id], let old = entry.deliveries[destination], !old.isSettled,
            replaying || delivery.isSettled || delivery.attempts >= old.attempts, delivery != old
        else {
            return nil
        }
        entry.deliveries[destination] = delivery
        self.entries[id] = entry
        self.noteIfDelivered(entry)
        if delivery.isSettled {
            // Being sent here, perhaps: its answer will change nothing; the customer goes on.
            if self.lanes[destination]?.queues[entry.summary.customerId]?.first == id {
                self.lanes[destination]?.inFlight.remove(entry.summary.customerId)
            }
            self.settle(entry, destination: destination, now: now)
        } else if let next = delivery.nextAttemptAt, self.lanes[destination]?.queues[entry.summary.customerId]?.first == id,
            self.lanes[destination]?.inFlight.contains(entry.summary.customerId) != true
        {
            self.makeReady(entry.summary.customerId, lane: destination, at: next)
        }
        return delivery
    }

    private mutating func afterAttempt(_ entry: Entry, _ delivery: Delivery, destination: String, now: Int64) {
        let customer = entry.summary.customerId
        self.lanes[destination]?.inFlight.remove(customer)
        if delivery.isSettled {
            self.settle(entry, destination: destination, now: now)
        } else {
            self.makeReady(customer, lane: destination, at: delivery.nextAttemptAt ?? now)
        }
    }

    /// Takes a settled event off its customer's queue; the next one becomes ready.
    private mutating func settle(_ entry: Entry, destination: String, now: Int64) {
        let customer = entry.summary.customerId
        let next = self.withLane(destination) { lane -> Bool in
            guard let position = lane.queues[customer]?.firstIndex(of: entry.summary.id) else {
                return false
            }
            let wasHead = position == lane.queues[customer]!.startIndex
            lane.queues[customer]!.remove(at: position)
            lane.unsettled -= 1
            if lane.queues[customer]!.isEmpty {
                lane.queues[customer] = nil
                lane.generations[customer] = nil
                return false
            }
            return wasHead
        }
        if next == true {
            self.makeReady(customer, lane: destination, at: now)
        }
    }

    /// `destination` answered 410 Gone: it is sent nothing more (its events stay).
    public mutating func disable(_ destination: String, reason: String) {
        self.lanes[destination]?.disabled = reason
    }

    public func disabledReason(_ destination: String) -> String? {
        self.lanes[destination]?.disabled
    }

    /// Events not yet delivered to (or given up by) `destination`.
    public func unsettledCount(_ destination: String) -> Int {
        self.lanes[destination]?.unsettled ?? 0
    }

    /// The derivation instant of the oldest event `destination` still has to deliver.
    public func oldestUnsettled(_ destination: String) -> Int64? {
        guard let lane = self.lanes[destination] else {
            return nil
        }
        return lane.queues.values.compactMap { $0.first.flatMap { self.entries[$0]?.summary.occurredAt } }.min()
    }

    /// Sends event `id` again to each destination that wanted it: a retrying one at once;
    /// a delivered or given-up one queued again behind its customer's waiting events.
    /// Returns whether the event is held.
    public mutating func redeliver(_ id: String, now: Int64) -> Bool {
        guard var entry = self.entries[id] else {
            return false
        }
        self.deliveredEverywhere.remove(id)
        for destination in entry.destinations {
            guard var delivery = entry.deliveries[destination] else { continue }
            if delivery.isSettled {
                delivery = Delivery()
                entry.deliveries[destination] = delivery
                self.entries[id] = entry
                self.enqueue(id, customer: entry.summary.customerId, lane: destination, now: now)
            } else if delivery.status == .retrying, self.lanes[destination]?.queues[entry.summary.customerId]?.first == id {
                delivery.nextAttemptAt = now
                entry.deliveries[destination] = delivery
                self.entries[id] = entry
                self.makeReady(entry.summary.customerId, lane: destination, at: now)
            }
        }
        return true
    }

    /// Forgets event `id` (settled everywhere, or dropped). One being sent is let go: its
    /// outcome, when it comes, changes nothing, and its customer's next event is ready.
    public mutating func remove(_ id: String, now: Int64) {
        guard var entry = self.entries[id] else {
            return
        }
        for destination in entry.destinations where !(entry.deliveries[destination]?.isSettled ?? true) {
            entry.deliveries[destination]?.status = .givenUp
            if self.lanes[destination]?.queues[entry.summary.customerId]?.first == id {
                self.lanes[destination]?.inFlight.remove(entry.summary.customerId)
            }
            self.settle(entry, destination: destination, now: now)
        }
        self.entries[id] = nil
        self.deliveredEverywhere.remove(id)
    }

    /// The held events in the order of derivation.
    public var ordered: [Entry] {
        self.order.compactMap { self.entries[$0] }
    }

    /// Drops the ids of removed events from the order (after a rewrite).
    public mutating func compactOrder() {
        // Once most of it is gone: each pass reads all of it.
        if self.order.count > 2 * self.entries.count + 64 {
            self.order.removeAll { self.entries[$0] == nil }
        }
    }

    /// Points event `id`'s body at its place in a rewritten outbox file.
    public mutating func moveBody(_ id: String, to offset: UInt64) {
        self.entries[id]?.bodyOffset = offset
    }
}

/// A binary min-heap.
struct Heap<Element: Comparable & Sendable>: Sendable {
    private var items: [Element] = []

    var min: Element? { self.items.first }

    mutating func append(_ element: Element) {
        self.items.append(element)
        var child = self.items.count - 1
        while child > 0 {
            let parent = (child - 1) / 2
            guard self.items[child] < self.items[parent] else { break }
            self.items.swapAt(child, parent)
            child = parent
        }
    }

    mutating func removeMin() -> Element? {
        guard !self.items.isEmpty else { return nil }
        self.items.swapAt(0, self.items.count - 1)
        let smallest = self.items.removeLast()
        var parent = 0
        while true {
            let left = 2 * parent + 1
            let right = left + 1
            var least = parent
            if left < self.items.count, self.items[left] < self.items[least] { least = left }
            if right < self.items.count, self.items[right] < self.items[least] { least = right }
            guard least != parent else { break }
            self.items.swapAt(parent, least)
            parent = least
        }
        return smallest
    }
}
