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

    func run() async throws {
        let client = try self.connection.makeClient()
        let request = CheckEntitlementsRequest(
            userId: self.query.user,
            entitlementIds: self.query.entitlements,
            at: self.query.instant,
            environment: self.query.requestedEnvironment
        )
        do {
            let response = try await client.checkEntitlements(request, timeout: self.connection.timeout)
            await client.close()
            print(self.query.render(response))
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
