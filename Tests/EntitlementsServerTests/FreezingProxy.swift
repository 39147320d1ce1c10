import NIOCore
import NIOPosix
import Synchronization

/// A loopback TCP proxy that can go silent: frozen, it drops every byte either way and
/// closes nothing, as a network partition or a hung server looks to a client (the kernel
/// reports nothing; only the silence tells).
final class FreezingProxy: Sendable {
    let port: Int
    private let frozen: Flag
    private let listener: any Channel

    private final class Flag: Sendable {
        let value = Atomic(false)
    }

    /// Copies what one side sends to the other, unless frozen.
    private final class Forward: ChannelInboundHandler, Sendable {
        typealias InboundIn = ByteBuffer
        let partner: any Channel
        let frozen: Flag

        init(to partner: any Channel, frozen: Flag) {
            self.partner = partner
            self.frozen = frozen
        }

        func channelRead(context: ChannelHandlerContext, data: NIOAny) {
            if !self.frozen.value.load(ordering: .relaxed) {
                self.partner.writeAndFlush(self.unwrapInboundIn(data), promise: nil)
            }
        }

        func channelInactive(context: ChannelHandlerContext) {
            self.partner.close(promise: nil)
        }
    }

    init(to target: Int, group: any EventLoopGroup) async throws {
        let frozen = Flag()
        self.listener = try await ServerBootstrap(group: group)
            .childChannelInitializer { inbound in
                // The connection to the target first: the client's bytes are read only
                // once it is there (the accepted channel registers after this completes).
                ClientBootstrap(group: inbound.eventLoop)
                    .channelInitializer { outbound in
                        outbound.eventLoop.makeCompletedFuture {
                            try outbound.pipeline.syncOperations.addHandler(Forward(to: inbound, frozen: frozen))
                        }
                    }
                    .connect(host: "127.0.0.1", port: target)
                    .flatMapThrowing { outbound in
                        try inbound.pipeline.syncOperations.addHandler(Forward(to: outbound, frozen: frozen))
                    }
            }
            .bind(host: "127.0.0.1", port: 0)
            .get()
        self.port = self.listener.localAddress!.port!
        self.frozen = frozen
    }

    /// From now on nothing gets through, either way, and nothing closes.
    func freeze() {
        self.frozen.value.store(true, ordering: .relaxed)
    }

    /// Bytes flow again (those dropped meanwhile are lost).
    func thaw() {
        self.frozen.value.store(false, ordering: .relaxed)
    }

    func close() async throws {
        try await self.listener.close()
    }
}
