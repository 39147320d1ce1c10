import EntitlementsFormats
public import EntitlementsMessages
public import EntitlementsResolver
public import EntitlementsStore
import Logging
import NIOCore
import PostgresNIO

/// The write path of fleet mode (docs/fleet.md, "Writes"): each write is one PostgreSQL
/// transaction that reads and locks the customers it touches, computes their new records
/// with the same rules as an embedded server (``CustomerMutation``), updates the domain
/// tables, takes the next sequence number from `change_head` and appends the write's
/// effect to `change_log`. It is acknowledged after COMMIT.
public final class FleetWriter: WriteUpstream {
    /// The NOTIFY channel: a hint that the change log grew (the payload is the sequence).
    public static let notifyChannel = "entitlements_changes"

    private let database: FleetDatabase
    private let catalog: ProductCatalog
    /// Runs after each commit with its sequence (the server's tailer polls at once).
    private let committed: @Sendable (UInt64) -> Void

    /// Transactions lost to a concurrent writer (deadlock, a customer created twice at
    /// once, an alias that moved) are run again, this many times at most.
    static let maximumAttempts = 8

    public init(database: FleetDatabase, catalog: ProductCatalog, committed: @escaping @Sendable (UInt64) -> Void = { _ in }) {
        self.database = database
        self.catalog = catalog
        self.committed = committed
    }

    /// A lookup the rules asked for that this transaction has not read yet.
    private struct NeedsLookup: Error {
        var userId: String
    }

    /// The customer an alias named moved while this transaction waited for its lock.
    private struct AliasMoved: Error {}

    public func write(_ mutation: LogRecord.Mutation, now: Int64) async throws -> CustomerStore.UpstreamWrite {
        var attempt = 1
        while true {
            do {
                let written = try await self.attempt(mutation, now: now)
                if written.changed {
                    self.committed(written.sequence)
                }
                return written
            } catch let refusal as WriteRefusal {
                throw refusal
            } catch let error as ProtobufError {
                // A value the wire format cannot carry (only in-process callers can send one:
                // the framed protocol refuses it when it decodes the request).
                throw WriteRefusal(.invalidArgument, "\(error)")
            } catch {
                let state = FleetError.sqlState(error)
                // 40P01 deadlock, 40001 serialization failure, 23505 a concurrent insert of
                // the same key, 23503 a customer deleted under an alias being linked.
                let lostRace = error is AliasMoved || ["40P01", "40001", "23505", "23503"].contains(state ?? "")
                if lostRace, attempt < Self.maximumAttempts {
                    attempt += 1
                    continue
                }
                if let state, state.hasPrefix("22") {
                    // A data exception: a value PostgreSQL cannot store (e.g. a NUL byte in an id).
                    throw WriteRefusal(.invalidArgument, "a value of this write cannot be stored: \(FleetError.describe(error))")
                }
                throw WriteRefusal(.unavailable, Self.unavailable(error))
            }
        }
    }

    static func unavailable(_ error: any Error) -> String {
        if error is CommitOutcomeUnknown {
            return "PostgreSQL failed during COMMIT, so the write may or may not be stored; retry it (a retry with the same ids is idempotent): \(FleetError.describe(error))"
        }
        return "the write was not stored (PostgreSQL: \(FleetError.describe(error)))"
    }

    private func attempt(_ mutation: LogRecord.Mutation, now: Int64) async throws -> CustomerStore.UpstreamWrite {
        let logger = self.database.logger
        let catalog = self.catalog
        return try await self.database.withTransaction { connection in
            var known: [String: CustomerRecord?] = [:]
            var lastSequence: [String: Int64] = [:]
            let effect: WriteEffect
            while true {
                do {
                    let snapshot = known
                    effect = try CustomerMutation(catalog: catalog) { userId in
                        guard let record = snapshot[userId] else {
                            throw NeedsLookup(userId: userId)
                        }
                        return record
                    }.effect(of: mutation, now: now)
                    break
                } catch let need as NeedsLookup {
                    let (record, sequence) = try await Self.lockedCustomer(need.userId, on: connection, logger: logger)
                    known[need.userId] = .some(record)
                    if let id = record?.id {
                        lastSequence[id] = sequence
                    }
                }
            }
            let existing = Set(known.values.compactMap { $0?.id })
            guard effect.changed else {
                return CustomerStore.UpstreamWrite(
                    customerId: effect.customerId,
                    sequence: UInt64(max(0, lastSequence[effect.customerId] ?? 0)),
                    changed: false,
                    created: false
                )
            }
            try await Self.store(effect, existing: existing, on: connection, logger: logger)
            let sequence = try await Self.append(effect, on: connection, logger: logger)
            return CustomerStore.UpstreamWrite(customerId: effect.customerId, sequence: sequence, changed: true, created: effect.created)
        }
    }

    /// The record `userId` (a customer id or an alias) names, with its row locked until the
    /// transaction ends, and the sequence of its last change.
    ///
    /// The id itself is locked first (a transaction-scoped advisory lock on its hash),
    /// whether or not anything has it yet: two writes that would each create customer X,
    /// or link alias X, or one of each, run one after the other, and the second sees what
    /// the first committed. Two writes that lock the same ids in another order deadlock,
    /// which PostgreSQL detects; the loser is run again.
    static func lockedCustomer(_ userId: String, on connection: PostgresConnection, logger: Logger) async throws -> (CustomerRecord?, Int64) {
        try await connection.query("SELECT pg_advisory_xact_lock(hashtextextended(\(userId), 0))", logger: logger)
        let rows = try await connection.query(
            """
            SELECT c.record, c.last_seq FROM customers c
            WHERE c.customer_id = \(userId)
               OR c.customer_id = (SELECT a.customer_id FROM aliases a WHERE a.alias = \(userId))
            ORDER BY c.customer_id = \(userId) DESC
            LIMIT 1
            FOR UPDATE OF c
            """,
            logger: logger
        )
        for try await (bytes, sequence) in rows.decode((ByteBuffer, Int64).self) {
            let record = try CustomerRecord(buffer: bytes)
            // Locked after the alias was read: if the alias moved meanwhile, start again.
            if record.id != userId, !record.aliases.contains(userId) {
                throw AliasMoved()
            }
            return (record, sequence)
        }
        return (nil, 0)
    }

    /// Writes the effect's customers and aliases to the domain tables. A customer that was
    /// not in `existing` when read is inserted without ON CONFLICT: had another transaction
    /// created it meanwhile, the insert fails (23505) and the write is run again.
    static func store(_ effect: WriteEffect, existing: Set<String>, on connection: PostgresConnection, logger: Logger) async throws {
        for (customerId, record) in effect.records.sorted(by: { $0.key < $1.key }) {
            guard let record else {
                // Its aliases and rows go with it (ON DELETE CASCADE).
                try await connection.query("DELETE FROM customers WHERE customer_id = \(customerId)", logger: logger)
                continue
            }
            try await Self.upsert(record, isNew: !existing.contains(customerId), on: connection, logger: logger)
        }
        let moved = effect.aliases.sorted { $0.key < $1.key }
        let removed = moved.filter { $0.value == nil }.map(\.key)
        if !removed.isEmpty {
            try await connection.query("DELETE FROM aliases WHERE alias = ANY(\(removed))", logger: logger)
        }
        let linked = moved.compactMap { alias, owner in owner.map { (alias, $0) } }
        if !linked.isEmpty {
            try await connection.query(
                """
                INSERT INTO aliases (alias, customer_id)
                SELECT * FROM unnest(\(linked.map(\.0))::text[], \(linked.map(\.1))::text[])
                ON CONFLICT (alias) DO UPDATE SET customer_id = EXCLUDED.customer_id
                """,
                logger: logger
            )
        }
    }

    /// A customer's row and its rows in the tables people query (transactions, subscription
    /// states, grants), replaced as a whole.
    static func upsert(_ record: CustomerRecord, isNew: Bool, on connection: PostgresConnection, logger: Logger) async throws {
        guard let customerId = record.id else { return }
        var bytes = ByteBuffer()
        try record.serialize(into: &bytes)
        if isNew {
            try await connection.query("INSERT INTO customers (customer_id, record, last_seq) VALUES (\(customerId), \(bytes), 0)", logger: logger)
        } else {
            try await connection.query("UPDATE customers SET record = \(bytes) WHERE customer_id = \(customerId)", logger: logger)
        }
        try await connection.query(
            """
            WITH t AS (DELETE FROM transactions WHERE customer_id = \(customerId)),
                 s AS (DELETE FROM subscription_states WHERE customer_id = \(customerId))
            DELETE FROM grants WHERE customer_id = \(customerId)
            """,
            logger: logger
        )
        let rows = DomainRows(record)
        guard !rows.isEmpty else { return }
        try await connection.query(
            """
            WITH t AS (
                INSERT INTO transactions (customer_id, store, transaction_id, original_transaction_id, product_id,
                    type, environment, transaction_date, expiration_date, revocation_date)
                SELECT \(customerId), j.store, j.transaction_id, j.original_transaction_id, j.product_id,
                    j.type, j.environment, j.transaction_date, j.expiration_date, j.revocation_date
                FROM jsonb_to_recordset(\(rows.transactions)::jsonb) AS j(store smallint, transaction_id text,
                    original_transaction_id text, product_id text, type smallint, environment smallint,
                    transaction_date bigint, expiration_date bigint, revocation_date bigint)
                ON CONFLICT DO NOTHING
            ), s AS (
                INSERT INTO subscription_states (customer_id, store, original_transaction_id, auto_renew_enabled,
                    billing_issue_detected_date, grace_period_expiration_date, is_in_billing_retry)
                SELECT \(customerId), j.store, j.original_transaction_id, j.auto_renew_enabled,
                    j.billing_issue_detected_date, j.grace_period_expiration_date, j.is_in_billing_retry
                FROM jsonb_to_recordset(\(rows.subscriptionStates)::jsonb) AS j(store smallint,
                    original_transaction_id text, auto_renew_enabled boolean, billing_issue_detected_date bigint,
                    grace_period_expiration_date bigint, is_in_billing_retry boolean)
                ON CONFLICT DO NOTHING
            )
            INSERT INTO grants (customer_id, grant_id, entitlement_id, granted_date, expiration_date, revoked_date)
            SELECT \(customerId), j.grant_id, j.entitlement_id, j.granted_date, j.expiration_date, j.revoked_date
            FROM jsonb_to_recordset(\(rows.grants)::jsonb) AS j(grant_id text, entitlement_id text,
                granted_date bigint, expiration_date bigint, revoked_date bigint)
            ON CONFLICT DO NOTHING
            """,
            logger: logger
        )
    }

    /// Takes the next sequence number and appends the effect to the change log, in one
    /// statement: the `change_head` row lock it takes is held until COMMIT, so sequence
    /// numbers commit in order with no gaps. NOTIFY is delivered at COMMIT.
    static func append(_ effect: WriteEffect, on connection: PostgresConnection, logger: Logger) async throws -> UInt64 {
        var bytes = ByteBuffer()
        try effect.replicated.serialize(into: &bytes)
        let touched = effect.records.compactMap { id, record in record == nil ? nil : id }
        let rows = try await connection.query(
            """
            WITH head AS (UPDATE change_head SET seq = seq + 1 RETURNING seq),
                 logged AS (
                     INSERT INTO change_log (seq, customer_id, record)
                     SELECT seq, \(effect.customerId), \(bytes) FROM head
                     RETURNING seq
                 ),
                 touched AS (
                     UPDATE customers SET last_seq = (SELECT seq FROM head) WHERE customer_id = ANY(\(touched))
                 ),
                 notified AS (SELECT pg_notify(\(Self.notifyChannel), seq::text) FROM logged)
            SELECT logged.seq FROM logged, notified
            """,
            logger: logger
        )
        for try await sequence in rows.decode(Int64.self) {
            return UInt64(sequence)
        }
        throw FleetError(.schema, "change_head has no row: run `entitlements db migrate`")
    }
}

/// A customer record as rows of the domain tables, in the JSON `jsonb_to_recordset` reads
/// (one round trip per table, whatever the count); an absent value is null.
struct DomainRows {
    var transactions: String
    var subscriptionStates: String
    var grants: String
    var isEmpty: Bool

    init(_ record: CustomerRecord) {
        func rows(_ objects: [[(String, JSONValue)]]) -> String {
            JSONValue.array(objects.map { .object($0) }).serialized(pretty: false)
        }
        func int(_ value: Int64?) -> JSONValue { value.map { .int($0) } ?? .null }
        self.transactions = rows(record.transactions.map { transaction in
            [
                ("store", .int(Int64(transaction.store.rawValue))),
                ("transaction_id", .string(transaction.transactionId)),
                ("original_transaction_id", .string(transaction.originalTransactionId)),
                ("product_id", .string(transaction.productId)),
                ("type", .int(Int64(transaction.type.rawValue))),
                ("environment", .int(Int64(transaction.environment.rawValue))),
                ("transaction_date", int(transaction.transactionDate)),
                ("expiration_date", int(transaction.expirationDate)),
                ("revocation_date", int(transaction.revocationDate)),
            ]
        })
        self.subscriptionStates = rows(record.subscriptions.map { state in
            [
                ("store", .int(Int64(state.store.rawValue))),
                ("original_transaction_id", .string(state.originalTransactionId)),
                ("auto_renew_enabled", .bool(state.autoRenewEnabled)),
                ("billing_issue_detected_date", int(state.billingIssueDetectedDate)),
                ("grace_period_expiration_date", int(state.gracePeriodExpirationDate)),
                ("is_in_billing_retry", .bool(state.isInBillingRetry)),
            ]
        })
        self.grants = rows(record.grants.map { grant in
            [
                ("grant_id", .string(grant.grantId)),
                ("entitlement_id", .string(grant.entitlementId)),
                ("granted_date", int(grant.grantedDate)),
                ("expiration_date", int(grant.expirationDate)),
                ("revoked_date", int(grant.revokedDate)),
            ]
        })
        self.isEmpty = record.transactions.isEmpty && record.subscriptions.isEmpty && record.grants.isEmpty
    }
}
