import EntitlementsMessages
public import EntitlementsServer
import EntitlementsStore
import Foundation
import Logging
public import NIOCore
public import ServiceLifecycle
import Synchronization

/// Google Play's settings (docs/ingestion.md, "Google Play").
public struct GooglePlaySettings: Sendable {
    /// Pub/Sub push (`POST /webhooks/googleplay`): how its OIDC tokens are checked.
    public struct Push: Sendable {
        public var jwksURL: String
        public var audience: String
        public var serviceAccount: String

        public init(jwksURL: String = "https://www.googleapis.com/oauth2/v3/certs", audience: String, serviceAccount: String) {
            self.jwksURL = jwksURL
            self.audience = audience
            self.serviceAccount = serviceAccount
        }
    }

    /// Pub/Sub pull: the subscription the server pulls from itself.
    public struct Pull: Sendable {
        public var subscription: String
        public var pubsubURL: String

        public init(subscription: String, pubsubURL: String = "https://pubsub.googleapis.com") {
            self.subscription = subscription
            self.pubsubURL = pubsubURL
        }
    }

    public var packages: Set<String>
    public var serviceAccount: GoogleServiceAccount
    public var apiURL: String
    public var push: Push?
    public var pull: Pull?

    public init(packages: Set<String>, serviceAccount: GoogleServiceAccount, apiURL: String = "https://androidpublisher.googleapis.com", push: Push?, pull: Pull?) {
        self.packages = packages
        self.serviceAccount = serviceAccount
        self.apiURL = apiURL
        self.push = push
        self.pull = pull
    }

    /// A Pub/Sub subscription's full name, `projects/P/subscriptions/S`.
    public static func subscriptionProblem(_ name: String) -> String? {
        let parts = name.split(separator: "/", omittingEmptySubsequences: false)
        guard parts.count == 4, parts[0] == "projects", parts[2] == "subscriptions", !parts[1].isEmpty, !parts[3].isEmpty else {
            return "must be projects/PROJECT/subscriptions/SUBSCRIPTION, got \"\(name)\""
        }
        return nil
    }
}

/// Google Play as the server talks to it: the notifications' mapping, the Play Developer
/// API, Pub/Sub push authentication and pull. Made once per server.
public final class GooglePlay: Sendable {
    let settings: GooglePlaySettings
    let notifications: PlayNotifications
    let api: PlayDeveloperAPI
    let push: PubSubPushVerifier?
    let pubsub: PubSubClient?
    /// The Play Developer API's (and the token exchange's) client and back-off.
    let http: StoreHTTP
    /// One refresh of a purchase token at a time; notifications that arrive meanwhile share
    /// the next one.
    let refreshes = SingleFlight<WebhookIngestion.Outcome>()

    /// `clock` is the current time in Unix milliseconds (for the push tokens' expiry).
    public init(settings: GooglePlaySettings, clock: (@Sendable () -> Int64)? = nil) async {
        let clock = clock ?? { WallClock.unixMilliseconds() }
        // One back-off per API: a throttled Play Developer API does not stop Pub/Sub pulls
        // or the fetch of Google's keys, and the reverse. A pull may wait for messages.
        let http = StoreHTTP()
        let tokens = await GoogleAccessTokens(account: settings.serviceAccount, http: http)
        self.settings = settings
        self.http = http
        self.notifications = PlayNotifications(packages: settings.packages)
        self.api = PlayDeveloperAPI(baseURL: Self.trimmed(settings.apiURL), http: http, tokens: tokens)
        self.push = settings.push.map { PubSubPushVerifier(jwksURL: $0.jwksURL, audience: $0.audience, serviceAccount: $0.serviceAccount, http: StoreHTTP(), clock: clock) }
        self.pubsub = settings.pull.map { PubSubClient(baseURL: Self.trimmed($0.pubsubURL), subscription: $0.subscription, http: StoreHTTP(timeout: .seconds(120)), tokens: tokens) }
    }

    private static func trimmed(_ url: String) -> String {
        url.hasSuffix("/") ? String(url.dropLast()) : url
    }
}

extension WebhookIngestion {
    public static let googlePlayPath = "/webhooks/googleplay"

    /// `POST /webhooks/googleplay`: a Pub/Sub push, `{"message": {"data": BASE64,
    /// "messageId": ...}, "subscription": ...}`, authenticated by its bearer token.
    public func googlePlay(authorization: String?, body: [UInt8], methods: EntitlementMethods, on eventLoop: any EventLoop) async -> WebhookAnswer {
        guard let play = self.googlePlay, let push = play.push else {
            return WebhookAnswer(status: 404, body: Self.json(["error": .string("Google Play push is not configured on this server (--googleplay-push-audience)")]))
        }
        let store = "googleplay"
        do {
            try await push.verify(authorization: authorization)
        } catch {
            return self.answer(Self.outcome(of: error), store: store, event: "")
        }
        let envelope: EventJSON
        do {
            envelope = try EventJSON(parsing: body)
        } catch {
            return self.answer(.rejected(error), store: store, event: "")
        }
        guard let data = envelope["message"]["data"].string else {
            return self.answer(.rejected(IngestionRejection(.missingField, "not a Pub/Sub push: message.data is required")), store: store, event: "")
        }
        let messageId = envelope["message"]["messageId"].string ?? envelope["message"]["message_id"].string ?? ""
        let outcome = await CallContext.$storeSource.withValue(WriteSource(method: store, caller: "webhooks", eventId: messageId)) {
            await self.googlePlayMessage(data: data, play: play, methods: methods, on: eventLoop)
        }
        return self.answer(outcome, store: store, event: messageId)
    }

    /// One Pub/Sub message's notification, pushed or pulled: refetched from the Play
    /// Developer API, applied, and the purchase acknowledged once its writes are durable.
    func googlePlayMessage(data: String, play: GooglePlay, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> Outcome {
        let notification: PlayNotification
        do {
            notification = try play.notifications.decode(data: data)
        } catch {
            return .rejected(error)
        }
        let catalog = PlayCatalog(contains: { methods.catalogContains($0) }, period: { methods.catalogPeriod($0) })
        let package = notification.packageName
        switch notification.kind {
        case .test:
            return .ignored("test")
        case .voided(let token, let orderId, _, let refundType):
            return await self.voided(play: play, package: package, token: token, orderId: orderId, refundType: refundType, at: notification.eventTime, methods: methods, on: eventLoop)
        case .subscription(_, let token):
            return await play.refreshes.run("subscription \(package) \(token)") {
                await self.refresh(play: play, package: package, methods: methods, on: eventLoop) {
                    try play.notifications.plan(subscription: try await play.api.subscription(package: package, token: token), token: token, catalog: catalog)
                }
            }
        case .oneTimeProduct(_, let token, let sku):
            return await play.refreshes.run("product \(package) \(sku) \(token)") {
                await self.refresh(play: play, package: package, methods: methods, on: eventLoop) {
                    try play.notifications.plan(product: try await play.api.product(package: package, productId: sku, token: token), token: token, sku: sku, catalog: catalog)
                }
            }
        }
    }

    /// A voided purchase, confirmed with `purchases.voidedpurchases.list` (the notification
    /// alone is not Google's answer): revoked at Google's `voidedTimeMillis`. One Google
    /// does not list is a retry for a day (the list may lag), then refused; one whose
    /// purchase names nobody we know, a day after its void, is a purchase this service never
    /// recorded, and is let go.
    private func voided(
        play: GooglePlay,
        package: String,
        token: String,
        orderId: String,
        refundType: Int64?,
        at eventTime: Int64,
        methods: EntitlementMethods,
        on eventLoop: any EventLoop
    ) async -> Outcome {
        let wait = StoreEventApplier.refundWait
        let now = self.now
        let listed: EventJSON?
        do {
            listed = try await play.api.voided(package: package, orderId: orderId, since: eventTime - wait)
        } catch {
            return Self.outcome(of: error)
        }
        guard let listed else {
            if now - eventTime < wait {
                return .retry(IngestionRetry(.notRecordedYet, "voided order \(orderId) is not in purchases.voidedpurchases.list yet: refused so that the notification comes again"))
            }
            return .rejected(IngestionRejection(.unknownToken, "Google lists no voided order \(orderId) (purchases.voidedpurchases.list, since a day before the notification)"))
        }
        let date = PlayNotifications.int64(listed["voidedTimeMillis"]) ?? eventTime
        let plan = play.notifications.plan(voided: token, orderId: orderId, refundType: PlayNotifications.int64(listed["refundType"]) ?? refundType, at: date)
        let outcome = await self.run(plan, methods: methods, on: eventLoop)
        if case .retry(let retry) = outcome, retry.reason == .unknownIdentity, now - date >= wait {
            return .ignored("refund_of_unknown_payment")
        }
        return outcome
    }

    /// Reads the purchase, applies it, and acknowledges it after its writes are durable.
    private func refresh(
        play: GooglePlay,
        package: String,
        methods: EntitlementMethods,
        on eventLoop: any EventLoop,
        _ read: () async throws -> (StoreEventPlan, PlayAcknowledgement?)
    ) async -> Outcome {
        let plan: StoreEventPlan
        let acknowledgement: PlayAcknowledgement?
        do {
            (plan, acknowledgement) = try await read()
        } catch {
            return Self.outcome(of: error)
        }
        let outcome = await self.run(plan, methods: methods, on: eventLoop)
        guard let acknowledgement else {
            return outcome
        }
        switch outcome {
        case .applied, .ignored:
            do {
                try await play.api.acknowledge(acknowledgement, package: package)
                self.countAcknowledgement("acknowledged")
                return outcome
            } catch {
                self.countAcknowledgement("failed")
                return .retry(error)
            }
        case .rejected, .retry:
            return outcome
        }
    }
}

/// Runs one body per key at a time. A call while the key's body runs waits for the next
/// run, which starts when the current one ends and is shared by every call that arrived
/// meanwhile: a burst of notifications for one purchase makes at most two API calls, and
/// the last reads a state at least as new as every notification of the burst.
final class SingleFlight<Value: Sendable>: Sendable {
    private struct Entry {
        var running: (id: UInt64, task: Task<Value, Never>)
        var next: (id: UInt64, task: Task<Value, Never>)?
    }

    private let entries = Mutex<(counter: UInt64, byKey: [String: Entry])>((0, [:]))

    func run(_ key: String, _ body: @escaping @Sendable () async -> Value) async -> Value {
        let task = self.entries.withLock { entries -> Task<Value, Never> in
            entries.counter += 1
            let id = entries.counter
            guard var entry = entries.byKey[key] else {
                let task = Task { let value = await body(); self.finish(key, id); return value }
                entries.byKey[key] = Entry(running: (id, task))
                return task
            }
            if let next = entry.next {
                return next.task
            }
            let previous = entry.running.task
            let task = Task { _ = await previous.value; let value = await body(); self.finish(key, id); return value }
            entry.next = (id, task)
            entries.byKey[key] = entry
            return task
        }
        return await task.value
    }

    /// How many keys have a run under way.
    var busyKeys: Int { self.entries.withLock { $0.byKey.count } }

    private func finish(_ key: String, _ id: UInt64) {
        self.entries.withLock { entries in
            guard let entry = entries.byKey[key], entry.running.id == id else { return }
            if let next = entry.next {
                entries.byKey[key] = Entry(running: next)
            } else {
                entries.byKey[key] = nil
            }
        }
    }
}

/// `--googleplay-pubsub-subscription`: pulls the notifications from Pub/Sub, applies each
/// as a push would be, and acknowledges to Pub/Sub those answered (applied, unchanged,
/// ignored, or refused for good); a retry is left unacknowledged, so Pub/Sub delivers it
/// again after its ack deadline. While Google is backed off from, it waits.
public struct GooglePlayPuller: Service {
    let ingestion: WebhookIngestion
    let play: GooglePlay
    let pubsub: PubSubClient
    let methods: EntitlementMethods
    let eventLoop: any EventLoop
    private let logger = Logger(label: "entitlements.googleplay")

    /// The puller of `ingestion`'s Google Play settings; nil when they name no subscription.
    public init?(ingestion: WebhookIngestion, methods: EntitlementMethods, eventLoop: any EventLoop) {
        guard let play = ingestion.googlePlay, let pubsub = play.pubsub else {
            return nil
        }
        self.ingestion = ingestion
        self.play = play
        self.pubsub = pubsub
        self.methods = methods
        self.eventLoop = eventLoop
    }

    public func run() async throws {
        // Cancelled at shutdown: a message applied but not acknowledged to Pub/Sub yet is
        // delivered again, and applying it again changes nothing.
        try await cancelWhenGracefulShutdown {
            while !Task.isCancelled {
                if let until = self.play.http.backingOffUntil {
                    try? await Task.sleep(nanoseconds: UInt64(max((until - .now()).nanoseconds, 0)))
                    continue
                }
                let messages: [PubSubClient.Message]
                do {
                    messages = try await self.pubsub.pull(maximum: 50)
                } catch {
                    self.logger.warning("Pub/Sub pull failed", metadata: ["why": "\(error)"])
                    try? await Task.sleep(nanoseconds: 1_000_000_000)
                    continue
                }
                if messages.isEmpty {
                    try? await Task.sleep(nanoseconds: 500_000_000)
                    continue
                }
                var done: [String] = []
                await withTaskGroup(of: String?.self) { group in
                    for message in messages {
                        group.addTask {
                            let source = WriteSource(method: "googleplay", caller: "pubsub pull", eventId: message.messageId)
                            let outcome = await CallContext.$storeSource.withValue(source) {
                                await self.ingestion.googlePlayMessage(data: message.data, play: self.play, methods: self.methods, on: self.eventLoop)
                            }
                            _ = self.ingestion.answer(outcome, store: "googleplay", event: message.messageId)
                            if case .retry = outcome {
                                return nil
                            }
                            return message.ackId
                        }
                    }
                    for await ackId in group {
                        if let ackId { done.append(ackId) }
                    }
                }
                do {
                    try await self.pubsub.acknowledge(done)
                } catch {
                    // Pub/Sub delivers them again; applying them again changes nothing.
                    self.logger.warning("Pub/Sub acknowledge failed", metadata: ["why": "\(error)"])
                }
            }
        }
    }
}
