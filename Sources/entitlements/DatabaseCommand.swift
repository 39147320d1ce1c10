import ArgumentParser
import EntitlementsFleet
import EntitlementsStore
import Foundation
import Logging

/// The PostgreSQL database of fleet mode: `--postgres URL`, also `ENTITLEMENTS_POSTGRES_URL`.
struct PostgresOption: ParsableArguments {
    @Option(help: "The fleet database, postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE (default: $ENTITLEMENTS_POSTGRES_URL).")
    var postgres: String?

    func database() throws -> FleetDatabase {
        guard let text = self.postgres ?? ProcessInfo.processInfo.environment["ENTITLEMENTS_POSTGRES_URL"] else {
            throw ValidationError("give --postgres URL (or set ENTITLEMENTS_POSTGRES_URL)")
        }
        do {
            return FleetDatabase(url: try FleetDatabaseURL(text), logger: Logger(label: "entitlements.fleet"))
        } catch {
            throw ValidationError("--postgres: \(error)")
        }
    }

    func validate() throws {
        _ = try self.database()
    }
}

/// Runs `body` against the fleet database, printing a fleet error as one line (exit 1).
func withFleetDatabase(_ option: PostgresOption, _ body: (FleetDatabase) async throws -> Void) async throws {
    let database = try option.database()
    do {
        try await body(database)
        await database.close()
    } catch {
        await database.close()
        ServeCommand.say("error: \(error)")
        throw ExitCode(1)
    }
}

/// `entitlements db migrate | import` (docs/fleet.md).
struct DatabaseCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "db",
        abstract: "Manage the PostgreSQL database of fleet mode (docs/fleet.md).",
        subcommands: [Migrate.self, Import.self, Prune.self]
    )

    struct Migrate: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Create or upgrade the schema (idempotent; safe from many pods at once)."
        )
        @OptionGroup var connection: PostgresOption

        func run() async throws {
            try await withFleetDatabase(self.connection) { database in
                let report = try await FleetSchema.migrate(database)
                if report.from == report.to {
                    ServeCommand.say("schema is at version \(report.to); nothing to do")
                } else {
                    ServeCommand.say("schema migrated from version \(report.from) to \(report.to)")
                }
            }
        }
    }

    struct Prune: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Remove change log rows older than a duration (the newest row is always kept)."
        )
        @OptionGroup var connection: PostgresOption
        @Option(help: "Remove rows committed longer ago than this, e.g. 7d, 36h, 90m.")
        var olderThan: String

        func validate() throws {
            _ = try Self.milliseconds(self.olderThan)
        }

        static func milliseconds(_ text: String) throws -> Int64 {
            let units: [(String, Int64)] = [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)]
            for (suffix, unit) in units where text.hasSuffix(suffix) {
                if let value = Int64(text.dropLast()), value > 0, value <= Int64.max / unit {
                    return value * unit
                }
            }
            throw ValidationError("--older-than \"\(text)\" is not a duration such as 7d, 36h, 90m or 600s")
        }

        func run() async throws {
            try await withFleetDatabase(self.connection) { database in
                try await FleetSchema.check(database)
                let cutoff = WallClock.unixMilliseconds() - (try Self.milliseconds(self.olderThan))
                let report = try await FleetSchema.prune(database, olderThan: cutoff)
                ServeCommand.say("removed \(report.removedRows) change log rows; the oldest kept is \(report.oldestKept.map(String.init) ?? "none")")
            }
        }
    }

    struct Import: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Load a snapshot file's catalog and customers into an empty fleet database."
        )
        @OptionGroup var connection: PostgresOption
        @Option(help: "The snapshot file (from `snapshot build`, `generate`, or an embedded server's data directory after `compact`: writes still in its log are not in the file).")
        var snapshot: String

        func run() async throws {
            try await withFleetDatabase(self.connection) { database in
                try await FleetSchema.check(database)
                let count = try await FleetSnapshot.importSnapshot(database, from: self.snapshot)
                ServeCommand.say("imported \(count) customers from \(self.snapshot)")
            }
        }
    }
}

/// `entitlements snapshot export`: the fleet database as a snapshot file, stamped with the
/// change log's epoch and sequence, for sidecars to start from.
struct SnapshotExportCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "export",
        abstract: "Write the fleet database as a snapshot file that sidecars start from (docs/fleet.md)."
    )
    @OptionGroup var connection: PostgresOption
    @Option(help: "The snapshot to write; replaced atomically if it exists.")
    var output: String

    func run() async throws {
        try await withFleetDatabase(self.connection) { database in
            try await FleetSchema.check(database)
            let report = try await FleetSnapshot.export(database, to: self.output, now: WallClock.unixMilliseconds())
            ServeCommand.say("wrote \(self.output): \(report.customers) customers at sequence \(report.sequence) of epoch \(report.epoch)")
        }
    }
}
