import EntitlementsClient
import EntitlementsMessages
import EntitlementsServer
import EntitlementsWire
import NIOCore
import Testing

/// What docs/PROTOCOL.md and the schema promise a client written from them alone: every
/// request decoded, the schema's rules on every write, stream deadlines, offsets in every
/// connection error.
@Suite("protocol promises")
struct ProtocolPromisesTests {
    @Test("Health and Compact decode their request: garbage is INVALID_ARGUMENT, and Compact does not run")
    func emptyRequestsAreDecoded() async throws {
        let fixture = try await ServerFixture(writable: true)
        let before = fixture.server.store.snapshot.header.snapshotId
        let connection = try RawConnection(port: fixture.port)
        connection.send([
            Frame.request(id: 1, method: .health, payload: ByteBuffer(bytes: [0xFF])),
            Frame.request(id: 2, method: .compact, payload: ByteBuffer(bytes: [0xFF])),
            Frame.request(id: 3, method: .health, payload: ByteBuffer()),
        ])
        var seen: [UInt64: Frame] = [:]
        while seen.count < 3, let frame = try await offThePool({ try connection.receive() }) {
            seen[frame.requestID] = frame
        }
        #expect(seen[1]?.status == .invalidArgument && seen[1]?.message.hasPrefix("entitlements.v1.HealthRequest") == true, "\(seen[1]?.message ?? "-")")
        #expect(seen[2]?.status == .invalidArgument && seen[2]?.message.hasPrefix("entitlements.v1.CompactRequest") == true, "\(seen[2]?.message ?? "-")")
        #expect(seen[3]?.status == .ok)
        #expect(fixture.server.store.snapshot.header.snapshotId == before, "Compact ran")
        try await fixture.stop()
    }

    @Test("writes the schema calls invalid are refused over the wire, naming the field", arguments: [
        (Transaction(transactionId: "t", store: .manual, productId: "com.example.premium.monthly", transactionDate: now, expirationDate: now + 1_000, type: .subscriptionStarted),
            "transaction.store: must be APPSTORE, PLAYSTORE or STRIPE, got MANUAL"),
        (Transaction(transactionId: "t", store: .stripe, productId: "com.example.premium.monthly", transactionDate: now, type: .subscriptionStarted),
            "transaction.expiration_date: required for a SUBSCRIPTION_STARTED transaction"),
        (Transaction(transactionId: "t", store: .stripe, productId: "com.example.premium.monthly", transactionDate: now, expirationDate: now + 1_000),
            "transaction.type: required"),
    ])
    func schemaRules(transaction: Transaction, message: String) async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        await #expect {
            let _: WriteResponse = try await client.call(.recordTransaction, RecordTransactionRequest(userId: "user-1", transaction: transaction))
        } throws: { error in
            let error = error as! EntitlementsClientError
            return error.code == .invalidArgument && error.message.hasPrefix(message)
        }
        #expect(fixture.server.store.committedSequence == 0, "a refused write was logged")
        await client.close()
        try await fixture.stop()
    }

    @Test("a watch's timeout ends the stream with DEADLINE_EXCEEDED")
    func watchTimeout() async throws {
        let fixture = try await ServerFixture(writable: true)
        let connection = try RawConnection(port: fixture.port)
        connection.send([RawConnection.request(1, WatchEntitlementsRequest(userIds: ["user-1"]), method: .watchEntitlements, timeoutMicroseconds: 300_000)])
        let end = try await offThePool { try connection.receive() }
        #expect(end?.type == .endOfStream && end?.status == .deadlineExceeded, "\(String(describing: end))")
        try await fixture.stop()
    }

    @Test("a watch with all_customers ignores user_ids, as service.proto says")
    func allCustomersIgnoresUserIds() async throws {
        let fixture = try await ServerFixture(writable: true)
        let connection = try RawConnection(port: fixture.port)
        connection.send([
            RawConnection.request(1, WatchEntitlementsRequest(userIds: ["user-1"], allCustomers: true), method: .watchEntitlements),
            Frame(type: .ping, requestID: 7),
        ])
        #expect(try await offThePool { try connection.receive() }?.type == .pong, "the watch was refused")
        let client = fixture.client()
        let _: WriteResponse = try await client.call(.grantEntitlement, GrantEntitlementRequest(userId: "user-9", grant: Grant(grantId: "g", entitlementId: "beta", grantedDate: now)))
        let event = try #require(try await offThePool { try connection.receive() })
        #expect(event.type == .streamMessage)
        #expect(try EntitlementsChangedEvent(buffer: event.payload).customerId == "user-9")
        await client.close()
        try await fixture.stop()
    }

    @Test("every connection error names its stream offset", arguments: [
        ([RawConnection.request(5, CheckEntitlementsRequest(userId: "u")), RawConnection.request(5, CheckEntitlementsRequest(userId: "u"))], 27),
        ([RawConnection.request(0, CheckEntitlementsRequest(userId: "u"))], 0),
        ([Frame(type: .ping, requestID: 1), Frame(type: .response, requestID: 1, payload: ByteBuffer())], 24),
        ([Frame(type: .streamMessage, requestID: 1, payload: ByteBuffer())], 0),
        ([Frame(type: .endOfStream, requestID: 1, payload: ByteBuffer())], 0),
        ([Frame(type: .goAway, requestID: 1, payload: ByteBuffer())], 0),
    ] as [([Frame], Int)])
    func connectionErrorOffsets(frames: [Frame], offset: Int) async throws {
        let fixture = try await ServerFixture()
        let connection = try RawConnection(port: fixture.port)
        connection.send(frames)
        var error: Frame?
        while let frame = try await offThePool({ try connection.receive() }) {
            if frame.type == .error {
                error = frame
            }
        }
        #expect(error?.message.hasSuffix("(at stream offset \(offset))") == true, "\(error?.message ?? "no ERROR")")
        try await fixture.stop()
    }
}
