import EntitlementsFleet
import Foundation

/// A real PostgreSQL for one test: `initdb` into a temporary directory (as the `postgres`
/// user when the tests run as root, since initdb refuses root), started with `pg_ctl` on a
/// free loopback port with password authentication, stopped and removed at the end.
final class PostgresServer: @unchecked Sendable {
    // @unchecked: the fields are set once in init; `stop` and `start` are called by one test.
    static let password = "fleet-test-secret"

    let directory: String
    let port: Int
    private let binaries: String

    var url: String { "postgres://postgres:\(Self.password)@127.0.0.1:\(self.port)/postgres" }
    var databaseURL: FleetDatabaseURL { try! FleetDatabaseURL(self.url) }

    init() throws {
        guard let binaries = Self.findBinaries() else {
            throw PostgresFixtureError("PostgreSQL's server is not installed (no /usr/lib/postgresql/*/bin/initdb): apt-get install -y postgresql")
        }
        self.binaries = binaries
        self.directory = try Self.makeDirectory()
        self.port = try Self.freePort()
        let passwordFile = self.directory + "/pwfile"
        try Self.password.write(toFile: passwordFile, atomically: true, encoding: .utf8)
        try self.run("initdb", ["-D", self.directory + "/data", "-U", "postgres", "--auth=scram-sha-256", "--pwfile=" + passwordFile, "-E", "UTF8", "--no-sync"])
        try self.start()
    }

    /// A streaming read replica of `primary` (pg_basebackup -R), started on a port of its own.
    init(replicaOf primary: PostgresServer) throws {
        self.binaries = primary.binaries
        self.directory = try Self.makeDirectory()
        self.port = try Self.freePort()
        try self.run(
            "pg_basebackup",
            ["-h", "127.0.0.1", "-p", "\(primary.port)", "-U", "postgres", "-D", self.directory + "/data", "-R", "-X", "stream", "--no-sync"],
            environment: ["PGPASSWORD": Self.password]
        )
        try self.start()
    }

    deinit {
        _ = try? self.run("pg_ctl", ["-D", self.directory + "/data", "-m", "immediate", "stop"], check: false)
        try? FileManager.default.removeItem(atPath: self.directory)
    }

    func start() throws {
        try self.run("pg_ctl", [
            "-D", self.directory + "/data", "-l", self.directory + "/log", "-w", "-t", "60",
            "-o", "-p \(self.port) -k \(self.directory) -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off",
            "start",
        ])
    }

    /// Stops the server; `immediate` is a crash (no checkpoint), as `kill -9` of the postmaster.
    func stop(mode: String = "fast") throws {
        try self.run("pg_ctl", ["-D", self.directory + "/data", "-m", mode, "-w", "stop"])
    }

    /// Runs SQL with psql as the superuser.
    @discardableResult
    func sql(_ statement: String) throws -> String {
        try self.run("psql", ["-h", "127.0.0.1", "-p", "\(self.port)", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-tAc", statement], environment: ["PGPASSWORD": Self.password])
    }

    // MARK: Processes

    private static var isRoot: Bool { getuid() == 0 }

    @discardableResult
    private func run(_ tool: String, _ arguments: [String], environment: [String: String] = [:], check: Bool = true) throws -> String {
        let path = tool == "psql" ? "/usr/bin/psql" : self.binaries + "/" + tool
        let command: [String]
        if Self.isRoot {
            command = ["/usr/sbin/runuser", "-u", "postgres", "--", "/usr/bin/env"] + environment.map { "\($0.key)=\($0.value)" } + [path] + arguments
        } else {
            command = ["/usr/bin/env"] + environment.map { "\($0.key)=\($0.value)" } + [path] + arguments
        }
        let (status, output) = try Self.spawn(command)
        if check, status != 0 {
            throw PostgresFixtureError("\(tool) \(arguments.joined(separator: " ")) exited \(status): \(output)")
        }
        return output.trimmingCharacters(in: .whitespacesAndNewlines)
    }

    /// Runs a program to its end with posix_spawn and waitpid (Foundation's Process did not
    /// always reap its child under the test runner), its output in a file, no other
    /// descriptor inherited: the postmaster `pg_ctl start` leaves running would hold a pipe
    /// open forever.
    private static func spawn(_ command: [String]) throws -> (Int32, String) {
        let outputPath = NSTemporaryDirectory() + "pg-output-\(UUID().uuidString)"
        defer { unlink(outputPath) }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_addopen(&actions, 1, outputPath, O_WRONLY | O_CREAT | O_TRUNC, 0o644)
        posix_spawn_file_actions_adddup2(&actions, 1, 2)
        // Nothing else is inherited: the postmaster outlives this call, and a pipe another
        // test had open at the moment (its child's output, read to the end) would stay open
        // in it, so that test's read would never end. Seen: protoc's and openssl's readers
        // blocked for good, holding the test runner's threads.
        try closeInheritedDescriptors(&actions)
        var arguments = command.map { strdup($0) } + [nil]
        defer { arguments.forEach { free($0) } }
        var pid: pid_t = 0
        let spawned = posix_spawn(&pid, command[0], &actions, nil, &arguments, environ)
        guard spawned == 0 else {
            throw PostgresFixtureError("cannot run \(command[0]): \(String(cString: strerror(spawned)))")
        }
        var status: Int32 = 0
        while waitpid(pid, &status, 0) < 0, errno == EINTR {}
        let output = (try? String(contentsOfFile: outputPath, encoding: .utf8)) ?? ""
        let exited = (status & 0x7f) == 0
        return (exited ? (status >> 8) & 0xff : 128 + (status & 0x7f), output)
    }

    private static func findBinaries() -> String? {
        let root = "/usr/lib/postgresql"
        let versions = ((try? FileManager.default.contentsOfDirectory(atPath: root)) ?? []).sorted { (Int($0) ?? 0) > (Int($1) ?? 0) }
        return versions.map { "\(root)/\($0)/bin" }.first { FileManager.default.isExecutableFile(atPath: $0 + "/initdb") }
    }

    private static func makeDirectory() throws -> String {
        var template = Array("/tmp/entitlements-pg-XXXXXX".utf8CString)
        guard let made = mkdtemp(&template) else {
            throw PostgresFixtureError("mkdtemp failed")
        }
        let path = String(cString: made)
        if Self.isRoot {
            var user = passwd()
            var buffer = [CChar](repeating: 0, count: 4096)
            var result: UnsafeMutablePointer<passwd>?
            guard getpwnam_r("postgres", &user, &buffer, buffer.count, &result) == 0, result != nil else {
                throw PostgresFixtureError("there is no postgres user (it comes with the postgresql package)")
            }
            guard chown(path, user.pw_uid, user.pw_gid) == 0 else {
                throw PostgresFixtureError("chown \(path) failed")
            }
        }
        return path
    }

    /// A port nobody listens on now (bound to 0, read, closed).
    static func freePort() throws -> Int {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        address.sin_port = 0
        var length = socklen_t(MemoryLayout<sockaddr_in>.size)
        let bound = withUnsafeMutablePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { pointer -> Bool in
                bind(fd, pointer, length) == 0 && getsockname(fd, pointer, &length) == 0
            }
        }
        guard bound else {
            throw PostgresFixtureError("cannot find a free port")
        }
        return Int(UInt16(bigEndian: address.sin_port))
    }
}

struct PostgresFixtureError: Error, CustomStringConvertible {
    var description: String
    init(_ description: String) { self.description = description }
}

/// Adds "close every descriptor from 3 up" to a spawn's actions (glibc 2.34's
/// posix_spawn_file_actions_addclosefrom_np, which Swift's Glibc module does not export):
/// a child that outlives the call must not hold another test's pipe open.
func closeInheritedDescriptors(_ actions: inout posix_spawn_file_actions_t) throws {
    typealias CloseFrom = @convention(c) (UnsafeMutablePointer<posix_spawn_file_actions_t>, Int32) -> Int32
    let defaultSearch: UnsafeMutableRawPointer? = nil  // RTLD_DEFAULT in glibc
    guard let symbol = dlsym(defaultSearch, "posix_spawn_file_actions_addclosefrom_np") else {
        return  // a C library before glibc 2.34: nothing to add
    }
    let status = unsafeBitCast(symbol, to: CloseFrom.self)(&actions, 3)
    guard status == 0 else {
        throw PostgresFixtureError("posix_spawn_file_actions_addclosefrom_np: \(String(cString: strerror(status)))")
    }
}

