import ArgumentParser
import AsyncHTTPClient
import EntitlementsSecurity
import Foundation
import NIOCore
import NIOHTTP1

/// `entitlements events`: the outbound events a server holds, through its admin listener
/// (docs/events.md, "Failures and replay").
struct EventsCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "events",
        abstract: "List the outbound events a server holds, or send some again (docs/events.md).",
        subcommands: [EventsListCommand.self, EventsRedeliverCommand.self]
    )
}

/// Where the admin listener is and the token for it.
struct AdminOptions: ParsableArguments {
    @Option(help: "The server's admin listener (serve --admin), HOST:PORT.")
    var admin: String = "127.0.0.1:9090"

    @Option(help: "Present the token in this file (its first word): listing needs the check permission, redelivering write.")
    var tokenFile: String?

    @Option(help: "How long to wait for the answer, in milliseconds.")
    var timeoutMs: Int = 10_000

    func validate() throws {
        _ = try ServeSettings.parseAddress(self.admin, origin: "--admin")
    }

    /// Calls the admin listener; returns the status and the JSON body, or throws a message.
    func call(_ method: HTTPMethod, _ pathAndQuery: String) async throws -> (status: Int, body: [String: Any]) {
        var request = HTTPClientRequest(url: "http://\(self.admin)\(pathAndQuery)")
        request.method = method
        if let path = self.tokenFile {
            let token = String(decoding: try readWholeFile(path), as: UTF8.self).split(whereSeparator: \.isWhitespace).first.map(String.init) ?? ""
            request.headers.add(name: "authorization", value: "Bearer \(token)")
        }
        if method == .POST {
            request.headers.add(name: "content-length", value: "0")
        }
        let response: HTTPClientResponse
        let bytes: ByteBuffer
        do {
            response = try await HTTPClient.shared.execute(request, timeout: .milliseconds(Int64(self.timeoutMs)))
            bytes = try await response.body.collect(upTo: 64 << 20)
        } catch {
            throw EventsFailure(message: "cannot reach the admin listener at \(self.admin): \(error)")
        }
        let object = (try? JSONSerialization.jsonObject(with: Data(buffer: bytes))) as? [String: Any]
        guard let object else {
            throw EventsFailure(message: "\(self.admin) answered HTTP \(response.status.code) that is not the events' JSON: \(String(buffer: bytes).prefix(200))")
        }
        return (Int(response.status.code), object)
    }

    /// ``call(_:_:)``, printing `error: ...` and exiting 1 unless the answer is 200.
    func succeed(_ method: HTTPMethod, _ pathAndQuery: String) async throws -> [String: Any] {
        do {
            let (status, body) = try await self.call(method, pathAndQuery)
            guard status == 200 else {
                throw EventsFailure(message: "HTTP \(status): \(body["error"] as? String ?? "")")
            }
            return body
        } catch let failure as EventsFailure {
            print("error: \(failure.message)")
            throw ExitCode(1)
        }
    }

    static func percentEncoded(_ text: String) -> String {
        text.addingPercentEncoding(withAllowedCharacters: .alphanumerics.union(CharacterSet(charactersIn: "-._~"))) ?? text
    }
}

struct EventsListCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "list",
        abstract: "The events the outbox holds, oldest first, with each destination's delivery."
    )

    @OptionGroup var options: AdminOptions

    @Flag(help: "Only the events whose last attempt failed somewhere (still retrying, or given up).")
    var failed = false

    @Option(help: "Only this user's events (a customer id or an alias).")
    var user: String?

    @Option(help: "At most this many events.")
    var limit: Int = 1_000

    @Flag(help: "Print the server's JSON answer.")
    var json = false

    func run() async throws {
        var query = "limit=\(self.limit)"
        if self.failed { query += "&failed=true" }
        if let user = self.user { query += "&user=\(AdminOptions.percentEncoded(user))" }
        let body = try await self.options.succeed(.GET, "/events?\(query)")
        if self.json {
            let data = try JSONSerialization.data(withJSONObject: body, options: [.prettyPrinted, .sortedKeys])
            print(String(decoding: data, as: UTF8.self))
            return
        }
        for destination in body["destinations"] as? [[String: Any]] ?? [] {
            let disabled = (destination["disabled"] as? String).map { ", DISABLED: \($0)" } ?? ""
            print("destination \(destination["name"] as? String ?? "?"): \(destination["waiting"] as? Int ?? 0) waiting\(disabled)")
        }
        let events = body["events"] as? [[String: Any]] ?? []
        for event in events {
            let head = [event["id"], event["type"], event["customerId"], event["occurredAt"]].map { ($0 as? String) ?? "-" }.joined(separator: "  ")
            print(head)
            for delivery in event["deliveries"] as? [[String: Any]] ?? [] {
                var line = "    \(delivery["destination"] as? String ?? "?"): \(delivery["status"] as? String ?? "?"), \(delivery["attempts"] as? Int ?? 0) attempts"
                if let result = delivery["lastResult"] as? String { line += ", last: \(result)" }
                if let next = delivery["nextAttemptAt"] as? String { line += ", next at \(next)" }
                print(line)
            }
        }
        if events.isEmpty {
            print(self.failed ? "no failed events" : "no events held")
        }
    }
}

struct EventsRedeliverCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "redeliver",
        abstract: "Send events again: one by id, or every failed one since an instant."
    )

    @OptionGroup var options: AdminOptions

    @Option(help: "The event to send again (to every destination that wanted it).")
    var id: String?

    @Flag(help: "Every event whose last attempt failed somewhere (with --since).")
    var failed = false

    @Option(help: "With --failed: events that occurred at or after this instant (RFC 3339, or Unix milliseconds).")
    var since: String?

    func validate() throws {
        switch (self.id, self.failed, self.since) {
        case (_?, false, nil), (nil, true, _?): break
        default: throw ValidationError("give --id ID, or --failed --since INSTANT")
        }
    }

    func run() async throws {
        let query = self.id.map { "id=\(AdminOptions.percentEncoded($0))" } ?? "failed=true&since=\(AdminOptions.percentEncoded(self.since ?? ""))"
        let body = try await self.options.succeed(.POST, "/events/redeliver?\(query)")
        print("redelivering \(body["redelivered"] as? Int ?? 0) event(s)")
    }
}

/// Why an `events` call failed, as printed.
struct EventsFailure: Error {
    var message: String
}
