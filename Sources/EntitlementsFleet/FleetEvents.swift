public import EntitlementsEvents
import Foundation
import Logging
import NIOCore
import PostgresNIO

/// Outbound events in fleet mode (docs/events.md, "Fleet mode"), on the tables of schema
/// migration 3: `event_lease` (one row: who delivers, until when), `events` (every event
/// any server derived, by id) and `event_deliveries` (each delivery's newest state).
///
/// A lease is a row with an expiry, taken by an `INSERT ... ON CONFLICT DO UPDATE ... WHERE`
/// that succeeds only for its holder or once it has expired: no advisory lock outlives a
/// connection, and nothing depends on PostgreSQL's session state (so the same statements
/// work on a PostgreSQL-compatible distributed engine). Writes to `events` and
/// `event_deliveries` take one advisory transaction lock, so that their numbers
/// (`seq`, `changed`, from one sequence) become visible in order and a reader that
/// remembers the last number it read misses none.
public final class FleetEvents: EventCoordinator {
    let database: FleetDatabase
    /// The key of the lock that orders the tables' numbers ("EVNT").
    static let orderLock: Int64 = 0x4556_4E54

    public init(database: FleetDatabase) {
        self.database = database
    }

    public func lease(holder: String, for duration: Duration) async throws -> Bool {
        let milliseconds = duration.components.seconds * 1000 + duration.components.attoseconds / 1_000_000_000_000_000
        return try await self.run("take the events lease") { connection, logger in
            let rows = try await connection.query(
                """
                INSERT INTO event_lease (name, holder, expires_at) VALUES ('events', \(holder), now() + \(milliseconds) * interval '1 millisecond')
                ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
                WHERE event_lease.holder = EXCLUDED.holder OR event_lease.expires_at < now()
                RETURNING holder
                """,
                logger: logger
            )
            var held = false
            for try await _ in rows.decode(String.self) {
                held = true
            }
            return held
        }
    }

    public func release(holder: String) async throws {
        try await self.run("give the events lease up") { connection, logger in
            try await connection.query("DELETE FROM event_lease WHERE name = 'events' AND holder = \(holder)", logger: logger)
        }
    }

    /// What `events.summary` holds: the event's summary and the destinations that want it.
    struct StoredSummary: Codable {
        var event: EventSummary
        var destinations: [String]
    }

    public func share(_ events: [SharedEvent]) async throws {
        guard !events.isEmpty else { return }
        let encoder = JSONEncoder()
        let ids = events.map(\.summary.id)
        let summaries = try events.map { String(decoding: try encoder.encode(StoredSummary(event: $0.summary, destinations: $0.destinations)), as: UTF8.self) }
        let bodies = events.map { ByteBuffer(bytes: $0.body) }
        try await self.transaction("share events") { connection, logger in
            try await connection.query(
                """
                INSERT INTO events (event_id, summary, body)
                SELECT * FROM unnest(\(ids)::text[], \(summaries)::text[], \(bodies)::bytea[])
                ON CONFLICT (event_id) DO NOTHING
                """,
                logger: logger
            )
        }
    }

    public func events(after cursor: Int64, limit: Int) async throws -> (events: [SharedEvent], cursor: Int64) {
        try await self.run("read the shared events") { connection, logger in
            let rows = try await connection.query(
                "SELECT seq, summary, body FROM events WHERE seq > \(cursor) ORDER BY seq LIMIT \(Int64(limit))",
                logger: logger
            )
            var events: [SharedEvent] = []
            var last = cursor
            let decoder = JSONDecoder()
            for try await (seq, summary, body) in rows.decode((Int64, String, ByteBuffer).self) {
                last = seq
                guard let stored = try? decoder.decode(StoredSummary.self, from: Data(summary.utf8)) else {
                    logger.warning("events: a shared event (row \(seq)) does not decode; skipped (written by a newer server?)")
                    continue
                }
                events.append(SharedEvent(summary: stored.event, destinations: stored.destinations, body: Array(buffer: body)))
            }
            return (events, last)
        }
    }

    public func record(_ deliveries: [SharedDelivery]) async throws {
        // One row per event and destination: the newest of a batch wins (an upsert may not
        // touch a row twice in one statement).
        var newest: [String: SharedDelivery] = [:]
        var order: [String] = []
        for delivery in deliveries {
            let key = delivery.eventId + "\u{0}" + delivery.destination
            if newest.updateValue(delivery, forKey: key) == nil {
                order.append(key)
            }
        }
        let rows = order.compactMap { newest[$0] }
        guard !rows.isEmpty else { return }
        let encoder = JSONEncoder()
        let ids = rows.map(\.eventId)
        let destinations = rows.map(\.destination)
        let states = try rows.map { String(decoding: try encoder.encode($0.delivery), as: UTF8.self) }
        let redeliver = rows.map(\.redeliver)
        let delivered = rows.map { $0.delivery.status == .delivered }
        try await self.transaction("record event deliveries") { connection, logger in
            try await connection.query(
                """
                INSERT INTO event_deliveries (event_id, destination, state, redeliver, delivered)
                SELECT * FROM unnest(\(ids)::text[], \(destinations)::text[], \(states)::text[], \(redeliver)::boolean[], \(delivered)::boolean[])
                ON CONFLICT (event_id, destination) DO UPDATE SET
                    state = EXCLUDED.state, redeliver = EXCLUDED.redeliver, delivered = EXCLUDED.delivered, changed = nextval('event_changes')
                """,
                logger: logger
            )
        }
    }

    public func deliveries(after cursor: Int64, limit: Int) async throws -> (deliveries: [SharedDelivery], cursor: Int64) {
        try await self.run("read the event deliveries") { connection, logger in
            let rows = try await connection.query(
                "SELECT changed, event_id, destination, state, redeliver FROM event_deliveries WHERE changed > \(cursor) ORDER BY changed LIMIT \(Int64(limit))",
                logger: logger
            )
            let (deliveries, last) = try await Self.decodeDeliveries(rows, logger: logger)
            return (deliveries, last ?? cursor)
        }
    }

    public func deliveries(of eventIds: [String]) async throws -> [SharedDelivery] {
        guard !eventIds.isEmpty else { return [] }
        return try await self.run("read the event deliveries") { connection, logger in
            let rows = try await connection.query(
                "SELECT changed, event_id, destination, state, redeliver FROM event_deliveries WHERE event_id = ANY(\(eventIds)::text[])",
                logger: logger
            )
            return try await Self.decodeDeliveries(rows, logger: logger).deliveries
        }
    }

    /// Rows of `event_deliveries` (changed, event_id, destination, state, redeliver); one
    /// that does not decode (a newer server's) is skipped and logged, not fatal.
    static func decodeDeliveries(_ rows: PostgresRowSequence, logger: Logger) async throws -> (deliveries: [SharedDelivery], last: Int64?) {
        var deliveries: [SharedDelivery] = []
        var last: Int64?
        let decoder = JSONDecoder()
        for try await (changed, id, destination, state, redeliver) in rows.decode((Int64, String, String, String, Bool).self) {
            last = changed
            guard let delivery = try? decoder.decode(EventLedger.Delivery.self, from: Data(state.utf8)) else {
                logger.warning("events: the delivery state of \(id) for \(destination) does not decode; skipped (written by a newer server?)")
                continue
            }
            deliveries.append(SharedDelivery(eventId: id, destination: destination, delivery: delivery, redeliver: redeliver))
        }
        return (deliveries, last)
    }

    public func prune(deliveredBefore age: Duration) async throws {
        let seconds = age.components.seconds
        // Deletes take no number from the sequence: no ordering lock.
        try await self.run("prune delivered events") { connection, logger in
            try await connection.query(
                """
                DELETE FROM events e WHERE e.created_at < now() - \(seconds) * interval '1 second'
                AND NOT EXISTS (SELECT 1 FROM event_deliveries d WHERE d.event_id = e.event_id AND NOT d.delivered)
                """,
                logger: logger
            )
            try await connection.query(
                "DELETE FROM event_deliveries d WHERE NOT EXISTS (SELECT 1 FROM events e WHERE e.event_id = d.event_id)",
                logger: logger
            )
        }
    }

    /// Runs `body` on a connection; errors say what was being done.
    private func run<T: Sendable>(_ what: String, _ body: @escaping @Sendable (PostgresConnection, Logger) async throws -> T) async throws -> T {
        let logger = self.database.logger
        do {
            return try await self.database.withConnection { connection in try await body(connection, logger) }
        } catch {
            throw FleetError(.database, "cannot \(what): \(FleetError.describe(error))")
        }
    }

    /// Runs `body` in a transaction holding the lock that orders the numbers.
    private func transaction(_ what: String, _ body: @escaping @Sendable (PostgresConnection, Logger) async throws -> Void) async throws {
        let logger = self.database.logger
        do {
            try await self.database.withTransaction { connection in
                try await connection.query("SELECT pg_advisory_xact_lock(\(Self.orderLock))", logger: logger)
                try await body(connection, logger)
            }
        } catch {
            throw FleetError(.database, "cannot \(what): \(FleetError.describe(error))")
        }
    }
}
