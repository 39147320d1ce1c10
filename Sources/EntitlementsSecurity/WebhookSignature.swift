public import Crypto

/// The webhook signature scheme Stripe documents and our outbound events use: the header
/// `t=TIMESTAMP,v1=HEX[,v1=HEX...]`, where each `v1` is the HMAC-SHA256, under one signing
/// secret, of `TIMESTAMP`, `.` and the raw body. Several `v1` values let a secret be
/// rolled: the sender signs with each secret it holds; the receiver accepts a match with
/// any secret it holds.
public enum WebhookSignature {
    /// What a header held: its timestamp (if any) and its `v1` signatures.
    public struct Parsed: Sendable {
        public var timestamp: Int64?
        public var signatures: [[UInt8]]
    }

    /// Why a header could not be read.
    public enum ParseError: Error, Sendable, Equatable {
        /// An item is not `key=value`: the item's first 40 characters.
        case notKeyValue(String)
        /// `t=` is not a non-negative whole number: its first 20 characters.
        case badTimestamp(String)
        /// A `v1` value is not hexadecimal.
        case badSignature
    }

    /// The header for `body` sent at `timestamp` (Unix seconds): one `v1` per secret.
    public static func header(body: [UInt8], timestamp: Int64, secrets: [String]) -> String {
        "t=\(timestamp)" + secrets.map { ",v1=" + Hex.encode(Self.code(body: body, timestamp: timestamp, secret: $0)) }.joined()
    }

    /// The HMAC-SHA256 of `TIMESTAMP.body` under `secret`.
    public static func code(body: [UInt8], timestamp: Int64, secret: String) -> [UInt8] {
        Array(HMAC<SHA256>.authenticationCode(for: Self.signed(body, timestamp), using: SymmetricKey(data: Array(secret.utf8))))
    }

    /// Reads a header: `t` and every `v1`; other schemes (`v0` ...) are skipped.
    public static func parse(_ header: String) throws(ParseError) -> Parsed {
        var parsed = Parsed(timestamp: nil, signatures: [])
        for item in header.split(separator: ",") {
            let parts = item.split(separator: "=", maxSplits: 1)
            guard parts.count == 2 else {
                throw .notKeyValue(String(item.prefix(40)))
            }
            switch parts[0].trimmingCharacters(in: " \t") {
            case "t":
                guard let value = Int64(parts[1]), value >= 0 else {
                    throw .badTimestamp(String(parts[1].prefix(20)))
                }
                parsed.timestamp = value
            case "v1":
                guard let bytes = Hex.decode(parts[1]) else {
                    throw .badSignature
                }
                parsed.signatures.append(bytes)
            default:
                continue
            }
        }
        return parsed
    }

    /// Whether any of `signatures` is `body`'s at `timestamp` under any of `keys` (each
    /// comparison in constant time).
    public static func matches(body: [UInt8], timestamp: Int64, signatures: [[UInt8]], keys: [SymmetricKey]) -> Bool {
        let signed = Self.signed(body, timestamp)
        return keys.contains { key in
            signatures.contains { HMAC<SHA256>.isValidAuthenticationCode($0, authenticating: signed, using: key) }
        }
    }

    private static func signed(_ body: [UInt8], _ timestamp: Int64) -> [UInt8] {
        var signed = Array("\(timestamp).".utf8)
        signed.append(contentsOf: body)
        return signed
    }
}

extension String {
    fileprivate func trimmingCharacters(in set: String) -> Substring {
        Substring(self).trimmingCharacters(in: set)
    }
}

extension Substring {
    fileprivate func trimmingCharacters(in set: String) -> Substring {
        var slice = self
        while let first = slice.first, set.contains(first) { slice = slice.dropFirst() }
        while let last = slice.last, set.contains(last) { slice = slice.dropLast() }
        return slice
    }
}

/// Lower-case hexadecimal.
public enum Hex {
    public static func encode(_ bytes: some Sequence<UInt8>) -> String {
        let digits = Array("0123456789abcdef".utf8)
        var out: [UInt8] = []
        for byte in bytes {
            out.append(digits[Int(byte >> 4)])
            out.append(digits[Int(byte & 0x0f)])
        }
        return String(decoding: out, as: UTF8.self)
    }

    /// The bytes of `text` (either case), or nil if it is empty, odd or not hexadecimal.
    public static func decode(_ text: some StringProtocol) -> [UInt8]? {
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
}

/// A file of signing secrets, one a line; blank lines and lines starting with `#` are
/// skipped (`--stripe-webhook-secret-file`, `--event-webhook-secret-file`).
public enum SigningSecretsFile {
    /// The secrets of `path`; errors name `setting` and say what a secret looks like
    /// (`example`, e.g. `whsec_...`).
    public static func load(path: String, setting: String, example: String) throws(SigningSecretsFileError) -> [String] {
        let text: String
        do {
            text = String(decoding: try readWholeFile(path), as: UTF8.self)
        } catch {
            throw SigningSecretsFileError(message: "\(setting) \(path): \(error)")
        }
        let secrets = text.split(whereSeparator: \.isNewline)
            .map { String($0.trimmingCharacters(in: " \t\r")) }
            .filter { !$0.isEmpty && !$0.hasPrefix("#") }
        guard !secrets.isEmpty else {
            throw SigningSecretsFileError(message: "\(setting) \(path): no secret in it (one signing secret a line, \(example))")
        }
        if let bad = secrets.firstIndex(where: { $0.contains(where: \.isWhitespace) }) {
            throw SigningSecretsFileError(message: "\(setting) \(path): secret \(bad + 1) has a space in it (one secret a line)")
        }
        return secrets
    }
}

public struct SigningSecretsFileError: Error, CustomStringConvertible {
    public var message: String
    public var description: String { self.message }
}
