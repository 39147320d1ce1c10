import EntitlementsMessages
import Foundation
import Testing

@testable import EntitlementsFormats

@Suite("customers.jsonl lines")
struct CustomerLineTests {
    static let validTransaction = #"{"store":"appstore","productId":"p","transactionId":"1","originalTransactionId":"1","type":"subscriptionStarted","transactionDate":"2026-01-01T00:00:00Z","expirationDate":"2026-02-01T00:00:00Z"}"#

    static func line(transactions: [String] = [validTransaction], extra: String = "") -> String {
        #"{"id":"user-1"\#(extra),"transactions":[\#(transactions.joined(separator: ","))]}"#
    }

    static func transaction(replacing key: String, with value: String) -> String {
        let pattern = try! Regex(#""\#(key)":("[^"]*"|null|true|false)"#)
        if validTransaction.contains(pattern) {
            return validTransaction.replacing(pattern, with: "\"\(key)\":\(value)")
        }
        return String(validTransaction.dropLast()) + ",\"\(key)\":\(value)}"
    }

    @Test("a full line converts every field")
    func fullLine() throws {
        let text = #"{"id":"user-1","aliases":["$anon:abc"],"transactions":[{"store":"playstore","productId":"p","transactionId":"GPA.2","originalTransactionId":"GPA.1","type":"introRenewed","transactionDate":"2026-01-01T00:00:00.250Z","expirationDate":"2026-02-01T00:00:00Z","revocationDate":"2026-01-15T00:00:00Z","environment":"sandbox","ownershipType":"familySharing","offerCode":"X","priceMicros":4990000,"currency":"EUR"}],"subscriptions":[{"store":"playstore","originalTransactionId":"GPA.1","autoRenewEnabled":false,"autoRenewDisabledDate":"2026-01-02T00:00:00Z","billingIssueDetectedDate":"2026-01-03T00:00:00Z","gracePeriodExpirationDate":"2026-01-04T00:00:00Z","isInBillingRetry":true,"cancellationReason":"priceIncrease","priceConsentStatus":"notified"}],"grants":[{"grantId":"g","entitlementId":"pro","grantedDate":"2026-01-05T00:00:00Z","expirationDate":"2026-01-06T00:00:00Z","revokedDate":"2026-01-07T00:00:00Z","reason":"r"}]}"#
        let record = try CustomersFile.parseLine(Array(text.utf8))
        let jan = { (day: Int64) in 1_767_225_600_000 + (day - 1) * 86_400_000 }
        #expect(
            record
                == CustomerRecord(
                    id: "user-1",
                    aliases: ["$anon:abc"],
                    transactions: [
                        Transaction(
                            originalTransactionId: "GPA.1", transactionId: "GPA.2", store: .playstore, productId: "p",
                            offerCode: "X", transactionDate: jan(1) + 250, expirationDate: 1_769_904_000_000,
                            revocationDate: jan(15), environment: .sandbox, ownershipType: .familySharing, type: .introRenewed,
                            priceMicros: 4_990_000, currency: "EUR"
                        )
                    ],
                    subscriptions: [
                        SubscriptionState(
                            store: .playstore, originalTransactionId: "GPA.1", autoRenewEnabled: false,
                            autoRenewDisabledDate: jan(2), billingIssueDetectedDate: jan(3),
                            gracePeriodExpirationDate: jan(4), isInBillingRetry: true,
                            cancellationReason: .priceIncrease, priceConsentStatus: .notified
                        )
                    ],
                    grants: [
                        Grant(grantId: "g", entitlementId: "pro", grantedDate: jan(5), expirationDate: jan(6), revokedDate: jan(7), reason: "r")
                    ]
                )
        )
    }

    @Test("environment and ownership default to production and owner; nullable fields may be missing")
    func defaults() throws {
        let record = try CustomersFile.parseLine(Array(Self.line().utf8))
        #expect(record.transactions[0].environment == .production)
        #expect(record.transactions[0].ownershipType == .owner)
        #expect(record.transactions[0].revocationDate == nil)
        #expect(record.aliases.isEmpty && record.grants.isEmpty)
    }

    static let badLines: [(String, String)] = [
        ("{", "not valid JSON"),
        (#"{"aliases":[]}"#, "id: missing"),
        (#"{"id":""}"#, "id: must not be empty"),
        (#"{"id":"\#(String(repeating: "x", count: 257))"}"#, "id: must be at most 256 bytes, got 257"),
        (#"{"id":"Zoe\u0308"}"#, "id: must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"),
        (#"{"id":"u","aliases":["\u2126"]}"#, "aliases[0]: must be in Unicode Normalization Form C (NFC), e.g. U+00E9, not e followed by U+0301; normalize it to NFC"),
        (#"{"id":"a\u0000b"}"#, "id: must not contain a NUL character"),
        (#"{"id":7}"#, "id: expected a string"),
        (#"{"id":null}"#, "id: must not be null"),
        (#"{"id":"u","aliases":["u"]}"#, "aliases[0]: an alias cannot be the customer's own id"),
        (#"{"id":"u","aliases":["a","a"]}"#, "aliases[1]: duplicate alias \"a\""),
        (line(transactions: [transaction(replacing: "expirationDate", with: #""2026-13-01T00:00:00Z""#)]),
         "transactions[0].expirationDate: not an RFC 3339 date"),
        (line(transactions: [validTransaction, transaction(replacing: "transactionDate", with: #""yesterday""#)]),
         "transactions[1].transactionDate: not an RFC 3339 date"),
        (line(transactions: [transaction(replacing: "store", with: #""amazon""#)]),
         "transactions[0].store: unknown value \"amazon\"; expected one of unknown, appstore, playstore, stripe, manual"),
        (line(transactions: [transaction(replacing: "store", with: #""manual""#)]),
         "transactions[0].store: must be appstore, playstore or stripe, got \"manual\""),
        (line(transactions: [transaction(replacing: "type", with: #""refund""#)]),
         "transactions[0].type: unknown value \"refund\"; expected one of subscriptionStarted, subscriptionRenewed, trialStarted, introStarted, introRenewed, nonConsumablePurchase"),
        (line(transactions: [transaction(replacing: "expirationDate", with: "null")]),
         "transactions[0].expirationDate: missing; only a nonConsumablePurchase has none"),
        (line(transactions: [transaction(replacing: "type", with: #""nonConsumablePurchase""#)]),
         "transactions[0].expirationDate: must be null for a nonConsumablePurchase"),
        (line(transactions: [transaction(replacing: "expirationDate", with: #""2025-12-31T00:00:00Z""#)]),
         "transactions[0].expirationDate: must be after transactionDate"),
        (line(transactions: [transaction(replacing: "environment", with: #""staging""#)]),
         "transactions[0].environment: unknown value \"staging\"; expected one of production, sandbox"),
        (line(transactions: [validTransaction, validTransaction]),
         "transactions[1].transactionId: duplicate transaction \"1\" in appstore (first at transactions[0])"),
        (line(transactions: [#"{"store":"appstore"}"#]), "transactions[0].productId: missing"),
        (line(transactions: [transaction(replacing: "currency", with: #""usd""#).replacingOccurrences(of: "}", with: #","priceMicros":990000}"#)]),
         #"transactions[0].currency: must be an ISO 4217 code in upper case, such as "USD""#),
        (line(transactions: [transaction(replacing: "priceMicros", with: "990000")]), "transactions[0].currency: priceMicros and currency go together"),
        (#"{"id":"u","transactions":{}}"#, "transactions: expected an array"),
        (#"{"id":"u","subscriptions":[{"store":"appstore","originalTransactionId":"1"}]}"#,
         "subscriptions[0].autoRenewEnabled: missing"),
        (#"{"id":"u","subscriptions":[{"store":"appstore","originalTransactionId":"1","autoRenewEnabled":true},{"store":"appstore","originalTransactionId":"1","autoRenewEnabled":false}]}"#,
         "subscriptions[1].originalTransactionId: a second state for chain \"1\" (first at subscriptions[0])"),
        (#"{"id":"u","grants":[{"grantId":"g","entitlementId":"e","grantedDate":"2026-01-02T00:00:00Z","expirationDate":"2026-01-01T00:00:00Z"}]}"#,
         "grants[0].expirationDate: must be after grantedDate"),
        (#"{"id":"u","grants":[{"grantId":"g","entitlementId":"","grantedDate":"2026-01-02T00:00:00Z"}]}"#,
         "grants[0].entitlementId: must not be empty"),
    ]

    @Test("every input error names the line, the field and why", arguments: badLines)
    func errorNamesLineAndField(text: String, expected: String) {
        #expect {
            try CustomersFile.parseLine(Array(text.utf8), file: "customers.jsonl", line: 1042)
        } throws: { error in
            let description = "\(error)"
            let matches = description == "customers.jsonl:1042: \(expected)"
                || (expected == "not valid JSON" && description.hasPrefix("customers.jsonl:1042: not valid JSON"))
            if !matches {
                Issue.record("got: \(description)")
            }
            return matches
        }
    }
}

@Suite("catalog.json")
struct CatalogFileTests {
    @Test("the example catalog parses")
    func example() throws {
        let catalog = try CatalogFile.load(path: Examples.path("catalog.json"))
        #expect(catalog.products.map(\.id) == ["com.app.monthly", "com.app.annual", "com.app.lifetime", "com.app.coins"])
        #expect(catalog.products[1] == Product(id: "com.app.annual", type: .subscription, period: .annual, entitlements: ["premium", "pro"]))
        #expect(catalog.products[2].period == .unspecified)
    }

    static let badCatalogs: [(String, String)] = [
        (#"{}"#, "products: missing"),
        (#"{"products":[{"id":"a","type":"subscription","entitlements":[]}]}"#,
         "products[0].period: missing; a subscription needs weekly, monthly, quarterly, semiannual or annual"),
        (#"{"products":[{"id":"a","type":"consumable","period":"weekly","entitlements":[]}]}"#,
         "products[0].period: only subscriptions have a period"),
        (#"{"products":[{"id":"a","type":"nonConsumable","entitlements":[]},{"id":"a","type":"nonConsumable","entitlements":[]}]}"#,
         "products[1].id: duplicate product \"a\" (first at products[0])"),
        (#"{"products":[{"id":"a","type":"gift","entitlements":[]}]}"#,
         "products[0].type: unknown value \"gift\"; expected one of subscription, nonConsumable, consumable"),
        (#"{"products":[{"id":"a","type":"nonConsumable","entitlements":[""]}]}"#,
         "products[0].entitlements[0]: must not be empty"),
    ]

    @Test("catalog errors name the field", arguments: badCatalogs)
    func catalogError(text: String, expected: String) {
        #expect {
            try CatalogFile.parse(Array(text.utf8), file: "catalog.json")
        } throws: { error in
            "\(error)" == "catalog.json: \(expected)"
        }
    }
}

@Suite("customer directory")
struct CustomerDirectoryTests {
    @Test("the example customers load and aliases answer for their customer")
    func example() throws {
        let directory = try CustomerDirectory.load(path: Examples.path("customers.jsonl"))
        #expect(directory.count == 5)
        #expect(directory.customer(for: "$anon:abc")?.id == "user-1")
        #expect(directory.customer(for: "user-1")?.id == "user-1")
        #expect(directory.customer(for: "nobody") == nil)
    }

    static let claims: [(CustomerRecord, String)] = [
        (CustomerRecord(id: "a"), #"customers.jsonl:3: id: "a" is already a customer id (line 1)"#),
        (CustomerRecord(id: "x"), #"customers.jsonl:3: id: "x" is already an alias of customer "a" (line 1)"#),
        (CustomerRecord(id: "c", aliases: ["ok", "x"]), #"customers.jsonl:3: aliases[1]: "x" is already an alias of customer "a" (line 1)"#),
        (CustomerRecord(id: "c", aliases: ["b"]), #"customers.jsonl:3: aliases[0]: "b" is already a customer id (line 2)"#),
    ]

    @Test("two customers claiming one id or alias is an input error", arguments: claims)
    func conflictingClaim(record: CustomerRecord, expected: String) throws {
        var directory = CustomerDirectory()
        try directory.add(CustomerRecord(id: "a", aliases: ["x"]), line: 1)
        try directory.add(CustomerRecord(id: "b"), line: 2)
        #expect {
            try directory.add(record, line: 3)
        } throws: { error in
            "\(error)" == expected
        }
        #expect(directory.count == 2)
    }

    @Test("a bad line in a file names the file and its line number")
    func badLineInFile() throws {
        let path = FileManager.default.temporaryDirectory.appendingPathComponent("customers-\(UInt64.random(in: 0...UInt64.max)).jsonl").path
        defer { try? FileManager.default.removeItem(atPath: path) }
        try Data("{\"id\":\"a\"}\n\n{\"id\":\"b\",\"grants\":[{}]}\n".utf8).write(to: URL(fileURLWithPath: path))
        #expect {
            try CustomerDirectory.load(path: path)
        } throws: { error in
            "\(error)" == "\(path):3: grants[0].grantId: missing"
        }
    }

    @Test("a missing file is a clear error")
    func missingFile() {
        #expect {
            try CustomerDirectory.load(path: "/nonexistent/customers.jsonl")
        } throws: { error in
            "\(error)" == "/nonexistent/customers.jsonl: cannot open: No such file or directory"
        }
    }
}

enum Examples {
    static func path(_ name: String) -> String {
        URL(fileURLWithPath: #filePath)
            .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
            .appendingPathComponent("docs/examples/\(name)").path
    }
}
