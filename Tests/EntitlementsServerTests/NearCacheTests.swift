import EntitlementsClient
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import EntitlementsWire
import Foundation
import NIOPosix
import Prometheus
import Synchronization
import Testing

/// The client's near-cache (docs/PROTOCOL.md, "Keeping answers") against a real server:
/// kept answers served without a round trip, forgotten on the watch's events, never past
/// their validUntil, stale only on request and within its bound.
@Suite("near-cache", .serialized)
struct NearCacheTests {
    static func nearClient(_ fixture: ServerFixture, staleIfErrorFor: Duration? = nil) -> EntitlementsClient {
        EntitlementsClient(configuration: .init(
            server: .tcp(host: "127.0.0.1", port: fixture.port),
            nearCache: NearCacheConfiguration(budgetBytes: 1 << 20, staleIfErrorFor: staleIfErrorFor)
        ))
    }

    /// Waits until `condition` holds (the watch connects, an event arrives), at most 5 s.
    static func eventually(_ what: String, _ condition: () async throws -> Bool) async throws {
        let deadline = ContinuousClock.now + .seconds(5)
        while ContinuousClock.now < deadline {
            if try await condition() { return }
            try await Task.sleep(for: .milliseconds(5))
        }
        Issue.record("not within 5 s: \(what)")
    }

    /// The server's count of CheckEntitlements calls answered OK.
    static func checksAnswered(_ fixture: ServerFixture, _ registry: PrometheusCollectorRegistry) async -> String {
        await fixture.server.refreshMetrics()
        var bytes: [UInt8] = []
        registry.emit(into: &bytes)
        return String(decoding: bytes, as: UTF8.self).split(separator: "\n")
            .first { $0.hasPrefix("entitlements_requests_total{") && $0.contains("CheckEntitlements") && $0.contains("\"OK\"") }
            .map(String.init) ?? "none"
    }

    static func active(_ response: CheckEntitlementsResponse) -> Set<String> {
        Set(response.entitlements.filter(\.isActive).compactMap(\.id))
    }

    @Test("kept answers are served without a round trip, filtered as the server would, and forgotten when a write changes them")
    func hitsAndInvalidation() async throws {
        let registry = PrometheusCollectorRegistry()
        let fixture = try await ServerFixture(writable: true, metrics: ServerMetrics(factory: PrometheusMetricsFactory(registry: registry)))
        let client = Self.nearClient(fixture)
        let writer = fixture.client()
        let first = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))
        try await Self.eventually("the watch connects") { client.nearCacheStatistics?.watching == true }
        let answered = await Self.checksAnswered(fixture, registry)
        let again = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))
        #expect(again.entitlements == first.entitlements && again.logSequence == first.logSequence)
        #expect(await Self.checksAnswered(fixture, registry) == answered, "a hit makes no call")
        // A filtered check from the whole answer: what the server answers to the same filter.
        let filtered = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7", entitlementIds: ["premium"]))
        let server = try await writer.checkEntitlements(CheckEntitlementsRequest(userId: "user-7", entitlementIds: ["premium"]))
        #expect(filtered.entitlements == server.entitlements && filtered.validUntil == server.validUntil)
        #expect(client.nearCacheStatistics?.hits == 2)
        // Sandbox checks always go to the server (the near-cache watches production).
        for _ in 0..<2 {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7", environment: .sandbox))
        }
        #expect(client.nearCacheStatistics?.hits == 2 && client.nearCacheStatistics?.entries == 1)
        // A filter the server would refuse is refused, kept answer or not.
        await #expect(throws: EntitlementsClientError.self) {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7", entitlementIds: [""]))
        }

        // Another client writes: the kept answer is forgotten once the event arrives.
        let grant = GrantEntitlementRequest(userId: "user-7", grant: Grant(grantId: "nc-1", entitlementId: "beta"))
        let written: WriteResponse = try await writer.call(.grantEntitlement, grant)
        try await Self.eventually("the write is seen through the near-cache") {
            Self.active(try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))).contains("beta")
        }
        #expect((client.nearCacheStatistics?.invalidations ?? 0) >= 1)
        // min_log_sequence: served only by an answer at least that fresh.
        let fresh = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7", minLogSequence: written.logSequence))
        #expect(fresh.logSequence >= written.logSequence && Self.active(fresh).contains("beta"))
        await client.close()
        await writer.close()
        try await fixture.stop()
    }

    @Test("an alias linked to a customer, and an unknown user created by a write, are not answered from what was kept before")
    func aliasesAndUnknownUsers() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = Self.nearClient(fixture)
        let writer = fixture.client()
        let unknown = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-alias"))
        #expect(unknown.customerId == nil)
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-new"))
        try await Self.eventually("the watch connects") { client.nearCacheStatistics?.watching == true }
        #expect(try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-alias")).customerId == nil)
        let _: WriteResponse = try await writer.call(.linkAlias, LinkAliasRequest(userId: "user-7", alias: "nc-alias"))
        try await Self.eventually("the alias names user-7 through the near-cache") {
            try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-alias")).customerId == "user-7"
        }
        let _: WriteResponse = try await writer.call(.grantEntitlement, GrantEntitlementRequest(userId: "nc-new", grant: Grant(grantId: "g", entitlementId: "beta")))
        try await Self.eventually("the new customer is seen through the near-cache") {
            Self.active(try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-new"))).contains("beta")
        }
        await client.close()
        await writer.close()
        try await fixture.stop()
    }

    @Test("a kept answer is never served past its validUntil, even with no event")
    func validUntil() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = Self.nearClient(fixture)
        let writer = fixture.client()
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))
        try await Self.eventually("the watch connects") { client.nearCacheStatistics?.watching == true }
        let wall = WallClock.unixMilliseconds()
        let until = wall + 3_000
        let grant = GrantEntitlementRequest(userId: "nc-expiring", grant: Grant(grantId: "g", entitlementId: "beta", grantedDate: wall - 1_000, expirationDate: until))
        let _: WriteResponse = try await writer.call(.grantEntitlement, grant)
        let kept = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-expiring"))
        #expect(Self.active(kept) == ["beta"] && kept.validUntil == until)
        // The write's event may come after that check left (then its answer is not kept):
        // check until one is a hit.
        try await Self.eventually("an answer for nc-expiring is kept") {
            let hits = client.nearCacheStatistics?.hits ?? 0
            let again = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-expiring"))
            #expect(Self.active(again) == ["beta"] || WallClock.unixMilliseconds() >= until)
            return client.nearCacheStatistics?.hits == hits + 1
        }
        while WallClock.unixMilliseconds() < until {
            try await Task.sleep(for: .milliseconds(20))
        }
        let after = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "nc-expiring"))
        #expect(Self.active(after).isEmpty, "past validUntil the server is asked again")
        await client.close()
        await writer.close()
        try await fixture.stop()
    }

    @Test("a watch whose connection goes silent (a partition, a hung server) is lost when a PONG does not come back: nothing kept is served, then a new connection and watch", .timeLimit(.minutes(1)))
    func silentConnection() async throws {
        let fixture = try await ServerFixture(writable: true)
        let proxy = try await FreezingProxy(to: fixture.port, group: fixture.group)
        let client = EntitlementsClient(configuration: .init(
            server: .tcp(host: "127.0.0.1", port: proxy.port),
            nearCache: NearCacheConfiguration(budgetBytes: 1 << 20, watchLiveness: .milliseconds(500))
        ))
        let writer = fixture.client()
        let kept = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))
        try await Self.eventually("the watch connects") { client.nearCacheStatistics?.watching == true }
        try await Task.sleep(for: .milliseconds(1_200))  // two PINGs answered: the watch holds
        #expect(client.nearCacheStatistics?.watching == true)
        #expect(try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7")).logSequence == kept.logSequence)
        #expect(client.nearCacheStatistics?.hits == 1)

        // The connection goes silent, and meanwhile the customer changes on the server: the
        // event never arrives, so only the missing PONG can tell the kept answer is stale.
        proxy.freeze()
        let _: WriteResponse = try await writer.call(.grantEntitlement, GrantEntitlementRequest(userId: "user-7", grant: Grant(grantId: "nc-silent", entitlementId: "beta")))
        try await Self.eventually("the silent watch is lost") { client.nearCacheStatistics?.watching == false }
        await #expect(throws: EntitlementsClientError.self, "the kept answer is not served; the server cannot be reached") {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"), timeout: .milliseconds(300))
        }
        #expect(client.nearCacheStatistics?.hits == 1)

        // Heard from again: the server's answer (with the write) is served, and kept under a
        // new watch.
        proxy.thaw()
        try await Self.eventually("the write is seen once the connection speaks again") {
            let answer = try? await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"), timeout: .milliseconds(300))
            return answer.map { Self.active($0).contains("beta") } ?? false
        }
        try await Self.eventually("a new watch connects") { client.nearCacheStatistics?.watching == true }
        #expect((client.nearCacheStatistics?.watchesStarted ?? 0) >= 2)

        // Silent again, and closed meanwhile: close() returns (a PING waiting for its PONG
        // is cancelled, not waited out).
        proxy.freeze()
        try await Task.sleep(for: .milliseconds(300))
        await client.close()
        #expect(client.nearCacheStatistics?.watching == false)
        await writer.close()
        try await proxy.close()
        try await fixture.stop()
    }

    @Test("stale-if-error: with the server gone, kept answers are served marked stale within the bound, then the error")
    func staleIfError() async throws {
        let fixture = try await ServerFixture(writable: true)
        let client = Self.nearClient(fixture, staleIfErrorFor: .seconds(2))
        let plain = Self.nearClient(fixture)
        let kept = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))
        _ = try await plain.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"))
        try await Self.eventually("the watches connect") {
            client.nearCacheStatistics?.watching == true && plain.nearCacheStatistics?.watching == true
        }
        try await fixture.stop()
        try await Self.eventually("the watch is lost") { client.nearCacheStatistics?.watching == false }
        let stale = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"), timeout: .seconds(1))
        #expect(stale.entitlements == kept.entitlements && stale.staleForMs > 0)
        #expect(client.nearCacheStatistics?.staleAnswers == 1)
        // Without stale-if-error, nothing is served while the watch is down.
        try await Self.eventually("the plain client's watch is lost") { plain.nearCacheStatistics?.watching == false }
        await #expect(throws: EntitlementsClientError.self) {
            _ = try await plain.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"), timeout: .seconds(1))
        }
        try await Task.sleep(for: .milliseconds(2_100))
        await #expect(throws: EntitlementsClientError.self) {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-7"), timeout: .seconds(1))
        }
        await client.close()
        await plain.close()
    }
}

/// A writable server on a scratch directory that can be restarted on the same port (the
/// log carries over), so that a client's watch is dropped for real.
final class RestartableServer: @unchecked Sendable {
    let directory: String
    let group = MultiThreadedEventLoopGroup(numberOfThreads: 2)
    private(set) var server: EntitlementsServer
    var port: Int { self.server.tcpAddress!.port! }

    init() async throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("near-cache-load-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        _ = try SnapshotTools.generate(count: 50, seed: 5, now: now, outputPath: self.directory + "/data.snap")
        self.server = try await Self.start(self.directory, port: 0, group: self.group)
    }

    private static func start(_ directory: String, port: Int, group: MultiThreadedEventLoopGroup) async throws -> EntitlementsServer {
        let store = try CustomerStore.open(dataDirectory: directory + "/data", seed: directory + "/data.snap").0
        return try await EntitlementsServer.start(store: store, configuration: ServerConfiguration(tcp: ("127.0.0.1", port)), group: group)
    }

    /// Stops the server (every connection closes) and starts it again on the same port.
    func restart() async throws {
        let port = self.port
        await self.server.shutdownGracefully()
        self.server.store.unlock()
        self.server = try await Self.start(self.directory, port: port, group: self.group)
    }

    func stop() async throws {
        await self.server.shutdownGracefully()
        try await self.group.shutdownGracefully()
        try? FileManager.default.removeItem(atPath: self.directory)
    }
}

/// The near-cache under load: random grants (each of its own entitlement, some ending
/// within 400 ms by time alone), revocations and moves of an alias between customers,
/// and two restarts of the server, while tasks check through the near-cache.
///
/// Every answer is checked exactly against the writes: its entitlements must be those the
/// writes up to its `log_sequence` give at its `request_date` (so an answer past its
/// validUntil, or one mixing writes, fails), its customer the alias's owner at that
/// sequence; and it may be older than a write that concerns it only within the allowed
/// lag after that write was acknowledged (the watch's delivery: docs/PROTOCOL.md, "Keeping
/// answers"). A wrong answer fails the test.
@Suite("near-cache under load", .serialized)
struct NearCacheLoadTests {
    enum Change: Sendable {
        case grant(id: String, from: Int64, until: Int64?)
        /// A revocation from `at` on (its revokedDate: before it, the grant still counts).
        case revoke(id: String, at: Int64)
        case move(alias: String, from: String)
    }

    /// One acknowledged write: its customer, its sequence, when it was acknowledged.
    struct Write: Sendable {
        var user: String
        var change: Change
        var sequence: UInt64
        var acknowledged: Int64
        /// The user ids whose answers it changes.
        var names: Set<String> {
            if case .move(let alias, let from) = self.change { return [self.user, alias, from] }
            return [self.user]
        }
    }

    struct Observation: Sendable {
        var user: String
        var before: Int64
        var response: CheckEntitlementsResponse
    }

    /// When the checks stop: 300 ms after the writer's last write.
    final class WritingUntil: Sendable {
        private let until = Mutex<Int64?>(nil)
        /// Checks made so far, by all the checking tasks, and the server's restarts.
        let checks = Atomic<Int>(0)
        let restarts = Atomic<Int>(0)
        func end(at instant: Int64) { self.until.withLock { $0 = instant } }
        /// Whether the checks go on: while the writes do, then until `enough` says so or
        /// `grace` ms have passed (on a loaded machine, whose other tests hold the
        /// cooperative pool, checks come slowly; the answers after the last write are
        /// checked against it as the others are).
        func checksGoOn(at instant: Int64, enough: Bool, grace: Int64) -> Bool {
            guard let until = self.until.withLock({ $0 }) else {
                return true
            }
            return instant < until || (!enough && instant < until + grace)
        }
    }

    static let alias = "load-alias"

    /// Waits (at most 20 s) until `client`'s near-cache has started `started` watches and
    /// watches, checking a customer now and then: a watch starts on an answer from the server.
    static func waitForWatch(_ client: EntitlementsClient, started: UInt64) async throws {
        let deadline = WallClock.unixMilliseconds() + 20_000
        while WallClock.unixMilliseconds() < deadline {
            if let statistics = client.nearCacheStatistics, statistics.watchesStarted >= started, statistics.watching {
                return
            }
            _ = try? await client.checkEntitlements(CheckEntitlementsRequest(userId: "load-\(Int.random(in: 0..<96))"), timeout: .seconds(2))
            try await Task.sleep(for: .milliseconds(10))
        }
    }

    /// What is wrong with `observation`, or nil: its customer and active entitlements
    /// against the writes up to its log_sequence, and its age against the lag.
    static func problem(_ observation: Observation, _ writes: [Write], lag: Int64) -> String? {
        let response = observation.response
        let sequence = response.logSequence
        let upTo = writes.filter { $0.sequence <= sequence }
        // A customer's id names it; an alias names its last owner; an id never linked, no one.
        var owner: String? = Int(observation.user.dropFirst("load-".count)) != nil ? observation.user : nil
        for write in upTo {
            if case .move(let alias, _) = write.change, alias == observation.user { owner = write.user }
        }
        guard response.customerId == owner else {
            return "customer \(response.customerId ?? "none"), the owner of \(observation.user) at \(sequence) is \(owner ?? "none")"
        }
        guard let owner else {
            return response.entitlements.isEmpty ? nil : "an unknown user with entitlements at \(sequence)"
        }
        var grants: [String: (from: Int64, until: Int64?, revoked: Int64?)] = [:]
        for write in upTo where write.user == owner {
            switch write.change {
            case .grant(let id, let from, let until): grants[id] = (from, until, nil)
            case .revoke(let id, let at): grants[id]?.revoked = at
            case .move: break
            }
        }
        let instant = response.requestDate ?? 0
        // Entitlement rules 4: active from grantedDate, before expirationDate and before
        // revokedDate. A check that read its instant before a revocation was written, and
        // the record after, rightly shows the grant active at that instant.
        let expected = Set(grants.filter { grant in
            grant.value.from <= instant && grant.value.until.map { instant < $0 } ?? true && grant.value.revoked.map { instant < $0 } ?? true
        }.keys).union(["base"])
        let active = Set(response.entitlements.filter(\.isActive).compactMap(\.id))
        guard active == expected else {
            return "at \(instant) with writes up to \(sequence): active \(active.sorted()), expected \(expected.sorted())"
        }
        if let missed = Self.oldestMissed(observation, writes, owner: owner), missed.acknowledged < observation.before - lag {
            return "answer at \(sequence) asked at \(observation.before), \(observation.before - missed.acknowledged) ms after write \(missed.sequence) was acknowledged"
        }
        return nil
    }

    /// The first write after the answer's log_sequence that concerns it.
    static func oldestMissed(_ observation: Observation, _ writes: [Write], owner: String?) -> Write? {
        let names: Set<String> = [observation.user, owner ?? observation.user]
        return writes.first { $0.sequence > observation.response.logSequence && !$0.names.isDisjoint(with: names) }
    }

    @Test("every answer through the near-cache is exact at its log_sequence and no older than the watch's lag, across restarts", .timeLimit(.minutes(3)))
    func correctUnderLoad() async throws {
        let server = try await RestartableServer()
        let client = EntitlementsClient(configuration: .init(
            server: .tcp(host: "127.0.0.1", port: server.port),
            maximumBackoff: .milliseconds(20),
            nearCache: NearCacheConfiguration(budgetBytes: 1 << 20)
        ))
        let writer = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: server.port), maximumBackoff: .milliseconds(20)))
        // Enough customers that each is written about every half second: an event missed
        // leaves a kept answer wrong for longer than the lag allowed, so the test sees it.
        let users = (0..<96).map { "load-\($0)" }
        var setup: [Write] = []
        for user in users {
            let base = GrantEntitlementRequest(userId: user, grant: Grant(grantId: "base", entitlementId: "base", grantedDate: now))
            let written: WriteResponse = try await writer.call(.grantEntitlement, base)
            setup.append(Write(user: user, change: .grant(id: "base", from: now, until: nil), sequence: written.logSequence, acknowledged: WallClock.unixMilliseconds()))
        }
        let linked: WriteResponse = try await writer.call(.linkAlias, LinkAliasRequest(userId: "load-0", alias: Self.alias))
        setup.append(Write(user: "load-0", change: .move(alias: Self.alias, from: "load-0"), sequence: linked.logSequence, acknowledged: WallClock.unixMilliseconds()))
        // Ids unknown at first, each linked to a customer just after a restart, while the
        // near-cache's new watch is starting (it has just kept them as unknown).
        let fresh = ["load-fresh-50", "load-fresh-100"]
        let asked = users + [Self.alias] + fresh
        // The near-cache watches before the first write (on a loaded machine a check can come
        // late, and a watch started only after the first restart would leave one restart
        // untested).
        for user in users.prefix(8) {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: user), timeout: .seconds(5))
        }
        try await Self.waitForWatch(client, started: 1)
        // At least 3 s and 150 writes (a loaded machine writes slowly), at most 60 s, with a
        // restart of the server after the 50th and the 100th, each followed by the
        // near-cache's new watch; the checks go on until 300 ms after the last write.
        let start = WallClock.unixMilliseconds()
        let writing = WritingUntil()
        let initial = setup
        async let written: [Write] = {
            var writes = initial
            var generator = SystemRandomNumberGenerator()
            var live: [String: [String]] = [:]
            var owner = "load-0"
            var counter = 0
            // However the writer ends (a failed write included), the checks stop.
            defer { writing.end(at: WallClock.unixMilliseconds() + 300) }
            // Counted from the loop's own writes (the setup's are many): both restarts come.
            while WallClock.unixMilliseconds() < start + 60_000, counter < 150 || WallClock.unixMilliseconds() < start + 3_000 {
                if counter == 50 || counter == 100 {
                    try await server.restart()
                    writing.restarts.add(1, ordering: .relaxed)
                    // The writer's connection closed with the old server: make sure it has a
                    // new one before writing, so that no write's fate is in doubt.
                    while (try? await writer.health(timeout: .seconds(1))) == nil {
                        try await Task.sleep(for: .milliseconds(10))
                    }
                    let alias = "load-fresh-\(counter)"
                    _ = try? await client.checkEntitlements(CheckEntitlementsRequest(userId: alias), timeout: .seconds(2))
                    let user = users.randomElement(using: &generator)!
                    let response: WriteResponse = try await writer.call(.linkAlias, LinkAliasRequest(userId: user, alias: alias))
                    writes.append(Write(user: user, change: .move(alias: alias, from: user), sequence: response.logSequence, acknowledged: WallClock.unixMilliseconds()))
                    // The checks' misses start the new watch; the next writes go under it.
                    try await Self.waitForWatch(client, started: UInt64(counter / 50 + 1))
                }
                counter += 1
                let user = users.randomElement(using: &generator)!
                let sent = WallClock.unixMilliseconds()
                let roll = Int.random(in: 0..<10, using: &generator)
                if roll == 0, user != owner {
                    let response: WriteResponse = try await writer.call(.linkAlias, LinkAliasRequest(userId: user, alias: Self.alias, transfer: true))
                    writes.append(Write(user: user, change: .move(alias: Self.alias, from: owner), sequence: response.logSequence, acknowledged: WallClock.unixMilliseconds()))
                    owner = user
                } else if roll < 5, let grant = live[user]?.randomElement(using: &generator) {
                    let response: WriteResponse = try await writer.call(.revokeGrant, RevokeGrantRequest(userId: user, grantId: grant, revokedDate: sent))
                    live[user]?.removeAll { $0 == grant }
                    writes.append(Write(user: user, change: .revoke(id: grant, at: sent), sequence: response.logSequence, acknowledged: WallClock.unixMilliseconds()))
                } else {
                    let grant = "e\(counter)"
                    let until = Bool.random(using: &generator) ? sent + Int64.random(in: 30...400, using: &generator) : nil
                    let request = GrantEntitlementRequest(userId: user, grant: Grant(grantId: grant, entitlementId: grant, grantedDate: sent, expirationDate: until))
                    let response: WriteResponse = try await writer.call(.grantEntitlement, request)
                    live[user, default: []].append(grant)
                    writes.append(Write(user: user, change: .grant(id: grant, from: sent, until: until), sequence: response.logSequence, acknowledged: WallClock.unixMilliseconds()))
                }
                try await Task.sleep(for: .milliseconds(Int.random(in: 1...8, using: &generator)))
            }
            return writes
        }()
        let (observations, failures): ([Observation], Int) = try await withThrowingTaskGroup(of: ([Observation], Int).self) { group in
            for _ in 0..<4 {
                group.addTask {
                    var seen: [Observation] = []
                    var failures = 0
                    while writing.checksGoOn(
                        at: WallClock.unixMilliseconds(),
                        enough: writing.checks.load(ordering: .relaxed) >= 1_000,
                        grace: 20_000
                    ) {
                        let user = asked.randomElement()!
                        let before = WallClock.unixMilliseconds()
                        do {
                            let answer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: user), timeout: .seconds(2))
                            seen.append(Observation(user: user, before: before, response: answer))
                            writing.checks.add(1, ordering: .relaxed)
                        } catch let error as EntitlementsClientError where error.code == .unavailable {
                            failures += 1  // the server restarting
                        }
                        // A hit does not suspend: leave the writer its turn.
                        try await Task.sleep(for: .microseconds(100))
                    }
                    return (seen, failures)
                }
            }
            return try await group.reduce(into: ([Observation](), 0)) { $0.0 += $1.0; $0.1 += $1.1 }
        }
        let writes = try await written
        // The lag allowed: the watch's delivery, generous for a loaded 2-core machine.
        let lag: Int64 = 250
        // The lag seen: how long after a write's acknowledgment a check still got an answer
        // from before it.
        let lags = observations.compactMap { observation -> Int64? in
            guard let missed = Self.oldestMissed(observation, writes, owner: observation.response.customerId) else { return nil }
            return max(0, observation.before - missed.acknowledged)
        }
        let problems = observations.compactMap { observation in Self.problem(observation, writes, lag: lag).map { "\(observation.user): \($0)" } }
        let statistics = client.nearCacheStatistics ?? NearCacheStatistics()
        let restarts = writing.restarts.load(ordering: .relaxed)
        print("near-cache under load: \(writes.count) writes, \(restarts) restarts, \(observations.count) checks (\(failures) unavailable while restarting), \(statistics.hits) hits, \(statistics.invalidations) invalidations, \(statistics.watchesStarted) watches, \(lags.count) answers older than a write, the oldest \(lags.max() ?? 0) ms after it, \(problems.count) wrong (lag allowed \(lag) ms)")
        #expect(problems.isEmpty, "\(problems.count) wrong answers: \(problems.prefix(5))")
        #expect(restarts == 2 && statistics.hits > 0 && statistics.watchesStarted >= 3 && writes.count > 100 && observations.count >= 1_000)
        await client.close()
        await writer.close()
        try await server.stop()
    }
}

