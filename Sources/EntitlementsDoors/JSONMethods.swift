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

    /// Every method of the service by its name in service.proto.
    static let methods: [String: MethodID] = Dictionary(uniqueKeysWithValues: MethodID.all.filter { $0 != .authenticate }.map { ("\($0)", $0) })

    /// The method a path names, or nil.
    static func method(path: String) -> MethodID? {
        guard path.hasPrefix(Self.servicePrefix) else {
            return nil
        }
        return Self.methods[String(path.dropFirst(Self.servicePrefix.count))]
    }
}

/// The HTTP/JSON door's unary calls (docs/doors.md): a request in protobuf's JSON mapping
/// in, the answer in the JSON of the CLI's `--json` out (EntitlementsOutput), an error as
/// `{"code": "invalid_argument", "message": "..."}` with the HTTP status Connect gives it.
/// Used by the HTTP/1.1 handler and by HTTP/2 streams whose content-type is JSON.
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

    /// A path that names no method of the service: 404, `unimplemented`.
    static func unknownMethod(_ path: String) -> ServiceError {
        ServiceError(.unimplemented, "unknown method \(path); this door serves POST /entitlements.v1.EntitlementService/<method>")
    }

    /// A body over --max-frame-bytes: 413, `resource_exhausted`.
    static func tooLarge(limit: Int) -> ServiceError {
        ServiceError(.resourceExhausted, "the request is over \(limit) bytes, the largest body this server accepts")
    }

    /// Runs `method` on a JSON body; answers JSON text, or the call's failure.
    static func call(
        _ method: MethodID,
        body: ByteBuffer,
        methods: EntitlementMethods,
        context: CallContext,
        draining: Bool
    ) -> MethodResult<String> {
        // Health and Compact take no fields: an empty body is their empty message.
        let body = body.readableBytes == 0 && (method == .health || method == .compact) ? ByteBuffer(string: "{}") : body
        let bytes = body.readableBytesView
        do {
            switch method {
            case .checkEntitlements:
                let request = try ProtoJSON.decode(CheckEntitlementsRequest.self, from: bytes)
                return Self.map(methods.checkEntitlements(request, context)) { EntitlementsOutput.json(try $0.response(), pretty: false) }
            case .batchCheckEntitlements:
                let request = try ProtoJSON.decode(BatchCheckEntitlementsRequest.self, from: bytes)
                return Self.map(methods.batchCheckEntitlements(request, context)) { EntitlementsOutput.json(try $0.response()) }
            case .health:
                _ = try ProtoJSON.decode(HealthRequest.self, from: bytes)
                return .now(.success(EntitlementsOutput.json(methods.health(draining: draining))))
            case .compact:
                _ = try ProtoJSON.decode(CompactRequest.self, from: bytes)
                return Self.map(methods.compact(context)) { EntitlementsOutput.json($0) }
            case .recordTransaction:
                return Self.write(.recordTransaction(try ProtoJSON.decode(RecordTransactionRequest.self, from: bytes)), methods, context)
            case .updateSubscriptionState:
                return Self.write(.updateSubscriptionState(try ProtoJSON.decode(UpdateSubscriptionStateRequest.self, from: bytes)), methods, context)
            case .grantEntitlement:
                return Self.write(.grantEntitlement(try ProtoJSON.decode(GrantEntitlementRequest.self, from: bytes)), methods, context)
            case .revokeGrant:
                return Self.write(.revokeGrant(try ProtoJSON.decode(RevokeGrantRequest.self, from: bytes)), methods, context)
            case .linkAlias:
                return Self.write(.linkAlias(try ProtoJSON.decode(LinkAliasRequest.self, from: bytes)), methods, context)
            case .deleteCustomer:
                return Self.write(.deleteCustomer(try ProtoJSON.decode(DeleteCustomerRequest.self, from: bytes)), methods, context)
            default:
                return .now(.failure(ServiceError(
                    .unimplemented,
                    "\(method) streams: the JSON door serves unary calls only; watch over gRPC or the framed protocol"
                )))
            }
        } catch {
            return .now(.failure(ServiceError(.invalidArgument, "\(error)")))
        }
    }

    private static func write(_ mutation: LogRecord.Mutation, _ methods: EntitlementMethods, _ context: CallContext) -> MethodResult<String> {
        Self.map(methods.write(mutation, context)) { EntitlementsOutput.json($0) }
    }

    private static func map<Value: Sendable>(_ result: MethodResult<Value>, _ render: @escaping @Sendable (Value) throws -> String) -> MethodResult<String> {
        @Sendable func rendered(_ result: Result<Value, ServiceError>) -> Result<String, ServiceError> {
            result.flatMap { value in
                do {
                    return .success(try render(value))
                } catch {
                    return .failure(ServiceError(.internalError, "cannot render the answer as JSON: \(error)"))
                }
            }
        }
        switch result {
        case .now(let result): return .now(rendered(result))
        case .later(let future): return .later(future.map(rendered))
        }
    }

    /// The error body: Connect's shape, `{"code": "...", "message": "..."}`.
    static func errorBody(_ error: ServiceError) -> String {
        JSONValue.object([
            ("code", .string(Self.codeName(error.status))),
            ("message", .string(error.message)),
        ]).serialized(pretty: false)
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
