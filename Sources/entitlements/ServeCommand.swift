import ArgumentParser
import Dispatch
import EntitlementsServer
import EntitlementsStore
import NIOPosix

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// `entitlements serve`: answer CheckEntitlements over TCP and/or a Unix socket.
struct ServeCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "serve",
        abstract: "Serve entitlement checks from a snapshot (docs/PROTOCOL.md).",
        discussion: "SIGINT or SIGTERM drains: GOAWAY to every connection, accepted requests are answered, then exit 0."
    )

    @Option(help: "The snapshot to serve (see `entitlements snapshot`). With --data-dir: the seed copied into a new data directory.")
    var snapshot: String?

    @Option(help: "The data directory: snapshot, write-ahead log, lock (docs/durability.md). Without it the server is read-only.")
    var dataDir: String?

    @Option(help: "When the log fsyncs: batch (group commit, default) or always (one fsync per write). Both are safe.")
    var fsync: String = "batch"

    @Option(help: "Compact when the log reaches this size, e.g. 64MiB; 0 compacts only when asked.")
    var compactAfter: String = "64MiB"

    @Option(help: "TCP address to listen on, HOST:PORT; port 0 picks a free port.")
    var listen: String = "127.0.0.1:7420"

    @Option(help: "Also listen on this Unix domain socket (for sidecars).")
    var unix: String?

    @Flag(help: "Do not listen on TCP (with --unix).")
    var noTcp = false

    @Option(help: "Resolver actors, each owning a cache shard. Default: CPU cores.")
    var resolvers: Int?

    @Option(help: "Cache budget, e.g. 64MiB, 1GiB or a number of bytes.")
    var cacheBytes: String = "256MiB"

    @Option(help: "The largest frame payload accepted, in bytes.")
    var maxFrameBytes: Int = 1 << 20

    func validate() throws {
        if self.snapshot == nil, self.dataDir == nil {
            throw ValidationError("give --snapshot FILE (read-only) or --data-dir DIR (with writes), or both to seed a new data directory")
        }
        guard WriteAheadLog.SyncMode(rawValue: self.fsync) != nil else {
            throw ValidationError("--fsync must be batch or always, got \"\(self.fsync)\"")
        }
        _ = try Self.parseBytes(self.compactAfter, flag: "--compact-after")
        if !self.noTcp {
            _ = try Self.parseAddress(self.listen)
        } else if self.unix == nil {
            throw ValidationError("--no-tcp needs --unix PATH, or the server would listen nowhere")
        }
        _ = try Self.parseBytes(self.cacheBytes, flag: "--cache-bytes")
        if let resolvers = self.resolvers, !(1...1_024).contains(resolvers) {
            throw ValidationError("--resolvers must be 1 to 1024, got \(resolvers)")
        }
        guard (1_024...(64 << 20)).contains(self.maxFrameBytes) else {
            throw ValidationError("--max-frame-bytes must be 1024 to 67108864, got \(self.maxFrameBytes)")
        }
    }

    func run() async throws {
        let store: CustomerStore
        do {
            if let dataDir = self.dataDir {
                let threshold = UInt64(try Self.parseBytes(self.compactAfter, flag: "--compact-after"))
                let options = CustomerStore.Options(
                    syncMode: WriteAheadLog.SyncMode(rawValue: self.fsync) ?? .batch,
                    compactAfterLogBytes: threshold == 0 ? nil : threshold
                )
                let started = ContinuousClock.now
                let (opened, report) = try CustomerStore.open(dataDirectory: dataDir, seed: self.snapshot, options: options)
                store = opened
                if report.seeded {
                    Self.say("data directory \(dataDir) seeded from \(self.snapshot ?? "-")")
                } else if self.snapshot != nil {
                    Self.say("data directory \(dataDir) has a snapshot already; --snapshot is ignored")
                }
                for path in report.removedTemporaryFiles {
                    Self.say("removed \(path), left by a compaction that did not finish")
                }
                if let torn = report.tornPath {
                    Self.say("log: dropped a torn last batch in \(torn) at offset \(report.tornOffset ?? 0) (\(report.tornBytes) bytes, never acknowledged)")
                }
                Self.say("log replayed: \(report.replayedRecords) writes applied (\(report.skippedRecords) already in the snapshot) in \(started.duration(to: .now))")
            } else {
                store = .readOnly(try SnapshotReader(path: self.snapshot!))
            }
        } catch {
            Self.say("error: cannot serve: \(error)")
            throw ExitCode(2)
        }
        let reader = store.snapshot
        let configuration = ServerConfiguration(
            tcp: self.noTcp ? nil : try Self.parseAddress(self.listen),
            unixSocketPath: self.unix,
            resolvers: self.resolvers,
            cacheBytes: try Self.parseBytes(self.cacheBytes, flag: "--cache-bytes"),
            maximumPayloadSize: self.maxFrameBytes
        )
        let server: EntitlementsServer
        do {
            server = try await EntitlementsServer.start(store: store, configuration: configuration, group: .singleton) { message in
                Self.say(message)
            }
        } catch {
            let places = [self.noTcp ? nil : self.listen, self.unix.map { "unix:\($0)" }].compactMap { $0 }.joined(separator: " and ")
            Self.say("error: cannot listen on \(places): \(error)")
            throw ExitCode(2)
        }
        let warm = server.pool.warmup
        Self.say("serving snapshot \(reader.header.snapshotId ?? "-") (\(reader.header.recordCount) customers) with \(server.pool.resolvers.count) resolvers, \(store.isWritable ? "writes on (fsync \(self.fsync))" : "read-only")")
        Self.say("cache warmed: \(warm.customersCached) customers, \(warm.bytes) bytes of \(configuration.cacheBytes)")
        if let address = server.tcpAddress {
            Self.say("listening on \(address.ipAddress ?? "?"):\(address.port ?? 0)")
        }
        if let path = server.unixSocketPath {
            Self.say("listening on unix:\(path)")
        }
        let signal = await Self.waitForSignal()
        Self.say("received \(signal == SIGTERM ? "SIGTERM" : "SIGINT"): draining")
        await server.shutdownGracefully()
        Self.say("stopped")
    }

    /// Writes a line to standard output unbuffered, so that a supervisor (or a test)
    /// reading a pipe sees "listening on" at once.
    static func say(_ text: String) {
        var line = text + "\n"
        line.withUTF8 { bytes in
            var offset = 0
            while offset < bytes.count {
                let written = write(1, bytes.baseAddress! + offset, bytes.count - offset)
                if written <= 0 { return }
                offset += written
            }
        }
    }

    static func waitForSignal() async -> Int32 {
        let stream = AsyncStream<Int32> { continuation in
            let sources = [SIGINT, SIGTERM].map { number in
                signal(number, SIG_IGN)
                let source = DispatchSource.makeSignalSource(signal: number, queue: .global())
                source.setEventHandler { continuation.yield(number) }
                source.resume()
                return source
            }
            let keeper = SignalSources(sources)
            continuation.onTermination = { _ in keeper.cancel() }
        }
        for await number in stream {
            return number
        }
        return SIGTERM
    }

    static func parseAddress(_ text: String) throws -> (host: String, port: Int) {
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]), (0...65_535).contains(port) else {
            throw ValidationError("--listen \"\(text)\" is not HOST:PORT (e.g. 127.0.0.1:7420, [::1]:7420)")
        }
        var host = String(text[..<colon])
        if host.hasPrefix("["), host.hasSuffix("]") {
            host = String(host.dropFirst().dropLast())
        }
        guard !host.isEmpty else {
            throw ValidationError("--listen \"\(text)\" has no host")
        }
        return (host, port)
    }

    static func parseBytes(_ text: String, flag: String) throws -> Int {
        let units: [(String, Int)] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1), ("", 1)]
        for (suffix, multiplier) in units where text.hasSuffix(suffix) {
            if let value = Int(text.dropLast(suffix.count)), value >= 0, value <= Int.max / multiplier {
                return value * multiplier
            }
        }
        throw ValidationError("\(flag) \"\(text)\" is not a size such as 64MiB, 1GiB or 1048576")
    }
}

/// Keeps the signal sources alive until the stream ends. `@unchecked Sendable` is safe:
/// the array is never mutated, and DispatchSource's cancel is thread-safe.
private final class SignalSources: @unchecked Sendable {
    private let sources: [any DispatchSourceSignal]

    init(_ sources: [any DispatchSourceSignal]) {
        self.sources = sources
    }

    func cancel() {
        self.sources.forEach { $0.cancel() }
    }
}
