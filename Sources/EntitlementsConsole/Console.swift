public import EntitlementsServer
import EntitlementsDoors
public import EntitlementsSecurity
import EntitlementsWire
public import NIOCore
public import NIOHTTP1

/// The support console (docs/console.md): `GET /console` on the admin listener, a page that
/// looks a customer up, shows its entitlements, the explanation and its history as a
/// timeline, and grants or revokes by hand. Everything it shows comes from the service's
/// own methods, called as `POST /console/api/<Method>` with the JSON door's request and
/// answer and the caller's `Authorization: Bearer` token, under the same permissions as
/// any other call: the console holds no credentials of its own and sets no cookie. Its
/// page, script and style are served from the binary; nothing is fetched from elsewhere.
public struct Console: AdminConsole {
    public let prefix = "/console"
    public let maximumBodyBytes = 64 << 10

    /// The methods a console page calls (any other is 404).
    static let methods: [String: MethodID] = [
        "CheckEntitlements": .checkEntitlements,
        "CustomerHistory": .customerHistory,
        "GrantEntitlement": .grantEntitlement,
        "RevokeGrant": .revokeGrant,
        "Health": .health,
    ]

    /// The server's methods once it is serving (the admin listener starts first).
    private let service: @Sendable () -> EntitlementMethods?

    public init(service: @escaping @Sendable () -> EntitlementMethods?) {
        self.service = service
    }

    /// Calls are POST with a JSON body from the console's own page: another site's page
    /// can send a form (`text/plain`, no preflight), which is refused here, and a browser
    /// that says where a request comes from (`Sec-Fetch-Site`, `Origin`) must say this
    /// listener. So no other site can make an engineer's browser call the console, even
    /// where the browser would present a client certificate by itself.
    public func head(_ head: HTTPRequestHead) -> HTTP1Answer? {
        let path = Self.path(head)
        guard path.hasPrefix("\(self.prefix)/api/") else {
            return head.method == .GET || head.method == .HEAD ? nil : .text(.methodNotAllowed, "only GET\n")
        }
        guard head.method == .POST else {
            return .text(.methodNotAllowed, "console calls are POST with a JSON body\n")
        }
        let contentType = head.headers.first(name: "content-type")?.lowercased() ?? ""
        guard contentType.hasPrefix("application/json") else {
            return JSONDoorCall.refusal(ServiceError(.invalidArgument, "console calls send application/json (got \(contentType.isEmpty ? "none" : contentType))"))
        }
        if let site = head.headers.first(name: "sec-fetch-site")?.lowercased(), site != "same-origin", site != "none" {
            return .text(.forbidden, "console calls come from the console's own page (Sec-Fetch-Site: \(site))\n")
        }
        if let origin = head.headers.first(name: "origin"), let host = head.headers.first(name: "host"),
            origin != "http://\(host)", origin != "https://\(host)"
        {
            return .text(.forbidden, "console calls come from the console's own page (Origin \(origin) is not this listener)\n")
        }
        return nil
    }

    public func answer(_ head: HTTPRequestHead, body: ByteBuffer, credentials: ConnectionCredentials, start: NIODeadline, eventLoop: any EventLoop) -> HTTP1Reply {
        let path = Self.path(head)
        switch path {
        case self.prefix, "\(self.prefix)/":
            return .now(Self.asset(ConsoleAssets.html, "text/html; charset=utf-8"))
        case "\(self.prefix)/console.js":
            return .now(Self.asset(ConsoleAssets.script, "text/javascript; charset=utf-8"))
        case "\(self.prefix)/console.css":
            return .now(Self.asset(ConsoleAssets.style, "text/css; charset=utf-8"))
        default:
            break
        }
        let name = path.dropFirst("\(self.prefix)/api/".count)
        guard path.hasPrefix("\(self.prefix)/api/"), let method = Self.methods[String(name)] else {
            return .now(.text(.notFound, "not found: the console serves \(self.prefix) and POST \(self.prefix)/api/{\(Self.methods.keys.sorted().joined(separator: ","))}\n"))
        }
        guard let methods = self.service() else {
            return .now(JSONDoorCall.refusal(ServiceError(.unavailable, "the server is starting (replaying its log): try again in a moment")))
        }
        let access: CallerAccess
        switch methods.access(credentials, authorization: head.headers.first(name: "authorization")) {
        case .success(let granted):
            access = granted
        case .failure(let error):
            return .now(JSONDoorCall.refusal(error))
        }
        let call = CallContext(
            eventLoop: eventLoop,
            deadline: start + .seconds(10),
            scope: ConnectionScope(peer: credentials.peer),
            access: access,
            start: start
        )
        return JSONDoorCall.answer(methods, method, body: body, call: call)
    }

    private static func path(_ head: HTTPRequestHead) -> String {
        head.uri.split(separator: "?", maxSplits: 1).first.map(String.init) ?? head.uri
    }

    /// A page asset: never cached (a new binary serves a new page), never framed by another
    /// site, and allowed to load only from this listener.
    private static func asset(_ text: String, _ contentType: String) -> HTTP1Answer {
        HTTP1Answer(.ok, contentType: contentType, body: ByteBuffer(string: text), headers: [
            ("cache-control", "no-store"),
            ("content-security-policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
            ("x-content-type-options", "nosniff"),
            ("referrer-policy", "no-referrer"),
        ])
    }
}
