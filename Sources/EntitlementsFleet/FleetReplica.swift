public import EntitlementsStore
public import Logging

/// One server's part of a fleet (docs/fleet.md): its data directory, opened from the
/// shared database's change log, its writes sent to that database, and the tailer that
/// keeps it current. `serve --postgres` runs one; tests run several in one process.
public final class FleetReplica: Sendable {
    public struct Configuration: Sendable {
        public var tailer: FleetTailer.Configuration
        /// How long a write waits after COMMIT for this server to apply it.
        public var writeWait: Duration
        public var storeOptions: CustomerStore.Options
        /// Connections to PostgreSQL for writes and polls (the LISTEN connection is one more).
        public var connections: Int
        /// A read replica of the database (or a pooler in front of replicas) to poll and to
        /// export from at a fresh start, instead of the primary; nil: the primary.
        public var readURL: FleetDatabaseURL?

        public init(
            tailer: FleetTailer.Configuration = .init(),
            writeWait: Duration = .seconds(1),
            storeOptions: CustomerStore.Options = .init(),
            connections: Int = 4,
            readURL: FleetDatabaseURL? = nil
        ) {
            self.tailer = tailer
            self.writeWait = writeWait
            self.storeOptions = storeOptions
            self.connections = connections
            self.readURL = readURL
        }
    }

    public let store: CustomerStore
    public let tailer: FleetTailer
    /// The primary: writes, LISTEN, and the start-up checks.
    public let database: FleetDatabase
    /// The read replica polls and exports go to, if one was given.
    public let reads: FleetDatabase?
    /// What opening the data directory did (continued, seeded, exported), for the log.
    public let startup: String
    public let openReport: CustomerStore.OpenReport

    private init(store: CustomerStore, tailer: FleetTailer, database: FleetDatabase, reads: FleetDatabase?, startup: String, openReport: CustomerStore.OpenReport) {
        self.store = store
        self.tailer = tailer
        self.database = database
        self.reads = reads
        self.startup = startup
        self.openReport = openReport
    }

    /// Checks the database's schema, opens the data directory (or starts it afresh from
    /// `seed` or an export), and sends the store's writes to the database. The tailer is
    /// not running yet: run ``FleetTailer/run()``.
    public static func open(
        url: FleetDatabaseURL,
        dataDirectory: String,
        seed: String?,
        configuration: Configuration = Configuration(),
        logger: Logger,
        now: Int64
    ) async throws -> FleetReplica {
        let database = FleetDatabase(url: url, maximumConnections: configuration.connections, logger: logger)
        let reads = configuration.readURL.map { FleetDatabase(url: $0, maximumConnections: configuration.connections, logger: logger) }
        do {
            try await FleetSchema.check(database)
            // Advisory: a database that cannot say (an odd setting, a timeout) still starts.
            do {
                for warning in try await FleetSchema.durabilityWarnings(database) {
                    logger.warning("\(warning)")
                }
            } catch {
                logger.notice("could not read PostgreSQL's fsync and full_page_writes settings: \(FleetError.describe(error))")
            }
            let (store, report, startup) = try await FleetSnapshot.openStore(
                dataDirectory: dataDirectory,
                seed: seed,
                database: database,
                exportFrom: reads,
                options: configuration.storeOptions,
                now: now
            )
            let tailer = FleetTailer(database: reads ?? database, primary: database, store: store, configuration: configuration.tailer, logger: logger)
            // Before any listener opens: no write may reach the local log directly, whose
            // sequence numbers are the change log's.
            store.forwardWrites(
                to: FleetWriter(database: database, catalog: store.catalog) { tailer.poke(upTo: $0, announced: true) },
                applyWait: configuration.writeWait,
                catchUp: { tailer.poke(upTo: $0) }
            )
            return FleetReplica(store: store, tailer: tailer, database: database, reads: reads, startup: startup, openReport: report)
        } catch {
            await database.close()
            await reads?.close()
            throw error
        }
    }

    /// Stops the store's log and closes the database connections (the tailer must have
    /// stopped).
    public func close() async {
        self.store.close()
        self.store.unlock()
        await self.database.close()
        await self.reads?.close()
    }
}
