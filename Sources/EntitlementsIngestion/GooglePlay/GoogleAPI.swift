import AsyncHTTPClient
import EntitlementsFormats
import EntitlementsStore
import Foundation
import JWTKit
import Logging
import NIOCore
import NIOHTTP1
import Synchronization

/// A Google service account's key file (`--googleplay-service-account`), exactly as the
/// Cloud console issues it. The private key is never logged, nor is a token made with it.
public struct GoogleServiceAccount: Sendable {
    public var clientEmail: String
    public var privateKeyId: String
    public var tokenURI: String
    let privateKey: Insecure.RSA.PrivateKey

    /// Reads and checks the key file: a JSON object with `client_email`, `private_key` (an
    /// RSA key in PEM), `private_key_id` and `token_uri`.
    public static func load(path: String) throws -> GoogleServiceAccount {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw GooglePlaySettingsError("--googleplay-service-account \(path): cannot read the file")
        }
        let json: EventJSON
        do {
            json = try EventJSON(parsing: Array(data))
        } catch {
            throw GooglePlaySettingsError("--googleplay-service-account \(path): not a JSON object (download the key as JSON from the Cloud console: IAM, Service accounts, Keys)")
        }
        guard let email = json["client_email"].string, let pem = json["private_key"].string, let keyId = json["private_key_id"].string,
            let tokenURI = json["token_uri"].string
        else {
            throw GooglePlaySettingsError("--googleplay-service-account \(path): client_email, private_key, private_key_id and token_uri are required (a service account key file as Google issues it)")
        }
        guard tokenURI.hasPrefix("https://") || tokenURI.hasPrefix("http://127.0.0.1") || tokenURI.hasPrefix("http://localhost") else {
            throw GooglePlaySettingsError("--googleplay-service-account \(path): token_uri must be https:// (got \(tokenURI))")
        }
        let key: Insecure.RSA.PrivateKey
        do {
            key = try Insecure.RSA.PrivateKey(pem: pem)
        } catch {
            throw GooglePlaySettingsError("--googleplay-service-account \(path): private_key is not an RSA private key in PEM")
        }
        return GoogleServiceAccount(clientEmail: email, privateKeyId: keyId, tokenURI: tokenURI, privateKey: key)
    }
}

/// A setting of Google Play that cannot be used, with what to do about it.
public struct GooglePlaySettingsError: Error, CustomStringConvertible {
    public var description: String
    init(_ description: String) { self.description = description }
}

/// OAuth access tokens for the service account (Google's "OAuth 2.0 for server to server
/// applications"): an RS256 JWT assertion signed with the account's key, exchanged at its
/// `token_uri`; kept until a minute before it expires, one exchange at a time.
final class GoogleAccessTokens: Sendable {
    static let scopes = ["https://www.googleapis.com/auth/androidpublisher", "https://www.googleapis.com/auth/pubsub"]

    private let account: GoogleServiceAccount
    private let http: StoreHTTP
    private let keys: JWTKeyCollection
    private let cached = Mutex<(token: String, expires: Int64)?>(nil)
    private let exchange = AsyncSerializer()

    init(account: GoogleServiceAccount, http: StoreHTTP) async {
        self.account = account
        self.http = http
        self.keys = JWTKeyCollection()
        await self.keys.add(rsa: account.privateKey, digestAlgorithm: .sha256, kid: JWKIdentifier(string: account.privateKeyId))
    }

    struct Assertion: JWTPayload {
        var iss: String
        var scope: String
        var aud: String
        var iat: Int64
        var exp: Int64
        func verify(using algorithm: some JWTAlgorithm) throws {}
    }

    /// Forgets `token` if it is the one kept: Google refused it (revoked, or the key
    /// rotated), so the next call exchanges a new one.
    func invalidate(_ token: String) {
        self.cached.withLock { cached in
            if cached?.token == token {
                cached = nil
            }
        }
    }

    /// A valid access token.
    func token() async throws(IngestionRetry) -> String {
        let now = WallClock.unixMilliseconds()
        if let cached = self.cached.withLock({ $0 }), cached.expires - 60_000 > now {
            return cached.token
        }
        await self.exchange.acquire()
        defer { self.exchange.release() }
        if let cached = self.cached.withLock({ $0 }), cached.expires - 60_000 > WallClock.unixMilliseconds() {
            return cached.token  // exchanged while this call waited
        }
        let issued = WallClock.unixMilliseconds() / 1000
        let assertion: String
        do {
            assertion = try await self.keys.sign(
                Assertion(iss: self.account.clientEmail, scope: Self.scopes.joined(separator: " "), aud: self.account.tokenURI, iat: issued, exp: issued + 3600),
                kid: JWKIdentifier(string: self.account.privateKeyId)
            )
        } catch {
            throw IngestionRetry(.storeDenied, "signing the service account's assertion failed: \(error)")
        }
        let form = "grant_type=" + PlayDeveloperAPI.path("urn:ietf:params:oauth:grant-type:jwt-bearer") + "&assertion=" + PlayDeveloperAPI.path(assertion)
        let answer = try await self.http.send(
            .POST, self.account.tokenURI, headers: [("content-type", "application/x-www-form-urlencoded")], body: Array(form.utf8),
            what: "the service account's token exchange at \(self.account.tokenURI)"
        )
        guard answer.status == 200, let json = answer.json, let token = json["access_token"].string, let lifetime = PlayNotifications.int64(json["expires_in"]) else {
            throw IngestionRetry(
                .storeDenied,
                "the token exchange for \(self.account.clientEmail) at \(self.account.tokenURI) was refused: \(answer.message) (HTTP \(answer.status)); check the key file and that the account is not disabled"
            )
        }
        // A day at most: Google's tokens last an hour, and a larger number cannot overflow.
        self.cached.withLock { $0 = (token, WallClock.unixMilliseconds() + min(max(lifetime, 0), 86_400) * 1000) }
        return token
    }
}

/// The Play Developer API calls of docs/ingestion.md: a subscription, a one-time product,
/// and their acknowledgement.
struct PlayDeveloperAPI: Sendable {
    let baseURL: String
    let http: StoreHTTP
    let tokens: GoogleAccessTokens

    /// `purchases.subscriptionsv2.get`.
    func subscription(package: String, token: String) async throws -> EventJSON {
        let url = "\(self.baseURL)/androidpublisher/v3/applications/\(Self.path(package))/purchases/subscriptionsv2/tokens/\(Self.path(token))"
        return try await self.get(url, what: "purchases.subscriptionsv2.get \(PlayNotifications.short(token))")
    }

    /// `purchases.products.get`.
    func product(package: String, productId: String, token: String) async throws -> EventJSON {
        let url = "\(self.baseURL)/androidpublisher/v3/applications/\(Self.path(package))/purchases/products/\(Self.path(productId))/tokens/\(Self.path(token))"
        return try await self.get(url, what: "purchases.products.get \(productId) \(PlayNotifications.short(token))")
    }

    /// `purchases.voidedpurchases.list`: the voided purchase of `orderId` among those voided
    /// since `since` (Unix milliseconds; subscriptions included), or nil when Google lists
    /// none. Follows up to 10 pages.
    func voided(package: String, orderId: String, since: Int64) async throws -> EventJSON? {
        var pageToken: String?
        for _ in 0..<10 {
            var url = "\(self.baseURL)/androidpublisher/v3/applications/\(Self.path(package))/purchases/voidedpurchases?type=1&maxResults=1000&startTime=\(since)"
            if let pageToken {
                url += "&token=" + Self.path(pageToken)
            }
            let page = try await self.get(url, what: "purchases.voidedpurchases.list \(orderId)")
            if let found = page["voidedPurchases"].array.first(where: { $0["orderId"].string == orderId }) {
                return found
            }
            guard let next = page["tokenPagination"]["nextPageToken"].string, !next.isEmpty else {
                return nil
            }
            pageToken = next
        }
        return nil
    }

    /// `purchases.subscriptions.acknowledge` or `purchases.products.acknowledge`.
    func acknowledge(_ acknowledgement: PlayAcknowledgement, package: String) async throws(IngestionRetry) {
        let kind = acknowledgement.kind == .subscription ? "subscriptions" : "products"
        let url = "\(self.baseURL)/androidpublisher/v3/applications/\(Self.path(package))/purchases/\(kind)/\(Self.path(acknowledgement.productId))/tokens/\(Self.path(acknowledgement.token)):acknowledge"
        let what = "purchases.\(kind).acknowledge \(acknowledgement.productId) \(PlayNotifications.short(acknowledgement.token))"
        let answer: StoreHTTP.Answer
        do {
            let access = try await self.tokens.token()
            answer = try await self.http.send(.POST, url, headers: [("authorization", "Bearer \(access)"), ("content-type", "application/json")], body: Array("{}".utf8), what: what)
            if answer.status == 401 {
                self.tokens.invalidate(access)
            }
        } catch {
            // Every failure is the acknowledgement's (the reason operators alert on).
            throw IngestionRetry(.acknowledgeFailed, "\(error.message); the writes are durable, the redelivery acknowledges it")
        }
        guard (200..<300).contains(answer.status) else {
            throw IngestionRetry(.acknowledgeFailed, "\(what): HTTP \(answer.status) (\(answer.message)); the writes are durable, the redelivery acknowledges it")
        }
    }

    private func get(_ url: String, what: String) async throws -> EventJSON {
        let access = try await self.tokens.token()
        let answer = try await self.http.send(.GET, url, headers: [("authorization", "Bearer \(access)")], what: what)
        if answer.status == 401 {
            self.tokens.invalidate(access)
        }
        switch answer.status {
        case 200:
            guard let json = answer.json else {
                throw IngestionRetry(.storeUnavailable, "\(what): the answer is not a JSON object")
            }
            return json
        case 401, 403:
            throw IngestionRetry(
                .storeDenied,
                "\(what): HTTP \(answer.status) (\(answer.message)): give the service account access to the app in the Play Console (Users and permissions: view financial data, manage orders and subscriptions)"
            )
        case 404, 410, 400:
            throw IngestionRejection(.unknownToken, "\(what): Google does not know this purchase (HTTP \(answer.status): \(answer.message))")
        default:
            throw IngestionRetry(.storeUnavailable, "\(what): HTTP \(answer.status) (\(answer.message))")
        }
    }

    /// A path segment or a form value, percent-encoded (all but RFC 3986's unreserved).
    static func path(_ segment: String) -> String {
        var allowed = CharacterSet.alphanumerics
        allowed.insert(charactersIn: "-._~")
        return segment.addingPercentEncoding(withAllowedCharacters: allowed) ?? segment
    }
}

/// Pub/Sub's REST pull and acknowledge, for `--googleplay-pubsub-subscription`.
struct PubSubClient: Sendable {
    struct Message: Sendable {
        var ackId: String
        var messageId: String
        var data: String
    }

    let baseURL: String
    let subscription: String
    let http: StoreHTTP
    let tokens: GoogleAccessTokens

    /// `projects.subscriptions.pull`: up to `maximum` messages; none when there are none.
    func pull(maximum: Int) async throws -> [Message] {
        let access = try await self.tokens.token()
        let what = "Pub/Sub pull from \(self.subscription)"
        let answer = try await self.http.send(
            .POST, "\(self.baseURL)/v1/\(self.subscription):pull", headers: [("authorization", "Bearer \(access)"), ("content-type", "application/json")],
            body: Array(#"{"maxMessages":\#(maximum)}"#.utf8), what: what
        )
        if answer.status == 401 {
            self.tokens.invalidate(access)
        }
        guard answer.status == 200, let json = answer.json else {
            throw IngestionRetry(answer.status == 401 || answer.status == 403 ? .storeDenied : .storeUnavailable, "\(what): HTTP \(answer.status) (\(answer.message))")
        }
        return json["receivedMessages"].array.compactMap { received in
            guard let ackId = received["ackId"].string else { return nil }
            return Message(ackId: ackId, messageId: received["message"]["messageId"].string ?? "", data: received["message"]["data"].string ?? "")
        }
    }

    /// `projects.subscriptions.acknowledge`.
    func acknowledge(_ ackIds: [String]) async throws {
        guard !ackIds.isEmpty else { return }
        let access = try await self.tokens.token()
        let body = JSONValue.object([("ackIds", .array(ackIds.map { .string($0) }))]).serialized(pretty: false)
        let what = "Pub/Sub acknowledge on \(self.subscription)"
        let answer = try await self.http.send(
            .POST, "\(self.baseURL)/v1/\(self.subscription):acknowledge", headers: [("authorization", "Bearer \(access)"), ("content-type", "application/json")],
            body: Array(body.utf8), what: what
        )
        if answer.status == 401 {
            self.tokens.invalidate(access)
        }
        guard answer.status == 200 else {
            throw IngestionRetry(.storeUnavailable, "\(what): HTTP \(answer.status) (\(answer.message))")
        }
    }
}
