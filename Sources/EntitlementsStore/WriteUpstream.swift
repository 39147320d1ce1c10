public import EntitlementsMessages

/// Where a store sends its writes instead of its own log (fleet mode, docs/fleet.md): a
/// shared database that makes each write durable and numbers it. The store learns of the
/// write again, in order, when the change log is tailed (``CustomerStore/applyReplicated(_:)``).
public protocol WriteUpstream: Sendable {
    /// Validates `mutation`, received at `now`, against the upstream's current state and
    /// makes it durable there. Throws a ``WriteRefusal`` for a write the rules refuse, or
    /// one with reason `.unavailable` when the upstream cannot be reached (nothing was
    /// stored).
    /// `source` goes into the change log with the write (a customer's history).
    func write(_ mutation: LogRecord.Mutation, now: Int64, source: WriteSource?) async throws -> CustomerStore.UpstreamWrite
}

/// A replicated write whose sequence is not the next one the local log expects: writes in
/// between are missing (the change log was pruned past this server, or it is another
/// history), so the server must start again from a snapshot.
public struct ReplicationGap: Error, CustomStringConvertible, Sendable {
    public var expected: UInt64
    public var received: UInt64

    public var description: String {
        "the change log jumps from sequence \(self.expected - 1) to \(self.received): writes \(self.expected) to \(self.received - 1) are missing here"
    }
}
