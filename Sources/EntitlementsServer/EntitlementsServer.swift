public import EntitlementsSecurity
public import EntitlementsCache
public import EntitlementsStore
import EntitlementsWire
public import Logging
public import NIOCore
import NIOExtras
public import NIOPosix
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Another server already accepts connections on this Unix socket.
public struct UnixSocketInUse: Error, CustomStringConvertible {
    public var path: String
    public var description: String { "another server is listening on \(self.path)" }
}

/// The Unix socket's mode or owner could not be set.
public struct UnixSocketPermissionError: Error, CustomStringConvertible {
    public var description: String
}

/// Whether the server is serving, and since when: what Health reports.
final class ServerHealth: Sendable {
    private let started = NIODeadline.now()
    private let serving = Atomic<Bool>(true)

    var isServing: Bool { self.serving.load(ordering: .relaxed) }

    func stopServing() {
        self.serving.store(false, ordering: .relaxed)
    }

    var uptimeMilliseconds: UInt64 {
        UInt64(max(0, (NIODeadline.now() - self.started).nanoseconds / 1_000_000))
    }
}

/// What every connection of a server shares: the resolvers, the store, the watches.
final class ServerServices: Sendable {
    let pool: ResolverPool
    var store: CustomerStore { self.pool.store }
    let watches: WatchHub
    let health: ServerHealth
    let connections: ConnectionCounter
    let metrics: ServerMetrics
    let logger: Logger
    /// Every open connection, to close them at once when a drain is cut short.
    let channels = Mutex<[ObjectIdentifier: any Channel]>([:])
    /// Where background work (compaction) reports.
    let report: @Sendable (String) -> Void

    init(
        pool: ResolverPool,
        watches: WatchHub,
        health: ServerHealth,
        connections: ConnectionCounter,
        metrics: ServerMetrics,
        logger: Logger,
        report: @escaping @Sendable (String) -> Void
    ) {
        self.logger = logger
        self.pool = pool
        self.metrics = metrics
        self.connections = connections
        self.watches = watches
        self.health = health
        self.report = report
    }

    /// A write is durable and visible: every resolver drops what it changed, then watchers
    /// are told (so that a check sent by a client that saw the event cannot be answered
    /// from what the write changed), then `done` lets the store acknowledge it. A write made
    /// here and one applied from fleet mode's change log both come this way, so both can
    /// start a compaction.
    func afterCommit(_ write: CustomerStore.CommittedWrite, done: @escaping @Sendable () -> Void) {
        let loop = self.pool.resolvers[0].eventLoop
        let invalidated = self.pool.invalidate(after: write, on: loop)
        invalidated.whenComplete { _ in
            self.watches.publish(write)
            self.metrics.writes.increment()
            done()
            self.compactIfNeeded()
        }
    }

    /// Counts a refused call or connection and logs it (at most once a second per listener
    /// and reason), naming the peer and never a token.
    func recordRefusal(_ refusal: Refusal, listener: String?, peer: String) {
        let listener = listener ?? "-"
        if self.metrics.refused(listener: listener, reason: refusal.reason.rawValue) {
            self.logger.notice(
                "refused",
                metadata: ["listener": "\(listener)", "peer": "\(peer)", "reason": "\(refusal.reason.rawValue)", "status": "\(refusal.status)", "why": "\(refusal.message)"]
            )
        }
    }

    /// Compacts now (the Compact method, `entitlements compact`).
    func compact() async throws -> CustomerStore.CompactionReport {
        let hotList = await self.pool.hotList()
        let report = try await self.store.compact(hotList: hotList, now: WallClock.unixMilliseconds())
        self.metrics.compactions.increment()
        if !report.historyProblems.isEmpty {
            // The compaction succeeded; what customers' histories need was not all kept.
            self.report("warning: compaction could not keep all that customers' histories need, so they start later than --history-retention says: \(report.historyProblems.joined(separator: "; "))")
        }
        return report
    }

    /// Starts a compaction in the background if the log has grown past the threshold.
    func compactIfNeeded() {
        guard self.store.shouldCompact else {
            return
        }
        Task {
            do {
                let done = try await self.compact()
                self.report("compacted: snapshot \(done.snapshotId) holds writes up to \(done.lastLogSequence), \(done.customers) customers; removed \(done.removedSegments.count) log segments")
            } catch let refusal as WriteRefusal where refusal.reason == .failedPrecondition {
                // Another compaction is running.
            } catch {
                self.report("compaction failed (the log and the old snapshot stay as they were): \(error)")
            }
        }
    }
}

/// A listener that speaks a protocol of its own beside the framed one (the gRPC and
/// HTTP/JSON doors, docs/doors.md) over the same methods. The server binds it, counts its
/// connections against --max-connections, tracks them for a drain (each gets
/// `ChannelShouldQuiesceEvent`) and closes them at shutdown, as it does its own.
public struct ServerDoor: Sendable {
    /// Names the door in logs and in ``EntitlementsServer/doorAddresses``.
    public var name: String
    public var host: String
    public var port: Int
    /// Who may do what through the door, and its TLS (added before `configure` runs).
    public var security: ListenerSecurity
    /// What the door speaks inside TLS (ALPN, and whether client certificates are asked for).
    public var protocols: ServerTLS.Protocols
    /// Sets up an accepted connection's pipeline, on its event loop, after TLS if any; the
    /// credentials are the connection's (its client certificate, once the handshake is done).
    public var configure: @Sendable (any Channel, EntitlementMethods, ConnectionCredentials) throws -> Void

    public init(
        name: String,
        host: String,
        port: Int,
        security: ListenerSecurity,
        protocols: ServerTLS.Protocols = .http,
        configure: @escaping @Sendable (any Channel, EntitlementMethods, ConnectionCredentials) throws -> Void
    ) {
        self.name = name
        self.host = host
        self.port = port
        self.security = security
        self.protocols = protocols
        self.configure = configure
    }
}

/// The framed RPC server of docs/PROTOCOL.md: listens on TCP and/or a Unix socket,
/// decodes frames on the event loops, and answers from a ``ResolverPool``.
public final class EntitlementsServer: Sendable {
    /// The bound TCP address (with the real port when configured with port 0).
    public let tcpAddress: SocketAddress?
    /// The Unix socket path, if any.
    public let unixSocketPath: String?
    /// Where each door listens, by its name (the real port when configured with port 0).
    public let doorAddresses: [String: SocketAddress]
    /// The methods every transport of this server calls.
    public let methods: EntitlementMethods
    /// The resolvers and their caches.
    public let pool: ResolverPool
    /// The customers: snapshot, log and the writes since the snapshot.
    public var store: CustomerStore { self.pool.store }
    private let services: ServerServices

    private let listeners: [any Channel]
    /// One per listener (a helper collects the connections of the one listener it was
    /// made for); empty once a drain has finished (see ``shutdownGracefully()``).
    private let quiescing: Mutex<[ServerQuiescingHelper]>
    private let health: ServerHealth
    /// The event loops the server runs on.
    public let group: any EventLoopGroup

    private init(
        tcpAddress: SocketAddress?,
        unixSocketPath: String?,
        doorAddresses: [String: SocketAddress],
        methods: EntitlementMethods,
        listeners: [any Channel],
        quiescing: [ServerQuiescingHelper],
        group: any EventLoopGroup
    ) {
        self.tcpAddress = tcpAddress
        self.unixSocketPath = unixSocketPath
        self.doorAddresses = doorAddresses
        self.methods = methods
        self.pool = methods.services.pool
        self.services = methods.services
        self.listeners = listeners
        self.quiescing = Mutex(quiescing)
        self.health = methods.services.health
        self.group = group
    }

    /// Reads the values metrics take at scrape time (cache counters from every resolver,
    /// the snapshot, the log) into ``ServerMetrics``.
    public func refreshMetrics() async {
        var total = AnswerCache.Statistics()
        for resolver in self.pool.resolvers {
            total = total + (await resolver.cacheStatistics)
        }
        self.services.metrics.refresh(cache: total, coldReads: self.pool.coldReads.statistics, store: self.store, now: WallClock.unixMilliseconds(), isReady: self.health.isServing)
    }

    /// Compacts the data directory now: a new snapshot with every acknowledged write.
    public func compact() async throws -> CustomerStore.CompactionReport {
        try await self.services.compact()
    }

    /// Serves `snapshot` read-only (writes answer UNAVAILABLE).
    public static func start(
        snapshot: SnapshotReader,
        configuration: ServerConfiguration,
        group: MultiThreadedEventLoopGroup,
        resolverLoops: [any EventLoop]? = nil,
        warmAt instant: Int64? = nil
    ) async throws -> EntitlementsServer {
        try await Self.start(
            store: .readOnly(snapshot),
            configuration: configuration,
            group: group,
            resolverLoops: resolverLoops,
            warmAt: instant
        )
    }

    /// Opens the resolvers over `store`, warms their caches (at `instant`, default now),
    /// and starts listening. `resolverLoops` puts the resolvers on other event loops than
    /// the connections' (tests use it to hold resolvers still). `report` receives what
    /// background work (compaction) has to say.
    public static func start(
        store: CustomerStore,
        configuration: ServerConfiguration,
        group: MultiThreadedEventLoopGroup,
        resolverLoops: [any EventLoop]? = nil,
        warmAt instant: Int64? = nil,
        metrics: ServerMetrics = ServerMetrics(),
        logger: Logger = Logger(label: "entitlements.server"),
        doors: [ServerDoor] = [],
        tracing: CallTracing? = nil,
        purchases: (any PurchaseVerifier)? = nil,
        report: @escaping @Sendable (String) -> Void = { _ in }
    ) async throws -> EntitlementsServer {
        // By default the resolvers run on the connections' event loops, so a check whose
        // customer belongs to the connection's loop costs no hop at all.
        let loops = resolverLoops ?? Array(group.makeIterator())
        let pool = try ResolverPool(
            count: max(1, configuration.resolvers),
            eventLoops: loops,
            store: store,
            cacheBytes: configuration.cacheBytes,
            cachePolicy: configuration.cachePolicy,
            warmAt: instant ?? WallClock.unixMilliseconds(),
            coldReads: configuration.coldReads
        )
        let health = ServerHealth()
        let services = ServerServices(
            pool: pool,
            watches: WatchHub(maximumWatches: configuration.maximumWatchStreams, metrics: metrics),
            health: health,
            connections: ConnectionCounter(maximum: configuration.maximumConnections),
            metrics: metrics,
            logger: logger,
            report: report
        )
        store.onCommit { write, done in services.afterCommit(write, done: done) }
        let methods = EntitlementMethods(services: services, configuration: configuration, tracing: tracing, purchases: purchases)
        // A quiescing helper per listener: one helper keeps the connections of the first
        // listener it was given only, so with one for both the Unix socket's connections
        // were never drained.
        var quiescing: [ServerQuiescingHelper] = []
        func bootstrap(
            _ security: ListenerSecurity,
            _ protocols: ServerTLS.Protocols = .framed,
            _ configure: @escaping @Sendable (any Channel, ConnectionCredentials) throws -> Void = { channel, credentials in
                try channel.pipeline.syncOperations.addHandler(ServerConnectionHandler(methods: methods, eventLoop: channel.eventLoop, credentials: credentials))
            },
            refuse: @escaping @Sendable (any Channel) throws -> Void = { channel in
                try channel.pipeline.syncOperations.addHandler(RefusedConnectionHandler(maximum: configuration.maximumConnections))
            }
        ) -> ServerBootstrap {
            let helper = ServerQuiescingHelper(group: group)
            quiescing.append(helper)
            return ServerBootstrap(group: group)
                .serverChannelOption(.backlog, value: 1_024)
                .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
                .serverChannelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        try channel.pipeline.syncOperations.addHandler(helper.makeServerChannelHandler(channel: channel))
                    }
                }
                .childChannelOption(.socketOption(.tcp_nodelay), value: 1)
                .childChannelOption(.maxMessagesPerRead, value: 16)
                .childChannelInitializer { channel in
                    channel.eventLoop.makeCompletedFuture {
                        guard services.connections.admit() else {
                            if security.tls != nil {
                                // A refusal in the clear means nothing to a TLS client.
                                logger.info("connection refused", metadata: ["listener": "\(security.policy.name)", "connections": "\(configuration.maximumConnections)"])
                                channel.close(promise: nil)
                            } else {
                                try refuse(channel)
                            }
                            return
                        }
                        services.metrics.connections.increment()
                        let id = ObjectIdentifier(channel)
                        services.channels.withLock { $0[id] = channel }
                        channel.closeFuture.whenComplete { _ in
                            services.connections.release()
                            services.metrics.connections.decrement()
                            services.channels.withLock { $0[id] = nil }
                        }
                        let peer = channel.remoteAddress.map(Self.describe) ?? security.policy.name
                        let credentials = ConnectionCredentials(security: security, peer: peer)
                        if let tls = security.tls {
                            try tls.configure(channel, protocols, credentials: credentials) { refusal in
                                services.recordRefusal(refusal, listener: security.policy.name, peer: peer)
                            }
                        }
                        try configure(channel, credentials)
                    }
                }
        }
        var listeners: [any Channel] = []
        var tcpAddress: SocketAddress?
        var doorAddresses: [String: SocketAddress] = [:]
        do {
            if let tcp = configuration.tcp {
                let channel = try await bootstrap(configuration.tcpSecurity).bind(host: tcp.host, port: tcp.port).get()
                listeners.append(channel)
                tcpAddress = channel.localAddress
            }
            if let path = configuration.unixSocketPath {
                // A stale socket file (a previous server that died) is replaced; a live
                // one belongs to a running server and is left alone.
                if Self.someoneListens(onUnixSocket: path) {
                    throw UnixSocketInUse(path: path)
                }
                // Bound at a private name, given its mode and owner, then renamed into
                // place: no client can connect before the file's permissions are right.
                let temporary = path + ".\(getpid()).binding"
                let channel = try await bootstrap(configuration.unixSecurity).bind(unixDomainSocketPath: temporary, cleanupExistingSocketFile: true).get()
                listeners.append(channel)
                try Self.setUnixSocketPermissions(temporary, configuration)
                guard rename(temporary, path) == 0 else {
                    let reason = String(cString: strerror(errno))
                    unlink(temporary)
                    throw UnixSocketPermissionError(description: "cannot move the socket into place at \(path): \(reason)")
                }
            }
            for door in doors {
                let channel = try await bootstrap(door.security, door.protocols, { channel, credentials in
                    try door.configure(channel, methods, credentials)
                }, refuse: { channel in
                    // Not framed: the door's protocol has no way to say why before it
                    // starts, so the connection is closed (and the refusal logged).
                    logger.info("connection refused", metadata: ["door": "\(door.name)", "connections": "\(configuration.maximumConnections)"])
                    channel.close(promise: nil)
                }).bind(host: door.host, port: door.port).get()
                listeners.append(channel)
                doorAddresses[door.name] = channel.localAddress
            }
        } catch {
            for channel in listeners {
                try? await channel.close()
            }
            throw error
        }
        return EntitlementsServer(
            tcpAddress: tcpAddress,
            unixSocketPath: configuration.unixSocketPath,
            doorAddresses: doorAddresses,
            methods: methods,
            listeners: listeners,
            quiescing: quiescing,
            group: group
        )
    }

    /// A peer's address for logs: `10.0.0.5:51234`, `[::1]:51234`, or `unix`.
    public static func describe(_ address: SocketAddress) -> String {
        switch address {
        case .v4: "\(address.ipAddress ?? "?"):\(address.port ?? 0)"
        case .v6: "[\(address.ipAddress ?? "?")]:\(address.port ?? 0)"
        case .unixDomainSocket: "unix"
        }
    }

    /// Gives the socket file its mode and owner (--unix-mode, --unix-owner).
    static func setUnixSocketPermissions(_ path: String, _ configuration: ServerConfiguration) throws {
        if configuration.unixSocketOwner != nil || configuration.unixSocketGroup != nil {
            let owner = configuration.unixSocketOwner.map { uid_t($0) } ?? uid_t.max  // -1: unchanged
            let group = configuration.unixSocketGroup.map { gid_t($0) } ?? gid_t.max
            guard chown(path, owner, group) == 0 else {
                let reason = String(cString: strerror(errno))
                unlink(path)
                throw UnixSocketPermissionError(description: "cannot give the socket owner \(configuration.unixSocketOwner.map(String.init) ?? "-") and group \(configuration.unixSocketGroup.map(String.init) ?? "-"): \(reason) (changing the owner needs root; the group, membership of it)")
            }
        }
        guard chmod(path, mode_t(configuration.unixSocketMode)) == 0 else {
            let reason = String(cString: strerror(errno))
            unlink(path)
            throw UnixSocketPermissionError(description: "cannot set the socket's mode to \(String(configuration.unixSocketMode, radix: 8)): \(reason)")
        }
    }

    /// Whether a server accepts connections on the Unix socket at `path`.
    static func someoneListens(onUnixSocket path: String) -> Bool {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue), 0)
        guard fd >= 0 else {
            return false
        }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        guard bytes.count < MemoryLayout.size(ofValue: address.sun_path) else {
            return false
        }
        withUnsafeMutableBytes(of: &address.sun_path) { raw in
            raw.copyBytes(from: bytes)
        }
        let result = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
        return result == 0
    }

    /// Closes every connection now, answered or not (a drain that ran out of time). Checks
    /// still queued on the resolvers' loops are not run: they fail UNAVAILABLE at once.
    public func closeAllConnections() {
        self.pool.abandonQueuedChecks()
        for channel in self.services.channels.withLock({ Array($0.values) }) {
            channel.close(promise: nil)
        }
    }

    /// Whether the server serves checks (false once a drain has started).
    public var isServing: Bool { self.health.isServing }

    /// Open connections.
    public var connectionCount: Int { self.services.connections.count }

    /// Stops accepting, sends GOAWAY on every connection, lets each finish the requests it
    /// accepted, and returns when every connection and listener is closed.
    public func shutdownGracefully() async {
        self.health.stopServing()
        let loop = self.group.next()
        let drained = self.quiescing.withLock { helpers in
            helpers.map { helper in
                let promise = loop.makePromise(of: Void.self)
                helper.initiateShutdown(promise: promise)
                return promise.futureResult
            }
        }
        if !drained.isEmpty {
            try? await EventLoopFuture.andAllComplete(drained, on: loop).get()
            // A helper fails a promise of the group's when it deinits: let that happen on
            // the group now, not whenever the server is released, perhaps after the group
            // has shut down (which NIO reports, and will make a crash).
            try? await loop.submit { self.quiescing.withLock { $0.removeAll() } }.get()
        }
        // Every call was answered: no cold read is still wanted.
        await self.pool.shutdown()
        // Every acknowledged write is durable already; this waits for queued ones.
        self.store.close()
    }
}
