public import EntitlementsFormats
public import EntitlementsMessages
public import EntitlementsStore
public import EntitlementsWire
public import NIOCore

/// How a transport reads requests and writes answers: protobuf (the framed protocol and
/// gRPC, ``ProtobufCodec``) or JSON (the HTTP/JSON door). A codec holds no rules: it turns
/// bytes into the service's request messages and its answers into bytes, and nothing else.
public protocol CallCodec: Sendable {
    /// An encoded answer, as the transport sends it.
    associatedtype Encoded: Sendable

    /// The request of `method` in `body`; throws a message a person can act on.
    func decode<Request: ServiceRequest>(_ type: Request.Type, from body: ByteBuffer) throws -> Request

    func encode(_ answer: CheckAnswer) throws -> Encoded
    func encode(_ answer: BatchCheckAnswer) throws -> Encoded
    func encode(_ answer: HealthResponse) throws -> Encoded
    func encode(_ answer: WriteResponse) throws -> Encoded
    func encode(_ answer: CompactResponse) throws -> Encoded
    func encode(_ answer: SubmitPurchaseResponse) throws -> Encoded
    /// An explained check's answer (``CheckEntitlementsRequest/explain``).
    func encode(_ answer: CheckEntitlementsResponse) throws -> Encoded
    func encode(_ answer: CustomerHistoryResponse) throws -> Encoded

    /// The size of an encoded answer's message, for ``AnswerLimit``.
    func byteCount(of encoded: Encoded) -> Int

    /// The transport's protocol, as a span's `rpc.system` names it (``CallTracing``).
    var rpcSystem: String { get }
}

/// A request message of `entitlements.v1.EntitlementService`: protobuf, or protobuf's JSON
/// mapping (the JSON door).
public protocol ServiceRequest: ProtobufMessage, ProtoJSONDecodable {}

extension CheckEntitlementsRequest: ServiceRequest {}
extension BatchCheckEntitlementsRequest: ServiceRequest {}
extension HealthRequest: ServiceRequest {}
extension CompactRequest: ServiceRequest {}
extension RecordTransactionRequest: ServiceRequest {}
extension UpdateSubscriptionStateRequest: ServiceRequest {}
extension GrantEntitlementRequest: ServiceRequest {}
extension RevokeGrantRequest: ServiceRequest {}
extension LinkAliasRequest: ServiceRequest {}
extension DeleteCustomerRequest: ServiceRequest {}
extension WatchEntitlementsRequest: ServiceRequest {}
extension SubmitPurchaseRequest: ServiceRequest {}
extension CustomerHistoryRequest: ServiceRequest {}

/// Protobuf requests and answers: the framed protocol's payloads, or gRPC's
/// length-prefixed messages.
public struct ProtobufCodec: CallCodec {
    /// Whether bodies and answers carry gRPC's message prefix (a compression flag and a
    /// 4-byte length: https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md).
    /// An answer is encoded with its prefix in place, so that it is never copied to add one.
    public var grpcFraming: Bool

    /// `grpcFraming`: gRPC's message prefix on bodies and answers (the door), or none (the
    /// framed protocol's payloads).
    public init(grpcFraming: Bool) {
        self.grpcFraming = grpcFraming
    }

    public func decode<Request: ServiceRequest>(_ type: Request.Type, from body: ByteBuffer) throws -> Request {
        try Request(buffer: self.grpcFraming ? try Self.message(in: body) : body)
    }

    /// The one message of a unary gRPC request body.
    public static func message(in body: ByteBuffer) throws(ServiceError) -> ByteBuffer {
        var body = body
        guard let flag = body.readInteger(as: UInt8.self), let length = body.readInteger(as: UInt32.self) else {
            throw ServiceError(.invalidArgument, "the request has no message: a unary call carries exactly one")
        }
        guard flag == 0 else {
            throw ServiceError(.unimplemented, "the request message is compressed (flag \(flag)); this server reads uncompressed messages only")
        }
        guard let message = body.readSlice(length: Int(length)) else {
            throw ServiceError(.invalidArgument, "the request message is cut short: \(length) bytes announced, \(body.readableBytes) sent")
        }
        guard body.readableBytes == 0 else {
            throw ServiceError(.invalidArgument, "the request has more than one message: a unary call carries exactly one")
        }
        return message
    }

    public func encode(_ answer: CheckAnswer) -> ByteBuffer {
        self.encoded(capacity: 5 + answer.reservedByteCount) { answer.write(into: &$0) }  // one allocation
    }

    public func encode(_ answer: BatchCheckAnswer) -> ByteBuffer {
        self.encoded { answer.write(into: &$0) }
    }

    public func encode(_ answer: HealthResponse) throws -> ByteBuffer {
        try self.encoded { try answer.serialize(into: &$0) }
    }

    public func encode(_ answer: WriteResponse) throws -> ByteBuffer {
        try self.encoded { try answer.serialize(into: &$0) }
    }

    public func encode(_ answer: CompactResponse) throws -> ByteBuffer {
        try self.encoded { try answer.serialize(into: &$0) }
    }

    public func encode(_ answer: SubmitPurchaseResponse) throws -> ByteBuffer {
        try self.encoded { try answer.serialize(into: &$0) }
    }

    public func encode(_ answer: CheckEntitlementsResponse) throws -> ByteBuffer {
        try self.encoded { try answer.serialize(into: &$0) }
    }

    public func encode(_ answer: CustomerHistoryResponse) throws -> ByteBuffer {
        try self.encoded { try answer.serialize(into: &$0) }
    }

    /// A message as gRPC sends it: the prefix, then the message.
    public static func grpcMessage(_ message: ByteBuffer) -> ByteBuffer {
        ProtobufCodec(grpcFraming: true).encoded(capacity: 5 + message.readableBytes) { $0.writeImmutableBuffer(message) }
    }

    public func byteCount(of encoded: ByteBuffer) -> Int {
        encoded.readableBytes - (self.grpcFraming ? 5 : 0)
    }

    public var rpcSystem: String {
        self.grpcFraming ? "grpc" : "entitlements_framed"
    }

    private func encoded(capacity: Int = 0, _ write: (inout ByteBuffer) throws -> Void) rethrows -> ByteBuffer {
        var buffer = ByteBuffer()
        buffer.reserveCapacity(capacity)
        guard self.grpcFraming else {
            try write(&buffer)
            return buffer
        }
        buffer.writeRepeatingByte(0, count: 5)
        try write(&buffer)
        buffer.setInteger(UInt32(buffer.readableBytes - 5), at: 1)  // flag 0: not compressed
        return buffer
    }
}

extension CallCodec where Self == ProtobufCodec {
    /// The framed protocol's codec.
    public static var framed: ProtobufCodec { ProtobufCodec(grpcFraming: false) }
    /// gRPC's codec.
    public static var grpc: ProtobufCodec { ProtobufCodec(grpcFraming: true) }
}

/// The largest answer a call may carry: 1 MiB, what every client accepts by default
/// (docs/PROTOCOL.md). A larger one would be a connection error on the client's side,
/// failing every call on its connection, so the call fails alone instead.
public enum AnswerLimit {
    public static let maximumBytes = Frame.defaultMaximumPayloadSize

    /// Nil when an answer of `byteCount` bytes may be sent; else the call's failure.
    @inline(__always)
    public static func refusal(byteCount: Int) -> ServiceError? {
        byteCount <= Self.maximumBytes ? nil : Self.tooLarge(byteCount)
    }

    @inline(never)
    static func tooLarge(_ byteCount: Int) -> ServiceError {
        ServiceError(.resourceExhausted, "the answer is \(byteCount) bytes; an answer carries at most \(Self.maximumBytes) (ask for fewer users or entitlements)")
    }
}

extension CheckAnswer {
    /// Nil when the encoded answer fits ``AnswerLimit``.
    var refusalBySize: ServiceError? {
        AnswerLimit.refusal(byteCount: self.byteCount)
    }
}

// MARK: - The router

/// The one way into the service's methods, for every transport (docs/architecture.md,
/// "One set of rules"). A transport finds the method, makes the call's ``CallContext`` and
/// supplies its ``CallCodec``; the router applies the rules every call obeys, in this order:
///
/// 0. with tracing on, the call gets a span (``CallTracing``), ended when it is counted;
/// 1. the method exists and is unary (else UNIMPLEMENTED);
/// 2. the caller may call it (``authorize(_:_:)``: UNAUTHENTICATED or PERMISSION_DENIED),
///    whatever the request holds;
/// 3. the call's deadline has not passed already (else DEADLINE_EXCEEDED, nothing run);
/// 4. the request decodes (else INVALID_ARGUMENT with the decoder's reason), and the
///    method runs;
/// 5. the encoded answer fits ``AnswerLimit`` (else RESOURCE_EXHAUSTED);
/// 6. an answer not ready by the call's deadline is DEADLINE_EXCEEDED, at the deadline;
/// 7. the call counts in `entitlements_requests_in_flight` while it waits, and once in
///    `entitlements_requests_total` and the latency histogram when its answer is ready
///    (CANCELLED when its caller went away or cancelled it meanwhile: its scope closed).
///
/// WatchEntitlements takes rules 2 to 4 (``watch(_:_:codec:sink:)``; a stream's timeout
/// bounds the stream). The framed protocol's CheckEntitlements is the one specialised path
/// (``check(_:_:)-(ByteBuffer,_)``): its answer is written in place, and it is counted by
/// that transport.
extension EntitlementMethods {
    /// Runs the unary `method` on `body`, read and answered with `codec`.
    public func unary<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: Codec) -> MethodResult<Codec.Encoded> {
        self.route(method, body, call, codec: codec)
    }

    /// ``unary(_:_:_:codec:)`` with protobuf (the framed protocol and gRPC), compiled for
    /// that codec here: a generic call from another module runs unspecialised (witness
    /// tables, boxed closures), which cost the gRPC door 17% of its throughput.
    public func unary(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: ProtobufCodec) -> MethodResult<ByteBuffer> {
        self.route(method, body, call, codec: codec)
    }

    // Inlined into each entry point, so that the protobuf one is compiled for its codec.
    @inline(__always)
    private func route<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: Codec) -> MethodResult<Codec.Encoded> {
        if let tracing = self.tracing {
            var traced = call
            traced.span = tracing.start(method, call, system: codec.rpcSystem)
            return self.applyRules(method, body, traced, codec: codec)
        }
        return self.applyRules(method, body, call, codec: codec)
    }

    /// Rules 1 to 7.
    @inline(__always)
    private func applyRules<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: Codec) -> MethodResult<Codec.Encoded> {
        if let refusal = Self.unaryRefusal(method) ?? self.authorize(method, call) ?? Self.expired(call) {
            return self.accounted(method, .now(.failure(refusal)), call)
        }
        return self.accounted(method, self.dispatch(method, body, call, codec: codec), call)
    }

    /// WatchEntitlements: the permission, the deadline and the request, then the stream.
    /// A refusal is counted here (a stream that ran is not an answered call).
    public func watch<Codec: CallCodec>(_ body: ByteBuffer, _ call: CallContext, codec: Codec, sink: WatchSink) -> Result<WatchStream, ServiceError> {
        let result: Result<WatchStream, ServiceError>
        if let refusal = self.authorize(.watchEntitlements, call) ?? Self.expired(call) {
            result = .failure(refusal)
        } else {
            do {
                result = self.watchEntitlements(try codec.decode(WatchEntitlementsRequest.self, from: body), call, sink: sink)
            } catch let error as ServiceError {
                result = .failure(error)
            } catch {
                result = .failure(ServiceError(.invalidArgument, "\(error)"))
            }
        }
        if case .failure(let error) = result {
            self.recordAnswers(.watchEntitlements, error.status, since: call.start)
        }
        return result
    }

    /// DEADLINE_EXCEEDED when the call's deadline has passed before it runs (its request
    /// arrived late): nothing is started for it. One clock reading, for calls with a deadline.
    @inline(__always)
    private static func expired(_ call: CallContext) -> ServiceError? {
        guard let deadline = call.deadline, deadline <= .now() else {
            return nil
        }
        return ServiceError(.deadlineExceeded, "the deadline passed before the call started")
    }

    /// Why `method` is not a unary call of this service, or nil.
    private static func unaryRefusal(_ method: MethodID) -> ServiceError? {
        switch method {
        case .checkEntitlements, .batchCheckEntitlements, .health, .compact, .customerHistory,
            .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant, .linkAlias, .deleteCustomer, .submitPurchase:
            nil
        case .watchEntitlements:
            ServiceError(.unimplemented, "WatchEntitlements is a stream: call it as one (the framed protocol or gRPC), not as a unary call")
        default:
            ServiceError(.unimplemented, "\(method) is not implemented by this server")
        }
    }

    /// A write from inside the server (the store ingestion): the caller's permission is
    /// checked as for a call; it is not counted as one.
    public func write(_ mutation: LogRecord.Mutation, _ call: CallContext) -> MethodResult<WriteResponse> {
        if let refusal = self.authorize(Self.method(of: mutation), call) {
            return .now(.failure(refusal))
        }
        return self.apply(mutation, call)
    }

    @inline(__always)
    private func dispatch<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: Codec) -> MethodResult<Codec.Encoded> {
        do {
            switch method {
            case .checkEntitlements:
                let request = try codec.decode(CheckEntitlementsRequest.self, from: body)
                if request.explain {
                    return Self.encoded(self.explainedCheck(request, call), codec) { try codec.encode($0) }
                }
                return Self.encoded(self.checkEntitlements(request, call).noted(on: call.span), codec) { try codec.encode($0) }
            case .batchCheckEntitlements:
                let request = try codec.decode(BatchCheckEntitlementsRequest.self, from: body)
                call.span?.note(batchOf: request.userIds.count)
                return Self.encoded(self.batchCheckEntitlements(request, call), codec) { try codec.encode($0) }
            case .health:
                _ = try codec.decode(HealthRequest.self, from: body)  // garbage is refused, not answered
                return Self.encoded(.now(self.health(call)), codec) { try codec.encode($0) }
            case .compact:
                _ = try codec.decode(CompactRequest.self, from: body)
                return Self.encoded(self.compact(call), codec) { try codec.encode($0) }
            case .customerHistory:
                let request = try codec.decode(CustomerHistoryRequest.self, from: body)
                return Self.encoded(self.customerHistory(request, call), codec) { try codec.encode($0) }
            case .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant, .linkAlias, .deleteCustomer:
                let mutation = try Self.mutation(method, body, codec)
                if case .recordTransaction(let request) = mutation, request.transaction?.verified == true {
                    return .failure(
                        .invalidArgument,
                        "transaction.verified: set by the server only, when a store's own record writes the transaction (a notification, SubmitPurchase); leave it unset"
                    )
                }
                return Self.encoded(self.apply(mutation, call), codec) { try codec.encode($0) }
            case .submitPurchase:
                let request = try codec.decode(SubmitPurchaseRequest.self, from: body)
                return Self.encoded(self.submitPurchase(request, call), codec) { try codec.encode($0) }
            default:
                return .failure(.internalError, "\(method) passed the router's check but has no handler")
            }
        } catch let error as ServiceError {
            return .now(.failure(error))  // a transport's framing (gRPC's prefix)
        } catch {
            return .failure(.invalidArgument, "\(error)")
        }
    }

    /// Decodes a write method's request.
    static func mutation<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ codec: Codec) throws -> LogRecord.Mutation {
        switch method {
        case .recordTransaction: .recordTransaction(try codec.decode(RecordTransactionRequest.self, from: body))
        case .updateSubscriptionState: .updateSubscriptionState(try codec.decode(UpdateSubscriptionStateRequest.self, from: body))
        case .grantEntitlement: .grantEntitlement(try codec.decode(GrantEntitlementRequest.self, from: body))
        case .revokeGrant: .revokeGrant(try codec.decode(RevokeGrantRequest.self, from: body))
        case .linkAlias: .linkAlias(try codec.decode(LinkAliasRequest.self, from: body))
        default: .deleteCustomer(try codec.decode(DeleteCustomerRequest.self, from: body))
        }
    }

    /// The answer encoded, and refused when it is over ``AnswerLimit``.
    private static func encoded<Value: Sendable, Codec: CallCodec>(
        _ result: MethodResult<Value>,
        _ codec: Codec,
        _ encode: @escaping @Sendable (Value) throws -> Codec.Encoded
    ) -> MethodResult<Codec.Encoded> {
        @Sendable func encoded(_ result: Result<Value, ServiceError>) -> Result<Codec.Encoded, ServiceError> {
            result.flatMap { value in
                let bytes: Codec.Encoded
                do {
                    bytes = try encode(value)
                } catch {
                    return .failure(ServiceError(.internalError, "cannot encode the answer: \(error)"))
                }
                if let refusal = AnswerLimit.refusal(byteCount: codec.byteCount(of: bytes)) {
                    return .failure(refusal)
                }
                return .success(bytes)
            }
        }
        switch result {
        case .now(let result): return .now(encoded(result))
        case .later(let future): return .later(future.map(encoded))
        }
    }

    // MARK: The framed check

    /// CheckEntitlements, its request in protobuf, for a transport that writes the answer
    /// itself (the framed protocol's hot path): rules 2 to 6 of the router, with no
    /// encoding. An answer ready at once comes back as it is; one ready later comes held to
    /// ``AnswerLimit`` and to the deadline, and in the in-flight gauge while it waits. The
    /// transport writes it in place, holds an answer ready at once to ``AnswerLimit``, and
    /// counts every such check (``recordAnswers(_:_:count:since:)``): a read's answers
    /// together, and a check its client cancels as CANCELLED when it does.
    @inline(__always)
    public func check(_ payload: ByteBuffer, _ call: CallContext) -> MethodResult<CheckAnswer> {
        if let tracing = self.tracing {
            return self.tracedCheck(payload, call, tracing)
        }
        return self.untracedCheck(payload, call)
    }

    /// ``check(_:_:)-(ByteBuffer,_)`` in its span (rule 0), ended when its answer is ready
    /// (CANCELLED when the call's scope closed meanwhile: with tracing on, the framed
    /// transport gives each check a scope of its own, which its CANCEL closes).
    @inline(never)
    private func tracedCheck(_ payload: ByteBuffer, _ call: CallContext, _ tracing: CallTracing) -> MethodResult<CheckAnswer> {
        var call = call
        let span = tracing.start(.checkEntitlements, call, system: ProtobufCodec.framed.rpcSystem)
        call.span = span
        switch self.untracedCheck(payload, call).noted(on: span) {
        case .now(let result):
            // As the transport will answer it: an answer over the limit is refused there.
            span.end(result.flatMap { answer in answer.refusalBySize.map { .failure($0) } ?? .success(answer) })
            return .now(result)
        case .later(let future):
            let scope = call.scope
            return .later(future.map { result in
                span.end(result, in: scope)
                return result
            })
        }
    }

    @inline(__always)
    private func untracedCheck(_ payload: ByteBuffer, _ call: CallContext) -> MethodResult<CheckAnswer> {
        // Rule 3 is the resolver's here: it reads the clock for a check with a deadline
        // anyway, and answers one past it DEADLINE_EXCEEDED without resolving.
        if let refusal = self.authorize(.checkEntitlements, call) {
            return .now(.failure(refusal))
        }
        let request: CheckEntitlementsRequest
        do {
            request = try CheckEntitlementsRequest(buffer: payload)
        } catch {
            return .failure(.invalidArgument, "\(error)")
        }
        let result = self.checkEntitlements(request, call)
        guard case .later = result else {
            return result
        }
        return self.timed(Self.limited(result), call) { _ in }
    }

    /// A CheckEntitlements from inside the server (tests, tools): the permission, then the
    /// method, not counted as a call.
    public func check(_ request: CheckEntitlementsRequest, _ call: CallContext) -> MethodResult<CheckAnswer> {
        if let refusal = self.authorize(.checkEntitlements, call) {
            return .now(.failure(refusal))
        }
        return self.checkEntitlements(request, call)
    }

    /// A later check's answer held to ``AnswerLimit`` before it is counted (the transport
    /// writes it in place).
    private static func limited(_ result: MethodResult<CheckAnswer>) -> MethodResult<CheckAnswer> {
        guard case .later(let future) = result else {
            return result
        }
        return .later(future.map { result in
            result.flatMap { answer in
                answer.refusalBySize.map { .failure($0) } ?? .success(answer)
            }
        })
    }

    // MARK: Deadlines and metrics

    /// Applies rules 6 and 7 to a method's result.
    func accounted<Value: Sendable>(_ method: MethodID, _ result: MethodResult<Value>, _ call: CallContext) -> MethodResult<Value> {
        switch result {
        case .now(let result):
            self.recordAnswers(method, result.status, since: call.start)
            call.span?.end(result)
            return .now(result)
        case .later:
            let metrics = self.services.metrics
            let (scope, start, span) = (call.scope, call.start, call.span)
            return self.timed(result, call) { result in
                metrics.answered(method, scope.isClosed ? .cancelled : result.status, since: start)
                span?.end(result, in: scope)
            }
        }
    }

    /// A later result bound by the call's deadline (rule 6) and in the in-flight gauge until
    /// it is ready; `ready` sees it then.
    private func timed<Value: Sendable>(
        _ result: MethodResult<Value>,
        _ call: CallContext,
        ready: @escaping @Sendable (Result<Value, ServiceError>) -> Void
    ) -> MethodResult<Value> {
        guard case .later(let future) = result else {
            return result
        }
        let metrics = self.services.metrics
        metrics.inFlight.increment()
        // The methods' futures carry failures as values; one that failed anyway is still
        // answered at once (and leaves the gauge).
        let recovered = future.recover { .failure(ServiceError(.internalError, "\($0)")) }
        let answered = call.deadline.map { Self.byDeadline(recovered, $0, on: call.eventLoop) } ?? recovered
        return .later(answered.map { result in
            metrics.inFlight.decrement()
            ready(result)
            return result
        })
    }

    /// `future`'s result, or DEADLINE_EXCEEDED at `deadline` if it is not ready by then
    /// (its result is then dropped; the resolvers skip work whose deadline has passed).
    private static func byDeadline<Value: Sendable>(
        _ future: EventLoopFuture<Result<Value, ServiceError>>,
        _ deadline: NIODeadline,
        on loop: any EventLoop
    ) -> EventLoopFuture<Result<Value, ServiceError>> {
        let promise = loop.makePromise(of: Result<Value, ServiceError>.self)
        let race = NIOLoopBoundBox(DeadlineRace.waiting, eventLoop: loop)
        let timer = loop.assumeIsolated().scheduleTask(deadline: deadline) {
            if race.value.settle() {
                promise.succeed(.failure(ServiceError(.deadlineExceeded, "the deadline passed before the answer was ready")))
            }
        }
        future.hop(to: loop).assumeIsolated().whenSuccess { result in
            if race.value.settle() {
                timer.cancel()
                promise.succeed(result)
            }
        }
        return promise.futureResult
    }

    /// Counts `count` answered calls of `method` with `status`, read at `start`.
    public func recordAnswers(_ method: MethodID, _ status: StatusCode, count: Int = 1, since start: NIODeadline) {
        self.services.metrics.answered(method, status, count: count, since: start)
    }
}

extension MethodResult where Value == CheckAnswer {
    /// The result, its answer noted on `span` (where it came from) when there is one.
    @inline(__always)
    func noted(on span: CallSpan?) -> Self {
        guard let span else {
            return self
        }
        switch self {
        case .now(let result):
            if case .success(let answer) = result {
                span.note(answer)
            }
            return self
        case .later(let future):
            return .later(future.map { result in
                if case .success(let answer) = result {
                    span.note(answer)
                }
                return result
            })
        }
    }
}

extension Result where Failure == ServiceError {
    /// The status a call with this result answers.
    public var status: StatusCode {
        switch self {
        case .success: .ok
        case .failure(let error): error.status
        }
    }
}

/// Which of an answer and its deadline came first.
private enum DeadlineRace {
    case waiting
    case settled

    /// True for the first caller only.
    mutating func settle() -> Bool {
        guard case .waiting = self else {
            return false
        }
        self = .settled
        return true
    }
}
