import ArgumentParser
import EntitlementsFormats
import EntitlementsMessages
import EntitlementsResolver

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

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

    @Option(help: "The customer id or alias to resolve (1 to 256 bytes).")
    var user: String

    @Option(name: .customLong("entitlement"), help: "Only this entitlement; repeat for several. Default: all.")
    var entitlements: [String] = []

    @Option(help: "The instant to evaluate at, RFC 3339 (e.g. 2026-01-31T12:00:00Z). Default: now.")
    var at: String?

    @Option(help: "production or sandbox.")
    var environment: String = "production"

    @Flag(help: "Print the JSON output format instead of a table.")
    var json = false

    func validate() throws {
        guard !self.user.isEmpty, self.user.utf8.count <= 256 else {
            throw ValidationError("--user must be 1 to 256 bytes, got \(self.user.utf8.count)")
        }
        if let at = self.at, RFC3339.parse(at) == nil {
            throw ValidationError("--at \"\(at)\" is not an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z")
        }
        guard Environment(jsonName: self.environment) != nil else {
            throw ValidationError("--environment must be production or sandbox, got \"\(self.environment)\"")
        }
    }

    func run() throws {
        let instant = self.at.flatMap(RFC3339.parse) ?? Self.now()
        let environment = Environment(jsonName: self.environment) ?? .production
        // An InputError names file, line and field; ArgumentParser prints it and exits 1.
        let catalog = try CatalogFile.load(path: self.catalog)
        let directory = try CustomerDirectory.load(path: self.customers)
        let customer = directory.customer(for: self.user)
        let resolution = EntitlementResolver(catalog: catalog)
            .resolve(customer, at: instant, environment: environment, entitlementIds: self.entitlements)
        let response = resolution.response(userId: self.user, customerId: customer?.id, requestDate: instant)
        print(self.json ? EntitlementsOutput.json(response) : EntitlementsOutput.table(response))
    }

    static func now() -> Int64 {
        var spec = timespec()
        clock_gettime(CLOCK_REALTIME, &spec)
        return Int64(spec.tv_sec) * 1_000 + Int64(spec.tv_nsec) / 1_000_000
    }
}
