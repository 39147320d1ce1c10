public import EntitlementsCache
public import EntitlementsStore

extension AnswerCache {
    /// The shard that owns `customerId` among `shardCount` shards: stable across runs, so
    /// that a customer always goes to the same resolver actor (the snapshot's ``KeyHash``,
    /// which ``CachePeek`` reads from a request's bytes too).
    @inlinable
    public static func shardIndex(for customerId: String, shardCount: Int) -> Int {
        precondition(shardCount > 0)
        // One shard owns everything: no need to hash (`serve --resolvers 1`, every check).
        return shardCount == 1 ? 0 : Int(KeyHash.hash(customerId) % UInt64(shardCount))
    }
}
