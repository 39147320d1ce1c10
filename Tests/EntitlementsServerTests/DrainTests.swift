import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsWire
import Foundation
import NIOCore
import Testing

/// The drain's promise (docs/PROTOCOL.md, "Going away"), under load and whatever the
/// client's reading speed: every connection gets its GOAWAY, every request id up to it is
/// answered exactly once, and no request above it is applied.
@Suite("drain under load")
struct DrainTests {
    /// What one connection received, checked against what it sent.
    struct Received {
        var goAway: UInt64?
        var answers: [UInt64: Frame] = [:]
        var duplicates: [UInt64] = []
        var afterEnd = false
    }

    static func readAll(_ connection: RawConnection) throws -> Received {
        var received = Received()
        while let frame = try connection.receive() {
            switch frame.type {
            case .goAway:
                received.goAway = frame.requestID
            case .response:
                if received.answers.updateValue(frame, forKey: frame.requestID) != nil {
                    received.duplicates.append(frame.requestID)
                }
            default:
                break
            }
        }
        connection.shutdown()  // as a client does at the server's FIN: the server need not linger
        return received
    }

    static func grant(_ id: UInt64, user: String) -> Frame {
        RawConnection.request(
            id,
            GrantEntitlementRequest(userId: user, grant: Grant(grantId: "g-\(id)", entitlementId: "beta", grantedDate: now)),
            method: .grantEntitlement
        )
    }

    /// The grant ids `user` holds in the store.
    static func grantIds(_ fixture: ServerFixture, user: String) throws -> Set<String> {
        Set(try fixture.server.store.customer(for: user)?.grants.compactMap(\.grantId) ?? [])
    }

    /// Checks the promise for one connection whose requests were `ids` (grants among them
    /// as `grantIds`, all for `user`).
    static func verify(_ received: Received, sent ids: [UInt64], grants: Set<UInt64>, applied: Set<String>) {
        let goAway = received.goAway ?? 0
        #expect(received.goAway != nil, "no GOAWAY")
        #expect(received.duplicates.isEmpty, "answered twice: \(received.duplicates)")
        let expected = Set(ids.filter { $0 <= goAway })
        let missing = expected.subtracting(received.answers.keys)
        #expect(missing.isEmpty, "accepted (id <= GOAWAY \(goAway)) and never answered: \(missing.sorted().prefix(20))")
        let unexpected = Set(received.answers.keys).subtracting(expected)
        #expect(unexpected.isEmpty, "answered above the GOAWAY id \(goAway): \(unexpected.sorted().prefix(20))")
        for id in grants {
            let isApplied = applied.contains("g-\(id)")
            if id <= goAway {
                #expect(received.answers[id]?.status == .ok, "grant \(id) was not acknowledged")
                #expect(isApplied, "grant \(id) was acknowledged but is not stored")
            } else {
                #expect(!isApplied, "grant \(id), above the GOAWAY id \(goAway), was applied")
            }
        }
    }

    @Test("a client that reads nothing during the drain still gets its GOAWAY and every accepted answer, writes included")
    func clientThatDoesNotRead() async throws {
        let fixture = try await ServerFixture(writable: true)
        // A small receive window: the answers (about 2 MB) cannot all leave the server
        // before the client reads, so they are still queued when the drain ends.
        let connection = try RawConnection(port: fixture.port, receiveBufferBytes: 4_096)
        let users = (0..<1_000).map { "user-\($0 % 300)" }
        var frames = (1...8).map { id in
            RawConnection.request(UInt64(id), BatchCheckEntitlementsRequest(userIds: users, at: now), method: .batchCheckEntitlements)
        }
        frames += (9...58).map { Self.grant(UInt64($0), user: "user-7") }
        connection.send(frames)
        // Every grant is stored before the drain starts, so all 58 calls are accepted.
        while fixture.server.store.committedSequence < 50 {
            try await Task.sleep(for: .milliseconds(5))
        }
        // The drain starts while the client reads nothing; it reads only a second later. (The
        // drain cannot end before: its last answers wait in the server for the client.)
        async let stopped: Void = fixture.server.shutdownGracefully()
        try await Task.sleep(for: .seconds(1))
        let received = try await offThePool { try Self.readAll(connection) }
        await stopped
        #expect(received.goAway == 58)
        Self.verify(received, sent: Array(1...58), grants: Set(9...58), applied: try Self.grantIds(fixture, user: "user-7"))
        for id in UInt64(1)...8 {
            #expect(received.answers[id]?.status == .ok)
        }
        try await fixture.stop()
    }

    @Test("many trials of SIGTERM-like drains under pipelined load: GOAWAY, each accepted id answered once, none above it applied")
    func randomizedDrains() async throws {
        var generator = SystemRandomNumberGenerator()
        for trial in 0..<12 {
            let fixture = try await ServerFixture(writable: true)
            let connections = try (0..<3).map { _ in try RawConnection(port: fixture.port, receiveBufferBytes: Int32.random(in: 4_096...262_144, using: &generator)) }
            // Each connection is the server's (accepted, not still in the listen backlog
            // when the listener closes) before the load and the drain begin.
            for connection in connections {
                connection.send([Frame(type: .ping, requestID: 1)])
                #expect(try await offThePool { try connection.receive() }?.type == .pong)
            }
            var sent: [[UInt64]] = []
            var grants: [Set<UInt64>] = []
            for (index, connection) in connections.enumerated() {
                var frames: [Frame] = []
                var ids: [UInt64] = []
                var grantIds: Set<UInt64> = []
                for id in UInt64(1)...300 {
                    ids.append(id)
                    switch Int.random(in: 0..<10, using: &generator) {
                    case 0..<3:
                        frames.append(Self.grant(id, user: "user-\(index)"))
                        grantIds.insert(id)
                    case 3..<5:
                        let users = (0..<100).map { "user-\(($0 * 7 + Int(id)) % 300)" }
                        frames.append(RawConnection.request(id, BatchCheckEntitlementsRequest(userIds: users, at: now), method: .batchCheckEntitlements))
                    default:
                        frames.append(RawConnection.request(id, CheckEntitlementsRequest(userId: "user-\(id % 300)", at: now)))
                    }
                }
                sent.append(ids)
                grants.append(grantIds)
                let bytes = { var buffer = ByteBuffer(); frames.forEach { buffer.writeFrame($0) }; return Array(buffer.readableBytesView) }()
                // From another thread: the server may stop reading before it has every byte.
                Thread { connection.send(bytes: bytes) }.start()
            }
            try await Task.sleep(for: .microseconds(Int.random(in: 0...3_000, using: &generator)))
            let stopped = Task { await fixture.server.shutdownGracefully() }
            // Some clients read all along; one starts reading only up to 300 ms into the drain.
            let lateStart = Int.random(in: 0...300, using: &generator)
            let readers = connections.enumerated().map { index, connection in
                let late = index == trial % 3
                return Task {
                    if late {
                        try await Task.sleep(for: .milliseconds(lateStart))
                    }
                    return try await offThePool { try Self.readAll(connection) }
                }
            }
            await stopped.value
            for index in connections.indices {
                let received = try await readers[index].value
                let applied = try Self.grantIds(fixture, user: "user-\(index)")
                Self.verify(received, sent: sent[index], grants: grants[index], applied: applied)
            }
            try await fixture.stop()
        }
    }
}
