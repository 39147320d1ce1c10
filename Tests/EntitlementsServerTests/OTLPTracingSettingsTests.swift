import EntitlementsTracing
import Testing

/// serve's --otlp-endpoint and --trace-sample-ratio, before anything is sent.
@Suite("OTLP tracing settings")
struct OTLPTracingSettingsTests {
    @Test("an endpoint must be an http or https URL, a ratio from 0 to 1")
    func problems() {
        #expect(OTLPTracingSettings(endpoint: "http://127.0.0.1:4318").problem == nil)
        #expect(OTLPTracingSettings(endpoint: "https://collector.example:4318/custom/path").problem == nil)
        #expect(OTLPTracingSettings(endpoint: "collector:4318").problem?.contains("is not an http:// or https:// URL") == true)
        #expect(OTLPTracingSettings(endpoint: "http://").problem != nil)
        #expect(OTLPTracingSettings(endpoint: "http://c:4318", sampleRatio: 1.5).problem?.contains("must be from 0 to 1") == true)
    }

    @Test("the tracer starts with usable settings and refuses others with the reason")
    func start() throws {
        #expect(throws: OTLPTracingError.self) {
            try OTLPTracing.start(OTLPTracingSettings(endpoint: "ftp://c"), logger: .init(label: "test"))
        }
        let started = try OTLPTracing.start(OTLPTracingSettings(endpoint: "http://127.0.0.1:4318", sampleRatio: 1), logger: .init(label: "test"), environment: [:])
        #expect(started != nil)
    }

    @Test("OTEL_SDK_DISABLED turns tracing off; a gRPC OTLP protocol is refused with the reason")
    func environment() throws {
        let settings = OTLPTracingSettings(endpoint: "http://127.0.0.1:4318")
        #expect(try OTLPTracing.start(settings, logger: .init(label: "test"), environment: ["OTEL_SDK_DISABLED": "true"]) == nil)
        #expect(throws: OTLPTracingError.self) {
            try OTLPTracing.start(settings, logger: .init(label: "test"), environment: ["OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"])
        }
        do {
            _ = try OTLPTracing.start(settings, logger: .init(label: "test"), environment: ["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"])
            Issue.record("a gRPC protocol was accepted")
        } catch {
            #expect("\(error)".contains("exports OTLP over HTTP only"))
        }
    }
}
