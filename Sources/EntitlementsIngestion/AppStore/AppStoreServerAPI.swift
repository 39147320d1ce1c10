import EntitlementsFormats
import EntitlementsMessages
import EntitlementsStore
import Foundation
import JWTKit
import NIOHTTP1

/// The App Store Server API's settings (`--appstore-api-key`, `--appstore-key-id`,
/// `--appstore-issuer-id`, the URLs): the in-app purchase key App Store Connect issues (a
/// `.p8` file, an EC P-256 key in PEM). The key is never logged, nor is a token made with it.
public struct AppStoreAPISettings: Sendable {
    public var keyId: String
    public var issuerId: String
    let privateKey: ES256PrivateKey
    /// `https://api.storekit.itunes.apple.com` and `https://api.storekit-sandbox.itunes.apple.com`
    /// unless tests point them at a fake.
    public var productionURL: String
    public var sandboxURL: String

    public init(keyPath: String, keyId: String, issuerId: String, productionURL: String? = nil, sandboxURL: String? = nil) throws {
        guard let data = FileManager.default.contents(atPath: keyPath) else {
            throw AppStoreRootError(message: "--appstore-api-key \(keyPath): cannot read the file")
        }
        do {
            self.privateKey = try ES256PrivateKey(pem: String(decoding: data, as: UTF8.self))
        } catch {
            throw AppStoreRootError(
                message: "--appstore-api-key \(keyPath): not an EC P-256 private key in PEM (download the in-app purchase key, SubscriptionKey_KEYID.p8, from App Store Connect: Users and Access, Integrations)"
            )
        }
        guard !keyId.isEmpty, !issuerId.isEmpty else {
            throw AppStoreRootError(message: "--appstore-api-key needs --appstore-key-id (the key's id) and --appstore-issuer-id (your team's issuer id, from the same page)")
        }
        self.keyId = keyId
        self.issuerId = issuerId
        self.productionURL = Self.trimmed(productionURL ?? "https://api.storekit.itunes.apple.com")
        self.sandboxURL = Self.trimmed(sandboxURL ?? "https://api.storekit-sandbox.itunes.apple.com")
    }

    private static func trimmed(_ url: String) -> String {
        url.hasSuffix("/") ? String(url.dropLast()) : url
    }
}

/// The App Store Server API calls of docs/ingestion.md ("The App Store Server API"): Get All
/// Subscription Statuses and Get Transaction History (v2), each authorized by an ES256 JWT
/// made for the call (`kid`, `iss`, `aud` appstoreconnect-v1, `bid`, five minutes of
/// life). Answers are JSON whose signed parts the caller verifies like notifications.
public final class AppStoreServerAPI: Sendable {
    let settings: AppStoreAPISettings
    /// One client and back-off per host: production and the sandbox are two services at
    /// Apple, and a sandbox that throttles or fails must not hold back production's calls.
    private let production: StoreHTTP
    private let sandbox: StoreHTTP
    private let keys: JWTKeyCollection

    public init(settings: AppStoreAPISettings) async {
        self.production = StoreHTTP(service: "Apple")
        self.sandbox = StoreHTTP(service: "Apple (sandbox)")
        self.settings = settings
        self.keys = JWTKeyCollection()
        await self.keys.add(ecdsa: settings.privateKey, kid: JWKIdentifier(string: settings.keyId))
    }

    struct Claims: JWTPayload {
        var iss: String
        var iat: Int64
        var exp: Int64
        var aud: String
        var bid: String
        func verify(using algorithm: some JWTAlgorithm) throws {}
    }

    /// The client of `environment`'s host, with its back-off.
    func http(_ environment: Environment) -> StoreHTTP {
        environment == .sandbox ? self.sandbox : self.production
    }

    /// The bearer token for one call about `bundleId`'s purchases.
    private func token(bundleId: String) async throws(IngestionRetry) -> String {
        let issued = WallClock.unixMilliseconds() / 1000
        do {
            return try await self.keys.sign(
                Claims(iss: self.settings.issuerId, iat: issued, exp: issued + 300, aud: "appstoreconnect-v1", bid: bundleId),
                kid: JWKIdentifier(string: self.settings.keyId),
                header: ["typ": "JWT"]
            )
        } catch {
            throw IngestionRetry(.storeDenied, "signing the App Store Server API token failed: \(error)")
        }
    }

    /// Get All Subscription Statuses: every auto-renewable subscription of the customer who
    /// made `transactionId`, with its latest transaction and renewal info.
    func statuses(transactionId: String, bundleId: String, environment: Environment) async throws -> EventJSON {
        try await self.get("/inApps/v1/subscriptions/\(PlayDeveloperAPI.path(transactionId))", bundleId: bundleId, environment: environment, what: "Get All Subscription Statuses for \(transactionId)")
    }

    /// One page of Get Transaction History (v2), oldest first; `revision` is the previous
    /// page's (nil for the first).
    func history(transactionId: String, bundleId: String, environment: Environment, revision: String?) async throws -> EventJSON {
        var path = "/inApps/v2/history/\(PlayDeveloperAPI.path(transactionId))?sort=ASCENDING"
        if let revision {
            path += "&revision=" + PlayDeveloperAPI.path(revision)
        }
        return try await self.get(path, bundleId: bundleId, environment: environment, what: "Get Transaction History for \(transactionId)")
    }

    private func get(_ path: String, bundleId: String, environment: Environment, what: String) async throws -> EventJSON {
        let base = environment == .sandbox ? self.settings.sandboxURL : self.settings.productionURL
        let where_ = environment == .sandbox ? "sandbox" : "production"
        let token = try await self.token(bundleId: bundleId)
        let answer = try await self.http(environment).send(.GET, base + path, headers: [("authorization", "Bearer \(token)")], what: "\(what) (\(where_))")
        switch answer.status {
        case 200:
            guard let json = answer.json else {
                throw IngestionRetry(.storeUnavailable, "\(what): Apple's answer is not a JSON object")
            }
            return json
        case 401, 403:
            throw IngestionRetry(
                .storeDenied,
                "\(what): HTTP \(answer.status) (\(answer.message)): Apple refused the token; check --appstore-key-id, --appstore-issuer-id and that the key is an active in-app purchase key"
            )
        case 404,
            400 where answer.json?["errorCode"].int64 == 4_000_006:
            // 4040010 TransactionIdNotFound, 4000006 InvalidTransactionId, 4040001 AccountNotFound ...
            throw IngestionRejection(.unknownTransaction, "\(what): Apple does not know this transaction in \(where_) for \(bundleId) (HTTP \(answer.status): \(answer.message))")
        case 400:
            // Another refusal of the request (an invalid revision, a parameter): ours to fix.
            throw IngestionRetry(.storeUnavailable, "\(what): Apple refused the request (HTTP 400: \(answer.message))")
        default:
            throw IngestionRetry(.storeUnavailable, "\(what): HTTP \(answer.status) (\(answer.message))")
        }
    }
}
