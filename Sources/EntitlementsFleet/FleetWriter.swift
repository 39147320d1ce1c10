import EntitlementsFormats
public import EntitlementsMessages
public import EntitlementsResolver
public import EntitlementsStore
import Logging
import NIOCore
import PostgresNIO
import Synchronization

/// The write path of fleet mode (docs/fleet.md, "Writes"): writes run in PostgreSQL
/// transactions that read and lock the customers they touch, compute their new records
/// with the same rules as an embedded server (``CustomerMutation``), update the domain
/// tables, take the next sequence numbers from `change_head` and append each write's
/// effect to `change_log`. A write is acknowledged after COMMIT.
///
/// Writes that arrive while a transaction is running are committed together, in one
/// transaction, in arrival order (group commit): the `change_head` row lock and the commit
/// flush are paid once per group rather than once per write, which is what bounds a
/// counter row's throughput. Each write still gets its own sequence number and its own
/// answer; a write the rules refuse fails alone, and a write PostgreSQL refuses is run
/// again alone so that it cannot fail its neighbours.
public final class FleetWriter: WriteUpstream {
    /// The NOTIFY channel: a hint that the change log grew (the payload is the sequence).
    public static let notifyChannel = "entitlements_changes"

    private let database: FleetDatabase
    private let catalog: ProductCatalog
    /// Runs after each commit with its sequence (the server's tailer polls at once).
    private let committed: @Sendable (UInt64) -> Void
    private let queue = Mutex(Queue())

    /// Transactions lost to a concurrent writer (deadlock, a customer created twice at
    /// once, an alias that moved) are run again, this many times at most.
    static let maximumAttempts = 8
    /// The most writes one transaction commits.
    static let maximumGroup = 64

    /// One transaction runs at a time; writes arriving meanwhile wait and join the next
    /// group. That measured fastest (docs/fleet.md, "Writes"): groups running at once
    /// queue on the `change_head` row and on the CPU, while a single group grows to absorb
    /// the load.
    public init(database: FleetDatabase, catalog: ProductCatalog, committed: @escaping @Sendable (UInt64) -> Void = { _ in }) {
        self.database = database
        self.catalog = catalog
        self.committed = committed
    }

    private struct Pending: Sendable {
        var mutation: LogRecord.Mutation
        var now: Int64
        var source: WriteSource?
        var answer: CheckedContinuation<CustomerStore.UpstreamWrite, any Error>
    }

    private struct Queue: Sendable {
        var waiting: [Pending] = []
        /// Whether a task is committing groups (it takes the waiting writes until none is left).
        var committing = false
    }

    /// A lookup the rules asked for that this transaction has not read yet.
    private struct NeedsLookup: Error {
        var userId: String
    }

    /// The customer an alias named moved while this transaction waited for its lock.
    private struct AliasMoved: Error {}

    public func write(_ mutation: LogRecord.Mutation, now: Int64, source: WriteSource?) async throws -> CustomerStore.UpstreamWrite {
        // Every continuation is resumed: a group always answers each of its writes, and
        // FleetDatabase bounds each use of a connection in time.
        try await withCheckedThrowingContinuation { answer in
            let lead = self.queue.withLock { queue -> Bool in
                queue.waiting.append(Pending(mutation: mutation, now: now, source: source, answer: answer))
                guard !queue.committing else { return false }
                queue.committing = true
                return true
            }
            if lead {
                Task { await self.commitGroups() }
            }
        }
    }

    /// Commits the waiting writes, a group at a time, until none is left.
    private func commitGroups() async {
        while true {
            let group = self.queue.withLock { queue -> [Pending] in
                let group = Array(queue.waiting.prefix(Self.maximumGroup))
                queue.waiting.removeFirst(group.count)
                if group.isEmpty {
                    queue.committing = false
                }
                return group
            }
            guard !group.isEmpty else { return }
            let results = await self.commit(group)
            if let last = results.compactMap({ try? $0.get() }).filter(\.changed).map(\.sequence).max() {
                self.committed(last)
            }
            for (pending, result) in zip(group, results) {
                pending.answer.resume(with: result)
            }
        }
    }

    /// One answer per write of `group`, in order.
    private func commit(_ group: [Pending]) async -> [Result<CustomerStore.UpstreamWrite, any Error>] {
        var attempt = 1
        while true {
            do {
                return try await self.attempt(group)
            } catch {
                let state = FleetError.sqlState(error)
                // 40P01 deadlock, 40001 serialization failure, 23505 a concurrent insert of
                // the same key, 23503 a customer deleted under an alias being linked.
                let lostRace = error is AliasMoved || ["40P01", "40001", "23505", "23503"].contains(state ?? "")
                if lostRace, attempt < Self.maximumAttempts {
                    attempt += 1
                    continue
                }
                if group.count > 1, let state, state.hasPrefix("22") || state.hasPrefix("23") {
                    // PostgreSQL refused a value or a constraint (the transaction rolled
                    // back, the connection is fine): run each write alone, so that only
                    // the write at fault fails. Other refusals (a cancelled statement, a
                    // full disk) are no one write's fault: the group fails as one.
                    var results: [Result<CustomerStore.UpstreamWrite, any Error>] = []
                    for pending in group {
                        results += await self.commit([pending])
                    }
                    return results
                }
                let refusal: WriteRefusal
                if let state, state.hasPrefix("22") {
                    // A data exception: a value PostgreSQL cannot store (e.g. a NUL byte in an id).
                    refusal = WriteRefusal(.invalidArgument, "a value of this write cannot be stored: \(FleetError.describe(error))")
                } else {
                    refusal = WriteRefusal(.unavailable, Self.unavailable(error))
                }
                return group.map { _ in .failure(refusal) }
            }
        }
    }

    static func unavailable(_ error: any Error) -> String {
        if error is CommitOutcomeUnknown {
            return "PostgreSQL failed during COMMIT, so the write may or may not be stored; retry it (a retry with the same ids is idempotent): \(FleetError.describe(error))"
        }
        return "the write was not stored (PostgreSQL: \(FleetError.describe(error)))"
    }

    /// How one write of a group ends, before the group's sequence numbers are known.
    private enum Outcome {
        case refused(WriteRefusal)
        /// A write that changes nothing: it answers the sequence of the customer's last
        /// change, `effect` when that change is an earlier write of this group.
        case unchanged(customerId: String, sequence: Int64, effect: Int?)
        case changed(customerId: String, created: Bool, effect: Int)
    }

    private func attempt(_ group: [Pending]) async throws -> [Result<CustomerStore.UpstreamWrite, any Error>] {
        let logger = self.database.logger
        let catalog = self.catalog
        return try await self.database.withTransaction { connection in
            var reads = GroupReads()
            var changes = PendingChanges()
            var outcomes: [Outcome] = []
            var effects: [WriteEffect] = []
            // Customer id -> the last effect of this group that changed it.
            var lastEffect: [String: Int] = [:]
            // The id each write looks up first, locked and read in one round trip.
            try await reads.lockAndRead(
                group.compactMap { reads.firstLookup(of: $0.mutation, now: $0.now, catalog: catalog) },
                on: connection,
                logger: logger
            )
            for pending in group {
                do {
                    var effect: WriteEffect
                    while true {
                        do {
                            effect = try reads.effect(of: pending.mutation, now: pending.now, catalog: catalog)
                            break
                        } catch let need as NeedsLookup {
                            // The tables must hold this group's earlier writes before they are read.
                            try await changes.flush(on: connection, logger: logger)
                            try await reads.lockAndRead([need.userId], on: connection, logger: logger)
                        }
                    }
                    effect.source = pending.source
                    guard effect.changed else {
                        outcomes.append(
                            .unchanged(customerId: effect.customerId, sequence: reads.lastSequence(of: effect.customerId), effect: lastEffect[effect.customerId])
                        )
                        continue
                    }
                    // Staged on copies: a write whose records cannot be encoded fails alone
                    // and leaves nothing of itself behind to be flushed.
                    var staged = changes
                    var stagedReads = reads
                    try staged.add(effect, reads: &stagedReads)
                    changes = staged
                    reads = stagedReads
                    reads.apply(effect)
                    for customerId in effect.records.keys {
                        lastEffect[customerId] = effects.count
                    }
                    outcomes.append(.changed(customerId: effect.customerId, created: effect.created, effect: effects.count))
                    effects.append(effect)
                } catch let refusal as WriteRefusal {
                    outcomes.append(.refused(refusal))
                } catch let error as ProtobufError {
                    // A value the wire format cannot carry (only in-process callers can send
                    // one: the framed protocol refuses it when it decodes the request).
                    outcomes.append(.refused(WriteRefusal(.invalidArgument, "\(error)")))
                }
            }
            try await changes.flush(on: connection, logger: logger)
            let first = effects.isEmpty ? 0 : try await Self.append(effects, on: connection, logger: logger)
            return outcomes.map { outcome -> Result<CustomerStore.UpstreamWrite, any Error> in
                switch outcome {
                case .refused(let refusal):
                    return .failure(refusal)
                case .unchanged(let customerId, let sequence, let effect):
                    let sequence = effect.map { first + UInt64($0) } ?? UInt64(max(0, sequence))
                    return .success(CustomerStore.UpstreamWrite(customerId: customerId, sequence: sequence, changed: false, created: false))
                case .changed(let customerId, let created, let effect):
                    return .success(CustomerStore.UpstreamWrite(customerId: customerId, sequence: first + UInt64(effect), changed: true, created: created))
                }
            }
        }
    }

    /// What a group's transaction has read: every id it looked up (locked until the
    /// transaction ends), as the tables will hold it once this group's changes so far are
    /// flushed.
    struct GroupReads {
        /// Lookup id (a customer id or an alias) -> the record it names.
        var records: [String: CustomerRecord?] = [:]
        /// Customer id -> the sequence of its last change, as read.
        var sequences: [String: Int64] = [:]
        /// Customer id -> whether its row exists once the pending changes are flushed.
        var present: [String: Bool] = [:]

        /// The first id `mutation` looks up, with nothing read yet (nil for a write that
        /// the rules refuse before any lookup).
        func firstLookup(of mutation: LogRecord.Mutation, now: Int64, catalog: ProductCatalog) -> String? {
            do {
                _ = try CustomerMutation(catalog: catalog) { throw NeedsLookup(userId: $0) }.effect(of: mutation, now: now)
                return nil
            } catch let need as NeedsLookup {
                return need.userId
            } catch {
                return nil
            }
        }

        func effect(of mutation: LogRecord.Mutation, now: Int64, catalog: ProductCatalog) throws -> WriteEffect {
            let records = self.records
            return try CustomerMutation(catalog: catalog) { userId in
                guard let record = records[userId] else {
                    throw NeedsLookup(userId: userId)
                }
                return record
            }.effect(of: mutation, now: now)
        }

        /// The record of customer `customerId` as read (and brought up to date), if it was.
        func record(of customerId: String) -> CustomerRecord? {
            if let record = self.records[customerId] ?? nil, record.id == customerId {
                return record
            }
            return self.records.values.lazy.compactMap { $0 }.first { $0.id == customerId }
        }

        func lastSequence(of customerId: String) -> Int64 {
            self.sequences[customerId] ?? 0
        }

        /// Locks and reads `ids` (customer ids or aliases; sorted, so that groups running at
        /// once take their locks in one order) in one round trip, each with its row locked
        /// until the transaction ends.
        ///
        /// `entitlements_lock_customer` (schema version 2) locks the id itself first (a
        /// transaction-scoped advisory lock on its hash), whether or not anything has it
        /// yet, then reads with a fresh snapshot: two writes that would each create customer
        /// X, or link alias X, or one of each, run one after the other, and the second sees
        /// what the first committed. Two writes that lock the same ids in another order
        /// deadlock, which PostgreSQL detects; the loser is run again.
        mutating func lockAndRead(_ ids: [String], on connection: PostgresConnection, logger: Logger) async throws {
            let ids = Array(Set(ids)).sorted()
            guard !ids.isEmpty else { return }
            let rows = try await connection.query(
                """
                SELECT u.id, l.customer_record, l.customer_last_seq
                FROM unnest(\(ids)::text[]) WITH ORDINALITY AS u(id, ordinal)
                LEFT JOIN LATERAL entitlements_lock_customer(u.id) l ON true
                ORDER BY u.ordinal
                """,
                logger: logger
            )
            for try await (id, bytes, sequence) in rows.decode((String, ByteBuffer?, Int64?).self) {
                try self.remember(id, bytes.map { try CustomerRecord(buffer: $0) }, sequence: sequence ?? 0)
            }
        }

        private mutating func remember(_ id: String, _ record: CustomerRecord?, sequence: Int64) throws {
            if let record, let customerId = record.id {
                // Locked after the alias was read: if the alias moved meanwhile, start again.
                guard customerId == id || record.aliases.contains(id) else {
                    throw AliasMoved()
                }
                self.sequences[customerId] = sequence
                self.present[customerId] = true
            } else if self.present[id] == nil {
                self.present[id] = false
            }
            self.records[id] = .some(record)
        }

        /// Brings what was read up to date with `effect` (not yet flushed): an id that
        /// still names the same customer gets its new record; any other id the effect
        /// touched is forgotten, and read again (after a flush) if a later write needs it.
        mutating func apply(_ effect: WriteEffect) {
            for (id, record) in self.records {
                let customerId = record?.id ?? id
                guard effect.records[customerId] != nil || effect.records[id] != nil || effect.aliases[id] != nil else {
                    continue
                }
                if effect.aliases[id] == nil, let new = effect.records[customerId] ?? nil, new.id == id || new.aliases.contains(id) {
                    self.records[id] = .some(new)
                } else {
                    self.records[id] = nil
                }
            }
        }
    }

    /// Changes to the tables not yet sent, in order, sent in one round trip
    /// (`entitlements_apply_changes`, schema version 2). Arrays of PostgreSQL cannot be
    /// bound with nulls here: a value a kind does not use is empty.
    struct PendingChanges {
        var kinds: [Int16] = []
        var ids: [String] = []
        var records: [ByteBuffer] = []
        var owners: [String] = []
        var transactions: [String] = []
        var subscriptionStates: [String] = []
        var grants: [String] = []

        var isEmpty: Bool { self.kinds.isEmpty }

        /// The kinds `entitlements_apply_changes` knows.
        enum Kind: Int16 {
            case insertCustomer = 1, updateCustomer = 2, deleteCustomer = 3, removeAlias = 4, linkAlias = 5
        }

        /// - Parameter previous: what the tables hold for the customer now: only the
        ///   domain tables whose rows differ are rewritten.
        mutating func append(_ kind: Kind, _ id: String, record: CustomerRecord? = nil, previous: DomainRows.Previous = .none, owner: String? = nil) throws {
            // Encoded before anything is appended: the arrays stay aligned if it throws.
            var bytes = ByteBuffer()
            try record?.serialize(into: &bytes)
            self.kinds.append(kind.rawValue)
            self.ids.append(id)
            self.owners.append(owner ?? "")
            if let record {
                let rows = DomainRows(record, previous: previous)
                self.records.append(bytes)
                self.transactions.append(rows.transactions)
                self.subscriptionStates.append(rows.subscriptionStates)
                self.grants.append(rows.grants)
            } else {
                self.records.append(ByteBuffer())
                self.transactions.append("null")
                self.subscriptionStates.append("null")
                self.grants.append("null")
            }
        }

        /// Adds the effect's customers (sorted by id) and aliases. A customer not present
        /// in the tables is inserted without ON CONFLICT: had another transaction created
        /// it meanwhile, the insert fails (23505) and the group is run again.
        mutating func add(_ effect: WriteEffect, reads: inout GroupReads) throws {
            for (customerId, record) in effect.records.sorted(by: { $0.key < $1.key }) {
                if let record {
                    if reads.present[customerId] == true {
                        try self.append(.updateCustomer, customerId, record: record, previous: reads.record(of: customerId).map { .record($0) } ?? .unknown)
                    } else {
                        try self.append(.insertCustomer, customerId, record: record)
                    }
                    reads.present[customerId] = true
                } else {
                    // Its aliases and rows go with it (ON DELETE CASCADE).
                    try self.append(.deleteCustomer, customerId)
                    reads.present[customerId] = false
                }
            }
            for (alias, owner) in effect.aliases.sorted(by: { $0.key < $1.key }) {
                try self.append(owner == nil ? .removeAlias : .linkAlias, alias, owner: owner)
            }
        }

        mutating func flush(on connection: PostgresConnection, logger: Logger) async throws {
            guard !self.kinds.isEmpty else { return }
            try await connection.query(
                """
                SELECT entitlements_apply_changes(\(self.kinds)::smallint[], \(self.ids)::text[], \(self.records)::bytea[],
                    \(self.owners)::text[], \(self.transactions)::jsonb[], \(self.subscriptionStates)::jsonb[], \(self.grants)::jsonb[])
                """,
                logger: logger
            )
            self = PendingChanges()
        }
    }

    /// Takes the next sequence numbers, one per effect in order, and appends the effects to
    /// the change log, in one statement; returns the first. The `change_head` row lock it
    /// takes is held until COMMIT, so sequence numbers commit in order with no gaps. NOTIFY
    /// is delivered at COMMIT.
    static func append(_ effects: [WriteEffect], on connection: PostgresConnection, logger: Logger) async throws -> UInt64 {
        var writers: [String] = []
        var records: [ByteBuffer] = []
        // Each customer's last change in this group (its ordinal, from 1).
        var lastChange: [String: Int64] = [:]
        for (index, effect) in effects.enumerated() {
            var bytes = ByteBuffer()
            try effect.replicated.serialize(into: &bytes)
            writers.append(effect.customerId)
            records.append(bytes)
            for (customerId, record) in effect.records where record != nil {
                lastChange[customerId] = Int64(index + 1)
            }
        }
        let count = Int64(effects.count)
        let touched = lastChange.sorted { $0.key < $1.key }
        let rows = try await connection.query(
            """
            WITH head AS (UPDATE change_head SET seq = seq + \(count) RETURNING seq),
                 logged AS (
                     INSERT INTO change_log (seq, customer_id, record)
                     SELECT head.seq - \(count) + e.ordinal, e.customer_id, e.record
                     FROM head, unnest(\(writers)::text[], \(records)::bytea[]) WITH ORDINALITY AS e(customer_id, record, ordinal)
                 ),
                 touched AS (
                     UPDATE customers c SET last_seq = head.seq - \(count) + t.ordinal
                     FROM head, unnest(\(touched.map(\.key))::text[], \(touched.map(\.value))::bigint[]) AS t(customer_id, ordinal)
                     WHERE c.customer_id = t.customer_id
                 ),
                 notified AS (SELECT pg_notify(\(Self.notifyChannel), head.seq::text) FROM head)
            SELECT head.seq FROM head, notified,
                -- The COMMIT that acknowledges these writes waits for its WAL flush, whatever
                -- the role's or database's default says: off is raised to on; a stronger
                -- setting (remote_write, remote_apply) or local is kept.
                (SELECT set_config('synchronous_commit',
                    CASE current_setting('synchronous_commit') WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END,
                    true)) AS durable
            """,
            logger: logger
        )
        for try await last in rows.decode(Int64.self) {
            return UInt64(last - count + 1)
        }
        throw FleetError(.schema, "change_head has no row: run `entitlements db migrate`")
    }
}

/// A customer record as changes to the domain tables' rows, in the JSON
/// `entitlements_apply_changes` reads, one value per table: JSON `null` when the table's
/// rows for the customer do not change; `{"upsert": [rows], "remove": [keys]}` for the rows
/// that are new or changed and the keys of those gone, when what the table holds now
/// (`previous`) is known; `{"replace": [rows]}` (every row, the old ones deleted) when it
/// is not. A customer with a year of monthly renewals gets one row written per renewal,
/// not twelve. Rows with the same key are one row (the last).
struct DomainRows {
    var transactions: String
    var subscriptionStates: String
    var grants: String

    /// What the tables hold for a customer before a write.
    enum Previous {
        /// A new customer: no rows.
        case none
        case record(CustomerRecord)
        /// Not known: every table is rewritten.
        case unknown
    }

    /// A row's primary key within its customer.
    private struct Key: Hashable {
        var store: Int64
        var id: String?
    }

    init(_ record: CustomerRecord, previous: Previous) {
        func int(_ value: Int64?) -> JSONValue { value.map { .int($0) } ?? .null }
        let before: CustomerRecord? = switch previous {
        case .none: CustomerRecord()
        case .record(let record): record
        case .unknown: nil
        }
        self.transactions = Self.change(
            record.transactions,
            previous: before?.transactions,
            key: { Key(store: Int64($0.store.rawValue), id: $0.transactionId) },
            keyColumns: { [("store", .int($0.store)), ("transaction_id", .string($0.id))] }
        ) { transaction in
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
        }
        self.subscriptionStates = Self.change(
            record.subscriptions,
            previous: before?.subscriptions,
            key: { Key(store: Int64($0.store.rawValue), id: $0.originalTransactionId) },
            keyColumns: { [("store", .int($0.store)), ("original_transaction_id", .string($0.id))] }
        ) { state in
            [
                ("store", .int(Int64(state.store.rawValue))),
                ("original_transaction_id", .string(state.originalTransactionId)),
                ("auto_renew_enabled", .bool(state.autoRenewEnabled)),
                ("billing_issue_detected_date", int(state.billingIssueDetectedDate)),
                ("grace_period_expiration_date", int(state.gracePeriodExpirationDate)),
                ("is_in_billing_retry", .bool(state.isInBillingRetry)),
            ]
        }
        self.grants = Self.change(
            record.grants,
            previous: before?.grants,
            key: { Key(store: 0, id: $0.grantId) },
            keyColumns: { [("grant_id", .string($0.id))] }
        ) { grant in
            [
                ("grant_id", .string(grant.grantId)),
                ("entitlement_id", .string(grant.entitlementId)),
                ("granted_date", int(grant.grantedDate)),
                ("expiration_date", int(grant.expirationDate)),
                ("revoked_date", int(grant.revokedDate)),
            ]
        }
    }

    /// One table's change (see the type's comment).
    private static func change<Row: Hashable>(
        _ rows: [Row],
        previous: [Row]?,
        key: (Row) -> Key,
        keyColumns: (Key) -> [(String, JSONValue)],
        columns: (Row) -> [(String, JSONValue)]
    ) -> String {
        var current: [Key: Row] = [:]
        var order: [Key] = []
        for row in rows {
            let rowKey = key(row)
            if current.updateValue(row, forKey: rowKey) == nil {
                order.append(rowKey)
            }
        }
        guard let previous else {
            let all = order.map { JSONValue.object(columns(current[$0]!)) }
            return JSONValue.object([("replace", .array(all))]).serialized(pretty: false)
        }
        var before: [Key: Row] = [:]
        for row in previous {
            before[key(row)] = row
        }
        let upsert = order.filter { before[$0] != current[$0] }.map { JSONValue.object(columns(current[$0]!)) }
        let removed = before.keys.filter { current[$0] == nil }.map { JSONValue.object(keyColumns($0)) }
        guard !upsert.isEmpty || !removed.isEmpty else {
            return "null"
        }
        return JSONValue.object([("upsert", .array(upsert)), ("remove", .array(removed))]).serialized(pretty: false)
    }
}
