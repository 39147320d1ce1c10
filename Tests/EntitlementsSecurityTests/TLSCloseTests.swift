import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsWire
import NIOConcurrencyHelpers
import NIOCore
import NIOPosix
import NIOSSL
import Testing

/// A TLS client that sends its checks and closes its side at once (close_notify, then its
/// FIN) still gets every answer made before: NIOSSLHandler closes the channel within the
/// read that carries the close_notify (the server allows no half-closure), once it has
/// passed on that read's data, so a TLS connection's answers are flushed as they are made,
/// not at the end of the loop tick (docs/server.md, step 5).
@Suite(.serialized) struct TLSCloseTests {
    @Test("checks then close_notify in one burst: every check is answered before the server closes", .timeLimit(.minutes(1)))
    func answeredBeforeCloseNotify() async throws {
        let certificates = try Certificates.get()
        let server = try await SecureServer(tcp: ListenerSecurity(policy: .open("tcp"), tls: try certificates.serverTLS()))
        do {
            try await Self.sendAndClose(server, try NIOSSLContext(configuration: try certificates.clientTLS()))
        } catch {
            try await server.stop()
            throw error
        }
        try await server.stop()
    }

    /// 50 connections, one after another: each sends 4 checks and its close_notify
    /// together, and must get the 4 answers before the server's close.
    static func sendAndClose(_ server: SecureServer, _ context: NIOSSLContext) async throws {
        for user in 0..<50 {
            // Every customer's answer is cached at start (warmAt), so each check is answered
            // as it is read: one not yet answered at the close would be dropped (PROTOCOL.md 6).
            var bytes = ByteBuffer()
            for id in 1...4 {
                let request = CheckEntitlementsRequest(userId: "customer-\(user)", at: now)
                bytes.writeFrame(.request(id: UInt64(id), method: .checkEntitlements, payload: ByteBuffer(bytes: try request.serializedBytes())))
            }
            let collector = Collector()
            let channel = try await ClientBootstrap(group: server.group)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHandler(NIOSSLClientHandler(context: context, serverHostname: "localhost"))
                        try channel.pipeline.syncOperations.addHandler(collector)
                    }
                }
                .connect(host: "127.0.0.1", port: server.port).get()
            // A server that kept the connection open would wait for its idle timeout: 10 s
            // is far more than the answers need.
            let giveUp = channel.eventLoop.scheduleTask(in: .seconds(10)) { channel.close(promise: nil) }
            // The checks and the close in one go: NIOSSL holds both until its handshake is
            // done and then writes the close_notify right behind them, so the server often
            // reads both together (not always: the test repeats it).
            channel.write(bytes, promise: nil)
            try? await channel.close(mode: .output).get()  // fails if the server closed first
            try await channel.closeFuture.get()
            giveUp.cancel()
            var (received, error) = collector.result
            let said = error.map { " (the connection failed: \($0))" } ?? ""
            var decoder = FrameDecoder()
            var ids: [UInt64] = []
            while let frame = try decoder.decode(buffer: &received) {
                #expect(frame.type == .response && frame.status == .ok)
                ids.append(frame.requestID)
            }
            #expect(ids == [1, 2, 3, 4], "customer-\(user)\(said)")
            #expect(received.readableBytes == 0)
        }
    }

    /// Gathers what the server sends, and the error that ended the connection if any.
    final class Collector: ChannelInboundHandler, Sendable {
        typealias InboundIn = ByteBuffer
        private let state = NIOLockedValueBox<(ByteBuffer, (any Error)?)>((ByteBuffer(), nil))

        var result: (ByteBuffer, (any Error)?) { self.state.withLockedValue { $0 } }

        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            var bytes = Self.unwrapInboundIn(data)
            self.state.withLockedValue { $0.0.writeBuffer(&bytes) }
        }

        func errorCaught(context: ChannelHandlerContext, error: any Error) {
            self.state.withLockedValue { $0.1 = $0.1 ?? error }
            context.close(promise: nil)
        }
    }
}
