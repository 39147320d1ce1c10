import Testing

@testable import EntitlementsIngestion

@Suite("Stripe-Signature, as Stripe documents it: HMAC-SHA256 of timestamp.body, any v1, 300 s tolerance")
struct StripeSignatureTests {
    let body = Array(#"{"id":"evt_1","type":"customer.created"}"#.utf8)
    let now: Int64 = 1_795_305_600
    let verifier = StripeSignatureVerifier(secrets: ["whsec_old", "whsec_new"])

    @Test("a signature by either configured secret is accepted (a secret being rolled)")
    func accepted() throws {
        for secret in ["whsec_old", "whsec_new"] {
            let header = StripeSignatureVerifier.header(body: body, timestamp: now - 10, secret: secret)
            #expect(try verifier.verify(header: header, body: body, now: now) == now - 10)
        }
    }

    @Test("one matching v1 among several is enough; v0 and unknown schemes are skipped")
    func severalSignatures() throws {
        let good = StripeSignatureVerifier.header(body: body, timestamp: now, secret: "whsec_new")
        let goodHex = String(good.split(separator: "v1=")[1])
        let header = "t=\(now),v1=\(String(repeating: "ab", count: 32)),v0=00ff,v1=\(goodHex),v9=zz"
        #expect(try verifier.verify(header: header, body: body, now: now) == now)
    }

    /// Each refusal, its reason and a fragment of its message.
    static let refusals: [(String, String?, RejectionReason, String)] = [
        ("no header", nil, .missingSignature, "no Stripe-Signature header"),
        ("empty header", "", .missingSignature, "no Stripe-Signature header"),
        ("no timestamp", "v1=abcd", .malformedSignature, "no timestamp"),
        ("a timestamp that is not a number", "t=soon,v1=abcd", .malformedSignature, "not a Unix time"),
        ("no v1", "t=1795305600,v0=abcd", .malformedSignature, "no v1 signature"),
        ("v1 not hexadecimal", "t=1795305600,v1=xyz1", .malformedSignature, "not hexadecimal"),
        ("an item without =", "t=1795305600,v1", .malformedSignature, "is not key=value"),
        ("a signature by another secret", StripeSignatureVerifier.header(body: Array(#"{"id":"evt_1","type":"customer.created"}"#.utf8), timestamp: 1_795_305_600, secret: "whsec_other"), .badSignature, "no v1 signature matches"),
    ]

    @Test("bad headers are refused with a reason and a message", arguments: 0..<refusals.count)
    func refused(_ index: Int) {
        let (_, header, reason, message) = Self.refusals[index]
        #expect {
            try verifier.verify(header: header, body: body, now: now)
        } throws: { error in
            let rejection = error as! IngestionRejection
            return rejection.reason == reason && rejection.message.contains(message)
        }
    }

    @Test("a changed body no longer matches its signature")
    func tampered() {
        let header = StripeSignatureVerifier.header(body: body, timestamp: now, secret: "whsec_new")
        var changed = body
        changed[changed.count - 3] ^= 0x01
        #expect(throws: IngestionRejection(.badSignature, "Stripe-Signature: no v1 signature matches any of the 2 configured secret(s) (--stripe-webhook-secret-file); check that it holds this endpoint's signing secret")) {
            try verifier.verify(header: header, body: changed, now: now)
        }
    }

    @Test("a signature older than the tolerance is refused as expired; at the tolerance it passes")
    func expired() throws {
        let atLimit = StripeSignatureVerifier.header(body: body, timestamp: now - 300, secret: "whsec_old")
        #expect(try verifier.verify(header: atLimit, body: body, now: now) == now - 300)
        let old = StripeSignatureVerifier.header(body: body, timestamp: now - 301, secret: "whsec_old")
        #expect {
            try verifier.verify(header: old, body: body, now: now)
        } throws: { error in
            (error as! IngestionRejection).reason == .expiredTimestamp
        }
    }
}
