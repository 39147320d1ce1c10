public import EntitlementsMessages
public import EntitlementsResolver

/// Why a write was refused; each maps to one status code (docs/PROTOCOL.md) and its
/// message names the field or the conflicting state.
public struct WriteRefusal: Error, Hashable, CustomStringConvertible {
    public enum Reason: Sendable, Hashable {
        /// A field is missing or malformed: INVALID_ARGUMENT.
        case invalidArgument
        /// The write refers to something that does not exist: NOT_FOUND.
        case notFound
        /// The write conflicts with what is stored: FAILED_PRECONDITION.
        case failedPrecondition
        /// The store cannot take writes (no data directory, or the log failed): UNAVAILABLE.
        case unavailable
    }

    public var reason: Reason
    public var message: String

    public init(_ reason: Reason, _ message: String) {
        self.reason = reason
        self.message = message
    }

    public var description: String { self.message }
}

/// What one write does: the customer records it replaces and the alias keys it moves,
/// computed against the current state and applied only once the write is durable.
public struct WriteEffect: Sendable, Hashable {
    /// The canonical id of the customer written.
    public var customerId: String
    /// Whether the write created the customer.
    public var created = false
    /// The customers whose records change: id -> new record, nil when deleted.
    public var records: [String: CustomerRecord?] = [:]
    /// The alias keys that move: alias -> new owner, nil when the alias is removed.
    public var aliases: [String: String?] = [:]
    /// The mutation as it goes into the log: user id canonical, defaults filled in, so that
    /// replaying it gives the same effect.
    public var logged: LogRecord.Mutation
    /// Where the write came from (fleet mode logs it with the effect).
    public var source: WriteSource?

    /// Whether anything changes (a repeated write changes nothing and is not logged).
    public var changed: Bool { !self.records.isEmpty || !self.aliases.isEmpty }
}

extension WriteEffect {
    /// The effect as fleet mode logs it: every customer and alias it changes, sorted by id
    /// so that the same effect always encodes to the same bytes.
    public var replicated: ReplicatedWrite {
        ReplicatedWrite(
            customerId: self.customerId,
            created: self.created,
            customers: self.records.sorted { $0.key < $1.key }.map { CustomerChange(customerId: $0.key, record: $0.value) },
            aliases: self.aliases.sorted { $0.key < $1.key }.map { AliasChange(alias: $0.key, customerId: $0.value) },
            source: self.source
        )
    }

    /// The effect a replicated write logged; throws for a record that names no customer.
    public init(replicated write: ReplicatedWrite) throws {
        guard let customerId = write.customerId else {
            throw WriteRefusal(.invalidArgument, "replicated write: customer_id missing")
        }
        self.init(customerId: customerId, created: write.created, logged: .replicatedWrite(write), source: write.source)
        for change in write.customers {
            guard let id = change.customerId, change.record.map({ $0.id == id }) ?? true else {
                throw WriteRefusal(.invalidArgument, "replicated write of \(customerId): a customer change without its id, or with a record of another id")
            }
            self.records[id] = .some(change.record)
        }
        for change in write.aliases {
            guard let alias = change.alias else {
                throw WriteRefusal(.invalidArgument, "replicated write of \(customerId): an alias change without the alias")
            }
            self.aliases[alias] = .some(change.customerId)
        }
    }
}

/// The write rules (docs/durability.md, "Write rules"): validates a mutation and computes
/// its effect. Pure: the current state comes in through `lookup`, which finds the customer
/// a user id (customer id or alias) names.
public struct CustomerMutation {
    public let catalog: ProductCatalog
    /// Finds the current record of the customer a user id names, or nil.
    public let lookup: (String) throws -> CustomerRecord?

    /// Replaying the log: writes are checked by the rules they were admitted under when
    /// they were logged. Binaries before log format 2 admitted a transaction or state with
    /// a MANUAL store, a transaction without a type, and one without an expiration date;
    /// a log holding such a write must still replay (docs/durability.md, "Format versions").
    public let replaying: Bool

    public init(catalog: ProductCatalog, replaying: Bool = false, lookup: @escaping (String) throws -> CustomerRecord?) {
        self.catalog = catalog
        self.replaying = replaying
        self.lookup = lookup
    }

    /// The effect of `mutation`, received at `now` (Unix milliseconds; the default for
    /// dates a request leaves out).
    public func effect(of mutation: LogRecord.Mutation, now: Int64) throws -> WriteEffect {
        switch mutation {
        case .recordTransaction(let request):
            return try self.recordTransaction(request)
        case .updateSubscriptionState(let request):
            return try self.updateSubscriptionState(request)
        case .grantEntitlement(let request):
            return try self.grantEntitlement(request, now: now)
        case .revokeGrant(let request):
            return try self.revokeGrant(request, now: now)
        case .linkAlias(let request):
            return try self.linkAlias(request)
        case .deleteCustomer(let request):
            return try self.deleteCustomer(request)
        case .replicatedWrite(let write):
            // Computed by the server that made the write (fleet mode): applied as it is.
            return try WriteEffect(replicated: write)
        }
    }

    // MARK: The mutations

    /// An enum case as the schema spells it without its prefix: `subscriptionStarted` is
    /// `SUBSCRIPTION_STARTED`.
    private static func constant(_ value: some Any) -> String {
        var words = ""
        for character in "\(value)" {
            if character.isUppercase {
                words.append("_")
            }
            words.append(contentsOf: character.uppercased())
        }
        return words
    }

    /// Transactions and subscription states come from a store: APPSTORE, PLAYSTORE or
    /// STRIPE (types.proto). Access given by hand is a grant.
    private func checkStore(_ store: Source, _ field: String) throws {
        if self.replaying, store != .unknown {
            return
        }
        switch store {
        case .appstore, .playstore, .stripe:
            return
        case .unknown:
            throw WriteRefusal(.invalidArgument, "\(field): required (APPSTORE, PLAYSTORE or STRIPE)")
        default:
            throw WriteRefusal(.invalidArgument, "\(field): must be APPSTORE, PLAYSTORE or STRIPE, got \(Self.constant(store)); access given by hand is a GrantEntitlement")
        }
    }

    /// The schema's rules for a new transaction (types.proto, docs/data-formats.md), as the
    /// JSON input checks them.
    private static func checkTypeAndExpiration(_ transaction: Transaction, purchased: Int64) throws {
        guard transaction.type != .unspecified else {
            throw WriteRefusal(
                .invalidArgument,
                "transaction.type: required (SUBSCRIPTION_STARTED, SUBSCRIPTION_RENEWED, TRIAL_STARTED, INTRO_STARTED, INTRO_RENEWED or NON_CONSUMABLE_PURCHASE)"
            )
        }
        if transaction.type == .nonConsumablePurchase {
            if let expiration = transaction.expirationDate {
                throw WriteRefusal(.invalidArgument, "transaction.expiration_date: must be absent for a NON_CONSUMABLE_PURCHASE (it never expires), got \(expiration)")
            }
        } else {
            guard let expiration = transaction.expirationDate else {
                throw WriteRefusal(.invalidArgument, "transaction.expiration_date: required for a \(Self.constant(transaction.type)) transaction; only a NON_CONSUMABLE_PURCHASE has none")
            }
            guard expiration > purchased else {
                throw WriteRefusal(.invalidArgument, "transaction.expiration_date: \(expiration) is not after transaction_date \(purchased)")
            }
        }
    }

    /// price_micros and currency go together: a non-negative amount and an ISO 4217 code in
    /// upper case.
    private static func checkPrice(_ transaction: Transaction) throws {
        switch (transaction.priceMicros, transaction.currency) {
        case (nil, nil):
            return
        case (let micros?, let currency?):
            guard micros >= 0 else {
                throw WriteRefusal(.invalidArgument, "transaction.price_micros: must not be negative, got \(micros)")
            }
            guard currency.utf8.count == 3, currency.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) else {
                throw WriteRefusal(.invalidArgument, "transaction.currency: must be an ISO 4217 code in upper case, such as \"USD\"; got \"\(currency)\"")
            }
        default:
            throw WriteRefusal(.invalidArgument, "transaction.price_micros and transaction.currency go together: give both, or neither")
        }
    }

    private func recordTransaction(_ request: RecordTransactionRequest) throws -> WriteEffect {
        let userId = try self.id(request.userId, "user_id")
        guard var transaction = request.transaction else {
            throw WriteRefusal(.invalidArgument, "transaction: required")
        }
        let transactionId = try self.id(transaction.transactionId, "transaction.transaction_id")
        if transaction.originalTransactionId == nil {
            transaction.originalTransactionId = transactionId  // the first of its chain
        }
        _ = try self.id(transaction.originalTransactionId, "transaction.original_transaction_id")
        try self.checkStore(transaction.store, "transaction.store")
        let productId = try self.id(transaction.productId, "transaction.product_id")
        guard self.catalog.contains(productId) else {
            throw WriteRefusal(
                .invalidArgument,
                "transaction.product_id: \"\(productId)\" is not in the catalog (\(self.catalog.count) products); add it to the catalog first"
            )
        }
        guard let purchased = transaction.transactionDate else {
            throw WriteRefusal(.invalidArgument, "transaction.transaction_date: required")
        }
        if self.replaying {
            // The rule before log format 2: only an expiration before the purchase was refused.
            if let expiration = transaction.expirationDate, expiration < purchased {
                throw WriteRefusal(.invalidArgument, "transaction.expiration_date: \(expiration) is before transaction_date \(purchased)")
            }
        } else {
            try Self.checkTypeAndExpiration(transaction, purchased: purchased)
            try Self.checkPrice(transaction)
        }
        if transaction.environment == .unspecified {
            transaction.environment = .production
        }

        var (record, created) = try self.recordOrNew(userId)
        let customerId = record.id!
        let index = record.transactions.firstIndex(where: { $0.store == transaction.store && $0.transactionId == transactionId })
        if let index, request.keepRevocation == true {
            // A writer that does not know of refunds never undoes one (keep_revocation).
            transaction.revocationDate = record.transactions[index].revocationDate
        }
        let chainState = record.subscriptions.first { $0.store == transaction.store && $0.originalTransactionId == transaction.originalTransactionId }
        if let ended = chainState?.endedDate, Self.runs(transaction, past: ended) {
            // The store ended the chain (ended_date): a period recorded after the end gives
            // nothing past it, as if the end had come second.
            transaction.revocationDate = ended
        }
        var logged = request
        logged.userId = customerId
        logged.transaction = transaction
        var effect = WriteEffect(customerId: customerId, created: created, logged: .recordTransaction(logged))
        if let index {
            let known = record.transactions[index]
            if known == transaction {
                return effect  // the same transaction again: nothing to do
            }
            if known.verified != true, transaction.verified == true {
                // The store's verified record completes what a caller wrote first (no
                // price, a guessed expiry): every field is the store's.
                record.transactions[index] = transaction
                effect.records[customerId] = record
                return effect
            }
            var withRevocation = known
            withRevocation.revocationDate = transaction.revocationDate
            if known.verified == true, transaction.verified != true {
                // A caller's write of what the store verified: the store's fields stand. A
                // refund by hand applies; clearing a refund only from a write that names
                // the store's record exactly (else a caller's first guess, sent again,
                // would undo the store's refund).
                var caller = transaction
                caller.verified = true
                caller.revocationDate = known.revocationDate
                let clearing = transaction.revocationDate == nil && known.revocationDate != nil
                if withRevocation == known || (clearing && caller != known) {
                    return effect
                }
                transaction = withRevocation
                logged.transaction = transaction
                effect.logged = .recordTransaction(logged)
            }
            guard withRevocation == transaction else {
                throw WriteRefusal(
                    .failedPrecondition,
                    "transaction \(transaction.store) \(transactionId) is already recorded with other values (\(Self.differences(known, transaction))); only its revocation_date may change"
                )
            }
            // A refund (revocation date set) or its reversal (cleared).
            record.transactions[index] = transaction
        } else {
            record.transactions.append(transaction)
        }
        effect.records[customerId] = record
        return effect
    }

    private func updateSubscriptionState(_ request: UpdateSubscriptionStateRequest) throws -> WriteEffect {
        let userId = try self.id(request.userId, "user_id")
        guard var state = request.state else {
            throw WriteRefusal(.invalidArgument, "state: required")
        }
        try self.checkStore(state.store, "state.store")
        let chain = try self.id(state.originalTransactionId, "state.original_transaction_id")
        var (record, created) = try self.recordOrNew(userId)
        let customerId = record.id!
        let store = state.store
        let matching: (SubscriptionState) -> Bool = { $0.store == store && $0.originalTransactionId == chain }
        let stored = record.subscriptions.first(where: matching)
        // An ended chain stays ended: a later state that does not say so keeps the end.
        if state.endedDate == nil {
            state.endedDate = stored?.endedDate
        }
        // Auto-renew still off: it went off when the stored state says (a store that dates
        // only the change, as the App Store does, sends later states without the date).
        // Only for dated states (event_date), so manual writes and older logs replay as
        // they were applied.
        if state.eventDate != nil, state.autoRenewEnabled == false, let stored, stored.autoRenewEnabled == false {
            if state.autoRenewDisabledDate == nil {
                state.autoRenewDisabledDate = stored.autoRenewDisabledDate
            }
            if state.cancellationReason == .unspecified {
                state.cancellationReason = stored.cancellationReason  // and why, likewise
            }
        }
        var logged = request
        logged.userId = customerId
        logged.state = state
        var effect = WriteEffect(customerId: customerId, created: created, logged: .updateSubscriptionState(logged))
        if let incoming = state.eventDate, let storedDate = stored?.eventDate, incoming < storedDate {
            // An older event delivered late: the newer state stays. One thing it may still
            // correct: when auto-renew went off, while it is off in the newer state. An older
            // state that turned it off later than the stored date gives its date; one that
            // turned it back on after the stored date clears it (that was not the last time
            // it went off).
            if var newer = stored, newer.autoRenewEnabled == false {
                let before = newer
                if state.autoRenewEnabled == false, let date = state.autoRenewDisabledDate, date > before.autoRenewDisabledDate ?? .min {
                    newer.autoRenewDisabledDate = date
                    if state.cancellationReason != .unspecified, newer.cancellationReason == .unspecified {
                        newer.cancellationReason = state.cancellationReason  // and why
                    }
                } else if state.autoRenewEnabled == true, let date = before.autoRenewDisabledDate, incoming > date {
                    newer.autoRenewDisabledDate = nil
                }
                if newer != before {
                    _ = Self.upsert(newer, into: &record.subscriptions, matching: matching)
                    effect.records[customerId] = record
                }
            }
            return effect
        }
        var changed = Self.upsert(state, into: &record.subscriptions, matching: matching)
        if let ended = state.endedDate {
            // Every transaction of the chain still running at the end is revoked there.
            for index in record.transactions.indices
            where record.transactions[index].store == store && record.transactions[index].originalTransactionId == chain
                && Self.runs(record.transactions[index], past: ended)
            {
                record.transactions[index].revocationDate = ended
                changed = true
            }
        }
        if changed {
            effect.records[customerId] = record
        }
        return effect
    }

    /// Whether `transaction` still gives access after `date`: bought before it, expiring
    /// after it, and not revoked by then.
    static func runs(_ transaction: Transaction, past date: Int64) -> Bool {
        guard let start = transaction.transactionDate, start < date else {
            return false
        }
        if let revoked = transaction.revocationDate, revoked <= date {
            return false
        }
        return transaction.expirationDate.map { $0 > date } ?? true
    }

    private func grantEntitlement(_ request: GrantEntitlementRequest, now: Int64) throws -> WriteEffect {
        let userId = try self.id(request.userId, "user_id")
        guard var grant = request.grant else {
            throw WriteRefusal(.invalidArgument, "grant: required")
        }
        let grantId = try self.id(grant.grantId, "grant.grant_id")
        _ = try self.id(grant.entitlementId, "grant.entitlement_id")
        var (record, created) = try self.recordOrNew(userId)
        // A retried grant without a date keeps the date it was first given.
        let granted = grant.grantedDate ?? record.grants.first { $0.grantId == grantId }?.grantedDate ?? now
        grant.grantedDate = granted
        if let expiration = grant.expirationDate, expiration <= granted {
            throw WriteRefusal(.invalidArgument, "grant.expiration_date: \(expiration) is not after granted_date \(granted)")
        }
        let customerId = record.id!
        var logged = request
        logged.userId = customerId
        logged.grant = grant
        var effect = WriteEffect(customerId: customerId, created: created, logged: .grantEntitlement(logged))
        // A grant id names one grant: granting it again replaces it (e.g. an extension).
        if Self.upsert(grant, into: &record.grants, matching: { $0.grantId == grantId }) {
            effect.records[customerId] = record
        }
        return effect
    }

    private func revokeGrant(_ request: RevokeGrantRequest, now: Int64) throws -> WriteEffect {
        let userId = try self.id(request.userId, "user_id")
        let grantId = try self.id(request.grantId, "grant_id")
        guard var record = try self.lookup(userId), let customerId = record.id else {
            throw WriteRefusal(.notFound, "user_id: no customer \"\(userId)\"")
        }
        guard let index = record.grants.firstIndex(where: { $0.grantId == grantId }) else {
            throw WriteRefusal(.notFound, "grant_id: customer \"\(customerId)\" has no grant \"\(grantId)\"")
        }
        // A retried revocation without a date keeps the first one.
        let revoked = request.revokedDate ?? record.grants[index].revokedDate ?? now
        var logged = request
        logged.userId = customerId
        logged.revokedDate = revoked
        var effect = WriteEffect(customerId: customerId, logged: .revokeGrant(logged))
        if record.grants[index].revokedDate == revoked {
            return effect
        }
        record.grants[index].revokedDate = revoked
        effect.records[customerId] = record
        return effect
    }

    private func linkAlias(_ request: LinkAliasRequest) throws -> WriteEffect {
        let userId = try self.id(request.userId, "user_id")
        let alias = try self.id(request.alias, "alias")
        var (record, created) = try self.recordOrNew(userId)
        let customerId = record.id!
        var logged = request
        logged.userId = customerId
        var effect = WriteEffect(customerId: customerId, created: created, logged: .linkAlias(logged))
        guard alias != customerId else {
            throw WriteRefusal(.invalidArgument, "alias: \"\(alias)\" is the customer's own id")
        }
        if let owner = try self.lookup(alias), let ownerId = owner.id {
            if ownerId == customerId {
                return effect  // already this customer's alias
            }
            guard ownerId != alias else {
                throw WriteRefusal(.failedPrecondition, "alias: \"\(alias)\" is a customer id, not an alias; customers are not merged")
            }
            guard request.transfer == true else {
                throw WriteRefusal(
                    .failedPrecondition,
                    "alias: \"\(alias)\" belongs to customer \"\(ownerId)\"; set transfer to move it"
                )
            }
            var previous = owner
            previous.aliases.removeAll { $0 == alias }
            effect.records[ownerId] = previous
        }
        record.aliases.append(alias)
        effect.records[customerId] = record
        effect.aliases[alias] = customerId
        return effect
    }

    private func deleteCustomer(_ request: DeleteCustomerRequest) throws -> WriteEffect {
        let userId = try self.id(request.userId, "user_id")
        guard let record = try self.lookup(userId), let customerId = record.id else {
            // Deleting what is not there is done already: a retried delete succeeds.
            return WriteEffect(customerId: userId, logged: .deleteCustomer(request))
        }
        var logged = request
        logged.userId = customerId
        var effect = WriteEffect(customerId: customerId, logged: .deleteCustomer(logged))
        effect.records[customerId] = .some(nil)
        for alias in record.aliases {
            effect.aliases[alias] = .some(nil)
        }
        return effect
    }

    // MARK: Helpers

    /// Replaces the element `matching` finds with `element`, or appends it; returns whether
    /// anything changed (an identical element already there changes nothing).
    private static func upsert<Element: Equatable>(_ element: Element, into elements: inout [Element], matching: (Element) -> Bool) -> Bool {
        guard let index = elements.firstIndex(where: matching) else {
            elements.append(element)
            return true
        }
        guard elements[index] != element else {
            return false
        }
        elements[index] = element
        return true
    }

    /// The customer `userId` names, or a new, empty one with that id.
    private func recordOrNew(_ userId: String) throws -> (CustomerRecord, created: Bool) {
        if let record = try self.lookup(userId), record.id != nil {
            return (record, false)
        }
        return (CustomerRecord(id: userId), true)
    }

    /// A required id: present and following ``IdRule`` (1 to 256 bytes, NFC). A replayed
    /// write is held to the length only: binaries before the NFC rule logged ids that are
    /// not NFC, and their writes must still replay.
    func id(_ value: String?, _ field: String) throws -> String {
        guard let value, !value.isEmpty else {
            throw WriteRefusal(.invalidArgument, "\(field): required")
        }
        if self.replaying {
            guard value.utf8.count <= IdRule.maximumBytes else {
                throw WriteRefusal(.invalidArgument, "\(field): must be at most \(IdRule.maximumBytes) bytes, got \(value.utf8.count)")
            }
        } else if let problem = IdRule.problem(value) {
            throw WriteRefusal(.invalidArgument, "\(field): \(problem)")
        }
        return value
    }

    /// The fields in which two versions of a transaction differ, for an error message.
    private static func differences(_ a: Transaction, _ b: Transaction) -> String {
        var fields: [String] = []
        if a.originalTransactionId != b.originalTransactionId { fields.append("original_transaction_id") }
        if a.productId != b.productId { fields.append("product_id") }
        if a.offerCode != b.offerCode { fields.append("offer_code") }
        if a.transactionDate != b.transactionDate { fields.append("transaction_date") }
        if a.expirationDate != b.expirationDate { fields.append("expiration_date") }
        if a.environment != b.environment { fields.append("environment") }
        if a.ownershipType != b.ownershipType { fields.append("ownership_type") }
        if a.type != b.type { fields.append("type") }
        if a.priceMicros != b.priceMicros { fields.append("price_micros") }
        if a.currency != b.currency { fields.append("currency") }
        if a.verified != b.verified { fields.append("verified") }
        return fields.joined(separator: ", ")
    }
}
