public import EntitlementsSecurity
public import NIOCore
public import NIOHTTP1
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
        /// The support console (`serve --console`), served under its prefix; nil: none.
        public var console: (any AdminConsole)?
        /// More calls under their prefixes (the outbound events' `/events`).
        public var routes: [any AdminConsole]

        public init(
            readiness: @escaping @Sendable () -> (ready: Bool, reason: String),
            console: (any AdminConsole)? = nil,
            routes: [any AdminConsole] = [],
            metrics: @escaping @Sendable () async -> [UInt8]
        ) {
            self.readiness = readiness
            self.console = console
            self.routes = routes
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

    /// Listens on `host:port`; `refused` counts and logs a refused request or connection. A
    /// connection closes after `idleTimeout` without a request; a request must arrive in
    /// full within `arrivalTimeout` of its head (serve's --idle-timeout and --frame-timeout).
    public static func start(
        host: String,
        port: Int,
        security: ListenerSecurity = .open("admin"),
        endpoints: Endpoints,
        group: MultiThreadedEventLoopGroup,
        idleTimeout: TimeAmount = .minutes(5),
        arrivalTimeout: TimeAmount = .seconds(10),
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
                    try channel.pipeline.syncOperations.configureHTTPServerPipeline(withErrorHandling: true)
                    let responder = AdminResponder(endpoints: endpoints, credentials: credentials, arrivalTimeout: arrivalTimeout, refused: refused)
                    try channel.pipeline.syncOperations.addHandler(HTTP1ExchangeHandler(responder: responder, idleTimeout: idleTimeout))
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

/// Pages and calls the admin listener serves under a prefix besides its endpoints: the
/// support console (EntitlementsConsole). It checks each call's credentials itself, with the
/// listener's ``ConnectionCredentials``, as every other transport does.
public protocol AdminConsole: Sendable {
    /// The path prefix it serves, e.g. `/console`.
    var prefix: String { get }
    /// The largest request body it reads.
    var maximumBodyBytes: Int { get }
    /// Refuses a request before its body is read (a method it does not serve); nil reads on.
    func head(_ head: HTTPRequestHead) -> HTTP1Answer?
    /// The answer to a whole request.
    func answer(_ head: HTTPRequestHead, body: ByteBuffer, credentials: ConnectionCredentials, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply
}

/// One admin connection's requests. The exchange (timers, limits, keep-alive, HEAD) is
/// ``HTTP1ExchangeHandler``'s.
private final class AdminResponder: HTTP1Responder {
    private let endpoints: AdminServer.Endpoints
    private let credentials: ConnectionCredentials
    private let arrivalTimeout: TimeAmount
    private let refused: @Sendable (Refusal, String) -> Void

    init(endpoints: AdminServer.Endpoints, credentials: ConnectionCredentials, arrivalTimeout: TimeAmount, refused: @escaping @Sendable (Refusal, String) -> Void) {
        self.endpoints = endpoints
        self.credentials = credentials
        self.arrivalTimeout = arrivalTimeout
        self.refused = refused
    }

    /// The endpoints take no body; the console's calls do.
    var maximumBodyBytes: Int {
        ([self.endpoints.console].compactMap { $0 } + self.endpoints.routes).map(\.maximumBodyBytes).max() ?? 0
    }

    /// The console or route `head` is for, if any.
    private func console(for head: HTTPRequestHead) -> (any AdminConsole)? {
        let path = Self.path(head)
        return ([self.endpoints.console].compactMap { $0 } + self.endpoints.routes).first { path == $0.prefix || path.hasPrefix($0.prefix + "/") }
    }

    private static func path(_ head: HTTPRequestHead) -> String {
        head.uri.split(separator: "?", maxSplits: 1).first.map(String.init) ?? head.uri
    }

    func head(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
        if let console = self.console(for: head) {
            return console.head(head)
        }
        return head.method == .GET || head.method == .HEAD ? nil : .text(.methodNotAllowed, "only GET\n")
    }

    func answer(_ head: HTTPRequestHead, body: ByteBuffer, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply {
        if let console = self.console(for: head) {
            return console.answer(head, body: body, credentials: self.credentials, start: start, eventLoop: eventLoop)
        }
        let path = Self.path(head)
        switch path {
        case "/healthz":
            return .now(.text(.ok, "ok\n"))
        case "/readyz":
            let (ready, reason) = self.endpoints.readiness()
            return .now(.text(ready ? .ok : .serviceUnavailable, reason + "\n"))
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
                return .now(.text(refusal.status == .unauthenticated ? .unauthorized : .forbidden, refusal.message + "\n"))
            }
            let endpoints = self.endpoints
            let promise = eventLoop.makePromise(of: HTTP1Answer.self)
            promise.completeWithTask {
                HTTP1Answer(.ok, contentType: "text/plain; version=0.0.4; charset=utf-8", body: ByteBuffer(bytes: await endpoints.metrics()))
            }
            return .later(promise.futureResult)
        default:
            let more = ([self.endpoints.console].compactMap { $0 } + self.endpoints.routes).map { ", \($0.prefix)" }.joined()
            return .now(.text(.notFound, "not found; try /healthz, /readyz, /metrics\(more)\n"))
        }
    }

    func tooLarge(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer {
        .text(.payloadTooLarge, "too large: the admin endpoints take no body, the console's calls at most \(self.maximumBodyBytes) bytes\n")
    }

    func arrivalLimit(_ head: HTTPRequestHead, start: NIODeadline) -> NIODeadline {
        start + self.arrivalTimeout
    }

    func arrivalExpired(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
        .text(.requestTimeout, "the request did not arrive in full in time\n")
    }
}
