public import EntitlementsMessages
import EntitlementsFormats
import EntitlementsResolver
import EntitlementsStore
import NIOCore
import NIOPosix

extension EntitlementMethods {
    /// CheckEntitlements with `explain`: the answer computed from the customer's record as
    /// read now (never from the answer cache, never stored in it), with the resolver's
    /// explanation and the log sequence and snapshot it was read at. For support tools: the
    /// record is read off the event loop, and resolved twice.
    func explainedCheck(_ request: CheckEntitlementsRequest, _ context: CallContext) -> MethodResult<CheckEntitlementsResponse> {
        if let problem = Validation.problem(userId: request.userId, field: "user_id") ?? Validation.problem(entitlementIds: request.entitlementIds) {
            return .failure(.invalidArgument, problem)
        }
        let freshness = self.freshness()
        if case .refused(let message) = freshness {
            return .failure(.unavailable, message)
        }
        let eventLoop = context.eventLoop
        let deadline = context.deadline
        let explain = { (methods: EntitlementMethods) -> EventLoopFuture<Result<CheckEntitlementsResponse, ServiceError>> in
            let store = methods.store
            let stale = methods.freshness().staleForMilliseconds
            // Blocking (the record may be read from disk): on NIO's thread pool, not the
            // event loop nor Swift's cooperative pool.
            return NIOThreadPool.singleton.runIfActive(eventLoop: eventLoop) {
                if let deadline, deadline <= .now() {
                    return .failure(ServiceError(.deadlineExceeded, "the deadline passed before the explained check ran"))
                }
                return Self.explained(request, store: store, staleForMilliseconds: stale)
            }.flatMapErrorThrowing { error in
                .failure(ServiceError(.unavailable, "the server is stopping: \(error)"))
            }
        }
        if request.minLogSequence > 0, self.store.appliedSequence < request.minLogSequence {
            return .later(self.afterCatchingUp(to: request.minLogSequence, on: eventLoop, run: explain))
        }
        return .later(explain(self))
    }

    private static func explained(_ request: CheckEntitlementsRequest, store: CustomerStore, staleForMilliseconds: UInt64) -> Result<CheckEntitlementsResponse, ServiceError> {
        let userId = request.userId ?? ""
        let instant = request.at ?? WallClock.unixMilliseconds()
        // The snapshot under the record: read again if a compaction swapped it meanwhile.
        var snapshot = store.snapshot
        var read: (record: CustomerRecord?, sequence: UInt64)
        do {
            read = try store.customerRead(for: userId)
            while store.snapshot !== snapshot {
                snapshot = store.snapshot
                read = try store.customerRead(for: userId)
            }
        } catch {
            return .failure(Self.serviceError(error))
        }
        let snapshotId = snapshot.header.snapshotId
        let resolver = EntitlementResolver(catalog: store.catalog)
        let resolution = resolver.resolve(read.record, at: instant, environment: request.environment, entitlementIds: request.entitlementIds)
        var explanation = resolver.explain(
            read.record, at: instant, environment: request.environment, entitlementIds: request.entitlementIds, resolution: resolution, date: RFC3339.format
        )
        explanation.logSequence = read.sequence
        explanation.snapshotId = snapshotId
        var response = resolution.response(userId: userId, customerId: read.record?.id, requestDate: instant)
        response.logSequence = read.sequence
        response.staleForMs = staleForMilliseconds
        response.explanation = explanation
        return .success(response)
    }
}
