import EntitlementsEvents
import EntitlementsMessages
import Foundation
import Testing

/// The outbox file: what survives a reopening, a torn last line, damage, a rewrite and the
/// size limit.
@Suite("outbound events: the outbox file")
struct OutboxTests {
    final class Scratch: Sendable {
        let path = FileManager.default.temporaryDirectory.appendingPathComponent("outbox-tests-\(UUID().uuidString)").path
        var events: String { self.path + "/events" }
        var file: String { self.events + "/outbox" }
        deinit { try? FileManager.default.removeItem(atPath: self.path) }
    }

    static func event(_ sequence: UInt64, _ customer: String, padding: Int = 0) -> OutboundEvent {
        OutboundEvent(id: "evt_\(sequence)_0", type: .grant, customerId: customer, occurredAt: 1_000 + Int64(sequence), logSequence: sequence,
                      store: .manual, grantId: String(repeating: "g", count: padding + 1))
    }

    /// Opens the outbox as a store at log sequence `sequence` would.
    static func open(_ scratch: Scratch, destinations: [String] = ["d"], at sequence: UInt64 = 0) throws -> Outbox {
        try Outbox.open(directory: scratch.events, destinations: destinations, policy: .init(), startingAfter: sequence, now: 5_000).0
    }

    @Test("events, their bodies and their deliveries' states survive a reopening; delivered ones are dropped")
    func reopen() throws {
        let scratch = Scratch()
        do {
            let outbox = try Self.open(scratch)
            outbox.append([Self.event(1, "a"), Self.event(2, "b"), Self.event(3, "a")], destinations: { _ in ["d"] }, through: 3, now: 0)
            _ = outbox.withLedger { $0.due(for: "d", now: 0, limit: 10) }
            _ = outbox.record("evt_1_0", destination: "d") { $0.attempted("evt_1_0", destination: "d", delivered: true, result: "HTTP 200", now: 0) }
            _ = outbox.record("evt_2_0", destination: "d") { $0.attempted("evt_2_0", destination: "d", delivered: false, result: "HTTP 500", now: 0) }
            try outbox.sync()
        }
        let outbox = try Self.open(scratch, at: 3)
        #expect(outbox.derivedThrough == 3)
        let held = outbox.withLedger { $0.ordered }
        #expect(held.map(\.summary.id) == ["evt_2_0", "evt_3_0"])
        #expect(held.first?.deliveries["d"]?.status == .retrying && held.first?.deliveries["d"]?.attempts == 1)
        #expect(try outbox.body(of: held[1].summary.id) == Self.event(3, "a").body)
        // Appending an event already held (derived again after a crash) changes nothing.
        #expect(outbox.append([Self.event(3, "a")], destinations: { _ in ["d"] }, through: nil, now: 0).isEmpty)
    }

    @Test("a torn last line is cut off; a damaged line with more after it refuses to open, naming its offset")
    func tornAndDamaged() throws {
        let scratch = Scratch()
        do {
            let outbox = try Self.open(scratch)
            outbox.append([Self.event(1, "a"), Self.event(2, "a")], destinations: { _ in ["d"] }, through: 2, now: 0)
            try outbox.sync()
        }
        let whole = try Data(contentsOf: URL(fileURLWithPath: scratch.file))
        // Cut in the middle of the last event's line (a crash while appending it).
        let lastEvent = try #require(whole.indices.last { whole[$0] == UInt8(ascii: "E") && (($0 == 0) || whole[$0 - 1] == UInt8(ascii: "\n")) })
        try whole.prefix(lastEvent + 40).write(to: URL(fileURLWithPath: scratch.file))
        do {
            let (outbox, opened) = try Outbox.open(directory: scratch.events, destinations: ["d"], policy: .init(), startingAfter: 2, now: 0)
            #expect(opened.tornBytes > 0)
            #expect(outbox.withLedger { $0.ordered.map(\.summary.id) } == ["evt_1_0"], "the torn event is derived again from the log")
        }
        var damaged = whole
        let middle = damaged.count / 2
        damaged[middle] ^= 0x01
        try damaged.write(to: URL(fileURLWithPath: scratch.file))
        #expect {
            _ = try Self.open(scratch, at: 2)
        } throws: { error in
            "\(error)".contains("fails its checksum and valid lines follow it") && "\(error)".contains("move it aside")
        }
    }

    @Test("a damaged last line (newline and all) is torn too; a time event's sequence does not count as derived")
    func damagedLastLine() throws {
        let scratch = Scratch()
        do {
            let outbox = try Self.open(scratch)
            var time = Self.event(9, "a")
            time.id = "evt_t5000_0123456789abcdef_0"
            outbox.append([Self.event(1, "a"), time], destinations: { _ in ["d"] }, through: nil, now: 0)
        }
        var bytes = try Data(contentsOf: URL(fileURLWithPath: scratch.file))
        bytes[bytes.count - 5] ^= 0x01  // inside the last line, before its newline
        try bytes.write(to: URL(fileURLWithPath: scratch.file))
        let (outbox, opened) = try Outbox.open(directory: scratch.events, destinations: ["d"], policy: .init(), now: 0)
        #expect(opened.tornBytes > 0)
        #expect(outbox.withLedger { $0.ordered.map(\.summary.id) } == ["evt_1_0"])
        let again = try Outbox.open(directory: scratch.events + "-other", destinations: ["d"], policy: .init(), startingAfter: 7, now: 0).0
        #expect(again.derivedThrough == 7, "a new outbox starts after the given sequence")
        #expect(outbox.derivedThrough == 0, "only Q lines say what was derived: not the write event at 1 (no Q after it), nor the time event at 9")
    }

    @Test("a redelivery and a drop are journalled: after reopening, the redelivered event waits again and the dropped one is gone")
    func journal() throws {
        let scratch = Scratch()
        do {
            let outbox = try Self.open(scratch)
            outbox.append([Self.event(1, "a"), Self.event(2, "b"), Self.event(3, "c")], destinations: { _ in ["d"] }, through: 3, now: 0)
            _ = outbox.withLedger { $0.due(for: "d", now: 0, limit: 10) }
            _ = outbox.record("evt_1_0", destination: "d") { $0.attempted("evt_1_0", destination: "d", delivered: false, result: "HTTP 500", now: 0) }
            _ = outbox.record("evt_2_0", destination: "d") { $0.attempted("evt_2_0", destination: "d", delivered: false, result: "HTTP 500", now: 0) }
            #expect(outbox.redeliver("evt_1_0", now: 1) == ["d"])
            #expect(outbox.enforce(limit: outbox.sizes.live - 1, now: 0) == ["evt_1_0"])
            try outbox.sync()
        }
        let outbox = try Self.open(scratch, at: 3)
        let held = outbox.withLedger { $0.ordered.map(\.summary.id) }
        #expect(held == ["evt_2_0", "evt_3_0"], "the dropped event stays dropped")
        #expect(outbox.withLedger { $0.entries["evt_2_0"]?.deliveries["d"]?.status } == .retrying)
    }

    @Test("a rewrite keeps the undelivered events with their bodies, and the file shrinks")
    func rewrite() throws {
        let scratch = Scratch()
        let outbox = try Self.open(scratch)
        let events = (1...200).map { Self.event(UInt64($0), "c\($0 % 7)", padding: 10_000) }
        outbox.append(events, destinations: { _ in ["d"] }, through: 200, now: 0)
        for _ in 0..<30 {
            for entry in outbox.withLedger({ $0.due(for: "d", now: 0, limit: 100) }) where entry.summary.logSequence <= 190 {
                _ = outbox.record(entry.summary.id, destination: "d") { $0.attempted(entry.summary.id, destination: "d", delivered: true, result: "HTTP 200", now: 0) }
            }
        }
        let before = outbox.sizes.file
        #expect(try outbox.compact(now: 0))
        #expect(outbox.sizes.file < before / 5)
        let held = outbox.withLedger { $0.ordered }
        #expect(held.map(\.summary.logSequence) == Array(191...200))
        for entry in held {
            #expect(try outbox.body(of: entry.summary.id) == events[Int(entry.summary.logSequence) - 1].body)
        }
        let reopened = try Self.open(scratch, at: 200)
        #expect(reopened.withLedger { $0.ordered.count } == 10 && reopened.derivedThrough == 200)
        // Opened by a store whose history is shorter (seeded anew): set aside, a new one starts.
        let (fresh, opened) = try Outbox.open(directory: scratch.events, destinations: ["d"], policy: .init(), startingAfter: 5, now: 0)
        #expect(opened.setAside != nil && fresh.withLedger { $0.ordered.isEmpty } && fresh.derivedThrough == 5)
    }

    @Test("past the limit the oldest undelivered events are dropped, given up")
    func limit() throws {
        let scratch = Scratch()
        let outbox = try Self.open(scratch)
        outbox.append((1...10).map { Self.event(UInt64($0), "c", padding: 1_000) }, destinations: { _ in ["d"] }, through: 10, now: 0)
        let dropped = outbox.enforce(limit: outbox.sizes.live * 6 / 10, now: 0)
        #expect(dropped.count == 5 && dropped.first == "evt_1_0")
        #expect(outbox.withLedger { $0.ordered.first?.summary.id } == "evt_6_0")
        #expect(outbox.withLedger { $0.due(for: "d", now: 0, limit: 5).map(\.summary.id) } == ["evt_6_0"])
    }
}
