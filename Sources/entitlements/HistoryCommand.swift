import ArgumentParser
import EntitlementsClient
import EntitlementsFormats
import EntitlementsMessages

/// `entitlements history`: a customer's timeline on a running server (CustomerHistory).
struct HistoryCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "history",
        abstract: "Show what happened to a customer: every write the server keeps, with its source, and the expiries between them.",
        discussion: "Oldest first. How far back it reaches is the server's --history-retention (docs/durability.md, \"History\")."
    )

    @OptionGroup var connection: ServerOptions

    @Option(help: "The customer id or alias (1 to 256 bytes, in Unicode NFC).")
    var user: String

    @Option(help: "At most this many entries, the latest (1 to 1000).")
    var limit: UInt32 = 1000

    @Option(help: "production or sandbox: whose transactions count for the entitlements shown.")
    var environment: String = "production"

    @Flag(help: "Print JSON instead of a timeline.")
    var json = false

    func validate() throws {
        if let problem = IdRule.problem(self.user) {
            throw ValidationError("--user \(problem)")
        }
        guard (1...1000).contains(self.limit) else {
            throw ValidationError("--limit must be 1 to 1000, got \(self.limit)")
        }
        guard Environment(jsonName: self.environment) != nil else {
            throw ValidationError("--environment must be production or sandbox, got \"\(self.environment)\"")
        }
    }

    func run() async throws {
        let client = try self.connection.makeClient()
        let request = CustomerHistoryRequest(userId: self.user, limit: self.limit, environment: Environment(jsonName: self.environment) ?? .production)
        do {
            let response: CustomerHistoryResponse = try await client.call(.customerHistory, request, timeout: self.connection.timeout)
            await client.close()
            print(self.json ? EntitlementsOutput.json(response, pretty: true) : EntitlementsOutput.timeline(response))
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
