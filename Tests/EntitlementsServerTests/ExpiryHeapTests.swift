@testable import EntitlementsServer
import Testing

@Suite("ExpiryHeap")
struct ExpiryHeapTests {
    @Test("entries come out earliest first, pushed in any order, ties and repeats included")
    func order() {
        var generator = SystemRandomNumberGenerator()
        for size in [0, 1, 2, 3, 10, 257, 2_000] {
            var heap = ExpiryHeap()
            var pushed: [Int64] = []
            for index in 0..<size {
                let instant = Int64(generator.next() % 500)  // many ties
                heap.push(instant, "c-\(index)")
                pushed.append(instant)
            }
            var popped: [Int64] = []
            while let entry = heap.removeFirst() {
                popped.append(entry.instant)
            }
            #expect(popped == pushed.sorted(), "size \(size)")
            #expect(heap.count == 0 && heap.first == nil)
        }
    }

    @Test("pops and pushes interleaved, and a rebuild, keep the order")
    func interleavedAndRebuilt() {
        var generator = SystemRandomNumberGenerator()
        var heap = ExpiryHeap()
        var model: [Int64] = []
        for round in 0..<5_000 {
            if generator.next() % 3 == 0, !model.isEmpty {
                let smallest = model.min()!
                #expect(heap.removeFirst()?.instant == smallest)
                model.remove(at: model.firstIndex(of: smallest)!)
            } else {
                let instant = Int64(generator.next() % 10_000)
                heap.push(instant, "c-\(round)")
                model.append(instant)
            }
            #expect(heap.first?.instant == model.min())
        }
        heap.rebuild(model.shuffled(using: &generator).enumerated().map { ExpiryHeap.Entry(instant: $1, customerId: "r-\($0)") })
        var popped: [Int64] = []
        while let entry = heap.removeFirst() {
            popped.append(entry.instant)
        }
        #expect(popped == model.sorted())
    }
}
