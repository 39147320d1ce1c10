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
        // 24 bytes of header, then 5 of message (user_id "u", and explain false: bools are always sent).
        ([RawConnection.request(5, CheckEntitlementsRequest(userId: "u")), RawConnection.request(5, CheckEntitlementsRequest(userId: "u"))], 29),
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

/// Presence (PROTOCOL.md section 9) and the log sequence that lines a check up with a watch.
@Suite("presence and log sequences")
struct LogSequenceTests {
    /// The fields present in a protobuf message's top level, by number, with their varint
    /// values (0 for other wire types).
    static func fields(_ payload: ByteBuffer) -> [UInt64: UInt64] {
        var bytes = Array(payload.readableBytesView)[...]
        func varint() -> UInt64 {
            var value: UInt64 = 0
            var shift: UInt64 = 0
            while let byte = bytes.popFirst() {
                value |= UInt64(byte & 0x7F) << shift
                if byte < 0x80 { break }
                shift += 7
            }
            return value
        }
        var fields: [UInt64: UInt64] = [:]
        while !bytes.isEmpty {
            let key = varint()
            switch key & 7 {
            case 0: fields[key >> 3] = varint()
            case 2: let length = Int(varint()); bytes = bytes.dropFirst(length); fields[key >> 3] = 0
            default: return fields
            }
        }
        return fields
    }

    static func grant(_ user: String, _ id: String) -> GrantEntitlementRequest {
        GrantEntitlementRequest(userId: user, grant: Grant(grantId: id, entitlementId: "beta", grantedDate: now, expirationDate: now + 86_400_000 * 400))
    }

    @Test("a retried write answers changed: false on the wire (bools are always sent); an inactive entitlement sends is_active: false")
    func falseIsSent() async throws {
        let fixture = try await ServerFixture(writable: true)
        let connection = try RawConnection(port: fixture.port)
        connection.send([
            RawConnection.request(1, Self.grant("user-1", "g"), method: .grantEntitlement),
            RawConnection.request(2, Self.grant("user-1", "g"), method: .grantEntitlement),
        ])
        var answers: [UInt64: Frame] = [:]
        while answers.count < 2, let frame = try await offThePool({ try connection.receive() }) {
            answers[frame.requestID] = frame
        }
        let first = Self.fields(try #require(answers[1]).payload)
        let retry = Self.fields(try #require(answers[2]).payload)
        #expect(first[2] == 1 && first[3] == 1 && first[4] == 0, "\(first)")  // log_sequence 1, changed, created: false
        #expect(retry[2] == nil && retry[3] == 0 && retry[4] == 0, "\(retry)")  // not logged: no sequence; changed: false, sent
        // An entitlement that ended: is_active (field 2 of Entitlement) is there, false.
        let ended = Entitlement(id: "beta", isActive: false)
        #expect(Self.fields(ByteBuffer(bytes: try ended.serializedBytes()))[2] == 0)
        try await fixture.stop()
    }

    @Test("a check carries the log sequence it reflects, from the cache too; a watch after it resumes with what changed since, and nothing else")
    func checkThenWatch() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-5", "a"))
        let answer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-5"))
        #expect(answer.logSequence == 1)
        let cached = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-5"))
        #expect(cached.logSequence == 1 && cached.entitlements == answer.entitlements)
        // Changes after the check: user-5 again (2), and user-6 (3), whom nobody checked.
        let _: WriteResponse = try await client.call(.revokeGrant, RevokeGrantRequest(userId: "user-5", grantId: "a", revokedDate: now))
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-6", "b"))
        let connection = try RawConnection(port: fixture.port)
        connection.send([
            RawConnection.request(1, WatchEntitlementsRequest(userIds: ["user-5", "user-7"], afterLogSequence: Int64(answer.logSequence)), method: .watchEntitlements),
        ])
        let resumed = try EntitlementsChangedEvent(buffer: try #require(try await offThePool { try connection.receive() }).payload)
        #expect(resumed.cause == .resumed && resumed.customerId == "user-5" && resumed.logSequence == 3)
        #expect(resumed.current?.entitlements.first { $0.id == "beta" }?.isActive == false)
        #expect(resumed.current?.logSequence == 3)
        // user-7 did not change after the check: its first event is its next write's.
        let write: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-7", "c"))
        let next = try EntitlementsChangedEvent(buffer: try #require(try await offThePool { try connection.receive() }).payload)
        #expect(next.cause == .write && next.customerId == "user-7" && next.logSequence == write.logSequence)

        // Watching from a fresh answer's sequence: no catch-up event at all.
        let fresh = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-5"))
        #expect(fresh.logSequence == 4)
        connection.send([RawConnection.request(2, WatchEntitlementsRequest(userIds: ["user-5"], afterLogSequence: Int64(fresh.logSequence)), method: .watchEntitlements)])
        let grant: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-5", "d"))
        let after = try EntitlementsChangedEvent(buffer: try #require(try await offThePool { try connection.receive() }).payload)
        #expect(after.cause == .write && after.customerId == "user-5" && after.logSequence == grant.logSequence)
        await client.close()
        try await fixture.stop()
    }

    @Test("min_log_sequence: answered once applied; a sequence this server does not have fails UNAVAILABLE naming what it has")
    func minimumSequence() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let write: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-5", "a"))
        let answer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-5", minLogSequence: write.logSequence))
        #expect(answer.entitlements.contains { $0.id == "beta" && $0.isActive })
        let batch = try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: ["user-5", "user-6"], minLogSequence: write.logSequence))
        #expect(batch.results.count == 2)
        // Sequence 9 was never written here: after the wait, UNAVAILABLE with the applied one.
        for call in ["check", "batch"] {
            await #expect {
                if call == "check" {
                    _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-5", minLogSequence: 9))
                } else {
                    _ = try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: ["user-5"], minLogSequence: 9))
                }
            } throws: { error in
                let failure = error as? EntitlementsClientError
                return failure?.code == .unavailable && failure?.message.contains("applied log sequence 1, the call asked for min_log_sequence 9") == true
            }
        }
        await client.close()
        try await fixture.stop()
    }

    @Test("an every-customer watch resumes from the overlay, and refuses a sequence compaction folded away")
    func everyCustomerResume() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let first: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-1", "a"))
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-2", "b"))
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-3", "c"))
        var events: [String] = []
        for try await event in try await client.watch(WatchEntitlementsRequest(allCustomers: true, afterLogSequence: Int64(first.logSequence))) {
            #expect(event.cause == .resumed)
            events.append(event.customerId ?? "")
            if events.count == 2 {
                break
            }
        }
        #expect(events == ["user-2", "user-3"])
        _ = try await fixture.server.compact()
        await #expect {
            for try await _ in try await client.watch(WatchEntitlementsRequest(allCustomers: true, afterLogSequence: 1)) {}
        } throws: { error in
            let error = error as! EntitlementsClientError
            return error.code == .failedPrecondition && error.message.hasPrefix("after_log_sequence 1 is older than the snapshot")
        }
        await client.close()
        try await fixture.stop()
    }
}
