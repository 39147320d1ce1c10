import ArgumentParser
import EntitlementsClient
import EntitlementsFormats
import EntitlementsMessages

/// `entitlements watch`: print an event whenever a watched customer's answer changes.
struct WatchCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "watch",
        abstract: "Print entitlement changes as they happen (writes, and expirations as their time comes).",
        discussion: "Runs until interrupted, or until the server ends the stream (then exit status 1)."
    )

    @OptionGroup var connection: ServerOptions

    @Option(name: .customLong("user"), help: "A customer id or alias to watch; repeat for several.")
    var users: [String] = []

    @Flag(help: "Watch every customer (write events; time events for customers written while watching).")
    var all = false

    @Option(name: .customLong("entitlement"), help: "Only this entitlement; repeat for several. Default: all.")
    var entitlements: [String] = []

    @Option(help: "production or sandbox.")
    var environment: String = "production"

    @Flag(help: "Print one JSON object per line.")
    var json = false

    func validate() throws {
        guard self.all != !self.users.isEmpty else {
            throw ValidationError("give --user ID (repeatable) or --all")
        }
        guard Environment(jsonName: self.environment) != nil else {
            throw ValidationError("--environment must be production or sandbox, got \"\(self.environment)\"")
        }
    }

    func run() async throws {
        let client = try self.connection.makeClient()
        let request = WatchEntitlementsRequest(
            userIds: self.users,
            allCustomers: self.all,
            entitlementIds: self.entitlements,
            environment: Environment(jsonName: self.environment) ?? .production
        )
        do {
            for try await event in try await client.watch(request) {
                ServeCommand.say(self.json ? EntitlementsOutput.json(event) : EntitlementsOutput.line(event))
            }
            await client.close()
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
