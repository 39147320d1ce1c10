import ArgumentParser
import EntitlementsFormats
import EntitlementsMessages

/// The question of `check` and `resolve`: who, which entitlements, when, where, and how
/// to print the answer.
struct QueryOptions: ParsableArguments {
    @Option(help: "The customer id or alias (1 to 256 bytes, in Unicode NFC).")
    var user: String

    @Option(name: .customLong("entitlement"), help: "Only this entitlement; repeat for several. Default: all.")
    var entitlements: [String] = []

    @Option(help: "Evaluate at this instant, RFC 3339 (e.g. 2026-01-31T12:00:00Z). Default: now.")
    var at: String?

    @Option(help: "production or sandbox.")
    var environment: String = "production"

    @Flag(help: "Print the JSON output format instead of a table.")
    var json = false

    func validate() throws {
        if let problem = IdRule.problem(self.user) {
            throw ValidationError("--user \(problem)")
        }
        for entitlement in self.entitlements {
            if let problem = IdRule.problem(entitlement) {
                throw ValidationError("--entitlement \(entitlement.debugDescription): \(problem)")
            }
        }
        if let at = self.at, RFC3339.parse(at) == nil {
            throw ValidationError("--at \"\(at)\" is not an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z")
        }
        guard Environment(jsonName: self.environment) != nil else {
            throw ValidationError("--environment must be production or sandbox, got \"\(self.environment)\"")
        }
    }

    /// The --at instant, if given (validated already).
    var instant: Int64? { self.at.flatMap(RFC3339.parse) }

    var requestedEnvironment: Environment { Environment(jsonName: self.environment) ?? .production }

    /// The answer as the table or the JSON output.
    func render(_ response: CheckEntitlementsResponse) -> String {
        self.json ? EntitlementsOutput.json(response) : EntitlementsOutput.table(response)
    }
}
