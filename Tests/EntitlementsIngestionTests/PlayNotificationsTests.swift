import EntitlementsFormats
import EntitlementsMessages
import Foundation
import Synchronization
import Testing

@testable import EntitlementsIngestion

/// The Play mapping alone (docs/ingestion.md, "Google Play"): notifications decoded, and
/// the Play Developer API's answers turned into writes. The whole path, over HTTP against a
/// loopback Google, is Tests/googleplay/test_googleplay.py.
@Suite("Google Play notifications and purchases as writes")
struct PlayNotificationsTests {
    let play = PlayNotifications(packages: ["com.example.app"])
    let catalog = PlayCatalog(
        contains: { ["premium_sub", "premium_sub:yearly", "lifetime"].contains($0) },
        period: { $0 == "premium_sub:yearly" ? .annual : $0 == "premium_sub" ? .monthly : .unspecified }
    )
    static let start = RFC3339.parse("2026-01-10T00:00:00Z")!
    static let expiry = RFC3339.parse("2026-03-10T00:00:00Z")!

    func data(_ json: String) -> String { Data(json.utf8).base64EncodedString() }

    func json(_ text: String) throws -> EventJSON { try EventJSON(parsing: Array(text.utf8)) }

    func subscription(state: String, order: String = "GPA.1-2-3-4", extra: String = "", item: String = "") throws -> EventJSON {
        try self.json(
            #"""
            {"startTime": "2026-01-10T00:00:00Z", "subscriptionState": "\#(state)", "acknowledgementState": "ACKNOWLEDGEMENT_STATE_PENDING",
             "externalAccountIdentifiers": {"obfuscatedExternalAccountId": "u1"}\#(extra),
             "lineItems": [{"productId": "premium_sub", "expiryTime": "2026-03-10T00:00:00Z", "latestSuccessfulOrderId": "\#(order)",
                            "autoRenewingPlan": {"autoRenewEnabled": true, "recurringPrice": {"currencyCode": "EUR", "units": "4", "nanos": 990000000}},
                            "offerDetails": {"basePlanId": "monthly"}\#(item)}]}
            """#
        )
    }

    func writes(_ plan: StoreEventPlan) -> [StoreWrite] {
        guard case .apply(_, let writes) = plan else { return [] }
        return writes
    }

    func state(_ plan: StoreEventPlan) -> SubscriptionState? {
        for write in self.writes(plan) {
            switch write {
            case .state(let state), .stateWithBillingIssue(let state): return state
            default: continue
            }
        }
        return nil
    }

    func transaction(_ plan: StoreEventPlan) -> Transaction? {
        for case .transaction(let transaction, _) in self.writes(plan) { return transaction }
        return nil
    }

    @Test("every notification kind decodes; Google's 64-bit numbers come as strings; an unknown type number is still refetched")
    func decode() throws {
        let subscription = try play.decode(data: data(#"{"packageName":"com.example.app","eventTimeMillis":"1700000000000","subscriptionNotification":{"notificationType":99,"purchaseToken":"t"}}"#))
        #expect(subscription == PlayNotification(packageName: "com.example.app", eventTime: 1_700_000_000_000, kind: .subscription(type: 99, token: "t")))
        let product = try play.decode(data: data(#"{"packageName":"com.example.app","eventTimeMillis":"1","oneTimeProductNotification":{"notificationType":1,"purchaseToken":"t","sku":"lifetime"}}"#))
        #expect(product.kind == .oneTimeProduct(type: 1, token: "t", sku: "lifetime"))
        let voided = try play.decode(data: data(#"{"packageName":"com.example.app","eventTimeMillis":"1","voidedPurchaseNotification":{"purchaseToken":"t","orderId":"GPA.1","productType":1,"refundType":1}}"#))
        #expect(voided.kind == .voided(token: "t", orderId: "GPA.1", productType: 1, refundType: 1))
        #expect(try play.decode(data: data(#"{"packageName":"com.example.app","eventTimeMillis":"1","testNotification":{"version":"1.0"}}"#)).kind == .test)
    }

    @Test("a notification that is not one is refused with its reason", arguments: [
        ("%%%", RejectionReason.malformedJSON),
        (Data("[1]".utf8).base64EncodedString(), .malformedJSON),
        (Data(#"{"eventTimeMillis":"1","testNotification":{}}"#.utf8).base64EncodedString(), .missingField),
        (Data(#"{"packageName":"com.other","eventTimeMillis":"1","testNotification":{}}"#.utf8).base64EncodedString(), .otherApp),
        (Data(#"{"packageName":"com.example.app","eventTimeMillis":"1"}"#.utf8).base64EncodedString(), .missingField),
        (Data(#"{"packageName":"com.example.app","eventTimeMillis":"1","subscriptionNotification":{"notificationType":4}}"#.utf8).base64EncodedString(), .missingField),
    ])
    func refused(data: String, reason: RejectionReason) {
        #expect(throws: IngestionRejection.self) { try play.decode(data: data) }
        do {
            _ = try play.decode(data: data)
        } catch {
            #expect(error.reason == reason)
        }
    }

    @Test("a token is its chain's id while its alias fits an id; a longer one is hashed, the same way every time")
    func chainIds() {
        #expect(PlayNotifications.chainId("abc") == "abc")
        #expect(PlayNotifications.alias(ofToken: "abc") == "googleplay:abc")
        let long = String(repeating: "x", count: 300)
        let hashed = PlayNotifications.chainId(long)
        #expect(hashed.hasPrefix("sha256:") && hashed.count == 71 && hashed == PlayNotifications.chainId(long))
        #expect(PlayNotifications.chainId("abc", lineItem: "p") == "abc:p")
    }

    @Test("a renewal starts its billing period before its expiry (UTC calendar), never before the subscription")
    func periodStart() {
        let march10 = RFC3339.parse("2026-03-10T00:00:00Z")!
        #expect(PlayNotifications.periodStart(expiry: march10, period: .monthly, notBefore: 0) == RFC3339.parse("2026-02-10T00:00:00Z")!)
        #expect(PlayNotifications.periodStart(expiry: march10, period: .annual, notBefore: 0) == RFC3339.parse("2025-03-10T00:00:00Z")!)
        #expect(PlayNotifications.periodStart(expiry: march10, period: .weekly, notBefore: 0) == RFC3339.parse("2026-03-03T00:00:00Z")!)
        #expect(PlayNotifications.periodStart(expiry: march10, period: .unspecified, notBefore: 0) == RFC3339.parse("2026-02-08T00:00:00Z")!)
        #expect(PlayNotifications.periodStart(expiry: march10, period: .annual, notBefore: Self.start) == Self.start)
    }

    @Test("an active purchase: the period, its price, auto-renew, the account id, and an acknowledgement")
    func active() throws {
        let (plan, acknowledgement) = try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_ACTIVE"), token: "tok", catalog: catalog)
        guard case .apply(let identity, _) = plan else { Issue.record("\(plan)"); return }
        #expect(identity == .accountId("u1", chainAlias: "googleplay:tok"))
        let transaction = try #require(self.transaction(plan))
        #expect(transaction.transactionId == "GPA.1-2-3-4" && transaction.originalTransactionId == "tok" && transaction.store == .playstore)
        #expect(transaction.transactionDate == Self.start && transaction.expirationDate == Self.expiry && transaction.type == .subscriptionStarted)
        #expect(transaction.priceMicros == 4_990_000 && transaction.currency == "EUR" && transaction.environment == .production)
        #expect(state(plan)?.autoRenewEnabled == true && state(plan)?.isInBillingRetry == false)
        #expect(acknowledgement == PlayAcknowledgement(kind: .subscription, productId: "premium_sub", token: "tok"))
    }

    @Test("each subscriptionState as a renewal state", arguments: [
        "SUBSCRIPTION_STATE_CANCELED", "SUBSCRIPTION_STATE_IN_GRACE_PERIOD", "SUBSCRIPTION_STATE_ON_HOLD", "SUBSCRIPTION_STATE_PAUSED", "SUBSCRIPTION_STATE_EXPIRED",
    ])
    func states(state name: String) throws {
        let canceled = #", "canceledStateContext": {"userInitiatedCancellation": {"cancelTime": "2026-02-01T00:00:00Z"}}"#
        let (plan, acknowledgement) = try play.plan(subscription: subscription(state: name, extra: canceled), token: "tok", catalog: catalog)
        let state = try #require(self.state(plan))
        switch name {
        case "SUBSCRIPTION_STATE_CANCELED":
            #expect(!state.autoRenewEnabled && state.cancellationReason == .customer && state.autoRenewDisabledDate == RFC3339.parse("2026-02-01T00:00:00Z"))
            #expect(acknowledgement != nil && state.endedDate == nil)
        case "SUBSCRIPTION_STATE_IN_GRACE_PERIOD", "SUBSCRIPTION_STATE_ON_HOLD":
            #expect(state.isInBillingRetry && state.gracePeriodExpirationDate == Self.expiry)
            guard case .stateWithBillingIssue = self.writes(plan).first else { Issue.record("the state goes first, to read the period before"); return }
        case "SUBSCRIPTION_STATE_PAUSED":
            #expect(state.autoRenewEnabled && !state.isInBillingRetry && acknowledgement == nil)
        default:
            #expect(!state.autoRenewEnabled && state.endedDate == Self.expiry && acknowledgement == nil)
        }
    }

    @Test("pending purchases write nothing; a state not known yet is a retry")
    func pending() throws {
        #expect(try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_PENDING"), token: "t", catalog: catalog).0 == .ignore(reason: "pending"))
        #expect(try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_PENDING_PURCHASE_CANCELED"), token: "t", catalog: catalog).0 == .ignore(reason: "pending_canceled"))
        #expect(throws: IngestionRetry(.unknownState, "subscription t: subscriptionState SUBSCRIPTION_STATE_NEW is not one this server knows; refused so that the notification is delivered again once it is upgraded")) {
            try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_NEW"), token: "t", catalog: catalog)
        }
    }

    @Test("trials, intro offers, renewals and test purchases")
    func offers() throws {
        let trial = try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_ACTIVE", item: #", "offerPhase": {"freeTrial": {}}"#), token: "t", catalog: catalog).0
        #expect(transaction(trial)?.type == .trialStarted && transaction(trial)?.priceMicros == 0)
        let intro = try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_ACTIVE", order: "GPA.1-2-3-4..2", item: #", "offerPhase": {"introductoryPrice": {}}"#), token: "t", catalog: catalog).0
        #expect(transaction(intro)?.type == .introRenewed && transaction(intro)?.priceMicros == nil)
        let renewal = try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_ACTIVE", order: "GPA.1-2-3-4..0"), token: "t", catalog: catalog).0
        #expect(transaction(renewal)?.type == .subscriptionRenewed && transaction(renewal)?.transactionDate == RFC3339.parse("2026-02-10T00:00:00Z"))
        let test = try play.plan(subscription: subscription(state: "SUBSCRIPTION_STATE_ACTIVE", extra: #", "testPurchase": {}"#), token: "t", catalog: catalog).0
        #expect(transaction(test)?.environment == .sandbox)
    }

    @Test("a linked token ends the chain it replaces where the new one starts; without an account id the old chain's customer is looked up")
    func linked() throws {
        let resource = try json(
            #"""
            {"startTime": "2026-01-10T00:00:00Z", "subscriptionState": "SUBSCRIPTION_STATE_ACTIVE", "linkedPurchaseToken": "old",
             "lineItems": [{"productId": "premium_sub", "expiryTime": "2027-01-10T00:00:00Z", "latestSuccessfulOrderId": "GPA.9", "offerDetails": {"basePlanId": "yearly"}}]}
            """#
        )
        let plan = try play.plan(subscription: resource, token: "new", catalog: catalog).0
        guard case .apply(let identity, let writes) = plan else { Issue.record("\(plan)"); return }
        #expect(identity == .chainAlias("googleplay:new", linked: "googleplay:old"))
        #expect(transaction(plan)?.productId == "premium_sub:yearly")
        #expect(writes.last == .endChains(store: .playstore, chain: "old", at: Self.start))
    }

    @Test("a product not in the catalog is a retry naming both ids tried")
    func unknownProduct() throws {
        let resource = try json(#"{"startTime": "2026-01-10T00:00:00Z", "subscriptionState": "SUBSCRIPTION_STATE_ACTIVE", "lineItems": [{"productId": "other", "expiryTime": "2026-03-10T00:00:00Z", "offerDetails": {"basePlanId": "b"}}]}"#)
        #expect(throws: IngestionRetry(.unknownProduct, "subscription t: product other:b or other is not in the catalog; add it, and the notification's redelivery records it")) {
            try play.plan(subscription: resource, token: "t", catalog: catalog)
        }
    }

    @Test("an add-on line item is a chain of its own, its line of the order a transaction of its own")
    func lineItems() throws {
        let resource = try json(
            #"""
            {"startTime": "2026-01-10T00:00:00Z", "subscriptionState": "SUBSCRIPTION_STATE_ACTIVE",
             "lineItems": [{"productId": "premium_sub", "expiryTime": "2026-03-10T00:00:00Z", "latestSuccessfulOrderId": "GPA.9"},
                           {"productId": "lifetime", "expiryTime": "2026-03-10T00:00:00Z", "latestSuccessfulOrderId": "GPA.9"}]}
            """#
        )
        let transactions = self.writes(try play.plan(subscription: resource, token: "t", catalog: catalog).0).compactMap { write -> String? in
            if case .transaction(let transaction, _) = write { return "\(transaction.originalTransactionId!) \(transaction.transactionId!)" }
            return nil
        }
        #expect(transactions == ["t GPA.9", "t:lifetime GPA.9:lifetime"])
    }

    @Test("one-time products: purchased, pending, canceled; a voided purchase revokes unless partial")
    func products() throws {
        let purchased = try json(#"{"purchaseTimeMillis": "1700000000000", "purchaseState": 0, "acknowledgementState": 0, "orderId": "GPA.5", "purchaseType": 0, "obfuscatedExternalAccountId": "u2"}"#)
        let (plan, acknowledgement) = try play.plan(product: purchased, token: "pt", sku: "lifetime", catalog: catalog)
        #expect(transaction(plan)?.type == .nonConsumablePurchase && transaction(plan)?.expirationDate == nil && transaction(plan)?.environment == .sandbox)
        #expect(acknowledgement == PlayAcknowledgement(kind: .product, productId: "lifetime", token: "pt"))
        #expect(try play.plan(product: json(#"{"purchaseTimeMillis": "1", "purchaseState": 2}"#), token: "pt", sku: "lifetime", catalog: catalog).0 == .ignore(reason: "pending"))
        #expect(try play.plan(product: json(#"{"purchaseTimeMillis": "1", "purchaseState": 1}"#), token: "pt", sku: "lifetime", catalog: catalog).0 == .ignore(reason: "canceled"))
        #expect(play.plan(voided: "pt", orderId: "GPA.5", refundType: 2, at: 5) == .ignore(reason: "partial_refund"))
        #expect(
            play.plan(voided: "pt", orderId: "GPA.5", refundType: 1, at: 5)
                == .apply(identity: .chainAlias("googleplay:pt", linked: nil), writes: [.revokeTransaction(store: .playstore, transactionId: "GPA.5", date: 5)])
        )
    }

    @Test("a burst of calls for one key makes at most two runs, the last after every call arrived")
    func singleFlight() async {
        let flights = SingleFlight<Int>()
        let runs = Counter()
        await withTaskGroup(of: Int.self) { group in
            for _ in 0..<20 {
                group.addTask {
                    await flights.run("k") {
                        let run = runs.next()
                        try? await Task.sleep(nanoseconds: 20_000_000)
                        return run
                    }
                }
            }
            for await _ in group {}
        }
        #expect((1...2).contains(runs.value) && flights.busyKeys == 0)
    }

    @Test("the service account's key file is checked when it is read")
    func keyFile() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("sa-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        try #"{"client_email": "a@b", "private_key_id": "k"}"#.write(toFile: directory + "/missing.json", atomically: true, encoding: .utf8)
        try #"{"client_email": "a@b", "private_key_id": "k", "token_uri": "https://oauth2.googleapis.com/token", "private_key": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"}"#
            .write(toFile: directory + "/badkey.json", atomically: true, encoding: .utf8)
        for (file, message) in [
            ("missing.json", "client_email, private_key, private_key_id and token_uri are required"),
            ("badkey.json", "private_key is not an RSA private key in PEM"),
        ] {
            #expect { try GoogleServiceAccount.load(path: directory + "/" + file) } throws: { "\($0)".contains(message) }
        }
    }
}

private final class Counter: Sendable {
    private let count = Mutex<Int>(0)
    func next() -> Int { self.count.withLock { $0 += 1; return $0 } }
    var value: Int { self.count.withLock { $0 } }
}
