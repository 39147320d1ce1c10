@testable import EntitlementsServer
import Testing

/// The framed connection's life without a channel: every transition the handler relies on.
@Suite("framed connection state")
struct FramedConnectionStateTests {
    @Test("open accepts calls; a drain sends GOAWAY once and closes at once when nothing is in flight")
    func drainIdle() {
        var state = FramedConnectionState()
        #expect(state.acceptsCalls && state.isReadingFrames)
        let result1 = state.drain(inFlight: 0)
        #expect(result1 == .goAway(closeNow: true))
        #expect(state.phase == .draining && !state.acceptsCalls && state.isReadingFrames)
        let result2 = state.drain(inFlight: 0)
        #expect(result2 == .none, "one GOAWAY")
        let result16 = state.close()
        #expect(result16)
        #expect(state.phase == .closing && !state.isReadingFrames)
        let result17 = state.close()
        #expect(!result17, "one close")
        state.closed()
        #expect(state.phase == .closed && !state.isReadingFrames && !state.acceptsCalls)
    }

    @Test("a drain with calls in flight waits for the last one to be answered")
    func drainWaits() {
        var state = FramedConnectionState()
        let result3 = state.drain(inFlight: 2)
        #expect(result3 == .goAway(closeNow: false))
        #expect(!state.closesAfterCall(inFlight: 1))
        #expect(state.closesAfterCall(inFlight: 0))
        let result18 = state.close()
        #expect(result18)
        #expect(!state.closesAfterCall(inFlight: 0), "already closing")
    }

    @Test("an open connection never closes because its calls are done")
    func openStaysOpen() {
        let state = FramedConnectionState()
        #expect(!state.closesAfterCall(inFlight: 0))
    }

    @Test("a connection error or the client's ERROR closes from open, and a drain after it does nothing")
    func errorCloses() {
        var state = FramedConnectionState()
        let result19 = state.close()
        #expect(result19)
        #expect(state.phase == .closing)
        let result4 = state.drain(inFlight: 0)
        #expect(result4 == .none)
        #expect(!state.acceptsCalls && !state.isReadingFrames)
    }

    @Test("reads pause at the in-flight limit or an unwritable socket, resume when neither holds, once each")
    func backpressure() {
        var state = FramedConnectionState()
        let result5 = state.reading(inFlight: 3, limit: 4, writable: true)
        #expect(result5 == .unchanged)
        let result6 = state.reading(inFlight: 4, limit: 4, writable: true)
        #expect(result6 == .pause)
        #expect(state.readsPaused)
        let result7 = state.reading(inFlight: 5, limit: 4, writable: true)
        #expect(result7 == .unchanged)
        let result8 = state.reading(inFlight: 3, limit: 4, writable: false)
        #expect(result8 == .unchanged, "still paused: the socket is full")
        let result9 = state.reading(inFlight: 3, limit: 4, writable: true)
        #expect(result9 == .resume)
        #expect(!state.readsPaused)
        let result10 = state.reading(inFlight: 0, limit: 4, writable: false)
        #expect(result10 == .pause)
    }

    @Test("a draining or closing connection reads (and drops) what comes, so that a close is not a reset")
    func drainingReads() {
        var state = FramedConnectionState()
        let result11 = state.reading(inFlight: 4, limit: 4, writable: false)
        #expect(result11 == .pause)
        _ = state.drain(inFlight: 4)
        let result12 = state.reading(inFlight: 4, limit: 4, writable: false)
        #expect(result12 == .resume)
        let result13 = state.reading(inFlight: 9, limit: 4, writable: false)
        #expect(result13 == .unchanged)
        _ = state.close()
        let result14 = state.reading(inFlight: 9, limit: 4, writable: false)
        #expect(result14 == .unchanged)
        state.closed()
        let result15 = state.reading(inFlight: 0, limit: 4, writable: true)
        #expect(result15 == .unchanged, "a closed connection has no socket to resume")
    }
}
