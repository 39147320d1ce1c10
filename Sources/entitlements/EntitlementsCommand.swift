import ArgumentParser
import EntitlementsStore

/// `entitlements`: the one executable of the service (server, client and tools).
@main
struct EntitlementsCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "entitlements",
        abstract: "An entitlement check service: what may user X use right now?",
        version: "0.1.0",
        subcommands: [
            ServeCommand.self, CheckCommand.self, WatchCommand.self,
            RecordTransactionCommand.self, UpdateSubscriptionCommand.self, GrantCommand.self, RevokeGrantCommand.self,
            LinkAliasCommand.self, DeleteCustomerCommand.self, SubmitPurchaseCommand.self, AppStoreCommand.self, CompactCommand.self, HealthCommand.self, HistoryCommand.self,
            SnapshotCommand.self, DatabaseCommand.self, ResolveCommand.self, DemoCommand.self, EventsCommand.self,
        ]
    )

    /// One malloc arena for the whole process (``ProcessMemory/useOneMallocArena()``), set
    /// here, on the main thread before any other starts: by the time a command's `run` is
    /// called, a thread of Swift's pool already has an arena of its own.
    static func main() async {
        ProcessMemory.useOneMallocArena()
        await Self.main(nil)
    }
}
