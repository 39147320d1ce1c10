import EntitlementsClient
import EntitlementsMessages
import EntitlementsStore
import EntitlementsTools
import Foundation
import Synchronization
import Testing

/// `entitlements serve` as a child process on a data directory, killed with SIGKILL while
/// writes are in flight, and started again.
struct ChildServer {
    let process: Process
    let port: Int

    static func start(dataDirectory: String, seed: String, extraArguments: [String] = [], environment: [String: String] = [:]) throws -> ChildServer {
        let (process, pipe, _, port) = try CommandLineTests.start(
            [
                "serve", "--data-dir", dataDirectory, "--snapshot", seed, "--listen", "127.0.0.1:0",
                "--resolvers", "2", "--cache-bytes", "4MiB",
            ] + extraArguments,
            environment: environment
        )
        // Keep draining its output so that it never blocks on a full pipe: on a thread of its
        // own, reading to the end (the child's death). Not a readabilityHandler: its
        // dispatch source crashed libdispatch's manager thread once here (SIGSEGV in
        // _dispatch_event_loop_drain) while these children were killed and restarted.
        let output = pipe.fileHandleForReading
        Thread.detachNewThread {
            while !output.availableData.isEmpty {}
        }
        return ChildServer(process: process, port: port)
    }

    func client() -> EntitlementsClient {
        EntitlementsClient(configuration: .init(server: .tcp(host: "127.0.0.1", port: self.port), connections: 2))
    }

    func kill9() {
        kill(self.process.processIdentifier, SIGKILL)
        self.process.waitUntilExit()
    }
}

@Suite("crash recovery", .serialized)
struct CrashRecoveryTests {
    /// What the writers were told, and what may have happened without their knowing.
    final class Ledger: Sendable {
        struct State {
            /// user -> entitlements of acknowledged grants.
            var granted: [String: Set<String>] = [:]
            /// alias -> the owners it may have: the last acknowledged, and any transfer
            /// in flight when the server died.
            var aliasOwners: [String: Set<String>] = [:]
            var sequences: [UInt64] = []
        }

        let state = Mutex(State())
    }

    static func seed(in directory: String) throws -> String {
        let path = directory + "/seed.snap"
        _ = try SnapshotTools.generate(count: 200, seed: 11, now: now, outputPath: path)
        return path
    }

    static func verify(_ ledger: Ledger, on server: ChildServer) async throws {
        let client = server.client()
        defer { Task { await client.close() } }
        let state = ledger.state.withLock { $0 }
        for (user, granted) in state.granted {
            let response = try await client.checkEntitlements(CheckEntitlementsRequest(userId: user))
            let active = Set(response.entitlements.filter(\.isActive).compactMap(\.id))
            #expect(granted.isSubset(of: active), "user \(user) lost acknowledged grants \(granted.subtracting(active).sorted())")
        }
        for (alias, owners) in state.aliasOwners {
            let response = try await client.checkEntitlements(CheckEntitlementsRequest(userId: alias))
            #expect(owners.contains(response.customerId ?? "-"), "alias \(alias) names \(response.customerId ?? "nobody"), expected one of \(owners.sorted())")
        }
        #expect(Set(state.sequences).count == state.sequences.count, "a log sequence was acknowledged twice")
    }

    @Test("kill -9 at random moments: every acknowledged write survives every restart (20 cycles)")
    func killNineCycles() async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("crash-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let seed = try Self.seed(in: directory)
        let ledger = Ledger()
        var generator = SystemRandomNumberGenerator()
        for cycle in 0..<20 {
            // A small compaction threshold, so that some kills land during compactions.
            let server = try ChildServer.start(dataDirectory: directory + "/data", seed: seed, extraArguments: ["--compact-after", "16KiB"])
            try await Self.verify(ledger, on: server)
            let client = server.client()
            let writers = Task {
                await withTaskGroup(of: Void.self) { group in
                    for task in 0..<6 {
                        group.addTask {
                            var random = SystemRandomNumberGenerator()
                            for index in 0..<100_000 {
                                let user = "user-\(Int.random(in: 0..<200, using: &random))"
                                do {
                                    if task == 0 {
                                        // Alias transfers: one writer per alias, so the last
                                        // acknowledged owner is known.
                                        let alias = "device-\(index % 5)"
                                        ledger.state.withLock { $0.aliasOwners[alias, default: ["-"]].insert(user) }
                                        let response: WriteResponse = try await client.call(.linkAlias, LinkAliasRequest(userId: user, alias: alias, transfer: true))
                                        ledger.state.withLock {
                                            $0.aliasOwners[alias] = [user]
                                            if response.logSequence > 0 { $0.sequences.append(response.logSequence) }
                                        }
                                    } else {
                                        let entitlement = "c\(cycle)-w\(task)-\(index)"
                                        let response: WriteResponse = try await client.call(
                                            .grantEntitlement,
                                            GrantEntitlementRequest(userId: user, grant: Grant(grantId: entitlement, entitlementId: entitlement))
                                        )
                                        ledger.state.withLock {
                                            $0.granted[user, default: []].insert(entitlement)
                                            $0.sequences.append(response.logSequence)
                                        }
                                    }
                                } catch {
                                    return  // the server died
                                }
                            }
                        }
                    }
                }
            }
            // Some progress first (a dozen acknowledged writes, however slow the disk's
            // fsync), so that 20 cycles always add up to hundreds of writes; then a random
            // moment.
            let before = ledger.state.withLock { $0.sequences.count }
            let patience = ContinuousClock.now + .seconds(60)
            while ledger.state.withLock({ $0.sequences.count }) < before + 12, ContinuousClock.now < patience {
                try await Task.sleep(for: .milliseconds(2))
            }
            try await Task.sleep(for: .milliseconds(Int.random(in: 0...250, using: &generator)))
            server.kill9()
            await writers.value
            await client.close()
        }
        let server = try ChildServer.start(dataDirectory: directory + "/data", seed: seed)
        try await Self.verify(ledger, on: server)
        let acknowledged = ledger.state.withLock { $0.sequences.count }
        #expect(acknowledged > 200, "only \(acknowledged) writes were acknowledged in 20 cycles")
        server.kill9()
    }

    @Test("a crash at each step of compaction leaves a data directory that starts with every acknowledged write", arguments: CrashPoint.compactionPoints)
    func crashDuringCompaction(point: String) async throws {
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("crash-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        defer { try? FileManager.default.removeItem(atPath: directory) }
        let seed = try Self.seed(in: directory)
        let ledger = Ledger()
        let server = try ChildServer.start(
            dataDirectory: directory + "/data", seed: seed,
            extraArguments: ["--compact-after", "0"], environment: ["ENTITLEMENTS_CRASH_POINT": point]
        )
        let client = server.client()
        for index in 0..<50 {
            let user = "user-\(index % 20)"
            let response: WriteResponse = try await client.call(.grantEntitlement, GrantEntitlementRequest(userId: user, grant: Grant(grantId: "g\(index)", entitlementId: "e\(index)")))
            ledger.state.withLock {
                $0.granted[user, default: []].insert("e\(index)")
                $0.sequences.append(response.logSequence)
            }
        }
        await #expect(throws: EntitlementsClientError.self) {
            let _: CompactResponse = try await client.call(.compact, CompactRequest())
        }
        server.process.waitUntilExit()
        #expect(server.process.terminationReason == .uncaughtSignal && server.process.terminationStatus == SIGKILL)
        await client.close()

        let restarted = try ChildServer.start(dataDirectory: directory + "/data", seed: seed, extraArguments: ["--compact-after", "0"])
        try await Self.verify(ledger, on: restarted)
        // And compaction works again afterwards, keeping everything.
        let again = restarted.client()
        let _: CompactResponse = try await again.call(.compact, CompactRequest())
        await again.close()
        restarted.kill9()
        let last = try ChildServer.start(dataDirectory: directory + "/data", seed: seed)
        try await Self.verify(ledger, on: last)
        last.kill9()
    }
}
