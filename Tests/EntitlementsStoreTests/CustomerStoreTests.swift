import EntitlementsMessages
import EntitlementsResolver
import Foundation
import Testing

@testable import EntitlementsStore

/// A small world for the write rules: a catalog and a snapshot with two customers.
enum WriteWorld {
    static let catalog = Catalog(products: [
        Product(id: "monthly", type: .subscription, period: .monthly, entitlements: ["premium"]),
        Product(id: "lifetime", type: .nonConsumable, entitlements: ["premium", "pro"]),
    ])

    /// alice (alias "anon-a") and bob, with nothing bought.
    static func snapshot(in scratch: borrowing ScratchDirectory, name: String = "seed.snap") throws -> String {
        let path = scratch.file(name)
        var writer = try SnapshotWriter(path: path, catalog: Self.catalog, createdDate: now)
        try writer.append(CustomerRecord(id: "alice", aliases: ["anon-a"]))
        try writer.append(CustomerRecord(id: "bob"))
        try writer.finish(hotList: ["alice"])
        return path
    }

    static func purchase(_ user: String, _ transactionId: String, product: String = "monthly", revoked: Int64? = nil) -> LogRecord.Mutation {
        .recordTransaction(RecordTransactionRequest(
            userId: user,
            transaction: Transaction(
                transactionId: transactionId,
                store: .appstore,
                productId: product,
                transactionDate: now - day,
                expirationDate: product == "monthly" ? now + 29 * day : nil,
                revocationDate: revoked,
                environment: .production,
                type: product == "monthly" ? .subscriptionStarted : .nonConsumablePurchase
            )
        ))
    }
}

extension CustomerStore {
    /// Writes and waits for the outcome.
    func write(_ mutation: LogRecord.Mutation, at instant: Int64 = now) async throws -> WriteOutcome {
        try await withCheckedThrowingContinuation { continuation in
            self.write(mutation, now: instant) { continuation.resume(with: $0) }
        }
    }

    func isActive(_ user: String, _ entitlement: String = "premium", at instant: Int64 = now) throws -> Bool {
        let resolution = EntitlementResolver(catalog: self.catalog).resolve(try self.customer(for: user), at: instant)
        return resolution.entitlements.first { $0.id == entitlement }?.isActive ?? false
    }
}

@Suite("write rules")
struct CustomerMutationTests {
    /// Applies mutations to an in-memory world, as the store does.
    struct World {
        var customers: [String: CustomerRecord] = ["alice": CustomerRecord(id: "alice", aliases: ["anon-a"]), "bob": CustomerRecord(id: "bob")]

        func lookup(_ userId: String) -> CustomerRecord? {
            self.customers[userId] ?? self.customers.values.first { $0.aliases.contains(userId) }
        }

        mutating func apply(_ mutation: LogRecord.Mutation, now instant: Int64 = now) throws -> WriteEffect {
            let snapshot = self
            let effect = try CustomerMutation(catalog: ProductCatalog(WriteWorld.catalog), lookup: { snapshot.lookup($0) }).effect(of: mutation, now: instant)
            for (id, record) in effect.records {
                self.customers[id] = record
            }
            return effect
        }
    }

    @Test("the same transaction twice is one transaction; a revocation date is a refund, clearing it a reversal")
    func idempotentRefundReversal() throws {
        var world = World()
        let first = try world.apply(WriteWorld.purchase("alice", "t1"))
        #expect(first.changed && !first.created)
        #expect(try !world.apply(WriteWorld.purchase("alice", "t1")).changed)
        #expect(world.customers["alice"]?.transactions.count == 1)
        let refund = try world.apply(WriteWorld.purchase("alice", "t1", revoked: now))
        #expect(refund.changed)
        #expect(world.customers["alice"]?.transactions.first?.revocationDate == now)
        let reversal = try world.apply(WriteWorld.purchase("alice", "t1"))
        #expect(reversal.changed)
        #expect(world.customers["alice"]?.transactions.first?.revocationDate == nil)
        // Through the alias, the same customer.
        #expect(try world.apply(WriteWorld.purchase("anon-a", "t2")).customerId == "alice")
    }

    @Test("keep_revocation: a stored refund stays whatever the request says; a new transaction is recorded as given")
    func keepRevocation() throws {
        var world = World()
        guard case .recordTransaction(var request) = WriteWorld.purchase("alice", "t1") else {
            return
        }
        request.keepRevocation = true
        #expect(try world.apply(.recordTransaction(request)).changed)
        _ = try world.apply(WriteWorld.purchase("alice", "t1", revoked: now))
        let again = try world.apply(.recordTransaction(request))  // the payment delivered again
        #expect(!again.changed)
        #expect(world.customers["alice"]?.transactions.first?.revocationDate == now)
        guard case .recordTransaction(let logged) = again.logged else {
            return
        }
        #expect(logged.transaction?.revocationDate == now, "logged as applied, so replay gives the same")
    }

    @Test("verified: the store's record completes what a caller wrote; a caller then changes only the revocation")
    func verifiedOutranksCaller() throws {
        var world = World()
        func write(_ mutate: (inout Transaction) -> Void) throws -> WriteEffect {
            guard case .recordTransaction(var request) = WriteWorld.purchase("alice", "t1") else {
                Issue.record("WriteWorld.purchase is a RecordTransaction")
                throw CancellationError()
            }
            mutate(&request.transaction!)
            return try world.apply(.recordTransaction(request))
        }
        #expect(try write { $0.expirationDate = now + 6 * day }.changed, "the app's guess: a week, no price")
        let completed = try write {
            $0.verified = true
            $0.priceMicros = 4_990_000
            $0.currency = "USD"
        }
        #expect(completed.changed)
        var stored = try #require(world.customers["alice"]?.transactions.first)
        #expect(stored.verified && stored.expirationDate == now + 29 * day && stored.priceMicros == 4_990_000)
        guard case .recordTransaction(let logged) = completed.logged else {
            Issue.record("a RecordTransaction logs a RecordTransaction")
            return
        }
        #expect(logged.transaction == stored, "logged as applied, so replay gives the same")

        #expect(try !write { $0.expirationDate = now + 6 * day }.changed, "the caller's write again: the store's record stands")
        stored = try #require(world.customers["alice"]?.transactions.first)
        #expect(stored.expirationDate == now + 29 * day && stored.verified)
        let refund = try write {
            $0.expirationDate = now + 6 * day
            $0.revocationDate = now
        }
        #expect(refund.changed, "a refund by hand applies")
        stored = try #require(world.customers["alice"]?.transactions.first)
        #expect(stored.revocationDate == now && stored.expirationDate == now + 29 * day && stored.verified)
        #expect(try !write { $0.expirationDate = now + 6 * day }.changed, "the caller's first guess again does not undo the refund")
        #expect(world.customers["alice"]?.transactions.first?.revocationDate == now)
        let reversal = try write {
            $0 = stored
            $0.verified = false
            $0.revocationDate = nil
        }
        #expect(reversal.changed, "a reversal that repeats the store's record applies")
        #expect(world.customers["alice"]?.transactions.first?.revocationDate == nil)
        _ = try write {
            $0.expirationDate = now + 6 * day
            $0.revocationDate = now
        }
        #expect(throws: WriteRefusal.self, "a verified record of other values is refused, as ever") {
            try write {
                $0.verified = true
                $0.revocationDate = now
                $0.expirationDate = now + 40 * day
            }
        }
    }

    @Test("event_date: an older state changes nothing; a newer or undated one replaces it")
    func stateOrder() throws {
        var world = World()
        func state(renews: Bool, at date: Int64?) -> LogRecord.Mutation {
            .updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "alice", state: SubscriptionState(
                store: .stripe, originalTransactionId: "sub_1", autoRenewEnabled: renews, eventDate: date
            )))
        }
        #expect(try world.apply(state(renews: false, at: 200)).changed)
        #expect(try !world.apply(state(renews: true, at: 100)).changed)
        #expect(world.customers["alice"]?.subscriptions.first?.autoRenewEnabled == false)
        #expect(try world.apply(state(renews: true, at: 300)).changed)
        #expect(try world.apply(state(renews: false, at: nil)).changed)
        #expect(world.customers["alice"]?.subscriptions.first?.autoRenewEnabled == false)
    }

    @Test("auto_renew_disabled_date: kept while auto-renew stays off, and learnt from the latest off state whatever the order of delivery")
    func autoRenewDisabledDate() throws {
        func state(renews: Bool, disabled: Int64?, at date: Int64) -> LogRecord.Mutation {
            .updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "dan", state: SubscriptionState(
                store: .appstore, originalTransactionId: "1000", autoRenewEnabled: renews, autoRenewDisabledDate: disabled, eventDate: date
            )))
        }
        // Off at 100, on at 200, off at 300, expired (off, undated) at 400: every order ends off since 300.
        let events = [state(renews: false, disabled: 100, at: 100), state(renews: true, disabled: nil, at: 200),
                      state(renews: false, disabled: 300, at: 300), state(renews: false, disabled: nil, at: 400)]
        var finals: Set<String> = []
        for order in [[0, 1, 2, 3], [3, 2, 1, 0], [3, 0, 1, 2], [3, 0, 2, 1], [1, 3, 0, 2], [2, 3, 0, 1]] {
            var world = World()
            for index in order {
                _ = try world.apply(events[index])
            }
            let stored = world.customers["dan"]?.subscriptions.first
            #expect(stored?.autoRenewEnabled == false && stored?.autoRenewDisabledDate == 300 && stored?.eventDate == 400, "order \(order): \(String(describing: stored))")
            finals.insert("\(String(describing: stored))")
        }
        #expect(finals.count == 1)
        // An older off state with an earlier date changes nothing.
        var world = World()
        _ = try world.apply(events[3])
        _ = try world.apply(events[2])
        #expect(try !world.apply(events[0]).changed)
        // Off at 100, back on at 200, off again undated at 400: the date of 100 is not kept.
        for order in [[0, 1, 3], [0, 3, 1], [3, 0, 1]] {
            var world = World()
            for index in order {
                _ = try world.apply(events[index])
            }
            #expect(world.customers["dan"]?.subscriptions.first?.autoRenewDisabledDate == nil, "order \(order)")
        }
        // Undated states (manual writes, logs from before event_date) inherit nothing.
        var manual = World()
        _ = try manual.apply(.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "eve", state: SubscriptionState(
            store: .appstore, originalTransactionId: "1", autoRenewEnabled: false, autoRenewDisabledDate: 100
        ))))
        _ = try manual.apply(.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "eve", state: SubscriptionState(
            store: .appstore, originalTransactionId: "1", autoRenewEnabled: false
        ))))
        #expect(manual.customers["eve"]?.subscriptions.first?.autoRenewDisabledDate == nil)
    }

    @Test("ended_date: running transactions of the chain are revoked at the end, those recorded later too, and the end stays")
    func chainEnd() throws {
        var world = World()
        func period(_ id: String, from start: Int64) -> LogRecord.Mutation {
            .recordTransaction(RecordTransactionRequest(userId: "bob", transaction: Transaction(
                originalTransactionId: "sub_9", transactionId: id, store: .stripe, productId: "monthly",
                transactionDate: start, expirationDate: start + 30 * day, type: .subscriptionStarted
            ), keepRevocation: true))
        }
        func state(ended: Int64?, at date: Int64) -> LogRecord.Mutation {
            var state = SubscriptionState(store: .stripe, originalTransactionId: "sub_9", eventDate: date)
            state.endedDate = ended
            return .updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "bob", state: state))
        }
        _ = try world.apply(period("in_1", from: now - 40 * day))  // over before the end
        _ = try world.apply(period("in_2", from: now - 10 * day))
        #expect(try world.apply(state(ended: now, at: now)).changed)
        #expect(world.customers["bob"]?.transactions.map(\.revocationDate) == [nil, now])
        _ = try world.apply(period("in_3", from: now - day))  // paid before the end, delivered after it
        #expect(world.customers["bob"]?.transactions.last?.revocationDate == now)
        #expect(try world.apply(state(ended: nil, at: now + 1)).changed)  // a later state that does not say so
        #expect(world.customers["bob"]?.subscriptions.first?.endedDate == now)
    }

    @Test("a known transaction with other values than its revocation date is refused, naming them")
    func changedTransactionRefused() throws {
        var world = World()
        _ = try world.apply(WriteWorld.purchase("alice", "t1"))
        #expect {
            try world.apply(WriteWorld.purchase("alice", "t1", product: "lifetime"))
        } throws: { error in
            let refusal = error as! WriteRefusal
            return refusal.reason == .failedPrecondition && refusal.message.contains("product_id, expiration_date")
        }
    }

    @Test("invalid writes name the field", arguments: [
        (LogRecord.Mutation.recordTransaction(RecordTransactionRequest(userId: "", transaction: Transaction())), "user_id: required"),
        (.recordTransaction(RecordTransactionRequest(userId: "u")), "transaction: required"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .appstore, productId: "nope", transactionDate: now))),
            "transaction.product_id: \"nope\" is not in the catalog"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", productId: "monthly", transactionDate: now))), "transaction.store: required"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly"))), "transaction.transaction_date: required"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly", transactionDate: now, expirationDate: now - 1, type: .subscriptionStarted))),
            "transaction.expiration_date:"),
        // The schema's rules: a store's transaction, a type, an expiration unless lifetime.
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .manual, productId: "monthly", transactionDate: now, expirationDate: now + day, type: .subscriptionStarted))),
            "transaction.store: must be APPSTORE, PLAYSTORE or STRIPE, got MANUAL"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly", transactionDate: now, expirationDate: now + day))),
            "transaction.type: required"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly", transactionDate: now, type: .subscriptionStarted))),
            "transaction.expiration_date: required for a SUBSCRIPTION_STARTED transaction"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "lifetime", transactionDate: now, expirationDate: now + day, type: .nonConsumablePurchase))),
            "transaction.expiration_date: must be absent for a NON_CONSUMABLE_PURCHASE"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly", transactionDate: now, expirationDate: now + day, type: .subscriptionStarted, priceMicros: 9_990_000, currency: "usd"))),
            "transaction.currency: must be an ISO 4217 code in upper case"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly", transactionDate: now, expirationDate: now + day, type: .subscriptionStarted, priceMicros: 9_990_000))),
            "transaction.price_micros and transaction.currency go together"),
        (.recordTransaction(RecordTransactionRequest(userId: "u", transaction: Transaction(transactionId: "t", store: .stripe, productId: "monthly", transactionDate: now, expirationDate: now + day, type: .subscriptionStarted, priceMicros: -1, currency: "USD"))),
            "transaction.price_micros: must not be negative"),
        (.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "u", state: SubscriptionState(store: .manual, originalTransactionId: "t"))),
            "state.store: must be APPSTORE, PLAYSTORE or STRIPE, got MANUAL"),
        (.grantEntitlement(GrantEntitlementRequest(userId: "u", grant: Grant(grantId: "g"))), "grant.entitlement_id: required"),
        (.grantEntitlement(GrantEntitlementRequest(userId: "u", grant: Grant(grantId: "g", entitlementId: "pro", grantedDate: now, expirationDate: now))), "grant.expiration_date:"),
        (.updateSubscriptionState(UpdateSubscriptionStateRequest(userId: "u", state: SubscriptionState(store: .appstore))), "state.original_transaction_id: required"),
        (.linkAlias(LinkAliasRequest(userId: "alice", alias: String(repeating: "x", count: 257))), "alias: must be at most 256 bytes, got 257"),
        (.linkAlias(LinkAliasRequest(userId: "alice", alias: "alice")), "alias: \"alice\" is the customer's own id"),
        // Not NFC: "é" as "e" and U+0301 is the same String as "é" (U+00E9), with other bytes.
        (.linkAlias(LinkAliasRequest(userId: "alice", alias: "ame\u{301}lie")), "alias: must be in Unicode Normalization Form C (NFC)"),
        (.grantEntitlement(GrantEntitlementRequest(userId: "Zoe\u{308}", grant: Grant(grantId: "g", entitlementId: "pro"))), "user_id: must be in Unicode Normalization Form C (NFC)"),
        (WriteWorld.purchase("alice", "t\u{2126}"), "transaction.transaction_id: must be in Unicode Normalization Form C (NFC)"),
    ])
    func invalid(mutation: LogRecord.Mutation, message: String) throws {
        var world = World()
        #expect {
            try world.apply(mutation)
        } throws: { error in
            let refusal = error as! WriteRefusal
            return refusal.reason == .invalidArgument && refusal.message.hasPrefix(message)
        }
    }

    @Test("a logged write with an id that is not NFC (admitted before the NFC rule) still replays")
    func replaysIdsThatAreNotNFC() throws {
        let world = World()
        let grant = LogRecord.Mutation.grantEntitlement(GrantEntitlementRequest(userId: "Zoe\u{308}", grant: Grant(grantId: "g", entitlementId: "pro")))
        let replay = CustomerMutation(catalog: ProductCatalog(WriteWorld.catalog), replaying: true, lookup: { world.lookup($0) })
        let effect = try replay.effect(of: grant, now: now)
        #expect(effect.created && Array(effect.customerId.utf8) == Array("Zoe\u{308}".utf8))
        #expect {
            try CustomerMutation(catalog: ProductCatalog(WriteWorld.catalog), lookup: { world.lookup($0) }).effect(of: grant, now: now)
        } throws: { error in
            (error as! WriteRefusal).reason == .invalidArgument
        }
    }

    @Test("an alias another customer owns needs transfer; transfer moves it; a customer id is never an alias")
    func aliasTransfer() throws {
        var world = World()
        #expect {
            try world.apply(.linkAlias(LinkAliasRequest(userId: "bob", alias: "anon-a")))
        } throws: { error in
            (error as! WriteRefusal) == WriteRefusal(.failedPrecondition, "alias: \"anon-a\" belongs to customer \"alice\"; set transfer to move it")
        }
        let moved = try world.apply(.linkAlias(LinkAliasRequest(userId: "bob", alias: "anon-a", transfer: true)))
        #expect(moved.aliases == ["anon-a": "bob"])
        #expect(world.customers["alice"]?.aliases == [])
        #expect(world.customers["bob"]?.aliases == ["anon-a"])
        #expect(try !world.apply(.linkAlias(LinkAliasRequest(userId: "bob", alias: "anon-a"))).changed)
        #expect {
            try world.apply(.linkAlias(LinkAliasRequest(userId: "bob", alias: "alice", transfer: true)))
        } throws: { error in
            (error as! WriteRefusal).reason == .failedPrecondition
        }
    }

    @Test("the first write creates a customer; revoking an unknown grant is NOT_FOUND; delete removes the aliases too")
    func createRevokeDelete() throws {
        var world = World()
        let granted = try world.apply(.grantEntitlement(GrantEntitlementRequest(userId: "carol", grant: Grant(grantId: "g1", entitlementId: "pro"))))
        #expect(granted.created && granted.customerId == "carol")
        #expect(world.customers["carol"]?.grants.first?.grantedDate == now)  // defaulted, and logged so
        guard case .grantEntitlement(let logged) = granted.logged else {
            Issue.record("logged \(granted.logged)")
            return
        }
        #expect(logged.grant?.grantedDate == now)
        // A retry later, without a date, is the same grant: nothing changes.
        #expect(try !world.apply(.grantEntitlement(GrantEntitlementRequest(userId: "carol", grant: Grant(grantId: "g1", entitlementId: "pro"))), now: now + day).changed)
        #expect {
            try world.apply(.revokeGrant(RevokeGrantRequest(userId: "carol", grantId: "g2")))
        } throws: { error in
            (error as! WriteRefusal) == WriteRefusal(.notFound, "grant_id: customer \"carol\" has no grant \"g2\"")
        }
        #expect(try world.apply(.revokeGrant(RevokeGrantRequest(userId: "carol", grantId: "g1", revokedDate: now + 1))).changed)
        #expect(try !world.apply(.revokeGrant(RevokeGrantRequest(userId: "carol", grantId: "g1", revokedDate: now + 1))).changed)
        #expect(try !world.apply(.revokeGrant(RevokeGrantRequest(userId: "carol", grantId: "g1")), now: now + day).changed)
        let deleted = try world.apply(.deleteCustomer(DeleteCustomerRequest(userId: "anon-a")))
        #expect(deleted.customerId == "alice")
        #expect(deleted.records.count == 1 && deleted.records["alice"] == .some(CustomerRecord?.none))
        #expect(deleted.aliases.count == 1 && deleted.aliases["anon-a"] == .some(String?.none))
        #expect(try !world.apply(.deleteCustomer(DeleteCustomerRequest(userId: "nobody"))).changed)
    }
}

@Suite("customer store")
struct CustomerStoreTests {
    @Test("an acknowledged write is visible at once and after reopening (log replay)")
    func writeAndReplay() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        do {
            let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            #expect(report.seeded)
            #expect(try !store.isActive("alice"))
            let outcome = try await store.write(WriteWorld.purchase("anon-a", "t1"))
            #expect(outcome.sequence == 1 && outcome.changed && outcome.customerId == "alice")
            #expect(outcome.committed?.before["alice"] == .some(CustomerRecord(id: "alice", aliases: ["anon-a"])))
            #expect(try store.isActive("alice") && store.isActive("anon-a"))
            _ = try await store.write(.linkAlias(LinkAliasRequest(userId: "bob", alias: "anon-a", transfer: true)))
            _ = try await store.write(.deleteCustomer(DeleteCustomerRequest(userId: "bob")))
            #expect(try store.customer(for: "anon-a") == nil)
            #expect(try store.customer(for: "bob") == nil)
            let again = try await store.write(WriteWorld.purchase("alice", "t1"))
            #expect(!again.changed && again.sequence == nil)
            store.close()
        }
        let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(!report.seeded && report.replayedRecords == 3)
        #expect(try store.isActive("alice"))
        #expect(try store.customer(for: "anon-a") == nil && store.customer(for: "bob") == nil)
        store.close()
    }

    /// The disk refuses the log's write (the segment's descriptor is pointed at /dev/full,
    /// which fails every write with ENOSPC): the write is answered UNAVAILABLE saying its
    /// outcome is unknown until a restart, later writes are refused, reads go on, and the
    /// store opens again with every acknowledged write.
    @Test("a log whose write fails: the write's outcome is unknown, later writes are refused, acknowledged ones survive")
    func logWriteFails() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        do {
            let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            _ = try await store.write(WriteWorld.purchase("alice", "t1"))
            let segment = try #require(try Self.openDescriptor { $0.hasPrefix(directory + "/") && $0.hasSuffix(".wal") })
            let full = open("/dev/full", O_WRONLY)
            #expect(full >= 0 && dup2(full, segment) == segment)
            close(full)
            await #expect {
                try await store.write(WriteWorld.purchase("bob", "t2"))
            } throws: { error in
                let refusal = error as? WriteRefusal
                return refusal?.reason == .unavailable && refusal?.message.hasPrefix("the write may or may not be stored: the log failed while storing it") == true
                    && refusal?.message.contains("after a restart") == true
            }
            await #expect {
                try await store.write(WriteWorld.purchase("bob", "t3"))
            } throws: { error in
                (error as? WriteRefusal)?.reason == .unavailable && "\(error)".hasPrefix("the log failed") && "\(error)".contains("restart")
            }
            #expect(try store.isActive("alice") && !store.isActive("bob"))
            store.close()
        }
        let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(report.replayedRecords == 1)
        #expect(try store.isActive("alice") && !store.isActive("bob"))
        store.close()
    }

    /// The first descriptor of this process whose target path satisfies `matches`.
    static func openDescriptor(where matches: (String) -> Bool) throws -> Int32? {
        for name in try FileManager.default.contentsOfDirectory(atPath: "/proc/self/fd") {
            if let fd = Int32(name), let target = try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/self/fd/\(name)"), matches(target) {
                return fd
            }
        }
        return nil
    }

    /// A log written before the NFC rule may name "Zoe\u{308}"; a write of "Zo\u{EB}" (its
    /// NFC spelling, one Swift String with it) is another customer. Before the overlay was
    /// keyed by bytes, the write found and changed the old record, and compaction folded
    /// the two into one.
    @Test("a customer logged under an id that is not NFC stays apart from its NFC spelling, through writes, compaction and reopening")
    func legacyIdsNotNFC() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        let (decomposed, composed) = ("Zoe\u{308}", "Zo\u{EB}")
        func grants(_ store: CustomerStore, _ id: String) throws -> [String] {
            let record = try store.customer(for: id)
            #expect(record?.id.map { Array($0.utf8) } == Array(id.utf8))
            return record?.grants.compactMap(\.grantId) ?? []
        }
        do {
            let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            store.close()
            // What a binary before the rule logged (this one refuses the write itself).
            let (log, _) = try WriteAheadLog.open(directory: directory + "/" + CustomerStore.logDirectoryName)
            _ = try await log.append(.grantEntitlement(GrantEntitlementRequest(userId: decomposed, grant: Grant(grantId: "old", entitlementId: "pro", grantedDate: now))), recordedDate: now)
            log.closeAndWait()
        }
        do {
            let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
            #expect(report.replayedRecords == 1)
            let written = try await store.write(.grantEntitlement(GrantEntitlementRequest(userId: composed, grant: Grant(grantId: "new", entitlementId: "pro", grantedDate: now))))
            #expect(written.created && Array(written.customerId.utf8) == Array(composed.utf8))
            #expect(try grants(store, decomposed) == ["old"] && grants(store, composed) == ["new"])
            _ = try await store.compact(hotList: [], now: now)
            #expect(try grants(store, decomposed) == ["old"] && grants(store, composed) == ["new"])
            store.close()
            // Compaction ran on a worker thread that may still hold the store for a moment:
            // release the directory now, as a server that reopens it does.
            store.unlock()
        }
        let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(try grants(store, decomposed) == ["old"] && grants(store, composed) == ["new"])
        store.close()
    }

    @Test("a second server on the same data directory is refused")
    func locked() throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let (store, _) = try CustomerStore.open(dataDirectory: scratch.file("data"), seed: seed)
        #expect {
            try CustomerStore.open(dataDirectory: scratch.file("data"), seed: seed)
        } throws: { error in
            "\(error)".contains("another server is using this data directory")
        }
        store.close()
    }

    @Test("a data directory without a snapshot and no seed says how to seed it")
    func noSnapshot() throws {
        let scratch = try ScratchDirectory()
        #expect {
            try CustomerStore.open(dataDirectory: scratch.file("data"), seed: nil)
        } throws: { error in
            "\(error)".hasSuffix("the data directory has no snapshot; start once with --snapshot FILE to seed it")
        }
    }

    @Test("compaction: a new snapshot holds every write, covered segments go, writes during it survive")
    func compaction() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        do {
            let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            _ = try await store.write(WriteWorld.purchase("alice", "t1"))
            _ = try await store.write(.grantEntitlement(GrantEntitlementRequest(userId: "dave", grant: Grant(grantId: "g", entitlementId: "pro"))))
            _ = try await store.write(.deleteCustomer(DeleteCustomerRequest(userId: "bob")))
            // Writes racing the compaction.
            async let racing = withThrowingTaskGroup(of: Void.self) { group in
                for index in 0..<20 {
                    group.addTask { _ = try await store.write(WriteWorld.purchase("erin-\(index)", "e\(index)")) }
                }
                try await group.waitForAll()
            }
            let report = try await store.compact(hotList: ["alice"], now: now)
            try await racing
            #expect(report.lastLogSequence >= 3)
            #expect(report.removedSegments.count == 1)
            #expect(store.snapshot.header.lastLogSequence == report.lastLogSequence)
            #expect(try store.customer(for: "dave")?.grants.count == 1)
            #expect(try store.customer(for: "bob") == nil)
            for index in 0..<20 {
                #expect(try store.isActive("erin-\(index)"))
            }
            store.close()
            // Compaction ran on a worker thread that may still hold the store for a moment:
            // release the directory now, as a server that reopens it does.
            store.unlock()
        }
        let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(report.replayedRecords + report.skippedRecords <= 23)
        #expect(try store.isActive("alice") && store.isActive("dave", "pro"))
        #expect(try store.customer(for: "bob") == nil)
        for index in 0..<20 {
            #expect(try store.isActive("erin-\(index)"))
        }
        store.close()
    }

    @Test("compacting twice with no write between keeps the segment being written (and every later write)")
    func compactTwice() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        do {
            let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            _ = try await store.compact(hotList: [], now: now)
            _ = try await store.compact(hotList: [], now: now)
            _ = try await store.write(WriteWorld.purchase("alice", "t1"))
            _ = try await store.compact(hotList: [], now: now)
            _ = try await store.compact(hotList: [], now: now)
            _ = try await store.write(WriteWorld.purchase("bob", "t2"))
            store.close()
            // Compaction ran on a worker thread that may still hold the store for a moment:
            // release the directory now, as a server that reopens it does.
            store.unlock()
        }
        let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(try store.isActive("alice") && store.isActive("bob"))
        store.close()
    }

    @Test("a deleted customer's id may become another customer's alias, before and after compaction")
    func deletedIdBecomesAlias() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let (store, _) = try CustomerStore.open(dataDirectory: scratch.file("data"), seed: seed)
        _ = try await store.write(.deleteCustomer(DeleteCustomerRequest(userId: "bob")))
        _ = try await store.write(.linkAlias(LinkAliasRequest(userId: "alice", alias: "bob")))
        #expect(try store.customer(for: "bob")?.id == "alice")
        _ = try await store.compact(hotList: [], now: now)
        #expect(try store.customer(for: "bob")?.id == "alice")
        store.close()
    }

    @Test("a torn last batch is dropped at open and reported")
    func tornTail() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        do {
            let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            _ = try await store.write(WriteWorld.purchase("alice", "t1"))
            _ = try await store.write(WriteWorld.purchase("bob", "t2"))
            store.close()
        }
        let segment = directory + "/log/log-00000000000000000001.wal"
        let bytes = try Data(contentsOf: URL(fileURLWithPath: segment))
        try bytes.dropLast(3).write(to: URL(fileURLWithPath: segment))
        let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(report.tornPath == segment && report.tornBytes > 0)
        #expect(report.replayedRecords == 1)
        #expect(try store.isActive("alice") && !store.isActive("bob"))
        store.close()
    }

    @Test("a log written under the rules before format 2 still replays (MANUAL store, no type, no expiration)")
    func legacyWritesReplay() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        let legacy = LogRecord.Mutation.recordTransaction(RecordTransactionRequest(
            userId: "alice",
            transaction: Transaction(transactionId: "old-1", store: .manual, productId: "monthly", transactionDate: now - day, environment: .production)
        ))
        do {
            let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
            // Today's rules refuse it as a new write ...
            await #expect(throws: WriteRefusal.self) { try await store.write(legacy) }
            store.close()
        }
        // ... but an older binary logged it, so replay must take it.
        do {
            let (log, _) = try WriteAheadLog.open(directory: directory + "/log")
            _ = try await log.append(legacy, recordedDate: now)
            log.closeAndWait()
        }
        let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
        #expect(report.replayedRecords == 1)
        #expect(try store.customer(for: "alice")?.transactions.map(\.transactionId) == ["old-1"])
        store.close()
    }

    @Test("a side file is never replaced: a second tear at the same offset goes to the next name")
    func sideFileKept() async throws {
        let scratch = try ScratchDirectory()
        let seed = try WriteWorld.snapshot(in: scratch)
        let directory = scratch.file("data")
        let segment = directory + "/log/log-00000000000000000001.wal"
        var sideFiles: [String] = []
        for round in 0..<2 {
            do {
                let (store, _) = try CustomerStore.open(dataDirectory: directory, seed: seed)
                _ = try await store.write(WriteWorld.purchase("bob", "t-\(round)"))
                store.close()
            }
            // Cut the last batch of this round: the first round's cut leaves the segment
            // where the second round appends, so both tears start at the same offset.
            let bytes = try Data(contentsOf: URL(fileURLWithPath: segment))
            try bytes.dropLast(3 + round).write(to: URL(fileURLWithPath: segment))
            let (store, report) = try CustomerStore.open(dataDirectory: directory, seed: nil)
            sideFiles.append(try #require(report.tornSideFile))
            store.close()
        }
        #expect(sideFiles[0] != sideFiles[1], "\(sideFiles)")
        #expect(FileManager.default.fileExists(atPath: sideFiles[0]) && FileManager.default.fileExists(atPath: sideFiles[1]))
    }

    @Test("a read-only store refuses writes with a message that says why")
    func readOnly() async throws {
        let scratch = try ScratchDirectory()
        let store = CustomerStore.readOnly(try SnapshotReader(path: WriteWorld.snapshot(in: scratch)))
        await #expect {
            try await store.write(WriteWorld.purchase("alice", "t1"))
        } throws: { error in
            (error as! WriteRefusal).reason == .unavailable && "\(error)".contains("--data-dir")
        }
    }
}
