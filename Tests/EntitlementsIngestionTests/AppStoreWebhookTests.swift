import EntitlementsSecurity
@testable import EntitlementsIngestion
import EntitlementsMessages
import EntitlementsServer
import Foundation
import Testing

@Suite("App Store Server Notifications V2 end to end: signed notifications in, durable writes, the same answer as the write calls")
struct AppStoreWebhookTests {
    typealias A = AppStoreFixture
    let apple: AppStoreFixture

    init() throws {
        self.apple = try AppStoreFixture()
    }

    func fixture() async throws -> WebhookFixture {
        try await WebhookFixture(now: self.apple.base, appStore: try self.apple.settings)
    }

    /// Bought with a free week, renewed, auto-renew turned off: one subscription's life.
    func life(token: String?, original: String) throws -> [String] {
        let a = self.apple
        let first = a.transaction(original, original: original, token: token, purchased: -40, fields: [("offerType", 1), ("offerDiscountType", "FREE_TRIAL")])
        let renewed = a.transaction("\(original)-2", original: original, token: token, purchased: -10)
        return [
            try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "n1-\(original)", at: 0, transaction: first, renewal: a.renewal(original: original, renews: true)),
            try a.notification("DID_RENEW", uuid: "n2-\(original)", at: 1, transaction: renewed, renewal: a.renewal(original: original, renews: true)),
            try a.notification("DID_CHANGE_RENEWAL_STATUS", subtype: "AUTO_RENEW_DISABLED", uuid: "n3-\(original)", at: 2, transaction: renewed, renewal: a.renewal(original: original, renews: false)),
        ]
    }

    @Test("a subscription's notifications give the answer the same purchase gives through RecordTransaction and UpdateSubscriptionState")
    func sameAnswerAsWriteCalls() async throws {
        let fixture = try await self.fixture()
        for notification in try self.life(token: "6a0f2c4e-0000-4000-8000-00000000a11c", original: "2000") {
            let answer = await fixture.deliverAppStore(notification)
            #expect(answer.status == 200, "\(answer.body)")
            #expect(answer.body.contains(#""changed":true"#), "\(answer.body)")
        }
        let a = self.apple
        _ = try await fixture.write(.recordTransaction(RecordTransactionRequest(userId: "bob", transaction: Transaction(
            originalTransactionId: "2000", transactionId: "2000", store: .appstore, productId: A.monthly, transactionDate: a.base - 40 * A.day,
            expirationDate: a.base - 10 * A.day, environment: .sandbox, ownershipType: .owner, type: .trialStarted,
            priceMicros: 9_990_000, currency: "USD", verified: true  // as a store writes it
        ))))
        _ = try await fixture.write(.recordTransaction(RecordTransactionRequest(userId: "bob", transaction: Transaction(
            originalTransactionId: "2000", transactionId: "2000-2", store: .appstore, productId: A.monthly, transactionDate: a.base - 10 * A.day,
            expirationDate: a.base + 20 * A.day, environment: .sandbox, ownershipType: .owner, type: .subscriptionRenewed,
            priceMicros: 9_990_000, currency: "USD", verified: true  // as a store writes it
        ))))
        _ = try await fixture.write(.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "bob", state: SubscriptionState(
            store: .appstore, originalTransactionId: "2000", autoRenewEnabled: false, autoRenewDisabledDate: a.signedDate(2), isInBillingRetry: false,
            cancellationReason: .customer
        ))))
        let user = "6a0f2c4e-0000-4000-8000-00000000a11c"
        for (instant, active) in [(a.base, true), (a.base + 21 * A.day, false)] {
            try await fixture.expectSameAnswer(user, as: "bob", at: instant, active: active)
        }
        #expect(try await fixture.check("appstore:2000", at: a.base).customerId == user)
        try await fixture.stop()
    }

    @Test("each handled notification type writes what its payloads hold", arguments: [
        "SUBSCRIBED with an intro offer", "DID_RENEW", "DID_CHANGE_RENEWAL_STATUS enabled", "DID_CHANGE_RENEWAL_PREF",
        "DID_FAIL_TO_RENEW with grace", "DID_FAIL_TO_RENEW without grace", "GRACE_PERIOD_EXPIRED", "EXPIRED", "REFUND",
        "REFUND_REVERSED", "REVOKE", "OFFER_REDEEMED", "PRICE_INCREASE", "ONE_TIME_CHARGE", "Production", "TEST", "CONSUMPTION_REQUEST",
        "Consumable",
    ])
    func eachType(_ name: String) async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let token = "0c1d2e3f-0000-4000-8000-000000000001"
        // Bought 10 days ago, running: what most notifications follow.
        let bought = a.transaction("3000", original: "3000", token: token, purchased: -10)
        let subscribed = try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "s", at: 0, transaction: bought, renewal: a.renewal(original: "3000", renews: true))
        var prior = [subscribed]
        let notification: String
        var expected = "changed"
        var check: (CustomerRecord?) -> Void = { _ in }
        var afterPrior: (CustomerRecord?) -> Void = { _ in }
        switch name {
        case "SUBSCRIBED with an intro offer":
            prior = []
            let intro = a.transaction("3000", original: "3000", token: token, purchased: -10, fields: [("offerType", 1), ("offerDiscountType", "PAY_AS_YOU_GO"), ("price", 990)])
            notification = try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "n", at: 1, transaction: intro, renewal: a.renewal(original: "3000", renews: true))
            check = { record in
                #expect(record?.transactions.first?.type == .introStarted)
                #expect(record?.transactions.first?.priceMicros == 990_000 && record?.transactions.first?.currency == "USD")
                #expect(record?.transactions.first?.environment == .sandbox)
                #expect(record?.transactions.first?.ownershipType == .owner)
                #expect(record?.subscriptions.first?.autoRenewEnabled == true)
            }
        case "DID_RENEW":
            let renewed = a.transaction("3001", original: "3000", token: token, purchased: 20)
            notification = try a.notification("DID_RENEW", uuid: "n", at: 1, transaction: renewed, renewal: a.renewal(original: "3000", renews: true))
            check = { record in
                #expect(record?.transactions.map(\.type) == [.subscriptionStarted, .subscriptionRenewed])
                #expect(record?.transactions.last?.expirationDate == a.base + 50 * A.day)
            }
        case "DID_CHANGE_RENEWAL_STATUS enabled":
            prior.append(try a.notification("DID_CHANGE_RENEWAL_STATUS", subtype: "AUTO_RENEW_DISABLED", uuid: "d", at: 1, transaction: bought, renewal: a.renewal(original: "3000", renews: false)))
            notification = try a.notification("DID_CHANGE_RENEWAL_STATUS", subtype: "AUTO_RENEW_ENABLED", uuid: "n", at: 2, transaction: bought, renewal: a.renewal(original: "3000", renews: true))
            check = { record in
                #expect(record?.subscriptions.first?.autoRenewEnabled == true)
                #expect(record?.subscriptions.first?.autoRenewDisabledDate == nil)
            }
        case "DID_CHANGE_RENEWAL_PREF":
            let upgraded = a.transaction("3001", original: "3000", token: token, purchased: -1, reason: "PURCHASE")
            notification = try a.notification("DID_CHANGE_RENEWAL_PREF", subtype: "UPGRADE", uuid: "n", at: 1, transaction: upgraded, renewal: a.renewal(original: "3000", renews: true))
            check = { record in
                #expect(record?.transactions.map(\.transactionId) == ["3000", "3001"])
                #expect(record?.transactions.last?.type == .subscriptionStarted)
            }
        case "DID_FAIL_TO_RENEW with grace", "DID_FAIL_TO_RENEW without grace":
            let grace: Int64? = name.hasSuffix("with grace") ? 26 : nil
            notification = try a.notification(
                "DID_FAIL_TO_RENEW", subtype: grace == nil ? nil : "GRACE_PERIOD", uuid: "n", at: 1, transaction: bought,
                renewal: a.renewal(original: "3000", renews: true, retrying: true, grace: grace)
            )
            check = { record in
                let state = record?.subscriptions.first
                #expect(state?.isInBillingRetry == true)
                #expect(state?.billingIssueDetectedDate == a.base + 20 * A.day)
                #expect(state?.gracePeriodExpirationDate == grace.map { a.base + $0 * A.day })
            }
        case "GRACE_PERIOD_EXPIRED":
            notification = try a.notification("GRACE_PERIOD_EXPIRED", uuid: "n", at: 1, transaction: bought, renewal: a.renewal(original: "3000", renews: true, retrying: true, grace: 26))
            check = { record in #expect(record?.subscriptions.first?.gracePeriodExpirationDate == a.base + 26 * A.day) }
        case "EXPIRED":
            notification = try a.notification("EXPIRED", subtype: "PRICE_INCREASE", uuid: "n", at: 1, transaction: bought, renewal: a.renewal(original: "3000", renews: false, fields: [("expirationIntent", 3)]))
            check = { record in
                #expect(record?.subscriptions.first?.autoRenewEnabled == false)
                #expect(record?.subscriptions.first?.isInBillingRetry == false)
                #expect(record?.subscriptions.first?.cancellationReason == .priceIncrease)
            }
        case "REFUND", "REVOKE":
            var fields: [(String, JSON)] = []
            if name == "REVOKE" {
                fields = [("inAppOwnershipType", "FAMILY_SHARED")]
                prior = [try a.notification("SUBSCRIBED", uuid: "s", at: 0, transaction: a.transaction("3000", original: "3000", token: token, purchased: -10, fields: fields), renewal: nil)]
            } else {
                // Auto-renew turned off first: the refund's state keeps when and why.
                prior.append(try a.notification("DID_CHANGE_RENEWAL_STATUS", subtype: "AUTO_RENEW_DISABLED", uuid: "d", at: 1, transaction: bought, renewal: a.renewal(original: "3000", renews: false)))
            }
            let refunded = a.transaction("3000", original: "3000", token: token, purchased: -10, revoked: -2, fields: fields)
            notification = try a.notification(name, uuid: "n", at: 2, transaction: refunded, renewal: a.renewal(original: "3000", renews: false))
            check = { record in
                #expect(record?.transactions.first?.revocationDate == a.base - 2 * A.day)
                #expect(record?.transactions.first?.ownershipType == (name == "REVOKE" ? .familySharing : .owner))
                if name == "REFUND" {
                    #expect(record?.subscriptions.first?.cancellationReason == .customer)
                    #expect(record?.subscriptions.first?.autoRenewDisabledDate == a.signedDate(1))
                }
            }
        case "REFUND_REVERSED":
            let refunded = a.transaction("3000", original: "3000", token: token, purchased: -10, revoked: -2)
            prior.append(try a.notification("REFUND", uuid: "r", at: 1, transaction: refunded, renewal: nil))
            afterPrior = { record in #expect(record?.transactions.first?.revocationDate == a.base - 2 * A.day) }
            notification = try a.notification("REFUND_REVERSED", uuid: "n", at: 2, transaction: bought, renewal: a.renewal(original: "3000", renews: true))
            check = { record in #expect(record?.transactions.first?.revocationDate == nil) }
        case "OFFER_REDEEMED":
            let offer = a.transaction("3001", original: "3000", token: token, purchased: -1, reason: "PURCHASE", fields: [("offerType", 3), ("offerIdentifier", "WINTER26")])
            notification = try a.notification("OFFER_REDEEMED", subtype: "UPGRADE", uuid: "n", at: 1, transaction: offer, renewal: a.renewal(original: "3000", renews: true))
            check = { record in #expect(record?.transactions.last?.offerCode == "WINTER26") }
        case "PRICE_INCREASE":
            notification = try a.notification(
                "PRICE_INCREASE", subtype: "PENDING", uuid: "n", at: 1, transaction: bought,
                renewal: a.renewal(original: "3000", renews: true, fields: [("priceIncreaseStatus", 0)])
            )
            check = { record in
                #expect(record?.subscriptions.first?.eventDate == a.signedDate(1))
                #expect(record?.subscriptions.first?.priceConsentStatus == .notified)
            }
        case "ONE_TIME_CHARGE":
            prior = []
            let lifetime = a.transaction("4000", original: "4000", token: token, purchased: -1, product: A.lifetime)
            notification = try a.notification("ONE_TIME_CHARGE", uuid: "n", at: 1, transaction: lifetime, renewal: nil)
            check = { record in
                #expect(record?.transactions.first?.type == .nonConsumablePurchase)
                #expect(record?.transactions.first?.expirationDate == nil)
            }
        case "Production":
            prior = []
            let production = a.transaction("3000", original: "3000", token: token, purchased: -10, fields: [("environment", "Production")])
            notification = try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "n", at: 1, transaction: production, renewal: a.renewal(original: "3000", renews: true))
            check = { record in #expect(record?.transactions.first?.environment == .production) }
        case "TEST", "CONSUMPTION_REQUEST":
            notification = try a.notification(name, uuid: "n", at: 1, transaction: name == "TEST" ? nil : bought, renewal: nil)
            expected = name == "TEST" ? "test" : "unhandled_type"
        default:  // Consumable
            let coins = a.transaction("5000", original: "5000", token: token, purchased: -1, fields: [("type", "Consumable")])
            notification = try a.notification("ONE_TIME_CHARGE", uuid: "n", at: 1, transaction: coins, renewal: nil)
            expected = "consumable"
        }
        for earlier in prior {
            let answer = await fixture.deliverAppStore(earlier)
            #expect(answer.status == 200, "\(answer.body)")
        }
        afterPrior(try fixture.record(token))
        let answer = await fixture.deliverAppStore(notification)
        #expect(answer.status == 200, "\(answer.body)")
        switch expected {
        case "changed": #expect(answer.body.contains(#""changed":true"#), "\(answer.body)")
        case "unchanged": #expect(answer.body.contains(#""changed":false"#), "\(answer.body)")
        default: #expect(answer.body.contains(#""ignored":"\#(expected)""#), "\(answer.body)")
        }
        check(try fixture.record(token))
        // Delivered again (Apple retries what it thinks failed): nothing changes.
        let before = try fixture.record(token)
        let again = await fixture.deliverAppStore(notification)
        #expect(again.status == 200 && !again.body.contains(#""changed":true"#), "\(again.body)")
        #expect(try fixture.record(token) == before)
        try await fixture.stop()
    }

    @Test("every order of a subscription's notifications, redelivered as Apple retries the refused ones, ends in the same state")
    func everyOrder() async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        // Bought (the only one naming the user), renewed, auto-renew off, renewal refunded, expired.
        func notifications(_ n: Int) throws -> [String] {
            let original = "\(7000 + n)"
            let token = String(format: "00000000-0000-4000-8000-%012d", n)
            let bought = a.transaction(original, original: original, token: token, purchased: -40)
            let renewed = a.transaction("\(original)-2", original: original, token: nil, purchased: -10)
            let refunded = a.transaction("\(original)-2", original: original, token: nil, purchased: -10, revoked: -3)
            return [
                try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "a\(n)", at: 0, transaction: bought, renewal: a.renewal(original: original, renews: true)),
                try a.notification("DID_RENEW", uuid: "b\(n)", at: 1, transaction: renewed, renewal: a.renewal(original: original, renews: true)),
                try a.notification("DID_CHANGE_RENEWAL_STATUS", subtype: "AUTO_RENEW_DISABLED", uuid: "c\(n)", at: 2, transaction: renewed, renewal: a.renewal(original: original, renews: false)),
                try a.notification("REFUND", uuid: "d\(n)", at: 3, transaction: refunded, renewal: a.renewal(original: original, renews: false)),
                try a.notification("EXPIRED", subtype: "VOLUNTARY", uuid: "e\(n)", at: 4, transaction: refunded, renewal: a.renewal(original: original, renews: false)),
            ]
        }
        var states: [String: [Int]] = [:]
        var n = 0
        for order in permutations(Array(0..<5)) {
            n += 1
            let all = try notifications(n)
            var pending = order.map { all[$0] }
            var rounds = 0
            while !pending.isEmpty, rounds < 6 {
                rounds += 1
                var refused: [String] = []
                for notification in pending {
                    let answer = await fixture.deliverAppStore(notification)
                    if answer.status == 503 {
                        #expect(answer.body.contains("unknown_identity"), "\(answer.body)")
                        refused.append(notification)
                    } else {
                        #expect(answer.status == 200, "\(answer.body)")
                    }
                }
                pending = refused
            }
            #expect(pending.isEmpty, "order \(order): still refused after \(rounds) rounds")
            guard let record = try fixture.record(String(format: "00000000-0000-4000-8000-%012d", n)) else {
                Issue.record("order \(order): no customer")
                continue
            }
            // The same in every order but for the chain's ids, which differ per customer.
            let original = "\(7000 + n)"
            let transactions = record.transactions.map { transaction in
                var transaction = transaction
                transaction.originalTransactionId = "ORIGINAL"
                transaction.transactionId = transaction.transactionId.map { $0 == original ? "ORIGINAL" : "RENEWAL" }
                return transaction
            }
            let subscriptions = record.subscriptions.map { state in
                var state = state
                state.originalTransactionId = "ORIGINAL"
                return state
            }
            let final = "\(transactions) \(subscriptions)"
            states[final, default: []].append(n)
        }
        #expect(states.count == 1, "\(states.keys.joined(separator: "\n"))")
        let record = try fixture.record("00000000-0000-4000-8000-000000000001")
        #expect(record?.transactions.map(\.revocationDate) == [nil, a.base - 3 * A.day])
        #expect(record?.subscriptions.first?.autoRenewEnabled == false)
        #expect(record?.subscriptions.first?.autoRenewDisabledDate == a.signedDate(2))
        #expect(record?.subscriptions.first?.cancellationReason == .customer)
        #expect(record?.subscriptions.first?.eventDate == a.signedDate(4))
        try await fixture.stop()
    }

    @Test("Apple's record completes a transaction the app's backend wrote with another period, its refund included; a different record of Apple's then changes nothing but the refund")
    func refundOfChangedTransaction() async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let token = "0c1d2e3f-0000-4000-8000-0000000000cc"
        // Recorded by the app's backend with a guessed period, five days longer.
        _ = try await fixture.write(.recordTransaction(RecordTransactionRequest(userId: token, transaction: Transaction(
            originalTransactionId: "9300", transactionId: "9300", store: .appstore, productId: A.monthly, transactionDate: a.base - 10 * A.day,
            expirationDate: a.base + 25 * A.day, environment: .sandbox, ownershipType: .owner, type: .subscriptionStarted
        ))))
        let refunded = a.transaction("9300", original: "9300", token: token, purchased: -10, revoked: -1)
        let answer = await fixture.deliverAppStore(try a.notification("REFUND", uuid: "r", at: 1, transaction: refunded, renewal: nil))
        #expect(answer.status == 200 && answer.body.contains(#""changed":true"#), "\(answer.body)")
        let stored = try fixture.record(token)?.transactions.first
        #expect(stored?.revocationDate == a.base - A.day)
        #expect(stored?.expirationDate == a.base + 20 * A.day && stored?.verified == true && stored?.priceMicros == 9_990_000, "Apple's period and price")
        let renewed = await fixture.deliverAppStore(try a.notification("DID_RENEW", uuid: "n", at: 2, transaction: a.transaction("9300", original: "9300", token: token, purchased: -10), renewal: nil))
        #expect(renewed.body.contains(#""changed":false"#), "the payment again keeps the refund: \(renewed.body)")
        let other = a.transaction("9300", original: "9300", token: token, purchased: -9)
        let changed = await fixture.deliverAppStore(try a.notification("DID_RENEW", uuid: "o", at: 3, transaction: other, renewal: nil))
        #expect(changed.body.contains(#""ignored":"transaction_changed""#), "\(changed.body)")
        #expect(try fixture.record(token)?.transactions.first?.revocationDate == a.base - A.day)
        #expect(try fixture.record(token)?.transactions.first?.expirationDate == a.base + 20 * A.day)
        try await fixture.stop()
    }

    @Test("appAccountToken names the customer (also one stored with the upper-case UUID); a token nobody knows on a known chain creates no customer")
    func accountToken() async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let upper = "AB0F2C4E-0000-4000-8000-0000000000DD"
        _ = try await fixture.write(.grantEntitlement(GrantEntitlementRequest(userId: upper, grant: Grant(grantId: "g", entitlementId: "beta", grantedDate: a.base))))
        let first = a.transaction("9400", original: "9400", token: upper.lowercased(), purchased: -1)
        #expect(await fixture.deliverAppStore(try a.notification("SUBSCRIBED", uuid: "s", at: 1, transaction: first, renewal: nil)).status == 200)
        #expect(try fixture.record(upper)?.transactions.map(\.transactionId) == ["9400"])
        #expect(try fixture.record(upper.lowercased()) == nil, "no second customer under the lower-case token")
        // The backend linked the chain to frank; the app set a token nobody linked.
        _ = try await fixture.write(.linkAlias(LinkAliasRequest(userId: "frank", alias: "appstore:9500")))
        let stranger = a.transaction("9500", original: "9500", token: "00000000-0000-4000-8000-0000000000ee", purchased: -1)
        #expect(await fixture.deliverAppStore(try a.notification("SUBSCRIBED", uuid: "t", at: 1, transaction: stranger, renewal: nil)).status == 200)
        #expect(try fixture.record("frank")?.transactions.map(\.transactionId) == ["9500"])
        #expect(try fixture.record("00000000-0000-4000-8000-0000000000ee") == nil)
        try await fixture.stop()
    }

    @Test("an appAccountToken that is not an id (not NFC) is refused, 400 invalid_id, and nothing is written")
    func accountTokenNotNFC() async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let token = "zoe\u{308}-not-a-uuid"
        let transaction = a.transaction("9600", original: "9600", token: token, purchased: -1)
        let answer = await fixture.deliverAppStore(try a.notification("SUBSCRIBED", uuid: "n", at: 1, transaction: transaction, renewal: nil))
        #expect(answer.status == 400 && answer.body.contains(#""reason":"invalid_id""#) && answer.body.contains("appAccountToken"), "\(answer.body)")
        #expect(try fixture.record("appstore:9600") == nil)
        try await fixture.stop()
    }

    @Test("without appAccountToken the subscription is found by its original transaction id once an event or LinkAlias linked it; until then 503")
    func identity() async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let renewed = try a.notification("DID_RENEW", uuid: "r", at: 1, transaction: a.transaction("8001", original: "8000", token: nil, purchased: -1), renewal: a.renewal(original: "8000", renews: true))
        let refused = await fixture.deliverAppStore(renewed)
        #expect(refused.status == 503)
        #expect(refused.body.contains("unknown_identity") && refused.body.contains("appstore:8000"), "\(refused.body)")
        _ = try await fixture.write(.linkAlias(LinkAliasRequest(userId: "erin", alias: "appstore:8000")))
        let applied = await fixture.deliverAppStore(renewed)
        #expect(applied.status == 200, "\(applied.body)")
        #expect(try fixture.record("erin")?.transactions.map(\.transactionId) == ["8001"])
        try await fixture.stop()
    }

    @Test("over HTTP: POST /webhooks/appstore beside /webhooks/stripe, answered once durable")
    func overHTTP() async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let token = "0c1d2e3f-0000-4000-8000-0000000000aa"
        let signed = try a.notification("SUBSCRIBED", uuid: "h", at: 1, transaction: a.transaction("9100", original: "9100", token: token, purchased: -1), renewal: a.renewal(original: "9100", renews: true))
        func post(_ path: String, _ body: String) async -> String {
            await exchange(port: fixture.port, "POST \(path) HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\nConnection: close\r\n\r\n\(body)")
        }
        let accepted = await post("/webhooks/appstore", #"{"signedPayload":"\#(signed)"}"#)
        #expect(accepted.hasPrefix("HTTP/1.1 200"), "\(accepted)")
        #expect(accepted.contains(#""customerId":"\#(token)""#), "\(accepted)")
        let truncated = await post("/webhooks/appstore", #"{"signedPayload":"\#(signed.dropLast(10))"}"#)
        #expect(truncated.hasPrefix("HTTP/1.1 400") && truncated.contains("bad_signature"), "\(truncated)")
        #expect(await post("/webhooks/stripe", "{}").hasPrefix("HTTP/1.1 400"), "Stripe's route is served beside it")
        #expect(try fixture.record(token)?.transactions.map(\.transactionId) == ["9100"])
        try await fixture.stop()
    }

    @Test("over TLS with --tls-client-ca set: the webhook listener asks the stores for no client certificate, and speaks HTTP/1.1")
    func overTLS() async throws {
        let a = self.apple
        let c = a.certificates
        let tls = try ServerTLS(files: .init(certificate: c.path("leaf.pem"), privateKey: c.path("leaf.key"), clientCA: c.path("root.pem")))
        #expect(tls.requiresClientCertificates)
        let fixture = try await WebhookFixture(now: a.base, appStore: try a.settings, security: ListenerSecurity(policy: .open("webhooks"), tls: tls))
        let token = "0c1d2e3f-0000-4000-8000-0000000000bb"
        let signed = try a.notification("SUBSCRIBED", uuid: "tls", at: 1, transaction: a.transaction("9200", original: "9200", token: token, purchased: -1), renewal: nil)
        let body = #"{"signedPayload":"\#(signed)"}"#
        let request = "POST /webhooks/appstore HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: \(body.utf8.count)\r\nConnection: close\r\n\r\n\(body)"
        // openssl s_client: no client certificate, ALPN http/1.1 as the stores' clients offer.
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        process.arguments = ["s_client", "-connect", "127.0.0.1:\(fixture.port)", "-quiet", "-alpn", "h2,http/1.1"]
        let input = Pipe()
        let output = Pipe()
        process.standardInput = input
        process.standardOutput = output
        process.standardError = FileHandle.nullDevice
        try process.run()
        input.fileHandleForWriting.write(Data(request.utf8))
        let answer = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        try input.fileHandleForWriting.close()
        process.waitUntilExit()
        #expect(answer.hasPrefix("HTTP/1.1 200"), "\(answer)")
        #expect(try fixture.record(token)?.transactions.map(\.transactionId) == ["9200"])
        try await fixture.stop()
    }

    @Test("refused with a reason and nothing written", arguments: [
        "another app", "another app's transaction", "not JSON", "no signedPayload", "a bad signature", "a chain to another root",
        "a transaction signed by another root", "a product not in the catalog", "no transaction",
    ])
    func refused(_ name: String) async throws {
        let fixture = try await self.fixture()
        let a = self.apple
        let token = "0c1d2e3f-0000-4000-8000-0000000000ff"
        let bought = a.transaction("9000", original: "9000", token: token, purchased: -1)
        let renewal = a.renewal(original: "9000", renews: true)
        let good = try a.notification("SUBSCRIBED", uuid: "n", at: 1, transaction: bought, renewal: renewal)
        var body: String? = nil
        var signed = good
        let status: Int
        let reason: String
        switch name {
        case "another app":
            (signed, status, reason) = (try a.notification("SUBSCRIBED", uuid: "n", at: 1, transaction: bought, renewal: renewal, bundleId: "com.other.app"), 400, "other_app")
        case "another app's transaction":
            let other = a.transaction("9000", original: "9000", token: token, purchased: -1, fields: [("bundleId", "com.other.app")])
            (signed, status, reason) = (try a.notification("SUBSCRIBED", uuid: "n", at: 1, transaction: other, renewal: renewal), 400, "other_app")
        case "not JSON":
            (body, status, reason) = ("{\"signedPayload\": ", 400, "malformed_json")
        case "no signedPayload":
            (body, status, reason) = (#"{"payload": "x"}"#, 400, "missing_field")
        case "a bad signature":
            var parts = good.split(separator: ".").map(String.init)
            parts[2] = String(parts[2].reversed())
            (signed, status, reason) = (parts.joined(separator: "."), 400, "bad_signature")
        case "a chain to another root":
            let payload = String(decoding: AppStoreJWSVerifier.base64URL(good.split(separator: ".")[1])!, as: UTF8.self)
            (signed, status, reason) = (try a.certificates.jws(payload, signer: "other-leaf", chain: ["other-leaf", "other-wwdr", "other-root"]), 400, "bad_chain")
        case "a transaction signed by another root":
            let payload = String(decoding: AppStoreJWSVerifier.base64URL(good.split(separator: ".")[1])!, as: UTF8.self)
            let forged = try a.certificates.jws(bought.text, signer: "other-leaf", chain: ["other-leaf", "other-wwdr", "other-root"])
            let original = payload.range(of: #""signedTransactionInfo":"[^"]*""#, options: .regularExpression)!
            (signed, status, reason) = (try a.certificates.jws(payload.replacingCharacters(in: original, with: #""signedTransactionInfo":"\#(forged)""#)), 400, "bad_chain")
        case "a product not in the catalog":
            let unknown = a.transaction("9000", original: "9000", token: token, purchased: -1, product: "com.example.unknown")
            (signed, status, reason) = (try a.notification("SUBSCRIBED", uuid: "n", at: 1, transaction: unknown, renewal: renewal), 503, "unknown_product")
        default:  // no transaction
            (signed, status, reason) = (try a.notification("DID_RENEW", uuid: "n", at: 1, transaction: nil, renewal: renewal), 400, "missing_field")
        }
        let bytes = Array((body ?? #"{"signedPayload":"\#(signed)"}"#).utf8)
        let answer = await fixture.ingestion.appStore(body: bytes, methods: fixture.methods, on: fixture.loop)
        #expect(answer.status == status, "\(answer.body)")
        #expect(answer.body.contains(#""reason":"\#(reason)""#), "\(answer.body)")
        #expect(try fixture.record(token) == nil)
        try await fixture.stop()
    }
}
