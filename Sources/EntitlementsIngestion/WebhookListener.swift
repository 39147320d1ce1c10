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
            try channel.pipeline.syncOperations.addHandler(
                HTTP1ExchangeHandler(responder: WebhookResponder(ingestion: ingestion, methods: methods), idleTimeout: methods.configuration.idleTimeout)
            )
        }
    }
}

/// One webhook connection's requests, each handed to ``WebhookIngestion`` and answered
/// once its writes are durable (or failed). The exchange (timers, limits, keep-alive) is
/// ``HTTP1ExchangeHandler``'s.
final class WebhookResponder: HTTP1Responder {
    private let ingestion: WebhookIngestion
    private let methods: EntitlementMethods

    init(ingestion: WebhookIngestion, methods: EntitlementMethods) {
        self.ingestion = ingestion
        self.methods = methods
    }

    var maximumBodyBytes: Int {
        WebhookListener.maximumBodyBytes
    }

    func head(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
        let path = Self.path(head)
        if !self.ingestion.routes.contains(path) {
            let served = self.ingestion.routes.isEmpty ? "none" : self.ingestion.routes.joined(separator: ", ")
            return Self.answer(WebhookAnswer(status: 404, body: WebhookIngestion.json(["error": .string("\(path): no such webhook here (served: \(served))")])))
        }
        if head.method != .POST {
            return Self.answer(WebhookAnswer(status: 405, body: WebhookIngestion.json(["error": .string("\(head.method) \(path): webhooks are POST")])))
        }
        return nil
    }

    func answer(_ head: HTTPRequestHead, body: ByteBuffer, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply {
        let body = Array(body.readableBytesView)
        let ingestion = self.ingestion
        let methods = self.methods
        let signature = head.headers.first(name: "stripe-signature")
        let authorization = head.headers.first(name: "authorization")
        let path = Self.path(head)
        let promise = eventLoop.makePromise(of: HTTP1Answer.self)
        promise.completeWithTask {
            let answer =
                switch path {
                case WebhookIngestion.appStorePath: await ingestion.appStore(body: body, methods: methods, on: eventLoop)
                case WebhookIngestion.googlePlayPath: await ingestion.googlePlay(authorization: authorization, body: body, methods: methods, on: eventLoop)
                default: await ingestion.stripe(signature: signature, body: body, methods: methods, on: eventLoop)
                }
            return Self.answer(answer)
        }
        return .later(promise.futureResult)
    }

    func tooLarge(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer {
        let message = "the body is over \(WebhookListener.maximumBodyBytes) bytes"
        return Self.answer(WebhookAnswer(status: 413, body: WebhookIngestion.json(["error": .string(message), "reason": .string("too_large")])))
    }

    func arrivalLimit(_ head: HTTPRequestHead, start: NIODeadline) -> NIODeadline {
        start + self.methods.configuration.frameTimeout
    }

    func arrivalExpired(_ head: HTTPRequestHead, start: NIODeadline) -> HTTP1Answer? {
        let seconds = Double(self.methods.configuration.frameTimeout.nanoseconds) / 1e9
        let message = "the request did not arrive in full within --frame-timeout (\(seconds) s after its headers)"
        return Self.answer(WebhookAnswer(status: 408, body: WebhookIngestion.json(["error": .string(message), "reason": .string("too_slow")])))
    }

    /// The request's path, without its query.
    private static func path(_ head: HTTPRequestHead) -> String {
        String(head.uri.split(separator: "?", maxSplits: 1).first ?? "")
    }

    private static func answer(_ answer: WebhookAnswer) -> HTTP1Answer {
        HTTP1Answer(HTTPResponseStatus(statusCode: answer.status), contentType: "application/json", body: ByteBuffer(string: answer.body))
    }
}
