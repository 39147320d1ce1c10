import Crypto
import EntitlementsSecurity
import Testing

/// The `t=...,v1=...` scheme the outbound events sign with (and Stripe's webhooks verify).
@Suite("webhook signatures")
struct WebhookSignatureTests {
    static let body = Array(#"{"id":"evt_7_0","type":"GRANT"}"#.utf8)

    @Test("signed with two secrets during a rotation: a receiver holding either verifies; a changed body or timestamp does not")
    func rotation() throws {
        let header = WebhookSignature.header(body: Self.body, timestamp: 1_795_305_600, secrets: ["old-secret", "new-secret"])
        let parsed = try WebhookSignature.parse(header)
        #expect(parsed.timestamp == 1_795_305_600 && parsed.signatures.count == 2)
        for secret in ["old-secret", "new-secret"] {
            #expect(WebhookSignature.matches(body: Self.body, timestamp: 1_795_305_600, signatures: parsed.signatures, keys: [SymmetricKey(data: Array(secret.utf8))]))
        }
        let stranger = [SymmetricKey(data: Array("other".utf8))]
        #expect(!WebhookSignature.matches(body: Self.body, timestamp: 1_795_305_600, signatures: parsed.signatures, keys: stranger))
        let key = [SymmetricKey(data: Array("old-secret".utf8))]
        #expect(!WebhookSignature.matches(body: Self.body + [0x20], timestamp: 1_795_305_600, signatures: parsed.signatures, keys: key))
        #expect(!WebhookSignature.matches(body: Self.body, timestamp: 1_795_305_601, signatures: parsed.signatures, keys: key))
    }

    @Test("the HMAC is over TIMESTAMP.BODY, hexadecimal: a known vector")
    func vector() {
        // printf '1700000000.{}' | openssl dgst -sha256 -hmac key
        let code = WebhookSignature.code(body: Array("{}".utf8), timestamp: 1_700_000_000, secret: "key")
        #expect(Hex.encode(code) == "9d713ed406bb7076d4123f0dc2c39d2df5c654ed4b0cd56b52c8b4c940bd63ae")
    }

    @Test("malformed headers are told apart")
    func malformed() {
        #expect(throws: WebhookSignature.ParseError.notKeyValue("t")) { try WebhookSignature.parse("t") }
        #expect(throws: WebhookSignature.ParseError.badTimestamp("-1")) { try WebhookSignature.parse("t=-1,v1=00") }
        #expect(throws: WebhookSignature.ParseError.badSignature) { try WebhookSignature.parse("t=1,v1=zz") }
        #expect(Hex.decode("0aFf") == [0x0a, 0xff] && Hex.decode("abc") == nil && Hex.decode("") == nil)
    }
}
