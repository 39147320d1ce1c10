import EntitlementsWire
import Foundation
import Testing

@testable import EntitlementsSecurity

@Suite struct PermissionsTests {
    @Test(arguments: [
        ("none", Permissions.none), ("check", .check), ("write", .write), ("check,write", .all), ("write,check", .all),
    ])
    func parses(_ text: String, _ expected: Permissions) {
        #expect(Permissions(parsing: text) == expected)
    }

    @Test(arguments: ["", "read", "check,", "CHECK", "check write", "none,check"])
    func refuses(_ text: String) {
        #expect(Permissions(parsing: text) == nil)
    }

    @Test func everyMethodNeedsExactlyOnePermission() {
        for method in MethodID.all {
            switch method {
            case .authenticate:
                #expect(Permissions.required(by: method) == nil)
            case .checkEntitlements, .batchCheckEntitlements, .watchEntitlements, .health, .customerHistory:
                #expect(Permissions.required(by: method) == .check)
            default:
                #expect(Permissions.required(by: method) == .write, "\(method)")
            }
        }
        #expect(Permissions.required(by: MethodID(rawValue: 99)) == nil)
    }
}

@Suite struct AccessTokensTests {
    static let reader = "r-0123456789abcdef0123456789"
    static let writer = "w-0123456789abcdef0123456789"

    @Test func parsesTokensWithPermissionsAndComments() throws {
        let tokens = try AccessTokens.parse("# the billing service\n\(Self.writer)\n  \(Self.reader)  check  # dashboards\n\n", origin: "f")
        #expect(tokens.map(\.permissions) == [.all, .check])
        #expect(tokens.map { String(decoding: $0.bytes, as: UTF8.self) } == [Self.writer, Self.reader])
    }

    @Test(arguments: [
        ("short-token\n", "f line 1: a token must be 16 to 4096 characters, this one has 11 (make one with: openssl rand -hex 32)"),
        ("\(AccessTokensTests.writer) read\n", "f line 1: permissions \"read\" must be check, write or check,write"),
        ("\(AccessTokensTests.writer) none\n", "f line 1: permissions \"none\" must be check, write or check,write"),
        ("\(AccessTokensTests.writer) check extra\n", "f line 1: expected TOKEN [PERMISSIONS], found 3 words"),
        ("\(AccessTokensTests.writer)\n\(AccessTokensTests.writer) check\n", "f line 2: the same token as line 1"),
        ("# nothing\n\n", "f has no token (one a line: TOKEN [check|write|check,write])"),
    ])
    func refusesMalformedFilesWithoutQuotingATokenBack(_ text: String, _ message: String) {
        #expect {
            try AccessTokens.parse(text, origin: "f")
        } throws: { error in
            "\(error)" == message && !"\(error)".contains(Self.writer)
        }
    }

    @Test func comparesInFullAndFindsThePresentedToken() throws {
        #expect(AccessTokens.constantTimeEqual(Array("abc".utf8), Array("abc".utf8)))
        #expect(!AccessTokens.constantTimeEqual(Array("abc".utf8), Array("abd".utf8)))
        #expect(!AccessTokens.constantTimeEqual(Array("abc".utf8), Array("abcd".utf8)))
        #expect(!AccessTokens.constantTimeEqual(Array("abcd".utf8), Array("abc".utf8)))
        #expect(!AccessTokens.constantTimeEqual([], Array("a".utf8)))
        let file = try TemporaryFile("\(Self.writer)\n\(Self.reader) check\n")
        let tokens = try AccessTokens(path: file.path)
        #expect(tokens.permissions(of: Self.writer.utf8) == .all)
        #expect(tokens.permissions(of: Self.reader.utf8) == .check)
        #expect(tokens.permissions(of: (Self.reader + "x").utf8) == nil)
        #expect(tokens.permissions(of: Self.reader.dropLast().utf8) == nil)
    }

    @Test func reloadChangesTheGenerationAndABadFileKeepsTheOldTokens() throws {
        let file = try TemporaryFile("\(Self.writer)\n")
        let tokens = try AccessTokens(path: file.path)
        let before = tokens.generation
        #expect(try tokens.reloadIfChanged() == nil)
        try file.write("\(Self.reader) check\n")
        #expect(try tokens.reload())
        #expect(tokens.generation == before + 1)
        #expect(tokens.permissions(of: Self.writer.utf8) == nil)
        #expect(tokens.permissions(of: Self.reader.utf8) == .check)
        try file.write("too-short\n")
        #expect(throws: AccessTokenFileError.self) { try tokens.reload() }
        #expect(tokens.generation == before + 1)
        #expect(tokens.permissions(of: Self.reader.utf8) == .check)
        try file.write("\(Self.reader) check\n")
        #expect(try tokens.reload() == false)  // the same tokens: no new generation
        #expect(tokens.generation == before + 1)
    }

    @Test func aMissingFileSaysSo() {
        #expect {
            try AccessTokens(path: "/nonexistent/tokens")
        } throws: { error in
            "\(error)" == "--auth-token-file /nonexistent/tokens: cannot open it (No such file or directory)"
        }
    }
}

@Suite struct CallerAccessTests {
    static let policy = ListenerPolicy(name: "tcp", granted: .all, anonymous: .check)

    @Test func aConnectionsAccessIsTheListenersWithinWhatItGrants() throws {
        let file = try TemporaryFile("\(AccessTokensTests.writer)\n\(AccessTokensTests.reader) check\n")
        let tokens = try AccessTokens(path: file.path)
        let readOnly = ListenerSecurity(policy: ListenerPolicy(name: "tcp", granted: .check, anonymous: .check), tokens: tokens)
        let credentials = ConnectionCredentials(security: readOnly, peer: "p")
        #expect(try credentials.authenticate(token: AccessTokensTests.writer.utf8).get() == .check)
        let open = ConnectionCredentials(security: ListenerSecurity(policy: Self.policy, tokens: tokens), peer: "p")
        #expect(open.access.permissions == .check)
        #expect(throws: Refusal.badToken) { try open.authenticate(token: "nope-nope-nope-nope".utf8).get() }
        #expect(open.access.permissions == .check)
        var seen = 0
        #expect(open.accessChanged(since: &seen) == false)
        #expect(try open.authenticate(token: AccessTokensTests.writer.utf8).get() == .all)
        #expect(open.accessChanged(since: &seen))
        #expect(open.access.credential == .token)
    }

    @Test func aRemovedTokenLeavesTheConnectionUnauthenticatedSayingWhy() throws {
        let file = try TemporaryFile("\(AccessTokensTests.writer)\n")
        let tokens = try AccessTokens(path: file.path)
        let credentials = ConnectionCredentials(security: ListenerSecurity(policy: Self.policy, tokens: tokens), peer: "p")
        _ = try credentials.authenticate(token: AccessTokensTests.writer.utf8).get()
        var seen = 0
        _ = credentials.accessChanged(since: &seen)
        try file.write("\(AccessTokensTests.reader)\n")
        try tokens.reload()
        #expect(credentials.accessChanged(since: &seen))
        #expect(credentials.access.permissions == .check)
        let refusal = try #require(credentials.access.refusal(for: .grantEntitlement))
        #expect(refusal.status == .unauthenticated)
        #expect(refusal.reason == .revoked)
        #expect(credentials.access.refusal(for: .checkEntitlements) == nil)
    }

    @Test(arguments: [
        // granted, anonymous, credential, credentials accepted -> status, reason
        (Permissions.check, Permissions.check, CallerCredential.token, true, StatusCode.permissionDenied, Refusal.Reason.listener),
        (.all, .check, .none, true, .unauthenticated, .unauthenticated),
        (.all, .check, .none, false, .permissionDenied, .listener),
        (.all, .check, .certificate("reader"), true, .permissionDenied, .notPermitted),
        (.all, .check, .revokedToken, true, .unauthenticated, .revoked),
    ])
    func refusals(_ granted: Permissions, _ anonymous: Permissions, _ credential: CallerCredential, _ accepts: Bool, _ status: StatusCode, _ reason: Refusal.Reason) throws {
        let file = try TemporaryFile("\(AccessTokensTests.writer)\n")
        let listener = ListenerSecurity(
            policy: ListenerPolicy(name: "tcp", granted: granted, anonymous: anonymous),
            tokens: accepts ? try AccessTokens(path: file.path) : nil
        )
        #expect(listener.acceptsCredentials == accepts)
        let access = CallerAccess(permissions: anonymous.intersection(granted), credential: credential, listener: listener)
        let refusal = try #require(access.refusal(for: .revokeGrant))
        #expect(refusal.status == status)
        #expect(refusal.reason == reason)
        #expect(refusal.message.hasPrefix("RevokeGrant needs the write permission") || reason == .revoked)
    }

    @Test func bearerTokensAreCheckedPerCall() throws {
        let file = try TemporaryFile("\(AccessTokensTests.writer)\n")
        let tokens = try AccessTokens(path: file.path)
        let credentials = ConnectionCredentials(security: ListenerSecurity(policy: Self.policy, tokens: tokens), peer: "p")
        #expect(try credentials.access(authorization: nil).get().permissions == .check)
        #expect(try credentials.access(authorization: "Bearer \(AccessTokensTests.writer)").get().permissions == .all)
        #expect(try credentials.access(authorization: "bearer \(AccessTokensTests.writer)").get().permissions == .all)
        #expect(throws: Refusal.badToken) { try credentials.access(authorization: "Bearer \(AccessTokensTests.reader)").get() }
        #expect(throws: Refusal.self) { try credentials.access(authorization: "Basic dXNlcjpwYXNz").get() }
        #expect(credentials.access.permissions == .check)  // a call's token is the call's only
    }

    @Test func clientCertificatePermissionsByCommonName() throws {
        let mapped = try ClientCertificatePermissions(parsing: "billing=check,write reporting=check", origin: "--x")
        #expect(mapped.permissions(commonName: "billing") == .all)
        #expect(mapped.permissions(commonName: "reporting") == .check)
        #expect(mapped.permissions(commonName: "other") == .none)
        #expect(mapped.permissions(commonName: nil) == .none)
        let withDefault = try ClientCertificatePermissions(parsing: "billing=check,write *=check", origin: "--x")
        #expect(withDefault.permissions(commonName: "other") == .check)
        #expect(ClientCertificatePermissions().permissions(commonName: "anyone") == .all)
        #expect(throws: TLSFileError.self) { try ClientCertificatePermissions(parsing: "billing", origin: "--x") }
        #expect(throws: TLSFileError.self) { try ClientCertificatePermissions(parsing: "billing=read", origin: "--x") }
    }
}

/// A file in a fresh temporary directory, removed with it.
final class TemporaryFile {
    let directory: String
    let path: String

    init(_ text: String) throws {
        self.directory = FileManager.default.temporaryDirectory.appendingPathComponent("security-tests-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.directory, withIntermediateDirectories: true)
        self.path = self.directory + "/file"
        try self.write(text)
    }

    /// Replaces the file as an editor or Kubernetes would: a new file moved into place.
    func write(_ text: String) throws {
        try Data(text.utf8).write(to: URL(fileURLWithPath: self.path), options: .atomic)
    }

    deinit {
        try? FileManager.default.removeItem(atPath: self.directory)
    }
}
