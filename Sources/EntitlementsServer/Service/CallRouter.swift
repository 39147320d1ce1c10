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

    /// The size of an encoded answer's message, for ``AnswerLimit``.
    func byteCount(of encoded: Encoded) -> Int
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

/// Protobuf requests and answers: the framed protocol's payloads and gRPC's messages.
public struct ProtobufCodec: CallCodec {
    /// Bytes left at the front of every encoded answer for the transport's own header
    /// (gRPC's 5-byte message prefix), so that the answer is not copied to add it.
    public var reservedPrefix: Int

    public init(reservedPrefix: Int = 0) {
        self.reservedPrefix = reservedPrefix
    }

    public func decode<Request: ServiceRequest>(_ type: Request.Type, from body: ByteBuffer) throws -> Request {
        try Request(buffer: body)
    }

    public func encode(_ answer: CheckAnswer) -> ByteBuffer {
        self.encoded { answer.write(into: &$0) }
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

    public func byteCount(of encoded: ByteBuffer) -> Int {
        encoded.readableBytes - self.reservedPrefix
    }

    private func encoded(_ write: (inout ByteBuffer) throws -> Void) rethrows -> ByteBuffer {
        var buffer = ByteBuffer()
        if self.reservedPrefix > 0 {
            buffer.writeRepeatingByte(0, count: self.reservedPrefix)
        }
        try write(&buffer)
        return buffer
    }
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
    /// Nil when the encoded answer fits ``AnswerLimit``; it is measured only when a bound
    /// on its size does not.
    var refusalBySize: ServiceError? {
        let bound = 64 + self.userId.utf8.count + (self.customerId?.utf8.count ?? 0) + self.answer.encodedEntitlements.count
        guard bound > AnswerLimit.maximumBytes else {
            return nil
        }
        var buffer = ByteBuffer()
        self.write(into: &buffer)
        return AnswerLimit.refusal(byteCount: buffer.readableBytes)
    }
}

// MARK: - The router

/// The one way into the service's unary methods, for every transport (docs/architecture.md,
/// "One set of rules"). A transport finds the method, makes the call's ``CallContext`` and
/// supplies its ``CallCodec``; the router applies the rules every call obeys, in this order:
///
/// 1. the method exists and is unary (else UNIMPLEMENTED);
/// 2. the caller may call it (``authorize(_:_:)``: UNAUTHENTICATED or PERMISSION_DENIED);
/// 3. the request decodes (else INVALID_ARGUMENT with the decoder's reason), and the
///    method runs;
/// 4. the answer is encoded and fits ``AnswerLimit`` (else RESOURCE_EXHAUSTED);
/// 5. an answer not ready by the call's deadline is DEADLINE_EXCEEDED, at the deadline;
/// 6. the call counts in `entitlements_requests_in_flight` while it waits, and once in
///    `entitlements_requests_total` and the latency histogram when its answer is ready
///    (CANCELLED when its caller went away meanwhile).
///
/// The framed protocol's CheckEntitlements is the one specialised path (``check(_:_:)``):
/// its answer is written in place, and answers ready at once are counted a read at a time.
extension EntitlementMethods {
    /// Runs the unary `method` on `body`, read and answered with `codec`.
    public func unary<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: Codec) -> MethodResult<Codec.Encoded> {
        if let refusal = Self.unaryRefusal(method) ?? self.authorize(method, call) {
            return self.accounted(method, .now(.failure(refusal)), call)
        }
        return self.accounted(method, self.dispatch(method, body, call, codec: codec), call)
    }

    /// Why `method` is not a unary call of this service, or nil.
    private static func unaryRefusal(_ method: MethodID) -> ServiceError? {
        switch method {
        case .checkEntitlements, .batchCheckEntitlements, .health, .compact,
            .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant, .linkAlias, .deleteCustomer:
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

    private func dispatch<Codec: CallCodec>(_ method: MethodID, _ body: ByteBuffer, _ call: CallContext, codec: Codec) -> MethodResult<Codec.Encoded> {
        do {
            switch method {
            case .checkEntitlements:
                let request = try codec.decode(CheckEntitlementsRequest.self, from: body)
                return Self.encoded(self.checkEntitlements(request, call), codec) { try codec.encode($0) }
            case .batchCheckEntitlements:
                let request = try codec.decode(BatchCheckEntitlementsRequest.self, from: body)
                return Self.encoded(self.batchCheckEntitlements(request, call), codec) { try codec.encode($0) }
            case .health:
                _ = try codec.decode(HealthRequest.self, from: body)  // garbage is refused, not answered
                return Self.encoded(.now(self.health(call)), codec) { try codec.encode($0) }
            case .compact:
                _ = try codec.decode(CompactRequest.self, from: body)
                return Self.encoded(self.compact(call), codec) { try codec.encode($0) }
            case .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant, .linkAlias, .deleteCustomer:
                let mutation = try Self.mutation(method, body, codec)
                return Self.encoded(self.apply(mutation, call), codec) { try codec.encode($0) }
            default:
                return .failure(.internalError, "\(method) passed the router's check but has no handler")
            }
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
    /// itself (the framed protocol's hot path): the rules of ``unary(_:_:_:codec:)``,
    /// except that an answer ready at once is neither encoded nor counted here. The
    /// transport writes it in place, holds it to ``AnswerLimit``, and counts a read's such
    /// answers together (``recordAnswers(_:_:count:since:)``).
    @inline(__always)
    public func check(_ payload: ByteBuffer, _ call: CallContext) -> MethodResult<CheckAnswer> {
        if let refusal = self.authorize(.checkEntitlements, call) {
            return self.accounted(.checkEntitlements, .now(.failure(refusal)), call)
        }
        let request: CheckEntitlementsRequest
        do {
            request = try CheckEntitlementsRequest(buffer: payload)
        } catch {
            return self.accounted(.checkEntitlements, .failure(.invalidArgument, "\(error)"), call)
        }
        return self.permittedCheck(request, call)
    }

    /// CheckEntitlements, decoded, as ``check(_:_:)-(ByteBuffer,_)`` answers it (the
    /// permission checked here too).
    @inline(__always)
    public func check(_ request: CheckEntitlementsRequest, _ call: CallContext) -> MethodResult<CheckAnswer> {
        if let refusal = self.authorize(.checkEntitlements, call) {
            return self.accounted(.checkEntitlements, .now(.failure(refusal)), call)
        }
        return self.permittedCheck(request, call)
    }

    @inline(__always)
    private func permittedCheck(_ request: CheckEntitlementsRequest, _ call: CallContext) -> MethodResult<CheckAnswer> {
        let result = self.checkEntitlements(request, call)
        if case .now(.success) = result {
            return result
        }
        return self.accounted(.checkEntitlements, Self.limited(result), call)
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

    /// Applies rules 5 and 6 to a method's result.
    func accounted<Value: Sendable>(_ method: MethodID, _ result: MethodResult<Value>, _ call: CallContext) -> MethodResult<Value> {
        switch result {
        case .now(let result):
            self.recordAnswers(method, Self.status(of: result), since: call.start)
            return .now(result)
        case .later(let future):
            let metrics = self.services.metrics
            metrics.inFlight.increment()
            let answered = call.deadline.map { Self.byDeadline(future, $0, on: call.eventLoop) } ?? future
            return .later(answered.map { result in
                metrics.inFlight.decrement()
                metrics.answered(method, call.scope.isClosed ? .cancelled : Self.status(of: result), since: call.start)
                return result
            })
        }
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

    private static func status<Value>(of result: Result<Value, ServiceError>) -> StatusCode {
        switch result {
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
