import EntitlementsMessages
import EntitlementsStore
import NIOCore
import PropertyBased
import Testing

import EntitlementsCache
@testable import EntitlementsServer

@Suite("cache peek: a check request's cache key, read from its bytes")
struct CachePeekTests {
    static func peek(_ bytes: [UInt8]) -> CachePeek? {
        bytes.withUnsafeBytes { CachePeek(checkRequest: $0, longestUserId: 256) }
    }

    @Test("the peeked hashes are the ones the cache and the shards use for the decoded request", arguments: [
        CheckEntitlementsRequest(userId: "user-1"),
        CheckEntitlementsRequest(userId: "a-much-longer-customer-id-0123456789abcdef", at: 1_700_000_000_000),
        CheckEntitlementsRequest(userId: "user-2", environment: .sandbox, minLogSequence: 42),
        CheckEntitlementsRequest(userId: "user-3", environment: .production),
        CheckEntitlementsRequest(userId: "caf\u{E9}", at: -5),
    ])
    func matchesTheKey(request: CheckEntitlementsRequest) throws {
        let peek = try #require(Self.peek(try request.serializedBytes()))
        let key = CacheKey(customerId: request.userId!, environment: request.environment)
        #expect(peek.hash == AnswerCache.hash(of: key))
        #expect(peek.shardHash == KeyHash.hash(request.userId!))
    }

    @Test("a filter, no user id, an unknown environment or bytes that do not parse give no peek")
    func refuses() throws {
        #expect(Self.peek(try CheckEntitlementsRequest(userId: "user-1", entitlementIds: ["pro"]).serializedBytes()) == nil)
        #expect(Self.peek(try CheckEntitlementsRequest(at: 5).serializedBytes()) == nil)
        #expect(Self.peek([0x0A, 0x06] + Array("user-1".utf8) + [0x20, 0x63]) == nil)  // environment 99
        #expect(Self.peek([0x0A, 0x10, 0x61]) == nil)  // a length past the end
        #expect(Self.peek([0x0A, 0x01, 0x61, 0xFF]) == nil)  // a varint cut short
        #expect(Self.peek([0x0D, 0, 0, 0, 0]) == nil)  // a wire type the message does not use
        #expect(Self.peek([]) == nil)
        #expect(Self.peek(try CheckEntitlementsRequest(userId: String(repeating: "x", count: 257)).serializedBytes()) == nil)
        #expect(Self.peek(try CheckEntitlementsRequest(userId: String(repeating: "x", count: 256)).serializedBytes()) != nil)
    }

    @Test("random messages: whenever the decoder accepts one, the peek names its key or declines; random bytes never crash it")
    func randomMessages() throws {
        var generator = SystemRandomNumberGenerator()
        func varint(_ value: UInt64) -> [UInt8] {
            var value = value
            var bytes: [UInt8] = []
            while value >= 0x80 {
                bytes.append(UInt8(truncatingIfNeeded: value) | 0x80)
                value >>= 7
            }
            return bytes + [UInt8(value)]
        }
        var compared = 0
        for _ in 0..<20_000 {
            // Fragments: user ids (repeated: the last wins), at, environment (known and not),
            // min_log_sequence, unknown fields, a filter, and now and then a random byte.
            var bytes: [UInt8] = []
            for _ in 0..<Int.random(in: 0..<6, using: &generator) {
                switch Int.random(in: 0..<8, using: &generator) {
                case 0, 1:
                    let id = Array("user-\(Int.random(in: 0..<1_000, using: &generator))".utf8)
                    bytes += [0x0A] + varint(UInt64(id.count)) + id
                case 2: bytes += [0x18] + varint(UInt64.random(in: 0...UInt64.max, using: &generator))
                case 3: bytes += [0x20] + varint(UInt64.random(in: 0..<4, using: &generator))
                case 4: bytes += [0x28] + varint(UInt64.random(in: 0..<1_000, using: &generator))
                case 5: bytes += [0x32, 0x02, 0x61, 0x62]  // field 6, unknown
                case 6: bytes += [0x12, 0x03] + Array("pro".utf8)
                default: bytes.append(UInt8.random(in: 0...255, using: &generator))
                }
            }
            let peek = Self.peek(bytes)
            guard let request = try? bytes.withUnsafeBytes({ try CheckEntitlementsRequest(serializedBytes: $0) }) else {
                continue
            }
            guard let peek else {
                continue  // declining is always allowed: it is a hint
            }
            #expect(request.entitlementIds.isEmpty)
            let userId = try #require(request.userId)
            #expect(peek.hash == AnswerCache.hash(of: CacheKey(customerId: userId, environment: request.environment)), "\(bytes)")
            compared += 1
        }
        #expect(compared > 1_000)
    }
}
