import EntitlementsMessages

/// A webhook not applied: its reason (a metric label) and a message a person can act on.
/// ``IngestionRejection`` (400) and ``IngestionRetry`` (503) are its two kinds.
public struct IngestionError<Reason: RawRepresentable & Sendable & Hashable>: Error, Sendable, Hashable, CustomStringConvertible
where Reason.RawValue == String {
    public var reason: Reason
    public var message: String

    public init(_ reason: Reason, _ message: String) {
        self.reason = reason
        self.message = message
    }

    public var description: String { self.message }
}

/// Why a webhook was refused before anything was written: answered 4xx with the message,
/// counted by reason (docs/ingestion.md, "Answers and errors"). The store does not fix such
/// an event by retrying it, but a person reading the message can.
public typealias IngestionRejection = IngestionError<RejectionReason>

public enum RejectionReason: String, Sendable, Hashable, CaseIterable {
    case missingSignature = "missing_signature"
    case malformedSignature = "malformed_signature"
    case badSignature = "bad_signature"
    case expiredTimestamp = "expired_timestamp"
    case malformedJSON = "malformed_json"
    case malformedJWS = "malformed_jws"
    case badAlgorithm = "bad_algorithm"
    case badChain = "bad_chain"
    case missingField = "missing_field"
    case tooLarge = "too_large"
    /// A user id the event names is not an id (docs/PROTOCOL.md, "Ids"): too long, or not NFC.
    case invalidId = "invalid_id"
    /// An App Store notification of an app not named by --appstore-bundle-id, or a Google
    /// Play notification of a package not named by --googleplay-package.
    case otherApp = "other_app"
    /// Google Play: the push carries no valid Pub/Sub token (answered 401).
    case unauthenticated = "unauthenticated"
    /// Google Play: a valid Google token, but not for our push subscription (answered 403).
    case forbidden = "forbidden"
    /// Google Play: the Play Developer API does not know the purchase token (404), or no
    /// longer does (410, 60 days after it expired).
    case unknownToken = "unknown_token"
    /// The App Store Server API does not know the transaction id (404, or 400 for an id
    /// that cannot be one) in the environment and app asked.
    case unknownTransaction = "unknown_transaction"
    /// SubmitPurchase: the purchase belongs to another customer (its account token or
    /// account id names another, or its alias is linked to another).
    case otherCustomer = "other_customer"
}

/// Why a verified event was not applied this time: answered 5xx so the store delivers it
/// again later (Stripe retries for three days, Apple five times over three days), and
/// counted by reason. Nothing the event asked for is lost while the store retries.
public typealias IngestionRetry = IngestionError<RetryReason>

public enum RetryReason: String, Sendable, Hashable, CaseIterable {
    /// The event names no user we know yet (docs/ingestion.md, "Identity").
    case unknownIdentity = "unknown_identity"
    /// A refund names a transaction not recorded yet (it came first).
    case notRecordedYet = "not_recorded_yet"
    /// The product is not in the catalog: add it, and the retry applies.
    case unknownProduct = "unknown_product"
    /// A write failed (the log, PostgreSQL, a refused write): its message says why.
    case writeFailed = "write_failed"
    /// Google Play: the store's API answered 429 or 5xx, or could not be reached; the server
    /// backs off before it calls again.
    case storeUnavailable = "store_unavailable"
    /// Google Play: the store's API refused our credentials (401, 403): the service
    /// account lacks a permission.
    case storeDenied = "store_denied"
    /// Google Play: a subscription state this server does not know yet.
    case unknownState = "unknown_state"
    /// Google Play: the writes are durable but acknowledging the purchase failed; the
    /// redelivery acknowledges it.
    case acknowledgeFailed = "acknowledge_failed"
    /// SubmitPurchase: the purchase's alias belongs to another customer (the store's write
    /// rule said so, against the newest record: in fleet mode, PostgreSQL's).
    case aliasTaken = "alias_taken"
    /// SubmitPurchase: this server verifies no purchases of the store named.
    case storeNotConfigured = "store_not_configured"
}

/// Who a store event is about, as the event names them.
enum StoreIdentity: Sendable, Hashable {
    /// Our user id, named by the event itself (Stripe: the metadata key). `storeCustomer`,
    /// when the event names one, is linked to it as an alias so later events that name
    /// only the store's customer find the user.
    case user(String, storeCustomer: String?)
    /// Only the store's customer, as the alias a user was linked to (`stripe:cus_...`).
    case storeCustomer(String)
    /// An App Store `appAccountToken` (lower case, as Apple sends it) and the chain's alias
    /// (`appstore:ORIGINAL_ID`): the customer the token names (as given, or in upper case),
    /// else the one the chain is linked to, else a new customer under the token.
    case accountToken(String, chainAlias: String)
    /// An account id the app set at purchase (Google Play's
    /// `obfuscatedExternalAccountId`), compared as given: the customer it names, else the
    /// one the chain is linked to, else a new customer under the id.
    case accountId(String, chainAlias: String)
    /// Only the chain's alias (`googleplay:TOKEN`), or else the alias of the chain it
    /// replaced (a linked purchase token): the chain's alias is then linked to that user.
    case chainAlias(String, linked: String?)
    /// SubmitPurchase: the caller's user, who claims the purchase's alias: linked unless
    /// another customer has it (then nothing is written: `aliasTaken`).
    case claimant(String, alias: String)
}

/// One write an event makes, before its customer is known.
enum StoreWrite: Sendable, Hashable {
    /// Links the store's customer alias to the user (moving it if another user had it).
    case linkStoreCustomer(alias: String)
    /// Links the alias to the user unless another customer has it (then `aliasTaken`).
    case claimAlias(String)
    /// Records a paid period. With `keepRevocation`, a refund already stored is kept
    /// (`keep_revocation`); without it, the transaction's own revocation date (or its
    /// absence: a refund reversed) replaces the stored one. A transaction stored with other
    /// values (a period the store extended since) is left as it is.
    case transaction(Transaction, keepRevocation: Bool)
    /// Replaces the chain's renewal state unless a newer event's state is stored
    /// (`event_date`); with `ended_date`, the write rules revoke what runs past the end.
    case state(SubscriptionState)
    /// As `state`, but written only when it says something the stored state does not (a
    /// newer `event_date` alone is not news): a state read from the store's API again and
    /// again (SubmitPurchase) changes nothing while the chain does not.
    case stateIfNew(SubscriptionState)
    /// A state in billing retry whose `billing_issue_detected_date` the store does not give
    /// (Google Play): kept from the stored state when it had one, else the end of the
    /// chain's latest recorded period, else now.
    case stateWithBillingIssue(SubscriptionState)
    /// Revokes the stored transaction `transactionId` at `date` (a refund); a transaction
    /// not recorded yet is a retry: the refund came before the payment. Google Play: the
    /// order's add-on lines (`ORDER:PRODUCT`) too.
    case revokeTransaction(store: Source, transactionId: String, date: Int64)
    /// Ends the chain `chain` and every chain of the customer whose id is `chain:...` (its
    /// add-ons) at `at`: replaced (Google Play's linked purchase token).
    case endChains(store: Source, chain: String, at: Int64)
}

/// What an event asks for, from its verified bytes alone.
enum StoreEventPlan: Sendable, Hashable {
    /// Writes for one customer, in order.
    case apply(identity: StoreIdentity, writes: [StoreWrite])
    /// Nothing to write: answered 2xx and counted under `reason` (a type we do not
    /// handle, or one whose state arrives with another event).
    case ignore(reason: String)
}

extension StoreEventPlan {
    /// The first id the plan would write or look up that is not an id by ``IdRule``
    /// (docs/PROTOCOL.md, "Ids": 1 to 256 bytes, in NFC), as "what: problem"; nil when
    /// there is none. Such an event is refused (400 `invalid_id`) before anything is read:
    /// its writes would be refused however often the store delivered it again.
    var idProblem: String? {
        guard case .apply(let identity, let writes) = self else {
            return nil
        }
        var ids: [(what: String, id: String?)] = []
        switch identity {
        case .user(let user, let storeCustomer):
            ids += [("the user id", user), ("the store customer's alias", storeCustomer)]
        case .storeCustomer(let alias):
            ids.append(("the store customer's alias", alias))
        case .accountToken(let token, let chainAlias):
            ids += [("appAccountToken", token), ("the subscription's alias", chainAlias)]
        case .accountId(let id, let chainAlias):
            ids += [("obfuscatedExternalAccountId", id), ("the purchase's alias", chainAlias)]
        case .chainAlias(let alias, let linked):
            ids += [("the purchase's alias", alias), ("the linked purchase's alias", linked)]
        case .claimant(let user, let alias):
            ids += [("the user id", user), ("the purchase's alias", alias)]
        }
        for write in writes {
            switch write {
            case .linkStoreCustomer(let alias), .claimAlias(let alias):
                ids.append(("the store customer's alias", alias))
            case .transaction(let transaction, _):
                ids += [
                    ("the transaction id", transaction.transactionId),
                    ("the original transaction id", transaction.originalTransactionId),
                    ("the product id", transaction.productId),
                ]
            case .state(let state), .stateWithBillingIssue(let state), .stateIfNew(let state):
                ids.append(("the original transaction id", state.originalTransactionId))
            case .revokeTransaction(_, let transactionId, _):
                ids.append(("the refunded transaction id", transactionId))
            case .endChains(_, let chain, _):
                ids.append(("the replaced purchase's chain", chain))
            }
        }
        for (what, id) in ids {
            if let id, let problem = IdRule.problem(id) {
                return "\(what) \(id.debugDescription): \(problem)"
            }
        }
        return nil
    }
}
