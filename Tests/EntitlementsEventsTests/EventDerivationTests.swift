import EntitlementsEvents
import EntitlementsMessages
import EntitlementsResolver
import Testing

@Suite("outbound events: what a change means, store-neutral")
struct EventDerivationTests {
    static let day: Int64 = 86_400_000

    static func transaction(_ id: String, chain: String = "chain-1", product: String = "monthly", store: Source = .appstore,
                            date: Int64, type: TransactionType = .subscriptionRenewed, revoked: Int64? = nil) -> Transaction {
        Transaction(originalTransactionId: chain, transactionId: id, store: store, productId: product, transactionDate: date,
                    expirationDate: date + 30 * day, revocationDate: revoked, type: type)
    }

    static func record(_ transactions: [Transaction] = [], subscriptions: [SubscriptionState] = [], grants: [Grant] = [], aliases: [String] = []) -> CustomerRecord {
        CustomerRecord(id: "c1", aliases: aliases, transactions: transactions, subscriptions: subscriptions, grants: grants)
    }

    static func types(_ before: CustomerRecord?, _ after: CustomerRecord?, _ answerBefore: Resolution = Resolution(), _ answerAfter: Resolution = Resolution()) -> [OutboundEventType] {
        EventDerivation.events(before: before, after: after, answerBefore: answerBefore, answerAfter: answerAfter).map(\.type)
    }

    static func answer(_ active: [String: Bool], product: String? = "monthly") -> Resolution {
        Resolution(entitlements: active.keys.sorted().map { Entitlement(id: $0, isActive: active[$0]!, source: .appstore, productId: product) })
    }

    @Test("purchases: the first of a chain, a trial, its conversion, a renewal, a change of product")
    func purchases() {
        let first = Self.transaction("t1", date: 0, type: .subscriptionStarted)
        #expect(Self.types(nil, Self.record([first])) == [.initialPurchase])
        let trial = Self.transaction("t1", date: 0, type: .trialStarted)
        #expect(Self.types(nil, Self.record([trial])) == [.trialStarted])
        let converted = Self.transaction("t2", date: 7 * Self.day)
        #expect(Self.types(Self.record([trial]), Self.record([trial, converted])) == [.trialConverted])
        let renewed = Self.transaction("t3", date: 37 * Self.day)
        #expect(Self.types(Self.record([trial, converted]), Self.record([trial, converted, renewed])) == [.renewal])
        let annual = Self.transaction("t4", product: "annual", date: 67 * Self.day)
        #expect(Self.types(Self.record([trial, converted, renewed]), Self.record([trial, converted, renewed, annual])) == [.productChange])
        // The same id in another store is another transaction.
        let other = Self.transaction("t1", store: .playstore, date: 0, type: .subscriptionStarted)
        #expect(Self.types(Self.record([first]), Self.record([first, other])) == [.initialPurchase])
    }

    @Test("refunds and their reversal; a transaction that arrives refunded")
    func refunds() {
        let paid = Self.transaction("t1", date: 0, type: .subscriptionStarted)
        let refunded = Self.transaction("t1", date: 0, type: .subscriptionStarted, revoked: Self.day)
        #expect(Self.types(Self.record([paid]), Self.record([refunded])) == [.refund])
        #expect(Self.types(Self.record([refunded]), Self.record([paid])) == [.refundReversed])
        #expect(Self.types(nil, Self.record([refunded])) == [.initialPurchase, .refund])
        #expect(Self.types(Self.record([paid]), Self.record([paid])) == [])
    }

    @Test("subscription state: auto-renew off and on again, a billing issue (once)")
    func subscriptionStates() {
        let on = SubscriptionState(store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: true)
        let off = SubscriptionState(store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: false, autoRenewDisabledDate: 5)
        #expect(Self.types(Self.record(subscriptions: [on]), Self.record(subscriptions: [off])) == [.cancellation])
        #expect(Self.types(Self.record(subscriptions: [off]), Self.record(subscriptions: [on])) == [.uncancellation])
        #expect(Self.types(Self.record(), Self.record(subscriptions: [on])) == [])
        var trouble = on
        trouble.isInBillingRetry = true
        #expect(Self.types(Self.record(subscriptions: [on]), Self.record(subscriptions: [trouble])) == [.billingIssue])
        var still = trouble
        still.billingIssueDetectedDate = 9
        #expect(Self.types(Self.record(subscriptions: [trouble]), Self.record(subscriptions: [still])) == [])
    }

    @Test("grants, their revocation, aliases moved, a customer deleted")
    func grantsAliasesDeletion() {
        let grant = Grant(grantId: "g1", entitlementId: "beta", grantedDate: 0)
        var revoked = grant
        revoked.revokedDate = 10
        let grantEvents = EventDerivation.events(before: Self.record(), after: Self.record(grants: [grant]), answerBefore: Resolution(), answerAfter: Resolution())
        #expect(grantEvents == [DerivedEvent(type: .grant, store: .manual, grantId: "g1", entitlementId: "beta")])
        #expect(Self.types(Self.record(grants: [grant]), Self.record(grants: [revoked])) == [.grantRevoked])
        let moved = EventDerivation.events(before: Self.record(aliases: ["a", "b"]), after: Self.record(aliases: ["b", "c"]), answerBefore: Resolution(), answerAfter: Resolution())
        #expect(moved == [DerivedEvent(type: .transfer, aliases: ["a", "c"])])
        #expect(Self.types(Self.record(aliases: ["a"]), nil, Self.answer(["premium": true]), Resolution()) == [.customerDeleted, .entitlementDeactivated])
    }

    @Test("entitlements: activated and deactivated by a write; by time, a subscription's end is an expiration too, a grant's is not")
    func entitlements() {
        let grant = Grant(grantId: "g1", entitlementId: "beta", grantedDate: 0)
        #expect(Self.types(Self.record(), Self.record(grants: [grant]), Resolution(), Self.answer(["beta": true], product: nil)) == [.grant, .entitlementActivated])
        let time = EventDerivation.timeEvents(from: Self.answer(["premium": true, "beta": true]), to: Self.answer(["premium": false, "beta": true]))
        #expect(time.map(\.type) == [.expiration, .entitlementDeactivated])
        #expect(time.allSatisfy { $0.entitlementId == "premium" && $0.productId == "monthly" })
        let grantEnded = EventDerivation.timeEvents(from: Self.answer(["beta": true], product: nil), to: Self.answer(["beta": false], product: nil))
        #expect(grantEnded.map(\.type) == [.entitlementDeactivated])
        // Deriving twice gives the same events in the same order.
        #expect(EventDerivation.timeEvents(from: Self.answer(["a": true, "b": false]), to: Self.answer(["a": false, "b": true])).map(\.entitlementId)
            == ["a", "a", "b"])
    }

    @Test("a chain the store ended early is an EXPIRATION, not a REFUND; a revocation alone is a REFUND")
    func endedEarly() {
        let running = Self.transaction("t1", date: 0, type: .subscriptionStarted)
        var ended = running
        ended.revocationDate = 10 * Self.day
        let state = SubscriptionState(store: .appstore, originalTransactionId: "chain-1", autoRenewEnabled: false, endedDate: 10 * Self.day)
        // (First seen with auto-renew off: also a CANCELLATION, as for any chain.)
        #expect(Self.types(Self.record([running]), Self.record([ended], subscriptions: [state])) == [.expiration, .cancellation])
        #expect(Self.types(Self.record([running]), Self.record([ended])) == [.refund])
    }
}
