import EntitlementsMessages

/// Stripe's events as writes (docs/ingestion.md, "Stripe"). Pure: the event's verified
/// JSON and the catalog in, a plan out.
///
/// API versions: the fields are read where each version puts them. Up to 2025-02-24.acacia
/// an invoice names its subscription in `subscription` and a line its price in `price`, a
/// subscription its period in `current_period_*`, and a charge its invoice in `invoice`.
/// From 2025-03-31.basil on, the invoice's subscription is in
/// `parent.subscription_details`, a line's price in `pricing.price_details`, the period on
/// the subscription's items, and a charge names no invoice.
public struct StripeEvents: Sendable {
    /// The metadata key that names our user id on a subscription (or on a Stripe customer,
    /// a charge, an invoice's subscription details). `--stripe-customer-key`.
    public let customerKey: String

    public init(customerKey: String = "user_id") {
        self.customerKey = customerKey
    }

    /// The alias a Stripe customer id is linked to a user under.
    static func alias(ofCustomer id: String) -> String { "stripe:" + id }

    /// The event types that write; every other type is answered 2xx and ignored.
    public static let handled: Set<String> = [
        "customer.created", "customer.updated",
        "customer.subscription.created", "customer.subscription.updated", "customer.subscription.deleted",
        "invoice.paid", "invoice.payment_failed", "charge.refunded",
    ]

    func plan(_ event: EventJSON, catalogContains: (String) -> Bool) throws -> StoreEventPlan {
        guard let type = event["type"].string, event["id"].string != nil, let eventDate = Self.seconds(event["created"]) else {
            throw IngestionRejection(.missingField, "not a Stripe event: id, type and created (Unix seconds) are required")
        }
        guard Self.handled.contains(type) else {
            return .ignore(reason: "unhandled_type")  // whatever its object holds
        }
        let object = event["data"]["object"]
        guard object["id"].string != nil else {
            throw IngestionRejection(.missingField, "\(type): data.object.id missing")
        }
        switch type {
        case "customer.created", "customer.updated":
            return self.customer(object)
        case "customer.subscription.created", "customer.subscription.updated", "customer.subscription.deleted":
            return try self.subscription(object, type: type, eventDate: eventDate)
        case "invoice.paid":
            return try self.invoicePaid(object, catalogContains: catalogContains)
        case "invoice.payment_failed":
            // The billing issue is the subscription's state: Stripe sends
            // customer.subscription.updated (status past_due) with it, carrying the whole state.
            return .ignore(reason: "state_from_subscription")
        default:  // charge.refunded
            return try self.chargeRefunded(object, eventDate: eventDate)
        }
    }

    // MARK: Events

    private func customer(_ customer: EventJSON) -> StoreEventPlan {
        let id = customer["id"].string!
        guard let user = self.user(in: customer["metadata"]) else {
            return .ignore(reason: "customer_without_user")
        }
        return .apply(identity: .user(user, storeCustomer: Self.alias(ofCustomer: id)), writes: [])
    }

    private func subscription(_ subscription: EventJSON, type: String, eventDate: Int64) throws -> StoreEventPlan {
        let id = subscription["id"].string!
        guard let status = subscription["status"].string else {
            throw IngestionRejection(.missingField, "\(type) \(id): status missing")
        }
        let identity = try self.identity(subscription, metadata: subscription["metadata"], what: "\(type) \(id)")
        let periodStart = Self.seconds(subscription["current_period_start"]) ?? Self.seconds(subscription["items"]["data"][0]["current_period_start"])
        let periodEnd = Self.seconds(subscription["current_period_end"]) ?? Self.seconds(subscription["items"]["data"][0]["current_period_end"])
        let canceledAt = Self.seconds(subscription["canceled_at"])
        let endsAtPeriodEnd = subscription["cancel_at_period_end"].bool == true || !subscription["cancel_at"].isNull

        var state = SubscriptionState(store: .stripe, originalTransactionId: id)
        state.eventDate = eventDate
        let ended = type == "customer.subscription.deleted" || ["canceled", "incomplete_expired"].contains(status)
        switch status {
        case _ where ended:
            state.autoRenewEnabled = false
            state.autoRenewDisabledDate = canceledAt
        case "past_due":
            // Stripe retries the renewal: access continues (grace) while it does, at most
            // to the end of the period it is trying to collect.
            state.autoRenewEnabled = !endsAtPeriodEnd
            state.autoRenewDisabledDate = endsAtPeriodEnd ? canceledAt : nil
            state.isInBillingRetry = true
            state.billingIssueDetectedDate = periodStart
            state.gracePeriodExpirationDate = periodEnd
        case "unpaid":
            // Retries are over; the subscription stays but nothing is collected.
            state.autoRenewEnabled = false
            state.isInBillingRetry = false
            state.billingIssueDetectedDate = periodStart
        case "paused":
            state.autoRenewEnabled = false
        default:  // trialing, active, incomplete
            state.autoRenewEnabled = !endsAtPeriodEnd
            state.autoRenewDisabledDate = endsAtPeriodEnd ? canceledAt : nil
        }
        switch subscription["cancellation_details"]["reason"].string {
        case "cancellation_requested": state.cancellationReason = .customer
        case "payment_failed", "payment_disputed": state.cancellationReason = .billingError
        default: break
        }
        if ended {
            state.endedDate = Self.seconds(subscription["ended_at"]) ?? canceledAt ?? eventDate
        }
        return .apply(identity: identity, writes: [.state(state)])
    }

    private func invoicePaid(_ invoice: EventJSON, catalogContains: (String) -> Bool) throws -> StoreEventPlan {
        let id = invoice["id"].string!
        let details = invoice["parent"]["subscription_details"]
        guard let subscription = invoice["subscription"].string ?? details["subscription"].string else {
            return .ignore(reason: "invoice_without_subscription")
        }
        let metadata = details["metadata"].isNull ? invoice["subscription_details"]["metadata"] : details["metadata"]
        let identity = try self.identity(invoice, metadata: metadata, what: "invoice.paid \(id)")
        // The subscription's line: its period is the one paid for, its price the product.
        // Proration lines (a plan change's credit and charge for part of a period) are not
        // periods bought; an invoice of prorations only changes no period.
        let lines = invoice["lines"]["data"].array.filter { line in
            let isSubscription = line["type"].string == "subscription" || line["parent"]["type"].string == "subscription_item_details"
            let isProration = line["proration"].bool == true || line["parent"]["subscription_item_details"]["proration"].bool == true
            return isSubscription && !isProration && (line["amount"].int64 ?? 0) >= 0
        }
        if lines.isEmpty, !invoice["lines"]["data"].array.isEmpty {
            return .ignore(reason: "proration_only")
        }
        guard let line = lines.max(by: { ($0["period"]["end"].int64 ?? 0) < ($1["period"]["end"].int64 ?? 0) }), let start = Self.seconds(line["period"]["start"]), let end = Self.seconds(line["period"]["end"]), end > start else {
            throw IngestionRejection(.missingField, "invoice.paid \(id): no subscription line with a period (lines.data[].period)")
        }
        let price = line["price"].isNull ? line["pricing"]["price_details"] : line["price"]
        let candidates = [price["id"].string, price["price"].string, price["lookup_key"].string, price["product"].string].compactMap { $0 }
        guard let product = candidates.first(where: catalogContains) else {
            throw IngestionRetry(
                .unknownProduct,
                "invoice.paid \(id): none of its price and product ids (\(candidates.joined(separator: ", "))) is in the catalog; add the one your catalog should use, and Stripe's retry will record it"
            )
        }
        let type: TransactionType
        switch invoice["billing_reason"].string {
        case "subscription_create":
            type = invoice["amount_paid"].int64 == 0 ? .trialStarted : .subscriptionStarted
        default:
            type = .subscriptionRenewed
        }
        var transaction = Transaction(
            originalTransactionId: subscription,
            transactionId: id,
            store: .stripe,
            productId: product,
            transactionDate: start,
            expirationDate: end,
            environment: invoice["livemode"].bool == false ? .sandbox : .production,
            ownershipType: .owner,
            type: type,
            verified: true
        )
        // The period's price: the line's amount less its discounts, in the currency's
        // smallest unit (tax, other items and a credit balance applied are not in it).
        let discounts = line["discount_amounts"].array.reduce(Int64(0)) { $0 &+ ($1["amount"].int64 ?? 0) }
        if let amount = line["amount"].int64, let currency = StorePrice.currency(invoice["currency"].string?.uppercased()),
            let micros = StorePrice.micros(smallestUnits: amount &- discounts, currency: currency)
        {
            transaction.priceMicros = micros
            transaction.currency = currency
        }
        return .apply(identity: identity, writes: [.transaction(transaction, keepRevocation: true)])
    }

    private func chargeRefunded(_ charge: EventJSON, eventDate: Int64) throws -> StoreEventPlan {
        let id = charge["id"].string!
        guard charge["refunded"].bool == true else {
            return .ignore(reason: "partial_refund")  // access stays until the charge is refunded in full
        }
        guard let invoice = charge["invoice"].string else {
            return .ignore(reason: "refund_without_invoice")
        }
        let identity = try self.identity(charge, metadata: charge["metadata"], what: "charge.refunded \(id)")
        return .apply(identity: identity, writes: [.revokeTransaction(store: .stripe, transactionId: invoice, date: eventDate)])
    }

    // MARK: Fields

    private func user(in metadata: EventJSON) -> String? {
        guard let user = metadata.strings[self.customerKey], !user.isEmpty else {
            return nil
        }
        return user
    }

    /// The metadata key's user, else the Stripe customer the object names.
    private func identity(_ object: EventJSON, metadata: EventJSON, what: String) throws -> StoreIdentity {
        let customer = object["customer"].string ?? object["customer"]["id"].string
        if let user = self.user(in: metadata) {
            return .user(user, storeCustomer: customer.map(Self.alias(ofCustomer:)))
        }
        guard let customer else {
            throw IngestionRejection(.missingField, "\(what): no metadata \"\(self.customerKey)\" and no customer")
        }
        return .storeCustomer(Self.alias(ofCustomer: customer))
    }

    /// A Stripe timestamp (Unix seconds) in Unix milliseconds; nil unless it is one (from
    /// 1970 to the year 5138: anything else is not a date Stripe sends).
    private static func seconds(_ value: EventJSON) -> Int64? {
        guard let seconds = value.int64, (0..<100_000_000_000).contains(seconds) else {
            return nil
        }
        return seconds * 1000
    }
}
