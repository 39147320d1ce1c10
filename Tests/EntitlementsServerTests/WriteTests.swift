import EntitlementsClient
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsWire
import Foundation
import NIOCore
import Testing

/// Write methods, cache invalidation and WatchEntitlements over real sockets.
@Suite("writes and watch")
struct WriteTests {
    static func grant(_ user: String, _ id: String, entitlement: String? = nil, from: Int64 = now, until: Int64? = nil) -> GrantEntitlementRequest {
        GrantEntitlementRequest(userId: user, grant: Grant(grantId: id, entitlementId: entitlement ?? id, grantedDate: from, expirationDate: until))
    }

    static func check(_ client: EntitlementsClient, _ user: String, at instant: Int64 = now) async throws -> CheckEntitlementsResponse {
        try await client.checkEntitlements(CheckEntitlementsRequest(userId: user, at: instant))
    }

    static func active(_ response: CheckEntitlementsResponse) -> Set<String> {
        Set(response.entitlements.filter(\.isActive).compactMap(\.id))
    }

    @Test("after a write is acknowledged, every later check on any connection sees it (cached answers are replaced)")
    func readYourWrites() async throws {
        let fixture = try await ServerFixture(writable: true)
        let reader = fixture.client(connections: 4)
        let writer = fixture.client()
        for index in 0..<40 {
            let user = "user-\(index)"
            // Cache the answer first, on every connection of the reader.
            for _ in 0..<4 {
                _ = try await Self.check(reader, user)
            }
            let response: WriteResponse = try await writer.call(.grantEntitlement, Self.grant(user, "vip-\(index)"))
            #expect(response.changed && response.logSequence == UInt64(index + 1))
            for _ in 0..<4 {
                #expect(Self.active(try await Self.check(reader, user)).contains("vip-\(index)"))
            }
        }
        await reader.close()
        await writer.close()
        try await fixture.stop()
    }

    /// "Zoë" spelt with U+00EB and with e followed by U+0301 are one Swift String but two
    /// byte strings. Before the NFC rule, a check of the decomposed id found the composed
    /// customer's write in the store's overlay (keyed by String) and answered with its
    /// entitlements.
    @Test("an id that is not NFC is refused by checks, batches, watches and writes; it never reads the NFC customer's answer", .timeLimit(.minutes(1)))
    func idsMustBeNFC() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let composed = "Zo\u{EB}", decomposed = "Zoe\u{308}"
        let notNFC = "must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"
        let written: WriteResponse = try await client.call(.grantEntitlement, Self.grant(composed, "vip"))
        #expect(written.created)
        #expect(Self.active(try await Self.check(client, composed)) == ["vip"])
        func refused(_ message: String, _ call: () async throws -> Void) async {
            await #expect {
                try await call()
            } throws: { error in
                (error as! EntitlementsClientError) == EntitlementsClientError(code: .invalidArgument, message: message)
            }
        }
        await refused("user_id: \(notNFC)") { _ = try await Self.check(client, decomposed) }
        await refused("user_ids[1]: \(notNFC)") {
            _ = try await client.batchCheckEntitlements(BatchCheckEntitlementsRequest(userIds: [composed, decomposed], at: now))
        }
        await refused("user_ids[0]: \(notNFC)") {
            for try await _ in try await client.watch(WatchEntitlementsRequest(userIds: [decomposed])) {}
        }
        await refused("user_id: \(notNFC)") {
            let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant(decomposed, "gold"))
        }
        await refused("alias: \(notNFC)") {
            let _: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-1", alias: decomposed))
        }
        // The composed customer is as it was.
        #expect(Self.active(try await Self.check(client, composed)) == ["vip"])
        await client.close()
        try await fixture.stop()
    }

    @Test("alias transfer and delete take effect for checks by alias, even for a learnt alias")
    func aliasesFollowWrites() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client(connections: 2)
        let _: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-1", alias: "device-9"))
        #expect(try await Self.check(client, "device-9").customerId == "user-1")  // learnt now
        await #expect {
            let _: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-2", alias: "device-9"))
        } throws: { error in
            let error = error as! EntitlementsClientError
            return error.code == .failedPrecondition && error.message == "alias: \"device-9\" belongs to customer \"user-1\"; set transfer to move it"
        }
        let moved: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-2", alias: "device-9", transfer: true))
        #expect(moved.changed && moved.customerId == "user-2")
        #expect(try await Self.check(client, "device-9").customerId == "user-2")
        let deleted: WriteResponse = try await client.call(.deleteCustomer, DeleteCustomerRequest(userId: "device-9"))
        #expect(deleted.customerId == "user-2")
        #expect(try await Self.check(client, "device-9").customerId == nil)
        #expect(try await Self.check(client, "user-2").customerId == nil)
        await client.close()
        try await fixture.stop()
    }

    @Test("write errors carry their status and name the field")
    func writeErrors() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let cases: [(StatusCode, String, @Sendable () async throws -> WriteResponse)] = [
            (.invalidArgument, "grant.entitlement_id: required", {
                try await client.call(.grantEntitlement, GrantEntitlementRequest(userId: "user-1", grant: Grant(grantId: "g")))
            }),
            (.invalidArgument, "transaction: required", {
                try await client.call(.recordTransaction, RecordTransactionRequest(userId: "user-1"))
            }),
            (.notFound, "user_id: no customer \"nobody\"", {
                try await client.call(.revokeGrant, RevokeGrantRequest(userId: "nobody", grantId: "g"))
            }),
            (.invalidArgument, "user_id: required", {
                try await client.call(.deleteCustomer, DeleteCustomerRequest())
            }),
        ]
        for (status, message, call) in cases {
            await #expect {
                _ = try await call()
            } throws: { error in
                let error = error as! EntitlementsClientError
                return error.code == status && error.message == message
            }
        }
        await client.close()
        try await fixture.stop()

        let readOnly = try await ServerFixture()
        let other = readOnly.client()
        await #expect {
            let _: WriteResponse = try await other.call(.grantEntitlement, Self.grant("user-1", "g"))
        } throws: { error in
            (error as! EntitlementsClientError).code == .unavailable
        }
        await other.close()
        try await readOnly.stop()
    }

    @Test("Compact writes a new snapshot with every write; checks and Health follow it")
    func compact() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        for index in 0..<10 {
            let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-\(index)", "early-\(index)"))
        }
        let before = try await client.health().snapshotId
        let response: CompactResponse = try await client.call(.compact, CompactRequest())
        #expect(response.lastLogSequence == 10)
        #expect(try await client.health().snapshotId == response.snapshotId && response.snapshotId != before)
        for index in 0..<10 {
            #expect(Self.active(try await Self.check(client, "user-\(index)")).contains("early-\(index)"))
        }
        #expect(fixture.server.store.overlayCount == 0)
        await client.close()
        try await fixture.stop()
    }

    @Test("watch: an event on a write, then one when the grant expires, without any request", .timeLimit(.minutes(1)))
    func watchWriteAndExpiry() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let events = try await client.watch(WatchEntitlementsRequest(userIds: ["user-7"]))
        var iterator = events.makeAsyncIterator()
        let wall = WallClock.unixMilliseconds()
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-7", "g1", entitlement: "trial-x", from: wall - 1_000, until: wall + 1_500))
        // 1.5 s: the write (an fsync) and its event must come before the expiry, even on a
        // slow disk; were the grant already expired, the event below would say so.
        let written = try await iterator.next()
        #expect(written?.cause == .write && written?.customerId == "user-7" && written?.logSequence == 1)
        #expect(written?.changes == [EntitlementChange(entitlementId: "trial-x", before: nil, after: EntitlementState(isActive: true, renewState: .nonRenewable))])
        let expired = try await iterator.next()
        #expect(expired?.cause == .time)
        #expect(expired?.changes.first?.entitlementId == "trial-x")
        #expect(expired?.changes.first?.after?.isActive == false)
        #expect((expired?.current?.requestDate ?? 0) >= wall + 1_500)
        await client.close()
        try await fixture.stop()
    }

    @Test("watch of every customer: one time event per expiry, none for an expiry a later write moved", .timeLimit(.minutes(1)))
    func watchExpiriesOnceEach() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let events = try await client.watch(WatchEntitlementsRequest(allCustomers: true))
        var iterator = events.makeAsyncIterator()
        // The watch is registered once it has had the event of a first write (a lifetime
        // grant: no time event of its own).
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("exp-first", "first", entitlement: "exp"))
        #expect(try await iterator.next()?.customerId == "exp-first")
        let wall = WallClock.unixMilliseconds()
        let day: Int64 = 86_400_000
        // Seconds of margin: every write is acknowledged before the first expiry, even on a
        // loaded machine (checked below, so that a slow run fails as such, not as a wrong
        // event). The answers replaced go first, in order; the rest together.
        let expiry = wall + 8_000
        let replaced: [(user: String, grant: String, until: Int64)] = [
            ("exp-c", "c", expiry - 500),
            ("exp-c", "c", expiry + day),  // moved a day later: no time event (at expiry - 500 its
            // replaced entry is skipped; were it not, the answer re-read then is unchanged and
            // sends nothing either: the skip saves work, which no event shows)
            ("exp-d", "d1", expiry + 500),
            ("exp-d", "d2", expiry + 500),  // a second answer with the same validUntil
        ]
        var together: [(user: String, grant: String, until: Int64)] = [
            ("exp-a", "a", expiry),
            ("exp-b", "b", expiry),  // the same instant: one timer for both
            // The last to expire: what is due before it, duplicates included, has come by then.
            ("exp-last", "l", expiry + 2_500),
        ]
        for index in 0..<50 {
            together.append(("exp-many-\(index)", "m", expiry + 1_000 + Int64(index % 5) * 100))
        }
        @Sendable func write(_ write: (user: String, grant: String, until: Int64)) async throws {
            let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant(write.user, write.grant, entitlement: "exp", from: wall - 1_000, until: write.until))
        }
        for each in replaced {
            try await write(each)
        }
        try await withThrowingTaskGroup(of: Void.self) { group in
            for each in together {
                group.addTask { try await write(each) }
            }
            try await group.waitForAll()
        }
        var until: [String: Int64] = [:]
        for each in replaced + together {
            until[each.user] = each.until
        }
        try #require(WallClock.unixMilliseconds() < expiry - 500, "the writes took longer than the test's margin")
        var timeEvents: [String: [Int64]] = [:]
        while timeEvents["exp-last"] == nil {
            let event = try #require(try await iterator.next())
            if event.cause == .time {
                timeEvents[event.customerId ?? "", default: []].append(event.current?.requestDate ?? 0)
                #expect(event.changes.first?.after?.isActive == false, "\(event)")
            }
        }
        #expect(timeEvents["exp-c"] == nil)
        #expect(Set(timeEvents.keys) == Set(until.keys).subtracting(["exp-c"]))
        for (customer, instants) in timeEvents {
            #expect(instants.count == 1, "\(customer): \(instants.count) time events")
            #expect(instants.allSatisfy { $0 >= until[customer]! }, "\(customer) expired early: \(instants)")
        }
        await client.close()
        try await fixture.stop()
    }

    @Test("watch: an alias linked or moved, and a write that moves only validUntil, each send an event (what a client cache needs)", .timeLimit(.minutes(1)))
    func watchAliasesAndValidUntil() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let events = try await client.watch(WatchEntitlementsRequest(allCustomers: true))
        var iterator = events.makeAsyncIterator()
        let wall = WallClock.unixMilliseconds()
        let day: Int64 = 86_400_000
        // Give the watch time to be registered before the first write.
        try await Task.sleep(for: .milliseconds(200))
        let linked: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-7", alias: "cache-alias-1"))
        let first = try await iterator.next()
        #expect(first?.customerId == "user-7" && first?.cause == .write && first?.logSequence == linked.logSequence)
        #expect(first?.aliasesChanged == ["cache-alias-1"] && first?.changes == [])
        let moved: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-8", alias: "cache-alias-1", transfer: true))
        var movedEvents: [String: EntitlementsChangedEvent] = [:]
        for _ in 0..<2 {
            let event = try #require(try await iterator.next())
            movedEvents[event.customerId ?? ""] = event
        }
        #expect(Set(movedEvents.keys) == ["user-7", "user-8"])
        #expect(movedEvents.values.allSatisfy { $0.aliasesChanged == ["cache-alias-1"] && $0.logSequence == moved.logSequence })
        // An expired grant, then one that starts tomorrow: the answer now is the same (the
        // new grant has not started), but it now changes tomorrow.
        let _: WriteResponse = try await client.call(.grantEntitlement, Self.grant("vu-1", "old", entitlement: "x", from: wall - 2 * day, until: wall - day))
        let created = try await iterator.next()
        #expect(created?.customerId == "vu-1" && created?.current?.validUntil == nil)
        let later: WriteResponse = try await client.call(.grantEntitlement, Self.grant("vu-1", "next", entitlement: "x", from: wall + day, until: wall + 2 * day))
        let moves = try await iterator.next()
        #expect(moves?.customerId == "vu-1" && moves?.logSequence == later.logSequence)
        #expect(moves?.changes == [] && moves?.current?.validUntil == wall + day)
        await client.close()
        try await fixture.stop()
    }

    @Test("watch: a RESUMED event names the customer's aliases (one may have been linked after the watch's sequence)", .timeLimit(.minutes(1)))
    func resumedNamesAliases() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = fixture.client()
        let before: WriteResponse = try await client.call(.grantEntitlement, Self.grant("user-7", "r1"))
        let _: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: "user-7", alias: "resumed-alias"))
        for request in [WatchEntitlementsRequest(allCustomers: true, afterLogSequence: Int64(before.logSequence)),
                        WatchEntitlementsRequest(userIds: ["user-7"], afterLogSequence: Int64(before.logSequence))] {
            var iterator = try await client.watch(request).makeAsyncIterator()
            let resumed = try await iterator.next()
            #expect(resumed?.cause == .resumed && resumed?.customerId == "user-7")
            #expect(resumed?.aliasesChanged == ["resumed-alias"])
        }
        await client.close()
        try await fixture.stop()
    }

    @Test("a watcher that does not read is ended with RESOURCE_EXHAUSTED; writers never wait for it")
    func slowWatcher() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.watchBufferEvents = 4
        let fixture = try await ServerFixture(writable: true, configuration: configuration)
        let slow = try RawConnection(port: fixture.port, receiveBufferBytes: 4_096)
        slow.send([RawConnection.request(1, WatchEntitlementsRequest(allCustomers: true), method: .watchEntitlements)])
        // Make sure the watch is registered before the writes: a check on the same connection.
        slow.send([RawConnection.request(2, CheckEntitlementsRequest(userId: "user-1", at: now))])
        #expect(try slow.receive()?.requestID == 2)
        let writer = fixture.client(connections: 4)
        try await withThrowingTaskGroup(of: Void.self) { group in
            for task in 0..<8 {
                group.addTask {
                    for index in 0..<400 {
                        let _: WriteResponse = try await writer.call(.grantEntitlement, Self.grant("user-\(index % 300)", "bulk-\(task)-\(index)-" + String(repeating: "x", count: 200)))
                    }
                }
            }
            try await group.waitForAll()
        }
        var end: Frame?
        var messages = 0
        while let frame = try slow.receive() {
            if frame.type == .endOfStream {
                end = frame
                break
            }
            messages += 1
        }
        #expect(end?.status == .resourceExhausted)
        #expect(end?.message.contains("fell more than 4 events behind") == true)
        #expect(messages < 3_200)
        await writer.close()
        try await fixture.stop()
    }

    @Test("watch requests are validated; the server's watch limit answers RESOURCE_EXHAUSTED")
    func watchLimits() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.maximumWatchStreams = 1
        let fixture = try await ServerFixture(writable: true, configuration: configuration)
        let connection = try RawConnection(port: fixture.port)
        connection.send([RawConnection.request(1, WatchEntitlementsRequest(), method: .watchEntitlements)])
        let invalid = try connection.receive()
        #expect(invalid?.type == .endOfStream && invalid?.status == .invalidArgument && invalid?.message == "user_ids: give at least one, or set all_customers")
        connection.send([RawConnection.request(2, WatchEntitlementsRequest(userIds: ["user-1"]), method: .watchEntitlements)])
        connection.send([RawConnection.request(3, WatchEntitlementsRequest(userIds: ["user-2"]), method: .watchEntitlements)])
        let refused = try connection.receive()
        #expect(refused?.requestID == 3 && refused?.type == .endOfStream && refused?.status == .resourceExhausted)
        connection.send([Frame(type: .cancel, requestID: 2)])
        let cancelled = try connection.receive()
        #expect(cancelled?.type == .endOfStream && cancelled?.status == .cancelled)
        // Through the client, a refused watch ends the sequence with the error.
        let client = fixture.client()
        await #expect {
            for try await _ in try await client.watch(WatchEntitlementsRequest(userIds: [""])) {}
        } throws: { error in
            (error as! EntitlementsClientError) == EntitlementsClientError(code: .invalidArgument, message: "user_ids[0]: must not be empty")
        }
        await client.close()
        try await fixture.stop()
    }
}
