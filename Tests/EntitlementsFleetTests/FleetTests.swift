import EntitlementsClient
import EntitlementsFleet
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsWire
import Foundation
import Logging
import NIOCore
import NIOPosix
import Synchronization
import Testing

/// A world for fleet tests: PostgreSQL with the schema and a small catalog and customers
/// imported, and helpers to open servers' replicas on it.
final class FleetWorld: @unchecked Sendable {
    // @unchecked: set once in init, then only read.
    static let day: Int64 = 86_400_000
    static let catalog = Catalog(products: [
        Product(id: "monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
    ])

    let postgres: PostgresServer
    let scratch: String
    let logger = Logger(label: "fleet-test")
    let now = Int64(Date().timeIntervalSince1970 * 1000)

    init(customers: [String] = ["alice", "bob"]) async throws {
        self.postgres = try PostgresServer()
        self.scratch = NSTemporaryDirectory() + "fleet-\(UUID().uuidString)"
        try FileManager.default.createDirectory(atPath: self.scratch, withIntermediateDirectories: true)
        let seed = self.scratch + "/seed.snap"
        var writer = try SnapshotWriter(path: seed, catalog: Self.catalog, createdDate: self.now)
        for id in customers {
            try writer.append(CustomerRecord(id: id, aliases: ["anon-\(id)"]))
        }
        try writer.finish(hotList: [])
        let database = self.database()
        _ = try await FleetSchema.migrate(database)
        _ = try await FleetSnapshot.importSnapshot(database, from: seed)
        await database.close()
    }

    deinit {
        try? FileManager.default.removeItem(atPath: self.scratch)
    }

    func database() -> FleetDatabase {
        FleetDatabase(url: self.postgres.databaseURL, logger: self.logger)
    }

    /// Opens a server's replica on data directory `name`; its tailer runs in `tasks`.
    func replica(
        _ name: String,
        seed: String? = nil,
        listen: Bool = true,
        poll: Duration = .milliseconds(100),
        reads: FleetDatabaseURL? = nil
    ) async throws -> FleetReplica {
        try await FleetReplica.open(
            url: self.postgres.databaseURL,
            dataDirectory: self.scratch + "/" + name,
            seed: seed,
            // writeWait: a write waits this long for its own tailer to apply it; the tests read
            // their writes back at once, and a loaded machine can stall the tailer for seconds.
            configuration: .init(tailer: .init(pollInterval: poll, listen: listen), writeWait: .seconds(10), readURL: reads),
            logger: self.logger,
            now: self.now
        )
    }

    static func grant(_ user: String, _ id: String, expires: Int64? = nil) -> LogRecord.Mutation {
        .grantEntitlement(GrantEntitlementRequest(userId: user, grant: Grant(grantId: id, entitlementId: "premium", expirationDate: expires)))
    }
}

extension CustomerStore {
    func write(_ mutation: LogRecord.Mutation, now: Int64) async throws -> WriteOutcome {
        try await withCheckedThrowingContinuation { continuation in
            self.write(mutation, now: now) { continuation.resume(with: $0) }
        }
    }

    func grantIds(_ user: String) throws -> [String] {
        (try self.customer(for: user)?.grants.compactMap(\.grantId) ?? []).sorted()
    }
}

/// Runs `replica`'s tailer for the duration of `body`.
func tailing<T: Sendable>(_ replicas: [FleetReplica], _ body: () async throws -> T) async throws -> T {
    try await withThrowingTaskGroup(of: Void.self) { group in
        for replica in replicas {
            group.addTask {
                do {
                    try await replica.tailer.run()
                } catch {
                    Issue.record("a tailer stopped: \(error)")
                }
            }
        }
        defer { group.cancelAll() }
        return try await body()
    }
}

@Suite("fleet database URL")
struct FleetDatabaseURLTests {
    @Test("a URL is parsed; its password is never printed")
    func parses() throws {
        let url = try FleetDatabaseURL("postgres://app:s%40cret@db.internal:6432/entitlements")
        #expect(url.host == "db.internal" && url.port == 6432 && url.username == "app" && url.password == "s@cret" && url.database == "entitlements")
        #expect("\(url)" == "postgres://app:***@db.internal:6432/entitlements")
        let v6 = try FleetDatabaseURL("postgresql://app@[::1]/e")
        #expect(v6.host == "::1" && v6.port == 5432 && v6.password == nil)
    }

    @Test("a bad URL says what is wrong", arguments: [
        ("mysql://a@b/c", "must start with postgres://"),
        ("postgres://db:5432/x", "no user name"),
        ("postgres://a@db:99999/x", "the port is not a number"),
        ("postgres://a@/x", "the host is empty"),
    ])
    func refuses(text: String, message: String) {
        #expect {
            _ = try FleetDatabaseURL(text)
        } throws: { error in
            "\(error)".contains(message) && "\(error)".contains("expected postgres://")
        }
    }
}

@Suite("fleet mode on a real PostgreSQL", .serialized)
struct FleetTests {
    @Test("db migrate is idempotent and safe to run at once from many pods; a newer schema is refused")
    func migrations() async throws {
        let postgres = try PostgresServer()
        let database = FleetDatabase(url: postgres.databaseURL, logger: Logger(label: "t"))
        // Four at once: one applies, the others wait on the advisory lock and find it done.
        let reports = try await withThrowingTaskGroup(of: FleetSchema.MigrationReport.self) { group in
            for _ in 0..<4 {
                group.addTask {
                    let own = FleetDatabase(url: postgres.databaseURL, logger: Logger(label: "t"))
                    defer { Task { await own.close() } }
                    return try await FleetSchema.migrate(own)
                }
            }
            return try await group.reduce(into: []) { $0.append($1) }
        }
        #expect(reports.filter { $0.from == 0 }.count == 1)
        #expect(reports.allSatisfy { $0.to == FleetSchema.currentVersion })
        try await FleetSchema.check(database)
        #expect(try postgres.sql("SELECT count(*) FROM change_head") == "1")

        try postgres.sql("INSERT INTO entitlements_schema (version) VALUES (99)")
        await #expect {
            try await FleetSchema.migrate(database)
        } throws: { error in
            "\(error)".contains("schema version 99, newer than this binary's \(FleetSchema.currentVersion)")
        }
        await #expect {
            try await FleetSchema.check(database)
        } throws: { error in
            "\(error)".contains("upgrade entitlements")
        }
        await database.close()
    }

    @Test("an unreachable database and a wrong password are refused with messages a person can act on")
    func unreachable() async throws {
        let postgres = try PostgresServer()
        let nobody = try PostgresServer.freePort()
        let closed = FleetDatabase(url: try FleetDatabaseURL("postgres://postgres:x@127.0.0.1:\(nobody)/postgres"), logger: Logger(label: "t"))
        await #expect {
            try await FleetSchema.check(closed)
        } throws: { error in
            (error as? FleetError)?.kind == .unreachable
                && "\(error)".hasSuffix("cannot connect to PostgreSQL at postgres://postgres:***@127.0.0.1:\(nobody)/postgres: connection refused (is PostgreSQL running, on that port?)")
        }
        let wrong = FleetDatabase(url: try FleetDatabaseURL("postgres://postgres:wrong@127.0.0.1:\(postgres.port)/postgres"), logger: Logger(label: "t"))
        await #expect {
            try await FleetSchema.check(wrong)
        } throws: { error in
            "\(error)".contains("password authentication failed") && !"\(error)".contains("wrong")
        }
        let empty = FleetDatabase(url: postgres.databaseURL, logger: Logger(label: "t"))
        await #expect {
            try await FleetSchema.check(empty)
        } throws: { error in
            "\(error)".contains("run `entitlements db migrate --postgres URL` first")
        }
        await empty.close()
    }

    @Test("a database whose settings can lose acknowledged writes is named at start (this test's PostgreSQL runs with fsync and full_page_writes off, for speed)")
    func durabilityWarnings() async throws {
        let postgres = try PostgresServer()
        let database = FleetDatabase(url: postgres.databaseURL, logger: Logger(label: "t"))
        let warnings = try await FleetSchema.durabilityWarnings(database)
        #expect(warnings.count == 2, "\(warnings)")
        #expect(warnings.first?.contains("runs with fsync=off: a crash of its machine can lose writes this server acknowledged") == true, "\(warnings)")
        #expect(warnings.last?.contains("full_page_writes=off") == true, "\(warnings)")
        await database.close()
    }

    @Test("two servers on one database: a write through A is applied on B in sequence order; a retry takes no new sequence")
    func twoServers() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        let b = try await world.replica("b")
        try await tailing([a, b]) {
            let first = try await a.store.write(FleetWorld.grant("anon-alice", "g1"), now: world.now)
            #expect(first.changed && first.customerId == "alice" && first.sequence == 1)
            // A reads its own write at once: the write waited until A applied it.
            #expect(try a.store.grantIds("alice") == ["g1"])
            let second = try await a.store.write(FleetWorld.grant("bob", "g2"), now: world.now)
            #expect(second.sequence == 2)
            #expect(await b.store.waitUntilApplied(2, timeout: .seconds(20)))
            #expect(try b.store.grantIds("anon-alice") == ["g1"] && b.store.grantIds("bob") == ["g2"])

            // The same grant again changes nothing: no new sequence, the customer's last one.
            let retry = try await b.store.write(FleetWorld.grant("alice", "g1"), now: world.now)
            #expect(!retry.changed && retry.sequence == 1)
            #expect(try world.postgres.sql("SELECT seq FROM change_head") == "2")
            // The domain tables hold the same data in columns.
            #expect(try world.postgres.sql("SELECT customer_id || '/' || grant_id FROM grants ORDER BY 1") == "alice/g1\nbob/g2")

            // A write the rules refuse is refused the same way as on an embedded server.
            await #expect {
                try await a.store.write(.grantEntitlement(GrantEntitlementRequest(userId: "alice", grant: Grant(entitlementId: "premium"))), now: world.now)
            } throws: { error in
                (error as? WriteRefusal)?.reason == .invalidArgument && "\(error)".contains("grant.grant_id")
            }
            // An alias moved from bob to alice logs both customers in one sequence.
            let moved = try await b.store.write(.linkAlias(LinkAliasRequest(userId: "alice", alias: "anon-bob", transfer: true)), now: world.now)
            #expect(moved.sequence == 3)
            #expect(await a.store.waitUntilApplied(3, timeout: .seconds(20)))
            #expect(try a.store.customer(for: "anon-bob")?.id == "alice" && a.store.customer(for: "bob")?.aliases == [])

            // History on B, from its log of the change log's rows: the effect of each write
            // on each customer, with the source A sent along.
            let source = WriteSource(method: "GrantEntitlement", caller: "grpc token")
            let sourced = try await withCheckedThrowingContinuation { continuation in
                a.store.write(FleetWorld.grant("alice", "g3"), now: world.now, source: source) { continuation.resume(with: $0) }
            }
            #expect(sourced.sequence == 4)
            #expect(await b.store.waitUntilApplied(4, timeout: .seconds(20)))
            let alice = try b.store.history(of: "anon-alice", limit: 100, environment: .production, now: world.now) { "\($0)" }
            #expect(alice.customerId == "alice" && alice.entries.filter { $0.cause == .write }.map(\.logSequence) == [1, 3, 4])
            #expect(alice.entries.last?.source == source && alice.entries.last?.summary?.contains("grant g3") == true)
            let bob = try b.store.history(of: "bob", limit: 100, environment: .production, now: world.now) { "\($0)" }
            #expect(bob.entries.filter { $0.cause == .write }.map(\.logSequence) == [2, 3])
            #expect(bob.entries.last?.summary == "alias anon-bob removed")
        }
        await a.close()
        await b.close()
    }

    enum Answer: Sendable, Equatable {
        case stored(sequence: UInt64, changed: Bool)
        case refused(WriteRefusal.Reason)
    }

    /// Sends `writes` through `replica` at once; each answer by name.
    static func writeAtOnce(_ writes: [(String, LogRecord.Mutation)], through replica: FleetReplica, now: Int64) async -> [String: Answer] {
        await withTaskGroup(of: (String, Answer).self) { group in
            for (name, mutation) in writes {
                group.addTask {
                    do {
                        let outcome = try await replica.store.write(mutation, now: now)
                        return (name, .stored(sequence: outcome.sequence ?? 0, changed: outcome.changed))
                    } catch let refusal as WriteRefusal {
                        return (name, .refused(refusal.reason))
                    } catch {
                        Issue.record("a write failed: \(error)")
                        return (name, .refused(.unavailable))
                    }
                }
            }
            return await group.reduce(into: [String: Answer]()) { $0[$1.0] = $1.1 }
        }
    }

    @Test("writes sent at once are committed in groups: each gets its own sequence and answer; a refused write or one PostgreSQL cannot store fails alone")
    func groupCommit() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        let b = try await world.replica("b")
        try await tailing([a, b]) {
            var writes: [(String, LogRecord.Mutation)] = []
            for index in 0..<12 {
                writes.append(("alice g\(index)", FleetWorld.grant(index % 2 == 0 ? "alice" : "anon-alice", "g\(index)")))
                writes.append(("new-\(index)", FleetWorld.grant("new-\(index)", "n\(index)")))
            }
            // The same write twice at once (a client's retry), and a write the rules refuse.
            writes.append(("retry 1", FleetWorld.grant("bob", "twice")))
            writes.append(("retry 2", FleetWorld.grant("bob", "twice")))
            writes.append(("no grant id", .grantEntitlement(GrantEntitlementRequest(userId: "bob", grant: Grant(entitlementId: "premium")))))
            var answers = await Self.writeAtOnce(writes, through: a, now: world.now)
            #expect(answers["no grant id"] == .refused(.invalidArgument))
            // One of the two identical writes stored it; the other changed nothing and
            // answers the same sequence, so a read with it sees the grant.
            let retries = [answers["retry 1"], answers["retry 2"]].compactMap { $0 }
            guard case .stored(let first, let firstChanged) = retries.first, case .stored(let second, let secondChanged) = retries.last else {
                Issue.record("the retried write was not stored: \(retries)")
                return
            }
            #expect(first == second && firstChanged != secondChanged)
            // Every changed write has its own sequence, with no gaps.
            let changed = answers.values.compactMap { answer -> UInt64? in
                if case .stored(let sequence, true) = answer { return sequence }
                return nil
            }.sorted()
            #expect(changed == Array(1...UInt64(25)))
            let head = try world.postgres.sql("SELECT seq FROM change_head")
            #expect(head == "25")
            // Writes were grouped: fewer transactions (each stamps its rows with one time) than writes.
            let transactions = try world.postgres.sql("SELECT count(DISTINCT committed_at) FROM change_log")
            #expect((Int(transactions) ?? 25) < 25, "\(transactions) transactions")
            #expect(await b.store.waitUntilApplied(25, timeout: .seconds(20)))
            for store in [a.store, b.store] {
                #expect(try store.grantIds("alice") == (0..<12).map { "g\($0)" }.sorted())
                #expect(try store.grantIds("bob") == ["twice"])
                for index in 0..<12 {
                    #expect(try store.grantIds("new-\(index)") == ["n\(index)"])
                }
            }
            // The domain tables hold the same rows, and each customer's last sequence.
            let rows = try world.postgres.sql("SELECT count(*) FROM grants")
            #expect(rows == "25")
            let lastChange = try world.postgres.sql("SELECT max(seq) FROM change_log WHERE customer_id = 'alice'")
            #expect(try world.postgres.sql("SELECT last_seq FROM customers WHERE customer_id = 'alice'") == lastChange)

            // A write whose id PostgreSQL cannot store, among good ones: it alone fails.
            writes = (0..<6).map { ("later \($0)", FleetWorld.grant("bob", "later-\($0)")) }
            writes.insert(("nul", FleetWorld.grant("bob", "nul\u{0}byte")), at: 3)
            answers = await Self.writeAtOnce(writes, through: a, now: world.now)
            #expect(answers["nul"] == .refused(.invalidArgument))
            #expect(answers.values.filter { if case .stored(_, true) = $0 { true } else { false } }.count == 6, "\(answers)")
            #expect(try a.store.grantIds("bob") == ["later-0", "later-1", "later-2", "later-3", "later-4", "later-5", "twice"])
            // The tables too: the refused write left nothing of itself among the group's changes.
            let bobRows = try world.postgres.sql("SELECT string_agg(grant_id, ',' ORDER BY grant_id COLLATE \"C\") FROM grants WHERE customer_id = 'bob'")
            #expect(bobRows == "later-0,later-1,later-2,later-3,later-4,later-5,twice")

            // Writes at once that move aliases and delete and re-create customers: whatever
            // order they land in, every server and the tables agree on the outcome.
            writes = [
                ("move to alice", .linkAlias(LinkAliasRequest(userId: "alice", alias: "anon-bob", transfer: true))),
                ("grant on alias", FleetWorld.grant("anon-bob", "via-alias")),
                ("move to new-1", .linkAlias(LinkAliasRequest(userId: "new-1", alias: "anon-bob", transfer: true))),
                ("delete new-2", .deleteCustomer(DeleteCustomerRequest(userId: "new-2"))),
                ("re-create new-2", FleetWorld.grant("new-2", "again")),
                ("delete new-1", .deleteCustomer(DeleteCustomerRequest(userId: "new-1"))),
                ("grant new-1", FleetWorld.grant("anon-new-1", "n1-again")),
                ("link to new-1", .linkAlias(LinkAliasRequest(userId: "new-1", alias: "anon-new-1"))),
                // Changes one row of alice's grants (the others are not rewritten).
                ("revoke g0", .revokeGrant(RevokeGrantRequest(userId: "alice", grantId: "g0"))),
            ]
            answers = await Self.writeAtOnce(writes, through: a, now: world.now)
            let last = UInt64(try world.postgres.sql("SELECT seq FROM change_head"))!
            #expect(await b.store.waitUntilApplied(last, timeout: .seconds(20)))
            for id in ["alice", "bob", "anon-bob", "new-1", "anon-new-1", "new-2"] {
                #expect(try a.store.customer(for: id) == b.store.customer(for: id), "\(id) after \(answers)")
            }
            for customer in ["alice", "bob", "new-1", "anon-new-1", "new-2"] {
                let record = try a.store.customer(for: customer)
                let owned = record?.id == customer
                let table = try world.postgres.sql(
                    "SELECT string_agg(grant_id || ':' || (revoked_date IS NOT NULL), ',' ORDER BY grant_id COLLATE \"C\") FROM grants WHERE customer_id = '\(customer)'"
                )
                let grants = (record?.grants ?? []).sorted { ($0.grantId ?? "") < ($1.grantId ?? "") }.map { "\($0.grantId ?? ""):\($0.revokedDate != nil)" }
                #expect(table == (owned ? grants.joined(separator: ",") : ""), "\(customer)")
                let aliases = try world.postgres.sql("SELECT string_agg(alias, ',' ORDER BY alias COLLATE \"C\") FROM aliases WHERE customer_id = '\(customer)'")
                #expect(aliases == (owned ? (record?.aliases.sorted().joined(separator: ",") ?? "") : ""), "\(customer)")
            }
            #expect(try world.postgres.sql("SELECT revoked_date IS NOT NULL FROM grants WHERE customer_id = 'alice' AND grant_id = 'g0'") == "t")
            // The export checks that every key has one owner.
            _ = try await FleetSnapshot.export(a.database, to: world.scratch + "/group.snap", now: world.now)
        }
        await a.close()
        await b.close()
    }

    @Test("two servers creating the same new customer at once, and linking one new alias at once: every acknowledged write is kept, no alias has two owners")
    func racingCreates() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        let b = try await world.replica("b")
        try await tailing([a, b]) {
            let grants = try await withThrowingTaskGroup(of: String.self) { group in
                for index in 0..<16 {
                    let replica = index % 2 == 0 ? a : b
                    group.addTask {
                        _ = try await replica.store.write(FleetWorld.grant("new-customer", "g\(index)"), now: world.now)
                        return "g\(index)"
                    }
                }
                return try await group.reduce(into: []) { $0.append($1) }
            }
            let linked = try await withThrowingTaskGroup(of: String?.self) { group in
                for owner in ["alice", "bob"] {
                    let replica = owner == "alice" ? a : b
                    group.addTask {
                        do {
                            _ = try await replica.store.write(.linkAlias(LinkAliasRequest(userId: owner, alias: "shared-alias")), now: world.now)
                            return owner
                        } catch let refusal as WriteRefusal where refusal.reason == .failedPrecondition {
                            return nil  // the other one got it first
                        }
                    }
                }
                var owners: [String] = []
                for try await owner in group {
                    if let owner { owners.append(owner) }
                }
                return owners
            }
            #expect(linked.count == 1, "\(linked)")
            let head = UInt64(try world.postgres.sql("SELECT seq FROM change_head"))!
            #expect(await a.store.waitUntilApplied(head, timeout: .seconds(20)))
            #expect(try a.store.grantIds("new-customer") == grants.sorted())
            #expect(try a.store.customer(for: "shared-alias")?.id == linked.first)
            #expect(try world.postgres.sql("SELECT count(*) FROM customers WHERE customer_id = 'shared-alias'") == "0")
            // The exported state agrees (every key has one owner, or export refuses).
            _ = try await FleetSnapshot.export(a.database, to: world.scratch + "/check.snap", now: world.now)

            // A value PostgreSQL cannot store is the request's fault, not an outage.
            await #expect {
                try await a.store.write(FleetWorld.grant("alice", "nul\u{0}byte"), now: world.now)
            } throws: { error in
                (error as? WriteRefusal)?.reason == .invalidArgument
            }
        }
        await a.close()
        await b.close()
    }

    @Test("ordering: a write that took its sequence and is still open holds back later commits; the tailer never skips it")
    func heldTransaction() async throws {
        let world = try await FleetWorld()
        let b = try await world.replica("b", listen: false, poll: .milliseconds(20))
        let writer = world.database()
        let held = try await writer.connect()
        // A writer takes sequence 1 and holds its transaction open.
        try await held.query("BEGIN", logger: world.logger)
        try await held.query("UPDATE change_head SET seq = seq + 1", logger: world.logger)
        try await tailing([b]) {
            // Another write meanwhile: it must wait for the row lock, so it cannot commit
            // sequence 2 before 1 is visible.
            async let later = b.store.write(FleetWorld.grant("bob", "later"), now: world.now)
            // Wait until that write is blocked on the change_head row lock (seen by PostgreSQL).
            while try world.postgres.sql("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'") != "1" {
                try await Task.sleep(for: .milliseconds(10))
            }
            #expect(b.store.committedSequence == 0)
            // The held writer logs its change and commits.
            let record = ByteBuffer(bytes: try ReplicatedWrite(customerId: "alice", customers: [CustomerChange(customerId: "alice", record: CustomerRecord(id: "alice", aliases: ["anon-alice"], grants: [Grant(grantId: "held", entitlementId: "premium", grantedDate: world.now)]))]).serializedBytes())
            try await held.query("INSERT INTO change_log (seq, customer_id, record) VALUES (1, 'alice', \(record))", logger: world.logger)
            try await held.query("COMMIT", logger: world.logger)
            let outcome = try await later
            #expect(outcome.sequence == 2)
            #expect(await b.store.waitUntilApplied(2, timeout: .seconds(20)))
            #expect(try b.store.grantIds("alice") == ["held"] && b.store.grantIds("bob") == ["later"])
        }
        try await held.close()
        await writer.close()
        await b.close()
    }

    @Test("a restarted server resumes from its saved cursor; an epoch change or a pruned change log starts it afresh, correctly")
    func restartAndRebootstrap() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        var b = try await world.replica("b")
        try await tailing([a, b]) { [b] in
            _ = try await a.store.write(FleetWorld.grant("alice", "g1"), now: world.now)
            #expect(await b.store.waitUntilApplied(1, timeout: .seconds(20)))
        }
        await b.close()
        b = try await world.replica("b")
        #expect(b.startup.contains("continuing from the data directory at sequence 1"), "\(b.startup)")
        try await tailing([a]) {
            _ = try await a.store.write(FleetWorld.grant("bob", "g2"), now: world.now)
            _ = try await a.store.write(FleetWorld.grant("bob", "g3"), now: world.now)
        }
        try await tailing([b]) { [b] in
            #expect(await b.store.waitUntilApplied(3, timeout: .seconds(20)))
            let ids = try b.store.grantIds("bob")
            #expect(ids == ["g2", "g3"])
        }
        await b.close()

        // Rows b has not applied are pruned: it cannot continue, so it starts afresh.
        try await tailing([a]) {
            _ = try await a.store.write(FleetWorld.grant("bob", "g4"), now: world.now)
        }
        try world.postgres.sql("DELETE FROM change_log WHERE seq <= 4")
        b = try await world.replica("b")
        #expect(b.startup.contains("the change log now starts at 5") && b.startup.contains("exported"), "\(b.startup)")
        #expect(try b.store.grantIds("bob") == ["g2", "g3", "g4"] && b.store.committedSequence == 4)

        // A new epoch (a restore that reuses sequence numbers): the running tailer stops
        // with a re-bootstrap error, and a restart starts afresh.
        try world.postgres.sql("UPDATE change_head SET epoch = gen_random_uuid()")
        await #expect {
            try await b.tailer.run()
        } throws: { error in
            (error as? FleetError)?.kind == .rebootstrap && "\(error)".contains("a restore or failover started a new history")
        }
        await b.close()
        b = try await world.replica("b")
        #expect(b.startup.contains("is from epoch") && b.startup.contains("exported"), "\(b.startup)")
        #expect(try b.store.grantIds("bob") == ["g2", "g3", "g4"])

        // A --snapshot of another epoch is not used: said, and exported instead.
        let stale = world.scratch + "/stale.snap"
        let writer = try SnapshotWriter(path: stale, catalog: FleetWorld.catalog, createdDate: world.now, fleetEpoch: "not-this-one")
        try writer.finish(hotList: [])
        let c = try await world.replica("c", seed: stale)
        #expect(c.startup.contains("--snapshot \(stale) is not used") && c.startup.contains("not-this-one"), "\(c.startup)")
        #expect(try c.store.grantIds("bob") == ["g2", "g3", "g4"])
        await c.close()

        // A --snapshot of this epoch but past the change log's head (a database that lost
        // writes) is not used either.
        let ahead = world.scratch + "/ahead.snap"
        let epoch = try world.postgres.sql("SELECT epoch FROM change_head")
        let aheadWriter = try SnapshotWriter(path: ahead, catalog: FleetWorld.catalog, createdDate: world.now, lastLogSequence: 999, fleetEpoch: epoch)
        try aheadWriter.finish(hotList: [])
        let d = try await world.replica("d", seed: ahead)
        #expect(d.startup.contains("--snapshot \(ahead) is not used (it holds writes up to 999, past the change log's head 4)"), "\(d.startup)")
        #expect(try d.store.grantIds("bob") == ["g2", "g3", "g4"])
        await d.close()
        await a.close()
        await b.close()
    }

    @Test("a history rewritten in the same epoch (a restore that kept its epoch, then new writes) is detected by a running server, at start-up, and in a --snapshot file; a new epoch starts the server afresh", .timeLimit(.minutes(2)))
    func rewrittenHistory() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        var b = try await world.replica("b")
        try await tailing([a, b]) { [b] in
            for id in ["g1", "g2", "g3"] {
                _ = try await a.store.write(FleetWorld.grant("alice", id), now: world.now)
            }
            #expect(await b.store.waitUntilApplied(3, timeout: .seconds(20)))
        }
        // A compaction keeps when row 3 was committed (in the snapshot's header), so a
        // restart can still tell it from another row 3.
        _ = try await b.store.compact(hotList: [], now: world.now)
        await b.close()
        b = try await world.replica("b")
        #expect(b.store.snapshot.header.fleetCommittedDate != nil && b.store.replicatedCommitDate(of: 3) == b.store.snapshot.header.fleetCommittedDate)
        let old = world.scratch + "/old.snap"
        let exported = try await FleetSnapshot.export(a.database, to: old, now: world.now)
        #expect(exported.sequence == 3)
        await a.close()

        // The database goes back to sequence 1, keeping its epoch, and takes new writes:
        // rows 2 and 3 are now other writes than the ones b applied.
        try world.postgres.sql("DELETE FROM change_log WHERE seq > 1")
        try world.postgres.sql("UPDATE change_head SET seq = 1")
        try await Task.sleep(for: .milliseconds(5))  // commit times differ in milliseconds
        let database = world.database()
        let writer = FleetWriter(database: database, catalog: b.store.catalog)
        for id in ["x2", "x3", "x4"] {
            _ = try await writer.write(FleetWorld.grant("bob", id), now: world.now, source: nil)
        }
        await database.close()

        // Running: b stops tailing, saying what happened; nothing of the new history is applied.
        await #expect {
            try await b.tailer.run()
        } throws: { error in
            (error as? FleetError)?.kind == .dataDirectory && "\(error)".contains("the change log's row 3 was committed at")
                && "\(error)".contains("history was rewritten in the same epoch")
        }
        #expect(try b.store.grantIds("bob") == [])
        await b.close()
        // Started again: refused, and the directory is left as it is (it may hold the only
        // copy of writes the database lost).
        await #expect {
            _ = try await world.replica("b")
        } throws: { error in
            (error as? FleetError)?.kind == .dataDirectory && "\(error)".contains("history was rewritten") && "\(error)".contains("Nothing was changed")
        }
        // A --snapshot file of the old history is not used.
        let c = try await world.replica("c", seed: old)
        #expect(c.startup.contains("--snapshot \(old) is not used (its row 3 was committed at") && c.startup.contains("exported"), "\(c.startup)")
        #expect(try c.store.grantIds("bob") == ["x2", "x3", "x4"] && c.store.committedSequence == 4)
        await c.close()

        // The operator sets a new epoch: b starts afresh, its old data kept aside.
        try world.postgres.sql("UPDATE change_head SET epoch = gen_random_uuid()")
        b = try await world.replica("b")
        #expect(b.startup.contains("is from epoch") && b.startup.contains("kept in"), "\(b.startup)")
        #expect(try b.store.grantIds("bob") == ["x2", "x3", "x4"])
        await b.close()
    }

    @Test("serve --postgres with an unreachable database exits 2 saying so, and the password never appears")
    func serveUnreachable() throws {
        let port = try PostgresServer.freePort()
        let directory = NSTemporaryDirectory() + "fleet-unreachable-\(UUID().uuidString)"
        defer { try? FileManager.default.removeItem(atPath: directory) }
        #expect {
            _ = try ServeProcess(["serve", "--postgres", "postgres://app:hunter2@127.0.0.1:\(port)/e", "--data-dir", directory, "--listen", "127.0.0.1:0"])
        } throws: { error in
            let text = "\(error)"
            return text.contains("error: cannot serve: cannot connect to PostgreSQL at postgres://app:***@127.0.0.1:\(port)/e: connection refused (is PostgreSQL running, on that port?)")
                && !text.contains("hunter2") && !text.contains("SingleConnectionFailure")
        }
        #expect(!FileManager.default.fileExists(atPath: directory + "/snapshot.snap"))
    }

    @Test("db prune removes old rows but the newest; a server stopped behind them starts afresh with the right state")
    func prune() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        var b = try await world.replica("b")
        try await tailing([a, b]) { [b] in
            _ = try await a.store.write(FleetWorld.grant("alice", "g1"), now: world.now)
            #expect(await b.store.waitUntilApplied(1, timeout: .seconds(20)))
        }
        await b.close()
        try await tailing([a]) {
            _ = try await a.store.write(FleetWorld.grant("alice", "g2"), now: world.now)
            _ = try await a.store.write(FleetWorld.grant("alice", "g3"), now: world.now)
        }
        // Rows committed before a minute ago: none.
        let none = try await FleetSchema.prune(a.database, olderThan: world.now - 60_000)
        #expect(none.removedRows == 0 && none.oldestKept == 1)
        // Everything committed before a minute from now: all but the newest.
        let pruned = try await FleetSchema.prune(a.database, olderThan: Int64(Date().timeIntervalSince1970 * 1000) + 60_000)
        #expect(pruned.removedRows == 2 && pruned.oldestKept == 3)
        b = try await world.replica("b")
        #expect(b.startup.contains("the change log now starts at 3"), "\(b.startup)")
        #expect(try b.store.grantIds("alice") == ["g1", "g2", "g3"])
        await b.close()

        // A row whose time is later than the next one's (a transaction that started first
        // and waited for the sequence): pruning stops at it, leaving no gap behind it.
        try await tailing([a]) {
            for grant in ["g4", "g5", "g6"] {
                _ = try await a.store.write(FleetWorld.grant("alice", grant), now: world.now)
            }
        }
        let sequences: @Sendable () async throws -> [Int64] = {
            try await a.database.withConnection { connection in
                var seen: [Int64] = []
                for try await seq in try await connection.query("SELECT seq FROM change_log ORDER BY seq", logger: world.logger).decode(Int64.self) {
                    seen.append(seq)
                }
                return seen
            }
        }
        #expect(try await sequences() == [3, 4, 5, 6])
        try await a.database.withConnection { connection in
            _ = try await connection.query("UPDATE change_log SET committed_at = now() + interval '1 hour' WHERE seq = 4", logger: world.logger)
        }
        let prefix = try await FleetSchema.prune(a.database, olderThan: Int64(Date().timeIntervalSince1970 * 1000) + 60_000)
        #expect(prefix.removedRows == 1 && prefix.oldestKept == 4)
        #expect(try await sequences() == [4, 5, 6], "no gap: 5 is kept though older than the cutoff")
        await a.close()
    }

    @Test("serve --postgres killed with SIGKILL at random moments resumes from its saved cursor and misses nothing", .timeLimit(.minutes(3)))
    func killNine() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        let arguments = [
            "serve", "--postgres", world.postgres.url, "--data-dir", world.scratch + "/b",
            "--listen", "127.0.0.1:0", "--threads", "1", "--fleet-poll-interval", "50ms", "--min-sequence-wait", "5s",
        ]
        var acknowledged: [String] = []
        var lastSequence: UInt64 = 0
        try await tailing([a]) {
            for round in 0..<4 {
                let b = try ServeProcess(arguments)
                if round > 0 {
                    #expect(b.startup.contains("continuing from the data directory at sequence"), "\(b.startup)")
                }
                // Writes through A while B tails; B is killed at a random moment among them.
                let killAfter = Int.random(in: 0..<15)
                for index in 0..<15 {
                    let id = "r\(round)-\(index)"
                    let outcome = try await a.store.write(FleetWorld.grant("bob", id), now: world.now)
                    acknowledged.append(id)
                    lastSequence = max(lastSequence, outcome.sequence ?? 0)
                    if index == killAfter {
                        b.kill9()
                    }
                }
                // Started again, B catches up on everything, missing nothing.
                let again = try ServeProcess(arguments)
                let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
                let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: again.port)), eventLoopGroup: group)
                let answer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "anon-bob", minLogSequence: lastSequence))
                #expect(answer.customerId == "bob" && answer.entitlements.first { $0.id == "premium" }?.isActive == true)
                await client.close()
                #expect(again.terminate() == 0)
                try await group.shutdownGracefully()
            }
        }
        // The directory B kept holds every acknowledged write, in order.
        let b = try await world.replica("b")
        #expect(try b.store.grantIds("bob") == acknowledged.sorted())
        #expect(b.store.committedSequence == lastSequence)
        await a.close()
        await b.close()
    }

    @Test("serve --postgres --stale-policy closed: past --max-staleness /readyz is 503 and checks are refused; PostgreSQL back, it is ready again", .timeLimit(.minutes(2)))
    func staleServe() async throws {
        let world = try await FleetWorld()
        let serve = try ServeProcess([
            "serve", "--postgres", world.postgres.url, "--data-dir", world.scratch + "/s", "--listen", "127.0.0.1:0",
            "--admin", "127.0.0.1:0", "--threads", "1", "--fleet-poll-interval", "50ms", "--max-staleness", "400ms", "--stale-policy", "closed",
        ])
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: serve.port)), eventLoopGroup: group)
        // Ready, not stale and answering, asked together until all three hold (bounded at
        // 10 s): on a loaded machine a poll can come later than the 400 ms bound between
        // any two of them.
        func current() async -> Bool {
            guard (try? serve.admin("/readyz"))?.status == 200,
                (try? serve.admin("/metrics"))?.body.contains("entitlements_fleet_stale 0") == true
            else { return false }
            return (try? await client.checkEntitlements(CheckEntitlementsRequest(userId: "alice")))?.customerId == "alice"
        }
        var isCurrent = await current()
        for _ in 0..<200 where !isCurrent {
            try await Task.sleep(for: .milliseconds(50))
            isCurrent = await current()
        }
        #expect(isCurrent, "ready, not stale and answering once PostgreSQL has been heard from")

        try world.postgres.stop(mode: "immediate")
        var ready = try serve.admin("/readyz")
        for _ in 0..<100 where ready.status == 200 {
            try await Task.sleep(for: .milliseconds(50))
            ready = try serve.admin("/readyz")
        }
        #expect(ready.status == 503 && ready.body.contains("stale (past --max-staleness) and --stale-policy closed"), "\(ready)")
        #expect(try serve.admin("/metrics").body.contains("entitlements_fleet_stale 1"))
        await #expect {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "alice"))
        } throws: { error in
            "\(error)".contains("stale: this server last heard from PostgreSQL")
        }

        try world.postgres.start()
        isCurrent = await current()
        for _ in 0..<200 where !isCurrent {
            try await Task.sleep(for: .milliseconds(50))
            isCurrent = await current()
        }
        #expect(isCurrent, "ready, not stale and answering again once PostgreSQL is back")
        await client.close()
        try await group.shutdownGracefully()
        #expect(serve.terminate() == 0)
    }

    @Test("PostgreSQL stopped under load (pg_ctl stop -m immediate): reads go on, writes fail with UNAVAILABLE, and after a restart every acknowledged write is on both servers", .timeLimit(.minutes(3)))
    func databaseDown() async throws {
        let world = try await FleetWorld()
        let a = try await world.replica("a")
        let b = try await world.replica("b")
        let outcomes = WriteOutcomes()
        try await tailing([a, b]) {
            let writes = Task {
                await withTaskGroup(of: Void.self) { group in
                    // 8 writers write until PostgreSQL is stopped, and on a little after.
                    for writer in 0..<8 {
                        group.addTask {
                            var index = 0
                            var afterStop = 0
                            while afterStop < 3 {
                                index += 1
                                if outcomes.stopped.load(ordering: .acquiring) { afterStop += 1 }
                                let id = "w\(writer)-\(index)"
                                do {
                                    _ = try await a.store.write(FleetWorld.grant(writer % 2 == 0 ? "alice" : "anon-bob", id), now: world.now)
                                    outcomes.acknowledged.withLock { $0.append(id) }
                                } catch let refusal as WriteRefusal where refusal.reason == .unavailable {
                                    if refusal.message.contains("may or may not be stored") {
                                        outcomes.uncertain.withLock { $0.append(id) }
                                    } else {
                                        outcomes.refused.add(1, ordering: .relaxed)
                                    }
                                } catch {
                                    Issue.record("unexpected: \(error)")
                                }
                            }
                        }
                    }
                }
            }
            // Stop PostgreSQL as a crash would, once some writes are outcomes.acknowledged.
            while outcomes.acknowledged.withLock({ $0.count }) < 40 {
                try await Task.sleep(for: .milliseconds(5))
            }
            try world.postgres.stop(mode: "immediate")
            outcomes.stopped.store(true, ordering: .releasing)
            let started = ContinuousClock.now
            await writes.value
            #expect(started.duration(to: .now) < .seconds(30), "writes must fail, not wait for PostgreSQL to come back")
            #expect(outcomes.refused.load(ordering: .relaxed) > 0)
            // Reads answer from what is applied.
            #expect(try !a.store.grantIds("alice").isEmpty)
            try world.postgres.start()
            var after: CustomerStore.WriteOutcome?
            for _ in 0..<5 where after == nil {
                after = try? await a.store.write(FleetWorld.grant("alice", "after"), now: world.now)
            }
            let sequence = try #require(after?.sequence)
            #expect(await b.store.waitUntilApplied(sequence, timeout: .seconds(30)))
            #expect(await a.store.waitUntilApplied(sequence, timeout: .seconds(30)))
            // Zero lost: every acknowledged write is on both servers (and in PostgreSQL).
            let expected = Set(outcomes.acknowledged.withLock { $0 } + ["after"])
            for replica in [a, b] {
                let present = Set(try replica.store.grantIds("alice") + replica.store.grantIds("bob"))
                #expect(expected.subtracting(present).isEmpty, "lost: \(expected.subtracting(present).sorted())")
                // Anything else present is a write whose answer was lost, never an invented one.
                #expect(present.subtracting(expected).isSubset(of: Set(outcomes.uncertain.withLock { $0 })))
            }
            // The tailer clears its error just after it applies a batch, so the wait above can
            // return a moment before it does (seen once in `make test`): wait for it, bounded.
            let deadline = ContinuousClock.now + .seconds(30)
            while b.tailer.status.lastError != nil, ContinuousClock.now < deadline {
                try await Task.sleep(for: .milliseconds(50))
            }
            #expect(b.tailer.status.lastError == nil)
        }
        await a.close()
        await b.close()
    }
}


/// What concurrent writers saw while PostgreSQL went away: grants acknowledged, those whose
/// COMMIT answer was lost (may or may not be stored: not acknowledged, so either is right),
/// and refusals.
final class WriteOutcomes: Sendable {
    let acknowledged = Mutex<[String]>([])
    let uncertain = Mutex<[String]>([])
    let refused = Atomic<Int>(0)
    let stopped = Atomic<Bool>(false)
}

@Suite("fleet mode: servers on a real PostgreSQL", .serialized)
struct FleetServerTests {
    /// A framed server over a replica, as `serve --postgres` runs one.
    struct Node {
        let replica: FleetReplica
        let server: EntitlementsServer
        let group: MultiThreadedEventLoopGroup
        let client: EntitlementsClient

        init(
            _ replica: FleetReplica,
            now: Int64,
            maximumStaleness: TimeAmount? = nil,
            stalePolicy: ServerConfiguration.StalePolicy = .open
        ) async throws {
            self.replica = replica
            self.group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
            self.server = try await EntitlementsServer.start(
                store: replica.store,
                configuration: ServerConfiguration(
                    tcp: ("127.0.0.1", 0),
                    resolvers: 1,
                    cacheBytes: 1 << 20,
                    minimumSequenceWait: .seconds(5),
                    maximumStaleness: maximumStaleness,
                    stalePolicy: stalePolicy
                ),
                group: self.group,
                warmAt: now
            )
            self.client = EntitlementsClient(
                configuration: .init(server: .tcp(host: "127.0.0.1", port: self.server.tcpAddress!.port!)),
                eventLoopGroup: self.group
            )
        }

        func stop() async throws {
            await self.client.close()
            await self.server.shutdownGracefully()
            try await self.group.shutdownGracefully()
            await self.replica.close()
        }
    }

    @Test("write through A, check on B with min_log_sequence: B polls at once and answers the new state; a watch on B sees the write")
    func readYourWritesOnAnotherServer() async throws {
        let world = try await FleetWorld()
        // B learns of writes only by polling every 30 s: no LISTEN. Only min_log_sequence's
        // request to catch up can make B current within the check's 100 ms wait.
        let a = try await Node(try await world.replica("a"), now: world.now)
        let b = try await Node(try await world.replica("b", listen: false, poll: .seconds(30)), now: world.now)
        try await tailing([a.replica, b.replica]) {
            // The tailer's first poll happens at start; let it pass before the watch.
            let before = try await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "anon-bob"))
            #expect(before.entitlements.isEmpty && before.customerId == "bob")
            let events = try await b.client.watch(WatchEntitlementsRequest(userIds: ["bob"]))

            let write: WriteResponse = try await a.client.call(
                .grantEntitlement,
                GrantEntitlementRequest(userId: "bob", grant: Grant(grantId: "g1", entitlementId: "premium", grantedDate: world.now, expirationDate: world.now + FleetWorld.day))
            )
            #expect(write.changed && write.logSequence == 1)
            let after = try await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "anon-bob", minLogSequence: write.logSequence))
            #expect(after.entitlements.first { $0.id == "premium" }?.isActive == true)
            #expect(after.logSequence == 1)

            var iterator = events.makeAsyncIterator()
            let event = try #require(try await iterator.next())
            #expect(event.customerId == "bob" && event.cause == .write && event.logSequence == 1)

            // A sequence nobody wrote: UNAVAILABLE, naming what B has applied.
            await #expect {
                _ = try await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "bob", minLogSequence: 50))
            } throws: { error in
                "\(error)".contains("applied log sequence 1, the call asked for min_log_sequence 50")
            }
        }
        try await a.stop()
        try await b.stop()
    }

    @Test("--fleet-read-url: a server polls and exports from a streaming read replica, writes to the primary, and still reads its own writes and others' with min_log_sequence", .timeLimit(.minutes(2)))
    func readReplica() async throws {
        let world = try await FleetWorld()
        let standby = try PostgresServer(replicaOf: world.postgres)
        let a = try await Node(try await world.replica("a"), now: world.now)
        // Polls every 30 s unless a write or a read asks for a sequence: then soon.
        let b = try await Node(
            try await world.replica("b", poll: .seconds(30), reads: standby.databaseURL),
            now: world.now,
            // Counted from the start of B's last successful poll: the one that fetches a
            // resumed replica's sequence may itself be slow on a loaded machine.
            maximumStaleness: .seconds(3)
        )
        #expect(b.replica.startup.contains("exported"), "\(b.replica.startup)")
        try await tailing([a.replica, b.replica]) {
            let first: WriteResponse = try await a.client.call(.grantEntitlement, GrantEntitlementRequest(userId: "bob", grant: Grant(grantId: "g1", entitlementId: "premium")))
            let read = try await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "anon-bob", minLogSequence: first.logSequence))
            #expect(read.entitlements.first { $0.id == "premium" }?.isActive == true)
            // A write through B goes to the primary; B reads it back at once, through the replica.
            let second: WriteResponse = try await b.client.call(.grantEntitlement, GrantEntitlementRequest(userId: "alice", grant: Grant(grantId: "g2", entitlementId: "premium")))
            #expect(second.logSequence == 2)
            #expect(b.replica.store.appliedSequence == 2)
            #expect(try b.replica.store.grantIds("alice") == ["g2"])

            // The replica stops: B's polls fail (they go there), its writes still commit on the primary.
            try standby.stop(mode: "immediate")
            let third: WriteResponse = try await b.client.call(.grantEntitlement, GrantEntitlementRequest(userId: "alice", grant: Grant(grantId: "g3", entitlementId: "premium")))
            #expect(third.logSequence == 3)
            // A poll on a connection to a replica that just died may take up to the 5 s
            // bound on one use of a connection to fail.
            for _ in 0..<200 where b.replica.tailer.status.failuresInARow == 0 {
                try await Task.sleep(for: .milliseconds(50))
            }
            #expect(b.replica.tailer.status.failuresInARow > 0 && b.replica.store.appliedSequence == 2)
            #expect(await a.replica.store.waitUntilApplied(3, timeout: .seconds(20)))
            // Back: B catches up on the next read that asks for it.
            try standby.start()
            var caughtUp = false
            for _ in 0..<200 where !caughtUp {
                caughtUp = (try? await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice", minLogSequence: 3))) != nil
                if !caughtUp { try await Task.sleep(for: .milliseconds(50)) }
            }
            #expect(caughtUp)
            #expect(try b.replica.store.grantIds("alice") == ["g2", "g3"])

            // The replica answers but stops replaying: B's polls succeed, yet the primary
            // announced (NOTIFY) a sequence B cannot get, so past --max-staleness B is stale.
            try standby.sql("SELECT pg_wal_replay_pause()")
            let fourth: WriteResponse = try await a.client.call(.grantEntitlement, GrantEntitlementRequest(userId: "bob", grant: Grant(grantId: "g4", entitlementId: "premium")))
            #expect(fourth.logSequence == 4)
            var stale: UInt64 = 0
            for _ in 0..<200 where stale == 0 {
                try await Task.sleep(for: .milliseconds(50))
                stale = try await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "bob")).staleForMs
            }
            #expect(stale > 3000 && b.replica.tailer.status.failuresInARow == 0)
            try standby.sql("SELECT pg_wal_replay_resume()")
            let fresh = try await b.client.checkEntitlements(CheckEntitlementsRequest(userId: "bob", minLogSequence: 4))
            #expect(fresh.staleForMs == 0 && fresh.entitlements.first { $0.id == "premium" }?.isActive == true)
        }
        try await a.stop()
        try await b.stop()
    }

    @Test("PostgreSQL gone past --max-staleness: policy open answers flagged stale, policy closed refuses with UNAVAILABLE and Health says NOT_SERVING; both recover when it is back", .timeLimit(.minutes(2)))
    func staleness() async throws {
        let world = try await FleetWorld()
        let bound = TimeAmount.milliseconds(600)
        let open = try await Node(try await world.replica("open"), now: world.now, maximumStaleness: bound, stalePolicy: .open)
        let closed = try await Node(try await world.replica("closed"), now: world.now, maximumStaleness: bound, stalePolicy: .closed)
        try await tailing([open.replica, closed.replica]) {
            let batch = BatchCheckEntitlementsRequest(userIds: ["alice", "anon-bob"])
            // Current once its tailer has polled: no flag, and serving. (A node made more
            // than the bound before its tailer's first poll is rightly stale until then: a
            // loaded CI machine took that long once.)
            for node in [open, closed] {
                func current() async -> Bool {  // a closed node refuses until then
                    let answer = try? await node.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice"))
                    let health: HealthResponse? = try? await node.client.call(.health, HealthRequest())
                    return answer?.customerId == "alice" && answer?.staleForMs == 0 && health?.status == .serving
                }
                var isCurrent = await current()
                for _ in 0..<100 where !isCurrent {
                    try await Task.sleep(for: .milliseconds(50))
                    isCurrent = await current()
                }
                #expect(isCurrent, "answering unflagged and serving")
            }

            try world.postgres.stop(mode: "immediate")
            // Past the bound (measured from the last successful poll, every 100 ms here).
            var flagged = false
            for _ in 0..<100 where !flagged {
                try await Task.sleep(for: .milliseconds(50))
                flagged = try await open.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice")).staleForMs > 600
            }
            #expect(flagged)
            // The closed node polls on its own schedule: past the bound a little later, maybe.
            for _ in 0..<100 {
                let health: HealthResponse = try await closed.client.call(.health, HealthRequest())
                if health.status == .notServing { break }
                try await Task.sleep(for: .milliseconds(50))
            }
            // Open: the answers are what it applied, each flagged.
            let answer = try await open.client.checkEntitlements(CheckEntitlementsRequest(userId: "anon-bob"))
            #expect(answer.customerId == "bob" && answer.staleForMs > 600)
            let answers: BatchCheckEntitlementsResponse = try await open.client.call(.batchCheckEntitlements, batch)
            #expect(answers.results.count == 2 && answers.results.allSatisfy { $0.staleForMs > 600 })
            let openHealth: HealthResponse = try await open.client.call(.health, HealthRequest())
            #expect(openHealth.status == .serving)
            // Closed: refused, saying why and what to do, and Health says so.
            await #expect {
                _ = try await closed.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice"))
            } throws: { error in
                "\(error)".contains("UNAVAILABLE") && "\(error)".contains("stale: this server last heard from PostgreSQL")
                    && "\(error)".contains("more than --max-staleness 600ms")
            }
            await #expect {
                let _: BatchCheckEntitlementsResponse = try await closed.client.call(.batchCheckEntitlements, batch)
            } throws: { error in
                "\(error)".contains("stale:")
            }
            let closedHealth: HealthResponse = try await closed.client.call(.health, HealthRequest())
            #expect(closedHealth.status == .notServing)

            // PostgreSQL back: the next successful poll makes both current again.
            try world.postgres.start()
            var recovered = false
            for _ in 0..<200 where !recovered {
                try await Task.sleep(for: .milliseconds(50))
                recovered = (try? await closed.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice"))) != nil
            }
            #expect(recovered)
            // The open server polls on its own schedule: its next successful poll, bounded.
            var fresh = try await open.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice"))
            for _ in 0..<200 where fresh.staleForMs != 0 {
                try await Task.sleep(for: .milliseconds(50))
                fresh = try await open.client.checkEntitlements(CheckEntitlementsRequest(userId: "alice"))
            }
            #expect(fresh.staleForMs == 0)
            var health: HealthResponse = try await closed.client.call(.health, HealthRequest())
            for _ in 0..<200 where health.status != .serving {  // current as of its last poll, not of the check above
                try await Task.sleep(for: .milliseconds(50))
                health = try await closed.client.call(.health, HealthRequest())
            }
            #expect(health.status == .serving)
        }
        try await open.stop()
        try await closed.stop()
    }
}
