import EntitlementsMessages
import Testing

@testable import EntitlementsFormats

@Suite("requests in protobuf's JSON mapping (the JSON door)")
struct ProtoJSONTests {
    static func decode<M: ProtoJSONDecodable>(_ type: M.Type, _ text: String) throws -> M {
        try ProtoJSON.decode(type, from: Array(text.utf8))
    }

    static func problem<M: ProtoJSONDecodable>(_ type: M.Type, _ text: String) -> String? {
        do {
            _ = try Self.decode(type, text)
            return nil
        } catch {
            return "\(error)"
        }
    }

    @Test("field names in lowerCamelCase or as in the .proto; 64-bit integers as numbers or strings; enums by name or number")
    func mapping() throws {
        let camel = try Self.decode(CheckEntitlementsRequest.self, #"{"userId":"u-1","entitlementIds":["premium","pro"],"at":"1769904000000","environment":"ENVIRONMENT_SANDBOX","minLogSequence":7}"#)
        #expect(camel == CheckEntitlementsRequest(userId: "u-1", entitlementIds: ["premium", "pro"], at: 1_769_904_000_000, environment: .sandbox, minLogSequence: 7))
        let proto = try Self.decode(CheckEntitlementsRequest.self, #"{"user_id":"u-1","entitlement_ids":["premium","pro"],"at":1769904000000,"environment":2,"min_log_sequence":"7"}"#)
        #expect(proto == camel)
        // Whole numbers with a fraction or an exponent, exactly (no rounding through Double).
        let whole = try Self.decode(CheckEntitlementsRequest.self, #"{"at":"9007199254740993.0","minLogSequence":1.5e1}"#)
        #expect(whole.at == 9_007_199_254_740_993 && whole.minLogSequence == 15)
        #expect(try Self.decode(CheckEntitlementsRequest.self, #"{"at":-2.50e1}"#).at == -25)
        // null is absent; an empty object is the empty message.
        #expect(try Self.decode(CheckEntitlementsRequest.self, #"{"userId":null,"at":null}"#) == CheckEntitlementsRequest())
        #expect(try Self.decode(HealthRequest.self, " { } ") == HealthRequest())
    }

    @Test("nested messages, booleans and escapes")
    func nested() throws {
        let request = try Self.decode(UpdateSubscriptionStateRequest.self, #"""
            {"userId": "caf\u00e9 \ud83d\ude00", "state": {"store": "SOURCE_APPSTORE", "originalTransactionId": "o-1",
             "autoRenewEnabled": true, "gracePeriodExpirationDate": "-5"}}
            """#)
        #expect(request.userId == "café 😀")
        #expect(request.state == SubscriptionState(store: .appstore, originalTransactionId: "o-1", autoRenewEnabled: true, gracePeriodExpirationDate: -5))
    }

    @Test("bad input: each refusal names the problem and where it is", arguments: [
        ("", "not valid JSON: unexpected end of input"),
        ("{not json", "not valid JSON: expected a member name in quotes"),
        (#"{"userId":"u"} x"#, "after the JSON value"),
        (#"[1]"#, "the body: expected an object"),
        (#"{"userID":"u"}"#, "userID: no such field"),
        (#"{"userId":"u","user_id":"v"}"#, "userId: given more than once"),
        (#"{"userId":5}"#, "userId: expected a string, found a number"),
        (#"{"at":"soon"}"#, #"at: "soon" is not a whole number"#),
        (#"{"at":1.5}"#, "not a whole number"),
        (#"{"at":"0x10"}"#, "not a whole number"),
        (#"{"at":"9007199254740993.5"}"#, "not a whole number"),
        (#"{"minLogSequence":-1}"#, "minLogSequence"),
        (#"{"at":99999999999999999999}"#, "not a whole number"),
        (#"{"environment":"SANDBOX"}"#, #"environment: "SANDBOX" is not one of ENVIRONMENT_UNSPECIFIED"#),
        (#"{"environment":9}"#, "environment: 9 is not a value"),
        (#"{"entitlementIds":"premium"}"#, "entitlementIds: expected an array"),
        (#"{"entitlementIds":[1]}"#, "entitlementIds[0]: expected a string"),
        (#"{"userId":"a\qb"}"#, "bad escape"),
        (#"{"userId":"\ud83d"}"#, "surrogate"),
        ("{\"userId\":\"a\u{01}\"}", "control character"),
        (#"{"userId":01}"#, "malformed number"),
        (String(repeating: "[", count: 40), "nested deeper than 32"),
    ])
    func refusals(body: String, expected: String) {
        let problem = Self.problem(CheckEntitlementsRequest.self, body)
        #expect(problem?.contains(expected) == true, "\(body): \(problem ?? "accepted")")
    }

    @Test("a nested message's problem is named by its path")
    func nestedPath() {
        let problem = Self.problem(RecordTransactionRequest.self, #"{"userId":"u","transaction":{"store":"SOURCE_APPSTORE","expirationDate":"x"}}"#)
        #expect(problem?.contains("transaction.expirationDate") == true, "\(problem ?? "accepted")")
    }

    @Test("bytes that are not UTF-8 are refused")
    func invalidUTF8() {
        #expect(throws: ProtoJSONError.self) {
            _ = try ProtoJSON.decode(CheckEntitlementsRequest.self, from: Array(#"{"userId":""#.utf8) + [0xFF, 0xFE] + Array(#""}"#.utf8))
        }
    }
}
