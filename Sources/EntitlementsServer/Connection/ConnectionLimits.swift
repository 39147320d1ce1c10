import EntitlementsWire
import NIOCore
import Synchronization

/// Counts the server's open connections against ``ServerConfiguration/maximumConnections``.
final class ConnectionCounter: Sendable {
    private let open = Atomic<Int>(0)
    let maximum: Int

    init(maximum: Int) {
        self.maximum = maximum
    }

    var count: Int { self.open.load(ordering: .relaxed) }

    /// Counts a new connection; false (and not counted) when the server is full.
    func admit() -> Bool {
        var current = self.open.load(ordering: .relaxed)
        while current < self.maximum {
            let (exchanged, original) = self.open.compareExchange(expected: current, desired: current + 1, ordering: .relaxed)
            if exchanged {
                return true
            }
            current = original
        }
        return false
    }

    func release() {
        self.open.subtract(1, ordering: .relaxed)
    }
}

/// The first handler of a connection refused for the connection limit: tells the client
/// why (an ERROR frame, RESOURCE_EXHAUSTED) and closes.
final class RefusedConnectionHandler: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let maximum: Int

    init(maximum: Int) {
        self.maximum = maximum
    }

    func channelActive(context: ChannelHandlerContext) {
        var buffer = context.channel.allocator.buffer(capacity: 128)
        buffer.writeFrame(.error(status: .resourceExhausted, message: "the server has \(self.maximum) connections, its maximum; try again later or another server"))
        context.writeAndFlush(self.wrapOutboundOut(buffer)).assumeIsolated().whenComplete { _ in
            context.close(promise: nil)
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {}
}
