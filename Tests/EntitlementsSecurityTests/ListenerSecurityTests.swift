import EntitlementsClient
import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsServer
import EntitlementsStore
import EntitlementsTools
import EntitlementsWire
import Foundation
import NIOCore
import NIOPosix
import NIOSSL
import Prometheus
import Testing

#if canImport(Glibc)
import Glibc
#endif

let now: Int64 = 1_795_305_600_000  // 2026-11-22T00:00:00Z

/// Certificates made by openssl for these tests: a CA, a server certificate for localhost
/// and 127.0.0.1, client certificates (CN=billing, CN=reader), an expired one, and the same
/// names from another CA.
struct Certificates: Sendable {
    let directory: String

    static let shared: Result<Certificates, any Error> = Result { try Certificates() }

    static func get() throws -> Certificates { try Self.shared.get() }

    func path(_ name: String) -> String { self.directory + "/" + name }

    private init() throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("security-certs-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        try Data("subjectAltName=DNS:localhost,IP:127.0.0.1\n".utf8).write(to: URL(fileURLWithPath: self.path("server.ext")))
        for ca in ["ca", "other-ca"] {
            try self.openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                             "-keyout", "\(ca).key", "-out", "\(ca).pem", "-days", "2", "-subj", "/CN=\(ca)")
        }
        // name, common name, signing CA, days (-1: expired), extensions
        let leaves: [(String, String, String, String, String?)] = [
            ("server", "localhost", "ca", "1", "server.ext"),
            ("server-expired", "localhost", "ca", "-1", "server.ext"),
            ("server-other-ca", "localhost", "other-ca", "1", "server.ext"),
            ("billing", "billing", "ca", "1", nil),
            ("reader", "reader", "ca", "1", nil),
            ("billing-expired", "billing", "ca", "-1", nil),
            ("billing-other-ca", "billing", "other-ca", "1", nil),
        ]
        for (name, commonName, ca, days, extensions) in leaves {
            try self.openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                             "-keyout", "\(name).key", "-out", "\(name).csr", "-subj", "/CN=\(commonName)")
            var arguments = ["x509", "-req", "-in", "\(name).csr", "-CA", "\(ca).pem", "-CAkey", "\(ca).key",
                             "-CAcreateserial", "-out", "\(name).pem", "-days", days]
            if let extensions {
                arguments += ["-extfile", extensions]
            }
            try self.openssl(arguments)
        }
    }

    private func openssl(_ arguments: String...) throws {
        try self.openssl(arguments)
    }

    private func openssl(_ arguments: [String]) throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/openssl")
        process.arguments = arguments
        process.currentDirectoryURL = URL(fileURLWithPath: self.directory)
        let errors = Pipe()
        process.standardOutput = errors
        process.standardError = errors
        try process.run()
        let said = errors.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else {
            throw CertificateError(description: "openssl \(arguments.joined(separator: " ")): \(String(decoding: said, as: UTF8.self))")
        }
    }

    struct CertificateError: Error, CustomStringConvertible {
        var description: String
    }

    /// Server TLS with the test CA's server certificate; `clientCA` asks for mutual TLS.
    func serverTLS(clientCA: Bool = false, permissions: ClientCertificatePermissions = .init()) throws -> ServerTLS {
        try ServerTLS(
            files: .init(certificate: self.path("server.pem"), privateKey: self.path("server.key"), clientCA: clientCA ? self.path("ca.pem") : nil),
            clientPermissions: permissions
        )
    }

    /// A client's TLS settings trusting `ca`, presenting `certificate` if given.
    func clientTLS(ca: String = "ca", certificate: String? = nil) throws -> TLSConfiguration {
        var tls = TLSConfiguration.makeClientConfiguration()
        tls.trustRoots = .certificates(try NIOSSLCertificate.fromPEMFile(self.path("\(ca).pem")))
        if let certificate {
            tls.certificateChain = try NIOSSLCertificate.fromPEMFile(self.path("\(certificate).pem")).map { .certificate($0) }
            tls.privateKey = .privateKey(try NIOSSLPrivateKey(file: self.path("\(certificate).key"), format: .pem))
        }
        return tls
    }
}

/// A writable server on a synthetic snapshot, with the given TCP security (and a Unix
/// socket), in a scratch directory.
final class SecureServer: Sendable {
    let directory: String
    let server: EntitlementsServer
    let group: MultiThreadedEventLoopGroup
    let metrics: ServerMetrics

    var port: Int { self.server.tcpAddress!.port! }

    init(tcp: ListenerSecurity, unix: ListenerSecurity = .open("unix"), unixMode: UInt32 = 0o660, metrics: ServerMetrics = ServerMetrics()) async throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("security-server-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        _ = try SnapshotTools.generate(count: 50, seed: 5, now: now, outputPath: self.directory + "/seed.snap")
        let store = try CustomerStore.open(dataDirectory: self.directory + "/data", seed: self.directory + "/seed.snap").0
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0), unixSocketPath: self.directory + "/s.sock")
        configuration.tcpSecurity = tcp
        configuration.unixSecurity = unix
        configuration.unixSocketMode = unixMode
        self.group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
        self.metrics = metrics
        self.server = try await EntitlementsServer.start(store: store, configuration: configuration, group: self.group, warmAt: now, metrics: self.metrics)
    }

    func client(host: String = "localhost", tls: TLSConfiguration? = nil, token: EntitlementsClientToken? = nil, unix: Bool = false) -> EntitlementsClient {
        EntitlementsClient(
            configuration: .init(
                server: unix ? .unixSocket(path: self.directory + "/s.sock") : .tcp(host: host, port: self.port),
                initialBackoff: .milliseconds(1),
                maximumBackoff: .milliseconds(1),
                tls: tls,
                token: token
            ),
            eventLoopGroup: self.group
        )
    }

    func stop() async throws {
        await self.server.shutdownGracefully()
        try await self.group.shutdownGracefully()
        try? FileManager.default.removeItem(atPath: self.directory)
    }
}

/// GET `path` on 127.0.0.1:`port` in plain HTTP/1.1 with `headers`, on a thread of its own
/// (a blocking socket must not hold the cooperative pool): the status and the body.
func httpGet(_ port: Int, _ path: String, headers: [String] = []) async throws -> (Int, String) {
    try await withCheckedThrowingContinuation { continuation in
        Thread {
            let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
            defer { close(fd) }
            var address = sockaddr_in()
            address.sin_family = sa_family_t(AF_INET)
            address.sin_port = in_port_t(UInt16(port).bigEndian)
            address.sin_addr.s_addr = inet_addr("127.0.0.1")
            let connected = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
            }
            guard connected == 0 else {
                continuation.resume(throwing: Certificates.CertificateError(description: "cannot connect to \(port)"))
                return
            }
            let request = Array((["GET \(path) HTTP/1.1", "Host: x", "Connection: close"] + headers + ["", ""]).joined(separator: "\r\n").utf8)
            _ = request.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, 0) }
            var response: [UInt8] = []
            var chunk = [UInt8](repeating: 0, count: 65_536)
            while true {
                let count = recv(fd, &chunk, chunk.count, 0)
                if count <= 0 { break }
                response += chunk[0..<count]
            }
            let text = String(decoding: response, as: UTF8.self)
            let status = Int(text.split(separator: " ").dropFirst().first ?? "") ?? 0
            continuation.resume(returning: (status, text.components(separatedBy: "\r\n\r\n").dropFirst().joined(separator: "\r\n\r\n")))
        }.start()
    }
}

let writer = "w-0123456789abcdef0123456789"
let reader = "r-0123456789abcdef0123456789"

func grant(_ client: EntitlementsClient, _ id: String = "g1") async throws -> WriteResponse {
    try await client.call(.grantEntitlement, GrantEntitlementRequest(userId: "new-user", grant: Grant(grantId: id, entitlementId: "premium", grantedDate: now)), timeout: .seconds(5))
}

/// Runs `body` and returns the status it failed with (nil when it did not fail).
func status(_ body: () async throws -> Void) async -> (StatusCode, String)? {
    do {
        try await body()
        return nil
    } catch let error as EntitlementsClientError {
        return (error.code, error.message)
    } catch {
        return (.unknown, "\(error)")
    }
}

@Suite(.serialized) struct ListenerSecurityTests {
    @Test func aTokenGivesWritesAndAWrongOneIsRefused() async throws {
        let file = try TemporaryFile("\(writer)\n\(reader) check\n")
        let tokens = try AccessTokens(path: file.path)
        let server = try await SecureServer(tcp: ListenerSecurity(policy: ListenerPolicy(name: "tcp", granted: .all, anonymous: .check), tokens: tokens))
        // Without a token: checks yes, writes UNAUTHENTICATED, saying how to authenticate.
        let anonymous = server.client()
        _ = try await anonymous.checkEntitlements(CheckEntitlementsRequest(userId: "new-user", at: now))
        let refused = await status { _ = try await grant(anonymous) }
        #expect(refused?.0 == .unauthenticated)
        #expect(refused?.1.contains("present a token") == true)
        // A wrong token: the connection is refused UNAUTHENTICATED.
        let wrong = await status { _ = try await server.client(token: .value("not-a-token-of-the-file")).health() }
        #expect(wrong?.0 == .unauthenticated)
        #expect(wrong?.1 == "the token presented is not one of --auth-token-file's")
        // A read token: writes PERMISSION_DENIED.
        let denied = await status { _ = try await grant(server.client(token: .value(reader))) }
        #expect(denied?.0 == .permissionDenied)
        // The write token: writes.
        let response = try await grant(server.client(token: .value(writer)))
        #expect(response.created == true)
        for client in [anonymous] {
            await client.close()
        }
        try await server.stop()
    }

    @Test func aReadOnlyListenerRefusesWritesWhateverTheToken() async throws {
        let file = try TemporaryFile("\(writer)\n")
        let tokens = try AccessTokens(path: file.path)
        let server = try await SecureServer(tcp: ListenerSecurity(policy: ListenerPolicy(name: "tcp", granted: .check, anonymous: .check), tokens: tokens))
        let client = server.client(token: .value(writer))
        _ = try await client.health()
        let denied = await status { _ = try await grant(client) }
        #expect(denied?.0 == .permissionDenied)
        #expect(denied?.1 == "GrantEntitlement needs the write permission, which the tcp listener does not grant (--listen-permissions check)")
        let compact = await status { let _: CompactResponse = try await client.call(.compact, CompactRequest()) }
        #expect(compact?.0 == .permissionDenied)
        // The Unix socket, open, takes the write.
        #expect(try await grant(server.client(unix: true)).created == true)
        await client.close()
        try await server.stop()
    }

    /// Chosen behaviour (docs/security.md): a connection keeps its token's permissions while
    /// the token is in the file; once a reload removes it, the connection's calls that
    /// needed it are refused UNAUTHENTICATED (it may authenticate again), and a new
    /// connection with the new token works.
    @Test func aRotatedTokenStopsWorkingOnOpenConnections() async throws {
        let file = try TemporaryFile("\(writer)\n")
        let tokens = try AccessTokens(path: file.path)
        let server = try await SecureServer(tcp: ListenerSecurity(policy: ListenerPolicy(name: "tcp", granted: .all, anonymous: .check), tokens: tokens))
        let old = server.client(token: .value(writer))
        _ = try await grant(old, "before")
        let rotated = "n-0123456789abcdef0123456789"
        try file.write("\(writer)\n\(rotated)\n")  // both, while clients move over
        #expect(try tokens.reload())
        _ = try await grant(old, "during")
        try file.write("\(rotated)\n")
        #expect(try tokens.reload())
        let revoked = await status { _ = try await grant(old, "after") }
        #expect(revoked?.0 == .unauthenticated)
        #expect(revoked?.1 == "the token this connection presented is no longer in --auth-token-file; present a current one")
        _ = try await old.checkEntitlements(CheckEntitlementsRequest(userId: "new-user", at: now))  // anonymous reads stay
        let tokenFile = try TemporaryFile("\(rotated)\n")
        _ = try await grant(server.client(token: .file(tokenFile.path)), "new")
        await old.close()
        try await server.stop()
    }

    @Test func readsAreTheSameOverTLSAsOverPlainTCP() async throws {
        let certificates = try Certificates.get()
        let plain = try await SecureServer(tcp: .open("tcp"))
        let tls = try await SecureServer(tcp: ListenerSecurity(policy: .open("tcp"), tls: try certificates.serverTLS()))
        let plainClient = plain.client()
        let tlsClient = tls.client(tls: try certificates.clientTLS())
        for index in 0..<50 {
            let request = CheckEntitlementsRequest(userId: "customer-\(index)", at: now)
            let overTLS = try await tlsClient.checkEntitlements(request)
            let overTCP = try await plainClient.checkEntitlements(request)
            #expect(overTLS == overTCP)
        }
        let batch = BatchCheckEntitlementsRequest(userIds: (0..<20).map { "customer-\($0)" }, at: now)
        let batchTLS: BatchCheckEntitlementsResponse = try await tlsClient.batchCheckEntitlements(batch)
        let batchTCP: BatchCheckEntitlementsResponse = try await plainClient.batchCheckEntitlements(batch)
        #expect(batchTLS == batchTCP)
        // The same client by IP address: the certificate carries 127.0.0.1 too.
        _ = try await tls.client(host: "127.0.0.1", tls: try certificates.clientTLS()).health()
        await plainClient.close()
        await tlsClient.close()
        try await plain.stop()
        try await tls.stop()
    }

    @Test func authenticateOnAServerWithoutATokenFileIsAFailedPrecondition() async throws {
        let server = try await SecureServer(tcp: .open("tcp"))
        let refused = await status { _ = try await server.client(token: .value(writer)).health() }
        #expect(refused?.0 == .failedPrecondition)
        #expect(refused?.1 == "this server has no --auth-token-file: there is nothing to authenticate with")
        try await server.stop()
    }

    @Test func aPlainClientOnATLSPortIsToldSo() async throws {
        let certificates = try Certificates.get()
        let server = try await SecureServer(tcp: ListenerSecurity(policy: .open("tcp"), tls: try certificates.serverTLS()))
        let refused = await status { _ = try await server.client().health() }
        #expect(refused?.0 == .unavailable)
        #expect(refused?.1 == "this listener requires TLS (serve --tls-cert); connect with TLS (docs/security.md)")
        try await server.stop()
    }

    @Test func aClientRefusesAServerCertificateItDoesNotTrust() async throws {
        let certificates = try Certificates.get()
        let other = try ServerTLS(files: .init(certificate: certificates.path("server-other-ca.pem"), privateKey: certificates.path("server-other-ca.key")))
        let server = try await SecureServer(tcp: ListenerSecurity(policy: .open("tcp"), tls: other))
        let refused = await status { _ = try await server.client(tls: try certificates.clientTLS()).health() }
        #expect(refused?.0 == .unavailable)
        #expect(refused?.1.contains("CERTIFICATE_VERIFY_FAILED") == true, "\(refused?.1 ?? "")")
        try await server.stop()
    }

    @Test func anExpiredOrUnreadableServerCertificateIsRefusedAtStart() throws {
        let certificates = try Certificates.get()
        #expect {
            try ServerTLS(files: .init(certificate: certificates.path("server-expired.pem"), privateKey: certificates.path("server-expired.key")))
        } throws: { error in
            "\(error)".hasPrefix("--tls-cert \(certificates.path("server-expired.pem")): the certificate expired ")
        }
        #expect {
            try ServerTLS(files: .init(certificate: certificates.path("server.key"), privateKey: certificates.path("server.key")))
        } throws: { error in
            "\(error)" == "--tls-cert \(certificates.path("server.key")): no PEM certificate in it (-----BEGIN CERTIFICATE-----)"
        }
        #expect {
            try ServerTLS(files: .init(certificate: certificates.path("server.pem"), privateKey: certificates.path("billing.key")))
        } throws: { error in
            "\(error)".contains("cannot be used together")
        }
    }

    @Test func mutualTLSMapsTheCertificateToPermissions() async throws {
        let certificates = try Certificates.get()
        let permissions = try ClientCertificatePermissions(parsing: "billing=check,write *=check", origin: "--tls-client-permissions")
        let tls = try certificates.serverTLS(clientCA: true, permissions: permissions)
        let server = try await SecureServer(tcp: ListenerSecurity(policy: ListenerPolicy(name: "tcp", granted: .all, anonymous: .none), tls: tls))
        // billing may write.
        let billing = server.client(tls: try certificates.clientTLS(certificate: "billing"))
        #expect(try await grant(billing).created == true)
        // reader may check, not write.
        let readerClient = server.client(tls: try certificates.clientTLS(certificate: "reader"))
        _ = try await readerClient.checkEntitlements(CheckEntitlementsRequest(userId: "new-user", at: now))
        let denied = await status { _ = try await grant(readerClient, "g2") }
        #expect(denied?.0 == .permissionDenied)
        #expect(denied?.1 == "GrantEntitlement needs the write permission, which this caller's certificate CN=reader does not grant")
        // No certificate, an expired one, one from another CA: no handshake at all.
        for certificate in [nil, "billing-expired", "billing-other-ca"] {
            let refused = await status { _ = try await server.client(tls: try certificates.clientTLS(certificate: certificate)).health() }
            #expect(refused?.0 == .unavailable, "\(certificate ?? "no certificate")")
        }
        await billing.close()
        await readerClient.close()
        try await server.stop()
    }

    @Test func theUnixSocketHasTheConfiguredMode() async throws {
        for mode: UInt32 in [0o660, 0o600] {
            let server = try await SecureServer(tcp: .open("tcp"), unixMode: mode)
            let attributes = try FileManager.default.attributesOfItem(atPath: server.directory + "/s.sock")
            #expect((attributes[.posixPermissions] as? NSNumber)?.uint32Value == mode)
            #expect(attributes[.type] as? FileAttributeType == .typeSocket)
            _ = try await server.client(unix: true).health()
            try await server.stop()
        }
    }

    @Test func refusalsAreCountedByListenerAndReasonAndMetricsCanNeedAToken() async throws {
        let registry = PrometheusCollectorRegistry()
        let metrics = ServerMetrics(factory: PrometheusMetricsFactory(registry: registry))
        let file = try TemporaryFile("\(writer)\n\(reader) check\n")
        let tokens = try AccessTokens(path: file.path)
        let server = try await SecureServer(
            tcp: ListenerSecurity(policy: ListenerPolicy(name: "tcp", granted: .all, anonymous: .check), tokens: tokens),
            metrics: metrics
        )
        let anonymous = server.client()
        for index in 0..<3 {
            _ = await status { _ = try await grant(anonymous, "g\(index)") }
        }
        _ = await status { _ = try await server.client(token: .value("not-a-token-of-the-file")).health() }
        _ = await status { _ = try await grant(server.client(token: .value(reader))) }
        // The admin listener with --admin-anonymous none: the probes stay open, /metrics
        // needs a token with the check permission.
        let admin = try await AdminServer.start(
            host: "127.0.0.1",
            port: 0,
            security: ListenerSecurity(policy: ListenerPolicy(name: "admin", granted: .check, anonymous: .none), tokens: tokens),
            endpoints: .init(readiness: { (true, "ready") }) {
                var bytes: [UInt8] = []
                registry.emit(into: &bytes)
                return bytes
            },
            group: server.group
        )
        let port = admin.address!.port!
        #expect(try await httpGet(port, "/healthz").0 == 200)
        let refused = try await httpGet(port, "/metrics")
        #expect(refused.0 == 401)
        #expect(refused.1.hasPrefix("/metrics needs the check permission, which callers without credentials do not have on the admin listener"))
        #expect(try await httpGet(port, "/metrics", headers: ["Authorization: Bearer wrong-wrong-wrong-wrong"]).0 == 401)
        let scrape = try await httpGet(port, "/metrics", headers: ["Authorization: Bearer \(reader)"])
        #expect(scrape.0 == 200)
        let lines = Set(scrape.1.split(separator: "\n").map(String.init))
        for expected in [
            #"entitlements_auth_refusals_total{listener="tcp",reason="unauthenticated"} 3"#,
            #"entitlements_auth_refusals_total{listener="tcp",reason="bad_token"} 1"#,
            #"entitlements_auth_refusals_total{listener="tcp",reason="not_permitted"} 1"#,
            #"entitlements_requests_total{method="GrantEntitlement",status="UNAUTHENTICATED"} 3"#,
        ] {
            #expect(lines.contains(expected), "missing \(expected)")
        }
        #expect(!scrape.1.contains(writer) && !scrape.1.contains(reader))
        await anonymous.close()
        await admin.close()
        try await server.stop()
    }
}
