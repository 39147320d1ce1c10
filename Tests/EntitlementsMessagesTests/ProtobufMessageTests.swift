import NIOCore
import Testing

@testable import EntitlementsMessages

@Suite("Swift <-> protobuf-c round trips")
struct ProtobufRoundTripTests {
    @Test("the fixtures cover every generated message type")
    func fixturesCoverEveryMessage() {
        let fixtureNames = Fixtures.all.map { type(of: $0).protoMessageName }
        let generatedNames = allProtobufMessageTypes.map { $0.protoMessageName }
        #expect(fixtureNames == generatedNames)
    }

    @Test("every message round-trips with all fields set", arguments: Fixtures.all.indices)
    func roundTripAllFieldsSet(index: Int) throws {
        // Only messages without fields (HealthRequest, CompactRequest) encode to nothing.
        let message = Fixtures.all[index]
        let hasFields = !(type(of: message) as! any ProtobufCBacked.Type).protobufCFieldNames.isEmpty
        try Self.expectRoundTrip(message, isEmpty: !hasFields)
    }

    @Test("every message round-trips with no field set, and then sends only its bool fields, as false", arguments: allProtobufMessageTypes.indices)
    func roundTripNoFieldSet(index: Int) throws {
        try Self.expectEmptyRoundTrip(allProtobufMessageTypes[index].init())
    }

    private static func expectEmptyRoundTrip<Message: ProtobufMessage>(_ message: Message) throws {
        let bytes = try message.serializedBytes()
        // Bools are always sent (docs/PROTOCOL.md section 9): each is a tag and a 0 byte.
        // Nothing else is, so every other field of an empty message is absent.
        var rest = bytes[...]
        func varint() -> UInt64? {
            var value: UInt64 = 0
            var shift: UInt64 = 0
            while let byte = rest.popFirst() {
                value |= UInt64(byte & 0x7F) << shift
                if byte < 0x80 {
                    return value
                }
                shift += 7
            }
            return nil
        }
        var onlyFalseBools = true
        while !rest.isEmpty {
            guard let key = varint(), key & 7 == 0, varint() == 0 else {
                onlyFalseBools = false
                break
            }
        }
        #expect(onlyFalseBools, "\(Message.protoMessageName): \(bytes)")
        #expect(try Message(serializedBytes: bytes) == message)
    }

    @Test("every case of LogRecord.mutation round-trips", arguments: Fixtures.logRecordsForEveryMutation)
    func roundTripEveryMutation(record: LogRecord) throws {
        #expect(try LogRecord(serializedBytes: record.serializedBytes()) == record)
    }

    @Test("the Swift structs cover every field of protoc-c's descriptors")
    func swiftFieldsMatchDescriptors() {
        // Mirror sees the stored properties of the fully populated fixture; each must
        // correspond to one field of protoc-c's descriptor (oneof members share one).
        for message in Fixtures.all {
            let type = type(of: message) as! any ProtobufCBacked.Type
            let descriptorFields = Set(type.protobufCFieldNames.map { Self.lowerCamel($0) })
            let swiftFields = Set(Mirror(reflecting: message).children.compactMap(\.label))
            let oneofMembers = descriptorFields.subtracting(swiftFields)
            // The oneofs: one Swift property for all their members.
            #expect(swiftFields.subtracting(descriptorFields).subtracting(["mutation", "purchase"]).isEmpty, "\(type.protoMessageName)")
            if type == LogRecord.self {
                #expect(oneofMembers.count == 7)
            } else if type == SubmitPurchaseRequest.self {
                #expect(oneofMembers == ["appStore", "googlePlay"])
            } else {
                #expect(oneofMembers.isEmpty, "\(type.protoMessageName) lacks \(oneofMembers.sorted())")
            }
        }
    }

    @Test("strings outside the stack arena spill to the heap and come back intact")
    func largeMessageRoundTrip() throws {
        // ~1,000 transactions need far more than the 8 KiB stack block of the arena.
        let transactions = (0..<1_000).map { index in
            Transaction(
                originalTransactionId: "chain-\(index / 10)",
                transactionId: "tx-\(index)",
                store: .appstore,
                productId: String(repeating: "p", count: index % 300),
                transactionDate: Int64(index),
                type: .subscriptionRenewed
            )
        }
        let record = CustomerRecord(id: "user-1", aliases: ["a", ""], transactions: transactions)
        let bytes = try record.serializedBytes()
        #expect(bytes.count > 100_000)
        #expect(try CustomerRecord(serializedBytes: bytes) == record)
    }

    @Test("serialize(into:) appends after existing bytes and init(buffer:) reads only the readable bytes")
    func byteBufferInterop() throws {
        var buffer = ByteBuffer(string: "head")
        try Fixtures.checkRequest.serialize(into: &buffer)
        #expect(buffer.readString(length: 4) == "head")
        #expect(try CheckEntitlementsRequest(buffer: buffer) == Fixtures.checkRequest)
    }

    @Test("an empty string and an absent string stay different")
    func emptyStringIsNotAbsent() throws {
        let message = DeleteCustomerRequest(userId: "")
        let bytes = try message.serializedBytes()
        #expect(bytes == [0x0A, 0x00])
        #expect(try DeleteCustomerRequest(serializedBytes: bytes).userId == "")
        #expect(try DeleteCustomerRequest(serializedBytes: []).userId == nil)
    }

    @Test("an unknown enum value fails a decode, unless the decode tolerates it (a client reading a newer server)")
    func unknownEnumValues() throws {
        let bytes: [UInt8] = [0x0A, 0x01, 0x75, 0x10, 0x63]  // customer_id "u", cause 99
        #expect(throws: ProtobufError.self) { try EntitlementsChangedEvent(serializedBytes: bytes) }
        let tolerant = try EntitlementsChangedEvent(buffer: ByteBuffer(bytes: bytes), toleratingUnknownEnumValues: true)
        #expect(tolerant.customerId == "u" && tolerant.cause == .unspecified)
        // The tolerance was for that decode only.
        #expect(throws: ProtobufError.self) { try EntitlementsChangedEvent(serializedBytes: bytes) }
    }

    @Test("a zero timestamp and an absent timestamp stay different")
    func zeroDateIsNotAbsent() throws {
        let zero = try Grant(serializedBytes: Grant(expirationDate: 0).serializedBytes())
        #expect(zero.expirationDate == 0)
        let absent = try Grant(serializedBytes: Grant().serializedBytes())
        #expect(absent.expirationDate == nil)
    }

    private static func expectRoundTrip(_ message: some ProtobufMessage, isEmpty: Bool) throws {
        let bytes = try message.serializedBytes()
        #expect(bytes.isEmpty == isEmpty, "\(type(of: message).protoMessageName): \(bytes.count) bytes")
        let decoded = try type(of: message).init(serializedBytes: bytes)
        #expect(decoded == message)
    }

    private static func lowerCamel(_ snake: String) -> String {
        let parts = snake.split(separator: "_")
        return parts.enumerated().map { $0 == 0 ? String($1) : $1.prefix(1).uppercased() + $1.dropFirst() }.joined()
    }
}

@Suite("decoding bad input")
struct ProtobufDecodingErrorTests {
    struct Case: Sendable, CustomStringConvertible {
        var name: String
        var bytes: [UInt8]
        var code: ProtobufError.Code
        var description: String
    }

    static let requestCases: [Case] = [
        Case(name: "a truncated varint", bytes: [0x18, 0xFF], code: .malformed,
             description: "entitlements.v1.CheckEntitlementsRequest: 2 bytes are not a valid protobuf encoding of this message"),
        Case(name: "a length past the end", bytes: [0x0A, 0x05, 0x61], code: .malformed,
             description: "entitlements.v1.CheckEntitlementsRequest: 3 bytes are not a valid protobuf encoding of this message"),
        Case(name: "a field number of zero", bytes: [0x00, 0x01], code: .malformed,
             description: "entitlements.v1.CheckEntitlementsRequest: 2 bytes are not a valid protobuf encoding of this message"),
        Case(name: "a string with the wrong wire type", bytes: [0x08, 0x01], code: .malformed,
             description: "entitlements.v1.CheckEntitlementsRequest: 2 bytes are not a valid protobuf encoding of this message"),
        Case(name: "invalid UTF-8", bytes: [0x0A, 0x02, 0xC3, 0x28], code: .invalidString,
             description: "entitlements.v1.CheckEntitlementsRequest.user_id: string is not valid UTF-8"),
        Case(name: "an embedded NUL", bytes: [0x0A, 0x03, 0x61, 0x00, 0x62], code: .invalidString,
             description: "entitlements.v1.CheckEntitlementsRequest.user_id: string contains a NUL byte"),
        Case(name: "a NUL in a repeated string", bytes: [0x12, 0x01, 0x61, 0x12, 0x01, 0x00], code: .invalidString,
             description: "entitlements.v1.CheckEntitlementsRequest.entitlement_ids[1]: string contains a NUL byte"),
        Case(name: "an unknown enum value", bytes: [0x20, 0x09], code: .unknownEnumValue,
             description: "entitlements.v1.CheckEntitlementsRequest.environment: unknown enum value 9"),
    ]

    @Test("CheckEntitlementsRequest rejects", arguments: requestCases)
    func rejects(testCase: Case) {
        #expect {
            try CheckEntitlementsRequest(serializedBytes: testCase.bytes)
        } throws: { error in
            let error = error as! ProtobufError
            return error.code == testCase.code && error.description == testCase.description
        }
    }

    @Test("an error deep inside names the whole field path")
    func nestedErrorPath() throws {
        // entitlements[1].transactions[0].type = 42
        var inner = ByteBuffer()
        try Entitlement(id: "pro").serialize(into: &inner)
        inner.writeBytes([0x7A, 0x02, 0x58, 0x2A])  // field 15 (transactions) { field 11 (type): 42 }
        var bytes = try CheckEntitlementsResponse(entitlements: [Entitlement(id: "premium")]).serializedBytes()
        bytes += [0x2A, UInt8(inner.readableBytes)] + inner.readableBytesView
        #expect {
            try CheckEntitlementsResponse(serializedBytes: bytes)
        } throws: { error in
            (error as? ProtobufError)?.description
                == "entitlements.v1.CheckEntitlementsResponse.entitlements[1].transactions[0].type: unknown enum value 42"
        }
    }

    @Test("unknown fields are skipped, so newer senders can add fields")
    func unknownFieldsAreSkipped() throws {
        // field 99 (varint 1), then user_id = "u"
        let bytes: [UInt8] = [0x98, 0x06, 0x01, 0x0A, 0x01, 0x75]
        #expect(try CheckEntitlementsRequest(serializedBytes: bytes) == CheckEntitlementsRequest(userId: "u"))
    }

    @Test("a small message that would unpack into too much memory is refused")
    func amplificationIsBounded() {
        // 4 million empty results: 8 MB on the wire, but each becomes a C struct of
        // more than 64 bytes, well past the arena's limit.
        let bytes = (0..<8_000_000).map { $0 % 2 == 0 ? UInt8(0x0A) : 0x00 }
        #expect {
            try BatchCheckEntitlementsResponse(serializedBytes: bytes)
        } throws: { error in
            (error as? ProtobufError)?.code == .tooLarge
        }
    }
}

@Suite("encoding bad input")
struct ProtobufEncodingErrorTests {
    @Test("a string with a NUL byte cannot be encoded, and the error names the field")
    func nulByteInString() {
        let message = CheckEntitlementsResponse(entitlements: [Entitlement(id: "ok"), Entitlement(productId: "a\u{0}b")])
        #expect {
            try message.serializedBytes()
        } throws: { error in
            (error as? ProtobufError)?.description
                == "entitlements.v1.CheckEntitlementsResponse.entitlements[1].product_id: string contains a NUL byte, which protobuf-c cannot carry"
        }
    }
}
