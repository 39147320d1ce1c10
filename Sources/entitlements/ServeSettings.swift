import ArgumentParser
import EntitlementsFleet
import EntitlementsServer
import EntitlementsStore
import Foundation
import Logging
import NIOCore
import NIOPosix

/// The settings of `serve`, from flags, `ENTITLEMENTS_*` environment variables and an
/// optional JSON config file, in that order of precedence, each validated with a message
/// that names where the bad value came from (docs/operations.md).
struct ServeSettings {
    /// One setting: its key (the flag without `--`), its default, and what it means.
    struct Key: Sendable {
        var name: String
        var defaultValue: String?
        var help: String
        /// The variable, when it is not ENTITLEMENTS_ and the name in capitals.
        var variable: String? = nil

        var environmentName: String { self.variable ?? "ENTITLEMENTS_" + self.name.uppercased().replacingOccurrences(of: "-", with: "_") }
    }

    static let keys: [Key] = [
        Key(name: "snapshot", defaultValue: nil, help: "snapshot to serve read-only, or to seed a new data directory"),
        Key(name: "data-dir", defaultValue: nil, help: "data directory: snapshot, write-ahead log, lock; enables writes"),
        Key(name: "fsync", defaultValue: "batch", help: "batch (group commit) or always (one fsync per write); both safe"),
        Key(name: "compact-after", defaultValue: "64MiB", help: "compact when the log reaches this size; 0: only on request"),
        Key(name: "listen", defaultValue: "127.0.0.1:7420", help: "TCP address HOST:PORT; port 0 picks one"),
        Key(name: "unix", defaultValue: nil, help: "also listen on this Unix domain socket"),
        Key(name: "no-tcp", defaultValue: "false", help: "listen only on --unix"),
        Key(name: "threads", defaultValue: "\(System.coreCount)", help: "event loop threads for connections and resolvers; default: CPU cores"),
        Key(name: "resolvers", defaultValue: "\(System.coreCount)", help: "resolver actors (cache shards); default: CPU cores"),
        Key(name: "cache-bytes", defaultValue: "256MiB", help: "cache budget across all resolvers"),
        Key(name: "max-frame-bytes", defaultValue: "1048576", help: "largest request payload"),
        Key(name: "max-connections", defaultValue: "10000", help: "connections open at once; more are refused with RESOURCE_EXHAUSTED"),
        Key(name: "max-in-flight", defaultValue: "1024", help: "calls in flight per connection before the server stops reading it"),
        Key(name: "max-batch", defaultValue: "1000", help: "users in one BatchCheckEntitlements or watch"),
        Key(name: "max-watches", defaultValue: "1024", help: "WatchEntitlements streams open at once"),
        Key(name: "watch-buffer", defaultValue: "1024", help: "events a watch holds while its client does not read, before it is ended"),
        Key(name: "idle-timeout", defaultValue: "300s", help: "close connections idle this long (GOAWAY first)"),
        Key(name: "frame-timeout", defaultValue: "10s", help: "a frame must arrive in full this long after its first byte"),
        Key(name: "drain-timeout", defaultValue: "30s", help: "on SIGTERM/SIGINT, time to finish accepted calls before cancelling"),
        Key(name: "admin", defaultValue: nil, help: "admin HTTP listener HOST:PORT for /healthz, /readyz, /metrics; off by default"),
        Key(name: "grpc-listen", defaultValue: nil, help: "the gRPC and HTTP/JSON door HOST:PORT (docs/doors.md); off by default"),
        Key(name: "log-level", defaultValue: "info", help: "trace, debug, info, notice, warning, error or critical"),
        Key(name: "min-sequence-wait", defaultValue: "100ms", help: "how long a check with min_log_sequence waits for this server to apply it"),
        Key(name: "postgres", defaultValue: nil, help: "fleet mode: the shared PostgreSQL database, postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE (docs/fleet.md)", variable: "ENTITLEMENTS_POSTGRES_URL"),
        Key(name: "fleet-poll-interval", defaultValue: "250ms", help: "fleet mode: how often the change log is polled when no NOTIFY arrives"),
        Key(name: "fleet-listen", defaultValue: "true", help: "fleet mode: LISTEN for the writers' NOTIFY (false: polling only)"),
        Key(name: "fleet-connections", defaultValue: "4", help: "fleet mode: connections to PostgreSQL for writes and polls, 1 to 100 (LISTEN takes one more)"),
        Key(name: "fleet-read-url", defaultValue: nil, help: "fleet mode: a read replica of --postgres to poll and to export from at a fresh start (writes, LISTEN and start-up checks stay on --postgres)"),
        Key(name: "max-staleness", defaultValue: "30s", help: "fleet mode: past this long since the last successful poll of PostgreSQL, check answers are stale (--stale-policy)"),
        Key(name: "stale-policy", defaultValue: "open", help: "fleet mode: what a stale server does with checks: open (answer, flagged stale) or closed (UNAVAILABLE; Health and /readyz not serving)"),
        Key(name: "fleet-write-wait", defaultValue: "1s", help: "fleet mode: how long a write waits, after COMMIT, for this server to apply it"),
    ]

    /// A value and where it came from.
    struct Value {
        var text: String
        var source: String

        /// How an error names the value's origin: `--flag`, `ENV_NAME` or `file: key`.
        var origin: String
    }

    private(set) var values: [String: Value] = [:]

    /// A config file value: a string, a whole number or a boolean.
    private struct Scalar: Decodable {
        var text: String

        init(from decoder: any Decoder) throws {
            let container = try decoder.singleValueContainer()
            if let flag = try? container.decode(Bool.self) {
                self.text = flag ? "true" : "false"
            } else if let number = try? container.decode(Int.self) {
                self.text = String(number)
            } else {
                self.text = try container.decode(String.self)
            }
        }
    }

    /// Layers `file` (a JSON object of key: value), then `environment`, then `flags`.
    init(flags: [String: String], environment: [String: String], configFile: String?) throws {
        if let configFile {
            let data: Data
            do {
                data = try Data(contentsOf: URL(fileURLWithPath: configFile))
            } catch {
                throw ValidationError("--config \(configFile): cannot read it (\(error.localizedDescription))")
            }
            let object: [String: Scalar]
            do {
                object = try JSONDecoder().decode([String: Scalar].self, from: data)
            } catch {
                throw ValidationError("--config \(configFile): not a JSON object of settings (strings, numbers, booleans), e.g. {\"listen\": \"127.0.0.1:7420\"}")
            }
            for (name, scalar) in object {
                guard Self.keys.contains(where: { $0.name == name }) else {
                    throw ValidationError("\(configFile): unknown setting \"\(name)\"; the settings are \(Self.keys.map(\.name).joined(separator: ", "))")
                }
                self.values[name] = Value(text: scalar.text, source: "config file \(configFile)", origin: "\(configFile): \(name)")
            }
        }
        for key in Self.keys {
            if let text = environment[key.environmentName] {
                self.values[key.name] = Value(text: text, source: "environment", origin: key.environmentName)
            }
        }
        for (name, text) in flags {
            self.values[name] = Value(text: text, source: "flag", origin: "--\(name)")
        }
        for key in Self.keys where self.values[key.name] == nil {
            if let value = key.defaultValue {
                self.values[key.name] = Value(text: value, source: "default", origin: "--\(key.name)")
            }
        }
    }

    func text(_ name: String) -> String? { self.values[name]?.text }

    private func origin(_ name: String) -> String { self.values[name]?.origin ?? "--\(name)" }

    func bool(_ name: String) throws -> Bool {
        switch self.text(name) {
        case nil, "false", "0", "no": return false
        case "true", "1", "yes": return true
        case let other?: throw ValidationError("\(self.origin(name)) \"\(other)\" is not true or false")
        }
    }

    func integer(_ name: String, in range: ClosedRange<Int>) throws -> Int {
        guard let text = self.text(name), let value = Int(text), range.contains(value) else {
            throw ValidationError("\(self.origin(name)) must be \(range.lowerBound) to \(range.upperBound), got \"\(self.text(name) ?? "")\"")
        }
        return value
    }

    func bytes(_ name: String) throws -> Int {
        let text = self.text(name) ?? ""
        let units: [(String, Int)] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1), ("", 1)]
        for (suffix, multiplier) in units where text.hasSuffix(suffix) {
            if let value = Int(text.dropLast(suffix.count)), value >= 0, value <= Int.max / multiplier {
                return value * multiplier
            }
        }
        throw ValidationError("\(self.origin(name)) \"\(text)\" is not a size such as 64MiB, 1GiB or 1048576")
    }

    func duration(_ name: String) throws -> TimeAmount {
        let text = self.text(name) ?? ""
        let units: [(String, Int64)] = [("ms", 1_000_000), ("s", 1_000_000_000), ("m", 60_000_000_000), ("h", 3_600_000_000_000)]
        for (suffix, nanoseconds) in units where text.hasSuffix(suffix) {
            if let value = Int64(text.dropLast(suffix.count)), value > 0, value <= Int64.max / nanoseconds {
                return .nanoseconds(value * nanoseconds)
            }
        }
        throw ValidationError("\(self.origin(name)) \"\(text)\" is not a duration such as 250ms, 30s, 5m or 1h")
    }

    func address(_ name: String) throws -> (host: String, port: Int)? {
        guard let text = self.text(name) else {
            return nil
        }
        return try Self.parseAddress(text, origin: self.origin(name))
    }

    /// `HOST:PORT` or `[IPv6]:PORT`; `origin` names the flag or variable in errors.
    static func parseAddress(_ text: String, origin: String) throws -> (host: String, port: Int) {
        guard let colon = text.lastIndex(of: ":"), let port = Int(text[text.index(after: colon)...]), (0...65_535).contains(port) else {
            throw ValidationError("\(origin) \"\(text)\" is not HOST:PORT (e.g. 127.0.0.1:7420, [::1]:7420)")
        }
        var host = String(text[..<colon])
        if host.hasPrefix("["), host.hasSuffix("]") {
            host = String(host.dropFirst().dropLast())
        }
        guard !host.isEmpty else {
            throw ValidationError("\(origin) \"\(text)\" has no host")
        }
        return (host, port)
    }

    // MARK: The typed settings

    var snapshot: String? { self.text("snapshot") }
    var dataDirectory: String? { self.text("data-dir") }

    /// Fleet mode's database, if `--postgres` is set.
    func fleetURL() throws -> FleetDatabaseURL? {
        try self.databaseURL("postgres")
    }

    /// Fleet mode: the read replica to poll and export from, if given.
    func fleetReadURL() throws -> FleetDatabaseURL? {
        try self.databaseURL("fleet-read-url")
    }

    private func databaseURL(_ name: String) throws -> FleetDatabaseURL? {
        guard let text = self.text(name) else {
            return nil
        }
        do {
            return try FleetDatabaseURL(text)
        } catch {
            throw ValidationError("\(self.origin(name)): \(error)")
        }
    }

    func syncMode() throws -> WriteAheadLog.SyncMode {
        guard let mode = WriteAheadLog.SyncMode(rawValue: self.text("fsync") ?? "") else {
            throw ValidationError("\(self.origin("fsync")) must be batch or always, got \"\(self.text("fsync") ?? "")\"")
        }
        return mode
    }

    func logLevel() throws -> Logger.Level {
        guard let level = Logger.Level(rawValue: self.text("log-level") ?? "") else {
            throw ValidationError("\(self.origin("log-level")) must be trace, debug, info, notice, warning, error or critical, got \"\(self.text("log-level") ?? "")\"")
        }
        return level
    }

    /// The server configuration; throws the first invalid setting.
    func serverConfiguration() throws -> ServerConfiguration {
        let noTCP = try self.bool("no-tcp")
        if self.text("fleet-read-url") != nil, self.text("postgres") == nil {
            throw ValidationError("--fleet-read-url needs --postgres URL: the replica is read, the primary takes the writes")
        }
        if self.text("postgres") != nil {
            guard self.dataDirectory != nil else {
                throw ValidationError("--postgres needs --data-dir DIR: a fleet server keeps its copy of the change log there (docs/fleet.md)")
            }
            _ = try self.fleetURL()
            _ = try self.fleetReadURL()
            _ = try self.duration("fleet-poll-interval")
            _ = try self.duration("fleet-write-wait")
            _ = try self.bool("fleet-listen")
            _ = try self.integer("fleet-connections", in: 1...100)
            let poll = try self.duration("fleet-poll-interval")
            let staleness = try self.duration("max-staleness")
            guard staleness > poll else {
                throw ValidationError("\(self.origin("max-staleness")) \"\(self.text("max-staleness") ?? "")\" must be longer than --fleet-poll-interval \"\(self.text("fleet-poll-interval") ?? "")\", or every answer would be stale")
            }
            _ = try self.stalePolicy()
        }
        if self.snapshot == nil, self.dataDirectory == nil {
            throw ValidationError("give --snapshot FILE (read-only) or --data-dir DIR (with writes), or both to seed a new data directory")
        }
        if noTCP, self.text("unix") == nil {
            throw ValidationError("--no-tcp needs --unix PATH, or the server would listen nowhere")
        }
        _ = try self.syncMode()
        _ = try self.bytes("compact-after")
        _ = try self.duration("drain-timeout")
        _ = try self.address("admin")
        _ = try self.address("grpc-listen")
        _ = try self.logLevel()
        _ = try self.integer("threads", in: 1...1_024)
        return ServerConfiguration(
            tcp: noTCP ? nil : try self.address("listen"),
            unixSocketPath: self.text("unix"),
            resolvers: try self.integer("resolvers", in: 1...1_024),
            cacheBytes: try self.bytes("cache-bytes"),
            maximumPayloadSize: try self.integer("max-frame-bytes", in: 1_024...(64 << 20)),
            maximumInFlightPerConnection: try self.integer("max-in-flight", in: 1...1_000_000),
            maximumBatchSize: try self.integer("max-batch", in: 1...100_000),
            maximumWatchStreams: try self.integer("max-watches", in: 0...1_000_000),
            watchBufferEvents: try self.integer("watch-buffer", in: 1...1_000_000),
            maximumConnections: try self.integer("max-connections", in: 1...1_000_000),
            idleTimeout: try self.duration("idle-timeout"),
            frameTimeout: try self.duration("frame-timeout"),
            minimumSequenceWait: try self.duration("min-sequence-wait"),
            // Only a fleet server has an upstream to be stale against.
            maximumStaleness: self.text("postgres") == nil ? nil : try self.duration("max-staleness"),
            stalePolicy: self.text("postgres") == nil ? .open : try self.stalePolicy()
        )
    }

    func stalePolicy() throws -> ServerConfiguration.StalePolicy {
        guard let policy = ServerConfiguration.StalePolicy(rawValue: self.text("stale-policy") ?? "") else {
            throw ValidationError("\(self.origin("stale-policy")) must be open or closed, got \"\(self.text("stale-policy") ?? "")\"")
        }
        return policy
    }

    /// The effective settings, one per line with where each came from.
    var printed: String {
        Self.keys.map { key in
            let value = self.values[key.name]
            var text = value?.text ?? "(none)"
            if key.name == "postgres" || key.name == "fleet-read-url", let url = try? self.databaseURL(key.name) {
                text = "\(url)"  // never the password
            }
            return "\(key.name) = \(text)  # \(value?.source ?? "default")"
        }.joined(separator: "\n")
    }
}
