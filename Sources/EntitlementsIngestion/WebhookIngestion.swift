import EntitlementsMessages
public import EntitlementsServer
import EntitlementsFormats
import EntitlementsStore
import Foundation
import Logging
public import Metrics
public import NIOCore
import Synchronization
public import X509

/// Stripe's settings (`--stripe-webhook-secret-file`, `--stripe-customer-key`).
public struct StripeWebhookSettings: Sendable {
    public var secrets: [String]
    public var customerKey: String
    /// Seconds a signature may be old (Stripe's libraries: 300).
    public var tolerance: Int64

    public init(secrets: [String], customerKey: String = "user_id", tolerance: Int64 = 300) {
        self.secrets = secrets
        self.customerKey = customerKey
        self.tolerance = tolerance
    }
}

/// The App Store's settings (`--appstore-root-cert`, `--appstore-bundle-id`).
public struct AppStoreWebhookSettings: Sendable {
    public var roots: [Certificate]
    public var bundleIds: Set<String>

    public init(roots: [Certificate], bundleIds: Set<String>) {
        self.roots = roots
        self.bundleIds = bundleIds
    }
}

/// An HTTP answer to a webhook: its status and a JSON body saying what happened.
public struct WebhookAnswer: Sendable, Hashable {
    public var status: Int
    public var body: String
}

/// The store webhooks of docs/ingestion.md, independent of HTTP: verified bytes in, writes
/// through ``EntitlementMethods``, an answer out. Every answer is counted in
/// `entitlements_webhook_events_total{store, outcome, reason}` (outcome: `applied`,
/// `unchanged`, `ignored`, `rejected` (4xx), `retry` (5xx)). Bodies are never logged.
public final class WebhookIngestion: Sendable {
    private let stripe: (verifier: StripeSignatureVerifier, events: StripeEvents)?
    let appStore: (verifier: AppStoreJWSVerifier, notifications: AppStoreNotifications)?
    let googlePlay: GooglePlay?
    /// The App Store Server API, when its key is given (`--appstore-api-key`).
    public let appStoreAPI: AppStoreServerAPI?
    private let clock: @Sendable () -> Int64
    private let factory: any MetricsFactory
    private let counters = Mutex<[String: Counter]>([:])
    private let serial = AsyncSerializer()
    let logger = Logger(label: "entitlements.webhooks")

    /// `clock` is the current Unix time in seconds (for the signature tolerance); default: the wall clock.
    public init(
        stripe: StripeWebhookSettings?,
        appStore: AppStoreWebhookSettings? = nil,
        googlePlay: GooglePlay? = nil,
        appStoreAPI: AppStoreServerAPI? = nil,
        factory: any MetricsFactory = MetricsSystem.factory,
        clock: (@Sendable () -> Int64)? = nil
    ) {
        self.appStoreAPI = appStoreAPI
        self.stripe = stripe.map {
            (StripeSignatureVerifier(secrets: $0.secrets, tolerance: $0.tolerance), StripeEvents(customerKey: $0.customerKey))
        }
        self.appStore = appStore.map { (AppStoreJWSVerifier(roots: $0.roots), AppStoreNotifications(bundleIds: $0.bundleIds)) }
        self.googlePlay = googlePlay
        self.factory = factory
        self.clock = clock ?? { WallClock.unixMilliseconds() / 1000 }
    }

    public static let stripePath = "/webhooks/stripe"
    public static let appStorePath = "/webhooks/appstore"

    /// The current time in Unix milliseconds (by `clock`).
    var now: Int64 { self.clock() * 1000 }

    /// The paths served with these stores set up.
    public static func routes(stripe: Bool, appStore: Bool, googlePlayPush: Bool = false) -> [String] {
        (stripe ? [Self.stripePath] : []) + (appStore ? [Self.appStorePath] : []) + (googlePlayPush ? [Self.googlePlayPath] : [])
    }

    /// The paths served.
    public var routes: [String] {
        Self.routes(stripe: self.stripe != nil, appStore: self.appStore != nil, googlePlayPush: self.googlePlay?.push != nil)
    }

    /// `POST /webhooks/stripe`.
    public func stripe(signature: String?, body: [UInt8], methods: EntitlementMethods, on eventLoop: any EventLoop) async -> WebhookAnswer {
        guard let stripe = self.stripe else {
            return WebhookAnswer(status: 404, body: Self.json(["error": .string("Stripe webhooks are not configured on this server (--stripe-webhook-secret-file)")]))
        }
        return await self.ingest("stripe", methods: methods, on: eventLoop) { eventId in
            try stripe.verifier.verify(header: signature, body: body, now: self.clock())
            let event = try EventJSON(parsing: body)
            eventId = event["id"].string ?? ""
            return try stripe.events.plan(event, catalogContains: methods.catalogContains)
        }
    }

    /// `POST /webhooks/appstore`: `{"signedPayload": "<JWS>"}`.
    public func appStore(body: [UInt8], methods: EntitlementMethods, on eventLoop: any EventLoop) async -> WebhookAnswer {
        guard let appStore = self.appStore else {
            return WebhookAnswer(status: 404, body: Self.json(["error": .string("App Store notifications are not configured on this server (--appstore-root-cert)")]))
        }
        return await self.ingest("appstore", methods: methods, on: eventLoop) { eventId in
            guard let signedPayload = try EventJSON(parsing: body)["signedPayload"].string else {
                throw IngestionRejection(.missingField, "the body must be {\"signedPayload\": \"<JWS>\"} (App Store Server Notifications V2)")
            }
            let notification = try await appStore.verifier.verify(signedPayload, what: "signedPayload")
            eventId = notification["notificationUUID"].string ?? ""
            if let ignored = try appStore.notifications.screen(notification) {
                return .ignore(reason: ignored)
            }
            let data = notification["data"]
            var signed = AppStoreNotifications.Signed()
            if let jws = data["signedTransactionInfo"].string {
                signed.transaction = try await appStore.verifier.verify(jws, what: "signedTransactionInfo")
            }
            if let jws = data["signedRenewalInfo"].string {
                signed.renewal = try await appStore.verifier.verify(jws, what: "signedRenewalInfo")
            }
            return try appStore.notifications.plan(notification, signed, catalogContains: methods.catalogContains)
        }
    }

    /// Plans an event with `plan` (which names the event's id once it has read it), then
    /// applies it; a refusal or a retry it throws becomes the answer.
    private func ingest(
        _ store: String,
        methods: EntitlementMethods,
        on eventLoop: any EventLoop,
        _ plan: (inout String) async throws -> StoreEventPlan
    ) async -> WebhookAnswer {
        var eventId = ""
        let planned: StoreEventPlan
        do {
            planned = try await plan(&eventId)
        } catch {
            return self.answer(Self.outcome(of: error, otherwise: .writeFailed), store: store, event: eventId)
        }
        return await CallContext.$storeSource.withValue(WriteSource(method: store, caller: "webhooks", eventId: eventId)) {
            await self.apply(planned, store: store, event: eventId, methods: methods, on: eventLoop)
        }
    }

    private func apply(_ plan: StoreEventPlan, store: String, event: String, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> WebhookAnswer {
        self.answer(await self.run(plan, methods: methods, on: eventLoop), store: store, event: event)
    }

    /// What became of an event: the answer it gets, before it is counted.
    enum Outcome: Sendable {
        case ignored(String)
        case applied(AppliedEvent)
        case rejected(IngestionRejection)
        case retry(IngestionRetry)
    }

    /// Applies a plan: its writes are durable when this returns `.applied`. `verify`, when
    /// given, runs first, in the same turn as the writes (no other event between): a
    /// refusal it throws writes nothing.
    func run(_ plan: StoreEventPlan, methods: EntitlementMethods, on eventLoop: any EventLoop, verify: (() throws -> Void)? = nil) async -> Outcome {
        switch plan {
        case .ignore(let reason):
            return .ignored(reason)
        case .apply(let identity, let writes):
            if let problem = plan.idProblem {
                return .rejected(IngestionRejection(.invalidId, problem))
            }
            // One event at a time: a refund reads the record it then writes, and two events
            // of one subscription must not interleave their reads and writes.
            await self.serial.acquire()
            defer { self.serial.release() }
            do {
                try verify?()
            } catch {
                return Self.outcome(of: error, otherwise: .writeFailed)
            }
            do {
                let now = self.clock() * 1000
                let applied = try await StoreEventApplier(methods: methods).apply(identity, writes, now: now, on: eventLoop)
                if let skipped = applied.skipped, !applied.changed {
                    return .ignored(skipped)
                }
                return .applied(applied)
            } catch {
                return .retry(error)
            }
        }
    }

    /// A thrown refusal or retry as an outcome; any other error is a retry for `otherwise`.
    static func outcome(of error: any Error, otherwise: RetryReason = .storeUnavailable) -> Outcome {
        switch error {
        case let rejection as IngestionRejection: .rejected(rejection)
        case let retry as IngestionRetry: .retry(retry)
        default: .retry(IngestionRetry(otherwise, "\(error)"))
        }
    }

    /// The answer to an outcome, counted and (refusals, retries) logged.
    func answer(_ outcome: Outcome, store: String, event: String) -> WebhookAnswer {
        switch outcome {
        case .ignored(let reason):
            self.count(store, "ignored", reason)
            return WebhookAnswer(status: 200, body: Self.json(["received": .bool(true), "ignored": .string(reason)]))
        case .applied(let applied):
            self.count(store, applied.changed ? "applied" : "unchanged", "")
            return WebhookAnswer(
                status: 200,
                body: Self.json([
                    "received": .bool(true), "customerId": .string(applied.customerId), "changed": .bool(applied.changed),
                    "logSequence": .string("\(applied.logSequence)"),
                ])
            )
        case .rejected(let rejection):
            return self.rejected(store, rejection, event: event)
        case .retry(let retry):
            return self.retry(store, retry, event: event)
        }
    }

    private func rejected(_ store: String, _ rejection: IngestionRejection, event: String) -> WebhookAnswer {
        self.count(store, "rejected", rejection.reason.rawValue)
        self.logger.warning("webhook refused", metadata: ["store": "\(store)", "event": "\(event)", "reason": "\(rejection.reason.rawValue)", "message": "\(rejection.message)"])
        let status =
            switch rejection.reason {
            case .unauthenticated: 401
            case .forbidden: 403
            default: 400
            }
        return WebhookAnswer(status: status, body: Self.json(["error": .string(rejection.message), "reason": .string(rejection.reason.rawValue)]))
    }

    private func retry(_ store: String, _ retry: IngestionRetry, event: String) -> WebhookAnswer {
        self.count(store, "retry", retry.reason.rawValue)
        self.logger.warning("webhook not applied yet", metadata: ["store": "\(store)", "event": "\(event)", "reason": "\(retry.reason.rawValue)", "message": "\(retry.message)"])
        return WebhookAnswer(status: 503, body: Self.json(["error": .string(retry.message), "reason": .string(retry.reason.rawValue)]))
    }

    private func count(_ store: String, _ outcome: String, _ reason: String) {
        self.increment("entitlements_webhook_events_total", [("store", store), ("outcome", outcome), ("reason", reason)])
    }

    /// Google Play's acknowledgements, by outcome (`acknowledged`, `failed`).
    func countAcknowledgement(_ outcome: String) {
        self.increment("entitlements_googleplay_acknowledgements_total", [("outcome", outcome)])
    }

    func increment(_ label: String, _ dimensions: [(String, String)]) {
        let key = label + dimensions.map { "/\($0.1)" }.joined()
        let counter = self.counters.withLock { counters in
            if let counter = counters[key] {
                return counter
            }
            let counter = Counter(label: label, dimensions: dimensions, factory: self.factory)
            counters[key] = counter
            return counter
        }
        counter.increment()
    }

    /// A flat JSON object, in the given key order. (`logSequence` is a string, as the JSON
    /// door writes 64-bit integers.)
    static func json(_ fields: KeyValuePairs<String, JSONValue>) -> String {
        JSONValue.object(fields.map { ($0.key, $0.value) }).serialized(pretty: false)
    }
}

/// A lock for async code: `acquire` suspends until the holder calls `release`; waiters go
/// in arrival order.
final class AsyncSerializer: Sendable {
    private let state = Mutex<(busy: Bool, waiters: [CheckedContinuation<Void, Never>])>((false, []))

    func acquire() async {
        await withCheckedContinuation { (continuation: CheckedContinuation<Void, Never>) in
            let free = self.state.withLock { state in
                if state.busy {
                    state.waiters.append(continuation)
                    return false
                }
                state.busy = true
                return true
            }
            if free {
                continuation.resume()
            }
        }
    }

    func release() {
        let next = self.state.withLock { state -> CheckedContinuation<Void, Never>? in
            guard !state.waiters.isEmpty else {
                state.busy = false
                return nil
            }
            return state.waiters.removeFirst()
        }
        next?.resume()
    }
}
