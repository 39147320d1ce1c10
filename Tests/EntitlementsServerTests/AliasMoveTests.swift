import Dispatch
import EntitlementsCache
import EntitlementsClient
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import EntitlementsWire
import Foundation
import NIOCore
import NIOPosix
import Testing

/// A check by an alias that moves while the check is under way. The alias hashes to one
/// resolver (A), its customer to the other (B): A remembers whose alias it is and forwards
/// the check to B. Each resolver runs on its own event loop, which the test can hold, so
/// that the check, the move and its invalidation meet in a chosen order, without clocks.
///
/// Whatever the order, the answer must be one moment's: its customer is the alias's owner
/// at the answer's `log_sequence` (docs/PROTOCOL.md, CheckEntitlementsResponse). Found by
/// the near-cache load test, once in some 60,000 checks.
@Suite("checks by an alias that moves", .serialized)
struct AliasMoveTests {
    final class Fixture: Sendable {
        let directory: String
        let server: EntitlementsServer
        let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        let resolverGroup = MultiThreadedEventLoopGroup(numberOfThreads: 2)
        let loops: [any EventLoop]
        private let gates = [DispatchSemaphore(value: 0), DispatchSemaphore(value: 0)]
        /// The alias, its first owner (on B) and its second.
        let alias: String
        let first = "user-1"
        let second = "user-2"
        /// The resolvers' shards: A, the alias's; B, the first owner's.
        let a: Int
        let b: Int

        init() async throws {
            self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("alias-move-\(UUID().uuidString)").path
            try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
            _ = try SnapshotTools.generate(count: 20, seed: 5, now: now, outputPath: self.directory + "/data.snap")
            let store = try CustomerStore.open(dataDirectory: self.directory + "/data", seed: self.directory + "/data.snap").0
            var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0), resolvers: 2)
            configuration.coldReads = .inline
            self.loops = Array(self.resolverGroup.makeIterator())
            self.server = try await EntitlementsServer.start(store: store, configuration: configuration, group: self.group, resolverLoops: self.loops, warmAt: now)
            self.b = AnswerCache.shardIndex(for: "user-1", shardCount: 2)
            self.a = 1 - self.b
            self.alias = (0...).lazy.map { "moving-alias-\($0)" }.first { AnswerCache.shardIndex(for: $0, shardCount: 2) == 1 - AnswerCache.shardIndex(for: "user-1", shardCount: 2) }!
        }

        var port: Int { self.server.tcpAddress!.port! }

        /// Blocks resolver `shard`'s loop until ``release(_:)``.
        func hold(_ shard: Int) {
            let gate = self.gates[shard]
            self.loops[shard].execute { gate.wait() }
        }

        func release(_ shard: Int) {
            self.gates[shard].signal()
        }

        /// Returns once everything queued on resolver `shard`'s loop before now has run.
        func drain(_ shard: Int) async throws {
            try await self.loops[shard].submit {}.get()
        }

        /// Waits until the store has made the write at `sequence` visible (its
        /// acknowledgement may be held up by a held resolver).
        func waitForCommit(after sequence: UInt64) async throws {
            while self.server.store.committedSequence <= sequence {
                try await Task.sleep(for: .milliseconds(1))
            }
        }

        func stop() async throws {
            await self.server.shutdownGracefully()
            try await self.resolverGroup.shutdownGracefully()
            try await self.group.shutdownGracefully()
            try? FileManager.default.removeItem(atPath: self.directory)
        }
    }

    /// The answer's customer against the alias's owner at its sequence: the first owner
    /// before the move, the second from it on.
    static func expectOneMoment(_ response: CheckEntitlementsResponse, _ fixture: Fixture, moved: UInt64) {
        let owner = response.logSequence >= moved ? fixture.second : fixture.first
        #expect(response.customerId == owner, "answer of \(response.customerId ?? "none") at sequence \(response.logSequence); the alias moved to \(fixture.second) at \(moved)")
    }

    /// Links the alias to its first owner, then checks it once: A learns whose it is.
    static func link(_ fixture: Fixture, _ client: EntitlementsClient) async throws {
        let _: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: fixture.first, alias: fixture.alias))
        let answer = try await client.checkEntitlements(CheckEntitlementsRequest(userId: fixture.alias, at: now))
        #expect(answer.customerId == fixture.first)
    }

    /// Sends a check by the alias on a new connection, and returns once the server has
    /// read it (queued it on A).
    static func sendCheck(_ fixture: Fixture) async throws -> RawConnection {
        let connection = try RawConnection(port: fixture.port)
        connection.send([RawConnection.request(1, CheckEntitlementsRequest(userId: fixture.alias, at: now)), Frame(type: .ping, requestID: 2)])
        #expect(try await offThePool { try connection.receive() }?.type == .pong)
        return connection
    }

    @Test("the forwarded check is held on B while the alias moves: B does not answer with the old owner's record read after the move")
    func forwardHeldOnOwner() async throws {
        let fixture = try await Fixture()
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: fixture.port)), eventLoopGroup: fixture.group)
        try await Self.link(fixture, client)
        // A write to the first owner that leaves the alias alone: B forgets its answer,
        // A still knows the alias.
        let grant = GrantEntitlementRequest(userId: fixture.first, grant: Grant(grantId: "g", entitlementId: "premium", grantedDate: now))
        let granted: WriteResponse = try await client.call(.grantEntitlement, grant)

        fixture.hold(fixture.b)
        let connection = try await Self.sendCheck(fixture)
        try await fixture.drain(fixture.a)  // A forwarded the check: it waits on B
        // The move: visible in the store; B has not been told (its loop is held), so the
        // write is not acknowledged yet.
        async let moved: WriteResponse = client.call(.linkAlias, LinkAliasRequest(userId: fixture.second, alias: fixture.alias, transfer: true))
        try await fixture.waitForCommit(after: granted.logSequence)
        fixture.release(fixture.b)

        let frame = try #require(try await offThePool { try connection.receive() })
        #expect(frame.requestID == 1 && frame.status == .ok)
        Self.expectOneMoment(try CheckEntitlementsResponse(buffer: frame.payload), fixture, moved: try await moved.logSequence)
        connection.shutdown()
        await client.close()
        try await fixture.stop()
    }

    @Test("A still remembers the old owner when B has cached that owner's answer read after the move: B does not serve it")
    func staleMemoryOnAsker() async throws {
        let fixture = try await Fixture()
        let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: fixture.port)), eventLoopGroup: fixture.group)
        try await Self.link(fixture, client)
        let before = fixture.server.store.committedSequence

        fixture.hold(fixture.a)
        let connection = try await Self.sendCheck(fixture)  // queued on A
        // The move: B is told at once, A only after the check it holds.
        async let moved: WriteResponse = client.call(.linkAlias, LinkAliasRequest(userId: fixture.second, alias: fixture.alias, transfer: true))
        try await fixture.waitForCommit(after: before)
        try await fixture.drain(fixture.b)
        // B caches the first owner's answer, read after the move.
        let direct = try await client.checkEntitlements(CheckEntitlementsRequest(userId: fixture.first, at: now))
        #expect(direct.customerId == fixture.first && direct.logSequence > before)
        fixture.release(fixture.a)

        let frame = try #require(try await offThePool { try connection.receive() })
        #expect(frame.requestID == 1 && frame.status == .ok)
        Self.expectOneMoment(try CheckEntitlementsResponse(buffer: frame.payload), fixture, moved: try await moved.logSequence)
        connection.shutdown()
        await client.close()
        try await fixture.stop()
    }
}
