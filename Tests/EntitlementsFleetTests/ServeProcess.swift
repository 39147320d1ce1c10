import Foundation

/// `entitlements serve` as a child process (posix_spawn), its output read from a pipe until
/// it says where it listens; killed by its pid.
final class ServeProcess: @unchecked Sendable {
    // @unchecked: the fields are set once in init; one test uses an instance.
    static let executable = URL(fileURLWithPath: CommandLine.arguments[0])
        .deletingLastPathComponent().appendingPathComponent("entitlements").path

    let pid: pid_t
    let port: Int
    /// What it printed up to its `listening on` line.
    let startup: String
    private let output: Int32

    init(_ arguments: [String]) throws {
        var fds: [Int32] = [0, 0]
        guard pipe(&fds) == 0 else { throw PostgresFixtureError("pipe failed") }
        var actions = posix_spawn_file_actions_t()
        posix_spawn_file_actions_init(&actions)
        defer { posix_spawn_file_actions_destroy(&actions) }
        posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0)
        posix_spawn_file_actions_adddup2(&actions, fds[1], 1)
        posix_spawn_file_actions_adddup2(&actions, fds[1], 2)
        posix_spawn_file_actions_addclose(&actions, fds[0])
        try closeInheritedDescriptors(&actions)  // no other test's pipe held open (PostgresServer.spawn)
        let command = [Self.executable] + arguments
        var argv = command.map { strdup($0) } + [nil]
        defer { argv.forEach { free($0) } }
        var pid: pid_t = 0
        let spawned = posix_spawn(&pid, Self.executable, &actions, nil, &argv, environ)
        close(fds[1])
        guard spawned == 0 else {
            close(fds[0])
            throw PostgresFixtureError("cannot run \(Self.executable): \(String(cString: strerror(spawned)))")
        }
        self.pid = pid
        self.output = fds[0]
        var seen = ""
        var buffer = [UInt8](repeating: 0, count: 4096)
        func lines() -> [Substring] { seen.split(separator: "\n") }
        while !(lines().contains { $0.hasPrefix("listening on 127.0.0.1:") } && seen.hasSuffix("\n")) {
            let count = read(fds[0], &buffer, buffer.count)
            guard count > 0 else {
                var status: Int32 = 0
                waitpid(pid, &status, 0)
                close(fds[0])
                throw PostgresFixtureError("serve exited before listening: \(seen)")
            }
            seen += String(decoding: buffer[0..<count], as: UTF8.self)
        }
        self.startup = seen
        func port(after prefix: String) -> Int? {
            lines().first { $0.hasPrefix(prefix) }.flatMap { Int($0.split(separator: ":").last ?? "") }
        }
        self.port = port(after: "listening on 127.0.0.1:")!
        self.adminPort = port(after: "admin listening on 127.0.0.1:")
    }

    /// The admin listener's port, when it was started with `--admin`.
    let adminPort: Int?

    /// An HTTP GET on the admin listener: the status and the body.
    func admin(_ path: String) throws -> (status: Int, body: String) {
        let fd = socket(AF_INET, Int32(SOCK_STREAM.rawValue), 0)
        defer { close(fd) }
        var address = sockaddr_in()
        address.sin_family = sa_family_t(AF_INET)
        address.sin_port = in_port_t(UInt16(self.adminPort ?? 0).bigEndian)
        address.sin_addr.s_addr = inet_addr("127.0.0.1")
        let connected = withUnsafePointer(to: &address) {
            $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { connect(fd, $0, socklen_t(MemoryLayout<sockaddr_in>.size)) }
        }
        guard connected == 0 else { throw PostgresFixtureError("cannot connect to the admin listener") }
        let request = Array("GET \(path) HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".utf8)
        _ = request.withUnsafeBytes { send(fd, $0.baseAddress, $0.count, 0) }
        var reply: [UInt8] = []
        var buffer = [UInt8](repeating: 0, count: 8192)
        while case let count = recv(fd, &buffer, buffer.count, 0), count > 0 {
            reply += buffer[0..<count]
        }
        let text = String(decoding: reply, as: UTF8.self)
        let head = text.prefix { $0 != "\r" }.split(separator: " ")
        let body = text.range(of: "\r\n\r\n").map { String(text[$0.upperBound...]) } ?? ""
        return (head.count > 1 ? Int(head[1]) ?? 0 : 0, body)
    }

    /// SIGKILL, then reaps it.
    func kill9() {
        kill(self.pid, SIGKILL)
        var status: Int32 = 0
        while waitpid(self.pid, &status, 0) < 0, errno == EINTR {}
        close(self.output)
    }

    /// SIGTERM (a drain), then reaps it; returns the exit status.
    func terminate() -> Int32 {
        kill(self.pid, SIGTERM)
        // Drain what it prints so that it never blocks on a full pipe.
        var buffer = [UInt8](repeating: 0, count: 4096)
        while read(self.output, &buffer, buffer.count) > 0 {}
        var status: Int32 = 0
        while waitpid(self.pid, &status, 0) < 0, errno == EINTR {}
        close(self.output)
        return (status >> 8) & 0xff
    }
}
