public import EntitlementsSecurity
public import NIOCore
import NIOHTTP1
public import NIOPosix

/// The admin HTTP listener (docs/operations.md): `/healthz` (the process is alive),
/// `/readyz` (it serves checks: snapshot open, log replayed, caches warm, not draining) and
/// `/metrics` (Prometheus text). GET only; anything else is 404 or 405. With TLS settings
/// it speaks HTTPS; `/metrics` needs the check permission (a bearer token or client
/// certificate when `--admin-anonymous none`), the probes never do (docs/security.md).
public final class AdminServer: Sendable {
    /// What the admin endpoints report; supplied by `serve`.
    public struct Endpoints: Sendable {
        /// Whether the service is ready, and why not if not.
        public var readiness: @Sendable () -> (ready: Bool, reason: String)
        /// The Prometheus text exposition, refreshed at each scrape.
        public var metrics: @Sendable () async -> [UInt8]

        public init(readiness: @escaping @Sendable () -> (ready: Bool, reason: String), metrics: @escaping @Sendable () async -> [UInt8]) {
            self.readiness = readiness
            self.metrics = metrics
        }
    }

    /// The bound address (the real port when asked for port 0).
    public let address: SocketAddress?
    private let channel: any Channel

    private init(channel: any Channel) {
        self.channel = channel
        self.address = channel.localAddress
    }

    /// Listens on `host:port`.
    /// Listens on `host:port`; `refused` counts and logs a refused request or connection.
    public static func start(
        host: String,
        port: Int,
        security: ListenerSecurity = .open("admin"),
        endpoints: Endpoints,
        group: MultiThreadedEventLoopGroup,
        refused: @escaping @Sendable (Refusal, String) -> Void = { _, _ in }
    ) async throws -> AdminServer {
        let channel = try await ServerBootstrap(group: group)
            .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
            .childChannelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    let peer = channel.remoteAddress.map(EntitlementsServer.describe) ?? "-"
                    let credentials = ConnectionCredentials(security: security, peer: peer)
                    if let tls = security.tls {
                        try tls.configure(channel, .http1, credentials: credentials) { refused($0, peer) }
                    }
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline()
                    try channel.pipeline.syncOperations.addHandler(AdminHandler(endpoints: endpoints, credentials: credentials, refused: refused))
                }
            }
            .bind(host: host, port: port)
            .get()
        return AdminServer(channel: channel)
    }

    /// Stops listening (open admin connections finish their request).
    public func close() async {
        try? await self.channel.close()
    }
}

/// One admin connection: answers each request in turn.
private final class AdminHandler: ChannelInboundHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let endpoints: AdminServer.Endpoints
    private let credentials: ConnectionCredentials
    private let refused: @Sendable (Refusal, String) -> Void
    private var head: HTTPRequestHead?

    init(endpoints: AdminServer.Endpoints, credentials: ConnectionCredentials, refused: @escaping @Sendable (Refusal, String) -> Void) {
        self.endpoints = endpoints
        self.credentials = credentials
        self.refused = refused
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch self.unwrapInboundIn(data) {
        case .head(let head):
            self.head = head
        case .body:
            break
        case .end:
            guard let head = self.head else {
                return
            }
            self.head = nil
            self.respond(to: head, context: context)
        }
    }

    private func respond(to head: HTTPRequestHead, context: ChannelHandlerContext) {
        let path = head.uri.split(separator: "?", maxSplits: 1).first.map(String.init) ?? head.uri
        guard head.method == .GET || head.method == .HEAD else {
            self.send(.methodNotAllowed, "only GET\n", head: head, context: context)
            return
        }
        switch path {
        case "/healthz":
            self.send(.ok, "ok\n", head: head, context: context)
        case "/readyz":
            let (ready, reason) = self.endpoints.readiness()
            self.send(ready ? .ok : .serviceUnavailable, reason + "\n", head: head, context: context)
        case "/metrics":
            let refusal: Refusal?
            switch self.credentials.access(authorization: head.headers.first(name: "authorization")) {
            case .success(let access):
                refusal = access.permissions.contains(.check) ? nil : access.refusal(needing: .check, method: "/metrics")
            case .failure(let failure):
                refusal = failure
            }
            if let refusal {
                self.refused(refusal, self.credentials.peer)
                self.send(refusal.status == .unauthenticated ? .unauthorized : .forbidden, refusal.message + "\n", head: head, context: context)
                return
            }
            let endpoints = self.endpoints
            let bound = NIOLoopBound((self, context), eventLoop: context.eventLoop)
            let promise = context.eventLoop.makePromise(of: [UInt8].self)
            promise.completeWithTask { await endpoints.metrics() }
            promise.futureResult.whenSuccess { bytes in
                let (handler, context) = bound.value
                handler.send(.ok, bytes, contentType: "text/plain; version=0.0.4; charset=utf-8", head: head, context: context)
            }
        default:
            self.send(.notFound, "not found; try /healthz, /readyz or /metrics\n", head: head, context: context)
        }
    }

    private func send(_ status: HTTPResponseStatus, _ text: String, head: HTTPRequestHead, context: ChannelHandlerContext) {
        self.send(status, Array(text.utf8), contentType: "text/plain; charset=utf-8", head: head, context: context)
    }

    private func send(_ status: HTTPResponseStatus, _ body: [UInt8], contentType: String, head: HTTPRequestHead, context: ChannelHandlerContext) {
        var headers = HTTPHeaders()
        headers.add(name: "Content-Type", value: contentType)
        headers.add(name: "Content-Length", value: "\(body.count)")
        if !head.isKeepAlive {
            headers.add(name: "Connection", value: "close")
        }
        context.write(self.wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
        if head.method != .HEAD {
            context.write(self.wrapOutboundOut(.body(.byteBuffer(context.channel.allocator.buffer(bytes: body)))), promise: nil)
        }
        let keepAlive = head.isKeepAlive
        context.writeAndFlush(self.wrapOutboundOut(.end(nil))).assumeIsolated().whenComplete { _ in
            if !keepAlive {
                context.close(promise: nil)
            }
        }
    }
}
