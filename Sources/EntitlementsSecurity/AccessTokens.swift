import Synchronization

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// A token file that cannot be used, with a message that names the file and the line but
/// never a token.
public struct AccessTokenFileError: Error, CustomStringConvertible, Sendable {
    public var description: String

    init(_ description: String) {
        self.description = description
    }
}

/// The tokens of `--auth-token-file` (docs/security.md, "Tokens"): one a line, each with
/// the permissions it grants, reloaded when the file changes or on SIGHUP.
///
///     # comment
///     TOKEN                 grants check,write
///     TOKEN check           grants check only
///
/// A token is 16 to 4,096 visible ASCII characters (no spaces). Presented tokens are
/// compared in constant time against every token in the file. A reload that finds the file
/// unreadable or malformed keeps the tokens it had (and says why); a good one bumps
/// ``generation``, so that connections authenticated by a token that is gone lose it.
public final class AccessTokens: Sendable {
    /// The smallest token accepted: 16 characters of a random alphabet are out of reach of
    /// guessing at any rate a network allows (docs/security.md says how to make one).
    public static let minimumLength = 16
    public static let maximumLength = 4_096

    struct Token: Sendable {
        var bytes: [UInt8]
        var permissions: Permissions
    }

    /// The file's path.
    public let path: String
    private let tokens: Mutex<[Token]>
    private let changes = Atomic<UInt64>(0)
    /// What the file looked like when last read, to notice a change without reading it.
    private let signature: Mutex<FileSignature?>

    /// Reads `path`; throws if it cannot be read, has no token, or has a malformed line.
    public init(path: String) throws {
        self.path = path
        let (tokens, signature) = try Self.read(path)
        self.tokens = Mutex(tokens)
        self.signature = Mutex(signature)
    }

    /// Bumped by every reload that changed the tokens. A connection remembers the value it
    /// authenticated at and checks its token again when this differs (one atomic load).
    public var generation: UInt64 { self.changes.load(ordering: .acquiring) }

    /// How many tokens the file holds.
    public var count: Int { self.tokens.withLock { $0.count } }

    /// The permissions of `presented`, or nil if no token in the file is it. Every token is
    /// compared, each in time that depends on its length only.
    public func permissions(of presented: some Collection<UInt8>) -> Permissions? {
        let presented = Array(presented)
        return self.tokens.withLock { tokens in
            var found: Permissions?
            for token in tokens where Self.constantTimeEqual(token.bytes, presented) {
                found = token.permissions
            }
            return found
        }
    }

    /// Reads the file again (SIGHUP). Returns true when the tokens changed; throws, keeping
    /// the tokens it had, when the file cannot be used.
    @discardableResult
    public func reload() throws -> Bool {
        let (tokens, signature) = try Self.read(self.path)
        self.signature.withLock { $0 = signature }
        let changed = self.tokens.withLock { current in
            let same = current.count == tokens.count
                && zip(current, tokens).allSatisfy { $0.bytes == $1.bytes && $0.permissions == $1.permissions }
            current = tokens
            return !same
        }
        if changed {
            self.changes.wrappingAdd(1, ordering: .releasing)
        }
        return changed
    }

    /// Reloads if the file looks different from when it was last read (its inode, size or
    /// modification time: a Kubernetes Secret is updated by swapping a symbolic link).
    /// Returns nil when it looked the same.
    public func reloadIfChanged() throws -> Bool? {
        let now = FileSignature(path: self.path)
        let before = self.signature.withLock { signature in
            defer { signature = now }  // a file that fails is reported once, not every poll
            return signature
        }
        guard now != before else {
            return nil
        }
        return try self.reload()
    }

    /// Equal contents, in time that depends on the lengths only.
    static func constantTimeEqual(_ a: [UInt8], _ b: [UInt8]) -> Bool {
        // The lengths are not secret (every token's is in the docs' range); the bytes are.
        var difference: UInt8 = a.count == b.count ? 0 : 1
        for index in 0..<a.count {
            difference |= a[index] ^ (index < b.count ? b[index] : 0)
        }
        return difference == 0
    }

    /// Parses a token file's text; `origin` names it in errors.
    static func parse(_ text: String, origin: String) throws -> [Token] {
        var tokens: [Token] = []
        var lineNumbers: [[UInt8]: Int] = [:]
        for (index, rawLine) in text.split(separator: "\n", omittingEmptySubsequences: false).enumerated() {
            let number = index + 1
            var line = rawLine
            if let hash = line.firstIndex(of: "#") {
                line = line[..<hash]
            }
            let words = line.split(whereSeparator: { $0 == " " || $0 == "\t" || $0 == "\r" })
            guard let first = words.first else {
                continue
            }
            guard words.count <= 2 else {
                throw AccessTokenFileError("\(origin) line \(number): expected TOKEN [PERMISSIONS], found \(words.count) words")
            }
            let bytes = Array(first.utf8)
            guard bytes.count >= Self.minimumLength, bytes.count <= Self.maximumLength else {
                throw AccessTokenFileError("\(origin) line \(number): a token must be \(Self.minimumLength) to \(Self.maximumLength) characters, this one has \(bytes.count) (make one with: openssl rand -hex 32)")
            }
            guard bytes.allSatisfy({ (0x21...0x7E).contains($0) }) else {
                throw AccessTokenFileError("\(origin) line \(number): a token must be visible ASCII characters")
            }
            var permissions = Permissions.all
            if words.count == 2 {
                guard let parsed = Permissions(parsing: words[1]), parsed != .none else {
                    throw AccessTokenFileError("\(origin) line \(number): permissions \"\(words[1])\" must be check, write or check,write")
                }
                permissions = parsed
            }
            if let earlier = lineNumbers[bytes] {
                throw AccessTokenFileError("\(origin) line \(number): the same token as line \(earlier)")
            }
            lineNumbers[bytes] = number
            tokens.append(Token(bytes: bytes, permissions: permissions))
        }
        guard !tokens.isEmpty else {
            throw AccessTokenFileError("\(origin) has no token (one a line: TOKEN [check|write|check,write])")
        }
        return tokens
    }

    private static func read(_ path: String) throws -> ([Token], FileSignature?) {
        let signature = FileSignature(path: path)
        let bytes: [UInt8]
        do {
            bytes = try readWholeFile(path)
        } catch {
            throw AccessTokenFileError("--auth-token-file \(path): \(error)")
        }
        return (try Self.parse(String(decoding: bytes, as: UTF8.self), origin: "--auth-token-file \(path)"), signature)
    }
}

/// What `stat` says of a file, to notice that it changed.
struct FileSignature: Hashable, Sendable {
    var device: UInt64
    var inode: UInt64
    var size: Int64
    var modified: Int64
    var modifiedNanoseconds: Int64

    init?(path: String) {
        var info = stat()
        guard stat(path, &info) == 0 else {
            return nil
        }
        self.device = UInt64(info.st_dev)
        self.inode = UInt64(info.st_ino)
        self.size = Int64(info.st_size)
        #if canImport(Darwin)
        self.modified = Int64(info.st_mtimespec.tv_sec)
        self.modifiedNanoseconds = Int64(info.st_mtimespec.tv_nsec)
        #else
        self.modified = Int64(info.st_mtim.tv_sec)
        self.modifiedNanoseconds = Int64(info.st_mtim.tv_nsec)
        #endif
    }
}

/// A file read failed; says why as `strerror` does.
public struct FileReadError: Error, CustomStringConvertible {
    public var description: String
}

/// The bytes of the file at `path` (at most 1 MiB: these are small files of secrets).
public func readWholeFile(_ path: String) throws -> [UInt8] {
    let fd = open(path, O_RDONLY | O_CLOEXEC)
    guard fd >= 0 else {
        throw FileReadError(description: "cannot open it (\(String(cString: strerror(errno))))")
    }
    defer { close(fd) }
    var bytes: [UInt8] = []
    var chunk = [UInt8](repeating: 0, count: 65_536)
    while true {
        let count = chunk.withUnsafeMutableBytes { read(fd, $0.baseAddress, $0.count) }
        if count < 0 {
            if errno == EINTR { continue }
            throw FileReadError(description: "cannot read it (\(String(cString: strerror(errno))))")
        }
        if count == 0 {
            return bytes
        }
        bytes += chunk[0..<count]
        guard bytes.count <= 1 << 20 else {
            throw FileReadError(description: "larger than 1 MiB; not a file of tokens, secrets or certificates")
        }
    }
}
