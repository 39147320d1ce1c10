/// The constants and layout of snapshot format version 1 (docs/snapshot-format.md).
/// All integers are little-endian.
enum SnapshotFormat {
    /// `ENTSNAP` and a NUL: the first 8 bytes of every snapshot.
    static let magic: [UInt8] = Array("ENTSNAP".utf8) + [0]
    static let version: UInt32 = 1
    /// The fixed file header: magic, version, flags, the sections' offsets and lengths,
    /// the file's length, and a CRC-32C of the bytes before it.
    static let fileHeaderSize = 96
    /// Each record: payload length (u32), CRC-32C of the payload (u32), the payload.
    static let recordHeaderSize = 8
    /// The largest record payload accepted: 64 MiB. A larger length is corruption.
    static let maximumRecordSize = 64 << 20
    /// Index entries are grouped by the top 16 bits of their key hash.
    static let fanoutSize = 65_536
    /// An index entry: key hash (u64), record offset (u64).
    static let indexEntrySize = 16
    /// How much a record read asks for at once: most records (about 500 bytes) fit, so one
    /// pread suffices; a larger one costs a second.
    static let speculativeReadSize = 1_024
}

/// Where a section of the file is.
struct SectionRange: Equatable, CustomStringConvertible {
    var offset: UInt64
    var length: UInt64

    var end: UInt64 { self.offset + self.length }

    var description: String { "[\(self.offset), \(self.end))" }
}

/// The hash that places a key (customer id or alias) in the index: FNV-1a over the
/// UTF-8 bytes, then the MurmurHash3 finaliser so that similar ids spread over the
/// fanout. Stable across processes and machines, unlike Swift's `Hasher`.
public enum KeyHash {
    /// The hash of a key (its UTF-8 bytes).
    @inlinable
    public static func hash(_ key: String) -> UInt64 {
        var key = key
        return key.withUTF8 { Self.hash($0) }
    }

    /// The hash of a key's UTF-8 bytes (what the peek at a request's user id reads).
    /// Inlinable: the cache's shard choice and the peek call it for every check.
    @inlinable
    public static func hash(_ bytes: UnsafeBufferPointer<UInt8>) -> UInt64 {
        var hash: UInt64 = 0xCBF2_9CE4_8422_2325
        for byte in bytes {
            hash ^= UInt64(byte)
            hash &*= 0x0000_0100_0000_01B3
        }
        hash ^= hash >> 33
        hash &*= 0xFF51_AFD7_ED55_8CCD
        hash ^= hash >> 33
        hash &*= 0xC4CE_B9FE_1A85_EC53
        hash ^= hash >> 33
        return hash
    }
}

/// Why a snapshot cannot be opened or read, with the file and the byte offset where the
/// problem is: `data.snap: offset 4096: record checksum mismatch (...)`.
public struct SnapshotError: Error, Hashable, CustomStringConvertible {
    /// The kind of problem.
    public enum Code: Sendable, Hashable {
        /// The file cannot be opened, read or written.
        case io
        /// Not a snapshot file at all.
        case notASnapshot
        /// A snapshot of a format version this build does not read.
        case unsupportedVersion
        /// The file is shorter than its header says.
        case truncated
        /// A checksum does not match, or a structure is inconsistent.
        case corrupt
        /// The input would make an invalid snapshot (e.g. a key claimed twice).
        case invalidInput
    }

    /// The kind of problem.
    public var code: Code
    /// The snapshot's path.
    public var path: String
    /// The byte offset of the problem, when there is one.
    public var offset: UInt64?
    /// What is wrong.
    public var reason: String

    /// Creates an error.
    public init(code: Code, path: String, offset: UInt64? = nil, reason: String) {
        self.code = code
        self.path = path
        self.offset = offset
        self.reason = reason
    }

    public var description: String {
        "\(self.path): " + (self.offset.map { "offset \($0): " } ?? "") + self.reason
    }
}

// MARK: Little-endian helpers

extension Array where Element == UInt8 {
    mutating func appendLittleEndian<Integer: FixedWidthInteger>(_ value: Integer) {
        Swift.withUnsafeBytes(of: value.littleEndian) { self.append(contentsOf: $0) }
    }
}

extension UnsafeRawBufferPointer {
    func littleEndian<Integer: FixedWidthInteger>(at offset: Int, as type: Integer.Type) -> Integer {
        Integer(littleEndian: self.loadUnaligned(fromByteOffset: offset, as: Integer.self))
    }
}
