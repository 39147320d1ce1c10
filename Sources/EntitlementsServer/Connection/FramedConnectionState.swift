/// The life of one framed connection, apart from its channel (tested without one): which
/// phase it is in, whether it reads, and what a drain, a finished call or a close does
/// next. ``ServerConnectionHandler`` asks it and does what it says.
///
/// ```
///   open --drain / idle--> draining --last call done--> closing --handler removed--> closed
///     \______________ connection error, client ERROR ______^
/// ```
struct FramedConnectionState: Equatable {
    enum Phase: Equatable {
        /// Calls are accepted.
        case open
        /// GOAWAY is out: calls already accepted are answered, new ones dropped unanswered.
        case draining
        /// The last frame is out (the final answer, a GOAWAY or an ERROR): nothing more is
        /// read as frames or written; the sending side shuts down and the connection lingers
        /// until the client closes it.
        case closing
        /// The handler has left the pipeline.
        case closed
    }

    private(set) var phase = Phase.open
    /// Reads are paused: backpressure, not buffering.
    private(set) var readsPaused = false

    /// Whether a new request is processed (after GOAWAY it is dropped: the client retries
    /// it elsewhere).
    var acceptsCalls: Bool {
        self.phase == .open
    }

    /// Whether what arrives is read as frames, and frames are written.
    var isReadingFrames: Bool {
        self.phase == .open || self.phase == .draining
    }

    /// What a drain asks of the connection.
    enum Drain: Equatable {
        /// Already draining or closing: nothing.
        case none
        /// Send GOAWAY; then close at once if nothing is in flight, else when the last
        /// call is answered.
        case goAway(closeNow: Bool)
    }

    /// serve's drain, or the idle timeout (called only when nothing is in flight).
    mutating func drain(inFlight: Int) -> Drain {
        guard self.phase == .open else {
            return .none
        }
        self.phase = .draining
        return .goAway(closeNow: inFlight == 0)
    }

    /// A call has been answered, `inFlight` are left: whether the connection closes now
    /// (a drain waiting for its last call).
    func closesAfterCall(inFlight: Int) -> Bool {
        self.phase == .draining && inFlight == 0
    }

    /// The connection's last frame is written: whether the close starts now (false when
    /// it is already closing or closed).
    mutating func close() -> Bool {
        guard self.isReadingFrames else {
            return false
        }
        self.phase = .closing
        return true
    }

    /// The handler has left the pipeline.
    mutating func closed() {
        self.phase = .closed
    }

    /// What to do about reading.
    enum Reading: Equatable {
        case unchanged
        case pause
        case resume
    }

    /// Reading pauses while `inFlight` reaches the per-connection limit or the socket takes
    /// no more writes (a client that does not read its answers), and resumes when neither
    /// holds. Once GOAWAY is out nothing new is accepted, so reading costs nothing and
    /// keeps the receive buffer empty (a close with unread input is answered with a reset,
    /// which would drop answers still on their way): a draining or closing connection reads.
    mutating func reading(inFlight: Int, limit: Int, writable: Bool) -> Reading {
        guard self.phase != .closed else {
            return .unchanged
        }
        let shouldPause = self.phase == .open && (inFlight >= limit || !writable)
        switch (shouldPause, self.readsPaused) {
        case (true, false):
            self.readsPaused = true
            return .pause
        case (false, true):
            self.readsPaused = false
            return .resume
        default:
            return .unchanged
        }
    }
}
