import EntitlementsIngestion
import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import Foundation
import NIOCore
import NIOPosix
import Testing

/// A writable server with the webhook listener on port 0, over a catalog whose Stripe
/// price is `price_monthly` (premium), whose App Store products are
/// `com.example.premium.monthly` (premium) and `com.example.lifetime` (a non-consumable,
/// premium), and an empty customer list.
final class WebhookFixture: Sendable {
    static let secret = "whsec_test_secret"
    let directory: String
    let server: EntitlementsServer
    let group: MultiThreadedEventLoopGroup
    let ingestion: WebhookIngestion

    var port: Int { self.server.doorAddresses["webhooks"]!.port! }
    var methods: EntitlementMethods { self.server.methods }
    var loop: any EventLoop { self.group.next() }

    init(now: Int64, appStore: AppStoreWebhookSettings? = nil, security: ListenerSecurity = ListenerSecurity(policy: .open("webhooks")), frameTimeout: TimeAmount = .seconds(10)) async throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("webhooks-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        let catalog = #"""
            {"products": [
              {"id": "price_monthly", "type": "subscription", "period": "monthly", "entitlements": ["premium"]},
              {"id": "com.example.premium.monthly", "type": "subscription", "period": "monthly", "entitlements": ["premium"]},
              {"id": "com.example.lifetime", "type": "nonConsumable", "entitlements": ["premium"]}
            ]}
            """#
        try catalog.write(toFile: self.directory + "/catalog.json", atomically: true, encoding: .utf8)
        try "".write(toFile: self.directory + "/customers.jsonl", atomically: true, encoding: .utf8)
        _ = try SnapshotTools.build(catalogPath: self.directory + "/catalog.json", customersPath: self.directory + "/customers.jsonl", outputPath: self.directory + "/seed.snap", createdDate: now)
        let store = try CustomerStore.open(dataDirectory: self.directory + "/data", seed: self.directory + "/seed.snap").0
        self.group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        self.ingestion = WebhookIngestion(stripe: StripeWebhookSettings(secrets: ["whsec_rolled_out", Self.secret]), appStore: appStore, clock: { now / 1000 })
        self.server = try await EntitlementsServer.start(
            store: store,
            configuration: ServerConfiguration(tcp: ("127.0.0.1", 0), frameTimeout: frameTimeout),
            group: self.group,
            warmAt: now,
            doors: [WebhookListener.door(host: "127.0.0.1", port: 0, ingestion: self.ingestion, security: security)],
            purchases: self.ingestion
        )
    }

    func stop() async throws {
        await self.server.shutdownGracefully()
        try await self.group.shutdownGracefully()
        try? FileManager.default.removeItem(atPath: self.directory)
    }

    /// Delivers `event` signed with the test secret, as Stripe does, without HTTP.
    func deliver(_ event: JSON, signedAt: Int64) async -> WebhookAnswer {
        let body = event.bytes
        let header = StripeSignatureVerifier.header(body: body, timestamp: signedAt, secret: Self.secret)
        return await self.ingestion.stripe(signature: header, body: body, methods: self.methods, on: self.loop)
    }

    /// Delivers an App Store notification, as Apple does, without HTTP.
    func deliverAppStore(_ signedPayload: String) async -> WebhookAnswer {
        let body = Array(#"{"signedPayload":"\#(signedPayload)"}"#.utf8)
        return await self.ingestion.appStore(body: body, methods: self.methods, on: self.loop)
    }

    func record(_ user: String) throws -> CustomerRecord? {
        try self.methods.customerRecord(user, CallContext(eventLoop: self.loop, deadline: nil, scope: ConnectionScope())).get()
    }

    /// A check in the sandbox: the fixtures' events are test mode (`livemode: false`).
    func check(_ user: String, at instant: Int64) async throws -> CheckEntitlementsResponse {
        try await self.onLoop { methods, context in
            switch methods.check(CheckEntitlementsRequest(userId: user, at: instant, environment: .sandbox), context) {
            case .now(let result): context.eventLoop.makeSucceededFuture(result.flatMap { answer in Result { try answer.response() }.mapError { ServiceError(.internalError, "\($0)") } })
            case .later(let future): future.map { $0.flatMap { answer in Result { try answer.response() }.mapError { ServiceError(.internalError, "\($0)") } } }
            }
        }
    }

    /// Expects `user` (written by webhooks) and `other` (by the write calls) to get the same
    /// answer at `instant`, but for their ids: premium, active or not, auto-renew turned off
    /// by the customer, 9.99 USD a month.
    func expectSameAnswer(_ user: String, as other: String, at instant: Int64, active: Bool, sourceLocation: SourceLocation = #_sourceLocation) async throws {
        var answer = try await self.check(user, at: instant)
        let expected = try await self.check(other, at: instant)
        #expect(answer.entitlements.map(\.id) == ["premium"], sourceLocation: sourceLocation)
        #expect(answer.entitlements.first?.isActive == active, sourceLocation: sourceLocation)
        #expect(answer.entitlements.first?.renewState == .canceled, sourceLocation: sourceLocation)
        #expect(answer.entitlements.first?.status == (active ? .active : .canceled), sourceLocation: sourceLocation)
        #expect(answer.entitlements.first?.cancellationReason == .customer, sourceLocation: sourceLocation)
        #expect(answer.entitlements.first?.priceMicros == 9_990_000 && answer.entitlements.first?.currency == "USD", sourceLocation: sourceLocation)
        #expect(answer.entitlements.first?.interval == .monthly, sourceLocation: sourceLocation)
        answer.userId = expected.userId
        answer.customerId = expected.customerId
        answer.logSequence = expected.logSequence
        #expect(answer == expected, sourceLocation: sourceLocation)
    }

    func write(_ mutation: LogRecord.Mutation) async throws -> WriteResponse {
        try await self.onLoop { methods, context in
            switch methods.write(mutation, context) {
            case .now(let result): context.eventLoop.makeSucceededFuture(result)
            case .later(let future): future
            }
        }
    }

    /// Calls the methods on their event loop, as a transport does.
    private func onLoop<Value: Sendable>(_ body: @escaping @Sendable (EntitlementMethods, CallContext) -> EventLoopFuture<Result<Value, ServiceError>>) async throws -> Value {
        let loop = self.loop
        let methods = self.methods
        return try await loop.flatSubmit { body(methods, CallContext(eventLoop: loop, deadline: nil, scope: ConnectionScope())) }.get().get()
    }
}
