/// Instants at which watched answers expire (their `validUntil`), earliest first: a binary
/// min-heap of (instant, customer id).
///
/// A watch pushes an entry each time it keeps a new answer, and never looks for the old
/// one: the caller knows which entry is current (the one whose instant its answer still
/// holds) and skips the others when they come up. So keeping an answer, finding the
/// earliest expiry and taking what expired each cost a logarithm of the entries, where a
/// walk over every watched customer cost their number, at every write an every-customer
/// watch was told of (benchmarks/README.md, "Watches of every customer").
struct ExpiryHeap {
    struct Entry {
        var instant: Int64
        var customerId: String
    }

    private var entries: [Entry] = []

    var count: Int { self.entries.count }

    /// The earliest entry (ties in no particular order).
    var first: Entry? { self.entries.first }

    mutating func push(_ instant: Int64, _ customerId: String) {
        self.entries.append(Entry(instant: instant, customerId: customerId))
        self.siftUp(self.entries.count - 1)
    }

    /// Removes and returns the earliest entry.
    @discardableResult
    mutating func removeFirst() -> Entry? {
        guard !self.entries.isEmpty else {
            return nil
        }
        let first = self.entries[0]
        let last = self.entries.removeLast()
        if !self.entries.isEmpty {
            self.entries[0] = last
            self.siftDown(0)
        }
        return first
    }

    /// Replaces every entry with `entries` (the current ones, when skipped entries have
    /// piled up), in linear time.
    mutating func rebuild(_ entries: [Entry]) {
        self.entries = entries
        var index = self.entries.count / 2
        while index > 0 {
            index -= 1
            self.siftDown(index)
        }
    }

    private mutating func siftUp(_ start: Int) {
        var child = start
        while child > 0 {
            let parent = (child - 1) / 2
            guard self.entries[child].instant < self.entries[parent].instant else {
                return
            }
            self.entries.swapAt(child, parent)
            child = parent
        }
    }

    private mutating func siftDown(_ start: Int) {
        var parent = start
        let count = self.entries.count
        while true {
            let left = 2 * parent + 1
            guard left < count else {
                return
            }
            var smallest = left
            if left + 1 < count, self.entries[left + 1].instant < self.entries[left].instant {
                smallest = left + 1
            }
            guard self.entries[smallest].instant < self.entries[parent].instant else {
                return
            }
            self.entries.swapAt(smallest, parent)
            parent = smallest
        }
    }
}
