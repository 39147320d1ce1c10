public import EntitlementsMessages

/// Where events are POSTed, and which (docs/events.md, "Destinations").
public struct EventDestination: Sendable, Hashable {
    /// How the outbox, metrics and `events list` name it: the configuration's `name`, or
    /// the URL.
    public var name: String
    public var url: String
    /// The signing secrets: each POST carries one `v1` signature per secret.
    public var secrets: [String]
    /// The event types it takes; nil: all.
    public var types: Set<OutboundEventType>?
    /// The environment whose events it takes; nil: both. Events of no environment
    /// (grants, aliases, deletions) go to every destination their type passes.
    public var environment: Environment?

    public init(name: String? = nil, url: String, secrets: [String], types: Set<OutboundEventType>? = nil, environment: Environment? = nil) {
        self.name = name ?? url
        self.url = url
        self.secrets = secrets
        self.types = types
        self.environment = environment
    }

    public func wants(_ event: OutboundEvent) -> Bool {
        if let types = self.types, !types.contains(event.type) {
            return false
        }
        if let environment = self.environment, let eventEnvironment = event.environment, eventEnvironment != environment {
            return false
        }
        return true
    }
}

/// The settings of outbound events.
public struct EventsConfiguration: Sendable {
    public var destinations: [EventDestination]
    public var policy: EventLedger.RetryPolicy
    /// The most bytes the outbox holds for undelivered events; past it the oldest are
    /// dropped (given up, logged, counted).
    public var outboxLimit: UInt64
    /// One POST's limit, from connecting to the end of the answer.
    public var requestTimeout: Duration
    /// POSTs in flight at once, per destination (each to a different customer).
    public var concurrency: Int

    public init(
        destinations: [EventDestination],
        policy: EventLedger.RetryPolicy = .init(),
        outboxLimit: UInt64 = 1 << 30,
        requestTimeout: Duration = .seconds(10),
        concurrency: Int = 8
    ) {
        self.destinations = destinations
        self.policy = policy
        self.outboxLimit = outboxLimit
        self.requestTimeout = requestTimeout
        self.concurrency = concurrency
    }
}

/// Customers' next time changes: when each one's answer changes with no write, earliest
/// first.
struct TimeSchedule: Sendable {
    struct Due: Comparable, Sendable {
        var at: Int64
        var customerId: String
        var generation: UInt64
        static func < (lhs: Self, rhs: Self) -> Bool { (lhs.at, lhs.customerId) < (rhs.at, rhs.customerId) }
    }

    private var heap = Heap<Due>()
    private var current: [String: (at: Int64, generation: UInt64)] = [:]
    private var generation: UInt64 = 0

    /// `customerId`'s next change is at `instant` (nil: none).
    mutating func set(_ customerId: String, at instant: Int64?) {
        guard let instant else {
            self.current[customerId] = nil
            return
        }
        if self.current[customerId]?.at == instant {
            return
        }
        self.generation &+= 1
        self.current[customerId] = (instant, self.generation)
        self.heap.append(Due(at: instant, customerId: customerId, generation: self.generation))
    }

    func next(of customerId: String) -> Int64? {
        self.current[customerId]?.at
    }

    /// The customers due by `now` (at most `limit`), each with its instant, taken off the
    /// schedule.
    mutating func takeDue(now: Int64, limit: Int = .max) -> [(customerId: String, at: Int64)] {
        var due: [(String, Int64)] = []
        while due.count < limit, let top = self.heap.min, top.at <= now {
            _ = self.heap.removeMin()
            guard let current = self.current[top.customerId], current.generation == top.generation else {
                continue
            }
            self.current[top.customerId] = nil
            due.append((top.customerId, top.at))
        }
        return due
    }

    /// Whether nothing is scheduled at or before `instant`.
    mutating func earliestIsAfter(_ instant: Int64) -> Bool {
        (self.earliest() ?? .max) > instant
    }

    /// The earliest instant scheduled (stale entries on top are dropped on the way).
    mutating func earliest() -> Int64? {
        while let top = self.heap.min {
            if self.current[top.customerId]?.generation == top.generation {
                return top.at
            }
            _ = self.heap.removeMin()
        }
        return nil
    }
}
