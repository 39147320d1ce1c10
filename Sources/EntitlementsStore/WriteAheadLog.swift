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
/// File layout (little-endian): a 16-byte header (`ENTWAL` and two NUL bytes, format
/// version u32, reserved u32), then **batches**. A batch is one group commit: payload
/// length (u32), CRC-32C of the payload (u32), and the payload, which is a sequence of
/// records, each a length (u32) and a `LogRecord` message. A batch is written with one
/// write and made durable with one fsync before any of its writes is acknowledged and
/// before the next batch is written, so only the last batch can be incomplete after a
/// crash: replay drops a torn last batch (none of its writes was acknowledged) and refuses
/// a damaged batch that has valid data after it.
///
/// Appends from many callers are gathered by one writer thread into a batch while the
/// previous fsync runs (group commit): under load, many writes share one fsync.
public final class WriteAheadLog: Sendable {
    /// What replay found.
    public struct Replay: Sendable {
        /// Every record of every complete batch, in order.
        public var records: [LogRecord]
        /// Bytes of a torn last batch that were dropped (and cut off the file); 0 if none.
        public var tornBytes: UInt64
        /// The offset the torn batch started at, if there was one.
        public var tornOffset: UInt64?
        /// Complete batches read: each was one write and one fsync.
        public var batches: Int = 0
    }

    static let magic: [UInt8] = Array("ENTWAL".utf8) + [0, 0]
    static let version: UInt32 = 1
    static let headerSize = 16

    public let path: String
    private let fd: Int32
    private let state: Mutex<State>
    private let wakeUp = DispatchSemaphoreBox()

    private struct Pending {
        var bytes: [UInt8]
        var continuation: CheckedContinuation<UInt64, any Error>
        var sequence: UInt64
    }

    private struct State {
        var queue: [Pending] = []
        var nextSequence: UInt64
        var offset: UInt64
        var closed = false
        var failure: String?
    }

    /// Opens (or creates) the log at `path`, replays it, cuts off a torn last batch, and
    /// starts the writer thread. Sequence numbers continue after the last replayed one
    /// (or after `lastSnapshotSequence`, whichever is greater).
    public static func open(path: String, lastSnapshotSequence: UInt64 = 0) throws -> (WriteAheadLog, Replay) {
        let fd = Glibc.open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0o644)
        guard fd >= 0 else {
            throw SnapshotError(code: .io, path: path, reason: "cannot open the log: \(String(cString: strerror(errno)))")
        }
        do {
            let replay = try Self.replay(fd: fd, path: path)
            let lastSequence = max(lastSnapshotSequence, replay.records.last?.sequence ?? 0)
            var size = UInt64(lseek(fd, 0, SEEK_END))
            if size == 0 {
                var header = Self.magic
                header.appendLittleEndian(Self.version)
                header.appendLittleEndian(UInt32(0))
                try Self.write(fd: fd, path: path, header, at: 0)
                guard fsync(fd) == 0 else {
                    throw SnapshotError(code: .io, path: path, reason: "cannot fsync the log")
                }
                size = UInt64(Self.headerSize)
            }
            let log = WriteAheadLog(path: path, fd: fd, nextSequence: lastSequence + 1, offset: size)
            log.startWriter()
            return (log, replay)
        } catch {
            Glibc.close(fd)
            throw error
        }
    }

    private init(path: String, fd: Int32, nextSequence: UInt64, offset: UInt64) {
        self.path = path
        self.fd = fd
        self.state = Mutex(State(nextSequence: nextSequence, offset: offset))
    }

    deinit {
        Glibc.close(self.fd)
    }

    /// Appends `mutation` and returns its sequence number once it is durable (fsynced).
    /// The record's `sequence` and `recordedDate` are filled in here.
    public func append(_ mutation: LogRecord.Mutation, recordedDate: Int64) async throws -> UInt64 {
        try await withCheckedThrowingContinuation { continuation in
            let error: (any Error)? = self.state.withLock { state in
                if let failure = state.failure {
                    return SnapshotError(code: .io, path: self.path, reason: "the log failed earlier: \(failure)")
                }
                guard !state.closed else {
                    return SnapshotError(code: .io, path: self.path, reason: "the log is closed")
                }
                let sequence = state.nextSequence
                let record = LogRecord(sequence: sequence, recordedDate: recordedDate, mutation: mutation)
                guard let bytes = try? record.serializedBytes() else {
                    return SnapshotError(code: .invalidInput, path: self.path, reason: "the write cannot be encoded")
                }
                state.nextSequence += 1
                state.queue.append(Pending(bytes: bytes, continuation: continuation, sequence: sequence))
                return nil
            }
            if let error {
                continuation.resume(throwing: error)
            } else {
                self.wakeUp.signal()
            }
        }
    }

    /// Stops the writer after the queued appends are durable.
    public func close() {
        self.state.withLock { $0.closed = true }
        self.wakeUp.signal()
    }

    // MARK: The writer thread

    private func startWriter() {
        // One long-lived loop on its own queue: it sleeps on the semaphore between batches.
        DispatchQueue(label: "entitlements.wal.writer").async { self.runWriter() }
    }

    private func runWriter() {
        while true {
            self.wakeUp.wait()
            let (batch, offset, closed) = self.state.withLock { state -> ([Pending], UInt64, Bool) in
                let batch = state.queue
                state.queue.removeAll(keepingCapacity: true)
                return (batch, state.offset, state.closed)
            }
            if !batch.isEmpty {
                var payload: [UInt8] = []
                for pending in batch {
                    payload.appendLittleEndian(UInt32(pending.bytes.count))
                    payload.append(contentsOf: pending.bytes)
                }
                var bytes: [UInt8] = []
                bytes.reserveCapacity(payload.count + 8)
                bytes.appendLittleEndian(UInt32(payload.count))
                bytes.appendLittleEndian(payload.withUnsafeBytes { CRC32C.checksum($0) })
                bytes.append(contentsOf: payload)
                do {
                    try Self.write(fd: self.fd, path: self.path, bytes, at: offset)
                    guard fdatasync(self.fd) == 0 else {
                        throw SnapshotError(code: .io, path: self.path, reason: "fsync failed: \(String(cString: strerror(errno)))")
                    }
                    self.state.withLock { $0.offset = offset + UInt64(bytes.count) }
                    for pending in batch {
                        pending.continuation.resume(returning: pending.sequence)
                    }
                } catch {
                    // After a failed write or fsync nothing more is acknowledged: the state
                    // of the file is unknown until the next replay.
                    let failed: [Pending] = self.state.withLock { state in
                        state.failure = "\(error)"
                        let rest = state.queue
                        state.queue.removeAll()
                        return rest
                    }
                    for pending in batch + failed {
                        pending.continuation.resume(throwing: error)
                    }
                }
            }
            if closed {
                let rest = self.state.withLock { state -> [Pending] in
                    let rest = state.queue
                    state.queue.removeAll()
                    return rest
                }
                if rest.isEmpty {
                    return
                }
                self.wakeUp.signal()
            }
        }
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

    // MARK: Replay

    /// Reads every batch; cuts off a torn last batch; throws for damage before the tail.
    static func replay(fd: Int32, path: String) throws -> Replay {
        let size = UInt64(lseek(fd, 0, SEEK_END))
        var replay = Replay(records: [], tornBytes: 0, tornOffset: nil, batches: 0)
        guard size > 0 else {
            return replay
        }
        func read(_ count: Int, at offset: UInt64) -> [UInt8]? {
            var bytes = [UInt8](repeating: 0, count: count)
            let got = bytes.withUnsafeMutableBytes { pread(fd, $0.baseAddress, count, off_t(offset)) }
            return got == count ? bytes : nil
        }
        guard size >= UInt64(Self.headerSize), let header = read(Self.headerSize, at: 0), Array(header[0..<8]) == Self.magic else {
            throw SnapshotError(code: .notASnapshot, path: path, offset: 0, reason: "not a write-ahead log (no ENTWAL magic)")
        }
        let version = header.withUnsafeBytes { $0.littleEndian(at: 8, as: UInt32.self) }
        guard version == Self.version else {
            throw SnapshotError(code: .unsupportedVersion, path: path, offset: 8, reason: "log format version \(version); this build reads version \(Self.version)")
        }
        var offset = UInt64(Self.headerSize)
        var lastSequence: UInt64 = 0
        while offset < size {
            let batchStart = offset
            // A batch that does not fit, or fails its checksum, is torn if nothing follows.
            guard size - offset >= 8, let head = read(8, at: offset) else {
                return try Self.tear(fd: fd, path: path, replay: &replay, at: batchStart, size: size)
            }
            let length = UInt64(head.withUnsafeBytes { $0.littleEndian(at: 0, as: UInt32.self) })
            let stored = head.withUnsafeBytes { $0.littleEndian(at: 4, as: UInt32.self) }
            guard offset + 8 + length <= size, let payload = read(Int(length), at: offset + 8) else {
                return try Self.tear(fd: fd, path: path, replay: &replay, at: batchStart, size: size)
            }
            let computed = payload.withUnsafeBytes { CRC32C.checksum($0) }
            guard computed == stored else {
                if offset + 8 + length == size {
                    return try Self.tear(fd: fd, path: path, replay: &replay, at: batchStart, size: size)
                }
                throw SnapshotError(
                    code: .corrupt,
                    path: path,
                    offset: batchStart,
                    reason: "log batch checksum mismatch before the end of the log (stored 0x\(String(stored, radix: 16)), computed 0x\(String(computed, radix: 16))); acknowledged writes follow it, so start-up stops"
                )
            }
            var position = 0
            while position < payload.count {
                guard position + 4 <= payload.count else {
                    throw SnapshotError(code: .corrupt, path: path, offset: batchStart, reason: "log batch ends inside a record length")
                }
                let recordLength = Int(payload.withUnsafeBytes { $0.littleEndian(at: position, as: UInt32.self) })
                position += 4
                guard position + recordLength <= payload.count else {
                    throw SnapshotError(code: .corrupt, path: path, offset: batchStart, reason: "log record runs past its batch")
                }
                let record: LogRecord
                do {
                    record = try payload[position..<(position + recordLength)].withUnsafeBytes { try LogRecord(serializedBytes: $0) }
                } catch {
                    throw SnapshotError(code: .corrupt, path: path, offset: batchStart, reason: "log record: \(error)")
                }
                guard record.sequence > lastSequence else {
                    throw SnapshotError(code: .corrupt, path: path, offset: batchStart, reason: "log sequence \(record.sequence) does not follow \(lastSequence)")
                }
                lastSequence = record.sequence
                replay.records.append(record)
                position += recordLength
            }
            offset += 8 + length
            replay.batches += 1
        }
        return replay
    }

    private static func tear(fd: Int32, path: String, replay: inout Replay, at offset: UInt64, size: UInt64) throws -> Replay {
        replay.tornOffset = offset
        replay.tornBytes = size - offset
        guard ftruncate(fd, off_t(offset)) == 0, fsync(fd) == 0 else {
            throw SnapshotError(code: .io, path: path, offset: offset, reason: "cannot cut off the torn end of the log: \(String(cString: strerror(errno)))")
        }
        return replay
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
