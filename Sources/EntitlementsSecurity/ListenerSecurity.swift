public import EntitlementsWire

/// One listener's rules (docs/security.md, "Permissions"): what it serves at all, and
/// what a caller that presents no credentials gets there.
public struct ListenerPolicy: Sendable, Hashable {
    /// Names the listener in messages, logs and metrics: `tcp`, `unix`, `grpc` or `admin`.
    public var name: String
    /// The setting of ``granted``, for messages (e.g. `--listen-permissions`).
    public var grantedSetting: String
    /// The setting of ``anonymous``, for messages (e.g. `--listen-anonymous`).
    public var anonymousSetting: String
    /// The most any caller may do here, whatever its credentials.
    public var granted: Permissions
    /// What a caller with no token and no client certificate may do here (within
    /// ``granted``).
    public var anonymous: Permissions

    public init(name: String, granted: Permissions = .all, anonymous: Permissions = .all, grantedSetting: String? = nil, anonymousSetting: String? = nil) {
        self.name = name
        self.granted = granted
        self.anonymous = anonymous
        let prefix = name == "tcp" ? "listen" : name
        self.grantedSetting = grantedSetting ?? "--\(prefix)-permissions"
        self.anonymousSetting = anonymousSetting ?? "--\(prefix)-anonymous"
    }

    /// A listener that lets anyone do anything: a server without security settings, and tests.
    public static func open(_ name: String) -> ListenerPolicy {
        ListenerPolicy(name: name)
    }
}

/// How a caller proved who it is.
public enum CallerCredential: Sendable, Hashable, CustomStringConvertible {
    /// Nothing: the listener's anonymous permissions.
    case none
    /// A token from --auth-token-file.
    case token
    /// A client certificate from --tls-client-ca, by its subject's common name.
    case certificate(String)
    /// A token that was accepted, and that a reload of the file has since removed.
    case revokedToken

    /// For logs: never a token, only what kind of credential it was.
    public var description: String {
        switch self {
        case .none: "none"
        case .token: "token"
        case .certificate(let name): "certificate CN=\(name)"
        case .revokedToken: "revoked token"
        }
    }
}

/// What one caller may do, and why: carried by every call into the service layer, which
/// checks it before anything else (one bit test).
public struct CallerAccess: Sendable {
    /// What the caller may call.
    public var permissions: Permissions
    public var credential: CallerCredential
    /// The listener called through: its rules and whether it accepts credentials, for a
    /// refusal's message and metric (one reference: the access rides in every call's context).
    public var listener: ListenerSecurity

    public init(permissions: Permissions, credential: CallerCredential, listener: ListenerSecurity) {
        self.permissions = permissions
        self.credential = credential
        self.listener = listener
    }

    /// Who called, for a write's source in the log: the listener and the kind of
    /// credential (`tcp token`, `grpc certificate CN=billing`, `unix anonymous`); never a token.
    public var callerDescription: String {
        "\(self.listener.policy.name) \(self.credential == .none ? "anonymous" : "\(self.credential)")"
    }

    /// Anyone may do anything (a server without security settings; tests).
    public static let unrestricted = CallerAccess(permissions: .all, credential: .none, listener: .open("tcp"))

    /// Whether `method` may be called; nil means yes.
    @inline(__always)
    public func refusal(for method: MethodID) -> Refusal? {
        guard let needed = Permissions.required(by: method), !self.permissions.isSuperset(of: needed) else {
            return nil
        }
        return self.refusal(needing: needed, method: "\(method)")
    }

    /// Why a call needing `needed` is refused (docs/security.md, "Refusals").
    @inline(never)
    public func refusal(needing needed: Permissions, method: String) -> Refusal {
        let policy = self.listener.policy
        if !policy.granted.isSuperset(of: needed) {
            return Refusal(
                .permissionDenied, reason: .listener,
                "\(method) needs the \(needed) permission, which the \(policy.name) listener does not grant (\(policy.grantedSetting) \(policy.granted))"
            )
        }
        switch self.credential {
        case .revokedToken:
            return Refusal(
                .unauthenticated, reason: .revoked,
                "the token this connection presented is no longer in --auth-token-file; present a current one"
            )
        case .none where self.listener.acceptsCredentials:
            return Refusal(
                .unauthenticated, reason: .unauthenticated,
                "\(method) needs the \(needed) permission, which callers without credentials do not have on the \(policy.name) listener (\(policy.anonymousSetting) \(policy.anonymous)): present a token (framed protocol: Authenticate, method 5; gRPC and HTTP: authorization: Bearer TOKEN) or a client certificate (docs/security.md)"
            )
        case .none:
            return Refusal(
                .permissionDenied, reason: .listener,
                "\(method) needs the \(needed) permission, which the \(policy.name) listener does not give (\(policy.anonymousSetting) \(policy.anonymous), and no --auth-token-file or --tls-client-ca to present credentials)"
            )
        case .token, .certificate:
            return Refusal(
                .permissionDenied, reason: .notPermitted,
                "\(method) needs the \(needed) permission, which this caller's \(self.credential.description) does not grant"
            )
        }
    }
}

/// A call refused for want of a permission or of credentials.
public struct Refusal: Error, Sendable, Hashable, CustomStringConvertible {
    /// Why, as the `reason` label of `entitlements_auth_refusals_total`.
    public enum Reason: String, Sendable, Hashable, CaseIterable {
        /// The listener does not serve this permission to anyone.
        case listener
        /// No credentials, and the listener's anonymous callers may not.
        case unauthenticated
        /// A token that is not in the file.
        case badToken = "bad_token"
        /// A token that was removed from the file after this connection presented it.
        case revoked
        /// Credentials that do not grant this permission.
        case notPermitted = "not_permitted"
        /// A TLS handshake that failed (a plain client, an unknown or expired certificate).
        case tls
    }

    /// PERMISSION_DENIED or UNAUTHENTICATED.
    public var status: StatusCode
    public var reason: Reason
    /// A message a person can act on; never a token.
    public var message: String

    public init(_ status: StatusCode, reason: Reason, _ message: String) {
        self.status = status
        self.reason = reason
        self.message = message
    }

    public var description: String { "\(self.status): \(self.message)" }

    /// A token that is not one of the file's.
    public static let badToken = Refusal(.unauthenticated, reason: .badToken, "the token presented is not one of --auth-token-file's")
}

/// A listener's security: its policy, the tokens it accepts, and its TLS (docs/security.md).
public final class ListenerSecurity: Sendable {
    public let policy: ListenerPolicy
    /// --auth-token-file, shared by every listener.
    public let tokens: AccessTokens?
    /// TLS on this listener (never on a Unix socket).
    public let tls: ServerTLS?

    public init(policy: ListenerPolicy, tokens: AccessTokens? = nil, tls: ServerTLS? = nil) {
        self.policy = policy
        self.tokens = tokens
        self.tls = tls
    }

    /// Anyone may do anything, in the clear.
    public static func open(_ name: String) -> ListenerSecurity {
        ListenerSecurity(policy: .open(name))
    }

    /// Whether a caller can present credentials here.
    public var acceptsCredentials: Bool {
        self.tokens != nil || self.tls?.requiresClientCertificates == true
    }

    /// The access of a caller with these credentials: the listener's anonymous permissions
    /// and the credentials', within what the listener grants.
    public func access(certificate: (name: String, permissions: Permissions)?, token: Permissions?, revoked: Bool = false) -> CallerAccess {
        var permissions = self.policy.anonymous
        var credential = CallerCredential.none
        if let certificate {
            permissions.formUnion(certificate.permissions)
            credential = .certificate(certificate.name)
        }
        if let token {
            permissions.formUnion(token)
            credential = .token
        } else if revoked {
            credential = .revokedToken
        }
        return CallerAccess(permissions: permissions.intersection(self.policy.granted), credential: credential, listener: self)
    }
}

/// One connection's credentials: its client certificate (set when the TLS handshake
/// completes, before any request is read) and the token it presented, if any; and the
/// access they give. Confined to the connection's event loop.
public final class ConnectionCredentials {
    public let security: ListenerSecurity
    /// Who is at the other end, for logs.
    public let peer: String
    private var certificate: (name: String, permissions: Permissions)?
    private var token: [UInt8]?
    private var tokenPermissions: Permissions?
    private var revoked = false
    private var generation: UInt64 = 0
    /// What this connection may do now.
    public private(set) var access: CallerAccess {
        didSet { self.version &+= 1 }
    }
    /// Counts changes of ``access`` (see ``accessChanged(since:)``).
    private var version = 0

    public init(security: ListenerSecurity, peer: String) {
        self.security = security
        self.peer = peer
        self.access = security.access(certificate: nil, token: nil)
    }

    /// Whether the token file changed since this connection's token was checked: then
    /// ``refresh()`` checks it again. One atomic load, and none without a token.
    @inline(__always)
    private var needsRefresh: Bool {
        guard self.token != nil, let tokens = self.security.tokens else {
            return false
        }
        return tokens.generation != self.generation
    }

    /// Whether ``access`` changed since `seen` (a client certificate verified, a token
    /// presented, or the token file reloaded: its token is checked again here); updates
    /// `seen`. A transport that caches the access calls this before each call: an integer
    /// compare, and an atomic load when the connection has a token.
    @inline(__always)
    public func accessChanged(since seen: inout Int) -> Bool {
        if self.needsRefresh {
            self.refresh()
        }
        guard seen != self.version else {
            return false
        }
        seen = self.version
        return true
    }

    /// Checks the connection's token against the file as it is now: a token that is gone
    /// leaves the connection with its other credentials (and its calls that needed the
    /// token are refused UNAUTHENTICATED, saying so); one whose permissions changed takes
    /// the new ones.
    private func refresh() {
        guard let token = self.token, let tokens = self.security.tokens else {
            return
        }
        self.generation = tokens.generation
        self.tokenPermissions = tokens.permissions(of: token)
        if let permissions = self.tokenPermissions {
            self.access = self.security.access(certificate: self.certificate, token: permissions)
        } else {
            self.token = nil
            self.revoked = true
            self.access = self.security.access(certificate: self.certificate, token: nil, revoked: true)
        }
    }

    /// The framed protocol's Authenticate: a token the file holds gives this connection
    /// its permissions; any other is refused and changes nothing.
    public func authenticate(token presented: some Collection<UInt8>) -> Result<Permissions, Refusal> {
        guard let tokens = self.security.tokens else {
            return .failure(Refusal(.failedPrecondition, reason: .badToken, "this server has no --auth-token-file: there is nothing to authenticate with"))
        }
        let generation = tokens.generation
        guard let permissions = tokens.permissions(of: presented) else {
            return .failure(.badToken)
        }
        self.token = Array(presented)
        self.tokenPermissions = permissions
        self.generation = generation
        self.revoked = false
        self.access = self.security.access(certificate: self.certificate, token: permissions)
        return .success(self.access.permissions)
    }

    /// The TLS handshake verified a client certificate.
    public func certificateVerified(name: String, permissions: Permissions) {
        self.certificate = (name, permissions)
        self.access = self.security.access(certificate: self.certificate, token: self.tokenPermissions, revoked: self.revoked)
    }

    /// The access of one gRPC or HTTP call that carries `authorization` (`Bearer TOKEN`),
    /// or not: the connection's certificate and the call's token. A token that is not
    /// the file's refuses the call, whatever the anonymous permissions.
    public func access(authorization: String?) -> Result<CallerAccess, Refusal> {
        guard let authorization else {
            return .success(self.access)
        }
        let words = authorization.split(separator: " ", maxSplits: 1)
        guard words.count == 2, words[0].lowercased() == "bearer" else {
            return .failure(Refusal(.unauthenticated, reason: .badToken, "the authorization header must be \"Bearer TOKEN\""))
        }
        guard let tokens = self.security.tokens else {
            return .failure(Refusal(.unauthenticated, reason: .badToken, "this server has no --auth-token-file: it accepts no bearer token"))
        }
        guard let permissions = tokens.permissions(of: words[1].utf8) else {
            return .failure(.badToken)
        }
        return .success(self.security.access(certificate: self.certificate, token: permissions))
    }
}
