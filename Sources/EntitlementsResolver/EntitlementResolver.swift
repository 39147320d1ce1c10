public import EntitlementsMessages

/// The answer for one customer at one instant: the entitlements and how long it holds.
public struct Resolution: Sendable, Hashable {
    /// One entry per entitlement with at least one candidate, sorted by id.
    public var entitlements: [Entitlement]
    /// The earliest instant after the evaluation instant at which the answer changes (rule
    /// 12); nil when it never does. The answer is exact for every instant before it.
    public var validUntil: Int64?

    /// Creates a resolution.
    public init(entitlements: [Entitlement] = [], validUntil: Int64? = nil) {
        self.entitlements = entitlements
        self.validUntil = validUntil
    }
}

extension Resolution {
    /// The CheckEntitlements answer for `userId`, resolved to `customerId` (nil for an
    /// unknown user) at `requestDate`.
    public func response(userId: String, customerId: String?, requestDate: Int64) -> CheckEntitlementsResponse {
        CheckEntitlementsResponse(
            userId: userId,
            customerId: customerId,
            requestDate: requestDate,
            validUntil: self.validUntil,
            entitlements: self.entitlements
        )
    }
}

/// Computes a customer's entitlements at an instant, by the rules of
/// docs/entitlement-rules.md (the rule numbers in comments refer to that file).
///
/// Pure: no I/O, no clock, no shared state. The same inputs always give the same answer,
/// whatever the order of the customer's transactions, subscription states and grants.
public struct EntitlementResolver: Sendable {
    /// The catalog the resolver maps products to entitlements with.
    public let catalog: ProductCatalog

    /// Creates a resolver for `catalog`.
    public init(catalog: Catalog) {
        self.catalog = ProductCatalog(catalog)
    }

    /// Creates a resolver for an indexed catalog.
    public init(catalog: ProductCatalog) {
        self.catalog = catalog
    }

    /// Resolves `customer`'s entitlements at `instant` (Unix milliseconds).
    ///
    /// - Parameters:
    ///   - customer: the customer's record; nil for an unknown user, who has no entitlements.
    ///   - instant: the evaluation instant T.
    ///   - environment: whose transactions count; `.unspecified` means production.
    ///   - entitlementIds: only these entitlements; empty means all.
    public func resolve(
        _ customer: CustomerRecord?,
        at instant: Int64,
        environment: Environment = .production,
        entitlementIds: [String] = []
    ) -> Resolution {
        guard let customer else {
            return Resolution()
        }
        // Each entitlement's candidates are its own (rules 5 and 6), so the filtered answer
        // is the whole customer's, filtered; validUntil is the whole customer's (rule 12).
        let whole = self.evaluate(customer, at: instant, environment: environment, entitlementIds: [])
        var answer = whole
        if !entitlementIds.isEmpty {
            answer.entitlements = whole.entitlements.filter { entitlementIds.contains($0.id ?? "") }
        }
        // Rule 12, exact: the answer can change only at the input dates the evaluation
        // noted; the first of them at which the whole customer's answer (every
        // entitlement, whatever the filter) differs is validUntil. Each step goes to the
        // next noted date, so it ends; past `exactSteps` the date reached is kept, early
        // and so still safe.
        guard var next = answer.validUntil else {
            return answer
        }
        for _ in 0..<Self.exactSteps {
            if Self.changes(whole, at: next) {
                break  // a date the answer shows changes it: no need to look
            }
            let later = self.evaluate(customer, at: next, environment: environment, entitlementIds: [])
            if later.entitlements != whole.entitlements {
                break
            }
            guard let after = later.validUntil else {
                answer.validUntil = nil  // no input date ahead changes anything
                return answer
            }
            next = after
        }
        answer.validUntil = next
        return answer
    }

    /// Whether `resolution`'s own fields say it changes at `instant` (a date after its
    /// evaluation instant): an active entitlement's expiration (it ends, or its grace
    /// starts), a grace end after the expiration, a billing issue's detection (renewState),
    /// the current transaction's revocation. The common case, known without evaluating
    /// again; false says only "not known", and the caller evaluates.
    static func changes(_ resolution: Resolution, at instant: Int64) -> Bool {
        for entitlement in resolution.entitlements {
            if entitlement.isActive, entitlement.expirationDate == instant {
                return true
            }
            if let expiration = entitlement.expirationDate {
                if let grace = entitlement.gracePeriodExpirationDate, grace == instant, grace > expiration, !entitlement.isRevoked {
                    return true
                }
                if entitlement.billingIssueDetectedDate == instant {
                    return true
                }
            }
            if entitlement.transactions.last?.revocationDate == instant {
                return true
            }
        }
        return false
    }

    /// The most later instants ``resolve(_:at:environment:entitlementIds:)`` evaluates to
    /// make validUntil exact (a customer has few future dates; a pathological one with
    /// more gets an early, safe validUntil).
    static let exactSteps = 16

    /// Rules 1 to 11 and 13 at `instant`; validUntil is rule 12's first candidate: the
    /// earliest input date after `instant`.
    private func evaluate(_ customer: CustomerRecord, at instant: Int64, environment: Environment, entitlementIds: [String]) -> Resolution {
        var evaluation = Evaluation(instant: instant)
        let environment = environment == .unspecified ? Environment.production : environment
        let wanted = entitlementIds.isEmpty ? nil : Set(entitlementIds)

        // Rule 1: group the counted transactions into chains. Every date of a transaction
        // in this environment can change the answer (rule 12), counted or not. Chains hold
        // indices into the customer's transactions, so nothing is copied until a winner's
        // fields are filled in; customers have few chains, so a linear search beats hashing.
        let transactions = customer.transactions
        var chains: [(key: ChainKey, members: [Int])] = []
        for (index, transaction) in transactions.enumerated() where transaction.effectiveEnvironment == environment {
            guard let date = transaction.transactionDate else {
                continue  // input validation rejects these; never count an undated transaction
            }
            evaluation.noteChange(at: date)
            evaluation.noteChange(at: transaction.expirationDate)
            evaluation.noteChange(at: transaction.revocationDate)
            guard date <= instant else {
                continue
            }
            let key = ChainKey(transaction)
            if let chain = chains.firstIndex(where: { $0.key == key }) {
                chains[chain].members.append(index)
            } else {
                chains.append((key, [index]))
            }
        }
        for state in customer.subscriptions {
            evaluation.noteChange(at: state.gracePeriodExpirationDate)
            evaluation.noteChange(at: state.billingIssueDetectedDate)
        }

        // Rule 5: candidates per entitlement; rule 6: keep the best of each.
        var best: [(entitlementId: String, candidate: Candidate)] = []
        for (key, members) in chains {
            // A chain has one state: input validation and the write path guarantee it.
            let state = customer.subscriptions.last {
                $0.store == key.store && ($0.originalTransactionId ?? "") == key.originalTransactionId
            }
            let chain = Chain(key: key, all: transactions, members: members, state: state, at: instant)
            for entitlementId in self.catalog.entitlements(unlockedBy: chain.current.productId)
            where wanted?.contains(entitlementId) ?? true {
                Self.offer(Candidate(chain: chain), for: entitlementId, to: &best)
            }
        }
        for grant in customer.grants {
            guard let grantedDate = grant.grantedDate, let entitlementId = grant.entitlementId else {
                continue
            }
            evaluation.noteChange(at: grantedDate)
            evaluation.noteChange(at: grant.expirationDate)
            evaluation.noteChange(at: grant.revokedDate)
            if grantedDate <= instant, wanted?.contains(entitlementId) ?? true {
                Self.offer(Candidate(grant: grant, grantedDate: grantedDate, at: instant), for: entitlementId, to: &best)
            }
        }

        // Rule 7: one entry per entitlement with a candidate, sorted by id.
        best.sort { $0.entitlementId < $1.entitlementId }
        let entitlements = best.map { $0.candidate.entitlement(id: $0.entitlementId, at: instant, catalog: self.catalog) }
        return Resolution(entitlements: entitlements, validUntil: evaluation.validUntil)
    }

    private static func offer(
        _ candidate: Candidate,
        for entitlementId: String,
        to best: inout [(entitlementId: String, candidate: Candidate)]
    ) {
        guard let index = best.firstIndex(where: { $0.entitlementId == entitlementId }) else {
            best.append((entitlementId, candidate))
            return
        }
        if candidate.beats(best[index].candidate) {
            best[index].candidate = candidate
        }
    }
}

/// Tracks rule 12: the earliest instant after T at which an input date takes effect.
struct Evaluation {
    let instant: Int64
    private(set) var validUntil: Int64?

    init(instant: Int64) {
        self.instant = instant
    }

    mutating func noteChange(at date: Int64?) {
        guard let date, date > self.instant else {
            return
        }
        if let validUntil, validUntil <= date {
            return
        }
        self.validUntil = date
    }
}

/// Identifies a chain: rule 1's (store, originalTransactionId).
struct ChainKey: Hashable {
    var store: Source
    var originalTransactionId: String

    init(store: Source, originalTransactionId: String) {
        self.store = store
        self.originalTransactionId = originalTransactionId
    }

    init(_ transaction: Transaction) {
        self.init(store: transaction.store, originalTransactionId: transaction.originalTransactionId ?? "")
    }
}

/// One chain's state at T (rules 2, 3, 8, 9).
struct Chain {
    let key: ChainKey
    /// The customer's transactions; the chain's are `members`.
    let all: [Transaction]
    /// Indices of the counted transactions in `all`, oldest first (ties: smaller
    /// transaction id first).
    let members: [Int]
    let state: SubscriptionState?
    let isRevoked: Bool
    let isActive: Bool

    var current: Transaction { self.all[self.members[self.members.count - 1]] }

    init(key: ChainKey, all: [Transaction], members: [Int], state: SubscriptionState?, at instant: Int64) {
        self.key = key
        self.all = all
        self.members = members.count < 2 ? members : members.sorted { Transaction.isOrderedBefore(all[$0], all[$1]) }
        self.state = state
        let current = all[self.members[self.members.count - 1]]
        // Rule 2.
        self.isRevoked = current.revocationDate.map { $0 <= instant } ?? false
        // Rule 3.
        if self.isRevoked {
            self.isActive = false
        } else if let expiration = current.expirationDate {
            let graceEnd = state?.gracePeriodExpirationDate
            self.isActive = instant < expiration || graceEnd.map { instant < $0 } ?? false
        } else {
            self.isActive = true
        }
    }

    /// When access ends or ended ignoring revocation: the expiration, or the grace end if
    /// later; nil if the current transaction never expires.
    var accessEnd: Int64? {
        guard let expiration = self.current.expirationDate else {
            return nil
        }
        return max(expiration, self.state?.gracePeriodExpirationDate ?? expiration)
    }

    /// Rule 9.
    func renewState(at instant: Int64) -> RenewState {
        guard self.current.expirationDate != nil else {
            return .nonRenewable
        }
        guard let state = self.state else {
            return .unknown
        }
        if let detected = state.billingIssueDetectedDate, detected <= instant {
            return .billingIssue
        }
        return state.autoRenewEnabled ? .willRenew : .canceled
    }
}

/// A chain or a grant competing for one entitlement (rule 6).
struct Candidate {
    enum Origin {
        case chain(Chain)
        case grant(Grant)
    }

    let origin: Origin
    let isActive: Bool
    /// Active: when access ends (nil = never, the latest). Inactive: when it ended.
    let end: Int64?
    /// The latest transaction date, or the grant date.
    let latestDate: Int64
    /// originalTransactionId or grantId: the last tie-breaker, smaller wins.
    let tieBreakId: String
    let store: Source

    init(chain: Chain) {
        self.origin = .chain(chain)
        self.isActive = chain.isActive
        if chain.isActive {
            self.end = chain.accessEnd
        } else if chain.isRevoked, let revocation = chain.current.revocationDate {
            self.end = min(revocation, chain.accessEnd ?? revocation)
        } else {
            self.end = chain.accessEnd
        }
        self.latestDate = chain.current.transactionDate ?? .min
        self.tieBreakId = chain.key.originalTransactionId
        self.store = chain.key.store
    }

    init(grant: Grant, grantedDate: Int64, at instant: Int64) {
        self.origin = .grant(grant)
        let expired = grant.expirationDate.map { instant >= $0 } ?? false
        let revoked = grant.revokedDate.map { instant >= $0 } ?? false
        // Rule 4.
        self.isActive = !expired && !revoked
        switch (grant.expirationDate, grant.revokedDate) {
        case (let expiration?, let revocation?): self.end = min(expiration, revocation)
        case (let expiration?, nil): self.end = expiration
        case (nil, let revocation?): self.end = revocation
        case (nil, nil): self.end = nil
        }
        self.latestDate = grantedDate
        self.tieBreakId = grant.grantId ?? ""
        self.store = .manual
    }

    /// Rule 6: active beats inactive; then the later end (nil, never ending, is latest);
    /// then the later latest date; then the smaller id (and store, for a total order).
    func beats(_ other: Candidate) -> Bool {
        if self.isActive != other.isActive {
            return self.isActive
        }
        if self.end != other.end {
            guard let end = self.end else { return true }
            guard let otherEnd = other.end else { return false }
            return end > otherEnd
        }
        if self.latestDate != other.latestDate {
            return self.latestDate > other.latestDate
        }
        if self.tieBreakId != other.tieBreakId {
            return self.tieBreakId < other.tieBreakId
        }
        return self.store.rawValue < other.store.rawValue
    }

    func entitlement(id: String, at instant: Int64, catalog: ProductCatalog) -> Entitlement {
        switch self.origin {
        case .chain(let chain):
            return Self.entitlement(id: id, chain: chain, at: instant, period: catalog.period(of: chain.current.productId))
        case .grant(let grant):
            // Rule 10.
            return Entitlement(
                id: id,
                isActive: self.isActive,
                source: .manual,
                startedDate: grant.grantedDate,
                expirationDate: grant.expirationDate,
                renewState: .nonRenewable,
                grantType: .manual,
                isRevoked: grant.revokedDate.map { $0 <= instant } ?? false
            )
        }
    }

    /// Rules 8, 9 and 13: the fields a winning chain supplies.
    private static func entitlement(id: String, chain: Chain, at instant: Int64, period: SubscriptionPeriod) -> Entitlement {
        let current = chain.current
        let transactions = chain.members.map { chain.all[$0] }
        var paidCount = 0
        var firstPurchaseDate: Int64?
        var lastPurchaseDate: Int64?
        var trialStartDate: Int64?
        var hasOfferCode = false
        var lastActivatedOfferCode: String?
        for transaction in transactions {
            if transaction.type == .trialStarted {
                trialStartDate = trialStartDate ?? transaction.transactionDate
            } else {
                paidCount += 1
                firstPurchaseDate = firstPurchaseDate ?? transaction.transactionDate
                lastPurchaseDate = transaction.transactionDate
            }
            if let offerCode = transaction.offerCode, !offerCode.isEmpty {
                hasOfferCode = true
                lastActivatedOfferCode = offerCode
            }
        }
        let renewState = chain.renewState(at: instant)
        let ownershipType = current.ownershipType
        let grantType: GrantType
        if ownershipType == .familySharing {
            grantType = .familySharing
        } else if hasOfferCode {
            grantType = .offerCode
        } else {
            grantType = .purchase
        }
        let periodType: PeriodType
        switch current.type {
        case .trialStarted: periodType = .trial
        case .introStarted, .introRenewed: periodType = .intro
        default: periodType = .normal
        }
        // Rule 13.
        let status: SubscriptionStatus
        if current.type == .nonConsumablePurchase || current.expirationDate == nil {
            status = .unspecified
        } else if renewState == .billingIssue, !chain.isRevoked, chain.isActive || chain.state?.isInBillingRetry == true {
            status = .pastDue
        } else if !chain.isActive {
            status = .canceled
        } else {
            status = periodType == .trial ? .trialing : .active
        }
        return Entitlement(
            id: id,
            isActive: chain.isActive,
            source: chain.key.store,
            startedDate: transactions.first?.transactionDate,
            trialStartDate: trialStartDate,
            firstPurchaseDate: firstPurchaseDate,
            lastPurchaseDate: lastPurchaseDate,
            autoRenewDisableDate: chain.state?.autoRenewDisabledDate,
            expirationDate: current.expirationDate,
            productId: current.productId,
            renewState: renewState,
            renewsCount: UInt32(max(0, paidCount - 1)),
            grantType: grantType,
            lastActivatedOfferCode: lastActivatedOfferCode,
            transactions: transactions,
            willRenew: renewState == .willRenew,
            isInGracePeriod: chain.isActive && current.expirationDate.map { instant >= $0 } ?? false,
            isInBillingRetry: (chain.state?.isInBillingRetry ?? false) && renewState == .billingIssue,
            isRevoked: chain.isRevoked,
            ownershipType: ownershipType,
            periodType: periodType,
            gracePeriodExpirationDate: chain.state?.gracePeriodExpirationDate,
            billingIssueDetectedDate: chain.state?.billingIssueDetectedDate,
            cancellationReason: chain.state?.cancellationReason ?? .unspecified,
            priceMicros: current.priceMicros,
            currency: current.currency,
            priceConsentStatus: chain.state?.priceConsentStatus ?? .unspecified,
            interval: period,
            status: status
        )
    }
}

extension Transaction {
    /// The environment a transaction counts in; unspecified counts as production.
    var effectiveEnvironment: Environment {
        self.environment == .unspecified ? .production : self.environment
    }

    /// Chain order: by transaction date, then by transaction id (``compareIds(_:_:)``), so
    /// that the order never depends on the input's order (ids are unique per store).
    static func isOrderedBefore(_ lhs: Transaction, _ rhs: Transaction) -> Bool {
        let lhsDate = lhs.transactionDate ?? .min
        let rhsDate = rhs.transactionDate ?? .min
        if lhsDate != rhsDate {
            return lhsDate < rhsDate
        }
        return compareIds(lhs.transactionId ?? "", rhs.transactionId ?? "")
    }
}

/// Numeric-aware id order, a strict total order: two all-digit ids compare by value
/// ("9" before "10"; equal values, like "7" and "07", then by their bytes); an all-digit id
/// comes before any other; other ids compare by their UTF-8 bytes.
func compareIds(_ lhs: String, _ rhs: String) -> Bool {
    let lhsDigits = !lhs.isEmpty && lhs.utf8.allSatisfy { $0 >= 0x30 && $0 <= 0x39 }
    let rhsDigits = !rhs.isEmpty && rhs.utf8.allSatisfy { $0 >= 0x30 && $0 <= 0x39 }
    if lhsDigits != rhsDigits {
        return lhsDigits
    }
    if lhsDigits {
        let lhsTrimmed = lhs.utf8.drop { $0 == 0x30 }
        let rhsTrimmed = rhs.utf8.drop { $0 == 0x30 }
        if lhsTrimmed.count != rhsTrimmed.count {
            return lhsTrimmed.count < rhsTrimmed.count
        }
        if !lhsTrimmed.elementsEqual(rhsTrimmed) {
            return lhsTrimmed.lexicographicallyPrecedes(rhsTrimmed)
        }
    }
    return lhs.utf8.lexicographicallyPrecedes(rhs.utf8)
}
