public import EntitlementsSecurity
public import EntitlementsServer
import EntitlementsFormats
import NIOCore
import NIOHTTP1

/// The listener of `serve --webhooks-listen HOST:PORT` (docs/ingestion.md): HTTP/1.1, what
/// the stores' webhook senders speak, one request at a time per connection. A store's
/// signature authenticates each event, so the listener takes no tokens; TLS is usually
/// ended by the load balancer in front (the stores require HTTPS).
public enum WebhookListener {
    /// The largest body read: Stripe's events are a few KiB, App Store notifications a few
    /// tens of KiB.
    public static let maximumBodyBytes = 1 << 20

    public static func door(host: String, port: Int, ingestion: WebhookIngestion, security: ListenerSecurity = .open("webhooks")) -> ServerDoor {
        ServerDoor(name: "webhooks", host: host, port: port, security: security, protocols: .webhooks) { channel, methods, _ in
            try channel.pipeline.syncOperations.configureHTTPServerPipeline(withErrorHandling: true)
            try channel.pipeline.syncOperations.addHandler(WebhookHandler(ingestion: ingestion, methods: methods))
        }
    }
}

/// Reads one webhook request, hands it to ``WebhookIngestion``, and answers once its writes
/// are durable (or failed).
final class WebhookHandler: ChannelInboundHandler {
    typealias InboundIn = HTTPServerRequestPart
    typealias OutboundOut = HTTPServerResponsePart

    private let ingestion: WebhookIngestion
    private let methods: EntitlementMethods
    private var head: HTTPRequestHead?
    /// The request's path, without its query.
    private var path = ""
    private var body: [UInt8] = []
    private var answered = false
    private var idleTimer: Scheduled<Void>?
    /// A request must arrive whole within --frame-timeout of its head (slowloris).
    private var requestTimer: Scheduled<Void>?
    private var removed = false

    init(ingestion: WebhookIngestion, methods: EntitlementMethods) {
        self.ingestion = ingestion
        self.methods = methods
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.armIdleTimer(context: context)
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.removed = true
        self.idleTimer?.cancel()
        self.requestTimer?.cancel()
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
            let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
            self.requestTimer = context.eventLoop.scheduleTask(in: self.methods.configuration.frameTimeout) {
                loopBound.value.close(promise: nil)
            }
            self.head = head
            self.body = []
            self.answered = false
            let path = String(head.uri.split(separator: "?", maxSplits: 1).first ?? "")
            self.path = path
            if !self.ingestion.routes.contains(path) {
                let served = self.ingestion.routes.isEmpty ? "none" : self.ingestion.routes.joined(separator: ", ")
                self.respond(context: context, WebhookAnswer(status: 404, body: WebhookIngestion.json(["error": .string("\(path): no such webhook here (served: \(served))")])))
            } else if head.method != .POST {
                self.respond(context: context, WebhookAnswer(status: 405, body: WebhookIngestion.json(["error": .string("\(head.method) \(path): webhooks are POST")])))
            }
        case .body(let bytes):
            guard !self.answered else {
                return
            }
            guard self.body.count + bytes.readableBytes <= WebhookListener.maximumBodyBytes else {
                let message = "the body is over \(WebhookListener.maximumBodyBytes) bytes"
                self.respond(context: context, WebhookAnswer(status: 413, body: WebhookIngestion.json(["error": .string(message), "reason": .string("too_large")])), close: true)
                return
            }
            self.body.append(contentsOf: bytes.readableBytesView)
        case .end:
            self.requestTimer?.cancel()
            self.requestTimer = nil
            guard !self.answered, let head = self.head else {
                self.armIdleTimer(context: context)
                return
            }
            let body = self.body
            let ingestion = self.ingestion
            let methods = self.methods
            let signature = head.headers.first(name: "stripe-signature")
            let isAppStore = self.path == WebhookIngestion.appStorePath
            let eventLoop = context.eventLoop
            let loopBound = NIOLoopBound((self, context), eventLoop: eventLoop)
            Task {
                let answer =
                    if isAppStore {
                        await ingestion.appStore(body: body, methods: methods, on: eventLoop)
                    } else {
                        await ingestion.stripe(signature: signature, body: body, methods: methods, on: eventLoop)
                    }
                eventLoop.execute {
                    let (handler, context) = loopBound.value
                    handler.respond(context: context, answer)
                    handler.armIdleTimer(context: context)
                }
            }
        }
    }

    private func respond(context: ChannelHandlerContext, _ answer: WebhookAnswer, close: Bool = false) {
        guard !self.answered, !self.removed, let head = self.head, context.channel.isActive else {
            return
        }
        self.answered = true
        let body = ByteBuffer(string: answer.body)
        let keepAlive = head.isKeepAlive && !close
        var headers: HTTPHeaders = ["content-type": "application/json", "content-length": String(body.readableBytes)]
        headers.add(name: "connection", value: keepAlive ? "keep-alive" : "close")
        let status = HTTPResponseStatus(statusCode: answer.status)
        context.write(self.wrapOutboundOut(.head(HTTPResponseHead(version: head.version, status: status, headers: headers))), promise: nil)
        context.write(self.wrapOutboundOut(.body(.byteBuffer(body))), promise: nil)
        let written = context.writeAndFlush(self.wrapOutboundOut(.end(nil)))
        if !keepAlive {
            let loopBound = NIOLoopBound(context, eventLoop: context.eventLoop)
            written.whenComplete { _ in loopBound.value.close(promise: nil) }
        }
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        context.close(promise: nil)
    }
}
