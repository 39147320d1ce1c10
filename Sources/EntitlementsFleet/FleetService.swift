public import CoreMetrics
import EntitlementsStore
import Foundation
public import Logging
public import ServiceLifecycle
import Synchronization

/// Fleet mode's tailer as a service: it runs until the graceful shutdown, or until the
/// change log can no longer be followed (then the group shuts down and serve exits 1).
public final class FleetService: Service, Sendable {
    /// The change-log tailer this service runs.
    public let tailer: FleetTailer
    /// The database the tailer polls (closed by serve once the group has stopped).
    public let database: FleetDatabase
    private let logger: Logger
    private let failed = Mutex<FleetError?>(nil)

    /// Runs `tailer` on `database`, logging a failure to follow the change log to `logger`.
    public init(tailer: FleetTailer, database: FleetDatabase, logger: Logger) {
        self.tailer = tailer
        self.database = database
        self.logger = logger
    }

    /// Why tailing stopped, if it failed.
    public var failure: FleetError? { self.failed.withLock { $0 } }

    public func run() async throws {
        do {
            try await cancelWhenGracefulShutdown {
                try await self.tailer.run()
            }
        } catch is CancellationError {
            return
        } catch {
            self.failed.withLock { $0 = error as? FleetError ?? FleetError(.local, "\(error)") }
            self.logger.error("fleet: cannot follow the change log: \(error)")
            throw error
        }
    }
}


/// Fleet mode's gauges (docs/operations.md, "Metrics"), set at each scrape.
public struct FleetMetrics: Sendable {
    private let applied: Meter
    private let head: Meter
    private let sincePoll: Meter
    private let failures: Meter
    private let stale: Meter

    /// The gauges, made by `factory` (serve's Prometheus registry).
    public init(factory: any MetricsFactory) {
        self.applied = Meter(label: "entitlements_fleet_applied_sequence", factory: factory)
        self.head = Meter(label: "entitlements_fleet_head_sequence", factory: factory)
        self.sincePoll = Meter(label: "entitlements_fleet_seconds_since_poll", factory: factory)
        self.failures = Meter(label: "entitlements_fleet_poll_failures", factory: factory)
        self.stale = Meter(label: "entitlements_fleet_stale", factory: factory)
    }

    /// Sets the gauges from the tailer's status and whether checks are stale, at a scrape.
    public func refresh(_ status: FleetTailer.Status, stale: Bool) {
        self.stale.set(stale ? 1 : 0)
        self.applied.set(Int(status.appliedSequence))
        self.head.set(Int(status.headSequence))
        let since = status.lastSuccessfulPoll.map { Double(WallClock.unixMilliseconds() - $0) / 1000 } ?? -1
        self.sincePoll.set(since)
        self.failures.set(status.failuresInARow)
    }
}

extension FleetTailer.Status {
    /// /readyz in fleet mode: the lifecycle's answer `base`, with how current this server
    /// is. A fleet server that cannot reach PostgreSQL stays ready, serving what it applied,
    /// unless it is past --max-staleness (`stale`) and refuses checks then
    /// (`refusesWhenStale`: --stale-policy closed; docs/fleet.md, "Staleness"); the body
    /// says how stale.
    public func readiness(_ base: (ready: Bool, reason: String), stale: Bool, refusesWhenStale: Bool, now: Int64) -> (ready: Bool, reason: String) {
        let since = self.lastSuccessfulPoll.map { String(format: "%.1f s ago", Double(now - $0) / 1000) } ?? "never"
        var text = "\(base.reason); fleet: applied sequence \(self.appliedSequence) of \(self.headSequence), last successful poll \(since)"
        if let error = self.lastError {
            text += "; last poll failed: \(error)"
        }
        guard stale else {
            return (base.ready, text)
        }
        if refusesWhenStale {
            return (false, text + "; stale (past --max-staleness) and --stale-policy closed: checks are refused")
        }
        return (base.ready, text + "; stale (past --max-staleness): answers are flagged stale")
    }
}
