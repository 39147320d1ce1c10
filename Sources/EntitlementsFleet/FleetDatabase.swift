import EntitlementsStore
import EntitlementsWire
public import Logging
import NIOCore
import NIOPosix
public import PostgresNIO
import Synchronization

/// Why fleet mode could not do something, in words a person can act on (the URL's
/// password never appears in it).
public struct FleetError: Error, CustomStringConvertible, Sendable {
    public enum Kind: Sendable, Equatable {
        /// The URL is malformed.
        case badURL
        /// PostgreSQL cannot be reached, or refused us (password, database name).
        case unreachable
        /// The database's schema is missing, or newer than this binary knows.
        case schema
        /// The data directory cannot serve this database and must not be replaced (it
        /// belongs to an embedded server, or holds writes the database lost).
        case dataDirectory
        /// The change log is not what the tailer expected (a gap, another epoch): the
        /// server must start again from a snapshot.
        case rebootstrap
        /// This server cannot apply the change log (its own log failed, a row does not
        /// decode): retrying would not help, so tailing stops.
        case local
        /// Anything else PostgreSQL answered.
        case database
    }

    public var kind: Kind
    public var message: String

    public init(_ kind: Kind, _ message: String) {
        self.kind = kind
        self.message = message
    }

    public var description: String { self.message }

    /// A PostgreSQL error (or a connection failure) as one line: PSQLError's own
    /// description is deliberately generic, so its server fields are read here.
    static func describe(_ error: any Error) -> String {
        if let fleet = error as? FleetError {
            return fleet.message
        }
        guard let psql = error as? PSQLError else {
            return "\(error)"
        }
        if let message = psql.serverInfo?[.message] {
            let state = psql.serverInfo?[.sqlState].map { " (SQLSTATE \($0))" } ?? ""
            return "PostgreSQL: \(message)\(state)"
        }
        if let underlying = psql.underlying {
            return "PostgreSQL connection: \(underlying)"
        }
        return "PostgreSQL connection: \(psql.code)"
    }

    /// Why a connection to PostgreSQL could not be made: the socket's reason in words a
    /// person can act on (``ConnectFailure``), else what PostgreSQL said (a wrong password).
    static func connectFailure(_ error: any Error) -> String {
        let underlying = (error as? PSQLError)?.underlying ?? error
        if let connection = underlying as? NIOConnectionError {
            let resolution = connection.dnsAError ?? connection.dnsAAAAError
            return ConnectFailure.reason(attempts: connection.connectionErrors.map(\.error), resolution: resolution, service: "PostgreSQL")
        }
        if underlying is IOError || underlying is ChannelError {
            return ConnectFailure.reason(underlying, service: "PostgreSQL")
        }
        return Self.describe(error)
    }

    /// The SQLSTATE of a PostgreSQL error, if it is one.
    static func sqlState(_ error: any Error) -> String? {
        (error as? PSQLError)?.serverInfo?[.sqlState]
    }

    /// Whether the error is the connection's rather than the statement's (the
    /// connection must be dropped).
    static func isConnectionFailure(_ error: any Error) -> Bool {
        switch error {
        case is CommitOutcomeUnknown: return true
        case let psql as PSQLError: return psql.code != .server
        case let fleet as FleetError: return fleet.kind == .unreachable
        // A refusal or a decoding error: the connection is fine (the transaction rolls back).
        default: return false
        }
    }
}

/// A use of a connection that ran out of time.
private struct TimedOut: Error {}

/// Where a transaction is, so that a timeout knows whether it may have committed. The body
/// and the timeout race for one transition: either COMMIT is sent (then a timeout cannot
/// say whether it took effect) or the transaction is abandoned (then COMMIT is never sent,
/// and closing the connection rolls it back).
private final class TransactionProgress: Sendable {
    private static let running = 0, committing = 1, abandoned = 2
    private let state = Atomic<Int>(TransactionProgress.running)

    /// Before COMMIT: false if the transaction was abandoned (do not commit).
    func beginCommit() -> Bool {
        self.state.compareExchange(expected: Self.running, desired: Self.committing, ordering: .acquiringAndReleasing).exchanged
    }

    /// On timeout: false if COMMIT was already sent (its outcome is unknown).
    func abandon() -> Bool {
        self.state.compareExchange(expected: Self.running, desired: Self.abandoned, ordering: .acquiringAndReleasing).exchanged
    }

    var commitSent: Bool { self.state.load(ordering: .acquiring) == Self.committing }
}

/// COMMIT was sent but its answer never came (the connection broke): the transaction may or
/// may not be committed.
public struct CommitOutcomeUnknown: Error, CustomStringConvertible {
    public var underlying: any Error
    public var description: String { "COMMIT's answer was lost: \(FleetError.describe(self.underlying))" }
}

/// Where the shared database is: parsed from a `postgres://user:password@host:port/database`
/// URL (docs/fleet.md). TLS to PostgreSQL is not used: fleet mode expects the database on
/// a private network or loopback (docs/fleet.md says so).
public struct FleetDatabaseURL: Sendable, CustomStringConvertible {
    public var host: String
    public var port: Int
    public var username: String
    public var password: String?
    public var database: String?

    public init(_ text: String) throws {
        let malformed = { (why: String) in
            FleetError(.badURL, "\(why); expected postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE")
        }
        var rest: Substring
        if text.hasPrefix("postgres://") {
            rest = text.dropFirst("postgres://".count)
        } else if text.hasPrefix("postgresql://") {
            rest = text.dropFirst("postgresql://".count)
        } else {
            throw malformed("the URL must start with postgres://")
        }
        if let query = rest.firstIndex(of: "?") {
            // TLS to PostgreSQL is not supported: an option asking for it must not be
            // dropped without a word.
            for option in rest[rest.index(after: query)...].split(separator: "&") where option != "sslmode=disable" {
                throw malformed("the option \"\(option)\" is not supported (only sslmode=disable: fleet mode does not use TLS to PostgreSQL yet)")
            }
            rest = rest[..<query]
        }
        var database: String?
        if let slash = rest.firstIndex(of: "/") {
            let name = String(rest[rest.index(after: slash)...])
            database = name.isEmpty ? nil : try Self.decode(name)
            rest = rest[..<slash]
        }
        guard let at = rest.lastIndex(of: "@") else {
            throw malformed("no user name (USER@HOST)")
        }
        let credentials = rest[..<at]
        let address = rest[rest.index(after: at)...]
        if let colon = credentials.firstIndex(of: ":") {
            self.username = try Self.decode(String(credentials[..<colon]))
            self.password = try Self.decode(String(credentials[credentials.index(after: colon)...]))
        } else {
            self.username = try Self.decode(String(credentials))
            self.password = nil
        }
        guard !self.username.isEmpty else {
            throw malformed("the user name is empty")
        }
        var host = String(address)
        var port = 5432
        if host.hasPrefix("[") {
            // [IPv6]:port
            guard let close = host.firstIndex(of: "]") else { throw malformed("an unclosed [ in the host") }
            let after = host[host.index(after: close)...]
            if after.hasPrefix(":") {
                guard let value = Int(after.dropFirst()), (1...65_535).contains(value) else { throw malformed("the port is not a number from 1 to 65535") }
                port = value
            }
            host = String(host[host.index(after: host.startIndex)..<close])
        } else if let colon = host.lastIndex(of: ":") {
            guard let value = Int(host[host.index(after: colon)...]), (1...65_535).contains(value) else {
                throw malformed("the port is not a number from 1 to 65535")
            }
            port = value
            host = String(host[..<colon])
        }
        guard !host.isEmpty else {
            throw malformed("the host is empty")
        }
        self.host = host
        self.port = port
        self.database = database
    }

    private static func decode(_ text: String) throws -> String {
        guard let decoded = text.removingPercentEncodingPortable() else {
            throw FleetError(.badURL, "a bad %-escape in the URL")
        }
        return decoded
    }

    /// The URL without its password (for logs and messages).
    public var description: String {
        let password = self.password == nil ? "" : ":***"
        let host = self.host.contains(":") ? "[\(self.host)]" : self.host
        return "postgres://\(self.username)\(password)@\(host):\(self.port)/\(self.database ?? "")"
    }

    var connectionConfiguration: PostgresConnection.Configuration {
        var configuration = PostgresConnection.Configuration(
            host: self.host,
            port: self.port,
            username: self.username,
            password: self.password,
            database: self.database,
            tls: .disable
        )
        configuration.options.connectTimeout = .seconds(5)
        return configuration
    }
}

extension String {
    /// Percent-decoding without Foundation.
    fileprivate func removingPercentEncodingPortable() -> String? {
        var bytes: [UInt8] = []
        var iterator = self.utf8.makeIterator()
        while let byte = iterator.next() {
            guard byte == UInt8(ascii: "%") else {
                bytes.append(byte)
                continue
            }
            guard let high = iterator.next(), let low = iterator.next(),
                let value = UInt8(String(decoding: [high, low], as: UTF8.self), radix: 16)
            else {
                return nil
            }
            bytes.append(value)
        }
        return String(validating: bytes, as: UTF8.self)
    }
}

/// The connections fleet mode holds to PostgreSQL: a few for writes and polls, opened on
/// demand and dropped on the first connection error. Unlike a pool that queues callers
/// while it retries in the background, a call here fails at once when PostgreSQL cannot be
/// reached, so a write is refused (UNAVAILABLE) rather than held.
public final class FleetDatabase: Sendable {
    public let url: FleetDatabaseURL
    let logger: Logger
    private let maximumConnections: Int
    private let state = Mutex(State())
    private let nextId = Atomic<Int>(1)

    private struct State {
        var idle: [PostgresConnection] = []
        var open = 0
        var waiters: [CheckedContinuation<PostgresConnection?, Never>] = []
        var closed = false
    }

    /// The longest one use of a connection may take (a write's transaction, a poll, an
    /// export has its own). Past it the connection is closed, which fails what waits on
    /// it: a database that vanished without closing its sockets (a crash, a network
    /// partition) must not hold a write forever.
    public let statementTimeout: Duration

    public init(url: FleetDatabaseURL, maximumConnections: Int = 4, statementTimeout: Duration = .seconds(5), logger: Logger) {
        self.url = url
        self.maximumConnections = max(1, maximumConnections)
        self.statementTimeout = statementTimeout
        self.logger = logger
    }

    /// Opens a connection of its own (LISTEN needs one), with a message a person can act
    /// on when it fails.
    public func connect() async throws -> PostgresConnection {
        do {
            return try await PostgresConnection.connect(
                on: MultiThreadedEventLoopGroup.singleton.any(),
                configuration: self.url.connectionConfiguration,
                id: self.nextId.wrappingAdd(1, ordering: .relaxed).oldValue,
                logger: self.logger
            )
        } catch {
            throw FleetError(.unreachable, "cannot connect to PostgreSQL at \(self.url): \(FleetError.connectFailure(error))")
        }
    }

    /// Runs `body` on a connection of the set, within `timeout` (default
    /// ``statementTimeout``); a connection error or the timeout drops the connection.
    ///
    /// The timeout does not rely on the connection: a query on a connection whose server
    /// vanished was seen to wait forever, even after the connection was closed. So `body`
    /// runs in a task of its own, and the caller stops waiting for it when the time is up;
    /// the connection is then closed and never reused.
    public func withConnection<T: Sendable>(
        timeout: Duration? = nil,
        _ body: @escaping @Sendable (PostgresConnection) async throws -> T
    ) async throws -> T {
        try await self.withConnection(timeout: timeout, progress: nil, body)
    }

    private func withConnection<T: Sendable>(
        timeout: Duration?,
        progress: TransactionProgress?,
        _ body: @escaping @Sendable (PostgresConnection) async throws -> T
    ) async throws -> T {
        let connection = try await self.lease()
        let limit = timeout ?? self.statementTimeout
        let work = Task { try await body(connection) }
        let outcome: Result<T, any Error> = await withCheckedContinuation { continuation in
            let done = Atomic<Bool>(false)
            let finish: @Sendable (Result<T, any Error>) -> Void = { result in
                if !done.exchange(true, ordering: .acquiringAndReleasing) {
                    continuation.resume(returning: result)
                }
            }
            Task {
                finish(await work.result)
            }
            Task {
                try? await Task.sleep(for: limit)
                finish(.failure(TimedOut()))
            }
        }
        switch outcome {
        case .success(let value):
            self.release(connection, broken: connection.isClosed)
            return value
        case .failure(let error as TimedOut):
            _ = error
            work.cancel()
            self.release(connection, broken: true)
            if let progress, !progress.abandon() {
                throw CommitOutcomeUnknown(underlying: FleetError(.unreachable, "PostgreSQL at \(self.url) did not answer COMMIT within \(limit)"))
            }
            throw FleetError(.unreachable, "PostgreSQL at \(self.url) did not answer within \(limit)")
        case .failure(let error):
            self.release(connection, broken: connection.isClosed || FleetError.isConnectionFailure(error))
            if connection.isClosed, !(error is FleetError), !(error is CommitOutcomeUnknown), !(error is WriteRefusal) {
                throw FleetError(.unreachable, "PostgreSQL at \(self.url) closed the connection (\(FleetError.describe(error)))")
            }
            throw error
        }
    }

    /// Runs `body` in a transaction (`BEGIN` + `begin`, then COMMIT, or ROLLBACK if it
    /// throws), within `timeout` as ``withConnection(timeout:_:)``.
    public func withTransaction<T: Sendable>(
        begin: String = "BEGIN",
        timeout: Duration? = nil,
        _ body: @escaping @Sendable (PostgresConnection) async throws -> T
    ) async throws -> T {
        let progress = TransactionProgress()
        let logger = self.logger
        return try await self.withConnection(timeout: timeout, progress: progress) { connection in
            try await connection.query(PostgresQuery(unsafeSQL: begin), logger: logger)
            do {
                let result = try await body(connection)
                guard progress.beginCommit() else {
                    throw TimedOut()  // the caller has given up and said it was not stored
                }
                do {
                    try await connection.query("COMMIT", logger: logger)
                } catch let error as PSQLError where error.code == .server && error.serverInfo?[.severity] == "ERROR" {
                    throw error  // the server answered ERROR: it did not commit
                } catch {
                    // Anything else, a FATAL or PANIC answer included (PostgreSQL PANICs when
                    // the WAL's flush fails after the commit record was written, and its crash
                    // recovery then finds the commit), says nothing sure about the commit.
                    // The server may have committed before the answer was lost.
                    throw CommitOutcomeUnknown(underlying: error)
                }
                return result
            } catch {
                if !FleetError.isConnectionFailure(error), !progress.commitSent {
                    _ = try? await connection.query("ROLLBACK", logger: logger)
                }
                throw error
            }
        }
    }

    private func lease() async throws -> PostgresConnection {
        enum Next {
            case use(PostgresConnection)
            case open
            case wait
            case closed
        }
        let next = self.state.withLock { state -> Next in
            if state.closed { return .closed }
            if let connection = state.idle.popLast() { return .use(connection) }
            if state.open < self.maximumConnections {
                state.open += 1
                return .open
            }
            return .wait
        }
        switch next {
        case .use(let connection):
            if connection.isClosed {
                // Closed while idle (the server went away): open another.
                self.release(connection, broken: true)
                return try await self.lease()
            }
            return connection
        case .closed:
            throw FleetError(.unreachable, "the connections to PostgreSQL are closed (shutting down)")
        case .open:
            do {
                return try await self.connect()
            } catch {
                // A caller waiting for a connection must not wait for this one, which will
                // never come: it tries for itself (and fails as fast, while the database is away).
                let waiter = self.state.withLock { state -> CheckedContinuation<PostgresConnection?, Never>? in
                    state.open -= 1
                    return state.waiters.isEmpty ? nil : state.waiters.removeFirst()
                }
                waiter?.resume(returning: nil)
                throw error
            }
        case .wait:
            let handed = await withCheckedContinuation { continuation in
                let ready = self.state.withLock { state -> PostgresConnection?? in
                    if let connection = state.idle.popLast() { return .some(connection) }
                    // Closed, or a connection failed since the first look (its slot is free
                    // and nobody will hand one over): look again rather than wait forever.
                    if state.closed || state.open < self.maximumConnections { return .some(nil) }
                    state.waiters.append(continuation)
                    return nil
                }
                if let ready {
                    continuation.resume(returning: ready)
                }
            }
            guard let handed else {
                // The connection it was to get broke, or the set closed: try afresh.
                return try await self.lease()
            }
            return handed
        }
    }

    private func release(_ connection: PostgresConnection, broken: Bool) {
        let (waiter, close) = self.state.withLock { state -> (CheckedContinuation<PostgresConnection?, Never>?, Bool) in
            if broken || state.closed {
                state.open -= 1
                // A waiter may now open a connection of its own.
                return (state.waiters.isEmpty ? nil : state.waiters.removeFirst(), true)
            }
            if !state.waiters.isEmpty {
                return (state.waiters.removeFirst(), false)
            }
            state.idle.append(connection)
            return (nil, false)
        }
        if close {
            Task { try? await connection.close() }
            waiter?.resume(returning: nil)
        } else {
            waiter?.resume(returning: connection)
        }
    }

    /// Closes every connection; later calls fail.
    public func close() async {
        let (idle, waiters) = self.state.withLock { state in
            state.closed = true
            defer {
                state.idle.removeAll()
                state.waiters.removeAll()
            }
            return (state.idle, state.waiters)
        }
        waiters.forEach { $0.resume(returning: nil) }
        for connection in idle {
            try? await connection.close()
        }
    }
}
