import EntitlementsMessages
import PropertyBased
import Testing

@testable import EntitlementsResolver

/// Properties over random customers. Dates fall on a coarse grid (whole hours within four
/// days) and so does T, so that equal instants (T at an expiration, a grace end, a
/// revocation) come up often.
@Suite("resolver properties")
struct ResolverPropertyTests {
    @Test("the answer does not depend on the order of transactions, states or grants")
    func orderIndependence() async {
        await propertyCheck(count: 300, input: Gen.int(in: 0...Int.max)) { seed in
            var random = SplitMix64(seed: UInt64(seed))
            let record = RandomCustomer.make(using: &random)
            let instant = RandomCustomer.instant(using: &random)
            let environment: Environment = random.next() % 4 == 0 ? .sandbox : .production
            var shuffled = record
            shuffled.transactions.shuffle(using: &random)
            shuffled.subscriptions.shuffle(using: &random)
            shuffled.grants.shuffle(using: &random)
            let expected = resolver.resolve(record, at: instant, environment: environment)
            #expect(resolver.resolve(shuffled, at: instant, environment: environment) == expected, "seed \(seed)")
        }
    }

    @Test("an answer stays exact for every T' in [T, validUntil)")
    func exactUntilValidUntil() async {
        await propertyCheck(count: 300, input: Gen.int(in: 0...Int.max)) { seed in
            var random = SplitMix64(seed: UInt64(seed))
            let record = RandomCustomer.make(using: &random)
            let instant = RandomCustomer.instant(using: &random)
            let answer = resolver.resolve(record, at: instant)
            let end = answer.validUntil ?? instant + 10 * day
            // Both ends of the interval, and instants inside it.
            var probes: [Int64] = [instant, end - 1]
            for _ in 0..<8 {
                probes.append(instant + Int64(random.next() % UInt64(end - instant)))
            }
            for probe in probes {
                #expect(resolver.resolve(record, at: probe) == answer, "seed \(seed), T=\(instant), T'=\(probe)")
            }
        }
    }

    @Test("validUntil is exact: the first instant a brute-force search finds a field of the answer changed at, never later")
    func validUntilAgainstBruteForce() {
        var exact = 0
        var total = 0
        for seed in 1...400 {
            var random = SplitMix64(seed: UInt64(seed))
            let record = RandomCustomer.make(using: &random)
            let instant = RandomCustomer.instant(using: &random)
            let answer = resolver.resolve(record, at: instant)
            // Every instant the generated dates can fall on (whole hours), and the
            // millisecond after each, from T on: the first at which the entitlements differ.
            var changed: Int64?
            search: for hour in 0...Int64(160) {
                for probe in [t0 + hour * Self.hour, t0 + hour * Self.hour + 1] where probe > instant {
                    if resolver.resolve(record, at: probe).entitlements != answer.entitlements {
                        changed = probe
                        break search
                    }
                }
            }
            total += 1
            if answer.validUntil == changed {
                exact += 1
            }
            if let validUntil = answer.validUntil {
                #expect(validUntil <= changed ?? .max, "seed \(seed): validUntil \(validUntil) is after the change at \(changed.map(String.init) ?? "never")")
            } else {
                #expect(changed == nil, "seed \(seed): validUntil is nil, but the answer changes at \(changed ?? 0)")
            }
        }
        let share = Double(exact) / Double(total)
        print("validUntil exact in \(exact) of \(total) generated customers (\(String(format: "%.1f", share * 100))%), never late")
        #expect(share >= 0.95, "exact in \(exact) of \(total)")
    }

    static let hour: Int64 = 3_600_000

    @Test("validUntil is a real change point or later: some input date equals it")
    func validUntilIsAnInputDate() async {
        await propertyCheck(count: 200, input: Gen.int(in: 0...Int.max)) { seed in
            var random = SplitMix64(seed: UInt64(seed))
            let record = RandomCustomer.make(using: &random)
            let instant = RandomCustomer.instant(using: &random)
            guard let validUntil = resolver.resolve(record, at: instant).validUntil else {
                return
            }
            #expect(validUntil > instant)
            let dates = record.transactions.flatMap { [$0.transactionDate, $0.expirationDate, $0.revocationDate] }
                + record.subscriptions.flatMap { [$0.gracePeriodExpirationDate, $0.billingIssueDetectedDate] }
                + record.grants.flatMap { [$0.grantedDate, $0.expirationDate, $0.revokedDate] }
            #expect(dates.contains(validUntil), "seed \(seed)")
        }
    }
}

/// Deterministic random numbers (SplitMix64), so that a seed reproduces a customer.
struct SplitMix64: RandomNumberGenerator {
    private var state: UInt64

    init(seed: UInt64) {
        self.state = seed
    }

    mutating func next() -> UInt64 {
        self.state &+= 0x9E37_79B9_7F4A_7C15
        var z = self.state
        z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
        z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
        return z ^ (z >> 31)
    }
}

enum RandomCustomer {
    static let products = ["monthly", "annual", "lifetime", "coins", "pro.monthly", "unknown.product"]
    static let types: [TransactionType] = [
        .subscriptionStarted, .subscriptionRenewed, .trialStarted, .introStarted, .introRenewed, .nonConsumablePurchase,
    ]

    static func instant(using random: inout SplitMix64) -> Int64 {
        t0 + Int64(random.next() % 96) * hour
    }

    static func date(using random: inout SplitMix64) -> Int64 {
        t0 + Int64(random.next() % 96) * hour
    }

    static func maybeDate(using random: inout SplitMix64, rate: UInt64 = 3) -> Int64? {
        random.next() % rate == 0 ? Self.date(using: &random) : nil
    }

    static func make(using random: inout SplitMix64) -> CustomerRecord {
        var record = CustomerRecord(id: "user-1")
        let chains = Int(random.next() % 4)
        var transactionNumber = 0
        for chain in 0..<chains {
            let store: Source = [.appstore, .playstore, .stripe][Int(random.next() % 3)]
            let chainId = "chain-\(chain)"
            for _ in 0..<(1 + Int(random.next() % 4)) {
                transactionNumber += 1
                let start = Self.date(using: &random)
                let type = Self.types[Int(random.next() % UInt64(Self.types.count))]
                record.transactions.append(
                    Transaction(
                        originalTransactionId: chainId,
                        transactionId: String(transactionNumber),
                        store: store,
                        productId: Self.products[Int(random.next() % UInt64(Self.products.count))],
                        offerCode: random.next() % 4 == 0 ? "CODE\(transactionNumber)" : nil,
                        transactionDate: start,
                        expirationDate: type == .nonConsumablePurchase ? nil : start + Int64(1 + random.next() % 48) * hour,
                        revocationDate: Self.maybeDate(using: &random, rate: 5),
                        environment: random.next() % 5 == 0 ? .sandbox : .production,
                        ownershipType: random.next() % 5 == 0 ? .familySharing : .owner,
                        type: type
                    )
                )
            }
            if random.next() % 3 != 0 {
                record.subscriptions.append(
                    SubscriptionState(
                        store: store,
                        originalTransactionId: chainId,
                        autoRenewEnabled: random.next() % 2 == 0,
                        autoRenewDisabledDate: Self.maybeDate(using: &random),
                        billingIssueDetectedDate: Self.maybeDate(using: &random),
                        gracePeriodExpirationDate: Self.maybeDate(using: &random),
                        isInBillingRetry: random.next() % 2 == 0
                    )
                )
            }
        }
        for index in 0..<Int(random.next() % 3) {
            let granted = Self.date(using: &random)
            record.grants.append(
                Grant(
                    grantId: "g\(index)",
                    entitlementId: ["premium", "pro"][Int(random.next() % 2)],
                    grantedDate: granted,
                    expirationDate: random.next() % 2 == 0 ? granted + Int64(1 + random.next() % 48) * hour : nil,
                    revokedDate: Self.maybeDate(using: &random, rate: 4)
                )
            )
        }
        return record
    }
}
