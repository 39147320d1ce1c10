public import EntitlementsMessages
public import EntitlementsSecurity
public import EntitlementsCache
public import EntitlementsStore
public import EntitlementsWire
public import NIOCore

/// A call that failed: a status of docs/PROTOCOL.md (the gRPC codes) and a message a
/// person can act on. Every transport sends both as they are.
public struct ServiceError: Error, Sendable, Hashable, CustomStringConvertible {
    public var status: StatusCode
    public var message: String

    public init(_ status: StatusCode, _ message: String) {
        self.status = status
        self.message = message
    }

    public var description: String { "\(self.status): \(self.message)" }
}

/// What a method answers: at once (a cache hit whose resolver runs on the caller's event
/// loop: no promise, no allocation), or later, on the caller's event loop.
public enum MethodResult<Value> {
    case now(Result<Value, ServiceError>)
    case later(EventLoopFuture<Result<Value, ServiceError>>)

    static func failure(_ status: StatusCode, _ message: String) -> Self {
        .now(.failure(ServiceError(status, message)))
    }
}

extension MethodResult: Sendable where Value: Sendable {}

/// Who is calling, and until when: what a transport knows about a call and the methods need.
public struct CallContext {
    /// The caller's event loop: answers come back on it, and a resolver running on it
    /// answers at once.
    public var eventLoop: any EventLoop
    /// Work not started by then is abandoned, and an answer not ready by then is
    /// DEADLINE_EXCEEDED (the caller's timeout); nil for none.
    public var deadline: NIODeadline?
    /// Closed when the caller goes away, so that work queued for it is skipped (and the
    /// call counted as CANCELLED).
    public var scope: ConnectionScope
    /// What the caller may do (docs/security.md): every method checks it first.
    public var access: CallerAccess
    /// When the call's request was read: its latency is measured from here.
    public var start: NIODeadline
    /// The caller's connection is being drained (told to go away): Health says NOT_SERVING.
    public var draining: Bool
    /// The caller's W3C trace context, read by the transport when tracing is on.
    public var traceHeaders: TraceHeaders?
    /// The call's span, opened by the router when tracing is on (``CallTracing``).
    var span: CallSpan?
    /// Where a write made in this call comes from, as the log keeps it for the customer's
    /// history; nil: the method and the caller's listener and credential.
    public var writeSource: WriteSource?

    /// The store path whose writes run in this task (a webhook's event, a Pub/Sub message,
    /// the App Store recheck): ingestion sets it around an event, and the writes it makes
    /// carry it into the log (``EntitlementMethods/apply(_:_:)``).
    @TaskLocal public static var storeSource: WriteSource?

    public init(
        eventLoop: any EventLoop,
        deadline: NIODeadline?,
        scope: ConnectionScope,
        access: CallerAccess = .unrestricted,
        start: NIODeadline = .now(),
        draining: Bool = false
    ) {
        self.eventLoop = eventLoop
        self.deadline = deadline
        self.scope = scope
        self.access = access
        self.start = start
        self.draining = draining
    }
}

/// The methods of `entitlements.v1.EntitlementService` (proto/entitlements/v1/service.proto),
/// written once for every transport: the framed protocol of docs/PROTOCOL.md, the gRPC door
/// and the HTTP/JSON door (docs/doors.md). Typed requests in, typed answers out; a transport
/// only decodes, calls, and encodes. Validation, staleness, read-your-writes waits, the
/// resolvers, the store and the watches are all behind these calls.
///
/// Every method is called on the caller's event loop (`CallContext.eventLoop`) and answers
/// there.
public final class EntitlementMethods: Sendable {
    let services: ServerServices
    /// The server's settings (limits, staleness policy, version).
    public let configuration: ServerConfiguration

    /// Spans for every routed call, or nil (``CallTracing``).
    let tracing: CallTracing?
    /// SubmitPurchase's stores, or nil (the method then answers FAILED_PRECONDITION).
    let purchases: (any PurchaseVerifier)?

    init(services: ServerServices, configuration: ServerConfiguration, tracing: CallTracing?, purchases: (any PurchaseVerifier)? = nil) {
        self.services = services
        self.configuration = configuration
        self.tracing = tracing
        self.purchases = purchases
    }

    /// Whether calls are traced: a transport reads the caller's trace context only then.
    public var isTracing: Bool {
        self.tracing != nil
    }

    var pool: ResolverPool { self.services.pool }
    var store: CustomerStore { self.services.store }

    // MARK: Checks

    /// CheckEntitlements. A cache hit whose resolver runs on the caller's loop is answered
    /// `.now`; anything else (another loop's resolver, an alias owned by another resolver,
    /// a `min_log_sequence` wait) `.later`. The per-call rules are the router's.
    @inline(__always)  // into the router's check: the hot path stays one function
    func checkEntitlements(_ request: CheckEntitlementsRequest, _ context: CallContext) -> MethodResult<CheckAnswer> {
        if let problem = Validation.problem(userId: request.userId, field: "user_id") ?? Validation.problem(entitlementIds: request.entitlementIds) {
            return .failure(.invalidArgument, problem)
        }
        let freshness = self.freshness()
        if case .refused(let message) = freshness {
            return .failure(.unavailable, message)
        }
        let userId = request.userId!
        let query = CheckQuery(
            userId: userId,
            environment: request.environment,
            entitlementIds: request.entitlementIds,
            instant: request.at ?? WallClock.unixMilliseconds(),
            deadline: context.deadline
        )
        if request.minLogSequence > 0, self.store.appliedSequence < request.minLogSequence {
            context.span?.waiting(forSequence: request.minLogSequence)
            return .later(self.afterCatchingUp(to: request.minLogSequence, on: context.eventLoop) { methods in
                context.span?.caughtUp()
                let promise = context.eventLoop.makePromise(of: CheckOutcome.self)
                methods.pool.check(query, for: context.scope, completing: promise)
                let stale = methods.freshness().staleForMilliseconds
                return promise.futureResult.map { CheckAnswer.make($0, query: query, staleForMilliseconds: stale) }
            })
        }
        let stale = freshness.staleForMilliseconds
        // When the user's resolver runs on the caller's loop (always with one loop; 1 in L
        // checks with L loops) the check is answered now: no promise, no hop.
        let first = self.pool.resolver(for: userId)
        var outcome: CheckOutcome?
        if first.eventLoop === context.eventLoop {
            outcome = first.core.value.check(query)
        }
        if let outcome, !outcome.isUnfinished {
            return .now(CheckAnswer.make(outcome, query: query, staleForMilliseconds: stale))
        }
        // The resolver is on another loop, or this was an alias of another resolver's
        // customer (which that resolver answers): one hop, answered when it is back. A miss
        // is read on a cold-read thread; this loop answers other checks meanwhile.
        let promise = context.eventLoop.makePromise(of: CheckOutcome.self)
        switch outcome {
        case .forward(let shard, let customerId, let named):
            self.pool.check(query, owner: shard, customerId: customerId, named: named, for: context.scope, completing: promise)
        case .cold:
            self.pool.readCold(query, on: first, completing: promise)
        default:
            self.pool.check(query, for: context.scope, completing: promise)
        }
        return .later(promise.futureResult.map { CheckAnswer.make($0, query: query, staleForMilliseconds: stale) })
    }

    /// Starts loading the cache entries of the checks a transport, on an event loop, is
    /// about to call ``checkEntitlements(_:_:)`` for, one after another (the framed
    /// connection does so for the checks of each read). A hint: it changes no answer.
    public func prefetch(_ peeks: UnsafeBufferPointer<CachePeek>) {
        self.pool.prefetch(peeks)
    }

    /// BatchCheckEntitlements: every user, in order, or one failure for the batch.
    func batchCheckEntitlements(_ request: BatchCheckEntitlementsRequest, _ context: CallContext) -> MethodResult<BatchCheckAnswer> {
        guard request.userIds.count <= self.configuration.maximumBatchSize else {
            return .failure(
                .resourceExhausted,
                "user_ids: \(request.userIds.count) users; a batch holds at most \(self.configuration.maximumBatchSize)"
            )
        }
        for (index, userId) in request.userIds.enumerated() {
            if let problem = Validation.problem(userId: userId, field: "user_ids[\(index)]") {
                return .failure(.invalidArgument, problem)
            }
        }
        if let problem = Validation.problem(entitlementIds: request.entitlementIds) {
            return .failure(.invalidArgument, problem)
        }
        let freshness = self.freshness()
        if case .refused(let message) = freshness {
            return .failure(.unavailable, message)
        }
        let instant = request.at ?? WallClock.unixMilliseconds()
        if request.minLogSequence > 0, self.store.appliedSequence < request.minLogSequence {
            context.span?.waiting(forSequence: request.minLogSequence)
            return .later(self.afterCatchingUp(to: request.minLogSequence, on: context.eventLoop) { methods in
                context.span?.caughtUp()
                return methods.runBatch(request, instant: instant, staleForMilliseconds: methods.freshness().staleForMilliseconds, context)
            })
        }
        return .later(self.runBatch(request, instant: instant, staleForMilliseconds: freshness.staleForMilliseconds, context))
    }

    private func runBatch(
        _ request: BatchCheckEntitlementsRequest,
        instant: Int64,
        staleForMilliseconds: UInt64,
        _ context: CallContext
    ) -> EventLoopFuture<Result<BatchCheckAnswer, ServiceError>> {
        let queries = request.userIds.map { userId in
            CheckQuery(userId: userId, environment: request.environment, entitlementIds: request.entitlementIds, instant: instant, deadline: context.deadline)
        }
        let answered = context.eventLoop.makePromise(of: [CheckOutcome].self)
        self.pool.checkBatch(queries, for: context.scope, on: context.eventLoop, completing: answered)
        return answered.futureResult.map { outcomes in
            var answers: [(CachedAnswer, customerId: String?)] = []
            answers.reserveCapacity(outcomes.count)
            for (userId, outcome) in zip(request.userIds, outcomes) {
                switch outcome {
                case .answer(let answer, let customerId, _):
                    answers.append((answer, customerId))
                default:
                    return .failure(outcome.failure(userId: userId, batch: true))
                }
            }
            return .success(BatchCheckAnswer(userIds: request.userIds, answers: answers, requestDate: instant, staleForMilliseconds: staleForMilliseconds))
        }
    }

    // MARK: Health

    /// Health, as a call (reached only through ``unary(_:_:_:codec:)``, which checks the
    /// permission: no variant without it is left to pick): NOT_SERVING when the caller's
    /// connection drains.
    func health(_ context: CallContext) -> Result<HealthResponse, ServiceError> {
        .success(HealthResponse(
            status: self.isServing(draining: context.draining) ? .serving : .notServing,
            snapshotId: self.store.snapshot.header.snapshotId,
            uptimeMs: self.services.health.uptimeMilliseconds,
            version: self.configuration.version
        ))
    }

    /// Whether checks are served: false during a drain, and for a fleet server past
    /// --max-staleness with --stale-policy closed (which refuses checks).
    public func isServing(draining: Bool = false) -> Bool {
        !draining && self.services.health.isServing
            && !(self.freshness() != .current && self.configuration.stalePolicy == .closed)
    }

    // MARK: Writes

    /// A write: validated and applied by the store, answered once it is durable and every
    /// resolver has forgotten what it changed (so any later check sees it).
    func apply(_ mutation: LogRecord.Mutation, _ context: CallContext) -> MethodResult<WriteResponse> {
        let promise = context.eventLoop.makePromise(of: Result<WriteResponse, ServiceError>.self)
        let source = context.writeSource ?? WriteSource(method: "\(Self.method(of: mutation))", caller: context.access.callerDescription)
        self.store.write(mutation, now: WallClock.unixMilliseconds(), source: source) { result in
            // The store calls this once every resolver has dropped what the write changed
            // (ServerServices.afterCommit).
            promise.succeed(result.map { outcome in
                WriteResponse(customerId: outcome.customerId, logSequence: outcome.sequence ?? 0, changed: outcome.changed, created: outcome.created)
            }.mapError(Self.serviceError))
        }
        return .later(promise.futureResult)
    }

    /// The stored record of the customer `userId` (a customer id or an alias) names, or nil:
    /// what a writer that must name a stored transaction reads first (the store ingestion's
    /// refunds). Needs the write permission, as the writes it serves; may read the snapshot
    /// from disk, so it is not for the check path. In fleet mode it is this server's replica.
    /// Unlike the other methods, it may be called from any thread.
    public func customerRecord(_ userId: String, _ context: CallContext) -> Result<CustomerRecord?, ServiceError> {
        if let refused = self.authorize(.recordTransaction, context) {
            return .failure(refused)
        }
        if let problem = Validation.problem(userId: userId, field: "user_id") {
            return .failure(ServiceError(.invalidArgument, problem))
        }
        do {
            return .success(try self.store.customer(for: userId))
        } catch {
            return .failure(Self.serviceError(error))
        }
    }

    /// Every customer's record, for a background task of the server (the App Store
    /// recheck): blocking and costly (it decodes every record), so call it off the event
    /// loops. `body` returns false to stop. In fleet mode it is this server's replica.
    public func forEachCustomer(_ body: (CustomerRecord) throws -> Bool) throws {
        try self.store.forEachCustomer(body)
    }

    /// Whether `productId` is in the catalog the writes are checked against.
    public func catalogContains(_ productId: String) -> Bool {
        self.store.catalog.contains(productId)
    }

    /// The billing period the catalog gives `productId` (`.unspecified` when it gives none).
    public func catalogPeriod(_ productId: String) -> SubscriptionPeriod {
        self.store.catalog.period(of: productId)
    }

    /// Compact: a new snapshot holding every acknowledged write.
    func compact(_ context: CallContext) -> MethodResult<CompactResponse> {
        let promise = context.eventLoop.makePromise(of: Result<CompactResponse, ServiceError>.self)
        let services = self.services
        Task {
            do {
                let report = try await services.compact()
                promise.succeed(.success(CompactResponse(snapshotId: report.snapshotId, lastLogSequence: report.lastLogSequence)))
            } catch {
                promise.succeed(.failure(Self.serviceError(error)))
            }
        }
        return .later(promise.futureResult)
    }

    static func serviceError(_ error: any Error) -> ServiceError {
        if let refusal = error as? WriteRefusal {
            return ServiceError(Self.status(of: refusal), refusal.message)
        }
        return ServiceError(.internalError, "\(error)")
    }

    static func status(of refusal: WriteRefusal) -> StatusCode {
        switch refusal.reason {
        case .invalidArgument: .invalidArgument
        case .notFound: .notFound
        case .failedPrecondition: .failedPrecondition
        case .unavailable: .unavailable
        }
    }

    // MARK: Watch

    /// WatchEntitlements: opens a stream that sends through `sink` until it ends (by the
    /// server, or `WatchStream.cancel`). A refused watch sends nothing and calls nothing.
    /// The per-call rules are the router's (``watch(_:_:codec:sink:)``).
    func watchEntitlements(_ request: WatchEntitlementsRequest, _ context: CallContext, sink: WatchSink) -> Result<WatchStream, ServiceError> {
        var request = request
        if request.allCustomers {
            request.userIds = []  // ignored when all_customers is set (service.proto)
        } else if request.userIds.isEmpty {
            return .failure(ServiceError(.invalidArgument, "user_ids: give at least one, or set all_customers"))
        }
        guard request.userIds.count <= self.configuration.maximumBatchSize else {
            return .failure(ServiceError(
                .resourceExhausted,
                "user_ids: \(request.userIds.count) users; a watch holds at most \(self.configuration.maximumBatchSize)"
            ))
        }
        for (index, userId) in request.userIds.enumerated() {
            if let problem = Validation.problem(userId: userId, field: "user_ids[\(index)]") {
                return .failure(ServiceError(.invalidArgument, problem))
            }
        }
        if let problem = Validation.problem(entitlementIds: request.entitlementIds) {
            return .failure(ServiceError(.invalidArgument, problem))
        }
        let store = self.store
        let customerIds: [String]
        do {
            // Aliases are watched as their customer; an unknown id as the customer a first
            // write would create.
            customerIds = Array(Set(try request.userIds.map { try store.customer(for: $0)?.id ?? $0 }))
        } catch {
            return .failure(ServiceError(.internalError, "\(error)"))
        }
        let hub = self.services.watches
        let watch = WatchStream(
            eventLoop: context.eventLoop,
            request: request,
            customerIds: customerIds,
            resolver: self.pool.resolver,
            store: store,
            bufferLimit: self.configuration.watchBufferEvents,
            sink: sink,
            ended: { hub.remove($0) }
        )
        guard hub.add(watch) else {
            return .failure(ServiceError(.resourceExhausted, "the server has \(hub.maximumWatches) watch streams, its maximum; try again later"))
        }
        if let deadline = context.deadline {
            // A stream's timeout bounds the whole stream, as a unary call's bounds its answer.
            let seconds = Double(((deadline - NIODeadline.now()).nanoseconds + 500_000) / 1_000_000) / 1000
            watch.deadlineTimer = context.eventLoop.assumeIsolated().scheduleTask(deadline: deadline) { [weak watch] in
                watch?.finish(.deadlineExceeded, "the watch's timeout of \(seconds) s elapsed; send a new WatchEntitlements to go on")
            }
        }
        do {
            try watch.start(now: WallClock.unixMilliseconds())
        } catch {
            watch.finish(.internalError, "cannot read the watched customers: \(error)")
        }
        return .success(watch)
    }

    /// The method that carries `mutation` (a replicated write is fleet mode's, never a
    /// caller's: it needs the write permission as any write does).
    static func method(of mutation: LogRecord.Mutation) -> MethodID {
        switch mutation {
        case .recordTransaction: .recordTransaction
        case .updateSubscriptionState: .updateSubscriptionState
        case .grantEntitlement: .grantEntitlement
        case .revokeGrant: .revokeGrant
        case .linkAlias: .linkAlias
        case .deleteCustomer, .replicatedWrite: .deleteCustomer
        }
    }

    // MARK: Permissions

    /// Nil when the caller may call `method`; else the refusal, counted and logged.
    @inline(__always)
    public func authorize(_ method: MethodID, _ context: CallContext) -> ServiceError? {
        context.access.refusal(for: method).map { self.refused($0, context) }
    }

    /// The access of one call carrying `authorization` (`Bearer TOKEN`, gRPC and HTTP) on a
    /// connection with `credentials`; a bad token is refused, counted and logged.
    public func access(_ credentials: ConnectionCredentials, authorization: String?) -> Result<CallerAccess, ServiceError> {
        credentials.access(authorization: authorization).mapError { refusal in
            self.recordRefusal(refusal, listener: credentials.security.policy.name, peer: credentials.peer)
            return ServiceError(refusal.status, refusal.message)
        }
    }

    /// Counts and logs a refused call (docs/security.md, "Refusals"), and says why.
    @inline(never)
    private func refused(_ refusal: Refusal, _ context: CallContext) -> ServiceError {
        self.recordRefusal(refusal, listener: context.access.listener.policy.name, peer: context.scope.peer)
        return ServiceError(refusal.status, refusal.message)
    }

    /// Counts a refusal by listener and reason, and logs it naming the peer (never a
    /// token), at most once a second per listener and reason so that a flood of refused
    /// calls cannot flood the log.
    public func recordRefusal(_ refusal: Refusal, listener: String? = nil, peer: String) {
        self.services.recordRefusal(refusal, listener: listener, peer: peer)
    }

    // MARK: Staleness and read-your-writes

    enum Freshness: Equatable {
        case current
        /// Past --max-staleness, policy open: answered with `stale_for_ms`.
        case stale(milliseconds: UInt64)
        /// Past --max-staleness, policy closed: UNAVAILABLE with this message.
        case refused(String)

        /// What `stale_for_ms` carries: 0 unless stale.
        var staleForMilliseconds: UInt64 {
            if case .stale(let milliseconds) = self { milliseconds } else { 0 }
        }
    }

    /// Whether a fleet server has heard from PostgreSQL within --max-staleness
    /// (docs/fleet.md, "Staleness"). An embedded server has no upstream: one atomic load.
    func freshness() -> Freshness {
        guard let since = self.configuration.staleness(of: self.store) else {
            return .current
        }
        switch self.configuration.stalePolicy {
        case .open:
            return .stale(milliseconds: UInt64(since))
        case .closed:
            return .refused(Self.staleMessage(sinceMilliseconds: since, bound: self.configuration.maximumStaleness ?? .zero))
        }
    }

    static func staleMessage(sinceMilliseconds since: Int64, bound: TimeAmount) -> String {
        let limit = bound.nanoseconds / 1_000_000
        let limitText = limit % 1000 == 0 ? "\(limit / 1000)s" : "\(limit)ms"
        return "stale: this server last heard from PostgreSQL \(since / 1000).\(since % 1000 / 100) s ago, more than --max-staleness \(limitText), and --stale-policy is closed; retry on another server"
    }

    /// A read that asked for writes this server has not applied (`min_log_sequence`) waits
    /// at most --min-sequence-wait for them (fleet mode polls at once), then `run` answers
    /// it as usual; still behind, it fails UNAVAILABLE naming the sequence applied here.
    /// Off the hot path: a check without the field never comes here.
    func afterCatchingUp<Value: Sendable>(
        to minimum: UInt64,
        on loop: any EventLoop,
        run: @escaping (EntitlementMethods) -> EventLoopFuture<Result<Value, ServiceError>>
    ) -> EventLoopFuture<Result<Value, ServiceError>> {
        let promise = loop.makePromise(of: Result<Value, ServiceError>.self)
        let run = NIOLoopBound(run, eventLoop: loop)
        let store = self.store
        let wait = self.configuration.minimumSequenceWait
        store.requestCatchUp(to: minimum)
        Task {
            let caughtUp = await store.waitUntilApplied(minimum, timeout: .nanoseconds(wait.nanoseconds))
            loop.execute {
                guard caughtUp else {
                    promise.succeed(.failure(ServiceError(
                        .unavailable,
                        "behind: this server has applied log sequence \(store.appliedSequence), the call asked for min_log_sequence \(minimum); retry, or ask another server"
                    )))
                    return
                }
                if case .refused(let message) = self.freshness() {
                    promise.succeed(.failure(ServiceError(.unavailable, message)))  // went stale while it waited
                    return
                }
                promise.completeWith(run.value(self))
            }
        }
        return promise.futureResult
    }
}

/// A CheckEntitlements answer: the resolver's cached bytes and what the response adds.
public struct CheckAnswer: Sendable {
    public var answer: CachedAnswer
    public var userId: String
    /// nil for an unknown user.
    public var customerId: String?
    public var requestDate: Int64
    public var staleForMilliseconds: UInt64
    /// Where the answer came from.
    public var source: AnswerSource

    /// Whether the answer came from the cache (the framed protocol's FROM_CACHE flag).
    public var fromCache: Bool {
        self.source == .cache
    }

    /// Writes the encoded CheckEntitlementsResponse.
    public func write(into buffer: inout ByteBuffer) {
        self.answer.writeResponse(userId: self.userId, customerId: self.customerId, requestDate: self.requestDate, staleForMilliseconds: self.staleForMilliseconds, into: &buffer)
    }

    /// The room ``write(into:)`` reserves before writing (more than ``byteCount``).
    public var reservedByteCount: Int {
        self.answer.responseReservation(userId: self.userId, customerId: self.customerId)
    }

    /// The exact size of what ``write(into:)`` writes.
    public var byteCount: Int {
        self.answer.responseByteCount(userId: self.userId, customerId: self.customerId, requestDate: self.requestDate, staleForMilliseconds: self.staleForMilliseconds)
    }

    /// The answer as a message (decoded from its bytes: for transports that do not send
    /// protobuf).
    public func response() throws -> CheckEntitlementsResponse {
        var buffer = ByteBuffer()
        self.write(into: &buffer)
        return try CheckEntitlementsResponse(buffer: buffer)
    }

    static let stoppingMessage = "the server stopped before this check ran; retry on another server"

    @inline(__always)
    static func make(_ outcome: CheckOutcome, query: CheckQuery, staleForMilliseconds: UInt64) -> Result<CheckAnswer, ServiceError> {
        switch outcome {
        case .answer(let answer, let customerId, let source):
            .success(CheckAnswer(answer: answer, userId: query.userId, customerId: customerId, requestDate: query.instant, staleForMilliseconds: staleForMilliseconds, source: source))
        default:
            .failure(outcome.failure(userId: nil, batch: false))
        }
    }
}

extension CheckOutcome {
    /// The status and message of an outcome that is not an answer: the one mapping every
    /// path (single checks, batches, the benchmarks' gRPC peer) uses. `userId` names the
    /// user in a batch's message.
    @inline(never)
    func failure(userId: String?, batch: Bool) -> ServiceError {
        let user = userId.map { "user \($0): " } ?? ""
        switch self {
        case .answer:
            return ServiceError(.internalError, "\(user)an answer is not a failure")
        case .deadlineExceeded, .forward, .cold:
            return ServiceError(.deadlineExceeded, batch ? "the deadline passed before every user was checked" : "the deadline passed before the answer was ready")
        case .busy(let reason):
            return ServiceError(.resourceExhausted, user + reason)
        case .failed(let reason):
            return ServiceError(.internalError, user + reason)
        case .stopping:
            return ServiceError(.unavailable, CheckAnswer.stoppingMessage)
        }
    }
}

/// A BatchCheckEntitlements answer: one result per user id, in the request's order.
public struct BatchCheckAnswer: Sendable {
    public var userIds: [String]
    public var answers: [(CachedAnswer, customerId: String?)]
    public var requestDate: Int64
    public var staleForMilliseconds: UInt64

    /// Writes the encoded BatchCheckEntitlementsResponse: each user's answer as its
    /// `results` field (1), as a single check's.
    public func write(into buffer: inout ByteBuffer) {
        var single = ByteBuffer()
        for (userId, (answer, customerId)) in zip(self.userIds, self.answers) {
            single.clear()
            answer.writeResponse(userId: userId, customerId: customerId, requestDate: self.requestDate, staleForMilliseconds: self.staleForMilliseconds, into: &single)
            buffer.writeProtobufField(1, single)
        }
    }

    /// The answer as a message.
    public func response() throws -> BatchCheckEntitlementsResponse {
        var buffer = ByteBuffer()
        self.write(into: &buffer)
        return try BatchCheckEntitlementsResponse(buffer: buffer)
    }
}

/// Request validation shared by the methods: every id follows ``IdRule``.
enum Validation {
    /// The longest user id accepted, in UTF-8 bytes.
    static let maximumUserIdBytes = IdRule.maximumBytes

    /// `field` names the id in the message; it is made only when there is one (a batch
    /// would otherwise format `user_ids[i]` for every user it checks).
    static func problem(userId: String?, field: @autoclosure () -> String) -> String? {
        guard let problem = IdRule.problem(userId ?? "") else {
            return nil
        }
        return "\(field()): \(problem)"
    }

    static func problem(entitlementIds: [String]) -> String? {
        for (index, id) in entitlementIds.enumerated() {
            if let problem = IdRule.problem(id) {
                return "entitlement_ids[\(index)]: \(problem)"
            }
        }
        return nil
    }
}
