import EntitlementsCache
import EntitlementsMessages
import EntitlementsStore

/// Where the cached answer to an encoded CheckEntitlementsRequest would be, read from its
/// bytes without decoding the message: the hash the cache files its key under and the
/// hash that picks its shard. The framed connection takes these for every check of a read
/// before it handles them one by one, to prefetch their cache entries together
/// (``AnswerCache/prefetch(hashes:)``).
///
/// A hint, nothing more: requests with an entitlement filter, an unknown environment or
/// anything unexpected give nil, and an alias hashes as itself (its customer's entry is
/// not prefetched). The request is still decoded and validated in full when it is handled.
public struct CachePeek: Sendable {
    /// ``SlotIndex/hash(_:)`` of the request's key.
    public let hash: UInt32
    /// ``KeyHash`` of the user id (its shard is this modulo the shard count).
    public let shardHash: UInt64

    /// Reads `payload`, a CheckEntitlementsRequest's encoding: its user_id (field 1) and
    /// environment (field 4); other known fields are skipped, and field 2 (a filter), field 6
    /// set (explain), a user
    /// id longer than `longestUserId` bytes (one the check refuses: not hashed) or bytes
    /// that do not parse give nil.
    public init?(checkRequest payload: UnsafeRawBufferPointer, longestUserId: Int) {
        var reader = ProtobufReader(bytes: payload)
        var userId: Range<Int>?
        var environment = Environment.production
        while !reader.isAtEnd {
            guard let tag = reader.varint() else {
                return nil
            }
            switch (tag >> 3, tag & 7) {
            case (1, 2):
                guard let range = reader.lengthDelimited() else {
                    return nil
                }
                userId = range
            case (2, _):
                return nil  // a filter: its key is hashed with the sorted ids; not worth it here
            case (4, 0):
                guard let value = reader.varint(), let known = Environment(rawValue: Int32(truncatingIfNeeded: value)) else {
                    return nil
                }
                environment = known == .unspecified ? .production : known
            case (6, 0):
                guard reader.varint() == 0 else {
                    return nil  // explain: never from the cache
                }
            case (_, 0):
                guard reader.varint() != nil else {
                    return nil
                }
            case (_, 2):
                guard reader.lengthDelimited() != nil else {
                    return nil
                }
            default:
                return nil
            }
        }
        guard let userId, !userId.isEmpty, userId.count <= longestUserId else {
            return nil
        }
        let id = UnsafeRawBufferPointer(rebasing: payload[userId])
        var hasher = Hasher()
        CacheKey.combine(customerId: id, environment: environment, filter: [], into: &hasher)
        self.hash = UInt32(truncatingIfNeeded: hasher.finalize())
        self.shardHash = KeyHash.hash(id.assumingMemoryBound(to: UInt8.self))
    }
}
