public import EntitlementsWire
import NIOCore
public import Tracing

/// Distributed tracing, the router's first rule (docs/tracing.md): with a tracer (serve's
/// --otlp-endpoint), every routed call gets a server span, a child of the caller's W3C
/// trace context when its transport carries one (gRPC and HTTP metadata; the framed
/// protocol carries none, so its calls start traces of their own). Without one, the rule
/// costs the router one branch.
public struct CallTracing: Sendable {
    let tracer: any Tracer

    public init(tracer: any Tracer) {
        self.tracer = tracer
    }

    /// The service's name in span names and `rpc.service`.
    static let service = "entitlements.v1.EntitlementService"

    /// Opens the span of a call of `method` over `system` (`rpc.system`), started when its
    /// request was read.
    @inline(never)
    func start(_ method: MethodID, _ call: CallContext, system: String) -> CallSpan {
        var context = ServiceContext.topLevel
        if let headers = call.traceHeaders {
            self.tracer.extract(headers, into: &context, using: TraceHeaders.Extract())
        }
        // Spans take wall-clock instants; the call's start is a monotonic one.
        let elapsed = max(0, (NIODeadline.now() - call.start).nanoseconds)
        let now = DefaultTracerClock.now.nanosecondsSinceEpoch
        let started = DefaultTracerClock.Instant(nanosecondsSinceEpoch: now - min(now, UInt64(elapsed)))
        let span = self.tracer.startSpan("\(Self.service)/\(method)", context: context, ofKind: .server, at: started)
        span.updateAttributes { attributes in
            attributes["rpc.system"] = system
            attributes["rpc.service"] = Self.service
            attributes["rpc.method"] = "\(method)"
        }
        return CallSpan(span)
    }
}

/// The W3C trace context a transport read with a call (`traceparent`, `tracestate`): read
/// only when tracing is on.
public final class TraceHeaders: Sendable {
    public let traceparent: String?
    public let tracestate: String?

    public init(traceparent: String?, tracestate: String?) {
        self.traceparent = traceparent
        self.tracestate = tracestate
    }

    struct Extract: Extractor {
        func extract(key: String, from carrier: TraceHeaders) -> String? {
            switch key {
            case "traceparent": carrier.traceparent
            case "tracestate": carrier.tracestate
            default: nil
            }
        }
    }
}

/// The span of one call: the methods note on it what they did (a cache hit or miss, a
/// cold read, a wait for the fleet's log), and the router ends it with the call's status
/// when it counts the call.
public final class CallSpan: Sendable {
    private let span: any Span

    init(_ span: any Span) {
        self.span = span
    }

    /// A check's answer: where it came from.
    func note(_ answer: CheckAnswer) {
        self.span.updateAttributes { attributes in
            attributes["entitlements.cache"] = answer.source == .cache ? "hit" : "miss"
            attributes["entitlements.cold_read"] = answer.source == .disk
        }
    }

    /// A batch's size.
    func note(batchOf count: Int) {
        self.span.attributes["entitlements.batch_size"] = count
    }

    /// The call waits for the log to reach `sequence` (read-your-writes, `min_log_sequence`).
    func waiting(forSequence sequence: UInt64) {
        self.span.attributes["entitlements.min_log_sequence"] = Int64(clamping: sequence)
        self.span.addEvent("waiting for the log to reach min_log_sequence")
    }

    /// The wait for the log is over.
    func caughtUp() {
        self.span.addEvent("caught up with min_log_sequence")
    }

    /// Ends the span with the call's status (`rpc.grpc.status_code`; an error status
    /// carries its message).
    func end(_ status: StatusCode, _ message: String?) {
        self.span.attributes["rpc.grpc.status_code"] = Int(status.rawValue)
        if status != .ok {
            self.span.setStatus(SpanStatus(code: .error, message: message))
        }
        self.span.end()
    }

    /// Ends the span with `result`'s status, or CANCELLED when the call's scope closed
    /// meanwhile (as the call is counted).
    func end<Value>(_ result: Result<Value, ServiceError>, in scope: ConnectionScope? = nil) {
        if scope?.isClosed == true {
            self.end(.cancelled, "the caller went away")
            return
        }
        switch result {
        case .success: self.end(.ok, nil)
        case .failure(let error): self.end(error.status, error.message)
        }
    }
}
