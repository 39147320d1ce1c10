import Benchmark
import EntitlementsMessages
import EntitlementsWire
import NIOCore

/// The typical answer of the service: one active subscription entitlement whose winning
/// chain has three transactions (start, two renewals), as CheckEntitlements returns it.
/// 471 bytes on the wire.
let typicalResponse: CheckEntitlementsResponse = {
    let start: Int64 = 1_760_000_000_000
    let month: Int64 = 30 * 86_400_000
    let transactions = (0..<3).map { index in
        Transaction(
            originalTransactionId: "2000000712345678",
            transactionId: "20000007123456\(78 + index)",
            store: .appstore,
            productId: "com.example.app.premium.monthly",
            transactionDate: start + Int64(index) * month,
            expirationDate: start + Int64(index + 1) * month,
            environment: .production,
            ownershipType: .owner,
            type: index == 0 ? .subscriptionStarted : .subscriptionRenewed
        )
    }
    return CheckEntitlementsResponse(
        userId: "user-4f2a9c71-8d3e-4b6a-9e21-0c5d7f3a1b88",
        customerId: "user-4f2a9c71-8d3e-4b6a-9e21-0c5d7f3a1b88",
        requestDate: start + 2 * month + 86_400_000,
        validUntil: start + 3 * month,
        entitlements: [
            Entitlement(
                id: "premium",
                isActive: true,
                source: .appstore,
                startedDate: start,
                firstPurchaseDate: start,
                lastPurchaseDate: start + 2 * month,
                expirationDate: start + 3 * month,
                productId: "com.example.app.premium.monthly",
                renewState: .willRenew,
                renewsCount: 2,
                grantType: .purchase,
                transactions: transactions,
                willRenew: true,
                ownershipType: .owner,
                periodType: .normal
            )
        ]
    )
}()

let typicalRequest = CheckEntitlementsRequest(
    userId: "user-4f2a9c71-8d3e-4b6a-9e21-0c5d7f3a1b88",
    entitlementIds: ["premium"],
    environment: .production
)

let benchmarks: @Sendable () -> Void = {
    Benchmark.defaultConfiguration = .init(
        metrics: [.wallClock, .mallocCountTotal, .throughput],
        timeUnits: .nanoseconds,
        warmupIterations: 10,
        // 1,000 iterations per sample, so the harness's own cost per sample is amortised;
        // the figures reported are per single iteration.
        scalingFactor: .kilo,
        maxDuration: .seconds(3),
        maxIterations: 100_000
    )

    Benchmark("baseline.empty-loop") { benchmark in
        for index in benchmark.scaledIterations {
            blackHole(index)
        }
    }

    Benchmark("response.encode+decode") { benchmark in
        var buffer = ByteBuffer()
        buffer.reserveCapacity(1_024)
        for _ in benchmark.scaledIterations {
            buffer.clear()
            try typicalResponse.serialize(into: &buffer)
            blackHole(try CheckEntitlementsResponse(buffer: buffer))
        }
    }

    Benchmark("response.encode") { benchmark in
        var buffer = ByteBuffer()
        buffer.reserveCapacity(1_024)
        for _ in benchmark.scaledIterations {
            buffer.clear()
            try typicalResponse.serialize(into: &buffer)
            blackHole(buffer)
        }
    }

    let encodedResponse = ByteBuffer(bytes: try! typicalResponse.serializedBytes())
    Benchmark("response.decode") { benchmark in
        for _ in benchmark.scaledIterations {
            blackHole(try CheckEntitlementsResponse(buffer: encodedResponse))
        }
    }

    let encodedRequest = ByteBuffer(bytes: try! typicalRequest.serializedBytes())
    Benchmark("request.decode") { benchmark in
        for _ in benchmark.scaledIterations {
            blackHole(try CheckEntitlementsRequest(buffer: encodedRequest))
        }
    }

    // 100 pipelined request frames in one read, as a busy connection delivers them.
    var frames = ByteBuffer()
    for id in 1...100 {
        frames.writeFrame(.request(id: UInt64(id), method: .checkEntitlements, payload: encodedRequest))
    }
    let pipelined = frames
    Benchmark("frame-decoder.100-frames") { benchmark in
        for _ in benchmark.scaledIterations {
            var input = pipelined
            var decoder = FrameDecoder()
            while let frame = try decoder.decode(buffer: &input) {
                blackHole(frame)
            }
        }
    }
}
