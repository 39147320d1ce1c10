import EntitlementsClient
import EntitlementsMessages
import EntitlementsServer
import EntitlementsWire
import Foundation
import Logging
import Metrics
import NIOCore
import NIOPosix
import Prometheus
import ServiceLifecycle
import Testing

/// The admin endpoints, metrics, and the drain under ServiceLifecycle, over real sockets.
@Suite("operations")
struct OperationsTests {
    /// GET `path` from the admin listener: status line and body.
    static func get(_ port: Int, _ path: String) async throws -> (status: Int, body: String) {
        try await offThePool { try Self.blockingGet(port, path) }
    }

    static func blockingGet(_ port: Int, _ path: String) throws -> (status: Int, body: String) {
        let connection = try RawConnection(port: port)
        connection.send(bytes: Array("GET \(path) HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".utf8))
        var response: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65_536)
        while true {
            let count = recv(connection.socket, &chunk, chunk.count, 0)
            if count <= 0 { break }
            response += chunk[0..<count]
        }
        let text = String(decoding: response, as: UTF8.self)
        let status = Int(text.split(separator: " ").dropFirst().first ?? "") ?? 0
        let body = text.components(separatedBy: "\r\n\r\n").dropFirst().joined(separator: "\r\n\r\n")
        return (status, body)
    }

    @Test("/healthz, /readyz and /metrics: requests by method and status, latency from 10 µs, cache, snapshot, connections")
    func adminEndpoints() async throws {
        let registry = PrometheusCollectorRegistry()
        let factory = PrometheusMetricsFactory(registry: registry)
        let metrics = ServerMetrics(factory: factory)
        let fixture = try await ServerFixture(writable: true, metrics: metrics)
        let server = fixture.server
        let admin = try await AdminServer.start(
            host: "127.0.0.1",
            port: 0,
            endpoints: .init(readiness: { server.isServing ? (true, "ready") : (false, "draining") }) {
                await server.refreshMetrics()
                var bytes: [UInt8] = []
                registry.emit(into: &bytes)
                metrics.emitLatency(into: &bytes)
                return bytes
            },
            group: fixture.group
        )
        let port = admin.address!.port!
        let client = fixture.client()
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-1", at: now))
        _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: "user-1", at: now))
        let _: WriteResponse = try await client.call(.grantEntitlement, GrantEntitlementRequest(userId: "user-1", grant: Grant(grantId: "g", entitlementId: "e")))
        await #expect(throws: EntitlementsClientError.self) {
            _ = try await client.checkEntitlements(CheckEntitlementsRequest(userId: ""))
        }
        let healthz = try await Self.get(port, "/healthz")
        #expect(healthz == (200, "ok\n"))
        let readyz = try await Self.get(port, "/readyz")
        #expect(readyz == (200, "ready\n"))
        let missing = try await Self.get(port, "/nope")
        #expect(missing.status == 404)
        let scrape = try await Self.get(port, "/metrics")
        #expect(scrape.status == 200)
        let lines = Set(scrape.body.split(separator: "\n").map(String.init))
        for expected in [
            #"entitlements_requests_total{method="CheckEntitlements",status="OK"} 2"#,
            #"entitlements_requests_total{method="CheckEntitlements",status="INVALID_ARGUMENT"} 1"#,
            #"entitlements_requests_total{method="GrantEntitlement",status="OK"} 1"#,
            #"entitlements_request_duration_seconds_count{method="CheckEntitlements"} 3"#,
            #"entitlements_request_duration_seconds_bucket{method="CheckEntitlements",le="+Inf"} 3"#,
            #"entitlements_request_duration_seconds_count{method="WatchEntitlements"} 0"#,
            "# TYPE entitlements_request_duration_seconds histogram",
            "entitlements_connections 1.0",
            "entitlements_requests_in_flight 0.0",
            "entitlements_log_sequence 1.0",
            "entitlements_writes_total 1",
            "entitlements_overlay_customers 1.0",
            "entitlements_ready 1.0",
        ] {
            #expect(lines.contains(expected), "missing \(expected)")
        }
        #expect(lines.contains { $0.hasPrefix(#"entitlements_request_duration_seconds_bucket{method="CheckEntitlements",le="0.00001"}"#) })
        // One histogram of that name: no swift-metrics Timer emits it as well.
        #expect(scrape.body.components(separatedBy: "# TYPE entitlements_request_duration_seconds ").count == 2)
        #expect(lines.contains { $0.hasPrefix("entitlements_cache_hits_total ") && !$0.hasSuffix(" 0") })
        #expect(lines.contains { $0.hasPrefix("entitlements_snapshot_info{snapshot_id=") })
        await client.close()
        await admin.close()
        try await fixture.stop()
    }

    @Test("drain under ServiceLifecycle: graceful shutdown answers accepted calls; past the grace period the rest is cut off")
    func drainTimeout() async throws {
        for holdPastGrace in [false, true] {
            let fixture = try await ServerFixture(holdableResolvers: true)
            let service = EntitlementsService(server: fixture.server)
            var configuration = ServiceGroupConfiguration(services: [.init(service: service)], logger: Logger(label: "test"))
            // Held past the grace: 1 s runs out. Released: 60 s never does, however slow
            // the machine.
            configuration.maximumGracefulShutdownDuration = holdPastGrace ? .seconds(1) : .seconds(60)
            let group = ServiceGroup(configuration: configuration)
            let running = Task { try await group.run() }
            let connection = try RawConnection(port: fixture.port)
            fixture.holdResolvers()
            // The check waits on the held resolver; the Health after it is answered at once,
            // which shows the check was accepted.
            connection.send([
                RawConnection.request(1, CheckEntitlementsRequest(userId: "user-1", at: now)),
                RawConnection.request(2, HealthRequest(), method: .health),
            ])
            let health = try await offThePool { try connection.receive() }
            #expect(health?.requestID == 2)
            await group.triggerGracefulShutdown()
            let goAway = try await offThePool { try connection.receive() }
            #expect(goAway?.type == .goAway && goAway?.requestID == 2)
            if !holdPastGrace {
                fixture.releaseResolvers()
                let answer = try await offThePool { try connection.receive() }
                #expect(answer?.status == .ok)  // the accepted call is answered
                _ = try? await running.value
                #expect(service.drained)
            } else {
                _ = try? await running.value  // the grace runs out: cancelled
                #expect(!service.drained)
                let closed = try await offThePool { try connection.receive() }
                #expect(closed == nil)  // closed without the answer
                fixture.releaseResolvers()
            }
            try await fixture.stop()
        }
    }
}
