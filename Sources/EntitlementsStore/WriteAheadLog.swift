import Dispatch
public import EntitlementsMessages
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The write-ahead log: every acknowledged write is on disk before it is acknowledged.
///
/// The log is a directory of **segments**, `log-<first sequence, 20 digits>.wal`; appends
/// go to the last one, and ``rotate()`` starts a new one so that compaction can remove the
/// segments a snapshot covers (docs/durability.md).
///
/// Segment layout (little-endian): a 16-byte header (`ENTWAL` and two NUL bytes, format
/// version u32, reserved u32), then **batches**. A batch is one group commit: a header
/// (payload length, CRC-32C of the payload, and a checksum of those two; LogReplay.swift),
/// and the payload, which is a sequence of records, each a length (u32) and a `LogRecord`
/// message. A batch is written with one write and made durable with one fsync before any
/// of its writes is acknowledged and before the next batch is written, so only the last
/// batch of the last segment can be incomplete after a crash: replay sets aside a tail a
/// crash can leave when nothing valid follows it, and refuses anything else.
///
/// Appends from many callers are gathered by one writer thread into a batch while the
/// previous fsync runs (group commit): under load, many writes share one fsync. The
/// writer calls each append's completion in sequence order, on its thread.
public final class WriteAheadLog: Sendable {
    /// When the log fsyncs. Both modes are safe: nothing is acknowledged before its fsync.
    public enum SyncMode: String, Sendable, CaseIterable {
        /// Group commit: each fsync covers every append that queued while the previous one
        /// ran. The default.
        case batch
        /// One fsync per append, one append at a time: the most latency, the least throughput.
        case always
    }

    /// What replay found.
    public struct Replay: Sendable {
        /// Every record of every complete batch, in order (empty when replay visited them).
        public var records: [LogRecord]
        /// How many records replay read, and the last one's sequence.
        public var recordCount = 0
        public var lastSequence: UInt64 = 0
        /// Bytes of a torn last batch that were dropped (and cut off the file); 0 if none.
        public var tornBytes: UInt64
        /// The segment and offset the torn batch started at, if there was one.
        public var tornOffset: UInt64?
        public var tornPath: String?
        /// Where the torn bytes were kept (`<segment>.torn-<offset>`), and what is known
        /// about them.
        public var tornSideFile: String?
        public var torn: TornTail?
        /// The format version of the last segment read.
        public var version: UInt32 = 0
        /// Complete batches read: each was one write and one fsync.
        public var batches: Int = 0
        /// The segments read, oldest first.
        public var segments: [String] = []
    }

    /// A completion: the sequence number once durable, or why the append failed.
    public typealias Completion = @Sendable (Result<UInt64, any Error>) -> Void

    static let magic: [UInt8] = Array("ENTWAL".utf8) + [0, 0]
    /// The format written: 2 since batch headers carry their own checksum (LogReplay.swift);
    /// segments of version 1 are still read.
    static let version: UInt32 = 2
    static let headerSize = 16
    static let segmentPrefix = "log-"
    static let segmentSuffix = ".wal"
    /// A batch holds at most this many bytes: the writer starts a new batch past
    /// `batchTarget`, and one record is at most a frame (64 MiB at most).
    static let maximumBatchBytes: UInt64 = 128 << 20
    static let batchTarget = 16 << 20

    /// The directory of segments.
    public let directory: String
    public let syncMode: SyncMode
    private let state: Mutex<State>
    private let wakeUp = DispatchSemaphoreBox()
    private let stopped = DispatchSemaphoreBox()

    private enum Item {
        case record(bytes: [UInt8], sequence: UInt64, completion: Completion)
        /// Start a new segment whose first sequence is `firstSequence`.
        case rotate(firstSequence: UInt64, completion: @Sendable (Result<String, any Error>) -> Void)
    }

    private struct Segment {
        var firstSequence: UInt64
        var path: String
    }

    private struct State {
        var queue: [Item] = []
        var nextSequence: UInt64
        /// Segments oldest first; the last is written to.
        var segments: [Segment]
        var fd: Int32
        var offset: UInt64
        /// Every segment's bytes.
        var diskBytes: UInt64
        var closed = false
        var failure: String?
    }

    /// Opens (or creates) the log in `directory`, replays every segment, cuts off a torn
    /// last batch, and starts the writer thread. Sequence numbers continue after the last
    /// replayed one (or after `lastSnapshotSequence`, whichever is greater).
    ///
    /// Throws if the segments do not reach back to `lastSnapshotSequence + 1` (writes
    /// would be missing), or for damage anywhere but the tail of the last segment.
    ///
    /// With `visit`, each replayed record is handed to it in order as it is read, and
    /// `Replay.records` stays empty: a long log is applied without holding it in memory.
    public static func open(
        directory: String,
        lastSnapshotSequence: UInt64 = 0,
        syncMode: SyncMode = .batch,
        visit: ((LogRecord) throws -> Void)? = nil
    ) throws -> (WriteAheadLog, Replay) {
        try FileDescriptor.makeDirectory(directory, what: "the log directory")
        var segments = try Self.segments(in: directory)
        if let first = segments.first, first.firstSequence > lastSnapshotSequence + 1 {
            throw SnapshotError(
                code: .corrupt,
                path: first.path,
                reason: "the oldest log segment starts at sequence \(first.firstSequence), but the snapshot holds writes only up to \(lastSnapshotSequence): writes \(lastSnapshotSequence + 1) to \(first.firstSequence - 1) are missing"
            )
        }
        var replay = Replay(records: [], tornBytes: 0, tornOffset: nil)
        var lastSequence = lastSnapshotSequence
        var fd: Int32 = -1
        do {
            for (index, segment) in segments.enumerated() {
                let isLast = index == segments.count - 1
                let segmentFD = Glibc.open(segment.path, O_RDWR | O_CLOEXEC)
                guard segmentFD >= 0 else {
                    throw SnapshotError(code: .io, path: segment.path, reason: "cannot open the log segment: \(String(cString: strerror(errno)))")
                }
                if index > 0, segment.firstSequence > max(replay.lastSequence, lastSnapshotSequence) + 1 {
                    Glibc.close(segmentFD)
                    throw SnapshotError(
                        code: .corrupt,
                        path: segment.path,
                        reason: "the segment starts at sequence \(segment.firstSequence), but the log before it ends at \(max(replay.lastSequence, lastSnapshotSequence)): writes in between are missing"
                    )
                }
                let part: Replay
                do {
                    // Only the last segment may end in a torn batch; anywhere else it is damage.
                    part = try Self.replay(fd: segmentFD, path: segment.path, after: replay.lastSequence, mayTear: isLast, visit: visit)
                } catch {
                    Glibc.close(segmentFD)
                    throw error
                }
                replay.records += part.records
                replay.lastSequence = max(replay.lastSequence, part.lastSequence)
                replay.recordCount += part.recordCount
                replay.batches += part.batches
                replay.segments.append(segment.path)
                if part.tornOffset != nil {
                    replay.tornOffset = part.tornOffset
                    replay.tornBytes = part.tornBytes
                    replay.tornPath = segment.path
                    replay.tornSideFile = part.tornSideFile
                    replay.torn = part.torn
                }
                replay.version = part.version
                if isLast, part.version == Self.version {
                    fd = segmentFD
                } else if isLast, part.batches == 0 {
                    // An empty segment of an older format: it becomes one of this format
                    // (its header's version field, one sector, rewritten and fsynced).
                    var version = Self.version.littleEndian
                    guard pwrite(segmentFD, &version, 4, 8) == 4, fsync(segmentFD) == 0 else {
                        Glibc.close(segmentFD)
                        throw SnapshotError(code: .io, path: segment.path, reason: "cannot upgrade the empty log segment: \(String(cString: strerror(errno)))")
                    }
                    fd = segmentFD
                } else {
                    // Appends never go to a segment of an older format: a new one is made below.
                    Glibc.close(segmentFD)
                }
            }
            lastSequence = max(lastSequence, replay.lastSequence)
            if fd < 0 {
                let segment = try Self.createSegment(in: directory, firstSequence: lastSequence + 1)
                segments.append(segment)
                fd = Glibc.open(segment.path, O_RDWR | O_CLOEXEC)
                guard fd >= 0 else {
                    throw SnapshotError(code: .io, path: segment.path, reason: "cannot open the log segment: \(String(cString: strerror(errno)))")
                }
            }
            let size = UInt64(lseek(fd, 0, SEEK_END))
            let diskBytes = segments.reduce(0) { $0 + Self.fileSize($1.path) }
            let log = WriteAheadLog(
                directory: directory,
                syncMode: syncMode,
                state: State(nextSequence: lastSequence + 1, segments: segments, fd: fd, offset: size, diskBytes: diskBytes)
            )
            log.startWriter()
            return (log, replay)
        } catch {
            if fd >= 0 {
                Glibc.close(fd)
            }
            throw error
        }
    }

    /// Replays one segment file on its own (for tools and fuzzing): its records, and any
    /// torn tail (which is cut off).
    /// Reads the records of one segment after `sequence`, without changing the file (mapped,
    /// not copied into memory). A segment being written (`mayBeWritten`) may end in a batch
    /// still being written, which ends the read (a customer's history reads only sequences
    /// known to be durable); any other damage, and a cut-short end of any other segment
    /// (start-up cut torn ends off long ago), throws. `wanted`, given the bytes of a record,
    /// says whether to decode it at all.
    public static func scanSegment(
        path: String,
        after sequence: UInt64,
        mayBeWritten: Bool,
        wanted: ((UnsafeRawBufferPointer) -> Bool)? = nil,
        visit: (LogRecord) throws -> Void
    ) throws {
        let fd = Glibc.open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else {
            throw SnapshotError(code: .io, path: path, reason: "cannot open the log segment: \(String(cString: strerror(errno)))")
        }
        defer { Glibc.close(fd) }
        let size = Int(lseek(fd, 0, SEEK_END))
        guard size > 0 else {
            throw SnapshotError(code: .notASnapshot, path: path, offset: 0, reason: "an empty log segment (no header)")
        }
        guard let mapped = mmap(nil, size, PROT_READ, MAP_PRIVATE, fd, 0), mapped != MAP_FAILED else {
            throw SnapshotError(code: .io, path: path, reason: "cannot map the log segment: \(String(cString: strerror(errno)))")
        }
        defer { munmap(mapped, size) }
        try withoutActuallyEscaping(visit) { visit in
            _ = try Self.replay(
                UnsafeRawBufferPointer(start: mapped, count: size),
                fd: fd,
                path: path,
                after: 0,
                mayTear: false,
                readOnly: true,
                tolerateTail: mayBeWritten,
                wanted: wanted
            ) { record in
                if record.sequence > sequence {
                    try visit(record)
                }
            }
        }
    }

    /// The first sequence of the segment file `name` (`log-<first>.wal`), or nil.
    public static func firstSequence(ofSegmentNamed name: String) -> UInt64? {
        guard name.hasPrefix(Self.segmentPrefix), name.hasSuffix(Self.segmentSuffix) else { return nil }
        return UInt64(name.dropFirst(Self.segmentPrefix.count).dropLast(Self.segmentSuffix.count))
    }

    public static func replaySegment(path: String) throws -> Replay {
        let fd = Glibc.open(path, O_RDWR | O_CLOEXEC)
        guard fd >= 0 else {
            throw SnapshotError(code: .io, path: path, reason: "cannot open the log segment: \(String(cString: strerror(errno)))")
        }
        defer { Glibc.close(fd) }
        return try Self.replay(fd: fd, path: path, after: 0, mayTear: true, visit: nil)
    }

    private init(directory: String, syncMode: SyncMode, state: State) {
        self.directory = directory
        self.syncMode = syncMode
        self.state = Mutex(state)
    }

    deinit {
        self.state.withLock { state in
            if state.fd >= 0 {
                Glibc.close(state.fd)
            }
        }
    }

    /// Why the log stopped taking appends, if it did (a failed write or fsync).
    public var failure: String? { self.state.withLock { $0.failure } }

    /// The sequence number the next append gets.
    public var nextSequence: UInt64 { self.state.withLock { $0.nextSequence } }

    /// The log's size on disk: every segment's bytes.
    public var diskBytes: UInt64 { self.state.withLock { $0.diskBytes } }

    private static func fileSize(_ path: String) -> UInt64 {
        var info = stat()
        return stat(path, &info) == 0 ? UInt64(info.st_size) : 0
    }

    /// The segment paths, oldest first.
    public var segmentPaths: [String] { self.state.withLock { $0.segments.map(\.path) } }

    /// Queues `mutation` and returns its sequence number; `completion` runs on the writer
    /// thread once the record is durable (or the log failed), in sequence order.
    public func enqueue(
        _ mutation: LogRecord.Mutation,
        recordedDate: Int64,
        source: WriteSource? = nil,
        completion: @escaping Completion
    ) throws(SnapshotError) -> UInt64 {
        let sequence = try self.state.withLock { state throws(SnapshotError) -> UInt64 in
            if let failure = state.failure {
                throw SnapshotError(code: .io, path: self.directory, reason: "the log failed earlier (\(failure)); restart the server to replay it")
            }
            guard !state.closed else {
                throw SnapshotError(code: .io, path: self.directory, reason: "the log is closed")
            }
            let sequence = state.nextSequence
            let record = LogRecord(sequence: sequence, recordedDate: recordedDate, source: source, mutation: mutation)
            guard let bytes = try? record.serializedBytes() else {
                throw SnapshotError(code: .invalidInput, path: self.directory, reason: "the write cannot be encoded")
            }
            state.nextSequence += 1
            state.queue.append(.record(bytes: bytes, sequence: sequence, completion: completion))
            return sequence
        }
        self.wakeUp.signal()
        return sequence
    }

    /// Appends `mutation` and returns its sequence number once it is durable (fsynced).
    public func append(_ mutation: LogRecord.Mutation, recordedDate: Int64) async throws -> UInt64 {
        try await withCheckedThrowingContinuation { continuation in
            do {
                _ = try self.enqueue(mutation, recordedDate: recordedDate) { result in
                    continuation.resume(with: result)
                }
            } catch {
                continuation.resume(throwing: error)
            }
        }
    }

    /// Starts a new segment after every append queued so far; returns the sequence the new
    /// segment starts at (every earlier sequence is in older segments) once it exists.
    public func rotate() async throws -> UInt64 {
        let (first, path): (UInt64, String) = try await withCheckedThrowingContinuation { continuation in
            let result = self.state.withLock { state -> Result<UInt64, any Error> in
                if let failure = state.failure {
                    return .failure(SnapshotError(code: .io, path: self.directory, reason: "the log failed earlier: \(failure)"))
                }
                guard !state.closed else {
                    return .failure(SnapshotError(code: .io, path: self.directory, reason: "the log is closed"))
                }
                let first = state.nextSequence
                state.queue.append(.rotate(firstSequence: first) { result in
                    continuation.resume(with: result.map { (first, $0) })
                })
                return .success(first)
            }
            if case .failure(let error) = result {
                continuation.resume(throwing: error)
            } else {
                self.wakeUp.signal()
            }
        }
        _ = path
        return first
    }

    /// Removes the segments whose records all have sequences up to `sequence` (a snapshot
    /// holds them), or moves them into `archive` (a customer's history keeps them,
    /// ``HistoryArchive``). The segment being written is never removed. Returns the paths
    /// they had; `historyProblems` gets why a segment could not be kept (it is then
    /// removed: history is optional, the log's bound is not).
    ///
    /// Each file is moved or removed before it leaves ``segmentPaths``: a reader that lists
    /// ``segmentPaths`` and then the archive finds every segment in one or the other (or
    /// fails to open one, and lists again).
    @discardableResult
    public func removeSegments(coveredBy sequence: UInt64, archive: HistoryArchive? = nil, historyProblems: inout [String]) throws -> [String] {
        let doomed = self.state.withLock { state -> [Segment] in
            // Segment i holds sequences [first_i, first_{i+1} - 1].
            var count = 0
            while count + 1 < state.segments.count, state.segments[count + 1].firstSequence - 1 <= sequence {
                count += 1
            }
            return Array(state.segments.prefix(count))
        }
        var freed: UInt64 = 0
        for segment in doomed {
            freed += Self.fileSize(segment.path)
            if let archive {
                do {
                    try archive.keep(segment: segment.path)
                } catch {
                    historyProblems.append("\(error)")
                    FileDescriptor.remove(segment.path)
                }
            } else {
                FileDescriptor.remove(segment.path)
            }
        }
        self.state.withLock { state in
            state.segments.removeFirst(min(doomed.count, state.segments.count))
            state.diskBytes -= min(state.diskBytes, freed)
        }
        if !doomed.isEmpty {
            try FileDescriptor.syncDirectory(of: doomed[0].path)
            if let archive {
                do {
                    try FileDescriptor.syncDirectory(of: "\(archive.directory)/.")
                } catch {
                    historyProblems.append("\(error)")
                }
            }
        }
        return doomed.map(\.path)
    }

    /// ``removeSegments(coveredBy:archive:historyProblems:)`` without an archive.
    @discardableResult
    public func removeSegments(coveredBy sequence: UInt64) throws -> [String] {
        var problems: [String] = []
        return try self.removeSegments(coveredBy: sequence, archive: nil, historyProblems: &problems)
    }

    /// Stops the writer after the queued appends are durable.
    public func close() {
        self.state.withLock { $0.closed = true }
        self.wakeUp.signal()
    }

    /// Stops the writer and waits until the queued appends are durable and the writer has
    /// stopped.
    public func closeAndWait() {
        self.close()
        self.stopped.wait()
        self.stopped.signal()  // later waiters return at once
    }

    // MARK: The writer thread

    private func startWriter() {
        // One long-lived loop on its own queue: it sleeps on the semaphore between batches.
        DispatchQueue(label: "entitlements.wal.writer").async {
            self.runWriter()
            self.stopped.signal()
        }
    }

    private func runWriter() {
        while true {
            self.wakeUp.wait()
            let (items, closed) = self.state.withLock { state -> ([Item], Bool) in
                let items = state.queue
                state.queue.removeAll(keepingCapacity: true)
                return (items, state.closed)
            }
            var run: [(bytes: [UInt8], sequence: UInt64, completion: Completion)] = []
            var runBytes = 0
            for item in items {
                switch item {
                case .record(let bytes, let sequence, let completion):
                    run.append((bytes, sequence, completion))
                    runBytes += bytes.count + 4
                    if self.syncMode == .always || runBytes >= Self.batchTarget {
                        self.writeBatch(run)
                        run.removeAll()
                        runBytes = 0
                    }
                case .rotate(let firstSequence, let completion):
                    self.writeBatch(run)
                    run.removeAll()
                    runBytes = 0
                    completion(self.startSegment(firstSequence: firstSequence))
                }
            }
            self.writeBatch(run)
            if closed {
                let empty = self.state.withLock { $0.queue.isEmpty }
                if empty {
                    return
                }
                self.wakeUp.signal()
            }
        }
    }

    /// Writes `run` as one batch, fsyncs, and completes each append in order.
    private func writeBatch(_ run: [(bytes: [UInt8], sequence: UInt64, completion: Completion)]) {
        guard !run.isEmpty else {
            return
        }
        let (fd, offset, path, failure) = self.state.withLock { ($0.fd, $0.offset, $0.segments.last?.path ?? self.directory, $0.failure) }
        if let failure {
            let error = SnapshotError(code: .io, path: path, reason: "the log failed earlier: \(failure)")
            run.forEach { $0.completion(.failure(error)) }
            return
        }
        var payloadLength = 0
        for entry in run {
            payloadLength += 4 + entry.bytes.count
        }
        let headerSize = Self.batchHeaderSize[Self.version]!
        var bytes = [UInt8](repeating: 0, count: headerSize)  // the header, below
        bytes.reserveCapacity(payloadLength + headerSize)
        for entry in run {
            bytes.appendLittleEndian(UInt32(entry.bytes.count))
            bytes.append(contentsOf: entry.bytes)
        }
        bytes.withUnsafeMutableBytes { raw in
            let header = Self.batchHeader(payload: UnsafeRawBufferPointer(rebasing: raw[headerSize...]))
            raw.copyBytes(from: header)
        }
        do {
            try Self.write(fd: fd, path: path, bytes, at: offset)
            guard fdatasync(fd) == 0 else {
                throw SnapshotError(code: .io, path: path, reason: "fsync failed: \(String(cString: strerror(errno)))")
            }
            self.state.withLock {
                $0.offset = offset + UInt64(bytes.count)
                $0.diskBytes += UInt64(bytes.count)
            }
            for entry in run {
                entry.completion(.success(entry.sequence))
            }
        } catch {
            // After a failed write or fsync nothing more is acknowledged: the state of the
            // file is unknown until the next replay, which may find this batch whole.
            self.state.withLock { $0.failure = "\(error)" }
            let failure = InterruptedWrite(reason: "\(error)")
            for entry in run {
                entry.completion(.failure(failure))
            }
        }
    }

    /// Creates the next segment and makes it the one written to.
    private func startSegment(firstSequence: UInt64) -> Result<String, any Error> {
        let (failure, current, isEmpty) = self.state.withLock { state in
            (state.failure, state.segments.last, state.offset == UInt64(Self.headerSize))
        }
        if let failure {
            // After a failed write the current segment may end in a torn batch: a segment
            // after it would make that damage in the middle of the log.
            return .failure(SnapshotError(code: .io, path: self.directory, reason: "the log failed earlier: \(failure)"))
        }
        if let current, isEmpty {
            // Nothing was written since the last rotation: the current segment already
            // starts at this sequence. (A second segment of the same name would replace it.)
            return .success(current.path)
        }
        do {
            let segment = try Self.createSegment(in: self.directory, firstSequence: firstSequence)
            let fd = Glibc.open(segment.path, O_RDWR | O_CLOEXEC)
            guard fd >= 0 else {
                throw SnapshotError(code: .io, path: segment.path, reason: "cannot open the log segment: \(String(cString: strerror(errno)))")
            }
            self.state.withLock { state in
                Glibc.close(state.fd)
                state.fd = fd
                state.offset = UInt64(Self.headerSize)
                state.segments.append(segment)
                state.diskBytes += UInt64(Self.headerSize)
            }
            return .success(segment.path)
        } catch {
            return .failure(error)
        }
    }

    /// Creates a segment with its header, crash-safely: a temporary file, fsynced, renamed
    /// into place, and the directory fsynced; a segment file with its final name always
    /// has a complete header.
    private static func createSegment(in directory: String, firstSequence: UInt64) throws -> Segment {
        let digits = String(firstSequence)
        let path = "\(directory)/\(Self.segmentPrefix)\(String(repeating: "0", count: max(0, 20 - digits.count)))\(digits)\(Self.segmentSuffix)"
        guard access(path, F_OK) != 0 else {
            throw SnapshotError(code: .io, path: path, reason: "the log segment exists already; refusing to replace it")
        }
        let temporary = path + ".tmp"
        let file = try FileDescriptor.create(temporary)
        var header = Self.magic
        header.appendLittleEndian(Self.version)
        header.appendLittleEndian(UInt32(0))
        try header.withUnsafeBytes { try file.write($0, at: 0) }
        try file.sync()
        try FileDescriptor.move(temporary, to: path)
        try FileDescriptor.syncDirectory(of: path)
        return Segment(firstSequence: firstSequence, path: path)
    }

    /// The segments in `directory`, oldest first; stale temporary files are removed.
    private static func segments(in directory: String) throws -> [Segment] {
        var segments: [Segment] = []
        for name in try FileDescriptor.names(in: directory, what: "log directory") {
            guard name.hasPrefix(Self.segmentPrefix) else {
                continue
            }
            if name.hasSuffix(Self.segmentSuffix + ".tmp") {
                FileDescriptor.remove("\(directory)/\(name)")  // a crash while creating it
                continue
            }
            guard name.hasSuffix(Self.segmentSuffix),
                let first = UInt64(name.dropFirst(Self.segmentPrefix.count).dropLast(Self.segmentSuffix.count))
            else {
                continue
            }
            segments.append(Segment(firstSequence: first, path: "\(directory)/\(name)"))
        }
        return segments.sorted { $0.firstSequence < $1.firstSequence }
    }

    private static func write(fd: Int32, path: String, _ bytes: [UInt8], at offset: UInt64) throws {
        try bytes.withUnsafeBytes { raw in
            var done = 0
            while done < raw.count {
                let result = pwrite(fd, raw.baseAddress! + done, raw.count - done, off_t(offset) + off_t(done))
                if result < 0 {
                    if errno == EINTR { continue }
                    throw SnapshotError(code: .io, path: path, offset: offset, reason: "cannot write the log: \(String(cString: strerror(errno)))")
                }
                done += result
            }
        }
    }
}

/// A counting semaphore the writer thread sleeps on.
final class DispatchSemaphoreBox: Sendable {
    private let semaphore = DispatchSemaphore(value: 0)

    func signal() {
        self.semaphore.signal()
    }

    func wait() {
        self.semaphore.wait()
    }
}

/// A batch whose write or fsync failed: some or all of its bytes may be on the disk, so
/// the next start-up's replay may find it whole and apply it. Its writes were neither
/// acknowledged nor refused: their outcome is unknown until then.
public struct InterruptedWrite: Error, CustomStringConvertible {
    public var reason: String
    public var description: String { self.reason }
}
