import EntitlementsFormats
import EntitlementsMessages
import Foundation
import Testing

import EntitlementsResolver

/// The examples in docs/ are real: the files in docs/examples resolve to the output the
/// docs show.
@Suite("docs examples")
struct DocsExampleTests {
    static let examples = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("docs/examples")

    @Test("user-2 at 2026-02-18 resolves to docs/examples/user-2-at-2026-02-18.json")
    func stripePastDueExample() throws {
        let catalog = try CatalogFile.load(path: Self.examples.appendingPathComponent("catalog.json").path)
        let directory = try CustomerDirectory.load(path: Self.examples.appendingPathComponent("customers.jsonl").path)
        let instant = try #require(RFC3339.parse("2026-02-18T00:00:00Z"))
        let customer = directory.customer(for: "user-2")
        let response = EntitlementResolver(catalog: catalog)
            .resolve(customer, at: instant)
            .response(userId: "user-2", customerId: customer?.id, requestDate: instant)
        let expected = try String(contentsOf: Self.examples.appendingPathComponent("user-2-at-2026-02-18.json"), encoding: .utf8)
        #expect(EntitlementsOutput.json(response) + "\n" == expected)
    }
}
