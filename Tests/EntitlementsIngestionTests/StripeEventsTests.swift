import EntitlementsMessages
import Testing

@testable import EntitlementsIngestion

@Suite("Stripe events as writes (docs/ingestion.md, the mapping table), in both API shapes")
struct StripeEventsTests {
    let events = StripeEvents()
    let catalog: Set<String> = ["price_monthly", "prod_annual"]
    typealias F = StripeFixture

    func plan(_ event: JSON) throws -> StoreEventPlan {
        try self.events.plan(try EventJSON(parsing: event.bytes), catalogContains: self.catalog.contains)
    }

    @Test("customer.created and .updated link the Stripe customer to the metadata's user; without it they write nothing")
    func customers() throws {
        #expect(try plan(F.event("evt_1", "customer.created", created: F.start, F.customer("cus_1", user: "u1"))) == .apply(identity: .user("u1", storeCustomer: "stripe:cus_1"), writes: []))
        #expect(try plan(F.event("evt_2", "customer.updated", created: F.start, F.customer("cus_1", user: nil))) == .ignore(reason: "customer_without_user"))
    }

    /// The catalog matches a product id as a Swift String, so a decomposed price id finds
    /// the NFC product; the plan names the decomposed id, which no write accepts: the
    /// event is refused (400 invalid_id) rather than retried by Stripe for days.
    @Test("a plan naming an id that is not NFC (user, product, transaction) has an id problem; an NFC plan has none")
    func idsNotNFC() throws {
        let catalog: Set<String> = ["prod_\u{E9}t\u{E9}"]
        func plan(_ event: JSON) throws -> StoreEventPlan {
            try self.events.plan(try EventJSON(parsing: event.bytes), catalogContains: catalog.contains)
        }
        let decomposedProduct = try plan(F.event("evt_1", "invoice.paid", created: F.start, F.invoice("in_1", subscription: "sub_1", customer: "cus_1", user: "u1", price: "prod_e\u{301}te\u{301}", periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create")))
        #expect(decomposedProduct.idProblem?.hasPrefix("the product id") == true)
        #expect(decomposedProduct.idProblem?.hasSuffix(IdRuleTexts.notNFC) == true)
        let composed = try plan(F.event("evt_2", "invoice.paid", created: F.start, F.invoice("in_1", subscription: "sub_1", customer: "cus_1", user: "u1", price: "prod_\u{E9}t\u{E9}", periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create")))
        #expect(composed.idProblem == nil)
        let decomposedUser = try plan(F.event("evt_3", "customer.created", created: F.start, F.customer("cus_1", user: "Zoe\u{308}")))
        #expect(decomposedUser.idProblem?.hasPrefix("the user id") == true)
        #expect(StoreEventPlan.ignore(reason: "x").idProblem == nil)
    }

    @Test("invoice.paid records the paid period: acacia and basil shapes give the same transaction", arguments: [false, true])
    func invoicePaid(basil: Bool) throws {
        let first = F.invoice("in_1", subscription: "sub_1", customer: "cus_1", user: "u1", periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_create", basil: basil)
        let expected = Transaction(
            originalTransactionId: "sub_1", transactionId: "in_1", store: .stripe, productId: "price_monthly", transactionDate: F.start * 1000,
            expirationDate: (F.start + 30 * F.day) * 1000, environment: .sandbox, ownershipType: .owner, type: .subscriptionStarted,
            priceMicros: 9_990_000, currency: "USD", verified: true
        )
        #expect(try plan(F.event("evt_1", "invoice.paid", created: F.start, first, basil: basil)) == .apply(identity: .user("u1", storeCustomer: "stripe:cus_1"), writes: [.transaction(expected, keepRevocation: true)]))

        let trial = F.invoice("in_0", subscription: "sub_1", customer: "cus_1", periodStart: F.start, periodEnd: F.start + 7 * F.day, reason: "subscription_create", amountPaid: 0, basil: basil)
        guard case .apply(let identity, let writes) = try plan(F.event("evt_0", "invoice.paid", created: F.start, trial, basil: basil)), case .transaction(let transaction, _) = writes.first else {
            Issue.record("a trial invoice wrote nothing")
            return
        }
        #expect(identity == .storeCustomer("stripe:cus_1"))
        #expect(transaction.type == .trialStarted)

        let renewal = F.invoice("in_2", subscription: "sub_1", customer: "cus_1", periodStart: F.start + 30 * F.day, periodEnd: F.start + 60 * F.day, reason: "subscription_cycle", basil: basil)
        guard case .apply(_, let renewed) = try plan(F.event("evt_2", "invoice.paid", created: F.start, renewal, basil: basil)), case .transaction(let next, _) = renewed.first else {
            Issue.record("a renewal wrote nothing")
            return
        }
        #expect(next.type == .subscriptionRenewed)
    }

    @Test("a subscription's status becomes its chain's state, dated by the event", arguments: [false, true])
    func subscriptionStates(basil: Bool) throws {
        let end = F.start + 30 * F.day
        func state(_ status: String, cancelAtPeriodEnd: Bool = false, canceledAt: Int64? = nil, endedAt: Int64? = nil, type: String = "customer.subscription.updated") throws -> [StoreWrite] {
            let object = F.subscription("sub_1", customer: "cus_1", user: "u1", status: status, periodStart: F.start, periodEnd: end, cancelAtPeriodEnd: cancelAtPeriodEnd, canceledAt: canceledAt, endedAt: endedAt, basil: basil)
            guard case .apply(let identity, let writes) = try plan(F.event("evt_s", type, created: F.start + 100, object, basil: basil)) else {
                Issue.record("\(status) wrote nothing")
                return []
            }
            #expect(identity == .user("u1", storeCustomer: "stripe:cus_1"))
            return writes
        }
        let dated: Int64 = (F.start + 100) * 1000
        #expect(try state("active") == [.state(SubscriptionState(store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: true, eventDate: dated))])
        #expect(try state("trialing") == [.state(SubscriptionState(store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: true, eventDate: dated))])
        #expect(
            try state("active", cancelAtPeriodEnd: true, canceledAt: F.start + 50)
                == [.state(SubscriptionState(store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: false, autoRenewDisabledDate: (F.start + 50) * 1000, eventDate: dated))]
        )
        #expect(
            try state("past_due")
                == [.state(SubscriptionState(
                    store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: true, billingIssueDetectedDate: F.start * 1000,
                    gracePeriodExpirationDate: end * 1000, isInBillingRetry: true, eventDate: dated
                ))]
        )
        #expect(try state("unpaid") == [.state(SubscriptionState(store: .stripe, originalTransactionId: "sub_1", billingIssueDetectedDate: F.start * 1000, eventDate: dated))])
        var ended = SubscriptionState(store: .stripe, originalTransactionId: "sub_1", autoRenewDisabledDate: (F.start + 60) * 1000, eventDate: dated)
        ended.endedDate = (F.start + 60) * 1000
        #expect(
            try state("canceled", canceledAt: F.start + 60, endedAt: F.start + 60, type: "customer.subscription.deleted")
                == [.state(ended)]
        )
    }

    @Test("charge.refunded revokes the invoice's transaction at the event's time; a partial refund or one without an invoice writes nothing")
    func refunds() throws {
        #expect(
            try plan(F.event("evt_r", "charge.refunded", created: F.start + 5, F.charge("ch_1", customer: "cus_1", invoice: "in_1")))
                == .apply(identity: .storeCustomer("stripe:cus_1"), writes: [.revokeTransaction(store: .stripe, transactionId: "in_1", date: (F.start + 5) * 1000)])
        )
        #expect(try plan(F.event("evt_p", "charge.refunded", created: F.start, F.charge("ch_1", customer: "cus_1", invoice: "in_1", refunded: false))) == .ignore(reason: "partial_refund"))
        #expect(try plan(F.event("evt_b", "charge.refunded", created: F.start, F.charge("ch_1", customer: "cus_1", invoice: nil), basil: true)) == .ignore(reason: "refund_without_invoice"))
    }

    @Test("types with nothing to write are ignored, by reason")
    func ignored() throws {
        let invoice = F.invoice("in_9", subscription: "sub_1", customer: "cus_1", periodStart: F.start, periodEnd: F.start + 30 * F.day, reason: "subscription_cycle")
        #expect(try plan(F.event("evt_f", "invoice.payment_failed", created: F.start, invoice)) == .ignore(reason: "state_from_subscription"))
        #expect(try plan(F.event("evt_x", "payment_intent.created", created: F.start, ["id": "pi_1"])) == .ignore(reason: "unhandled_type"))
        #expect(try plan(F.event("evt_y", "radar.early_fraud_warning.created", created: F.start, ["object": "radar.early_fraud_warning"])) == .ignore(reason: "unhandled_type"))
        let oneOff: JSON = ["id": "in_5", "object": "invoice", "customer": "cus_1", "lines": ["data": []]]
        #expect(try plan(F.event("evt_o", "invoice.paid", created: F.start, oneOff)) == .ignore(reason: "invoice_without_subscription"))
    }

    @Test("a plan change's proration lines are not periods: the full period's line is recorded; prorations alone record nothing")
    func prorations() throws {
        func line(_ price: String, start: Int64, end: Int64, amount: Int64, proration: Bool) -> JSON {
            ["type": "subscription", "proration": .bool(proration), "amount": .integer(amount), "period": ["start": .integer(start), "end": .integer(end)], "price": ["id": .string(price)]]
        }
        func invoice(_ lines: [JSON]) -> JSON {
            ["id": "in_u", "customer": "cus_1", "subscription": "sub_1", "billing_reason": "subscription_update", "lines": ["data": .array(lines)]]
        }
        let credit = line("prod_old", start: F.start + 5 * F.day, end: F.start + 30 * F.day, amount: -500, proration: true)
        let charge = line("prod_annual", start: F.start + 5 * F.day, end: F.start + 30 * F.day, amount: 2000, proration: true)
        let next = line("prod_annual", start: F.start + 30 * F.day, end: F.start + 395 * F.day, amount: 9900, proration: false)
        guard case .apply(_, let writes) = try plan(F.event("evt_u", "invoice.paid", created: F.start, invoice([credit, charge, next]))), case .transaction(let transaction, _) = writes.first else {
            Issue.record("the full period's line was not recorded")
            return
        }
        #expect(transaction.productId == "prod_annual")
        #expect(transaction.transactionDate == (F.start + 30 * F.day) * 1000)
        #expect(try plan(F.event("evt_p", "invoice.paid", created: F.start, invoice([credit, charge]))) == .ignore(reason: "proration_only"))
    }

    @Test("timestamps that are not Unix seconds Stripe would send are refused, not trapped on")
    func hugeTimestamps() {
        let object = F.subscription("sub_1", customer: "cus_1", status: "past_due", periodStart: Int64.max / 10, periodEnd: Int64.max)
        for event in [F.event("evt_1", "customer.created", created: Int64.max, F.customer("cus_1", user: "u")), F.event("evt_2", "customer.created", created: -5, F.customer("cus_1", user: "u"))] {
            #expect(throws: IngestionRejection.self) { try plan(event) }
        }
        #expect(throws: Never.self) { try plan(F.event("evt_3", "customer.subscription.updated", created: F.start, object)) }
    }

    @Test("a price and product not in the catalog are a retry that names them")
    func unknownProduct() {
        let invoice = F.invoice("in_1", subscription: "sub_1", customer: "cus_1", price: "price_other", periodStart: F.start, periodEnd: F.start + F.day, reason: "subscription_create")
        #expect {
            try plan(F.event("evt_1", "invoice.paid", created: F.start, invoice))
        } throws: { error in
            let retry = error as! IngestionRetry
            return retry.reason == .unknownProduct && retry.message.contains("price_other, prod_premium")
        }
    }

    @Test("malformed events are refused: not JSON, not an object, no type, no object id, no status, no period")
    func malformed() {
        let cases: [([UInt8], RejectionReason)] = [
            (Array("{\"id\":".utf8), .malformedJSON),
            (Array("[1,2]".utf8), .malformedJSON),
            (JSON(dictionaryLiteral: ("id", "evt_1"), ("created", 1)).bytes, .missingField),
            (F.event("evt_1", "customer.created", created: 1, ["object": "customer"]).bytes, .missingField),
            (F.event("evt_1", "customer.subscription.updated", created: 1, ["id": "sub_1", "customer": "cus_1"]).bytes, .missingField),
            (F.event("evt_1", "invoice.paid", created: 1, ["id": "in_1", "subscription": "sub_1", "customer": "cus_1", "lines": ["data": []]]).bytes, .missingField),
        ]
        for (bytes, reason) in cases {
            #expect {
                try self.events.plan(try EventJSON(parsing: bytes), catalogContains: self.catalog.contains)
            } throws: { error in
                (error as? IngestionRejection)?.reason == reason
            }
        }
    }
}

enum IdRuleTexts {
    static let notNFC = "must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"
}
