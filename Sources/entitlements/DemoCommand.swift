import ArgumentParser
import EntitlementsMessages
import EntitlementsWire
import NIOCore

/// `entitlements demo`: one CheckEntitlements exchange, encoded with protobuf-c, framed,
/// decoded again, and checked to come back identical. Shows the wire format at work
/// before the server exists.
struct DemoCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "demo",
        abstract: "Round-trip a CheckEntitlements request and response through protobuf-c and the frame codec."
    )

    @Flag(name: .long, help: "Print every frame as hex.")
    var hex = false

    @Option(name: .long, help: "The user id to put in the request (1 to 256 bytes, in Unicode NFC).")
    var user = "user-1"

    func validate() throws {
        if let problem = IdRule.problem(self.user) {
            throw ValidationError("--user \(problem)")
        }
        guard !self.user.utf8.contains(0) else {
            throw ValidationError("--user must not contain a NUL character")
        }
    }

    func run() throws {
        let now: Int64 = 1_767_225_600_000  // 2026-01-01T00:00:00Z, fixed so the output is stable
        let day: Int64 = 86_400_000
        let request = CheckEntitlementsRequest(userId: self.user, entitlementIds: ["premium"], at: now, environment: .production)
        let renewal = Transaction(
            originalTransactionId: "1000000000000001",
            transactionId: "1000000000000002",
            store: .appstore,
            productId: "com.app.monthly",
            transactionDate: now - 10 * day,
            expirationDate: now + 20 * day,
            environment: .production,
            ownershipType: .owner,
            type: .subscriptionRenewed
        )
        let response = CheckEntitlementsResponse(
            userId: self.user,
            customerId: self.user,
            requestDate: now,
            validUntil: now + 20 * day,
            entitlements: [
                Entitlement(
                    id: "premium",
                    isActive: true,
                    source: .appstore,
                    startedDate: now - 40 * day,
                    firstPurchaseDate: now - 40 * day,
                    lastPurchaseDate: now - 10 * day,
                    expirationDate: now + 20 * day,
                    productId: "com.app.monthly",
                    renewState: .willRenew,
                    renewsCount: 1,
                    grantType: .purchase,
                    transactions: [renewal],
                    willRenew: true,
                    ownershipType: .owner,
                    periodType: .normal
                )
            ]
        )

        var wire = ByteBuffer()
        var payload = ByteBuffer()
        try request.serialize(into: &payload)
        let requestFrameSize = wire.writeFrame(.request(id: 1, method: .checkEntitlements, timeoutMicroseconds: 50_000, payload: payload))
        payload.clear()
        try response.serialize(into: &payload)
        let responseFrameSize = wire.writeFrame(.response(id: 1, payload: payload))
        let allBytes = Array(wire.readableBytesView)

        var decoder = FrameDecoder()
        guard let requestFrame = try decoder.decode(buffer: &wire), let responseFrame = try decoder.decode(buffer: &wire) else {
            throw ValidationError("the frame decoder did not return both frames")
        }
        let decodedRequest = try CheckEntitlementsRequest(buffer: requestFrame.payload)
        let decodedResponse = try CheckEntitlementsResponse(buffer: responseFrame.payload)

        print("\(requestFrame.type) #\(requestFrame.requestID) \(requestFrame.method): \(requestFrameSize) bytes "
              + "(\(requestFrame.payload.readableBytes)-byte CheckEntitlementsRequest for \"\(self.user)\")")
        if self.hex { print(Self.hex(allBytes.prefix(requestFrameSize))) }
        print("\(responseFrame.type) #\(responseFrame.requestID) \(responseFrame.status): \(responseFrameSize) bytes "
              + "(\(responseFrame.payload.readableBytes)-byte CheckEntitlementsResponse)")
        if self.hex { print(Self.hex(allBytes.suffix(responseFrameSize))) }
        for entitlement in decodedResponse.entitlements {
            print("  \(entitlement.id ?? "?"): active=\(entitlement.isActive) renewState=\(entitlement.renewState) "
                  + "product=\(entitlement.productId ?? "-") expires=\(entitlement.expirationDate.map(String.init) ?? "never") (Unix ms)")
        }
        guard decodedRequest == request, decodedResponse == response else {
            print("MISMATCH: the decoded messages differ from the encoded ones")
            throw ExitCode.failure
        }
        print("Both messages decoded back identical: protobuf-c encode -> frame -> decode works.")
    }

    private static func hex(_ bytes: some Collection<UInt8>) -> String {
        stride(from: 0, to: bytes.count, by: 24).map { start in
            bytes.dropFirst(start).prefix(24).map { byte in
                let digits = String(byte, radix: 16)
                return digits.count == 1 ? "0" + digits : digits
            }.joined(separator: " ")
        }.map { "    " + $0 }.joined(separator: "\n")
    }
}
