import Prometheus
import Testing

@testable import EntitlementsServer

@Suite("latency histogram")
struct LatencyHistogramTests {
    /// The series of `name` in Prometheus text, without the TYPE line.
    static func series(_ bytes: [UInt8], _ name: String) -> [String] {
        String(decoding: bytes, as: UTF8.self).split(separator: "\n").map(String.init).filter { $0.hasPrefix(name) }
    }

    @Test("n observations at once emit exactly what swift-prometheus emits for them one by one, bounds inclusive")
    func sameAsPrometheus() {
        let registry = PrometheusCollectorRegistry()
        let reference = registry.makeDurationHistogram(name: "latency", labels: [("method", "Check")], buckets: ServerMetrics.latencyBuckets)
        let ours = LatencyHistogram(bounds: ServerMetrics.latencyBuckets)
        // Below, on and just above bounds, in every bucket, past the last, and zero.
        let observations: [(nanoseconds: Int64, count: Int)] = [
            (0, 1), (9_999, 3), (10_000, 2), (10_001, 5), (63_000, 16), (250_000, 1), (999_999, 7),
            (1_000_000, 4), (2_500_000, 1), (7_000_000_000, 2), (10_000_000_000, 1), (12_345_678_901, 9),
        ]
        for (nanoseconds, count) in observations {
            ours.record(nanoseconds: nanoseconds, count: count)
            for _ in 0..<count {
                reference.record(.nanoseconds(nanoseconds))
            }
        }
        var expected: [UInt8] = []
        registry.emit(into: &expected)
        var emitted: [UInt8] = []
        ours.emit(name: "latency", labels: #"method="Check""#, into: &emitted)
        #expect(Self.series(emitted, "latency") == Self.series(expected, "latency"))
        #expect(Self.series(emitted, "latency").contains(#"latency_bucket{method="Check",le="0.00001"} 6"#))
        #expect(Self.series(emitted, "latency").contains(#"latency_count{method="Check"} 52"#))
    }

    @Test("the sum does not wrap where nanoseconds in 64 bits would (a year of 1,000 checks in flight)")
    func largeSum() {
        let histogram = LatencyHistogram(bounds: ServerMetrics.latencyBuckets)
        // 3.2e16 ns at a time, 1,000 times: 3.2e19 ns, past Int64's 9.2e18.
        for _ in 0..<1_000 {
            histogram.record(nanoseconds: 32_000_000_000_000_000, count: 1)
        }
        var emitted: [UInt8] = []
        histogram.emit(name: "latency", labels: #"method="Check""#, into: &emitted)
        #expect(Self.series(emitted, "latency").contains(#"latency_sum{method="Check"} 32000000000.0"#))
    }

    @Test("seconds are spelled as swift-prometheus spells a Duration")
    func spelling() {
        for (nanoseconds, text) in [(Int64(10_000), "0.00001"), (2_500_000, "0.0025"), (1_000_000_000, "1.0"), (0, "0.0"), (2_500_000_000, "2.5"), (123, "0.000000123")] {
            #expect(LatencyHistogram.seconds(.nanoseconds(nanoseconds)) == text)
            #expect(Duration.nanoseconds(nanoseconds).bucketRepresentation == text)
        }
    }
}
