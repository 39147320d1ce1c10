@testable import EntitlementsDoors
import Testing

/// A door stream's life without a channel: each call is counted once, by one party, and a
/// stream answered before its request ended is reset.
@Suite("door stream state")
struct DoorStreamStateTests {
    @Test("a routed unary call: the router counts it; no reset once the request ended")
    func routedCall() {
        var state = DoorStreamState()
        let starts = state.headers(endStream: false)
        #expect(starts && state.phase == .receiving)
        let data = state.data(endStream: true)
        #expect(data)
        let made = state.requestComplete()
        #expect(made && state.phase == .answering)
        state.routed()
        let finish = state.finish()
        #expect(finish == DoorStreamState.Finish(count: false, reset: false))
        let again = state.finish()
        #expect(again == nil, "one answer")
        let cancelled = state.ended()
        #expect(!cancelled, "answered: not counted again")
    }

    @Test("refused at its headers: the transport counts it, and resets the stream the client has not ended")
    func refusedEarly() {
        var state = DoorStreamState()
        _ = state.headers(endStream: false)
        let finish = state.finish()
        #expect(finish == DoorStreamState.Finish(count: true, reset: true))
        let late = state.data(endStream: true)
        #expect(!late, "the rest of the body is not read")
        let made = state.requestComplete()
        #expect(!made, "and no call is made")
    }

    @Test("reset by the client while arriving: counted CANCELLED by the transport; once routed, by the router")
    func resetByClient() {
        var arriving = DoorStreamState()
        _ = arriving.headers(endStream: false)
        let counted = arriving.ended()
        #expect(counted)
        let twice = arriving.ended()
        #expect(!twice, "channelInactive and handlerRemoved both end it: counted once")

        var routed = DoorStreamState()
        _ = routed.headers(endStream: true)
        _ = routed.requestComplete()
        routed.routed()
        let byTransport = routed.ended()
        #expect(!byTransport)
    }

    @Test("a health watch that runs (not routed) is counted by nobody; its end writes trailers only once")
    func streaming() {
        var state = DoorStreamState()
        _ = state.headers(endStream: true)
        _ = state.requestComplete()
        state.streaming()
        #expect(state.counter == .nobody)
        let finish = state.finish()
        #expect(finish == DoorStreamState.Finish(count: false, reset: false))
        let again = state.finish()
        #expect(again == nil, "trailers once")

        var reset = DoorStreamState()
        _ = reset.headers(endStream: true)
        _ = reset.requestComplete()
        reset.streaming()
        let cancelled = reset.ended()
        #expect(!cancelled, "a stream that ran is not counted when its client resets it")
    }

    @Test("a grpc.health.v1 check (not routed, not a stream) is counted by the transport")
    func healthCheck() {
        var state = DoorStreamState()
        _ = state.headers(endStream: true)
        _ = state.requestComplete()
        let finish = state.finish()
        #expect(finish == DoorStreamState.Finish(count: true, reset: false))
    }

    @Test("trailers (HEADERS after the first) end the request; they start no call")
    func trailers() {
        var state = DoorStreamState()
        _ = state.headers(endStream: false)
        let second = state.headers(endStream: true)
        #expect(!second && state.requestEnded)
        let made = state.requestComplete()
        #expect(made)
    }
}
