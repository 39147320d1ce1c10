public import EntitlementsSecurity
public import EntitlementsServer
import NIOCore
import NIOHTTP1
import NIOHTTP2

/// The doors of docs/doors.md: gRPC (`entitlements.v1.EntitlementService` and
/// `grpc.health.v1.Health`) and HTTP/JSON (Connect-style unary calls) on one port, over the
/// same ``EntitlementMethods`` as the framed protocol.
///
/// A connection's first bytes choose its protocol: the HTTP/2 connection preface (what every
/// gRPC client sends on a cleartext connection) makes it an HTTP/2 connection whose streams
/// carry gRPC or JSON by their content-type; anything else is read as HTTP/1.1, which
/// carries JSON only (curl's default).
public enum Doors {
    /// The door of `serve --grpc-listen HOST:PORT`, for ``EntitlementsServer/start(store:configuration:group:resolverLoops:warmAt:metrics:logger:doors:report:)``.
    /// `security` says who may do what through it, and its TLS (with ALPN `h2` and
    /// `http/1.1`); a caller presents a token as `authorization: Bearer TOKEN`.
    public static func grpcAndJSON(host: String, port: Int, security: ListenerSecurity = .open("grpc")) -> ServerDoor {
        ServerDoor(name: "grpc", host: host, port: port, security: security) { channel, methods, credentials in
            try channel.pipeline.syncOperations.addHandler(ProtocolSniffer(methods: methods, credentials: credentials))
        }
    }

    /// The HTTP/2 settings a door connection announces: the framed listener's limits.
    static func settings(_ configuration: ServerConfiguration) -> HTTP2Settings {
        [
            HTTP2Setting(parameter: .maxConcurrentStreams, value: min(configuration.maximumInFlightPerConnection, 1 << 20)),
            HTTP2Setting(parameter: .maxHeaderListSize, value: 16 * 1024),
            HTTP2Setting(parameter: .maxFrameSize, value: 1 << 14),
        ]
    }

    /// Sets up an HTTP/2 connection's pipeline (on its event loop).
    static func configureHTTP2(_ channel: any Channel, methods: EntitlementMethods, credentials: ConnectionCredentials) throws {
        let connection = DoorConnection(methods: methods, eventLoop: channel.eventLoop, credentials: credentials)
        let shared = NIOLoopBound(connection, eventLoop: channel.eventLoop)
        var connectionConfiguration = NIOHTTP2Handler.ConnectionConfiguration()
        connectionConfiguration.initialSettings = Self.settings(methods.configuration)
        var streamConfiguration = NIOHTTP2Handler.StreamConfiguration()
        // Bounds what a stream whose client does not read holds in memory (answers,
        // watch events) before its channel stops being writable.
        streamConfiguration.outboundBufferSizeHighWatermark = 64 * 1024
        streamConfiguration.outboundBufferSizeLowWatermark = 16 * 1024
        _ = try channel.pipeline.syncOperations.configureHTTP2Pipeline(
            mode: .server,
            connectionConfiguration: connectionConfiguration,
            streamConfiguration: streamConfiguration,
            inboundStreamInitializer: { stream in
                stream.eventLoop.makeCompletedFuture {
                    try stream.pipeline.syncOperations.addHandler(DoorStreamHandler(connection: shared.value))
                }
            }
        )
        try channel.pipeline.syncOperations.addHandler(DoorConnectionHandler(connection: connection))
    }

    /// Sets up an HTTP/1.1 connection's pipeline (on its event loop).
    static func configureHTTP1(_ channel: any Channel, methods: EntitlementMethods, credentials: ConnectionCredentials) throws {
        try channel.pipeline.syncOperations.configureHTTPServerPipeline(withErrorHandling: true)
        try channel.pipeline.syncOperations.addHandler(
            HTTP1ExchangeHandler(responder: JSONResponder(methods: methods, credentials: credentials), idleTimeout: methods.configuration.idleTimeout)
        )
    }
}

/// Waits for a connection's first bytes and sets up the protocol they ask for: HTTP/2 when
/// they are the connection preface (or a prefix of it, so far), HTTP/1.1 otherwise. Then it
/// replays what it read and leaves the pipeline.
final class ProtocolSniffer: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer

    private static let preface = Array("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".utf8)
    private let methods: EntitlementMethods
    private let credentials: ConnectionCredentials
    private var buffered: ByteBuffer?
    private var timer: Scheduled<Void>?

    init(methods: EntitlementMethods, credentials: ConnectionCredentials) {
        self.methods = methods
        self.credentials = credentials
    }

    func handlerAdded(context: ChannelHandlerContext) {
        // A connection that says nothing is closed after --frame-timeout (slowloris).
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        self.timer = context.eventLoop.scheduleTask(in: self.methods.configuration.frameTimeout) {
            loopBound.value.close(promise: nil)
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.timer?.cancel()
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var bytes = self.unwrapInboundIn(data)
        if var buffered = self.buffered {
            buffered.writeBuffer(&bytes)
            bytes = buffered
        }
        let seen = bytes.readableBytesView.prefix(Self.preface.count)
        guard seen.elementsEqual(Self.preface.prefix(seen.count)) else {
            self.choose(context: context, http2: false, bytes)
            return
        }
        guard seen.count == Self.preface.count else {
            self.buffered = bytes  // a prefix of the preface so far: wait for more
            return
        }
        self.choose(context: context, http2: true, bytes)
    }

    private func choose(context: ChannelHandlerContext, http2: Bool, _ bytes: ByteBuffer) {
        self.timer?.cancel()
        self.timer = nil
        self.buffered = nil
        do {
            if http2 {
                try Doors.configureHTTP2(context.channel, methods: self.methods, credentials: self.credentials)
            } else {
                try Doors.configureHTTP1(context.channel, methods: self.methods, credentials: self.credentials)
            }
        } catch {
            context.close(promise: nil)
            return
        }
        context.fireChannelRead(self.wrapInboundOut(bytes))
        context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if event is ChannelShouldQuiesceEvent {
            context.close(promise: nil)  // nothing was asked yet: nothing to finish
            return
        }
        context.fireUserInboundEventTriggered(event)
    }
}
