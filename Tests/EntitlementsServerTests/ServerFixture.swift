import Dispatch
import EntitlementsClient
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import EntitlementsWire
import Foundation
import NIOCore
import NIOPosix

let now: Int64 = 1_795_305_600_000  // 2026-11-22T00:00:00Z

/// A served synthetic snapshot in a scratch directory, on port 0 and a Unix socket.
/// With `holdableResolvers`, the resolvers run on their own event loop, which
/// ``holdResolvers()`` blocks until ``releaseResolvers()``: requests then wait inside the
/// server, so cancels, deadlines and draining can be tested without timing races.
final class ServerFixture: Sendable {
    let directory: String
    let server: EntitlementsServer
    let snapshot: SnapshotReader
    let group: MultiThreadedEventLoopGroup
    let resolverGroup: MultiThreadedEventLoopGroup?
    private let gate = DispatchSemaphore(value: 0)

    var port: Int { self.server.tcpAddress!.port! }
    var socketPath: String { self.directory + "/server.sock" }

    /// With `writable`, the server runs on a data directory seeded from the snapshot, and
    /// takes writes.
    init(
        customers: Int = 300,
        holdableResolvers: Bool = false,
        writable: Bool = false,
        metrics: ServerMetrics = ServerMetrics(),
        loops: Int = 2,
        configuration: ServerConfiguration = ServerConfiguration(tcp: ("127.0.0.1", 0))
    ) async throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("server-tests-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        _ = try SnapshotTools.generate(count: customers, seed: 5, now: now, outputPath: self.directory + "/data.snap")
        self.snapshot = try SnapshotReader(path: self.directory + "/data.snap")
        self.group = MultiThreadedEventLoopGroup(numberOfThreads: loops)
        self.resolverGroup = holdableResolvers ? MultiThreadedEventLoopGroup(numberOfThreads: 1) : nil
        var configuration = configuration
        configuration.unixSocketPath = self.directory + "/server.sock"
        if holdableResolvers {
            configuration.resolvers = 1
        }
        let store = writable
            ? try CustomerStore.open(dataDirectory: self.directory + "/data", seed: self.directory + "/data.snap").0
            : CustomerStore.readOnly(self.snapshot)
        self.server = try await EntitlementsServer.start(
            store: store,
            configuration: configuration,
            group: self.group,
            resolverLoops: self.resolverGroup.map { [$0.next()] },
            warmAt: now,
            metrics: metrics
        )
    }

    func holdResolvers() {
        self.resolverGroup!.next().execute { self.gate.wait() }
    }

    func releaseResolvers() {
        self.gate.signal()
    }

    func client(connections: Int = 1) -> EntitlementsClient {
        EntitlementsClient(
            configuration: .init(server: .tcp(host: "127.0.0.1", port: self.port), connections: connections),
            eventLoopGroup: self.group
        )
    }

    func stop() async throws {
        await self.server.shutdownGracefully()
        // The resolvers' loop first: work still queued there (released by the test just
        // before) completes promises of the connections' loops, which must still run.
        try await self.resolverGroup?.shutdownGracefully()
        try await self.group.shutdownGracefully()
        try? FileManager.default.removeItem(atPath: self.directory)
    }
}

/// Runs blocking socket I/O on a Dispatch thread, not on Swift's cooperative pool: with two
/// cores the pool has two threads, and a test blocked in `recv` on each would starve the
/// tasks the server under test needs (ServiceGroup, the admin /metrics handler).
func offThePool<T: Sendable>(_ body: @escaping @Sendable () throws -> T) async throws -> T {
    try await withCheckedThrowingContinuation { continuation in
        DispatchQueue.global().async {
            continuation.resume(with: Result { try body() })
        }
    }
}

/// A raw connection speaking frames, for what the client library would never send.
///
/// `@unchecked Sendable`: a test uses a connection from one place at a time, handing it to
/// a Dispatch thread (``offThePool(_:)``) and waiting for it to come back.
final class RawConnection: @unchecked Sendable {
    let socket: Int32
    private var buffer = ByteBuffer()
    private var decoder = FrameDecoder()

    /// `receiveBufferBytes` shrinks the socket's receive buffer (before connecting, so the
    /// window stays small): a client that does not read then fills up fast.
    init(port: Int, receiveBufferBytes: Int32? = nil) throws {
        self.socket = Glibc.socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        if var size = receiveBufferBytes {
            setsockopt(self.socket, SOL_SOCKET, SO_RCVBUF, &size, socklen_t(MemoryLayout<Int32>.size))
        }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(port).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(self.socket, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard result == 0 else {
            throw EntitlementsClientError(code: .unavailable, message: "connect failed: \(errno)")
        }
        var timeout = timeval(tv_sec: 10, tv_usec: 0)
        setsockopt(self.socket, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    }

    /// Connects to the server's Unix socket.
    init(unixPath: String) throws {
        self.socket = Glibc.socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let path = Array(unixPath.utf8)
        precondition(path.count < MemoryLayout.size(ofValue: address.sun_path))
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: path) }
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(self.socket, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        guard result == 0 else {
            close(self.socket)
            throw EntitlementsClientError(code: .unavailable, message: "connect failed: \(errno)")
        }
        var timeout = timeval(tv_sec: 10, tv_usec: 0)
        setsockopt(self.socket, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    }

    deinit {
        close(self.socket)
    }

    func send(_ frames: [Frame]) {
        var out = ByteBuffer()
        for frame in frames {
            out.writeFrame(frame)
        }
        self.send(bytes: Array(out.readableBytesView))
    }

    func send(bytes: [UInt8]) {
        bytes.withUnsafeBytes { raw in
            var offset = 0
            while offset < raw.count {
                let written = Glibc.send(self.socket, raw.baseAddress! + offset, raw.count - offset, Int32(MSG_NOSIGNAL))
                if written <= 0 { return }
                offset += written
            }
        }
    }

    /// Ends the connection both ways (FIN): the server sees it closed.
    func shutdown() {
        _ = Glibc.shutdown(self.socket, Int32(SHUT_RDWR))
    }

    /// Sends a FIN and keeps reading: `shutdown(SHUT_WR)`.
    func finishSending() {
        _ = Glibc.shutdown(self.socket, Int32(SHUT_WR))
    }

    /// Sends what the socket takes now; returns how many bytes that was.
    func sendWithoutBlocking(_ bytes: [UInt8]) -> Int {
        bytes.withUnsafeBytes { raw in
            var offset = 0
            while offset < raw.count {
                let written = Glibc.send(self.socket, raw.baseAddress! + offset, raw.count - offset, Int32(MSG_NOSIGNAL | MSG_DONTWAIT))
                if written <= 0 { break }
                offset += written
            }
            return offset
        }
    }

    /// The next frame, or nil at end of stream (or after a 10 s silence).
    func receive() throws -> Frame? {
        while true {
            if let frame = try self.decoder.decode(buffer: &self.buffer) {
                return frame
            }
            var chunk = [UInt8](repeating: 0, count: 65_536)
            let count = recv(self.socket, &chunk, chunk.count, 0)
            if count <= 0 {
                return nil
            }
            self.buffer.writeBytes(chunk[0..<count])
        }
    }

    static func request(_ id: UInt64, _ message: some ProtobufMessage, method: MethodID = .checkEntitlements, timeoutMicroseconds: UInt32 = 0) -> Frame {
        .request(id: id, method: method, timeoutMicroseconds: timeoutMicroseconds, payload: ByteBuffer(bytes: try! message.serializedBytes()))
    }
}
