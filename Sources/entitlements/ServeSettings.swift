import ArgumentParser
import EntitlementsFleet
import EntitlementsIngestion
import EntitlementsSecurity
import EntitlementsServer
import EntitlementsCache
import EntitlementsEvents
import EntitlementsMessages
import EntitlementsStore
import EntitlementsTracing
import Foundation
import Logging
import Metrics
import NIOCore
import NIOPosix

/// Every listener's security, and the files they share (reloaded together on SIGHUP).
struct ServeSecurity {
    var tcp: ListenerSecurity
    var unix: ListenerSecurity
    var grpc: ListenerSecurity
    var admin: ListenerSecurity
    /// The store webhooks: TLS when --tls-cert is set, without client certificates; no
    /// tokens (each event's signature authenticates it).
    var webhooks: ListenerSecurity
    var tokens: AccessTokens?
    var tls: ServerTLS?
}

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
        Key(name: "history-retention", defaultValue: "7d", help: "how far back a customer's history reaches at least: what compaction keeps in DIR/history; 0 keeps nothing"),
        Key(name: "listen", defaultValue: "127.0.0.1:7420", help: "TCP address HOST:PORT; port 0 picks one"),
        Key(name: "unix", defaultValue: nil, help: "also listen on this Unix domain socket"),
        Key(name: "no-tcp", defaultValue: "false", help: "listen only on --unix"),
        Key(name: "threads", defaultValue: "\(System.coreCount)", help: "event loop threads for connections and resolvers; default: CPU cores"),
        Key(name: "resolvers", defaultValue: "\(System.coreCount)", help: "resolver actors (cache shards); default: CPU cores"),
        Key(name: "cache-bytes", defaultValue: "256MiB", help: "cache budget across all resolvers"),
        Key(name: "cache-policy", defaultValue: "tinylfu", help: "what a full cache keeps: tinylfu (the answers asked for most often) or lru (the most recent)"),
        Key(name: "cold-read-threads", defaultValue: "8", help: "threads that read cache misses off the event loops; 0 reads them on the loop"),
        Key(name: "cold-read-queue", defaultValue: "1024", help: "cache misses read or waiting at once; more are refused with RESOURCE_EXHAUSTED"),
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
        Key(name: "console", defaultValue: "false", help: "serve the support console at /console on the admin listener (docs/console.md)"),
        Key(name: "grpc-listen", defaultValue: nil, help: "the gRPC and HTTP/JSON door HOST:PORT (docs/doors.md); off by default"),
        Key(name: "webhooks-listen", defaultValue: nil, help: "the store webhooks' HTTP HOST:PORT (docs/ingestion.md); off by default"),
        Key(name: "stripe-webhook-secret-file", defaultValue: nil, help: "Stripe's endpoint signing secrets, one a line; turns on POST /webhooks/stripe"),
        Key(name: "stripe-customer-key", defaultValue: "user_id", help: "the metadata key naming the user id on Stripe subscriptions and customers"),
        Key(name: "appstore-root-cert", defaultValue: nil, help: "Apple Root CA - G3 (PEM or DER) App Store notifications must chain to; turns on POST /webhooks/appstore"),
        Key(name: "appstore-bundle-id", defaultValue: nil, help: "the app bundle ids whose App Store notifications are accepted, comma-separated"),
        Key(name: "appstore-api-key", defaultValue: nil, help: "the App Store Server API's in-app purchase key (.p8): reads renewal states, histories and missed notifications from Apple (docs/ingestion.md)"),
        Key(name: "appstore-key-id", defaultValue: nil, help: "the id of --appstore-api-key, from App Store Connect"),
        Key(name: "appstore-issuer-id", defaultValue: nil, help: "your team's issuer id for the App Store Server API, from App Store Connect"),
        Key(name: "appstore-api-url", defaultValue: "https://api.storekit.itunes.apple.com", help: "the App Store Server API's production base URL (a test's fake)"),
        Key(name: "appstore-sandbox-api-url", defaultValue: "https://api.storekit-sandbox.itunes.apple.com", help: "the App Store Server API's sandbox base URL (a test's fake)"),
        Key(name: "appstore-recheck-interval", defaultValue: "15m", help: "with --appstore-api-key, how often the customers are scanned for App Store chains whose notice never came (off: never)"),
        Key(name: "appstore-recheck-rate", defaultValue: "60", help: "the most App Store Server API reads a minute the recheck makes, 1 to 3000"),
        Key(name: "googleplay-package", defaultValue: nil, help: "the Android package names whose Google Play notifications are accepted, comma-separated (docs/ingestion.md)"),
        Key(name: "googleplay-service-account", defaultValue: nil, help: "the Google service account's JSON key file, as Google issues it: reads purchases with the Play Developer API, pulls from Pub/Sub"),
        Key(name: "googleplay-api-url", defaultValue: "https://androidpublisher.googleapis.com", help: "the Play Developer API's base URL (a private proxy, or a test's fake)"),
        Key(name: "googleplay-push-audience", defaultValue: nil, help: "the audience of the Pub/Sub push subscription's tokens; turns on POST /webhooks/googleplay"),
        Key(name: "googleplay-push-service-account", defaultValue: nil, help: "the service account email the Pub/Sub push tokens must name"),
        Key(name: "googleplay-jwks-url", defaultValue: "https://www.googleapis.com/oauth2/v3/certs", help: "Google's keys for the Pub/Sub push tokens"),
        Key(name: "googleplay-pubsub-subscription", defaultValue: nil, help: "pull the notifications from this Pub/Sub subscription, projects/P/subscriptions/S, instead of (or as well as) push"),
        Key(name: "googleplay-pubsub-url", defaultValue: "https://pubsub.googleapis.com", help: "Pub/Sub's base URL for pull (a test's fake, or a private endpoint)"),
        Key(name: "event-webhook", defaultValue: nil, help: "POST a signed event to this URL when a customer's access changes (docs/events.md); repeatable, or space-separated"),
        Key(name: "event-webhook-secret-file", defaultValue: nil, help: "the signing secrets of the --event-webhook destinations, one a line; each POST is signed with each"),
        Key(name: "event-retry-max-interval", defaultValue: "10m", help: "the longest wait between two attempts to deliver an event (they start at 1s and double)"),
        Key(name: "event-retry-horizon", defaultValue: "72h", help: "how long an event is retried after its first attempt before it is given up"),
        Key(name: "event-outbox-limit", defaultValue: "1GiB", help: "the most bytes of undelivered events kept in DATA-DIR/events; past it the oldest are dropped, loudly"),
        Key(name: "otlp-endpoint", defaultValue: nil, help: "send a span per call to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (docs/tracing.md); off by default"),
        Key(name: "trace-sample-ratio", defaultValue: "0.01", help: "the share of the traces this server starts that it records, 0 to 1; a caller's sampled trace is always recorded"),
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
        Key(name: "auth-token-file", defaultValue: nil, help: "accepted tokens, one a line: TOKEN [check|write|check,write] (docs/security.md); reloaded on change and on SIGHUP"),
        Key(name: "allow-unauthenticated-writes", defaultValue: "false", help: "let a listener on a non-loopback address take writes from callers without credentials (protected mode off)"),
        Key(name: "listen-permissions", defaultValue: "check,write", help: "what the TCP listener serves at all: none, check, write or check,write"),
        Key(name: "listen-anonymous", defaultValue: nil, help: "what a caller without credentials may do on the TCP listener; default check with --auth-token-file or --tls-client-ca, else check,write"),
        Key(name: "unix-permissions", defaultValue: "check,write", help: "what the Unix socket serves at all"),
        Key(name: "unix-anonymous", defaultValue: "check,write", help: "what a caller without credentials may do on the Unix socket (its file mode decides who can connect)"),
        Key(name: "unix-mode", defaultValue: "0660", help: "the Unix socket file's mode, octal"),
        Key(name: "unix-owner", defaultValue: nil, help: "the Unix socket file's owner and group, USER[:GROUP] or :GROUP (names or ids)"),
        Key(name: "grpc-permissions", defaultValue: "check,write", help: "what the gRPC and HTTP/JSON door serves at all"),
        Key(name: "grpc-anonymous", defaultValue: nil, help: "what a caller without credentials may do through the door; default as --listen-anonymous"),
        Key(name: "admin-anonymous", defaultValue: "check", help: "whether the admin listener's /metrics needs a token: check (no) or none (yes); /healthz and /readyz are always open"),
        Key(name: "tls-cert", defaultValue: nil, help: "TLS on the TCP listeners (framed, door, admin): the certificate chain, PEM; reloaded on SIGHUP"),
        Key(name: "tls-key", defaultValue: nil, help: "the private key of --tls-cert, PEM, unencrypted"),
        Key(name: "tls-client-ca", defaultValue: nil, help: "mutual TLS: clients must present a certificate this CA (PEM) signed; it counts as authentication"),
        Key(name: "tls-client-permissions", defaultValue: "*=check,write", help: "what a client certificate may do, by subject common name: NAME=PERMISSIONS ... (* for the rest)"),
    ]

    /// A value and where it came from.
    struct Value {
        var text: String
        var source: String

        /// How an error names the value's origin: `--flag`, `ENV_NAME` or `file: key`.
        var origin: String
    }

    private(set) var values: [String: Value] = [:]
    /// The config file's `event-webhooks` list, if any.
    private(set) var eventDestinations: [DestinationJSON] = []
    private(set) var eventDestinationsOrigin = ""
    static let eventWebhooksKey = "event-webhooks"

    /// One destination of the config file's `event-webhooks` (docs/events.md).
    struct DestinationJSON: Decodable {
        var url: String
        var secretFile: String
        var name: String?
        var types: [String]?
        var environment: String?

        enum CodingKeys: String, CodingKey {
            case url, name, types, environment
            case secretFile = "secret-file"
        }
    }

    /// A config file entry: a setting's value, or the list of event destinations.
    private enum ConfigEntry: Decodable {
        case scalar(Scalar)
        case destinations([DestinationJSON])

        init(from decoder: any Decoder) throws {
            do {
                self = .destinations(try decoder.singleValueContainer().decode([DestinationJSON].self))
            } catch let listError {
                guard let scalar = try? Scalar(from: decoder) else {
                    throw listError
                }
                self = .scalar(scalar)
            }
        }
    }

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
                var decoded = try JSONDecoder().decode([String: ConfigEntry].self, from: data)
                if case .destinations(let destinations)? = decoded.removeValue(forKey: Self.eventWebhooksKey) {
                    self.eventDestinations = destinations
                    self.eventDestinationsOrigin = "\(configFile): \(Self.eventWebhooksKey)"
                }
                object = try decoded.mapValues { entry in
                    guard case .scalar(let scalar) = entry else { throw ValidationError("") }
                    return scalar
                }
            } catch {
                throw ValidationError(
                    "--config \(configFile): not a JSON object of settings (strings, numbers, booleans, and \"\(Self.eventWebhooksKey)\": a list of destinations), e.g. {\"listen\": \"127.0.0.1:7420\"}; \(error)"
                )
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

    /// --history-retention in milliseconds; nil for 0 (keep nothing).
    func historyRetention() throws -> Int64? {
        let name = "history-retention"
        let text = self.text(name) ?? ""
        if text == "0" {
            return nil
        }
        let units: [(String, Int64)] = [("ms", 1), ("s", 1000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000)]
        for (suffix, milliseconds) in units where text.hasSuffix(suffix) {
            if let value = Int64(text.dropLast(suffix.count)), value > 0, value <= Int64.max / milliseconds {
                return value * milliseconds
            }
        }
        throw ValidationError("\(self.origin(name)) \"\(text)\" is not a duration such as 7d, 36h or 30m, or 0 to keep no history")
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

    // MARK: Security (docs/security.md)

    func permissions(_ name: String) throws -> Permissions? {
        guard let text = self.text(name) else {
            return nil
        }
        guard let permissions = Permissions(parsing: text) else {
            throw ValidationError("\(self.origin(name)) \"\(text)\" must be \(Permissions.accepted)")
        }
        return permissions
    }

    /// The token file, read and checked; nil without --auth-token-file.
    func accessTokens() throws -> AccessTokens? {
        guard let path = self.text("auth-token-file") else {
            return nil
        }
        do {
            return try AccessTokens(path: path)
        } catch {
            throw ValidationError("\(error)")
        }
    }

    /// TLS for the TCP listeners, loaded and checked; nil without --tls-cert.
    func serverTLS() throws -> ServerTLS? {
        let certificate = self.text("tls-cert")
        let key = self.text("tls-key")
        guard let certificate, let key else {
            if certificate != nil || key != nil {
                throw ValidationError("--tls-cert and --tls-key go together: give both, or neither")
            }
            if self.text("tls-client-ca") != nil {
                throw ValidationError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
            }
            return nil
        }
        do {
            let clientPermissions = try ClientCertificatePermissions(parsing: self.text("tls-client-permissions") ?? "*=check,write", origin: self.origin("tls-client-permissions"))
            return try ServerTLS(files: .init(certificate: certificate, privateKey: key, clientCA: self.text("tls-client-ca")), clientPermissions: clientPermissions)
        } catch {
            throw ValidationError("\(error)")
        }
    }

    /// Each listener's security: its permissions, the tokens, TLS on the TCP ones; and
    /// protected mode, which refuses a listener on a non-loopback address that would take
    /// writes from anyone.
    func listenerSecurity() throws -> ServeSecurity {
        let tokens = try self.accessTokens()
        let tls = try self.serverTLS()
        let credentials = tokens != nil || tls?.requiresClientCertificates == true
        let tcpAnonymous = try self.permissions("listen-anonymous") ?? (credentials ? .check : .all)
        let tcp = ListenerPolicy(name: "tcp", granted: try self.permissions("listen-permissions") ?? .all, anonymous: tcpAnonymous)
        let unix = ListenerPolicy(name: "unix", granted: try self.permissions("unix-permissions") ?? .all, anonymous: try self.permissions("unix-anonymous") ?? .all)
        let grpc = ListenerPolicy(name: "grpc", granted: try self.permissions("grpc-permissions") ?? .all, anonymous: try self.permissions("grpc-anonymous") ?? tcpAnonymous)
        let adminAnonymous = try self.permissions("admin-anonymous") ?? .check
        guard adminAnonymous == .check || adminAnonymous == .none else {
            throw ValidationError("\(self.origin("admin-anonymous")) must be check (/metrics open) or none (/metrics needs a token)")
        }
        // The console grants and revokes by hand: its listener serves writes to a caller
        // whose token has the permission; without credentials it stays at --admin-anonymous.
        let console = try self.bool("console")
        if console, try self.address("admin") == nil {
            throw ValidationError("--console is served on the admin listener: give --admin HOST:PORT too")
        }
        // So does `events redeliver` (POST /events/redeliver), with outbound events on.
        let events = self.text("event-webhook") != nil || !self.eventDestinations.isEmpty
        let admin = ListenerPolicy(name: "admin", granted: console || events ? .all : .check, anonymous: adminAnonymous)
        if adminAnonymous == .none, tokens == nil, tls?.requiresClientCertificates != true {
            throw ValidationError("\(self.origin("admin-anonymous")) none needs --auth-token-file (or --tls-client-ca): else nobody could read /metrics")
        }
        // A server without a data directory takes no writes at all: nothing to protect.
        if self.dataDirectory != nil, !(try self.bool("allow-unauthenticated-writes")) {
            var exposed: [(String, (host: String, port: Int), ListenerPolicy)] = []
            if !(try self.bool("no-tcp")), let address = try self.address("listen") {
                exposed.append(("--listen", address, tcp))
            }
            if let address = try self.address("grpc-listen") {
                exposed.append(("--grpc-listen", address, grpc))
            }
            for (flag, address, policy) in exposed where !Self.isLoopback(address.host) && policy.anonymous.intersection(policy.granted).contains(.write) {
                let printed = address.host.contains(":") ? "[\(address.host)]:\(address.port)" : "\(address.host):\(address.port)"
                throw ValidationError(
                    "refusing to start (protected mode, docs/security.md): \(flag) \(printed) is not a loopback address, and it would take writes from anyone who can reach it. Set --auth-token-file FILE so that writers present a token, or \(policy.grantedSetting) check to serve reads only there, or --allow-unauthenticated-writes if every client that can reach it is trusted"
                )
            }
        }
        return ServeSecurity(
            tcp: ListenerSecurity(policy: tcp, tokens: tokens, tls: tls),
            unix: ListenerSecurity(policy: unix, tokens: tokens),
            grpc: ListenerSecurity(policy: grpc, tokens: tokens, tls: tls),
            admin: ListenerSecurity(policy: admin, tokens: tokens, tls: tls),
            webhooks: ListenerSecurity(policy: .open("webhooks"), tls: tls),
            tokens: tokens,
            tls: tls
        )
    }

    /// Whether `host` names this machine only: 127.0.0.0/8, ::1, localhost.
    static func isLoopback(_ host: String) -> Bool {
        host == "localhost" || host == "::1" || host.hasPrefix("127.")
    }

    /// --unix-mode, octal.
    func unixMode() throws -> UInt32 {
        let text = self.text("unix-mode") ?? "0660"
        guard let mode = UInt32(text, radix: 8), mode <= 0o777 else {
            throw ValidationError("\(self.origin("unix-mode")) \"\(text)\" is not a file mode in octal, e.g. 0660 or 0600")
        }
        return mode
    }

    /// --unix-owner USER[:GROUP] or :GROUP, as ids.
    func unixOwner() throws -> (owner: UInt32?, group: UInt32?) {
        guard let text = self.text("unix-owner") else {
            return (nil, nil)
        }
        let parts = text.split(separator: ":", maxSplits: 1, omittingEmptySubsequences: false).map(String.init)
        var owner: UInt32?
        var group: UInt32?
        if let user = parts.first, !user.isEmpty {
            if let id = UInt32(user) {
                owner = id
            } else if let entry = getpwnam(user) {
                owner = entry.pointee.pw_uid
            } else {
                throw ValidationError("\(self.origin("unix-owner")): no user \"\(user)\" on this machine")
            }
        }
        if parts.count == 2, !parts[1].isEmpty {
            if let id = UInt32(parts[1]) {
                group = id
            } else if let entry = getgrnam(parts[1]) {
                group = entry.pointee.gr_gid
            } else {
                throw ValidationError("\(self.origin("unix-owner")): no group \"\(parts[1])\" on this machine")
            }
        }
        guard owner != nil || group != nil else {
            throw ValidationError("\(self.origin("unix-owner")) \"\(text)\" is not USER[:GROUP] or :GROUP")
        }
        return (owner, group)
    }

    /// The server configuration; throws the first invalid setting.
    /// `security`: the listeners' security, if already loaded (serve loads it once, so
    /// that one token file and one certificate are reloaded for every listener).
    func serverConfiguration(security given: ServeSecurity? = nil) throws -> ServerConfiguration {
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
        _ = try self.historyRetention()
        _ = try self.duration("drain-timeout")
        _ = try self.address("admin")
        _ = try self.address("grpc-listen")
        _ = try self.webhooks()
        _ = try self.appStoreAPI()
        _ = try self.appStoreRecheck()
        _ = try self.tracing()
        _ = try self.logLevel()
        _ = try self.integer("threads", in: 1...1_024)
        let security = try given ?? self.listenerSecurity()
        let (owner, group) = try self.unixOwner()
        var configuration = ServerConfiguration(
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
        configuration.cachePolicy = try self.cachePolicy()
        configuration.coldReads = ColdReadSettings(
            threads: try self.integer("cold-read-threads", in: 0...256),
            queueLimit: try self.integer("cold-read-queue", in: 1...1_000_000)
        )
        configuration.tcpSecurity = security.tcp
        configuration.unixSecurity = security.unix
        configuration.unixSocketMode = try self.unixMode()
        configuration.unixSocketOwner = owner
        configuration.unixSocketGroup = group
        return configuration
    }

    func cachePolicy() throws -> AnswerCache.Policy {
        guard let policy = AnswerCache.Policy(rawValue: self.text("cache-policy") ?? "") else {
            throw ValidationError("\(self.origin("cache-policy")) must be tinylfu or lru, got \"\(self.text("cache-policy") ?? "")\"")
        }
        return policy
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

extension ServeSettings {
    /// The outbound events' destinations and limits (--event-webhook with
    /// --event-webhook-secret-file, and the config file's `event-webhooks`); nil when no
    /// destination is configured.
    func events() throws -> EventsConfiguration? {
        var destinations: [EventDestination] = []
        let urls = (self.text("event-webhook") ?? "").split(whereSeparator: \.isWhitespace).map(String.init)
        if !urls.isEmpty {
            guard let path = self.text("event-webhook-secret-file") else {
                throw ValidationError("\(self.origin("event-webhook")) needs --event-webhook-secret-file FILE: every event is signed (docs/events.md)")
            }
            let secrets = try Self.eventSecrets(path, setting: self.origin("event-webhook-secret-file"))
            for url in urls {
                destinations.append(EventDestination(url: try Self.eventURL(url, origin: self.origin("event-webhook")), secrets: secrets))
            }
        } else if self.text("event-webhook-secret-file") != nil, self.eventDestinations.isEmpty {
            throw ValidationError("\(self.origin("event-webhook-secret-file")) is set but no --event-webhook URL is")
        }
        for (index, entry) in self.eventDestinations.enumerated() {
            let origin = "\(self.eventDestinationsOrigin)[\(index)]"
            var types: Set<OutboundEventType>?
            if let names = entry.types {
                types = []
                for name in names {
                    guard let type = OutboundEventType(rawValue: name) else {
                        throw ValidationError("\(origin).types: \"\(name)\" is not an event type; the types are \(OutboundEventType.allCases.map(\.rawValue).joined(separator: ", "))")
                    }
                    types?.insert(type)
                }
            }
            var environment: Environment?
            switch entry.environment {
            case nil: environment = nil
            case "production": environment = .production
            case "sandbox": environment = .sandbox
            case let other?: throw ValidationError("\(origin).environment: \"\(other)\" is not production or sandbox")
            }
            destinations.append(EventDestination(
                name: entry.name,
                url: try Self.eventURL(entry.url, origin: "\(origin).url"),
                secrets: try Self.eventSecrets(entry.secretFile, setting: "\(origin).secret-file"),
                types: types,
                environment: environment
            ))
        }
        guard !destinations.isEmpty else {
            return nil
        }
        var names = Set<String>()
        for destination in destinations where !names.insert(destination.name).inserted {
            throw ValidationError("two event destinations are named \(destination.name); give each a distinct \"name\" in \(Self.eventWebhooksKey)")
        }
        let maxInterval = try self.duration("event-retry-max-interval")
        let horizon = try self.duration("event-retry-horizon")
        return EventsConfiguration(
            destinations: destinations,
            policy: .init(initialInterval: 1_000, maxInterval: max(1_000, maxInterval.nanoseconds / 1_000_000), horizon: horizon.nanoseconds / 1_000_000),
            outboxLimit: UInt64(try self.bytes("event-outbox-limit"))
        )
    }

    private static func eventSecrets(_ path: String, setting: String) throws -> [String] {
        do {
            return try SigningSecretsFile.load(path: path, setting: setting, example: "a random string of 32 or more characters")
        } catch {
            throw ValidationError(error.message)
        }
    }

    private static func eventURL(_ text: String, origin: String) throws -> String {
        guard text.hasPrefix("http://") || text.hasPrefix("https://"), text.count > "https://".count else {
            throw ValidationError("\(origin) \"\(text)\" is not an http:// or https:// URL")
        }
        return text
    }

    /// --stripe-webhook-secret-file and --stripe-customer-key; nil when Stripe's webhook is off.
    func stripeWebhooks() throws -> StripeWebhookSettings? {
        guard let path = self.text("stripe-webhook-secret-file") else {
            return nil
        }
        let secrets: [String]
        do {
            secrets = try StripeSecretsFile.load(path: path)
        } catch {
            throw ValidationError("\(error)")
        }
        let key = self.text("stripe-customer-key") ?? "user_id"
        guard !key.isEmpty, key.utf8.count <= 40, !key.contains(where: \.isWhitespace) else {
            throw ValidationError("\(self.origin("stripe-customer-key")) must be a Stripe metadata key: 1 to 40 characters, no spaces; got \"\(key)\"")
        }
        return StripeWebhookSettings(secrets: secrets, customerKey: key)
    }

    /// --appstore-root-cert and --appstore-bundle-id; nil when the App Store's webhook is off.
    func appStoreWebhooks() throws -> AppStoreWebhookSettings? {
        let bundleIds = Set((self.text("appstore-bundle-id") ?? "").split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty })
        guard let path = self.text("appstore-root-cert") else {
            if !bundleIds.isEmpty {
                throw ValidationError("\(self.origin("appstore-bundle-id")) needs --appstore-root-cert FILE (Apple Root CA - G3) to verify the notifications with")
            }
            return nil
        }
        guard !bundleIds.isEmpty else {
            throw ValidationError(
                "--appstore-root-cert needs --appstore-bundle-id ID[,ID...]: every app's notifications are signed by Apple, so the bundle id is what tells your app's apart"
            )
        }
        do {
            return AppStoreWebhookSettings(roots: [try AppStoreJWSVerifier.loadRoot(path: path)], bundleIds: bundleIds)
        } catch {
            throw ValidationError("\(error)")
        }
    }

    /// --appstore-api-key with its id, issuer and URLs; nil when the App Store Server API
    /// is not used. The key is read and checked here.
    func appStoreAPI() throws -> AppStoreAPISettings? {
        let names = ["appstore-api-key", "appstore-key-id", "appstore-issuer-id"]
        let given = names.filter { self.text($0) != nil }
        guard !given.isEmpty else {
            return nil
        }
        guard let path = self.text("appstore-api-key"), let keyId = self.text("appstore-key-id"), let issuerId = self.text("appstore-issuer-id") else {
            throw ValidationError("\(self.origin(given[0])) needs all of --appstore-api-key FILE, --appstore-key-id ID and --appstore-issuer-id ID (App Store Connect, Users and Access, Integrations)")
        }
        guard self.text("appstore-root-cert") != nil else {
            throw ValidationError("--appstore-api-key needs --appstore-root-cert and --appstore-bundle-id: Apple's answers are signed like its notifications, and checked the same way")
        }
        do {
            return try AppStoreAPISettings(
                keyPath: path, keyId: keyId, issuerId: issuerId, productionURL: try self.url("appstore-api-url"), sandboxURL: try self.url("appstore-sandbox-api-url")
            )
        } catch let error as ValidationError {
            throw error
        } catch {
            throw ValidationError("\(error)")
        }
    }

    /// --appstore-recheck-interval (nil: off; in fleet mode off unless given) and
    /// --appstore-recheck-rate.
    func appStoreRecheck() throws -> (interval: Duration, perMinute: Int)? {
        let rate = self.text("appstore-recheck-rate") ?? "60"
        guard let perMinute = Int(rate), (1...3000).contains(perMinute) else {
            throw ValidationError("\(self.origin("appstore-recheck-rate")) \"\(rate)\" is not a number of reads a minute from 1 to 3000")
        }
        if self.text("appstore-recheck-interval") == "off" {
            return nil
        }
        if self.text("postgres") != nil, self.values["appstore-recheck-interval"]?.source == "default" {
            return nil  // fleet mode: on only where asked for, else every node would ask Apple
        }
        let interval = try self.duration("appstore-recheck-interval")
        return (.nanoseconds(interval.nanoseconds), perMinute)
    }

    /// The paths --webhooks-listen serves, for the start-up line.
    func webhookRoutes() -> [String] {
        WebhookIngestion.routes(
            stripe: self.text("stripe-webhook-secret-file") != nil, appStore: self.text("appstore-root-cert") != nil,
            googlePlayPush: self.text("googleplay-push-audience") != nil
        )
    }

    /// The --googleplay-* settings; nil when Google Play is off. The key file is read and
    /// its key checked here.
    func googlePlay() throws -> GooglePlaySettings? {
        let names = ["googleplay-package", "googleplay-service-account", "googleplay-push-audience", "googleplay-push-service-account", "googleplay-pubsub-subscription"]
        let given = names.filter { self.text($0) != nil }
        guard !given.isEmpty else {
            return nil
        }
        let packages = Set((self.text("googleplay-package") ?? "").split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }.filter { !$0.isEmpty })
        guard !packages.isEmpty, let keyFile = self.text("googleplay-service-account") else {
            throw ValidationError(
                "\(self.origin(given[0])) turns on Google Play, which needs --googleplay-package NAME[,NAME] (the apps whose notifications are accepted) and --googleplay-service-account FILE (the key that reads their purchases)"
            )
        }
        var push: GooglePlaySettings.Push?
        switch (self.text("googleplay-push-audience"), self.text("googleplay-push-service-account")) {
        case (let audience?, let email?):
            push = GooglePlaySettings.Push(jwksURL: try self.url("googleplay-jwks-url"), audience: audience, serviceAccount: email)
        case (nil, nil):
            push = nil
        default:
            throw ValidationError("--googleplay-push-audience and --googleplay-push-service-account go together: the push tokens are checked for both")
        }
        let pull = try self.text("googleplay-pubsub-subscription").map { subscription in
            if let problem = GooglePlaySettings.subscriptionProblem(subscription) {
                throw ValidationError("\(self.origin("googleplay-pubsub-subscription")) \(problem)")
            }
            return GooglePlaySettings.Pull(subscription: subscription, pubsubURL: try self.url("googleplay-pubsub-url"))
        }
        guard push != nil || pull != nil else {
            throw ValidationError(
                "Google Play needs a way in: --googleplay-push-audience with --googleplay-push-service-account (Pub/Sub push to --webhooks-listen), or --googleplay-pubsub-subscription (pull)"
            )
        }
        guard self.dataDirectory != nil else {
            throw ValidationError("Google Play needs --data-dir (and, in fleet mode, --postgres): the notifications are writes")
        }
        let apiURL = try self.url("googleplay-api-url")
        let account: GoogleServiceAccount
        do {
            account = try GoogleServiceAccount.load(path: keyFile)
        } catch {
            throw ValidationError("\(error)")
        }
        return GooglePlaySettings(packages: packages, serviceAccount: account, apiURL: apiURL, push: push, pull: pull)
    }

    /// A store's URL (Google's, Apple's): https://, or http:// on a loopback address only (a test's fake, a
    /// local proxy): access tokens and Google's keys travel on it.
    private func url(_ name: String) throws -> String {
        let text = self.text(name) ?? Self.keys.first { $0.name == name }?.defaultValue ?? ""
        guard let url = URL(string: text), let host = url.host, !host.isEmpty,
            url.scheme == "https" || (url.scheme == "http" && ["127.0.0.1", "localhost", "::1", "[::1]"].contains(host))
        else {
            throw ValidationError("\(self.origin(name)) must be an https:// URL (http:// only on 127.0.0.1 or localhost), got \"\(text)\"")
        }
        return text
    }

    /// --otlp-endpoint and --trace-sample-ratio: where spans go, or nil (tracing off).
    func tracing() throws -> OTLPTracingSettings? {
        let ratioText = self.text("trace-sample-ratio") ?? "0.01"
        guard let ratio = Double(ratioText), ratio >= 0, ratio <= 1 else {
            throw ValidationError("\(self.origin("trace-sample-ratio")) must be a number from 0 to 1 (e.g. 0.01), got \"\(ratioText)\"")
        }
        guard let endpoint = self.text("otlp-endpoint") else {
            return nil
        }
        if let problem = OTLPTracingSettings.endpointProblem(endpoint, origin: self.origin("otlp-endpoint")) {
            throw ValidationError(problem)
        }
        return OTLPTracingSettings(endpoint: endpoint, sampleRatio: ratio)
    }

    /// The store webhooks (docs/ingestion.md): the ingestion, nil when no store is set up,
    /// and the listener of --webhooks-listen, nil when it is off. Counters go to `factory`
    /// (the server's Prometheus registry). `googlePlay` is made from ``googlePlay()``
    /// by the caller (it is made asynchronously).
    func webhooks(
        factory: (any MetricsFactory)? = nil,
        security: ListenerSecurity = ListenerSecurity(policy: .open("webhooks")),
        googlePlay: GooglePlay? = nil,
        appStoreAPI: AppStoreServerAPI? = nil
    ) throws -> (door: ServerDoor?, ingestion: WebhookIngestion?) {
        let address = try self.address("webhooks-listen")
        let stripe = try self.stripeWebhooks()
        let appStore = try self.appStoreWebhooks()
        let play = try self.googlePlay()
        guard let address else {
            if stripe != nil {
                throw ValidationError("--stripe-webhook-secret-file needs --webhooks-listen HOST:PORT to receive Stripe's events on")
            }
            if play?.push != nil {
                throw ValidationError("--googleplay-push-audience needs --webhooks-listen HOST:PORT to receive Pub/Sub's pushes on (or pull instead: --googleplay-pubsub-subscription)")
            }
            // No listener: the App Store's and Google Play's settings still verify the
            // purchases of SubmitPurchase, and Google Play may pull.
            guard appStore != nil || play != nil else {
                return (nil, nil)
            }
            guard self.dataDirectory != nil else {
                throw ValidationError("--appstore-root-cert needs --data-dir (and, in fleet mode, --postgres): the purchases it verifies are writes")
            }
            return (nil, WebhookIngestion(stripe: nil, appStore: appStore, googlePlay: googlePlay, appStoreAPI: appStoreAPI, factory: factory ?? MetricsSystem.factory))
        }
        guard stripe != nil || appStore != nil || play?.push != nil else {
            throw ValidationError(
                "--webhooks-listen needs a store to take events from: --stripe-webhook-secret-file FILE, or --appstore-root-cert FILE with --appstore-bundle-id ID, or --googleplay-push-audience with the other --googleplay-* settings"
            )
        }
        guard self.dataDirectory != nil else {
            throw ValidationError("--webhooks-listen needs --data-dir (and, in fleet mode, --postgres): the events are writes")
        }
        let ingestion = WebhookIngestion(stripe: stripe, appStore: appStore, googlePlay: googlePlay, appStoreAPI: appStoreAPI, factory: factory ?? MetricsSystem.factory)
        return (WebhookListener.door(host: address.host, port: address.port, ingestion: ingestion, security: security), ingestion)
    }
}
