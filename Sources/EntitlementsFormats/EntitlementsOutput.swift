public import EntitlementsMessages

/// The output formats of an answer (docs/data-formats.md, "Output"): JSON for programs,
/// a table for people. `entitlements resolve` and `entitlements check` print these.
public enum EntitlementsOutput {
    /// The JSON document `{"requestDate": ..., "validUntil": ..., "entitlements": {...}}`,
    /// every Entitlement field named as in the schema (camelCase), dates as RFC 3339 UTC
    /// with milliseconds, absent values as null.
    /// A stale answer (a fleet server past its --max-staleness) has `"staleForMs": N` last;
    /// any other has no such key.
    public static func json(_ response: CheckEntitlementsResponse, pretty: Bool = true) -> String {
        Self.checkValue(response).serialized(pretty: pretty)
    }

    static func checkValue(_ response: CheckEntitlementsResponse) -> JSONValue {
        var fields: [(String, JSONValue)] = [
            ("requestDate", .date(response.requestDate)),
            ("validUntil", .date(response.validUntil)),
            ("entitlements", Self.entitlementsValue(response.entitlements)),
        ]
        if response.staleForMs != 0 {
            fields.append(("staleForMs", .int(Int64(clamping: response.staleForMs))))
        }
        if let explanation = response.explanation {
            fields.append(("explanation", Self.json(explanation)))
        }
        return JSONValue.object(fields)
    }

    /// The `entitlements` object of `check --json`: each entitlement by its id.
    public static func entitlementsValue(_ entitlements: [Entitlement]) -> JSONValue {
        .object(entitlements.map { ($0.id ?? "", Self.json($0)) })
    }

    /// An explained check's `explanation` (CheckEntitlementsRequest.explain).
    static func json(_ explanation: Explanation) -> JSONValue {
        .object([
            ("entitlements", .array(explanation.entitlements.map { entitlement in
                .object([
                    ("entitlementId", .string(entitlement.entitlementId)),
                    ("decision", .string(entitlement.decision)),
                    ("candidates", .array(entitlement.candidates.map { candidate in
                        .object([
                            ("kind", .string(candidate.kind)),
                            ("source", .name(candidate.source)),
                            ("id", .string(candidate.id)),
                            ("productId", .string(candidate.productId)),
                            ("counted", .bool(candidate.counted)),
                            ("isActive", .bool(candidate.isActive)),
                            ("won", .bool(candidate.won)),
                            ("reason", .string(candidate.reason)),
                            ("end", .date(candidate.end)),
                        ])
                    })),
                ])
            })),
            ("validUntilFrom", .string(explanation.validUntilFrom)),
            ("logSequence", explanation.logSequence > 0 ? .int(Int64(clamping: explanation.logSequence)) : .null),
            ("snapshotId", .string(explanation.snapshotId)),
        ])
    }

    /// An explanation as a tree for people (`check --explain`).
    public static func tree(_ explanation: Explanation) -> String {
        var lines: [String] = []
        for entitlement in explanation.entitlements {
            lines.append("\(entitlement.entitlementId ?? "?"): \(entitlement.decision ?? "")")
            for (index, candidate) in entitlement.candidates.enumerated() {
                let branch = index == entitlement.candidates.count - 1 ? "└─" : "├─"
                let mark = candidate.won ? "WON " : candidate.counted ? (candidate.isActive ? "active " : "inactive ") : "not counted "
                let what = "\(candidate.kind ?? "?") \(candidate.source.jsonName ?? "unknown") \(candidate.id ?? "?")" + (candidate.productId.map { " (\($0))" } ?? "")
                lines.append("  \(branch) \(mark)\(what): \(candidate.reason ?? "")")
            }
        }
        if let from = explanation.validUntilFrom {
            lines.append("validUntil: \(from)")
        }
        lines.append("read at log sequence \(explanation.logSequence), snapshot \(explanation.snapshotId ?? "-")")
        return lines.joined(separator: "\n")
    }


    static func json(_ entitlement: Entitlement) -> JSONValue {
        .object([
            ("id", .string(entitlement.id)),
            ("isActive", .bool(entitlement.isActive)),
            ("source", .name(entitlement.source)),
            ("startedDate", .date(entitlement.startedDate)),
            ("trialStartDate", .date(entitlement.trialStartDate)),
            ("firstPurchaseDate", .date(entitlement.firstPurchaseDate)),
            ("lastPurchaseDate", .date(entitlement.lastPurchaseDate)),
            ("autoRenewDisableDate", .date(entitlement.autoRenewDisableDate)),
            ("expirationDate", .date(entitlement.expirationDate)),
            ("productId", .string(entitlement.productId)),
            ("renewState", .name(entitlement.renewState)),
            ("renewsCount", .int(Int64(entitlement.renewsCount))),
            ("grantType", .name(entitlement.grantType)),
            ("lastActivatedOfferCode", .string(entitlement.lastActivatedOfferCode)),
            ("transactions", .array(entitlement.transactions.map(Self.json))),
            ("willRenew", .bool(entitlement.willRenew)),
            ("isInGracePeriod", .bool(entitlement.isInGracePeriod)),
            ("isInBillingRetry", .bool(entitlement.isInBillingRetry)),
            ("isRevoked", .bool(entitlement.isRevoked)),
            ("ownershipType", .name(entitlement.ownershipType)),
            ("periodType", .name(entitlement.periodType)),
            ("gracePeriodExpirationDate", .date(entitlement.gracePeriodExpirationDate)),
            ("billingIssueDetectedDate", .date(entitlement.billingIssueDetectedDate)),
            ("cancellationReason", .name(entitlement.cancellationReason)),
            ("priceMicros", entitlement.priceMicros.map { .int($0) } ?? .null),
            ("currency", .string(entitlement.currency)),
            ("priceConsentStatus", .name(entitlement.priceConsentStatus)),
            ("interval", .name(entitlement.interval)),
            ("status", .name(entitlement.status)),
        ])
    }

    static func json(_ transaction: Transaction) -> JSONValue {
        .object([
            ("originalTransactionId", .string(transaction.originalTransactionId)),
            ("transactionId", .string(transaction.transactionId)),
            ("store", .name(transaction.store)),
            ("productId", .string(transaction.productId)),
            ("offerCode", .string(transaction.offerCode)),
            ("transactionDate", .date(transaction.transactionDate)),
            ("expirationDate", .date(transaction.expirationDate)),
            ("revocationDate", .date(transaction.revocationDate)),
            ("environment", .name(transaction.environment)),
            ("ownershipType", .name(transaction.ownershipType)),
            ("type", .name(transaction.type)),
            ("priceMicros", transaction.priceMicros.map { .int($0) } ?? .null),
            ("currency", .string(transaction.currency)),
            ("verified", .bool(transaction.verified == true)),
        ])
    }

    /// A batch's answer as one JSON line: `{"results": [...]}`, one object per user in the
    /// request's order, each the JSON of a single check with the user's `userId` and
    /// `customerId` (null for an unknown user) first.
    public static func json(_ response: BatchCheckEntitlementsResponse) -> String {
        JSONValue.object([
            ("results", .array(response.results.map { result in
                var fields: [(String, JSONValue)] = [("userId", .string(result.userId)), ("customerId", .string(result.customerId))]
                if case .object(let check) = Self.checkValue(result) {
                    fields += check
                }
                return .object(fields)
            })),
        ]).serialized(pretty: false)
    }

    /// Health's answer as one JSON line.
    public static func json(_ response: HealthResponse) -> String {
        JSONValue.object([
            ("status", .name(response.status)),
            ("snapshotId", .string(response.snapshotId)),
            ("uptimeMs", .int(Int64(clamping: response.uptimeMs))),
            ("version", .string(response.version)),
        ]).serialized(pretty: false)
    }

    /// Compact's answer as one JSON line.
    public static func json(_ response: CompactResponse) -> String {
        JSONValue.object([
            ("snapshotId", .string(response.snapshotId)),
            ("lastLogSequence", .int(Int64(clamping: response.lastLogSequence))),
        ]).serialized(pretty: false)
    }

    /// A write's answer as one JSON line.
    public static func json(_ response: WriteResponse) -> String {
        JSONValue.object([
            ("customerId", .string(response.customerId)),
            ("changed", .bool(response.changed)),
            ("created", .bool(response.created)),
            ("logSequence", response.logSequence > 0 ? .int(Int64(response.logSequence)) : .null),
        ]).serialized(pretty: false)
    }

    /// SubmitPurchase's answer as one JSON line: the purchase's write (`changed`,
    /// `logSequence`, `linkedAlias`, `ignored`, `transactions`), the user and customer, the environment of
    /// the answer, and under `entitlements` the answer of a check, as `check --json` prints it.
    public static func json(_ response: SubmitPurchaseResponse) -> String {
        let check = response.entitlements ?? CheckEntitlementsResponse()
        return JSONValue.object([
            ("userId", .string(check.userId)),
            ("customerId", .string(check.customerId)),
            ("changed", .bool(response.changed)),
            ("logSequence", response.logSequence > 0 ? .int(Int64(response.logSequence)) : .null),
            ("linkedAlias", .string(response.linkedAlias)),
            ("environment", .name(response.environment)),
            ("ignored", .string(response.ignored)),
            ("transactions", .int(Int64(response.transactions))),
            ("entitlements", Self.checkValue(check)),
        ]).serialized(pretty: false)
    }

    /// A watch event as one JSON line: customer, cause, what changed, and the new answer.
    /// `aliasesChanged` comes last, only when the write linked, moved or removed an alias.
    public static func json(_ event: EntitlementsChangedEvent) -> String {
        let current = event.current ?? CheckEntitlementsResponse()
        var fields: [(String, JSONValue)] = [
            ("customerId", .string(event.customerId)),
            ("cause", .string(event.cause == .time ? "time" : event.cause == .write ? "write" : nil)),
            ("logSequence", event.logSequence > 0 ? .int(Int64(event.logSequence)) : .null),
            ("changes", .array(event.changes.map(Self.json))),
            ("requestDate", .date(current.requestDate)),
            ("validUntil", .date(current.validUntil)),
            ("entitlements", .object(current.entitlements.map { ($0.id ?? "", Self.json($0)) })),
        ]
        if !event.aliasesChanged.isEmpty {
            fields.append(("aliasesChanged", .array(event.aliasesChanged.map { .string($0) })))
        }
        return JSONValue.object(fields).serialized(pretty: false)
    }

    /// A customer's history (CustomerHistory) as one JSON document: the customer, where the
    /// history starts, and the entries oldest first, each with its date, cause, log
    /// sequence, source, summary, changes and the entitlements after it (as `check --json`
    /// has them).
    public static func json(_ response: CustomerHistoryResponse, pretty: Bool = false) -> String {
        JSONValue.object([
            ("userId", .string(response.userId)),
            ("customerId", .string(response.customerId)),
            ("startsAfterLogSequence", .int(Int64(clamping: response.startsAfterLogSequence))),
            ("startsDate", .date(response.startsDate)),
            ("logSequence", .int(Int64(clamping: response.logSequence))),
            ("truncated", .bool(response.truncated)),
            ("entries", .array(response.entries.map { entry in
                .object([
                    ("date", .date(entry.date)),
                    ("cause", .string(entry.cause == .time ? "time" : entry.cause == .write ? "write" : "start")),
                    ("logSequence", entry.logSequence > 0 ? .int(Int64(clamping: entry.logSequence)) : .null),
                    ("source", entry.source.map { source in
                        .object([("method", .string(source.method)), ("caller", .string(source.caller)), ("eventId", .string(source.eventId))])
                    } ?? .null),
                    ("summary", .string(entry.summary)),
                    ("changes", .array(entry.changes.map(Self.json))),
                    ("entitlements", .object(entry.entitlements.map { ($0.id ?? "", Self.json($0)) })),
                    ("deleted", .bool(entry.deleted)),
                ])
            })),
        ]).serialized(pretty: pretty)
    }

    static func json(_ change: EntitlementChange) -> JSONValue {
        func state(_ state: EntitlementState?) -> JSONValue {
            guard let state else { return .null }
            return .object([("isActive", .bool(state.isActive)), ("renewState", .name(state.renewState))])
        }
        return .object([("entitlementId", .string(change.entitlementId)), ("before", state(change.before)), ("after", state(change.after))])
    }

    /// A customer's history for people: one line per entry, oldest first, with what was
    /// active after it.
    public static func timeline(_ response: CustomerHistoryResponse) -> String {
        var lines: [String] = []
        let user = response.userId ?? "?"
        guard let customer = response.customerId else {
            return "\(user): no write ever named this user (the history starts after log sequence \(response.startsAfterLogSequence))"
        }
        lines.append("\(user)\(customer == user ? "" : " (customer \(customer))"): history up to log sequence \(response.logSequence)")
        if response.startsAfterLogSequence > 0 {
            lines.append("starts from the state kept at log sequence \(response.startsAfterLogSequence) (\(response.startsDate.map(RFC3339.format) ?? "?")); earlier writes are folded into it")
        }
        if response.truncated {
            lines.append("(older entries left out: raise --limit)")
        }
        for entry in response.entries {
            let when = entry.date.map(RFC3339.format) ?? "?"
            let cause: String
            switch entry.cause {
            case .write:
                let source = entry.source.map { source in
                    " " + [source.method, source.caller.map { "by " + $0 }, source.eventId.map { "event " + $0 }].compactMap { $0 }.joined(separator: " ")
                } ?? ""
                cause = "write \(entry.logSequence)\(source)"
            case .time: cause = "time"
            default: cause = "start"
            }
            lines.append("\(when) [\(cause)] \(entry.summary ?? "")")
            let active = entry.entitlements.filter(\.isActive).map { $0.id ?? "?" }
            let changes = entry.changes.map { change in
                "\(change.entitlementId ?? "?") \(change.before?.isActive == true ? "active" : "inactive") -> \(change.after?.isActive == true ? "active" : "inactive")"
            }
            lines.append("    " + (changes.isEmpty ? "" : changes.joined(separator: ", ") + "; ") + (entry.deleted ? "customer deleted" : "active: " + (active.isEmpty ? "none" : active.joined(separator: ", "))))
        }
        return lines.joined(separator: "\n")
    }

    /// A watch event as one line for people.
    public static func line(_ event: EntitlementsChangedEvent) -> String {
        func state(_ state: EntitlementState?) -> String {
            guard let state else { return "absent" }
            return (state.isActive ? "active" : "inactive") + (state.renewState.jsonName.map { " (\($0))" } ?? "")
        }
        let when = event.current?.requestDate.map(RFC3339.format) ?? "?"
        let cause = event.cause == .time ? "time" : "write \(event.logSequence)"
        var changes = event.changes.isEmpty
            ? (event.aliasesChanged.isEmpty ? "answer changed (dates only)" : "")
            : event.changes.map { "\($0.entitlementId ?? "?"): \(state($0.before)) -> \(state($0.after))" }.joined(separator: "; ")
        if !event.aliasesChanged.isEmpty {
            changes += (changes.isEmpty ? "" : "; ") + "aliases changed: " + event.aliasesChanged.joined(separator: ", ")
        }
        return "\(when) \(event.customerId ?? "?") [\(cause)] \(changes)"
    }

    /// The STATUS cell: the status, with the cancellation reason and a price consent when
    /// known (`canceled (customer)`, `active (price notified)`); `-` when unknown.
    static func status(_ entitlement: Entitlement) -> String {
        let notes = [entitlement.cancellationReason.jsonName, entitlement.priceConsentStatus.jsonName.map { "price " + $0 }].compactMap { $0 }
        let status = entitlement.status.jsonName ?? (notes.isEmpty ? "-" : "")
        return notes.isEmpty ? status : status + (status.isEmpty ? "" : " ") + "(" + notes.joined(separator: ", ") + ")"
    }

    /// The PRICE cell: `9.99 USD/monthly`; `-` when unknown.
    static func price(_ entitlement: Entitlement) -> String {
        guard let micros = entitlement.priceMicros else {
            return "-"
        }
        let sign = micros < 0 ? "-" : ""
        let magnitude = micros.magnitude
        var fraction = String(magnitude % 1_000_000)
        fraction = String(repeating: "0", count: 6 - fraction.count) + fraction
        while fraction.count > 2, fraction.hasSuffix("0") {
            fraction.removeLast()
        }
        let amount = "\(sign)\(magnitude / 1_000_000).\(fraction)"
        return amount + (entitlement.currency.map { " " + $0 } ?? "") + (entitlement.interval.jsonName.map { "/" + $0 } ?? "")
    }

    /// A table for people: one row per entitlement, then when the answer can change.
    public static func table(_ response: CheckEntitlementsResponse) -> String {
        var lines: [String] = []
        let user = response.userId ?? "?"
        let customer = response.customerId.map { $0 == user ? "" : " (customer \($0))" } ?? " (unknown user)"
        lines.append("\(user)\(customer) at \(response.requestDate.map(RFC3339.format) ?? "?")")
        if response.entitlements.isEmpty {
            lines.append("no entitlements")
        } else {
            var rows = [["ENTITLEMENT", "ACTIVE", "SOURCE", "PRODUCT", "EXPIRES", "RENEW STATE", "STATUS", "PRICE"]]
            for entitlement in response.entitlements {
                var active = entitlement.isActive ? "yes" : "no"
                if entitlement.isInGracePeriod { active += " (grace)" }
                if entitlement.isRevoked { active += " (revoked)" }
                rows.append([
                    entitlement.id ?? "",
                    active,
                    entitlement.source.jsonName ?? "-",
                    entitlement.productId ?? "-",
                    entitlement.expirationDate.map(RFC3339.format) ?? "never",
                    entitlement.renewState.jsonName ?? "-",
                    Self.status(entitlement),
                    Self.price(entitlement),
                ])
            }
            let widths = rows[0].indices.map { column in rows.map { $0[column].count }.max() ?? 0 }
            for row in rows {
                let cells = row.enumerated().map { index, cell in
                    index == row.count - 1 ? cell : cell + String(repeating: " ", count: widths[index] - cell.count)
                }
                lines.append(cells.joined(separator: "  "))
            }
        }
        lines.append("valid until \(response.validUntil.map(RFC3339.format) ?? "further notice (no pending change)")")
        if response.staleForMs != 0 {
            lines.append("STALE: the server last heard from PostgreSQL \(response.staleForMs / 1000) s ago, more than its --max-staleness; writes made elsewhere since may be missing")
        }
        return lines.joined(separator: "\n")
    }
}
