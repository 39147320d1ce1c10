public import CoreMetrics
import EntitlementsCache
import EntitlementsStore
public import EntitlementsWire
import Metrics
public import NIOCore
import Synchronization

/// The server's metrics (docs/operations.md, "Metrics"), through swift-metrics (the
/// `serve` command backs them with swift-prometheus; with the default factory they cost
/// next to nothing), except the request latency histogram, kept here and emitted by
/// ``emitLatency(into:)``.
///
/// Per-request metrics: a latency histogram per method, created up front and kept here
/// (``LatencyHistogram``: a read's checks are recorded together; a /metrics endpoint
/// appends ``emitLatency(into:)`` to the backend's output), and a counter per method and
/// status, created the first time that pair happens (so /metrics lists what occurred, not
/// 187 zeros); recording a read's answers is two locks and a few atomic operations.
public final class ServerMetrics: Sendable {
    /// Latency histogram buckets, from 10 microseconds: a cache hit is answered in tens.
    public static let latencyBuckets: [Duration] = [
        .microseconds(10), .microseconds(25), .microseconds(50), .microseconds(100), .microseconds(250),
        .microseconds(500), .milliseconds(1), .microseconds(2_500), .milliseconds(5), .milliseconds(10),
        .milliseconds(25), .milliseconds(50), .milliseconds(100), .milliseconds(250), .milliseconds(500),
        .seconds(1), .microseconds(2_500_000), .seconds(5), .seconds(10),
    ]

    private static let methods = MethodID.all
    private static let statusCount = 17

    private let requests: Mutex<[[Counter?]]>
    private let latency: [LatencyHistogram]
    private let otherRequests: Counter
    let inFlight: Meter
    let connections: Meter
    let watchers: Meter
    /// Writes that changed something: logged, fsynced, acknowledged.
    let writes: Counter
    let compactions: Counter
    private let cacheHits: Counter
    private let cacheMisses: Counter
    private let cacheEvictions: Counter
    private let cacheExpirations: Counter
    private let cacheRejections: Counter
    private let cacheBytes: Meter
    private let coldReadsQueued: Meter
    private let coldReads: Counter
    private let coldReadsRefused: Counter
    private let lastColdReads = Mutex(ColdReads.Statistics(queued: 0, started: 0, refused: 0))
    private let cacheEntries: Meter
    private let snapshotAge: Meter
    private let logBytes: Meter
    private let logSequence: Meter
    private let overlayCustomers: Meter
    private let ready: Meter
    private let factory: any MetricsFactory
    /// The cache counters at the previous refresh: Prometheus counters only go up, so each
    /// refresh adds what happened since.
    private let lastCache = Mutex(AnswerCache.Statistics())
    private let snapshotLabel = Mutex<(String, Meter)?>(nil)
    /// Refused calls and connections by listener and reason, made the first time each
    /// pair happens; and when each pair was last logged.
    private let refusals = Mutex<[String: (counter: Counter, lastLogged: NIODeadline?)]>([:])
    /// Reloads of the token file and TLS files that failed (the old ones stay in use).
    public let reloadFailures: Counter

    public init(factory: any MetricsFactory = MetricsSystem.factory) {
        self.factory = factory
        self.requests = Mutex(Self.methods.map { _ in [Counter?](repeating: nil, count: Self.statusCount) })
        self.otherRequests = Counter(label: "entitlements_requests_total", dimensions: [("method", "unknown"), ("status", "UNIMPLEMENTED")], factory: factory)
        self.latency = Self.methods.map { _ in LatencyHistogram(bounds: Self.latencyBuckets) }
        self.inFlight = Meter(label: "entitlements_requests_in_flight", factory: factory)
        self.connections = Meter(label: "entitlements_connections", factory: factory)
        self.watchers = Meter(label: "entitlements_watch_streams", factory: factory)
        self.writes = Counter(label: "entitlements_writes_total", factory: factory)
        self.compactions = Counter(label: "entitlements_compactions_total", factory: factory)
        self.cacheHits = Counter(label: "entitlements_cache_hits_total", factory: factory)
        self.cacheMisses = Counter(label: "entitlements_cache_misses_total", factory: factory)
        self.cacheEvictions = Counter(label: "entitlements_cache_evictions_total", factory: factory)
        self.cacheExpirations = Counter(label: "entitlements_cache_expirations_total", factory: factory)
        self.cacheRejections = Counter(label: "entitlements_cache_rejections_total", factory: factory)
        self.cacheBytes = Meter(label: "entitlements_cache_bytes", factory: factory)
        self.coldReadsQueued = Meter(label: "entitlements_cold_reads_queued", factory: factory)
        self.coldReads = Counter(label: "entitlements_cold_reads_total", factory: factory)
        self.coldReadsRefused = Counter(label: "entitlements_cold_reads_refused_total", factory: factory)
        self.cacheEntries = Meter(label: "entitlements_cache_entries", factory: factory)
        self.snapshotAge = Meter(label: "entitlements_snapshot_age_seconds", factory: factory)
        self.logBytes = Meter(label: "entitlements_log_bytes", factory: factory)
        self.logSequence = Meter(label: "entitlements_log_sequence", factory: factory)
        self.overlayCustomers = Meter(label: "entitlements_overlay_customers", factory: factory)
        self.ready = Meter(label: "entitlements_ready", factory: factory)
        self.reloadFailures = Counter(label: "entitlements_auth_reload_failures_total", factory: factory)
    }

    /// Counts a refusal (`entitlements_auth_refusals_total{listener,reason}`); true when it
    /// should be logged: the first of its listener and reason in a second.
    func refused(listener: String, reason: String) -> Bool {
        let key = listener + "/" + reason
        let now = NIODeadline.now()
        let factory = self.factory
        return self.refusals.withLock { refusals in
            var entry = refusals[key] ?? (
                Counter(label: "entitlements_auth_refusals_total", dimensions: [("listener", listener), ("reason", reason)], factory: factory),
                nil
            )
            entry.counter.increment()
            let log = entry.lastLogged.map { now - $0 >= .seconds(1) } ?? true
            if log {
                entry.lastLogged = now
            }
            refusals[key] = entry
            return log
        }
    }

    /// Counts `count` answered requests of one kind, read at `start`, and their latency
    /// (each the same: from `start` to now).
    func answered(_ method: MethodID, _ status: StatusCode, count: Int = 1, since start: NIODeadline) {
        guard let index = Self.methods.firstIndex(of: method) else {
            self.otherRequests.increment(by: Int64(count))
            return
        }
        let counter = self.requests.withLock { requests in
            if let counter = requests[index][Int(status.rawValue)] {
                return counter
            }
            let counter = Counter(
                label: "entitlements_requests_total",
                dimensions: [("method", "\(method)"), ("status", "\(status)")],
                factory: self.factory  // copied (an existential) only here, once per series
            )
            requests[index][Int(status.rawValue)] = counter
            return counter
        }
        counter.increment(by: Int64(count))
        self.latency[index].record(nanoseconds: (NIODeadline.now() - start).nanoseconds, count: count)
    }

    /// Appends `entitlements_request_duration_seconds`, a histogram by method, in
    /// Prometheus' text format: a /metrics endpoint emits its registry, then this. Every
    /// method has its series from the start, zeros included.
    public func emitLatency(into buffer: inout [UInt8]) {
        let name = "entitlements_request_duration_seconds"
        buffer.append(contentsOf: "# TYPE \(name) histogram\n".utf8)
        for (method, histogram) in zip(Self.methods, self.latency) {
            histogram.emit(name: name, labels: "method=\"\(method)\"", into: &buffer)
        }
    }

    /// Sets the values read at scrape time: the caches, the snapshot, the log.
    func refresh(cache: AnswerCache.Statistics, coldReads: ColdReads.Statistics, store: CustomerStore, now: Int64, isReady: Bool) {
        let previousCold = self.lastColdReads.withLock { last in
            defer { last = coldReads }
            return last
        }
        self.coldReadsQueued.set(coldReads.queued)
        self.coldReads.increment(by: Int64(coldReads.started - previousCold.started))
        self.coldReadsRefused.increment(by: Int64(coldReads.refused - previousCold.refused))
        let previous = self.lastCache.withLock { last in
            defer { last = cache }
            return last
        }
        self.cacheHits.increment(by: Int64(cache.hits &- previous.hits))
        self.cacheMisses.increment(by: Int64(cache.misses &- previous.misses))
        self.cacheEvictions.increment(by: Int64(cache.evictions &- previous.evictions))
        self.cacheExpirations.increment(by: Int64(cache.expirations &- previous.expirations))
        self.cacheRejections.increment(by: Int64(cache.rejections &- previous.rejections))
        self.cacheBytes.set(cache.bytes)
        self.cacheEntries.set(cache.entries)
        let header = store.snapshot.header
        self.snapshotAge.set(Double(max(0, now - (header.createdDate ?? now))) / 1_000)
        self.logBytes.set(Int(store.logBytes))
        self.logSequence.set(Int(store.committedSequence))
        self.overlayCustomers.set(store.overlayCount)
        self.ready.set(isReady ? 1 : 0)
        // The snapshot's id as a label of a gauge that is 1, the Prometheus idiom for text.
        let id = header.snapshotId ?? "-"
        self.snapshotLabel.withLock { current in
            if current?.0 != id {
                current?.1.destroy()
                let meter = Meter(label: "entitlements_snapshot_info", dimensions: [("snapshot_id", id)], factory: self.factory)
                meter.set(1)
                current = (id, meter)
            }
        }
    }
}
