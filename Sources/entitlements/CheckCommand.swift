import ArgumentParser
import EntitlementsClient
import EntitlementsFormats
import EntitlementsMessages

/// `entitlements check`: ask a running server what a user may use.
struct CheckCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "check",
        abstract: "Check a user's entitlements on a running server."
    )

    @OptionGroup var connection: ServerOptions

    @OptionGroup var query: QueryOptions

    @Option(name: .customLong("min-seq"), help: "Read your writes: answer only once the server has applied this log sequence (a write's logSequence).")
    var minimumSequence: UInt64?

    @Flag(help: "Explain the answer: every candidate of every entitlement, whether it counted and was active and why not, what won by which rule (read from the customer's record, not the cache).")
    var explain = false

    func run() async throws {
        let client = try self.connection.makeClient()
        let request = CheckEntitlementsRequest(
            userId: self.query.user,
            entitlementIds: self.query.entitlements,
            at: self.query.instant,
            environment: self.query.requestedEnvironment,
            minLogSequence: self.minimumSequence ?? 0,
            explain: self.explain
        )
        do {
            let response = try await client.checkEntitlements(request, timeout: self.connection.timeout)
            await client.close()
            print(self.query.render(response))
            if let explanation = response.explanation, !self.query.json {
                print("")
                print(EntitlementsOutput.tree(explanation))
            }
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
