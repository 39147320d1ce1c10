import EntitlementsMessages
import NIOCore

func roundTrip<Message: ProtobufMessage>(_ type: Message.Type, _ bytes: UnsafeRawBufferPointer) {
    guard let message = try? Message(serializedBytes: bytes) else { return }
    // What decodes must encode, and decode again to the same value.
    guard let encoded = try? message.serializedBytes() else {
        fatalError("\(Message.protoMessageName) decoded but does not encode")
    }
    guard let again = try? Message(serializedBytes: encoded), again == message else {
        fatalError("\(Message.protoMessageName) does not round-trip")
    }
}

/// The first byte picks the message; the rest is its encoding.

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    guard size > 0 else { return 0 }
    let bytes = UnsafeRawBufferPointer(start: data + 1, count: size - 1)
    switch data[0] % 12 {
    case 0: roundTrip(CheckEntitlementsRequest.self, bytes)
    case 1: roundTrip(BatchCheckEntitlementsRequest.self, bytes)
    case 2: roundTrip(WatchEntitlementsRequest.self, bytes)
    case 3: roundTrip(HealthRequest.self, bytes)
    case 4: roundTrip(RecordTransactionRequest.self, bytes)
    case 5: roundTrip(UpdateSubscriptionStateRequest.self, bytes)
    case 6: roundTrip(GrantEntitlementRequest.self, bytes)
    case 7: roundTrip(RevokeGrantRequest.self, bytes)
    case 8: roundTrip(LinkAliasRequest.self, bytes)
    case 9: roundTrip(DeleteCustomerRequest.self, bytes)
    case 10: roundTrip(CompactRequest.self, bytes)
    default: roundTrip(CheckEntitlementsResponse.self, bytes)
    }
    return 0
}
