import EntitlementsStore
import Foundation
import Glibc
import Synchronization

/// The durable half of the outbound events: `DATA-DIR/events/outbox`, an append-only file
/// of the derived events (their bodies as sent) and of what became of each delivery, and
/// the in-memory ``EventLedger`` it replays into at opening (docs/events.md, "The outbox").
///
/// It is written without an fsync per event: every event is derived from a write that is
/// in the write-ahead log, and at opening the writes the outbox had not made durable are
/// derived again (``derivedThrough``), with the same ids. It is fsynced every second while
/// it changes, before a compaction removes log records, and when the server stops.
///
/// Each line is `TAG CRC32C PAYLOAD`, the CRC (8 hex digits) over the tag and payload:
/// `H` the header, `E` an event (`LENGTH SUMMARY BODY`: the summary JSON is LENGTH bytes),
/// `S` a delivery's state (JSON), `Q` the log sequence every write up to which was derived,
/// `T` the instant up to which time events were derived.
public final class Outbox: Sendable {
    public static let fileName = "outbox"
    static let tombstoneLimit = 200_000

    struct State {
        var ledger: EventLedger
        var fd: Int32
        /// Bytes in the file.
        var size: UInt64
        /// Bytes of the events still held (their E lines), and each one's.
        var liveBytes: UInt64
        var lineSizes: [String: UInt64]
        var derivedThrough: UInt64
        var timeCursor: Int64
        /// What the file says of them (written at each sync that changes them).
        var writtenDerivedThrough: UInt64 = 0
        var writtenTimeCursor: Int64 = 0
        /// The file's size after the last rewrite (the state lines it keeps are not counted
        /// as live, so a rewrite waits for the file to grow past it).
        var rewrittenSize: UInt64 = 0
        /// Fleet mode: how far this server has read what the others shared and recorded.
        var cursors: (events: Int64, deliveries: Int64) = (0, 0)
        var writtenCursors: (events: Int64, deliveries: Int64) = (0, 0)
        /// Changed since the last fsync.
        var dirty = false
        /// A write to the file failed: nothing more is appended (the log still holds the
        /// writes; a restart derives their events again).
        var failure: String?

        /// The ids of the events forgotten most recently, oldest first (at most
        /// ``tombstoneLimit``): the same event arriving again (another fleet server's copy,
        /// read after this one was delivered) is not taken for a new one.
        var tombstones: Set<String> = []
        var tombstoneOrder: [String] = []

        /// Forgets event `id`.
        mutating func remove(_ id: String, now: Int64) {
            self.ledger.remove(id, now: now)
            self.liveBytes -= min(self.liveBytes, self.lineSizes.removeValue(forKey: id) ?? 0)
            if self.tombstones.insert(id).inserted {
                self.tombstoneOrder.append(id)
                if self.tombstoneOrder.count > Outbox.tombstoneLimit {
                    let old = self.tombstoneOrder.prefix(Outbox.tombstoneLimit / 2)
                    self.tombstones.subtract(old)
                    self.tombstoneOrder.removeFirst(old.count)
                }
            }
        }

        /// Forgets the events delivered to every destination that wanted them.
        mutating func removeDelivered(now: Int64) {
            guard !self.ledger.deliveredEverywhere.isEmpty else {
                return
            }
            for id in self.ledger.deliveredEverywhere {
                self.remove(id, now: now)
            }
            self.ledger.compactOrder()
        }
    }

    public let path: String
    let state: Mutex<State>
    /// Serialises fsyncs and rewrites (never held by a write's commit path).
    private let fileLock = Mutex<Void>(())

    /// What opening found.
    public struct Opened: Sendable {
        /// A torn last line cut off (its event is derived again from the log).
        public var tornBytes: UInt64
        /// Where an outbox of another history (its writes past the store's) was set aside.
        public var setAside: String?
    }

    /// Opens (or creates) the outbox in `directory` and replays it into a ledger for
    /// `destinations`. Events for a destination no longer configured are forgotten for it.
    /// A new outbox (or one whose creation a crash cut short: no `Q` line) starts after log
    /// sequence `startingAfter`: it says so durably before anything else.
    public static func open(directory: String, destinations: [String], policy: EventLedger.RetryPolicy, startingAfter: UInt64 = 0, now: Int64) throws -> (Outbox, Opened) {
        try Self.makeDirectory(directory)
        let path = "\(directory)/\(Self.fileName)"
        var ledger = EventLedger(destinations: destinations, policy: policy)
        var opened = Opened(tornBytes: 0)
        var derivedThrough: UInt64 = 0
        var timeCursor: Int64 = now
        var size: UInt64 = 0
        var lineSizes: [String: UInt64] = [:]
        if access(path, F_OK) != 0, errno == ENOENT {
            // Written whole to a temporary file and renamed: a crash leaves the old state or
            // the new one, never a file that would take every write in the log for new.
            let contents = Self.line("H", Array(#"{"version":1}"#.utf8)) + Self.line("Q", Array(String(startingAfter).utf8)) + Self.line("T", Array(String(now).utf8))
            let temporary = path + ".new"
            let fd = try Self.create(temporary, contents: contents)
            close(fd)
            guard rename(temporary, path) == 0 else {
                throw OutboxError(path: path, reason: "cannot rename the new outbox into place: \(String(cString: strerror(errno)))")
            }
            try Self.syncDirectory(of: path)
        }
        let fd = Glibc.open(path, O_RDWR | O_CLOEXEC)
        guard fd >= 0 else {
            throw OutboxError(path: path, reason: "cannot open: \(String(cString: strerror(errno)))")
        }
        var journal: [JournalLine] = []
        var sawQ = false
        var cursors: (events: Int64, deliveries: Int64) = (0, 0)
        do {
            size = try Self.scan(fd: fd, path: path) { tag, payload, offset, length in
                switch tag {
                case UInt8(ascii: "H"):
                    break
                case UInt8(ascii: "E"):
                    let (summary, body) = try Self.parseEvent(payload, path: path, offset: offset)
                    if ledger.add(summary.event, destinations: summary.destinations, bodyOffset: offset + 11 + UInt64(body.lowerBound), bodyLength: body.count, now: now) {
                        lineSizes[summary.event.id] = UInt64(length)
                    }
                    // What was derived here is said by the Q lines alone: an event's own
                    // sequence may be another server's (fleet mode) or a time event's.
                case UInt8(ascii: "S"):
                    let record = try Self.decode(DeliveryRecord.self, payload, path: path, offset: offset)
                    journal.append(.state(record.id, record.destination, record.delivery))
                case UInt8(ascii: "R"):
                    journal.append(.redeliver(String(decoding: payload, as: UTF8.self)))
                case UInt8(ascii: "X"):
                    journal.append(.drop(String(decoding: payload, as: UTF8.self)))
                case UInt8(ascii: "Q"):
                    sawQ = true
                    derivedThrough = max(derivedThrough, UInt64(String(decoding: payload, as: UTF8.self)) ?? 0)
                case UInt8(ascii: "C"):
                    let parts = String(decoding: payload, as: UTF8.self).split(separator: " ").compactMap { Int64($0) }
                    if parts.count == 2 {
                        cursors = (parts[0], parts[1])
                    }
                case UInt8(ascii: "T"):
                    timeCursor = Int64(String(decoding: payload, as: UTF8.self)) ?? timeCursor
                default:
                    throw OutboxError(path: path, reason: "unknown line type \(UnicodeScalar(tag)) at offset \(offset)")
                }
            } torn: { offset, bytes in
                opened.tornBytes = bytes
                guard ftruncate(fd, off_t(offset)) == 0, fsync(fd) == 0 else {
                    throw OutboxError(path: path, reason: "cannot cut the torn last line at offset \(offset): \(String(cString: strerror(errno)))")
                }
            }
        } catch {
            close(fd)
            throw error
        }
        if sawQ, derivedThrough > startingAfter {
            // The outbox has derived writes the store does not have: the data directory was
            // seeded anew (or a fleet given a new epoch) and its sequences start again.
            // Its events belong to another history: set aside, and a new outbox starts.
            close(fd)
            let aside = "\(path).replaced-\(now)"
            guard rename(path, aside) == 0 else {
                throw OutboxError(path: path, reason: "cannot set the outbox of another history aside: \(String(cString: strerror(errno)))")
            }
            try Self.syncDirectory(of: path)
            var (outbox, reopened) = try Self.open(directory: directory, destinations: destinations, policy: policy, startingAfter: startingAfter, now: now)
            reopened.setAside = aside
            return (outbox, reopened)
        }
        var state = State(ledger: ledger, fd: fd, size: size, liveBytes: lineSizes.values.reduce(0, +), lineSizes: lineSizes, derivedThrough: derivedThrough, timeCursor: timeCursor)
        for line in journal {
            switch line {
            case .state(let id, let destination, let delivery):
                state.ledger.restore(id, destination: destination, delivery: delivery, now: now, replaying: true)
            case .redeliver(let id):
                _ = state.ledger.redeliver(id, now: now)
            case .drop(let id):
                state.remove(id, now: now)
            }
        }
        state.ledger.compactOrder()
        state.writtenDerivedThrough = derivedThrough
        state.writtenTimeCursor = timeCursor
        state.cursors = cursors
        state.writtenCursors = cursors
        if !sawQ {
            // An outbox of an earlier version, or one a crash left before it said where it
            // starts: it starts after the store's last write, said now.
            state.derivedThrough = startingAfter
            Self.write(Self.line("Q", Array(String(startingAfter).utf8)), to: &state)
            state.writtenDerivedThrough = startingAfter
        }
        state.removeDelivered(now: now)
        return (Outbox(path: path, state: state), opened)
    }

    /// What an outbox in `directory` says before the store opens (read without changing
    /// the file): none there, or there and derived up to a sequence (nil when it cannot
    /// say: unreadable, or from before it said).
    public enum Peek: Sendable, Equatable {
        case absent
        case present(derivedThrough: UInt64?)
    }

    public static func peek(directory: String) -> Peek {
        let path = "\(directory)/\(Self.fileName)"
        let fd = Glibc.open(path, O_RDONLY | O_CLOEXEC)
        guard fd >= 0 else {
            return errno == ENOENT ? .absent : .present(derivedThrough: nil)
        }
        defer { close(fd) }
        var derived: UInt64?
        do {
            _ = try Self.scan(fd: fd, path: directory) { tag, payload, _, _ in
                if tag == UInt8(ascii: "Q") {
                    derived = max(derived ?? 0, UInt64(String(decoding: payload, as: UTF8.self)) ?? 0)
                }
            } torn: { _, _ in }
        } catch {
            return .present(derivedThrough: nil)
        }
        return .present(derivedThrough: derived)
    }

    private init(path: String, state: State) {
        self.path = path
        self.state = Mutex(state)
    }

    deinit {
        self.state.withLock { close($0.fd) }
    }

    // MARK: The file format

    struct StoredSummary: Codable {
        var event: EventSummary
        var destinations: [String]
    }

    /// What a journal line says, replayed in file order at opening.
    enum JournalLine {
        case state(String, String, EventLedger.Delivery)
        case redeliver(String)
        case drop(String)
    }

    /// A delivery's state as journalled.
    struct DeliveryRecord: Codable {
        var id: String
        var destination: String
        var status: EventLedger.Status
        var attempts: Int
        var first: Int64?
        var last: Int64?
        var next: Int64?
        var result: String?

        init(id: String, destination: String, delivery: EventLedger.Delivery) {
            self.id = id
            self.destination = destination
            self.status = delivery.status
            self.attempts = delivery.attempts
            self.first = delivery.firstAttemptAt
            self.last = delivery.lastAttemptAt
            self.next = delivery.nextAttemptAt
            self.result = delivery.lastResult
        }

        var delivery: EventLedger.Delivery {
            EventLedger.Delivery(status: self.status, attempts: self.attempts, firstAttemptAt: self.first, lastAttemptAt: self.last, nextAttemptAt: self.next, lastResult: self.result)
        }
    }

    static func line(_ tag: Character, _ payload: [UInt8]) -> [UInt8] {
        var checked = [tag.asciiValue!]
        checked.append(contentsOf: payload)
        let crc = CRC32C.checksum(checked)
        var digits = Array(String(crc, radix: 16).utf8)
        digits = Array(repeating: UInt8(ascii: "0"), count: 8 - digits.count) + digits
        return [tag.asciiValue!, UInt8(ascii: " ")] + digits + [UInt8(ascii: " ")] + payload + [UInt8(ascii: "\n")]
    }

    static func eventLine(_ event: SharedEvent) -> (line: [UInt8], bodyStart: Int, bodyLength: Int) {
        let summary = (try? JSONEncoder().encode(StoredSummary(event: event.summary, destinations: event.destinations))).map { Array($0) } ?? []
        let body = event.body
        var payload = Array("\(summary.count) ".utf8)
        payload += summary
        let bodyStart = 11 + payload.count  // "E " + 8 + " " before the payload
        payload += body
        return (Self.line("E", payload), bodyStart, body.count)
    }

    /// Splits an E payload: its summary and the range of its body within the payload.
    static func parseEvent(_ payload: ArraySlice<UInt8>, path: String, offset: UInt64) throws -> (StoredSummary, Range<Int>) {
        guard let space = payload.firstIndex(of: UInt8(ascii: " ")), let length = Int(String(decoding: payload[payload.startIndex..<space], as: UTF8.self)),
            length >= 0, space + 1 + length <= payload.endIndex
        else {
            throw OutboxError(path: path, reason: "an event line at offset \(offset) has no summary length")
        }
        let summary = try Self.decode(StoredSummary.self, payload[(space + 1)..<(space + 1 + length)], path: path, offset: offset)
        let bodyStart = space + 1 + length - payload.startIndex
        return (summary, bodyStart..<(payload.count))
    }

    static func decode<T: Decodable>(_ type: T.Type, _ bytes: ArraySlice<UInt8>, path: String, offset: UInt64) throws -> T {
        do {
            return try JSONDecoder().decode(T.self, from: Data(bytes))
        } catch {
            throw OutboxError(path: path, reason: "the line at offset \(offset) does not decode: \(error)")
        }
    }

    /// Reads every line of the file, calling `visit` with each whole, checked one (its tag,
    /// payload, offset and length). A last line cut short (no newline, or a bad checksum
    /// with nothing after it) goes to `torn`; a bad line before the end is corruption.
    static func scan(
        fd: Int32,
        path: String,
        visit: (UInt8, ArraySlice<UInt8>, UInt64, Int) throws -> Void,
        torn: (UInt64, UInt64) throws -> Void
    ) throws -> UInt64 {
        var buffer: [UInt8] = []
        var bufferStart: UInt64 = 0  // file offset of buffer[0]
        var fileOffset: UInt64 = 0
        var chunk = [UInt8](repeating: 0, count: 1 << 20)
        var atEnd = false
        var position = 0
        // The first line that failed its checksum: the tail from it is torn (a crash while
        // appending) if no valid line follows, else the file is damaged.
        var firstBad: UInt64?
        while true {
            if let newline = buffer[position...].firstIndex(of: UInt8(ascii: "\n")) {
                let line = buffer[position..<newline]
                let offset = bufferStart + UInt64(position)
                let length = newline + 1 - position
                position = newline + 1
                guard let (tag, payload) = Self.checked(line) else {
                    firstBad = firstBad ?? offset
                    continue
                }
                if let bad = firstBad {
                    throw OutboxError(
                        path: path,
                        reason: "the line at offset \(bad) fails its checksum and valid lines follow it: the file is damaged; move it aside to start a new outbox (its undelivered events are then not sent: `entitlements events list` on the old server shows them)"
                    )
                }
                try visit(tag, payload, offset, length)
                continue
            }
            if atEnd {
                let end = bufferStart + UInt64(buffer.count)
                if let bad = firstBad ?? (position < buffer.count ? bufferStart + UInt64(position) : nil) {
                    try torn(bad, end - bad)
                    return bad
                }
                return end
            }
            buffer.removeFirst(position)
            bufferStart += UInt64(position)
            position = 0
            let count = chunk.withUnsafeMutableBytes { pread(fd, $0.baseAddress, $0.count, off_t(fileOffset)) }
            guard count >= 0 else {
                throw OutboxError(path: path, reason: "cannot read: \(String(cString: strerror(errno)))")
            }
            if count == 0 {
                atEnd = true
            } else {
                buffer += chunk[0..<count]
                fileOffset += UInt64(count)
            }
        }
    }

    /// A line's tag and payload if its checksum holds.
    static func checked(_ line: ArraySlice<UInt8>) -> (UInt8, ArraySlice<UInt8>)? {
        let start = line.startIndex
        guard line.count >= 11, line[start + 1] == UInt8(ascii: " "), line[start + 10] == UInt8(ascii: " "),
            let stored = UInt32(String(decoding: line[(start + 2)..<(start + 10)], as: UTF8.self), radix: 16)
        else {
            return nil
        }
        let payload = line[(start + 11)...]
        var crc = CRC32C.checksum([line[start]])
        crc = CRC32C.checksum(payload, continuing: crc)
        return crc == stored ? (line[start], payload) : nil
    }

    // MARK: Changes

    /// Appends `events` (each to `destinations(event)`) and notes that every write up to
    /// `through` was derived. Events already held (derived again) are skipped. Returns the
    /// events added.
    @discardableResult
    public func append(_ events: [OutboundEvent], destinations: (OutboundEvent) -> [String], through: UInt64?, now: Int64) -> [SharedEvent] {
        let shared = events.map { SharedEvent(summary: $0.summary, destinations: destinations($0), body: $0.body) }.filter { !$0.destinations.isEmpty }
        return self.append(shared, through: through, now: now)
    }

    /// Appends events as kept (derived here, or by another server of a fleet); those held
    /// already are skipped. Returns those added.
    @discardableResult
    public func append(_ events: [SharedEvent], through: UInt64? = nil, now: Int64) -> [SharedEvent] {
        self.state.withLock { state in
            if let through {
                state.derivedThrough = max(state.derivedThrough, through)
            }
            guard state.failure == nil else {
                return []
            }
            var added: [SharedEvent] = []
            var bytes: [UInt8] = []
            for event in events where state.ledger.entries[event.summary.id] == nil && !state.tombstones.contains(event.summary.id) {
                let (line, bodyStart, bodyLength) = Self.eventLine(event)
                let offset = state.size + UInt64(bytes.count)
                guard state.ledger.add(event.summary, destinations: event.destinations, bodyOffset: offset + UInt64(bodyStart), bodyLength: bodyLength, now: now) else {
                    continue
                }
                state.liveBytes += UInt64(line.count)
                state.lineSizes[event.summary.id] = UInt64(line.count)
                bytes += line
                added.append(event)
            }
            Self.write(bytes, to: &state)
            return added
        }
    }

    /// Journals a delivery's new state and applies it to the ledger through `change`.
    public func record(_ id: String, destination: String, _ change: (inout EventLedger) -> EventLedger.Delivery?) -> EventLedger.Delivery? {
        self.state.withLock { state in
            guard let delivery = change(&state.ledger) else {
                return nil
            }
            if let payload = try? JSONEncoder().encode(DeliveryRecord(id: id, destination: destination, delivery: delivery)) {
                Self.write(Self.line("S", Array(payload)), to: &state)
            }
            return delivery
        }
    }

    /// Sends event `id` again (``EventLedger/redeliver(_:now:)``), journalled; returns the
    /// destinations it goes to again, or nil if it is not held.
    public func redeliver(_ id: String, now: Int64) -> [String]? {
        self.state.withLock { state in
            guard state.ledger.redeliver(id, now: now) else {
                return nil
            }
            Self.write(Self.line("R", Array(id.utf8)), to: &state)
            return state.ledger.entries[id]?.destinations ?? []
        }
    }

    /// Reads and changes the ledger (no journal line: for what is not persisted).
    public func withLedger<T>(_ body: (inout EventLedger) -> T) -> T {
        self.state.withLock { body(&$0.ledger) }
    }

    /// Notes that time events were derived up to `instant`.
    /// Noted in the file at the next sync that has other changes to make durable, or a
    /// minute later: a time event derived since the last noted instant makes the outbox
    /// change, so what it says is never past what is derived.
    public func timeDerived(through instant: Int64) {
        self.state.withLock { state in
            state.timeCursor = max(state.timeCursor, instant)
        }
    }

    public var timeCursor: Int64 { self.state.withLock { $0.timeCursor } }

    /// Fleet mode: how far this server has read the events and the delivery states the
    /// others shared (kept at each sync, so that a restart reads on from there).
    public var coordinationCursors: (events: Int64, deliveries: Int64) {
        get { self.state.withLock { $0.cursors } }
        set { self.state.withLock { $0.cursors = newValue } }
    }

    /// Whether event `id` was held and forgotten lately (delivered, or dropped).
    public func isForgotten(_ id: String) -> Bool {
        self.state.withLock { $0.tombstones.contains(id) }
    }
    public var derivedThrough: UInt64 { self.state.withLock { $0.derivedThrough } }
    public var failure: String? { self.state.withLock { $0.failure } }
    /// Bytes in the file, and bytes of the events it still holds.
    public var sizes: (file: UInt64, live: UInt64) { self.state.withLock { ($0.size, $0.liveBytes) } }

    private static func write(_ bytes: [UInt8], to state: inout State) {
        guard !bytes.isEmpty, state.failure == nil else {
            return
        }
        var written = 0
        while written < bytes.count {
            let count = bytes.withUnsafeBytes { pwrite(state.fd, $0.baseAddress! + written, $0.count - written, off_t(state.size) + off_t(written)) }
            if count < 0 {
                if errno == EINTR { continue }
                state.failure = "cannot write \(bytes.count) bytes at offset \(state.size): \(String(cString: strerror(errno)))"
                return
            }
            written += count
        }
        state.size += UInt64(bytes.count)
        state.dirty = true
    }

    /// The body of held event `id`, as sent: read where the event is now (a rewrite of
    /// the file moves it).
    public func body(of id: String) throws -> [UInt8] {
        try self.state.withLock { state in
            guard let entry = state.ledger.entries[id] else {
                throw OutboxError(path: self.path, reason: "event \(id) is not held any more")
            }
            var body = [UInt8](repeating: 0, count: entry.bodyLength)
            let count = body.withUnsafeMutableBytes { pread(state.fd, $0.baseAddress, $0.count, off_t(entry.bodyOffset)) }
            guard count == entry.bodyLength else {
                throw OutboxError(path: self.path, reason: "cannot read event \(entry.summary.id)'s body at offset \(entry.bodyOffset)")
            }
            return body
        }
    }

    /// Makes every change so far durable (with `through`: after noting that every write
    /// up to it was derived). Throws if the file cannot be written.
    public func sync(through: UInt64? = nil) throws {
        try self.fileLock.withLock { _ in
            let (fd, dirty, failure) = self.state.withLock { state -> (Int32, Bool, String?) in
                if let through, through > state.derivedThrough {
                    state.derivedThrough = through
                }
                if state.derivedThrough != state.writtenDerivedThrough {
                    Self.write(Self.line("Q", Array(String(state.derivedThrough).utf8)), to: &state)
                    state.writtenDerivedThrough = state.derivedThrough
                }
                if state.cursors != state.writtenCursors {
                    Self.write(Self.line("C", Array("\(state.cursors.events) \(state.cursors.deliveries)".utf8)), to: &state)
                    state.writtenCursors = state.cursors
                }
                if state.timeCursor != state.writtenTimeCursor, state.dirty || state.timeCursor - state.writtenTimeCursor >= 60_000 {
                    Self.write(Self.line("T", Array(String(state.timeCursor).utf8)), to: &state)
                    state.writtenTimeCursor = state.timeCursor
                }
                let dirty = state.dirty
                state.dirty = false
                return (state.fd, dirty, state.failure)
            }
            if let failure {
                throw OutboxError(path: self.path, reason: failure)
            }
            guard dirty else { return }
            guard fdatasync(fd) == 0 else {
                let reason = "fsync failed: \(String(cString: strerror(errno)))"
                self.state.withLock { $0.failure = reason }
                throw OutboxError(path: self.path, reason: reason)
            }
        }
    }

    /// Forgets the events delivered everywhere and, once the file is more than twice what
    /// it still holds (and over `minimumBytes`), rewrites it with only those. Returns whether
    /// it rewrote.
    @discardableResult
    public func compact(now: Int64, minimumBytes: UInt64 = 1 << 20) throws -> Bool {
        try self.fileLock.withLock { _ in
            try self.state.withLock { state in
                state.removeDelivered(now: now)
                guard state.failure == nil, state.size > minimumBytes, state.size > 2 * state.liveBytes, state.size > state.rewrittenSize + minimumBytes / 2 else {
                    return false
                }
                try self.rewrite(&state)
                return true
            }
        }
    }

    /// Drops the oldest held events until the live bytes are under `limit`: each given up
    /// for its destinations (journalled). Returns the ids dropped.
    public func enforce(limit: UInt64, now: Int64) -> [String] {
        self.state.withLock { state in
            var dropped: [String] = []
            guard state.liveBytes > limit else {
                return []
            }
            for entry in state.ledger.ordered {
                guard state.liveBytes > limit else { break }
                Self.write(Self.line("X", Array(entry.summary.id.utf8)), to: &state)
                state.remove(entry.summary.id, now: now)
                dropped.append(entry.summary.id)
            }
            state.ledger.compactOrder()
            return dropped
        }
    }

    /// Writes the held events (and their deliveries' states) to a new file and swaps it in.
    private func rewrite(_ state: inout State) throws {
        let temporary = self.path + ".tmp"
        var bytes = Self.line("H", Array(#"{"version":1}"#.utf8))
        bytes += Self.line("Q", Array(String(state.derivedThrough).utf8))
        bytes += Self.line("T", Array(String(state.timeCursor).utf8))
        bytes += Self.line("C", Array("\(state.cursors.events) \(state.cursors.deliveries)".utf8))
        var offsets: [(String, UInt64)] = []
        var live: UInt64 = 0
        var sizes: [String: UInt64] = [:]
        for entry in state.ledger.ordered {
            var body = [UInt8](repeating: 0, count: entry.bodyLength)
            let count = body.withUnsafeMutableBytes { pread(state.fd, $0.baseAddress, $0.count, off_t(entry.bodyOffset)) }
            guard count == entry.bodyLength else {
                throw OutboxError(path: self.path, reason: "cannot read event \(entry.summary.id) to rewrite the outbox")
            }
            let (line, bodyStart, _) = Self.eventLine(SharedEvent(summary: entry.summary, destinations: entry.destinations, body: body))
            offsets.append((entry.summary.id, UInt64(bytes.count + bodyStart)))
            live += UInt64(line.count)
            sizes[entry.summary.id] = UInt64(line.count)
            bytes += line
            for destination in entry.destinations {
                guard let delivery = entry.deliveries[destination], delivery.attempts > 0 || delivery.status != .pending else { continue }
                bytes += Self.line("S", Array(try JSONEncoder().encode(DeliveryRecord(id: entry.summary.id, destination: destination, delivery: delivery))))
            }
        }
        let fd = try Self.create(temporary, contents: bytes)
        guard rename(temporary, self.path) == 0 else {
            close(fd)
            unlink(temporary)
            throw OutboxError(path: self.path, reason: "cannot rename the rewritten outbox into place: \(String(cString: strerror(errno)))")
        }
        try Self.syncDirectory(of: self.path)
        close(state.fd)
        state.fd = fd
        state.size = UInt64(bytes.count)
        state.liveBytes = live
        state.lineSizes = sizes
        state.rewrittenSize = UInt64(bytes.count)
        state.writtenDerivedThrough = state.derivedThrough
        state.writtenTimeCursor = state.timeCursor
        state.dirty = false
        for (id, offset) in offsets {
            state.ledger.moveBody(id, to: offset)
        }
    }

    // MARK: Files

    /// Creates `path` (replacing a leftover) with `contents`, fsynced, and returns it open
    /// for reading and writing.
    static func create(_ path: String, contents: [UInt8]) throws -> Int32 {
        let fd = Glibc.open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0o644)
        guard fd >= 0 else {
            throw OutboxError(path: path, reason: "cannot create: \(String(cString: strerror(errno)))")
        }
        var written = 0
        while written < contents.count {
            let count = contents.withUnsafeBytes { pwrite(fd, $0.baseAddress! + written, $0.count - written, off_t(written)) }
            guard count > 0 else {
                if count < 0, errno == EINTR { continue }
                close(fd)
                throw OutboxError(path: path, reason: "cannot write: \(String(cString: strerror(errno)))")
            }
            written += count
        }
        guard fsync(fd) == 0 else {
            close(fd)
            throw OutboxError(path: path, reason: "cannot fsync: \(String(cString: strerror(errno)))")
        }
        try Self.syncDirectory(of: path)
        return fd
    }

    /// Creates `directory` (and its parent, a data directory not created yet), each fsynced
    /// into its own parent.
    static func makeDirectory(_ directory: String) throws {
        if let slash = directory.lastIndex(of: "/"), slash != directory.startIndex {
            let parent = String(directory[..<slash])
            if access(parent, F_OK) != 0 {
                try Self.makeDirectory(parent)
            }
        }
        if mkdir(directory, 0o755) == 0 {
            try Self.syncDirectory(of: directory)
        } else if errno != EEXIST {
            throw OutboxError(path: directory, reason: "cannot create the events directory: \(String(cString: strerror(errno)))")
        }
    }

    static func syncDirectory(of path: String) throws {
        let directory = path.contains("/") ? String(path[..<path.lastIndex(of: "/")!]) : "."
        let fd = Glibc.open(directory.isEmpty ? "/" : directory, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else {
            throw OutboxError(path: directory, reason: "cannot open the directory to fsync it: \(String(cString: strerror(errno)))")
        }
        defer { close(fd) }
        guard fsync(fd) == 0 else {
            throw OutboxError(path: directory, reason: "cannot fsync the directory: \(String(cString: strerror(errno)))")
        }
    }
}

/// The outbox cannot be read or written: the file and what is wrong.
public struct OutboxError: Error, CustomStringConvertible {
    public var path: String
    public var reason: String
    public var description: String { "\(self.path): \(self.reason)" }
}
