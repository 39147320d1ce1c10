public import EntitlementsMessages

/// An open snapshot file (docs/snapshot-format.md), read by offset: opening reads the
/// header, the catalog, the hot list and the index's fanout (256 KiB), and verifies the
/// checksums of everything but the records; a lookup reads a few hundred bytes of index
/// and one record, and verifies that record's checksum. Memory use does not grow with
/// the file, so a snapshot far larger than RAM is servable.
///
/// Immutable after opening; lookups from many threads at once are safe (pread).
public final class SnapshotReader: Sendable {
    /// The path the snapshot was opened from.
    public let path: String
    /// The header: id, creation time, record count, catalog, last log sequence.
    public let header: SnapshotHeader
    /// Customer ids in the order the writer found them hot, hottest first.
    public let hotList: [String]
    /// The file's size in bytes.
    public let fileSize: UInt64
    /// The number of index keys (ids and aliases).
    public let keyCount: UInt64

    private let file: FileDescriptor
    private let records: SectionRange
    private let entriesOffset: UInt64
    private let fanout: [UInt32]

    /// Opens and verifies the snapshot at `path`. Throws a ``SnapshotError`` naming the
    /// file, the offset and the problem for anything missing, truncated or corrupt.
    public init(path: String) throws {
        self.path = path
        self.file = try FileDescriptor.openForReading(path)
        self.fileSize = try self.file.size()
        let fileSize = self.fileSize

        guard fileSize >= UInt64(SnapshotFormat.fileHeaderSize) else {
            if fileSize >= 8, try self.file.read(count: 8, at: 0) != SnapshotFormat.magic {
                throw SnapshotError(code: .notASnapshot, path: path, offset: 0, reason: "not a snapshot file (no ENTSNAP magic)")
            }
            throw SnapshotError(
                code: .truncated,
                path: path,
                offset: fileSize,
                reason: "the file has \(fileSize) bytes, fewer than the \(SnapshotFormat.fileHeaderSize)-byte file header"
            )
        }
        let fileHeader = try self.file.read(count: SnapshotFormat.fileHeaderSize, at: 0)
        let ranges = try fileHeader.withUnsafeBytes { bytes -> [SectionRange] in
            guard Array(bytes[0..<8]) == SnapshotFormat.magic else {
                throw SnapshotError(code: .notASnapshot, path: path, offset: 0, reason: "not a snapshot file (no ENTSNAP magic)")
            }
            let version = bytes.littleEndian(at: 8, as: UInt32.self)
            guard version == SnapshotFormat.version else {
                throw SnapshotError(
                    code: .unsupportedVersion,
                    path: path,
                    offset: 8,
                    reason: "format version \(version); this build reads version \(SnapshotFormat.version)"
                )
            }
            let stored = bytes.littleEndian(at: 92, as: UInt32.self)
            let computed = CRC32C.checksum(UnsafeRawBufferPointer(rebasing: bytes[0..<92]))
            guard stored == computed else {
                throw Self.checksumError(path: path, offset: 0, what: "file header", stored: stored, computed: computed)
            }
            let declaredSize = bytes.littleEndian(at: 80, as: UInt64.self)
            guard declaredSize == fileSize else {
                throw SnapshotError(
                    code: declaredSize > fileSize ? .truncated : .corrupt,
                    path: path,
                    offset: min(declaredSize, fileSize),
                    reason: "the header says the file has \(declaredSize) bytes, but it has \(fileSize)"
                        + (declaredSize > fileSize ? " (truncated)" : "")
                )
            }
            return (0..<4).map { section in
                SectionRange(
                    offset: bytes.littleEndian(at: 16 + section * 16, as: UInt64.self),
                    length: bytes.littleEndian(at: 24 + section * 16, as: UInt64.self)
                )
            }
        }
        let (headerRange, recordsRange, indexRange, hotRange) = (ranges[0], ranges[1], ranges[2], ranges[3])
        // The sections follow each other in this order and fill the file exactly.
        let ordered = [recordsRange, indexRange, hotRange, headerRange]
        var expectedOffset = UInt64(SnapshotFormat.fileHeaderSize)
        for (range, name) in zip(ordered, ["records", "index", "hot list", "header"]) {
            guard range.offset == expectedOffset, range.length <= fileSize, range.end <= fileSize else {
                throw SnapshotError(code: .corrupt, path: path, offset: 16, reason: "the \(name) section \(range) does not fit the file layout")
            }
            expectedOffset = range.end
        }
        guard expectedOffset == fileSize else {
            throw SnapshotError(
                code: .corrupt,
                path: path,
                offset: expectedOffset,
                reason: "the sections end at offset \(expectedOffset), but the file has \(fileSize) bytes"
            )
        }
        self.records = recordsRange

        // Header section: the SnapshotHeader message and the catalog.
        let headerBytes = try Self.readSection(self.file, path: path, headerRange, name: "header")
        do {
            self.header = try headerBytes.withUnsafeBytes { try SnapshotHeader(serializedBytes: $0) }
        } catch {
            throw SnapshotError(code: .corrupt, path: path, offset: headerRange.offset, reason: "header section: \(error)")
        }

        // Hot list: count, then length-prefixed ids.
        let hotBytes = try Self.readSection(self.file, path: path, hotRange, name: "hot list")
        self.hotList = try hotBytes.withUnsafeBytes { bytes in
            var ids: [String] = []
            guard bytes.count >= 4 else {
                throw SnapshotError(code: .corrupt, path: path, offset: hotRange.offset, reason: "hot list section too short")
            }
            let count = Int(bytes.littleEndian(at: 0, as: UInt32.self))
            var position = 4
            ids.reserveCapacity(min(count, bytes.count / 2))
            for _ in 0..<count {
                guard position + 2 <= bytes.count else {
                    throw SnapshotError(code: .corrupt, path: path, offset: hotRange.offset + UInt64(position), reason: "hot list ends early")
                }
                let length = Int(bytes.littleEndian(at: position, as: UInt16.self))
                position += 2
                guard position + length <= bytes.count else {
                    throw SnapshotError(code: .corrupt, path: path, offset: hotRange.offset + UInt64(position), reason: "hot list ends early")
                }
                ids.append(String(decoding: UnsafeRawBufferPointer(rebasing: bytes[position..<(position + length)]), as: UTF8.self))
                position += length
            }
            return ids
        }

        // Index: verified whole (checksum, sorted entries, offsets inside the records
        // section) but streamed, so only the fanout stays in memory.
        let index = try Self.verifyIndex(self.file, path: path, indexRange, records: recordsRange)
        self.fanout = index.fanout
        self.keyCount = index.entryCount
        self.entriesOffset = indexRange.offset + 8 + UInt64(SnapshotFormat.fanoutSize * 4)
    }

    /// The catalog stored in the snapshot.
    public var catalog: Catalog { self.header.catalog ?? Catalog() }

    /// The customer whose id or alias is `userId`, or nil for an unknown user. Throws a
    /// ``SnapshotError`` if the record found is corrupt; with `mayWait` false, ``WouldWait``
    /// if a page it needs is not in memory (the read would wait for the disk).
    public func customer(for userId: String, mayWait: Bool = true) throws -> CustomerRecord? {
        let hash = KeyHash.hash(userId)
        let bucket = Int(hash >> 48)
        let low = bucket == 0 ? 0 : Int(self.fanout[bucket - 1])
        let high = Int(self.fanout[bucket])
        guard high > low else {
            return nil
        }
        // The bucket's entries are sorted by hash: read them at once, then search.
        let count = high - low
        let entries = try self.file.read(count: count * SnapshotFormat.indexEntrySize, at: self.entriesOffset + UInt64(low * SnapshotFormat.indexEntrySize), mayWait: mayWait)
        return try entries.withUnsafeBytes { bytes in
            var first = 0
            var last = count
            while first < last {
                let middle = (first + last) / 2
                if bytes.littleEndian(at: middle * SnapshotFormat.indexEntrySize, as: UInt64.self) < hash {
                    first = middle + 1
                } else {
                    last = middle
                }
            }
            var position = first
            while position < count, bytes.littleEndian(at: position * SnapshotFormat.indexEntrySize, as: UInt64.self) == hash {
                let offset = bytes.littleEndian(at: position * SnapshotFormat.indexEntrySize + 8, as: UInt64.self)
                let record = try Self.readRecord(from: self.file, path: self.path, at: offset, limit: self.records.end, mayWait: mayWait)
                if record.id == userId || record.aliases.contains(userId) {
                    return record
                }
                position += 1  // a hash collision: another key with the same hash
            }
            return nil
        }
    }

    /// Calls `body` with every record in file order, verifying each checksum.
    public func forEachRecord(_ body: (CustomerRecord, _ offset: UInt64) throws -> Void) throws {
        var offset = self.records.offset
        while offset < self.records.end {
            let (record, size) = try Self.readRecordAndSize(from: self.file, path: self.path, at: offset, limit: self.records.end)
            try body(record, offset)
            offset += size
        }
    }

    /// Verifies every record's checksum and that the index points at every record's keys;
    /// `inspect` runs this. Opening already verified everything else.
    public func verifyRecords() throws -> (records: UInt64, keys: UInt64) {
        var records: UInt64 = 0
        var keys: UInt64 = 0
        try self.forEachRecord { record, offset in
            records += 1
            for key in [record.id ?? ""] + record.aliases {
                keys += 1
                guard try self.customer(for: key)?.id == record.id else {
                    throw SnapshotError(code: .corrupt, path: self.path, offset: offset, reason: "the index does not find \"\(key)\"")
                }
            }
        }
        guard records == self.header.recordCount else {
            throw SnapshotError(
                code: .corrupt,
                path: self.path,
                offset: self.records.offset,
                reason: "the header counts \(self.header.recordCount) records, the file holds \(records)"
            )
        }
        guard keys == self.keyCount else {
            throw SnapshotError(code: .corrupt, path: self.path, reason: "the index has \(self.keyCount) keys, the records \(keys)")
        }
        return (records, keys)
    }

    // MARK: Reading pieces

    static func readRecord(from file: FileDescriptor, path: String, at offset: UInt64, limit: UInt64, mayWait: Bool = true) throws -> CustomerRecord {
        try Self.readRecordAndSize(from: file, path: path, at: offset, limit: limit, mayWait: mayWait).record
    }

    /// Reads the record at `offset` (which must end by `limit`) with one pread when it is
    /// small, verifies its checksum and decodes it.
    static func readRecordAndSize(
        from file: FileDescriptor,
        path: String,
        at offset: UInt64,
        limit: UInt64,
        mayWait: Bool = true
    ) throws -> (record: CustomerRecord, size: UInt64) {
        guard offset + UInt64(SnapshotFormat.recordHeaderSize) <= limit else {
            throw SnapshotError(code: .corrupt, path: path, offset: offset, reason: "a record header would extend past the records section")
        }
        let speculative = Int(min(UInt64(SnapshotFormat.speculativeReadSize), limit - offset))
        return try withUnsafeTemporaryAllocation(byteCount: SnapshotFormat.speculativeReadSize, alignment: 8) { buffer in
            let got = try file.readUpTo(into: buffer, count: speculative, at: offset, mayWait: mayWait)
            guard got >= SnapshotFormat.recordHeaderSize else {
                throw SnapshotError(code: .truncated, path: path, offset: offset, reason: "the file ends inside a record header")
            }
            let header = UnsafeRawBufferPointer(buffer)
            let length = Int(header.littleEndian(at: 0, as: UInt32.self))
            let stored = header.littleEndian(at: 4, as: UInt32.self)
            let size = UInt64(SnapshotFormat.recordHeaderSize + length)
            guard length > 0 else {
                // A writer never writes an empty record (every record has an id), and an
                // all-zero header would otherwise pass: the CRC of no bytes is 0.
                throw SnapshotError(code: .corrupt, path: path, offset: offset, reason: "record with length 0")
            }
            guard length <= SnapshotFormat.maximumRecordSize, offset + size <= limit else {
                throw SnapshotError(
                    code: .corrupt,
                    path: path,
                    offset: offset,
                    reason: "record length \(length) runs past the records section, which ends at offset \(limit)"
                )
            }
            func decode(_ payload: UnsafeRawBufferPointer) throws -> CustomerRecord {
                let computed = CRC32C.checksum(payload)
                guard computed == stored else {
                    throw Self.checksumError(path: path, offset: offset, what: "record", stored: stored, computed: computed)
                }
                let record: CustomerRecord
                do {
                    record = try CustomerRecord(serializedBytes: payload)
                } catch {
                    throw SnapshotError(code: .corrupt, path: path, offset: offset, reason: "record: \(error)")
                }
                guard let id = record.id, !id.isEmpty else {
                    throw SnapshotError(code: .corrupt, path: path, offset: offset, reason: "record without a customer id")
                }
                return record
            }
            if SnapshotFormat.recordHeaderSize + length <= got {
                let payload = UnsafeRawBufferPointer(rebasing: header[SnapshotFormat.recordHeaderSize..<(SnapshotFormat.recordHeaderSize + length)])
                return (try decode(payload), size)
            }
            let payload = try file.read(count: length, at: offset + UInt64(SnapshotFormat.recordHeaderSize), mayWait: mayWait)
            return (try payload.withUnsafeBytes { try decode($0) }, size)
        }
    }

    /// Reads a small section and checks its trailing CRC-32C; returns it without the CRC.
    private static func readSection(_ file: FileDescriptor, path: String, _ range: SectionRange, name: String) throws -> [UInt8] {
        guard range.length >= 4, range.length <= 1 << 30 else {
            throw SnapshotError(code: .corrupt, path: path, offset: range.offset, reason: "the \(name) section has an impossible length \(range.length)")
        }
        var bytes = try file.read(count: Int(range.length), at: range.offset)
        let stored = bytes.withUnsafeBytes { $0.littleEndian(at: bytes.count - 4, as: UInt32.self) }
        bytes.removeLast(4)
        let computed = bytes.withUnsafeBytes { CRC32C.checksum($0) }
        guard stored == computed else {
            throw Self.checksumError(path: path, offset: range.offset, what: "\(name) section", stored: stored, computed: computed)
        }
        return bytes
    }

    private static func verifyIndex(
        _ file: FileDescriptor,
        path: String,
        _ range: SectionRange,
        records: SectionRange
    ) throws -> (fanout: [UInt32], entryCount: UInt64) {
        let fixed = UInt64(8 + SnapshotFormat.fanoutSize * 4)
        guard range.length >= fixed + 4 else {
            throw SnapshotError(code: .corrupt, path: path, offset: range.offset, reason: "the index section is too short (\(range.length) bytes)")
        }
        let head = try file.read(count: Int(fixed), at: range.offset)
        var crc = head.withUnsafeBytes { CRC32C.checksum($0) }
        let entryCount = head.withUnsafeBytes { $0.littleEndian(at: 0, as: UInt64.self) }
        guard entryCount <= (range.length - fixed - 4) / UInt64(SnapshotFormat.indexEntrySize),
            fixed + entryCount * UInt64(SnapshotFormat.indexEntrySize) + 4 == range.length
        else {
            throw SnapshotError(code: .corrupt, path: path, offset: range.offset, reason: "the index holds \(entryCount) entries, which does not match its length \(range.length)")
        }
        let fanout = head.withUnsafeBytes { bytes in
            (0..<SnapshotFormat.fanoutSize).map { bytes.littleEndian(at: 8 + $0 * 4, as: UInt32.self) }
        }
        // Entries, streamed in 1 MiB chunks: checksum, order, bucket and target offset. A
        // checksum mismatch is the root cause of any inconsistency, so it is reported first.
        var inconsistency: SnapshotError?
        func note(_ offset: UInt64, _ reason: String) {
            if inconsistency == nil {
                inconsistency = SnapshotError(code: .corrupt, path: path, offset: offset, reason: reason)
            }
        }
        var previous: UInt64 = 0
        var bucketEnd = 0
        var bucket = 0
        var position: UInt64 = 0
        let chunkEntries = 65_536
        var chunk = [UInt8](repeating: 0, count: chunkEntries * SnapshotFormat.indexEntrySize)
        while position < entryCount {
            let count = Int(min(UInt64(chunkEntries), entryCount - position))
            let chunkOffset = range.offset + fixed + position * UInt64(SnapshotFormat.indexEntrySize)
            try chunk.withUnsafeMutableBytes { try file.read(into: $0, count: count * SnapshotFormat.indexEntrySize, at: chunkOffset) }
            chunk.withUnsafeBytes { bytes in
                crc = CRC32C.checksum(UnsafeRawBufferPointer(rebasing: bytes[0..<(count * SnapshotFormat.indexEntrySize)]), continuing: crc)
                guard inconsistency == nil else {
                    return
                }
                for entry in 0..<count {
                    let hash = bytes.littleEndian(at: entry * SnapshotFormat.indexEntrySize, as: UInt64.self)
                    let target = bytes.littleEndian(at: entry * SnapshotFormat.indexEntrySize + 8, as: UInt64.self)
                    let here = chunkOffset + UInt64(entry * SnapshotFormat.indexEntrySize)
                    if position + UInt64(entry) > 0, hash < previous {
                        note(here, "index entries are out of order")
                    }
                    if target < records.offset || target >= records.end {
                        note(here, "index entry points at offset \(target), outside the records section \(records)")
                    }
                    // The entry's bucket must be the one the fanout puts it in.
                    let index = Int(position) + entry
                    while bucket < SnapshotFormat.fanoutSize, index >= bucketEnd {
                        bucketEnd = Int(fanout[bucket])
                        if index >= bucketEnd { bucket += 1 }
                    }
                    if bucket != Int(hash >> 48) {
                        note(here, "index entry is not in the fanout bucket of its hash")
                    }
                    previous = hash
                }
            }
            position += UInt64(count)
        }
        let stored = try file.read(count: 4, at: range.end - 4).withUnsafeBytes { $0.littleEndian(at: 0, as: UInt32.self) }
        guard stored == crc else {
            throw Self.checksumError(path: path, offset: range.offset, what: "index section", stored: stored, computed: crc)
        }
        if let inconsistency {
            throw inconsistency
        }
        for bucket in 1..<SnapshotFormat.fanoutSize where fanout[bucket] < fanout[bucket - 1] {
            throw SnapshotError(code: .corrupt, path: path, offset: range.offset + 8 + UInt64(bucket * 4), reason: "the index fanout decreases")
        }
        guard UInt64(fanout[SnapshotFormat.fanoutSize - 1]) == entryCount else {
            throw SnapshotError(code: .corrupt, path: path, offset: range.offset, reason: "the index fanout does not count every entry")
        }
        return (fanout, entryCount)
    }

    private static func checksumError(path: String, offset: UInt64, what: String, stored: UInt32, computed: UInt32) -> SnapshotError {
        SnapshotError(
            code: .corrupt,
            path: path,
            offset: offset,
            reason: "\(what) checksum mismatch (stored 0x\(String(stored, radix: 16)), computed 0x\(String(computed, radix: 16)))"
        )
    }
}
