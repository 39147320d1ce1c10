public import EntitlementsMessages
import EntitlementsFormats
import EntitlementsStore
import NIOCore
import NIOPosix
import Synchronization

extension EntitlementsMessages.CustomerHistoryRequest {
    /// The most entries one answer holds (and the default).
    static let maximumLimit = 1000
}

/// Where history reads run: threads of their own, so that a long one never delays an
/// explained check or the cold reads (NIO's shared pool), and at most `limit` at once.
enum HistoryReads {
    static let limit = 2
    static let running = Atomic<Int>(0)
    static let pool: NIOThreadPool = {
        let pool = NIOThreadPool(numberOfThreads: HistoryReads.limit)
        pool.start()
        return pool
    }()
}

extension EntitlementMethods {
    /// CustomerHistory (method 6): the customer's timeline from the log the data directory
    /// keeps (docs/durability.md, "History"). Reads files, so it runs on threads of its own
    /// (``HistoryReads``, at most two at once: a third is RESOURCE_EXHAUSTED), never on the
    /// event loop, and stops between segments once the call's deadline has passed or the
    /// call was cancelled (CANCEL, or its connection closed: its place is freed); needs
    /// `check`, as a check or an explained check, whose record already holds every
    /// transaction and grant the customer ever had.
    func customerHistory(_ request: CustomerHistoryRequest, _ context: CallContext) -> MethodResult<CustomerHistoryResponse> {
        if let problem = Validation.problem(userId: request.userId, field: "user_id") {
            return .failure(.invalidArgument, problem)
        }
        let limit = request.limit == 0 ? CustomerHistoryRequest.maximumLimit : min(Int(request.limit), CustomerHistoryRequest.maximumLimit)
        guard HistoryReads.running.add(1, ordering: .relaxed).newValue <= HistoryReads.limit else {
            HistoryReads.running.subtract(1, ordering: .relaxed)
            return .failure(.resourceExhausted, "\(HistoryReads.limit) history reads are running (each reads the kept log); try again shortly")
        }
        let store = self.store
        let deadline = context.deadline
        let scope = context.scope
        let userId = request.userId ?? ""
        let environment = request.environment
        let read = HistoryReads.pool.runIfActive(eventLoop: context.eventLoop) { () -> Result<CustomerHistoryResponse, ServiceError> in
            defer { HistoryReads.running.subtract(1, ordering: .relaxed) }
            let expired = { deadline.map { $0 <= .now() } ?? false }
            if expired() {
                return .failure(ServiceError(.deadlineExceeded, "the deadline passed before the history was read"))
            }
            if scope.isClosed {
                return .failure(ServiceError(.cancelled, "the call was cancelled before the history was read"))
            }
            do {
                let history = try store.history(
                    of: userId, limit: limit, environment: environment, now: WallClock.unixMilliseconds(), date: RFC3339.format,
                    cancelled: { expired() || scope.isClosed }
                )
                return .success(history)
            } catch is CancellationError {
                if scope.isClosed {
                    return .failure(ServiceError(.cancelled, "the call was cancelled while the history was read"))
                }
                return .failure(ServiceError(.deadlineExceeded, "the deadline passed while the history was read"))
            } catch let error as SnapshotError {
                // A damaged kept file: only histories that read it fail; checks and writes
                // do not read DIR/history.
                return .failure(ServiceError(.internalError, "the customer's history cannot be read: \(error); checks and writes are not affected (docs/durability.md, \"History\")"))
            } catch {
                return .failure(Self.serviceError(error))
            }
        }.flatMapErrorThrowing { error in
            HistoryReads.running.subtract(1, ordering: .relaxed)  // the read never ran
            return .failure(ServiceError(.unavailable, "the server is stopping: \(error)"))
        }
        return .later(read)
    }
}
