import Glibc

/// What a customer's history needs after a compaction (docs/durability.md, "History"): the
/// log segments the compaction no longer needs, moved into `DIR/history/` instead of
/// deleted, and an older snapshot to start from (a hard link, no copy). A history is the
/// oldest kept snapshot's record of the customer, then every write after it in the kept
/// and live segments.
///
/// Bounded by `retention`: a snapshot is kept at a compaction when none is, or when the
/// newest kept one is older than half the retention; the oldest is dropped, with the
/// segments only it needs, once the next one is itself older than the retention. So a
/// history always reaches back at least `retention`, and the directory holds at most three
/// snapshots and the log of about one and a half retentions.
public struct HistoryArchive: Sendable {
    public static let directoryName = "history"
    static let basePrefix = "base-"
    static let baseSuffix = ".snap"

    /// `DIR/history`.
    public let directory: String
    /// How far back a history must reach, in milliseconds (> 0).
    public let retention: Int64

    /// A kept snapshot: the writes up to `lastSequence` are in it; written at `createdDate`.
    public struct Base: Sendable, Hashable {
        public var lastSequence: UInt64
        public var createdDate: Int64
        public var path: String
    }

    /// A kept log segment: its records start at `firstSequence`.
    public struct Segment: Sendable, Hashable {
        public var firstSequence: UInt64
        public var path: String
    }

    public init(dataDirectory: String, retention: Int64) {
        self.directory = "\(dataDirectory)/\(Self.directoryName)"
        self.retention = retention
    }

    /// Creates the directory if it is missing (durably: the data directory is fsynced).
    func prepare() throws {
        if mkdir(self.directory, 0o755) == 0 {
            try FileDescriptor.syncDirectory(of: self.directory)
        } else if errno != EEXIST {
            throw SnapshotError(code: .io, path: self.directory, reason: "cannot create the history directory: \(String(cString: strerror(errno)))")
        }
    }

    /// Called by a compaction before it replaces `snapshotPath` (which holds writes up to
    /// `lastSequence`, written at `createdDate`): keeps it if the policy says so. Kept
    /// snapshots are at least half a retention apart by their own dates, so at most three
    /// are ever kept.
    func offer(snapshotPath: String, lastSequence: UInt64, createdDate: Int64) throws {
        try self.prepare()
        let bases = try self.bases()
        if let newest = bases.last, newest.lastSequence >= lastSequence || createdDate - newest.createdDate < self.retention / 2 {
            return
        }
        let digits = String(lastSequence)
        let name = Self.basePrefix + String(repeating: "0", count: max(0, 20 - digits.count)) + digits + "-\(createdDate)" + Self.baseSuffix
        let path = "\(self.directory)/\(name)"
        guard link(snapshotPath, path) == 0 || errno == EEXIST else {
            throw SnapshotError(code: .io, path: path, reason: "cannot keep the snapshot for history (a hard link in the data directory): \(String(cString: strerror(errno)))")
        }
        try FileDescriptor.syncDirectory(of: path)
    }

    /// Moves a segment the snapshot now covers into the archive.
    func keep(segment path: String) throws {
        try self.prepare()
        let name = path.split(separator: "/").last.map(String.init) ?? path
        guard rename(path, "\(self.directory)/\(name)") == 0 else {
            throw SnapshotError(code: .io, path: path, reason: "cannot move the log segment into the history directory: \(String(cString: strerror(errno)))")
        }
    }

    /// Drops what no history within the retention needs; returns the removed paths.
    @discardableResult
    func prune(now: Int64) throws -> [String] {
        var bases = try self.bases()
        var removed: [String] = []
        while bases.count >= 2, now - bases[1].createdDate >= self.retention {
            let dropped = bases.removeFirst()
            FileDescriptor.remove(dropped.path)
            removed.append(dropped.path)
        }
        // Segments whose every record is at or before the oldest base are needed no more.
        let segments = try self.segments()
        if let oldest = bases.first {
            for (index, segment) in segments.enumerated() {
                let nextFirst = index + 1 < segments.count ? segments[index + 1].firstSequence : nil
                if let nextFirst, nextFirst - 1 <= oldest.lastSequence {
                    FileDescriptor.remove(segment.path)
                    removed.append(segment.path)
                }
            }
        }
        if !removed.isEmpty {
            try FileDescriptor.syncDirectory(of: "\(self.directory)/.")
        }
        return removed
    }

    /// The kept snapshots, oldest first.
    public func bases() throws -> [Base] {
        try Self.list(self.directory).compactMap { name in
            guard name.hasPrefix(Self.basePrefix), name.hasSuffix(Self.baseSuffix) else { return nil }
            let parts = name.dropFirst(Self.basePrefix.count).dropLast(Self.baseSuffix.count).split(separator: "-", maxSplits: 1)
            guard parts.count == 2, let sequence = UInt64(parts[0]), let date = Int64(parts[1]) else { return nil }
            return Base(lastSequence: sequence, createdDate: date, path: "\(self.directory)/\(name)")
        }.sorted { $0.lastSequence < $1.lastSequence }
    }

    /// The kept segments, oldest first.
    public func segments() throws -> [Segment] {
        try Self.list(self.directory).compactMap { name in
            WriteAheadLog.firstSequence(ofSegmentNamed: name).map { Segment(firstSequence: $0, path: "\(self.directory)/\(name)") }
        }.sorted { $0.firstSequence < $1.firstSequence }
    }

    /// Removes the whole archive (history switched off).
    static func remove(dataDirectory: String) {
        let directory = "\(dataDirectory)/\(Self.directoryName)"
        for name in (try? Self.list(directory)) ?? [] {
            FileDescriptor.remove("\(directory)/\(name)")
        }
        rmdir(directory)
    }

    /// The names in `directory`; none when it does not exist.
    static func list(_ directory: String) throws -> [String] {
        try FileDescriptor.names(in: directory, what: "history directory", missingIsEmpty: true)
    }
}
