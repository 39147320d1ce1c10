public import EntitlementsMessages
import EntitlementsFormats

/// One outbound event: what is kept in the outbox and POSTed to each destination that
/// wants it (docs/events.md, "What is sent").
public struct OutboundEvent: Sendable, Hashable {
    /// Stable: the same event derived again (after a crash, or by another fleet server)
    /// has the same id. `evt_<logSequence>_<n>` for a write's events, `evt_t<instant>_<customer
    /// hash>_<n>` for time's. Receivers dedupe by it.
    public var id: String
    public var type: OutboundEventType
    public var customerId: String
    /// The customer's aliases after the change (before it, for a deletion).
    public var aliases: [String]
    /// When it happened (Unix milliseconds): the write's received date, or the instant
    /// time changed the answer.
    public var occurredAt: Int64
    /// The log sequence the change is at (for a time event, the last write applied when it
    /// was derived): give it to a check's `min_log_sequence` to read at least this state.
    public var logSequence: UInt64
    /// The store environment it is about; nil for what belongs to none (grants, aliases,
    /// a deletion).
    public var environment: Environment?
    /// The store, product and transaction it is about, where there is one; `manual` for
    /// grants.
    public var store: Source?
    public var productId: String?
    public var transactionId: String?
    public var originalTransactionId: String?
    public var grantId: String?
    public var entitlementId: String?
    /// The customer's entitlements (in `environment`, production for none) just before
    /// and just after the change, as `check --json` shows them.
    public var entitlementsBefore: [Entitlement]
    public var entitlementsAfter: [Entitlement]

    public init(
        id: String,
        type: OutboundEventType,
        customerId: String,
        aliases: [String] = [],
        occurredAt: Int64,
        logSequence: UInt64,
        environment: Environment? = nil,
        store: Source? = nil,
        productId: String? = nil,
        transactionId: String? = nil,
        originalTransactionId: String? = nil,
        grantId: String? = nil,
        entitlementId: String? = nil,
        entitlementsBefore: [Entitlement] = [],
        entitlementsAfter: [Entitlement] = []
    ) {
        self.id = id
        self.type = type
        self.customerId = customerId
        self.aliases = aliases
        self.occurredAt = occurredAt
        self.logSequence = logSequence
        self.environment = environment
        self.store = store
        self.productId = productId
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.grantId = grantId
        self.entitlementId = entitlementId
        self.entitlementsBefore = entitlementsBefore
        self.entitlementsAfter = entitlementsAfter
    }

    /// The JSON body POSTed, compact, keys in this fixed order (docs/events.md).
    public var body: [UInt8] {
        let value = JSONValue.object([
            ("id", .string(self.id)),
            ("type", .string(self.type.rawValue)),
            ("customerId", .string(self.customerId)),
            ("aliases", .array(self.aliases.map { .string($0) })),
            ("occurredAt", .date(self.occurredAt)),
            ("logSequence", .int(Int64(clamping: self.logSequence))),
            ("environment", self.environment.map { .name($0) } ?? .null),
            ("store", self.store.map { .name($0) } ?? .null),
            ("productId", .string(self.productId)),
            ("transactionId", .string(self.transactionId)),
            ("originalTransactionId", .string(self.originalTransactionId)),
            ("grantId", .string(self.grantId)),
            ("entitlementId", .string(self.entitlementId)),
            ("entitlementsBefore", EntitlementsOutput.entitlementsValue(self.entitlementsBefore)),
            ("entitlementsAfter", EntitlementsOutput.entitlementsValue(self.entitlementsAfter)),
        ])
        return Array(value.serialized(pretty: false).utf8)
    }

    /// What the outbox keeps beside the body, to route, order and list the event without
    /// parsing it.
    public var summary: EventSummary {
        EventSummary(
            id: self.id,
            type: self.type.rawValue,
            customerId: self.customerId,
            environment: self.environment?.jsonName,
            logSequence: self.logSequence,
            occurredAt: self.occurredAt
        )
    }
}

/// An event as the outbox and the delivery know it: its routing fields and its body.
public struct EventSummary: Sendable, Hashable, Codable {
    public var id: String
    public var type: String
    public var customerId: String
    /// `production`, `sandbox`, or nil.
    public var environment: String?
    public var logSequence: UInt64
    public var occurredAt: Int64

    public init(id: String, type: String, customerId: String, environment: String?, logSequence: UInt64, occurredAt: Int64) {
        self.id = id
        self.type = type
        self.customerId = customerId
        self.environment = environment
        self.logSequence = logSequence
        self.occurredAt = occurredAt
    }
}

/// An event as the outbox keeps it and a fleet's servers share it: its summary, the
/// destinations that want it, and its body as sent.
public struct SharedEvent: Sendable {
    public var summary: EventSummary
    public var destinations: [String]
    public var body: [UInt8]

    public init(summary: EventSummary, destinations: [String], body: [UInt8]) {
        self.summary = summary
        self.destinations = destinations
        self.body = body
    }
}
