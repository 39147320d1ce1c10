public import EntitlementsMessages
import EntitlementsFormats
import EntitlementsStore
import NIOCore
import NIOPosix

extension EntitlementsMessages.CustomerHistoryRequest {
    /// The most entries one answer holds (and the default).
    static let maximumLimit = 1000
}

extension EntitlementMethods {
    /// CustomerHistory (method 6): the customer's timeline from the log the data directory
    /// keeps (docs/durability.md, "History"). Reads files, so it runs on NIO's thread pool
    /// with the call's deadline, never on the event loop; needs `check`, as a check or an
    /// explained check, whose record already holds every transaction and grant the customer
    /// ever had.
    func customerHistory(_ request: CustomerHistoryRequest, _ context: CallContext) -> MethodResult<CustomerHistoryResponse> {
        if let problem = Validation.problem(userId: request.userId, field: "user_id") {
            return .failure(.invalidArgument, problem)
        }
        let limit = request.limit == 0 ? CustomerHistoryRequest.maximumLimit : min(Int(request.limit), CustomerHistoryRequest.maximumLimit)
        let store = self.store
        let deadline = context.deadline
        let userId = request.userId ?? ""
        let environment = request.environment
        let read = NIOThreadPool.singleton.runIfActive(eventLoop: context.eventLoop) { () -> Result<CustomerHistoryResponse, ServiceError> in
            if let deadline, deadline <= .now() {
                return .failure(ServiceError(.deadlineExceeded, "the deadline passed before the history was read"))
            }
            do {
                return .success(try store.history(of: userId, limit: limit, environment: environment, now: WallClock.unixMilliseconds(), date: RFC3339.format))
            } catch let error as SnapshotError {
                // A damaged kept file: only histories that read it fail; checks and writes
                // do not read DIR/history.
                return .failure(ServiceError(.internalError, "the customer's history cannot be read: \(error); checks and writes are not affected (docs/durability.md, \"History\")"))
            } catch {
                return .failure(Self.serviceError(error))
            }
        }.flatMapErrorThrowing { error in
            .failure(ServiceError(.unavailable, "the server is stopping: \(error)"))
        }
        return .later(read)
    }
}
