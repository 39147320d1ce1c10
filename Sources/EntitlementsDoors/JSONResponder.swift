public import EntitlementsSecurity
public import EntitlementsServer
public import EntitlementsWire
public import NIOCore
import NIOHTTP1

/// The JSON door over HTTP/1.1 (what curl speaks by default): `POST
/// /entitlements.v1.EntitlementService/<Method>` with a JSON body, one call at a time per
/// connection. The exchange (timers, limits, keep-alive) is ``HTTP1ExchangeHandler``'s; the
/// call's rules are the router's. gRPC needs HTTP/2: a gRPC content-type here is refused
/// with 415 and a message that says so.
final class JSONResponder: HTTP1Responder {
    private let methods: EntitlementMethods
    private let credentials: ConnectionCredentials
    private let scope: ConnectionScope
    /// The method the request being handled names (nil: none), for its count.
    private var method: MethodID?

    init(methods: EntitlementMethods, credentials: ConnectionCredentials) {
        self.methods = methods
        self.credentials = credentials
        self.scope = ConnectionScope(peer: credentials.peer)
    }

    var maximumBodyBytes: Int {
        self.methods.configuration.maximumPayloadSize
    }

    /// What refuses a request before its body is read: the method, the content-type, the
    /// route, the timeout header.
    func head(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
        let path = head.uri
        self.method = DoorRoutes.method(path: String(path.split(separator: "?", maxSplits: 1).first ?? ""))
        let contentType = head.headers.first(name: "content-type")
        if let contentType, contentType.lowercased().hasPrefix("application/grpc") {
            return self.refuse(.unsupportedMediaType, ServiceError(.invalidArgument, "gRPC needs HTTP/2 (this request came over HTTP/1.1); use a gRPC client, or send application/json"), start: start)
        }
        guard head.method == .POST else {
            return self.refuse(.methodNotAllowed, ServiceError(.unimplemented, "\(head.method) \(path): calls are POST with a JSON body (docs/doors.md)"), start: start)
        }
        guard self.method != nil else {
            return self.refuse(.notFound, JSONMethods.unknownMethod(path), start: start)
        }
        guard JSONMethods.isJSON(contentType) else {
            return self.refuse(.unsupportedMediaType, ServiceError(.invalidArgument, "content-type \(contentType ?? "(none)") is not served: send application/json"), start: start)
        }
        if case .failure(let error) = JSONMethods.connectTimeout(head.headers.first(name: "connect-timeout-ms")) {
            return self.refuse(.badRequest, error, start: start)
        }
        return nil
    }

    /// Runs the call through the service's router, which applies every per-call rule.
    func answer(_ head: HTTPRequestHead, body: ByteBuffer, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply {
        guard let method = self.method else {
            preconditionFailure("head(_:start:) refuses a request that names no method")
        }
        let access: CallerAccess
        switch self.methods.access(self.credentials, authorization: head.headers.first(name: "authorization")) {
        case .success(let granted):
            access = granted
        case .failure(let error):
            return .now(self.refuse(JSONMethods.httpStatus(error.status), error, start: start))
        }
        var call = CallContext(
            eventLoop: eventLoop,
            deadline: self.deadline(head, start: start),
            scope: self.scope,
            access: access,
            start: start
        )
        if self.methods.isTracing {
            call.traceHeaders = TraceHeaders(traceparent: head.headers.first(name: "traceparent"), tracestate: head.headers.first(name: "tracestate"))
        }
        switch self.methods.unary(method, body, call, codec: JSONCodec()) {
        case .now(let result):
            return .now(Self.answer(result))
        case .later(let future):
            return .later(future.map(Self.answer))
        }
    }

    static func answer(_ result: Result<ByteBuffer, ServiceError>) -> HTTP1Answer {
        switch result {
        case .success(let json):
            HTTP1Answer(.ok, contentType: "application/json", body: json)
        case .failure(let error):
            HTTP1Answer(JSONMethods.httpStatus(error.status), contentType: "application/json", body: JSONMethods.errorBody(error))
        }
    }

    func tooLarge(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer {
        self.refuse(.payloadTooLarge, JSONMethods.tooLarge(limit: self.maximumBodyBytes), start: start)
    }

    func arrivalLimit(_ head: HTTPRequestHead, start: NIODeadline) -> NIODeadline {
        JSONMethods.arrivalLimit(start: start, deadline: self.deadline(head, start: start), frameTimeout: self.methods.configuration.frameTimeout).at
    }

    func arrivalExpired(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
        let frameTimeout = self.methods.configuration.frameTimeout
        let limit = JSONMethods.arrivalLimit(start: start, deadline: self.deadline(head, start: start), frameTimeout: frameTimeout)
        let error = JSONMethods.arrivalFailure(byDeadline: limit.byDeadline, frameTimeout: frameTimeout)
        return self.refuse(JSONMethods.httpStatus(error.status), error, start: start)
    }

    /// Gone while its request was arriving: never routed, so counted here.
    func abandoned(_ head: HTTPRequestHead, start: NIODeadline) {
        self.methods.recordAnswers(self.method ?? MethodID(rawValue: 0), .cancelled, since: start)
        self.scope.close()
    }

    /// Routed calls still being worked on count as CANCELLED.
    func closed() {
        self.scope.close()
    }

    /// The call's deadline, from `Connect-Timeout-Ms` (valid: `head` refused it otherwise).
    private func deadline(_ head: HTTPRequestHead, start: NIODeadline) -> NIODeadline? {
        let timeout = try? JSONMethods.connectTimeout(head.headers.first(name: "connect-timeout-ms")).get()
        return timeout.flatMap { $0 }.map { start + $0 }
    }

    /// A request this transport refuses before the router sees it: counted here, since no
    /// method ran.
    private func refuse(_ httpStatus: HTTPResponseStatus, _ error: ServiceError, start: NIODeadline) -> HTTP1Answer {
        self.methods.recordAnswers(self.method ?? MethodID(rawValue: 0), error.status, since: start)
        return HTTP1Answer(httpStatus, contentType: "application/json", body: JSONMethods.errorBody(error))
    }
}

/// A call of the JSON door made from another HTTP listener (the admin listener's console):
/// the same router, codec and answers as `POST /entitlements.v1.EntitlementService/<Method>`,
/// with an access the caller's listener checked.
public enum JSONDoorCall {
    public static func answer(_ methods: EntitlementMethods, _ method: MethodID, body: ByteBuffer, call: CallContext) -> HTTP1Reply {
        switch methods.unary(method, body, call, codec: JSONCodec()) {
        case .now(let result):
            .now(JSONResponder.answer(result))
        case .later(let future):
            .later(future.map(JSONResponder.answer))
        }
    }

    /// The error answer of the door, for a refusal before the call.
    public static func refusal(_ error: ServiceError) -> HTTP1Answer {
        HTTP1Answer(JSONMethods.httpStatus(error.status), contentType: "application/json", body: JSONMethods.errorBody(error))
    }
}
