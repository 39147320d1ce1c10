public import EntitlementsMessages

extension EntitlementResolver {
    /// Why ``resolve(_:at:environment:entitlementIds:)`` answers as it does for `customer`
    /// at `instant`: per entitlement, every chain and grant the rules considered, whether
    /// each counted and was active and why not, and which won by which step of rule 6
    /// (docs/entitlement-rules.md). Pure, like the resolver; `date` writes an instant in
    /// messages. Slower than a check: for support tools, never on the hot path.
    public func explain(
        _ customer: CustomerRecord?,
        at instant: Int64,
        environment: Environment = .production,
        entitlementIds: [String] = [],
        resolution known: Resolution? = nil,
        date: (Int64) -> String
    ) -> Explanation {
        guard let customer else {
            return Explanation(entitlements: Set(entitlementIds).sorted().map { EntitlementExplanation(entitlementId: $0, decision: "no such customer: nothing to give it") })
        }
        let environment = environment == .unspecified ? Environment.production : environment
        let resolution = known ?? self.resolve(customer, at: instant, environment: environment, entitlementIds: entitlementIds)

        // Every chain, in any environment and from any date, with its members oldest first.
        var keys: [ChainKey] = []
        for transaction in customer.transactions where !keys.contains(ChainKey(transaction)) {
            keys.append(ChainKey(transaction))
        }
        struct Considered {
            var explanation: CandidateExplanation
            var candidate: Candidate?
        }
        var byEntitlement: [String: [Considered]] = [:]
        var wanted = Set(entitlementIds)
        let asked = !entitlementIds.isEmpty
        for key in keys {
            let all = customer.transactions
            let inChain = all.indices.filter { ChainKey(all[$0]) == key }
            let counted = inChain.filter { all[$0].effectiveEnvironment == environment && (all[$0].transactionDate ?? .max) <= instant }
            let state = customer.subscriptions.last { $0.store == key.store && ($0.originalTransactionId ?? "") == key.originalTransactionId }
            var products = Set(inChain.compactMap { all[$0].productId })
            var explanation = CandidateExplanation(kind: "chain", source: key.store, id: key.originalTransactionId)
            var candidate: Candidate?
            if counted.isEmpty {
                if inChain.allSatisfy({ all[$0].effectiveEnvironment != environment }) {
                    explanation.reason = "other environment: \(Self.name(all[inChain[0]].effectiveEnvironment)) (rule 1)"
                } else {
                    let first = inChain.filter { all[$0].effectiveEnvironment == environment }.compactMap { all[$0].transactionDate }.min()
                    explanation.reason = "not started: its first transaction is dated \(first.map(date) ?? "never") (rule 1)"
                }
            } else {
                let chain = Chain(key: key, all: all, members: counted, state: state, at: instant)
                explanation.productId = chain.current.productId
                products = [chain.current.productId ?? ""]
                candidate = Candidate(chain: chain)
                explanation.counted = true
                explanation.isActive = chain.isActive
                explanation.end = candidate?.end
                explanation.reason = Self.reason(chain, at: instant, date: date)
            }
            // Once per entitlement, though several of the chain's products unlock it.
            let unlocked = Set(products.flatMap { self.catalog.entitlements(unlockedBy: $0) })
            for entitlementId in unlocked.sorted() {
                if !asked { wanted.insert(entitlementId) }
                byEntitlement[entitlementId, default: []].append(Considered(explanation: explanation, candidate: candidate))
            }
            if asked {
                // A chain whose product unlocks none of the entitlements asked about.
                for entitlementId in Set(entitlementIds) where !products.contains(where: { self.catalog.entitlements(unlockedBy: $0).contains(entitlementId) }) {
                    var other = explanation
                    other.counted = false
                    other.isActive = false
                    other.end = nil
                    other.reason = "its product \(products.sorted().joined(separator: ", ")) does not unlock \(entitlementId) (rule 5)"
                    byEntitlement[entitlementId, default: []].append(Considered(explanation: other, candidate: nil))
                }
            }
        }
        for grant in customer.grants {
            guard let entitlementId = grant.entitlementId else { continue }
            if !asked { wanted.insert(entitlementId) }
            guard wanted.contains(entitlementId) else { continue }
            var explanation = CandidateExplanation(kind: "grant", source: .manual, id: grant.grantId)
            var candidate: Candidate?
            if let granted = grant.grantedDate, granted <= instant {
                let made = Candidate(grant: grant, grantedDate: granted, at: instant)
                candidate = made
                explanation.counted = true
                explanation.isActive = made.isActive
                explanation.end = made.end
                // Whichever ended (or ends) first: rule 6 compares that.
                let revoked = grant.revokedDate
                let expires = grant.expirationDate
                if let revoked, revoked <= instant, revoked <= (expires ?? .max) {
                    explanation.reason = "revoked at \(date(revoked)) (rule 4)"
                } else if let expires, expires <= instant {
                    explanation.reason = "expired at \(date(expires)) (rule 4)"
                } else if let revoked, revoked < (expires ?? .max) {
                    explanation.reason = "granted; revoked from \(date(revoked)) (rule 4)"
                } else {
                    explanation.reason = expires.map { "granted until \(date($0)) (rule 4)" } ?? "granted for life (rule 4)"
                }
            } else {
                explanation.reason = "not started: granted from \(grant.grantedDate.map(date) ?? "no date") (rule 4)"
            }
            byEntitlement[entitlementId, default: []].append(Considered(explanation: explanation, candidate: candidate))
        }

        var entitlements: [EntitlementExplanation] = []
        for entitlementId in wanted.sorted() {
            var considered = byEntitlement[entitlementId] ?? []
            // The winner first, then rule 6's order; those not counted last.
            considered.sort { lhs, rhs in
                switch (lhs.candidate, rhs.candidate) {
                case (let l?, let r?): return l.beats(r)
                case (.some, nil): return true
                case (nil, .some): return false
                case (nil, nil): return (lhs.explanation.id ?? "") < (rhs.explanation.id ?? "")
                }
            }
            var decision: String
            if let winner = considered.first?.candidate {
                considered[0].explanation.won = true
                decision = "won by rule 6: "
                if let runnerUp = considered.dropFirst().first?.candidate {
                    decision += Self.step(winner, over: runnerUp, date: date)
                } else {
                    decision += "the only counted candidate"
                }
                decision += winner.isActive ? "; active" : "; no candidate is active, so the entitlement shows as inactive (rule 7)"
            } else {
                decision = considered.isEmpty
                    ? "nothing the customer has unlocks \(entitlementId): not in the answer (rule 7)"
                    : "no candidate counts at this instant: not in the answer (rule 7)"
            }
            entitlements.append(EntitlementExplanation(entitlementId: entitlementId, candidates: considered.map(\.explanation), decision: decision))
        }
        return Explanation(
            entitlements: entitlements, validUntilFrom: resolution.validUntil.map { Self.source(of: $0, in: customer, answer: resolution, environment: environment) }
        )
    }

    /// Rules 2 and 3 in words, for a counted chain.
    private static func reason(_ chain: Chain, at instant: Int64, date: (Int64) -> String) -> String {
        let current = chain.current
        let which = "current transaction \(current.transactionId ?? "?")"
        if chain.isRevoked, let revoked = current.revocationDate {
            return "\(which) revoked at \(date(revoked)) (rule 2)"
        }
        guard let expiration = current.expirationDate else {
            return "\(which) never expires (rule 3)"
        }
        if instant < expiration {
            return "\(which) runs until \(date(expiration)) (rule 3)"
        }
        if let grace = chain.state?.gracePeriodExpirationDate {
            return instant < grace
                ? "\(which) expired at \(date(expiration)); in grace until \(date(grace)) (rule 3)"
                : "\(which) expired at \(date(expiration)); grace ended at \(date(grace)) (rule 3)"
        }
        return "\(which) expired at \(date(expiration)) (rule 3)"
    }

    /// The step of rule 6 that puts `winner` before `other`.
    private static func step(_ winner: Candidate, over other: Candidate, date: (Int64) -> String) -> String {
        if winner.isActive != other.isActive {
            return "active beats inactive"
        }
        if winner.end != other.end {
            return "the later end (\(winner.end.map(date) ?? "never") over \(other.end.map(date) ?? "never"))"
        }
        if winner.latestDate != other.latestDate {
            return "the later latest transaction or grant (\(date(winner.latestDate)) over \(date(other.latestDate)))"
        }
        return "the smaller id (\(winner.tieBreakId) before \(other.tieBreakId))"
    }

    /// The input date `validUntil` is, in words: preferably one of the answer's own (the
    /// winners' dates change it), else the first input date equal to it.
    private static func source(of validUntil: Int64, in customer: CustomerRecord, answer: Resolution, environment: Environment) -> String {
        for entitlement in answer.entitlements {
            let current = entitlement.transactions.last.map { "\(Self.name($0.store)) transaction \($0.transactionId ?? "?")" }
            if let current, entitlement.expirationDate == validUntil { return "expirationDate of \(current)" }
            if let current, entitlement.transactions.last?.revocationDate == validUntil { return "revocationDate of \(current)" }
            let chain = entitlement.transactions.last.map { "the state of \(Self.name($0.store)) chain \($0.originalTransactionId ?? "?")" }
            if let chain, entitlement.gracePeriodExpirationDate == validUntil { return "gracePeriodExpirationDate of \(chain)" }
            if let chain, entitlement.billingIssueDetectedDate == validUntil { return "billingIssueDetectedDate of \(chain)" }
        }
        for transaction in customer.transactions where transaction.effectiveEnvironment == environment {
            let which = "\(Self.name(transaction.store)) transaction \(transaction.transactionId ?? "?")"
            if transaction.transactionDate == validUntil { return "transactionDate of \(which)" }
            if transaction.expirationDate == validUntil { return "expirationDate of \(which)" }
            if transaction.revocationDate == validUntil { return "revocationDate of \(which)" }
        }
        for state in customer.subscriptions {
            let which = "the state of \(Self.name(state.store)) chain \(state.originalTransactionId ?? "?")"
            if state.gracePeriodExpirationDate == validUntil { return "gracePeriodExpirationDate of \(which)" }
            if state.billingIssueDetectedDate == validUntil { return "billingIssueDetectedDate of \(which)" }
        }
        for grant in customer.grants {
            let which = "grant \(grant.grantId ?? "?")"
            if grant.grantedDate == validUntil { return "grantedDate of \(which)" }
            if grant.expirationDate == validUntil { return "expirationDate of \(which)" }
            if grant.revokedDate == validUntil { return "revokedDate of \(which)" }
        }
        return "an input date (rule 12)"
    }

    private static func name(_ source: Source) -> String {
        switch source {
        case .appstore: "appstore"
        case .playstore: "playstore"
        case .stripe: "stripe"
        case .manual: "manual"
        default: "unknown"
        }
    }

    private static func name(_ environment: Environment) -> String {
        environment == .sandbox ? "sandbox" : "production"
    }
}
