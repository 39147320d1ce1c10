public import EntitlementsMessages

/// An answer a client keeps (its near-cache, docs/PROTOCOL.md "Keeping answers"): the
/// decoded response, so that serving it allocates nothing, with when it was kept and the
/// log sequence it reflects.
public struct KeptResponse: CacheEntry {
    /// The server's answer as it came (with the whole customer's entitlements).
    public let response: CheckEntitlementsResponse
    /// When the client kept it, by the client's clock: it is served from then on.
    public let resolvedAt: Int64
    /// The answer's valid_until.
    public var validUntil: Int64? { self.response.validUntil }
    /// The answer's log_sequence.
    public var logSequence: UInt64 { self.response.logSequence }
    public let byteCount: Int

    /// `response` as kept at `keptAt`; `encodedBytes` is its size on the wire, the measure
    /// of what it holds.
    public init(_ response: CheckEntitlementsResponse, keptAt: Int64, encodedBytes: Int) {
        self.response = response
        self.resolvedAt = keptAt
        // A decoded answer takes a few times its wire size: each entitlement is a struct
        // with optional strings and dates, and each string its own storage.
        self.byteCount = 4 * encodedBytes
    }

    public static var vacant: KeptResponse { KeptResponse(CheckEntitlementsResponse(), keptAt: 0, encodedBytes: 0) }
    public static var storageOffset: Int? { nil }
}

/// A client's near-cache of answers (``KeptResponse``), bounded by bytes and kept by the
/// same Window TinyLFU policy as the server's ``AnswerCache`` (one ``EntryCache``). Keys
/// are the request's user id (``CacheKey/customerId`` holds it), environment and filter.
/// A value type with no locks: its owner serializes access.
public struct ResponseCache: Sendable {
    private var core: EntryCache<KeptResponse>

    public init(budgetBytes: Int) {
        self.core = EntryCache(budgetBytes: budgetBytes, policy: .tinyLFU)
    }

    public var statistics: CacheStatistics { self.core.statistics }

    /// The kept answer for `key` if it holds at `instant` (before its validUntil); marks it
    /// most recently used. Allocates nothing.
    public mutating func response(for key: CacheKey, at instant: Int64) -> KeptResponse? {
        self.core.answer(for: key, at: instant)
    }

    /// Keeps `kept` for `key` as the policy says; false when it was not kept.
    @discardableResult
    public mutating func insert(_ kept: KeptResponse, for key: CacheKey, at instant: Int64) -> Bool {
        self.core.insert(kept, for: key, at: instant)
    }

    /// Forgets every answer kept for the user id `userId` (every environment and filter).
    public mutating func removeAll(userId: String) {
        self.core.removeAll(customerId: userId)
    }

    /// Forgets everything.
    public mutating func removeAll() {
        self.core = EntryCache(budgetBytes: self.core.budgetBytes, policy: self.core.policy)
    }

    /// Calls `body` with each kept answer's user id and answer, touching no recency.
    public func forEachKept(_ body: (_ userId: String, _ kept: KeptResponse) -> Void) {
        self.core.forEachEntry { body($0.customerId, $1) }
    }
}
