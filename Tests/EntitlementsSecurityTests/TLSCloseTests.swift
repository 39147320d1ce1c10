import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsWire
import NIOCore
import NIOPosix
import NIOSSL
import Testing

/// A TLS client that sends its checks and closes its side at once (close_notify, then its
/// FIN) still gets every answer made before: NIOSSLHandler closes the channel right after
/// the read that carries the close_notify, so a TLS connection's answers are flushed as they
/// are made, not at the end of the loop tick (docs/server.md, step 5).
@Suite(.serialized) struct TLSCloseTests {
    @Test("checks then close_notify in one burst: every check is answered before the server closes")
    func answeredBeforeCloseNotify() async throws {
        let certificates = try Certificates.get()
        let server = try await SecureServer(tcp: ListenerSecurity(policy: .open("tcp"), tls: try certificates.serverTLS()))
        let context = try NIOSSLContext(configuration: try certificates.clientTLS())
        for user in 0..<50 {
            // Every customer's answer is cached at start (warmAt), so each check is answered
            // as it is read: one not yet answered at the close would be dropped (PROTOCOL.md 6).
            var bytes = ByteBuffer()
            for id in 1...4 {
                let request = CheckEntitlementsRequest(userId: "customer-\(user)", at: now)
                bytes.writeFrame(.request(id: UInt64(id), method: .checkEntitlements, payload: ByteBuffer(bytes: try request.serializedBytes())))
            }
            let done = server.group.next().makePromise(of: ByteBuffer.self)  // one loop: the channel's
            let channel = try await ClientBootstrap(group: server.group)
                .channelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHandler(NIOSSLClientHandler(context: context, serverHostname: "localhost"))
                        try channel.pipeline.syncOperations.addHandler(Collector(done: done, eventLoop: channel.eventLoop))
                    }
                }
                .connect(host: "127.0.0.1", port: server.port).get()
            // The checks and the close in one go: NIOSSL holds both until its handshake is
            // done and then writes the close_notify right behind them, so the server often
            // reads both together.
            channel.write(bytes, promise: nil)
            try await channel.close(mode: .output).get()
            var received = try await done.futureResult.get()
            var decoder = FrameDecoder()
            var ids: [UInt64] = []
            while let frame = try decoder.decode(buffer: &received) {
                #expect(frame.type == .response && frame.status == .ok)
                ids.append(frame.requestID)
            }
            #expect(ids == [1, 2, 3, 4], "customer-\(user)")
            #expect(received.readableBytes == 0)
        }
        try await server.stop()
    }

    /// Gathers what the server sends until the connection ends.
    final class Collector: ChannelInboundHandler, Sendable {
        typealias InboundIn = ByteBuffer
        let done: EventLoopPromise<ByteBuffer>
        private let received: NIOLoopBoundBox<ByteBuffer>

        init(done: EventLoopPromise<ByteBuffer>, eventLoop: any EventLoop) {
            self.done = done
            self.received = NIOLoopBoundBox(ByteBuffer(), eventLoop: eventLoop)
        }

        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            var bytes = Self.unwrapInboundIn(data)
            self.received.value.writeBuffer(&bytes)
        }

        func channelInactive(context: ChannelHandlerContext) {
            self.done.succeed(self.received.value)
        }

        func errorCaught(context: ChannelHandlerContext, error: any Error) {
            // NIOSSL reports a server that closes without its own close_notify; what was
            // received is still the answer to check.
            context.close(promise: nil)
        }
    }
}
