import EntitlementsSecurity
import EntitlementsServer
import EntitlementsWire
import NIOCore
import NIOHTTP1

/// The JSON door over HTTP/1.1 (what curl speaks by default): `POST
/// /entitlements.v1.EntitlementService/<Method>` with a JSON body, one call at a time per
/// connection (NIO's pipelining handler queues the next request until this one is
/// answered). gRPC needs HTTP/2: a gRPC content-type here is refused with 415 and a message
/// that says so.
final class HTTPJSONHandler: ChannelInboundHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let methods: EntitlementMethods
    private let credentials: ConnectionCredentials
    private let scope: ConnectionScope
    private var head: HTTPRequestHead?
    private var method: MethodID?
    private var body = ByteBuffer()
    /// The request being read or answered has been answered (perhaps early: refused
    /// before its body arrived), and read to its end.
    private var answered = false
    private var readEnd = false
    private var start = NIODeadline.now()
    private var idleTimer: Scheduled<Void>?
    /// Ends a request that has not arrived in full in time (``JSONMethods/arrivalLimit(start:deadline:frameTimeout:)``).
    private var receivingTimer: Scheduled<Void>?
    /// Set once the handler has left the pipeline: a late answer is dropped.
    private var removed = false

    init(methods: EntitlementMethods, credentials: ConnectionCredentials) {
        self.methods = methods
        self.credentials = credentials
        self.scope = ConnectionScope(peer: credentials.peer)
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.armIdleTimer(context: context)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.removed = true
        self.scope.close()
        self.idleTimer?.cancel()
        self.receivingTimer?.cancel()
    }

    private func armIdleTimer(context: ChannelHandlerContext) {
        self.idleTimer?.cancel()
        guard !self.removed else {
            return
        }
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        self.idleTimer = context.eventLoop.scheduleTask(in: self.methods.configuration.idleTimeout) {
            loopBound.value.close(promise: nil)
        }
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch self.unwrapInboundIn(data) {
        case .head(let head):
            self.idleTimer?.cancel()
            self.head = head
            self.body.clear()
            self.answered = false
            self.readEnd = false
            self.start = .now()
            self.method = DoorRoutes.method(path: String(head.uri.split(separator: "?", maxSplits: 1).first ?? ""))
            if let problem = self.refusal(head) {
                self.refuse(context: context, problem.http, problem.error)
            }
        case .body(var bytes):
            guard !self.answered else {
                return
            }
            guard self.body.readableBytes + bytes.readableBytes <= self.methods.configuration.maximumPayloadSize else {
                self.refuse(context: context, .payloadTooLarge, JSONMethods.tooLarge(limit: self.methods.configuration.maximumPayloadSize), close: true)
                return
            }
            self.body.writeBuffer(&bytes)
        case .end:
            self.readEnd = true
            self.receivingTimer?.cancel()
            self.receivingTimer = nil
            guard !self.answered, let method = self.method, let head = self.head else {
                self.requestDone(context: context)
                return
            }
            self.call(context: context, method, head)
        }
    }

    /// A request still arriving when a read ends is held to its arrival limit: one timer,
    /// armed only for a request that did not come in one read. Past it, the request is
    /// answered (unless it was already: refused early) and the connection closed (the rest
    /// of its body cannot be told from the next request).
    func channelReadComplete(context: ChannelHandlerContext) {
        if let head = self.head, !self.readEnd, self.receivingTimer == nil {
            self.armReceivingTimer(context: context, head)
        }
        context.fireChannelReadComplete()
    }

    private func armReceivingTimer(context: ChannelHandlerContext, _ head: HTTPRequestHead) {
        let timeout = try? JSONMethods.connectTimeout(head.headers.first(name: "connect-timeout-ms")).get()  // valid: refusal(_:) checked it
        let frameTimeout = self.methods.configuration.frameTimeout
        let limit = JSONMethods.arrivalLimit(start: self.start, deadline: timeout.flatMap { $0 }.map { self.start + $0 }, frameTimeout: frameTimeout)
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        self.receivingTimer = context.eventLoop.assumeIsolated().scheduleTask(deadline: limit.at) {
            self.receivingTimer = nil
            guard !self.readEnd else {
                return
            }
            if self.answered {
                loopBound.value.close(promise: nil)
            } else {
                let error = JSONMethods.arrivalFailure(byDeadline: limit.byDeadline, frameTimeout: frameTimeout)
                self.refuse(context: loopBound.value, JSONMethods.httpStatus(error.status), error, close: true)
            }
        }
    }

    /// What refuses a request before its body is read: the method, the content-type, the route.
    private func refusal(_ head: HTTPRequestHead) -> (http: HTTPResponseStatus, error: ServiceError)? {
        let path = head.uri
        let contentType = head.headers.first(name: "content-type")
        if let contentType, contentType.lowercased().hasPrefix("application/grpc") {
            return (.unsupportedMediaType, ServiceError(.invalidArgument, "gRPC needs HTTP/2 (this request came over HTTP/1.1); use a gRPC client, or send application/json"))
        }
        guard head.method == .POST else {
            return (.methodNotAllowed, ServiceError(.unimplemented, "\(head.method) \(path): calls are POST with a JSON body (docs/doors.md)"))
        }
        guard self.method != nil else {
            return (.notFound, JSONMethods.unknownMethod(path))
        }
        guard JSONMethods.isJSON(contentType) else {
            return (.unsupportedMediaType, ServiceError(.invalidArgument, "content-type \(contentType ?? "(none)") is not served: send application/json"))
        }
        if case .failure(let error) = JSONMethods.connectTimeout(head.headers.first(name: "connect-timeout-ms")) {
            return (.badRequest, error)
        }
        return nil
    }

    /// Runs the call through the service's router, which applies every per-call rule.
    private func call(context: ChannelHandlerContext, _ method: MethodID, _ head: HTTPRequestHead) {
        let access: CallerAccess
        switch self.methods.access(self.credentials, authorization: head.headers.first(name: "authorization")) {
        case .success(let granted):
            access = granted
        case .failure(let error):
            self.refuse(context: context, JSONMethods.httpStatus(error.status), error)
            return
        }
        // Valid: refusal(_:) checked it.
        let timeout = try? JSONMethods.connectTimeout(head.headers.first(name: "connect-timeout-ms")).get()
        let call = CallContext(
            eventLoop: context.eventLoop,
            deadline: timeout.flatMap { $0 }.map { self.start + $0 },
            scope: self.scope,
            access: access,
            start: self.start
        )
        let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
        let finish: (Result<ByteBuffer, ServiceError>) -> Void = { result in
            switch result {
            case .success(let json):
                self.respond(context: loopBound.value, .ok, json)
            case .failure(let error):
                self.respond(context: loopBound.value, JSONMethods.httpStatus(error.status), JSONMethods.errorBody(error))
            }
        }
        switch self.methods.unary(method, self.body, call, codec: JSONCodec()) {
        case .now(let result):
            finish(result)
        case .later(let future):
            future.assumeIsolated().whenSuccess(finish)
        }
    }

    /// A request this transport refuses before the router sees it: counted here, since no
    /// method ran.
    private func refuse(context: ChannelHandlerContext, _ httpStatus: HTTPResponseStatus, _ error: ServiceError, close: Bool = false) {
        guard !self.answered, !self.removed else {
            return
        }
        self.methods.recordAnswers(self.method ?? MethodID(rawValue: 0), error.status, since: self.start)
        self.respond(context: context, httpStatus, JSONMethods.errorBody(error), close: close)
    }

    private func respond(context: ChannelHandlerContext, _ httpStatus: HTTPResponseStatus, _ body: ByteBuffer, close: Bool = false) {
        guard !self.answered, !self.removed, let head = self.head else {
            return
        }
        self.answered = true
        let keepAlive = head.isKeepAlive && !close
        var headers: HTTPHeaders = [
            "content-type": "application/json",
            "content-length": String(body.readableBytes),
        ]
        headers.add(name: "connection", value: keepAlive ? "keep-alive" : "close")
        context.write(self.wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: httpStatus, headers: headers))), promise: nil)
        context.write(self.wrapOutboundOut(.body(.byteBuffer(body))), promise: nil)
        let written = context.writeAndFlush(self.wrapOutboundOut(.end(nil)))
        if !keepAlive {
            let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
            written.whenComplete { _ in loopBound.value.close(promise: nil) }
        }
        if self.readEnd {
            self.requestDone(context: context)
        }
    }

    /// The request is read and answered: the connection waits for the next. (A drain is
    /// NIO's HTTPServerPipelineHandler's: it closes the connection once no response is in
    /// progress, and does not pass the event on.)
    private func requestDone(context: ChannelHandlerContext) {
        self.armIdleTimer(context: context)
    }


    /// A request NIO could not parse (answered 400 by its error handler) ends the
    /// connection, as does any other error on it; other connections are untouched.
    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }

    func channelInactive(context: ChannelHandlerContext) {
        if self.head != nil, !self.readEnd, !self.answered {
            // Gone while its request was arriving: never routed, so counted here.
            self.methods.recordAnswers(self.method ?? MethodID(rawValue: 0), .cancelled, since: self.start)
            self.answered = true
        }
        self.scope.close()
        context.fireChannelInactive()
    }
}
