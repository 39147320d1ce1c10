import EntitlementsMessages
import EntitlementsResolver

/// Builders that keep the rule tables short. Dates are Unix milliseconds; `day` and
/// `hour` count from `t0` (2026-01-01T00:00:00Z).
let t0: Int64 = 1_767_225_600_000
let hour: Int64 = 3_600_000
let day: Int64 = 86_400_000

/// monthly and annual unlock premium (annual also pro); lifetime is a non-consumable
/// premium; coins is a consumable that lists premium but must unlock nothing; pro.monthly
/// unlocks pro only.
let testCatalog = Catalog(products: [
    Product(id: "monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
    Product(id: "annual", type: .subscription, period: .annual, entitlements: ["premium", "pro"]),
    Product(id: "lifetime", type: .nonConsumable, entitlements: ["premium"]),
    Product(id: "coins", type: .consumable, entitlements: ["premium"]),
    Product(id: "pro.monthly", type: .subscription, period: .monthly, entitlements: ["pro"]),
])

let resolver = EntitlementResolver(catalog: testCatalog)

func tx(
    _ id: String,
    chain: String = "c1",
    store: Source = .appstore,
    product: String = "monthly",
    type: TransactionType = .subscriptionRenewed,
    at date: Int64,
    expires: Int64? = nil,
    revoked: Int64? = nil,
    environment: Environment = .production,
    ownership: OwnershipType = .owner,
    offer: String? = nil
) -> Transaction {
    Transaction(
        originalTransactionId: chain,
        transactionId: id,
        store: store,
        productId: product,
        offerCode: offer,
        transactionDate: date,
        expirationDate: expires,
        revocationDate: revoked,
        environment: environment,
        ownershipType: ownership,
        type: type
    )
}

func state(
    chain: String = "c1",
    store: Source = .appstore,
    autoRenew: Bool = true,
    autoRenewDisabled: Int64? = nil,
    billingIssue: Int64? = nil,
    grace: Int64? = nil,
    retry: Bool = false
) -> SubscriptionState {
    SubscriptionState(
        store: store,
        originalTransactionId: chain,
        autoRenewEnabled: autoRenew,
        autoRenewDisabledDate: autoRenewDisabled,
        billingIssueDetectedDate: billingIssue,
        gracePeriodExpirationDate: grace,
        isInBillingRetry: retry
    )
}

func grant(_ id: String, _ entitlement: String = "premium", granted: Int64, expires: Int64? = nil, revoked: Int64? = nil) -> Grant {
    Grant(grantId: id, entitlementId: entitlement, grantedDate: granted, expirationDate: expires, revokedDate: revoked, reason: "test")
}

func customer(
    _ transactions: [Transaction] = [],
    states: [SubscriptionState] = [],
    grants: [Grant] = []
) -> CustomerRecord {
    CustomerRecord(id: "user-1", transactions: transactions, subscriptions: states, grants: grants)
}

/// A monthly chain started at t0 and renewed once: periods [t0, t0+30d) and [t0+30d, t0+60d).
let renewedMonthly = [
    tx("1", type: .subscriptionStarted, at: t0, expires: t0 + 30 * day),
    tx("2", at: t0 + 30 * day, expires: t0 + 60 * day),
]

extension Resolution {
    /// The entitlement with `id`, if the answer has one.
    subscript(id: String) -> Entitlement? {
        self.entitlements.first { $0.id == id }
    }
}
