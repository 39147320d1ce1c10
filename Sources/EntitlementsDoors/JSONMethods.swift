import EntitlementsFormats
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import EntitlementsWire
import NIOCore
import NIOHTTP1

/// The methods of `entitlements.v1.EntitlementService` by name, as gRPC and the JSON door
/// route them (`/entitlements.v1.EntitlementService/<name>`).
enum DoorRoutes {
    static let servicePrefix = "/entitlements.v1.EntitlementService/"
    static let healthPrefix = "/grpc.health.v1.Health/"

    /// Every method of the service by its path, `/entitlements.v1.EntitlementService/<name
    /// in service.proto>`.
    static let methods: [String: MethodID] = Dictionary(uniqueKeysWithValues: MethodID.all.filter { $0 != .authenticate }.map { (Self.servicePrefix + "\($0)", $0) })

    /// The method a path names, or nil.
    static func method(path: String) -> MethodID? {
        Self.methods[path]
    }
}

/// The HTTP/JSON door's codec (docs/doors.md): a request in protobuf's JSON mapping in, the
/// answer in the JSON of the CLI's `--json` out (EntitlementsOutput). Used by the HTTP/1.1
/// handler and by HTTP/2 streams whose content-type is JSON; the rules of a call are the
/// router's (``EntitlementMethods/unary(_:_:_:codec:)``), as for every transport.
struct JSONCodec: CallCodec {
    func decode<Request: ServiceRequest>(_ type: Request.Type, from body: ByteBuffer) throws -> Request {
        // Health and Compact take no fields: an empty body is their empty message.
        if body.readableBytes == 0, type == HealthRequest.self || type == CompactRequest.self {
            return try ProtoJSON.decode(type, from: "{}".utf8)
        }
        return try ProtoJSON.decode(type, from: body.readableBytesView)
    }

    func encode(_ answer: CheckAnswer) throws -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(try answer.response(), pretty: false))
    }

    func encode(_ answer: BatchCheckAnswer) throws -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(try answer.response()))
    }

    func encode(_ answer: HealthResponse) -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(answer))
    }

    func encode(_ answer: WriteResponse) -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(answer))
    }

    func encode(_ answer: CompactResponse) -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(answer))
    }

    func encode(_ answer: SubmitPurchaseResponse) -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(answer))
    }

    func encode(_ answer: CheckEntitlementsResponse) -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(answer, pretty: false))
    }

    func encode(_ answer: CustomerHistoryResponse) -> ByteBuffer {
        ByteBuffer(string: EntitlementsOutput.json(answer))
    }

    func byteCount(of encoded: ByteBuffer) -> Int {
        encoded.readableBytes
    }

    /// Connect's unary protocol, JSON flavour.
    var rpcSystem: String {
        "connect_rpc"
    }
}

/// What the JSON door says around a call: timeouts, routes, errors in Connect's shape
/// (`{"code": "invalid_argument", "message": "..."}` with the HTTP status Connect gives it).
enum JSONMethods {
    /// `Connect-Timeout-Ms`: the call's timeout, nil for none, or why the header is refused.
    static func connectTimeout(_ text: String?) -> Result<TimeAmount?, ServiceError> {
        guard let text else {
            return .success(nil)
        }
        guard text.count <= 10, let value = Int64(text), value >= 0 else {
            return .failure(ServiceError(.invalidArgument, "connect-timeout-ms \"\(text)\" is not a whole number of milliseconds (at most 10 digits)"))
        }
        return .success(.milliseconds(value))
    }

    /// When a request whose headers arrived at `start` must have arrived in full: its
    /// deadline, or --frame-timeout after its headers, whichever is first (as the framed
    /// listener's slow-sender guard); `byDeadline` says which. Both doors, HTTP/1.1 and
    /// HTTP/2, hold a request to it; once in, the router holds the call to its deadline.
    static func arrivalLimit(start: NIODeadline, deadline: NIODeadline?, frameTimeout: TimeAmount) -> (at: NIODeadline, byDeadline: Bool) {
        let slowSender = start + frameTimeout
        if let deadline, deadline <= slowSender {
            return (deadline, true)
        }
        return (slowSender, false)
    }

    /// What a call whose request did not arrive by its limit is answered (made only then).
    @inline(never)
    static func arrivalFailure(byDeadline: Bool, frameTimeout: TimeAmount) -> ServiceError {
        if byDeadline {
            return ServiceError(.deadlineExceeded, "the deadline passed before the request arrived in full")
        }
        let seconds = Double(frameTimeout.nanoseconds) / 1e9
        return ServiceError(.deadlineExceeded, "the request did not arrive in full within --frame-timeout (\(seconds) s after its headers)")
    }

    /// A path that names no method of the service: 404, `unimplemented`.
    static func unknownMethod(_ path: String) -> ServiceError {
        ServiceError(.unimplemented, "unknown method \(path); this door serves POST /entitlements.v1.EntitlementService/<method>")
    }

    /// A body over --max-frame-bytes: 413, `resource_exhausted`.
    static func tooLarge(limit: Int) -> ServiceError {
        ServiceError(.resourceExhausted, "the request is over \(limit) bytes, the largest body this server accepts")
    }

    /// The error body: Connect's shape, `{"code": "...", "message": "..."}`.
    static func errorBody(_ error: ServiceError) -> ByteBuffer {
        ByteBuffer(string: JSONValue.object([
            ("code", .string(Self.codeName(error.status))),
            ("message", .string(error.message)),
        ]).serialized(pretty: false))
    }

    /// A status's name in Connect's JSON (the gRPC name, lower snake case).
    static func codeName(_ status: StatusCode) -> String {
        status == .cancelled ? "canceled" : status.description.lowercased()
    }

    /// The HTTP status Connect's protocol gives a gRPC status.
    static func httpStatus(_ status: StatusCode) -> HTTPResponseStatus {
        switch status {
        case .ok: .ok
        case .cancelled: .custom(code: 499, reasonPhrase: "Client Closed Request")
        case .invalidArgument, .failedPrecondition, .outOfRange: .badRequest
        case .deadlineExceeded: .gatewayTimeout
        case .notFound: .notFound
        case .alreadyExists, .aborted: .conflict
        case .permissionDenied: .forbidden
        case .resourceExhausted: .tooManyRequests
        case .unimplemented: .notImplemented
        case .unavailable: .serviceUnavailable
        case .unauthenticated: .unauthorized
        case .unknown, .internalError, .dataLoss: .internalServerError
        }
    }

    /// Whether a content-type is JSON (`application/json`, with any parameters).
    static func isJSON(_ contentType: String?) -> Bool {
        guard let contentType else {
            return false
        }
        let mediaType = contentType.split(separator: ";", maxSplits: 1).first.map { $0.filter { $0 != " " && $0 != "\t" }.lowercased() }
        return mediaType == "application/json"
    }
}
