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

    @Option(help: "The customer id or alias (1 to 256 bytes).")
    var user: String

    @Option(name: .customLong("entitlement"), help: "Only this entitlement; repeat for several. Default: all.")
    var entitlements: [String] = []

    @Option(help: "Evaluate at this instant, RFC 3339. Default: now.")
    var at: String?

    @Option(help: "production or sandbox.")
    var environment: String = "production"

    @Option(help: "How long to wait for the answer, in milliseconds.")
    var timeoutMs: Int = 2_000

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
            userId: self.user,
            entitlementIds: self.entitlements,
            at: self.at.flatMap(RFC3339.parse),
            environment: Environment(jsonName: self.environment) ?? .production
        )
        do {
            let response = try await client.checkEntitlements(request, timeout: .milliseconds(self.timeoutMs))
            await client.close()
            print(self.json ? EntitlementsOutput.json(response) : EntitlementsOutput.table(response))
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
