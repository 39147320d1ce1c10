import EntitlementsClient
@testable import EntitlementsIngestion
import EntitlementsMessages
import EntitlementsServer
import EntitlementsWire
import Foundation
import Testing

/// SubmitPurchase with App Store transactions (docs/ingestion.md, "A purchase the app just
/// made"), over the framed protocol with the Swift client: JWS signed by the openssl-made
/// chain, verified as notifications are. Google Play's submissions run against the loopback
/// Google in Tests/googleplay/test_googleplay.py.
@Suite("SubmitPurchase: the App Store transaction the app holds, verified, recorded, answered")
struct SubmitPurchaseTests {
    typealias A = AppStoreFixture
    let apple: AppStoreFixture

    init() throws {
        self.apple = try AppStoreFixture()
    }

    func submit(_ fixture: WebhookFixture, user: String, jws: String) async throws -> SubmitPurchaseResponse {
        let client = EntitlementsClient(server: .tcp(host: "127.0.0.1", port: fixture.server.tcpAddress!.port!))
        defer { Task { await client.close() } }
        return try await client.submitPurchase(SubmitPurchaseRequest(userId: user, purchase: .appStore(AppStorePurchase(signedTransaction: jws))))
    }

    func refusal(_ fixture: WebhookFixture, user: String, jws: String) async -> EntitlementsClientError? {
        do {
            _ = try await self.submit(fixture, user: user, jws: jws)
            return nil
        } catch let error as EntitlementsClientError {
            return error
        } catch {
            return EntitlementsClientError(code: .unknown, message: "\(error)")
        }
    }

    @Test("a submitted transaction is recorded and answered at once; again, it changes nothing; its notification then finds the user")
    func submitThenNotify() async throws {
        let fixture = try await WebhookFixture(now: self.apple.base, appStore: try self.apple.settings)
        let a = self.apple
        let transaction = a.transaction("3000", original: "3000", token: nil, purchased: -1)
        let jws = try a.certificates.jws(transaction.text)
        let first = try await self.submit(fixture, user: "carl", jws: jws)
        let premium = first.entitlements?.entitlements.first { $0.id == "premium" }
        #expect(first.changed && first.logSequence > 0 && first.linkedAlias == "appstore:3000" && first.ignored == nil)
        #expect(first.environment == .sandbox, "a sandbox transaction is answered for the sandbox, and says so")
        #expect(premium?.isActive == true && premium?.source == .appstore && first.entitlements?.customerId == "carl")
        let again = try await self.submit(fixture, user: "carl", jws: jws)
        #expect(!again.changed && again.entitlements?.entitlements == first.entitlements?.entitlements)
        // The renewal's notification carries no token: the alias the submission linked finds carl.
        let renewed = a.transaction("3000-2", original: "3000", token: nil, purchased: 29)
        let answer = await fixture.deliverAppStore(try a.notification("DID_RENEW", uuid: "n-3000", at: 1, transaction: renewed, renewal: a.renewal(original: "3000", renews: true)))
        #expect(answer.status == 200 && answer.body.contains(#""customerId":"carl""#), "\(answer.body)")
        try await fixture.stop()
    }

    @Test("notified first, then submitted: the same record; submitted for another customer than the one it names: refused, nothing written")
    func notifyThenSubmit() async throws {
        let fixture = try await WebhookFixture(now: self.apple.base, appStore: try self.apple.settings)
        let a = self.apple
        let token = "7b1e3d5f-0000-4000-8000-0000000000c1"
        let transaction = a.transaction("4000", original: "4000", token: token, purchased: -1)
        let notified = await fixture.deliverAppStore(try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "n-4000", at: 0, transaction: transaction, renewal: a.renewal(original: "4000", renews: true)))
        #expect(notified.status == 200)
        let jws = try a.certificates.jws(transaction.text)
        let submitted = try await self.submit(fixture, user: token, jws: jws)
        #expect(!submitted.changed && submitted.entitlements?.entitlements.first?.isActive == true)
        let stolen = await self.refusal(fixture, user: "mallory", jws: jws)
        #expect(stolen?.code == .permissionDenied && stolen?.message.contains("names another customer") == true, "\(String(describing: stolen))")
        #expect(stolen?.message.contains(token) == false, "another customer's id is never said")
        let other = a.transaction("4100", original: "4100", token: nil, purchased: -1)
        _ = try await self.submit(fixture, user: "erin", jws: try a.certificates.jws(other.text))
        let taken = await self.refusal(fixture, user: "mallory", jws: try a.certificates.jws(other.text))
        #expect(taken?.code == .permissionDenied && taken?.message.contains("belongs to another customer") == true, "\(String(describing: taken))")
        #expect(try fixture.record("mallory") == nil)
        try await fixture.stop()
    }

    @Test("an appAccountToken that is not the user and names nobody is refused, submitted first or notified first; linked to the user first, it is taken")
    func unlinkedToken() async throws {
        let fixture = try await WebhookFixture(now: self.apple.base, appStore: try self.apple.settings)
        let a = self.apple
        let token = "8c2f4a6b-0000-4000-8000-0000000000d1"
        let jws = try a.certificates.jws(a.transaction("6000", original: "6000", token: token, purchased: -1).text)
        let first = await self.refusal(fixture, user: "gina", jws: jws)
        #expect(first?.code == .permissionDenied && first?.message.contains("names no customer") == true, "\(String(describing: first))")
        #expect(try fixture.record("gina") == nil)
        // Notified first: the notification makes a customer under the token; gina's
        // submission is refused the same.
        let other = try a.certificates.jws(a.transaction("6100", original: "6100", token: "8c2f4a6b-0000-4000-8000-0000000000d2", purchased: -1).text)
        let transaction = a.transaction("6100", original: "6100", token: "8c2f4a6b-0000-4000-8000-0000000000d2", purchased: -1)
        _ = await fixture.deliverAppStore(try a.notification("SUBSCRIBED", subtype: "INITIAL_BUY", uuid: "n-6100", at: 0, transaction: transaction, renewal: a.renewal(original: "6100", renews: true)))
        #expect(await self.refusal(fixture, user: "gina", jws: other)?.code == .permissionDenied)
        // Linked to gina first, the token is hers.
        _ = try await fixture.write(.linkAlias(LinkAliasRequest(userId: "gina", alias: token)))
        let taken = try await self.submit(fixture, user: "gina", jws: jws)
        #expect(taken.changed && taken.entitlements?.customerId == "gina")
        try await fixture.stop()
    }

    @Test("a JWS that fails a check, another app's transaction, a product not in the catalog: refused with a status that says so")
    func refusals() async throws {
        let fixture = try await WebhookFixture(now: self.apple.base, appStore: try self.apple.settings)
        let a = self.apple
        let good = try a.certificates.jws(a.transaction("5000", original: "5000", token: nil, purchased: -1).text)
        var parts = good.split(separator: ".").map(String.init)
        parts[2] = String(parts[2].reversed())
        for (jws, code, words) in [
            ("not-a-jws", StatusCode.invalidArgument, "signed_transaction"),
            (parts.joined(separator: "."), .invalidArgument, "signature"),
            (try a.certificates.jws(a.transaction("5001", original: "5001", token: nil, purchased: -1, fields: [("bundleId", "com.other.app")]).text), .invalidArgument, "bundleId com.other.app"),
            (try a.certificates.jws(a.transaction("5002", original: "5002", token: nil, purchased: -1, product: "com.example.unknown").text), .failedPrecondition, "not in the catalog"),
        ] {
            let refusal = await self.refusal(fixture, user: "dora", jws: jws)
            #expect(refusal?.code == code && refusal?.message.contains(words) == true, "\(String(describing: refusal))")
        }
        #expect(try fixture.record("dora") == nil)
        try await fixture.stop()
    }
}
