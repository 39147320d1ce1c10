import EntitlementsEvents
import Testing

/// The delivery rules without a network: what is sent when, per destination and customer.
@Suite("outbound events: the delivery ledger")
struct EventLedgerTests {
    static func summary(_ id: String, _ customer: String, at instant: Int64 = 0) -> EventSummary {
        EventSummary(id: id, type: "GRANT", customerId: customer, environment: nil, logSequence: 1, occurredAt: instant)
    }

    static func ledger(_ destinations: [String] = ["d"], policy: EventLedger.RetryPolicy = .init()) -> EventLedger {
        EventLedger(destinations: destinations, policy: policy)
    }

    @Test("a customer's events go one at a time, in order; a failing customer holds up only its own")
    func perCustomerOrder() {
        var ledger = Self.ledger()
        for (id, customer) in [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b")] {
            ledger.add(Self.summary(id, customer), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 0)
        }
        #expect(ledger.due(for: "d", now: 0, limit: 10).map(\.summary.id).sorted() == ["a1", "b1"])
        #expect(ledger.due(for: "d", now: 0, limit: 10).isEmpty, "in flight: nothing more for these customers")
        ledger.attempted("a1", destination: "d", delivered: false, result: "HTTP 500", now: 0)
        ledger.attempted("b1", destination: "d", delivered: true, result: "HTTP 200", now: 0)
        #expect(ledger.due(for: "d", now: 0, limit: 10).map(\.summary.id) == ["b2"], "b goes on while a waits for its retry")
        #expect(ledger.due(for: "d", now: 999, limit: 10).isEmpty)
        #expect(ledger.due(for: "d", now: 1_000, limit: 10).map(\.summary.id) == ["a1"], "a's first event again, not its second")
        ledger.attempted("a1", destination: "d", delivered: true, result: "HTTP 200", now: 1_000)
        #expect(ledger.due(for: "d", now: 1_000, limit: 10).map(\.summary.id) == ["a2"])
    }

    @Test("retries start after 1 s and double up to the maximum; past the horizon the event is given up and the next goes")
    func backoffAndHorizon() {
        let policy = EventLedger.RetryPolicy(initialInterval: 1_000, maxInterval: 8_000, horizon: 30_000)
        #expect((1...6).map { policy.interval(afterFailures: $0) } == [1_000, 2_000, 4_000, 8_000, 8_000, 8_000])
        var ledger = Self.ledger(policy: policy)
        ledger.add(Self.summary("e1", "c"), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 0)
        ledger.add(Self.summary("e2", "c"), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 0)
        var now: Int64 = 0
        var attempts: [Int64] = []
        while let entry = ledger.due(for: "d", now: now, limit: 1).first, entry.summary.id == "e1" {
            attempts.append(now)
            let delivery = ledger.attempted("e1", destination: "d", delivered: false, result: "timeout", now: now)
            guard let next = delivery?.nextAttemptAt else {
                #expect(delivery?.status == .givenUp)
                break
            }
            now = next
        }
        #expect(attempts == [0, 1_000, 3_000, 7_000, 15_000, 23_000])
        #expect(ledger.due(for: "d", now: now, limit: 1).map(\.summary.id) == ["e2"], "the customer's next event goes once e1 is given up")
    }

    @Test("each destination keeps its own state; a 410 stops one and not the other")
    func destinations() {
        var ledger = Self.ledger(["x", "y"])
        ledger.add(Self.summary("e1", "c"), destinations: ["x", "y", "removed"], bodyOffset: 0, bodyLength: 0, now: 0)
        #expect(ledger.entries["e1"]?.destinations == ["x", "y"], "a destination no longer configured is dropped")
        _ = ledger.due(for: "x", now: 0, limit: 5)
        ledger.disable("x", reason: "410")
        ledger.attempted("e1", destination: "x", delivered: false, result: "HTTP 410", now: 0)
        #expect(ledger.due(for: "x", now: 10_000, limit: 5).isEmpty && ledger.disabledReason("x") == "410")
        #expect(ledger.due(for: "y", now: 0, limit: 5).map(\.summary.id) == ["e1"])
        #expect(ledger.unsettledCount("x") == 1 && ledger.unsettledCount("y") == 1)
    }

    @Test("an event dropped while it is being sent lets its customer's next one go")
    func removeInFlight() {
        var ledger = Self.ledger()
        ledger.add(Self.summary("e1", "c"), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 0)
        ledger.add(Self.summary("e2", "c"), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 0)
        #expect(ledger.due(for: "d", now: 0, limit: 5).map(\.summary.id) == ["e1"])
        ledger.remove("e1", now: 0)
        #expect(ledger.attempted("e1", destination: "d", delivered: true, result: "HTTP 200", now: 0) == nil, "its outcome changes nothing")
        #expect(ledger.due(for: "d", now: 0, limit: 5).map(\.summary.id) == ["e2"])
    }

    @Test("redeliver: a retrying event goes at once; a delivered one is queued again behind the customer's others")
    func redeliver() {
        var ledger = Self.ledger()
        ledger.add(Self.summary("e1", "c"), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 0)
        _ = ledger.due(for: "d", now: 0, limit: 1)
        ledger.attempted("e1", destination: "d", delivered: false, result: "HTTP 500", now: 0)
        let held = ledger.redeliver("e1", now: 10)
        #expect(held)
        #expect(ledger.due(for: "d", now: 10, limit: 1).map(\.summary.id) == ["e1"])
        ledger.attempted("e1", destination: "d", delivered: true, result: "HTTP 200", now: 10)
        ledger.add(Self.summary("e2", "c"), destinations: ["d"], bodyOffset: 0, bodyLength: 0, now: 20)
        let again = ledger.redeliver("e1", now: 20)
        #expect(again)
        #expect(ledger.due(for: "d", now: 20, limit: 5).map(\.summary.id) == ["e2"])
        ledger.attempted("e2", destination: "d", delivered: true, result: "HTTP 200", now: 20)
        #expect(ledger.due(for: "d", now: 20, limit: 5).map(\.summary.id) == ["e1"])
        let unknown = ledger.redeliver("unknown", now: 20)
        #expect(!unknown)
    }
}
