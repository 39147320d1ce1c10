public import ServiceLifecycle
import Synchronization

/// `serve` as a swift-service-lifecycle `Service`: runs until graceful shutdown is
/// requested (SIGTERM/SIGINT through the `ServiceGroup`), then drains: Health says
/// NOT_SERVING, every connection gets GOAWAY, accepted calls are answered, the log is
/// flushed. If the group is cancelled meanwhile (the drain took longer than the group's
/// maximum graceful shutdown duration, or a second signal), the remaining connections are
/// closed at once and ``drained`` stays false.
public final class EntitlementsService: Service, Sendable {
    public let server: EntitlementsServer
    private let onDrain: @Sendable () -> Void
    private let drainedFlag = Mutex(false)

    /// `onDrain` runs when the drain starts (e.g. to say so, and to fail readiness).
    public init(server: EntitlementsServer, onDrain: @escaping @Sendable () -> Void = {}) {
        self.server = server
        self.onDrain = onDrain
    }

    /// Whether the last drain finished: every accepted call answered.
    public var drained: Bool { self.drainedFlag.withLock { $0 } }

    public func run() async throws {
        // Returns when graceful shutdown is requested; throws if cancelled first.
        try? await gracefulShutdown()
        self.onDrain()
        await withTaskCancellationHandler {
            await self.server.shutdownGracefully()
        } onCancel: {
            self.server.closeAllConnections()
        }
        if !Task.isCancelled {
            self.drainedFlag.withLock { $0 = true }
        }
    }
}
