public import NIOCore

/// A message of `proto/entitlements/v1`, encoded and decoded by libprotobuf-c.
///
/// Every message is a plain Swift value. The bytes are standard protobuf: any protobuf
/// implementation reads what ``serialize(into:)`` writes, and ``init(serializedBytes:)``
/// reads what any implementation writes. Decoding and encoding throw ``ProtobufError``.
public protocol ProtobufMessage: Sendable, Hashable {
    /// The fully qualified proto name, e.g. `entitlements.v1.CheckEntitlementsRequest`.
    static var protoMessageName: String { get }

    /// The message with every field absent; it encodes to zero bytes.
    init()

    /// Decodes a message from its protobuf encoding.
    ///
    /// Throws ``ProtobufError`` when the bytes are not a valid encoding of this message,
    /// when a string is not UTF-8 or contains a NUL byte, or when an enum value is unknown.
    init(serializedBytes bytes: UnsafeRawBufferPointer) throws

    /// Appends the protobuf encoding of the message to `buffer`.
    ///
    /// Throws ``ProtobufError`` when a string contains a NUL byte, which protobuf-c's
    /// C strings cannot carry.
    func serialize(into buffer: inout ByteBuffer) throws
}

extension ProtobufMessage {
    /// Decodes a message from its protobuf encoding.
    public init(serializedBytes bytes: [UInt8]) throws {
        self = try bytes.withUnsafeBytes { try Self(serializedBytes: $0) }
    }

    /// Decodes a message from the readable bytes of `buffer`, which are not consumed.
    public init(buffer: ByteBuffer) throws {
        self = try buffer.withUnsafeReadableBytes { try Self(serializedBytes: $0) }
    }

    /// Decodes an answer from a peer that may be newer than this build: an enum value this
    /// build does not know is read as the enum's value 0 (unspecified) instead of failing
    /// (docs/PROTOCOL.md section 9: clients tolerate new values in responses; a server
    /// still refuses them in requests).
    public init(buffer: ByteBuffer, toleratingUnknownEnumValues: Bool) throws {
        guard toleratingUnknownEnumValues else {
            try self.init(buffer: buffer)
            return
        }
        self = try toleratingUnknownEnums { try Self(buffer: buffer) }
    }

    /// The protobuf encoding of the message.
    public func serializedBytes() throws -> [UInt8] {
        var buffer = ByteBuffer()
        try self.serialize(into: &buffer)
        return Array(buffer.readableBytesView)
    }
}
