public import NIOCore
public import NIOHTTP1

/// One answer of an HTTP/1.1 listener.
public struct HTTP1Answer: Sendable {
    public var status: HTTPResponseStatus
    public var contentType: String
    public var body: ByteBuffer
    /// The connection closes once this answer is out (the rest of the request cannot be
    /// told from the next one).
    public var close: Bool
    /// More response headers (the console's security headers).
    public var headers: [(String, String)]

    public init(_ status: HTTPResponseStatus, contentType: String, body: ByteBuffer, close: Bool = false, headers: [(String, String)] = []) {
        self.status = status
        self.contentType = contentType
        self.body = body
        self.close = close
        self.headers = headers
    }

    /// A `text/plain` answer.
    public static func text(_ status: HTTPResponseStatus, _ text: String) -> HTTP1Answer {
        HTTP1Answer(status, contentType: "text/plain; charset=utf-8", body: ByteBuffer(string: text))
    }
}

/// An answer at once, or later (on any loop).
public enum HTTP1Reply: Sendable {
    case now(HTTP1Answer)
    case later(EventLoopFuture<HTTP1Answer>)
}

/// What one HTTP/1.1 listener answers (the JSON door, the store webhooks, the admin
/// endpoints); ``HTTP1ExchangeHandler`` does the rest, the same for all of them. One per
/// connection, called on the connection's loop.
public protocol HTTP1Responder: AnyObject {
    /// The largest request body read: a larger one is answered by `tooLarge`, and the
    /// connection closed.
    var maximumBodyBytes: Int { get }

    /// A request's head has arrived (read at `start`): an answer refuses it before its
    /// body is read (what arrives of the body is then dropped).
    func head(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer?

    /// The whole request, not refused: its answer.
    func answer(_ head: HTTPRequestHead, body: ByteBuffer, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply

    /// The answer to a body over `maximumBodyBytes` (the connection then closes).
    func tooLarge(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer

    /// When a request whose head came at `start` must have arrived in full (slowloris).
    func arrivalLimit(_ head: HTTPRequestHead, start: NIODeadline) -> NIODeadline

    /// The answer to a request that has not arrived in full by its limit (the connection
    /// then closes); nil closes it without one.
    func arrivalExpired(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer?

    /// The connection ended while a request, never answered, was arriving.
    func abandoned(_ head: HTTPRequestHead, start: NIODeadline)

    /// The connection has ended (called once, when it goes inactive or its handler leaves
    /// the pipeline, whichever is first): work for it may be dropped; late answers are.
    func closed()
}

extension HTTP1Responder {
    public func abandoned(_ head: HTTPRequestHead, start: NIODeadline) {}
    public func closed() {}
}

/// The one HTTP/1.1 exchange of every listener that speaks it, behind NIO's server pipeline
/// (which queues a pipelined request until the one before is answered): a request is read
/// (its body up to the responder's limit, the whole of it within its arrival limit),
/// answered once (early, when its head is refused), and the connection closes after
/// `idleTimeout` without a request. A `HEAD` request gets the head of its answer only.
public final class HTTP1ExchangeHandler: ChannelInboundHandler {
    public typealias InboundIn = HTTPServerRequestPart
    public typealias OutboundOut = HTTPServerResponsePart

    private let responder: any HTTP1Responder
    private let idleTimeout: TimeAmount
    private var context: ChannelHandlerContext?
    /// The request being read or answered.
    private var head: HTTPRequestHead?
    private var body = ByteBuffer()
    private var start = NIODeadline.now()
    /// The request has been answered (perhaps early, refused before its body arrived),
    /// and read to its end.
    private var answered = false
    private var readEnd = false
    private var idleTimer: Scheduled<Void>?
    /// Armed only for a request that did not arrive in one read.
    private var arrivalTimer: Scheduled<Void>?
    /// `responder.closed()` has been called.
    private var responderClosed = false

    public init(responder: any HTTP1Responder, idleTimeout: TimeAmount) {
        self.responder = responder
        self.idleTimeout = idleTimeout
    }

    public func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        self.armIdleTimer()
    }

    public func handlerRemoved(context: ChannelHandlerContext) {
        self.context = nil
        self.idleTimer?.cancel()
        self.arrivalTimer?.cancel()
        self.closeResponder()
    }

    private func closeResponder() {
        if !self.responderClosed {
            self.responderClosed = true
            self.responder.closed()
        }
    }

    private func armIdleTimer() {
        self.idleTimer?.cancel()
        guard let context = self.context else {
            return
        }
        self.idleTimer = context.eventLoop.assumeIsolated().scheduleTask(in: self.idleTimeout) {
            self.context?.close(promise: nil)
        }
    }

    public func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        switch self.unwrapInboundIn(data) {
        case .head(let head):
            self.idleTimer?.cancel()
            self.head = head
            self.body.clear()
            self.answered = false
            self.readEnd = false
            self.start = context.eventLoop.now
            if let refusal = self.responder.head(head, start: self.start) {
                self.respond(refusal)
            }
        case .body(var bytes):
            guard !self.answered, let head = self.head else {
                return
            }
            guard self.body.readableBytes + bytes.readableBytes <= self.responder.maximumBodyBytes else {
                var answer = self.responder.tooLarge(head, start: self.start)
                answer.close = true
                self.respond(answer)
                return
            }
            self.body.writeBuffer(&bytes)
        case .end:
            self.readEnd = true
            self.arrivalTimer?.cancel()
            self.arrivalTimer = nil
            guard !self.answered, let head = self.head else {
                self.armIdleTimer()  // answered early: the connection waits for the next
                return
            }
            switch self.responder.answer(head, body: self.body, start: self.start, eventLoop: context.eventLoop) {
            case .now(let answer):
                self.respond(answer)
            case .later(let future):
                future.hop(to: context.eventLoop).assumeIsolated().whenComplete { result in
                    switch result {
                    case .success(let answer):
                        self.respond(answer)
                    case .failure(let error):
                        // A responder's failure is still an answer: the client is not left waiting.
                        self.respond(HTTP1Answer(.internalServerError, contentType: "text/plain; charset=utf-8", body: ByteBuffer(string: "internal error: \(error)\n"), close: true))
                    }
                }
            }
        }
    }

    /// A request still arriving when a read ends is held to its arrival limit: one timer,
    /// armed only for a request that did not come in one read. Past it the request is
    /// answered (unless it was already, refused early) and the connection closed (the
    /// rest of its body cannot be told from the next request).
    public func channelReadComplete(context: ChannelHandlerContext) {
        if let head = self.head, !self.readEnd, self.arrivalTimer == nil {
            let start = self.start
            self.arrivalTimer = context.eventLoop.assumeIsolated().scheduleTask(deadline: self.responder.arrivalLimit(head, start: start)) {
                self.arrivalTimer = nil
                guard !self.readEnd, self.start == start else {
                    return
                }
                if !self.answered, var answer = self.responder.arrivalExpired(head, start: start) {
                    answer.close = true
                    self.respond(answer)
                } else {
                    self.context?.close(promise: nil)
                }
            }
        }
        context.fireChannelReadComplete()
    }

    /// Writes the request's one answer (a second, or one after the connection ended, is
    /// dropped); once the request is also read to its end, the connection waits for the next.
    private func respond(_ answer: HTTP1Answer) {
        guard !self.answered, let context = self.context, let head = self.head else {
            return
        }
        self.answered = true
        let keepAlive = head.isKeepAlive && !answer.close
        var headers: HTTPHeaders = [
            "content-type": answer.contentType,
            "content-length": String(answer.body.readableBytes),
        ]
        headers.add(name: "connection", value: keepAlive ? "keep-alive" : "close")
        for (name, value) in answer.headers {
            headers.add(name: name, value: value)
        }
        context.write(self.wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: answer.status, headers: headers))), promise: nil)
        if head.method != .HEAD {
            context.write(self.wrapOutboundOut(.body(.byteBuffer(answer.body))), promise: nil)
        }
        let written = context.writeAndFlush(self.wrapOutboundOut(.end(nil)))
        if !keepAlive {
            written.assumeIsolated().whenComplete { _ in
                self.context?.close(promise: nil)
            }
        }
        if self.readEnd {
            self.armIdleTimer()
        }
    }

    /// A request NIO could not parse (answered 400 by its error handler) ends the
    /// connection, as does any other error on it; other connections are untouched.
    public func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }

    public func channelInactive(context: ChannelHandlerContext) {
        if let head = self.head, !self.readEnd, !self.answered {
            self.responder.abandoned(head, start: self.start)
        }
        self.answered = true  // nothing more is written: a late answer is dropped
        self.closeResponder()
        context.fireChannelInactive()
    }
}
