import EntitlementsMessages
import Testing

@testable import EntitlementsResolver

// One suite per rule of docs/entitlement-rules.md; every rule has a case that fails if
// the rule breaks.

@Suite("rule 1: chains, environment, future transactions")
struct ChainRuleTests {
    @Test("transactions of the other environment are ignored")
    func otherEnvironment() {
        let sandboxOnly = customer([tx("1", at: t0, expires: t0 + 30 * day, environment: .sandbox)])
        #expect(resolver.resolve(sandboxOnly, at: t0 + day).entitlements.isEmpty)
        #expect(resolver.resolve(sandboxOnly, at: t0 + day, environment: .sandbox)["premium"]?.isActive == true)
        // Unspecified means production, for the request and for a transaction.
        #expect(resolver.resolve(sandboxOnly, at: t0 + day, environment: .unspecified).entitlements.isEmpty)
        let unspecified = customer([tx("1", at: t0, expires: t0 + 30 * day, environment: .unspecified)])
        #expect(resolver.resolve(unspecified, at: t0 + day)["premium"]?.isActive == true)
    }

    @Test("a transaction dated after T is ignored until its date")
    func futureTransaction() {
        let record = customer(renewedMonthly)
        let before = resolver.resolve(record, at: t0 + 29 * day)
        #expect(before["premium"]?.transactions.count == 1)
        #expect(before["premium"]?.expirationDate == t0 + 30 * day)
        #expect(before.validUntil == t0 + 30 * day)
        let at = resolver.resolve(record, at: t0 + 30 * day)
        #expect(at["premium"]?.transactions.count == 2)
        #expect(at["premium"]?.isActive == true)
    }

    @Test("transactions group into chains by store and original transaction id")
    func chainsByStoreAndOriginalId() {
        // Same original id in two stores: two chains, the App Store one lapsed, the Play
        // Store one active, so the entitlement is active from the Play Store.
        let record = customer([
            tx("1", chain: "X", store: .appstore, at: t0, expires: t0 + day),
            tx("2", chain: "X", store: .playstore, at: t0, expires: t0 + 30 * day),
        ])
        let premium = resolver.resolve(record, at: t0 + 2 * day)["premium"]
        #expect(premium?.isActive == true)
        #expect(premium?.source == .playstore)
        #expect(premium?.transactions.map(\.transactionId) == ["2"])
    }
}

@Suite("rule 2: the current transaction and revocation")
struct CurrentTransactionRuleTests {
    @Test("the current transaction is the latest by date")
    func latestByDate() {
        let record = customer([
            tx("2", at: t0 + 30 * day, expires: t0 + 60 * day),
            tx("1", type: .subscriptionStarted, at: t0, expires: t0 + 30 * day),
        ])
        #expect(resolver.resolve(record, at: t0 + 31 * day)["premium"]?.expirationDate == t0 + 60 * day)
    }

    @Test("ties on date go to the larger transaction id, compared as numbers")
    func tieOnDate() {
        let record = customer([
            tx("10", at: t0, expires: t0 + 20 * day),
            tx("9", at: t0, expires: t0 + 10 * day),
        ])
        let premium = resolver.resolve(record, at: t0 + day)["premium"]
        #expect(premium?.expirationDate == t0 + 20 * day)
        #expect(premium?.transactions.map(\.transactionId) == ["9", "10"])
    }

    @Test("revoked iff the current transaction's revocation date <= T", arguments: [
        (t0 + 10 * day - 1, false),
        (t0 + 10 * day, true),
        (t0 + 10 * day + 1, true),
    ])
    func revocationBoundary(at instant: Int64, revoked: Bool) {
        let record = customer([tx("1", at: t0, expires: t0 + 30 * day, revoked: t0 + 10 * day)])
        let premium = resolver.resolve(record, at: instant)["premium"]
        #expect(premium?.isRevoked == revoked)
        #expect(premium?.isActive == !revoked)
    }

    @Test("a refunded earlier period does not revoke the chain")
    func earlierRefund() {
        let record = customer([
            tx("1", type: .subscriptionStarted, at: t0, expires: t0 + 30 * day, revoked: t0 + 5 * day),
            tx("2", at: t0 + 30 * day, expires: t0 + 60 * day),
        ])
        let premium = resolver.resolve(record, at: t0 + 31 * day)["premium"]
        #expect(premium?.isRevoked == false)
        #expect(premium?.isActive == true)
    }

    @Test("a refunded latest period removes access, and reports it")
    func refundedLatestPeriod() {
        let record = customer(
            [
                tx("1", type: .subscriptionStarted, at: t0, expires: t0 + 30 * day),
                tx("2", at: t0 + 30 * day, expires: t0 + 60 * day, revoked: t0 + 35 * day),
            ],
            states: [state(autoRenew: false)]
        )
        let premium = resolver.resolve(record, at: t0 + 40 * day)["premium"]
        #expect(premium?.isActive == false)
        #expect(premium?.isRevoked == true)
        #expect(premium?.expirationDate == t0 + 60 * day)
    }
}

@Suite("rule 3: chain activity")
struct ChainActivityRuleTests {
    // (expiration, grace end, revocation, T, active)
    static let cases: [(String, Int64?, Int64?, Int64?, Int64, Bool)] = [
        ("before expiration", t0 + 30 * day, nil, nil, t0 + 30 * day - 1, true),
        ("at expiration", t0 + 30 * day, nil, nil, t0 + 30 * day, false),
        ("after expiration", t0 + 30 * day, nil, nil, t0 + 31 * day, false),
        ("in grace", t0 + 30 * day, t0 + 36 * day, nil, t0 + 33 * day, true),
        ("just before grace end", t0 + 30 * day, t0 + 36 * day, nil, t0 + 36 * day - 1, true),
        ("at grace end", t0 + 30 * day, t0 + 36 * day, nil, t0 + 36 * day, false),
        ("revoked during grace", t0 + 30 * day, t0 + 36 * day, t0 + 32 * day, t0 + 33 * day, false),
        ("no expiration", nil, nil, nil, t0 + 9_999 * day, true),
        ("no expiration, revoked", nil, nil, t0 + 5 * day, t0 + 6 * day, false),
    ]

    @Test("active iff not revoked and before expiration or grace end", arguments: cases)
    func activity(testCase: (String, Int64?, Int64?, Int64?, Int64, Bool)) {
        let (_, expiration, grace, revocation, instant, active) = testCase
        let product = expiration == nil ? "lifetime" : "monthly"
        let type: TransactionType = expiration == nil ? .nonConsumablePurchase : .subscriptionStarted
        let record = customer(
            [tx("1", product: product, type: type, at: t0, expires: expiration, revoked: revocation)],
            states: grace == nil ? [] : [state(grace: grace)]
        )
        #expect(resolver.resolve(record, at: instant)["premium"]?.isActive == active)
    }
}

@Suite("rule 4: grants")
struct GrantRuleTests {
    // (granted, expiration, revocation, T, active or nil when the grant is ignored)
    static let cases: [(String, Int64, Int64?, Int64?, Int64, Bool?)] = [
        ("not yet granted", t0 + day, nil, nil, t0 + day - 1, nil),
        ("at grant", t0 + day, nil, nil, t0 + day, true),
        ("lifetime", t0, nil, nil, t0 + 9_999 * day, true),
        ("before expiration", t0, t0 + 7 * day, nil, t0 + 7 * day - 1, true),
        ("at expiration", t0, t0 + 7 * day, nil, t0 + 7 * day, false),
        ("before revocation", t0, nil, t0 + 3 * day, t0 + 3 * day - 1, true),
        ("at revocation", t0, nil, t0 + 3 * day, t0 + 3 * day, false),
    ]

    @Test("active iff granted <= T < expiration and T < revocation", arguments: cases)
    func activity(testCase: (String, Int64, Int64?, Int64?, Int64, Bool?)) {
        let (_, granted, expiration, revocation, instant, active) = testCase
        let record = customer(grants: [grant("g1", granted: granted, expires: expiration, revoked: revocation)])
        #expect(resolver.resolve(record, at: instant)["premium"]?.isActive == active)
    }
}

@Suite("rule 5: candidates")
struct CandidateRuleTests {
    @Test("a consumable unlocks nothing, even if the catalog lists entitlements for it")
    func consumable() {
        let record = customer([tx("1", product: "coins", type: .nonConsumablePurchase, at: t0)])
        #expect(resolver.resolve(record, at: t0 + day).entitlements.isEmpty)
    }

    @Test("a product missing from the catalog unlocks nothing")
    func unknownProduct() {
        let record = customer([tx("1", product: "com.other.app", at: t0, expires: t0 + 30 * day)])
        #expect(resolver.resolve(record, at: t0 + day).entitlements.isEmpty)
    }

    @Test("one product unlocking several entitlements")
    func oneProductSeveralEntitlements() {
        let record = customer([tx("1", product: "annual", at: t0, expires: t0 + 365 * day)])
        let resolution = resolver.resolve(record, at: t0 + day)
        #expect(resolution.entitlements.map(\.id) == ["premium", "pro"])
        #expect(resolution.entitlements.allSatisfy { $0.isActive && $0.productId == "annual" })
    }

    @Test("several products unlocking one entitlement: the best candidate wins")
    func severalProductsOneEntitlement() {
        let record = customer([
            tx("1", chain: "m", product: "monthly", at: t0, expires: t0 + 30 * day),
            tx("2", chain: "a", product: "annual", at: t0, expires: t0 + 365 * day),
        ])
        let resolution = resolver.resolve(record, at: t0 + day)
        #expect(resolution["premium"]?.productId == "annual")
        #expect(resolution["pro"]?.productId == "annual")
    }

    @Test("the current transaction's product decides what a chain unlocks (an upgrade)")
    func upgradeWithinChain() {
        let record = customer([
            tx("1", product: "pro.monthly", at: t0, expires: t0 + 30 * day),
            tx("2", product: "monthly", at: t0 + 30 * day, expires: t0 + 60 * day),
        ])
        #expect(resolver.resolve(record, at: t0 + day).entitlements.map(\.id) == ["pro"])
        #expect(resolver.resolve(record, at: t0 + 31 * day).entitlements.map(\.id) == ["premium"])
    }
}

@Suite("rule 6: merging candidates")
struct MergeRuleTests {
    @Test("active beats inactive, even one that expired later")
    func activeBeatsInactive() {
        let record = customer([
            tx("1", chain: "lapsed", product: "annual", at: t0 - 400 * day, expires: t0 + 2 * day, revoked: t0 + day),
            tx("2", chain: "live", at: t0, expires: t0 + 30 * day),
        ])
        let premium = resolver.resolve(record, at: t0 + 3 * day)["premium"]
        #expect(premium?.isActive == true)
        #expect(premium?.productId == "monthly")
    }

    @Test("among active, the later expiration wins")
    func laterExpiration() {
        let record = customer([
            tx("1", chain: "a", at: t0, expires: t0 + 30 * day),
            tx("2", chain: "b", at: t0 + day, expires: t0 + 20 * day),
        ])
        #expect(resolver.resolve(record, at: t0 + 2 * day)["premium"]?.expirationDate == t0 + 30 * day)
    }

    @Test("lifetime plus subscription for one entitlement: the lifetime purchase wins")
    func lifetimeBeatsSubscription() {
        let record = customer(
            [
                tx("1", chain: "sub", at: t0, expires: t0 + 30 * day),
                tx("2", chain: "life", product: "lifetime", type: .nonConsumablePurchase, at: t0 + 10 * day),
            ],
            states: [state(chain: "sub")]
        )
        let premium = resolver.resolve(record, at: t0 + 11 * day)["premium"]
        #expect(premium?.productId == "lifetime")
        #expect(premium?.expirationDate == nil)
        #expect(premium?.renewState == .nonRenewable)
        // The lifetime purchase keeps access after the subscription lapses.
        #expect(resolver.resolve(record, at: t0 + 90 * day)["premium"]?.isActive == true)
    }

    @Test("equal expirations: the later latest transaction wins, then the smaller id")
    func tieBreakers() {
        let laterDate = customer([
            tx("1", chain: "a", at: t0, expires: t0 + 30 * day),
            tx("2", chain: "b", at: t0 + day, expires: t0 + 30 * day),
        ])
        #expect(resolver.resolve(laterDate, at: t0 + 2 * day)["premium"]?.transactions.first?.originalTransactionId == "b")
        let sameDate = customer([
            tx("1", chain: "b", at: t0, expires: t0 + 30 * day),
            tx("2", chain: "a", at: t0, expires: t0 + 30 * day),
        ])
        #expect(resolver.resolve(sameDate, at: t0 + 2 * day)["premium"]?.transactions.first?.originalTransactionId == "a")
    }

    @Test("among inactive, the one that ended last wins (expiration, grace end or revocation)")
    func inactiveEndedLast() {
        let record = customer(
            [
                tx("1", chain: "expired", at: t0, expires: t0 + 30 * day),
                tx("2", chain: "grace", at: t0, expires: t0 + 25 * day),
                tx("3", chain: "refunded", at: t0, expires: t0 + 60 * day, revoked: t0 + 20 * day),
            ],
            states: [state(chain: "grace", grace: t0 + 33 * day)]
        )
        let premium = resolver.resolve(record, at: t0 + 70 * day)["premium"]
        #expect(premium?.isActive == false)
        #expect(premium?.transactions.first?.originalTransactionId == "grace")
    }

    @Test("a grant competes with purchases: an active lifetime grant beats an expiring subscription")
    func grantVersusChain() {
        let record = customer(
            [tx("1", at: t0, expires: t0 + 30 * day)],
            grants: [grant("g1", granted: t0 + day)]
        )
        let premium = resolver.resolve(record, at: t0 + 2 * day)["premium"]
        #expect(premium?.source == .manual)
        let limited = customer(
            [tx("1", at: t0, expires: t0 + 30 * day)],
            grants: [grant("g1", granted: t0 + day, expires: t0 + 10 * day)]
        )
        #expect(resolver.resolve(limited, at: t0 + 2 * day)["premium"]?.source == .appstore)
    }
}

@Suite("rule 7: which entitlements appear")
struct PresenceRuleTests {
    @Test("an unknown user and a customer without purchases get an empty answer")
    func empty() {
        #expect(resolver.resolve(nil, at: t0) == Resolution())
        #expect(resolver.resolve(customer(), at: t0) == Resolution())
    }

    @Test("only entitlements with a candidate appear, expired ones included")
    func onlyCandidates() {
        let record = customer([tx("1", at: t0, expires: t0 + day)])
        let resolution = resolver.resolve(record, at: t0 + 2 * day)
        #expect(resolution.entitlements.map(\.id) == ["premium"])
        #expect(resolution["premium"]?.isActive == false)
    }

    @Test("an entitlement filter keeps only the requested ones")
    func filter() {
        let record = customer([tx("1", product: "annual", at: t0, expires: t0 + 365 * day)])
        #expect(resolver.resolve(record, at: t0, entitlementIds: ["pro"]).entitlements.map(\.id) == ["pro"])
        #expect(resolver.resolve(record, at: t0, entitlementIds: ["gold"]).entitlements.isEmpty)
    }
}

@Suite("rules 8 and 9: fields of a winning chain")
struct ChainFieldRuleTests {
    @Test("a trial, an intro period and renewals with an offer code fill every field")
    func allFields() {
        let record = customer(
            [
                tx("1", type: .trialStarted, at: t0, expires: t0 + 7 * day),
                tx("2", type: .introStarted, at: t0 + 7 * day, expires: t0 + 37 * day, offer: "INTRO"),
                tx("3", type: .subscriptionRenewed, at: t0 + 37 * day, expires: t0 + 67 * day),
                tx("4", type: .subscriptionRenewed, at: t0 + 67 * day, expires: t0 + 97 * day, offer: "WINBACK"),
            ],
            states: [state(autoRenew: false, autoRenewDisabled: t0 + 80 * day)]
        )
        let premium = resolver.resolve(record, at: t0 + 90 * day)["premium"]!
        #expect(premium.source == .appstore)
        #expect(premium.productId == "monthly")
        #expect(premium.startedDate == t0)
        #expect(premium.trialStartDate == t0)
        #expect(premium.firstPurchaseDate == t0 + 7 * day)
        #expect(premium.lastPurchaseDate == t0 + 67 * day)
        #expect(premium.expirationDate == t0 + 97 * day)
        #expect(premium.renewsCount == 2)
        #expect(premium.lastActivatedOfferCode == "WINBACK")
        #expect(premium.grantType == .offerCode)
        #expect(premium.ownershipType == .owner)
        #expect(premium.periodType == .normal)
        #expect(premium.autoRenewDisableDate == t0 + 80 * day)
        #expect(premium.renewState == .canceled)
        #expect(premium.willRenew == false)
        #expect(premium.transactions.map(\.transactionId) == ["1", "2", "3", "4"])
    }

    @Test("period type follows the current transaction", arguments: [
        (TransactionType.trialStarted, PeriodType.trial),
        (.introStarted, .intro),
        (.introRenewed, .intro),
        (.subscriptionStarted, .normal),
        (.subscriptionRenewed, .normal),
    ])
    func periodType(type: TransactionType, expected: PeriodType) {
        let record = customer([tx("1", type: type, at: t0, expires: t0 + 7 * day)])
        #expect(resolver.resolve(record, at: t0)["premium"]?.periodType == expected)
    }

    @Test("a trial alone has no purchase dates and no renewals")
    func trialOnly() {
        let record = customer([tx("1", type: .trialStarted, at: t0, expires: t0 + 7 * day)])
        let premium = resolver.resolve(record, at: t0)["premium"]
        #expect(premium?.firstPurchaseDate == nil && premium?.lastPurchaseDate == nil)
        #expect(premium?.renewsCount == 0)
    }

    @Test("family sharing sets grantType and ownershipType")
    func familySharing() {
        let record = customer([tx("1", at: t0, expires: t0 + 30 * day, ownership: .familySharing, offer: "ALSO")])
        let premium = resolver.resolve(record, at: t0)["premium"]
        #expect(premium?.grantType == .familySharing)
        #expect(premium?.ownershipType == .familySharing)
    }

    @Test("a purchase without offer codes is grantType purchase")
    func purchase() {
        #expect(resolver.resolve(customer(renewedMonthly), at: t0)["premium"]?.grantType == .purchase)
    }

    // (expiration, state, T, expected renewState)
    static let renewStates: [(String, Int64?, SubscriptionState?, Int64, RenewState)] = [
        ("no expiration", nil, state(), t0, .nonRenewable),
        ("no subscription state", t0 + 30 * day, nil, t0, .unknown),
        ("billing issue detected", t0 + 30 * day, state(billingIssue: t0 + 10 * day), t0 + 10 * day, .billingIssue),
        ("billing issue not yet detected", t0 + 30 * day, state(billingIssue: t0 + 10 * day), t0 + 10 * day - 1, .willRenew),
        ("billing issue beats canceled", t0 + 30 * day, state(autoRenew: false, billingIssue: t0), t0 + day, .billingIssue),
        ("canceled", t0 + 30 * day, state(autoRenew: false), t0, .canceled),
        ("will renew", t0 + 30 * day, state(), t0, .willRenew),
    ]

    @Test("renewState is the first rule that holds", arguments: renewStates)
    func renewState(testCase: (String, Int64?, SubscriptionState?, Int64, RenewState)) {
        let (_, expiration, subscriptionState, instant, expected) = testCase
        let record = customer(
            [tx("1", product: expiration == nil ? "lifetime" : "monthly", at: t0, expires: expiration)],
            states: subscriptionState.map { [$0] } ?? []
        )
        let premium = resolver.resolve(record, at: instant)["premium"]
        #expect(premium?.renewState == expected)
        #expect(premium?.willRenew == (expected == .willRenew))
    }

    @Test("grace period and billing retry flags")
    func graceAndRetry() {
        let record = customer(
            [tx("1", at: t0, expires: t0 + 30 * day)],
            states: [state(billingIssue: t0 + 30 * day, grace: t0 + 46 * day, retry: true)]
        )
        let beforeExpiry = resolver.resolve(record, at: t0 + 30 * day - 1)["premium"]!
        #expect(beforeExpiry.isInGracePeriod == false)
        #expect(beforeExpiry.isInBillingRetry == false)  // no billing issue yet
        let inGrace = resolver.resolve(record, at: t0 + 30 * day)["premium"]!
        #expect(inGrace.isActive && inGrace.isInGracePeriod && inGrace.isInBillingRetry)
        #expect(inGrace.renewState == .billingIssue)
        #expect(inGrace.gracePeriodExpirationDate == t0 + 46 * day)
        #expect(inGrace.billingIssueDetectedDate == t0 + 30 * day)
        let afterGrace = resolver.resolve(record, at: t0 + 46 * day)["premium"]!
        #expect(!afterGrace.isActive && !afterGrace.isInGracePeriod && afterGrace.isInBillingRetry)
    }

    @Test("the retry flag alone, without a billing issue, is not billing retry")
    func retryWithoutIssue() {
        let record = customer([tx("1", at: t0, expires: t0 + 30 * day)], states: [state(retry: true)])
        #expect(resolver.resolve(record, at: t0)["premium"]?.isInBillingRetry == false)
    }
}

@Suite("rule 10: fields of a winning grant")
struct GrantFieldRuleTests {
    @Test("a grant supplies manual source, grant type and non-renewable state")
    func fields() {
        let record = customer(grants: [grant("g1", granted: t0, expires: t0 + 30 * day, revoked: t0 + 10 * day)])
        let premium = resolver.resolve(record, at: t0 + 11 * day)["premium"]!
        #expect(premium.source == .manual)
        #expect(premium.grantType == .manual)
        #expect(premium.renewState == .nonRenewable)
        #expect(premium.startedDate == t0)
        #expect(premium.expirationDate == t0 + 30 * day)
        #expect(premium.isRevoked)
        #expect(!premium.isActive)
        #expect(premium.productId == nil)
        #expect(premium.transactions.isEmpty)
    }
}

@Suite("rule 12: validUntil")
struct ValidUntilRuleTests {
    @Test("validUntil is the earliest future instant of any kind", arguments: [
        ("expiration", customer([tx("1", at: t0, expires: t0 + 30 * day)]), t0 + 30 * day),
        ("revocation", customer([tx("1", at: t0, expires: t0 + 30 * day, revoked: t0 + 3 * day)]), t0 + 3 * day),
        ("future transaction", customer([tx("1", at: t0, expires: t0 + 30 * day), tx("2", at: t0 + 2 * day, expires: t0 + 60 * day)]), t0 + 2 * day),
        ("grace end", customer([tx("1", at: t0 - 40 * day, expires: t0 - day)], states: [state(grace: t0 + 5 * day)]), t0 + 5 * day),
        ("billing issue", customer([tx("1", at: t0, expires: t0 + 30 * day)], states: [state(billingIssue: t0 + 4 * day)]), t0 + 4 * day),
        ("grant start", customer(grants: [grant("g", granted: t0 + 6 * day)]), t0 + 6 * day),
        ("grant end", customer(grants: [grant("g", granted: t0, expires: t0 + 7 * day)]), t0 + 7 * day),
        ("grant revocation", customer(grants: [grant("g", granted: t0, expires: t0 + 70 * day, revoked: t0 + 8 * day)]), t0 + 8 * day),
    ])
    func earliest(name: String, record: CustomerRecord, expected: Int64) {
        #expect(resolver.resolve(record, at: t0 + day).validUntil == expected, "\(name)")
    }

    @Test("validUntil skips the input dates that change no field of the answer", arguments: [
        ("a losing monthly chain beside an annual one that ends later",
         customer([tx("m", chain: "m", product: "monthly", at: t0, expires: t0 + 30 * day), tx("a", chain: "a", product: "annual", at: t0, expires: t0 + 365 * day)]),
         Int64?(t0 + 365 * day)),
        ("a grant beside a lifetime purchase", customer([tx("l", chain: "l", product: "lifetime", type: .nonConsumablePurchase, at: t0)], grants: [grant("g", granted: t0, expires: t0 + 30 * day)]), nil),
        ("the expiry of a transaction already revoked", customer([tx("1", at: t0, expires: t0 + 30 * day, revoked: t0)]), nil),
        ("the expiry of a product that maps no entitlement",
         customer([tx("1", at: t0, expires: t0 + 30 * day), tx("c", chain: "c", product: "coins", at: t0, expires: t0 + 2 * day)]), Int64?(t0 + 30 * day)),
        ("a grace end before the expiration", customer([tx("1", at: t0, expires: t0 + 30 * day)], states: [state(grace: t0 + 3 * day)]), Int64?(t0 + 30 * day)),
    ])
    func exact(name: String, record: CustomerRecord, expected: Int64?) {
        let answer = resolver.resolve(record, at: t0 + day)
        #expect(answer.validUntil == expected, "\(name)")
        if let expected {
            #expect(resolver.resolve(record, at: expected).entitlements != answer.entitlements, "\(name): the answer changes at validUntil")
        }
        #expect(resolver.resolve(record, at: t0 + day, entitlementIds: ["pro"]).validUntil == expected, "\(name): the filter does not change it")
    }

    @Test("validUntil is nil when nothing can change")
    func never() {
        let record = customer(
            [tx("1", product: "lifetime", type: .nonConsumablePurchase, at: t0)],
            grants: [grant("g", granted: t0)]
        )
        #expect(resolver.resolve(record, at: t0 + day).validUntil == nil)
    }

    @Test("instants at or before T do not count")
    func pastInstants() {
        let record = customer([tx("1", at: t0, expires: t0 + day)])
        #expect(resolver.resolve(record, at: t0 + day).validUntil == nil)
    }
}

@Suite("scenarios")
struct ScenarioTests {
    @Test("Stripe past_due: billing issue with a grace period keeps access until the grace end")
    func stripePastDue() {
        let record = customer(
            [tx("in_1", chain: "sub_1", store: .stripe, at: t0, expires: t0 + 30 * day)],
            states: [state(chain: "sub_1", store: .stripe, billingIssue: t0 + 30 * day, grace: t0 + 37 * day, retry: true)]
        )
        let premium = resolver.resolve(record, at: t0 + 32 * day)["premium"]
        #expect(premium?.isActive == true)
        #expect(premium?.source == .stripe)
        #expect(premium?.renewState == .billingIssue)
        #expect(premium?.isInGracePeriod == true)
        #expect(resolver.resolve(record, at: t0 + 32 * day).validUntil == t0 + 37 * day)
    }

    @Test("Stripe canceled at period end: active until the period ends, then not")
    func stripeCanceledAtPeriodEnd() {
        let record = customer(
            [tx("in_1", chain: "sub_1", store: .stripe, at: t0, expires: t0 + 30 * day)],
            states: [state(chain: "sub_1", store: .stripe, autoRenew: false, autoRenewDisabled: t0 + 10 * day)]
        )
        let during = resolver.resolve(record, at: t0 + 20 * day)["premium"]
        #expect(during?.isActive == true && during?.renewState == .canceled && during?.willRenew == false)
        #expect(resolver.resolve(record, at: t0 + 30 * day)["premium"]?.isActive == false)
    }

    @Test("Stripe trialing: a trialStarted transaction")
    func stripeTrialing() {
        let record = customer(
            [tx("in_0", chain: "sub_1", store: .stripe, type: .trialStarted, at: t0, expires: t0 + 14 * day)],
            states: [state(chain: "sub_1", store: .stripe)]
        )
        let premium = resolver.resolve(record, at: t0 + day)["premium"]
        #expect(premium?.periodType == .trial && premium?.isActive == true && premium?.willRenew == true)
    }

    @Test("sandbox-only purchases give nothing in production and access in sandbox")
    func sandboxOnly() {
        let record = customer([tx("1", product: "lifetime", type: .nonConsumablePurchase, at: t0, environment: .sandbox)])
        #expect(resolver.resolve(record, at: t0 + day).entitlements.isEmpty)
        #expect(resolver.resolve(record, at: t0 + day, environment: .sandbox)["premium"]?.isActive == true)
    }
}

@Test("transaction ids compare as numbers when both are numeric")
func idOrder() {
    #expect(compareIds("9", "10"))
    #expect(!compareIds("10", "9"))
    #expect(compareIds("0009", "10"))
    #expect(compareIds("GPA.1", "GPA.2"))
    #expect(compareIds("10", "A"))  // all-digit ids come first
    // Equal values are still ordered, by their bytes, in exactly one direction.
    #expect(compareIds("07", "7") != compareIds("7", "07"))
}

@Test("the id order is a strict total order (antisymmetric, transitive) on mixed ids")
func idOrderIsTotal() {
    let ids = ["9", "10", "1a", "07", "7", "007", "A", "a", "", "0", "00", "GPA.1", "GPA.10", "1", "01"]
    for a in ids {
        #expect(!compareIds(a, a))
        for b in ids where a != b {
            #expect(compareIds(a, b) != compareIds(b, a), "\(a) vs \(b)")
            for c in ids where compareIds(a, b) && compareIds(b, c) {
                #expect(compareIds(a, c), "\(a) < \(b) < \(c)")
            }
        }
    }
}

@Suite("rule 13: subscription status, and the subscription view's fields from the winner")
struct SubscriptionStatusRuleTests {
    let period = [tx("1", type: .subscriptionStarted, at: t0, expires: t0 + 30 * day)]

    @Test("active, trialing, past_due (in grace, or after it while the store retries), canceled (expired, revoked, retries over)")
    func status() {
        #expect(resolver.resolve(customer(period, states: [state()]), at: t0 + day)["premium"]?.status == .active)
        #expect(resolver.resolve(customer(period, states: [state(autoRenew: false)]), at: t0 + day)["premium"]?.status == .active)
        let trial = [tx("1", type: .trialStarted, at: t0, expires: t0 + 7 * day)]
        #expect(resolver.resolve(customer(trial), at: t0 + day)["premium"]?.status == .trialing)
        let failing = state(billingIssue: t0 + 30 * day, grace: t0 + 36 * day, retry: true)
        #expect(resolver.resolve(customer(period, states: [failing]), at: t0 + 31 * day)["premium"]?.status == .pastDue)
        #expect(resolver.resolve(customer(period, states: [failing]), at: t0 + 40 * day)["premium"]?.status == .pastDue, "still retrying")
        var over = failing
        over.isInBillingRetry = false
        #expect(resolver.resolve(customer(period, states: [over]), at: t0 + 40 * day)["premium"]?.status == .canceled, "retries over")
        #expect(resolver.resolve(customer(period), at: t0 + 31 * day)["premium"]?.status == .canceled, "expired")
        let revoked = [tx("1", type: .subscriptionStarted, at: t0, expires: t0 + 30 * day, revoked: t0 + 2 * day)]
        #expect(resolver.resolve(customer(revoked, states: [failing]), at: t0 + 3 * day)["premium"]?.status == .canceled, "revoked")
    }

    @Test("no status and no interval for a non-consumable or a grant; interval from the catalog; price, reason and consent from the winner")
    func viewFields() {
        let lifetime = resolver.resolve(customer([tx("l", chain: "l", product: "lifetime", type: .nonConsumablePurchase, at: t0)]), at: t0 + day)["premium"]
        #expect(lifetime?.status == .unspecified && lifetime?.interval == .unspecified)
        let granted = resolver.resolve(customer(grants: [grant("g", granted: t0)]), at: t0 + day)["premium"]
        #expect(granted?.status == .unspecified && granted?.interval == .unspecified && granted?.priceMicros == nil)
        var paid = tx("a", chain: "a", product: "annual", type: .subscriptionStarted, at: t0, expires: t0 + 365 * day)
        paid.priceMicros = 59_990_000
        paid.currency = "USD"
        var view = state(chain: "a", autoRenew: false)
        view.cancellationReason = .priceIncrease
        view.priceConsentStatus = .notified
        let annual = resolver.resolve(customer([paid], states: [view]), at: t0 + day)["pro"]
        #expect(annual?.interval == .annual)
        #expect(annual?.priceMicros == 59_990_000 && annual?.currency == "USD")
        #expect(annual?.cancellationReason == .priceIncrease && annual?.priceConsentStatus == .notified)
        let monthly = resolver.resolve(customer(period), at: t0 + day)["premium"]
        #expect(monthly?.interval == .monthly && monthly?.priceMicros == nil && monthly?.cancellationReason == .unspecified)
    }
}
