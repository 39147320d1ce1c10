public import EntitlementsMessages
import EntitlementsResolver
public import EntitlementsStore
import Logging
import NIOCore
import PostgresNIO

#if canImport(Glibc)
import Glibc
#endif

/// Snapshots in and out of PostgreSQL (docs/fleet.md, "Bootstrap").
public enum FleetSnapshot {
    /// What an export wrote.
    public struct ExportReport: Sendable {
        public var epoch: String
        public var sequence: UInt64
        public var customers: UInt64
    }

    /// Writes every customer to a snapshot file at `path`, as of one moment: one REPEATABLE
    /// READ transaction, so the file holds exactly the writes up to the `change_head`
    /// sequence it read, and is stamped with that sequence and the epoch.
    public static func export(_ database: FleetDatabase, to path: String, now: Int64) async throws -> ExportReport {
        let logger = database.logger
        do {
            return try await database.withTransaction(begin: "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY", timeout: .seconds(3_600)) { connection in
                let (epoch, sequence) = try await FleetTailer.head(on: connection, logger: logger)
                let catalog = try await Self.catalog(on: connection, logger: logger)
                let committed = try await FleetTailer.committedDate(of: sequence, on: connection, logger: logger)
                var writer = try SnapshotWriter(
                    path: path,
                    catalog: catalog,
                    createdDate: now,
                    lastLogSequence: sequence,
                    fleetEpoch: epoch,
                    fleetCommittedDate: committed
                )
                let rows = try await connection.query("SELECT record FROM customers", logger: logger)
                for try await bytes in rows.decode(ByteBuffer.self) {
                    try writer.append(try CustomerRecord(buffer: bytes))
                }
                let count = writer.recordCount
                try writer.finish(hotList: [])
                return ExportReport(epoch: epoch, sequence: sequence, customers: count)
            }
        } catch let error as FleetError {
            throw error
        } catch let error as SnapshotError {
            throw error
        } catch {
            throw FleetError(.database, "snapshot export failed (no file was written): \(FleetError.describe(error))")
        }
    }

    /// The catalog the database holds.
    static func catalog(on connection: PostgresConnection, logger: Logger) async throws -> Catalog {
        for try await bytes in try await connection.query("SELECT catalog FROM catalog", logger: logger).decode(ByteBuffer.self) {
            return try Catalog(buffer: bytes)
        }
        throw FleetError(.schema, "the database has no catalog yet: load one with `entitlements db import --postgres URL --snapshot FILE`")
    }

    /// Loads a snapshot file into an empty fleet database (its catalog and customers): how
    /// an embedded deployment moves to fleet mode. Refused if the database already holds
    /// customers or writes. Returns the customers loaded.
    public static func importSnapshot(_ database: FleetDatabase, from path: String) async throws -> UInt64 {
        let snapshot = try SnapshotReader(path: path)
        let logger = database.logger
        do {
            return try await database.withTransaction(timeout: .seconds(3_600)) { connection in
                // One import at a time, and none over a database that already has data.
                try await connection.query("LOCK TABLE customers, change_head IN EXCLUSIVE MODE", logger: logger)
                var existing: Int64 = 0
                for try await count in try await connection.query("SELECT (SELECT count(*) FROM customers) + (SELECT seq FROM change_head)", logger: logger).decode(Int64.self) {
                    existing = count
                }
                guard existing == 0 else {
                    throw FleetError(.database, "the database already holds customers or writes; db import loads only an empty one (nothing was changed)")
                }
                var catalogBytes = ByteBuffer()
                try snapshot.catalog.serialize(into: &catalogBytes)
                try await connection.query(
                    "INSERT INTO catalog (catalog) VALUES (\(catalogBytes)) ON CONFLICT (id) DO UPDATE SET catalog = EXCLUDED.catalog",
                    logger: logger
                )
                var records: [CustomerRecord] = []
                try snapshot.forEachRecord { record, _ in records.append(record) }
                // A thousand customers per round trip.
                var changes = FleetWriter.PendingChanges()
                for record in records {
                    guard let id = record.id else { continue }
                    try changes.append(.insertCustomer, id, record: record)
                    for alias in record.aliases {
                        try changes.append(.linkAlias, alias, owner: id)
                    }
                    if changes.kinds.count >= 1_000 {
                        try await changes.flush(on: connection, logger: logger)
                    }
                }
                try await changes.flush(on: connection, logger: logger)
                return UInt64(records.count)
            }
        } catch let error as FleetError {
            throw error
        } catch {
            throw FleetError(.database, "db import failed, nothing was changed: \(FleetError.describe(error))")
        }
    }

    /// Opens a fleet server's data directory (docs/fleet.md, "Start-up"): keeps it if its
    /// snapshot is of the database's epoch and its log can continue from the change log;
    /// otherwise starts it afresh from `seed` (an exported file of the same epoch, recent
    /// enough) or from an export streamed from PostgreSQL. Returns the store and what was
    /// done, in words for the log.
    ///
    /// The checks ask `database` (the primary); a fresh export reads `exportFrom` when given
    /// (a read replica), else `database`.
    public static func openStore(
        dataDirectory directory: String,
        seed: String?,
        database: FleetDatabase,
        exportFrom replica: FleetDatabase? = nil,
        options: CustomerStore.Options,
        now: Int64
    ) async throws -> (CustomerStore, CustomerStore.OpenReport, String) {
        let (epoch, head, oldest) = try await database.withConnection { connection in
            let (epoch, head) = try await FleetTailer.head(on: connection, logger: database.logger)
            var oldest: UInt64 = head + 1
            for try await value in try await connection.query("SELECT min(seq) FROM change_log", logger: database.logger).decode(Int64?.self) {
                oldest = value.map { UInt64($0) } ?? head + 1
            }
            return (epoch, head, oldest)
        }
        let rewritten = { (store: CustomerStore) async throws -> FleetError? in
            let applied = store.committedSequence
            guard applied > 0, let date = store.replicatedCommitDate(of: applied) else {
                return nil
            }
            let found = try await database.withConnection { connection in
                try await FleetTailer.committedDate(of: applied, on: connection, logger: database.logger)
            }
            guard let found, found != date else {
                return nil
            }
            return FleetTailer.rewritten(applied, applied: date, found: found)
        }
        /// Why a snapshot (with the log after it, up to `applied`) cannot continue from
        /// the change log; nil if it can.
        let unusable = { (header: SnapshotHeader, applied: UInt64) -> String? in
            guard header.fleetEpoch == epoch else {
                return "its data is from epoch \(header.fleetEpoch ?? "none"), the database's is \(epoch)"
            }
            guard applied + 1 >= oldest else {
                return "it has applied up to \(applied), but the change log now starts at \(oldest) (pruned)"
            }
            guard applied <= head else {
                // Only a --snapshot file gets here (a data directory that far ahead is
                // refused above): it is not used, and stays as it is.
                return "it holds writes up to \(applied), past the change log's head \(head)"
            }
            return nil
        }
        let snapshotPath = "\(directory)/\(CustomerStore.snapshotFileName)"
        var reason = "a new data directory"
        if access(snapshotPath, F_OK) == 0 {
            let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil, options: options)
            let header = store.snapshot.header
            let applied = store.committedSequence
            guard header.fleetEpoch != nil else {
                store.close()
                throw FleetError(
                    .dataDirectory,
                    "the data directory \(directory) belongs to an embedded server (its snapshot has no fleet epoch); nothing was changed. Give fleet mode a directory of its own; to move this data into the database, compact it and load the snapshot with `entitlements db import`"
                )
            }
            if header.fleetEpoch == epoch, applied > head {
                // The database lost writes this server applied (a restore that kept the
                // epoch): this directory may be the only copy of them. Never discard it.
                store.close()
                throw FleetError(
                    .dataDirectory,
                    "the data directory has applied up to sequence \(applied), but the database's change log (same epoch \(epoch)) ends at \(head): the database lost writes (restored without a new epoch?). Nothing was changed; see docs/fleet.md, \"Failures\""
                )
            }
            if header.fleetEpoch == epoch, let error = try await rewritten(store) {
                store.close()
                throw FleetError(.dataDirectory, "\(error.message). Nothing was changed; see docs/fleet.md, \"Failures\"")
            }
            guard let why = unusable(header, applied) else {
                return (store, report, "fleet: continuing from the data directory at sequence \(applied) (the change log's head is \(head))")
            }
            store.close()
            store.unlock()
            let kept = try Self.setAside(directory, now: now)
            reason = "the data directory cannot continue (\(why)), so it starts afresh; its old snapshot and log are kept in \(kept)"
        } else {
            // Log segments without a snapshot are a start-up that never finished: not ours to replay.
            _ = try Self.setAside(directory, now: now)
        }
        let (done, seedToCopy) = try await Self.fresh(
            directory: directory,
            seed: seed,
            database: database,
            exportFrom: replica ?? database,
            now: now,
            unusable: unusable,
            reason: reason
        )
        let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: seedToCopy, options: options)
        return (store, report, done)
    }

    private static func fresh(
        directory: String,
        seed: String?,
        database: FleetDatabase,
        exportFrom source: FleetDatabase,
        now: Int64,
        unusable: (SnapshotHeader, UInt64) -> String?,
        reason: String
    ) async throws -> (String, seed: String?) {
        if mkdir(directory, 0o755) != 0, errno != EEXIST {
            throw SnapshotError(code: .io, path: directory, reason: "cannot create the data directory: \(String(cString: strerror(errno)))")
        }
        let snapshotPath = "\(directory)/\(CustomerStore.snapshotFileName)"
        if let seed {
            let file = try SnapshotReader(path: seed)
            var why = unusable(file.header, file.header.lastLogSequence)
            if why == nil, let date = file.header.fleetCommittedDate {
                // Of this epoch, but is it of this history?
                let sequence = file.header.lastLogSequence
                let found = try await database.withConnection { connection in
                    try await FleetTailer.committedDate(of: sequence, on: connection, logger: database.logger)
                }
                if let found, found != date {
                    why = "its row \(sequence) was committed at \(date) (Unix ms), the change log's at \(found): another history in the same epoch"
                }
            }
            if let why {
                // Defined behaviour for a file from another epoch: not used, said why.
                let report = try await Self.export(source, orElse: database, to: snapshotPath, now: now)
                return ("fleet: \(reason); --snapshot \(seed) is not used (\(why)); exported \(report.customers) customers from PostgreSQL at sequence \(report.sequence)", nil)
            }
            // CustomerStore.open copies it in (in chunks, fsynced, renamed into place).
            return ("fleet: \(reason); seeded from \(seed) at sequence \(file.header.lastLogSequence)", seed)
        }
        let report = try await Self.export(source, orElse: database, to: snapshotPath, now: now)
        return ("fleet: \(reason); exported \(report.customers) customers from PostgreSQL at sequence \(report.sequence)", nil)
    }

    /// Exports from `source` (a read replica, or the primary); if a replica fails (e.g. a
    /// hot standby cancelled the long transaction on a recovery conflict), from `primary`.
    private static func export(_ source: FleetDatabase, orElse primary: FleetDatabase, to path: String, now: Int64) async throws -> ExportReport {
        guard source !== primary else {
            return try await Self.export(primary, to: path, now: now)
        }
        do {
            return try await Self.export(source, to: path, now: now)
        } catch {
            primary.logger.warning(
                "fleet: the export from the read replica failed; exporting from the primary instead",
                metadata: ["fleet.error": "\(error)"]
            )
            return try await Self.export(primary, to: path, now: now)
        }
    }

    /// Moves a data directory's snapshot and log into `DIR/replaced-<time>/` (never
    /// deletes them: an operator may want them), and returns that folder. Nothing to move:
    /// returns it anyway, not created.
    static func setAside(_ directory: String, now: Int64) throws -> String {
        var kept = "\(directory)/replaced-\(now)"
        var attempt = 1
        while access(kept, F_OK) == 0 {
            attempt += 1
            kept = "\(directory)/replaced-\(now)-\(attempt)"
        }
        let names = [CustomerStore.snapshotFileName, CustomerStore.logDirectoryName, HistoryArchive.directoryName]
        for name in names where access("\(directory)/\(name)", F_OK) == 0 {
            if mkdir(kept, 0o755) != 0, errno != EEXIST {
                throw SnapshotError(code: .io, path: kept, reason: "cannot create: \(String(cString: strerror(errno)))")
            }
            guard rename("\(directory)/\(name)", "\(kept)/\(name)") == 0 else {
                throw SnapshotError(code: .io, path: "\(directory)/\(name)", reason: "cannot move it aside: \(String(cString: strerror(errno)))")
            }
        }
        return kept
    }
}
