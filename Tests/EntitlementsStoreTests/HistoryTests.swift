import EntitlementsMessages
import EntitlementsResolver
import Foundation
import Testing

@testable import EntitlementsStore

@Suite("customer history")
struct HistoryTests {
    static func history(_ store: CustomerStore, _ user: String, at instant: Int64 = now + 60 * day, limit: Int = 1000) throws -> CustomerHistoryResponse {
        try store.history(of: user, limit: limit, environment: .production, now: instant) { "\($0)" }
    }

    static func grant(_ user: String, _ id: String, _ entitlement: String = "pro", until: Int64? = nil, from: Int64 = now) -> LogRecord.Mutation {
        .grantEntitlement(GrantEntitlementRequest(userId: user, grant: Grant(grantId: id, entitlementId: entitlement, grantedDate: from, expirationDate: until)))
    }

    /// A store whose first log segment, with `grants` grants of bob's, a compaction moved
    /// into DIR/history.
    static func storeWithKeptSegment(in scratch: borrowing ScratchDirectory, grants: Int) async throws -> (CustomerStore, HistoryArchive.Segment) {
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
        for index in 1...grants {
            _ = try await store.write(Self.grant("bob", "g\(index)"))
        }
        _ = try await store.compact(hotList: [], now: now)
        return (store, try #require(try HistoryArchive(dataDirectory: directory, retention: 7 * day).segments().first))
    }

    /// The entitlements active in an entry.
    static func active(_ entry: HistoryEntry) -> [String] {
        entry.entitlements.filter(\.isActive).compactMap(\.id)
    }

    @Test("every write with its source, the entitlements after it, expiries at their instants, through compactions")
    func timeline() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let (store, _) = try CustomerStore.open(dataDirectory: scratch.file("data"), seed: seed)
        defer { store.close() }
        let source = WriteSource(method: "stripe", caller: "webhooks", eventId: "evt_1")
        _ = try await withCheckedThrowingContinuation { continuation in
            store.write(WriteWorld.purchase("anon-a", "t1"), now: now, source: source) { continuation.resume(with: $0) }
        }
        _ = try await store.compact(hotList: [], now: now)
        _ = try await store.write(Self.grant("alice", "g1", until: now + 40 * day), at: now + day)
        _ = try await store.compact(hotList: [], now: now + day)
        _ = try await store.write(WriteWorld.purchase("alice", "t1", revoked: now + 2 * day), at: now + 2 * day)

        let history = try Self.history(store, "anon-a")
        #expect(history.customerId == "alice")
        #expect(history.startsAfterLogSequence == 0)  // the seed snapshot: every write is here
        #expect(history.logSequence == 3)
        let entries = history.entries
        // The seed's alice (with her alias), the three writes, and the grant's end.
        #expect(entries.map(\.cause) == [.unspecified, .write, .write, .write, .time])
        #expect(entries[1].source == source && entries[1].logSequence == 1)
        #expect(entries[1].summary?.contains("App Store transaction t1 recorded: monthly") == true)
        #expect(Self.active(entries[1]) == ["premium"])
        #expect(entries[2].source?.method == nil)  // a write without a source logs none
        #expect(Self.active(entries[2]) == ["premium", "pro"])
        #expect(entries[3].summary?.contains("refunded") == true)
        #expect(entries[3].changes.map(\.entitlementId) == ["premium"])
        #expect(Self.active(entries[3]) == ["pro"])
        #expect(entries[4].date == now + 40 * day && entries[4].changes.first?.after?.isActive == false)
        #expect(Self.active(entries[4]).isEmpty)
        // The last write's entitlements are what a check resolves from the stored record.
        let resolved = EntitlementResolver(catalog: store.catalog).resolve(try store.customer(for: "alice"), at: now + 2 * day)
        #expect(entries[3].entitlements == resolved.entitlements)
    }

    @Test("a retention moves the start forward: the state kept then, then the writes after it")
    func retention() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed, options: .init(historyRetention: 10 * day))
        defer { store.close() }
        for step in 0..<6 {
            let instant = now + Int64(step) * 4 * day
            _ = try await store.write(Self.grant("bob", "g\(step)", until: instant + 2 * day, from: instant), at: instant)
            _ = try await store.compact(hotList: [], now: instant)
        }
        let archive = HistoryArchive(dataDirectory: directory, retention: 10 * day)
        let bases = try archive.bases()
        #expect(bases.count <= 3 && bases.count >= 2)
        let history = try Self.history(store, "bob", at: now + 21 * day)
        #expect(history.startsAfterLogSequence == bases[0].lastSequence && history.startsAfterLogSequence > 0)
        // Reaches back at least the retention from the last compaction (day 20): it starts
        // from a state kept no later than day 10, and holds every write after it.
        #expect(history.startsDate.map { $0 <= now + 20 * day - 10 * day } == true)
        let writes = history.entries.filter { $0.cause == .write }
        #expect(writes.map(\.logSequence) == Array((history.startsAfterLogSequence + 1)...6))
        // The first entry is the state kept at the start, with the grants given before it.
        #expect(history.entries.first?.cause == .unspecified)
        #expect(history.entries.first?.summary?.contains("grants") == true)
        // Nothing older than the oldest base is kept.
        #expect(try archive.segments().allSatisfy { $0.firstSequence > 0 })
    }

    @Test("with history off a compaction keeps nothing: the history starts at it")
    func off() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed, options: .init(historyRetention: nil))
        defer { store.close() }
        _ = try await store.write(Self.grant("bob", "g1"))
        _ = try await store.compact(hotList: [], now: now)
        _ = try await store.write(Self.grant("bob", "g2", "premium"), at: now + 1)
        #expect(!FileManager.default.fileExists(atPath: "\(directory)/history"))
        let history = try Self.history(store, "bob")
        #expect(history.startsAfterLogSequence == 1)
        #expect(history.entries.map(\.cause) == [.unspecified, .write])
        #expect(Self.active(history.entries[0]) == ["pro"])
        #expect(Self.active(history.entries[1]) == ["premium", "pro"])
    }

    @Test("an alias taken by another customer, and a deletion, are in the history; an unknown user has none")
    func aliasesAndDeletion() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let (store, _) = try CustomerStore.open(dataDirectory: scratch.file("data"), seed: seed)
        defer { store.close() }
        _ = try await store.write(.linkAlias(LinkAliasRequest(userId: "bob", alias: "anon-a", transfer: true)))
        _ = try await store.write(Self.grant("alice", "g1"), at: now + 1)
        _ = try await store.write(.deleteCustomer(DeleteCustomerRequest(userId: "alice")), at: now + 2)
        let alice = try Self.history(store, "alice")
        #expect(alice.customerId == "alice")
        #expect(alice.entries.map(\.cause) == [.unspecified, .write, .write, .write])
        #expect(alice.entries[1].summary == "alias anon-a moved to customer bob")
        #expect(alice.entries[2].summary?.contains("grant g1 of pro given") == true)
        #expect(alice.entries[3].deleted && alice.entries[3].summary == "customer deleted")
        #expect(alice.entries[3].entitlements.isEmpty)
        // The alias names bob now: its history is bob's.
        let bob = try Self.history(store, "anon-a")
        #expect(bob.customerId == "bob")
        #expect(bob.entries.last?.summary == "alias anon-a linked")
        let nobody = try Self.history(store, "carol")
        #expect(nobody.customerId == nil && nobody.entries.isEmpty)
        // limit keeps the latest entries.
        let last = try Self.history(store, "alice", limit: 1)
        #expect(last.truncated && last.entries.map(\.logSequence) == [3])
    }

    @Test("a damaged kept segment makes a history fail, naming the file; the store goes on")
    func damagedArchive() async throws {
        let scratch = try ScratchDirectory()
        let (store, kept) = try await Self.storeWithKeptSegment(in: scratch, grants: 2)
        defer { store.close() }
        // Flip a byte inside the first batch's records: its checksum no longer matches.
        let file = try FileHandle(forUpdating: URL(fileURLWithPath: kept.path))
        try file.seek(toOffset: 40)
        let byte = try #require(try file.read(upToCount: 1)).first!
        try file.seek(toOffset: 40)
        try file.write(contentsOf: Data([byte ^ 0xFF]))
        try file.close()
        #expect {
            try Self.history(store, "bob")
        } throws: { error in
            (error as? SnapshotError)?.code == .corrupt && "\(error)".contains(kept.path)
        }
        _ = try await store.write(Self.grant("bob", "g3"))
        #expect(try store.customer(for: "bob")?.grants.count == 3)
    }

    @Test("a kept segment cut short is damage, not a segment being written: the history fails")
    func cutShortArchive() async throws {
        let scratch = try ScratchDirectory()
        let (store, kept) = try await Self.storeWithKeptSegment(in: scratch, grants: 1)
        defer { store.close() }
        let file = try FileHandle(forWritingTo: URL(fileURLWithPath: kept.path))
        try file.seekToEnd()
        try file.write(contentsOf: Data([9, 0, 0, 0, 1, 2]))  // half a batch header
        try file.close()
        #expect {
            try Self.history(store, "bob")
        } throws: { error in
            (error as? SnapshotError)?.code == .corrupt && "\(error)".contains(kept.path)
        }
    }

    @Test("time alone: a grace period's start and end are entries; past 64 changes between writes the rest is folded into one")
    func timeEntries() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let (store, _) = try CustomerStore.open(dataDirectory: scratch.file("data"), seed: seed)
        defer { store.close() }
        let purchase = Transaction(
            originalTransactionId: "o1", transactionId: "t1", store: .appstore, productId: "monthly",
            transactionDate: now - day, expirationDate: now + day, environment: .production, type: .subscriptionStarted
        )
        _ = try await store.write(.recordTransaction(RecordTransactionRequest(userId: "bob", transaction: purchase)))
        let state = SubscriptionState(
            store: .appstore, originalTransactionId: "o1", autoRenewEnabled: true, billingIssueDetectedDate: now,
            gracePeriodExpirationDate: now + 3 * day, isInBillingRetry: true, eventDate: now
        )
        _ = try await store.write(.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "bob", state: state)))
        let grace = try Self.history(store, "bob", at: now + 5 * day).entries.filter { $0.cause == .time }
        #expect(grace.map(\.date) == [now + day, now + 3 * day])
        #expect(grace.first?.summary?.contains("premium in grace period") == true && grace.first?.entitlements.first?.isInGracePeriod == true)
        #expect(grace.last?.changes.first?.after?.isActive == false)

        // 70 one-hour grants, two hours apart: 140 changes by time after the writes.
        for index in 0..<70 {
            let start = now + Int64(index) * 2 * 3_600_000
            _ = try await store.write(Self.grant("erin", "h\(index)", "pro", until: start + 3_600_000, from: start), at: now)
        }
        let end = now + 300 * 3_600_000
        let erin = try Self.history(store, "erin", at: end).entries
        let times = erin.filter { $0.cause == .time }
        #expect(times.count == 65)
        #expect(times.last?.summary?.hasPrefix("more changes by time until") == true)
        let resolved = EntitlementResolver(catalog: store.catalog).resolve(try store.customer(for: "erin"), at: end)
        #expect(times.last?.entitlements == resolved.entitlements)
    }

    @Test("replicated writes (fleet mode) are read from the record they carry, with their source")
    func replicated() throws {
        var builder = CustomerHistoryBuilder(customerId: "u", record: nil, startDate: now, catalog: ProductCatalog(WriteWorld.catalog), environment: .production) { "\($0)" }
        let record = CustomerRecord(id: "u", grants: [Grant(grantId: "g", entitlementId: "pro", grantedDate: now)])
        let write = ReplicatedWrite(customerId: "u", created: true, customers: [CustomerChange(customerId: "u", record: record)], source: WriteSource(method: "GrantEntitlement", caller: "grpc token"))
        builder.apply(LogRecord(sequence: 7, recordedDate: now + 1, mutation: .replicatedWrite(write)))
        builder.apply(LogRecord(sequence: 8, recordedDate: now + 2, mutation: .replicatedWrite(ReplicatedWrite(customerId: "v", customers: [CustomerChange(customerId: "v")]))))
        builder.finish(now: now + 3)
        #expect(builder.entries.count == 1)
        #expect(builder.entries[0].source?.caller == "grpc token")
        #expect(builder.entries[0].summary == "customer created; grant g of pro given from \(now) for good")
        #expect(Self.active(builder.entries[0]) == ["pro"])
    }
}
