import EntitlementsMessages
import EntitlementsStore
import EntitlementsWire
import NIOCore
import NIOExtras

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The server side of one connection (docs/PROTOCOL.md): turns REQUEST frames into work
/// for the resolver pool, and answers in completion order. It enforces the protocol's
/// rules for this connection only: a violation gets an ERROR frame and closes this
/// connection, never another.
///
/// Runs on the connection's event loop; all its state is confined there.
final class ServerConnectionHandler: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let services: ServerServices
    private var pool: ResolverPool { self.services.pool }
    private let configuration: ServerConfiguration
    private var health: ServerHealth { self.services.health }
    /// Frames are decoded here, not by a ByteToMessageHandler before this handler: no
    /// pipeline hop and no NIOAny box per frame.
    private let frames: NIOSingleStepByteToMessageProcessor<FrameDecoder>
    /// Bytes read from the socket, and bytes of complete frames, for the slow-sender guard.
    private var received = 0
    private var consumed = 0
    /// Where the frame being handled starts in the stream, for connection errors.
    private var frameOffset = 0
    private var slowSenderTimer: Scheduled<Void>?
    private var consumedWhenArmed = 0
    /// When bytes last arrived, for the idle timeout (a partial frame counts; the
    /// slow-sender guard, with its shorter timeout, deals with those).
    private var lastActivity = NIODeadline.now()
    /// Checks answered OK during the current read from its own frames: counted, with one
    /// clock read for all of them, when the read's frames are done (a clock read and a lock
    /// per answer were 3 to 4% of the server's CPU at 50 x 16).
    private var checksAnsweredInRead = 0
    private var idleTimer: Scheduled<Void>?
    /// Armed once the sending side is shut down (see `closeGracefully`).
    private var lingerTimer: Scheduled<Void>?

    /// A call accepted and not yet answered.
    private struct Call {
        var timer: Scheduled<Void>?
        var method: MethodID
        /// When its frame was read, for the latency metric.
        var start: NIODeadline
    }

    /// Calls accepted and not yet answered.
    private var pending: [UInt64: Call] = [:]
    /// The method and read time of the request being handled (set by `request(_:)`).
    private var current = (method: MethodID(rawValue: 0), start: NIODeadline.uptimeNanoseconds(0))
    private var metrics: ServerMetrics { self.services.metrics }
    /// Open WatchEntitlements streams by request id (not in `pending`: they never end on
    /// their own).
    private var watches: [UInt64: Watch] = [:]
    private var lastRequestID: UInt64 = 0
    private var draining = false
    /// Tells resolvers on other loops when this connection has closed.
    private let scope = ConnectionScope()
    /// Set after a connection error, or when a drained connection closes: no more frames are read.
    private var closing = false
    /// Reads stop while too many calls are in flight, or while the socket cannot take
    /// more writes (a client that does not read its answers): backpressure, not buffering.
    private var readsPaused = false
    private var inReadBatch = false
    private var needsFlush = false
    /// Frames not yet handed to the channel (see `sendOutgoing`).
    private var outgoing = ByteBuffer()
    private var context: ChannelHandlerContext!

    init(services: ServerServices, configuration: ServerConfiguration) {
        self.services = services
        self.configuration = configuration
        self.frames = NIOSingleStepByteToMessageProcessor(FrameDecoder(maximumPayloadSize: configuration.maximumPayloadSize))
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        self.outgoing = context.channel.allocator.buffer(capacity: Self.outgoingInitialCapacity)
        self.armIdleTimer(at: NIODeadline.now() + self.configuration.idleTimeout)
    }

    /// Closes the connection once it has been idle (nothing in flight, no watch, no frame)
    /// for the idle timeout: GOAWAY first, so the client knows why.
    private func armIdleTimer(at deadline: NIODeadline) {
        self.idleTimer = self.context.eventLoop.assumeIsolated().scheduleTask(deadline: deadline) {
            guard self.context != nil, !self.draining else {
                return
            }
            let idleUntil = self.lastActivity + self.configuration.idleTimeout
            if idleUntil > NIODeadline.now() || !self.pending.isEmpty || !self.watches.isEmpty {
                self.armIdleTimer(at: max(idleUntil, NIODeadline.now() + .nanoseconds(self.configuration.idleTimeout.nanoseconds / 4)))
                return
            }
            let seconds = Double(self.configuration.idleTimeout.nanoseconds) / 1e9
            self.draining = true
            self.write(header: .goAway, requestID: self.lastRequestID, payload: ByteBuffer(string: "idle for \(seconds) s; reconnect when needed"))
            self.closeGracefully(waitForReader: false)
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        for call in self.pending.values {
            call.timer?.cancel()
            self.metrics.inFlight.decrement()
        }
        self.pending.removeAll()
        for watch in self.watches.values {
            watch.abandon()
        }
        self.watches.removeAll()
        self.idleTimer?.cancel()
        self.idleTimer = nil
        self.slowSenderTimer?.cancel()
        self.slowSenderTimer = nil
        self.lingerTimer?.cancel()
        self.lingerTimer = nil
        self.context = nil
    }

    // MARK: Reading

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard !self.closing else {
            return
        }
        let bytes = self.unwrapInboundIn(data)
        self.received += bytes.readableBytes
        self.inReadBatch = true
        // One clock read per read: the idle clock and the latency start of its frames.
        self.lastActivity = NIODeadline.now()
        do {
            try self.frames.process(buffer: bytes) { frame in
                self.handle(frame)
            }
        } catch {
            self.frameError(error)
        }
        if self.checksAnsweredInRead > 0 {
            self.metrics.answered(.checkEntitlements, .ok, count: self.checksAnsweredInRead, since: self.lastActivity)
            self.checksAnsweredInRead = 0
        }
        self.guardAgainstSlowSender()
    }

    private func handle(_ frame: Frame) {
        guard !self.closing else {
            return
        }
        self.frameOffset = self.consumed
        self.consumed += Frame.headerSize + frame.payload.readableBytes
        switch frame.type {
        case .request:
            self.request(frame)
        case .cancel:
            self.cancel(frame.requestID)
        case .ping:
            self.write(header: .pong, requestID: frame.requestID, payload: nil)
        case .pong:
            break
        case .error:
            // The client gave up on the connection: nothing it sent after this is read, and
            // what was sent to it goes out before the FIN.
            self.closeGracefully(waitForReader: false)
        case .response, .streamMessage, .endOfStream, .goAway:
            self.connectionError(.invalidArgument, "a client must not send \(frame.type) frames (at stream offset \(self.frameOffset))", requestID: frame.requestID)
        }
    }

    /// A malformed frame: ERROR with the decoder's reason, then close.
    private func frameError(_ error: any Error) {
        if let error = error as? FrameError {
            self.connectionError(error.status, error.description, requestID: 0)
        } else {
            self.connectionError(.invalidArgument, "\(error)", requestID: 0)
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        self.scope.close()  // checks still queued on other loops for this connection are skipped
        // The peer closed: a frame it left unfinished is reported (logged), not answered.
        if !self.closing {
            do {
                try self.frames.finishProcessing(seenEOF: true) { _ in }
            } catch {
                self.services.logger.info(
                    "connection error",
                    metadata: ["peer": "\(context.remoteAddress.map { "\($0)" } ?? "unix")", "error": "\(error)"]
                )
            }
        }
        context.fireChannelInactive()
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        self.inReadBatch = false
        self.flushIfNeeded()
        context.fireChannelReadComplete()
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable {
            for watch in self.watches.values {
                watch.channelBecameWritable()
            }
        }
        self.updateReading()
        context.fireChannelWritabilityChanged()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        self.services.logger.info(
            "connection error",
            metadata: ["peer": "\(context.remoteAddress.map { "\($0)" } ?? "unix")", "error": "\(error)"]
        )
        context.close(promise: nil)
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if event is ChannelShouldQuiesceEvent {
            self.drain()
        } else {
            context.fireUserInboundEventTriggered(event)
        }
    }

    // MARK: Requests

    private func request(_ frame: Frame) {
        self.current = (frame.method, self.lastActivity)  // read by channelRead for this frame
        guard frame.requestID > self.lastRequestID else {
            self.connectionError(
                .invalidArgument,
                "request id \(frame.requestID) is not greater than the previous one (\(self.lastRequestID)); ids must increase (at stream offset \(self.frameOffset))",
                requestID: frame.requestID
            )
            return
        }
        self.lastRequestID = frame.requestID
        if self.draining {
            return  // after GOAWAY: not processed, no answer; the client retries elsewhere
        }
        let deadline = frame.timeoutMicroseconds > 0
            ? self.current.start + .microseconds(Int64(frame.timeoutMicroseconds)) : nil
        switch frame.method {
        case .checkEntitlements:
            self.check(frame, deadline: deadline)
        case .batchCheckEntitlements:
            self.batchCheck(frame, deadline: deadline)
        case .health:
            self.healthCheck(frame)
        case .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant, .linkAlias, .deleteCustomer:
            self.write(frame, deadline: deadline)
        case .watchEntitlements:
            self.watch(frame)
        case .compact:
            self.compact(frame)
        default:
            self.fail(frame.requestID, .unimplemented, "\(frame.method) is not implemented by this server")
        }
    }

    private func check(_ frame: Frame, deadline: NIODeadline?) {
        let request: CheckEntitlementsRequest
        do {
            request = try CheckEntitlementsRequest(buffer: frame.payload)
        } catch {
            self.fail(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        if let problem = Validation.problem(userId: request.userId, field: "user_id") ?? Validation.problem(entitlementIds: request.entitlementIds) {
            self.fail(frame.requestID, .invalidArgument, problem)
            return
        }
        let freshness = self.freshness()
        if case .refused(let message) = freshness {
            self.fail(frame.requestID, .unavailable, message)
            return
        }
        let stale = freshness.staleForMilliseconds
        let userId = request.userId!
        let query = CheckQuery(
            userId: userId,
            environment: request.environment,
            entitlementIds: request.entitlementIds,
            instant: request.at ?? WallClock.unixMilliseconds(),
            deadline: deadline
        )
        let requestID = frame.requestID  // not the frame: its payload pins the read buffer
        if request.minLogSequence > 0, self.services.store.appliedSequence < request.minLogSequence {
            self.afterCatchingUp(to: request.minLogSequence, requestID, deadline: deadline) { handler in
                let promise = handler.context.eventLoop.makePromise(of: CheckOutcome.self)
                handler.pool.check(query, for: handler.scope, completing: promise)
                handler.answerLater(requestID, userId: userId, instant: query.instant, staleForMilliseconds: handler.freshness().staleForMilliseconds, promise.futureResult)
            }
            return
        }
        // When the user's resolver runs on this connection's loop (always with one loop; 1 in
        // L checks with L loops) the check is answered now: no promise, no pending entry, no hop.
        let first = self.pool.resolver(for: userId)
        var outcome: CheckOutcome?
        if first.eventLoop === self.context.eventLoop {
            outcome = first.core.value.check(query)
        }
        if let outcome, !outcome.isForward {
            self.answer(Call(timer: nil, method: self.current.method, start: self.current.start), requestID) { buffer in
                Self.writeCheck(outcome, userId: userId, instant: query.instant, staleForMilliseconds: stale, into: &buffer)
            } failure: {
                Self.status(of: outcome)
            }
            self.afterCompletion()
            return
        }
        // The resolver is on another loop, or this was an alias of another resolver's
        // customer (which that resolver answers): one hop, answered when it is back.
        self.accept(requestID, deadline: deadline)
        let promise = self.context.eventLoop.makePromise(of: CheckOutcome.self)
        if case .forward(let shard, let customerId) = outcome {
            self.pool.check(query, owner: shard, customerId: customerId, for: self.scope, completing: promise)
        } else {
            self.pool.check(query, for: self.scope, completing: promise)
        }
        self.answerLater(requestID, userId: userId, instant: query.instant, staleForMilliseconds: stale, promise.futureResult)
    }

    private enum Freshness: Equatable {
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
    private func freshness() -> Freshness {
        guard let since = self.configuration.staleness(of: self.services.store) else {
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

    /// A read that asked for writes this server has not applied (`min_log_sequence`): it is
    /// accepted, waits at most --min-sequence-wait for them (fleet mode polls at once), then
    /// `run` answers it as usual; still behind, it fails UNAVAILABLE naming the sequence
    /// applied here. Off the hot path: a check without the field never comes here.
    private func afterCatchingUp(
        to minimum: UInt64,
        _ requestID: UInt64,
        deadline: NIODeadline?,
        run: @escaping (ServerConnectionHandler) -> Void
    ) {
        self.accept(requestID, deadline: deadline)
        let loop = self.context.eventLoop
        let handler = NIOLoopBound(self, eventLoop: loop)
        let run = NIOLoopBound(run, eventLoop: loop)
        let store = self.services.store
        let wait = self.configuration.minimumSequenceWait
        store.requestCatchUp(to: minimum)
        Task {
            let caughtUp = await store.waitUntilApplied(minimum, timeout: .nanoseconds(wait.nanoseconds))
            loop.execute {
                let handler = handler.value
                guard handler.context != nil, handler.pending[requestID] != nil else {
                    return  // timed out, or the connection closed, meanwhile
                }
                guard caughtUp else {
                    handler.fail(
                        requestID,
                        .unavailable,
                        "behind: this server has applied log sequence \(store.appliedSequence), the call asked for min_log_sequence \(minimum); retry, or ask another server"
                    )
                    return
                }
                if case .refused(let message) = handler.freshness() {
                    handler.fail(requestID, .unavailable, message)  // went stale while it waited
                    return
                }
                run.value(handler)
            }
        }
    }

    /// Answers an accepted check when its resolver on another event loop is done.
    private func answerLater(_ requestID: UInt64, userId: String, instant: Int64, staleForMilliseconds: UInt64, _ outcome: EventLoopFuture<CheckOutcome>) {
        outcome.assumeIsolated().whenSuccess { outcome in
            self.complete(requestID) { buffer in
                Self.writeCheck(outcome, userId: userId, instant: instant, staleForMilliseconds: staleForMilliseconds, into: &buffer)
            } failure: {
                Self.status(of: outcome)
            }
        }
    }

    /// Writes a check's RESPONSE payload: the answer's bytes and nil flags for a failure
    /// (whose message it writes).
    private static func writeCheck(_ outcome: CheckOutcome, userId: String, instant: Int64, staleForMilliseconds: UInt64, into buffer: inout ByteBuffer) -> FrameFlags? {
        switch outcome {
        case .answer(let answer, let customerId, let fromCache):
            answer.writeResponse(userId: userId, customerId: customerId, requestDate: instant, staleForMilliseconds: staleForMilliseconds, into: &buffer)
            return fromCache ? .fromCache : []
        case .deadlineExceeded, .forward:
            return nil
        case .failed(let reason):
            buffer.writeString(reason)
            return nil
        case .stopping:
            buffer.writeString(Self.stoppingMessage)
            return nil
        }
    }

    private static let stoppingMessage = "the server stopped before this check ran; retry on another server"

    private static func status(of outcome: CheckOutcome) -> StatusCode {
        switch outcome {
        case .failed: .internalError
        case .stopping: .unavailable
        default: .deadlineExceeded
        }
    }

    private func batchCheck(_ frame: Frame, deadline: NIODeadline?) {
        let request: BatchCheckEntitlementsRequest
        do {
            request = try BatchCheckEntitlementsRequest(buffer: frame.payload)
        } catch {
            self.fail(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        guard request.userIds.count <= self.configuration.maximumBatchSize else {
            self.fail(
                frame.requestID,
                .resourceExhausted,
                "user_ids: \(request.userIds.count) users; a batch holds at most \(self.configuration.maximumBatchSize)"
            )
            return
        }
        for (index, userId) in request.userIds.enumerated() {
            if let problem = Validation.problem(userId: userId, field: "user_ids[\(index)]") {
                self.fail(frame.requestID, .invalidArgument, problem)
                return
            }
        }
        if let problem = Validation.problem(entitlementIds: request.entitlementIds) {
            self.fail(frame.requestID, .invalidArgument, problem)
            return
        }
        let freshness = self.freshness()
        if case .refused(let message) = freshness {
            self.fail(frame.requestID, .unavailable, message)
            return
        }
        let instant = request.at ?? WallClock.unixMilliseconds()
        let requestID = frame.requestID  // not the frame: its payload pins the read buffer
        if request.minLogSequence > 0, self.services.store.appliedSequence < request.minLogSequence {
            self.afterCatchingUp(to: request.minLogSequence, requestID, deadline: deadline) { handler in
                handler.runBatch(request, instant: instant, staleForMilliseconds: handler.freshness().staleForMilliseconds, requestID: requestID, deadline: deadline)
            }
            return
        }
        self.accept(requestID, deadline: deadline)
        self.runBatch(request, instant: instant, staleForMilliseconds: freshness.staleForMilliseconds, requestID: requestID, deadline: deadline)
    }

    /// Resolves an accepted batch and answers it.
    private func runBatch(_ request: BatchCheckEntitlementsRequest, instant: Int64, staleForMilliseconds: UInt64, requestID: UInt64, deadline: NIODeadline?) {
        let queries = request.userIds.map { userId in
            CheckQuery(userId: userId, environment: request.environment, entitlementIds: request.entitlementIds, instant: instant, deadline: deadline)
        }
        let answered = self.context.eventLoop.makePromise(of: [CheckOutcome].self)
        self.pool.checkBatch(queries, for: self.scope, on: self.context.eventLoop, completing: answered)
        answered.futureResult.assumeIsolated().whenSuccess { outcomes in
            guard self.pending[requestID] != nil else {
                return  // cancelled or timed out meanwhile
            }
            for (userId, outcome) in zip(request.userIds, outcomes) {
                switch outcome {
                case .answer:
                    continue
                case .failed(let reason):
                    self.fail(requestID, .internalError, "user \(userId): \(reason)")
                    return
                case .stopping:
                    self.fail(requestID, .unavailable, Self.stoppingMessage)
                    return
                case .deadlineExceeded, .forward:
                    self.fail(requestID, .deadlineExceeded, "the deadline passed before every user was checked")
                    return
                }
            }
            self.complete(requestID) { buffer in
                var single = ByteBuffer()
                for (userId, outcome) in zip(request.userIds, outcomes) {
                    guard case .answer(let answer, let customerId, _) = outcome else {
                        continue
                    }
                    single.clear()
                    answer.writeResponse(userId: userId, customerId: customerId, requestDate: instant, staleForMilliseconds: staleForMilliseconds, into: &single)
                    // results (field 1) of BatchCheckEntitlementsResponse: tag, length, message.
                    Self.writeVarint(1 << 3 | 2, into: &buffer)
                    Self.writeVarint(UInt64(single.readableBytes), into: &buffer)
                    buffer.writeImmutableBuffer(single)
                }
                return []
            } failure: {
                .internalError
            }
        }
    }

    private func healthCheck(_ frame: Frame) {
        // Every request is decoded, even one with no fields: garbage is refused, not answered.
        do {
            _ = try HealthRequest(buffer: frame.payload)
        } catch {
            self.fail(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        let response = HealthResponse(
            // A fleet server past --max-staleness with --stale-policy closed refuses checks.
            status: self.draining || !self.health.isServing || self.freshness() != .current && self.configuration.stalePolicy == .closed ? .notServing : .serving,
            snapshotId: self.services.store.snapshot.header.snapshotId,
            uptimeMs: self.health.uptimeMilliseconds,
            version: self.configuration.version
        )
        self.accept(frame.requestID, deadline: nil)
        self.complete(frame.requestID) { buffer in
            // A HealthResponse of these fields always encodes.
            try? response.serialize(into: &buffer)
            return []
        } failure: {
            .internalError
        }
    }

    // MARK: Writes

    /// A write: validated and applied by the store, acknowledged once it is durable and
    /// every resolver has forgotten what it changed (so any later check sees it).
    private func write(_ frame: Frame, deadline: NIODeadline?) {
        let mutation: LogRecord.Mutation
        do {
            mutation = try Self.mutation(frame)
        } catch {
            self.fail(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        let requestID = frame.requestID
        self.accept(requestID, deadline: deadline)
        let loop = self.context.eventLoop
        let handler = NIOLoopBound(self, eventLoop: loop)
        let services = self.services
        services.store.write(mutation, now: WallClock.unixMilliseconds()) { result in
            switch result {
            case .success(let outcome):
                let response = WriteResponse(
                    customerId: outcome.customerId,
                    logSequence: outcome.sequence ?? 0,
                    changed: outcome.changed,
                    created: outcome.created
                )
                // The store calls this once every resolver has dropped what the write
                // changed (ServerServices.afterCommit).
                loop.execute { handler.value.answerWrite(requestID, response) }
            case .failure(let error):
                loop.execute {
                    handler.value.failWrite(requestID, error)
                }
            }
        }
    }

    private func answerWrite(_ requestID: UInt64, _ response: WriteResponse) {
        guard self.context != nil else {
            return
        }
        self.complete(requestID) { buffer in
            (try? response.serialize(into: &buffer)) == nil ? nil : []
        } failure: {
            .internalError
        }
    }

    private func failWrite(_ requestID: UInt64, _ error: any Error) {
        guard self.context != nil, self.pending[requestID] != nil else {
            return
        }
        if let refusal = error as? WriteRefusal {
            self.fail(requestID, Self.status(of: refusal), refusal.message)
        } else {
            self.fail(requestID, .internalError, "\(error)")
        }
    }

    static func status(of refusal: WriteRefusal) -> StatusCode {
        switch refusal.reason {
        case .invalidArgument: .invalidArgument
        case .notFound: .notFound
        case .failedPrecondition: .failedPrecondition
        case .unavailable: .unavailable
        }
    }

    private static func mutation(_ frame: Frame) throws -> LogRecord.Mutation {
        switch frame.method {
        case .recordTransaction: .recordTransaction(try RecordTransactionRequest(buffer: frame.payload))
        case .updateSubscriptionState: .updateSubscriptionState(try UpdateSubscriptionStateRequest(buffer: frame.payload))
        case .grantEntitlement: .grantEntitlement(try GrantEntitlementRequest(buffer: frame.payload))
        case .revokeGrant: .revokeGrant(try RevokeGrantRequest(buffer: frame.payload))
        case .linkAlias: .linkAlias(try LinkAliasRequest(buffer: frame.payload))
        default: .deleteCustomer(try DeleteCustomerRequest(buffer: frame.payload))
        }
    }

    private func compact(_ frame: Frame) {
        do {
            _ = try CompactRequest(buffer: frame.payload)
        } catch {
            self.fail(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        let requestID = frame.requestID
        self.accept(requestID, deadline: nil)
        let handler = NIOLoopBound(self, eventLoop: self.context.eventLoop)
        let loop = self.context.eventLoop
        let services = self.services
        Task {
            let result: Result<CustomerStore.CompactionReport, any Error>
            do {
                result = .success(try await services.compact())
            } catch {
                result = .failure(error)
            }
            loop.execute {
                switch result {
                case .success(let report):
                    let response = CompactResponse(snapshotId: report.snapshotId, lastLogSequence: report.lastLogSequence)
                    handler.value.complete(requestID) { buffer in
                        (try? response.serialize(into: &buffer)) == nil ? nil : []
                    } failure: {
                        .internalError
                    }
                case .failure(let error):
                    handler.value.failWrite(requestID, error)
                }
            }
        }
    }

    // MARK: Watch

    /// Refuses a watch: a streaming call always ends with END_OF_STREAM.
    private func refuseWatch(_ requestID: UInt64, _ status: StatusCode, _ message: String) {
        self.metrics.answered(.watchEntitlements, status, since: self.current.start)
        var buffer = self.context.channel.allocator.buffer(capacity: Frame.headerSize + message.utf8.count)
        buffer.writeFrame(Frame(type: .endOfStream, status: status, requestID: requestID, payload: ByteBuffer(string: message)))
        self.send(buffer)
    }

    private func watch(_ frame: Frame) {
        var request: WatchEntitlementsRequest
        do {
            request = try WatchEntitlementsRequest(buffer: frame.payload)
        } catch {
            self.refuseWatch(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        if request.allCustomers {
            request.userIds = []  // ignored when all_customers is set (service.proto)
        } else if request.userIds.isEmpty {
            self.refuseWatch(frame.requestID, .invalidArgument, "user_ids: give at least one, or set all_customers")
            return
        }
        guard request.userIds.count <= self.configuration.maximumBatchSize else {
            self.refuseWatch(
                frame.requestID,
                .resourceExhausted,
                "user_ids: \(request.userIds.count) users; a watch holds at most \(self.configuration.maximumBatchSize)"
            )
            return
        }
        for (index, userId) in request.userIds.enumerated() {
            if let problem = Validation.problem(userId: userId, field: "user_ids[\(index)]") {
                self.refuseWatch(frame.requestID, .invalidArgument, problem)
                return
            }
        }
        if let problem = Validation.problem(entitlementIds: request.entitlementIds) {
            self.refuseWatch(frame.requestID, .invalidArgument, problem)
            return
        }
        let requestID = frame.requestID
        let store = self.services.store
        let customerIds: [String]
        do {
            // Aliases are watched as their customer; an unknown id as the customer a first
            // write would create.
            customerIds = Array(Set(try request.userIds.map { try store.customer(for: $0)?.id ?? $0 }))
        } catch {
            self.refuseWatch(requestID, .internalError, "\(error)")
            return
        }
        let hub = self.services.watches
        let watch = Watch(
            eventLoop: self.context.eventLoop,
            requestID: requestID,
            request: request,
            customerIds: customerIds,
            resolver: self.pool.resolver,
            store: store,
            bufferLimit: self.configuration.watchBufferEvents,
            send: { [unowned self] buffer in
                self.send(buffer)
                return self.context?.channel.isWritable ?? false
            },
            ended: { [unowned self] watch in
                hub.remove(watch)
                self.watches[watch.requestID] = nil
            }
        )
        guard hub.add(watch) else {
            self.refuseWatch(requestID, .resourceExhausted, "the server has \(hub.maximumWatches) watch streams, its maximum; try again later")
            return
        }
        self.watches[requestID] = watch
        if frame.timeoutMicroseconds > 0 {
            // A stream's timeout bounds the whole stream, as a unary call's bounds its answer.
            let seconds = Double(frame.timeoutMicroseconds) / 1e6
            self.context.eventLoop.assumeIsolated().scheduleTask(deadline: self.current.start + .microseconds(Int64(frame.timeoutMicroseconds))) { [weak watch] in
                watch?.finish(.deadlineExceeded, "the watch's timeout of \(seconds) s elapsed; send a new WatchEntitlements to go on")
            }
        }
        do {
            try watch.start(now: WallClock.unixMilliseconds())
        } catch {
            watch.finish(.internalError, "cannot read the watched customers: \(error)")
        }
    }

    private func cancel(_ requestID: UInt64) {
        if let watch = self.watches[requestID] {
            watch.finish(.cancelled, "cancelled by the client")
            return
        }
        guard self.pending[requestID] != nil else {
            return  // already answered, or never existed: harmless
        }
        self.fail(requestID, .cancelled, "cancelled by the client")
    }

    // MARK: Answering

    /// Registers a call as in flight, with its deadline, and applies backpressure.
    private func accept(_ requestID: UInt64, deadline: NIODeadline?) {
        var timer: Scheduled<Void>?
        if let deadline {
            timer = self.context.eventLoop.assumeIsolated().scheduleTask(deadline: deadline) {
                if self.pending[requestID] != nil {
                    self.fail(requestID, .deadlineExceeded, "the deadline passed before the answer was ready")
                }
            }
        }
        self.pending[requestID] = Call(timer: timer, method: self.current.method, start: self.current.start)
        self.metrics.inFlight.increment()
        self.updateReading()
    }

    /// Pauses reading when too many calls are in flight or the socket is not writable;
    /// resumes when neither holds.
    private func updateReading() {
        guard let context = self.context else {
            return
        }
        // Once draining (GOAWAY sent) nothing new is accepted, so reading costs nothing and
        // keeps the receive buffer empty: a close with unread input is answered with a
        // reset, which would drop the answers still on their way to the client.
        let shouldPause = !self.draining
            && (self.pending.count >= self.configuration.maximumInFlightPerConnection || !context.channel.isWritable)
        if shouldPause, !self.readsPaused {
            self.readsPaused = true
            context.channel.setOption(ChannelOptions.autoRead, value: false).whenComplete { _ in }
        } else if !shouldPause, self.readsPaused {
            self.readsPaused = false
            context.channel.setOption(ChannelOptions.autoRead, value: true).whenComplete { _ in }
            context.read()
        }
    }

    /// Answers a pending call: `body` writes the payload of an OK RESPONSE and returns its
    /// flags, or returns nil for a failure whose status `failure` gives (the payload then
    /// being the message). A call no longer pending (cancelled, timed out) is dropped.
    fileprivate func complete(
        _ requestID: UInt64,
        _ body: (inout ByteBuffer) -> FrameFlags?,
        failure: () -> StatusCode
    ) {
        guard let call = self.pending.removeValue(forKey: requestID) else {
            return
        }
        call.timer?.cancel()
        self.metrics.inFlight.decrement()
        self.answer(call, requestID, body, failure: failure)
        self.afterCompletion()
    }

    /// Writes the RESPONSE frame of `call` (no longer pending) straight into the outgoing
    /// bytes: no buffer of its own.
    private func answer(
        _ call: Call,
        _ requestID: UInt64,
        _ body: (inout ByteBuffer) -> FrameFlags?,
        failure: () -> StatusCode
    ) {
        let frameStart = self.outgoing.writerIndex
        self.outgoing.writeRepeatingByte(0, count: Frame.headerSize)  // the header, once the length is known
        let flags = body(&self.outgoing)
        let payloadLength = self.outgoing.writerIndex - frameStart - Frame.headerSize
        guard payloadLength <= Frame.defaultMaximumPayloadSize else {
            // Clients accept 1 MiB by default (docs/PROTOCOL.md): a larger answer would be
            // a connection error on their side, failing every call on the connection.
            self.outgoing.moveWriterIndex(to: frameStart)
            let message = "the answer is \(payloadLength) bytes; a frame carries at most \(Frame.defaultMaximumPayloadSize) (ask for fewer users or entitlements)"
            self.metrics.answered(call.method, .resourceExhausted, since: call.start)
            self.outgoing.writeFrame(.failure(id: requestID, status: .resourceExhausted, message: message))
            self.sendOutgoing()
            return
        }
        let end = self.outgoing.writerIndex
        self.outgoing.moveWriterIndex(to: frameStart)
        if let flags {
            self.outgoing.writeFrameHeader(type: .response, flags: flags, requestID: requestID, payloadLength: UInt32(payloadLength))
            if self.inReadBatch, call.start == self.lastActivity, call.method == .checkEntitlements {
                self.checksAnsweredInRead += 1  // counted at the end of this read
            } else {
                self.metrics.answered(call.method, .ok, since: call.start)
            }
        } else {
            let status = failure()
            self.outgoing.writeFrameHeader(type: .response, status: status, requestID: requestID, payloadLength: UInt32(payloadLength))
            self.metrics.answered(call.method, status, since: call.start)
        }
        self.outgoing.moveWriterIndex(to: end)
        self.sendOutgoing()
    }

    /// Fails a call (pending or not yet accepted) with a status and a message.
    private func fail(_ requestID: UInt64, _ status: StatusCode, _ message: String) {
        if let call = self.pending.removeValue(forKey: requestID) {
            call.timer?.cancel()
            self.metrics.inFlight.decrement()
            self.metrics.answered(call.method, status, since: call.start)
        } else {
            self.metrics.answered(self.current.method, status, since: self.current.start)  // refused before it was accepted
        }
        self.outgoing.writeFrame(.failure(id: requestID, status: status, message: message))
        self.sendOutgoing()
        self.afterCompletion()
    }

    private func write(header type: FrameType, requestID: UInt64, payload: ByteBuffer?) {
        self.outgoing.writeFrame(Frame(type: type, requestID: requestID, payload: payload ?? ByteBuffer()))
        self.sendOutgoing()
    }

    private func send(_ buffer: ByteBuffer) {
        self.outgoing.writeImmutableBuffer(buffer)
        self.sendOutgoing()
    }

    /// Frames written into `outgoing` go out with one write and one flush per read batch
    /// (at its end, or as soon as 16 KiB are waiting), or at once outside a read batch (a
    /// hop's answer, a watch event, a timer).
    private func sendOutgoing() {
        if self.closing {
            // The connection's last frame (the final answer, a GOAWAY or an ERROR) is out:
            // nothing follows it, not even a late answer from another loop.
            self.outgoing.clear()
            return
        }
        if self.inReadBatch {
            self.needsFlush = true
            if self.outgoing.readableBytes >= Self.outgoingFlushThreshold {
                self.flushOutgoing()  // bounded memory, and writability sees the bytes
            }
        } else {
            self.flushOutgoing()
        }
    }

    /// Writes and flushes the outgoing bytes, then makes `outgoing` ready for more. When the
    /// socket took every byte, the channel has let go of the storage and `clear` reuses it
    /// (no allocation next time); otherwise the channel still holds it and `outgoing` gets
    /// new, small storage (writing into shared storage would copy all of it). A buffer grown
    /// by a large answer is not kept.
    private func flushOutgoing() {
        if self.outgoing.readableBytes > 0 {
            self.context.write(self.wrapOutboundOut(self.outgoing), promise: nil)
        }
        self.context.flush()
        if self.outgoing.capacity >= Self.outgoingFlushThreshold {
            self.outgoing = self.context.channel.allocator.buffer(capacity: Self.outgoingInitialCapacity)
        } else {
            self.outgoing.clear(minimumCapacity: Self.outgoingInitialCapacity)
        }
    }

    /// Outgoing bytes are flushed once this many wait in a read batch; a buffer this large
    /// is not kept.
    private static let outgoingFlushThreshold = 16 * 1024
    private static let outgoingInitialCapacity = 1_024

    private func flushIfNeeded() {
        if self.needsFlush {
            self.needsFlush = false
            self.flushOutgoing()
        }
    }

    private func afterCompletion() {
        self.updateReading()
        if self.draining, self.pending.isEmpty, !self.closing {
            self.closeGracefully()  // the rest of this read batch is not processed
        }
    }

    /// Ends the connection without losing a byte sent: the outgoing bytes are written, the
    /// sending side is shut down once NIO has handed every pending write to the socket (a
    /// FIN after the last answer), and the connection is read and discarded until the
    /// client closes it, or for at most `closeLinger`. Closing at once instead, with
    /// answers still queued or input unread, makes the kernel reset the connection and
    /// drop what the client had not yet received (the GOAWAY and answers included).
    ///
    /// `waitForReader`: a drain waits for a slow reader to take every answer (serve's
    /// --drain-timeout bounds it); an idle or broken connection gets `closeLinger` in all.
    private func closeGracefully(waitForReader: Bool = true) {
        guard let context = self.context, !self.closing else {
            return
        }
        self.closing = true  // nothing more is read as frames
        self.draining = true
        self.needsFlush = false
        self.flushOutgoing()
        self.updateReading()
        let linger = self.configuration.closeLinger
        if !waitForReader {
            self.lingerTimer = context.eventLoop.assumeIsolated().scheduleTask(in: linger) {
                self.context?.close(promise: nil)
            }
        }
        context.close(mode: .output).assumeIsolated().whenComplete { result in
            guard let context = self.context else {
                return
            }
            if case .failure = result {
                context.close(promise: nil)
                return
            }
            guard self.lingerTimer == nil else {
                return  // already bounded
            }
            self.lingerTimer = context.eventLoop.assumeIsolated().scheduleTask(in: linger) {
                self.context?.close(promise: nil)
            }
        }
    }

    // MARK: Connection-level

    /// GOAWAY with the last accepted id; finish what is pending; then close.
    private func drain() {
        guard !self.draining else {
            return
        }
        self.draining = true
        self.write(header: .goAway, requestID: self.lastRequestID, payload: ByteBuffer(string: "server shutting down"))
        for watch in Array(self.watches.values) {
            watch.finish(.unavailable, "the server is shutting down; resubscribe")
        }
        self.updateReading()  // paused reads resume: input after GOAWAY is read and dropped
        self.flushIfNeeded()
        if self.pending.isEmpty {
            self.closeGracefully()  // a frame left unread is ours to drop, not the client's error
        }
    }

    private func connectionError(_ status: StatusCode, _ message: String, requestID: UInt64) {
        guard let context = self.context else {
            return
        }
        guard !self.closing else {
            return
        }
        // One line per connection error; requests are never logged at the default level.
        self.services.logger.info(
            "connection error",
            metadata: ["peer": "\(context.remoteAddress.map { "\($0)" } ?? "unix")", "status": "\(status)", "error": "\(message)"]
        )
        // Answers already written go first; the ERROR is the last frame.
        self.outgoing.writeFrame(.error(id: requestID, status: status, message: message))
        self.closeGracefully(waitForReader: false)
    }

    // MARK: Slow senders

    /// Cuts off a sender that starts a frame and does not finish it within the frame
    /// timeout (slowloris: holding a connection with a trickle of bytes). Armed while a
    /// frame is partial; time the server itself stopped reading is not held against it.
    private func guardAgainstSlowSender() {
        if self.received > self.consumed {
            if self.slowSenderTimer == nil {
                self.armSlowSenderTimer()
            }
        } else {
            self.slowSenderTimer?.cancel()
            self.slowSenderTimer = nil
        }
    }

    private func armSlowSenderTimer() {
        self.consumedWhenArmed = self.consumed
        self.slowSenderTimer = self.context.eventLoop.assumeIsolated().scheduleTask(in: self.configuration.frameTimeout) {
            self.slowSenderTimer = nil
            self.slowSenderTimerFired()
        }
    }

    private func slowSenderTimerFired() {
        guard self.context != nil, !self.closing, self.received > self.consumed else {
            return  // nothing partial
        }
        if self.readsPaused || self.consumed != self.consumedWhenArmed {
            self.armSlowSenderTimer()  // frames completed meanwhile, or we stopped reading
            return
        }
        let seconds = Double(self.configuration.frameTimeout.nanoseconds) / 1e9
        self.connectionError(
            .deadlineExceeded,
            "a frame started \(seconds) s ago has not arrived in full (\(self.received - self.consumed) bytes so far); closing (at stream offset \(self.consumed))",
            requestID: 0
        )
    }

    // MARK: Helpers


    private static func writeVarint(_ value: UInt64, into buffer: inout ByteBuffer) {
        var value = value
        while value >= 0x80 {
            buffer.writeInteger(UInt8(truncatingIfNeeded: value) | 0x80)
            value >>= 7
        }
        buffer.writeInteger(UInt8(value))
    }
}

/// Request validation shared by the methods.
enum Validation {
    /// The longest user id accepted, in UTF-8 bytes.
    static let maximumUserIdBytes = 256

    static func problem(userId: String?, field: String) -> String? {
        guard let userId, !userId.isEmpty else {
            return "\(field): must not be empty"
        }
        guard userId.utf8.count <= Self.maximumUserIdBytes else {
            return "\(field): must be at most \(Self.maximumUserIdBytes) bytes, got \(userId.utf8.count)"
        }
        return nil
    }

    static func problem(entitlementIds: [String]) -> String? {
        for (index, id) in entitlementIds.enumerated() where id.isEmpty || id.utf8.count > Self.maximumUserIdBytes {
            return "entitlement_ids[\(index)]: must be 1 to \(Self.maximumUserIdBytes) bytes"
        }
        return nil
    }
}
