import Crypto
import EntitlementsSecurity
public import EntitlementsMessages
public import EntitlementsResolver
public import EntitlementsStore

/// Turns changes into ``OutboundEvent``s: a committed write (each customer it changed), or
/// time passing a customer's `validUntil`. Deterministic: the same change gives the same
/// events with the same ids, whoever derives it and however often.
public struct EventFactory: Sendable {
    let resolver: EntitlementResolver

    public init(catalog: ProductCatalog) {
        self.resolver = EntitlementResolver(catalog: catalog)
    }

    /// The events of `write`, customer by customer (by id), each customer's in the order
    /// of ``EventDerivation``; and each changed customer's next `validUntil` after the
    /// write (nil: the answer never changes by time; a deleted customer has none).
    /// A customer in `instants` is read at that instant rather than at the write's (a time
    /// event already said what its answer was then).
    public func events(of write: CustomerStore.CommittedWrite, at instants: [String: Int64] = [:]) -> (events: [OutboundEvent], nextChange: [String: Int64?]) {
        var events: [OutboundEvent] = []
        var nextChange: [String: Int64?] = [:]
        for (customerId, after) in write.effect.records.sorted(by: { $0.key < $1.key }) {
            let instant = instants[customerId] ?? write.recordedDate
            let before = write.before[customerId] ?? nil
            var derived: [(DerivedEvent, Environment?, [Entitlement], [Entitlement])] = []
            let environments = Self.environments(before, after)
            var answers: [Environment: (before: Resolution, after: Resolution)] = [:]
            for environment in environments {
                answers[environment] = (
                    self.resolver.resolve(before, at: instant, environment: environment),
                    self.resolver.resolve(after, at: instant, environment: environment)
                )
            }
            for event in EventDerivation.recordEvents(before: before, after: after) {
                let environment = Self.environment(of: event, in: after ?? before)
                let pair = answers[environment ?? .production] ?? answers[.production]!
                derived.append((event, environment, pair.before.entitlements, pair.after.entitlements))
            }
            for environment in environments {
                let pair = answers[environment]!
                for event in EventDerivation.entitlementEvents(from: pair.before, to: pair.after, byTime: false) {
                    derived.append((event, environment, pair.before.entitlements, pair.after.entitlements))
                }
            }
            let aliases = (after ?? before)?.aliases.sorted() ?? []
            for (event, environment, entitlementsBefore, entitlementsAfter) in derived {
                events.append(Self.event(
                    event,
                    id: "evt_\(write.sequence)_\(events.count)",
                    customerId: customerId,
                    aliases: event.type == .transfer || event.type == .customerDeleted ? event.aliases : aliases,
                    occurredAt: instant,
                    logSequence: write.sequence,
                    environment: environment,
                    before: entitlementsBefore,
                    after: entitlementsAfter
                ))
            }
            nextChange[customerId] = after == nil ? .some(nil) : environments.compactMap { answers[$0]?.after.validUntil }.min()
        }
        return (events, nextChange)
    }

    /// The events of time reaching `instant` for `record` (its answer's `validUntil`, with
    /// no write since): its answers just before and at `instant` compared. Returns them and
    /// the next instant its answer changes by time.
    public func timeEvents(of record: CustomerRecord, at instant: Int64, logSequence: UInt64) -> (events: [OutboundEvent], next: Int64?) {
        guard let customerId = record.id else {
            return ([], nil)
        }
        var events: [OutboundEvent] = []
        var next: Int64?
        let tag = Self.hash(customerId)
        for environment in Self.environments(record, nil) {
            let old = self.resolver.resolve(record, at: instant - 1, environment: environment)
            let new = self.resolver.resolve(record, at: instant, environment: environment)
            for event in EventDerivation.entitlementEvents(from: old, to: new, byTime: true) {
                events.append(Self.event(
                    event,
                    id: "evt_t\(instant)_\(tag)_\(events.count)",
                    customerId: customerId,
                    aliases: record.aliases.sorted(),
                    occurredAt: instant,
                    logSequence: logSequence,
                    environment: environment,
                    before: old.entitlements,
                    after: new.entitlements
                ))
            }
            if let until = new.validUntil {
                next = min(next ?? until, until)
            }
        }
        return (events, next)
    }

    /// The next instant after `instant` at which `record`'s answer changes by time.
    public func nextChange(of record: CustomerRecord, after instant: Int64) -> Int64? {
        Self.environments(record, nil).compactMap { self.resolver.resolve(record, at: instant, environment: $0).validUntil }.min()
    }

    /// Production always; sandbox too for a customer with a sandbox transaction (its
    /// sandbox answer is then not production's).
    static func environments(_ before: CustomerRecord?, _ after: CustomerRecord?) -> [Environment] {
        let sandbox = [before, after].contains { $0?.transactions.contains { $0.environment == .sandbox } == true }
        return sandbox ? [.production, .sandbox] : [.production]
    }

    /// The environment of a record event: its transaction's, or its chain's for a
    /// subscription state; nil for grants, aliases and deletion.
    static func environment(of event: DerivedEvent, in record: CustomerRecord?) -> Environment? {
        guard let store = event.store, store != .manual, let record else {
            return nil
        }
        let transaction = record.transactions.first { transaction in
            transaction.store == store
                && (event.transactionId.map { transaction.transactionId == $0 } ?? (transaction.originalTransactionId == event.originalTransactionId))
        }
        guard let transaction else {
            return .production
        }
        return transaction.environment == .sandbox ? .sandbox : .production
    }

    static func event(
        _ event: DerivedEvent,
        id: String,
        customerId: String,
        aliases: [String],
        occurredAt: Int64,
        logSequence: UInt64,
        environment: Environment?,
        before: [Entitlement],
        after: [Entitlement]
    ) -> OutboundEvent {
        OutboundEvent(
            id: id,
            type: event.type,
            customerId: customerId,
            aliases: aliases,
            occurredAt: occurredAt,
            logSequence: logSequence,
            environment: environment,
            store: event.store,
            productId: event.productId,
            transactionId: event.transactionId,
            originalTransactionId: event.originalTransactionId,
            grantId: event.grantId,
            entitlementId: event.entitlementId,
            entitlementsBefore: before,
            entitlementsAfter: after
        )
    }

    /// 16 hex digits of the SHA-256 of a customer id: its time events' ids, whatever
    /// characters the id holds.
    static func hash(_ customerId: String) -> String {
        Hex.encode(SHA256.hash(data: Array(customerId.utf8)).prefix(8))
    }
}
