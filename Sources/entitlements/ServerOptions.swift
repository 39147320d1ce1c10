import ArgumentParser
import EntitlementsClient
import NIOSSL

/// Where the server is, and how to prove who we are to it (docs/security.md), for the
/// commands that talk to one.
struct ServerOptions: ParsableArguments {
    @Option(help: "The server's TCP address, HOST:PORT.")
    var server: String = "127.0.0.1:7420"

    @Option(help: "Connect to this Unix domain socket instead of --server.")
    var unix: String?

    @Option(help: "How long to wait for the answer, in milliseconds.")
    var timeoutMs: Int = 2_000

    @Option(help: "Connect with TLS, trusting the server certificates this CA (PEM) signed.")
    var tlsCa: String?

    @Option(help: "Mutual TLS: this client's certificate chain, PEM (with --tls-key).")
    var tlsCert: String?

    @Option(help: "Mutual TLS: the private key of --tls-cert, PEM.")
    var tlsKey: String?

    @Option(help: "The name the server's certificate must carry (default: the host of --server).")
    var tlsServerName: String?

    @Option(help: "Present the token in this file (its first word) to the server (Authenticate).")
    var tokenFile: String?

    func validate() throws {
        if self.unix == nil {
            _ = try ServeSettings.parseAddress(self.server, origin: "--server")
        }
        guard self.timeoutMs > 0 else {
            throw ValidationError("--timeout-ms must be positive")
        }
        if (self.tlsCert == nil) != (self.tlsKey == nil) {
            throw ValidationError("--tls-cert and --tls-key go together: give both, or neither")
        }
        if self.tlsCert != nil, self.tlsCa == nil {
            throw ValidationError("--tls-cert needs --tls-ca: a client certificate is presented over TLS")
        }
        if self.tlsCa != nil, self.unix != nil {
            throw ValidationError("--tls-ca is for TCP (--server); a Unix socket is never TLS")
        }
    }

    /// The TLS settings of --tls-ca, --tls-cert and --tls-key; nil without --tls-ca.
    func tlsConfiguration() throws -> TLSConfiguration? {
        guard let ca = self.tlsCa else {
            return nil
        }
        var tls = TLSConfiguration.makeClientConfiguration()
        do {
            tls.trustRoots = .certificates(try NIOSSLCertificate.fromPEMFile(ca))
            if let certificate = self.tlsCert, let key = self.tlsKey {
                tls.certificateChain = try NIOSSLCertificate.fromPEMFile(certificate).map { .certificate($0) }
                tls.privateKey = .privateKey(try NIOSSLPrivateKey(file: key, format: .pem))
            }
        } catch {
            throw ValidationError("--tls-ca \(ca)\(self.tlsCert.map { ", --tls-cert \($0)" } ?? ""): cannot be read as PEM (\(error))")
        }
        return tls
    }

    func makeClient() throws -> EntitlementsClient {
        let address: EntitlementsServerAddress
        if let unix = self.unix {
            address = .unixSocket(path: unix)
        } else {
            let (host, port) = try ServeSettings.parseAddress(self.server, origin: "--server")
            address = .tcp(host: host, port: port)
        }
        return EntitlementsClient(
            configuration: .init(
                server: address,
                initialBackoff: .milliseconds(1),
                maximumBackoff: .milliseconds(1),
                tls: try self.tlsConfiguration(),
                serverHostname: self.tlsServerName,
                token: self.tokenFile.map { .file($0) }
            )
        )
    }

    var timeout: Duration { .milliseconds(self.timeoutMs) }
}
