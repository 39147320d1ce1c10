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

    @Option(help: "The server's TCP address, HOST:PORT.")
    var server: String = "127.0.0.1:7420"

    @Option(help: "Connect to this Unix domain socket instead of --server.")
    var unix: String?

    @OptionGroup var query: QueryOptions

    @Option(help: "How long to wait for the answer, in milliseconds.")
    var timeoutMs: Int = 2_000

    func validate() throws {
        if self.unix == nil {
            _ = try ServeCommand.parseAddress(self.server)
        }
        guard self.timeoutMs > 0 else {
            throw ValidationError("--timeout-ms must be positive")
        }
    }

    func run() async throws {
        let address: EntitlementsServerAddress
        if let unix = self.unix {
            address = .unixSocket(path: unix)
        } else {
            let (host, port) = try ServeCommand.parseAddress(self.server)
            address = .tcp(host: host, port: port)
        }
        let client = EntitlementsClient(
            configuration: .init(server: address, initialBackoff: .milliseconds(1), maximumBackoff: .milliseconds(1))
        )
        let request = CheckEntitlementsRequest(
            userId: self.query.user,
            entitlementIds: self.query.entitlements,
            at: self.query.instant,
            environment: self.query.requestedEnvironment
        )
        do {
            let response = try await client.checkEntitlements(request, timeout: .milliseconds(self.timeoutMs))
            await client.close()
            print(self.query.render(response))
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
