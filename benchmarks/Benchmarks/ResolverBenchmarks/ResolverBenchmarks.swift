import Benchmark
import EntitlementsMessages
import EntitlementsResolver

let start: Int64 = 1_735_689_600_000  // 2025-01-01
let month: Int64 = 30 * 86_400_000

let catalog = Catalog(products: [
    Product(id: "com.app.monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
    Product(id: "com.app.annual", type: .subscription, period: .annual, entitlements: ["premium", "pro"]),
    Product(id: "com.app.lifetime", type: .nonConsumable, entitlements: ["premium"]),
    Product(id: "com.app.coins", type: .consumable, entitlements: []),
])

func chain(_ id: String, product: String, periods: Int, from first: Int64, length: Int64) -> [Transaction] {
    (0..<periods).map { index in
        Transaction(
            originalTransactionId: id,
            transactionId: "\(id)-\(index)",
            store: .appstore,
            productId: product,
            transactionDate: first + Int64(index) * length,
            expirationDate: first + Int64(index + 1) * length,
            environment: .production,
            ownershipType: .owner,
            type: index == 0 ? .trialStarted : .subscriptionRenewed
        )
    }
}

/// A typical paying customer: a monthly subscription, trial then 11 renewals, with its
/// renewal state, evaluated in the middle of the current period.
let typicalCustomer = CustomerRecord(
    id: "user-4f2a9c71",
    aliases: ["$anon:1"],
    transactions: chain("2000000712345678", product: "com.app.monthly", periods: 12, from: start, length: month),
    subscriptions: [SubscriptionState(store: .appstore, originalTransactionId: "2000000712345678", autoRenewEnabled: true)]
)

/// A heavy customer: three chains (a lapsed monthly, an active annual, coins), a lifetime
/// purchase and two grants; 40 transactions.
let heavyCustomer = CustomerRecord(
    id: "user-heavy",
    transactions: chain("m", product: "com.app.monthly", periods: 30, from: start - 36 * month, length: month)
        + chain("a", product: "com.app.annual", periods: 3, from: start - 24 * month, length: 12 * month)
        + chain("c", product: "com.app.coins", periods: 6, from: start, length: month)
        + [Transaction(originalTransactionId: "l", transactionId: "l", store: .playstore, productId: "com.app.lifetime",
                       transactionDate: start, environment: .production, ownershipType: .owner, type: .nonConsumablePurchase)],
    subscriptions: [
        SubscriptionState(store: .appstore, originalTransactionId: "m", autoRenewEnabled: false),
        SubscriptionState(store: .appstore, originalTransactionId: "a", autoRenewEnabled: true),
    ],
    grants: [
        Grant(grantId: "g1", entitlementId: "pro", grantedDate: start, expirationDate: start + month),
        Grant(grantId: "g2", entitlementId: "beta", grantedDate: start),
    ]
)

let benchmarks: @Sendable () -> Void = {
    Benchmark.defaultConfiguration = .init(
        metrics: [.wallClock, .mallocCountTotal, .throughput],
        timeUnits: .nanoseconds,
        warmupIterations: 10,
        scalingFactor: .kilo,
        maxDuration: .seconds(3),
        maxIterations: 100_000
    )
    let resolver = EntitlementResolver(catalog: catalog)
    let instant = start + 11 * month + month / 2

    Benchmark("resolve.typical-customer") { benchmark in
        for _ in benchmark.scaledIterations {
            blackHole(resolver.resolve(typicalCustomer, at: instant))
        }
    }

    Benchmark("resolve.heavy-customer") { benchmark in
        for _ in benchmark.scaledIterations {
            blackHole(resolver.resolve(heavyCustomer, at: instant))
        }
    }

    Benchmark("resolve.unknown-user") { benchmark in
        for _ in benchmark.scaledIterations {
            blackHole(resolver.resolve(nil, at: instant))
        }
    }
}
