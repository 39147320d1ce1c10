import ArgumentParser
import Dispatch
import EntitlementsConsole
import EntitlementsDoors
import EntitlementsEvents
import EntitlementsFleet
import EntitlementsIngestion
import EntitlementsSecurity
import EntitlementsServer
import EntitlementsStore
import EntitlementsTracing
import Foundation
import Logging
import Metrics
import NIOCore
import NIOPosix
import Prometheus
import ServiceLifecycle
import Synchronization
import UnixSignals

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// `entitlements serve`: answer CheckEntitlements over TCP and/or a Unix socket, take
/// writes with a data directory, and expose /healthz, /readyz and /metrics with --admin.
struct ServeCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "serve",
        abstract: "Serve entitlement checks (docs/server.md, docs/operations.md).",
        discussion: """
            Every option may also come from the environment (ENTITLEMENTS_CACHE_BYTES=64MiB) or a JSON \
            config file (--config), in that order of precedence after the flags. SIGINT or SIGTERM drains: \
            GOAWAY to every connection, accepted requests are answered, the log is flushed, exit 0; a second \
            signal, or --drain-timeout running out, closes what is left and exits 1.
            """
    )

    @Option(help: "A JSON file of settings, e.g. {\"listen\": \"0.0.0.0:7420\", \"cache-bytes\": \"1GiB\"}.")
    var config: String?

    @Flag(help: "Print the effective settings (and where each came from), then exit.")
    var printConfig = false

    @Option(help: "The snapshot to serve read-only; with --data-dir, the seed of a new data directory.")
    var snapshot: String?
    @Option(help: "The data directory (snapshot, write-ahead log); enables writes. See docs/durability.md.")
    var dataDir: String?
    @Option(help: "When the log fsyncs: batch (group commit, default) or always. Both are safe.")
    var fsync: String?
    @Option(help: "Compact when the log reaches this size (default 64MiB); 0 compacts only when asked.")
    var compactAfter: String?
    @Option(help: "How far back a customer's history reaches at least (default 7d): the log and snapshot compaction keeps in DIR/history; 0 keeps nothing. See docs/durability.md, \"History\".")
    var historyRetention: String?
    @Option(help: "TCP address to listen on, HOST:PORT (default 127.0.0.1:7420); port 0 picks a free port.")
    var listen: String?
    @Option(help: "Also listen on this Unix domain socket (for sidecars).")
    var unix: String?
    @Flag(help: "Do not listen on TCP (with --unix).")
    var noTcp = false
    @Flag(help: "Serve the support console at /console on the admin listener (with --admin); grants and revokes need a write token. See docs/console.md.")
    var console = false
    @Option(help: "Event loop threads (connections and resolvers). Default: CPU cores; 1 on a server pinned to one core.")
    var threads: String?
    @Option(help: "Resolver actors, each owning a cache shard. Default: CPU cores.")
    var resolvers: String?
    @Option(help: "Cache budget, e.g. 64MiB, 1GiB or a number of bytes (default 256MiB).")
    var cacheBytes: String?
    @Option(help: "What a full cache keeps: tinylfu (the answers asked for most often; default) or lru (the most recent).")
    var cachePolicy: String?
    @Option(help: "Threads that read cache misses off the event loops (default 8); 0 reads them on the loop.")
    var coldReadThreads: String?
    @Option(help: "Cache misses being read or waiting at once (default 1024); more get RESOURCE_EXHAUSTED.")
    var coldReadQueue: String?
    @Option(help: "The largest frame payload accepted, in bytes (default 1048576).")
    var maxFrameBytes: String?
    @Option(help: "Connections open at once (default 10000); more get RESOURCE_EXHAUSTED.")
    var maxConnections: String?
    @Option(help: "Calls in flight per connection before the server stops reading it (default 1024).")
    var maxInFlight: String?
    @Option(help: "Users in one BatchCheckEntitlements or watch (default 1000).")
    var maxBatch: String?
    @Option(help: "WatchEntitlements streams open at once (default 1024).")
    var maxWatches: String?
    @Option(help: "Events a watch holds for a client that does not read, before ending it (default 1024).")
    var watchBuffer: String?
    @Option(help: "Close connections idle this long, e.g. 300s (default), 5m.")
    var idleTimeout: String?
    @Option(help: "A frame must arrive in full this long after its first byte (default 10s).")
    var frameTimeout: String?
    @Option(help: "Time to finish accepted calls after SIGTERM/SIGINT (default 30s).")
    var drainTimeout: String?
    @Option(help: "Admin HTTP listener HOST:PORT for /healthz, /readyz and /metrics; off by default. Keep it on loopback.")
    var admin: String?
    @Option(help: "The gRPC and HTTP/JSON door HOST:PORT (docs/doors.md): entitlements.v1.EntitlementService and grpc.health.v1.Health over gRPC, and JSON calls over HTTP/1.1 or HTTP/2; off by default.")
    var grpcListen: String?
    @Option(help: "The store webhooks' HTTP HOST:PORT (docs/ingestion.md): POST /webhooks/stripe and /webhooks/appstore; off by default. Needs --data-dir and a store's settings.")
    var webhooksListen: String?
    @Option(help: "Stripe's endpoint signing secrets, one a line (whsec_...; several while one is rolled). Turns on POST /webhooks/stripe.")
    var stripeWebhookSecretFile: String?
    @Option(help: "POST a signed event to this URL when a customer's access changes (docs/events.md). Repeatable. Needs --data-dir.")
    var eventWebhook: [String] = []
    @Option(help: "The signing secrets of the --event-webhook destinations, one a line; each POST carries a signature by each.")
    var eventWebhookSecretFile: String?
    @Option(help: "The longest wait between two attempts to deliver an event (default 10m; they start at 1s and double).")
    var eventRetryMaxInterval: String?
    @Option(help: "How long an event is retried after its first attempt before it is given up (default 72h).")
    var eventRetryHorizon: String?
    @Option(help: "The most bytes of undelivered events DATA-DIR/events keeps (default 1GiB); past it the oldest are dropped, loudly.")
    var eventOutboxLimit: String?
    @Option(help: "The metadata key naming the user id on a Stripe subscription or customer (default user_id).")
    var stripeCustomerKey: String?
    @Option(help: "Apple Root CA - G3 as a file (PEM or DER, from apple.com/certificateauthority): App Store notifications must chain to it. Turns on POST /webhooks/appstore.")
    var appstoreRootCert: String?
    @Option(help: "The bundle ids of the apps whose App Store notifications are accepted, comma-separated. Required with --appstore-root-cert.")
    var appstoreBundleId: String?
    @Option(help: "The App Store Server API's in-app purchase key (.p8, from App Store Connect): reads renewal states on SubmitPurchase, histories (appstore sync) and missed notifications.")
    var appstoreApiKey: String?
    @Option(help: "The id of --appstore-api-key.")
    var appstoreKeyId: String?
    @Option(help: "Your team's issuer id for the App Store Server API.")
    var appstoreIssuerId: String?
    @Option(help: "The App Store Server API's production base URL (default https://api.storekit.itunes.apple.com).")
    var appstoreApiUrl: String?
    @Option(help: "The App Store Server API's sandbox base URL (default https://api.storekit-sandbox.itunes.apple.com).")
    var appstoreSandboxApiUrl: String?
    @Option(help: "With --appstore-api-key: how often to scan for App Store subscriptions whose notice never came (default 15m; off: never).")
    var appstoreRecheckInterval: String?
    @Option(help: "The most App Store Server API reads a minute the recheck makes (default 60).")
    var appstoreRecheckRate: String?
    @Option(help: "The Android package names whose Google Play notifications are accepted, comma-separated (docs/ingestion.md).")
    var googleplayPackage: String?
    @Option(help: "The Google service account's JSON key file, as Google issues it: reads purchases with the Play Developer API and pulls from Pub/Sub.")
    var googleplayServiceAccount: String?
    @Option(help: "The Play Developer API's base URL (default https://androidpublisher.googleapis.com).")
    var googleplayApiUrl: String?
    @Option(help: "The audience of the Pub/Sub push subscription's tokens. Turns on POST /webhooks/googleplay.")
    var googleplayPushAudience: String?
    @Option(help: "The service account email the Pub/Sub push tokens must name.")
    var googleplayPushServiceAccount: String?
    @Option(help: "Google's keys for the push tokens (default https://www.googleapis.com/oauth2/v3/certs).")
    var googleplayJwksUrl: String?
    @Option(help: "Pull the notifications from this Pub/Sub subscription (projects/P/subscriptions/S).")
    var googleplayPubsubSubscription: String?
    @Option(help: "Pub/Sub's base URL for pull (default https://pubsub.googleapis.com).")
    var googleplayPubsubUrl: String?
    @Option(help: "trace, debug, info (default), notice, warning, error or critical.")
    var logLevel: String?
    @Option(help: "How long a check with min_log_sequence waits for this server to apply it (default 100ms).")
    var minSequenceWait: String?
    @Option(help: "Fleet mode: the shared PostgreSQL database, postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE (docs/fleet.md). Needs --data-dir.")
    var postgres: String?
    @Option(help: "Fleet mode: poll the change log this often when no NOTIFY arrives (default 250ms).")
    var fleetPollInterval: String?
    @Option(help: "Fleet mode: LISTEN for the writers' NOTIFY, true (default) or false (polling only).")
    var fleetListen: String?
    @Option(help: "Fleet mode: connections to PostgreSQL for writes and polls, 1 to 100 (default 4; LISTEN takes one more).")
    var fleetConnections: String?
    @Option(help: "Fleet mode: how long a write waits after COMMIT for this server to apply it (default 1s).")
    var fleetWriteWait: String?
    @Option(help: "Fleet mode: a read replica of --postgres to poll and to export from at a fresh start (same URL form).")
    var fleetReadUrl: String?
    @Option(help: "Fleet mode: past this long since the last successful poll of PostgreSQL, check answers are stale (default 30s).")
    var maxStaleness: String?
    @Option(help: "Fleet mode: a stale server answers checks flagged stale (open, the default) or refuses them with UNAVAILABLE (closed).")
    var stalePolicy: String?
    @Option(help: "Accepted tokens, one a line: TOKEN [check|write|check,write] (docs/security.md). Reloaded when the file changes and on SIGHUP.")
    var authTokenFile: String?
    @Flag(help: "Let a listener on a non-loopback address take writes from callers without credentials (turns protected mode off).")
    var allowUnauthenticatedWrites = false
    @Option(help: "What the TCP listener serves at all: none, check, write or check,write (default).")
    var listenPermissions: String?
    @Option(help: "What a caller without credentials may do on the TCP listener. Default: check with --auth-token-file or --tls-client-ca, else check,write.")
    var listenAnonymous: String?
    @Option(help: "What the Unix socket serves at all (default check,write).")
    var unixPermissions: String?
    @Option(help: "What a caller without credentials may do on the Unix socket (default check,write: the file's mode decides who connects).")
    var unixAnonymous: String?
    @Option(help: "The Unix socket file's mode, octal (default 0660).")
    var unixMode: String?
    @Option(help: "The Unix socket file's owner and group: USER[:GROUP] or :GROUP, names or ids.")
    var unixOwner: String?
    @Option(help: "What the gRPC and HTTP/JSON door serves at all (default check,write).")
    var grpcPermissions: String?
    @Option(help: "What a caller without credentials may do through the door (default as --listen-anonymous).")
    var grpcAnonymous: String?
    @Option(help: "check (default): /metrics is open; none: /metrics needs a token. /healthz and /readyz are always open.")
    var adminAnonymous: String?
    @Option(help: "TLS on the TCP listeners (framed, door, admin): the certificate chain file, PEM. Reloaded on SIGHUP.")
    var tlsCert: String?
    @Option(help: "The private key of --tls-cert, PEM, unencrypted.")
    var tlsKey: String?
    @Option(help: "Mutual TLS: clients must present a certificate this CA (PEM) signed; it counts as authentication.")
    var tlsClientCa: String?
    @Option(help: "What a client certificate may do, by its subject's common name: NAME=PERMISSIONS entries, * for the rest (default *=check,write).")
    var tlsClientPermissions: String?
    @Option(help: "Send a span per call to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 (docs/tracing.md); off by default.")
    var otlpEndpoint: String?
    @Option(help: "The share of the traces this server starts that it records, 0 to 1 (default 0.01); a caller's sampled trace is always recorded.")
    var traceSampleRatio: String?

    /// The flags given, by setting name.
    private var flagValues: [String: String] {
        var values: [String: String] = [:]
        let options: [(String, String?)] = [
            ("snapshot", self.snapshot), ("data-dir", self.dataDir), ("fsync", self.fsync), ("compact-after", self.compactAfter), ("history-retention", self.historyRetention),
            ("listen", self.listen), ("unix", self.unix), ("threads", self.threads), ("resolvers", self.resolvers), ("cache-bytes", self.cacheBytes), ("cache-policy", self.cachePolicy),
            ("cold-read-threads", self.coldReadThreads), ("cold-read-queue", self.coldReadQueue),
            ("max-frame-bytes", self.maxFrameBytes), ("max-connections", self.maxConnections), ("max-in-flight", self.maxInFlight),
            ("max-batch", self.maxBatch), ("max-watches", self.maxWatches), ("watch-buffer", self.watchBuffer),
            ("idle-timeout", self.idleTimeout), ("frame-timeout", self.frameTimeout), ("drain-timeout", self.drainTimeout),
            ("admin", self.admin), ("grpc-listen", self.grpcListen), ("webhooks-listen", self.webhooksListen),
            ("stripe-webhook-secret-file", self.stripeWebhookSecretFile), ("stripe-customer-key", self.stripeCustomerKey),
            ("appstore-root-cert", self.appstoreRootCert), ("appstore-bundle-id", self.appstoreBundleId), ("appstore-api-key", self.appstoreApiKey),
            ("appstore-key-id", self.appstoreKeyId), ("appstore-issuer-id", self.appstoreIssuerId), ("appstore-api-url", self.appstoreApiUrl),
            ("appstore-sandbox-api-url", self.appstoreSandboxApiUrl), ("appstore-recheck-interval", self.appstoreRecheckInterval), ("appstore-recheck-rate", self.appstoreRecheckRate),
            ("googleplay-package", self.googleplayPackage), ("googleplay-service-account", self.googleplayServiceAccount), ("googleplay-api-url", self.googleplayApiUrl),
            ("googleplay-push-audience", self.googleplayPushAudience), ("googleplay-push-service-account", self.googleplayPushServiceAccount),
            ("googleplay-jwks-url", self.googleplayJwksUrl), ("googleplay-pubsub-subscription", self.googleplayPubsubSubscription), ("googleplay-pubsub-url", self.googleplayPubsubUrl),
            ("log-level", self.logLevel), ("min-sequence-wait", self.minSequenceWait), ("postgres", self.postgres),
            ("fleet-poll-interval", self.fleetPollInterval), ("fleet-listen", self.fleetListen), ("fleet-write-wait", self.fleetWriteWait), ("fleet-connections", self.fleetConnections),
            ("max-staleness", self.maxStaleness), ("stale-policy", self.stalePolicy), ("fleet-read-url", self.fleetReadUrl),
            ("auth-token-file", self.authTokenFile), ("listen-permissions", self.listenPermissions), ("listen-anonymous", self.listenAnonymous),
            ("unix-permissions", self.unixPermissions), ("unix-anonymous", self.unixAnonymous), ("unix-mode", self.unixMode), ("unix-owner", self.unixOwner),
            ("grpc-permissions", self.grpcPermissions), ("grpc-anonymous", self.grpcAnonymous), ("admin-anonymous", self.adminAnonymous),
            ("tls-cert", self.tlsCert), ("tls-key", self.tlsKey), ("tls-client-ca", self.tlsClientCa), ("tls-client-permissions", self.tlsClientPermissions),
            ("otlp-endpoint", self.otlpEndpoint), ("trace-sample-ratio", self.traceSampleRatio),
            ("event-webhook-secret-file", self.eventWebhookSecretFile), ("event-retry-max-interval", self.eventRetryMaxInterval),
            ("event-retry-horizon", self.eventRetryHorizon), ("event-outbox-limit", self.eventOutboxLimit),
        ]
        for case let (name, value?) in options {
            values[name] = value
        }
        if !self.eventWebhook.isEmpty {
            values["event-webhook"] = self.eventWebhook.joined(separator: " ")
        }
        if self.noTcp {
            values["no-tcp"] = "true"
        }
        if self.console {
            values["console"] = "true"
        }
        if self.allowUnauthenticatedWrites {
            values["allow-unauthenticated-writes"] = "true"
        }
        return values
    }

    private func settings() throws -> ServeSettings {
        try ServeSettings(flags: self.flagValues, environment: ProcessInfo.processInfo.environment, configFile: self.config)
    }

    func validate() throws {
        _ = try self.settings().serverConfiguration()
    }

    func run() async throws {
        let settings = try self.settings()
        let security = try settings.listenerSecurity()
        let configuration = try settings.serverConfiguration(security: security)
        let threads = try settings.integer("threads", in: 1...1_024)
        if self.printConfig {
            print(settings.printed)
            return
        }
        let level = try settings.logLevel()
        LoggingSystem.bootstrap { label in
            var handler = StreamLogHandler.standardError(label: label)
            handler.logLevel = level
            return handler
        }
        let logger = Logger(label: "entitlements")
        let readiness = Readiness()

        // Metrics: swift-metrics backed by a Prometheus registry; the request latency
        // histogram is ServerMetrics' own, appended to /metrics below.
        let registry = PrometheusCollectorRegistry()
        let factory = PrometheusMetricsFactory(registry: registry)
        let metrics = ServerMetrics(factory: factory)
        let running = RunningServer(configuration: configuration)
        let fleetMetrics = FleetMetrics(factory: factory)

        // The admin listener comes first, so that probes see "starting" during replay.
        var admin: AdminServer?
        if let (host, port) = try settings.address("admin") {
            do {
                admin = try await AdminServer.start(
                    host: host,
                    port: port,
                    security: security.admin,
                    endpoints: .init(
                        readiness: { running.describe(readiness.state()) },
                        console: try settings.bool("console") ? Console { running.server?.methods } : nil,
                        routes: try settings.events() != nil ? [EventsAdmin { running.events }] : []
                    ) {
                        await running.server?.refreshMetrics()
                        if let fleet = running.fleet {
                            fleetMetrics.refresh(fleet.status, stale: running.isStale)
                        }
                        var bytes: [UInt8] = []
                        registry.emit(into: &bytes)
                        metrics.emitLatency(into: &bytes)
                        return bytes
                    },
                    group: .singleton,
                    idleTimeout: configuration.idleTimeout,
                    arrivalTimeout: configuration.frameTimeout,
                    refused: { refusal, peer in running.server?.methods.recordRefusal(refusal, listener: "admin", peer: peer) }
                )
                Self.say("admin listening on \(host):\(admin?.address?.port ?? port)")
                if try settings.bool("console") {
                    Self.say("console at http://\(host):\(admin?.address?.port ?? port)/console (TLS settings make it https)")
                }
            } catch {
                Self.say("error: cannot listen on --admin \(host):\(port): \(error)")
                throw ExitCode(2)
            }
        }

        let store: CustomerStore
        var fleet: FleetService?
        var events: OutboundEvents?
        do {
            // The events' outbox is opened once the store holds the data directory's lock;
            // before, only what the log replays is kept for it.
            let eventsConfiguration = try settings.events()
            var replay: EventReplay?
            if eventsConfiguration != nil {
                guard let dataDir = settings.dataDirectory else {
                    throw ValidationError("--event-webhook needs --data-dir: the events wait for delivery in DATA-DIR/events")
                }
                replay = EventReplay(directory: "\(dataDir)/events")
            }
            if let url = try settings.fleetURL() {
                (store, fleet) = try await Self.openFleet(settings, url: url, logger: logger, replayed: replay?.observer)
                running.set(fleet: fleet?.tailer)
            } else {
                store = try Self.openStore(settings, replayed: replay?.observer)
            }
            if let eventsConfiguration, let replay {
                events = try OutboundEvents.open(configuration: eventsConfiguration, replay: replay, store: store, logger: logger, metrics: factory, now: WallClock.unixMilliseconds())
            }
            if let events {
                if let fleet {
                    // One server of the fleet delivers at a time: the lease's holder.
                    let holder = "\(ProcessInfo.processInfo.hostName)/\(getpid())/\(UInt32.random(in: 0...UInt32.max))"
                    events.attach(to: store, coordinator: FleetEvents(database: fleet.database), holder: holder)
                } else {
                    events.attach(to: store)
                }
                running.set(events: events)
                let names = events.configuration.destinations.map(\.name).joined(separator: ", ")
                Self.say("events: delivering to \(names); \(events.outbox.path) holds \(events.list(failedOnly: false, customerId: nil, limit: .max).count) events")
            }
        } catch {
            Self.say("error: cannot serve: \(error)")
            throw ExitCode(2)
        }
        let reader = store.snapshot
        // SIGTERM and SIGINT are trapped before the listeners open, so that from the
        // `listening on` line on a signal always drains (a signal before the ServiceGroup
        // runs waits in the sequence's buffer). Until here, a signal ends the process as
        // usual: nothing has been accepted yet.
        let signals = await UnixSignalsSequence(trapping: .sigterm, .sigint)
        // Spans, when --otlp-endpoint is given: the router's tracing rule, and the exporter
        // run in the ServiceGroup (stopped last, so that the drain's calls are sent too).
        var tracing: OTLPTracing?
        do {
            tracing = try settings.tracing().flatMap { try OTLPTracing.start($0, logger: logger) }
        } catch {
            Self.say("error: cannot serve: \(error)")
            throw ExitCode(2)
        }
        // The store webhooks, and Google Play's client (made before the server: its pull
        // starts once the server runs).
        let webhooks: (door: ServerDoor?, ingestion: WebhookIngestion?)
        let recheck: (interval: Duration, perMinute: Int)?
        do {
            var play: GooglePlay?
            if let playSettings = try settings.googlePlay() {
                play = await GooglePlay(settings: playSettings)
            }
            var appStoreAPI: AppStoreServerAPI?
            if let apiSettings = try settings.appStoreAPI() {
                appStoreAPI = await AppStoreServerAPI(settings: apiSettings)
            }
            recheck = try settings.appStoreRecheck()
            webhooks = try settings.webhooks(factory: factory, security: security.webhooks, googlePlay: play, appStoreAPI: appStoreAPI)
        } catch {
            Self.say("error: cannot serve: \(error)")
            throw ExitCode(2)
        }
        let server: EntitlementsServer
        do {
            server = try await EntitlementsServer.start(
                store: store,
                configuration: configuration,
                group: MultiThreadedEventLoopGroup(numberOfThreads: threads),
                metrics: metrics,
                logger: logger,
                doors: (try settings.address("grpc-listen").map { [Doors.grpcAndJSON(host: $0.0, port: $0.1, security: security.grpc)] } ?? [])
                    + (webhooks.door.map { [$0] } ?? []),
                tracing: tracing.map { CallTracing(tracer: $0.tracer) },
                purchases: webhooks.ingestion
            ) { message in
                logger.notice("\(message)")
            }
        } catch {
            let places = [
                configuration.tcp.map { "\($0.host):\($0.port)" }, configuration.unixSocketPath.map { "unix:\($0)" },
                (try? settings.address("grpc-listen")).flatMap { $0 }.map { "--grpc-listen \($0.0):\($0.1)" },
                (try? settings.address("webhooks-listen")).flatMap { $0 }.map { "--webhooks-listen \($0.0):\($0.1)" },
            ]
                .compactMap { $0 }.joined(separator: " and ")
            Self.say("error: cannot listen on \(places): \(error)")
            throw ExitCode(2)
        }
        running.set(server)
        let warm = server.pool.warmup
        Self.say("serving snapshot \(reader.header.snapshotId ?? "-") (\(reader.header.recordCount) customers) with \(server.pool.resolvers.count) resolvers, \(store.isWritable ? "writes on (fsync \(settings.text("fsync") ?? "batch"))" : "read-only")")
        Self.say("cache warmed: \(warm.customersCached) customers, \(warm.bytes) bytes of \(configuration.cacheBytes)")
        if let address = server.tcpAddress {
            Self.say("listening on \(address.ipAddress ?? "?"):\(address.port ?? 0)")
        }
        if let path = server.unixSocketPath {
            Self.say("listening on unix:\(path)")
        }
        if let address = server.doorAddresses["grpc"] {
            Self.say("grpc listening on \(address.ipAddress ?? "?"):\(address.port ?? 0)")
        }
        if let address = server.doorAddresses["webhooks"] {
            let routes = settings.webhookRoutes()
            Self.say("webhooks listening on \(address.ipAddress ?? "?"):\(address.port ?? 0) (POST \(routes.joined(separator: ", "))\(security.webhooks.tls != nil ? ", TLS" : ""))")
        }
        Self.describe(security, configuration, door: server.doorAddresses["grpc"] != nil)
        readiness.set(.ready)

        // Lifecycle: the first SIGTERM/SIGINT drains, within --drain-timeout; a second one
        // or the timeout cancels the drain (SignalHandler).
        let drainTimeout = try settings.duration("drain-timeout")
        let service = EntitlementsService(server: server) {
            readiness.set(.draining)
            Self.say("draining: GOAWAY sent, finishing accepted calls (at most \(Double(drainTimeout.nanoseconds) / 1e9) s)")
        }
        let signalHandler = SignalHandler(signals: signals)
        var services: [ServiceGroupConfiguration.ServiceConfiguration] = [
            .init(service: signalHandler, successTerminationBehavior: .ignore, failureTerminationBehavior: .cancelGroup),
        ]
        if let tracing {
            // A collector that cannot be reached loses spans (swift-otel logs it), never calls.
            services.append(.init(service: tracing.service, successTerminationBehavior: .ignore, failureTerminationBehavior: .ignore))
        }
        if security.tokens != nil || security.tls != nil {
            let reloader = CredentialReloader(tokens: security.tokens, tls: security.tls, signals: await UnixSignalsSequence(trapping: .sighup), failures: metrics.reloadFailures, say: Self.say)
            services.append(.init(service: reloader, successTerminationBehavior: .ignore, failureTerminationBehavior: .ignore))
        }
        if let fleet {
            // Shut down after the server (services stop in reverse order): the tailer keeps
            // applying while accepted calls finish.
            services.append(.init(service: fleet, successTerminationBehavior: .ignore, failureTerminationBehavior: .gracefullyShutdownGroup))
        }
        if let events {
            // Stopped after the server (services stop in reverse order): the writes of the
            // drain still get their events; the outbox is made durable as it stops.
            services.append(.init(service: events, successTerminationBehavior: .ignore, failureTerminationBehavior: .ignore))
        }
        services.append(.init(service: service))
        if let ingestion = webhooks.ingestion, let puller = GooglePlayPuller(ingestion: ingestion, methods: server.methods, eventLoop: server.group.next()) {
            // Stopped first (services stop in reverse order): no message is taken once the drain starts.
            services.append(.init(service: puller, successTerminationBehavior: .ignore, failureTerminationBehavior: .ignore))
            Self.say("googleplay pulling from \(settings.text("googleplay-pubsub-subscription") ?? "?")")
        }
        if let ingestion = webhooks.ingestion, let recheck,
            let rechecker = AppStoreRecheck(ingestion: ingestion, methods: server.methods, eventLoop: server.group.next(), interval: recheck.interval, perMinute: recheck.perMinute)
        {
            services.append(.init(service: rechecker, successTerminationBehavior: .ignore, failureTerminationBehavior: .ignore))
            Self.say("appstore recheck every \(settings.text("appstore-recheck-interval") ?? "15m"), at most \(recheck.perMinute) reads a minute")
        } else if webhooks.ingestion?.appStoreAPI != nil {
            Self.say(
                settings.text("postgres") != nil && settings.text("appstore-recheck-interval") != "off"
                    ? "appstore recheck off (fleet mode: give --appstore-recheck-interval on the one node that should run it)" : "appstore recheck off"
            )
        }
        var groupConfiguration = ServiceGroupConfiguration(services: services, logger: logger)
        groupConfiguration.maximumGracefulShutdownDuration = .nanoseconds(drainTimeout.nanoseconds)
        let group = ServiceGroup(configuration: groupConfiguration)
        signalHandler.attach(group)
        var cancelledBySignal = false
        do {
            try await group.run()
        } catch is SignalHandler.SecondSignal {
            cancelledBySignal = true
        } catch {
            logger.error("service group: \(error)")
        }
        await admin?.close()
        store.close()  // waits for queued writes' fsync
        await fleet?.database.close()
        if let failure = fleet?.failure {
            if failure.kind == .dataDirectory {
                Self.say("fleet: \(failure); this server stopped and will refuse to start on this data directory until the database has a new epoch (docs/fleet.md, \"Epochs\"), which starts it afresh and keeps the old data in the directory's replaced-<time> folder")
            } else {
                Self.say("fleet: \(failure); start the server again: it starts its data directory afresh from PostgreSQL")
            }
            throw ExitCode(1)
        }
        if service.drained {
            Self.say("stopped")
            return
        }
        Self.say(cancelledBySignal
            ? "second signal: closed \(server.connectionCount) connections without finishing the drain"
            : "the drain did not finish within --drain-timeout; closed the remaining connections")
        throw ExitCode(1)
    }

    /// Says how each listener is guarded, once at start (never a token).
    static func describe(_ security: ServeSecurity, _ configuration: ServerConfiguration, door: Bool) {
        if let tokens = security.tokens {
            Self.say("auth: \(tokens.count) tokens from \(tokens.path)")
        }
        if let tls = security.tls {
            Self.say("tls: \(tls.files.certificate), valid until \(ServerTLS.date(tls.notValidAfter))\(tls.requiresClientCertificates ? "; client certificates required (\(tls.files.clientCA ?? "-"))" : "")")
        }
        var listeners: [ListenerSecurity] = []
        if configuration.tcp != nil {
            listeners.append(security.tcp)
        }
        if door {
            listeners.append(security.grpc)
        }
        if configuration.unixSocketPath != nil {
            listeners.append(security.unix)
        }
        for listener in listeners {
            let policy = listener.policy
            Self.say("permissions: \(policy.name) serves \(policy.granted), anonymous callers \(policy.anonymous.intersection(policy.granted))\(listener.tls != nil ? ", TLS" : "")")
        }
    }

    static func openStore(_ settings: ServeSettings, replayed: (@Sendable (CustomerStore.CommittedWrite) -> Void)? = nil) throws -> CustomerStore {
        guard let dataDir = settings.dataDirectory else {
            return .readOnly(try SnapshotReader(path: settings.snapshot!))
        }
        let threshold = UInt64(try settings.bytes("compact-after"))
        let options = CustomerStore.Options(
            syncMode: try settings.syncMode(),
            compactAfterLogBytes: threshold == 0 ? nil : threshold,
            historyRetention: try settings.historyRetention(),
            replayed: replayed
        )
        let started = ContinuousClock.now
        let (store, report) = try CustomerStore.open(dataDirectory: dataDir, seed: settings.snapshot, options: options)
        if report.seeded {
            Self.say("data directory \(dataDir) seeded from \(settings.snapshot ?? "-")")
        } else if settings.snapshot != nil {
            Self.say("data directory \(dataDir) has a snapshot already; --snapshot is ignored")
        }
        for path in report.removedTemporaryFiles {
            Self.say("removed \(path), left by a compaction that did not finish")
        }
        if let torn = report.tornPath {
            Self.say("log: set aside a torn last batch of \(torn) at offset \(report.tornOffset ?? 0) (\(report.tornBytes) bytes, \(report.torn?.description ?? "never acknowledged")), kept in \(report.tornSideFile ?? "-")")
        }
        Self.say("log replayed: \(report.replayedRecords) writes applied (\(report.skippedRecords) already in the snapshot) in \(started.duration(to: .now))")
        return store
    }

    /// Fleet mode: checks the database, opens (or starts afresh) the data directory from
    /// it, and sends writes to it; the returned service tails its change log.
    static func openFleet(
        _ settings: ServeSettings,
        url: FleetDatabaseURL,
        logger: Logger,
        replayed: (@Sendable (CustomerStore.CommittedWrite) -> Void)? = nil
    ) async throws -> (CustomerStore, FleetService) {
        let threshold = UInt64(try settings.bytes("compact-after"))
        let poll = try settings.duration("fleet-poll-interval")
        let wait = try settings.duration("fleet-write-wait")
        let replica = try await FleetReplica.open(
            url: url,
            dataDirectory: settings.dataDirectory!,
            seed: settings.snapshot,
            configuration: .init(
                tailer: .init(pollInterval: .nanoseconds(poll.nanoseconds), listen: try settings.bool("fleet-listen")),
                writeWait: .nanoseconds(wait.nanoseconds),
                storeOptions: .init(
                    syncMode: try settings.syncMode(),
                    compactAfterLogBytes: threshold == 0 ? nil : threshold,
                    historyRetention: try settings.historyRetention(),
                    replayed: replayed
                ),
                connections: try settings.integer("fleet-connections", in: 1...100),
                readURL: try settings.fleetReadURL()
            ),
            logger: logger,
            now: WallClock.unixMilliseconds()
        )
        Self.say(replica.startup)
        Self.say("log replayed: \(replica.openReport.replayedRecords) writes applied (\(replica.openReport.skippedRecords) already in the snapshot)")
        let polled = try settings.fleetReadURL().map { "the replica \($0)" } ?? "it"
        Self.say("fleet mode: writes go to \(url); tailing its change log from sequence \(replica.store.committedSequence), polling \(polled)")
        return (replica.store, FleetService(tailer: replica.tailer, database: replica.database, logger: logger))
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
}

/// The server once started, for the metrics endpoint (which exists before it), and in
/// fleet mode its tailer.
final class RunningServer: Sendable {
    private let current = Mutex<EntitlementsServer?>(nil)
    private let tailer = Mutex<FleetTailer?>(nil)
    private let configuration: ServerConfiguration

    init(configuration: ServerConfiguration) {
        self.configuration = configuration
    }

    var server: EntitlementsServer? { self.current.withLock { $0 } }
    private let outbound = Mutex<OutboundEvents?>(nil)
    var events: OutboundEvents? { self.outbound.withLock { $0 } }

    func set(events: OutboundEvents) {
        self.outbound.withLock { $0 = events }
    }
    var fleet: FleetTailer? { self.tailer.withLock { $0 } }

    func set(_ server: EntitlementsServer) {
        self.current.withLock { $0 = server }
    }

    func set(fleet: FleetTailer?) {
        self.tailer.withLock { $0 = fleet }
    }

    /// Whether a fleet server is past --max-staleness (as checks measure it).
    var isStale: Bool {
        self.server.map { self.configuration.staleness(of: $0.store) != nil } ?? false
    }

    /// /readyz: the lifecycle's answer, and in fleet mode how current this server is.
    func describe(_ state: (ready: Bool, reason: String)) -> (ready: Bool, reason: String) {
        guard let status = self.fleet?.status else {
            return state
        }
        return status.readiness(state, stale: self.isStale, refusesWhenStale: self.configuration.stalePolicy == .closed, now: WallClock.unixMilliseconds())
    }
}
