import Crypto
import Foundation
import SwiftASN1
import Testing
import X509

@testable import EntitlementsIngestion

/// A root, an intermediate and leaves made by openssl for these tests, with Apple's OIDs
/// where Apple puts them (docs/ingestion.md): the test root stands in for Apple Root CA - G3.
struct AppleLikeCertificates: Sendable {
    let directory: String

    static let shared: Result<AppleLikeCertificates, any Error> = Result { try AppleLikeCertificates() }

    func path(_ name: String) -> String { self.directory + "/" + name }

    private init() throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("appstore-certs-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        let files = [
            "ca.ext": "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n",
            "wwdr.ext": "basicConstraints=critical,CA:TRUE,pathlen:0\nkeyUsage=critical,keyCertSign,cRLSign\n1.2.840.113635.100.6.2.1=ASN1:NULL\n",
            "plain-ca.ext": "basicConstraints=critical,CA:TRUE,pathlen:0\nkeyUsage=critical,keyCertSign,cRLSign\n",
            "leaf.ext": "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n1.2.840.113635.100.6.11.1=ASN1:NULL\n",
            "plain-leaf.ext": "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n",
        ]
        for (name, text) in files {
            try Data(text.utf8).write(to: URL(fileURLWithPath: self.path(name)))
        }
        for root in ["root", "other-root"] {
            try self.openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", "\(root).key",
                              "-out", "\(root).pem", "-days", "30", "-subj", "/CN=\(root)", "-addext", "basicConstraints=critical,CA:TRUE",
                              "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
        }
        // name, signed by, extensions file
        let issued: [(String, String, String)] = [
            ("wwdr", "root", "wwdr.ext"), ("plain-ca", "root", "plain-ca.ext"), ("other-wwdr", "other-root", "wwdr.ext"),
            ("leaf", "wwdr", "leaf.ext"), ("plain-leaf", "wwdr", "plain-leaf.ext"), ("leaf-of-plain-ca", "plain-ca", "leaf.ext"),
            ("other-leaf", "other-wwdr", "leaf.ext"),
        ]
        for (name, issuer, extensions) in issued {
            try self.openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "\(name).key"])
            try self.openssl(["req", "-new", "-key", "\(name).key", "-out", "\(name).csr", "-subj", "/CN=\(name)"])
            try self.openssl(["x509", "-req", "-in", "\(name).csr", "-CA", "\(issuer).pem", "-CAkey", "\(issuer).key", "-CAcreateserial",
                              "-out", "\(name).pem", "-days", "10", "-extfile", extensions])
        }
    }

    /// Runs openssl in the directory with posix_spawn and waitpid, its output in a file:
    /// not Foundation's Process with a pipe, whose read to the end never ends when another
    /// test's long-lived child (a postmaster, a server) inherited the pipe's write end while
    /// it was open, and which held this lazily made fixture's once-lock, and with it every
    /// test waiting for it, for good (seen in CI).
    private func openssl(_ arguments: [String]) throws {
        let outputPath = self.path("openssl-\(UUID().uuidString).out")
        defer { unlink(outputPath) }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 1, outputPath, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
        posix_spawn_file_actions_adddup2(&actions, 1, 2)
        let command = "cd '\(self.directory)' && exec /usr/bin/openssl " + arguments.map { "'\($0)'" }.joined(separator: " ")
        let words: [String] = ["/bin/sh", "-c", command]
        var argv: [UnsafeMutablePointer<CChar>?] = words.map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let spawned = posix_spawn(&pid, "/bin/sh", &actions, nil, &argv, environ)
        guard spawned == 0 else {
            throw AppStoreRootError(message: "cannot run openssl: \(String(cString: strerror(spawned)))")
        }
        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0, errno == EINTR {}
        guard status == 0 else {
            let said = (try? String(contentsOfFile: outputPath, encoding: .utf8)) ?? ""
            throw AppStoreRootError(message: "openssl \(arguments.joined(separator: " ")): \(said)")
        }
    }

    func der(_ name: String) throws -> String {
        let certificate = try Certificate(pemEncoded: String(contentsOfFile: self.path("\(name).pem"), encoding: .utf8))
        var serializer = DER.Serializer()
        try serializer.serialize(certificate)
        return Data(serializer.serializedBytes).base64EncodedString()
    }

    /// A compact JWS of `payload`, signed by `signer`'s key, with `chain` as its x5c.
    func jws(_ payload: String, signer: String = "leaf", chain: [String] = ["leaf", "wwdr", "root"], alg: String = "ES256") throws -> String {
        let key = try P256.Signing.PrivateKey(pemRepresentation: String(contentsOfFile: self.path("\(signer).key"), encoding: .utf8))
        let x5c = try chain.map { "\"\(try self.der($0))\"" }.joined(separator: ",")
        let signingInput = Self.base64URL(Array("{\"alg\":\"\(alg)\",\"x5c\":[\(x5c)]}".utf8)) + "." + Self.base64URL(Array(payload.utf8))
        let signature = try key.signature(for: Array(signingInput.utf8))
        return signingInput + "." + Self.base64URL(Array(signature.rawRepresentation))
    }

    static func base64URL(_ bytes: [UInt8]) -> String {
        Data(bytes).base64EncodedString().replacingOccurrences(of: "+", with: "-").replacingOccurrences(of: "/", with: "_").replacingOccurrences(of: "=", with: "")
    }
}

@Suite("App Store JWS: ES256 only, the x5c chain to the configured root with Apple's OIDs, valid at signedDate")
struct AppStoreJWSTests {
    let certificates: AppleLikeCertificates
    let verifier: AppStoreJWSVerifier
    /// Taken after the certificates exist: openssl makes them valid from the second it runs,
    /// so a signedDate read before that would fall outside their validity.
    let now: Int64

    init() throws {
        self.certificates = try AppleLikeCertificates.shared.get()
        self.verifier = AppStoreJWSVerifier(roots: [try AppStoreJWSVerifier.loadRoot(path: self.certificates.path("root.pem"))])
        self.now = Int64(Date().timeIntervalSince1970 * 1000)
    }

    func payload(signedDate: Int64) -> String {
        #"{"notificationType":"DID_RENEW","notificationUUID":"u-1","signedDate":\#(signedDate)}"#
    }

    @Test("a notification signed by the leaf, chained to the root, is accepted and its payload returned")
    func accepted() async throws {
        let payload = try await verifier.verify(try certificates.jws(payload(signedDate: now)), what: "signedPayload")
        #expect(payload["notificationType"].string == "DID_RENEW")
    }

    @Test("the root is read from PEM and from DER")
    func rootFormats() throws {
        let pem = try AppStoreJWSVerifier.loadRoot(path: certificates.path("root.pem"))
        let der = certificates.path("root.der")
        var serializer = DER.Serializer()
        try serializer.serialize(pem)
        try Data(serializer.serializedBytes).write(to: URL(fileURLWithPath: der))
        #expect(try AppStoreJWSVerifier.loadRoot(path: der) == pem)
        #expect(throws: AppStoreRootError.self) { try AppStoreJWSVerifier.loadRoot(path: certificates.path("leaf.ext")) }
        #expect(throws: AppStoreRootError.self) { try AppStoreJWSVerifier.loadRoot(path: "/nonexistent/AppleRootCA-G3.cer") }
    }

    @Test("refused, each with its reason", arguments: [
        "alg none", "alg HS256", "signed by another key", "a chain to another root", "no Apple OID on the leaf",
        "no Apple OID on the intermediate", "not valid at signedDate", "not a JWS", "only a leaf in x5c", "a changed payload",
    ])
    func refused(_ name: String) async throws {
        let c = certificates
        let payload = self.payload(signedDate: now)
        let (jws, reason): (String, RejectionReason)
        switch name {
        case "alg none": (jws, reason) = (try c.jws(payload, alg: "none"), .badAlgorithm)
        case "alg HS256": (jws, reason) = (try c.jws(payload, alg: "HS256"), .badAlgorithm)
        case "signed by another key": (jws, reason) = (try c.jws(payload, signer: "plain-leaf"), .badSignature)
        case "a chain to another root": (jws, reason) = (try c.jws(payload, signer: "other-leaf", chain: ["other-leaf", "other-wwdr", "other-root"]), .badChain)
        case "no Apple OID on the leaf": (jws, reason) = (try c.jws(payload, signer: "plain-leaf", chain: ["plain-leaf", "wwdr", "root"]), .badChain)
        case "no Apple OID on the intermediate": (jws, reason) = (try c.jws(payload, signer: "leaf-of-plain-ca", chain: ["leaf-of-plain-ca", "plain-ca", "root"]), .badChain)
        case "not valid at signedDate": (jws, reason) = (try c.jws(self.payload(signedDate: now - 400 * 86_400_000)), .badChain)
        case "not a JWS": (jws, reason) = ("eyJhbGciOiJFUzI1NiJ9.e30", .malformedJWS)
        case "only a leaf in x5c": (jws, reason) = (try c.jws(payload, chain: ["leaf"]), .badChain)
        default:
            let good = try c.jws(payload)
            let parts = good.split(separator: ".")
            let changed = AppleLikeCertificates.base64URL(Array(self.payload(signedDate: now + 1).utf8))
            (jws, reason) = ("\(parts[0]).\(changed).\(parts[2])", .badSignature)
        }
        await #expect {
            try await verifier.verify(jws, what: "signedPayload")
        } throws: { error in
            (error as? IngestionRejection)?.reason == reason
        }
    }
}
