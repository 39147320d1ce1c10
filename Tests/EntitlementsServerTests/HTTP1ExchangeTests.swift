import EntitlementsServer
import NIOCore
import NIOEmbedded
import NIOHTTP1
import Testing

/// The HTTP/1.1 exchange every HTTP/1.1 listener shares (JSON door, webhooks, admin),
/// driven without a socket: request parts in, response parts out, time advanced by hand.
@Suite("one HTTP/1.1 exchange for every listener")
struct HTTP1ExchangeTests {
    /// A responder that refuses `/refused` at its head, echoes a body at once on `/now`,
    /// and answers `/later` when the test completes the promise.
    final class Echo: HTTP1Responder {
        var maximumBodyBytes: Int { 8 }
        var later: EventLoopPromise<HTTP1Answer>?
        var abandonedCount = 0
        var closedCount = 0

        func head(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
            head.uri == "/refused" ? .text(.forbidden, "no") : nil
        }

        func answer(_ head: HTTPRequestHead, body: ByteBuffer, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply {
            if head.uri == "/later" {
                let promise = eventLoop.makePromise(of: HTTP1Answer.self)
                self.later = promise
                return .later(promise.futureResult)
            }
            return .now(HTTP1Answer(.ok, contentType: "text/plain", body: body))
        }

        func tooLarge(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer {
            .text(.payloadTooLarge, "too large")
        }

        func arrivalLimit(_ head: HTTPRequestHead, start: NIODeadline) -> NIODeadline {
            start + .seconds(10)
        }

        func arrivalExpired(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
            .text(.requestTimeout, "too slow")
        }

        func abandoned(_ head: HTTPRequestHead, start: NIODeadline) {
            self.abandonedCount += 1
        }

        func closed() {
            self.closedCount += 1
        }
    }

    let responder = Echo()
    let loop = EmbeddedEventLoop()
    let channel: EmbeddedChannel

    init() throws {
        self.channel = EmbeddedChannel(loop: self.loop)
        try self.channel.pipeline.syncOperations.addHandler(HTTP1ExchangeHandler(responder: self.responder, idleTimeout: .seconds(60)))
        try self.channel.connect(to: SocketAddress(ipAddress: "127.0.0.1", port: 1)).wait()
    }

    func send(_ uri: String, method: HTTPMethod = .POST, body: String? = nil, end: Bool = true, keepAlive: Bool = true) throws {
        var head = HTTPRequestHead(version: .http1_1, method: method, uri: uri)
        if !keepAlive {
            head.headers.add(name: "connection", value: "close")
        }
        try self.channel.writeInbound(HTTPServerRequestPart.head(head))
        if let body {
            try self.channel.writeInbound(HTTPServerRequestPart.body(ByteBuffer(string: body)))
        }
        if end {
            try self.channel.writeInbound(HTTPServerRequestPart.end(nil))
        }
        self.channel.pipeline.fireChannelReadComplete()
    }

    /// The next response: its head and body (nil when it was not written: a HEAD request).
    func response() throws -> (head: HTTPResponseHead, body: String?)? {
        guard case .head(let head) = try self.channel.readOutbound(as: HTTPServerResponsePart.self) else {
            return nil
        }
        var body: String?
        var part = try self.channel.readOutbound(as: HTTPServerResponsePart.self)
        if case .body(.byteBuffer(let bytes)) = part {
            body = String(buffer: bytes)
            part = try self.channel.readOutbound(as: HTTPServerResponsePart.self)
        }
        guard case .end = part else {
            Issue.record("a response without its end: \(String(describing: part))")
            return nil
        }
        return (head, body)
    }

    @Test("a whole request is answered once, keep-alive, with its length")
    func answersOnce() throws {
        try self.send("/now", body: "hello")
        let answer = try #require(try self.response())
        #expect(answer.head.status == .ok)
        #expect(answer.body == "hello")
        #expect(answer.head.headers["content-length"] == ["5"])
        #expect(answer.head.headers["connection"] == ["keep-alive"])
        #expect(self.channel.isActive)
        try self.send("/now", body: "again")
        #expect(try self.response()?.body == "again")
    }

    @Test("a refused head is answered at once; the rest of its body is dropped, not answered again")
    func refusedEarly() throws {
        try self.send("/refused", body: nil, end: false)
        #expect(try self.response()?.head.status == .forbidden)
        try self.channel.writeInbound(HTTPServerRequestPart.body(ByteBuffer(string: "ignored")))
        try self.channel.writeInbound(HTTPServerRequestPart.end(nil))
        #expect(try self.channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
        #expect(self.channel.isActive)
    }

    @Test("a body over the responder's limit is refused and the connection closed")
    func tooLarge() throws {
        try self.send("/now", body: "123456789", end: false)
        let answer = try #require(try self.response())
        #expect(answer.head.status == .payloadTooLarge)
        #expect(answer.head.headers["connection"] == ["close"])
        self.loop.run()
        #expect(!self.channel.isActive)
    }

    @Test("a request not in by its arrival limit is answered and the connection closed; one in time is not")
    func arrivalLimit() throws {
        try self.send("/now", body: "1234", end: false)
        self.loop.advanceTime(by: .seconds(9))
        #expect(try self.channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
        self.loop.advanceTime(by: .seconds(1))
        let answer = try #require(try self.response())
        #expect(answer.head.status == .requestTimeout)
        #expect(answer.body == "too slow")
        self.loop.run()
        #expect(!self.channel.isActive)
    }

    @Test("a request that ends before its arrival limit is not cut off when the limit passes")
    func arrivalInTime() throws {
        try self.send("/now", body: "12", end: false)
        self.loop.advanceTime(by: .seconds(5))
        try self.channel.writeInbound(HTTPServerRequestPart.end(nil))
        #expect(try self.response()?.head.status == .ok)
        self.loop.advanceTime(by: .seconds(20))
        #expect(try self.channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
        #expect(self.channel.isActive)
    }

    @Test("a connection without a request closes after the idle timeout, counted from its last answer")
    func idle() throws {
        self.loop.advanceTime(by: .seconds(59))
        try self.send("/now", body: "x")
        _ = try self.response()
        self.loop.advanceTime(by: .seconds(59))
        #expect(self.channel.isActive)
        self.loop.advanceTime(by: .seconds(1))
        #expect(!self.channel.isActive)
        #expect(self.responder.closedCount == 1)
    }

    @Test("a later answer is written when it comes; none after the connection ended")
    func later() throws {
        try self.send("/later")
        #expect(try self.channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
        self.responder.later?.succeed(.text(.ok, "done"))
        #expect(try self.response()?.body == "done")

        // Gone (inactive) before its handler leaves the pipeline: the late answer is dropped.
        try self.send("/later")
        self.channel.pipeline.fireChannelInactive()
        #expect(self.responder.closedCount == 1, "the responder hears of it at once")
        self.responder.later?.succeed(.text(.ok, "too late"))
        #expect(try self.channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
    }

    @Test("a later answer that fails is answered 500 and the connection closed, not left waiting")
    func laterFailure() throws {
        struct Broken: Error {}
        try self.send("/later")
        self.responder.later?.fail(Broken())
        let answer = try #require(try self.response())
        #expect(answer.head.status == .internalServerError)
        self.loop.run()
        #expect(!self.channel.isActive)
    }

    @Test("HEAD gets the head of its answer only; Connection: close closes after the answer")
    func headAndClose() throws {
        try self.send("/now", method: .HEAD)
        let answer = try #require(try self.response())
        #expect(answer.body == nil)
        try self.send("/now", body: "bye", keepAlive: false)
        let last = try #require(try self.response())
        #expect(last.head.headers["connection"] == ["close"])
        self.loop.run()
        #expect(!self.channel.isActive)
    }

    @Test("a connection gone while its request was arriving tells the responder, once")
    func abandoned() throws {
        try self.send("/now", body: "12", end: false)
        self.channel.pipeline.fireChannelInactive()
        self.channel.pipeline.fireChannelInactive()
        _ = try? self.channel.close().wait()
        self.loop.run()
        #expect(self.responder.abandonedCount == 1)
        #expect(self.responder.closedCount == 1)
        #expect(try self.channel.readOutbound(as: HTTPServerResponsePart.self) == nil)
    }
}
