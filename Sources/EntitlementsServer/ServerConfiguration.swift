public import EntitlementsSecurity
public import EntitlementsCache
public import EntitlementsStore
public import EntitlementsWire
public import NIOCore
import NIOPosix

/// How `entitlements serve` runs. Every field has the documented default.
public struct ServerConfiguration: Sendable {
    /// Where to accept TCP connections; nil for none. Default `127.0.0.1:7420`.
    public var tcp: (host: String, port: Int)?
    /// A Unix domain socket path to accept connections on too (for sidecars); nil for none.
    public var unixSocketPath: String?
    /// How many resolver actors (and cache shards). Default: the number of CPU cores.
    public var resolvers: Int
    /// The cache budget, shared equally by the resolvers. Default 256 MiB.
    public var cacheBytes: Int
    /// The largest frame payload accepted. Default 1 MiB.
    public var maximumPayloadSize: Int
    /// Requests in flight on one connection before the server stops reading it. Default 1,024.
    public var maximumInFlightPerConnection: Int
    /// The most user ids in one BatchCheckEntitlements. Default 1,000.
    public var maximumBatchSize: Int
    /// The most connections open at once; one more gets an ERROR frame
    /// (RESOURCE_EXHAUSTED) and is closed. Default 10,000.
    public var maximumConnections: Int
    /// A connection with nothing in flight and no watch for this long gets a GOAWAY and
    /// is closed. Default 5 minutes.
    public var idleTimeout: TimeAmount
    /// A frame must arrive in full this long after its first byte, or the connection is
    /// cut off (a slow sender holding a connection: slowloris). Default 10 s.
    public var frameTimeout: TimeAmount
    /// How long a closing connection (drained, idle, or after a connection error) waits,
    /// with its sending side shut down, for the client to close its side, reading and
    /// dropping what arrives, before it is closed. Default 5 s.
    public var closeLinger: TimeAmount
    /// The most WatchEntitlements streams open at once. Default 1,024.
    public var maximumWatchStreams: Int
    /// Events a watch holds while its socket is full before it is ended with
    /// RESOURCE_EXHAUSTED. Default 1,024.
    public var watchBufferEvents: Int
    /// Reported by Health.
    public var version: String
    /// How long a check with `min_log_sequence` waits for this server to apply that
    /// sequence before it fails UNAVAILABLE. Default 100 ms.
    public var minimumSequenceWait: TimeAmount
    /// Fleet mode: past this long since this server last heard from PostgreSQL (its last
    /// successful poll), its check answers are stale, and ``stalePolicy`` says what to do.
    /// nil: never stale (and always so for a server that is its own source of truth).
    /// Default nil; `serve` sets 30 s.
    public var maximumStaleness: TimeAmount?
    /// What a stale server does with checks. Default `.open`.
    public var stalePolicy: StalePolicy
    /// Who may do what on the TCP listener, its tokens and TLS (docs/security.md).
    /// Default: anyone may do anything, in the clear (`serve` applies its settings).
    public var tcpSecurity: ListenerSecurity = .open("tcp")
    /// The same for the Unix socket (never TLS: the file's mode and owner guard it).
    public var unixSecurity: ListenerSecurity = .open("unix")
    /// The Unix socket file's mode. Default 0660: the owner and the group may connect.
    public var unixSocketMode: UInt32 = 0o660
    /// How cache misses are read: on how many threads of their own, with how long a queue
    /// (docs/architecture.md, "Cold reads").
    public var coldReads = ColdReadSettings()
    /// What a full cache keeps (docs/architecture.md, "What a full cache keeps"). Default
    /// ``AnswerCache/Policy/tinyLFU``.
    public var cachePolicy: AnswerCache.Policy = .tinyLFU
    /// The Unix socket file's owner and group ids; nil keeps the server's.
    public var unixSocketOwner: UInt32?
    public var unixSocketGroup: UInt32?

    /// What a fleet server past ``maximumStaleness`` does with checks and batches.
    public enum StalePolicy: String, Sendable, CaseIterable {
        /// Answers from what it applied, each answer flagged `stale`.
        case open
        /// Refuses them with UNAVAILABLE (and Health says NOT_SERVING), so that callers
        /// and load balancers go to a server that is current.
        case closed
    }

    /// Creates a configuration; `resolvers` nil means one per CPU core.
    public init(
        tcp: (host: String, port: Int)? = ("127.0.0.1", 7420),
        unixSocketPath: String? = nil,
        resolvers: Int? = nil,
        cacheBytes: Int = 256 << 20,
        maximumPayloadSize: Int = Frame.defaultMaximumPayloadSize,
        maximumInFlightPerConnection: Int = 1_024,
        maximumBatchSize: Int = 1_000,
        maximumWatchStreams: Int = 1_024,
        watchBufferEvents: Int = 1_024,
        maximumConnections: Int = 10_000,
        idleTimeout: TimeAmount = .minutes(5),
        frameTimeout: TimeAmount = .seconds(10),
        closeLinger: TimeAmount = .seconds(5),
        minimumSequenceWait: TimeAmount = .milliseconds(100),
        maximumStaleness: TimeAmount? = nil,
        stalePolicy: StalePolicy = .open,
        version: String = "0.1.0"
    ) {
        self.minimumSequenceWait = minimumSequenceWait
        self.maximumStaleness = maximumStaleness
        self.stalePolicy = stalePolicy
        self.maximumConnections = maximumConnections
        self.idleTimeout = idleTimeout
        self.frameTimeout = frameTimeout
        self.closeLinger = closeLinger
        self.maximumWatchStreams = maximumWatchStreams
        self.watchBufferEvents = watchBufferEvents
        self.tcp = tcp
        self.unixSocketPath = unixSocketPath
        self.resolvers = resolvers ?? System.coreCount
        self.cacheBytes = cacheBytes
        self.maximumPayloadSize = maximumPayloadSize
        self.maximumInFlightPerConnection = maximumInFlightPerConnection
        self.maximumBatchSize = maximumBatchSize
        self.version = version
    }
}

extension ServerConfiguration {
    /// Fleet mode: how long since `store` was last current (Unix milliseconds), when that
    /// is past ``maximumStaleness``; nil when it is not stale, and always for a store that
    /// is its own source of truth (docs/fleet.md, "Staleness"). Checks, Health, /readyz and
    /// the stale gauge all ask this.
    public func staleness(of store: CustomerStore) -> Int64? {
        guard let bound = self.maximumStaleness, let contact = store.lastUpstreamContact else {
            return nil
        }
        let since = WallClock.unixMilliseconds() - contact
        return since > bound.nanoseconds / 1_000_000 ? since : nil
    }
}
