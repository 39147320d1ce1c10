import Crypto
import EntitlementsSecurity

/// Checks a `Stripe-Signature` header as Stripe documents it ("Verify webhook signatures
/// manually"): the header is `t=TIMESTAMP,v1=HEX[,v1=HEX...][,v0=...]`; the signed payload is
/// `TIMESTAMP` `.` and the raw body, its HMAC-SHA256 under an endpoint secret must equal one
/// of the `v1` values (compared in constant time), and the timestamp must be at most
/// `tolerance` seconds old. Several secrets are tried, so a secret can be rolled (Stripe
/// signs with both while the old one expires).
public struct StripeSignatureVerifier: Sendable {
    private let keys: [SymmetricKey]
    /// Seconds a signature's timestamp may be older than now (Stripe's libraries: 300).
    public let tolerance: Int64

    public init(secrets: [String], tolerance: Int64 = 300) {
        self.keys = secrets.map { SymmetricKey(data: Array($0.utf8)) }
        self.tolerance = tolerance
    }

    /// Throws a rejection saying what is wrong; returns the signature's timestamp.
    @discardableResult
    public func verify(header: String?, body: [UInt8], now: Int64) throws(IngestionRejection) -> Int64 {
        guard let header, !header.isEmpty else {
            throw IngestionRejection(.missingSignature, "no Stripe-Signature header: this endpoint takes only events Stripe signed")
        }
        let parsed: WebhookSignature.Parsed
        do {
            parsed = try WebhookSignature.parse(header)
        } catch {
            switch error {
            case .notKeyValue(let item):
                throw IngestionRejection(.malformedSignature, "Stripe-Signature: \"\(item)\" is not key=value")
            case .badTimestamp(let value):
                throw IngestionRejection(.malformedSignature, "Stripe-Signature: t=\(value) is not a Unix time")
            case .badSignature:
                throw IngestionRejection(.malformedSignature, "Stripe-Signature: a v1 signature is not hexadecimal")
            }
        }
        guard let timestamp = parsed.timestamp else {
            throw IngestionRejection(.malformedSignature, "Stripe-Signature: no timestamp (t=)")
        }
        guard !parsed.signatures.isEmpty else {
            throw IngestionRejection(.malformedSignature, "Stripe-Signature: no v1 signature (only the v1 scheme is accepted)")
        }
        let matches = WebhookSignature.matches(body: body, timestamp: timestamp, signatures: parsed.signatures, keys: self.keys)
        guard matches else {
            throw IngestionRejection(
                .badSignature,
                "Stripe-Signature: no v1 signature matches any of the \(self.keys.count) configured secret(s) (--stripe-webhook-secret-file); check that it holds this endpoint's signing secret"
            )
        }
        guard timestamp >= now - self.tolerance else {
            throw IngestionRejection(
                .expiredTimestamp,
                "Stripe-Signature: signed at \(timestamp), \(now - timestamp) s ago, more than the tolerance of \(self.tolerance) s (a replayed event, or this server's clock is wrong)"
            )
        }
        return timestamp
    }

    /// Signs `body` at `timestamp` as Stripe does: the header value a test (or a tool
    /// replaying an event by hand) sends.
    public static func header(body: [UInt8], timestamp: Int64, secret: String) -> String {
        WebhookSignature.header(body: body, timestamp: timestamp, secrets: [secret])
    }
}

/// The secrets of `--stripe-webhook-secret-file`: one endpoint signing secret a line
/// (`whsec_...`); blank lines and lines starting with `#` are skipped.
public enum StripeSecretsFile {
    public static func load(path: String) throws -> [String] {
        do {
            return try SigningSecretsFile.load(path: path, setting: "--stripe-webhook-secret-file", example: "whsec_...")
        } catch {
            throw StripeSecretsFileError(message: error.message)
        }
    }
}

public struct StripeSecretsFileError: Error, CustomStringConvertible {
    public var message: String
    public var description: String { self.message }
}
