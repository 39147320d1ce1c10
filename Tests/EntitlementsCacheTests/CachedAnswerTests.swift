import NIOCore
import Testing

@testable import EntitlementsCache

@Suite("cached answer")
struct CachedAnswerTests {
    /// The framed connection writes a response's header, with its length, before the
    /// response: the length said must be the length written, for every field's varint size.
    @Test("responseByteCount is exactly what writeResponse appends")
    func byteCountIsExact() {
        let numbers: [UInt64] = [0, 1, 127, 128, 16_383, 16_384, 1 << 35, 1 << 56, UInt64(Int64.max), UInt64.max]
        let ids = ["", "u", String(repeating: "x", count: 127), String(repeating: "é", count: 64), String(repeating: "y", count: 300)]
        var checked = 0
        for userId in ids {
            for customerId in [nil, "", "c-1", String(repeating: "z", count: 200)] as [String?] {
                for number in numbers {
                    for entitlementBytes in [0, 1, 200] {
                        let answer = CachedAnswer(
                            encodedEntitlements: [UInt8](repeating: 9, count: entitlementBytes),
                            resolvedAt: 0,
                            validUntil: number == 0 ? nil : Int64(bitPattern: number),
                            logSequence: number
                        )
                        for requestDate in [Int64(0), Int64(bitPattern: number), -1] {
                            for stale in [0, number] {
                                var buffer = ByteBuffer(string: "prefix")
                                answer.writeResponse(userId: userId, customerId: customerId, requestDate: requestDate, staleForMilliseconds: stale, into: &buffer)
                                let said = answer.responseByteCount(userId: userId, customerId: customerId, requestDate: requestDate, staleForMilliseconds: stale)
                                #expect(said == buffer.readableBytes - 6, "user \(userId.utf8.count) bytes, customer \(customerId?.utf8.count ?? -1), number \(number)")
                                checked += 1
                            }
                        }
                    }
                }
            }
        }
        #expect(checked == 5 * 4 * 10 * 3 * 3 * 2)
    }
}
