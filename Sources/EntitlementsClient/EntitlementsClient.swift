public import EntitlementsMessages
public import EntitlementsWire
public import NIOCore
public import NIOPosix
public import NIOSSL
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Where the server is.
public enum EntitlementsServerAddress: Sendable, Hashable, CustomStringConvertible {
    case tcp(host: String, port: Int)
    case unixSocket(path: String)

    public var description: String {
        switch self {
        case .tcp(let host, let port): "\(host):\(port)"
        case .unixSocket(let path): "unix:\(path)"
        }
    }
}

/// How the client proves itself to a server with --auth-token-file (docs/security.md).
public enum EntitlementsClientToken: Sendable, Hashable {
    /// This token.
    case value(String)
    /// The first word of this file, read again for every new connection, so that a token
    /// rotated in the file is used from the next connection on.
    case file(String)

    /// The token now.
    func read() throws -> String {
        switch self {
        case .value(let token):
            return token
        case .file(let path):
            let fd = open(path, O_RDONLY | O_CLOEXEC)
            guard fd >= 0 else {
                throw EntitlementsClientError(code: .unauthenticated, message: "cannot open the token file \(path): \(String(cString: strerror(errno)))")
            }
            defer { close(fd) }
            var bytes = [UInt8](repeating: 0, count: 8_192)
            let count = bytes.withUnsafeMutableBytes { Glibc.read(fd, $0.baseAddress, $0.count) }
            guard count > 0 else {
                throw EntitlementsClientError(code: .unauthenticated, message: "the token file \(path) is empty or unreadable")
            }
            let text = String(decoding: bytes[0..<count], as: UTF8.self)
            guard let token = text.split(whereSeparator: { $0 == " " || $0 == "\n" || $0 == "\t" || $0 == "\r" }).first else {
                throw EntitlementsClientError(code: .unauthenticated, message: "the token file \(path) holds no token")
            }
            return String(token)
        }
    }
}

/// A failed call: the status code (gRPC numbering) and the server's message. Connection
/// problems are `UNAVAILABLE`; a call that ran out of time is `DEADLINE_EXCEEDED`.
public struct EntitlementsClientError: Error, Hashable, CustomStringConvertible {
    public var code: StatusCode
    public var message: String

    public init(code: StatusCode, message: String) {
        self.code = code
        self.message = message
    }

    public var description: String { "\(self.code): \(self.message)" }
}

/// A client for the entitlements service (docs/PROTOCOL.md).
///
/// One connection multiplexes any number of concurrent calls; `connections` > 1 spreads
/// calls over a small pool. Connections are made on first use and remade after they fail,
/// with exponential backoff between failed attempts. A call the server did not process
/// because it was going away (GOAWAY) is sent again on a new connection, once.
///
/// ```swift
/// let client = EntitlementsClient(server: .tcp(host: "127.0.0.1", port: 7420))
/// let answer = try await client.checkEntitlements(
///     CheckEntitlementsRequest(userId: "user-1", entitlementIds: ["premium"]),
///     timeout: .milliseconds(50)
/// )
/// if answer.entitlements.first?.isActive == true { /* unlock premium */ }
/// await client.close()
/// ```
public final class EntitlementsClient: Sendable {
    /// How the client connects.
    public struct Configuration: Sendable {
        public var server: EntitlementsServerAddress
        /// How many connections to spread calls over. Default 1.
        public var connections: Int
        /// The largest answer accepted. Default 1 MiB.
        public var maximumPayloadSize: Int
        /// How long to wait for a connection. Default 2 s.
        public var connectTimeout: TimeAmount
        /// The first and the longest wait between failed connection attempts.
        public var initialBackoff: TimeAmount
        public var maximumBackoff: TimeAmount
        /// TLS to a server with --tls-cert: the CA to trust (`trustRoots`) and, for mutual
        /// TLS, this client's certificate and key. nil: plain TCP. Not for Unix sockets.
        public var tls: TLSConfiguration?
        /// The name the server's certificate must carry; default the host of `server`.
        public var serverHostname: String?
        /// Presented on every new connection (Authenticate, before any call); nil for none.
        public var token: EntitlementsClientToken?
        /// Keep answers and serve checks from them without a round trip, exactly (until
        /// each answer's validUntil, forgetting what a watch of every customer says
        /// changed: docs/PROTOCOL.md, "Keeping answers"); nil (the default): off.
        public var nearCache: NearCacheConfiguration?

        public init(
            server: EntitlementsServerAddress,
            connections: Int = 1,
            maximumPayloadSize: Int = Frame.defaultMaximumPayloadSize,
            connectTimeout: TimeAmount = .seconds(2),
            initialBackoff: TimeAmount = .milliseconds(50),
            maximumBackoff: TimeAmount = .seconds(5),
            tls: TLSConfiguration? = nil,
            serverHostname: String? = nil,
            token: EntitlementsClientToken? = nil,
            nearCache: NearCacheConfiguration? = nil
        ) {
            self.nearCache = nearCache
            self.tls = tls
            self.serverHostname = serverHostname
            self.token = token
            self.server = server
            self.connections = max(1, connections)
            self.maximumPayloadSize = maximumPayloadSize
            self.connectTimeout = connectTimeout
            self.initialBackoff = initialBackoff
            self.maximumBackoff = maximumBackoff
        }
    }

    public let configuration: Configuration
    private let group: any EventLoopGroup
    private let slots: [Slot]
    private let nextSlot = Atomic<Int>(0)
    private let nearCache: NearCache?

    /// Creates a client; nothing connects until the first call.
    public init(configuration: Configuration, eventLoopGroup: any EventLoopGroup = MultiThreadedEventLoopGroup.singleton) {
        self.configuration = configuration
        self.group = eventLoopGroup
        self.slots = (0..<configuration.connections).map { _ in Slot() }
        self.nearCache = configuration.nearCache.map(NearCache.init(configuration:))
    }

    /// Creates a client for `server` with one connection.
    public convenience init(server: EntitlementsServerAddress) {
        self.init(configuration: Configuration(server: server))
    }

    /// CheckEntitlements: what may this user use? With the near-cache, a check of now is
    /// answered from a kept answer when one holds (docs/PROTOCOL.md, "Keeping answers"),
    /// else from the server, whose whole answer for the user is then kept.
    public func checkEntitlements(_ request: CheckEntitlementsRequest, timeout: Duration? = nil) async throws -> CheckEntitlementsResponse {
        guard let nearCache = self.nearCache, NearCache.accepts(request) else {
            return try await self.call(.checkEntitlements, request, timeout: timeout)
        }
        if let kept = nearCache.lookup(request, now: NearCache.now()) {
            return kept
        }
        // Stale-if-error without the wait: while every connection is between attempts that
        // could not reach the server, a call would only sleep until the next; a kept answer
        // within the bound is answered now (a call after the backoff still tries the
        // server, so an answer may be stale for up to maximumBackoff after it is back).
        if nearCache.configuration.staleIfErrorFor != nil, self.slots.allSatisfy(\.isBackingOffUnreachable),
            let stale = nearCache.stale(request, now: NearCache.now())
        {
            return stale
        }
        var whole = request
        whole.entitlementIds = []
        let ticket = nearCache.ticket()
        do {
            let (answer, bytes): (CheckEntitlementsResponse, Int) = try await self.callMeasured(.checkEntitlements, whole, timeout: timeout)
            var response = answer
            nearCache.keep(answer, userId: request.userId ?? "", encodedBytes: bytes, now: NearCache.now(), ticket: ticket, client: self)
            NearCache.filter(&response, request.entitlementIds)
            return response
        } catch let error as EntitlementsClientError where error.code == .unavailable || error.code == .deadlineExceeded {
            // Either: a connection that died without the kernel noticing (a partition) shows
            // as a deadline, and the watch on it may be as dead.
            nearCache.serverUnreachable()
            if let stale = nearCache.stale(request, now: NearCache.now()) {
                return stale
            }
            throw error
        }
    }

    /// What the near-cache has done (nil without one).
    public var nearCacheStatistics: NearCacheStatistics? {
        self.nearCache?.statistics
    }

    /// BatchCheckEntitlements: one answer per user id, in order.
    public func batchCheckEntitlements(_ request: BatchCheckEntitlementsRequest, timeout: Duration? = nil) async throws -> BatchCheckEntitlementsResponse {
        try await self.call(.batchCheckEntitlements, request, timeout: timeout)
    }

    /// SubmitPurchase: a purchase the app holds (a StoreKit 2 signed transaction, or a Google
    /// Play purchase token), verified with its store and recorded for the user; answered
    /// with the user's entitlements once it is applied.
    public func submitPurchase(_ request: SubmitPurchaseRequest, timeout: Duration? = nil) async throws -> SubmitPurchaseResponse {
        try await self.call(.submitPurchase, request, timeout: timeout)
    }

    /// Health: whether the server is serving, its snapshot and uptime.
    public func health(timeout: Duration? = nil) async throws -> HealthResponse {
        try await self.call(.health, HealthRequest(), timeout: timeout)
    }

    /// Closes every connection (and the near-cache's watch). Calls in flight fail with
    /// UNAVAILABLE.
    public func close() async {
        await self.nearCache?.close()
        for slot in self.slots {
            if let channel = slot.takeChannel() {
                try? await channel.close()
            }
        }
    }

    /// Sends any request message and decodes the answer as `Response`.
    public func call<Request: ProtobufMessage, Response: ProtobufMessage>(
        _ method: MethodID,
        _ request: Request,
        timeout: Duration? = nil
    ) async throws -> Response {
        try await self.callMeasured(method, request, timeout: timeout).0
    }

    /// ``call(_:_:timeout:)``, with the answer's size on the wire.
    private func callMeasured<Request: ProtobufMessage, Response: ProtobufMessage>(
        _ method: MethodID,
        _ request: Request,
        timeout: Duration?
    ) async throws -> (Response, Int) {
        let payload: ByteBuffer
        do {
            var buffer = ByteBuffer()
            try request.serialize(into: &buffer)
            payload = buffer
        } catch {
            throw EntitlementsClientError(code: .invalidArgument, message: "\(error)")
        }
        let amount = timeout.map(TimeAmount.init)  // clamped to Int64.max nanoseconds
        let ticket = self.nextSlot.wrappingAdd(1, ordering: .relaxed).oldValue & Int.max
        let slot = self.slots[ticket % self.slots.count]
        var attempt = 0
        while true {
            attempt += 1
            let connection = try await self.connection(in: slot)
            do {
                let frame = try await connection.channel.eventLoop.flatSubmit {
                    connection.handler.value.call(method: method, payload: payload, timeout: amount)
                }.get()
                guard frame.status == .ok else {
                    throw EntitlementsClientError(code: frame.status, message: frame.message)
                }
                do {
                    return (try Response(buffer: frame.payload, toleratingUnknownEnumValues: true), frame.payload.readableBytes)
                } catch {
                    throw EntitlementsClientError(code: .internalError, message: "the server's answer does not decode: \(error)")
                }
            } catch let failure as CallFailure {
                switch failure {
                case .notProcessed where attempt == 1:
                    slot.forget(connection.channel)
                    continue  // the server never processed it: safe to send again
                case .notProcessed:
                    throw EntitlementsClientError(code: .unavailable, message: "the server is going away and did not process the call")
                case .timedOut:
                    throw EntitlementsClientError(code: .deadlineExceeded, message: "no answer within the timeout")
                case .connectionLost(let reason):
                    slot.forget(connection.channel)
                    throw EntitlementsClientError(code: .unavailable, message: "connection to \(self.configuration.server) lost: \(reason)")
                case .connectionError(let code, let message):
                    slot.forget(connection.channel)
                    throw EntitlementsClientError(code: code, message: message)
                }
            }
        }
    }

    /// Opens a WatchEntitlements stream: an event each time a watched customer's answer
    /// changes. The sequence ends with an error carrying the server's status (e.g.
    /// RESOURCE_EXHAUSTED for a watcher that fell behind: resubscribe); stopping iteration
    /// cancels the stream.
    public func watch(_ request: WatchEntitlementsRequest) async throws -> AsyncThrowingStream<EntitlementsChangedEvent, any Error> {
        try await self.openWatch(request).events
    }

    /// A watch, and a PING of the connection it runs on (the near-cache's proof that the
    /// watch is alive: its PONG comes after every event the server sent before it).
    struct OpenWatch: Sendable {
        let events: AsyncThrowingStream<EntitlementsChangedEvent, any Error>
        /// Succeeds when a PONG comes back within the timeout; throws otherwise.
        let ping: @Sendable (TimeAmount) async throws -> Void
    }

    /// ``watch(_:)``, with a way to PING the watch's connection.
    func openWatch(_ request: WatchEntitlementsRequest) async throws -> OpenWatch {
        let payload: ByteBuffer
        do {
            var buffer = ByteBuffer()
            try request.serialize(into: &buffer)
            payload = buffer
        } catch {
            throw EntitlementsClientError(code: .invalidArgument, message: "\(error)")
        }
        let ticket = self.nextSlot.wrappingAdd(1, ordering: .relaxed).oldValue & Int.max
        let connection = try await self.connection(in: self.slots[ticket % self.slots.count])
        let (stream, continuation) = AsyncThrowingStream.makeStream(of: EntitlementsChangedEvent.self)
        let handler = connection.handler
        let started = try await connection.channel.eventLoop.submit {
            handler.value.openStream(
                method: .watchEntitlements,
                payload: payload,
                message: { buffer in
                    do {
                        continuation.yield(try EntitlementsChangedEvent(buffer: buffer, toleratingUnknownEnumValues: true))
                    } catch {
                        continuation.finish(throwing: EntitlementsClientError(code: .internalError, message: "an event does not decode: \(error)"))
                    }
                },
                end: { status, message in
                    continuation.finish(throwing: status == .ok ? nil : EntitlementsClientError(code: status, message: message))
                }
            )
        }.get()
        let loop = connection.channel.eventLoop
        if let id = started {
            continuation.onTermination = { _ in
                loop.execute { handler.value.cancelStream(id) }
            }
        }
        return OpenWatch(events: stream) { timeout in
            let (id, answered) = try await loop.submit { handler.value.ping(timeout: timeout) }.get()
            try await withTaskCancellationHandler {
                try await answered.get()
            } onCancel: {
                loop.execute { handler.value.cancelPing(id) }
            }
        }
    }

    // MARK: Connections

    struct Connection: Sendable {
        let channel: any Channel
        let handler: NIOLoopBound<ClientConnectionHandler>
    }

    /// One pooled connection and its reconnect state.
    final class Slot: Sendable {
        private struct State {
            var connection: Connection?
            /// The attempt in progress, which concurrent callers share.
            var connecting: EventLoopFuture<Connection>?
            var failures = 0
            var nextAttempt = NIODeadline.uptimeNanoseconds(0)
            /// Whether the last failed attempt could not reach the server (UNAVAILABLE), not
            /// one the server refused (a token) or the settings (TLS) made fail.
            var lastFailureUnreachable = false
        }

        /// Either the attempt in progress, or a new promise the caller must complete.
        enum Attempt {
            /// Another caller's attempt finished after this caller looked: use its connection.
            case ready(Connection)
            case join(EventLoopFuture<Connection>)
            case lead(EventLoopPromise<Connection>)
        }

        /// Starts or joins the attempt that replaces `unusable` (the connection the caller
        /// found closed or draining, or nil if there was none).
        func beginAttempt(on loop: any EventLoop, replacing unusable: Connection?) -> Attempt {
            self.state.withLock { state in
                if let connection = state.connection, connection.channel !== unusable?.channel, connection.channel.isActive {
                    return .ready(connection)
                }
                if let connecting = state.connecting {
                    return .join(connecting)
                }
                let promise = loop.makePromise(of: Connection.self)
                state.connecting = promise.futureResult
                return .lead(promise)
            }
        }

        func endAttempt() {
            self.state.withLock { $0.connecting = nil }
        }

        private let state = Mutex(State())

        func current() -> Connection? {
            self.state.withLock { $0.connection }
        }

        func store(_ connection: Connection) {
            self.state.withLock {
                $0.connection = connection
                $0.failures = 0
            }
        }

        func forget(_ channel: any Channel) {
            self.state.withLock { state in
                if let connection = state.connection, connection.channel === channel {
                    state.connection = nil
                }
            }
        }

        func takeChannel() -> (any Channel)? {
            self.state.withLock { state in
                defer { state.connection = nil }
                return state.connection?.channel
            }
        }

        /// Records a failed attempt; returns when the next may start.
        func failed(initial: TimeAmount, maximum: TimeAmount, unreachable: Bool) {
            self.state.withLock { state in
                state.failures += 1
                state.lastFailureUnreachable = unreachable
                let exponent = min(state.failures - 1, 16)
                let delay = min(maximum.nanoseconds, initial.nanoseconds << exponent)
                // Full jitter keeps many clients from reconnecting in step.
                state.nextAttempt = .now() + .nanoseconds(Int64.random(in: delay / 2...max(delay / 2, delay)))
            }
        }

        var nextAttempt: NIODeadline {
            self.state.withLock { $0.nextAttempt }
        }

        /// Whether the slot has no connection, its last attempt could not reach the server,
        /// and the next may not start yet: a call now would wait for the backoff.
        var isBackingOffUnreachable: Bool {
            self.state.withLock { state in
                state.failures > 0 && state.lastFailureUnreachable && !(state.connection?.channel.isActive ?? false) && state.nextAttempt > .now()
            }
        }
    }

    private func connection(in slot: Slot) async throws -> Connection {
        let current = slot.current()
        if let connection = current, connection.channel.isActive,
            try await connection.channel.eventLoop.submit({ !connection.handler.value.isDraining }).get()
        {
            return connection
        }
        // One attempt per slot at a time: callers arriving meanwhile wait for it, so a burst
        // of first calls (or of retries after GOAWAY) opens one connection, not one each.
        switch slot.beginAttempt(on: self.group.next(), replacing: current) {
        case .ready(let connection):
            return connection
        case .join(let attempt):
            return try await attempt.get()
        case .lead(let promise):
            do {
                let connection = try await self.connect(slot)
                slot.store(connection)
                slot.endAttempt()
                promise.succeed(connection)
                return connection
            } catch {
                slot.failed(
                    initial: self.configuration.initialBackoff,
                    maximum: self.configuration.maximumBackoff,
                    unreachable: (error as? EntitlementsClientError)?.code == .unavailable
                )
                slot.endAttempt()
                promise.fail(error)
                throw error
            }
        }
    }

    private func connect(_ slot: Slot) async throws -> Connection {
        let wait = slot.nextAttempt - .now()
        if wait.nanoseconds > 0 {
            try await Task.sleep(nanoseconds: UInt64(wait.nanoseconds))
        }
        let configuration = self.configuration
        var sslContext: NIOSSLContext?
        if let tls = configuration.tls {
            do {
                sslContext = try NIOSSLContext(configuration: tls)
            } catch {
                throw EntitlementsClientError(code: .invalidArgument, message: "the TLS settings cannot be used: \(error)")
            }
        }
        var hostname = configuration.serverHostname
        if hostname == nil, case .tcp(let host, _) = configuration.server, !Self.isIPAddress(host) {
            hostname = host
        }
        let serverHostname = hostname
        let tlsContext = sslContext
        // The handler, kept from the initializer: a connection whose TLS handshake fails is
        // torn down at once, and its handler is then no longer in the pipeline to look up,
        // while the calls made on it must still fail with the handshake's reason.
        let made = Mutex<NIOLoopBound<ClientConnectionHandler>?>(nil)
        let bootstrap = ClientBootstrap(group: self.group)
            .connectTimeout(configuration.connectTimeout)
            .channelOption(.socketOption(.tcp_nodelay), value: 1)
            .channelInitializer { channel in
                channel.eventLoop.makeCompletedFuture {
                    if let tlsContext {
                        try channel.pipeline.syncOperations.addHandler(try NIOSSLClientHandler(context: tlsContext, serverHostname: serverHostname))
                    }
                    let handler = ClientConnectionHandler()
                    try channel.pipeline.syncOperations.addHandlers(
                        ByteToMessageHandler(FrameDecoder(maximumPayloadSize: configuration.maximumPayloadSize)),
                        handler
                    )
                    made.withLock { $0 = NIOLoopBound(handler, eventLoop: channel.eventLoop) }
                }
            }
        do {
            let channel: any Channel
            switch configuration.server {
            case .tcp(let host, let port):
                channel = try await bootstrap.connect(host: host, port: port).get()
            case .unixSocket(let path):
                channel = try await bootstrap.connect(unixDomainSocketPath: path).get()
            }
            guard let handler = made.withLock({ $0 }) else {
                throw EntitlementsClientError(code: .internalError, message: "the connection to \(configuration.server) has no handler")
            }
            let connection = Connection(channel: channel, handler: handler)
            if let token = configuration.token {
                try await self.authenticate(connection, token: token)
            }
            return connection
        } catch let error as EntitlementsClientError {
            throw error
        } catch {
            throw EntitlementsClientError(code: .unavailable, message: "cannot connect to \(configuration.server): \(Self.connectFailure(error, to: configuration.server))")
        }
    }

    /// Why connecting failed, in words a person can act on (``ConnectFailure``).
    static func connectFailure(_ error: any Error, to server: EntitlementsServerAddress) -> String {
        guard let connection = error as? NIOConnectionError else {
            if case .unixSocket = server {
                return ConnectFailure.reason(error, service: "the server", socketFile: true)
            }
            return ConnectFailure.reason(error, service: "the server")
        }
        return ConnectFailure.reason(
            attempts: connection.connectionErrors.map(\.error),
            resolution: connection.dnsAError ?? connection.dnsAAAAError,
            service: "the server"
        )
    }

    /// Presents the token on a new connection (docs/PROTOCOL.md, "Authentication"); a
    /// refusal closes it and fails the call that wanted it, with the server's reason.
    private func authenticate(_ connection: Connection, token: EntitlementsClientToken) async throws {
        var payload = ByteBuffer()
        do {
            try AuthenticateRequest(token: try token.read()).serialize(into: &payload)
            let request = payload
            let frame = try await connection.channel.eventLoop.flatSubmit {
                connection.handler.value.call(method: .authenticate, payload: request, timeout: self.configuration.connectTimeout)
            }.get()
            guard frame.status == .ok else {
                throw EntitlementsClientError(code: frame.status, message: frame.message)
            }
        } catch {
            try? await connection.channel.close()
            if let error = error as? EntitlementsClientError {
                throw error
            }
            throw EntitlementsClientError(code: .unavailable, message: "cannot connect to \(self.configuration.server): \(error)")
        }
    }

    /// Whether `host` is an IP address (no name to check in the server's certificate: a
    /// certificate for an address carries it as an IP SAN, which NIOSSL checks anyway).
    static func isIPAddress(_ host: String) -> Bool {
        (try? SocketAddress(ipAddress: host, port: 0)) != nil
    }
}
