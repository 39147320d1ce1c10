public import EntitlementsMessages
public import EntitlementsResolver

/// Builds one customer's timeline from the state it had at a starting point and the log
/// records after it (docs/durability.md, "History"). Pure: the records come in, in log
/// order; nothing is read here.
///
/// Each record that changes the customer gives a WRITE entry with the entitlements right
/// after it; between writes, and after the last up to `now`, each instant at which time
/// alone changes an entitlement (an expiry, a grace period's end, a grant's end: the
/// answers' `validUntil`) gives a TIME entry.
public struct CustomerHistoryBuilder {
    public let customerId: String
    public let resolver: EntitlementResolver
    public let catalog: ProductCatalog
    public let environment: Environment
    /// Formats an instant for summaries.
    public let date: (Int64) -> String

    /// The customer's id and aliases now, as UTF-8: a log record that holds none of them
    /// does not touch the customer.
    /// Kept up to date as records apply: the scan asks for them once per log record.
    public private(set) var names: [[UInt8]] = []

    /// The entries so far, oldest first.
    public private(set) var entries: [HistoryEntry] = []
    /// The customer's record after the last step (nil: it does not exist).
    public private(set) var record: CustomerRecord? {
        didSet { self.names = Self.names(of: self.customerId, self.record) }
    }
    private var answer: Resolution
    private var lastDate: Int64

    /// At most this many TIME entries between two writes (a grant renewed daily for years
    /// would otherwise fill the history with its own ends).
    static let timeStepsBetweenWrites = 64

    /// Starts from `record` (the customer as the starting snapshot holds it, or nil) at
    /// `startDate`; an existing record gives a first entry, cause UNSPECIFIED.
    public init(
        customerId: String,
        record: CustomerRecord?,
        startDate: Int64,
        catalog: ProductCatalog,
        environment: Environment,
        date: @escaping (Int64) -> String
    ) {
        self.customerId = customerId
        self.catalog = catalog
        self.resolver = EntitlementResolver(catalog: catalog)
        self.environment = environment
        self.date = date
        self.record = record
        self.names = Self.names(of: customerId, record)  // (didSet does not run in init)
        self.lastDate = startDate
        self.answer = self.resolver.resolve(record, at: startDate, environment: environment)
        if let record {
            self.entries.append(HistoryEntry(
                date: startDate,
                cause: .unspecified,
                summary: "as kept at the start of the history: " + Self.describe(record),
                changes: Self.changes(from: Resolution(), to: self.answer),
                entitlements: self.answer.entitlements
            ))
        }
    }

    /// Applies one log record, in order; records of other customers change nothing.
    public mutating func apply(_ logRecord: LogRecord) {
        guard let mutation = logRecord.mutation, let after = self.recordAfter(mutation, at: logRecord.recordedDate ?? self.lastDate) else {
            return
        }
        let date = max(logRecord.recordedDate ?? self.lastDate, self.lastDate)
        self.advanceTime(to: date)
        let before = self.record
        self.record = after.record
        let answer = self.resolver.resolve(after.record, at: date, environment: self.environment)
        var source = logRecord.source
        if source == nil, case .replicatedWrite(let write) = mutation {
            source = write.source
        }
        self.entries.append(HistoryEntry(
            date: date,
            cause: .write,
            logSequence: logRecord.sequence,
            source: source,
            summary: after.note ?? Self.summary(before: before, after: after.record, date: self.date),
            changes: Self.changes(from: self.answer, to: answer),
            entitlements: answer.entitlements,
            deleted: after.record == nil && before != nil
        ))
        self.answer = answer
        self.lastDate = date
    }

    /// Adds the TIME entries up to `now` (call once, after the last record).
    public mutating func finish(now: Int64) {
        self.advanceTime(to: now + 1)
    }

    /// TIME entries for every change of the answer at an instant before `date`: of an
    /// entitlement's isActive or renewState (its `changes`), or of whether it is in a grace
    /// period (the console draws grace periods from these).
    private mutating func advanceTime(to date: Int64) {
        var steps = 0
        while let until = self.answer.validUntil, until < date {
            guard steps < Self.timeStepsBetweenWrites else {
                // Folded: one entry for the rest, with the answer just before `date`.
                let next = self.resolver.resolve(self.record, at: date - 1, environment: self.environment)
                self.entries.append(HistoryEntry(
                    date: until,
                    cause: .time,
                    summary: "more changes by time until \(self.date(date)), folded into this entry (at most \(Self.timeStepsBetweenWrites) between two writes)",
                    changes: Self.changes(from: self.answer, to: next),
                    entitlements: next.entitlements
                ))
                self.answer = next
                self.lastDate = date - 1
                return
            }
            steps += 1
            let next = self.resolver.resolve(self.record, at: until, environment: self.environment)
            let changes = Self.changes(from: self.answer, to: next)
            let grace = Self.graceChanges(from: self.answer, to: next)
            if !changes.isEmpty || !grace.isEmpty {
                self.entries.append(HistoryEntry(
                    date: until,
                    cause: .time,
                    summary: (changes.map { Self.describe($0) } + grace).joined(separator: "; "),
                    changes: changes,
                    entitlements: next.entitlements
                ))
            }
            self.answer = next
            self.lastDate = until
        }
    }

    /// "premium in grace period until ..." / "premium grace period over", for each
    /// entitlement whose isInGracePeriod differs.
    private static func graceChanges(from old: Resolution, to new: Resolution) -> [String] {
        let before = Dictionary(old.entitlements.map { ($0.id ?? "", $0.isInGracePeriod) }, uniquingKeysWith: { $1 })
        return new.entitlements.compactMap { entitlement in
            let id = entitlement.id ?? ""
            guard before[id, default: false] != entitlement.isInGracePeriod else { return nil }
            return entitlement.isInGracePeriod ? "\(id) in grace period" : "\(id) grace period over"
        }
    }

    /// The customer's record after `mutation`, or nil when the mutation does not touch it.
    /// A record the store logged was accepted when written, so the rules are run as replay
    /// runs them; `note` says when this reading cannot follow it.
    private func recordAfter(_ mutation: LogRecord.Mutation, at now: Int64) -> (record: CustomerRecord?, note: String?)? {
        switch mutation {
        case .replicatedWrite(let write):
            // Fleet mode: the record as the writing server computed it.
            guard let change = write.customers.first(where: { $0.customerId == self.customerId }) else { return nil }
            return (change.record, nil)
        case .linkAlias(let request) where request.userId != self.customerId:
            // Another customer took one of this one's aliases (transfer).
            guard var record = self.record, let alias = request.alias, record.aliases.contains(alias) else { return nil }
            record.aliases.removeAll { $0 == alias }
            return (record, "alias \(alias) moved to customer \(request.userId ?? "")")
        default:
            // Logged writes name the canonical customer id (CustomerMutation).
            guard Self.customerId(of: mutation) == self.customerId else { return nil }
            let current = self.record
            let ownNames = Set([self.customerId] + (current?.aliases ?? []))
            let rules = CustomerMutation(catalog: self.catalog, replaying: true) { id in
                ownNames.contains(id) ? current : nil
            }
            do {
                let effect = try rules.effect(of: mutation, now: now)
                guard let changed = effect.records[self.customerId] else {
                    return (current, "no change")
                }
                return (changed, nil)
            } catch {
                return (current, "not replayed here (\(error)); the entitlements shown are from before it")
            }
        }
    }

    static func customerId(of mutation: LogRecord.Mutation) -> String? {
        switch mutation {
        case .recordTransaction(let request): request.userId
        case .updateSubscriptionState(let request): request.userId
        case .grantEntitlement(let request): request.userId
        case .revokeGrant(let request): request.userId
        case .linkAlias(let request): request.userId
        case .deleteCustomer(let request): request.userId
        case .replicatedWrite(let write): write.customerId
        }
    }

    // MARK: Describing

    /// Each entitlement whose isActive or renewState differs, as watch events have them.
    static func changes(from old: Resolution, to new: Resolution) -> [EntitlementChange] {
        let before = Self.states(old)
        let after = Self.states(new)
        return Set(before.keys).union(after.keys).sorted().compactMap { id in
            before[id] == after[id] ? nil : EntitlementChange(entitlementId: id, before: before[id], after: after[id])
        }
    }

    private static func states(_ resolution: Resolution) -> [String: EntitlementState] {
        var states: [String: EntitlementState] = [:]
        for entitlement in resolution.entitlements {
            states[entitlement.id ?? ""] = EntitlementState(isActive: entitlement.isActive, renewState: entitlement.renewState)
        }
        return states
    }

    static func describe(_ change: EntitlementChange) -> String {
        let id = change.entitlementId ?? ""
        switch (change.before?.isActive, change.after?.isActive) {
        case (true, false): return "\(id) ended"
        case (false, true), (nil, true): return "\(id) active"
        case (_, nil): return "\(id) gone"
        default: return "\(id) \(Self.name(change.after?.renewState ?? .unknown))"
        }
    }

    private static func name(_ state: RenewState) -> String {
        switch state {
        case .willRenew: "will renew"
        case .canceled: "renewal off"
        case .billingIssue: "billing issue"
        case .nonRenewable: "non-renewable"
        default: "renew state changed"
        }
    }

    static func names(of customerId: String, _ record: CustomerRecord?) -> [[UInt8]] {
        [Array(customerId.utf8)] + (record?.aliases ?? []).map { Array($0.utf8) }
    }

    static func describe(_ record: CustomerRecord) -> String {
        "\(record.transactions.count) transactions, \(record.subscriptions.count) renewal states, \(record.grants.count) grants, \(record.aliases.count) aliases"
    }

    /// What a write changed in the record, in one line.
    static func summary(before: CustomerRecord?, after: CustomerRecord?, date: (Int64) -> String) -> String {
        guard let after else {
            return before == nil ? "nothing to delete" : "customer deleted"
        }
        var parts: [String] = []
        if before == nil {
            parts.append("customer created")
        }
        let old = before ?? CustomerRecord()
        func key(_ transaction: Transaction) -> String { "\(transaction.store) \(transaction.transactionId ?? "")" }
        let oldTransactions = Dictionary(old.transactions.map { (key($0), $0) }, uniquingKeysWith: { $1 })
        for transaction in after.transactions {
            let store = Self.store(transaction.store)
            let what = "\(store) transaction \(transaction.transactionId ?? "")"
            guard let previous = oldTransactions[key(transaction)] else {
                var line = "\(what) recorded: \(transaction.productId ?? "?")"
                if let original = transaction.originalTransactionId, original != transaction.transactionId { line += " (chain \(original))" }
                if let purchased = transaction.transactionDate { line += ", purchased \(date(purchased))" }
                if let expires = transaction.expirationDate { line += ", expires \(date(expires))" }
                if let revoked = transaction.revocationDate { line += ", refunded \(date(revoked))" }
                if transaction.verified { line += ", verified by the store" }
                parts.append(line)
                continue
            }
            guard previous != transaction else { continue }
            if previous.revocationDate != transaction.revocationDate {
                parts.append(transaction.revocationDate.map { "\(what) refunded \(date($0))" } ?? "\(what) refund undone")
            }
            if previous.expirationDate != transaction.expirationDate {
                parts.append("\(what) expiry \(transaction.expirationDate.map(date) ?? "none")")
            }
            if previous.verified != transaction.verified, transaction.verified {
                parts.append("\(what) verified by the store")
            }
        }
        func stateKey(_ state: SubscriptionState) -> String { "\(state.store) \(state.originalTransactionId ?? "")" }
        let oldStates = Dictionary(old.subscriptions.map { (stateKey($0), $0) }, uniquingKeysWith: { $1 })
        for state in after.subscriptions where oldStates[stateKey(state)] != state {
            var line = "\(Self.store(state.store)) chain \(state.originalTransactionId ?? "") renewal: auto-renew \(state.autoRenewEnabled ? "on" : "off")"
            if state.isInBillingRetry { line += ", billing retry" }
            if let grace = state.gracePeriodExpirationDate { line += ", grace until \(date(grace))" }
            if let ended = state.endedDate { line += ", ended \(date(ended))" }
            parts.append(line)
        }
        let oldGrants = Dictionary(old.grants.map { ($0.grantId ?? "", $0) }, uniquingKeysWith: { $1 })
        for grant in after.grants {
            let what = "grant \(grant.grantId ?? "") of \(grant.entitlementId ?? "")"
            guard let previous = oldGrants[grant.grantId ?? ""] else {
                var line = "\(what) given"
                if let from = grant.grantedDate { line += " from \(date(from))" }
                line += grant.expirationDate.map { " until \(date($0))" } ?? " for good"
                if let reason = grant.reason, !reason.isEmpty { line += " (\(reason))" }
                parts.append(line)
                continue
            }
            guard previous != grant else { continue }
            if previous.revokedDate != grant.revokedDate, let revoked = grant.revokedDate {
                parts.append("\(what) revoked at \(date(revoked))")
            } else {
                parts.append("\(what) changed" + (grant.expirationDate.map { ", until \(date($0))" } ?? ""))
            }
        }
        for alias in after.aliases where !old.aliases.contains(alias) {
            parts.append("alias \(alias) linked")
        }
        for alias in old.aliases where !after.aliases.contains(alias) {
            parts.append("alias \(alias) removed")
        }
        return parts.isEmpty ? "no change" : parts.joined(separator: "; ")
    }

    private static func store(_ source: Source) -> String {
        switch source {
        case .appstore: "App Store"
        case .playstore: "Google Play"
        case .stripe: "Stripe"
        case .manual: "manual"
        default: "store"
        }
    }
}
