import NIOCore
import Testing

@testable import EntitlementsCache

@Suite("cached answer")
struct CachedAnswerTests {
    /// The framed connection writes a response's header, with its length, before the
    /// response: the length said must be the length written. Every varint size (1 to 10
    /// bytes) for the log sequence and the stale time, negative and zero instants, lengths
    /// of 1, 2 and 3 bytes for the strings, a customer id absent and empty, and the
    /// optional fields set and unset independently.
    @Test("responseByteCount is exactly what writeResponse appends, within what it reserves")
    func byteCountIsExact() {
        // For each varint size: the largest value of one size and the smallest of the next.
        var numbers: [UInt64] = [0]
        for size: UInt64 in 1...9 {
            let next: UInt64 = 1 << (7 * size)
            numbers += [next - 1, next]
        }
        numbers.append(UInt64.max)
        let instants: [Int64?] = [nil, 0, 1 << 35, Int64.max, -1]
        let ids = ["", "u", String(repeating: "x", count: 127), String(repeating: "é", count: 64), String(repeating: "y", count: 16_384)]
        var checked = 0
        for userId in ids {
            for customerId in [nil, "", "c-1", String(repeating: "z", count: 200)] as [String?] {
                for validUntil in instants {
                    for logSequence in numbers {
                        for entitlementBytes in [0, 200] {
                            let answer = CachedAnswer(
                                encodedEntitlements: [UInt8](repeating: 9, count: entitlementBytes),
                                resolvedAt: 0,
                                validUntil: validUntil,
                                logSequence: logSequence
                            )
                            for requestDate in [Int64(0), 1_795_874_138_000, -1] {
                                for stale in [0, logSequence] {
                                    var buffer = ByteBuffer(string: "prefix")
                                    answer.writeResponse(userId: userId, customerId: customerId, requestDate: requestDate, staleForMilliseconds: stale, into: &buffer)
                                    let written = buffer.readableBytes - 6
                                    let said = answer.responseByteCount(userId: userId, customerId: customerId, requestDate: requestDate, staleForMilliseconds: stale)
                                    let context = "user id \(userId.utf8.count) bytes, customer id \(customerId.map { "\($0.utf8.count) bytes" } ?? "none"), validUntil \(validUntil.map { "\($0)" } ?? "none"), logSequence \(logSequence), \(entitlementBytes) entitlement bytes, requestDate \(requestDate), stale \(stale)"
                                    #expect(said == written, "\(context)")
                                    #expect(written <= answer.responseReservation(userId: userId, customerId: customerId), "\(context)")
                                    checked += 1
                                }
                            }
                        }
                    }
                }
            }
        }
        #expect(checked == ids.count * 4 * instants.count * numbers.count * 2 * 3 * 2)
    }
}
