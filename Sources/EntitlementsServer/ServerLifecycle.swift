public import ServiceLifecycle
import Synchronization
public import UnixSignals

/// Where serve is in its life, for /readyz.
public final class Readiness: Sendable {
    /// Starting (snapshot, log replay, warm-up), ready, or draining (shutting down).
    public enum State: Sendable {
        case starting, ready, draining
    }

    private let current = Mutex(State.starting)

    /// Starting.
    public init() {}

    /// Moves to `state`.
    public func set(_ state: State) {
        self.current.withLock { $0 = state }
    }

    /// What /readyz answers: ready or not, and why, in words.
    public func state() -> (ready: Bool, reason: String) {
        switch self.current.withLock({ $0 }) {
        case .starting: (false, "starting: opening the snapshot, replaying the log, warming the cache")
        case .ready: (true, "ready")
        case .draining: (false, "draining: shutting down")
        }
    }
}

/// SIGTERM and SIGINT, trapped from before the listeners open: the first starts the
/// ServiceGroup's graceful shutdown (the drain), the second fails this service, which
/// cancels the group, which cuts the drain short.
public final class SignalHandler: Service, Sendable {
    /// Thrown by ``run()`` on the second signal, which cancels the group.
    public struct SecondSignal: Error {}

    private let signals: UnixSignalsSequence
    /// The group to shut down; set once it exists (it is made with this service in it).
    private let group = Mutex<ServiceGroup?>(nil)

    /// `signals`: SIGTERM and SIGINT, trapped before the listeners open.
    public init(signals: UnixSignalsSequence) {
        self.signals = signals
    }

    /// The group the first signal shuts down gracefully.
    public func attach(_ group: ServiceGroup) {
        self.group.withLock { $0 = group }
    }

    public func run() async throws {
        try await withThrowingTaskGroup(of: Void.self) { tasks in
            tasks.addTask {
                var seen = 0
                for await _ in self.signals {
                    seen += 1
                    if seen == 1 {
                        await self.group.withLock { $0 }?.triggerGracefulShutdown()
                    } else {
                        throw SecondSignal()
                    }
                }
            }
            tasks.addTask {
                // Asked to stop (after the server's drain, which is shut down first).
                try await gracefulShutdown()
            }
            try await tasks.next()
            tasks.cancelAll()
        }
    }
}
