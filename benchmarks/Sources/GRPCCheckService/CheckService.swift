// The gRPC face of `EntitlementService.CheckEntitlements` (proto/entitlements/v1/service.proto),
// for the gRPC peer of the benchmarks: what protoc-gen-grpc-swift-2 would generate for this one
// method, written out because the messages go through the protobuf-c shim, as in our own server,
// rather than through SwiftProtobuf. No generated code: nothing to regenerate.
public import EntitlementsMessages
public import GRPCCore
public import NIOCore

/// The method: `/entitlements.v1.EntitlementService/CheckEntitlements`.
public enum CheckEntitlementsRPC {
    public static let descriptor = MethodDescriptor(
        fullyQualifiedService: "entitlements.v1.EntitlementService",
        method: "CheckEntitlements"
    )
}

/// Requests, encoded by the protobuf-c shim.
public struct CheckRequestSerializer: MessageSerializer {
    public init() {}

    public func serialize<Bytes: GRPCContiguousBytes>(_ message: CheckEntitlementsRequest) throws -> Bytes {
        Bytes(try message.serializedBytes())
    }
}

/// Requests, decoded by the protobuf-c shim.
public struct CheckRequestDeserializer: MessageDeserializer {
    public init() {}

    public func deserialize<Bytes: GRPCContiguousBytes>(_ serializedMessageBytes: Bytes) throws -> CheckEntitlementsRequest {
        try serializedMessageBytes.withUnsafeBytes { try CheckEntitlementsRequest(serializedBytes: $0) }
    }
}

/// Responses that are already encoded: the resolvers assemble a CheckEntitlementsResponse from
/// the cache's wire bytes (as our server does), so serializing is one copy.
public struct EncodedResponseSerializer: MessageSerializer {
    public init() {}

    public func serialize<Bytes: GRPCContiguousBytes>(_ message: ByteBuffer) throws -> Bytes {
        var bytes = Bytes(repeating: 0, count: message.readableBytes)
        bytes.withUnsafeMutableBytes { target in
            message.withUnsafeReadableBytes { source in
                target.copyMemory(from: source)
            }
        }
        return bytes
    }
}

/// The load generator's side: it counts the bytes of an answer and does not decode them, as it
/// does for our protocol and for Redis.
public struct ResponseSizeDeserializer: MessageDeserializer {
    public init() {}

    public func deserialize<Bytes: GRPCContiguousBytes>(_ serializedMessageBytes: Bytes) throws -> Int {
        serializedMessageBytes.count
    }
}
