import CEntitlementsShim
import Dispatch
public import EntitlementsMessages
public import EntitlementsResolver
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The customers as they are now: the snapshot, with the writes since it applied on top
/// (an in-memory overlay), and the write-ahead log that makes those writes durable.
///
/// - **Reads** (``customer(for:)``) see only acknowledged writes: a write's effect reaches
///   the readers' overlay after its log record is fsynced.
/// - **Writes** are computed under one lock against the newest state (including writes
///   not yet durable), queued to the log in that order, and applied for readers in log
///   order by the log's writer thread.
/// - **Compaction** writes a new snapshot (old snapshot + overlay) beside the serving one,
///   renames it into place, then removes the log segments it covers. Checks and writes go
///   on meanwhile. See docs/durability.md for the crash analysis.
///
/// Without a data directory (``readOnly(_:)``) the store serves the snapshot and refuses
/// writes.
public final class CustomerStore: Sendable {
    /// How the store runs.
    public struct Options: Sendable {
        /// When the log fsyncs (both modes are safe).
        public var syncMode: WriteAheadLog.SyncMode
        /// Compact when the log holds this many bytes; nil: only when asked.
        public var compactAfterLogBytes: UInt64?
        /// How far back a customer's history reaches at least, in milliseconds: what a
        /// compaction keeps in `DIR/history/` (``HistoryArchive``); nil keeps nothing (a
        /// history then starts at the last compaction).
        public var historyRetention: Int64?
        /// Told of each write the log replays at opening (past the snapshot), in order, as
        /// ``observeCommits(_:)`` is told of each new one: for what is derived from the
        /// writes and kept apart from the log (the outbound events' outbox).
        public var replayed: (@Sendable (CommittedWrite) -> Void)?

        public init(
            syncMode: WriteAheadLog.SyncMode = .batch,
            compactAfterLogBytes: UInt64? = 64 << 20,
            historyRetention: Int64? = 7 * 86_400_000,
            replayed: (@Sendable (CommittedWrite) -> Void)? = nil
        ) {
            self.syncMode = syncMode
            self.compactAfterLogBytes = compactAfterLogBytes
            self.historyRetention = historyRetention
            self.replayed = replayed
        }

        /// The archive of `directory` these options keep, or nil.
        func historyArchive(of directory: String) -> HistoryArchive? {
            self.historyRetention.flatMap { $0 > 0 ? HistoryArchive(dataDirectory: directory, retention: $0) : nil }
        }
    }

    /// What opening a data directory found.
    public struct OpenReport: Sendable {
        /// Whether the snapshot was copied in from the seed (a new data directory).
        public var seeded = false
        /// Log records applied on top of the snapshot.
        public var replayedRecords = 0
        /// Log records the snapshot already held (skipped).
        public var skippedRecords = 0
        /// A torn last batch that was dropped: segment, offset, bytes.
        public var tornPath: String?
        public var tornOffset: UInt64?
        public var tornBytes: UInt64 = 0
        /// Where the torn bytes were kept, and what is known of them.
        public var tornSideFile: String?
        public var torn: WriteAheadLog.TornTail?
        /// Stale temporary files removed (a crash during compaction).
        public var removedTemporaryFiles: [String] = []
    }

    /// A write that is now durable and visible to readers.
    public struct CommittedWrite: Sendable {
        public var sequence: UInt64
        /// When the write was received (Unix milliseconds): the instant its rules used.
        public var recordedDate: Int64
        public var effect: WriteEffect
        /// The records the write replaced, as readers saw them just before: id -> record
        /// (nil if the customer did not exist).
        public var before: [String: CustomerRecord?]
    }

    /// The answer to a write.
    public struct WriteOutcome: Sendable {
        public var customerId: String
        /// The write's log sequence; nil when it changed nothing (nothing was logged).
        /// Through an upstream (fleet mode), an unchanged write answers the sequence of the
        /// customer's last change, so that a retry still gives a read-your-writes token.
        public var sequence: UInt64?
        public var created: Bool
        /// What readers now see; nil when the write changed nothing, or was made upstream.
        public var committed: CommittedWrite?
        /// Whether the write changed anything.
        public var changed: Bool

        init(customerId: String, sequence: UInt64?, created: Bool, committed: CommittedWrite?, changed: Bool? = nil) {
            self.customerId = customerId
            self.sequence = sequence
            self.created = created
            self.committed = committed
            self.changed = changed ?? (committed != nil)
        }
    }

    /// A write the upstream made durable (fleet mode).
    public struct UpstreamWrite: Sendable {
        public var customerId: String
        /// The write's sequence in the upstream's change log (for an unchanged write, the
        /// customer's last change; 0 if none).
        public var sequence: UInt64
        public var changed: Bool
        public var created: Bool

        public init(customerId: String, sequence: UInt64, changed: Bool, created: Bool) {
            self.customerId = customerId
            self.sequence = sequence
            self.changed = changed
            self.created = created
        }
    }

    /// A write made upstream, as the store applies it (``applyReplicated(_:)``).
    public struct ReplicatedEntry: Sendable {
        public var sequence: UInt64
        public var write: ReplicatedWrite
        /// When the upstream committed it (Unix milliseconds).
        public var recordedDate: Int64

        public init(sequence: UInt64, write: ReplicatedWrite, recordedDate: Int64) {
            self.sequence = sequence
            self.write = write
            self.recordedDate = recordedDate
        }
    }

    /// What a compaction did.
    public struct CompactionReport: Sendable {
        public var snapshotId: String
        public var lastLogSequence: UInt64
        public var customers: UInt64
        public var removedSegments: [String]
        /// Why what a customer's history needs could not all be kept (the compaction
        /// itself succeeded; the history then starts later than the retention says).
        public var historyProblems: [String] = []
    }

    /// The file names inside a data directory (docs/durability.md).
    public static let snapshotFileName = "snapshot.snap"
    public static let logDirectoryName = "log"
    public static let lockFileName = "LOCK"

    public let catalog: ProductCatalog
    public let options: Options
    /// The data directory; nil for a read-only store.
    public let dataDirectory: String?
    private let log: WriteAheadLog?
    private let lockFD: Int32
    private let state: Mutex<State>

    private struct State {
        var snapshot: SnapshotReader
        /// What readers see: acknowledged writes only.
        var committed = Overlay()
        var committedSequence: UInt64
        /// What writers compute against: every queued write.
        var latest = Overlay()
        /// Writes up to this one are durable, visible, and their ``onCommit`` work is done
        /// (the server: caches invalidated): what an unchanged write waits for.
        var acknowledgedSequence: UInt64 = 0
        /// Writes after `acknowledgedSequence` whose commit work finished early.
        var finishedEarly: Set<UInt64> = []
        /// Waiting for `acknowledgedSequence` to reach a sequence (or for the log to fail).
        var barriers: [(sequence: UInt64, id: UInt64, resume: @Sendable (_ durable: Bool) -> Void)] = []
        var logFailed = false
        var compacting = false
        var compactions = 0
        var onCommit: (@Sendable (CommittedWrite, @escaping @Sendable () -> Void) -> Void)?
        var observers: [@Sendable (CommittedWrite) -> Void] = []
        var beforeCompacting: [@Sendable (UInt64) throws -> Void] = []
        /// Fleet mode: where writes go instead of the local log.
        var upstream: (any WriteUpstream)?
        var upstreamApplyWait: Duration = .seconds(1)
        /// Asks the upstream's tailer to poll now (a read waits for a sequence).
        var catchUp: (@Sendable (UInt64) -> Void)?
        /// Identifies barriers, so that a bounded wait that ran out withdraws its own (1 on;
        /// 0 for barriers never withdrawn).
        var nextBarrierId: UInt64 = 1
        /// Fleet mode: the newest replicated write logged here and when the upstream
        /// committed it, if known (to tell it from another write a rewritten history puts
        /// at the same sequence).
        var lastReplicated: (sequence: UInt64, committedDate: Int64)?
    }

    /// Sends every write to `upstream` (fleet mode) instead of the local log: the local log
    /// then takes only the upstream's writes, through ``applyReplicated(_:)``, numbered as
    /// the upstream numbered them. A write is acknowledged once the upstream made it
    /// durable and, within `applyWait`, this store has applied it too (so the writer reads
    /// its own write here); past that it is acknowledged anyway, with its sequence.
    /// `catchUp` asks for the upstream's new writes, up to a sequence, now
    /// (``requestCatchUp(to:)``).
    public func forwardWrites(to upstream: any WriteUpstream, applyWait: Duration, catchUp: @escaping @Sendable (UInt64) -> Void = { _ in }) {
        self.state.withLock { state in
            state.upstream = upstream
            state.upstreamApplyWait = applyWait
            state.catchUp = catchUp
        }
    }

    /// The last sequence acknowledged here: every write up to it is visible and its cached
    /// answers are dropped.
    public var appliedSequence: UInt64 { self.state.withLock { $0.acknowledgedSequence } }

    /// Fleet mode: when the upstream last confirmed that this store had applied every write
    /// it holds (Unix milliseconds); 0 for a store that is its own source of truth. A
    /// plain atomic: every check of a server with a staleness bound reads it.
    private let upstreamContact = Atomic<Int64>(0)

    /// The upstream confirmed, at `instant`, that this store is current (its tailer found
    /// nothing left to apply up to the head of the change log and every sequence the
    /// primary announced).
    public func confirmUpstreamContact(at instant: Int64) {
        self.upstreamContact.store(instant, ordering: .relaxed)
    }

    /// When the upstream last confirmed this store current; nil when it has no upstream.
    public var lastUpstreamContact: Int64? {
        let instant = self.upstreamContact.load(ordering: .relaxed)
        return instant == 0 ? nil : instant
    }

    /// A read waits for writes up to `sequence`, which this store has not applied: fleet
    /// mode polls now, and again soon while it is short of it.
    public func requestCatchUp(to sequence: UInt64) {
        self.state.withLock { $0.catchUp }?(sequence)
    }

    /// Work to do when a write has become durable and visible, before it is acknowledged
    /// (the server drops cached answers and tells watchers); it calls the closure it is
    /// given when done. Runs on the log's writer thread, in sequence order.
    public func onCommit(_ work: @escaping @Sendable (CommittedWrite, @escaping @Sendable () -> Void) -> Void) {
        self.state.withLock { $0.onCommit = work }
    }

    /// Tells `observer` of each write once it is durable and visible, before the
    /// ``onCommit(_:)`` work and so before it is acknowledged: on the log's writer thread, in
    /// sequence order, so it must be quick. With ``Options/replayed`` and
    /// ``beforeCompacting(_:)``, what an observer derives from the writes can be kept
    /// lazily: every write it was not yet told of durably is still in the log.
    public func observeCommits(_ observer: @escaping @Sendable (CommittedWrite) -> Void) {
        self.state.withLock { $0.observers.append(observer) }
    }

    /// `work` runs before a compaction folds the writes up to a sequence into a snapshot
    /// (and removes their log), with that sequence. It must make durable what it derived
    /// from those writes; the last of them may still be being told to the observers (on
    /// the writer thread, just after they became visible), so it waits for them if it must.
    /// If it throws, the compaction fails and the log is kept.
    public func beforeCompacting(_ work: @escaping @Sendable (UInt64) throws -> Void) {
        self.state.withLock { $0.beforeCompacting.append(work) }
    }

    private init(snapshot: SnapshotReader, dataDirectory: String?, log: WriteAheadLog?, lockFD: Int32, options: Options) {
        self.catalog = ProductCatalog(snapshot.catalog)
        self.options = options
        self.dataDirectory = dataDirectory
        self.log = log
        self.lockFD = lockFD
        let covered = snapshot.header.lastLogSequence ?? 0
        var state = State(snapshot: snapshot, committedSequence: covered, acknowledgedSequence: covered)
        state.lastReplicated = snapshot.header.fleetCommittedDate.map { (covered, $0) }
        self.state = Mutex(state)
    }

    deinit {
        if self.lockFD >= 0 {
            Glibc.close(self.lockFD)
        }
    }

    /// A store that serves `snapshot` and refuses writes.
    public static func readOnly(_ snapshot: SnapshotReader) -> CustomerStore {
        CustomerStore(snapshot: snapshot, dataDirectory: nil, log: nil, lockFD: -1, options: Options(compactAfterLogBytes: nil))
    }

    /// Opens the data directory `directory` (created if missing): locks it against a second
    /// server, removes what a crash mid-compaction left, opens its snapshot (copied in from
    /// `seed` first if the directory has none), and replays the log on top.
    public static func open(dataDirectory directory: String, seed: String?, options: Options = Options()) throws -> (CustomerStore, OpenReport) {
        var report = OpenReport()
        try FileDescriptor.makeDirectory(directory, what: "the data directory")
        let lockPath = "\(directory)/\(Self.lockFileName)"
        let lockFD = Glibc.open(lockPath, O_RDWR | O_CREAT | O_CLOEXEC, 0o644)
        guard lockFD >= 0 else {
            throw SnapshotError(code: .io, path: lockPath, reason: "cannot open the lock file: \(String(cString: strerror(errno)))")
        }
        guard flock(lockFD, LOCK_EX | LOCK_NB) == 0 else {
            Glibc.close(lockFD)
            throw SnapshotError(code: .io, path: directory, reason: "another server is using this data directory (it holds \(Self.lockFileName))")
        }
        do {
            report.removedTemporaryFiles = try Self.removeTemporaryFiles(in: directory)
            if options.historyArchive(of: directory) == nil {
                HistoryArchive.remove(dataDirectory: directory)  // history switched off: keep nothing
            }
            let snapshotPath = "\(directory)/\(Self.snapshotFileName)"
            if access(snapshotPath, F_OK) != 0 {
                guard let seed else {
                    throw SnapshotError(
                        code: .io,
                        path: snapshotPath,
                        reason: "the data directory has no snapshot; start once with --snapshot FILE to seed it"
                    )
                }
                try Self.copy(seed, to: snapshotPath)
                report.seeded = true
            }
            let snapshot = try SnapshotReader(path: snapshotPath)
            let covered = snapshot.header.lastLogSequence ?? 0
            let logDirectory = "\(directory)/\(Self.logDirectoryName)"
            // The replaying store does not own the lock; the one returned does.
            let store = CustomerStore(snapshot: snapshot, dataDirectory: directory, log: nil, lockFD: -1, options: options)
            // Records are applied as they are read: the log is never all in memory.
            let (log, replay) = try WriteAheadLog.open(
                directory: logDirectory,
                lastSnapshotSequence: covered,
                syncMode: options.syncMode
            ) { record in
                guard record.sequence > covered else {
                    report.skippedRecords += 1
                    return
                }
                try store.replay(record, logDirectory: logDirectory)
                report.replayedRecords += 1
            }
            report.tornPath = replay.tornPath
            report.tornOffset = replay.tornOffset
            report.tornBytes = replay.tornBytes
            report.tornSideFile = replay.tornSideFile
            report.torn = replay.torn
            ent_release_free_memory()  // replay's garbage: superseded copies of records
            return (store.taking(log: log, lockFD: lockFD), report)
        } catch {
            Glibc.close(lockFD)
            throw error
        }
    }

    /// This store, taking writes to `log` (after replay).
    private func taking(log: WriteAheadLog, lockFD: Int32) -> CustomerStore {
        let store = CustomerStore(snapshot: self.snapshot, dataDirectory: self.dataDirectory, log: log, lockFD: lockFD, options: self.options)
        self.state.withLock { replayed in
            store.state.withLock { state in
                state.committed = replayed.committed
                state.latest = replayed.latest
                state.committedSequence = replayed.committedSequence
                state.acknowledgedSequence = replayed.committedSequence
                state.lastReplicated = replayed.lastReplicated
            }
        }
        return store
    }

    /// Applies a replayed log record to both overlays.
    private func replay(_ record: LogRecord, logDirectory: String) throws {
        guard let mutation = record.mutation else {
            throw SnapshotError(code: .corrupt, path: logDirectory, reason: "log record \(record.sequence) has no mutation")
        }
        let replayed = try self.state.withLock { state -> CommittedWrite? in
            let snapshot = state.snapshot
            let effect: WriteEffect
            do {
                effect = try self.effect(of: mutation, now: record.recordedDate ?? 0, latest: state.latest, snapshot: snapshot, replaying: true)
            } catch {
                throw SnapshotError(code: .corrupt, path: logDirectory, reason: "log record \(record.sequence) cannot be applied again: \(error)")
            }
            let write = self.options.replayed.map { _ in
                CommittedWrite(sequence: record.sequence, recordedDate: record.recordedDate ?? 0, effect: effect, before: Self.before(effect, in: state))
            }
            state.latest.apply(effect, sequence: record.sequence)
            state.committed.apply(effect, sequence: record.sequence)
            state.committedSequence = record.sequence
            if case .replicatedWrite = mutation, let date = record.recordedDate {
                state.lastReplicated = (record.sequence, date)
            }
            return write
        }
        if let replayed {
            self.options.replayed?(replayed)
        }
    }

    /// The records `effect` replaces, as readers see them in `state`.
    private static func before(_ effect: WriteEffect, in state: State) -> [String: CustomerRecord?] {
        var before: [String: CustomerRecord?] = [:]
        for id in effect.records.keys {
            before[id] = .some((try? state.committed.customer(for: id, snapshot: state.snapshot)) ?? nil)
        }
        return before
    }

    // MARK: Reading

    /// The snapshot being served (it changes when a compaction finishes).
    public var snapshot: SnapshotReader { self.state.withLock { $0.snapshot } }

    /// The sequence of the last acknowledged write.
    public var committedSequence: UInt64 { self.state.withLock { $0.committedSequence } }

    /// Fleet mode: when the upstream committed the replicated write at `sequence`, if that
    /// is the newest one logged here and its time is known (from the log, or from the
    /// snapshot's header when the snapshot ends there).
    public func replicatedCommitDate(of sequence: UInt64) -> Int64? {
        self.state.withLock { state in
            state.lastReplicated.flatMap { $0.sequence == sequence ? $0.committedDate : nil }
        }
    }

    /// Customers written since the snapshot (the overlay's size).
    public var overlayCount: Int { self.state.withLock { $0.committed.customers.count } }

    /// The log's bytes on disk; 0 without a data directory.
    public var logBytes: UInt64 { self.log?.diskBytes ?? 0 }

    /// Whether the store takes writes.
    public var isWritable: Bool { self.log != nil }

    /// The current record of the customer `userId` names (a customer id or an alias), as
    /// of the last acknowledged write; nil for an unknown user.
    ///
    /// The snapshot is read outside the lock; if a compaction swapped the snapshot
    /// meanwhile, the lookup starts again.
    public func customer(for userId: String) throws -> CustomerRecord? {
        try self.customerRead(for: userId).record
    }

    /// The current record of the customer `userId` names, and the log sequence it was read
    /// at: every write up to that sequence is in it, and none after. Both come from one
    /// moment under the lock (the snapshot itself is read outside it). With `mayWait` false
    /// the snapshot read throws ``WouldWait`` rather than wait for the disk.
    public func customerRead(for userId: String, mayWait: Bool = true) throws -> (record: CustomerRecord?, sequence: UInt64) {
        while true {
            let (found, snapshot, sequence) = self.state.withLock { state in
                (state.committed.find(userId), state.snapshot, state.committedSequence)
            }
            let record: CustomerRecord?
            switch found {
            case .record(let record):
                return (record, sequence)
            case .snapshotId(let id):
                record = try snapshot.customer(for: id, mayWait: mayWait).flatMap { $0.id == id ? $0 : nil }
            case .notWritten:
                record = try snapshot.customer(for: userId, mayWait: mayWait)
            }
            guard let record, let id = record.id else {
                // Unknown at the first look: the snapshot never changes, so `sequence` is
                // the moment this answer holds for.
                return (nil, sequence)
            }
            // The snapshot's record, unless a write replaced it since.
            let current: (CustomerRecord?, UInt64)? = self.state.withLock { state in
                guard state.snapshot === snapshot else {
                    return nil  // compacted meanwhile: look again
                }
                if let entry = state.committed.customers[ExactId(id)] {
                    return (entry.record, state.committedSequence)
                }
                return (record, state.committedSequence)
            }
            if let current {
                return current
            }
        }
    }

    /// Calls `body` with every customer's current record, once each, in no set order: the
    /// snapshot's records (those a write replaced since, as written) and then the customers
    /// only written since. It reads one moment's overlay and the snapshot of that moment,
    /// so writes made meanwhile may be missed; it decodes every record (docs/ingestion.md,
    /// "Missed notifications", says what a scan costs). `body` returns false to stop.
    public func forEachCustomer(_ body: (CustomerRecord) throws -> Bool) throws {
        let (overlay, snapshot) = self.state.withLock { ($0.committed, $0.snapshot) }
        var replaced = Set<ExactId>()
        var going = true
        struct Stop: Error {}
        do {
            try snapshot.forEachRecord { record, _ in
                guard let id = record.id.map(ExactId.init) else { return }
                if let entry = overlay.customers[id] {
                    replaced.insert(id)
                    if let current = entry.record {
                        going = try body(current)
                    }
                } else {
                    going = try body(record)
                }
                if !going { throw Stop() }
            }
        } catch is Stop {
            return
        }
        for (id, entry) in overlay.customers where !replaced.contains(id) {
            if let record = entry.record, try !body(record) {
                return
            }
        }
    }

    /// The customers written after `sequence`, if the overlay still knows them all (nil
    /// when `sequence` is older than the snapshot's last sequence: compaction folded the
    /// writes in between, and the snapshot does not say whom they touched).
    public func customersChanged(after sequence: UInt64) -> [String]? {
        self.state.withLock { state in
            guard sequence >= (state.snapshot.header.lastLogSequence ?? 0) else {
                return nil
            }
            return state.committed.customers.compactMap { $0.value.sequence > sequence ? $0.key.string : nil }
        }
    }

    /// The sequence of the last write that may have changed customer `customerId`: its
    /// last logged write since the snapshot, else the snapshot's last sequence (the
    /// snapshot does not say which customer each folded write touched).
    public func lastChange(of customerId: String) -> UInt64 {
        self.state.withLock { state in
            state.committed.customers[ExactId(customerId)]?.sequence ?? (state.snapshot.header.lastLogSequence ?? 0)
        }
    }

    /// The customer's record and the sequence of the last write it reflects, read
    /// together (watch streams compare later writes' sequences with it).
    public func customerAndSequence(for userId: String) throws -> (CustomerRecord?, UInt64) {
        try self.state.withLock { state in
            (try state.committed.customer(for: userId, snapshot: state.snapshot), state.committedSequence)
        }
    }

    // MARK: Writing

    /// Validates and applies `mutation`, received at `now`. `completion` runs once the
    /// write is durable and visible to readers (on the log's writer thread), or at once
    /// for a refused write. A write that changes nothing is not logged; it completes once
    /// every write queued before it is durable (it may depend on one of them).
    public func write(
        _ mutation: LogRecord.Mutation,
        now: Int64,
        source: WriteSource? = nil,
        completion: @escaping @Sendable (Result<WriteOutcome, any Error>) -> Void
    ) {
        guard let log = self.log else {
            completion(.failure(WriteRefusal(.unavailable, "this server has no data directory (--data-dir), so it takes no writes")))
            return
        }
        if let (upstream, applyWait) = self.state.withLock({ state in state.upstream.map { ($0, state.upstreamApplyWait) } }) {
            Task {
                do {
                    let written = try await upstream.write(mutation, now: now, source: source)
                    if written.sequence > 0 {
                        _ = await self.waitUntilApplied(written.sequence, timeout: applyWait)
                    }
                    completion(.success(WriteOutcome(
                        customerId: written.customerId,
                        sequence: written.sequence == 0 ? nil : written.sequence,
                        created: written.created,
                        committed: nil,
                        changed: written.changed
                    )))
                } catch {
                    completion(.failure(error))
                }
            }
            return
        }
        let immediate: Result<WriteOutcome, any Error>? = self.state.withLock { state in
            if state.logFailed, let failure = log.failure {
                return .failure(WriteRefusal(.unavailable, "the log failed (\(failure)); restart the server to replay it"))
            }
            let snapshot = state.snapshot
            let effect: WriteEffect
            do {
                effect = try self.effect(of: mutation, now: now, latest: state.latest, snapshot: snapshot)
            } catch {
                return .failure(error)
            }
            guard effect.changed else {
                let outcome = WriteOutcome(customerId: effect.customerId, sequence: nil, created: false, committed: nil)
                let waitFor = log.nextSequence - 1
                if waitFor <= state.acknowledgedSequence {
                    return .success(outcome)
                }
                state.barriers.append((waitFor, 0, { durable in
                    completion(durable ? .success(outcome) : .failure(WriteRefusal(.unavailable, "an earlier write this one depends on was not stored; the log failed")))
                }))
                return nil
            }
            let sequence: UInt64
            do {
                sequence = try log.enqueue(effect.logged, recordedDate: now, source: source) { result in
                    switch result {
                    case .success(let sequence):
                        self.makeVisible(effect, sequence: sequence, recordedDate: now) { committed in
                            completion(.success(WriteOutcome(customerId: effect.customerId, sequence: sequence, created: effect.created, committed: committed)))
                        }
                    case .failure(let error as InterruptedWrite):
                        self.failBarriers()
                        completion(.failure(WriteRefusal(.unavailable, "the write may or may not be stored: the log failed while storing it (\(error)), and the server takes no more writes; after a restart, which replays what reached the disk, send it again (writes are idempotent)")))
                    case .failure(let error):
                        self.failBarriers()
                        completion(.failure(WriteRefusal(.unavailable, "the write was not stored: \(error)")))
                    }
                }
            } catch {
                return .failure(WriteRefusal(.unavailable, "\(error)"))
            }
            state.latest.apply(effect, sequence: sequence)
            return nil
        }
        if let immediate {
            completion(immediate)
        }
    }

    /// A durable write becomes visible: readers see it, the commit work runs (the server
    /// drops cached answers and tells watchers), then it is acknowledged and `done` runs.
    private func makeVisible(_ effect: WriteEffect, sequence: UInt64, recordedDate: Int64, done: @escaping @Sendable (CommittedWrite) -> Void) {
        let (committed, hook, observers) = self.commit(effect, sequence: sequence, recordedDate: recordedDate)
        for observer in observers {
            observer(committed)
        }
        let finish: @Sendable () -> Void = {
            self.acknowledge(sequence)
            done(committed)
        }
        if let hook {
            hook(committed, finish)
        } else {
            finish()
        }
    }

    /// Applies writes the upstream made (fleet mode), in their order: each is logged here
    /// under the upstream's sequence, then made visible exactly as a local write is.
    /// Returns once the last is acknowledged. Throws, applying nothing of the entry it
    /// names, if an entry's sequence is not the next this log expects (a gap: the caller
    /// must start again from a snapshot).
    public func applyReplicated(_ entries: [ReplicatedEntry]) async throws {
        guard let log = self.log, let last = entries.last else {
            if entries.isEmpty { return }
            throw WriteRefusal(.unavailable, "this server has no data directory (--data-dir), so it cannot apply replicated writes")
        }
        let effects = try entries.map { try WriteEffect(replicated: $0.write) }
        try await withCheckedThrowingContinuation { (continuation: CheckedContinuation<Void, any Error>) in
            let queued: (any Error)? = self.state.withLock { state in
                for (entry, effect) in zip(entries, effects) {
                    let expected = log.nextSequence
                    guard entry.sequence == expected else {
                        return ReplicationGap(expected: expected, received: entry.sequence)
                    }
                    let isLast = entry.sequence == last.sequence
                    do {
                        _ = try log.enqueue(effect.logged, recordedDate: entry.recordedDate) { result in
                            switch result {
                            case .success(let sequence):
                                self.makeVisible(effect, sequence: sequence, recordedDate: entry.recordedDate) { _ in
                                    if isLast { continuation.resume() }
                                }
                            case .failure(let error):
                                self.failBarriers()
                                if isLast { continuation.resume(throwing: error) }
                            }
                        }
                    } catch {
                        return error
                    }
                    state.latest.apply(effect, sequence: entry.sequence)
                    state.lastReplicated = (entry.sequence, entry.recordedDate)
                }
                return nil
            }
            if let queued {
                // Entries queued before the failing one still complete, but nobody waits
                // for them: the caller starts again from a snapshot.
                continuation.resume(throwing: queued)
            }
        }
    }

    /// Returns true once writes up to `sequence` are acknowledged (visible, caches
    /// dropped), or false after `timeout` (nil: no limit) or if the log failed.
    public func waitUntilApplied(_ sequence: UInt64, timeout: Duration?) async -> Bool {
        await withCheckedContinuation { (continuation: CheckedContinuation<Bool, Never>) in
            let resumed = Atomic<Bool>(false)
            let resume: @Sendable (Bool) -> Void = { value in
                if !resumed.exchange(true, ordering: .acquiringAndReleasing) {
                    continuation.resume(returning: value)
                }
            }
            let id = self.state.withLock { state -> UInt64? in
                if state.logFailed { resume(false); return nil }
                if state.acknowledgedSequence >= sequence { resume(true); return nil }
                let id = state.nextBarrierId
                state.nextBarrierId += 1
                state.barriers.append((sequence, id, resume))
                return id
            }
            guard let id, let timeout else { return }
            let nanoseconds = max(0, timeout.components.seconds * 1_000_000_000 + timeout.components.attoseconds / 1_000_000_000)
            DispatchQueue.global().asyncAfter(deadline: .now() + .nanoseconds(Int(nanoseconds))) {
                self.state.withLock { $0.barriers.removeAll { $0.id == id } }
                resume(false)
            }
        }
    }

    /// The effect of `mutation` on the newest state.
    private func effect(of mutation: LogRecord.Mutation, now: Int64, latest: Overlay, snapshot: SnapshotReader, replaying: Bool = false) throws -> WriteEffect {
        let lookup = { (userId: String) throws -> CustomerRecord? in try latest.customer(for: userId, snapshot: snapshot) }
        return try withoutActuallyEscaping(lookup) { lookup in
            try CustomerMutation(catalog: self.catalog, replaying: replaying, lookup: lookup).effect(of: mutation, now: now)
        }
    }

    /// Makes a durable write visible to readers (log writer thread, in sequence order).
    private func commit(_ effect: WriteEffect, sequence: UInt64, recordedDate: Int64) -> (CommittedWrite, (@Sendable (CommittedWrite, @escaping @Sendable () -> Void) -> Void)?, [@Sendable (CommittedWrite) -> Void]) {
        let (before, hook, observers) = self.state.withLock { state in
            let before = Self.before(effect, in: state)
            state.committed.apply(effect, sequence: sequence)
            state.committedSequence = sequence
            return (before, state.onCommit, state.observers)
        }
        return (CommittedWrite(sequence: sequence, recordedDate: recordedDate, effect: effect, before: before), hook, observers)
    }

    /// A write's commit work is done: advance the acknowledged sequence over every write
    /// finished in order, and release what waited for it.
    private func acknowledge(_ sequence: UInt64) {
        let released = self.state.withLock { state -> [@Sendable (Bool) -> Void] in
            state.finishedEarly.insert(sequence)
            while state.finishedEarly.remove(state.acknowledgedSequence + 1) != nil {
                state.acknowledgedSequence += 1
            }
            var released: [@Sendable (Bool) -> Void] = []
            let acknowledged = state.acknowledgedSequence
            state.barriers.removeAll { barrier in
                guard barrier.sequence <= acknowledged else { return false }
                released.append(barrier.resume)
                return true
            }
            return released
        }
        released.forEach { $0(true) }
    }

    /// The log failed: nothing queued will become durable, so nothing waiting on it may
    /// succeed.
    private func failBarriers() {
        let released = self.state.withLock { state in
            state.logFailed = true
            let released = state.barriers.map(\.resume)
            state.barriers.removeAll()
            return released
        }
        released.forEach { $0(false) }
    }

    /// Whether the log has grown past the compaction threshold (and no compaction runs).
    public var shouldCompact: Bool {
        guard let threshold = self.options.compactAfterLogBytes, let log = self.log else {
            return false
        }
        return log.diskBytes >= threshold && !self.state.withLock { $0.compacting }
    }

    // MARK: History

    /// The customer `userId` names now (its own id, an alias, or, for a customer no longer
    /// there, the id it had): its timeline from the oldest state the data directory keeps
    /// (docs/durability.md, "History"). Blocking: it reads a kept snapshot and every kept
    /// and live log segment after it, so call it off the event loops. `cancelled` is asked
    /// between segments: true ends the read with `CancellationError`.
    public func history(
        of userId: String,
        limit: Int,
        environment: Environment,
        now: Int64,
        date: @escaping (Int64) -> String,
        cancelled: () -> Bool = { false }
    ) throws -> CustomerHistoryResponse {
        var attempt = 1
        while true {
            do {
                return try self.readHistory(of: userId, limit: limit, environment: environment, now: now, date: date, cancelled: cancelled)
            } catch let error as SnapshotError where error.code == .io && attempt < 3 {
                attempt += 1  // a compaction moved or dropped a file meanwhile: list again
            }
        }
    }

    /// Whether `bytes` hold `needle` anywhere.
    private static func contains(_ bytes: UnsafeRawBufferPointer, _ needle: [UInt8]) -> Bool {
        guard !needle.isEmpty, bytes.count >= needle.count, let base = bytes.baseAddress else { return false }
        return needle.withUnsafeBytes { needle in
            let first = Int32(needle[0])
            var offset = 0
            let last = bytes.count - needle.count
            while offset <= last {
                guard let found = memchr(base + offset, first, last - offset + 1) else { return false }
                offset = base.distance(to: UnsafeRawPointer(found))
                if memcmp(base + offset, needle.baseAddress!, needle.count) == 0 { return true }
                offset += 1
            }
            return false
        }
    }

    private func readHistory(
        of userId: String,
        limit: Int,
        environment: Environment,
        now: Int64,
        date: @escaping (Int64) -> String,
        cancelled: () -> Bool
    ) throws -> CustomerHistoryResponse {
        let (snapshot, sequence, current) = try self.state.withLock { state in
            (state.snapshot, state.committedSequence, try state.committed.customer(for: userId, snapshot: state.snapshot))
        }
        let customerId = current?.id ?? userId
        let archive = self.dataDirectory.flatMap { self.options.historyArchive(of: $0) }
        // Every segment, live and kept, by first sequence: the live ones first, since a
        // compaction moves a segment into the archive before it leaves the live list (so it
        // is in one of the two lists, or its live path fails to open and this reads again).
        var segments: [UInt64: String] = [:]
        let live = self.log?.segmentPaths ?? []
        for path in live {
            let name = path.split(separator: "/").last.map(String.init) ?? path
            if let first = WriteAheadLog.firstSequence(ofSegmentNamed: name) {
                segments[first] = path
            }
        }
        for kept in try archive?.segments() ?? [] where segments[kept.firstSequence] == nil {
            segments[kept.firstSequence] = kept.path
        }
        let ordered = segments.sorted { $0.key < $1.key }
        // Only the segment being written may end in a batch still being written.
        let writing = live.last
        // The oldest kept state the segments continue from without a gap.
        let served = HistoryArchive.Base(lastSequence: snapshot.header.lastLogSequence, createdDate: snapshot.header.createdDate ?? 0, path: snapshot.path)
        let candidates = (try archive?.bases() ?? []) + [served]
        let base = candidates.first { base in
            base.lastSequence >= sequence || ordered.contains { $0.key <= base.lastSequence + 1 }
        } ?? served
        let baseRecord: CustomerRecord?
        if base.path == snapshot.path, base.lastSequence == snapshot.header.lastLogSequence {
            baseRecord = try snapshot.customer(for: customerId)
        } else {
            baseRecord = try SnapshotReader(path: base.path).customer(for: customerId)
        }
        var builder = CustomerHistoryBuilder(
            customerId: customerId,
            record: baseRecord?.id == customerId ? baseRecord : nil,
            startDate: base.createdDate,
            catalog: self.catalog,
            environment: environment,
            date: date
        )
        for (index, segment) in ordered.enumerated() {
            // Skip segments that end at or before the base.
            if index + 1 < ordered.count, ordered[index + 1].key - 1 <= base.lastSequence { continue }
            if segment.key > sequence { break }
            // Only records that hold one of the customer's names can touch it: its id, or
            // an alias it holds (another customer taking that alias names the alias).
            if cancelled() {
                throw CancellationError()
            }
            try WriteAheadLog.scanSegment(path: segment.value, after: base.lastSequence, mayBeWritten: segment.value == writing, wanted: { bytes in
                builder.names.contains { name in Self.contains(bytes, name) }
            }) { record in
                if record.sequence <= sequence {
                    builder.apply(record)
                }
            }
        }
        builder.finish(now: now)
        let entries = builder.entries
        let known = current != nil || !entries.isEmpty
        return CustomerHistoryResponse(
            userId: userId,
            customerId: known ? customerId : nil,
            entries: Array(entries.suffix(limit)),
            startsAfterLogSequence: base.lastSequence,
            startsDate: base.lastSequence == 0 ? nil : base.createdDate,
            logSequence: sequence,
            truncated: entries.count > limit
        )
    }

    // MARK: Compaction

    /// Writes a new snapshot holding every acknowledged write, swaps it in, and removes the
    /// log segments it covers. `hotList` becomes the new snapshot's hot list. Checks and
    /// writes continue meanwhile; only one compaction runs at a time.
    public func compact(hotList: [String], now: Int64) async throws -> CompactionReport {
        guard let log = self.log, let directory = self.dataDirectory else {
            throw WriteRefusal(.unavailable, "this server has no data directory (--data-dir), so there is nothing to compact")
        }
        let started = self.state.withLock { state -> Bool in
            if state.compacting { return false }
            state.compacting = true
            return true
        }
        guard started else {
            throw WriteRefusal(.failedPrecondition, "a compaction is already running")
        }
        defer { self.state.withLock { $0.compacting = false } }

        // 1. Later writes go to a new segment; wait until every earlier one is visible.
        let firstOfNewSegment = try await log.rotate()
        CrashPoint.reach("compact.rotated")
        guard await self.waitUntilApplied(firstOfNewSegment - 1, timeout: nil) else {
            throw WriteRefusal(.unavailable, "the log failed; restart the server to replay it")
        }
        let (overlay, sequence, old, committedDate, beforeCompacting) = self.state.withLock { state in
            (state.committed, state.committedSequence, state.snapshot, state.lastReplicated.flatMap { $0.sequence == state.committedSequence ? $0.committedDate : nil }, state.beforeCompacting)
        }
        // What was derived from the writes about to leave the log is made durable first:
        // once the snapshot holds them, replay no longer tells of them.
        for work in beforeCompacting {
            try work(sequence)
        }

        // 2. Old snapshot + overlay -> a new snapshot, off the cooperative pool. A
        // customer's history may start from the old one: kept first (a hard link).
        let path = "\(directory)/\(Self.snapshotFileName)"
        let archive = self.options.historyArchive(of: directory)
        var historyProblems: [String] = []
        do {
            try archive?.offer(snapshotPath: path, lastSequence: old.header.lastLogSequence, createdDate: old.header.createdDate ?? 0)
        } catch {
            historyProblems.append("\(error)")  // history is optional; the compaction goes on
        }
        let catalog = old.catalog
        let written: UInt64 = try await Self.onWorkerThread {
            var writer = try SnapshotWriter(
                path: path,
                catalog: catalog,
                createdDate: now,
                lastLogSequence: sequence,
                fleetEpoch: old.header.fleetEpoch,
                fleetCommittedDate: committedDate
            )
            var replaced = Set<ExactId>()
            try old.forEachRecord { record, _ in
                guard let id = record.id.map(ExactId.init) else { return }
                if let entry = overlay.customers[id] {
                    replaced.insert(id)
                    if let current = entry.record {
                        try writer.append(current)
                    }
                } else {
                    try writer.append(record)
                }
            }
            for (id, entry) in overlay.customers where !replaced.contains(id) {
                if let record = entry.record {
                    try writer.append(record)
                }
            }
            let count = writer.recordCount
            try writer.finish(hotList: hotList) { CrashPoint.reach("compact.before-rename") }
            return count
        }
        CrashPoint.reach("compact.renamed")

        // 3. Serve the new snapshot; drop the overlay entries it holds.
        let fresh = try SnapshotReader(path: path)
        self.state.withLock { state in
            state.snapshot = fresh
            state.committed.prune(upTo: sequence)
            state.latest.prune(upTo: sequence)
            state.compactions += 1
        }
        // The overlay's records were many small allocations; give the pages back to the
        // system rather than keep the high-water mark resident.
        ent_release_free_memory()

        // 4. The segments the snapshot covers are no longer needed.
        let removed = try log.removeSegments(coveredBy: sequence, archive: archive, historyProblems: &historyProblems)
        CrashPoint.reach("compact.segments-removed")
        do {
            try archive?.prune(now: now)
        } catch {
            historyProblems.append("\(error)")
        }
        return CompactionReport(
            snapshotId: fresh.header.snapshotId ?? "",
            lastLogSequence: sequence,
            customers: written,
            removedSegments: removed,
            historyProblems: historyProblems
        )
    }

    /// Runs blocking file work on a thread of its own, not on Swift's cooperative pool.
    private static func onWorkerThread<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
        try await withCheckedThrowingContinuation { continuation in
            DispatchQueue(label: "entitlements.compaction").async {
                continuation.resume(with: Result { try body() })
            }
        }
    }

    /// Waits until every queued write is durable, then stops the log (shutdown).
    public func close() {
        self.log?.closeAndWait()
    }

    /// Releases the data directory's lock now, not when the store is released (a fleet
    /// server that starts its directory afresh reopens it at once). Call after ``close()``;
    /// the store must not be used afterwards.
    public func unlock() {
        if self.lockFD >= 0 {
            flock(self.lockFD, LOCK_UN)
        }
    }

    // MARK: Files

    private static func removeTemporaryFiles(in directory: String) throws -> [String] {
        var removed: [String] = []
        for name in try FileDescriptor.names(in: directory, what: "data directory") {
            if name.hasPrefix("\(Self.snapshotFileName).tmp") {
                let path = "\(directory)/\(name)"
                unlink(path)
                removed.append(path)
            }
        }
        return removed
    }

    /// Copies `source` to `destination` crash-safely (temporary file, fsync, rename, fsync
    /// of the directory).
    private static func copy(_ source: String, to destination: String) throws {
        let input = try FileDescriptor.openForReading(source)
        let size = try input.size()
        let temporary = "\(destination).tmp-seed"
        let output = try FileDescriptor.create(temporary)
        var offset: UInt64 = 0
        var chunk = [UInt8](repeating: 0, count: 1 << 20)
        while offset < size {
            let count = Int(min(UInt64(chunk.count), size - offset))
            try chunk.withUnsafeMutableBytes { try input.read(into: $0, count: count, at: offset) }
            try chunk.withUnsafeBytes { try output.write(UnsafeRawBufferPointer(rebasing: $0[0..<count]), at: offset) }
            offset += UInt64(count)
        }
        try output.sync()
        try FileDescriptor.move(temporary, to: destination)
        try FileDescriptor.syncDirectory(of: destination)
    }
}

/// The writes since the snapshot: customer records and alias keys that differ from it,
/// each with the log sequence of the write that set it.
struct Overlay: Sendable {
    struct CustomerEntry: Sendable {
        /// nil: deleted.
        var record: CustomerRecord?
        var sequence: UInt64
    }

    struct AliasEntry: Sendable {
        /// nil: the alias names nobody now.
        var owner: String?
        var sequence: UInt64
    }

    enum Found {
        /// The overlay decides: this record, or nil (deleted, or an alias removed).
        case record(CustomerRecord?)
        /// An alias that moved to a customer the overlay does not hold: read it by id.
        case snapshotId(String)
        /// The overlay knows nothing of the id: read the snapshot.
        case notWritten
    }

    /// Keyed by bytes (``ExactId``), as the snapshot is.
    var customers: [ExactId: CustomerEntry] = [:]
    var aliases: [ExactId: AliasEntry] = [:]

    func find(_ userId: String) -> Found {
        let entry = self.customers[ExactId(userId)]
        if let entry, entry.record != nil {
            return .record(entry.record)
        }
        // A deleted customer's id may since have become another customer's alias.
        if let alias = self.aliases[ExactId(userId)] {
            guard let owner = alias.owner else {
                return .record(nil)
            }
            if let entry = self.customers[ExactId(owner)] {
                return .record(entry.record)
            }
            return .snapshotId(owner)
        }
        if entry != nil {
            return .record(nil)  // deleted
        }
        return .notWritten
    }

    /// The record `userId` names, reading the snapshot where the overlay does not decide.
    func customer(for userId: String, snapshot: SnapshotReader) throws -> CustomerRecord? {
        switch self.find(userId) {
        case .record(let record):
            return record
        case .snapshotId(let id):
            return try snapshot.customer(for: id).flatMap { $0.id == id ? $0 : nil }
        case .notWritten:
            guard let record = try snapshot.customer(for: userId), let id = record.id else {
                return nil
            }
            if let entry = self.customers[ExactId(id)] {
                return entry.record
            }
            return record
        }
    }

    mutating func apply(_ effect: WriteEffect, sequence: UInt64) {
        for (id, record) in effect.records {
            self.customers[ExactId(id)] = CustomerEntry(record: record, sequence: sequence)
        }
        for (alias, owner) in effect.aliases {
            self.aliases[ExactId(alias)] = AliasEntry(owner: owner, sequence: sequence)
        }
    }

    /// Drops the entries a snapshot holding writes up to `sequence` has.
    mutating func prune(upTo sequence: UInt64) {
        self.customers = self.customers.filter { $0.value.sequence > sequence }
        self.aliases = self.aliases.filter { $0.value.sequence > sequence }
    }
}

/// Fault injection for the crash tests: when the environment variable
/// `ENTITLEMENTS_CRASH_POINT` names a point, the process kills itself (SIGKILL) on reaching
/// it. Unset in production; reaching a point costs one comparison.
public enum CrashPoint {
    private static let armed: String? = {
        guard let value = getenv("ENTITLEMENTS_CRASH_POINT") else { return nil }
        return String(cString: value)
    }()

    /// The points, in the order compaction reaches them.
    public static let compactionPoints = ["compact.rotated", "compact.before-rename", "compact.renamed", "compact.segments-removed"]

    public static func reach(_ point: String) {
        if Self.armed == point {
            kill(getpid(), SIGKILL)
        }
    }
}
