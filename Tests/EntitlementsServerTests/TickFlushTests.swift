import EntitlementsMessages
import EntitlementsWire
import Foundation
import NIOCore
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The framed connections of one event loop flush their answers together at the end of
/// the loop tick (`TickFlush`). What a client gets is as when each read was flushed at its
/// end: every answer comes, those answered before its FIN included, and a connection that
/// goes away with its answers waiting to be flushed takes none of the others' with it.
@Suite("answers flushed at the end of the loop tick")
struct TickFlushTests {
    static let connections = 24
    static let rounds = 3
    static let checksPerRound = 4

    @Test("many connections on one loop, read in the same ticks, several reads each: every answer arrives; connections closed with answers waiting stop none of the others")
    func everyConnectionIsFlushed() async throws {
        let fixture = try await ServerFixture(loops: 1)  // every connection on one loop: one tick's list
        let connections = try (0..<Self.connections).map { _ in try RawConnection(port: fixture.port) }
        for round in 0..<Self.rounds {
            // Each connection's checks in one write, all connections back to back, so that
            // the server reads several of them in one tick; a few connections send theirs
            // and go away at once, their channels closing in the ticks whose lists hold the
            // others' answers (held here to the round's end: closing the socket too would
            // make it a reset).
            var quitters: [RawConnection] = []
            for (index, connection) in connections.enumerated() {
                connection.send(Self.checks(round: round, user: index))
                if index % 6 == 0 {
                    let quitter = try RawConnection(port: fixture.port)
                    quitter.send(Self.checks(round: round, user: index))
                    quitter.shutdown()
                    quitters.append(quitter)
                }
            }
            for (index, connection) in connections.enumerated() {
                let answers = try await offThePool { try (0..<Self.checksPerRound).map { _ in try connection.receive() } }
                let expected = (0..<Self.checksPerRound).map { UInt64(round * Self.checksPerRound + $0 + 1) }
                #expect(answers.map { $0?.requestID } == expected, "connection \(index), round \(round)")
                for answer in answers {
                    #expect(answer?.type == .response && answer?.status == .ok)
                    let response = try CheckEntitlementsResponse(buffer: try #require(answer).payload)
                    #expect(response.userId == "user-\(index)")
                }
            }
        }
        // Still open and answering in order.
        for connection in connections {
            connection.send([Frame(type: .ping, requestID: 1)])
            let pong = try await offThePool { try connection.receive() }
            #expect(pong?.type == .pong)
        }
        try await fixture.stop()
    }

    @Test("checks followed at once by the client's FIN: those answered as they were read still go out, before the server's FIN")
    func answeredBeforeFin() async throws {
        // Every user's answer is cached at start (the fixture warms them all), so the checks
        // below are answered as they are read: a call not yet answered at a FIN is dropped
        // (PROTOCOL.md section 6).
        let fixture = try await ServerFixture(loops: 1)
        for user in 0..<20 {
            // The checks and the FIN back to back: the server usually reads both in one
            // event, and NIO closes the channel right after that read's end.
            let connection = try RawConnection(port: fixture.port)
            connection.send(Self.checks(round: 0, user: user))
            connection.finishSending()
            #expect(try await Self.answeredIds(connection) == Array(1...UInt64(Self.checksPerRound)), "user-\(user)")
        }
        try await fixture.stop()
    }

    @Test("checks that exactly fill NIO's first read buffer (2,048 bytes), then the FIN: NIO reads again at once, finds the FIN and closes after one read complete; the answers still go out")
    func answeredBeforeFinAfterAFullRead() async throws {
        let fixture = try await ServerFixture(loops: 1)  // every user's answer cached at start
        for user in 0..<20 {
            var frames = Self.checks(round: 0, user: user)
            // The last check padded with an unknown field (number 100; protobuf skips it)
            // so that the frames come to NIO's initial read size exactly.
            let others = frames.dropLast().reduce(0) { $0 + Frame.headerSize + $1.payload.readableBytes }
            var payload = frames[frames.count - 1].payload
            let room = 2_048 - others - Frame.headerSize - payload.readableBytes - 2  // the field's tag: 2 bytes
            let padding = room - (room - 1 < 128 ? 1 : 2)  // its length: a varint of 1 or 2 bytes
            payload.writeBytes([0xA2, 0x06])
            payload.writeBytes(padding < 128 ? [UInt8(padding)] : [UInt8(padding & 0x7F | 0x80), UInt8(padding >> 7)])
            payload.writeRepeatingByte(0x2A, count: padding)
            frames[frames.count - 1].payload = payload
            let connection = try RawConnection(port: fixture.port)
            var bytes = ByteBuffer()
            frames.forEach { bytes.writeFrame($0) }
            #expect(bytes.readableBytes == 2_048)
            connection.send(bytes: Array(bytes.readableBytesView))
            connection.finishSending()
            #expect(try await Self.answeredIds(connection) == Array(1...UInt64(Self.checksPerRound)), "user-\(user)")
        }
        try await fixture.stop()
    }

    /// The request ids of the frames `connection` receives until the server's FIN.
    static func answeredIds(_ connection: RawConnection) async throws -> [UInt64] {
        try await offThePool {
            var ids: [UInt64] = []
            while let frame = try connection.receive() {
                ids.append(frame.requestID)
            }
            return ids
        }
    }

    static func checks(round: Int, user: Int) -> [Frame] {
        (0..<Self.checksPerRound).map { offset in
            RawConnection.request(UInt64(round * Self.checksPerRound + offset + 1), CheckEntitlementsRequest(userId: "user-\(user)", at: now))
        }
    }
}
