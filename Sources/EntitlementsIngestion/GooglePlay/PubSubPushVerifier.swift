import EntitlementsStore
import Foundation
import JWTKit
import Synchronization

/// Pub/Sub push authentication, as Google documents it: each push carries
/// `Authorization: Bearer JWT`, an OIDC token Google signs (RS256) for the push
/// subscription's service account. It must verify against Google's JWKS, be issued by
/// Google, be for our audience and our service account (with `email_verified`), and not
/// have expired.
final class PubSubPushVerifier: Sendable {
    static let issuers: Set<String> = ["https://accounts.google.com", "accounts.google.com"]
    /// Unknown `kid`s refetch the JWKS at most this often (milliseconds): a stream of forged
    /// tokens does not become a stream of calls to Google.
    static let refetchInterval: Int64 = 5_000

    let jwksURL: String
    let audience: String
    let serviceAccount: String
    private let http: StoreHTTP
    private let clock: @Sendable () -> Int64
    private let cache = Mutex<(keys: JWTKeyCollection, kids: Set<String>, expires: Int64, fetched: Int64)?>(nil)
    private let fetching = AsyncSerializer()

    /// `clock` is the current time in Unix milliseconds.
    init(jwksURL: String, audience: String, serviceAccount: String, http: StoreHTTP, clock: @escaping @Sendable () -> Int64) {
        self.jwksURL = jwksURL
        self.audience = audience
        self.serviceAccount = serviceAccount
        self.http = http
        self.clock = clock
    }

    /// The claims read; checked by ``verify(authorization:)`` itself, for messages that say
    /// which one failed.
    struct Claims: JWTPayload {
        var json: EventJSON
        init(from decoder: any Decoder) throws { self.json = try EventJSON(from: decoder) }
        func encode(to encoder: any Encoder) throws {
            throw EncodingError.invalidValue(self, .init(codingPath: [], debugDescription: "claims are only read"))
        }
        func verify(using algorithm: some JWTAlgorithm) throws {}
    }

    /// Checks the `Authorization` header; throws a rejection (`unauthenticated`: 401,
    /// `forbidden`: 403) or, when Google's keys cannot be fetched, a retry.
    func verify(authorization: String?) async throws {
        guard let authorization, authorization.lowercased().hasPrefix("bearer ") else {
            throw IngestionRejection(.unauthenticated, "no Authorization: Bearer token: turn on authentication in the push subscription (Pub/Sub, Edit subscription, Enable authentication)")
        }
        let token = String(authorization.dropFirst("bearer ".count)).trimmingCharacters(in: .whitespaces)
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerBytes = Self.base64URL(parts[0]), let header = try? EventJSON(parsing: headerBytes) else {
            throw IngestionRejection(.unauthenticated, "the bearer token is not a JWT")
        }
        guard header["alg"].string == "RS256" else {
            throw IngestionRejection(.unauthenticated, "the bearer token's alg is \(header["alg"].string ?? "missing"), not RS256")
        }
        guard let kid = header["kid"].string else {
            throw IngestionRejection(.unauthenticated, "the bearer token has no kid")
        }
        let keys = try await self.keys(for: kid)
        let claims: EventJSON
        do {
            claims = try await keys.verify(token, as: Claims.self).json
        } catch {
            throw IngestionRejection(.unauthenticated, "the bearer token's signature does not verify with Google's key \(kid)")
        }
        let now = self.clock()
        guard let exp = PlayNotifications.int64(claims["exp"]), exp * 1000 > now else {
            throw IngestionRejection(.unauthenticated, "the bearer token has expired")
        }
        guard let issuer = claims["iss"].string, Self.issuers.contains(issuer) else {
            throw IngestionRejection(.unauthenticated, "the bearer token's iss is \(claims["iss"].string ?? "missing"), not Google's")
        }
        let audiences = claims["aud"].string.map { [$0] } ?? claims["aud"].array.compactMap(\.string)
        guard audiences.contains(self.audience) else {
            throw IngestionRejection(.forbidden, "the bearer token's aud is not --googleplay-push-audience (\(self.audience)): set the push subscription's audience to it")
        }
        guard claims["email"].string == self.serviceAccount else {
            throw IngestionRejection(.forbidden, "the bearer token is for \(claims["email"].string ?? "no email"), not --googleplay-push-service-account (\(self.serviceAccount))")
        }
        guard claims["email_verified"].bool == true || claims["email_verified"].string == "true" else {
            throw IngestionRejection(.forbidden, "the bearer token's email is not verified")
        }
    }

    /// Google's keys, holding `kid`: the cached set while its `Cache-Control: max-age`
    /// lasts and it has the key, else fetched again.
    private func keys(for kid: String) async throws -> JWTKeyCollection {
        let now = self.clock()
        if let cached = self.cache.withLock({ $0 }), cached.expires > now, cached.kids.contains(kid) || now - cached.fetched < Self.refetchInterval {
            return cached.keys
        }
        await self.fetching.acquire()
        defer { self.fetching.release() }
        if let cached = self.cache.withLock({ $0 }), cached.expires > self.clock(), cached.kids.contains(kid) || self.clock() - cached.fetched < Self.refetchInterval {
            return cached.keys  // fetched while this call waited
        }
        do {
            return try await self.fetch()
        } catch {
            // Google's keys could not be fetched again: the ones held still verify the
            // tokens they signed (Google rotates keys over weeks).
            if let held = self.cache.withLock({ $0 }) {
                self.cache.withLock { $0?.fetched = self.clock() }  // refetch no sooner than refetchInterval
                return held.keys
            }
            throw error
        }
    }

    private func fetch() async throws -> JWTKeyCollection {
        let answer = try await self.http.send(.GET, self.jwksURL, what: "Google's keys at \(self.jwksURL)")
        guard answer.status == 200, let json = answer.json else {
            throw IngestionRetry(.storeUnavailable, "Google's keys at \(self.jwksURL): HTTP \(answer.status) (\(answer.message))")
        }
        let keys = JWTKeyCollection()
        do {
            _ = try await keys.add(jwksJSON: String(decoding: answer.body, as: UTF8.self))
        } catch {
            throw IngestionRetry(.storeUnavailable, "Google's keys at \(self.jwksURL) are not a JWKS: \(error)")
        }
        let kids = Set(json["keys"].array.compactMap { $0["kid"].string })
        let fetched = self.clock()
        // Kept for max-age (300 s without one), a day at most: Google says hours.
        let maxAge = min(max(answer.maxAge ?? 300, 0), 86_400)
        self.cache.withLock { $0 = (keys, kids, fetched + maxAge * 1000, fetched) }
        return keys
    }

    private static func base64URL(_ part: Substring) -> [UInt8]? {
        var text = part.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        text += String(repeating: "=", count: (4 - text.count % 4) % 4)
        return Data(base64Encoded: text).map(Array.init)
    }
}
