import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsServer
import EntitlementsStore
import EntitlementsWire
import NIOCore

/// What applying an event did.
struct AppliedEvent: Sendable, Hashable {
    var customerId: String
    /// False when every write repeated what was stored: a redelivery, or an older event.
    var changed: Bool
    /// The log sequence of the last write that changed something; 0 when none did.
    var logSequence: UInt64
    /// Why a write the event asked for was left out (a refund of a payment never seen).
    var skipped: String? = nil
    /// The highest log sequence any write answered (an unchanged write in fleet mode names
    /// the customer's last): a read at it sees every write of the event.
    var readSequence: UInt64 = 0
}

/// Runs a plan's writes, one after another, through the same ``EntitlementMethods/write(_:_:)``
/// as every write call: each is durable (fleet mode: committed in PostgreSQL) before the
/// next starts, and the event is answered 2xx only after the last. A failure stops it with a
/// retry: every write is idempotent, so the store's redelivery finishes the event.
struct StoreEventApplier: Sendable {
    let methods: EntitlementMethods

    /// How long after its refund a payment may still arrive: until then a refund of a
    /// payment not recorded is refused (503) so the store delivers it again.
    static let refundWait: Int64 = 24 * 3_600_000

    /// `now` is the current time in Unix milliseconds.
    func apply(_ identity: StoreIdentity, _ writes: [StoreWrite], now: Int64, on eventLoop: any EventLoop) async throws(IngestionRetry) -> AppliedEvent {
        let context = Self.context(on: eventLoop)
        let user: String
        var planned = writes
        switch identity {
        case .user(let id, let storeCustomer):
            user = id
            if let storeCustomer {
                planned.insert(.linkStoreCustomer(alias: storeCustomer), at: 0)
            }
        case .accountToken(let token, let alias):
            var named = try self.record(token, context)?.id
            if named == nil, IdRule.problem(token.uppercased()) == nil {
                named = try self.record(token.uppercased(), context)?.id
            }
            user = try self.account(named: named, as: token, chainAlias: alias, context, planned: &planned)
        case .accountId(let id, let alias):
            user = try self.account(named: try self.record(id, context)?.id, as: id, chainAlias: alias, context, planned: &planned)
        case .chainAlias(let alias, let linked):
            if let id = try self.record(alias, context)?.id {
                user = id
            } else if let linked, let id = try self.record(linked, context)?.id {
                user = id
                planned.insert(.linkStoreCustomer(alias: alias), at: 0)
            } else {
                throw IngestionRetry(
                    .unknownIdentity,
                    "no user is linked to \(alias)\(linked.map { " or \($0)" } ?? "") yet, and the purchase names no account id: refused so that the notification is delivered again once the app's backend links the alias"
                )
            }
        case .claimant(let id, let alias):
            user = id
            planned.insert(.claimAlias(alias), at: 0)
        case .storeCustomer(let alias):
            guard let record = try self.record(alias, context), let id = record.id else {
                throw IngestionRetry(
                    .unknownIdentity,
                    "no user is linked to \(alias) yet: the event is refused so that the store delivers it again once a customer event or a subscription's metadata names the user"
                )
            }
            user = id
        }
        var applied = AppliedEvent(customerId: user, changed: false, logSequence: 0)
        for write in planned {
            for mutation in try self.mutations(for: write, user: user, now: now, skipped: &applied.skipped, context) {
                let response = try await self.write(mutation, context)
                applied.customerId = response.customerId ?? applied.customerId
                applied.readSequence = max(applied.readSequence, response.logSequence)
                if response.changed {
                    applied.changed = true
                    applied.logSequence = response.logSequence
                }
            }
        }
        return applied
    }

    /// The customer an account id names (`named`, found already), else the one the chain is
    /// linked to (no second customer is made), else a new customer under `id`.
    private func account(named: String?, as id: String, chainAlias alias: String, _ context: CallContext, planned: inout [StoreWrite]) throws(IngestionRetry) -> String {
        if let named {
            planned.insert(.linkStoreCustomer(alias: alias), at: 0)
            return named
        }
        if let linked = try self.record(alias, context)?.id {
            return linked  // an id nobody linked, on a chain we know
        }
        planned.insert(.linkStoreCustomer(alias: alias), at: 0)
        return id
    }

    /// The write calls one planned write makes; those that name stored transactions read
    /// the customer's record first.
    private func mutations(
        for write: StoreWrite,
        user: String,
        now: Int64,
        skipped: inout String?,
        _ context: CallContext
    ) throws(IngestionRetry) -> [LogRecord.Mutation] {
        switch write {
        case .linkStoreCustomer(let alias):
            return [.linkAlias(LinkAliasRequest(userId: user, alias: alias, transfer: true))]
        case .claimAlias(let alias):
            return [.linkAlias(LinkAliasRequest(userId: user, alias: alias, transfer: false))]
        case .state(let state):
            return [.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: user, state: state))]
        case .stateIfNew(let state):
            let stored = try self.record(user, context)?.subscriptions.last { $0.store == state.store && $0.originalTransactionId == state.originalTransactionId }
            if let stored, Self.sameNews(stored, state) {
                return []
            }
            return [.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: user, state: state))]
        case .stateWithBillingIssue(var state):
            let record = try self.record(user, context)
            let stored = record?.subscriptions.last { $0.store == state.store && $0.originalTransactionId == state.originalTransactionId }
            let periods = record?.transactions.filter { $0.store == state.store && $0.originalTransactionId == state.originalTransactionId }.compactMap(\.expirationDate) ?? []
            state.billingIssueDetectedDate = stored?.billingIssueDetectedDate ?? periods.max().map { min($0, now) } ?? now
            return [.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: user, state: state))]
        case .transaction(let transaction, let keepRevocation):
            if let stored = try self.record(user, context)?.transactions.first(where: { $0.store == transaction.store && $0.transactionId == transaction.transactionId }) {
                var comparable = stored
                comparable.revocationDate = transaction.revocationDate
                if stored.verified != true, transaction.verified == true {
                    // A caller wrote it first: the store's record completes it (the write
                    // rules let a verified record replace an unverified one).
                } else if comparable != transaction {
                    // Recorded with other values (the write rules let only a revocation
                    // change): the stored period stays, the rest of the event applies, and
                    // so does a refund or its reversal.
                    if !keepRevocation, stored.revocationDate != transaction.revocationDate {
                        var revised = stored
                        revised.revocationDate = transaction.revocationDate
                        return [.recordTransaction(RecordTransactionRequest(userId: user, transaction: revised))]
                    }
                    skipped = "transaction_changed"
                    return []
                }
            }
            // An end stored for the chain (ended_date) is applied by the write rules.
            return [.recordTransaction(RecordTransactionRequest(userId: user, transaction: transaction, keepRevocation: keepRevocation))]
        case .endChains(let store, let chain, let date):
            let chains = Set(try self.record(user, context)?.transactions.compactMap { transaction -> String? in
                guard transaction.store == store, let id = transaction.originalTransactionId, id == chain || id.hasPrefix(chain + ":") else { return nil }
                return id
            } ?? [])
            return (chains.isEmpty ? [chain] : chains.sorted()).map { id in
                var ended = SubscriptionState(store: store, originalTransactionId: id)
                ended.autoRenewEnabled = false
                ended.endedDate = date
                ended.cancellationReason = .replaced
                return .updateSubscriptionState(UpdateSubscriptionStateRequest(userId: user, state: ended))
            }
        case .revokeTransaction(let store, let transactionId, let date) where store == .playstore:
            // A Play order and its add-on lines.
            let lines = try self.record(user, context)?.transactions.filter {
                $0.store == store && ($0.transactionId == transactionId || $0.transactionId?.hasPrefix(transactionId + ":") == true)
            } ?? []
            guard !lines.isEmpty else {
                return try Self.refundOfUnrecorded(transactionId, user: user, date: date, now: now, skipped: &skipped)
            }
            return lines.compactMap { line in
                if let revoked = line.revocationDate, revoked <= date {
                    return nil
                }
                var revoked = line
                revoked.revocationDate = date
                return .recordTransaction(RecordTransactionRequest(userId: user, transaction: revoked))
            }
        case .revokeTransaction(let store, let transactionId, let date):
            guard var transaction = try self.record(user, context)?.transactions.first(where: { $0.store == store && $0.transactionId == transactionId }) else {
                return try Self.refundOfUnrecorded(transactionId, user: user, date: date, now: now, skipped: &skipped)
            }
            if let revoked = transaction.revocationDate, revoked <= date {
                return []  // revoked already, at this instant or before
            }
            transaction.revocationDate = date
            return [.recordTransaction(RecordTransactionRequest(userId: user, transaction: transaction))]
        }
    }

    /// Whether `incoming` says nothing `stored` does not: the same state but for its date,
    /// and for what the write rules keep from the stored state when the incoming one is
    /// silent (when auto-renew went off, and why).
    static func sameNews(_ stored: SubscriptionState, _ incoming: SubscriptionState) -> Bool {
        guard let storedDate = stored.eventDate, let incomingDate = incoming.eventDate, incomingDate >= storedDate else {
            return false
        }
        var comparable = incoming
        comparable.eventDate = stored.eventDate
        comparable.endedDate = comparable.endedDate ?? stored.endedDate
        if comparable.autoRenewEnabled == false, stored.autoRenewEnabled == false {
            comparable.autoRenewDisabledDate = comparable.autoRenewDisabledDate ?? stored.autoRenewDisabledDate
            if comparable.cancellationReason == .unspecified {
                comparable.cancellationReason = stored.cancellationReason
            }
        }
        return comparable == stored
    }

    /// A refund of a transaction not recorded: a retry while the payment may still come,
    /// then nothing.
    private static func refundOfUnrecorded(_ transactionId: String, user: String, date: Int64, now: Int64, skipped: inout String?) throws(IngestionRetry) -> [LogRecord.Mutation] {
        guard now - date < Self.refundWait else {
            // Not recorded a day after the refund: a payment this service never saw
            // (a one-off invoice, or one paid before ingestion started).
            skipped = "refund_of_unknown_payment"
            return []
        }
        throw IngestionRetry(
            .notRecordedYet,
            "the refund names transaction \(transactionId), which is not recorded for \(user) yet: refused so that the store delivers it again after the payment"
        )
    }

    /// A webhook's calls: no deadline (the store waits for the answer), every permission (the
    /// signature was the credential).
    static func context(on eventLoop: any EventLoop) -> CallContext {
        CallContext(eventLoop: eventLoop, deadline: nil, scope: ConnectionScope(peer: "webhook"), access: .unrestricted)
    }

    private func record(_ userId: String, _ context: CallContext) throws(IngestionRetry) -> CustomerRecord? {
        switch self.methods.customerRecord(userId, context) {
        case .success(let record):
            return record
        case .failure(let error):
            throw IngestionRetry(.writeFailed, "reading \(userId): \(error.message)")
        }
    }

    /// Runs the write on `context`'s event loop, as every transport calls the methods.
    private func write(_ mutation: LogRecord.Mutation, _ context: CallContext) async throws(IngestionRetry) -> WriteResponse {
        let eventLoop = context.eventLoop
        let methods = self.methods
        let source = CallContext.storeSource
        let answer = eventLoop.flatSubmit { () -> EventLoopFuture<Result<WriteResponse, ServiceError>> in
            var call = Self.context(on: eventLoop)
            call.writeSource = source
            switch methods.write(mutation, call) {
            case .now(let result): return eventLoop.makeSucceededFuture(result)
            case .later(let future): return future
            }
        }
        let result: Result<WriteResponse, ServiceError>
        do {
            result = try await answer.get()
        } catch {
            result = .failure(ServiceError(.internalError, "\(error)"))
        }
        switch result {
        case .success(let response):
            return response
        case .failure(let error):
            if case .linkAlias(let link) = mutation, link.transfer != true, error.status == .failedPrecondition {
                // The write rule, against the newest record, says another customer has it.
                throw IngestionRetry(.aliasTaken, "the purchase (\(link.alias ?? "")) belongs to another customer; LinkAlias with transfer moves it if that is right")
            }
            throw IngestionRetry(.writeFailed, "\(error.status): \(error.message)")
        }
    }
}
