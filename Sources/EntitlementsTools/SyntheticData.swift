public import EntitlementsMessages

/// Realistic synthetic customers for demos, tests and benchmarks
/// (`entitlements snapshot generate`). Deterministic: customer `i` depends only on the
/// seed, `i` and the reference instant `now`, so any slice can be made on its own.
///
/// The mix, per 100 customers: 30 never paid (some bought coins), 8 in or after a trial,
/// 24 active subscriptions (App Store, Play Store, Stripe; renewals, offer codes, intro
/// periods, family sharing), 12 lapsed or canceled, 5 lifetime purchases, 3 refunded,
/// 4 in a billing-issue grace period, 2 in billing retry without grace, 5 with manual
/// grants, 4 with a lifetime purchase and a subscription, 3 with sandbox purchases only.
/// A quarter have an anonymous alias (`$anon:` and 16 hex digits).
public struct SyntheticData: Sendable {
    /// The catalog every generated customer buys from.
    public static let catalog = Catalog(products: [
        Product(id: "com.example.premium.weekly", type: .subscription, period: .weekly, entitlements: ["premium"]),
        Product(id: "com.example.premium.monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
        Product(id: "com.example.premium.annual", type: .subscription, period: .annual, entitlements: ["premium"]),
        Product(id: "com.example.pro.monthly", type: .subscription, period: .monthly, entitlements: ["premium", "pro"]),
        Product(id: "com.example.lifetime", type: .nonConsumable, entitlements: ["premium", "ad_free"]),
        Product(id: "com.example.coins.100", type: .consumable, entitlements: []),
        Product(id: "play.premium.monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
        Product(id: "play.pro.annual", type: .subscription, period: .annual, entitlements: ["premium", "pro"]),
        Product(id: "stripe.premium.monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
        Product(id: "stripe.team.annual", type: .subscription, period: .annual, entitlements: ["premium", "pro", "team"]),
    ])

    public let seed: UInt64
    /// The reference instant: active subscriptions are active then.
    public let now: Int64

    /// Creates a generator.
    public init(seed: UInt64, now: Int64) {
        self.seed = seed
        self.now = now
    }

    /// The id of customer `index`.
    public static func customerId(_ index: Int) -> String {
        "user-\(index)"
    }

    /// The hot list of a generated snapshot: the first customers, hottest first. A
    /// Zipf-distributed load generator picks low indices most, so these are the hot ones.
    public static func hotList(customers: Int, limit: Int = 100_000) -> [String] {
        (0..<min(customers, limit)).map(Self.customerId)
    }

    private static let day: Int64 = 86_400_000

    private enum Kind {
        case neverPaid, trial, active, lapsed, lifetime, refunded, grace, billingRetry, grants, lifetimeAndSubscription, sandbox
    }

    private static let mix: [(Kind, Int)] = [
        (.neverPaid, 30), (.trial, 8), (.active, 24), (.lapsed, 12), (.lifetime, 5), (.refunded, 3),
        (.grace, 4), (.billingRetry, 2), (.grants, 5), (.lifetimeAndSubscription, 4), (.sandbox, 3),
    ]

    /// Customer `index`.
    public func customer(_ index: Int) -> CustomerRecord {
        var random = Random(seed: self.seed, index: UInt64(index))
        var builder = Builder(index: index, now: self.now, random: random)
        var roll = Int(random.next() % 100)
        var kind = Kind.neverPaid
        for (candidate, weight) in Self.mix {
            if roll < weight {
                kind = candidate
                break
            }
            roll -= weight
        }
        builder.random = random
        switch kind {
        case .neverPaid:
            if builder.chance(20) {
                builder.consumable()
            }
        case .trial:
            builder.subscription(periodsAgo: 0, trial: true, endedDaysAgo: builder.chance(50) ? nil : builder.int(1...60))
        case .active:
            builder.subscription(periodsAgo: builder.int(0...24), trial: builder.chance(30), endedDaysAgo: nil)
        case .lapsed:
            builder.subscription(periodsAgo: builder.int(1...12), trial: builder.chance(30), endedDaysAgo: builder.int(1...400))
        case .lifetime:
            builder.lifetime()
        case .refunded:
            builder.subscription(periodsAgo: builder.int(0...6), trial: false, endedDaysAgo: nil, refundLatest: true)
        case .grace:
            builder.subscription(periodsAgo: builder.int(1...12), trial: false, endedDaysAgo: builder.int(1...5), billingIssue: .grace)
        case .billingRetry:
            builder.subscription(periodsAgo: builder.int(1...12), trial: false, endedDaysAgo: builder.int(1...30), billingIssue: .retry)
        case .grants:
            builder.grant()
            if builder.chance(30) { builder.grant() }
        case .lifetimeAndSubscription:
            builder.lifetime()
            builder.subscription(periodsAgo: builder.int(0...12), trial: false, endedDaysAgo: builder.chance(50) ? nil : builder.int(1...90))
        case .sandbox:
            builder.subscription(periodsAgo: builder.int(0...3), trial: false, endedDaysAgo: nil, environment: .sandbox)
        }
        if builder.chance(25) {
            builder.record.aliases.append("$anon:" + builder.hex(16))
        }
        return builder.record
    }

    /// SplitMix64 seeded from (seed, index).
    private struct Random {
        private var state: UInt64

        init(seed: UInt64, index: UInt64) {
            self.state = seed &* 0x9E37_79B9_7F4A_7C15 ^ index &* 0xBF58_476D_1CE4_E5B9 ^ 0x94D0_49BB_1331_11EB
            _ = self.next()
        }

        mutating func next() -> UInt64 {
            self.state &+= 0x9E37_79B9_7F4A_7C15
            var z = self.state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return z ^ (z >> 31)
        }
    }

    private enum BillingIssue {
        case grace, retry
    }

    private struct Builder {
        var record: CustomerRecord
        var random: Random
        let index: Int
        let now: Int64
        var transactionNumber = 0

        init(index: Int, now: Int64, random: Random) {
            self.record = CustomerRecord(id: SyntheticData.customerId(index))
            self.random = random
            self.index = index
            self.now = now
        }

        mutating func chance(_ percent: Int) -> Bool {
            Int(self.random.next() % 100) < percent
        }

        mutating func int(_ range: ClosedRange<Int>) -> Int {
            range.lowerBound + Int(self.random.next() % UInt64(range.count))
        }

        mutating func hex(_ digits: Int) -> String {
            var text = String(self.random.next(), radix: 16)
            text = String(repeating: "0", count: max(0, 16 - text.count)) + text
            return String(text.prefix(digits))
        }

        mutating func pick<T>(_ options: [T]) -> T {
            options[Int(self.random.next() % UInt64(options.count))]
        }

        mutating func transactionId(store: Source) -> String {
            self.transactionNumber += 1
            switch store {
            case .playstore: return "GPA.\(3_300 + self.index % 700)-\(self.index)-\(self.transactionNumber)"
            case .stripe: return "in_\(self.hex(14))"
            default: return String(2_000_000_000_000_000 + self.index * 1_000 + self.transactionNumber)
            }
        }

        mutating func consumable() {
            let id = self.transactionId(store: .appstore)
            self.record.transactions.append(
                Transaction(
                    originalTransactionId: id, transactionId: id, store: .appstore, productId: "com.example.coins.100",
                    transactionDate: self.now - Int64(self.int(1...300)) * SyntheticData.day,
                    environment: .production, ownershipType: .owner, type: .nonConsumablePurchase
                )
            )
        }

        mutating func lifetime() {
            let store: Source = self.chance(70) ? .appstore : .playstore
            let id = self.transactionId(store: store)
            self.record.transactions.append(
                Transaction(
                    originalTransactionId: id, transactionId: id, store: store, productId: "com.example.lifetime",
                    transactionDate: self.now - Int64(self.int(1...900)) * SyntheticData.day,
                    environment: .production, ownershipType: .owner, type: .nonConsumablePurchase
                )
            )
        }

        mutating func grant() {
            let granted = self.now - Int64(self.int(0...120)) * SyntheticData.day
            let lifetime = self.chance(40)
            self.record.grants.append(
                Grant(
                    grantId: "grant-\(self.record.grants.count + 1)",
                    entitlementId: self.pick(["premium", "pro", "premium"]),
                    grantedDate: granted,
                    expirationDate: lifetime ? nil : granted + Int64(self.pick([7, 30, 90])) * SyntheticData.day,
                    revokedDate: self.chance(10) ? granted + Int64(self.int(1...5)) * SyntheticData.day : nil,
                    reason: self.pick(["support ticket", "partner promotion", "beta tester", "outage apology"])
                )
            )
        }

        /// A chain of periods: an optional trial, then `periodsAgo` paid periods before the
        /// current one; `endedDaysAgo` nil means the last period covers `now`.
        mutating func subscription(
            periodsAgo: Int,
            trial: Bool,
            endedDaysAgo: Int?,
            refundLatest: Bool = false,
            billingIssue: BillingIssue? = nil,
            environment: Environment = .production
        ) {
            let storeRoll = self.int(0...99)
            let store: Source = storeRoll < 55 ? .appstore : storeRoll < 85 ? .playstore : .stripe
            let product: String
            switch store {
            case .playstore: product = self.pick(["play.premium.monthly", "play.premium.monthly", "play.pro.annual"])
            case .stripe: product = self.pick(["stripe.premium.monthly", "stripe.premium.monthly", "stripe.team.annual"])
            default: product = self.pick(["com.example.premium.monthly", "com.example.premium.monthly", "com.example.premium.annual", "com.example.pro.monthly", "com.example.premium.weekly"])
            }
            let days: Int64 = product.hasSuffix("annual") ? 365 : product.hasSuffix("weekly") ? 7 : 30
            let period = days * SyntheticData.day
            let offer = self.chance(10) ? self.pick(["SPRING24", "WINBACK", "FRIENDS", "LAUNCH50"]) : nil
            let family = store == .appstore && self.chance(4)
            let intro = !trial && self.chance(10)
            let original = store == .stripe ? "sub_\(self.hex(14))" : self.transactionId(store: store)

            // The last period ends `endedDaysAgo` before now, or covers now.
            let lastEnd = endedDaysAgo.map { self.now - Int64($0) * SyntheticData.day }
                ?? self.now + Int64(self.int(1...Int(days))) * SyntheticData.day - Int64(self.int(0...3_600)) * 1_000
            let paidPeriods = trial && periodsAgo == 0 && endedDaysAgo != nil && self.chance(60) ? 0 : periodsAgo + 1
            let trialLength = 7 * SyntheticData.day
            var end = lastEnd
            var periods: [(start: Int64, end: Int64, type: TransactionType)] = []
            for number in stride(from: paidPeriods - 1, through: 0, by: -1) {
                let type: TransactionType
                if number == 0 {
                    type = intro ? .introStarted : .subscriptionStarted
                } else {
                    type = intro && number == 1 ? .introRenewed : .subscriptionRenewed
                }
                periods.insert((end - period, end, type), at: 0)
                end -= period
            }
            if trial {
                periods.insert((end - trialLength, end, .trialStarted), at: 0)
            }
            for (position, span) in periods.enumerated() {
                let id = position == 0 && store != .stripe ? original : self.transactionId(store: store)
                let isLatest = position == periods.count - 1
                self.record.transactions.append(
                    Transaction(
                        originalTransactionId: original,
                        transactionId: id,
                        store: store,
                        productId: product,
                        offerCode: position == 0 || (isLatest && offer != nil && self.chance(50)) ? offer : nil,
                        transactionDate: span.start,
                        expirationDate: span.end,
                        revocationDate: isLatest && refundLatest ? max(span.start, min(self.now - 1_000, span.start + SyntheticData.day)) : nil,
                        environment: environment,
                        ownershipType: family ? .familySharing : .owner,
                        type: span.type
                    )
                )
            }
            var state = SubscriptionState(store: store, originalTransactionId: original, autoRenewEnabled: true)
            switch billingIssue {
            case .grace:
                state.billingIssueDetectedDate = lastEnd
                state.gracePeriodExpirationDate = lastEnd + (store == .stripe ? 7 : 16) * SyntheticData.day
                state.isInBillingRetry = true
            case .retry:
                state.billingIssueDetectedDate = lastEnd
                state.isInBillingRetry = true
            case nil:
                if endedDaysAgo != nil || refundLatest || self.chance(12) {
                    state.autoRenewEnabled = false
                    let disabled = max(periods[periods.count - 1].start, lastEnd - Int64(self.int(1...20)) * SyntheticData.day)
                    state.autoRenewDisabledDate = min(self.now, disabled)
                }
            }
            if !(store == .stripe && self.chance(5)) {  // a few Stripe chains lack a state: renewState unknown
                self.record.subscriptions.append(state)
            }
        }
    }
}
