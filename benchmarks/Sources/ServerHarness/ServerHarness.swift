// What the tools that start their own writable server share (NearCacheLoad, WatchFanout):
// their `--name value` settings, and the server, started pinned as run.sh pins servers and
// waited for until it answers Health.
public import EntitlementsClient
public import Foundation

/// `--name value` pairs from the command line; a malformed one ends the tool (status 2).
public struct ToolSettings: Sendable {
    public let tool: String
    public private(set) var values: [String: String] = [:]

    public init(tool: String) {
        self.tool = tool
        var arguments = CommandLine.arguments.dropFirst().makeIterator()
        while let name = arguments.next() {
            guard name.hasPrefix("--"), let value = arguments.next() else {
                FileHandle.standardError.write("\(tool): expected --name value, got '\(name)'\n".data(using: .utf8)!)
                exit(2)
            }
            self.values[String(name.dropFirst(2))] = value
        }
    }

    public func text(_ name: String) -> String {
        guard let value = self.values[name] else {
            FileHandle.standardError.write("\(self.tool): --\(name) is required\n".data(using: .utf8)!)
            exit(2)
        }
        return value
    }

    public func number(_ name: String, _ fallback: Double) -> Double { self.values[name].flatMap(Double.init) ?? fallback }
}

/// `entitlements serve` on `port` with a data directory (writes on), one loop and one
/// resolver, under `taskset -c CPU` when `--server-cpu` is set; its output goes to
/// DATA-DIR.log. Returns once it answers Health (at most 60 s; else the tool ends, status 1,
/// printing the server's log). The caller ends it, by its pid.
public func startServer(_ settings: ToolSettings, dataDirectory: String, port: Int) async throws -> Process {
    let binary = settings.text("entitlements")
    let server = Process()
    if let cpu = settings.values["server-cpu"] {
        server.executableURL = URL(fileURLWithPath: "/usr/bin/taskset")
        server.arguments = ["-c", cpu, binary]
    } else {
        server.executableURL = URL(fileURLWithPath: binary)
        server.arguments = []
    }
    server.arguments! += [
        "serve", "--data-dir", dataDirectory, "--snapshot", settings.text("snapshot"),
        "--listen", "127.0.0.1:\(port)", "--threads", "1", "--resolvers", "1",
    ]
    let log = dataDirectory + ".log"
    _ = FileManager.default.createFile(atPath: log, contents: nil)
    server.standardOutput = FileHandle(forWritingAtPath: log)
    server.standardError = server.standardOutput
    try server.run()
    let client = EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: port)))
    var serving = false
    for _ in 0..<600 where !serving {
        serving = (try? await client.health(timeout: .milliseconds(200))) != nil
        if !serving {
            try await Task.sleep(for: .milliseconds(100))
        }
    }
    await client.close()
    if serving {
        return server
    }
    print("\(settings.tool): the server did not start: \(String(decoding: FileManager.default.contents(atPath: log) ?? Data(), as: UTF8.self))")
    kill(server.processIdentifier, SIGKILL)
    exit(1)
}
