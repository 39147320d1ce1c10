import Dispatch
public import EntitlementsMessages
public import EntitlementsServer
import EntitlementsStore
import Logging
public import NIOCore
public import ServiceLifecycle
import Synchronization

/// The safety net for App Store notifications that never came (docs/ingestion.md, "Missed
/// notifications"): which subscription chains the App Store Server API is asked about again.
/// Pure: a customer's record and the time in, the chains due out.
public struct AppStoreRecheckRule: Sendable {
    /// A chain that is due, and why.
    public struct Due: Sendable, Hashable {
        public var customerId: String
        public var originalTransactionId: String
        /// The chain's latest transaction: the id Apple is asked about.
        public var transactionId: String
        public var environment: Environment
        /// `missed_period_end`: the period ended and nothing was heard of the chain since;
        /// `billing_retry`: in billing retry (or its grace period) and not heard of for a day.
        public var reason: String
    }

    /// How long after a period's end its renewal or expiry notice may still come (Apple
    /// renews up to a day before the end and notifies at once; a day of retries follows a
    /// failed delivery).
    public var margin: Int64 = 3_600_000
    /// How often a chain in billing retry is read again while nothing is heard of it.
    public var retryEvery: Int64 = 86_400_000
    /// How long after its period's end a chain is still watched (Apple's billing retry
    /// lasts up to 60 days).
    public var lookback: Int64 = 60 * 86_400_000

    public init() {}

    public func due(_ record: CustomerRecord, now: Int64) -> [Due] {
        guard let customerId = record.id else { return [] }
        var latest: [String: Transaction] = [:]
        for transaction in record.transactions where transaction.store == .appstore && transaction.expirationDate != nil {
            guard let chain = transaction.originalTransactionId else { continue }
            if let known = latest[chain], (known.expirationDate ?? 0) >= (transaction.expirationDate ?? 0) {
                continue
            }
            latest[chain] = transaction
        }
        var due: [Due] = []
        for (chain, transaction) in latest.sorted(by: { $0.key < $1.key }) {
            let end = transaction.expirationDate ?? 0
            guard transaction.revocationDate == nil, end < now - self.margin, end > now - self.lookback, let transactionId = transaction.transactionId else {
                continue  // running, refunded, or long over
            }
            let state = record.subscriptions.first { $0.store == .appstore && $0.originalTransactionId == chain }
            if state?.endedDate != nil {
                continue
            }
            let heard = state?.eventDate ?? 0
            let reason: String
            if heard < end {
                reason = "missed_period_end"
            } else if state?.isInBillingRetry == true, heard < now - self.retryEvery {
                reason = "billing_retry"
            } else {
                continue
            }
            due.append(Due(customerId: customerId, originalTransactionId: chain, transactionId: transactionId, environment: transaction.environment, reason: reason))
        }
        return due
    }
}

/// Runs the safety net with the App Store Server API (`--appstore-recheck-interval`): every
/// interval it scans the customers for chains ``AppStoreRecheckRule`` says are due and reads
/// each from Apple, at most `perMinute` reads a minute, recording what Apple says as a
/// notification would. Counted in `entitlements_appstore_rechecks_total{reason, outcome}`.
public struct AppStoreRecheck: Service {
    let ingestion: WebhookIngestion
    let api: AppStoreServerAPI
    let methods: EntitlementMethods
    let eventLoop: any EventLoop
    let interval: Duration
    let perMinute: Int
    let rule = AppStoreRecheckRule()
    private let logger = Logger(label: "entitlements.appstore")

    /// nil when `ingestion` has no App Store Server API.
    public init?(ingestion: WebhookIngestion, methods: EntitlementMethods, eventLoop: any EventLoop, interval: Duration, perMinute: Int) {
        guard let api = ingestion.appStoreAPI, ingestion.appStore != nil, interval > .zero, perMinute > 0 else {
            return nil
        }
        self.ingestion = ingestion
        self.api = api
        self.methods = methods
        self.eventLoop = eventLoop
        self.interval = interval
        self.perMinute = perMinute
    }

    public func run() async throws {
        try await cancelWhenGracefulShutdown {
            // Chains not to ask about again before an instant: a day for those Apple did
            // not list or know, an hour for those whose read failed.
            var quiet: [String: Int64] = [:]
            while !Task.isCancelled {
                let started = ContinuousClock.now
                await self.pass(quiet: &quiet)
                let next = started + self.interval
                if next > ContinuousClock.now {
                    try? await Task.sleep(until: next)
                }
            }
        }
    }

    /// One scan and the reads it finds due, paced to `perMinute`.
    func pass(quiet: inout [String: Int64]) async {
        let now = WallClock.unixMilliseconds()
        quiet = quiet.filter { $0.value > now }
        let budget = max(1, Int(Double(self.perMinute) * max(self.interval / .seconds(60), 1)))
        let skip = quiet
        let stop = StopFlag()
        let scanned: Result<(due: [AppStoreRecheckRule.Due], customers: Int, milliseconds: Int64), any Error> = await withTaskCancellationHandler {
            await self.scan(now: now, budget: budget, skip: skip, stop: stop)
        } onCancel: {
            stop.flag.store(true, ordering: .relaxed)  // shutdown: the scan stops at its next record
        }
        let due: [AppStoreRecheckRule.Due]
        switch scanned {
        case .success(let scan):
            due = scan.due
            self.logger.info("App Store recheck: scanned", metadata: ["customers": "\(scan.customers)", "due": "\(due.count)", "ms": "\(scan.milliseconds)"])
        case .failure(let error):
            self.logger.warning("App Store recheck: the scan failed", metadata: ["why": "\(error)"])
            return
        }
        let pause = Duration.seconds(60) / self.perMinute
        for chain in due {
            if Task.isCancelled {
                return
            }
            if self.api.http(chain.environment).backingOffUntil != nil {
                continue  // that host's chains wait for the next pass, after its back-off
            }
            let outcome = await self.ingestion.recheckAppStore(chain, api: self.api, methods: self.methods, on: self.eventLoop)
            switch outcome {
            case "applied", "unchanged":
                break
            case "retry":
                quiet[chain.originalTransactionId] = WallClock.unixMilliseconds() + 3_600_000
            default:
                // Not listed, unknown, no renewal info, gone: again in a day.
                quiet[chain.originalTransactionId] = WallClock.unixMilliseconds() + self.rule.retryEvery
            }
            try? await Task.sleep(for: pause)
        }
    }

    /// Reads every customer on a thread of its own (the reads are blocking), until
    /// `budget` chains are due or `stop` is set.
    private func scan(now: Int64, budget: Int, skip: [String: Int64], stop: StopFlag) async -> Result<(due: [AppStoreRecheckRule.Due], customers: Int, milliseconds: Int64), any Error> {
        let rule = self.rule
        let methods = self.methods
        return await withCheckedContinuation { continuation in
            DispatchQueue(label: "entitlements.appstore-recheck").async {
                let clock = ContinuousClock.now
                var due: [AppStoreRecheckRule.Due] = []
                var customers = 0
                let result = Result { () throws -> (due: [AppStoreRecheckRule.Due], customers: Int, milliseconds: Int64) in
                    try methods.forEachCustomer { record in
                        customers += 1
                        due += rule.due(record, now: now).filter { skip[$0.originalTransactionId] == nil }
                        return due.count < budget && !stop.flag.load(ordering: .relaxed)
                    }
                    let elapsed = ContinuousClock.now - clock
                    return (due: due, customers: customers, milliseconds: elapsed.components.seconds * 1000 + elapsed.components.attoseconds / 1_000_000_000_000_000)
                }
                continuation.resume(returning: result)
            }
        }
    }
}

extension WebhookIngestion {
    /// Reads one due chain from Apple and records what it says for the chain's customer;
    /// returns the outcome it was counted under.
    func recheckAppStore(_ chain: AppStoreRecheckRule.Due, api: AppStoreServerAPI, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> String {
        let outcome: String
        defer {
            self.increment("entitlements_appstore_rechecks_total", [("reason", chain.reason), ("outcome", outcome)])
        }
        guard let appStore = self.appStore else {
            outcome = "retry"  // not reached: the recheck runs only with the App Store set up
            return outcome
        }
        let reads: [AppStoreRead]
        do {
            (reads, _, _) = try await self.firstAppStoreApp(bundleIds: appStore.notifications.bundleIds.sorted(), environments: [chain.environment]) { bundleId, environment in
                try await self.appStoreStatuses(
                    api, transactionId: chain.transactionId, bundleId: bundleId, environment: environment, chain: chain.originalTransactionId, onlyNews: false,
                    catalogContains: methods.catalogContains
                )
            }
        } catch let rejection as IngestionRejection {
            // Apple does not know it (or its answer does not verify): asked again in a day.
            self.logger.warning("App Store recheck: not read", metadata: ["chain": "\(chain.originalTransactionId)", "why": "\(rejection.message)"])
            outcome = rejection.reason.rawValue
            return outcome
        } catch {
            // Apple unreachable or throttling: the next pass asks again, after the back-off.
            self.logger.warning("App Store recheck: the read failed", metadata: ["chain": "\(chain.originalTransactionId)", "why": "\(error)"])
            outcome = "retry"
            return outcome
        }
        let writes = reads.filter { $0.original == chain.originalTransactionId }.flatMap(\.writes)
        guard !writes.isEmpty else {
            outcome = "not_listed"
            return outcome
        }
        // The customer may have been deleted, or the chain moved, since the scan: then the
        // read is dropped (written, it would bring the customer back).
        let holds = { [chain] () throws in
            let found = try? methods.customerRecord(chain.customerId, StoreEventApplier.context(on: eventLoop)).get()
            guard let record = found ?? nil, record.id == chain.customerId,
                record.transactions.contains(where: { $0.store == .appstore && $0.originalTransactionId == chain.originalTransactionId })
            else {
                throw IngestionRejection(.missingField, "the chain \(chain.originalTransactionId) is no longer \(chain.customerId)'s")
            }
        }
        let state = writes.contains { write in
            if case .state = write { return true }
            return false
        }
        let plan = StoreEventPlan.apply(identity: .user(chain.customerId, storeCustomer: nil), writes: writes)
        let result = await CallContext.$storeSource.withValue(WriteSource(method: "appstore_recheck", caller: "server")) {
            await self.run(plan, methods: methods, on: eventLoop, verify: holds)
        }
        switch result {
        case .applied(let applied) where !state:
            // Apple gave no renewal info: nothing says the chain was heard of, so it would
            // stay due; asked again in a day.
            outcome = applied.changed ? "applied_without_state" : "no_renewal_info"
        case .applied(let applied):
            outcome = applied.changed ? "applied" : "unchanged"
        case .ignored:
            outcome = "unchanged"
        case .rejected(let rejection) where rejection.message.hasPrefix("the chain "):
            outcome = "gone"
        case .rejected(let rejection):
            self.logger.warning("App Store recheck: not recorded", metadata: ["chain": "\(chain.originalTransactionId)", "why": "\(rejection.message)"])
            outcome = rejection.reason.rawValue
        case .retry(let retry):
            self.logger.warning("App Store recheck: not recorded", metadata: ["chain": "\(chain.originalTransactionId)", "why": "\(retry.message)"])
            outcome = "retry"
        }
        return outcome
    }
}

/// Set once to ask a scan on another thread to stop.
final class StopFlag: Sendable {
    let flag = Atomic<Bool>(false)
}
