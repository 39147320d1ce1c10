import Crypto
import EntitlementsSecurity
import Foundation

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
        var timestamp: Int64?
        var signatures: [[UInt8]] = []
        for item in header.split(separator: ",") {
            let parts = item.split(separator: "=", maxSplits: 1)
            guard parts.count == 2 else {
                throw IngestionRejection(.malformedSignature, "Stripe-Signature: \"\(item.prefix(40))\" is not key=value")
            }
            switch parts[0].trimmingCharacters(in: .whitespaces) {
            case "t":
                guard let value = Int64(parts[1]), value >= 0 else {
                    throw IngestionRejection(.malformedSignature, "Stripe-Signature: t=\(parts[1].prefix(20)) is not a Unix time")
                }
                timestamp = value
            case "v1":
                guard let bytes = Self.hex(parts[1]) else {
                    throw IngestionRejection(.malformedSignature, "Stripe-Signature: a v1 signature is not hexadecimal")
                }
                signatures.append(bytes)
            default:
                continue  // v0 (test mode's old scheme) and future schemes: not checked
            }
        }
        guard let timestamp else {
            throw IngestionRejection(.malformedSignature, "Stripe-Signature: no timestamp (t=)")
        }
        guard !signatures.isEmpty else {
            throw IngestionRejection(.malformedSignature, "Stripe-Signature: no v1 signature (only the v1 scheme is accepted)")
        }
        var signed = Array("\(timestamp).".utf8)
        signed.append(contentsOf: body)
        let matches = self.keys.contains { key in
            signatures.contains { HMAC<SHA256>.isValidAuthenticationCode($0, authenticating: signed, using: key) }
        }
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

    private static func hex(_ text: Substring) -> [UInt8]? {
        let digits = Array(text.utf8)
        guard !digits.isEmpty, digits.count % 2 == 0 else {
            return nil
        }
        var bytes: [UInt8] = []
        bytes.reserveCapacity(digits.count / 2)
        var index = 0
        while index < digits.count {
            guard let high = Self.nibble(digits[index]), let low = Self.nibble(digits[index + 1]) else {
                return nil
            }
            bytes.append(high << 4 | low)
            index += 2
        }
        return bytes
    }

    private static func nibble(_ digit: UInt8) -> UInt8? {
        switch digit {
        case UInt8(ascii: "0")...UInt8(ascii: "9"): digit - UInt8(ascii: "0")
        case UInt8(ascii: "a")...UInt8(ascii: "f"): digit - UInt8(ascii: "a") + 10
        case UInt8(ascii: "A")...UInt8(ascii: "F"): digit - UInt8(ascii: "A") + 10
        default: nil
        }
    }

    /// Signs `body` at `timestamp` as Stripe does: the header value a test (or a tool
    /// replaying an event by hand) sends.
    public static func header(body: [UInt8], timestamp: Int64, secret: String) -> String {
        var signed = Array("\(timestamp).".utf8)
        signed.append(contentsOf: body)
        let code = HMAC<SHA256>.authenticationCode(for: signed, using: SymmetricKey(data: Array(secret.utf8)))
        return "t=\(timestamp),v1=" + code.map { String(format: "%02x", $0) }.joined()
    }
}

/// The secrets of `--stripe-webhook-secret-file`: one endpoint signing secret a line
/// (`whsec_...`); blank lines and lines starting with `#` are skipped.
public enum StripeSecretsFile {
    public static func load(path: String) throws -> [String] {
        let text: String
        do {
            text = String(decoding: try readWholeFile(path), as: UTF8.self)
        } catch {
            throw StripeSecretsFileError(message: "--stripe-webhook-secret-file \(path): \(error)")
        }
        let secrets = text.split(whereSeparator: \.isNewline)
            .map { $0.trimmingCharacters(in: .whitespaces) }
            .filter { !$0.isEmpty && !$0.hasPrefix("#") }
        guard !secrets.isEmpty else {
            throw StripeSecretsFileError(message: "--stripe-webhook-secret-file \(path): no secret in it (one signing secret a line, whsec_...)")
        }
        if let bad = secrets.firstIndex(where: { $0.contains(where: \.isWhitespace) }) {
            throw StripeSecretsFileError(message: "--stripe-webhook-secret-file \(path): secret \(bad + 1) has a space in it (one secret a line)")
        }
        return secrets
    }
}

public struct StripeSecretsFileError: Error, CustomStringConvertible {
    public var message: String
    public var description: String { self.message }
}
