public import NIOCore

// Protobuf's wire format by hand, for the few paths that must not go through protobuf-c: a
// cached answer assembled from its stored bytes, a batch's answers concatenated, and the
// peek at a check's user id before the request is decoded. One reader and one writer, so
// that varints and tags are written in one place. Everything else encodes and decodes
// through the generated messages.

/// Writes varints, tags and bytes into memory reserved for them (at most
/// ``maximumVarintBytes`` per varint). Its position is a stored property changed by mutating
/// methods, which the compiler checks for exclusive access at compile time; as a `var`
/// captured by nested functions it was checked at run time, on every byte written (3% of
/// the server's CPU at 50 connections x 16).
@frozen
public struct ProtobufWriter {
    /// The most bytes a varint takes.
    public static let maximumVarintBytes = 10

    @usableFromInline
    let out: UnsafeMutableRawBufferPointer
    /// Bytes written so far.
    public var position = 0

    /// A writer at the start of `out`, which must have room for everything written.
    @inlinable
    public init(out: UnsafeMutableRawBufferPointer) {
        self.out = out
    }

    /// An unsigned varint (1 to 10 bytes).
    @inlinable
    public mutating func varint(_ value: UInt64) {
        var value = value
        while value >= 0x80 {
            self.out[self.position] = UInt8(truncatingIfNeeded: value) | 0x80
            self.position += 1
            value >>= 7
        }
        self.out[self.position] = UInt8(value)
        self.position += 1
    }

    /// How many bytes ``varint(_:)`` writes for `value`.
    @inlinable
    public static func varintByteCount(_ value: UInt64) -> Int {
        (64 - (value | 1).leadingZeroBitCount + 6) / 7
    }

    /// A field's tag: its number and wire type (0 varint, 2 length-delimited).
    @inlinable
    public mutating func tag(field: UInt64, wireType: UInt64) {
        self.varint(field << 3 | wireType)
    }

    /// Bytes as they are (a message's encoded fields).
    @inlinable
    public mutating func bytes(_ source: UnsafeRawBufferPointer) {
        guard let base = source.baseAddress, source.count > 0 else { return }
        (self.out.baseAddress! + self.position).copyMemory(from: base, byteCount: source.count)
        self.position += source.count
    }

    /// A length-delimited string field.
    @inlinable
    public mutating func string(field: UInt64, _ string: inout String) {
        string.withUTF8 { utf8 in
            self.tag(field: field, wireType: 2)
            self.varint(UInt64(utf8.count))
            self.bytes(UnsafeRawBufferPointer(utf8))
        }
    }
}

extension ByteBuffer {
    /// Appends a length-delimited field whose value is `value`'s readable bytes (an embedded
    /// message: a batch's answers are concatenated this way).
    @inlinable
    public mutating func writeProtobufField(_ field: UInt64, _ value: ByteBuffer) {
        self.writeWithUnsafeMutableBytes(minimumWritableBytes: ProtobufWriter.maximumVarintBytes * 2) { out in
            var writer = ProtobufWriter(out: out)
            writer.tag(field: field, wireType: 2)
            writer.varint(UInt64(value.readableBytes))
            return writer.position
        }
        self.writeImmutableBuffer(value)
    }
}

/// Reads varints and length-delimited fields from bytes that may be malformed: every read
/// says nil instead of reading past the end or accepting a varint longer than 10 bytes.
@frozen
public struct ProtobufReader {
    @usableFromInline
    let bytes: UnsafeRawBufferPointer
    /// Where the next read starts.
    public var position = 0

    /// A reader at the start of `bytes`.
    @inlinable
    public init(bytes: UnsafeRawBufferPointer) {
        self.bytes = bytes
    }

    /// Whether every byte has been read.
    @inlinable
    public var isAtEnd: Bool { self.position >= self.bytes.count }

    /// An unsigned varint, or nil when it is cut short or longer than 10 bytes.
    @inlinable
    public mutating func varint() -> UInt64? {
        var value: UInt64 = 0
        for shift in stride(from: 0, to: 64, by: 7) {
            guard self.position < self.bytes.count else {
                return nil
            }
            let byte = self.bytes[self.position]
            self.position += 1
            value |= UInt64(byte & 0x7F) << UInt64(shift)
            if byte < 0x80 {
                return value
            }
        }
        return nil
    }

    /// A length-delimited field's value: its range in the bytes.
    @inlinable
    public mutating func lengthDelimited() -> Range<Int>? {
        guard let length = self.varint(), length <= UInt64(self.bytes.count - self.position) else {
            return nil
        }
        let range = self.position..<(self.position + Int(length))
        self.position = range.upperBound
        return range
    }
}
