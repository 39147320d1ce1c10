import Dispatch
import EntitlementsMessages
import EntitlementsServer
import EntitlementsWire
import NIOCore
import Prometheus
import Synchronization
import Testing

/// Cache misses that would wait for the disk are read off the event loops (docs/architecture.md,
/// "Cold reads"). A slow disk is injected with `ColdReadSettings.disk`: the ids it holds are
/// "not in memory" to the loop's non-waiting read, and their read on a cold-read thread
/// blocks (the record read, not yet resolved) on a gate the test opens. The order of the
/// answers shows what waited for what, with no clock.
///
/// The warm-up caches every customer's unfiltered answer, so a check with an entitlement
/// filter is a miss and one without is a hit.
@Suite("cold reads")
struct ColdReadTests {
    /// Holds the reads of some ids until opened; counts every read by id.
    final class SlowDisk: Sendable {
        private let held: Set<String>
        private let gate = DispatchSemaphore(value: 0)
        private let reads = Mutex<[String: Int]>([:])

        init(holding ids: Set<String>) {
            self.held = ids
        }

        var disk: @Sendable (String, Bool) -> Bool {
            { id, mayWait in
                let held = self.held.contains(id)
                if mayWait || !held {
                    self.reads.withLock { $0[id, default: 0] += 1 }
                }
                if mayWait, held {
                    self.gate.wait()
                }
                return !held  // on the loop: a held id is not in memory
            }
        }

        func open(reads: Int = 1) {
            for _ in 0..<reads {
                self.gate.signal()
            }
        }

        func reads(of id: String) -> Int {
            self.reads.withLock { $0[id, default: 0] }
        }
    }

    static func configuration(_ disk: SlowDisk, threads: Int = 2, queue: Int = 1_024) -> ServerConfiguration {
        var configuration = ServerConfiguration(tcp: ("127.0.0.1", 0), resolvers: 1)
        configuration.coldReads = ColdReadSettings(threads: threads, queueLimit: queue, disk: disk.disk)
        return configuration
    }

    static func cold(_ id: UInt64, _ user: String, _ entitlement: String = "premium") -> Frame {
        RawConnection.request(id, CheckEntitlementsRequest(userId: user, entitlementIds: [entitlement], at: now))
    }

    static func hot(_ id: UInt64, _ user: String) -> Frame {
        RawConnection.request(id, CheckEntitlementsRequest(userId: user, at: now))
    }

    @Test("a miss whose read is slow does not hold up the hits behind it on the same loop and connection")
    func hitsPassASlowMiss() async throws {
        let disk = SlowDisk(holding: ["user-7"])
        // One event loop: the connection, the resolver and the cache are all on it.
        let fixture = try await ServerFixture(loops: 1, configuration: Self.configuration(disk))
        let connection = try RawConnection(port: fixture.port)
        connection.send([Self.cold(1, "user-7"), Self.hot(2, "user-8"), Self.hot(3, "user-9")])
        // The read of user-7 is still held: the hits are answered first. (Read inline on the
        // loop, they would wait for it: this receive would time out.)
        let first = try await offThePool { try connection.receive() }
        let second = try await offThePool { try connection.receive() }
        #expect(first?.requestID == 2 && first?.status == .ok)
        #expect(second?.requestID == 3 && second?.status == .ok)
        #expect(disk.reads(of: "user-8") == 0 && disk.reads(of: "user-9") == 0)
        disk.open()
        let third = try await offThePool { try connection.receive() }
        #expect(third?.requestID == 1 && third?.status == .ok)
        let answer = try CheckEntitlementsResponse(buffer: third!.payload)
        #expect(answer.userId == "user-7")
        // Now cached: answered without another read.
        connection.send([Self.cold(4, "user-7")])
        #expect(try await offThePool { try connection.receive() }?.requestID == 4)
        #expect(disk.reads(of: "user-7") == 1)
        try await fixture.stop()
    }

    @Test("concurrent misses of one key are read once, and each gets the answer")
    func concurrentMissesReadOnce() async throws {
        let disk = SlowDisk(holding: ["user-11"])
        let fixture = try await ServerFixture(loops: 1, configuration: Self.configuration(disk))
        let connections = try (0..<3).map { _ in try RawConnection(port: fixture.port) }
        for connection in connections {
            // The PONG says the server has read the checks before it: all are waiting.
            connection.send([Self.cold(1, "user-11"), Self.cold(2, "user-11"), Frame(type: .ping, requestID: 3)])
            #expect(try await offThePool { try connection.receive() }?.type == .pong)
        }
        disk.open()
        var payloads: Set<ByteBuffer> = []
        for connection in connections {
            for _ in 0..<2 {
                let frame = try #require(try await offThePool { try connection.receive() })
                #expect(frame.status == .ok)
                payloads.insert(frame.payload)
            }
        }
        #expect(disk.reads(of: "user-11") == 1)
        #expect(payloads.count == 1)  // the same request date: byte for byte the same answer
        try await fixture.stop()
    }

    @Test("a full cold-read queue refuses a miss with RESOURCE_EXHAUSTED, counted in /metrics; hits go on")
    func fullQueue() async throws {
        let disk = SlowDisk(holding: ["user-20", "user-21"])
        let registry = PrometheusCollectorRegistry()
        let fixture = try await ServerFixture(
            metrics: ServerMetrics(factory: PrometheusMetricsFactory(registry: registry)),
            loops: 1,
            configuration: Self.configuration(disk, threads: 1, queue: 1)
        )
        let connection = try RawConnection(port: fixture.port)
        connection.send([Self.cold(1, "user-20"), Self.cold(2, "user-21"), Self.hot(3, "user-22")])
        let refused = try #require(try await offThePool { try connection.receive() })
        #expect(refused.requestID == 2 && refused.status == .resourceExhausted)
        #expect(refused.message == "cold-read queue full: 1 cache misses are waiting for the snapshot (--cold-read-queue); retry with backoff")
        #expect(try await offThePool { try connection.receive() }?.requestID == 3)
        await fixture.server.refreshMetrics()
        var bytes: [UInt8] = []
        registry.emit(into: &bytes)
        let metrics = String(decoding: bytes, as: UTF8.self)
        #expect(metrics.contains("entitlements_cold_reads_refused_total 1"))
        #expect(metrics.contains("entitlements_cold_reads_queued 1.0"))
        disk.open(reads: 2)  // user-20's read, and user-21's when retried
        #expect(try await offThePool { try connection.receive() }?.requestID == 1)
        // The place is free again: the refused check succeeds when retried.
        connection.send([Self.cold(4, "user-21")])
        #expect(try await offThePool { try connection.receive() }?.status == .ok)
        try await fixture.stop()
    }

    @Test("a write acknowledged while a miss of its customer is being read is not hidden by that read")
    func writeDuringRead() async throws {
        let disk = SlowDisk(holding: ["user-30"])
        let fixture = try await ServerFixture(writable: true, loops: 1, configuration: Self.configuration(disk))
        let connection = try RawConnection(port: fixture.port)
        connection.send([Self.cold(1, "user-30", "beta"), Frame(type: .ping, requestID: 2)])
        #expect(try await offThePool { try connection.receive() }?.type == .pong)
        // The read is held, the record read and not yet resolved; the write is acknowledged.
        let grant = GrantEntitlementRequest(userId: "user-30", grant: Grant(grantId: "cold-1", entitlementId: "beta", grantedDate: now - 1))
        connection.send([RawConnection.request(3, grant, method: .grantEntitlement)])
        let written = try #require(try await offThePool { try connection.receive() })
        #expect(written.requestID == 3 && written.status == .ok)
        disk.open(reads: 2)  // this read, and the one after it
        let before = try #require(try await offThePool { try connection.receive() })
        #expect(before.requestID == 1)
        #expect(try CheckEntitlementsResponse(buffer: before.payload).entitlements.isEmpty)
        // The read that started before the write was not cached: this check sees the grant.
        connection.send([Self.cold(4, "user-30", "beta")])
        let after = try #require(try await offThePool { try connection.receive() })
        let response = try CheckEntitlementsResponse(buffer: after.payload)
        #expect(response.entitlements.contains { $0.id == "beta" && $0.isActive })
        #expect(disk.reads(of: "user-30") == 2)
        try await fixture.stop()
    }

    @Test("with --cold-read-threads 0 a miss is read on the loop, and the hits behind it wait (the comparison)")
    func inlineReadsBlockTheLoop() async throws {
        let disk = SlowDisk(holding: ["user-40"])
        let fixture = try await ServerFixture(loops: 1, configuration: Self.configuration(disk, threads: 0))
        let connection = try RawConnection(port: fixture.port)
        connection.send([Self.cold(1, "user-40"), Self.hot(2, "user-41")])
        // Opened only once the read has started, so that both are in the server.
        for _ in 0..<30_000 where disk.reads(of: "user-40") == 0 {
            try await Task.sleep(for: .milliseconds(1))
        }
        try #require(disk.reads(of: "user-40") == 1, "the miss was never read")
        disk.open()
        #expect(try await offThePool { try connection.receive() }?.requestID == 1)
        #expect(try await offThePool { try connection.receive() }?.requestID == 2)
        try await fixture.stop()
    }
}
