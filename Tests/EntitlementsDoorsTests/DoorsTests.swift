import EntitlementsDoors
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import Foundation
import NIOCore
import NIOPosix
import Testing

@testable import EntitlementsDoors

private let now: Int64 = 1_795_305_600_000  // 2026-11-22T00:00:00Z

/// A server with the door on port 0, over a synthetic snapshot (read-only).
private final class DoorFixture: Sendable {
    let directory: String
    let server: EntitlementsServer
    let group: MultiThreadedEventLoopGroup

    var port: Int { self.server.doorAddresses["grpc"]!.port! }

    init(configuration: ServerConfiguration = ServerConfiguration(tcp: ("127.0.0.1", 0))) async throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("doors-tests-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        _ = try SnapshotTools.generate(count: 50, seed: 5, now: now, outputPath: self.directory + "/data.snap")
        self.group = MultiThreadedEventLoopGroup(numberOfThreads: 2)
        self.server = try await EntitlementsServer.start(
            store: .readOnly(try SnapshotReader(path: self.directory + "/data.snap")),
            configuration: configuration,
            group: self.group,
            warmAt: now,
            doors: [Doors.grpcAndJSON(host: "127.0.0.1", port: 0)]
        )
    }

    func stop() async throws {
        await self.server.shutdownGracefully()
        try await self.group.shutdownGracefully()
        try? FileManager.default.removeItem(atPath: self.directory)
    }
}

/// A blocking loopback TCP connection, for bytes no client library would send.
private final class RawConnection: @unchecked Sendable {
    // @unchecked: one test uses a connection, one thread at a time.
    private(set) var fd: Int32

    init(port: Int, receiveTimeout seconds: Int = 10) throws {
        self.fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(self.fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard connected == 0 else {
            Glibc.close(self.fd)
            throw POSIXError(.ECONNREFUSED)
        }
        var timeout = timeval(tv_sec: seconds, tv_usec: 0)
        setsockopt(self.fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    }

    deinit {
        self.close()
    }

    /// Closes this side, as a client does once it has its answers (a server lingers for
    /// that after its FIN).
    func close() {
        if self.fd >= 0 {
            Glibc.close(self.fd)
            self.fd = -1
        }
    }

    func send(_ bytes: [UInt8]) {
        _ = bytes.withUnsafeBytes { Glibc.send(self.fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL)) }
    }

    func send(_ text: String) {
        self.send(Array(text.utf8))
    }

    /// Reads until the peer closes (or the receive timeout): everything received, and
    /// whether it closed.
    func readToEnd() -> (bytes: [UInt8], closed: Bool) {
        var out: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65536)
        while true {
            let count = recv(self.fd, &buffer, buffer.count, 0)
            if count == 0 {
                return (out, true)
            }
            if count < 0 {
                return (out, false)
            }
            out += buffer[0..<count]
        }
    }

    /// Reads until `done` holds for what arrived, or the peer closes.
    func read(until done: ([UInt8]) -> Bool) -> [UInt8] {
        var out: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 65536)
        while !done(out) {
            let count = recv(self.fd, &buffer, buffer.count, 0)
            if count <= 0 {
                break
            }
            out += buffer[0..<count]
        }
        return out
    }
}

/// HTTP/2 frames in `bytes` (after none of the preface: the server sends none): type and
/// stream id of each complete frame.
private func frames(_ bytes: [UInt8]) -> [(type: UInt8, stream: UInt32, flags: UInt8)] {
    var frames: [(UInt8, UInt32, UInt8)] = []
    var index = 0
    while bytes.count - index >= 9 {
        let length = Int(bytes[index]) << 16 | Int(bytes[index + 1]) << 8 | Int(bytes[index + 2])
        guard bytes.count - index >= 9 + length else {
            break
        }
        let stream = UInt32(bytes[index + 5] & 0x7F) << 24 | UInt32(bytes[index + 6]) << 16 | UInt32(bytes[index + 7]) << 8 | UInt32(bytes[index + 8])
        frames.append((bytes[index + 3], stream, bytes[index + 4]))
        index += 9 + length
    }
    return frames
}

private let preface = Array("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".utf8)

/// A gRPC request on stream 1: HEADERS (HPACK literals, no Huffman) and one DATA frame
/// with the length-prefixed message, END_STREAM.
private func grpcRequest(_ path: String, _ message: [UInt8]) -> [UInt8] {
    var block: [UInt8] = []
    for (name, value) in [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "t"), ("content-type", "application/grpc"), ("te", "trailers")] {
        block += [0x00, UInt8(name.utf8.count)] + Array(name.utf8) + [UInt8(value.utf8.count)] + Array(value.utf8)
    }
    func frame(_ type: UInt8, _ flags: UInt8, _ payload: [UInt8]) -> [UInt8] {
        [UInt8(payload.count >> 16), UInt8(payload.count >> 8 & 0xFF), UInt8(payload.count & 0xFF), type, flags, 0, 0, 0, 1] + payload
    }
    let body: [UInt8] = [0, UInt8(message.count >> 24), UInt8(message.count >> 16 & 0xFF), UInt8(message.count >> 8 & 0xFF), UInt8(message.count & 0xFF)] + message
    return frame(1, 0x4, block) + frame(0, 0x1, body)
}
private let emptySettings: [UInt8] = [0, 0, 0, 4, 0, 0, 0, 0, 0]
private let goAwayType: UInt8 = 7

private func jsonPost(_ method: String, _ body: String, keepAlive: Bool = false) -> String {
    "POST /entitlements.v1.EntitlementService/\(method) HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\n\(keepAlive ? "" : "Connection: close\r\n")\r\n\(body)"
}

/// Runs blocking socket reads on a thread of their own, never on the cooperative pool (which
/// the server's drain needs).
private func blocking<T: Sendable>(_ body: @escaping @Sendable () -> T) async -> T {
    await withCheckedContinuation { continuation in
        Thread { continuation.resume(returning: body()) }.start()
    }
}

@Suite("the gRPC and HTTP/JSON door's transport", .serialized)
struct DoorsTests {
    @Test("HTTP/1.1 JSON on the door port: a check answered in check --json's JSON, a broken request line answered 400 without touching another connection")
    func http1() async throws {
        let fixture = try await DoorFixture()
        let garbage = try RawConnection(port: fixture.port)
        garbage.send("\u{01}\u{02} nonsense \r\n\r\n")
        let refused = String(decoding: await blocking { garbage.readToEnd().bytes }, as: UTF8.self)
        #expect(refused.hasPrefix("HTTP/1.1 400"), "\(refused)")

        let connection = try RawConnection(port: fixture.port)
        connection.send(jsonPost("CheckEntitlements", #"{"userId":"user-1"}"#))
        let answer = String(decoding: await blocking { connection.readToEnd().bytes }, as: UTF8.self)
        #expect(answer.hasPrefix("HTTP/1.1 200 OK"), "\(answer)")
        #expect(answer.contains(#""entitlements":{"#))
        try await fixture.stop()
    }

    @Test("a drain sends GOAWAY on an HTTP/2 connection and closes it; a keep-alive HTTP/1.1 connection is closed")
    func drain() async throws {
        let fixture = try await DoorFixture()
        let http2 = try RawConnection(port: fixture.port)
        http2.send(preface + emptySettings)
        // The server's SETTINGS comes first: the connection is HTTP/2 now.
        let settings = http2.read { frames($0).contains { $0.type == 4 } }
        #expect(frames(settings).first?.type == 4)
        let http1 = try RawConnection(port: fixture.port)
        http1.send(jsonPost("Health", "{}", keepAlive: true))
        let health = String(decoding: http1.read { String(decoding: $0, as: UTF8.self).contains(#""version""#) }, as: UTF8.self)
        #expect(health.contains("200 OK") && health.contains(#""status":"serving""#), "\(health)")

        let shutdown = Task { await fixture.server.shutdownGracefully() }
        let (bytes, closed) = await blocking { http2.readToEnd() }
        #expect(frames(settings + bytes).contains { $0.type == goAwayType && $0.stream == 0 }, "no GOAWAY in \(frames(settings + bytes))")
        #expect(closed)
        http2.close()
        #expect(await blocking { http1.readToEnd().closed })
        await shutdown.value
        try await fixture.group.shutdownGracefully()
    }

    @Test("a drain answers the call in progress before it closes the connection: GOAWAY, then the call's trailers, then the FIN")
    func drainAnswersTheLastCall() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.minimumSequenceWait = .milliseconds(300)
        let fixture = try await DoorFixture(configuration: configuration)
        let connection = try RawConnection(port: fixture.port)
        // A read that waits for a log sequence never reached: in progress when the drain starts.
        let waiting = try CheckEntitlementsRequest(userId: "user-1", minLogSequence: 1 << 40).serializedBytes()
        connection.send(preface + emptySettings + grpcRequest("/entitlements.v1.EntitlementService/CheckEntitlements", waiting))
        _ = connection.read { frames($0).contains { $0.type == 4 } }
        let shutdown = Task { await fixture.server.shutdownGracefully() }
        let (bytes, closed) = await blocking { connection.readToEnd() }
        let received = frames(bytes)
        let goAway = received.firstIndex { $0.type == goAwayType }
        let trailers = received.firstIndex { $0.type == 1 && $0.stream == 1 && $0.flags & 0x1 != 0 }
        #expect(goAway != nil && trailers != nil && goAway! < trailers!, "frames: \(received)")
        #expect(closed)
        connection.close()
        await shutdown.value
        try await fixture.group.shutdownGracefully()
    }

    @Test("a connection that sends nothing is closed after --frame-timeout")
    func silentConnection() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.frameTimeout = .milliseconds(200)
        let fixture = try await DoorFixture(configuration: configuration)
        let silent = try RawConnection(port: fixture.port)
        #expect(await blocking { silent.readToEnd().closed })
        try await fixture.stop()
    }

    @Test("connections past --max-connections are closed at once; the one admitted is served")
    func connectionLimit() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.maximumConnections = 1
        let fixture = try await DoorFixture(configuration: configuration)
        let admitted = try RawConnection(port: fixture.port)
        admitted.send(preface + emptySettings)
        _ = admitted.read { frames($0).contains { $0.type == 4 } }
        let refused = try RawConnection(port: fixture.port)
        let (bytes, closed) = await blocking { refused.readToEnd() }
        #expect(bytes.isEmpty && closed)
        admitted.close()
        try await fixture.stop()
    }

    @Test("grpc-message is percent-encoded as gRPC requires")
    func percentEncoding() {
        #expect(DoorStreamHandler.percentEncoded("user_id: must not be empty") == "user_id: must not be empty")
        #expect(DoorStreamHandler.percentEncoded("50% café\n") == "50%25 caf%C3%A9%0A")
    }
}
