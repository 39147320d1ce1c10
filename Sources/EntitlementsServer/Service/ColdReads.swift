import Dispatch
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsCache
import EntitlementsStore
import NIOCore
import NIOPosix
import Synchronization

/// How the server reads the customers its cache does not hold (docs/architecture.md,
/// "Cold reads"). A miss is first read on its resolver's event loop with reads that do not
/// wait for the disk (RWF_NOWAIT): when the snapshot's pages are in memory that is a few
/// microseconds, less than a hop to another thread. When a page is not in memory the read
/// goes to a few threads of their own, so that the checks answered from the cache never
/// wait behind a disk read.
public struct ColdReadSettings: Sendable {
    /// Threads that read what is not in memory; 0 reads every miss on the resolver's event
    /// loop, waiting for the disk if need be (the hits queued behind it then wait too).
    /// They mostly wait for the disk, so their number is how many reads the disk is given
    /// at once, not a share of the CPU: 8 by default (benchmarks/README.md, "Cold reads").
    public var threads: Int
    /// Reads queued or running at most (distinct customers: a check for a customer whose
    /// read is already under way waits for that read and takes no place). A miss beyond
    /// that is refused RESOURCE_EXHAUSTED.
    public var queueLimit: Int
    /// Tests only: stands for a slow disk. Called with the id being read and whether the
    /// read may wait. On an event loop (`mayWait` false), before reading: false makes the
    /// read one that would wait for the disk. Where the read may wait (a cold-read thread,
    /// or a loop with no threads), once the record is read and before it is resolved: it
    /// may block, to make the read slow (a write may land meanwhile); its result is ignored.
    public var disk: (@Sendable (_ id: String, _ mayWait: Bool) -> Bool)?

    public init(threads: Int = 8, queueLimit: Int = 1_024, disk: (@Sendable (_ id: String, _ mayWait: Bool) -> Bool)? = nil) {
        self.threads = threads
        self.queueLimit = queueLimit
        self.disk = disk
    }

    /// On the resolver's loop (no threads): what the gRPC peer and the microbenchmarks use.
    public static let inline = ColdReadSettings(threads: 0)
}

/// The cold-read threads and the bound on their queue. Reads are submitted from resolver
/// loops and finish on them (``ResolverPool``).
final class ColdReads: Sendable {
    let settings: ColdReadSettings
    private let threads: NIOThreadPool?
    /// Reads queued or running.
    private let depth = Atomic<Int>(0)
    /// Reads started, and misses refused because the queue was full (for /metrics).
    private let started = Atomic<Int>(0)
    private let refused = Atomic<Int>(0)

    init(_ settings: ColdReadSettings) {
        self.settings = settings
        if settings.threads > 0 {
            let threads = NIOThreadPool(numberOfThreads: settings.threads)
            threads.start()
            self.threads = threads
        } else {
            self.threads = nil
        }
    }

    struct Statistics: Sendable {
        var queued: Int
        var started: Int
        var refused: Int
    }

    var statistics: Statistics {
        Statistics(
            queued: self.depth.load(ordering: .relaxed),
            started: self.started.load(ordering: .relaxed),
            refused: self.refused.load(ordering: .relaxed)
        )
    }

    /// Takes a place in the queue, or counts a refusal and returns false when it is full.
    func reserve() -> Bool {
        var current = self.depth.load(ordering: .relaxed)
        while current < self.settings.queueLimit {
            let (done, seen) = self.depth.compareExchange(expected: current, desired: current + 1, ordering: .relaxed)
            if done {
                self.started.add(1, ordering: .relaxed)
                return true
            }
            current = seen
        }
        self.refused.add(1, ordering: .relaxed)
        return false
    }

    /// Runs `read` on a cold-read thread, then `finish` with its result on `loop`, where the
    /// place taken by ``reserve()`` is given back. A read the threads drop (they are shutting
    /// down) finishes as ``ColdRead/abandoned``, so that every waiter is answered.
    func run(_ read: @escaping @Sendable () -> ColdRead, thenOn loop: any EventLoop, _ finish: @escaping @Sendable (ColdRead) -> Void) {
        guard let threads = self.threads else {
            preconditionFailure("inline cold reads run on the resolver's loop, not here")
        }
        threads.submit { state in
            let result = state == .active ? read() : .abandoned
            loop.execute {
                self.depth.subtract(1, ordering: .relaxed)
                finish(result)
            }
        }
    }

    /// The message of a refused miss.
    var queueFullMessage: String {
        "cold-read queue full: \(self.settings.queueLimit) cache misses are waiting for the snapshot (--cold-read-queue); retry with backoff"
    }

    /// Stops the threads once the reads they hold have run.
    func shutdown() async {
        try? await self.threads?.shutdownGracefully()
    }

    deinit {
        // A pool that was not shut down (a server never stopped): stop its threads now.
        self.threads?.shutdownGracefully(queue: .global()) { _ in }
    }
}

/// What reading a customer the cache did not hold gave: done on a cold-read thread (or
/// inline), from the store, which any thread may read.
enum ColdRead: Sendable {
    /// No such user, as of log sequence `sequence`.
    case unknown(sequence: UInt64)
    /// The user is (an alias of) customer `customerId`, owned by resolver `owner`, not by
    /// the one that read it, as of log sequence `sequence`.
    case elsewhere(owner: Int, customerId: String, sequence: UInt64)
    /// The answer for customer `customerId`, resolved at the first asker's instant.
    case resolved(CachedAnswer, customerId: String)
    /// The snapshot could not be read or the answer encoded.
    case failed(String)
    /// Not read: the server stopped without finishing its drain.
    case abandoned
}

/// The reading and resolving of a miss: everything a resolver does for one that needs no
/// state of its own (the cache, the aliases), so that it can run on another thread.
struct ColdReader: Sendable {
    let shard: Int
    let shardCount: Int
    let store: CustomerStore
    let resolver: EntitlementResolver
    let disk: (@Sendable (_ id: String, _ mayWait: Bool) -> Bool)?

    /// Reads `query`'s user, by the id as asked (a customer id or an alias: the store says
    /// whose it is now), and resolves it if it is this resolver's. With `mayWait` false, nil
    /// if the read would wait for the disk.
    func read(_ query: CheckQuery, mayWait: Bool = true) -> ColdRead? {
        let id = query.userId
        if !mayWait, let disk = self.disk, !disk(id, false) {
            return nil
        }
        let record: CustomerRecord?
        let sequence: UInt64
        do {
            (record, sequence) = try self.store.customerRead(for: id, mayWait: mayWait)
        } catch is WouldWait {
            return nil
        } catch {
            return .failed("\(error)")
        }
        if mayWait {
            _ = self.disk?(id, true)
        }
        guard let record, let canonical = record.id else {
            return .unknown(sequence: sequence)
        }
        let owner = AnswerCache.shardIndex(for: canonical, shardCount: self.shardCount)
        guard owner == self.shard else {
            return .elsewhere(owner: owner, customerId: canonical, sequence: sequence)
        }
        let resolution = self.resolver.resolve(record, at: query.instant, environment: query.environment, entitlementIds: query.entitlementIds)
        do {
            return .resolved(try CachedAnswer(resolution, resolvedAt: query.instant, logSequence: sequence), customerId: canonical)
        } catch {
            return .failed("cannot encode the answer for \(canonical): \(error)")
        }
    }
}

/// A cold read under way on a resolver, and the checks waiting for it: the one that started
/// it and those that asked for the same key meanwhile. Touched only on its resolver's loop.
final class PendingRead {
    /// The resolver's write epoch when the read started: if a write changed any customer
    /// since, what was read may be older than an acknowledged write, so it answers the
    /// checks that were waiting (they ran concurrently with the write) but is not cached.
    let epoch: UInt64
    var waiters: [(query: CheckQuery, promise: EventLoopPromise<CheckOutcome>)]

    init(epoch: UInt64, first: CheckQuery, promise: EventLoopPromise<CheckOutcome>) {
        self.epoch = epoch
        self.waiters = [(first, promise)]
    }
}
