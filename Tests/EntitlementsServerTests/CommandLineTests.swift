import EntitlementsFormats
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsStore
import EntitlementsTools
import EntitlementsWire
import Foundation
import Synchronization
import Testing

/// The `entitlements` executable, run as a user would: `serve` in the background, `check`
/// against it. Uses the binary SwiftPM built next to the test bundle.
@Suite("command line", .serialized)
struct CommandLineTests {
    static let executable = URL(fileURLWithPath: CommandLine.arguments[0])
        .deletingLastPathComponent().appendingPathComponent("entitlements").path

    struct Output {
        var status: Int32
        var text: String
    }

    /// Launches `entitlements` with `arguments`, its standard output and error in one pipe.
    static func launch(_ arguments: [String], environment: [String: String] = [:]) throws -> (Process, Pipe) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: Self.executable)
        process.arguments = arguments
        process.environment = ProcessInfo.processInfo.environment.merging(environment) { $1 }
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        try process.run()
        return (process, pipe)
    }

    static func run(_ arguments: [String], environment: [String: String] = [:]) throws -> Output {
        let (process, pipe) = try Self.launch(arguments, environment: environment)
        let data = pipe.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return Output(status: process.terminationStatus, text: String(decoding: data, as: UTF8.self))
    }

    /// Starts `entitlements serve` on port 0 and returns it with the port it printed.
    static func serve(snapshot: String) throws -> (Process, Pipe, Int) {
        let (process, pipe, _, port) = try Self.start(["serve", "--snapshot", snapshot, "--listen", "127.0.0.1:0", "--resolvers", "2", "--cache-bytes", "8MiB"])
        return (process, pipe, port)
    }

    /// Runs `entitlements` with `arguments` (a `serve` on `127.0.0.1:0`) and waits for its
    /// `listening on` line: the process, its output pipe, what it printed, and the port.
    static func start(_ arguments: [String], environment: [String: String] = [:]) throws -> (Process, Pipe, String, Int) {
        let (process, pipe) = try Self.launch(arguments, environment: environment)
        var seen = ""
        while !seen.contains("listening on 127.0.0.1:") || !seen.hasSuffix("\n") {
            let chunk = pipe.fileHandleForReading.availableData
            guard !chunk.isEmpty else {
                throw CocoaError(.fileReadUnknown, userInfo: [NSLocalizedDescriptionKey: "serve exited: \(seen)"])
            }
            seen += String(decoding: chunk, as: UTF8.self)
        }
        let line = seen.split(separator: "\n").first { $0.hasPrefix("listening on 127.0.0.1:") }!
        return (process, pipe, seen, Int(line.split(separator: ":").last!)!)
    }

    @Test("serve, then check with the table and the JSON output; SIGTERM drains and exits 0")
    func serveAndCheck() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("cli-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/data.snap"
        _ = try SnapshotTools.generate(count: 200, seed: 8, now: now, outputPath: path)
        let (server, pipe, port) = try Self.serve(snapshot: path)

        let at = "2026-11-22T00:00:00Z"
        let json = try Self.run(["check", "--server", "127.0.0.1:\(port)", "--user", "user-2", "--at", at, "--json"])
        #expect(json.status == 0)
        let snapshot = try SnapshotReader(path: path)
        let record = try snapshot.customer(for: "user-2")
        let expected = EntitlementResolver(catalog: snapshot.catalog).resolve(record, at: now)
            .response(userId: "user-2", customerId: "user-2", requestDate: now)
        #expect(json.text == EntitlementsOutput.json(expected) + "\n")

        let table = try Self.run(["check", "--server", "127.0.0.1:\(port)", "--user", "user-2", "--at", at])
        #expect(table.status == 0)
        #expect(table.text == EntitlementsOutput.table(expected) + "\n")

        server.terminate()  // SIGTERM
        server.waitUntilExit()
        let log = String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(server.terminationStatus == 0)
        #expect(log.contains("draining: GOAWAY sent") && log.hasSuffix("stopped\n"), "\(log)")

        // The server is gone: check says so and fails.
        let down = try Self.run(["check", "--server", "127.0.0.1:\(port)", "--user", "user-2"])
        #expect(down.status == 1)
        #expect(down.text.hasPrefix("error: UNAVAILABLE: cannot connect to 127.0.0.1:\(port)"))
    }

    @Test("SIGTERM the moment `listening on` is printed drains and exits 0 (12 trials)")
    func signalRightAfterListening() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("cli-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/data.snap"
        _ = try SnapshotTools.generate(count: 50, seed: 8, now: now, outputPath: path)
        for trial in 0..<12 {
            let (process, pipe, seen, _) = try Self.start(["serve", "--snapshot", path, "--listen", "127.0.0.1:0", "--resolvers", "1"])
            if trial % 2 == 1 {
                usleep(UInt32(trial) * 250)  // 0 to 3 ms after the line
            }
            kill(process.processIdentifier, SIGTERM)
            process.waitUntilExit()
            let output = seen + String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
            #expect(process.terminationReason == .exit && process.terminationStatus == 0, "trial \(trial): \(output)")
            #expect(output.hasSuffix("stopped\n"), "trial \(trial): \(output)")
        }
    }

    @Test("serve refuses to start without a usable snapshot, saying why", arguments: ["missing", "corrupt"])
    func unusableSnapshot(kind: String) throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("cli-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/data.snap"
        if kind == "corrupt" {
            _ = try SnapshotTools.generate(count: 20, seed: 8, now: now, outputPath: path)
            var bytes = try Data(contentsOf: URL(fileURLWithPath: path))
            bytes[40] ^= 0xFF
            try bytes.write(to: URL(fileURLWithPath: path))
        }
        let output = try Self.run(["serve", "--snapshot", path, "--listen", "127.0.0.1:0"])
        #expect(output.status == 2)
        let reason = kind == "corrupt" ? "offset 0: file header checksum mismatch" : "cannot open: No such file or directory"
        #expect(output.text.hasPrefix("error: cannot serve: \(path): \(reason)"), "\(output.text)")
    }

    @Test("serve on a port already in use exits 2 and says so")
    func portInUse() async throws {
        let fixture = try await ServerFixture()
        let output = try Self.run(["serve", "--snapshot", fixture.directory + "/data.snap", "--listen", "127.0.0.1:\(fixture.port)"])
        #expect(output.status == 2)
        #expect(output.text.contains("error: cannot listen on 127.0.0.1:\(fixture.port): "), "\(output.text)")
        #expect(output.text.contains("Address already in use"), "\(output.text)")
        // A live Unix socket is not taken over either.
        let unix = try Self.run(["serve", "--snapshot", fixture.directory + "/data.snap", "--no-tcp", "--unix", fixture.socketPath])
        #expect(unix.status == 2)
        #expect(unix.text.contains("another server is listening on \(fixture.socketPath)"), "\(unix.text)")
        try await fixture.stop()
    }

    @Test("bad flags are refused with a message", arguments: [
        (["serve", "--snapshot", "x", "--listen", "nowhere"], "--listen \"nowhere\" is not HOST:PORT"),
        (["serve", "--snapshot", "x", "--cache-bytes", "lots"], "--cache-bytes \"lots\" is not a size"),
        (["serve", "--snapshot", "x", "--cache-policy", "lfu"], "--cache-policy must be tinylfu or lru, got \"lfu\""),
        (["serve", "--snapshot", "x", "--cold-read-threads", "many"], "--cold-read-threads must be 0 to 256, got \"many\""),
        (["serve", "--snapshot", "x", "--cold-read-queue", "0"], "--cold-read-queue must be 1 to 1000000, got \"0\""),
        (["check", "--user", "u", "--at", "tomorrow"], "--at \"tomorrow\" is not an RFC 3339 date-time"),
        (["check", "--user", "u", "--environment", "staging"], "--environment must be production or sandbox"),
        (["serve"], "give --snapshot FILE (read-only) or --data-dir DIR (with writes)"),
        (["serve", "--data-dir", "d", "--fsync", "never"], "--fsync must be batch or always, got \"never\""),
        (["serve", "--data-dir", "d", "--compact-after", "big"], "--compact-after \"big\" is not a size"),
        (["grant", "--user", "u", "--grant-id", "g", "--entitlement", "e", "--expires", "soon"], "--expires \"soon\" is not an RFC 3339 date-time"),
        (["record-transaction", "--user", "u", "--store", "ebay", "--transaction-id", "t", "--product", "p", "--purchased", "2026-01-01T00:00:00Z", "--type", "subscriptionStarted"],
            "--store must be one of unknown, appstore, playstore, stripe, manual, got \"ebay\""),
        (["record-transaction", "--user", "u", "--store", "manual", "--transaction-id", "t", "--product", "p", "--purchased", "2026-01-01T00:00:00Z", "--type", "subscriptionStarted"],
            "--store must be appstore, playstore or stripe, got \"manual\""),
        (["update-subscription", "--user", "u", "--store", "manual", "--original-transaction-id", "t"],
            "--store must be appstore, playstore or stripe, got \"manual\""),
        (["record-transaction", "--user", "u", "--store", "stripe", "--transaction-id", "t", "--product", "p", "--purchased", "2026-01-01T00:00:00Z"],
            "Missing expected argument '--type <type>'"),
        (["watch"], "give --user ID (repeatable) or --all"),
        (["serve", "--postgres", "postgres://u@db/e"], "--postgres needs --data-dir DIR"),
        (["serve", "--data-dir", "d", "--postgres", "mysql://u@db/e"], "--postgres: the URL must start with postgres://"),
        (["serve", "--data-dir", "d", "--postgres", "postgres://u@db/e?sslmode=require"], "the option \"sslmode=require\" is not supported"),
        (["db", "migrate", "--postgres", "postgres://db/e"], "--postgres: no user name"),
        (["serve", "--data-dir", "d", "--postgres", "postgres://u@db/e", "--max-staleness", "200ms"],
            "--max-staleness \"200ms\" must be longer than --fleet-poll-interval \"250ms\", or every answer would be stale"),
        (["serve", "--data-dir", "d", "--postgres", "postgres://u@db/e", "--stale-policy", "maybe"], "--stale-policy must be open or closed, got \"maybe\""),
        (["db", "prune", "--postgres", "postgres://u@db/e", "--older-than", "soon"], "--older-than \"soon\" is not a duration"),
        (["serve", "--snapshot", "x", "--idle-timeout", "forever"], "--idle-timeout \"forever\" is not a duration such as 250ms, 30s, 5m or 1h"),
        (["serve", "--snapshot", "x", "--max-connections", "0"], "--max-connections must be 1 to 1000000, got \"0\""),
        (["serve", "--snapshot", "x", "--threads", "none"], "--threads must be 1 to 1024, got \"none\""),
        (["serve", "--snapshot", "x", "--log-level", "loud"], "--log-level must be trace, debug, info"),
        (["serve", "--snapshot", "x", "--otlp-endpoint", "127.0.0.1:4318"], "--otlp-endpoint \"127.0.0.1:4318\" is not an http:// or https:// URL (an OTLP/HTTP collector, e.g. http://127.0.0.1:4318)"),
        (["serve", "--snapshot", "x", "--trace-sample-ratio", "2"], "--trace-sample-ratio must be a number from 0 to 1 (e.g. 0.01), got \"2\""),
        (["serve", "--snapshot", "x", "--admin", "7421"], "--admin \"7421\" is not HOST:PORT"),
        (["serve", "--snapshot", "x", "--config", "/nonexistent.json"], "--config /nonexistent.json: cannot read it"),
        (["check", "--user", "u", "--server", "here"], "--server \"here\" is not HOST:PORT"),
        (["serve", "--data-dir", "d", "--listen", "0.0.0.0:7420"],
            "refusing to start (protected mode, docs/security.md): --listen 0.0.0.0:7420 is not a loopback address, and it would take writes from anyone who can reach it. Set --auth-token-file FILE"),
        (["serve", "--data-dir", "d", "--grpc-listen", "[::]:7430"], "--grpc-listen [::]:7430 is not a loopback address"),
        (["serve", "--snapshot", "x", "--listen-permissions", "read"], "--listen-permissions \"read\" must be none, check, write or check,write"),
        (["serve", "--snapshot", "x", "--auth-token-file", "/nonexistent/tokens"], "--auth-token-file /nonexistent/tokens: cannot open it (No such file or directory)"),
        (["serve", "--snapshot", "x", "--tls-cert", "c.pem"], "--tls-cert and --tls-key go together: give both, or neither"),
        (["serve", "--snapshot", "x", "--tls-client-ca", "ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
        (["serve", "--snapshot", "x", "--tls-cert", "/nonexistent.pem", "--tls-key", "k"], "--tls-cert /nonexistent.pem: cannot open it (No such file or directory)"),
        (["serve", "--snapshot", "x", "--unix-mode", "0999"], "--unix-mode \"0999\" is not a file mode in octal, e.g. 0660 or 0600"),
        (["serve", "--snapshot", "x", "--unix-owner", "no-such-user-here"], "--unix-owner: no user \"no-such-user-here\" on this machine"),
        (["serve", "--snapshot", "x", "--admin-anonymous", "none"], "--admin-anonymous none needs --auth-token-file (or --tls-client-ca): else nobody could read /metrics"),
        (["check", "--user", "u", "--tls-cert", "c.pem", "--tls-key", "k.pem"], "--tls-cert needs --tls-ca: a client certificate is presented over TLS"),
        (["check", "--user", "u", "--unix", "/s", "--tls-ca", "ca.pem"], "--tls-ca is for TCP (--server); a Unix socket is never TLS"),
        (["serve", "--data-dir", "d", "--webhooks-listen", "127.0.0.1:7430"], "--webhooks-listen needs a store to take events from: --stripe-webhook-secret-file FILE, or --appstore-root-cert FILE with --appstore-bundle-id ID"),
        (["serve", "--data-dir", "d", "--googleplay-package", "com.example.app"],
            "--googleplay-package turns on Google Play, which needs --googleplay-package NAME[,NAME] (the apps whose notifications are accepted) and --googleplay-service-account FILE"),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/nonexistent/sa.json", "--googleplay-push-audience", "x"],
            "--googleplay-push-audience and --googleplay-push-service-account go together"),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/nonexistent/sa.json"],
            "Google Play needs a way in: --googleplay-push-audience with --googleplay-push-service-account (Pub/Sub push to --webhooks-listen), or --googleplay-pubsub-subscription (pull)"),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/nonexistent/sa.json", "--googleplay-pubsub-subscription", "play-rtdn"],
            "--googleplay-pubsub-subscription must be projects/PROJECT/subscriptions/SUBSCRIPTION, got \"play-rtdn\""),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/nonexistent/sa.json", "--googleplay-pubsub-subscription", "projects/p/subscriptions/s"],
            "--googleplay-service-account /nonexistent/sa.json: cannot read the file"),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/etc/passwd", "--googleplay-pubsub-subscription", "projects/p/subscriptions/s"],
            "--googleplay-service-account /etc/passwd: not a JSON object"),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/etc/passwd", "--googleplay-pubsub-subscription", "projects/p/subscriptions/s",
          "--googleplay-pubsub-url", "ftp://x"], "--googleplay-pubsub-url must be an https:// URL (http:// only on 127.0.0.1 or localhost), got \"ftp://x\""),
        (["serve", "--data-dir", "d", "--googleplay-package", "a", "--googleplay-service-account", "/etc/passwd", "--googleplay-pubsub-subscription", "projects/p/subscriptions/s",
          "--googleplay-api-url", "http://proxy.example.com"], "--googleplay-api-url must be an https:// URL (http:// only on 127.0.0.1 or localhost)"),
        (["serve", "--snapshot", "x", "--googleplay-package", "a", "--googleplay-service-account", "/etc/passwd", "--googleplay-pubsub-subscription", "projects/p/subscriptions/s"],
            "Google Play needs --data-dir (and, in fleet mode, --postgres): the notifications are writes"),
        (["serve", "--data-dir", "d", "--webhooks-listen", "127.0.0.1:7430", "--appstore-root-cert", "/etc/passwd"], "--appstore-root-cert needs --appstore-bundle-id ID[,ID...]"),
        (["serve", "--data-dir", "d", "--webhooks-listen", "127.0.0.1:7430", "--appstore-bundle-id", "com.example.app"], "--appstore-bundle-id needs --appstore-root-cert FILE"),
        (["serve", "--data-dir", "d", "--webhooks-listen", "127.0.0.1:7430", "--appstore-root-cert", "/etc/passwd", "--appstore-bundle-id", "com.example.app"],
            "--appstore-root-cert /etc/passwd: not a certificate in PEM or DER"),
        (["serve", "--data-dir", "d", "--webhooks-listen", "127.0.0.1:7430", "--appstore-root-cert", "/nonexistent/AppleRootCA-G3.cer", "--appstore-bundle-id", "a"],
            "--appstore-root-cert /nonexistent/AppleRootCA-G3.cer: cannot open it (No such file or directory)"),
        (["serve", "--data-dir", "d", "--appstore-api-key", "/nonexistent/SubscriptionKey.p8"],
            "--appstore-api-key needs all of --appstore-api-key FILE, --appstore-key-id ID and --appstore-issuer-id ID"),
        (["serve", "--data-dir", "d", "--appstore-api-key", "/nonexistent/k.p8", "--appstore-key-id", "K", "--appstore-issuer-id", "I"],
            "--appstore-api-key needs --appstore-root-cert and --appstore-bundle-id"),
        (["serve", "--data-dir", "d", "--appstore-root-cert", "/etc/passwd", "--appstore-bundle-id", "a", "--appstore-api-key", "/etc/passwd", "--appstore-key-id", "K",
          "--appstore-issuer-id", "I"], "--appstore-root-cert /etc/passwd: not a certificate in PEM or DER"),
        (["serve", "--data-dir", "d", "--appstore-recheck-rate", "0"], "--appstore-recheck-rate \"0\" is not a number of reads a minute from 1 to 3000"),
        (["serve", "--data-dir", "d", "--appstore-recheck-interval", "soon"], "--appstore-recheck-interval \"soon\" is not a duration"),
        (["serve", "--data-dir", "d", "--stripe-webhook-secret-file", "/nonexistent/secrets"], "--stripe-webhook-secret-file /nonexistent/secrets: cannot open it (No such file or directory)"),
        (["serve", "--snapshot", "x", "--webhooks-listen", "127.0.0.1:7430", "--stripe-webhook-secret-file", "/dev/null"], "--stripe-webhook-secret-file /dev/null: no secret in it"),
        (["serve", "--data-dir", "d", "--webhooks-listen", "hook", "--stripe-webhook-secret-file", "/dev/null"], "--webhooks-listen \"hook\" is not HOST:PORT"),
    ])
    func badFlags(arguments: [String], message: String) throws {
        let output = try Self.run(arguments)
        #expect(output.status == 64)
        #expect(output.text.contains(message), "\(output.text)")
    }

    @Test("serve --data-dir takes writes from the write commands; they survive a restart")
    func writesFromTheCommandLine() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("cli-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let seed = directory + "/seed.snap"
        _ = try SnapshotTools.generate(count: 50, seed: 8, now: now, outputPath: seed)
        var server = try ChildServer.start(dataDirectory: directory + "/data", seed: seed)
        let address = ["--server", "127.0.0.1:\(server.port)"]
        let granted = try Self.run(["grant", "--user", "newcomer", "--grant-id", "g1", "--entitlement", "beta"] + address)
        #expect(granted.text == "customer newcomer: created, log sequence 1\n")
        let retried = try Self.run(["grant", "--user", "newcomer", "--grant-id", "g1", "--entitlement", "beta", "--json"] + address)
        #expect(retried.text == "{\"customerId\":\"newcomer\",\"changed\":false,\"created\":false,\"logSequence\":null}\n")
        let conflict = try Self.run(["link-alias", "--user", "user-1", "--alias", "newcomer"] + address)
        #expect(conflict.status == 1)
        #expect(conflict.text == "error: FAILED_PRECONDITION: alias: \"newcomer\" is a customer id, not an alias; customers are not merged\n")
        #expect(try Self.run(["link-alias", "--user", "newcomer", "--alias", "phone-1"] + address).status == 0)
        server.kill9()
        server = try ChildServer.start(dataDirectory: directory + "/data", seed: seed)
        let check = try Self.run(["check", "--user", "phone-1", "--entitlement", "beta", "--server", "127.0.0.1:\(server.port)"])
        #expect(check.text.contains("phone-1 (customer newcomer)") && check.text.contains("beta "), "\(check.text)")
        let compacted = try Self.run(["compact", "--server", "127.0.0.1:\(server.port)"])
        #expect(compacted.text.hasSuffix("holds writes up to log sequence 2\n"), "\(compacted.text)")
        server.kill9()
    }

    @Test("settings: flags over ENTITLEMENTS_* variables over the config file over defaults; bad values name their source")
    func settingsPrecedence() throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("cli-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let file = directory + "/serve.json"
        try Data(#"{"cache-bytes": "32MiB", "max-batch": 50, "resolvers": 4, "no-tcp": false}"#.utf8).write(to: URL(fileURLWithPath: file))
        let printed = try Self.run(
            ["serve", "--snapshot", "s.snap", "--config", file, "--resolvers", "3", "--print-config"],
            environment: ["ENTITLEMENTS_CACHE_BYTES": "16MiB", "ENTITLEMENTS_RESOLVERS": "2"]
        )
        #expect(printed.status == 0)
        let lines = Set(printed.text.split(separator: "\n").map(String.init))
        for expected in [
            "resolvers = 3  # flag",
            "cache-bytes = 16MiB  # environment",
            "max-batch = 50  # config file \(file)",
            "listen = 127.0.0.1:7420  # default",
            "snapshot = s.snap  # flag",
        ] {
            #expect(lines.contains(expected), "\(printed.text)")
        }
        let badVariable = try Self.run(["serve", "--snapshot", "s.snap"], environment: ["ENTITLEMENTS_CACHE_BYTES": "lots"])
        #expect(badVariable.status == 64)
        #expect(badVariable.text.contains("ENTITLEMENTS_CACHE_BYTES \"lots\" is not a size"), "\(badVariable.text)")
        try Data(#"{"cache": "1GiB"}"#.utf8).write(to: URL(fileURLWithPath: file))
        let badFile = try Self.run(["serve", "--snapshot", "s.snap", "--config", file])
        #expect(badFile.status == 64)
        #expect(badFile.text.contains("\(file): unknown setting \"cache\""), "\(badFile.text)")
        try Data(#"{"frame-timeout": "soon"}"#.utf8).write(to: URL(fileURLWithPath: file))
        let badValue = try Self.run(["serve", "--snapshot", "s.snap", "--config", file])
        #expect(badValue.text.contains("\(file): frame-timeout \"soon\" is not a duration"), "\(badValue.text)")
    }

    @Test("a drain cut short (a second SIGTERM, or --drain-timeout) closes what is left and exits 1", arguments: ["second signal", "timeout"])
    func drainCutShort(how: String) async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("cli-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let path = directory + "/data.snap"
        _ = try SnapshotTools.generate(count: 20_000, seed: 8, now: now, outputPath: path)
        let (process, pipe, seen, port) = try Self.start([
            "serve", "--snapshot", path, "--listen", "127.0.0.1:0", "--threads", "2", "--resolvers", "1",
            "--cache-bytes", "1KiB", "--drain-timeout", how == "timeout" ? "200ms" : "60s",
        ])
        // Work accepted before the signal that takes far longer than the drain is given:
        // on each of two connections, 400 batches of 1,000 cache misses (small answers: an
        // entitlement nobody has), then a PING. The lone resolver lives on one of the two
        // event loops, and the two connections land on different loops (round-robin), so one
        // connection only reads and hands its checks to the other loop, whose queue grows.
        // Frames are handled in order, so that connection's PONG says all 400 of its
        // batches were accepted; the signal goes then. (Waiting for a first answer raced the
        // server instead: on a fast machine the drain began after the work was done.)
        let batches = 400
        let users = (0..<1_000).map { "user-\(($0 * 7_919) % 20_000)" }
        let frames = (1...batches).map { id in
            RawConnection.request(
                UInt64(id),
                BatchCheckEntitlementsRequest(userIds: users, entitlementIds: ["none-has-this"], at: now),
                method: .batchCheckEntitlements
            )
        } + [Frame(type: .ping, requestID: 1)]
        let answered = Mutex([0, 0])  // per connection
        let ponged = Mutex(false)
        let goneAway = Mutex(false)
        let connections = try (0..<2).map { _ in try RawConnection(port: port) }
        let readers = connections.indices.map { index in
            Thread {
                while let frame = try? connections[index].receive() {
                    if frame.type == .pong {
                        ponged.withLock { $0 = true }
                    } else if frame.type == .goAway {
                        goneAway.withLock { $0 = true }
                    } else if frame.type == .response {
                        answered.withLock { $0[index] += 1 }
                    }
                }
            }
        }
        readers.forEach { $0.start() }
        let senders = connections.map { connection in Thread { connection.send(frames) } }
        senders.forEach { $0.start() }
        let patience = ContinuousClock.now + .seconds(120)
        while !ponged.withLock({ $0 }), ContinuousClock.now < patience {
            try await Task.sleep(for: .milliseconds(5))
        }
        try #require(ponged.withLock { $0 }, "no PONG within 120 s")
        // The connection that only reads and hands off has (almost) nothing answered yet.
        let answeredBeforeSignal = answered.withLock { $0.min()! }
        kill(process.processIdentifier, SIGTERM)
        if how == "second signal" {
            // Once the first has been handled (its GOAWAY is here): two signals that arrive
            // before the server's handler runs are one to it.
            let handled = ContinuousClock.now + .seconds(30)
            while !goneAway.withLock({ $0 }), ContinuousClock.now < handled {
                try await Task.sleep(for: .milliseconds(5))
            }
            kill(process.processIdentifier, SIGTERM)
        }
        try await offThePool { process.waitUntilExit() }
        let output = seen + String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(process.terminationStatus == 1, "\(output)")
        #expect(output.contains("draining: GOAWAY sent"), "\(output)")
        let expected = how == "timeout" ? "the drain did not finish within --drain-timeout" : "second signal: closed"
        #expect(output.contains(expected), "\(output)")
        #expect(answeredBeforeSignal < batches, "the connection off the resolver's loop had every batch answered before the signal: too little work left to cut short")
        #expect(answered.withLock { $0.reduce(0, +) } < 2 * batches, "every batch was answered: the drain was not cut short")
    }
}
