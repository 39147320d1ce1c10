import EntitlementsMessages

/// App Store Server Notifications V2 as writes (docs/ingestion.md, "App Store"). Pure: the
/// verified payloads and the catalog in, a plan out.
///
/// A notification's `data` carries the latest transaction of the subscription
/// (`signedTransactionInfo`) and its renewal state (`signedRenewalInfo`), each a JWS
/// verified like the notification. Every handled type writes what its payloads hold: the
/// transaction (a new period, a refund's revocation, a family member's loss of access) and
/// the renewal state, dated by the notification's `signedDate` so an older notification
/// delivered late never rolls the state back.
public struct AppStoreNotifications: Sendable {
    /// The apps whose notifications are accepted (`--appstore-bundle-id`): every app's
    /// notifications are signed by Apple, so the bundle id is what tells ours apart.
    public let bundleIds: Set<String>

    public init(bundleIds: Set<String>) {
        self.bundleIds = bundleIds
    }

    /// The alias an App Store subscription (its original transaction id) is linked to a user under.
    static func alias(ofOriginalTransaction id: String) -> String { "appstore:" + id }

    /// The notification types that write; every other type is answered 2xx and ignored.
    public static let handled: Set<String> = [
        "SUBSCRIBED", "DID_RENEW", "DID_CHANGE_RENEWAL_STATUS", "DID_CHANGE_RENEWAL_PREF", "DID_FAIL_TO_RENEW",
        "GRACE_PERIOD_EXPIRED", "EXPIRED", "REFUND", "REFUND_REVERSED", "REVOKE", "OFFER_REDEEMED", "PRICE_INCREASE",
        "ONE_TIME_CHARGE",
    ]

    /// The signed parts of a handled notification, verified by the caller.
    struct Signed: Sendable {
        var transaction: EventJSON?
        var renewal: EventJSON?
    }

    /// Checks what must hold before the signed parts are verified: the fields every
    /// notification has, and that it is one of ours. Returns nil when the type is handled,
    /// else the reason it is ignored.
    func screen(_ notification: EventJSON) throws(IngestionRejection) -> String? {
        guard let type = notification["notificationType"].string, notification["notificationUUID"].string != nil,
            notification["signedDate"].int64 != nil
        else {
            throw IngestionRejection(.missingField, "not an App Store Server Notification V2: notificationType, notificationUUID and signedDate are required")
        }
        if let bundleId = notification["data"]["bundleId"].string, !self.bundleIds.contains(bundleId) {
            throw IngestionRejection(.otherApp, "\(type): bundleId \(bundleId) is not one of --appstore-bundle-id (\(self.bundleIds.sorted().joined(separator: ", ")))")
        }
        guard Self.handled.contains(type) else {
            return type == "TEST" ? "test" : "unhandled_type"
        }
        guard notification["data"]["bundleId"].string != nil else {
            throw IngestionRejection(.missingField, "\(type): data.bundleId missing")
        }
        return nil
    }

    func plan(_ notification: EventJSON, _ signed: Signed, catalogContains: (String) -> Bool) throws -> StoreEventPlan {
        let type = notification["notificationType"].string!
        let subtype = notification["subtype"].string
        let eventDate = notification["signedDate"].int64!
        guard let transaction = signed.transaction else {
            throw IngestionRejection(.missingField, "\(type): data.signedTransactionInfo missing")
        }
        let record: Transaction
        switch try self.record(transaction, what: type, environment: notification["data"]["environment"].string, catalogContains: catalogContains) {
        case .ignore(let reason): return .ignore(reason: reason)
        case .record(let recorded): record = recorded
        }
        let original = record.originalTransactionId!
        let kind = transaction["type"].string
        // The transaction's own revocation (a refund) replaces the stored one, as does its
        // absence in REFUND_REVERSED (Apple sends the transaction as it now is); any other
        // notification without one keeps a stored refund.
        var writes: [StoreWrite] = [.transaction(record, keepRevocation: record.revocationDate == nil && type != "REFUND_REVERSED")]
        if kind == "Auto-Renewable Subscription", let renewal = signed.renewal {
            writes.append(.state(Self.state(renewal, original: original, type: type, subtype: subtype, eventDate: eventDate, lastExpiration: record.expirationDate)))
        }
        let identity: StoreIdentity
        let alias = Self.alias(ofOriginalTransaction: original)
        if let token = transaction["appAccountToken"].string, !token.isEmpty {
            identity = .accountToken(token.lowercased(), chainAlias: alias)
        } else {
            identity = .storeCustomer(alias)
        }
        return .apply(identity: identity, writes: writes)
    }

    /// A verified `signedTransactionInfo` (or a StoreKit 2 transaction's JWS) as the
    /// transaction it records, or why it records none.
    enum Recorded {
        case record(Transaction)
        case ignore(String)
    }

    /// `what` names the transaction in messages (the notification's type, or the call);
    /// `environment` is the notification's, for a transaction without its own.
    func record(_ transaction: EventJSON, what context: String, environment: String?, catalogContains: (String) -> Bool) throws -> Recorded {
        guard let transactionId = transaction["transactionId"].string, let original = transaction["originalTransactionId"].string else {
            throw IngestionRejection(.missingField, "\(context): transactionId and originalTransactionId are required in signedTransactionInfo")
        }
        if let bundleId = transaction["bundleId"].string, !self.bundleIds.contains(bundleId) {
            throw IngestionRejection(.otherApp, "\(context): the transaction's bundleId \(bundleId) is not one of --appstore-bundle-id")
        }
        let what = "\(context) \(transactionId)"
        let kind = transaction["type"].string
        switch kind {
        case "Auto-Renewable Subscription", "Non-Consumable":
            break
        case "Consumable":
            return .ignore("consumable")  // used up, never an entitlement
        case nil:
            throw IngestionRejection(.missingField, "\(what): type missing in signedTransactionInfo")
        default:
            // Non-Renewing Subscription: Apple sends no expiration for it; the app's backend
            // records it with the period it sells (docs/ingestion.md).
            return .ignore("non_renewing_subscription")
        }
        guard let productId = transaction["productId"].string, let purchased = transaction["purchaseDate"].int64 else {
            throw IngestionRejection(.missingField, "\(what): productId and purchaseDate are required in signedTransactionInfo")
        }
        guard catalogContains(productId) else {
            throw IngestionRetry(
                .unknownProduct,
                "\(what): product \(productId) is not in the catalog; add it, and Apple's retry (or the call again) will record it"
            )
        }

        var record = Transaction(
            originalTransactionId: original,
            transactionId: transactionId,
            store: .appstore,
            productId: productId,
            transactionDate: purchased,
            revocationDate: transaction["revocationDate"].int64,
            environment: Self.environment(transaction["environment"].string ?? environment),
            ownershipType: transaction["inAppOwnershipType"].string == "FAMILY_SHARED" ? .familySharing : .owner,
            verified: true
        )
        // `price` is in milliunits of `currency` (9.99 is 9990).
        if let price = transaction["price"].int64, (0...Int64.max / 1000).contains(price), let currency = StorePrice.currency(transaction["currency"].string) {
            record.priceMicros = price * 1000
            record.currency = currency
        }
        if kind == "Non-Consumable" {
            record.type = .nonConsumablePurchase
        } else {
            guard let expires = transaction["expiresDate"].int64, expires > purchased else {
                throw IngestionRejection(.missingField, "\(what): an auto-renewable subscription needs expiresDate after purchaseDate")
            }
            record.expirationDate = expires
            record.type = Self.transactionType(transaction, isFirst: transactionId == original)
            if transaction["offerType"].int64 == 3 {
                record.offerCode = transaction["offerIdentifier"].string  // the offer code's reference name
            }
        }

        return .record(record)
    }

    /// The renewal state of `signedRenewalInfo`; `type` is the notification's, or
    /// ``apiRead`` for the App Store Server API's answer.
    static func state(_ renewal: EventJSON, original: String, type: String, subtype: String?, eventDate: Int64, lastExpiration: Int64?) -> SubscriptionState {
        var state = SubscriptionState(store: .appstore, originalTransactionId: original)
        state.eventDate = eventDate
        let renews = renewal["autoRenewStatus"].int64 == 1
        state.autoRenewEnabled = renews
        if !renews, type == "DID_CHANGE_RENEWAL_STATUS", subtype == "AUTO_RENEW_DISABLED" {
            // The only notification that says when; the write rules keep the date while
            // later states still say auto-renew is off.
            state.autoRenewDisabledDate = eventDate
        }
        switch renewal["expirationIntent"].int64 {
        case 1: state.cancellationReason = .customer
        case 2: state.cancellationReason = .billingError
        case 3: state.cancellationReason = .priceIncrease
        case 4: state.cancellationReason = .productUnavailable
        case 5: state.cancellationReason = .unknown
        default:
            if !renews, type == "DID_CHANGE_RENEWAL_STATUS" || type == Self.apiRead {
                state.cancellationReason = .customer  // the customer turned auto-renew off
            }
        }
        switch renewal["priceIncreaseStatus"].int64 {
        case 0: state.priceConsentStatus = .notified
        case 1: state.priceConsentStatus = .agreed
        default: break
        }
        let retrying = renewal["isInBillingRetryPeriod"].bool == true
        state.isInBillingRetry = retrying
        if let grace = renewal["gracePeriodExpiresDate"].int64, retrying || type == "GRACE_PERIOD_EXPIRED" {
            state.gracePeriodExpirationDate = grace
        }
        if retrying || type == "DID_FAIL_TO_RENEW" || type == "GRACE_PERIOD_EXPIRED" {
            // The renewal failed when the last period ended.
            state.billingIssueDetectedDate = lastExpiration
        }
        return state
    }

    /// The `type` of a state read from the App Store Server API.
    static let apiRead = "API"

    /// The writes of one subscription as the App Store Server API reads it (an item of Get
    /// All Subscription Statuses' `lastTransactions`, its two JWS verified): its latest
    /// transaction and its renewal state, dated by the renewal info's `signedDate` (when
    /// Apple read it), so a notification signed later still wins and an older one does not.
    /// With `onlyNews`, the state is written only when it differs from the stored one by
    /// more than its date (``StoreWrite/stateIfNew(_:)``).
    func apiWrites(transaction: EventJSON, renewal: EventJSON?, onlyNews: Bool, catalogContains: (String) -> Bool) throws -> [StoreWrite] {
        guard case .record(let record) = try self.record(transaction, what: "Get All Subscription Statuses", environment: nil, catalogContains: catalogContains) else {
            return []
        }
        var writes: [StoreWrite] = [.transaction(record, keepRevocation: record.revocationDate == nil)]
        if let other = renewal?["originalTransactionId"].string, other != record.originalTransactionId {
            throw IngestionRejection(.missingField, "Get All Subscription Statuses: the renewal info of chain \(other) came with chain \(record.originalTransactionId ?? "")'s transaction")
        }
        if let renewal, let signed = renewal["signedDate"].int64, transaction["type"].string == "Auto-Renewable Subscription" {
            let state = Self.state(renewal, original: record.originalTransactionId!, type: Self.apiRead, subtype: nil, eventDate: signed, lastExpiration: record.expirationDate)
            writes.append(onlyNews ? .stateIfNew(state) : .state(state))
        }
        return writes
    }

    /// What the transaction is: a free trial (any offer whose discount is FREE_TRIAL:
    /// introductory, promotional, offer code, win-back), an introductory offer's paid
    /// period (offerType 1), else the first period of the chain or a renewal.
    private static func transactionType(_ transaction: EventJSON, isFirst: Bool) -> TransactionType {
        let purchase = transaction["transactionReason"].string.map { $0 == "PURCHASE" } ?? isFirst
        if transaction["offerDiscountType"].string == "FREE_TRIAL", transaction["offerType"].int64 != nil {
            return .trialStarted
        }
        if transaction["offerType"].int64 == 1 {
            return purchase ? .introStarted : .introRenewed
        }
        return purchase ? .subscriptionStarted : .subscriptionRenewed
    }

    /// Apple's `environment`: Production, or a test one (Sandbox, Xcode, LocalTesting).
    static func environment(_ value: String?) -> Environment {
        value == "Production" ? .production : .sandbox
    }
}
