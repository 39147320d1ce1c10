import EntitlementsWire
public import NIOCore
public import NIOSSL
import NIOTLS
import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A TLS file that cannot be used, with a message that names it and says why.
public struct TLSFileError: Error, CustomStringConvertible, Sendable {
    public var description: String

    init(_ description: String) {
        self.description = description
    }
}

/// Which permissions a client certificate gives, by its subject's common name
/// (`--tls-client-permissions`, docs/security.md): `NAME=PERMISSIONS` entries separated
/// by spaces, `*` for any other name. Default `*=check,write`: a certificate from the
/// client CA may do anything.
public struct ClientCertificatePermissions: Sendable, Hashable {
    public var byCommonName: [String: Permissions]
    public var others: Permissions

    public init(byCommonName: [String: Permissions] = [:], others: Permissions = .all) {
        self.byCommonName = byCommonName
        self.others = others
    }

    /// Parses `billing=check,write reporting=check *=none`; `origin` names the setting.
    public init(parsing text: String, origin: String) throws {
        self.init(byCommonName: [:], others: .all)
        var sawDefault = false
        for entry in text.split(whereSeparator: { $0 == " " || $0 == "\t" || $0 == "\n" }) {
            guard let equals = entry.lastIndex(of: "="), equals != entry.startIndex,
                let permissions = Permissions(parsing: entry[entry.index(after: equals)...])
            else {
                throw TLSFileError("\(origin) \"\(entry)\" is not NAME=PERMISSIONS (permissions: \(Permissions.accepted)), e.g. billing=check,write *=check")
            }
            let name = String(entry[..<equals])
            if name == "*" {
                self.others = permissions
                sawDefault = true
            } else {
                self.byCommonName[name] = permissions
            }
        }
        if !sawDefault, !self.byCommonName.isEmpty {
            // Naming some certificates means the rest get nothing unless `*` says otherwise.
            self.others = .none
        }
    }

    public func permissions(commonName: String?) -> Permissions {
        commonName.flatMap { self.byCommonName[$0] } ?? self.others
    }
}

/// TLS on the TCP listeners (docs/security.md, "TLS"): the certificate chain and key of
/// `--tls-cert` and `--tls-key`, and with `--tls-client-ca` mutual TLS (a client must
/// present a certificate that CA signed; it counts as authentication). ``reload()``
/// (SIGHUP) reads the files again: connections accepted afterwards use the new ones, open
/// connections keep the session they made.
public final class ServerTLS: Sendable {
    public struct Files: Sendable, Hashable {
        public var certificate: String
        public var privateKey: String
        public var clientCA: String?

        public init(certificate: String, privateKey: String, clientCA: String? = nil) {
            self.certificate = certificate
            self.privateKey = privateKey
            self.clientCA = clientCA
        }
    }

    /// What the connection speaks inside TLS, announced by ALPN.
    public enum Protocols: Sendable {
        /// The framed protocol: no ALPN.
        case framed
        /// The doors: `h2` then `http/1.1`.
        case http
        /// The admin listener: `http/1.1`.
        case http1
        /// The store webhooks: `http/1.1`, and no client certificate asked for even with
        /// --tls-client-ca (the stores have none; their signatures authenticate each event).
        case webhooks
    }

    private struct Contexts: Sendable {
        var framed: NIOSSLContext
        var http: NIOSSLContext
        var http1: NIOSSLContext
        var webhooks: NIOSSLContext
        /// The leaf certificate's last valid instant (Unix seconds).
        var notValidAfter: Int
    }

    public let files: Files
    public let clientPermissions: ClientCertificatePermissions
    private let contexts: Mutex<Contexts>

    /// Loads the files; throws a message naming the file that cannot be used.
    public init(files: Files, clientPermissions: ClientCertificatePermissions = .init()) throws {
        self.files = files
        self.clientPermissions = clientPermissions
        self.contexts = Mutex(try Self.load(files))
    }

    /// Whether clients must present a certificate (--tls-client-ca).
    public var requiresClientCertificates: Bool { self.files.clientCA != nil }

    /// When the serving certificate stops being valid (Unix seconds).
    public var notValidAfter: Int { self.contexts.withLock { $0.notValidAfter } }

    /// Reads the files again; throws, keeping the certificate it had, if they cannot be used.
    public func reload() throws {
        let contexts = try Self.load(self.files)
        self.contexts.withLock { $0 = contexts }
    }

    /// A handler for one accepted connection, with the current certificate.
    public func makeServerHandler(_ protocols: Protocols) -> NIOSSLServerHandler {
        let context = self.contexts.withLock { contexts in
            switch protocols {
            case .framed: contexts.framed
            case .http: contexts.http
            case .http1: contexts.http1
            case .webhooks: contexts.webhooks
            }
        }
        return NIOSSLServerHandler(context: context)
    }

    /// Adds TLS to an accepted connection's pipeline: a greeting for a client that does
    /// not speak TLS, the TLS handler, and the handler that gives the connection its
    /// client certificate's identity.
    public func configure(_ channel: any Channel, _ protocols: Protocols, credentials: ConnectionCredentials?, refused: @escaping @Sendable (Refusal) -> Void) throws {
        let operations = channel.pipeline.syncOperations
        try operations.addHandler(PlaintextOnTLSPort(protocols: protocols, refused: refused))
        try operations.addHandler(self.makeServerHandler(protocols))
        try operations.addHandler(PeerCertificateHandler(credentials: credentials, permissions: self.clientPermissions, refused: refused))
    }

    private static func load(_ files: Files) throws -> Contexts {
        let chain = try Self.certificates(files.certificate, setting: "--tls-cert")
        let leaf = chain[0]
        let now = Int(time(nil))
        guard leaf.notValidAfter > now else {
            throw TLSFileError("--tls-cert \(files.certificate): the certificate expired \(Self.date(leaf.notValidAfter)); renew it")
        }
        guard leaf.notValidBefore <= now else {
            throw TLSFileError("--tls-cert \(files.certificate): the certificate is not valid before \(Self.date(leaf.notValidBefore)); check the clock")
        }
        let keyBytes: [UInt8]
        do {
            keyBytes = try readWholeFile(files.privateKey)
        } catch {
            throw TLSFileError("--tls-key \(files.privateKey): \(error)")
        }
        let key: NIOSSLPrivateKey
        do {
            key = try NIOSSLPrivateKey(bytes: keyBytes, format: .pem)
        } catch {
            throw TLSFileError("--tls-key \(files.privateKey): not an unencrypted PEM private key (\(error))")
        }
        var configuration = TLSConfiguration.makeServerConfiguration(
            certificateChain: chain.map { .certificate($0) },
            privateKey: .privateKey(key)
        )
        configuration.minimumTLSVersion = .tlsv12
        if let clientCA = files.clientCA {
            configuration.trustRoots = .certificates(try Self.certificates(clientCA, setting: "--tls-client-ca"))
            configuration.certificateVerification = .noHostnameVerification
        }
        func context(_ protocols: [String], clientCertificates: Bool = true) throws -> NIOSSLContext {
            var configuration = configuration
            configuration.applicationProtocols = protocols
            if !clientCertificates {
                configuration.certificateVerification = .none
            }
            do {
                return try NIOSSLContext(configuration: configuration)
            } catch {
                throw TLSFileError("--tls-cert \(files.certificate) with --tls-key \(files.privateKey): cannot be used together (\(error)); is the key the certificate's?")
            }
        }
        return Contexts(
            framed: try context([]),
            http: try context(["h2", "http/1.1"]),
            http1: try context(["http/1.1"]),
            webhooks: try context(["http/1.1"], clientCertificates: false),
            notValidAfter: leaf.notValidAfter
        )
    }

    private static func certificates(_ path: String, setting: String) throws -> [NIOSSLCertificate] {
        let bytes: [UInt8]
        do {
            bytes = try readWholeFile(path)
        } catch {
            throw TLSFileError("\(setting) \(path): \(error)")
        }
        let certificates = try? NIOSSLCertificate.fromPEMBytes(bytes)
        guard let certificates, !certificates.isEmpty else {
            throw TLSFileError("\(setting) \(path): no PEM certificate in it (-----BEGIN CERTIFICATE-----)")
        }
        return certificates
    }

    /// `2026-11-24 10:00:00 UTC`.
    public static func date(_ seconds: Int) -> String {
        var time = time_t(seconds)
        var parts = tm()
        gmtime_r(&time, &parts)
        var buffer = [CChar](repeating: 0, count: 32)
        let count = strftime(&buffer, buffer.count, "%Y-%m-%d %H:%M:%S UTC", &parts)
        return String(decoding: buffer[0..<count].map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }
}

/// After the TLS handshake: gives the connection its client certificate's identity (the
/// subject's common name and the permissions --tls-client-permissions maps it to), and
/// counts failed handshakes as refusals. The handshake completes before any request is
/// read, so every request sees the identity.
final class PeerCertificateHandler: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer

    private let credentials: ConnectionCredentials?
    private let permissions: ClientCertificatePermissions
    private let refused: @Sendable (Refusal) -> Void

    init(credentials: ConnectionCredentials?, permissions: ClientCertificatePermissions, refused: @escaping @Sendable (Refusal) -> Void) {
        self.credentials = credentials
        self.permissions = permissions
        self.refused = refused
    }

    /// Errors after the handshake (a peer closing without close_notify, say) are not
    /// refusals: only a failed handshake is counted.
    private var handshakeCompleted = false

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if let event = event as? TLSUserEvent, case .handshakeCompleted = event {
            self.handshakeCompleted = true
            if let certificate = try? context.pipeline.syncOperations.nioSSL_peerCertificate() {
                let name = certificate.subjectName.first { $0.type == .commonName }?.value
                self.credentials?.certificateVerified(name: name ?? "", permissions: self.permissions.permissions(commonName: name))
            }
        }
        context.fireUserInboundEventTriggered(event)
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        if !self.handshakeCompleted, error is NIOSSLError || error is BoringSSLError, !(error as? NIOSSLError == .uncleanShutdown) {
            self.refused(Refusal(.unauthenticated, reason: .tls, "TLS handshake failed: \(error)"))
            context.close(promise: nil)
            return
        }
        context.fireErrorCaught(error)
    }
}

/// Before TLS on a listener: a client that speaks plain text to it (its first byte is not
/// a TLS record's, 0x16) is told so in its own protocol, not just cut off: an ERROR frame
/// on the framed listener, a 400 answer on an HTTP one. Then it leaves the pipeline.
final class PlaintextOnTLSPort: ChannelInboundHandler, RemovableChannelHandler {
    typealias InboundIn = ByteBuffer
    typealias InboundOut = ByteBuffer

    static let message = "this listener requires TLS (serve --tls-cert); connect with TLS (docs/security.md)"
    private let protocols: ServerTLS.Protocols
    private let refused: @Sendable (Refusal) -> Void

    init(protocols: ServerTLS.Protocols, refused: @escaping @Sendable (Refusal) -> Void) {
        self.protocols = protocols
        self.refused = refused
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let bytes = self.unwrapInboundIn(data)
        guard let first = bytes.getInteger(at: bytes.readerIndex, as: UInt8.self) else {
            return
        }
        if first == 0x16 {
            context.fireChannelRead(data)
            context.pipeline.syncOperations.removeHandler(context: context, promise: nil)
            return
        }
        self.refused(Refusal(.unauthenticated, reason: .tls, "a client spoke plain text to a TLS listener"))
        var answer = context.channel.allocator.buffer(capacity: 256)
        switch self.protocols {
        case .framed:
            _ = answer.writeFrame(.error(status: .unavailable, message: Self.message))
        case .http, .http1, .webhooks:
            let body = Self.message + "\n"
            answer.writeString("HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: \(body.utf8.count)\r\nConnection: close\r\n\r\n\(body)")
        }
        context.writeAndFlush(NIOAny(answer)).assumeIsolated().whenComplete { _ in
            context.close(promise: nil)
        }
    }
}
