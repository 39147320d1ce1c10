import Synchronization

/// A latency histogram that takes many observations of one value at once: the checks
/// answered within one read share one clock reading (``ServerMetrics/answered(_:_:count:since:)``),
/// so a read of 16 pipelined checks records 16 of one duration with one lock and one bucket
/// search. swift-prometheus's histogram takes one observation per call, each its lock and a
/// walk of every bucket: 4 to 5% of the server's CPU at 50 connections x 16
/// (benchmarks/README.md).
///
/// Emitted in Prometheus' text format as swift-prometheus emits its own histograms (the
/// same `le` spelling), so dashboards see no difference.
final class LatencyHistogram: Sendable {
    private struct State {
        /// Observations per bucket, not cumulative; the last is above every bound (+Inf).
        var counts: [Int]
        /// A `Duration` (128 bits), as swift-prometheus keeps its sum: nanoseconds in an
        /// Int64 would wrap after a few months of a busy server's latencies.
        var sum = Duration.zero
        var count = 0
    }

    /// The buckets' upper bounds (inclusive), ascending.
    private let bounds: [Int64]
    private let state: Mutex<State>

    /// A histogram with the given upper bounds (inclusive), ascending.
    init(bounds: [Duration]) {
        precondition(zip(bounds, bounds.dropFirst()).allSatisfy { $0 < $1 }, "histogram bounds must ascend")
        self.bounds = bounds.map { Self.nanoseconds($0) }
        self.state = Mutex(State(counts: [Int](repeating: 0, count: bounds.count + 1)))
    }

    /// Records `count` observations of `nanoseconds`.
    func record(nanoseconds: Int64, count: Int = 1) {
        guard count > 0 else {
            return
        }
        let nanoseconds = max(0, nanoseconds)
        // The first bound at or above the value (the buckets are inclusive, as Prometheus's).
        var low = 0
        var high = self.bounds.count
        while low < high {
            let middle = (low + high) / 2
            if self.bounds[middle] >= nanoseconds {
                high = middle
            } else {
                low = middle + 1
            }
        }
        self.state.withLock { state in
            state.counts[low] += count
            // Multiplied as integers: Duration's `*` goes through generic 128-bit arithmetic
            // (1.3% of the server's CPU at 50 connections x 1, a read of one check each).
            let (total, overflow) = nanoseconds.multipliedReportingOverflow(by: Int64(count))
            state.sum += overflow ? .nanoseconds(nanoseconds) * count : .nanoseconds(total)
            state.count += count
        }
    }

    /// Appends the histogram's series, labelled `labels` (already rendered, e.g.
    /// `method="CheckEntitlements"`), to `buffer`: cumulative buckets, +Inf, sum, count.
    func emit(name: String, labels: String, into buffer: inout [UInt8]) {
        let state = self.state.withLock { $0 }
        var cumulative = 0
        for (index, bound) in self.bounds.enumerated() {
            cumulative += state.counts[index]
            buffer.append(contentsOf: "\(name)_bucket{\(labels),le=\"\(Self.seconds(.nanoseconds(bound)))\"} \(cumulative)\n".utf8)
        }
        buffer.append(contentsOf: "\(name)_bucket{\(labels),le=\"+Inf\"} \(state.count)\n".utf8)
        buffer.append(contentsOf: "\(name)_sum{\(labels)} \(Self.seconds(state.sum))\n".utf8)
        buffer.append(contentsOf: "\(name)_count{\(labels)} \(state.count)\n".utf8)
    }

    /// A duration of whole nanoseconds, not negative, as seconds with as many decimals as
    /// needed, at least one (`0.00001`, `2.5`, `1.0`): swift-prometheus's spelling.
    static func seconds(_ duration: Duration) -> String {
        let (whole, attoseconds) = duration.components
        var fraction = String(max(0, attoseconds) / 1_000_000_000)
        fraction = String(repeating: "0", count: max(0, 9 - fraction.count)) + fraction
        while fraction.count > 1, fraction.hasSuffix("0") {
            fraction.removeLast()
        }
        return "\(whole).\(fraction)"
    }

    private static func nanoseconds(_ duration: Duration) -> Int64 {
        let (seconds, attoseconds) = duration.components
        return seconds * 1_000_000_000 + attoseconds / 1_000_000_000
    }
}
