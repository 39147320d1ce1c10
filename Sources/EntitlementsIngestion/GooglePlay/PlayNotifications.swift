import Crypto
import EntitlementsFormats
import EntitlementsMessages
import Foundation

/// A Real-time developer notification (RTDN), as Google Play publishes it to Pub/Sub: the
/// base64 `data` of a message, decoded and checked. It says only that something changed
/// for a purchase token; the state is what the Play Developer API returns for the token.
struct PlayNotification: Sendable, Hashable {
    enum Kind: Sendable, Hashable {
        /// `subscriptionNotification`: any `notificationType`, known or not.
        case subscription(type: Int64, token: String)
        /// `oneTimeProductNotification` (`sku` is the product id).
        case oneTimeProduct(type: Int64, token: String, sku: String)
        /// `voidedPurchaseNotification`: `productType` 1 subscription, 2 one-time;
        /// `refundType` 1 full, 2 partial (quantity-based).
        case voided(token: String, orderId: String, productType: Int64?, refundType: Int64?)
        /// `testNotification`, sent by the Play Console's "Send test notification".
        case test
    }

    var packageName: String
    /// `eventTimeMillis`.
    var eventTime: Int64
    var kind: Kind

    /// The purchase token named, if any.
    var token: String? {
        switch self.kind {
        case .subscription(_, let token), .oneTimeProduct(_, let token, _), .voided(let token, _, _, _): token
        case .test: nil
        }
    }

    /// What the notification is, for logs and metrics: `subscription:4`, `voided`, ...
    var label: String {
        switch self.kind {
        case .subscription(let type, _): "subscription:\(type)"
        case .oneTimeProduct(let type, _, _): "one_time_product:\(type)"
        case .voided: "voided"
        case .test: "test"
        }
    }
}

/// The catalog as the Play mapping reads it.
struct PlayCatalog: Sendable {
    var contains: @Sendable (String) -> Bool
    var period: @Sendable (String) -> SubscriptionPeriod
}

/// What a purchase still needs from Google after its writes are durable.
struct PlayAcknowledgement: Sendable, Hashable {
    enum Kind: Sendable, Hashable {
        case subscription
        case product
    }
    var kind: Kind
    /// The subscription's or the product's id at Google (the `subscriptionId` or
    /// `productId` of the acknowledge call).
    var productId: String
    var token: String
}

/// Google Play as writes (docs/ingestion.md, "Google Play"). Pure: a notification and the
/// Play Developer API's answer for its token in, a plan out. The state written is derived
/// from the API's answer alone, never from the notification's type, so notifications
/// delivered in any order, or again, end in the same record.
struct PlayNotifications: Sendable {
    /// `--googleplay-package`: notifications of any other app are refused (`other_app`).
    let packages: Set<String>

    /// The alias a Play purchase token's chain is linked to a user under.
    static func alias(ofToken token: String) -> String { "googleplay:" + Self.chainId(token) }

    /// The original transaction id of a token's chain: the token itself when its alias
    /// fits an id (256 bytes), else `sha256:` and the token's SHA-256 in hex. The line
    /// items of a subscription after its first (add-ons) get `:PRODUCT` after it.
    static func chainId(_ token: String, lineItem productId: String? = nil) -> String {
        let whole = productId.map { token + ":" + $0 } ?? token
        if ("googleplay:" + whole).utf8.count <= 256, IdRule.problem(whole) == nil {
            return whole
        }
        let digest = SHA256.hash(data: Array(whole.utf8)).map { String(format: "%02x", $0) }.joined()
        return "sha256:" + digest
    }

    // MARK: The notification

    /// The Pub/Sub message's `data`, base64 as Pub/Sub sends it, as a notification of one of
    /// our packages.
    func decode(data: String) throws(IngestionRejection) -> PlayNotification {
        guard let bytes = Data(base64Encoded: data) ?? Data(base64Encoded: Self.padded(data)) else {
            throw IngestionRejection(.malformedJSON, "message.data is not base64")
        }
        let json = try EventJSON(parsing: Array(bytes))
        guard let packageName = json["packageName"].string, let eventTime = Self.int64(json["eventTimeMillis"]) else {
            throw IngestionRejection(.missingField, "not a Google Play developer notification: packageName and eventTimeMillis are required")
        }
        guard self.packages.contains(packageName) else {
            throw IngestionRejection(.otherApp, "packageName \(packageName) is not one of --googleplay-package (\(self.packages.sorted().joined(separator: ", ")))")
        }
        let kind: PlayNotification.Kind
        let subscription = json["subscriptionNotification"]
        let oneTime = json["oneTimeProductNotification"]
        let voided = json["voidedPurchaseNotification"]
        if !subscription.isNull {
            guard let type = Self.int64(subscription["notificationType"]), let token = Self.token(subscription["purchaseToken"]) else {
                throw IngestionRejection(.missingField, "subscriptionNotification needs notificationType and purchaseToken")
            }
            kind = .subscription(type: type, token: token)
        } else if !oneTime.isNull {
            guard let type = Self.int64(oneTime["notificationType"]), let token = Self.token(oneTime["purchaseToken"]), let sku = oneTime["sku"].string, !sku.isEmpty else {
                throw IngestionRejection(.missingField, "oneTimeProductNotification needs notificationType, purchaseToken and sku")
            }
            kind = .oneTimeProduct(type: type, token: token, sku: sku)
        } else if !voided.isNull {
            guard let token = Self.token(voided["purchaseToken"]), let orderId = voided["orderId"].string, !orderId.isEmpty else {
                throw IngestionRejection(.missingField, "voidedPurchaseNotification needs purchaseToken and orderId")
            }
            kind = .voided(token: token, orderId: orderId, productType: Self.int64(voided["productType"]), refundType: Self.int64(voided["refundType"]))
        } else if !json["testNotification"].isNull {
            kind = .test
        } else {
            throw IngestionRejection(.missingField, "the notification has none of subscriptionNotification, oneTimeProductNotification, voidedPurchaseNotification, testNotification")
        }
        return PlayNotification(packageName: packageName, eventTime: eventTime, kind: kind)
    }

    // MARK: Subscriptions

    /// The plan for a subscription, from `purchases.subscriptionsv2.get`'s answer for
    /// `token`, and the acknowledgement it still needs once written.
    func plan(subscription: EventJSON, token: String, catalog: PlayCatalog) throws -> (StoreEventPlan, PlayAcknowledgement?) {
        let what = "subscription \(Self.short(token))"
        guard let state = subscription["subscriptionState"].string else {
            throw IngestionRejection(.missingField, "\(what): the Play Developer API's answer has no subscriptionState")
        }
        switch state {
        case "SUBSCRIPTION_STATE_PENDING":
            return (.ignore(reason: "pending"), nil)  // not paid yet: no access, nothing to acknowledge
        case "SUBSCRIPTION_STATE_PENDING_PURCHASE_CANCELED":
            return (.ignore(reason: "pending_canceled"), nil)
        case "SUBSCRIPTION_STATE_ACTIVE", "SUBSCRIPTION_STATE_CANCELED", "SUBSCRIPTION_STATE_IN_GRACE_PERIOD", "SUBSCRIPTION_STATE_ON_HOLD",
            "SUBSCRIPTION_STATE_PAUSED", "SUBSCRIPTION_STATE_EXPIRED":
            break
        default:
            throw IngestionRetry(.unknownState, "\(what): subscriptionState \(state) is not one this server knows; refused so that the notification is delivered again once it is upgraded")
        }
        let items = subscription["lineItems"].array
        guard !items.isEmpty else {
            throw IngestionRejection(.missingField, "\(what): the Play Developer API's answer has no lineItems")
        }
        guard let startTime = subscription["startTime"].string.flatMap(RFC3339.parse) else {
            throw IngestionRejection(.missingField, "\(what): the Play Developer API's answer has no startTime")
        }
        let environment: Environment = subscription["testPurchase"].isNull ? .production : .sandbox
        var writes: [StoreWrite] = []
        for (index, item) in items.enumerated() {
            // The first item is the subscription's own chain; an add-on is a chain of its
            // own, its period an order line of its own (one order bills them all).
            let addOn = index == 0 ? nil : item["productId"].string ?? "\(index)"
            let chain = Self.chainId(token, lineItem: addOn)
            let (transaction, itemState) = try Self.lineItem(
                item, chain: chain, addOn: addOn, state: state, subscription: subscription, startTime: startTime, environment: environment, catalog: catalog, what: what
            )
            if itemState.isInBillingRetry {
                writes.append(.stateWithBillingIssue(itemState))  // first: it reads the period before this one
                writes.append(.transaction(transaction, keepRevocation: true))
            } else {
                writes.append(.transaction(transaction, keepRevocation: true))
                writes.append(.state(itemState))
            }
        }
        if let linked = Self.token(subscription["linkedPurchaseToken"]) {
            // An upgrade, downgrade or re-subscription: the chains it replaces (the old
            // token's, and its add-ons') end where this one starts.
            writes.append(.endChains(store: .playstore, chain: Self.chainId(linked), at: startTime))
        }
        let identity = Self.identity(subscription["externalAccountIdentifiers"]["obfuscatedExternalAccountId"].string, token: token, linked: Self.token(subscription["linkedPurchaseToken"]))
        var acknowledgement: PlayAcknowledgement?
        if subscription["acknowledgementState"].string == "ACKNOWLEDGEMENT_STATE_PENDING",
            ["SUBSCRIPTION_STATE_ACTIVE", "SUBSCRIPTION_STATE_IN_GRACE_PERIOD", "SUBSCRIPTION_STATE_CANCELED"].contains(state),
            let productId = items[0]["productId"].string
        {
            acknowledgement = PlayAcknowledgement(kind: .subscription, productId: productId, token: token)
        }
        return (.apply(identity: identity, writes: writes), acknowledgement)
    }

    /// One line item's period and renewal state.
    private static func lineItem(
        _ item: EventJSON,
        chain: String,
        addOn: String?,
        state: String,
        subscription: EventJSON,
        startTime: Int64,
        environment: Environment,
        catalog: PlayCatalog,
        what: String
    ) throws -> (Transaction, SubscriptionState) {
        guard let playProduct = item["productId"].string, !playProduct.isEmpty, let expiry = item["expiryTime"].string.flatMap(RFC3339.parse) else {
            throw IngestionRejection(.missingField, "\(what): a line item needs productId and expiryTime")
        }
        let basePlan = item["offerDetails"]["basePlanId"].string
        let productId = try Self.catalogProduct(playProduct, basePlan: basePlan, catalog: catalog, what: what)
        let orderId = item["latestSuccessfulOrderId"].string ?? subscription["latestOrderId"].string
        // A renewal's order id is the first order's with `..N` after it.
        let isRenewal = orderId?.contains("..") ?? false
        let phase = item["offerPhase"]
        var transaction = Transaction(
            originalTransactionId: chain,
            transactionId: (orderId ?? "\(chain)@\(expiry)") + (addOn.map { ":" + $0 } ?? ""),
            store: .playstore,
            productId: productId,
            transactionDate: isRenewal ? Self.periodStart(expiry: expiry, period: catalog.period(productId), notBefore: startTime) : min(startTime, expiry),
            expirationDate: expiry,
            environment: environment,
            ownershipType: .owner,
            verified: true
        )
        if !phase["freeTrial"].isNull {
            transaction.type = .trialStarted
        } else if !phase["introductoryPrice"].isNull {
            transaction.type = isRenewal ? .introRenewed : .introStarted
        } else {
            transaction.type = isRenewal ? .subscriptionRenewed : .subscriptionStarted
        }
        // The price of the period where the answer gives it: the base plan's recurring
        // price for a base-price period, nothing for a trial; an introductory price is
        // not in the answer.
        let recurring = item["autoRenewingPlan"]["recurringPrice"]
        if phase["introductoryPrice"].isNull, phase["prorationPeriod"].isNull, let currency = StorePrice.currency(recurring["currencyCode"].string) {
            if !phase["freeTrial"].isNull {
                transaction.priceMicros = 0
                transaction.currency = currency
            } else if let micros = Self.micros(units: recurring["units"], nanos: recurring["nanos"]) {
                transaction.priceMicros = micros
                transaction.currency = currency
            }
        }

        var renewal = SubscriptionState(store: .playstore, originalTransactionId: chain)
        renewal.autoRenewEnabled = item["autoRenewingPlan"]["autoRenewEnabled"].bool ?? false
        let canceled = subscription["canceledStateContext"]
        switch state {
        case "SUBSCRIPTION_STATE_CANCELED", "SUBSCRIPTION_STATE_EXPIRED":
            renewal.autoRenewEnabled = false
            renewal.cancellationReason = Self.cancellationReason(canceled)
            renewal.autoRenewDisabledDate = canceled["userInitiatedCancellation"]["cancelTime"].string.flatMap(RFC3339.parse)
            if state == "SUBSCRIPTION_STATE_EXPIRED" {
                // Over at expiryTime: before the paid period's end when Google revoked it.
                renewal.endedDate = expiry
            }
        case "SUBSCRIPTION_STATE_IN_GRACE_PERIOD", "SUBSCRIPTION_STATE_ON_HOLD":
            // Google extends expiryTime to the grace period's end; on hold it is past.
            renewal.isInBillingRetry = true
            renewal.gracePeriodExpirationDate = expiry
        case "SUBSCRIPTION_STATE_PAUSED":
            renewal.autoRenewEnabled = true  // it resumes by itself (pausedStateContext.autoResumeTime)
        default:
            break
        }
        return (transaction, renewal)
    }

    // MARK: One-time products

    /// The plan for a one-time product, from `purchases.products.get`'s answer.
    func plan(product: EventJSON, token: String, sku: String, catalog: PlayCatalog) throws -> (StoreEventPlan, PlayAcknowledgement?) {
        let what = "product \(sku) \(Self.short(token))"
        switch Self.int64(product["purchaseState"]) {
        case 0:
            break
        case 1:
            return (.ignore(reason: "canceled"), nil)  // a pending purchase canceled; a refund is a voided purchase
        case 2:
            return (.ignore(reason: "pending"), nil)
        default:
            throw IngestionRejection(.missingField, "\(what): the Play Developer API's answer has no purchaseState")
        }
        guard let purchased = Self.int64(product["purchaseTimeMillis"]) else {
            throw IngestionRejection(.missingField, "\(what): the Play Developer API's answer has no purchaseTimeMillis")
        }
        guard catalog.contains(sku) else {
            throw IngestionRetry(.unknownProduct, "\(what): product \(sku) is not in the catalog; add it, and the notification's redelivery records it")
        }
        let chain = Self.chainId(token)
        var transaction = Transaction(
            originalTransactionId: chain,
            transactionId: product["orderId"].string ?? chain,
            store: .playstore,
            productId: sku,
            transactionDate: purchased,
            environment: Self.int64(product["purchaseType"]) == 0 ? .sandbox : .production,
            ownershipType: .owner,
            verified: true
        )
        transaction.type = .nonConsumablePurchase
        let identity = Self.identity(product["obfuscatedExternalAccountId"].string, token: token, linked: nil)
        let acknowledgement = Self.int64(product["acknowledgementState"]) == 0 ? PlayAcknowledgement(kind: .product, productId: sku, token: token) : nil
        return (.apply(identity: identity, writes: [.transaction(transaction, keepRevocation: true)]), acknowledgement)
    }

    // MARK: Voided purchases

    /// A voided purchase: a full refund or chargeback revokes the order at the
    /// notification's time; a partial one leaves access, as for Stripe.
    func plan(voided token: String, orderId: String, refundType: Int64?, at eventTime: Int64) -> StoreEventPlan {
        if refundType == 2 {
            return .ignore(reason: "partial_refund")
        }
        return .apply(identity: .chainAlias(Self.alias(ofToken: token), linked: nil), writes: [.revokeTransaction(store: .playstore, transactionId: orderId, date: eventTime)])
    }

    // MARK: Parts

    /// The account id the app set at purchase names the customer; without it, the chain's
    /// alias (or the one of the chain it replaced) must be linked to one already.
    private static func identity(_ accountId: String?, token: String, linked: String?) -> StoreIdentity {
        if let accountId, !accountId.isEmpty {
            return .accountId(accountId, chainAlias: Self.alias(ofToken: token))
        }
        return .chainAlias(Self.alias(ofToken: token), linked: linked.map(Self.alias(ofToken:)))
    }

    /// The catalog's product for a Play product and base plan: `PRODUCT:BASEPLAN` when the
    /// catalog names it, else `PRODUCT`.
    private static func catalogProduct(_ product: String, basePlan: String?, catalog: PlayCatalog, what: String) throws(IngestionRetry) -> String {
        if let basePlan, catalog.contains(product + ":" + basePlan) {
            return product + ":" + basePlan
        }
        if catalog.contains(product) {
            return product
        }
        let names = basePlan.map { "\(product):\($0) or \(product)" } ?? product
        throw IngestionRetry(.unknownProduct, "\(what): product \(names) is not in the catalog; add it, and the notification's redelivery records it")
    }

    /// A renewal's start: its expiry less the catalog's billing period (UTC calendar), not
    /// before the subscription's start. Without a period in the catalog, 30 days.
    static func periodStart(expiry: Int64, period: SubscriptionPeriod, notBefore start: Int64) -> Int64 {
        var calendar = Calendar(identifier: .gregorian)
        calendar.timeZone = TimeZone(identifier: "UTC")!
        let end = Date(timeIntervalSince1970: Double(expiry) / 1000)
        let back: DateComponents =
            switch period {
            case .weekly: DateComponents(day: -7)
            case .monthly: DateComponents(month: -1)
            case .quarterly: DateComponents(month: -3)
            case .semiannual: DateComponents(month: -6)
            case .annual: DateComponents(year: -1)
            default: DateComponents(day: -30)
            }
        let begin = calendar.date(byAdding: back, to: end).map { Int64(($0.timeIntervalSince1970 * 1000).rounded()) } ?? expiry
        return min(max(begin, start), expiry)
    }

    private static func cancellationReason(_ context: EventJSON) -> CancellationReason {
        if !context["userInitiatedCancellation"].isNull { return .customer }
        if !context["systemInitiatedCancellation"].isNull { return .billingError }
        if !context["developerInitiatedCancellation"].isNull { return .developer }
        if !context["replacementCancellation"].isNull { return .replaced }
        return .unspecified
    }

    /// Google's `Money`: `units` (a decimal string) and `nanos`, in millionths.
    private static func micros(units: EventJSON, nanos: EventJSON) -> Int64? {
        guard let whole = Self.int64(units) ?? (units.isNull ? 0 : nil), whole >= 0, whole <= Int64.max / 1_000_000 - 1 else {
            return nil
        }
        let fraction = Self.int64(nanos) ?? 0
        guard (0..<1_000_000_000).contains(fraction) else {
            return nil
        }
        return whole * 1_000_000 + fraction / 1000
    }

    /// Google writes 64-bit integers as decimal strings in JSON (`"eventTimeMillis":
    /// "1700000000000"`), and smaller ones as numbers.
    static func int64(_ value: EventJSON) -> Int64? {
        value.int64 ?? value.string.flatMap { Int64($0) }
    }

    private static func token(_ value: EventJSON) -> String? {
        guard let token = value.string, !token.isEmpty else {
            return nil
        }
        return token
    }

    /// A token's first characters, for messages: a token is a credential of sorts
    /// (it reads the purchase with our API key), and long.
    static func short(_ token: String) -> String {
        token.count > 12 ? String(token.prefix(12)) + "..." : token
    }

    private static func padded(_ base64: String) -> String {
        let converted = base64.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        return converted + String(repeating: "=", count: (4 - converted.count % 4) % 4)
    }
}
