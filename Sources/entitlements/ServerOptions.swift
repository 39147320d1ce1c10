import ArgumentParser
import EntitlementsClient

/// Where the server is, for the commands that talk to one.
struct ServerOptions: ParsableArguments {
    @Option(help: "The server's TCP address, HOST:PORT.")
    var server: String = "127.0.0.1:7420"

    @Option(help: "Connect to this Unix domain socket instead of --server.")
    var unix: String?

    @Option(help: "How long to wait for the answer, in milliseconds.")
    var timeoutMs: Int = 2_000

    func validate() throws {
        if self.unix == nil {
            _ = try ServeSettings.parseAddress(self.server, origin: "--server")
        }
        guard self.timeoutMs > 0 else {
            throw ValidationError("--timeout-ms must be positive")
        }
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
            configuration: .init(server: address, initialBackoff: .milliseconds(1), maximumBackoff: .milliseconds(1))
        )
    }

    var timeout: Duration { .milliseconds(self.timeoutMs) }
}
