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

/// What the decoder has consumed of the bytes a connection received: shared by the
/// ``SlowSenderGuard`` (before the decoder) and the connection handler (after it), both
/// on the connection's event loop.
final class FrameProgress {
    /// Bytes read from the socket.
    var received = 0
    /// Bytes of complete frames.
    var consumed = 0
    /// Set while the server itself stopped reading (backpressure): not the sender's fault.
    var readsPaused = false
}

/// Cuts off a sender that starts a frame and does not finish it within the frame timeout
/// (slowloris: holding a connection open with a trickle of bytes). Sits before the frame
/// decoder; the connection handler reports each complete frame in ``FrameProgress``.
final class SlowSenderGuard: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let progress: FrameProgress
    private let timeout: TimeAmount
    private var timer: Scheduled<Void>?
    private var consumedWhenArmed = 0

    init(progress: FrameProgress, timeout: TimeAmount) {
        self.progress = progress
        self.timeout = timeout
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        self.progress.received += self.unwrapInboundIn(data).readableBytes
        context.fireChannelRead(data)
        if self.progress.received > self.progress.consumed {
            if self.timer == nil {
                self.arm(context: context)
            }
        } else {
            self.timer?.cancel()
            self.timer = nil
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.timer?.cancel()
        self.timer = nil
    }

    private func arm(context: ChannelHandlerContext) {
        self.consumedWhenArmed = self.progress.consumed
        self.timer = context.eventLoop.assumeIsolated().scheduleTask(in: self.timeout) {
            self.timer = nil
            self.expired(context: context)
        }
    }

    private func expired(context: ChannelHandlerContext) {
        guard self.progress.received > self.progress.consumed else {
            return  // nothing partial
        }
        if self.progress.readsPaused || self.progress.consumed != self.consumedWhenArmed {
            self.arm(context: context)  // frames completed meanwhile, or we stopped reading
            return
        }
        let seconds = Double(self.timeout.nanoseconds) / 1e9
        var buffer = context.channel.allocator.buffer(capacity: 128)
        buffer.writeFrame(.error(
            status: .deadlineExceeded,
            message: "a frame started \(seconds) s ago has not arrived in full (\(self.progress.received - self.progress.consumed) bytes so far); closing"
        ))
        context.writeAndFlush(self.wrapOutboundOut(buffer)).assumeIsolated().whenComplete { _ in
            context.close(promise: nil)
        }
    }
}
