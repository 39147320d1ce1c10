import EntitlementsClient
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsServer
import EntitlementsCache
import EntitlementsStore
import EntitlementsTools
import EntitlementsWire
import Foundation
import NIOCore
import NIOConcurrencyHelpers
import NIOPosix
import Testing

/// Real sockets on port 0 (and a Unix socket), a real snapshot, the real client.
@Suite("server end to end", .serialized)
struct EntitlementsServerTests {
    @Test("check through the client: customers, aliases and unknown users, answered as the resolver answers")
    func checkThroughClient() async throws {
        let fixture = try await ServerFixture()
        let client = fixture.client()
        let resolver = EntitlementResolver(catalog: fixture.snapshot.catalog)
        // Twice: the second pass answers from the caches, and aliases from the resolvers'
        // alias memory (no snapshot read), which must give the same answers.
        for index in Array(0..<100) + Array(0..<100) {
            let record = try #require(try fixture.snapshot.customer(for: "user-\(index)"))
            for userId in [record.id!] + record.aliases {
                let response = try await client.checkEntitlements(CheckEntitlementsRequest(userId: userId, at: now))
                let expected = resolver.resolve(record, at: now)
                #expect(response.userId == userId)
                #expect(response.customerId == record.id)
                #expect(response.requestDate == now)
                #expect(response.entitlements == expected.entitlements)
                #expect(response.validUntil == expected.validUntil)
            }
        }
        let unknown = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nobody", at: now))
        #expect(unknown.customerId == nil && unknown.entitlements.isEmpty && unknown.userId == "nobody")
        let filtered = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-2", entitlementIds: ["pro"], at: now))
        #expect(filtered.entitlements.allSatisfy { $0.id == "pro" })
        let health = try await client.health()
        #expect(health.status == .serving)
        #expect(health.snapshotId == fixture.snapshot.header.snapshotId)
        // Explained (user-2 was answered, so cached, above): the same answer, explained.
        let plain = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-2", at: now))
        let explained = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-2", at: now, explain: true))
        #expect(plain.explanation == nil && explained.entitlements == plain.entitlements && explained.validUntil == plain.validUntil)
        let explanation = try #require(explained.explanation)
        #expect(explanation.snapshotId == fixture.snapshot.header.snapshotId)
        #expect(explanation.entitlements.map(\.entitlementId) == plain.entitlements.map(\.id))
        await client.close()
        try await fixture.stop()
    }

    @Test("CustomerHistory over the framed protocol: each write with its caller, a bad id refused, the limit kept")
    func historyThroughClient() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        for id in ["h-1", "h-2", "h-3"] {
            let grant = GrantEntitlementRequest(userId: "user-7", grant: Grant(grantId: id, entitlementId: "beta", expirationDate: 4_102_444_800_000))
            let _: WriteResponse = try await client.call(.grantEntitlement, grant)
        }
        let history: CustomerHistoryResponse = try await client.call(.customerHistory, CustomerHistoryRequest(userId: "user-7"))
        #expect(history.customerId == "user-7" && history.logSequence == 3 && history.startsAfterLogSequence == 0)
        // The snapshot's user-7, then the three grants, each by a caller on the TCP listener.
        #expect(history.entries.map(\.cause) == [.unspecified, .write, .write, .write])
        #expect(history.entries.dropFirst().allSatisfy { $0.source == WriteSource(method: "GrantEntitlement", caller: "tcp anonymous") })
        #expect(history.entries[1].changes.map(\.entitlementId) == ["beta"])
        #expect(history.entries.last?.entitlements.first { $0.id == "beta" }?.isActive == true)
        let latest: CustomerHistoryResponse = try await client.call(.customerHistory, CustomerHistoryRequest(userId: "user-7", limit: 2))
        #expect(latest.truncated && latest.entries.map(\.logSequence) == [2, 3])
        await #expect(throws: EntitlementsClientError.self) {
            let _: CustomerHistoryResponse = try await client.call(.customerHistory, CustomerHistoryRequest(userId: ""))
        }
        await client.close()
        try await fixture.stop()
    }

    @Test("explain on the framed transport: the last field 6 counts, and unknown fixed-width fields do not hide it")
    func explainFlagInRawBytes() async throws {
        let fixture = try await ServerFixture()
        let connection = try RawConnection(port: fixture.port)
        // user_id "user-1"; explain false; explain true; field 7 as fixed32 (unknown)
        let explained: [UInt8] = [0x0A, 0x06] + Array("user-1".utf8) + [0x30, 0x00, 0x30, 0x01, 0x3D, 1, 2, 3, 4]
        // user_id "user-1"; explain true; explain false
        let plain: [UInt8] = [0x0A, 0x06] + Array("user-1".utf8) + [0x30, 0x01, 0x30, 0x00]
        connection.send([
            Frame.request(id: 1, method: .checkEntitlements, payload: ByteBuffer(bytes: explained)),
            Frame.request(id: 2, method: .checkEntitlements, payload: ByteBuffer(bytes: plain)),
        ])
        var seen: [UInt64: Frame] = [:]
        while seen.count < 2, let frame = try connection.receive() {
            seen[frame.requestID] = frame
        }
        let first = try CheckEntitlementsResponse(buffer: try #require(seen[1]?.payload))
        let second = try CheckEntitlementsResponse(buffer: try #require(seen[2]?.payload))
        #expect(first.explanation != nil && first.customerId == "user-1")
        #expect(second.explanation == nil && second.customerId == "user-1")
        try await fixture.stop()
    }

    @Test("checkResponse (the resolvers behind another transport) answers byte for byte what the server sends")
    func checkResponseMatchesTheServer() async throws {
        let fixture = try await ServerFixture()
        let client = fixture.client()
        // Customers and their aliases (some forwarded to the other resolver), then an unknown user.
        for index in 0..<50 {
            let record = try #require(try fixture.snapshot.customer(for: "user-\(index)"))
            for userId in [record.id!] + record.aliases {
                let bytes = try await fixture.server.pool.checkResponse(userId: userId, at: now)
                let viaServer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: userId, at: now))
                #expect(try CheckEntitlementsResponse(buffer: bytes) == viaServer)
                #expect(Array(bytes.readableBytesView) == (try viaServer.serializedBytes()))
            }
        }
        let unknown = try CheckEntitlementsResponse(buffer: try await fixture.server.pool.checkResponse(userId: "nobody", at: now))
        #expect(unknown.userId == "nobody" && unknown.customerId == nil && unknown.entitlements.isEmpty)
        for (userId, entitlementIds) in [("", [String]()), ("user-1", [""]), (String(repeating: "x", count: 257), [])] {
            let failure = await #expect(throws: ServiceError.self) {
                try await fixture.server.pool.checkResponse(userId: userId, entitlementIds: entitlementIds, at: now)
            }
            #expect(failure?.status == .invalidArgument)
        }
        await client.close()
        try await fixture.stop()
    }

    @Test("once the server closes its connections without a drain, checks fail UNAVAILABLE and are not resolved")
    func abandonedChecks() async throws {
        let fixture = try await ServerFixture()
        _ = try await fixture.server.pool.checkResponse(userId: "user-3", at: now)
        func misses() async -> UInt64 {
            var total: UInt64 = 0
            for resolver in fixture.server.pool.resolvers {
                total += await resolver.cacheStatistics.misses
            }
            return total
        }
        let before = await misses()
        fixture.server.closeAllConnections()
        for index in 0..<20 {
            let failure = await #expect(throws: ServiceError.self) {
                try await fixture.server.pool.checkResponse(userId: "user-\(index)", environment: .sandbox, at: now)
            }
            #expect(failure?.status == .unavailable)
        }
        #expect(await misses() == before, "a check ran after the server gave up its drain")
        try await fixture.stop()
    }

    @Test("a miss is counted once, and the repeated check is a hit")
    func missCountedOnce() async throws {
        let fixture = try await ServerFixture()
        let client = fixture.client()
        func totals() async -> (hits: UInt64, misses: UInt64) {
            var hits: UInt64 = 0
            var misses: UInt64 = 0
            for resolver in fixture.server.pool.resolvers {
                let statistics = await resolver.cacheStatistics
                hits += statistics.hits
                misses += statistics.misses
            }
            return (hits, misses)
        }
        // Warm-up cached production answers; a sandbox check is a new request shape.
        let before = await totals()
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-4", at: now, environment: .sandbox))
        let afterMiss = await totals()
        #expect(afterMiss.misses - before.misses == 1 && afterMiss.hits == before.hits)
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-4", at: now, environment: .sandbox))
        let afterHit = await totals()
        #expect(afterHit.hits - afterMiss.hits == 1 && afterHit.misses == afterMiss.misses)
        await client.close()
        try await fixture.stop()
    }

    @Test("bad requests get a clear status and the connection stays usable", arguments: [
        (CheckEntitlementsRequest(userId: ""), StatusCode.invalidArgument, "user_id: must not be empty"),
        (CheckEntitlementsRequest(), .invalidArgument, "user_id: must not be empty"),
        (CheckEntitlementsRequest(userId: String(repeating: "x", count: 257)), .invalidArgument, "user_id: must be at most 256 bytes, got 257"),
        (CheckEntitlementsRequest(userId: "u", entitlementIds: [""]), .invalidArgument, "entitlement_ids[0]: must not be empty"),
        (CheckEntitlementsRequest(userId: "Zoe\u{308}"), .invalidArgument, "user_id: must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"),
        (CheckEntitlementsRequest(userId: "u", entitlementIds: ["pre\u{301}mium"]), .invalidArgument, "entitlement_ids[0]: must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"),
    ])
    func badRequests(request: CheckEntitlementsRequest, code: StatusCode, message: String) async throws {
        let fixture = try await ServerFixture()
        let client = fixture.client()
        await #expect {
            try await client.checkEntitlements(request)
        } throws: { error in
            (error as? EntitlementsClientError) == EntitlementsClientError(code: code, message: message)
        }
        #expect(try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-1")).userId == "user-1")
        await client.close()
        try await fixture.stop()
    }

    @Test("raw protocol: unknown method, undecodable payload, ping, and a non-increasing id")
    func rawProtocol() async throws {
        let fixture = try await ServerFixture()
        let connection = try RawConnection(port: fixture.port)
        connection.send([
            Frame.request(id: 1, method: MethodID(rawValue: 99), payload: ByteBuffer()),
            Frame.request(id: 2, method: .checkEntitlements, payload: ByteBuffer(bytes: [0xFF, 0xFF])),
            Frame(type: .ping, requestID: 0xABCD),
            RawConnection.request(3, CheckEntitlementsRequest(userId: "user-1")),
        ])
        var seen: [UInt64: Frame] = [:]
        while seen.count < 4, let frame = try connection.receive() {
            seen[frame.requestID] = frame
        }
        #expect(seen[1]?.status == .unimplemented && seen[1]?.message == "method 99 is not implemented by this server")
        #expect(seen[2]?.status == .invalidArgument && seen[2]?.message.hasPrefix("entitlements.v1.CheckEntitlementsRequest") == true)
        #expect(seen[0xABCD]?.type == .pong)
        #expect(seen[3]?.status == .ok)
        // Reusing an id is a protocol violation: ERROR, then the connection closes.
        connection.send([RawConnection.request(3, CheckEntitlementsRequest(userId: "user-1"))])
        let error = try #require(try connection.receive())
        #expect(error.type == .error && error.status == .invalidArgument)
        #expect(error.message == "request id 3 is not greater than the previous one (3); ids must increase (at stream offset 108)")
        #expect(try connection.receive() == nil)
        try await fixture.stop()
    }

    @Test("1,000 pipelined requests on one connection are each answered once, matched by id")
    func pipelined() async throws {
        let fixture = try await ServerFixture()
        let connection = try RawConnection(port: fixture.port)
        let frames = (1...1_000).map { id in
            RawConnection.request(UInt64(id), CheckEntitlementsRequest(userId: "user-\(id % 300)", at: now))
        }
        connection.send(frames)
        var answered: [UInt64: CheckEntitlementsResponse] = [:]
        while answered.count < 1_000, let frame = try connection.receive() {
            #expect(frame.type == .response && frame.status == .ok)
            #expect(answered[frame.requestID] == nil, "answered twice: \(frame.requestID)")
            answered[frame.requestID] = try CheckEntitlementsResponse(buffer: frame.payload)
        }
        #expect(answered.count == 1_000)
        for (id, response) in answered {
            #expect(response.userId == "user-\(id % 300)")
        }
        try await fixture.stop()
    }

    @Test("checks pipelined in one read are prefetched together and answered as one by one, however the bytes are split")
    func prefetchedChecks() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.resolvers = 1
        let fixture = try await ServerFixture(loops: 1, configuration: configuration)
        let users = (0..<20).map { "user-\($0 * 13 % 300)" }
        // One by one first: the expected answers, and every customer cached.
        var expected: [String: CheckEntitlementsResponse] = [:]
        let single = try RawConnection(port: fixture.port)
        for (index, user) in users.enumerated() {
            single.send([RawConnection.request(UInt64(index + 1), CheckEntitlementsRequest(userId: user, at: now))])
            expected[user] = try CheckEntitlementsResponse(buffer: try #require(try single.receive()).payload)
        }
        // The same checks in one stream, with frames the peek must pass over: a ping, a check
        // whose payload does not parse, one with a filter.
        var stream = ByteBuffer()
        for (index, user) in users.enumerated() {
            stream.writeFrame(RawConnection.request(UInt64(index * 2 + 1), CheckEntitlementsRequest(userId: user, at: now)))
            switch index {
            case 5: stream.writeFrame(Frame(type: .ping, requestID: 0xABCD))
            case 9: stream.writeFrame(Frame.request(id: UInt64(index * 2 + 2), method: .checkEntitlements, payload: ByteBuffer(bytes: [0x0A, 0x7F, 0x01])))
            case 12: stream.writeFrame(RawConnection.request(UInt64(index * 2 + 2), CheckEntitlementsRequest(userId: users[0], entitlementIds: ["premium"], at: now)))
            default: break
            }
        }
        let bytes = Array(stream.readableBytesView)
        let before = await fixture.server.pool.resolvers[0].cacheStatistics.prefetched
        // In one write (one read on the server), then split at points inside headers and payloads.
        for split in [0, 1, 3, 21, 24, 30, bytes.count / 2, bytes.count - 1] {
            let connection = try RawConnection(port: fixture.port)
            connection.send(bytes: Array(bytes[..<split]))
            if split > 0 {
                try await Task.sleep(for: .milliseconds(20))  // a read of its own, most likely
            }
            connection.send(bytes: Array(bytes[split...]))
            var answered = 0
            var others = 0
            while answered + others < users.count + 3, let frame = try connection.receive() {
                if frame.type == .response, frame.requestID % 2 == 1 {
                    let user = users[Int(frame.requestID / 2)]
                    #expect(try CheckEntitlementsResponse(buffer: frame.payload) == expected[user], "\(user), split at \(split)")
                    answered += 1
                } else {
                    others += 1
                }
            }
            #expect(answered == users.count && others == 3, "split at \(split)")
            if split == 0 {
                let after = await fixture.server.pool.resolvers[0].cacheStatistics.prefetched
                #expect(after > before, "one read of 20 cached checks prefetched nothing")
            }
        }
        try await fixture.stop()
    }

    @Test("a malformed frame closes only its own connection")
    func malformedFrameClosesOneConnection() async throws {
        let fixture = try await ServerFixture()
        let good = try RawConnection(port: fixture.port)
        let bad = try RawConnection(port: fixture.port)
        bad.send(bytes: Array("GET / HTTP/1.1\r\nHost: x\r\n\r\n".utf8))
        let error = try #require(try bad.receive())
        #expect(error.type == .error && error.status == .invalidArgument)
        #expect(error.message.contains("not the magic 0x454E"))
        #expect(try bad.receive() == nil)
        good.send([RawConnection.request(1, CheckEntitlementsRequest(userId: "user-1"))])
        #expect(try good.receive()?.status == .ok)
        // An oversized length: RESOURCE_EXHAUSTED from the header alone.
        let big = try RawConnection(port: fixture.port)
        var header = ByteBuffer()
        header.writeFrameHeader(type: .request, method: .checkEntitlements, requestID: 1, payloadLength: 50 << 20)
        big.send(bytes: Array(header.readableBytesView))
        #expect(try big.receive()?.status == .resourceExhausted)
        try await fixture.stop()
    }

    @Test("100 concurrent connections")
    func hundredConnections() async throws {
        let fixture = try await ServerFixture()
        try await withThrowingTaskGroup(of: Bool.self) { group in
            for index in 0..<100 {
                group.addTask {
                    let client = fixture.client()
                    let response = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-\(index)"))
                    await client.close()
                    return response.userId == "user-\(index)"
                }
            }
            var successes = 0
            for try await ok in group where ok {
                successes += 1
            }
            #expect(successes == 100)
        }
        try await fixture.stop()
    }

    @Test("the Unix socket serves the same answers")
    func unixSocket() async throws {
        let fixture = try await ServerFixture()
        let client = EntitlementsClient(configuration: .init(server: .unixSocket(path: fixture.socketPath)), eventLoopGroup: fixture.group)
        let overUnix = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-3", at: now))
        let tcp = fixture.client()
        let overTCP = try await tcp.checkEntitlements(CheckEntitlementsRequest(userId: "user-3", at: now))
        #expect(overUnix == overTCP)
        await client.close()
        await tcp.close()
        try await fixture.stop()
    }

    @Test("batch check: one answer per user in order; too many users or a bad id fails the batch")
    func batch() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0), maximumBatchSize: 50)
        configuration.resolvers = 2  // whatever the machine's cores: aliases are forwarded
        let fixture = try await ServerFixture(configuration: configuration)
        let client = fixture.client()
        let ids = (0..<50).map { "user-\($0 * 3)" } + ["nobody"]
        let batch = try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: Array(ids.prefix(49)) + ["nobody"], at: now))
        #expect(batch.results.map(\.userId) == Array(ids.prefix(49)) + ["nobody"])
        for result in batch.results.prefix(49) {
            let single = try await client.checkEntitlements(CheckEntitlementsRequest(userId: result.userId, at: now))
            #expect(result == single)
        }
        // Aliases (some owned by the other resolver: forwarded) mixed with customer ids:
        // each answer as its single check gives it, in the batch's order.
        var mixed: [String] = []
        var forwarded = 0  // aliases whose customer the other resolver owns
        for index in 0..<40 where mixed.count < 48 {
            let record = try #require(try fixture.snapshot.customer(for: "user-\(index)"))
            for alias in record.aliases.prefix(1) where AnswerCache.shardIndex(for: alias, shardCount: 2) != AnswerCache.shardIndex(for: record.id!, shardCount: 2) {
                forwarded += 1
            }
            mixed += record.aliases.prefix(1) + [record.id!]
        }
        #expect(mixed.count > 40 && mixed.count < 80)
        #expect(forwarded >= 1, "no alias owned by the other resolver: the forwarding path is not exercised")
        let mixedBatch = try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: Array(mixed.prefix(50)), at: now))
        #expect(mixedBatch.results.map(\.userId) == Array(mixed.prefix(50)))
        for result in mixedBatch.results {
            #expect(result == (try await client.checkEntitlements(CheckEntitlementsRequest(userId: result.userId, at: now))))
        }
        // An alias no resolver has learnt yet, asked twice in one batch with its customer,
        // all three in one resolver's share: the first read teaches the alias, so the
        // customer is read once and the other two are hits, as one by one.
        var found: (record: CustomerRecord, alias: String)?
        for index in 40..<400 where found == nil {
            if let record = try fixture.snapshot.customer(for: "user-\(index)"),
                let alias = record.aliases.first(where: { AnswerCache.shardIndex(for: $0, shardCount: 2) == AnswerCache.shardIndex(for: record.id!, shardCount: 2) })
            {
                found = (record, alias)
            }
        }
        let (fresh, freshAlias) = try #require(found)
        func totals() async -> (hits: UInt64, insertions: UInt64) {
            var totals: (hits: UInt64, insertions: UInt64) = (0, 0)
            for resolver in fixture.server.pool.resolvers {
                let statistics = await resolver.cacheStatistics
                totals = (totals.hits + statistics.hits, totals.insertions + statistics.insertions)
            }
            return totals
        }
        let before = await totals()
        let repeated = [freshAlias, fresh.id!, freshAlias]
        let repeatedBatch = try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: repeated, at: now))
        let after = await totals()
        #expect(after.insertions - before.insertions == 1, "the customer was read more than once")
        #expect(after.hits - before.hits == 2)
        #expect(repeatedBatch.results.map(\.userId) == repeated)
        #expect(repeatedBatch.results.allSatisfy { $0.customerId == fresh.id })
        for result in repeatedBatch.results {
            #expect(result == (try await client.checkEntitlements(CheckEntitlementsRequest(userId: result.userId, at: now))))
        }
        await #expect {
            try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: ids))
        } throws: { error in
            (error as? EntitlementsClientError) == EntitlementsClientError(code: .resourceExhausted, message: "user_ids: 51 users; a batch holds at most 50")
        }
        await #expect {
            try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: ["user-1", ""]))
        } throws: { error in
            (error as? EntitlementsClientError) == EntitlementsClientError(code: .invalidArgument, message: "user_ids[1]: must not be empty")
        }
        await client.close()
        try await fixture.stop()
    }
}

@Suite("server: cancels, deadlines, draining", .serialized)
struct ServerLifecycleTests {
    @Test("a cancel answers CANCELLED at once, and the late answer is dropped")
    func cancel() async throws {
        let fixture = try await ServerFixture(holdableResolvers: true)
        let connection = try RawConnection(port: fixture.port)
        fixture.holdResolvers()
        connection.send([RawConnection.request(1, CheckEntitlementsRequest(userId: "user-1")), Frame(type: .cancel, requestID: 1)])
        let cancelled = try #require(try connection.receive())
        #expect(cancelled.requestID == 1 && cancelled.status == .cancelled)
        fixture.releaseResolvers()
        // The next answer is for the next request: nothing more came for id 1.
        connection.send([RawConnection.request(2, CheckEntitlementsRequest(userId: "user-2"))])
        let next = try #require(try connection.receive())
        #expect(next.requestID == 2 && next.status == .ok)
        // A cancel for an id that is done, or unknown, is ignored.
        connection.send([Frame(type: .cancel, requestID: 2), Frame(type: .cancel, requestID: 77), Frame(type: .ping, requestID: 5)])
        #expect(try connection.receive()?.type == .pong)
        try await fixture.stop()
    }

    @Test("checks queued on another loop for a connection that has closed are not run")
    func closedConnectionSkipsQueuedWork() async throws {
        let fixture = try await ServerFixture(holdableResolvers: true)
        func lookups() async -> UInt64 {
            var total: UInt64 = 0
            for resolver in fixture.server.pool.resolvers {
                let statistics = await resolver.cacheStatistics
                total += statistics.hits + statistics.misses
            }
            return total
        }
        let before = await lookups()
        let connection = try RawConnection(port: fixture.port)
        fixture.holdResolvers()
        connection.send([
            RawConnection.request(1, BatchCheckEntitlementsRequest(userIds: (0..<50).map { "user-\($0)" }, at: now), method: .batchCheckEntitlements),
            RawConnection.request(2, CheckEntitlementsRequest(userId: "user-60", at: now)),
            RawConnection.request(3, CheckEntitlementsRequest(userId: "user-61", at: now, environment: .sandbox)),
            Frame(type: .ping, requestID: 9),
        ])
        #expect(try connection.receive()?.type == .pong)  // all three accepted, held on the resolver's loop
        connection.shutdown()
        let patience = ContinuousClock.now + .seconds(30)
        while fixture.server.connectionCount > 0, ContinuousClock.now < patience {
            try await Task.sleep(for: .milliseconds(5))
        }
        #expect(fixture.server.connectionCount == 0)
        fixture.releaseResolvers()
        // The statistics are read on the resolver's loop, after the queued work.
        #expect(await lookups() == before, "a check ran for a connection that had gone")
        // The server still serves: a new connection's check is looked up and answered.
        let client = fixture.client()
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-60", at: now))
        #expect(await lookups() == before + 1)
        await client.close()
        try await fixture.stop()
    }

    @Test("a deadline that expires answers DEADLINE_EXCEEDED, and the work is abandoned")
    func deadline() async throws {
        let fixture = try await ServerFixture(holdableResolvers: true)
        let connection = try RawConnection(port: fixture.port)
        fixture.holdResolvers()
        connection.send([RawConnection.request(1, CheckEntitlementsRequest(userId: "user-1"), timeoutMicroseconds: 20_000)])
        let frame = try #require(try connection.receive())
        #expect(frame.requestID == 1 && frame.status == .deadlineExceeded)
        fixture.releaseResolvers()
        // Through the client: the same status as a typed error.
        let client = fixture.client()
        fixture.holdResolvers()
        await #expect {
            try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-1"), timeout: .milliseconds(20))
        } throws: { error in
            (error as? EntitlementsClientError)?.code == .deadlineExceeded
        }
        fixture.releaseResolvers()
        await client.close()
        try await fixture.stop()
    }

    @Test("graceful shutdown: GOAWAY with the last id, every accepted request answered, then close", arguments: ["tcp", "unix"])
    func gracefulShutdown(listener: String) async throws {
        let fixture = try await ServerFixture(holdableResolvers: true)
        let connection = listener == "tcp" ? try RawConnection(port: fixture.port) : try RawConnection(unixPath: fixture.socketPath)
        fixture.holdResolvers()
        connection.send((1...50).map { RawConnection.request(UInt64($0), CheckEntitlementsRequest(userId: "user-\($0)")) } + [Frame(type: .ping, requestID: 9)])
        // Frames are read in order: the PONG means all 50 requests were accepted.
        #expect(try connection.receive()?.type == .pong)
        async let stopped: Void = fixture.server.shutdownGracefully()
        // Blocking receives off the task pool: on it, they could hold the thread the
        // shutdown needs to send the GOAWAY (one core: the only one).
        let goAway = try #require(try await offThePool { try connection.receive() })
        #expect(goAway.type == .goAway && goAway.requestID == 50)
        fixture.releaseResolvers()
        let frames = try await offThePool {
            var frames: [Frame] = []
            while let frame = try connection.receive() {
                frames.append(frame)
            }
            return frames
        }
        for frame in frames {
            #expect(frame.type == .response && frame.status == .ok)
        }
        #expect(Set(frames.map(\.requestID)) == Set(1...50))
        await stopped
        // Both listeners are closed: no new connection on either.
        #expect(throws: (any Error).self) { try RawConnection(port: fixture.port) }
        #expect(throws: (any Error).self) { try RawConnection(unixPath: fixture.socketPath) }
        try await fixture.stop()
    }

    @Test("a request sent after GOAWAY is not processed, and the client retries it on a new connection")
    func clientRetriesAfterGoAway() async throws {
        // A stand-in server: its first connection answers any request with GOAWAY(0) and
        // closes; later connections answer Health.
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let connections = NIOLockedValueBox(0)
        let channel = try await ServerBootstrap(group: group)
            .childChannelInitializer { channel in
                let number = connections.withLockedValue { $0 += 1; return $0 }
                return channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.addHandlers(ByteToMessageHandler(FrameDecoder()), StandInServer(goAway: number == 1))
                }
            }
            .bind(host: "127.0.0.1", port: 0).get()
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: channel.localAddress!.port!)), eventLoopGroup: group)
        let health = try await client.health()
        #expect(health.version == "stand-in")
        #expect(connections.withLockedValue { $0 } == 2)
        await client.close()
        try await channel.close()
        try await group.shutdownGracefully()
    }

    @Test("concurrent first calls share one connection attempt")
    func singleConnectionAttempt() async throws {
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let connections = NIOLockedValueBox(0)
        let channel = try await ServerBootstrap(group: group)
            .childChannelInitializer { channel in
                connections.withLockedValue { $0 += 1 }
                return channel.eventLoop.makeCompletedFuture {
                    try channel.pipeline.syncOperations.addHandlers(ByteToMessageHandler(FrameDecoder()), StandInServer(goAway: false))
                }
            }
            .bind(host: "127.0.0.1", port: 0).get()
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: channel.localAddress!.port!)), eventLoopGroup: group)
        try await withThrowingTaskGroup(of: Void.self) { tasks in
            for _ in 0..<50 {
                tasks.addTask { _ = try await client.health() }
            }
            try await tasks.waitForAll()
        }
        #expect(connections.withLockedValue { $0 } == 1)
        await client.close()
        try await channel.close()
        try await group.shutdownGracefully()
    }

    @Test("a client that never reads its answers makes the server stop reading (backpressure)")
    func writeBackpressure() async throws {
        let fixture = try await ServerFixture()
        let connection = try RawConnection(port: fixture.port)
        let request = RawConnection.request(1, CheckEntitlementsRequest(userId: "user-1"))
        var sent = 0
        var blocked = false
        var id: UInt64 = 1
        // Without backpressure the server would read everything and buffer the answers
        // without bound; with it, its reads stop and our socket's send buffer fills up.
        while sent < 64 << 20 {
            var out = ByteBuffer()
            for _ in 0..<256 {
                out.writeFrame(.request(id: id, method: .checkEntitlements, payload: request.payload))
                id += 1
            }
            let result = connection.sendWithoutBlocking(Array(out.readableBytesView))
            if result < out.readableBytes {
                blocked = true
                break
            }
            sent += result
        }
        #expect(blocked, "sent \(sent) bytes without the server pushing back")
        // The client goes away: a drain would otherwise wait (up to serve's --drain-timeout)
        // for it to read the answers the server holds for it.
        connection.shutdown()
        try await fixture.stop()
    }

    /// A customer whose answer is over 1 MiB: 30,000 renewals of `productId`, every one
    /// listed in the entitlement's transactions.
    static func customerOverOneMiB(productId: String) -> CustomerRecord {
        let transactions = (0..<30_000).map { index in
            Transaction(
                originalTransactionId: "chain", transactionId: "transaction-\(index)", store: .appstore, productId: productId,
                transactionDate: now - Int64(30_000 - index) * 60_000, expirationDate: now + 86_400_000,
                environment: .production, ownershipType: .owner, type: .subscriptionRenewed
            )
        }
        return CustomerRecord(id: "big", transactions: transactions)
    }

    @Test("a watch event larger than a frame may carry ends the watch with RESOURCE_EXHAUSTED, and the connection lives", .timeLimit(.minutes(1)))
    func oversizedEvent() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("big-event-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        var writer = try SnapshotWriter(path: directory + "/big.snap", catalog: SyntheticData.catalog, createdDate: now)
        try writer.append(Self.customerOverOneMiB(productId: "com.example.premium.monthly"))
        try writer.finish()
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let store = try CustomerStore.open(dataDirectory: directory + "/data", seed: directory + "/big.snap").0
        let server = try await EntitlementsServer.start(store: store, configuration: ServerConfiguration(tcp: ("127.0.0.1", 0), resolvers: 1), group: group)
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: server.tcpAddress!.port!)), eventLoopGroup: group)
        // One connection: the server reads the watch, and registers it, before the write.
        let events = try await client.watch(WatchEntitlementsRequest(userIds: ["big"]))
        let _: WriteResponse = try await client.call(.grantEntitlement, GrantEntitlementRequest(userId: "big", grant: Grant(grantId: "g", entitlementId: "beta")))
        await #expect {
            for try await _ in events {}
        } throws: { error in
            let error = error as? EntitlementsClientError
            return error?.code == .resourceExhausted && error?.message.contains("an event carries at most 1048576") == true
        }
        #expect(try await client.health().status == .serving, "the connection lives")
        await client.close()
        await server.shutdownGracefully()
        try await group.shutdownGracefully()
    }

    @Test("an answer larger than a frame may carry fails with RESOURCE_EXHAUSTED, and the connection lives")
    func oversizedAnswer() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("big-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        var writer = try SnapshotWriter(
            path: directory + "/big.snap",
            catalog: Catalog(products: [Product(id: "p", type: .subscription, period: .monthly, entitlements: ["premium"])]),
            createdDate: now
        )
        try writer.append(Self.customerOverOneMiB(productId: "p"))
        try writer.append(CustomerRecord(id: "small"))
        try writer.finish()
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let server = try await EntitlementsServer.start(
            snapshot: try SnapshotReader(path: directory + "/big.snap"),
            configuration: ServerConfiguration(tcp: ("127.0.0.1", 0), resolvers: 1),
            group: group
        )
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: server.tcpAddress!.port!)), eventLoopGroup: group)
        await #expect {
            try await client.checkEntitlements(CheckEntitlementsRequest(userId: "big"))
        } throws: { error in
            let error = error as? EntitlementsClientError
            return error?.code == .resourceExhausted && error?.message.contains("an answer carries at most 1048576") == true
        }
        #expect(try await client.checkEntitlements(CheckEntitlementsRequest(userId: "small")).customerId == "small")
        await client.close()
        await server.shutdownGracefully()
        try await group.shutdownGracefully()
    }

    @Test("an unreachable server is UNAVAILABLE, with a reason a person can act on (no NIO internals)")
    func unreachable() async throws {
        let socket = NSTemporaryDirectory() + "no-server-\(UUID().uuidString).sock"
        let cases: [(EntitlementsServerAddress, String)] = [
            (.tcp(host: "127.0.0.1", port: 1), "cannot connect to 127.0.0.1:1: connection refused (is the server running, on that port?)"),
            (.unixSocket(path: socket), "cannot connect to unix:\(socket): no such socket file (is the server running, with that socket?)"),
        ]
        for (address, message) in cases {
            let client = EntitlementsClient(server: address)
            await #expect {
                try await client.health()
            } throws: { error in
                (error as? EntitlementsClientError)?.code == .unavailable && (error as? EntitlementsClientError)?.message == message
            }
            await client.close()
        }
    }
}

final class StandInServer: ChannelInboundHandler, Sendable {
    typealias InboundIn = Frame
    typealias OutboundOut = ByteBuffer
    let goAway: Bool

    init(goAway: Bool) {
        self.goAway = goAway
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = self.unwrapInboundIn(data)
        guard frame.type == .request else { return }
        var buffer = ByteBuffer()
        if self.goAway {
            buffer.writeFrame(.goAway(lastRequestID: 0))
            context.writeAndFlush(self.wrapOutboundOut(buffer)).assumeIsolated().whenComplete { _ in context.close(promise: nil) }
        } else {
            buffer.writeFrame(.response(id: frame.requestID, payload: ByteBuffer(bytes: try! HealthResponse(status: .serving, version: "stand-in").serializedBytes())))
            context.writeAndFlush(self.wrapOutboundOut(buffer), promise: nil)
        }
    }
}
