import EntitlementsTools
import Foundation
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// `serve` with a token file and TLS, driven by the `entitlements` commands: what an
/// operator types (docs/security.md).
@Suite(.serialized) struct CommandLineSecurityTests {
    static let executable = URL(fileURLWithPath: CommandLine.arguments[0])
        .deletingLastPathComponent().appendingPathComponent("entitlements").path

    /// A running `serve`: its output so far is read on a thread of its own.
    final class Serve: @unchecked Sendable {
        // @unchecked: `output` is only touched under `lock`.
        let process = Process()
        private let lock = NSCondition()
        private var output = ""

        init(_ arguments: [String]) throws {
            self.process.executableURL = URL(fileURLWithPath: CommandLineSecurityTests.executable)
            self.process.arguments = arguments
            let pipe = Pipe()
            self.process.standardOutput = pipe
            self.process.standardError = pipe
            try self.process.run()
            Thread {
                while true {
                    let data = pipe.fileHandleForReading.availableData
                    if data.isEmpty { break }
                    self.lock.lock()
                    self.output += String(decoding: data, as: UTF8.self)
                    self.lock.broadcast()
                    self.lock.unlock()
                }
            }.start()
        }

        /// Waits until the output has a line containing `text` (or the process ends); returns it.
        func line(containing text: String) -> String? {
            self.lock.lock()
            defer { self.lock.unlock() }
            while true {
                if let line = self.output.split(separator: "\n").first(where: { $0.contains(text) }) {
                    return String(line)
                }
                if !self.process.isRunning {
                    return nil
                }
                self.lock.wait(until: Date().addingTimeInterval(0.2))
            }
        }

        var port: Int? {
            self.line(containing: "listening on 127.0.0.1:").flatMap { Int($0.split(separator: ":").last ?? "") }
        }

        func stop() {
            kill(self.process.processIdentifier, SIGTERM)
            self.process.waitUntilExit()
        }
    }

    static func run(_ arguments: [String]) throws -> (Int32, String) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: Self.executable)
        process.arguments = arguments
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        try process.run()
        let data = pipe.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return (process.terminationStatus, String(decoding: data, as: UTF8.self))
    }

    @Test func tokensAndTLSFromTheCommandLineWithARotationBySIGHUP() throws {
        let certificates = try Certificates.get()
        let tokens = try TemporaryFile("\(writer)\n")
        let directory = tokens.directory
        _ = try SnapshotTools.generate(count: 20, seed: 3, now: now, outputPath: directory + "/seed.snap")
        try Data("\(writer)\n".utf8).write(to: URL(fileURLWithPath: directory + "/writer.token"))
        let serve = try Serve([
            "serve", "--data-dir", directory + "/data", "--snapshot", directory + "/seed.snap", "--listen", "127.0.0.1:0",
            "--auth-token-file", tokens.path, "--tls-cert", certificates.path("server.pem"), "--tls-key", certificates.path("server.key"),
        ])
        defer { serve.stop() }
        let port = try #require(serve.port)
        #expect(serve.line(containing: "permissions: tcp") == "permissions: tcp serves check,write, anonymous callers check, TLS")
        let tls = ["--server", "localhost:\(port)", "--tls-ca", certificates.path("ca.pem")]
        let grant = ["grant", "--user", "cli-user", "--entitlement", "beta"]
        let plain = try Self.run(["check", "--user", "cli-user", "--server", "127.0.0.1:\(port)"])
        #expect(plain.0 == 1)
        #expect(plain.1 == "error: UNAVAILABLE: this listener requires TLS (serve --tls-cert); connect with TLS (docs/security.md)\n")
        #expect(try Self.run(["check", "--user", "cli-user"] + tls).0 == 0)
        let anonymous = try Self.run(grant + ["--grant-id", "g0"] + tls)
        #expect(anonymous.0 == 1)
        #expect(anonymous.1.hasPrefix("error: UNAUTHENTICATED: GrantEntitlement needs the write permission"))
        let written = try Self.run(grant + ["--grant-id", "g1", "--token-file", directory + "/writer.token"] + tls)
        #expect(written.1 == "customer cli-user: created, log sequence 1\n")
        // Rotation: a new token in the file, SIGHUP; the old token no longer works.
        let rotated = "n-0123456789abcdef0123456789"
        try tokens.write("\(rotated)\n")
        kill(serve.process.processIdentifier, SIGHUP)
        #expect(serve.line(containing: "auth: reloaded") != nil)
        #expect(serve.line(containing: "tls: reloaded \(certificates.path("server.pem")), valid until ") != nil)
        let old = try Self.run(grant + ["--grant-id", "g2", "--token-file", directory + "/writer.token"] + tls)
        #expect(old.1 == "error: UNAUTHENTICATED: the token presented is not one of --auth-token-file's\n")
        try Data("\(rotated)\n".utf8).write(to: URL(fileURLWithPath: directory + "/writer.token"))
        #expect(try Self.run(grant + ["--grant-id", "g3", "--token-file", directory + "/writer.token"] + tls).0 == 0)
        // A malformed reload keeps the tokens in use, and says so.
        try tokens.write("short\n")
        kill(serve.process.processIdentifier, SIGHUP)
        #expect(serve.line(containing: "auth: cannot reload, keeping the tokens in use") != nil)
        #expect(try Self.run(grant + ["--grant-id", "g4", "--token-file", directory + "/writer.token"] + tls).0 == 0)
    }
}
