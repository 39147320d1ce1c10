/// What a fleet's servers share so that each event is delivered by one of them
/// (docs/events.md, "Fleet mode"): a lease that says who delivers, the events any of them
/// derived, and what became of each delivery. Fleet mode implements it on PostgreSQL
/// (`FleetEvents`); a server on its own has none and delivers everything itself.
///
/// Every server derives every event (the same ids), keeps it in its outbox and shares it;
/// only the lease holder sends. The holder records each outcome; every server reads the
/// outcomes back, so that whoever holds the lease next knows what was delivered, and each
/// outbox forgets what is settled.
public protocol EventCoordinator: Sendable {
    /// Takes or keeps the lease for `holder` for `duration`; false if another holds it.
    func lease(holder: String, for duration: Duration) async throws -> Bool
    /// Gives the lease up (a server that stops), so that another takes it at once.
    func release(holder: String) async throws
    /// Keeps `events`; those kept already (by id) are left as they are.
    func share(_ events: [SharedEvent]) async throws
    /// The events kept after `cursor` (0: from the first), at most `limit`, and the cursor
    /// after them.
    func events(after cursor: Int64, limit: Int) async throws -> (events: [SharedEvent], cursor: Int64)
    /// The newest states of the deliveries of `eventIds`.
    func deliveries(of eventIds: [String]) async throws -> [SharedDelivery]
    /// Keeps each delivery's newest state (one per event and destination).
    func record(_ deliveries: [SharedDelivery]) async throws
    /// The delivery states changed after `cursor`, at most `limit`, and the cursor after them.
    func deliveries(after cursor: Int64, limit: Int) async throws -> (deliveries: [SharedDelivery], cursor: Int64)
    /// Forgets the events delivered everywhere more than `age` ago.
    func prune(deliveredBefore age: Duration) async throws
}

/// One delivery's state as a fleet's servers share it: an outcome the lease holder
/// recorded, or a request (`entitlements events redeliver` on any server) to send again.
public struct SharedDelivery: Sendable, Hashable {
    public var eventId: String
    public var destination: String
    public var delivery: EventLedger.Delivery
    public var redeliver: Bool

    public init(eventId: String, destination: String, delivery: EventLedger.Delivery, redeliver: Bool = false) {
        self.eventId = eventId
        self.destination = destination
        self.delivery = delivery
        self.redeliver = redeliver
    }
}
