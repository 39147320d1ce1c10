public import EntitlementsMessages

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The batch formats of the write-ahead log's segments, and replay.
///
/// **Version 2** (written since this release): a batch is a 12-byte header, payload length
/// (u32), CRC-32C of the payload (u32) and a masked CRC-32C of those 8 bytes (u32), then
/// the payload. The header's own checksum makes a damaged length damage, not a short batch.
///
/// **Version 1** (read only): payload length (u32), CRC-32C of the payload (u32), payload.
/// Its length is not checked, so a flipped length looked like a batch cut short by a crash;
/// replay now scans on past such a tail and refuses to start when a valid batch follows.
///
/// What replay drops is only ever a tail a crash can leave, in the last segment, with
/// nothing valid after it; the dropped bytes are kept in a side file next to the segment.
extension WriteAheadLog {
    /// How much of the end of a segment was set aside, and what is known about it.
    public enum TornTail: Sendable, Equatable {
        /// The file ends inside a batch whose (checksummed) header is intact, or inside a
        /// header, or is zeros where it grew but was never written. A process that dies
        /// while appending leaves exactly that, and then the batch's fsync never returned,
        /// so none of its writes was acknowledged. The file cannot prove it was a crash: a
        /// file cut short or zeroed by something else looks the same, and then the writes
        /// may have been acknowledged. The words `serve` prints say both.
        case neverAcknowledged
        /// A version-1 tail that may be a crash's or damage: it cannot be told whether its
        /// writes were acknowledged.
        case possiblyAcknowledged

        /// The words `serve` prints.
        public var description: String {
            switch self {
            case .neverAcknowledged: "never acknowledged if the server died while appending, which is what leaves such a tail; possibly acknowledged if the file was cut short by other means: compare the side file with what clients were told"
            case .possiblyAcknowledged: "possibly acknowledged: a format-1 log cannot tell a crash from damage here"
            }
        }
    }

    static let batchHeaderSize = [1: 8, 2: 12] as [UInt32: Int]
    /// XORed into a version-2 header checksum, so that zeros never make a valid header.
    static let headerChecksumMask: UInt32 = 0xA282_EAD8

    /// The version-2 header of a batch with this payload.
    static func batchHeader(payload: UnsafeRawBufferPointer) -> [UInt8] {
        var header: [UInt8] = []
        header.reserveCapacity(12)
        header.appendLittleEndian(UInt32(payload.count))
        header.appendLittleEndian(CRC32C.checksum(payload))
        let check = header.withUnsafeBytes { CRC32C.checksum($0) } ^ Self.headerChecksumMask
        header.appendLittleEndian(check)
        return header
    }

    /// What a segment's bytes hold at one offset.
    private enum BatchAt {
        /// A whole, valid batch: its payload's range in the segment.
        case valid(payload: Range<Int>)
        /// The file ends inside a header, or inside a batch whose header is valid (v2).
        case cutShort
        /// Bytes that are not a valid batch, and why.
        case damaged(String)
    }

    /// Parses the batch at `offset` of `bytes` (a whole segment).
    private static func batch(in bytes: UnsafeRawBufferPointer, at offset: Int, version: UInt32) -> BatchAt {
        let headerSize = Self.batchHeaderSize[version]!
        let left = bytes.count - offset
        guard left >= headerSize else {
            return .cutShort
        }
        let length = Int(bytes.littleEndian(at: offset, as: UInt32.self))
        let stored = bytes.littleEndian(at: offset + 4, as: UInt32.self)
        if version >= 2 {
            let check = bytes.littleEndian(at: offset + 8, as: UInt32.self)
            guard CRC32C.checksum(UnsafeRawBufferPointer(rebasing: bytes[offset..<(offset + 8)])) ^ Self.headerChecksumMask == check else {
                return .damaged("log batch header checksum mismatch (its length cannot be trusted)")
            }
        }
        guard length > 0, UInt64(length) <= Self.maximumBatchBytes else {
            return .damaged("a log batch declares \(length) bytes; batches are 1 to \(Self.maximumBatchBytes)")
        }
        guard left - headerSize >= length else {
            // v1: the length may be damage; the caller scans on before believing it.
            return .cutShort
        }
        let payload = (offset + headerSize)..<(offset + headerSize + length)
        let computed = CRC32C.checksum(UnsafeRawBufferPointer(rebasing: bytes[payload]))
        guard computed == stored else {
            return .damaged("log batch checksum mismatch (stored 0x\(String(stored, radix: 16)), computed 0x\(String(computed, radix: 16)))")
        }
        return .valid(payload: payload)
    }

    /// The first offset after `offset` where a valid batch starts, if any. For version 1
    /// a candidate must also begin with a record that decodes: a random length that fits
    /// is common enough in a large file that a checksum alone would be tried too often.
    private static func validBatch(in bytes: UnsafeRawBufferPointer, after offset: Int, version: UInt32) -> Int? {
        let headerSize = Self.batchHeaderSize[version]!
        var candidate = offset + 1
        while candidate + headerSize < bytes.count {
            defer { candidate += 1 }
            let length = Int(bytes.littleEndian(at: candidate, as: UInt32.self))
            guard length >= 4, length <= bytes.count - candidate - headerSize else {
                continue
            }
            if version == 1 {
                let recordLength = Int(bytes.littleEndian(at: candidate + headerSize, as: UInt32.self))
                guard recordLength <= length - 4 else {
                    continue
                }
                let start = candidate + headerSize + 4
                let decodes = (try? LogRecord(serializedBytes: UnsafeRawBufferPointer(rebasing: bytes[start..<(start + recordLength)]))) != nil
                guard decodes else {
                    continue
                }
            }
            if case .valid = Self.batch(in: bytes, at: candidate, version: version) {
                return candidate
            }
        }
        return nil
    }

    /// Reads every batch of one segment (read whole into memory: replay is sequential and
    /// the damage scan needs random access); sets a torn tail aside; throws for damage.
    static func replay(
        fd: Int32,
        path: String,
        after previousSequence: UInt64,
        mayTear: Bool,
        visit: ((LogRecord) throws -> Void)?
    ) throws -> Replay {
        let size = Int(lseek(fd, 0, SEEK_END))
        guard size > 0 else {
            throw SnapshotError(code: .notASnapshot, path: path, offset: 0, reason: "an empty log segment (no header)")
        }
        var bytes = [UInt8](repeating: 0, count: size)
        var done = 0
        while done < size {
            let got = bytes.withUnsafeMutableBytes { pread(fd, $0.baseAddress! + done, size - done, off_t(done)) }
            if got < 0, errno == EINTR {
                continue
            }
            guard got > 0 else {
                throw SnapshotError(code: .io, path: path, offset: UInt64(done), reason: "cannot read the log segment: \(String(cString: strerror(errno)))")
            }
            done += got
        }
        return try bytes.withUnsafeBytes { bytes in
            try Self.replay(bytes, fd: fd, path: path, after: previousSequence, mayTear: mayTear, readOnly: false, tolerateTail: false, wanted: nil, visit: visit)
        }
    }

    /// `readOnly`: nothing is cut or set aside; a torn or damaged end is then an error,
    /// unless `tolerateTail` (a segment being written: its last batch may be mid-write),
    /// which ends the read there.
    static func replay(
        _ bytes: UnsafeRawBufferPointer,
        fd: Int32,
        path: String,
        after previousSequence: UInt64,
        mayTear: Bool,
        readOnly: Bool,
        tolerateTail: Bool,
        wanted: ((UnsafeRawBufferPointer) -> Bool)?,
        visit: ((LogRecord) throws -> Void)?
    ) throws -> Replay {
        var replay = Replay(records: [], tornBytes: 0, tornOffset: nil, batches: 0)
        guard bytes.count >= Self.headerSize, Array(bytes[0..<8]) == Self.magic else {
            throw SnapshotError(code: .notASnapshot, path: path, offset: 0, reason: "not a write-ahead log (no ENTWAL magic)")
        }
        let version = bytes.littleEndian(at: 8, as: UInt32.self)
        guard Self.batchHeaderSize[version] != nil else {
            throw SnapshotError(code: .unsupportedVersion, path: path, offset: 8, reason: "log format version \(version); this build reads versions 1 and 2")
        }
        replay.version = version
        var offset = Self.headerSize
        var lastSequence = previousSequence
        while offset < bytes.count {
            let payload: Range<Int>
            switch Self.batch(in: bytes, at: offset, version: version) {
            case .valid(let range):
                payload = range
            case .cutShort:
                try Self.setAside(bytes, fd: fd, path: path, at: offset, version: version, mayTear: mayTear, readOnly: readOnly, tolerateTail: tolerateTail, known: version >= 2 ? .neverAcknowledged : .possiblyAcknowledged, replay: &replay)
                return replay
            case .damaged(let reason):
                if version == 1, offset + 8 <= bytes.count, Int(bytes.littleEndian(at: offset, as: UInt32.self)) + 8 + offset == bytes.count {
                    // v1: a last batch that fails its checksum may be a crash's.
                    try Self.setAside(bytes, fd: fd, path: path, at: offset, version: version, mayTear: mayTear, readOnly: readOnly, tolerateTail: tolerateTail, known: .possiblyAcknowledged, replay: &replay)
                    return replay
                }
                if bytes[offset...].allSatisfy({ $0 == 0 }) {
                    // The writer never writes zeros where a header goes: the file grew and
                    // a crash came before the data.
                    try Self.setAside(bytes, fd: fd, path: path, at: offset, version: version, mayTear: mayTear, readOnly: readOnly, tolerateTail: tolerateTail, known: .neverAcknowledged, replay: &replay)
                    return replay
                }
                if readOnly, tolerateTail, Self.validBatch(in: bytes, after: offset, version: version) == nil {
                    return replay  // the end of a segment being written, seen mid-write
                }
                throw Self.damage(bytes, path: path, at: offset, version: version, reason: reason)
            }
            var position = payload.lowerBound
            while position < payload.upperBound {
                guard position + 4 <= payload.upperBound else {
                    throw SnapshotError(code: .corrupt, path: path, offset: UInt64(offset), reason: "log batch ends inside a record length")
                }
                let recordLength = Int(bytes.littleEndian(at: position, as: UInt32.self))
                position += 4
                guard recordLength <= payload.upperBound - position else {
                    throw SnapshotError(code: .corrupt, path: path, offset: UInt64(offset), reason: "log record runs past its batch")
                }
                let recordBytes = UnsafeRawBufferPointer(rebasing: bytes[position..<(position + recordLength)])
                if let wanted, !wanted(recordBytes) {
                    // A reader that looks for a few records (a customer's history) skips
                    // the others without decoding them.
                    position += recordLength
                    continue
                }
                let record: LogRecord
                do {
                    record = try LogRecord(serializedBytes: recordBytes)
                } catch {
                    throw SnapshotError(code: .corrupt, path: path, offset: UInt64(offset), reason: "log record: \(error)")
                }
                guard record.sequence > lastSequence else {
                    throw SnapshotError(code: .corrupt, path: path, offset: UInt64(offset), reason: "log sequence \(record.sequence) does not follow \(lastSequence)")
                }
                lastSequence = record.sequence
                if let visit {
                    try visit(record)
                } else {
                    replay.records.append(record)
                }
                replay.recordCount += 1
                replay.lastSequence = record.sequence
                position += recordLength
            }
            offset = payload.upperBound
            replay.batches += 1
        }
        return replay
    }

    /// The error for damage at `offset`: names the file and offset, and says whether a
    /// valid batch follows (acknowledged writes after the damage).
    private static func damage(_ bytes: UnsafeRawBufferPointer, path: String, at offset: Int, version: UInt32, reason: String) -> SnapshotError {
        let after: String
        if let next = Self.validBatch(in: bytes, after: offset, version: version) {
            after = "a valid batch follows at offset \(next), so acknowledged writes come after the damage"
        } else {
            after = "nothing valid follows, but a whole batch that fails its checks cannot be told from an acknowledged one hit by damage"
        }
        return SnapshotError(code: .corrupt, path: path, offset: UInt64(offset), reason: "\(reason); \(after); start-up stops (docs/durability.md, recovery procedure)")
    }

    /// A tail a crash can leave: set aside (copied to a side file, then cut off) if this
    /// segment may end so and nothing valid follows; otherwise it is damage.
    private static func setAside(
        _ bytes: UnsafeRawBufferPointer,
        fd: Int32,
        path: String,
        at offset: Int,
        version: UInt32,
        mayTear: Bool,
        readOnly: Bool = false,
        tolerateTail: Bool = false,
        known: TornTail,
        replay: inout Replay
    ) throws {
        if readOnly, tolerateTail, Self.validBatch(in: bytes, after: offset, version: version) == nil {
            // A batch still being written: the records before it are all a reader may
            // rely on.
            return
        }
        if readOnly {
            throw SnapshotError(code: .corrupt, path: path, offset: UInt64(offset), reason: "the batch here is incomplete or damaged, in a segment no longer written")
        }
        if let next = Self.validBatch(in: bytes, after: offset, version: version) {
            throw SnapshotError(
                code: .corrupt,
                path: path,
                offset: UInt64(offset),
                reason: "the batch here is incomplete or damaged, and a valid batch follows at offset \(next), so acknowledged writes come after it; start-up stops (docs/durability.md, recovery procedure)"
            )
        }
        guard mayTear else {
            throw SnapshotError(
                code: .corrupt,
                path: path,
                offset: UInt64(offset),
                reason: "a damaged batch at the end of a segment that is not the last; acknowledged writes follow it in later segments, so start-up stops"
            )
        }
        let tail = UnsafeRawBufferPointer(rebasing: bytes[offset...])
        // The side file is durable before a byte is cut: a crash between the two leaves
        // both, and the next start-up finds the same bytes there and keeps that file. A
        // side file is never replaced: another tear at the same offset (the segment took
        // writes after an earlier one) goes to the next free name.
        var sideFile = "\(path).torn-\(offset)"
        var attempt = 1
        while let existing = try? FileDescriptor.openForReading(sideFile) {
            let size = (try? existing.size()) ?? 0
            if size == UInt64(tail.count) {
                var kept = [UInt8](repeating: 0, count: tail.count)
                let same = (try? kept.withUnsafeMutableBytes { try existing.read(into: $0, count: tail.count, at: 0) }) != nil
                    && kept.elementsEqual(tail)
                if same {
                    break
                }
            }
            attempt += 1
            sideFile = "\(path).torn-\(offset).\(attempt)"
        }
        if (try? FileDescriptor.openForReading(sideFile)) == nil {
            let file = try FileDescriptor.create(sideFile)
            try file.write(tail, at: 0)
            try file.sync()
            try FileDescriptor.syncDirectory(of: sideFile)
        }
        guard ftruncate(fd, off_t(offset)) == 0, fsync(fd) == 0 else {
            throw SnapshotError(code: .io, path: path, offset: UInt64(offset), reason: "cannot cut off the torn end of the log: \(String(cString: strerror(errno)))")
        }
        replay.tornOffset = UInt64(offset)
        replay.tornBytes = UInt64(tail.count)
        replay.tornSideFile = sideFile
        replay.torn = known
    }
}
