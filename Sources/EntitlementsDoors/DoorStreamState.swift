/// The life of one call on an HTTP/2 stream of the door, apart from its channel (tested
/// without one): its phase, who counts its answer, and whether the stream is reset after
/// it. ``DoorStreamHandler`` asks it and does what it says.
///
/// ```
///   idle --HEADERS--> receiving --request ended--> answering --last frame--> done
///                        \___________ refused early, reset, connection gone ____^
/// ```
struct DoorStreamState: Equatable {
    enum Phase: Equatable {
        /// Waiting for the request's HEADERS.
        case idle
        /// Reading the request's DATA.
        case receiving
        /// The request is in; the answer is being worked on, or streamed.
        case answering
        /// The answer's last frame is written, or the stream is gone.
        case done
    }

    /// Who counts the call in `entitlements_requests_total`: exactly one, once.
    enum Counter: Equatable {
        /// This transport: refused before the router saw it, or a grpc.health.v1 call.
        case transport
        /// The router, which took the call (and counts it CANCELLED if the stream goes).
        case router
        /// Nobody: a stream that ran (a watch); only refused watches count, as on the
        /// framed listener.
        case nobody
    }

    private(set) var phase = Phase.idle
    private(set) var counter = Counter.transport
    /// The client has ended its side of the stream (END_STREAM seen).
    private(set) var requestEnded = false

    /// The request's HEADERS: whether they start the call (later HEADERS are trailers).
    mutating func headers(endStream: Bool) -> Bool {
        self.requestEnded = self.requestEnded || endStream
        guard self.phase == .idle else {
            return false
        }
        self.phase = .receiving
        return true
    }

    /// A DATA frame: whether its bytes belong to the request (not once it is answered).
    mutating func data(endStream: Bool) -> Bool {
        self.requestEnded = self.requestEnded || endStream
        return self.phase == .receiving
    }

    /// The whole request is in: whether the call is to be made now (false when it was
    /// already answered, refused early or timed out).
    mutating func requestComplete() -> Bool {
        guard self.phase == .receiving else {
            return false
        }
        self.phase = .answering
        return true
    }

    /// The router took the call: it counts it.
    mutating func routed() {
        self.counter = .router
    }

    /// The call became a stream that runs (a watch): its end is not counted.
    mutating func streaming() {
        self.counter = .nobody
    }

    /// What writing the call's last frame involves.
    struct Finish: Equatable {
        /// This transport counts the call (the router did not see it).
        var count: Bool
        /// The client has not ended its request: the stream is reset with NO_ERROR after
        /// the answer (RFC 9113, 8.1), so that it does not stay open as long as the client
        /// sends.
        var reset: Bool
    }

    /// The call's last frame is to be written: how, or nil when it already was (a second
    /// answer is dropped).
    mutating func finish() -> Finish? {
        guard self.phase != .done else {
            return nil
        }
        self.phase = .done
        return Finish(count: self.counter == .transport, reset: !self.requestEnded)
    }

    /// The stream is gone (reset by the client, or its connection closed): whether this
    /// transport counts the call CANCELLED (one it had not answered and did not route).
    mutating func ended() -> Bool {
        let unanswered = self.phase == .receiving || self.phase == .answering
        self.phase = .done
        return unanswered && self.counter == .transport
    }
}
