import EntitlementsSecurity
import EntitlementsServer
import NIOCore
import NIOHTTP2

/// What the streams of one HTTP/2 door connection share: the drain, and the streams still
/// open. Confined to the connection's event loop, which its stream channels share.
final class DoorConnection {
    let methods: EntitlementMethods
    let eventLoop: any EventLoop
    /// The connection's client certificate, if any; each call adds its bearer token.
    let credentials: ConnectionCredentials
    private(set) var draining = false
    private var streams: [ObjectIdentifier: DoorStreamHandler] = [:]
    /// The highest stream id a handler was made for: the GOAWAY's last stream.
    private(set) var lastStreamID = HTTP2StreamID(0)
    /// When the last stream closed (for the idle timeout); nil while streams are open.
    private(set) var idleSince: NIODeadline? = .now()
    /// Closes the connection gracefully, soon (set by ``DoorConnectionHandler``).
    var close: () -> Void = {}

    init(methods: EntitlementMethods, eventLoop: any EventLoop, credentials: ConnectionCredentials) {
        self.methods = methods
        self.eventLoop = eventLoop
        self.credentials = credentials
    }

    var isIdle: Bool { self.streams.isEmpty }

    func opened(_ stream: DoorStreamHandler, id: HTTP2StreamID?) {
        self.streams[ObjectIdentifier(stream)] = stream
        self.idleSince = nil
        if let id, id > self.lastStreamID {
            self.lastStreamID = id
        }
    }

    func closed(_ stream: DoorStreamHandler) {
        guard self.streams.removeValue(forKey: ObjectIdentifier(stream)) != nil else {
            return
        }
        if self.streams.isEmpty {
            self.idleSince = .now()
            if self.draining {
                self.close()
            }
        }
    }

    /// Ends the calls whose requests are still arriving past their limit (the
    /// --frame-timeout sweep, run every half of it).
    func sweepArrivals() {
        let now = NIODeadline.now()
        for stream in Array(self.streams.values) {
            stream.arrivalOverdue(at: now)
        }
    }

    /// The server drains: streams that never end on their own (watches) end now; the rest
    /// finish, then the connection closes.
    func drain() {
        guard !self.draining else {
            return
        }
        self.draining = true
        for stream in Array(self.streams.values) {
            stream.drain()
        }
        if self.streams.isEmpty {
            self.close()
        }
    }
}

/// The connection end of an HTTP/2 door connection, after NIOHTTP2Handler: a drain sends
/// GOAWAY (no new streams; those open finish) and closes the connection once they have;
/// an idle connection (no stream for --idle-timeout) is sent GOAWAY and closed too.
final class DoorConnectionHandler: ChannelInboundHandler {
    typealias InboundIn = HTTP2Frame
    typealias OutboundOut = HTTP2Frame

    private let connection: DoorConnection
    private var idleTimer: RepeatedTask?
    private var arrivalTimer: RepeatedTask?
    private var lingerTimer: Scheduled<Void>?
    private var closing = false

    init(connection: DoorConnection) {
        self.connection = connection
    }

    func handlerAdded(context: ChannelHandlerContext) {
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        let handler = NIOLoopBound(self, eventLoop: context.eventLoop)
        self.connection.close = {
            // Not now: the last stream closes while NIOHTTP2Handler is still writing its
            // trailers, which it flushes after this returns.
            context.eventLoop.execute {
                handler.value.closeGracefully(context: loopBound.value)
            }
        }
        let timeout = self.connection.methods.configuration.idleTimeout
        self.idleTimer = context.eventLoop.scheduleRepeatedTask(initialDelay: timeout, delay: .nanoseconds(max(timeout.nanoseconds / 4, 1_000_000))) { _ in
            handler.value.closeIfIdle(context: loopBound.value, timeout: timeout)
        }
        // A request must arrive within --frame-timeout of its headers: one sweep per
        // connection, every half of it (so at most 1.5 times it), not a timer per call.
        let frameTimeout = self.connection.methods.configuration.frameTimeout
        let sweep = TimeAmount.nanoseconds(max(frameTimeout.nanoseconds / 2, 10_000_000))
        self.arrivalTimer = context.eventLoop.scheduleRepeatedTask(initialDelay: sweep, delay: sweep) { _ in
            handler.value.connection.sweepArrivals()
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.idleTimer?.cancel()
        self.idleTimer = nil
        self.arrivalTimer?.cancel()
        self.arrivalTimer = nil
        self.lingerTimer?.cancel()
        self.lingerTimer = nil
        self.connection.close = {}
    }

    /// Ends the connection without losing a byte sent, as the framed listener does: what
    /// is written goes out, then a FIN; the client's side is read (and dropped) until it
    /// closes, or for at most `closeLinger`. Closing at once with input unread makes the
    /// kernel reset the connection, and the client may lose the last answers.
    private func closeGracefully(context: ChannelHandlerContext) {
        guard !self.closing else {
            return
        }
        self.closing = true
        context.flush()
        let linger = self.connection.methods.configuration.closeLinger
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        self.lingerTimer = context.eventLoop.scheduleTask(in: linger) {
            loopBound.value.close(promise: nil)
        }
        context.close(mode: .output).whenFailure { _ in
            loopBound.value.close(promise: nil)
        }
    }

    private func closeIfIdle(context: ChannelHandlerContext, timeout: TimeAmount) {
        guard let since = self.connection.idleSince, NIODeadline.now() - since >= timeout, !self.connection.draining else {
            return
        }
        self.goAway(context: context)
        self.connection.drain()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        // Connection-level frames (SETTINGS, PING, GOAWAY) are NIOHTTP2Handler's business.
    }

    /// Backpressure, as on the framed listener: while the socket cannot take more (a client
    /// that does not read), no more requests are read, so no more answers pile up.
    func channelWritabilityChanged(context: ChannelHandlerContext) {
        let writable = context.channel.isWritable
        context.channel.setOption(ChannelOptions.autoRead, value: writable).whenComplete { _ in }
        if writable {
            context.read()
        }
        context.fireChannelWritabilityChanged()
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if event is ChannelShouldQuiesceEvent {
            if !self.connection.draining {
                self.goAway(context: context)
                self.connection.drain()
            }
            return
        }
        context.fireUserInboundEventTriggered(event)
    }

    private func goAway(context: ChannelHandlerContext) {
        let frame = HTTP2Frame(
            streamID: .rootStream,
            payload: .goAway(lastStreamID: self.connection.lastStreamID, errorCode: .noError, opaqueData: nil)
        )
        context.writeAndFlush(self.wrapOutboundOut(frame), promise: nil)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        // A stream's error ends that stream only (NIOHTTP2Handler has reset it); any other
        // is the connection's (NIOHTTP2Handler has sent GOAWAY as the protocol requires):
        // it goes, and other connections are untouched.
        if error is NIOHTTP2Errors.StreamError, !self.closing {
            return
        }
        context.close(promise: nil)
    }
}
