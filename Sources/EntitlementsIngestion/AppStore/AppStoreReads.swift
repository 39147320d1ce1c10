import EntitlementsFormats
import EntitlementsMessages
import Logging

/// What the App Store Server API said about one subscription chain (or, from the history,
/// one transaction): verified writes, and the account token the app set at purchase.
struct AppStoreRead: Sendable {
    var original: String
    var writes: [StoreWrite]
    var accountToken: String?
}

extension WebhookIngestion {
    /// Get All Subscription Statuses for the customer who made `transactionId`: one read per
    /// subscription chain, its JWS verified as notifications are. With `onlyNews`, a state
    /// that says nothing new is not written (a caller's repeated submission); without it
    /// (the recheck) the newer date is recorded: the chain was heard of.
    /// With `chain`, only that chain is read (another chain's product missing from the
    /// catalog does not fail it).
    func appStoreStatuses(
        _ api: AppStoreServerAPI, transactionId: String, bundleId: String, environment: Environment, chain: String? = nil, onlyNews: Bool = true,
        catalogContains: (String) -> Bool
    ) async throws -> [AppStoreRead] {
        guard let appStore = self.appStore else { return [] }
        let answer = try await self.countingAppStoreCall("statuses") {
            try await api.statuses(transactionId: transactionId, bundleId: bundleId, environment: environment)
        }
        var reads: [AppStoreRead] = []
        for group in answer["data"].array {
            for item in group["lastTransactions"].array {
                if let chain, let original = item["originalTransactionId"].string, original != chain {
                    continue
                }
                guard let signedTransaction = item["signedTransactionInfo"].string else {
                    throw IngestionRetry(.storeUnavailable, "Get All Subscription Statuses: an item without signedTransactionInfo")
                }
                let transaction = try await appStore.verifier.verify(signedTransaction, what: "Get All Subscription Statuses' signedTransactionInfo")
                var renewal: EventJSON?
                if let signedRenewal = item["signedRenewalInfo"].string {
                    renewal = try await appStore.verifier.verify(signedRenewal, what: "Get All Subscription Statuses' signedRenewalInfo")
                }
                let writes = try appStore.notifications.apiWrites(transaction: transaction, renewal: renewal, onlyNews: onlyNews, catalogContains: catalogContains)
                if let original = transaction["originalTransactionId"].string, !writes.isEmpty {
                    reads.append(AppStoreRead(original: original, writes: writes, accountToken: Self.accountToken(transaction)))
                }
            }
        }
        return reads
    }

    /// Get Transaction History (v2) of the customer who made `transactionId`, every page
    /// (20 transactions each, by `revision`), oldest first: one read per transaction that
    /// records one (consumables and non-renewing subscriptions do not), and the count of
    /// transactions Apple listed.
    func appStoreHistory(_ api: AppStoreServerAPI, transactionId: String, bundleId: String, environment: Environment, catalogContains: (String) -> Bool) async throws -> (reads: [AppStoreRead], listed: Int) {
        guard let appStore = self.appStore else { return ([], 0) }
        var reads: [AppStoreRead] = []
        var listed = 0
        var revision: String?
        for page in 1...Self.historyPageLimit {
            let answer = try await self.countingAppStoreCall("history") {
                try await api.history(transactionId: transactionId, bundleId: bundleId, environment: environment, revision: revision)
            }
            for signed in answer["signedTransactions"].array {
                guard let jws = signed.string else {
                    throw IngestionRetry(.storeUnavailable, "Get Transaction History: signedTransactions holds something that is not a JWS")
                }
                listed += 1
                let transaction = try await appStore.verifier.verify(jws, what: "Get Transaction History's transaction")
                guard case .record(let record) = try appStore.notifications.record(transaction, what: "Get Transaction History", environment: nil, catalogContains: catalogContains) else {
                    continue
                }
                reads.append(
                    AppStoreRead(
                        original: record.originalTransactionId!, writes: [.transaction(record, keepRevocation: record.revocationDate == nil)],
                        accountToken: Self.accountToken(transaction)
                    )
                )
            }
            guard answer["hasMore"].bool == true else {
                return (reads, listed)
            }
            guard let next = answer["revision"].string, next != revision else {
                throw IngestionRetry(.storeUnavailable, "Get Transaction History: page \(page) says hasMore without a new revision")
            }
            revision = next
        }
        throw IngestionRetry(.storeUnavailable, "Get Transaction History: more than \(Self.historyPageLimit) pages (\(Self.historyPageLimit * 20) transactions); refused rather than read without end")
    }

    /// The most pages a backfill reads.
    static let historyPageLimit = 500

    /// Runs `body` with each app (`--appstore-bundle-id`) and environment in turn until one
    /// knows the transaction (Apple answers 404 for a transaction of another app or
    /// environment); the last refusal when none does.
    func firstAppStoreApp<T>(bundleIds: [String], environments: [Environment], _ body: (String, Environment) async throws -> T) async throws -> (T, String, Environment) {
        var unknown: IngestionRejection?
        var asked: [String] = []
        for environment in environments {
            for bundleId in bundleIds {
                do {
                    return (try await body(bundleId, environment), bundleId, environment)
                } catch let rejection as IngestionRejection where rejection.reason == .unknownTransaction {
                    unknown = rejection
                    asked.append("\(bundleId) in \(environment == .sandbox ? "the sandbox" : "production")")
                }
            }
        }
        guard var unknown else {
            throw IngestionRetry(.storeNotConfigured, "no --appstore-bundle-id to ask Apple about")
        }
        if asked.count > 1 {
            unknown.message += "; asked: " + asked.joined(separator: ", ")
        }
        throw unknown
    }

    /// Counts an App Store Server API call in
    /// `entitlements_appstore_api_requests_total{call, outcome}` (outcome: `ok`, or the
    /// failure's reason).
    private func countingAppStoreCall(_ call: String, _ body: () async throws -> EventJSON) async throws -> EventJSON {
        do {
            let answer = try await body()
            self.increment("entitlements_appstore_api_requests_total", [("call", call), ("outcome", "ok")])
            return answer
        } catch {
            let reason =
                switch error {
                case let rejection as IngestionRejection: rejection.reason.rawValue
                case let retry as IngestionRetry: retry.reason.rawValue
                default: "error"
                }
            self.increment("entitlements_appstore_api_requests_total", [("call", call), ("outcome", reason)])
            throw error
        }
    }

    static func accountToken(_ transaction: EventJSON) -> String? {
        transaction["appAccountToken"].string.flatMap { $0.isEmpty ? nil : $0.lowercased() }
    }
}
