import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsServer
import EntitlementsWire
import NIOCore
import NIOHPACK
import NIOHTTP1
import NIOHTTP2

/// One HTTP/2 stream of a door connection: one gRPC call (`application/grpc`), or one
/// Connect-style JSON call (`application/json`). It reads the request, calls the service
/// layer, and writes the answer; it holds no method logic.
///
/// gRPC on the wire (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md): the
/// request HEADERS (`:path /entitlements.v1.EntitlementService/<Method>`, `grpc-timeout`),
/// DATA with length-prefixed messages (a flag byte, 4 bytes of length, the message); the
/// answer HEADERS (`:status 200`), DATA, and trailers with `grpc-status` and
/// `grpc-message`, or trailers alone for a failure.
final class DoorStreamHandler: ChannelInboundHandler {
    typealias InboundIn = HTTP2Frame.FramePayload
    typealias OutboundOut = HTTP2Frame.FramePayload

    private enum Kind {
        case grpc
        case json
    }

    private enum Route {
        case method(MethodID)
        case healthCheck
        case healthWatch
    }

    private let connection: DoorConnection
    private var methods: EntitlementMethods { self.connection.methods }
    private var context: ChannelHandlerContext!
    /// The call's phase, who counts it, whether its request has ended (DoorStreamState).
    private var state = DoorStreamState()
    private var kind = Kind.grpc
    private var route = Route.healthCheck
    /// For metrics: the method the call counts as (until routed, none: counted as
    /// `method="unknown"`, as an unknown framed method is).
    private var metricMethod = MethodID(rawValue: 0)
    private var body = ByteBuffer()
    private var start = NIODeadline.now()
    private var deadline: NIODeadline?
    /// The caller's W3C trace context, read only when tracing is on.
    private var traceHeaders: TraceHeaders?
    /// Ends a call whose request has not arrived in full by its deadline; once it has,
    /// the router holds the call to its deadline.
    private var receivingTimer: Scheduled<Void>?
    /// Closed when the stream goes (reset by the client, or the connection closed).
    private let scope: ConnectionScope
    /// What this call may do: the connection's certificate and the call's bearer token.
    private var access = CallerAccess.unrestricted
    private var watch: WatchStream?
    private var healthTimer: RepeatedTask?
    private var lastHealth: HealthCheckServingStatus?
    private var sentHeaders = false

    init(connection: DoorConnection) {
        self.connection = connection
        self.scope = ConnectionScope(peer: connection.credentials.peer)
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        let id = try? context.channel.syncOptions?.getOption(HTTP2StreamChannelOptions.streamID)
        self.connection.opened(self, id: id)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.ended()
        self.context = nil
    }

    func channelInactive(context: ChannelHandlerContext) {
        self.ended()
        context.fireChannelInactive()
    }

    /// The stream is gone: work still queued for it is skipped, a watch stops, and nothing
    /// more is written.
    private func ended() {
        if self.state.ended() {
            // Dropped (reset, or its connection closed) before it was answered or routed;
            // a routed call is counted by the router, CANCELLED through its scope.
            self.methods.recordAnswers(self.metricMethod, .cancelled, since: self.start)
        }
        self.scope.close()  // a routed call still being worked on counts as CANCELLED
        self.receivingTimer?.cancel()
        self.receivingTimer = nil
        self.healthTimer?.cancel()
        self.healthTimer = nil
        self.watch?.abandon()
        self.watch = nil
        self.connection.closed(self)
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable {
            self.watch?.resume()
        }
        context.fireChannelWritabilityChanged()
    }

    // MARK: Reading

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch self.unwrapInboundIn(data) {
        case .headers(let headers):
            if self.state.headers(endStream: headers.endStream) {
                self.requestHeaders(headers.headers, endStream: headers.endStream)
            } else if headers.endStream {
                self.requestComplete()  // the client's trailers end the request
            }
        case .data(let data):
            guard self.state.data(endStream: data.endStream), case .byteBuffer(var bytes) = data.data else {
                return
            }
            let limit = self.methods.configuration.maximumPayloadSize + (self.kind == .grpc ? 5 : 0)
            guard self.body.readableBytes + bytes.readableBytes <= limit else {
                let error = JSONMethods.tooLarge(limit: self.methods.configuration.maximumPayloadSize)
                if self.kind == .json {
                    self.respondJSON(.payloadTooLarge, JSONMethods.errorBody(error), status: error.status)
                } else {
                    self.fail(error.status, error.message)
                }
                return
            }
            if self.body.readableBytes == 0 {
                self.body = bytes  // the usual one DATA frame: its bytes as they are, no copy
            } else {
                self.body.writeBuffer(&bytes)
            }
            if data.endStream {
                self.requestComplete()
            }
        case .rstStream:
            self.ended()  // the client cancelled (counted CANCELLED, as a framed CANCEL): nothing more is sent
        default:
            break
        }
    }

    /// A request with a deadline still arriving when a read ends is held to that deadline:
    /// one timer, armed only for such a request that did not come in one read. The
    /// --frame-timeout bound is the connection's sweep (``arrivalOverdue(at:)``), not a
    /// timer per call: a request's HEADERS and DATA often come in separate reads, and a
    /// timer per call cost the door 7% of its throughput.
    func channelReadComplete(context: ChannelHandlerContext) {
        if self.state.phase == .receiving, self.receivingTimer == nil, let deadline = self.deadline {
            let limit = JSONMethods.arrivalLimit(start: self.start, deadline: deadline, frameTimeout: self.methods.configuration.frameTimeout)
            if limit.byDeadline {
                self.receivingTimer = context.eventLoop.assumeIsolated().scheduleTask(deadline: limit.at) {
                    self.receivingTimer = nil
                    self.arrivalOverdue(at: .distantFuture)
                }
            }
        }
        context.fireChannelReadComplete()
    }

    /// Ends the call if its request is still arriving past its limit (its deadline, or
    /// --frame-timeout after its headers) at `now`; `.distantFuture`: its deadline timer
    /// fired. Called by that timer and by the connection's sweep.
    func arrivalOverdue(at now: NIODeadline) {
        guard self.state.phase == .receiving else {
            return
        }
        let frameTimeout = self.methods.configuration.frameTimeout
        let limit = JSONMethods.arrivalLimit(start: self.start, deadline: self.deadline, frameTimeout: frameTimeout)
        if limit.at <= now {
            let error = JSONMethods.arrivalFailure(byDeadline: limit.byDeadline, frameTimeout: frameTimeout)
            self.fail(error.status, error.message)
        }
    }

    private func requestHeaders(_ headers: HPACKHeaders, endStream: Bool) {
        self.start = .now()
        let fullPath = headers.first(name: ":path") ?? ""
        let path = fullPath.utf8.contains(UInt8(ascii: "?")) ? String(fullPath.prefix { $0 != "?" }) : fullPath
        let contentType = headers.first(name: "content-type")
        if let contentType, contentType.lowercased().hasPrefix("application/grpc") {
            self.kind = .grpc
            let subtype = contentType.lowercased().dropFirst("application/grpc".count)
            guard subtype.isEmpty || subtype == "+proto" || subtype.hasPrefix(";") else {
                self.refuseHTTP(.unsupportedMediaType, "content-type \(contentType) is not served: send application/grpc (protobuf)")
                return
            }
        } else if JSONMethods.isJSON(contentType) {
            self.kind = .json
        } else {
            self.refuseHTTP(.unsupportedMediaType, "content-type \(contentType ?? "(none)") is not served: send application/grpc, or application/json for the JSON door")
            return
        }
        guard headers.first(name: ":method") == "POST" else {
            self.refuseHTTP(.methodNotAllowed, "\(headers.first(name: ":method") ?? "?") \(path): calls are POST")
            return
        }
        if self.kind == .grpc, let encoding = headers.first(name: "grpc-encoding"), encoding != "identity" {
            self.fail(.unimplemented, "grpc-encoding \(encoding) is not supported: this server reads uncompressed messages only (grpc-accept-encoding: identity)")
            return
        }
        if let method = DoorRoutes.method(path: path) {
            self.route = .method(method)
            self.metricMethod = method
        } else if self.kind == .grpc, path == DoorRoutes.healthPrefix + "Check" {
            self.route = .healthCheck
            self.metricMethod = .health
        } else if self.kind == .grpc, path == DoorRoutes.healthPrefix + "Watch" {
            self.route = .healthWatch
            self.metricMethod = .health
        } else if self.kind == .json {
            self.respondJSON(.notFound, JSONMethods.errorBody(JSONMethods.unknownMethod(path)), status: .unimplemented)
            return
        } else {
            self.fail(.unimplemented, "unknown method \(path); this server serves /entitlements.v1.EntitlementService/<method> and /grpc.health.v1.Health/Check and Watch")
            return
        }
        if self.connection.draining {
            self.fail(.unavailable, "the server is shutting down; retry on another server")
            return
        }
        switch self.methods.access(self.connection.credentials, authorization: headers.first(name: "authorization")) {
        case .success(let access):
            self.access = access
        case .failure(let error):
            self.fail(error.status, error.message)
            return
        }
        if self.methods.isTracing {
            self.traceHeaders = TraceHeaders(traceparent: headers.first(name: "traceparent"), tracestate: headers.first(name: "tracestate"))
        }
        switch self.timeout(headers) {
        case .success(let timeout):
            if let timeout {
                self.deadline = self.start + timeout
            }
        case .failure(let error):
            self.fail(error.status, error.message)
            return
        }
        if endStream {
            self.requestComplete()
        }
    }

    private var isStream: Bool {
        switch self.route {
        case .method(let method): method == .watchEntitlements
        case .healthWatch: true
        case .healthCheck: false
        }
    }

    /// `grpc-timeout` (gRPC) or `connect-timeout-ms` (JSON) as a duration; nil for none.
    private func timeout(_ headers: HPACKHeaders) -> Result<TimeAmount?, ServiceError> {
        switch self.kind {
        case .grpc:
            guard let text = headers.first(name: "grpc-timeout") else {
                return .success(nil)
            }
            guard let unit = text.last, text.count >= 2, text.count <= 9, let value = Int64(text.dropLast()), value >= 0 else {
                return .failure(ServiceError(.invalidArgument, "grpc-timeout \"\(text)\" is malformed: 1 to 8 digits and a unit of H, M, S, m, u or n"))
            }
            switch unit {
            case "H": return .success(.hours(value))
            case "M": return .success(.minutes(value))
            case "S": return .success(.seconds(value))
            case "m": return .success(.milliseconds(value))
            case "u": return .success(.microseconds(value))
            case "n": return .success(.nanoseconds(value))
            default: return .failure(ServiceError(.invalidArgument, "grpc-timeout \"\(text)\": unknown unit \(unit)"))
            }
        case .json:
            return JSONMethods.connectTimeout(headers.first(name: "connect-timeout-ms"))
        }
    }

    // MARK: Calling

    private func requestComplete() {
        guard self.state.requestComplete() else {
            return
        }
        // The request is decoded before the call returns: its bytes (a slice of a read
        // buffer) are not held while the answer, or a watch, takes its time.
        defer { self.body = ByteBuffer() }
        self.receivingTimer?.cancel()
        self.receivingTimer = nil
        if self.connection.draining, self.isStream {
            // Its HEADERS came before the GOAWAY, the rest after: a stream started now
            // would hold the drain open.
            self.fail(.unavailable, "the server is shutting down; resubscribe")
            return
        }
        var context = CallContext(
            eventLoop: self.context.eventLoop,
            deadline: self.deadline,
            scope: self.scope,
            access: self.access,
            start: self.start,
            draining: self.connection.draining
        )
        if let headers = self.traceHeaders {
            context.traceHeaders = headers
        }
        if self.kind == .json {
            guard case .method(let method) = self.route else {
                return
            }
            self.state.routed()
            self.answer(self.methods.unary(method, self.body, context, codec: JSONCodec())) { handler, json in
                handler.respondJSON(.ok, json)
            }
            return
        }
        switch self.route {
        case .method(.watchEntitlements):
            self.state.routed()
            self.watch(context)
        case .method(let method):
            self.state.routed()
            self.answer(self.methods.unary(method, self.body, context, codec: .grpc)) { handler, answer in
                handler.respondMessage(answer)
            }
        case .healthCheck, .healthWatch:
            // grpc.health.v1 is this door's own service; it needs the permission Health does,
            // checked before its request is read, as the router does for the others.
            if let refused = self.methods.authorize(.health, context) {
                self.fail(refused.status, refused.message)
                return
            }
            let request: HealthCheckRequest
            do {
                request = try HealthCheckRequest(buffer: try ProtobufCodec.message(in: self.body))
            } catch let error as ServiceError {
                self.fail(error.status, error.message)
                return
            } catch {
                self.fail(.invalidArgument, "\(error)")
                return
            }
            if case .healthWatch = self.route {
                self.healthWatch(request)
                return
            }
            switch self.healthStatus(request) {
            case .success(let status):
                self.sendMessage(Self.encode(HealthCheckResponse(status: status)), flush: false)
                self.finish(.ok, "")
            case .failure(let error):
                self.fail(error.status, error.message)
            }
        }
    }

    private func answer<Value>(_ result: MethodResult<Value>, _ respond: @escaping (DoorStreamHandler, Value) -> Void) {
        switch result {
        case .now(.success(let value)):
            respond(self, value)
        case .now(.failure(let error)):
            self.fail(error.status, error.message)
        case .later(let future):
            future.assumeIsolated().whenSuccess { result in
                guard self.context != nil, self.state.phase == .answering else {
                    return  // timed out or cancelled meanwhile
                }
                switch result {
                case .success(let value): respond(self, value)
                case .failure(let error): self.fail(error.status, error.message)
                }
            }
        }
    }

    // MARK: Streams

    private func watch(_ context: CallContext) {
        let sink = WatchSink(
            send: { [unowned self] event in
                self.sendMessage(event, flush: true)
                return self.context?.channel.isWritable ?? false
            },
            end: { [unowned self] status, message in
                self.watch = nil
                self.finish(status, message)
            }
        )
        switch self.methods.watch(self.body, context, codec: .grpc, sink: sink) {
        case .success(let watch):
            if !watch.isFinished {
                self.watch = watch
                self.state.streaming()
            }
        case .failure(let error):
            self.fail(error.status, error.message)
        }
    }

    /// The status grpc.health.v1 reports for the service a request names.
    private func healthStatus(_ request: HealthCheckRequest) -> Result<HealthCheckServingStatus, ServiceError> {
        switch request.service ?? "" {
        case "", "entitlements.v1.EntitlementService":
            return .success(self.methods.isServing(draining: self.connection.draining) ? .serving : .notServing)
        case let service:
            return .failure(ServiceError(.notFound, "unknown service \"\(service)\"; this server reports \"\" and \"entitlements.v1.EntitlementService\""))
        }
    }

    /// grpc.health.v1.Health/Watch: the status now, then each change (checked every
    /// second); an unknown service is SERVICE_UNKNOWN, as the protocol says.
    private func healthWatch(_ request: HealthCheckRequest) {
        let status: HealthCheckServingStatus
        switch self.healthStatus(request) {
        case .success(let current): status = current
        case .failure(let error) where error.status == .notFound: status = .serviceUnknown
        case .failure(let error):
            self.fail(error.status, error.message)
            return
        }
        self.lastHealth = status
        self.state.streaming()
        self.sendMessage(Self.encode(HealthCheckResponse(status: status)), flush: true)
        guard status != .serviceUnknown else {
            return
        }
        let handler = NIOLoopBound(self, eventLoop: self.context.eventLoop)
        self.healthTimer = self.context.eventLoop.scheduleRepeatedTask(initialDelay: .seconds(1), delay: .seconds(1)) { _ in
            let handler = handler.value
            guard handler.context != nil, handler.state.phase == .answering else {
                return
            }
            let now: HealthCheckServingStatus = handler.methods.isServing(draining: handler.connection.draining) ? .serving : .notServing
            if now != handler.lastHealth {
                handler.lastHealth = now
                handler.sendMessage(Self.encode(HealthCheckResponse(status: now)), flush: true)
            }
        }
    }

    /// The server drains: a watch ends (after telling a health watcher NOT_SERVING); a
    /// unary call finishes as usual.
    func drain() {
        guard self.state.phase == .answering else {
            return
        }
        if let watch = self.watch {
            watch.finish(.unavailable, "the server is shutting down; resubscribe")
        } else if case .healthWatch = self.route {
            if self.lastHealth != .notServing {
                self.sendMessage(Self.encode(HealthCheckResponse(status: .notServing)), flush: false)
            }
            self.finish(.unavailable, "the server is shutting down")
        }
    }

    // MARK: Writing

    private static func encode(_ message: some ProtobufMessage) -> ByteBuffer {
        var buffer = ByteBuffer()
        try? message.serialize(into: &buffer)  // these small messages always encode
        return buffer
    }

    private func responseHeaders() {
        guard !self.sentHeaders else {
            return
        }
        self.sentHeaders = true
        self.context.write(self.wrapOutboundOut(.headers(.init(headers: Self.okHeaders))), promise: nil)
    }

    private func sendMessage(_ message: ByteBuffer, flush: Bool) {
        guard let context = self.context else {
            return
        }
        self.responseHeaders()
        context.write(self.wrapOutboundOut(.data(.init(data: .byteBuffer(ProtobufCodec.grpcMessage(message))))), promise: nil)
        if flush {
            context.flush()
        }
    }

    /// A unary call's answer: headers, the message (with its gRPC prefix, as the codec
    /// encoded it; the router has checked its size), trailers with OK.
    private func respondMessage(_ framed: ByteBuffer) {
        guard let context = self.context else {
            return
        }
        self.responseHeaders()
        context.write(self.wrapOutboundOut(.data(.init(data: .byteBuffer(framed)))), promise: nil)
        self.finish(.ok, "")
    }

    /// Ends the call with `status`: trailers (or, before any message, trailers only).
    private func finish(_ status: StatusCode, _ message: String) {
        guard let context = self.context, let finish = self.state.finish() else {
            return
        }
        self.healthTimer?.cancel()
        self.healthTimer = nil
        if finish.count {
            self.methods.recordAnswers(self.metricMethod, status, since: self.start)
        }
        if self.sentHeaders, status == .ok, message.isEmpty {
            // The usual end of a unary call: trailers made once.
            context.writeAndFlush(self.wrapOutboundOut(.headers(.init(headers: Self.okTrailers, endStream: true))), promise: nil)
            self.resetIfRequestOpen(context, finish)
            return
        }
        var trailers: HPACKHeaders = [:]
        if !self.sentHeaders {
            self.sentHeaders = true
            trailers.add(name: ":status", value: "200")
            trailers.add(name: "content-type", value: "application/grpc")
        }
        trailers.add(name: "grpc-status", value: String(status.rawValue))
        if !message.isEmpty {
            trailers.add(name: "grpc-message", value: Self.percentEncoded(message))
        }
        context.writeAndFlush(self.wrapOutboundOut(.headers(.init(headers: trailers, endStream: true))), promise: nil)
        self.resetIfRequestOpen(context, finish)
    }

    /// A failed call, in the stream's protocol.
    private func fail(_ status: StatusCode, _ message: String) {
        if self.kind == .json {
            self.respondJSON(JSONMethods.httpStatus(status), JSONMethods.errorBody(ServiceError(status, message)), status: status)
        } else {
            self.watch?.abandon()
            self.watch = nil
            self.finish(status, message)
        }
    }

    /// A JSON call's answer (Connect's unary protocol): the HTTP status, the JSON body.
    private func respondJSON(_ httpStatus: HTTPResponseStatus, _ json: ByteBuffer, status: StatusCode = .ok) {
        guard let context = self.context, let finish = self.state.finish() else {
            return
        }
        if finish.count {
            self.methods.recordAnswers(self.metricMethod, status, since: self.start)
        }
        let body = json
        let headers: HPACKHeaders = [
            ":status": String(httpStatus.code),
            "content-type": "application/json",
            "content-length": String(body.readableBytes),
        ]
        context.write(self.wrapOutboundOut(.headers(.init(headers: headers))), promise: nil)
        context.writeAndFlush(self.wrapOutboundOut(.data(.init(data: .byteBuffer(body), endStream: true))), promise: nil)
        self.resetIfRequestOpen(context, finish)
    }

    /// After an answer to a request the client has not ended: the stream is reset with
    /// NO_ERROR, as RFC 9113 (8.1) has a server that needs no more of a request do, so that
    /// it does not stay open, holding the connection out of its idle close and a drain, for
    /// as long as the client sends. NO_ERROR, not the CANCEL that closing the stream channel
    /// sends: gRPC clients then keep the status of the trailers already received.
    private func resetIfRequestOpen(_ context: ChannelHandlerContext, _ finish: DoorStreamState.Finish) {
        if finish.reset {
            context.writeAndFlush(self.wrapOutboundOut(.rstStream(.noError)), promise: nil)
        }
    }

    /// Not a call this door serves at the HTTP level (wrong method or content-type): a
    /// plain HTTP error, as the gRPC protocol asks for a content-type it does not know.
    private func refuseHTTP(_ httpStatus: HTTPResponseStatus, _ message: String) {
        self.kind = .json
        let status: StatusCode = httpStatus == .unsupportedMediaType ? .invalidArgument : .unimplemented
        self.respondJSON(httpStatus, JSONMethods.errorBody(ServiceError(status, message)), status: status)
    }

    /// A gRPC answer's headers, and an OK call's trailers: made once, shared by every call.
    private static let okHeaders: HPACKHeaders = [":status": "200", "content-type": "application/grpc"]
    private static let okTrailers: HPACKHeaders = ["grpc-status": "0"]

    /// `grpc-message`'s percent-encoding: bytes outside printable ASCII, and `%`, as %XX.
    static func percentEncoded(_ text: String) -> String {
        var out = ""
        for byte in text.utf8 {
            if byte >= 0x20, byte <= 0x7E, byte != UInt8(ascii: "%") {
                out.unicodeScalars.append(Unicode.Scalar(byte))
            } else {
                out += "%" + (byte < 16 ? "0" : "") + String(byte, radix: 16, uppercase: true)
            }
        }
        return out
    }
}
