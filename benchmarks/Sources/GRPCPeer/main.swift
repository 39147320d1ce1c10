// GRPCPeer: the gRPC peer of benchmarks/run.sh. A grpc-swift-2 server (HTTP/2 through
// grpc-swift-nio-transport) answering CheckEntitlements from the same resolvers and caches
// as `entitlements serve` (ResolverPool), with requests decoded by the protobuf-c shim: only
// the transport differs.
//
//   GRPCPeer --snapshot FILE [--host 127.0.0.1] [--port 7493] [--threads 1]
//            [--cache-bytes 268435456]
//
// Prints `listening on HOST:PORT` when ready; SIGINT or SIGTERM stops it.
import EntitlementsMessages
import EntitlementsServer
import EntitlementsStore
import Foundation
import GRPCCheckService
import GRPCCore
import GRPCNIOTransportHTTP2Posix
import NIOCore
import NIOPosix

struct CheckService: RegistrableRPCService {
    let pool: ResolverPool

    func registerMethods<Transport: ServerTransport>(with router: inout RPCRouter<Transport>) {
        router.registerHandler(
            forMethod: CheckEntitlementsRPC.descriptor,
            deserializer: CheckRequestDeserializer(),
            serializer: EncodedResponseSerializer()
        ) { request, context in
            let single = try await ServerRequest(stream: request)
            return StreamingServerResponse(single: try await self.check(single))
        }
    }

    private func check(_ request: ServerRequest<CheckEntitlementsRequest>) async throws -> ServerResponse<ByteBuffer> {
        let message = request.message
        do {
            // checkResponse validates as our server does (an absent user id is an empty one).
            let bytes = try await self.pool.checkResponse(
                userId: message.userId ?? "",
                environment: message.environment,
                entitlementIds: message.entitlementIds,
                at: message.at ?? Int64(Date().timeIntervalSince1970 * 1_000)
            )
            return ServerResponse(message: bytes)
        } catch let failure as ServiceError {
            let code: RPCError.Code = switch failure.status {
            case .invalidArgument: .invalidArgument
            case .resourceExhausted: .resourceExhausted
            case .deadlineExceeded: .deadlineExceeded
            case .unavailable: .unavailable
            default: .internalError
            }
            throw RPCError(code: code, message: failure.message)
        }
    }
}

func argument(_ name: String) -> String? {
    let arguments = CommandLine.arguments
    guard let index = arguments.firstIndex(of: "--\(name)"), index + 1 < arguments.count else { return nil }
    return arguments[index + 1]
}

guard let snapshotPath = argument("snapshot") else {
    print("usage: GRPCPeer --snapshot FILE [--host H] [--port P] [--threads N] [--cache-bytes B]")
    exit(2)
}
let host = argument("host") ?? "127.0.0.1"
guard let port = Int(argument("port") ?? "7493"), let threads = Int(argument("threads") ?? "1"), threads > 0,
    let cacheBytes = Int(argument("cache-bytes") ?? "268435456"), cacheBytes > 0
else {
    print("error: --port, --threads and --cache-bytes take positive whole numbers")
    exit(2)
}

let group = MultiThreadedEventLoopGroup(numberOfThreads: threads)
let store = CustomerStore.readOnly(try SnapshotReader(path: snapshotPath))
// As `serve`: one resolver per event loop, on the loops the connections use.
let pool = try ResolverPool(
    count: threads,
    eventLoops: (0..<threads).map { _ in group.next() },
    store: store,
    cacheBytes: cacheBytes,
    warmAt: Int64(Date().timeIntervalSince1970 * 1_000)
)
let server = GRPCServer(
    transport: HTTP2ServerTransport.Posix(
        address: .ipv4(host: host, port: port),
        transportSecurity: .plaintext,
        eventLoopGroup: group
    ),
    services: [CheckService(pool: pool)]
)

let signalSources = [SIGINT, SIGTERM].map { signalNumber in
    signal(signalNumber, SIG_IGN)
    let source = DispatchSource.makeSignalSource(signal: signalNumber, queue: .global())
    source.setEventHandler { server.beginGracefulShutdown() }
    source.resume()
    return source
}

/// A line on standard output, now (run.sh waits for "listening on").
func say(_ line: String) {
    FileHandle.standardOutput.write(Data((line + "\n").utf8))
}

_ = signalSources
try await withThrowingDiscardingTaskGroup { tasks in
    tasks.addTask { try await server.serve() }
    if let address = try await server.listeningAddress?.ipv4 {
        say("cache warmed: \(pool.warmup.customersCached) customers")
        say("listening on \(address.host):\(address.port)")
    }
}
