import Dispatch
public import EntitlementsStore
import EntitlementsMessages
public import Logging
import NIOCore
import PostgresNIO
import Synchronization

/// Follows PostgreSQL's change log into the local store (docs/fleet.md, "Tail"): polls
/// `seq > cursor ORDER BY seq` every ``Configuration/pollInterval``, and at once when a
/// NOTIFY arrives on a dedicated LISTEN connection or a write through this server commits.
/// Each row is applied as a local write is (logged under its sequence, made visible,
/// cached answers dropped, watchers told), in sequence order. The cursor is the local
/// log's last sequence, so it survives a restart with the data directory.
public final class FleetTailer: Sendable {
    public struct Configuration: Sendable {
        /// How often the change log is polled when no NOTIFY arrives.
        public var pollInterval: Duration
        /// Rows read per query.
        public var batchSize: Int
        /// Whether to LISTEN for the writers' NOTIFY (off: polling only).
        public var listen: Bool

        public init(pollInterval: Duration = .milliseconds(250), batchSize: Int = 1_000, listen: Bool = true) {
            self.pollInterval = pollInterval
            self.batchSize = batchSize
            self.listen = listen
        }
    }

    /// What the tailer knows now (for /readyz, /metrics and logs).
    public struct Status: Sendable {
        /// The last sequence applied here.
        public var appliedSequence: UInt64 = 0
        /// The head of the change log at the last successful poll.
        public var headSequence: UInt64 = 0
        /// When the last poll succeeded (Unix milliseconds); nil before the first.
        public var lastSuccessfulPoll: Int64?
        /// The highest sequence the primary announced (a NOTIFY, a write through this
        /// server): a read replica short of it is behind, whatever its own head says.
        public var announced: UInt64 = 0
        /// Why the last poll failed, if it did.
        public var lastError: String?
        /// Polls that failed in a row.
        public var failuresInARow = 0
        /// The highest sequence a write through this server or a read asked for: while
        /// short of it, the next poll comes soon rather than after the interval (a read
        /// replica may not have replayed it yet).
        public var wanted: UInt64 = 0
        /// Until when `wanted` hurries polls (a sequence nobody wrote must not).
        var wantedUntil = ContinuousClock.now
    }

    /// Polls and exports go here: the primary, or a read replica of it (--fleet-read-url).
    private let database: FleetDatabase
    /// LISTEN goes here: the primary (a replica in recovery cannot LISTEN).
    private let primary: FleetDatabase
    /// Whether `database` is a replica, whose change log may lag the primary's.
    private var readsFromReplica: Bool { self.database !== self.primary }
    private let store: CustomerStore
    public let configuration: Configuration
    private let logger: Logger
    private let wakeup = Wakeup()
    private let state: Mutex<Status>

    /// - Parameters:
    ///   - database: where to poll: the primary, or a read replica of `primary`.
    ///   - primary: where to LISTEN; default `database`.
    public init(database: FleetDatabase, primary: FleetDatabase? = nil, store: CustomerStore, configuration: Configuration = Configuration(), logger: Logger) {
        self.database = database
        self.primary = primary ?? database
        self.store = store
        self.configuration = configuration
        self.logger = logger
        self.state = Mutex(Status(appliedSequence: store.committedSequence))
        // The store was just opened against the database (FleetSnapshot.openStore).
        store.confirmUpstreamContact(at: WallClock.unixMilliseconds())
    }

    public var status: Status { self.state.withLock { $0 } }

    /// Polls now (a write through this server committed, or a NOTIFY came, or a read
    /// waits for `sequence`); while short of `sequence`, polls again soon. `announced`: the
    /// primary holds `sequence` (a commit or a NOTIFY, not a client's wish), so this server
    /// is not current until it has applied it.
    public func poke(upTo sequence: UInt64 = 0, announced: Bool = false) {
        if sequence > 0 {
            self.state.withLock { status in
                status.wanted = max(status.wanted, sequence)
                status.wantedUntil = .now + Self.hurryFor
                if announced {
                    status.announced = max(status.announced, sequence)
                }
            }
        }
        self.wakeup.signal()
    }

    /// How long until the next poll: the interval, or a few milliseconds while a write or a
    /// read waits for a sequence not applied yet (for at most ``hurryFor``).
    private var nextPollIn: Duration {
        let behind = self.state.withLock { status in
            status.wanted > status.appliedSequence && status.failuresInARow == 0 && ContinuousClock.now < status.wantedUntil
        }
        return behind ? .milliseconds(5) : self.configuration.pollInterval
    }

    /// How long a sequence asked for hurries the polls.
    static let hurryFor = Duration.seconds(1)

    /// Tails until cancelled. Throws a ``FleetError`` of kind `.rebootstrap` when the
    /// change log can no longer be followed from here (another epoch, or rows pruned past
    /// the cursor): the server must start again from a snapshot; of kind `.dataDirectory`
    /// when the database has lost writes this server applied (its change log ends before
    /// this server's cursor, or holds other rows at sequences this server applied, in the
    /// same epoch); of kind `.local` when this server cannot apply a row.
    public func run() async throws {
        try await withThrowingTaskGroup(of: Void.self) { group in
            if self.configuration.listen {
                group.addTask { await self.listenLoop() }
            }
            group.addTask { try await self.pollLoop() }
            defer { group.cancelAll() }
            try await group.next()
        }
    }

    private func pollLoop() async throws {
        while !Task.isCancelled {
            do {
                try await self.catchUp()
            } catch let error as FleetError where [.rebootstrap, .local, .dataDirectory].contains(error.kind) {
                self.state.withLock { $0.lastError = error.message }
                throw error
            } catch let gap as ReplicationGap {
                let error = FleetError(.rebootstrap, "\(gap)")
                self.state.withLock { $0.lastError = error.message }
                throw error
            } catch {
                if Task.isCancelled {
                    return
                }
                let message = FleetError.describe(error)
                let first = self.state.withLock { status -> Bool in
                    status.lastError = message
                    status.failuresInARow += 1
                    return status.failuresInARow == 1
                }
                if first {
                    self.logger.warning("fleet: polling the change log failed; serving what is applied until PostgreSQL answers again", metadata: ["fleet.error": "\(message)"])
                }
            }
            await withTaskCancellationHandler {
                await self.wakeup.wait(timeout: self.nextPollIn)
            } onCancel: {
                self.wakeup.signal()
            }
        }
    }

    /// Applies every row after the cursor.
    func catchUp() async throws {
        while true {
            let cursor = self.store.committedSequence
            let epoch = self.store.snapshot.header.fleetEpoch
            let asked = WallClock.unixMilliseconds()
            let cursorCommitted = self.store.replicatedCommitDate(of: cursor)
            let batch = try await self.database.withConnection { connection -> (head: UInt64, rows: [CustomerStore.ReplicatedEntry]) in
                // The head, and when the row at the cursor was committed: one round trip.
                let (headEpoch, head, atCursor) = try await Self.head(on: connection, logger: self.logger, committedDateOf: cursor)
                if let cursorCommitted, let atCursor, cursorCommitted != atCursor {
                    throw Self.rewritten(cursor, applied: cursorCommitted, found: atCursor)
                }
                guard headEpoch == epoch else {
                    throw FleetError(
                        .rebootstrap,
                        "the database's change log is epoch \(headEpoch), this server's data is from epoch \(epoch ?? "none") (a restore or failover started a new history)"
                    )
                }
                guard head > cursor else {
                    // A replica behind this server's cursor is lagging (the cursor came
                    // from it or from the primary at start-up): wait for it.
                    if head < cursor, !self.readsFromReplica {
                        throw FleetError(
                            .dataDirectory,
                            "the database's change log (same epoch) ends at \(head), but this server has applied up to \(cursor): the database lost writes (restored without a new epoch?), and this server's data directory may be their only copy"
                        )
                    }
                    return (head, [])
                }
                let rows = try await connection.query(
                    """
                    SELECT seq, record, (extract(epoch FROM committed_at) * 1000)::bigint FROM change_log
                    WHERE seq > \(Int64(cursor)) ORDER BY seq LIMIT \(Int64(self.configuration.batchSize))
                    """,
                    logger: self.logger
                )
                var entries: [CustomerStore.ReplicatedEntry] = []
                for try await (sequence, bytes, committed) in rows.decode((Int64, ByteBuffer, Int64).self) {
                    let write: ReplicatedWrite
                    do {
                        write = try ReplicatedWrite(buffer: bytes)
                    } catch {
                        throw FleetError(.local, "change_log row \(sequence) does not decode (\(error)); a newer binary may have written it")
                    }
                    entries.append(CustomerStore.ReplicatedEntry(sequence: UInt64(sequence), write: write, recordedDate: committed))
                }
                return (head, entries)
            }
            if let first = batch.rows.first, first.sequence != cursor + 1 {
                throw FleetError(
                    .rebootstrap,
                    "the change log's rows after \(cursor) start at \(first.sequence): rows \(cursor + 1) to \(first.sequence - 1) were pruned while this server was behind"
                )
            }
            if batch.rows.isEmpty, batch.head > cursor, !self.readsFromReplica {
                // The newest row is never pruned, so on one database this is a prune past
                // the cursor. Through a pooler in front of several replicas the head and the
                // rows may come from two replicas: lag, polled again.
                throw FleetError(.rebootstrap, "the change log's head is \(batch.head) but it holds no row after \(cursor): pruned while this server was behind")
            }
            // Current once these rows are applied: nothing left up to the head, nor up to
            // what the primary announced (a read replica may be behind it). Said before the
            // rows become visible, so that a read that waited for them is not answered as
            // stale; if applying fails, tailing stops and the server with it.
            let reached = batch.rows.last?.sequence ?? cursor
            if self.state.withLock({ reached >= batch.head && reached >= $0.announced }) {
                // What --max-staleness measures (docs/fleet.md, "Staleness").
                self.store.confirmUpstreamContact(at: asked)
            }
            do {
                try await self.store.applyReplicated(batch.rows)
            } catch let gap as ReplicationGap {
                throw gap
            } catch {
                throw FleetError(.local, "this server cannot apply the change log: \(error)")
            }
            let applied = self.store.committedSequence
            let recovered = self.state.withLock { status -> Bool in
                status.appliedSequence = applied
                status.headSequence = batch.head
                status.lastSuccessfulPoll = asked
                status.lastError = nil
                defer { status.failuresInARow = 0 }
                return status.failuresInARow > 0
            }
            if recovered {
                self.logger.notice("fleet: polling the change log works again", metadata: ["fleet.applied": "\(applied)"])
            }
            if batch.rows.count < self.configuration.batchSize || applied >= batch.head {
                return
            }
        }
    }

    /// The change log's epoch and last sequence.
    static func head(on connection: PostgresConnection, logger: Logger) async throws -> (String, UInt64) {
        let (epoch, sequence, _) = try await Self.head(on: connection, logger: logger, committedDateOf: 0)
        return (epoch, sequence)
    }

    /// The epoch and head of the change log, and when its row `sequence` was committed
    /// (Unix milliseconds; nil without such a row).
    static func head(on connection: PostgresConnection, logger: Logger, committedDateOf sequence: UInt64) async throws -> (String, UInt64, Int64?) {
        let rows = try await connection.query(
            """
            SELECT h.epoch::text, h.seq,
                (SELECT (extract(epoch FROM l.committed_at) * 1000)::bigint FROM change_log l WHERE l.seq = \(Int64(sequence)))
            FROM change_head h
            """,
            logger: logger
        )
        for try await (epoch, head, committed) in rows.decode((String, Int64, Int64?).self) {
            return (epoch, UInt64(head), committed)
        }
        throw FleetError(.schema, "change_head has no row: run `entitlements db migrate`")
    }

    /// When the change log's row `sequence` was committed (Unix milliseconds); nil
    /// without such a row.
    static func committedDate(of sequence: UInt64, on connection: PostgresConnection, logger: Logger) async throws -> Int64? {
        try await Self.head(on: connection, logger: logger, committedDateOf: sequence).2
    }

    /// The change log holds, at a sequence this server applied, a row committed at another
    /// time: another history in the same epoch (a restore that kept its epoch, then new
    /// writes). This server's data may hold writes the database lost.
    static func rewritten(_ sequence: UInt64, applied: Int64, found: Int64) -> FleetError {
        FleetError(
            .dataDirectory,
            "the change log's row \(sequence) was committed at \(found) (Unix ms), but the row \(sequence) this server applied was committed at \(applied): the database's history was rewritten in the same epoch (restored without a new epoch?), and this server's data directory may hold writes the database lost"
        )
    }

    /// LISTENs on a connection of its own and pokes the poller on each NOTIFY; after a
    /// lost connection it reconnects (and the poller polls first, as it does every
    /// interval anyway).
    private func listenLoop() async {
        while !Task.isCancelled {
            do {
                let connection = try await self.primary.connect()
                do {
                    try await connection.listen(on: FleetWriter.notifyChannel) { notifications in
                        // Whatever was committed before LISTEN took effect is found by polling.
                        self.poke()
                        for try await notification in notifications {
                            self.poke(upTo: UInt64(notification.payload) ?? 0, announced: true)
                        }
                    }
                } catch {
                    if !Task.isCancelled {
                        self.logger.debug("fleet: the LISTEN connection ended", metadata: ["fleet.error": "\(FleetError.describe(error))"])
                    }
                }
                try? await connection.close()
            } catch {
                // PostgreSQL unreachable: polling reports it; try again after an interval.
            }
            try? await Task.sleep(for: self.configuration.pollInterval)
        }
    }
}

/// Wakes one waiter early; a signal with nobody waiting is kept for the next wait.
final class Wakeup: Sendable {
    private struct State {
        var pending = false
        var waiter: (id: UInt64, continuation: CheckedContinuation<Void, Never>)?
        var nextId: UInt64 = 0
    }

    private let state = Mutex(State())

    func signal() {
        let waiter = self.state.withLock { state -> CheckedContinuation<Void, Never>? in
            guard let waiter = state.waiter else {
                state.pending = true
                return nil
            }
            state.waiter = nil
            return waiter.continuation
        }
        waiter?.resume()
    }

    func wait(timeout: Duration) async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let id = self.state.withLock { state -> UInt64? in
                if state.pending {
                    state.pending = false
                    return nil
                }
                state.nextId += 1
                state.waiter = (state.nextId, continuation)
                return state.nextId
            }
            guard let id else {
                continuation.resume()
                return
            }
            let nanoseconds = timeout.components.seconds * 1_000_000_000 + timeout.components.attoseconds / 1_000_000_000
            DispatchQueue.global().asyncAfter(deadline: .now() + .nanoseconds(Int(nanoseconds))) {
                let timedOut = self.state.withLock { state -> CheckedContinuation<Void, Never>? in
                    guard let waiter = state.waiter, waiter.id == id else { return nil }
                    state.waiter = nil
                    return waiter.continuation
                }
                timedOut?.resume()
            }
        }
    }
}
