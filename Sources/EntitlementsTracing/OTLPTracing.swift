import Foundation
public import Logging
import OTel
public import ServiceLifecycle
public import Tracing

/// Where serve's spans go (docs/tracing.md): an OTLP/HTTP endpoint (a collector, Jaeger,
/// Tempo...), protobuf-encoded, in batches. Off unless `--otlp-endpoint` is given.
public struct OTLPTracingSettings: Sendable {
    /// The collector's traces URL: a base such as `http://127.0.0.1:4318` gets OTLP's
    /// `/v1/traces`; a URL with a path is used as it is.
    public var endpoint: String
    /// The share of traces this server starts that it records (its own root spans: a framed
    /// call, a call without a `traceparent`); a call whose caller's trace is sampled is always
    /// recorded, one whose caller's is not never is (parent-based sampling).
    public var sampleRatio: Double
    /// How long spans wait before they are sent, at most.
    public var exportInterval: Duration
    /// `service.name` in the spans' resource.
    public var serviceName: String

    public init(endpoint: String, sampleRatio: Double = 0.01, exportInterval: Duration = .seconds(1), serviceName: String = "entitlements") {
        self.endpoint = endpoint
        self.sampleRatio = sampleRatio
        self.exportInterval = exportInterval
        self.serviceName = serviceName
    }

    /// What is wrong with the settings, for a person to fix; nil when they are usable.
    public var problem: String? {
        if let problem = Self.endpointProblem(self.endpoint, origin: "--otlp-endpoint") {
            return problem
        }
        guard self.sampleRatio >= 0, self.sampleRatio <= 1 else {
            return "--trace-sample-ratio \(self.sampleRatio) must be from 0 to 1 (e.g. 0.01 records 1 in 100 of the traces this server starts)"
        }
        return nil
    }

    /// Why `endpoint` (from `origin`: a flag, a variable) is not a collector's URL, or nil.
    public static func endpointProblem(_ endpoint: String, origin: String) -> String? {
        let lowered = endpoint.lowercased()
        guard lowered.hasPrefix("http://") || lowered.hasPrefix("https://"), endpoint.count > "https://".count else {
            return "\(origin) \"\(endpoint)\" is not an http:// or https:// URL (an OTLP/HTTP collector, e.g. http://127.0.0.1:4318)"
        }
        return nil
    }

    /// The traces URL the exporter posts to.
    var tracesURL: String {
        let afterScheme = self.endpoint.split(separator: "://", maxSplits: 1).last ?? ""
        if let slash = afterScheme.firstIndex(of: "/"), afterScheme[slash...] != "/" {
            return self.endpoint
        }
        return (self.endpoint.hasSuffix("/") ? String(self.endpoint.dropLast()) : self.endpoint) + "/v1/traces"
    }
}

/// swift-otel's tracer and exporter, made from ``OTLPTracingSettings``. The tracer is not
/// bootstrapped as the process's global one: the server is handed it (its router's tracing
/// rule), and the returned service, run in serve's ServiceGroup, sends the spans and
/// flushes them when the server stops. The standard `OTEL_*` environment variables
/// (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_BSP_*`, `OTEL_PROPAGATORS`...) are honoured and take
/// precedence; `OTEL_SDK_DISABLED=true` turns tracing off, and an OTLP protocol other than
/// `http/protobuf` or `http/json` is refused (this build carries the HTTP exporter only).
public struct OTLPTracing: Sendable {
    /// The tracer to hand the server.
    public let tracer: any Tracer
    /// Sends the spans; run it in the ServiceGroup.
    public let service: any Service

    /// The tracer and its exporter; nil when `environment` (default: the process's) turns
    /// tracing off (`OTEL_SDK_DISABLED=true`).
    public static func start(
        _ settings: OTLPTracingSettings,
        logger: Logger,
        environment: [String: String]? = nil
    ) throws -> OTLPTracing? {
        let environment = environment ?? ProcessInfo.processInfo.environment
        if let problem = settings.problem {
            throw OTLPTracingError(message: problem)
        }
        if environment["OTEL_SDK_DISABLED"]?.lowercased() == "true" {
            logger.notice("tracing off: OTEL_SDK_DISABLED=true overrides --otlp-endpoint")
            return nil
        }
        for name in ["OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] {
            if let value = environment[name], value != "http/protobuf", value != "http/json" {
                throw OTLPTracingError(message: "\(name)=\(value): this server exports OTLP over HTTP only (http/protobuf or http/json); unset it, or point --otlp-endpoint at the collector's HTTP port (4318)")
            }
        }
        var configuration = OTel.Configuration.default
        configuration.serviceName = settings.serviceName
        configuration.diagnosticLogger = .custom(logger)
        configuration.logs.enabled = false
        configuration.metrics.enabled = false
        configuration.traces.enabled = true
        configuration.traces.exporter = .otlp
        configuration.traces.otlpExporter.protocol = .httpProtobuf
        configuration.traces.otlpExporter.endpoint = settings.tracesURL
        configuration.traces.batchSpanProcessor.scheduleDelay = settings.exportInterval
        guard let sampler = OTel.Configuration.TracesConfiguration.SamplerConfiguration.parentBasedTraceIDRatio(ratio: settings.sampleRatio) else {
            throw OTLPTracingError(message: "--trace-sample-ratio \(settings.sampleRatio) must be from 0 to 1")
        }
        configuration.traces.sampler = sampler
        do {
            let backend = try OTel.makeTracingBackend(configuration: configuration)
            return OTLPTracing(tracer: backend.factory, service: backend.service)
        } catch {
            throw OTLPTracingError(message: "cannot set up tracing to \(settings.tracesURL) (check --otlp-endpoint and the OTEL_* variables): \(error)")
        }
    }
}

/// Tracing could not be set up: a message a person can act on.
public struct OTLPTracingError: Error, CustomStringConvertible {
    public var message: String
    public var description: String { self.message }
}
