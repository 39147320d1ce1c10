public import EntitlementsMessages
import EntitlementsWire
public import EntitlementsServer
import EntitlementsStore
import Logging
public import NIOCore

/// SubmitPurchase (docs/ingestion.md, "A purchase the app just made"): the purchase the app
/// holds, verified with its store as a notification would be and recorded for the caller's
/// user, who must not be another customer than the purchase names. Counted in
/// `entitlements_submitted_purchases_total{store, outcome, reason}`.
extension WebhookIngestion: PurchaseVerifier {
    public func submit(_ request: SubmitPurchaseRequest, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> Result<SubmittedPurchase, ServiceError> {
        let user = request.userId ?? ""
        switch request.purchase {
        case .appStore(let purchase):
            return self.answer(await self.submitAppStore(purchase, user: user, environment: request.environment, methods: methods, on: eventLoop), store: "appstore")
        case .googlePlay(let purchase):
            return self.answer(await self.submitGooglePlay(purchase, user: user, methods: methods, on: eventLoop), store: "googleplay")
        case nil:
            return .failure(ServiceError(.invalidArgument, "purchase: set app_store or google_play"))
        }
    }

    /// What a submission came to: the outcome of its writes, and what the answer needs.
    struct Submission {
        var outcome: Outcome
        var alias: String?
        var environment: Environment = .production
        var transactions: UInt32 = 0
    }

    private func submitAppStore(_ purchase: AppStorePurchase, user: String, environment hint: Environment, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> Submission {
        guard let appStore = self.appStore else {
            return Submission(outcome: .retry(IngestionRetry(.storeNotConfigured, "App Store purchases are not verified by this server: start it with --appstore-root-cert and --appstore-bundle-id")))
        }
        let jws = purchase.signedTransaction ?? ""
        let transactionId = purchase.transactionId ?? ""
        switch (jws.isEmpty, transactionId.isEmpty) {
        case (true, true):
            return Submission(
                outcome: .rejected(
                    IngestionRejection(.missingField, "app_store: signed_transaction (the transaction's jwsRepresentation) or transaction_id (to record the customer's history) is required")
                )
            )
        case (false, false):
            return Submission(outcome: .rejected(IngestionRejection(.missingField, "app_store: give signed_transaction or transaction_id, not both")))
        case (true, false):
            return await self.backfillAppStore(transactionId, user: user, environment: hint, methods: methods, on: eventLoop)
        case (false, true):
            break
        }
        let transaction: EventJSON
        let recorded: AppStoreNotifications.Recorded
        do {
            transaction = try await appStore.verifier.verify(jws, what: "signed_transaction")
            recorded = try appStore.notifications.record(transaction, what: "SubmitPurchase", environment: nil, catalogContains: methods.catalogContains)
        } catch {
            return Submission(outcome: Self.outcome(of: error))
        }
        let record: Transaction
        switch recorded {
        case .record(let recorded):
            record = recorded
        case .ignore(let reason):
            return Submission(outcome: .ignored(reason), environment: AppStoreNotifications.environment(transaction["environment"].string))
        }
        let original = record.originalTransactionId ?? ""
        let alias = AppStoreNotifications.alias(ofOriginalTransaction: original)
        // The JWS as the app holds it may be older than a refund stored since: it keeps it.
        var writes: [StoreWrite] = [.transaction(record, keepRevocation: record.revocationDate == nil)]
        var tokens = [Self.accountToken(transaction)].compactMap { $0 }
        if let api = self.appStoreAPI, record.type != .nonConsumablePurchase, let bundleId = transaction["bundleId"].string {
            // The chain's renewal state (auto-renew, billing retry, grace) and its latest
            // period, so the first answer is right. Without them the transaction alone is
            // recorded: the purchase is proven, and the notifications bring the rest.
            do {
                let reads = try await self.appStoreStatuses(
                    api, transactionId: record.transactionId ?? "", bundleId: bundleId, environment: record.environment, chain: original, catalogContains: methods.catalogContains
                )
                for read in reads where read.original == original {
                    writes += read.writes
                    tokens += [read.accountToken].compactMap { $0 }
                }
            } catch {
                self.logger.warning(
                    "SubmitPurchase: the App Store Server API did not answer; the transaction alone is recorded",
                    metadata: ["transaction": "\(record.transactionId ?? "")", "why": "\(error)"]
                )
            }
        }
        let plan = StoreEventPlan.apply(identity: .claimant(user, alias: alias), writes: writes)
        let outcome = await self.run(plan, methods: methods, on: eventLoop) {
            try Self.checkOwner(user: user, aliases: [alias], accountIds: Self.spellings(tokens), what: "appAccountToken", methods: methods, on: eventLoop)
        }
        return Submission(outcome: outcome, alias: alias, environment: record.environment, transactions: Self.transactionCount(writes))
    }

    /// SubmitPurchase with `app_store.transaction_id`: the customer's whole history read
    /// from Apple (Get Transaction History, then Get All Subscription Statuses for the
    /// renewal states) and recorded for `user`. Every write is idempotent: run twice, the
    /// second changes nothing.
    private func backfillAppStore(_ transactionId: String, user: String, environment hint: Environment, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> Submission {
        guard let api = self.appStoreAPI, let appStore = self.appStore else {
            return Submission(
                outcome: .retry(
                    IngestionRetry(.storeNotConfigured, "a backfill reads the history from Apple: start the server with --appstore-api-key, --appstore-key-id and --appstore-issuer-id")
                )
            )
        }
        if let problem = IdRule.problem(transactionId) {
            return Submission(outcome: .rejected(IngestionRejection(.invalidId, "app_store.transaction_id: \(problem)")))
        }
        let environments: [Environment] =
            switch hint {
            case .sandbox: [.sandbox]
            case .production: [.production]
            default: [.production, .sandbox]  // Apple's advice: production first, then the sandbox
            }
        let history: (reads: [AppStoreRead], listed: Int)
        let statuses: [AppStoreRead]
        let environment: Environment
        do {
            let found = try await self.firstAppStoreApp(bundleIds: appStore.notifications.bundleIds.sorted(), environments: environments) { bundleId, environment in
                try await self.appStoreHistory(api, transactionId: transactionId, bundleId: bundleId, environment: environment, catalogContains: methods.catalogContains)
            }
            (history, environment) = (found.0, found.2)
            statuses = try await self.appStoreStatuses(api, transactionId: transactionId, bundleId: found.1, environment: environment, catalogContains: methods.catalogContains)
        } catch let rejection as IngestionRejection where ![.unknownTransaction, .invalidId].contains(rejection.reason) {
            // Apple's own answer failed a check (its signature, its chain, a field): the
            // caller sent only an id, so this is not theirs to fix.
            return Submission(
                outcome: .retry(IngestionRetry(.storeUnavailable, "Apple's answer did not verify: \(rejection.message)")), environment: hint == .unspecified ? .production : hint
            )
        } catch {
            return Submission(outcome: Self.outcome(of: error), environment: hint == .unspecified ? .production : hint)
        }
        let reads = history.reads + statuses
        var aliases: [String] = []
        for read in reads {
            let alias = AppStoreNotifications.alias(ofOriginalTransaction: read.original)
            if !aliases.contains(alias) {
                aliases.append(alias)
            }
        }
        guard let first = aliases.first else {
            return Submission(outcome: .ignored(history.listed == 0 ? "no_transactions" : "nothing_to_record"), environment: environment)
        }
        let writes = aliases.dropFirst().map { StoreWrite.claimAlias($0) } + reads.flatMap(\.writes)
        let plan = StoreEventPlan.apply(identity: .claimant(user, alias: first), writes: writes)
        let outcome = await self.run(plan, methods: methods, on: eventLoop) {
            try Self.checkOwner(user: user, aliases: aliases, accountIds: Self.spellings(reads.compactMap(\.accountToken)), what: "appAccountToken", methods: methods, on: eventLoop)
        }
        return Submission(outcome: outcome, alias: first, environment: environment, transactions: Self.transactionCount(writes))
    }

    /// An App Store account token as the customer ids it may name (as Apple sends it, lower
    /// case, and in upper case), one list per distinct token.
    private static func spellings(_ tokens: [String]) -> [[String]] {
        var seen = Set<String>()
        return tokens.filter { seen.insert($0).inserted }.map { [$0, $0.uppercased()] }
    }

    /// The distinct transactions `writes` record.
    private static func transactionCount(_ writes: [StoreWrite]) -> UInt32 {
        var ids = Set<String>()
        for case .transaction(let transaction, _) in writes {
            ids.insert(transaction.transactionId ?? "")
        }
        return UInt32(ids.count)
    }

    private func submitGooglePlay(_ purchase: GooglePlayPurchase, user: String, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> Submission {
        guard let play = self.googlePlay else {
            return Submission(outcome: .retry(IngestionRetry(.storeNotConfigured, "Google Play purchases are not verified by this server: start it with the --googleplay-* settings")))
        }
        guard let package = purchase.packageName, let productId = purchase.productId, let token = purchase.purchaseToken, !package.isEmpty, !productId.isEmpty, !token.isEmpty else {
            return Submission(outcome: .rejected(IngestionRejection(.missingField, "google_play: package_name, product_id and purchase_token are required")))
        }
        guard play.settings.packages.contains(package) else {
            return Submission(outcome: .rejected(IngestionRejection(.otherApp, "package_name \(package) is not one of --googleplay-package (\(play.settings.packages.sorted().joined(separator: ", ")))")))
        }
        let catalog = PlayCatalog(contains: { methods.catalogContains($0) }, period: { methods.catalogPeriod($0) })
        var plan: StoreEventPlan
        let acknowledgement: PlayAcknowledgement?
        do {
            do {
                let subscription = try await play.api.subscription(package: package, token: token)
                guard subscription["lineItems"].array.contains(where: { $0["productId"].string == productId }) else {
                    throw IngestionRejection(.missingField, "the purchase token is a subscription to \(subscription["lineItems"][0]["productId"].string ?? "another product"), not to \(productId)")
                }
                (plan, acknowledgement) = try play.notifications.plan(subscription: subscription, token: token, catalog: catalog)
            } catch let rejection as IngestionRejection where rejection.reason == .unknownToken {
                // Not a subscription's token: a one-time product's.
                let product = try await play.api.product(package: package, productId: productId, token: token)
                (plan, acknowledgement) = try play.notifications.plan(product: product, token: token, sku: productId, catalog: catalog)
            }
        } catch {
            return Submission(outcome: Self.outcome(of: error))
        }
        let identity: StoreIdentity
        let writes: [StoreWrite]
        switch plan {
        case .apply(let planned, let planWrites):
            (identity, writes) = (planned, planWrites)
        case .ignore(let reason):
            return Submission(outcome: .ignored(reason))
        }
        let alias = PlayNotifications.alias(ofToken: token)
        var accountIds: [[String]] = []
        var aliases = [alias]
        switch identity {
        case .accountId(let id, _): accountIds = [[id]]
        case .chainAlias(_, let linked?): aliases.append(linked)
        default: break
        }
        if let linked = Self.linkedToken(of: writes) {
            aliases.append(PlayNotifications.alias(ofToken: linked))
        }
        plan = .apply(identity: .claimant(user, alias: alias), writes: writes)
        var environment = Environment.production
        for case .transaction(let transaction, _) in writes {
            environment = transaction.environment
        }
        var outcome = await self.run(plan, methods: methods, on: eventLoop) {
            try Self.checkOwner(user: user, aliases: aliases, accountIds: accountIds, what: "obfuscatedExternalAccountId", methods: methods, on: eventLoop)
        }
        if let acknowledgement {
            switch outcome {
            case .applied, .ignored:
                do {
                    try await play.api.acknowledge(acknowledgement, package: package)
                    self.countAcknowledgement("acknowledged")
                } catch {
                    self.countAcknowledgement("failed")
                    outcome = .retry(error)
                }
            case .rejected, .retry:
                break
            }
        }
        return Submission(outcome: outcome, alias: alias, environment: environment, transactions: Self.transactionCount(writes))
    }

    /// The old token a plan's linked purchase ends, if any.
    private static func linkedToken(of writes: [StoreWrite]) -> String? {
        for case .endChains(_, let chain, _) in writes {
            return chain
        }
        return nil
    }

    /// Refuses a purchase that is not `user`'s to claim, the same whichever comes first,
    /// the submission or the store's notification:
    /// - each account id the app set at purchase (`accountIds`: their spellings) must be the
    ///   user id or name the user's customer (link it with LinkAlias before the purchase);
    /// - the purchase's aliases (its own, and a replaced purchase's) must be linked to
    ///   nobody or to the user's customer.
    /// Another customer's id is never said: the message may reach the app's user. The link
    /// itself is made without transfer, so the write rule decides a race (`aliasTaken`).
    private static func checkOwner(user: String, aliases: [String], accountIds: [[String]], what: String, methods: EntitlementMethods, on eventLoop: any EventLoop) throws {
        let context = StoreEventApplier.context(on: eventLoop)
        func owner(_ id: String) throws -> String? {
            guard IdRule.problem(id) == nil else { return nil }
            switch methods.customerRecord(id, context) {
            case .success(let record): return record?.id
            case .failure(let error): throw IngestionRetry(.writeFailed, "reading \(id): \(error.message)")
            }
        }
        let customer = try owner(user) ?? user
        for spellings in accountIds where !spellings.contains(user) {
            let named = try spellings.compactMap(owner)
            guard !named.isEmpty else {
                throw IngestionRejection(
                    .otherCustomer,
                    "the purchase's \(what) (\(spellings[0])) is not \(user) and names no customer: link it to \(user) with LinkAlias first (as the app's backend does before the purchase)"
                )
            }
            guard named.contains(customer) else {
                throw IngestionRejection(.otherCustomer, "the purchase's \(what) names another customer than \(user)")
            }
        }
        for alias in aliases {
            if let linked = try owner(alias), linked != customer {
                throw IngestionRejection(.otherCustomer, "the purchase (\(alias)) belongs to another customer; LinkAlias with transfer moves it if that is right")
            }
        }
    }

    /// The call's answer, counted by store, outcome and reason.
    private func answer(_ submission: Submission, store: String) -> Result<SubmittedPurchase, ServiceError> {
        switch submission.outcome {
        case .ignored(let reason):
            self.countSubmission(store, "ignored", reason)
            return .success(
                SubmittedPurchase(logSequence: 0, readSequence: 0, changed: false, linkedAlias: nil, environment: submission.environment, ignored: reason, transactions: submission.transactions)
            )
        case .applied(let applied):
            self.countSubmission(store, applied.changed ? "applied" : "unchanged", "")
            return .success(
                SubmittedPurchase(
                    logSequence: applied.logSequence, readSequence: applied.readSequence, changed: applied.changed, linkedAlias: submission.alias,
                    environment: submission.environment, transactions: submission.transactions
                )
            )
        case .rejected(let rejection):
            self.countSubmission(store, "rejected", rejection.reason.rawValue)
            let status: StatusCode =
                switch rejection.reason {
                case .otherCustomer: .permissionDenied
                case .unknownToken, .unknownTransaction: .notFound
                default: .invalidArgument
                }
            return .failure(ServiceError(status, rejection.message))
        case .retry(let retry):
            self.countSubmission(store, retry.reason == .aliasTaken ? "rejected" : "retry", retry.reason.rawValue)
            let status: StatusCode =
                switch retry.reason {
                case .aliasTaken: .permissionDenied
                case .unknownProduct, .unknownState, .storeNotConfigured: .failedPrecondition
                default: .unavailable  // the store, its credentials (a 401 is exchanged again), a write: retry
                }
            return .failure(ServiceError(status, retry.message))
        }
    }

    private func countSubmission(_ store: String, _ outcome: String, _ reason: String) {
        self.increment("entitlements_submitted_purchases_total", [("store", store), ("outcome", outcome), ("reason", reason)])
    }
}
