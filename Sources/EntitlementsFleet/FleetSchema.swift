import Logging
import PostgresNIO

/// The PostgreSQL schema of fleet mode, as numbered migrations (docs/fleet.md, "Schema").
///
/// `entitlements db migrate` applies the missing ones in one transaction under an advisory
/// lock, so many pods may run it at once: the first applies, the others wait and find
/// nothing to do. A database whose schema is newer than this binary's is refused, not
/// touched.
public enum FleetSchema {
    /// The newest schema version this binary knows.
    public static var currentVersion: Int { Self.migrations.count }

    /// The key of the advisory lock migrations hold (an arbitrary constant: "ENTL").
    static let migrationLock: Int64 = 0x454E_544C

    /// Each migration: its statements, run in order in one transaction. Never edit one
    /// that has shipped; add the next.
    static let migrations: [[String]] = [
        // 1: the domain tables, the catalog, and the change log with its head row.
        [
            """
            CREATE TABLE catalog (
                id boolean PRIMARY KEY DEFAULT true CHECK (id),
                catalog bytea NOT NULL
            )
            """,
            // The customer's full record (storage.proto CustomerRecord) is what writes are
            // computed against; the tables after it are the same data in columns, kept in
            // the same transaction, for people and reports to query.
            """
            CREATE TABLE customers (
                customer_id text PRIMARY KEY,
                record bytea NOT NULL,
                last_seq bigint NOT NULL
            )
            """,
            """
            CREATE TABLE aliases (
                alias text PRIMARY KEY,
                customer_id text NOT NULL REFERENCES customers ON DELETE CASCADE
            )
            """,
            "CREATE INDEX aliases_customer ON aliases (customer_id)",
            """
            CREATE TABLE transactions (
                customer_id text NOT NULL REFERENCES customers ON DELETE CASCADE,
                store smallint NOT NULL,
                transaction_id text NOT NULL,
                original_transaction_id text,
                product_id text,
                type smallint,
                environment smallint,
                transaction_date bigint,
                expiration_date bigint,
                revocation_date bigint,
                PRIMARY KEY (customer_id, store, transaction_id)
            )
            """,
            """
            CREATE TABLE subscription_states (
                customer_id text NOT NULL REFERENCES customers ON DELETE CASCADE,
                store smallint NOT NULL,
                original_transaction_id text NOT NULL,
                auto_renew_enabled boolean NOT NULL,
                billing_issue_detected_date bigint,
                grace_period_expiration_date bigint,
                is_in_billing_retry boolean NOT NULL,
                PRIMARY KEY (customer_id, store, original_transaction_id)
            )
            """,
            """
            CREATE TABLE grants (
                customer_id text NOT NULL REFERENCES customers ON DELETE CASCADE,
                grant_id text NOT NULL,
                entitlement_id text,
                granted_date bigint,
                expiration_date bigint,
                revoked_date bigint,
                PRIMARY KEY (customer_id, grant_id)
            )
            """,
            // One row. seq is taken with UPDATE ... RETURNING: the row lock is held to
            // COMMIT, so sequence numbers become visible in order with no gaps. epoch names
            // this history of sequence numbers (a restore that reuses them gets a new one).
            """
            CREATE TABLE change_head (
                id boolean PRIMARY KEY DEFAULT true CHECK (id),
                epoch uuid NOT NULL,
                seq bigint NOT NULL
            )
            """,
            "INSERT INTO change_head (epoch, seq) VALUES (gen_random_uuid(), 0)",
            // Append-only: one row per write, its effect (storage.proto ReplicatedWrite).
            """
            CREATE TABLE change_log (
                seq bigint PRIMARY KEY,
                customer_id text NOT NULL,
                record bytea NOT NULL,
                committed_at timestamptz NOT NULL DEFAULT now()
            )
            """,
        ],
        // 2: a write in fewer round trips (FleetWriter). Locking a customer and reading it
        // are one call; the read must take its snapshot after the lock is granted, which a
        // VOLATILE PL/pgSQL function does (each of its statements takes a fresh snapshot
        // under READ COMMITTED), and a single SQL statement does not.
        [
            """
            CREATE FUNCTION entitlements_lock_customer(lookup_id text)
            RETURNS TABLE (customer_record bytea, customer_last_seq bigint)
            LANGUAGE plpgsql VOLATILE AS $$
            BEGIN
                PERFORM pg_advisory_xact_lock(hashtextextended(lookup_id, 0));
                RETURN QUERY
                    SELECT c.record, c.last_seq FROM customers c
                    WHERE c.customer_id = lookup_id
                       OR c.customer_id = (SELECT a.customer_id FROM aliases a WHERE a.alias = lookup_id)
                    ORDER BY c.customer_id = lookup_id DESC
                    LIMIT 1
                    FOR UPDATE OF c;
            END
            $$
            """,
            // The changes of a group of writes, in order, in one call. kinds: 1 insert a
            // customer (without ON CONFLICT: one created meanwhile by another transaction
            // fails the group with 23505, and the writer runs it again), 2 update one, 3
            // delete one (its aliases and rows go with it), 4 remove an alias, 5 link an
            // alias to p_owners[i]. For an inserted or updated customer, each domain table's
            // value says what changes (FleetWriter's DomainRows): JSON null nothing,
            // {"replace": rows} every row, {"upsert": rows, "remove": keys} only those.
            """
            CREATE FUNCTION entitlements_apply_changes(
                p_kinds smallint[], p_ids text[], p_records bytea[], p_owners text[],
                p_transactions jsonb[], p_subscription_states jsonb[], p_grants jsonb[]
            ) RETURNS void
            LANGUAGE plpgsql VOLATILE AS $$
            BEGIN
                FOR i IN 1 .. coalesce(array_length(p_kinds, 1), 0) LOOP
                    CASE p_kinds[i]
                    WHEN 1 THEN
                        INSERT INTO customers (customer_id, record, last_seq) VALUES (p_ids[i], p_records[i], 0);
                    WHEN 2 THEN
                        UPDATE customers SET record = p_records[i] WHERE customer_id = p_ids[i];
                    WHEN 3 THEN
                        DELETE FROM customers WHERE customer_id = p_ids[i];
                    WHEN 4 THEN
                        DELETE FROM aliases WHERE alias = p_ids[i];
                    WHEN 5 THEN
                        INSERT INTO aliases (alias, customer_id) VALUES (p_ids[i], p_owners[i])
                        ON CONFLICT (alias) DO UPDATE SET customer_id = EXCLUDED.customer_id;
                    END CASE;
                    CONTINUE WHEN p_kinds[i] NOT IN (1, 2);
                    IF p_transactions[i] <> 'null' THEN
                        IF p_transactions[i] ? 'replace' THEN
                            DELETE FROM transactions WHERE customer_id = p_ids[i];
                        ELSE
                            DELETE FROM transactions t
                            USING jsonb_to_recordset(p_transactions[i] -> 'remove') AS k(store smallint, transaction_id text)
                            WHERE t.customer_id = p_ids[i] AND t.store = k.store AND t.transaction_id = k.transaction_id;
                        END IF;
                        INSERT INTO transactions (customer_id, store, transaction_id, original_transaction_id, product_id,
                            type, environment, transaction_date, expiration_date, revocation_date)
                        SELECT p_ids[i], j.store, j.transaction_id, j.original_transaction_id, j.product_id,
                            j.type, j.environment, j.transaction_date, j.expiration_date, j.revocation_date
                        FROM jsonb_to_recordset(coalesce(p_transactions[i] -> 'replace', p_transactions[i] -> 'upsert'))
                            AS j(store smallint, transaction_id text, original_transaction_id text, product_id text,
                                type smallint, environment smallint, transaction_date bigint, expiration_date bigint,
                                revocation_date bigint)
                        ON CONFLICT (customer_id, store, transaction_id) DO UPDATE SET
                            original_transaction_id = EXCLUDED.original_transaction_id, product_id = EXCLUDED.product_id,
                            type = EXCLUDED.type, environment = EXCLUDED.environment,
                            transaction_date = EXCLUDED.transaction_date, expiration_date = EXCLUDED.expiration_date,
                            revocation_date = EXCLUDED.revocation_date;
                    END IF;
                    IF p_subscription_states[i] <> 'null' THEN
                        IF p_subscription_states[i] ? 'replace' THEN
                            DELETE FROM subscription_states WHERE customer_id = p_ids[i];
                        ELSE
                            DELETE FROM subscription_states s
                            USING jsonb_to_recordset(p_subscription_states[i] -> 'remove') AS k(store smallint, original_transaction_id text)
                            WHERE s.customer_id = p_ids[i] AND s.store = k.store AND s.original_transaction_id = k.original_transaction_id;
                        END IF;
                        INSERT INTO subscription_states (customer_id, store, original_transaction_id, auto_renew_enabled,
                            billing_issue_detected_date, grace_period_expiration_date, is_in_billing_retry)
                        SELECT p_ids[i], j.store, j.original_transaction_id, j.auto_renew_enabled,
                            j.billing_issue_detected_date, j.grace_period_expiration_date, j.is_in_billing_retry
                        FROM jsonb_to_recordset(coalesce(p_subscription_states[i] -> 'replace', p_subscription_states[i] -> 'upsert'))
                            AS j(store smallint, original_transaction_id text, auto_renew_enabled boolean,
                                billing_issue_detected_date bigint, grace_period_expiration_date bigint, is_in_billing_retry boolean)
                        ON CONFLICT (customer_id, store, original_transaction_id) DO UPDATE SET
                            auto_renew_enabled = EXCLUDED.auto_renew_enabled,
                            billing_issue_detected_date = EXCLUDED.billing_issue_detected_date,
                            grace_period_expiration_date = EXCLUDED.grace_period_expiration_date,
                            is_in_billing_retry = EXCLUDED.is_in_billing_retry;
                    END IF;
                    IF p_grants[i] <> 'null' THEN
                        IF p_grants[i] ? 'replace' THEN
                            DELETE FROM grants WHERE customer_id = p_ids[i];
                        ELSE
                            DELETE FROM grants g
                            USING jsonb_to_recordset(p_grants[i] -> 'remove') AS k(grant_id text)
                            WHERE g.customer_id = p_ids[i] AND g.grant_id = k.grant_id;
                        END IF;
                        INSERT INTO grants (customer_id, grant_id, entitlement_id, granted_date, expiration_date, revoked_date)
                        SELECT p_ids[i], j.grant_id, j.entitlement_id, j.granted_date, j.expiration_date, j.revoked_date
                        FROM jsonb_to_recordset(coalesce(p_grants[i] -> 'replace', p_grants[i] -> 'upsert'))
                            AS j(grant_id text, entitlement_id text, granted_date bigint, expiration_date bigint, revoked_date bigint)
                        ON CONFLICT (customer_id, grant_id) DO UPDATE SET
                            entitlement_id = EXCLUDED.entitlement_id, granted_date = EXCLUDED.granted_date,
                            expiration_date = EXCLUDED.expiration_date, revoked_date = EXCLUDED.revoked_date;
                    END IF;
                END LOOP;
            END
            $$
            """,
        ],
        // 3: outbound events in fleet mode (FleetEvents, docs/events.md): the lease that
        // says which server delivers, the events every server derived (the same ids), and
        // each delivery's newest state. Rows of both tables are numbered from one sequence
        // under an advisory lock, so that a reader that remembers the last number it read
        // misses none.
        [
            "CREATE TABLE event_lease (name text PRIMARY KEY, holder text NOT NULL, expires_at timestamptz NOT NULL)",
            "CREATE SEQUENCE event_changes",
            """
            CREATE TABLE events (
                seq bigint PRIMARY KEY DEFAULT nextval('event_changes'),
                event_id text NOT NULL UNIQUE,
                summary text NOT NULL,
                body bytea NOT NULL,
                created_at timestamptz NOT NULL DEFAULT now()
            )
            """,
            """
            CREATE TABLE event_deliveries (
                event_id text NOT NULL,
                destination text NOT NULL,
                state text NOT NULL,
                redeliver boolean NOT NULL,
                delivered boolean NOT NULL,
                changed bigint NOT NULL DEFAULT nextval('event_changes'),
                PRIMARY KEY (event_id, destination)
            )
            """,
            "CREATE INDEX event_deliveries_changed ON event_deliveries (changed)",
            "CREATE INDEX events_created_at ON events (created_at)",
        ],
    ]

    /// What a migration run did.
    public struct MigrationReport: Sendable {
        public var from: Int
        public var to: Int
    }

    /// Creates or upgrades the schema to ``currentVersion``.
    public static func migrate(_ database: FleetDatabase) async throws -> MigrationReport {
        do {
            // Other pods' migrations may hold the lock a while: a generous limit.
            return try await database.withTransaction(timeout: .seconds(600)) { connection in
                try await connection.query("SELECT pg_advisory_xact_lock(\(Self.migrationLock))", logger: database.logger)
                try await connection.query(
                    "CREATE TABLE IF NOT EXISTS entitlements_schema (version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
                    logger: database.logger
                )
                let from = try await Self.version(on: connection, logger: database.logger)
                guard from <= Self.currentVersion else {
                    throw Self.newer(from)
                }
                for version in (from + 1)...max(from + 1, Self.currentVersion) where version <= Self.currentVersion {
                    for statement in Self.migrations[version - 1] {
                        try await connection.query(PostgresQuery(unsafeSQL: statement), logger: database.logger)
                    }
                    try await connection.query("INSERT INTO entitlements_schema (version) VALUES (\(version))", logger: database.logger)
                }
                return MigrationReport(from: from, to: Self.currentVersion)
            }
        } catch let error as FleetError {
            throw error
        } catch {
            throw FleetError(.database, "db migrate failed, nothing was changed: \(FleetError.describe(error))")
        }
    }

    /// What a prune removed.
    public struct PruneReport: Sendable {
        public var removedRows: Int
        /// The oldest sequence still in the change log (nil: the log is empty).
        public var oldestKept: UInt64?
    }

    /// Removes the change log's rows before the first one committed at or after `cutoff`
    /// (Unix milliseconds), always keeping the newest row: a prefix, so what is left has no
    /// gap (`committed_at` is its transaction's start, which does not rise with `seq`: a
    /// transaction that waited for the sequence's lock has a later `seq` and an earlier
    /// time). A server whose cursor is older than what is left starts afresh from a
    /// snapshot (docs/fleet.md, "Retention").
    public static func prune(_ database: FleetDatabase, olderThan cutoff: Int64) async throws -> PruneReport {
        do {
            return try await database.withTransaction(timeout: .seconds(3_600)) { connection in
                var removed = 0
                let rows = try await connection.query(
                    """
                    WITH gone AS (
                        DELETE FROM change_log
                        WHERE seq < COALESCE(
                            (SELECT min(seq) FROM change_log WHERE committed_at >= to_timestamp(\(Double(cutoff) / 1000))),
                            (SELECT max(seq) FROM change_log)
                        )
                        RETURNING 1
                    )
                    SELECT count(*) FROM gone
                    """,
                    logger: database.logger
                )
                for try await count in rows.decode(Int64.self) {
                    removed = Int(count)
                }
                var oldest: UInt64?
                for try await value in try await connection.query("SELECT min(seq) FROM change_log", logger: database.logger).decode(Int64?.self) {
                    oldest = value.map { UInt64($0) }
                }
                return PruneReport(removedRows: removed, oldestKept: oldest)
            }
        } catch let error as FleetError {
            throw error
        } catch {
            throw FleetError(.database, "db prune failed, nothing was removed: \(FleetError.describe(error))")
        }
    }

    /// Checks that the database has exactly this binary's schema (what `serve` needs).
    public static func check(_ database: FleetDatabase) async throws {
        let version = try await database.withConnection { connection in
            try await Self.version(on: connection, logger: database.logger)
        }
        if version > Self.currentVersion {
            throw Self.newer(version)
        }
        if version < Self.currentVersion {
            throw FleetError(
                .schema,
                "the database at \(database.url) has schema version \(version), this binary needs \(Self.currentVersion): run `entitlements db migrate --postgres URL` first"
            )
        }
    }

    /// What about the database's settings could lose a write this server acknowledges
    /// (its COMMIT returns before the WAL is durable): `fsync` or `full_page_writes` off.
    /// Each write's transaction sets `synchronous_commit` on itself. Empty when none.
    public static func durabilityWarnings(_ database: FleetDatabase) async throws -> [String] {
        try await database.withConnection { connection in
            var warnings: [String] = []
            for setting in ["fsync", "full_page_writes"] {
                for try await value in try await connection.query(PostgresQuery(unsafeSQL: "SHOW \(setting)"), logger: database.logger).decode(String.self) where value == "off" {
                    warnings.append(
                        "PostgreSQL at \(database.url) runs with \(setting)=off: a crash of its machine can lose writes this server acknowledged (docs/fleet.md, \"Durability\"); never in production"
                    )
                }
            }
            return warnings
        }
    }

    private static func newer(_ version: Int) -> FleetError {
        FleetError(
            .schema,
            "the database has schema version \(version), newer than this binary's \(Self.currentVersion): upgrade entitlements (nothing was changed)"
        )
    }

    /// The applied version: 0 for a database without the schema table.
    static func version(on connection: PostgresConnection, logger: Logger) async throws -> Int {
        let exists = try await connection.query("SELECT to_regclass('entitlements_schema') IS NOT NULL", logger: logger)
        var found = false
        for try await value in exists.decode(Bool.self) {
            found = value
        }
        guard found else {
            return 0
        }
        var version = 0
        for try await value in try await connection.query("SELECT coalesce(max(version), 0) FROM entitlements_schema", logger: logger).decode(Int32.self) {
            version = Int(value)
        }
        return version
    }
}
