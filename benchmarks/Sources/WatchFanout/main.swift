// WatchFanout: writes under watches of every customer (benchmarks/README.md, "Watches of
// every customer"), against a server it starts itself:
//
//   WatchFanout --entitlements BIN --snapshot SNAP --data-dir DIR --port P
//               [--server-cpu N] [--watches 8] [--writes 20000] [--writers 16]
//               [--json FILE]
//
// Opens WATCHES WatchEntitlements streams of `all_customers` (what every near-cache client
// holds), each on a connection of its own, then records WRITES grants, each to a new
// customer (fanout-user-0, fanout-user-1, ...; each grant expires at its own instant a day
// ahead, so that every watch keeps the answer and when it expires), from WRITERS tasks. Reports the writes' rate and
// the server's CPU time per write in each quarter of the writes (each watch keeps one more
// customer per write: a cost that grows with what a watch keeps shows as later quarters
// slower than the first), and how long after the last write's acknowledgment every watch
// had had every write's event.
import EntitlementsClient
import EntitlementsMessages
import Foundation
import ServerHarness
import Synchronization

let settings = ToolSettings(tool: "WatchFanout")
let watches = Int(settings.number("watches", 8))
let writes = Int(settings.number("writes", 20_000))
let writers = Int(settings.number("writers", 16))
let port = Int(settings.number("port", 7497))
let dataDirectory = settings.text("data-dir")

func nowNanoseconds() -> UInt64 { DispatchTime.now().uptimeNanoseconds }

/// CPU time (user + system, seconds) process `pid` has used, from /proc/PID/stat.
func cpuSeconds(pid: Int32) -> Double {
    guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
        let end = stat.lastIndex(of: ")")
    else { return .nan }
    // After "pid (comm) ": utime and stime are the 12th and 13th fields.
    let fields = stat[stat.index(after: end)...].split(separator: " ")
    guard fields.count > 12, let user = Double(fields[11]), let system = Double(fields[12]) else { return .nan }
    return (user + system) / Double(sysconf(Int32(_SC_CLK_TCK)))
}

// MARK: The server

let server = try await startServer(settings, dataDirectory: dataDirectory, port: port)
defer { if server.isRunning { kill(server.processIdentifier, SIGKILL) } }

let address = EntitlementsServerAddress.tcp(host: "127.0.0.1", port: port)
let client = EntitlementsClient(configuration: .init(server: address, connections: 4))

// MARK: The watches

/// Events each watch has had, when the last watch had its last one, and whether a stream
/// ended early (the server ended it, or the connection went).
final class Received: Sendable {
    let counts: Mutex<[Int]>
    let allDelivered = Atomic<UInt64>(0)
    let endedEarly = Mutex<String?>(nil)
    init(watches: Int) { self.counts = Mutex(Array(repeating: 0, count: watches)) }
}
let received = Received(watches: watches)
// Each watch on a connection of its own, as each near-cache client holds its own.
var opened: [AsyncThrowingStream<EntitlementsChangedEvent, any Error>] = []
var watchers: [EntitlementsClient] = []  // kept open until the end
for _ in 0..<watches {
    let watcher = EntitlementsClient(configuration: .init(server: address, connections: 1))
    watchers.append(watcher)
    opened.append(try await watcher.watch(WatchEntitlementsRequest(allCustomers: true, environment: .production)))
}
let streams = opened
// One write before the measured ones, whose event every watch must have had before they
// start: a watch registered late would miss the first writes and never count them all.
let expected = writes + 1
let counting = Task.detached {
    await withTaskGroup(of: Void.self) { group in
        for (index, stream) in streams.enumerated() {
            group.addTask {
                do {
                    for try await _ in stream {
                        let done = received.counts.withLock { counts in
                            counts[index] += 1
                            return counts.allSatisfy { $0 >= expected }
                        }
                        if done {
                            received.allDelivered.store(nowNanoseconds(), ordering: .relaxed)
                        }
                        if received.counts.withLock({ $0[index] }) >= expected {
                            return
                        }
                    }
                    received.endedEarly.withLock { $0 = $0 ?? "watch \(index) ended by the server" }
                } catch {
                    received.endedEarly.withLock { $0 = $0 ?? "watch \(index) failed: \(error)" }
                }
            }
        }
    }
}
let day: Int64 = 86_400_000
let base = Int64(Date().timeIntervalSince1970 * 1000)
func grant(_ index: Int) -> GrantEntitlementRequest {
    // A customer prefix no snapshot holds: each write makes a new customer.
    GrantEntitlementRequest(
        userId: "fanout-user-\(index)",
        grant: Grant(grantId: "fanout-\(index)", entitlementId: "fanout", grantedDate: base - 1_000, expirationDate: base + day + Int64(index))
    )
}
let _: WriteResponse = try await client.call(.grantEntitlement, grant(-1), timeout: .seconds(60))
let registeredBy = nowNanoseconds() + 30_000_000_000
while watches > 0, received.counts.withLock({ $0.contains(0) }), received.endedEarly.withLock({ $0 }) == nil, nowNanoseconds() < registeredBy {
    try await Task.sleep(for: .milliseconds(2))
}
if watches > 0, received.counts.withLock({ $0.contains(0) }) || received.endedEarly.withLock({ $0 }) != nil {
    print("WatchFanout: the watches did not all see the first write within 30 s: \(received.endedEarly.withLock { $0 } ?? "\(received.counts.withLock { $0 })")")
    kill(server.processIdentifier, SIGKILL)  // exit runs no defer
    exit(1)
}

// MARK: The writes

let next = Atomic<Int>(0)
let quarter = max(1, writes / 4)
/// Per quarter: when its last write was acknowledged, and the server's CPU time then.
let marks = Mutex<[(at: UInt64, cpu: Double)]>([])
let pid = server.processIdentifier
let start = (at: nowNanoseconds(), cpu: cpuSeconds(pid: pid))
let acknowledged = Atomic<Int>(0)
try await withThrowingTaskGroup(of: Void.self) { group in
    for _ in 0..<writers {
        group.addTask {
            while true {
                let index = next.add(1, ordering: .relaxed).oldValue
                guard index < writes else { return }
                let _: WriteResponse = try await client.call(.grantEntitlement, grant(index), timeout: .seconds(60))
                let count = acknowledged.add(1, ordering: .relaxed).newValue
                if count % quarter == 0 {
                    let mark = (at: nowNanoseconds(), cpu: cpuSeconds(pid: pid))
                    marks.withLock { $0.append(mark) }
                }
            }
        }
    }
    try await group.waitForAll()
}
let lastAcknowledged = nowNanoseconds()
let deliveredBy = lastAcknowledged + 120_000_000_000
while watches > 0, received.allDelivered.load(ordering: .relaxed) == 0, received.endedEarly.withLock({ $0 }) == nil, nowNanoseconds() < deliveredBy {
    try await Task.sleep(for: .milliseconds(2))
}
let delivered = watches == 0 ? lastAcknowledged : received.allDelivered.load(ordering: .relaxed)
counting.cancel()

// MARK: Report

var rows: [[String: Double]] = []
var previous = start
// Sorted: two writers can pass quarter marks close together and append them out of order.
for (index, mark) in marks.withLock({ $0 }).sorted(by: { $0.at < $1.at }).enumerated() {
    let seconds = Double(mark.at - previous.at) / 1e9
    let rate = Double(quarter) / seconds
    let cpu = (mark.cpu - previous.cpu) / Double(quarter) * 1e6
    rows.append(["quarter": Double(index + 1), "writesPerSecond": rate, "serverCpuMicrosecondsPerWrite": cpu])
    print(String(format: "quarter %d: %.0f writes/s, server CPU %.1f µs per write", index + 1, rate, cpu))
    previous = mark
}
let deliveryMilliseconds = delivered == 0 ? -1 : Double(delivered > lastAcknowledged ? delivered - lastAcknowledged : 0) / 1e6
if delivered == 0 {
    print("not every watch had every event within 120 s of the last acknowledgment: \(received.endedEarly.withLock { $0 } ?? "\(received.counts.withLock { $0 })")")
} else {
    print(String(format: "every watch had every event %.1f ms after the last acknowledgment", deliveryMilliseconds))
}
if let path = settings.values["json"] {
    let document: [String: Any] = [
        "watches": watches, "writes": writes, "writers": writers,
        "quarters": rows, "deliveryAfterLastAckMilliseconds": deliveryMilliseconds,
    ]
    try JSONSerialization.data(withJSONObject: document, options: [.prettyPrinted, .sortedKeys]).write(to: URL(fileURLWithPath: path))
}
kill(server.processIdentifier, SIGINT)
server.waitUntilExit()
exit(delivered == 0 ? 1 : 0)
