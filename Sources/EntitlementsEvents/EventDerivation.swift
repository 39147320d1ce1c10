public import EntitlementsMessages
public import EntitlementsResolver

/// What an outbound event says happened (issue 31, docs/events.md when it lands): store
/// neutral, read from the change itself, never from which store or method sent it.
public enum OutboundEventType: String, Sendable, Hashable, CaseIterable {
    case initialPurchase = "INITIAL_PURCHASE"
    case renewal = "RENEWAL"
    case trialStarted = "TRIAL_STARTED"
    case trialConverted = "TRIAL_CONVERTED"
    /// Auto-renew turned off.
    case cancellation = "CANCELLATION"
    case uncancellation = "UNCANCELLATION"
    case billingIssue = "BILLING_ISSUE"
    /// A subscription's access ended by time (its period, or its grace period, ran out).
    case expiration = "EXPIRATION"
    case refund = "REFUND"
    case refundReversed = "REFUND_REVERSED"
    case productChange = "PRODUCT_CHANGE"
    case grant = "GRANT"
    case grantRevoked = "GRANT_REVOKED"
    /// An alias linked to, moved away from, or removed with the customer.
    case transfer = "TRANSFER"
    case customerDeleted = "CUSTOMER_DELETED"
    case entitlementActivated = "ENTITLEMENT_ACTIVATED"
    case entitlementDeactivated = "ENTITLEMENT_DEACTIVATED"
}

/// One event derived from one change of one customer, before it has an id, a sequence or
/// a destination.
public struct DerivedEvent: Sendable, Hashable {
    public var type: OutboundEventType
    /// The store of the transaction or subscription it is about; `.manual` for grants.
    public var store: Source?
    public var productId: String?
    public var transactionId: String?
    public var originalTransactionId: String?
    /// The grant, for GRANT and GRANT_REVOKED.
    public var grantId: String?
    /// The entitlement, for ENTITLEMENT_ACTIVATED / _DEACTIVATED and EXPIRATION.
    public var entitlementId: String?
    /// The aliases, for TRANSFER.
    public var aliases: [String] = []

    public init(type: OutboundEventType, store: Source? = nil, productId: String? = nil, transactionId: String? = nil,
                originalTransactionId: String? = nil, grantId: String? = nil, entitlementId: String? = nil, aliases: [String] = []) {
        self.type = type
        self.store = store
        self.productId = productId
        self.transactionId = transactionId
        self.originalTransactionId = originalTransactionId
        self.grantId = grantId
        self.entitlementId = entitlementId
        self.aliases = aliases
    }
}

/// The rules that turn a change into events. Pure: the records before and after a write
/// (or the answers before and after an instant passed, for time) in, events out, in a
/// fixed order (the record's own events first, by kind, then entitlement activations and
/// deactivations by entitlement id), so that deriving twice gives the same list and the
/// same ids.
public enum EventDerivation {
    /// The events of one write to one customer. `answerBefore` and `answerAfter` are the
    /// customer's answers just before and just after the write, at its instant.
    public static func events(
        before: CustomerRecord?,
        after: CustomerRecord?,
        answerBefore: Resolution,
        answerAfter: Resolution
    ) -> [DerivedEvent] {
        Self.recordEvents(before: before, after: after) + Self.entitlementEvents(from: answerBefore, to: answerAfter, byTime: false)
    }

    /// The events of the record's own change (purchases, refunds, subscription states,
    /// grants, aliases, deletion), without the entitlement changes they cause.
    public static func recordEvents(before: CustomerRecord?, after: CustomerRecord?) -> [DerivedEvent] {
        if before != nil, after == nil {
            return [DerivedEvent(type: .customerDeleted, aliases: (before?.aliases ?? []).sorted())]
        }
        let after = after ?? CustomerRecord()
        let before = before ?? CustomerRecord()
        var events = Self.transactionEvents(before: before, after: after)
        events += Self.subscriptionEvents(before: before, after: after)
        events += Self.grantEvents(before: before, after: after)
        let aliasesChanged = Set(before.aliases).symmetricDifference(after.aliases).sorted()
        if !aliasesChanged.isEmpty {
            events.append(DerivedEvent(type: .transfer, aliases: aliasesChanged))
        }
        return events
    }

    /// The events of time passing with no write: the customer's answer at the instant its
    /// last answer's validUntil named, against that last answer. An entitlement that a
    /// subscription held and time ended is an EXPIRATION as well as a deactivation.
    public static func timeEvents(from old: Resolution, to new: Resolution) -> [DerivedEvent] {
        Self.entitlementEvents(from: old, to: new, byTime: true)
    }

    // MARK: Transactions

    private struct ChainKey: Hashable {
        var store: Source
        var originalTransactionId: String
    }

    private static func key(_ transaction: Transaction) -> String {
        "\(transaction.store.rawValue) \(transaction.transactionId ?? "")"
    }

    private static func transactionEvents(before: CustomerRecord, after: CustomerRecord) -> [DerivedEvent] {
        var known: [String: Transaction] = [:]
        for transaction in before.transactions {
            known[Self.key(transaction)] = transaction
        }
        var events: [DerivedEvent] = []
        for transaction in after.transactions {
            let event = { (type: OutboundEventType) in
                DerivedEvent(type: type, store: transaction.store, productId: transaction.productId,
                             transactionId: transaction.transactionId, originalTransactionId: transaction.originalTransactionId)
            }
            guard let old = known[Self.key(transaction)] else {
                // New: where it stands in its chain says what it is.
                let earlier = before.transactions.filter {
                    $0.store == transaction.store && $0.originalTransactionId == transaction.originalTransactionId
                        && ($0.transactionDate ?? 0) <= (transaction.transactionDate ?? 0)
                }.max { ($0.transactionDate ?? 0) < ($1.transactionDate ?? 0) }
                events.append(event(Self.purchaseType(transaction, previous: earlier)))
                if transaction.revocationDate != nil {
                    events.append(event(.refund))
                }
                continue
            }
            switch (old.revocationDate, transaction.revocationDate) {
            case (nil, .some(let revoked)):
                // A chain the store ended early (its state's endedDate) cuts its running
                // transaction there: an end of access, not a refund.
                let ended = after.subscriptions.contains {
                    $0.store == transaction.store && $0.originalTransactionId == transaction.originalTransactionId && $0.endedDate == revoked
                }
                events.append(event(ended ? .expiration : .refund))
            case (.some, nil): events.append(event(.refundReversed))
            default: break
            }
        }
        return events
    }

    private static func purchaseType(_ transaction: Transaction, previous: Transaction?) -> OutboundEventType {
        guard let previous else {
            return transaction.type == .trialStarted ? .trialStarted : .initialPurchase
        }
        if previous.productId != transaction.productId {
            return .productChange
        }
        if previous.type == .trialStarted, transaction.type != .trialStarted {
            return .trialConverted
        }
        return .renewal
    }

    // MARK: Subscription states

    private static func subscriptionEvents(before: CustomerRecord, after: CustomerRecord) -> [DerivedEvent] {
        var known: [ChainKey: SubscriptionState] = [:]
        for state in before.subscriptions {
            known[ChainKey(store: state.store, originalTransactionId: state.originalTransactionId ?? "")] = state
        }
        var events: [DerivedEvent] = []
        for state in after.subscriptions {
            let old = known[ChainKey(store: state.store, originalTransactionId: state.originalTransactionId ?? "")]
            let event = { (type: OutboundEventType) in
                DerivedEvent(type: type, store: state.store, originalTransactionId: state.originalTransactionId)
            }
            // A chain first seen with auto-renew off was cancelled by this write as far as
            // anyone told of it knows; one seen with it on started renewing, which the
            // purchase's own event says.
            let renewedBefore = old?.autoRenewEnabled ?? true
            let renewsNow = state.autoRenewEnabled
            if renewedBefore, !renewsNow {
                events.append(event(.cancellation))
            } else if old != nil, !renewedBefore, renewsNow {
                events.append(event(.uncancellation))
            }
            let troubledBefore = old.map { $0.billingIssueDetectedDate != nil || $0.isInBillingRetry } ?? false
            let troubledNow = state.billingIssueDetectedDate != nil || state.isInBillingRetry
            if troubledNow, !troubledBefore {
                events.append(event(.billingIssue))
            }
        }
        return events
    }

    // MARK: Grants

    private static func grantEvents(before: CustomerRecord, after: CustomerRecord) -> [DerivedEvent] {
        var known: [String: Grant] = [:]
        for grant in before.grants {
            known[grant.grantId ?? ""] = grant
        }
        var events: [DerivedEvent] = []
        for grant in after.grants {
            let old = known[grant.grantId ?? ""]
            let event = { (type: OutboundEventType) in
                DerivedEvent(type: type, store: .manual, grantId: grant.grantId, entitlementId: grant.entitlementId)
            }
            if old == nil {
                events.append(event(.grant))
            }
            if grant.revokedDate != nil, old?.revokedDate == nil {
                events.append(event(.grantRevoked))
            }
        }
        return events
    }

    // MARK: Entitlements

    /// ENTITLEMENT_ACTIVATED and _DEACTIVATED for each entitlement whose `isActive` differs
    /// between the answers, by entitlement id; `byTime` (no write: time passed) adds an
    /// EXPIRATION before the deactivation of one a purchase held.
    public static func entitlementEvents(from old: Resolution, to new: Resolution, byTime: Bool) -> [DerivedEvent] {
        var before: [String: Entitlement] = [:]
        for entitlement in old.entitlements {
            before[entitlement.id ?? ""] = entitlement
        }
        var after: [String: Entitlement] = [:]
        for entitlement in new.entitlements {
            after[entitlement.id ?? ""] = entitlement
        }
        var events: [DerivedEvent] = []
        for id in Set(before.keys).union(after.keys).sorted() {
            let was = before[id]?.isActive == true
            let now = after[id]?.isActive == true
            guard was != now else { continue }
            let entitlement = now ? after[id] : before[id]
            let store = entitlement?.source
            if !now, byTime, entitlement?.grantType != .manual, entitlement?.productId != nil {
                events.append(DerivedEvent(type: .expiration, store: store, productId: entitlement?.productId, entitlementId: id))
            }
            events.append(DerivedEvent(type: now ? .entitlementActivated : .entitlementDeactivated, store: store, productId: entitlement?.productId, entitlementId: id))
        }
        return events
    }
}
