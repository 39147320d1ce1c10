import EntitlementsMessages
import EntitlementsServer
import EntitlementsWire
import NIOCore
import Prometheus
import Testing

/// The per-server and per-connection limits, over real sockets.
@Suite("limits")
struct LimitTests {
    static func health(_ id: UInt64) -> Frame {
        RawConnection.request(id, HealthRequest(), method: .health)
    }

    @Test("one connection more than the maximum gets RESOURCE_EXHAUSTED and is closed; a freed slot is reusable")
    func maximumConnections() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.maximumConnections = 2
        let fixture = try await ServerFixture(configuration: configuration)
        var first: RawConnection? = try RawConnection(port: fixture.port)
        let second = try RawConnection(port: fixture.port)
        for connection in [first!, second] {
            connection.send([Self.health(1)])
            #expect(try connection.receive()?.status == .ok)
        }
        let third = try RawConnection(port: fixture.port)
        let refused = try third.receive()
        #expect(refused?.type == .error && refused?.status == .resourceExhausted)
        #expect(refused?.message == "the server has 2 connections, its maximum; try again later or another server")
        #expect(try third.receive() == nil)  // closed
        first = nil  // closes the socket: its slot is freed
        var admitted = false
        for _ in 0..<100 where !admitted {
            let again = try RawConnection(port: fixture.port)
            again.send([Self.health(1)])
            admitted = try again.receive()?.type == .response
        }
        #expect(admitted)
        _ = first
        try await fixture.stop()
    }

    @Test("an idle connection gets GOAWAY and is closed; one with a call in flight is not")
    func idleTimeout() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.idleTimeout = .milliseconds(500)
        let fixture = try await ServerFixture(holdableResolvers: true, configuration: configuration)
        fixture.holdResolvers()
        // The busy connection's call is in flight (the PONG after it says it was read)
        // before the idle one even connects.
        let busy = try RawConnection(port: fixture.port)
        busy.send([RawConnection.request(1, CheckEntitlementsRequest(userId: "user-1", at: now)), Frame(type: .ping, requestID: 2)])
        #expect(try busy.receive()?.type == .pong)
        let idle = try RawConnection(port: fixture.port)
        let goAway = try idle.receive()
        #expect(goAway?.type == .goAway && goAway?.message == "idle for 0.5 s; reconnect when needed")
        #expect(try idle.receive() == nil)
        // The busy one waited longer than the timeout with its call held, and is served.
        fixture.releaseResolvers()
        let answer = try busy.receive()
        #expect(answer?.requestID == 1 && answer?.status == .ok)
        try await fixture.stop()
    }

    @Test("a sender that starts a frame and never finishes it is cut off with DEADLINE_EXCEEDED")
    func slowSender() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.frameTimeout = .milliseconds(200)
        let fixture = try await ServerFixture(configuration: configuration)
        let slow = try RawConnection(port: fixture.port)
        var bytes = ByteBuffer()
        bytes.writeFrame(Self.health(1))
        slow.send(bytes: Array(bytes.readableBytesView.prefix(10)))  // 10 of 24 header bytes
        let error = try slow.receive()
        #expect(error?.type == .error && error?.status == .deadlineExceeded)
        #expect(error?.message == "a frame started 0.2 s ago has not arrived in full (10 bytes so far); closing (at stream offset 0)")
        #expect(try slow.receive() == nil)

        // A sender that completes frames, however slowly in between, is fine.
        let steady = try RawConnection(port: fixture.port)
        for id in 1...3 {
            steady.send([Self.health(UInt64(id))])
            #expect(try steady.receive()?.requestID == UInt64(id))
            try await Task.sleep(for: .milliseconds(150))
        }
        try await fixture.stop()
    }

    @Test("at the in-flight maximum the server stops reading the connection until answers drain")
    func inFlightMaximum() async throws {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0))
        configuration.maximumInFlightPerConnection = 4
        let registry = PrometheusCollectorRegistry()
        let fixture = try await ServerFixture(
            holdableResolvers: true,
            metrics: ServerMetrics(factory: PrometheusMetricsFactory(registry: registry)),
            configuration: configuration
        )
        let connection = try RawConnection(port: fixture.port)
        fixture.holdResolvers()
        let checks = (1...4).map { RawConnection.request(UInt64($0), CheckEntitlementsRequest(userId: "user-\($0)", at: now)) }
        connection.send(checks)
        // Four calls in flight (held): the server has stopped reading. Only then the PING,
        // so that it cannot arrive in the same read as the checks.
        func inFlight() -> String {
            var bytes: [UInt8] = []
            registry.emit(into: &bytes)
            let line = String(decoding: bytes, as: UTF8.self).split(separator: "\n").first { $0.hasPrefix("entitlements_requests_in_flight ") }
            return line.map { String($0.split(separator: " ").last!) } ?? "absent"
        }
        let patience = ContinuousClock.now + .seconds(30)
        while inFlight() != "4.0", ContinuousClock.now < patience {
            try await Task.sleep(for: .milliseconds(5))
        }
        try #require(inFlight() == "4.0", "requests in flight: \(inFlight())")
        connection.send([Frame(type: .ping, requestID: 99)])
        // Were the server still reading, it would answer the PING now, the calls being held.
        try await Task.sleep(for: .milliseconds(100))
        fixture.releaseResolvers()
        var order: [FrameType] = []
        for _ in 0..<5 {
            order.append(try connection.receive()?.type ?? .error)
        }
        // Without the limit the PONG would come first (the resolver is held); with it, the
        // PING is read only once an answer has freed a slot.
        #expect(order.first == .response)
        #expect(order.filter { $0 == .response }.count == 4 && order.contains(.pong))
        try await fixture.stop()
    }
}
