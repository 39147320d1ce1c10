public import EntitlementsMessages
import NIOCore

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Writes a snapshot file (docs/snapshot-format.md), crash-safely: everything goes to a
/// temporary file beside the destination, which is fsynced, renamed over the destination
/// and the directory fsynced. A crash or an error before the rename leaves the destination
/// as it was (the old snapshot, or nothing).
///
/// Records stream through: only their index entries (16 bytes per id and alias) stay in
/// memory until ``finish(hotList:)``.
public struct SnapshotWriter: ~Copyable {
    /// The destination path.
    public let path: String
    private let temporaryPath: String
    private let file: FileDescriptor
    private var header: SnapshotHeader
    private var offset = UInt64(SnapshotFormat.fileHeaderSize)
    private var entries: [(hash: UInt64, offset: UInt64)] = []
    private var buffer = ByteBuffer()
    private var finished = false

    /// Starts a snapshot at `path` with `catalog`.
    ///
    /// - Parameters:
    ///   - snapshotId: identifies the snapshot (reported by Health); default: made from
    ///     the creation time and random bits.
    ///   - createdDate: Unix milliseconds.
    ///   - lastLogSequence: the last write-ahead log sequence the snapshot contains.
    ///   - fleetEpoch: fleet mode: the epoch of the change log `lastLogSequence` counts in.
    ///   - fleetCommittedDate: fleet mode: when the change log row `lastLogSequence` was
    ///     committed, if known.
    public init(
        path: String,
        catalog: Catalog,
        createdDate: Int64,
        snapshotId: String? = nil,
        lastLogSequence: UInt64 = 0,
        fleetEpoch: String? = nil,
        fleetCommittedDate: Int64? = nil
    ) throws {
        self.path = path
        self.temporaryPath = "\(path).tmp-\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        self.file = try FileDescriptor.create(self.temporaryPath)
        self.header = SnapshotHeader(
            formatVersion: SnapshotFormat.version,
            snapshotId: snapshotId ?? Self.makeSnapshotId(createdDate: createdDate),
            createdDate: createdDate,
            recordCount: 0,
            catalog: catalog,
            lastLogSequence: lastLogSequence,
            fleetEpoch: fleetEpoch,
            fleetCommittedDate: fleetCommittedDate
        )
    }

    deinit {
        if !self.finished {
            FileDescriptor.remove(self.temporaryPath)
        }
    }

    /// The number of records appended so far.
    public var recordCount: UInt64 { self.header.recordCount }

    /// Appends one customer. Its id and aliases become index keys; ``finish(hotList:)``
    /// rejects a key claimed by two customers.
    public mutating func append(_ record: CustomerRecord) throws {
        guard let id = record.id, !id.isEmpty else {
            throw SnapshotError(code: .invalidInput, path: self.path, reason: "record \(self.header.recordCount) has no customer id")
        }
        self.buffer.clear()
        self.buffer.writeInteger(UInt64(0))  // room for the record header
        do {
            try record.serialize(into: &self.buffer)
        } catch {
            throw SnapshotError(code: .invalidInput, path: self.path, reason: "customer \"\(id)\": \(error)")
        }
        let payloadLength = self.buffer.readableBytes - SnapshotFormat.recordHeaderSize
        guard payloadLength <= SnapshotFormat.maximumRecordSize else {
            throw SnapshotError(
                code: .invalidInput,
                path: self.path,
                reason: "customer \"\(id)\" encodes to \(payloadLength) bytes; a record is at most \(SnapshotFormat.maximumRecordSize)"
            )
        }
        let checksum = self.buffer.withUnsafeReadableBytes {
            CRC32C.checksum(UnsafeRawBufferPointer(rebasing: $0[SnapshotFormat.recordHeaderSize...]))
        }
        self.buffer.setInteger(UInt32(payloadLength), at: 0, endianness: .little)
        self.buffer.setInteger(checksum, at: 4, endianness: .little)
        try self.buffer.withUnsafeReadableBytes { try self.file.write($0, at: self.offset) }

        self.entries.append((KeyHash.hash(id), self.offset))
        for alias in record.aliases {
            self.entries.append((KeyHash.hash(alias), self.offset))
        }
        self.offset += UInt64(self.buffer.readableBytes)
        self.header.recordCount += 1
    }

    /// Writes the index, the hot list (customer ids, hottest first) and the header, then
    /// makes the file durable and moves it into place.
    ///
    /// `beforeRename` runs once the temporary file is complete and durable, just before it
    /// replaces the destination (compaction's crash tests stop the process there).
    public consuming func finish(hotList: [String] = [], beforeRename: () -> Void = {}) throws {
        let recordsRange = SectionRange(offset: UInt64(SnapshotFormat.fileHeaderSize), length: self.offset - UInt64(SnapshotFormat.fileHeaderSize))
        self.entries.sort { $0.hash != $1.hash ? $0.hash < $1.hash : $0.offset < $1.offset }
        try self.checkDuplicateKeys()

        // Index: entry count, fanout, entries, CRC.
        var index: [UInt8] = []
        index.reserveCapacity(8 + SnapshotFormat.fanoutSize * 4 + self.entries.count * SnapshotFormat.indexEntrySize + 4)
        index.appendLittleEndian(UInt64(self.entries.count))
        var position = 0
        for bucket in 0..<SnapshotFormat.fanoutSize {
            while position < self.entries.count, Int(self.entries[position].hash >> 48) <= bucket {
                position += 1
            }
            index.appendLittleEndian(UInt32(position))
        }
        for entry in self.entries {
            index.appendLittleEndian(entry.hash)
            index.appendLittleEndian(entry.offset)
        }
        let indexRange = try self.appendSection(&index)

        var hot: [UInt8] = []
        hot.appendLittleEndian(UInt32(hotList.count))
        for id in hotList {
            let bytes = Array(id.utf8.prefix(Int(UInt16.max)))
            hot.appendLittleEndian(UInt16(bytes.count))
            hot.append(contentsOf: bytes)
        }
        let hotRange = try self.appendSection(&hot)

        var headerBytes = try self.header.serializedBytes()
        let headerRange = try self.appendSection(&headerBytes)

        var fileHeader = SnapshotFormat.magic
        fileHeader.appendLittleEndian(SnapshotFormat.version)
        fileHeader.appendLittleEndian(UInt32(0))  // flags
        for range in [headerRange, recordsRange, indexRange, hotRange] {
            fileHeader.appendLittleEndian(range.offset)
            fileHeader.appendLittleEndian(range.length)
        }
        fileHeader.appendLittleEndian(self.offset)  // the file's length
        fileHeader.appendLittleEndian(UInt32(0))  // reserved
        fileHeader.appendLittleEndian(fileHeader.withUnsafeBytes { CRC32C.checksum($0) })
        assert(fileHeader.count == SnapshotFormat.fileHeaderSize)
        try fileHeader.withUnsafeBytes { try self.file.write($0, at: 0) }

        try self.file.sync()
        beforeRename()
        try FileDescriptor.move(self.temporaryPath, to: self.path)
        self.finished = true
        try FileDescriptor.syncDirectory(of: self.path)
    }

    /// Appends `bytes` and its CRC-32C as a section; returns where it went.
    private mutating func appendSection(_ bytes: inout [UInt8]) throws -> SectionRange {
        bytes.appendLittleEndian(bytes.withUnsafeBytes { CRC32C.checksum($0) })
        let range = SectionRange(offset: self.offset, length: UInt64(bytes.count))
        try bytes.withUnsafeBytes { try self.file.write($0, at: self.offset) }
        self.offset += range.length
        return range
    }

    /// Equal hashes are rare; for each run of them, read the records back and compare the
    /// keys themselves, so that two customers never claim one id or alias.
    private func checkDuplicateKeys() throws {
        var start = 0
        while start < self.entries.count {
            var end = start + 1
            while end < self.entries.count, self.entries[end].hash == self.entries[start].hash {
                end += 1
            }
            if end - start > 1 {
                let hash = self.entries[start].hash
                var owners: [String: String] = [:]
                var offsets = Set<UInt64>()
                for entry in self.entries[start..<end] where offsets.insert(entry.offset).inserted {
                    let record = try SnapshotReader.readRecord(from: self.file, path: self.temporaryPath, at: entry.offset, limit: self.offset)
                    let id = record.id ?? ""
                    for key in [id] + record.aliases where KeyHash.hash(key) == hash {
                        if let owner = owners[key] {
                            throw SnapshotError(
                                code: .invalidInput,
                                path: self.path,
                                reason: "\"\(key)\" is claimed by customer \"\(owner)\" and by customer \"\(id)\"; ids and aliases must be unique"
                            )
                        }
                        owners[key] = id
                    }
                }
            }
            start = end
        }
    }

    private static func makeSnapshotId(createdDate: Int64) -> String {
        var digits = String(UInt32.random(in: 0...UInt32.max), radix: 16)
        digits = String(repeating: "0", count: 8 - digits.count) + digits
        return "snap-\(createdDate)-\(digits)"
    }
}
