import ArgumentParser
import EntitlementsStore
import EntitlementsFormats
import EntitlementsMessages
import EntitlementsResolver

/// `entitlements resolve`: answer a check offline, straight from the JSON input files.
/// For trying out the rules and checking data; the server answers the same question from
/// a snapshot.
struct ResolveCommand: ParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "resolve",
        abstract: "Resolve a user's entitlements from catalog.json and customers.jsonl, without a server.",
        discussion: "The input formats and the rules are in docs/data-formats.md and docs/entitlement-rules.md."
    )

    @Option(help: "The catalog file.")
    var catalog: String

    @Option(help: "The customers file, one JSON object per line.")
    var customers: String

    @OptionGroup var query: QueryOptions

    func run() throws {
        let instant = self.query.instant ?? WallClock.unixMilliseconds()
        // An InputError names file, line and field; ArgumentParser prints it and exits 1.
        let catalog = try CatalogFile.load(path: self.catalog)
        let directory = try CustomerDirectory.load(path: self.customers)
        let customer = directory.customer(for: self.query.user)
        let resolution = EntitlementResolver(catalog: catalog)
            .resolve(customer, at: instant, environment: self.query.requestedEnvironment, entitlementIds: self.query.entitlements)
        let response = resolution.response(userId: self.query.user, customerId: customer?.id, requestDate: instant)
        print(self.query.render(response))
    }
}
