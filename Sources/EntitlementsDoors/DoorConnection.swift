import EntitlementsServer
import NIOCore
import NIOHTTP2

/// What the streams of one HTTP/2 door connection share: the drain, and the streams still
/// open. Confined to the connection's event loop, which its stream channels share.
final class DoorConnection {
    let methods: EntitlementMethods
    let eventLoop: any EventLoop
    private(set) var draining = false
    private var streams: [ObjectIdentifier: DoorStreamHandler] = [:]
    /// The highest stream id a handler was made for: the GOAWAY's last stream.
    private(set) var lastStreamID = HTTP2StreamID(0)
    /// When the last stream closed (for the idle timeout); nil while streams are open.
    private(set) var idleSince: NIODeadline? = .now()
    /// Closes the connection (set by ``DoorConnectionHandler``).
    var close: () -> Void = {}

    init(methods: EntitlementMethods, eventLoop: any EventLoop) {
        self.methods = methods
        self.eventLoop = eventLoop
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

    init(connection: DoorConnection) {
        self.connection = connection
    }

    func handlerAdded(context: ChannelHandlerContext) {
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        self.connection.close = {
            loopBound.value.close(promise: nil)
        }
        let timeout = self.connection.methods.configuration.idleTimeout
        let handler = NIOLoopBound(self, eventLoop: context.eventLoop)
        self.idleTimer = context.eventLoop.scheduleRepeatedTask(initialDelay: timeout, delay: .nanoseconds(max(timeout.nanoseconds / 4, 1_000_000))) { _ in
            handler.value.closeIfIdle(context: loopBound.value, timeout: timeout)
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.idleTimer?.cancel()
        self.idleTimer = nil
        self.connection.close = {}
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
        if error is NIOHTTP2Errors.StreamError {
            return
        }
        context.close(promise: nil)
    }
}
