import Crypto
import EntitlementsSecurity
import Foundation
import SwiftASN1
public import X509

/// Verifies the JWS values of App Store Server Notifications V2 (`signedPayload`,
/// `signedTransactionInfo`, `signedRenewalInfo`) as Apple documents them and as Apple's
/// App Store Server Library does: the header's `alg` must be ES256 (`none` and every other
/// algorithm refused); `x5c` carries the leaf, the intermediate and a root, of which only
/// the leaf and intermediate are used: the chain must reach the configured root
/// (`--appstore-root-cert`, Apple Root CA - G3 in production), valid at the payload's
/// `signedDate` (not at the time it is received), with Apple's OID for App Store receipt
/// signing on the leaf (1.2.840.113635.100.6.11.1) and for the WWDR intermediate
/// (1.2.840.113635.100.6.2.1); the signature over `header.payload` is the leaf key's.
public struct AppStoreJWSVerifier: Sendable {
    static let leafOID: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 11, 1]
    static let intermediateOID: ASN1ObjectIdentifier = [1, 2, 840, 113_635, 100, 6, 2, 1]

    let roots: [Certificate]

    public init(roots: [Certificate]) {
        self.roots = roots
    }

    /// The root of `--appstore-root-cert`: one certificate, PEM or DER.
    public static func loadRoot(path: String) throws -> Certificate {
        let bytes: [UInt8]
        do {
            bytes = try readWholeFile(path)
        } catch {
            throw AppStoreRootError(message: "--appstore-root-cert \(path): \(error)")
        }
        do {
            if let text = String(bytes: bytes, encoding: .utf8), text.contains("-----BEGIN CERTIFICATE-----") {
                return try Certificate(pemEncoded: text)
            }
            return try Certificate(derEncoded: bytes)
        } catch {
            throw AppStoreRootError(message: "--appstore-root-cert \(path): not a certificate in PEM or DER (\(error)); download AppleRootCA-G3.cer from https://www.apple.com/certificateauthority/")
        }
    }

    /// The payload of `jws`, once every check above passed; `what` names it in messages.
    func verify(_ jws: String, what: String) async throws(IngestionRejection) -> EventJSON {
        let parts = jws.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3, let headerBytes = Self.base64URL(parts[0]), let payloadBytes = Self.base64URL(parts[1]),
            let signatureBytes = Self.base64URL(parts[2])
        else {
            throw IngestionRejection(.malformedJWS, "\(what): not a compact JWS (three base64url parts)")
        }
        let header = try EventJSON(parsing: headerBytes)
        guard header["alg"].string == "ES256" else {
            throw IngestionRejection(.badAlgorithm, "\(what): algorithm \(header["alg"].string ?? "(none)") is not accepted; App Store notifications are signed ES256")
        }
        let chain = header["x5c"].array.compactMap { $0.string.flatMap { Data(base64Encoded: $0) } }
        guard chain.count >= 2, chain.count == header["x5c"].array.count else {
            throw IngestionRejection(.badChain, "\(what): x5c must hold the leaf and intermediate certificates in base64 DER")
        }
        let certificates: [Certificate]
        do {
            certificates = try chain.map { try Certificate(derEncoded: Array($0)) }
        } catch {
            throw IngestionRejection(.badChain, "\(what): an x5c certificate does not parse (\(error))")
        }
        let payload = try EventJSON(parsing: payloadBytes)
        guard let signedDate = payload["signedDate"].int64 else {
            throw IngestionRejection(.missingField, "\(what): signedDate missing (the instant the certificates are checked at)")
        }
        // The signature first: the leaf's key over the two first parts as sent.
        guard let key = P256.Signing.PublicKey(certificates[0].publicKey), signatureBytes.count == 64,
            let signature = try? P256.Signing.ECDSASignature(rawRepresentation: signatureBytes),
            key.isValidSignature(signature, for: Array(jws.utf8.prefix(parts[0].utf8.count + 1 + parts[1].utf8.count)))
        else {
            throw IngestionRejection(.badSignature, "\(what): the ES256 signature does not verify with the x5c leaf's key")
        }
        let instant = Date(timeIntervalSince1970: Double(signedDate) / 1000)
        var verifier = Verifier(rootCertificates: CertificateStore(self.roots)) {
            RFC5280Policy(fixedValidationTime: instant)
            AppleOIDPolicy()
        }
        let result = await verifier.validate(leaf: certificates[0], intermediates: CertificateStore(Array(certificates[1...])))
        guard case .validCertificate = result else {
            var reasons = ""
            if case .couldNotValidate(let failures) = result {
                reasons = failures.map { "\($0.policyFailureReason)" }.joined(separator: "; ")
            }
            throw IngestionRejection(
                .badChain,
                "\(what): the x5c chain does not reach the configured root (--appstore-root-cert) with Apple's OIDs, valid at its signedDate \(signedDate)\(reasons.isEmpty ? "" : ": \(reasons)")"
            )
        }
        return payload
    }

    static func base64URL(_ text: Substring) -> [UInt8]? {
        var standard = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
        while standard.count % 4 != 0 {
            standard += "="
        }
        return Data(base64Encoded: standard).map(Array.init)
    }
}

/// Apple's marker extensions: the leaf signs App Store data, the intermediate is Apple's
/// Worldwide Developer Relations CA.
struct AppleOIDPolicy: VerifierPolicy {
    let verifyingCriticalExtensions: [ASN1ObjectIdentifier] = []

    func chainMeetsPolicyRequirements(chain: UnverifiedCertificateChain) async -> PolicyEvaluationResult {
        guard chain.count == 3 else {
            return .failsToMeetPolicy(reason: "the chain must be leaf, intermediate, root; it has \(chain.count) certificates")
        }
        guard chain[0].extensions[oid: AppStoreJWSVerifier.leafOID] != nil else {
            return .failsToMeetPolicy(reason: "the leaf lacks Apple's App Store signing OID 1.2.840.113635.100.6.11.1")
        }
        guard chain[1].extensions[oid: AppStoreJWSVerifier.intermediateOID] != nil else {
            return .failsToMeetPolicy(reason: "the intermediate lacks Apple's WWDR OID 1.2.840.113635.100.6.2.1")
        }
        return .meetsPolicy
    }
}

public struct AppStoreRootError: Error, CustomStringConvertible {
    public var message: String
    public var description: String { self.message }
}
