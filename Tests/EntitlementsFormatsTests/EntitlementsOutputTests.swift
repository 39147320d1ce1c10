import EntitlementsMessages
import Testing

@testable import EntitlementsFormats

@Suite("output formats")
struct EntitlementsOutputTests {
    static let response = CheckEntitlementsResponse(
        userId: "$anon:abc",
        customerId: "user-1",
        requestDate: 1_769_860_800_000,
        validUntil: nil,
        entitlements: [
            Entitlement(
                id: "premium",
                isActive: true,
                source: .playstore,
                startedDate: 1_769_860_800_123,
                productId: "p",
                renewState: .willRenew,
                renewsCount: 3,
                grantType: .purchase,
                lastActivatedOfferCode: "Q\"\\\n\u{1}",
                transactions: [Transaction(transactionId: "t", store: .playstore, transactionDate: 0, type: .subscriptionRenewed)],
                willRenew: true,
                ownershipType: .owner,
                periodType: .normal
            )
        ]
    )

    @Test("JSON: schema field names and order, RFC 3339 dates, null for absent values and unspecified enums")
    func compactJSON() {
        #expect(
            EntitlementsOutput.json(Self.response, pretty: false)
                == #"{"requestDate":"2026-01-31T12:00:00.000Z","validUntil":null,"entitlements":{"premium":{"id":"premium","isActive":true,"source":"playstore","startedDate":"2026-01-31T12:00:00.123Z","trialStartDate":null,"firstPurchaseDate":null,"lastPurchaseDate":null,"autoRenewDisableDate":null,"expirationDate":null,"productId":"p","renewState":"willRenew","renewsCount":3,"grantType":"purchase","lastActivatedOfferCode":"Q\"\\\n\u0001","transactions":[{"originalTransactionId":null,"transactionId":"t","store":"playstore","productId":null,"offerCode":null,"transactionDate":"1970-01-01T00:00:00.000Z","expirationDate":null,"revocationDate":null,"environment":null,"ownershipType":null,"type":"subscriptionRenewed","priceMicros":null,"currency":null,"verified":false}],"willRenew":true,"isInGracePeriod":false,"isInBillingRetry":false,"isRevoked":false,"ownershipType":"owner","periodType":"normal","gracePeriodExpirationDate":null,"billingIssueDetectedDate":null,"cancellationReason":null,"priceMicros":null,"currency":null,"priceConsentStatus":null,"interval":null,"status":null}}}"#
        )
    }

    @Test("a stale answer (fleet mode past --max-staleness) says so last, in JSON and in the table; others have no stale key")
    func staleAnswer() {
        var stale = CheckEntitlementsResponse(userId: "u", customerId: "u", requestDate: 0, staleForMs: 42_500)
        #expect(EntitlementsOutput.json(stale, pretty: false) == #"{"requestDate":"1970-01-01T00:00:00.000Z","validUntil":null,"entitlements":{},"staleForMs":42500}"#)
        #expect(EntitlementsOutput.table(stale).hasSuffix("\nSTALE: the server last heard from PostgreSQL 42 s ago, more than its --max-staleness; writes made elsewhere since may be missing"))
        stale.staleForMs = 0
        #expect(!EntitlementsOutput.json(stale, pretty: false).contains("stale"))
        #expect(!EntitlementsOutput.table(stale).contains("STALE"))
    }

    @Test("pretty JSON indents by two spaces; empty collections stay on one line")
    func prettyJSON() {
        let empty = CheckEntitlementsResponse(userId: "u", requestDate: 0, validUntil: 86_400_000)
        #expect(
            EntitlementsOutput.json(empty)
                == """
                {
                  "requestDate": "1970-01-01T00:00:00.000Z",
                  "validUntil": "1970-01-02T00:00:00.000Z",
                  "entitlements": {}
                }
                """
        )
    }

    @Test("the table shows one row per entitlement and when the answer can change")
    func table() {
        #expect(
            EntitlementsOutput.table(Self.response)
                == """
                $anon:abc (customer user-1) at 2026-01-31T12:00:00.000Z
                ENTITLEMENT  ACTIVE  SOURCE     PRODUCT  EXPIRES  RENEW STATE  STATUS  PRICE
                premium      yes     playstore  p        never    willRenew    -       -
                valid until further notice (no pending change)
                """
        )
    }

    @Test("the table's STATUS and PRICE: status with the cancellation reason and price consent, the price in its currency per interval")
    func statusAndPrice() {
        var canceled = Entitlement(cancellationReason: .customer, priceMicros: 9_990_000, currency: "USD", interval: .monthly, status: .canceled)
        #expect(EntitlementsOutput.status(canceled) == "canceled (customer)")
        #expect(EntitlementsOutput.price(canceled) == "9.99 USD/monthly")
        canceled.priceMicros = 500_000_000
        canceled.currency = "JPY"
        canceled.interval = .unspecified
        #expect(EntitlementsOutput.price(canceled) == "500.00 JPY")
        canceled.priceMicros = 1_234_567
        #expect(EntitlementsOutput.price(canceled) == "1.234567 JPY")
        let consenting = Entitlement(priceConsentStatus: .agreed, status: .active)
        #expect(EntitlementsOutput.status(consenting) == "active (price agreed)")
        #expect(EntitlementsOutput.price(consenting) == "-")
        #expect(EntitlementsOutput.status(Entitlement()) == "-")
        #expect(EntitlementsOutput.json(Entitlement(priceMicros: 9_990_000, currency: "USD", status: .pastDue)).serialized(pretty: false).contains(#""priceMicros":9990000,"currency":"USD","priceConsentStatus":null,"interval":null,"status":"past_due""#))
    }

    @Test("every enum value has a JSON name that reads back, except unspecified ones")
    func enumNames() {
        func check<Value: JSONNamedEnum>(_: Value.Type) {
            for value in Value.allCases {
                if let name = value.jsonName {
                    #expect(Value(jsonName: name) == value)
                }
            }
            #expect(Set(Value.allCases.compactMap(\.jsonName)).count == Value.allCases.compactMap(\.jsonName).count)
        }
        check(Source.self)
        check(Environment.self)
        check(OwnershipType.self)
        check(TransactionType.self)
        check(RenewState.self)
        check(GrantType.self)
        check(PeriodType.self)
        check(ProductType.self)
        check(SubscriptionPeriod.self)
        check(CancellationReason.self)
        check(PriceConsentStatus.self)
        check(SubscriptionStatus.self)
    }
}
