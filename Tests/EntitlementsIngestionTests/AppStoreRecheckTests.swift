import EntitlementsMessages
import Testing

@testable import EntitlementsIngestion

/// Which App Store chains the safety net asks Apple about again (docs/ingestion.md,
/// "Missed notifications"), and when a state read again is news.
@Suite("App Store recheck")
struct AppStoreRecheckTests {
    static let now: Int64 = 1_800_000_000_000
    static let hour: Int64 = 3_600_000
    static let day: Int64 = 86_400_000

    static func period(_ id: String, chain: String = "1000", ends: Int64, revoked: Int64? = nil, store: Source = .appstore) -> Transaction {
        Transaction(
            originalTransactionId: chain, transactionId: id, store: store, productId: "monthly", transactionDate: ends - 30 * day, expirationDate: ends,
            revocationDate: revoked, environment: .sandbox, type: .subscriptionStarted, verified: true
        )
    }

    static func state(heard: Int64?, retrying: Bool = false, ended: Int64? = nil, chain: String = "1000") -> SubscriptionState {
        SubscriptionState(store: .appstore, originalTransactionId: chain, autoRenewEnabled: true, isInBillingRetry: retrying, eventDate: heard, endedDate: ended)
    }

    func due(_ transactions: [Transaction], _ states: [SubscriptionState] = []) -> [AppStoreRecheckRule.Due] {
        AppStoreRecheckRule().due(CustomerRecord(id: "c", transactions: transactions, subscriptions: states), now: Self.now)
    }

    @Test("a period that ended an hour ago with nothing heard since is due, asked about by its latest transaction")
    func missedPeriodEnd() {
        let found = self.due([Self.period("1000", ends: Self.now - 31 * Self.day), Self.period("1001", ends: Self.now - 2 * Self.hour)], [Self.state(heard: Self.now - 31 * Self.day)])
        #expect(found == [AppStoreRecheckRule.Due(customerId: "c", originalTransactionId: "1000", transactionId: "1001", environment: .sandbox, reason: "missed_period_end")])
        #expect(self.due([Self.period("1000", ends: Self.now - 2 * Self.hour)]).count == 1, "no state at all: nothing was heard")
    }

    @Test("not due: running, within the hour's margin, heard of since the end, refunded, ended, older than 60 days, or not the App Store's")
    func notDue() {
        #expect(self.due([Self.period("1", ends: Self.now + Self.day)]).isEmpty)
        #expect(self.due([Self.period("1", ends: Self.now - Self.hour / 2)]).isEmpty)
        #expect(self.due([Self.period("1", ends: Self.now - 2 * Self.hour)], [Self.state(heard: Self.now - Self.hour)]).isEmpty)
        #expect(self.due([Self.period("1", ends: Self.now - 2 * Self.hour, revoked: Self.now - 3 * Self.hour)]).isEmpty)
        #expect(self.due([Self.period("1", ends: Self.now - 2 * Self.hour)], [Self.state(heard: nil, ended: Self.now - 3 * Self.hour)]).isEmpty)
        #expect(self.due([Self.period("1", ends: Self.now - 61 * Self.day)]).isEmpty)
        #expect(self.due([Self.period("1", ends: Self.now - 2 * Self.hour, store: .playstore)]).isEmpty)
    }

    @Test("in billing retry: due once a day while nothing is heard")
    func billingRetry() {
        let ended = Self.now - 3 * Self.day
        #expect(self.due([Self.period("1", ends: ended)], [Self.state(heard: Self.now - 2 * Self.day, retrying: true)]).map(\.reason) == ["billing_retry"])
        #expect(self.due([Self.period("1", ends: ended)], [Self.state(heard: Self.now - Self.hour, retrying: true)]).isEmpty)
        #expect(self.due([Self.period("1", ends: ended)], [Self.state(heard: Self.now - 2 * Self.day)]).isEmpty, "not retrying: it expired, as heard")
    }

    @Test("each chain of a customer on its own")
    func chains() {
        let found = self.due(
            [Self.period("1", chain: "a", ends: Self.now - 2 * Self.hour), Self.period("2", chain: "b", ends: Self.now + Self.day)],
            [Self.state(heard: Self.now - 40 * Self.day, chain: "a"), Self.state(heard: Self.now - 40 * Self.day, chain: "b")]
        )
        #expect(found.map(\.originalTransactionId) == ["a"])
    }

    @Test("a state read again is news only when more than its date changed")
    func sameNews() {
        var stored = Self.state(heard: 100)
        stored.autoRenewEnabled = false
        stored.autoRenewDisabledDate = 50
        stored.cancellationReason = .customer
        var incoming = Self.state(heard: 200)
        incoming.autoRenewEnabled = false
        #expect(StoreEventApplier.sameNews(stored, incoming), "the API does not say when auto-renew went off, or why: kept")
        incoming.isInBillingRetry = true
        #expect(!StoreEventApplier.sameNews(stored, incoming))
        #expect(!StoreEventApplier.sameNews(stored, Self.state(heard: 200)), "auto-renew back on")
        #expect(!StoreEventApplier.sameNews(Self.state(heard: nil), Self.state(heard: 200)), "an undated stored state is replaced")
    }
}
