import ArgumentParser
import EntitlementsStore
import EntitlementsFormats
import EntitlementsTools

/// `entitlements snapshot build | generate | inspect` (docs/snapshot-format.md).
struct SnapshotCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "snapshot",
        abstract: "Build, generate and inspect snapshot files.",
        subcommands: [Build.self, Generate.self, Inspect.self, SnapshotExportCommand.self]
    )

    struct Build: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Build a snapshot from catalog.json and customers.jsonl (docs/data-formats.md)."
        )

        @Option(help: "The catalog file.")
        var catalog: String

        @Option(help: "The customers file, one JSON object per line; streamed.")
        var customers: String

        @Option(help: "The snapshot to write; replaced atomically if it exists.")
        var output: String

        @Option(help: "A file of customer ids, one per line, hottest first: the hot list that warms the cache.")
        var hotList: String?

        func run() throws {
            var hot: [String] = []
            if let hotList = self.hotList {
                hot = try HotListFile.read(path: hotList)
            }
            let start = ContinuousClock.now
            let report = try SnapshotTools.build(
                catalogPath: self.catalog,
                customersPath: self.customers,
                outputPath: self.output,
                createdDate: WallClock.unixMilliseconds(),
                hotList: hot
            )
            print("wrote \(self.output): \(report.customers) customers, \(report.bytes) bytes, id \(report.snapshotId), in \(start.duration(to: .now))")
        }
    }

    struct Generate: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Generate realistic synthetic customers, deterministic per seed, as a snapshot or as JSON."
        )

        @Option(help: "How many customers.")
        var customers: Int

        @Option(help: "The random seed: the same seed, count and --now give the same data.")
        var seed: UInt64 = 1

        @Option(help: "The reference instant (RFC 3339) active subscriptions are active at. Default: today, 00:00 UTC.")
        var now: String?

        @Option(help: "The snapshot to write, or with --jsonl the customers.jsonl to write.")
        var output: String

        @Flag(help: "Write customers.jsonl (and catalog.json beside it) instead of a snapshot.")
        var jsonl = false

        @Option(help: "With --jsonl: where to write the catalog. Default: catalog.json beside --output.")
        var catalogOutput: String?

        func validate() throws {
            guard self.customers >= 0 else {
                throw ValidationError("--customers must be 0 or more, got \(self.customers)")
            }
            if let now = self.now, RFC3339.parse(now) == nil {
                throw ValidationError("--now \"\(now)\" is not an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z")
            }
        }

        func run() throws {
            let day: Int64 = 86_400_000
            let now = self.now.flatMap(RFC3339.parse) ?? WallClock.unixMilliseconds() / day * day
            let start = ContinuousClock.now
            if self.jsonl {
                let directory = self.output.contains("/") ? String(self.output[..<self.output.lastIndex(of: "/")!]) : "."
                let catalogPath = self.catalogOutput ?? directory + "/catalog.json"
                try SnapshotTools.generateJSON(count: self.customers, seed: self.seed, now: now, customersPath: self.output, catalogPath: catalogPath)
                print("wrote \(self.output) (\(self.customers) customers) and \(catalogPath) in \(start.duration(to: .now))")
            } else {
                let report = try SnapshotTools.generate(count: self.customers, seed: self.seed, now: now, outputPath: self.output)
                print("wrote \(self.output): \(report.customers) customers, \(report.bytes) bytes, id \(report.snapshotId), in \(start.duration(to: .now))")
            }
        }
    }

    struct Inspect: ParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Show a snapshot's header and counts, and verify its checksums."
        )

        @Argument(help: "The snapshot file.")
        var snapshot: String

        @Flag(inversion: .prefixedNo, help: "Also read every record and verify its checksum and index entry.")
        var verify = true

        func run() throws {
            print(try SnapshotTools.inspect(path: self.snapshot, verify: self.verify))
        }
    }
}
