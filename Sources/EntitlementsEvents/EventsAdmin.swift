import EntitlementsFormats
public import EntitlementsSecurity
public import EntitlementsServer
public import NIOCore
public import NIOHTTP1

/// The events' calls on the admin listener (docs/events.md, "Failures and replay"), what
/// `entitlements events` uses: `GET /events` lists the events the outbox holds (needs the
/// `check` permission, as /metrics), `POST /events/redeliver` sends some again (needs
/// `write`). Answers are JSON.
public struct EventsAdmin: AdminConsole {
    /// The events once the server has opened them (the admin listener starts first).
    let events: @Sendable () -> OutboundEvents?
    public let prefix = "/events"
    public let maximumBodyBytes = 0

    public init(_ events: @escaping @Sendable () -> OutboundEvents?) {
        self.events = events
    }

    public func head(_ head: HTTPRequestHead) -> HTTP1Answer? {
        switch (head.method, Self.path(head)) {
        case (.GET, "/events"), (.POST, "/events/redeliver"): nil
        default: Self.json(.methodNotAllowed, ["error": .string("GET /events, or POST /events/redeliver")])
        }
    }

    public func answer(_ head: HTTPRequestHead, body: ByteBuffer, credentials: ConnectionCredentials, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply {
        let path = Self.path(head)
        let needed: Permissions = path == "/events" ? .check : .write
        switch credentials.access(authorization: head.headers.first(name: "authorization")) {
        case .success(let access) where access.permissions.contains(needed):
            break
        case .success(let access):
            let refusal = access.refusal(needing: needed, method: "\(head.method) \(path)")
            return .now(Self.json(.forbidden, ["error": .string(refusal.message)]))
        case .failure(let refusal):
            return .now(Self.json(refusal.status == .unauthenticated ? .unauthorized : .forbidden, ["error": .string(refusal.message)]))
        }
        guard let events = self.events() else {
            return .now(Self.json(.serviceUnavailable, ["error": .string("starting: the events are not open yet")]))
        }
        let query = Self.query(head)
        if path == "/events" {
            return .now(Self.list(events, query))
        }
        return .now(Self.redeliver(events, query))
    }

    private static func list(_ events: OutboundEvents, _ query: [String: String]) -> HTTP1Answer {
        let limit = query["limit"].flatMap(Int.init) ?? 1_000
        guard limit > 0 else {
            return Self.json(.badRequest, ["error": .string("limit must be a positive whole number")])
        }
        let customer = query["user"].map { events.customerId(of: $0) ?? $0 }
        let listings = events.list(failedOnly: query["failed"] == "true", customerId: customer, limit: limit)
        let destinations = events.outbox.withLedger { ledger in
            events.configuration.destinations.map { destination -> JSONValue in
                .object([
                    ("name", .string(destination.name)),
                    ("waiting", .int(Int64(ledger.unsettledCount(destination.name)))),
                    ("disabled", .string(ledger.disabledReason(destination.name))),
                ])
            }
        }
        let events = listings.map { listing -> JSONValue in
            let summary = listing.summary
            return .object([
                ("id", .string(summary.id)),
                ("type", .string(summary.type)),
                ("customerId", .string(summary.customerId)),
                ("environment", .string(summary.environment)),
                ("logSequence", .int(Int64(clamping: summary.logSequence))),
                ("occurredAt", .date(summary.occurredAt)),
                ("deliveries", .array(listing.deliveries.map { destination, delivery in
                    .object([
                        ("destination", .string(destination)),
                        ("status", .string(delivery.status.rawValue)),
                        ("attempts", .int(Int64(delivery.attempts))),
                        ("firstAttemptAt", .date(delivery.firstAttemptAt)),
                        ("lastAttemptAt", .date(delivery.lastAttemptAt)),
                        ("nextAttemptAt", .date(delivery.nextAttemptAt)),
                        ("lastResult", .string(delivery.lastResult)),
                    ])
                })),
            ])
        }
        return Self.json(.ok, ["destinations": .array(destinations), "events": .array(events)])
    }

    private static func redeliver(_ events: OutboundEvents, _ query: [String: String]) -> HTTP1Answer {
        if let id = query["id"] {
            guard events.redeliver(id: id) else {
                return Self.json(.notFound, ["error": .string("no event \(id) in the outbox (delivered events leave it; ids are listed by GET /events)")])
            }
            return Self.json(.ok, ["redelivered": .int(1)])
        }
        guard query["failed"] == "true", let sinceText = query["since"] else {
            return Self.json(.badRequest, ["error": .string("give id=ID, or failed=true&since=INSTANT (RFC 3339 or Unix milliseconds)")])
        }
        guard let since = Int64(sinceText) ?? RFC3339.parse(sinceText) else {
            return Self.json(.badRequest, ["error": .string("since \"\(sinceText)\" is not an RFC 3339 instant or Unix milliseconds")])
        }
        return Self.json(.ok, ["redelivered": .int(Int64(events.redeliverFailed(since: since)))])
    }

    private static func path(_ head: HTTPRequestHead) -> String {
        head.uri.split(separator: "?", maxSplits: 1).first.map(String.init) ?? head.uri
    }

    /// The query's parameters, percent-decoded (`+` is a space).
    static func query(_ head: HTTPRequestHead) -> [String: String] {
        guard let mark = head.uri.firstIndex(of: "?") else {
            return [:]
        }
        var out: [String: String] = [:]
        for pair in head.uri[head.uri.index(after: mark)...].split(separator: "&") {
            let parts = pair.split(separator: "=", maxSplits: 1)
            guard let name = parts.first.flatMap({ Self.decode($0) }) else { continue }
            out[name] = parts.count == 2 ? Self.decode(parts[1]) ?? "" : ""
        }
        return out
    }

    private static func decode(_ text: Substring) -> String? {
        var bytes: [UInt8] = []
        var iterator = Array(text.utf8).makeIterator()
        while let byte = iterator.next() {
            switch byte {
            case UInt8(ascii: "+"): bytes.append(UInt8(ascii: " "))
            case UInt8(ascii: "%"):
                guard let high = iterator.next(), let low = iterator.next(), let value = Hex.decode(String(decoding: [high, low], as: UTF8.self)) else {
                    return nil
                }
                bytes += value
            default: bytes.append(byte)
            }
        }
        return String(validating: bytes, as: UTF8.self)
    }

    private static func json(_ status: HTTPResponseStatus, _ fields: KeyValuePairs<String, JSONValue>) -> HTTP1Answer {
        let text = JSONValue.object(fields.map { ($0.key, $0.value) }).serialized(pretty: false) + "\n"
        return HTTP1Answer(status, contentType: "application/json", body: ByteBuffer(string: text))
    }
}
