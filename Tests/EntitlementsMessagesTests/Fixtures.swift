import EntitlementsMessages

/// One value of every message with every field set (non-default, non-empty), so that a
/// field the shim forgets to encode or decode shows up as a difference.
enum Fixtures {
    static let transaction = Transaction(
        originalTransactionId: "1000000000000001",
        transactionId: "1000000000000042",
        store: .appstore,
        productId: "com.app.monthly",
        offerCode: "SPRING24",
        transactionDate: 1_767_225_600_000,
        expirationDate: 1_769_904_000_000,
        revocationDate: 1_768_000_000_000,
        environment: .sandbox,
        ownershipType: .familySharing,
        type: .introRenewed,
        priceMicros: 4_990_000,
        currency: "EUR",
        verified: true
    )

    static let subscriptionState = SubscriptionState(
        store: .playstore,
        originalTransactionId: "GPA.3345-1234-5678-90123",
        autoRenewEnabled: true,
        autoRenewDisabledDate: 1_767_000_000_000,
        billingIssueDetectedDate: 1_767_100_000_000,
        gracePeriodExpirationDate: 1_767_200_000_000,
        isInBillingRetry: true,
        eventDate: 1_767_300_000_000,
        endedDate: 1_767_400_000_000,
        cancellationReason: .priceIncrease,
        priceConsentStatus: .notified
    )

    static let grant = Grant(
        grantId: "grant-7",
        entitlementId: "premium",
        grantedDate: 1_760_000_000_000,
        expirationDate: 1_790_000_000_000,
        revokedDate: 1_780_000_000_000,
        reason: "support ticket #4521: réclamation ✓"
    )

    static let entitlement = Entitlement(
        id: "premium",
        isActive: true,
        source: .stripe,
        startedDate: 1_700_000_000_000,
        trialStartDate: 1_700_000_000_001,
        firstPurchaseDate: 1_700_000_000_002,
        lastPurchaseDate: 1_700_000_000_003,
        autoRenewDisableDate: 1_700_000_000_004,
        expirationDate: 1_700_000_000_005,
        productId: "com.app.annual",
        renewState: .billingIssue,
        renewsCount: 7,
        grantType: .offerCode,
        lastActivatedOfferCode: "WINBACK",
        transactions: [transaction, Transaction(transactionId: "2", type: .subscriptionRenewed)],
        willRenew: true,
        isInGracePeriod: true,
        isInBillingRetry: true,
        isRevoked: true,
        ownershipType: .owner,
        periodType: .intro,
        gracePeriodExpirationDate: 1_700_000_000_006,
        billingIssueDetectedDate: 1_700_000_000_007,
        cancellationReason: .billingError,
        priceMicros: 9_990_000,
        currency: "USD",
        priceConsentStatus: .agreed,
        interval: .monthly,
        status: .pastDue
    )

    static let checkRequest = CheckEntitlementsRequest(
        userId: "user-1",
        entitlementIds: ["premium", "pro"],
        at: 1_767_225_600_000,
        environment: .sandbox,
        minLogSequence: 42,
        explain: true
    )

    static let candidate = CandidateExplanation(
        kind: "chain", source: .appstore, id: "1000", productId: "com.app.monthly", counted: true, isActive: false, won: true,
        reason: "current transaction 1001 expired at 2026-02-15T09:30:00.000Z (rule 3)", end: 1_771_147_800_000
    )

    static let explanation = Explanation(
        entitlements: [EntitlementExplanation(entitlementId: "premium", candidates: [candidate], decision: "won by rule 6: the only counted candidate")],
        validUntilFrom: "expirationDate of appstore transaction 1001",
        logSequence: 42,
        snapshotId: "snap-1"
    )

    static let checkResponse = CheckEntitlementsResponse(
        userId: "$anon:abc",
        customerId: "user-1",
        requestDate: 1_767_225_600_000,
        validUntil: 1_769_904_000_000,
        entitlements: [entitlement, Entitlement(id: "pro", isActive: false)],
        logSequence: 42,
        staleForMs: 31_000,
        explanation: explanation
    )

    static let entitlementChange = EntitlementChange(
        entitlementId: "premium",
        before: EntitlementState(isActive: true, renewState: .willRenew),
        after: EntitlementState(isActive: false, renewState: .canceled)
    )

    static let recordTransaction = RecordTransactionRequest(userId: "user-1", transaction: transaction, keepRevocation: true)
    static let updateSubscriptionState = UpdateSubscriptionStateRequest(userId: "user-1", state: subscriptionState)
    static let grantEntitlement = GrantEntitlementRequest(userId: "user-1", grant: grant)
    static let revokeGrant = RevokeGrantRequest(userId: "user-1", grantId: "grant-7", revokedDate: 1_780_000_000_000)
    static let linkAlias = LinkAliasRequest(userId: "user-1", alias: "$anon:abc", transfer: true)
    static let deleteCustomer = DeleteCustomerRequest(userId: "user-1")

    static let product = Product(
        id: "com.app.monthly",
        type: .subscription,
        period: .monthly,
        entitlements: ["premium", "pro"]
    )

    static let catalog = Catalog(products: [product, Product(id: "com.app.lifetime", type: .nonConsumable)])

    /// Every message type, fully populated; `allProtobufMessageTypes` must match it.
    static let all: [any ProtobufMessage] = [
        transaction,
        subscriptionState,
        grant,
        entitlement,
        explanation,
        EntitlementExplanation(entitlementId: "premium", candidates: [candidate], decision: "won by rule 6: active beats inactive"),
        candidate,
        source,
        checkRequest,
        checkResponse,
        BatchCheckEntitlementsRequest(
            userIds: ["user-1", "user-2"],
            entitlementIds: ["premium"],
            at: 1_767_225_600_000,
            environment: .production,
            minLogSequence: 7
        ),
        BatchCheckEntitlementsResponse(results: [checkResponse, CheckEntitlementsResponse(userId: "user-2")]),
        WatchEntitlementsRequest(
            userIds: ["user-1"],
            allCustomers: true,
            entitlementIds: ["premium"],
            environment: .sandbox,
            afterLogSequence: 7
        ),
        EntitlementState(isActive: true, renewState: .nonRenewable),
        entitlementChange,
        EntitlementsChangedEvent(
            customerId: "user-1",
            cause: .time,
            changes: [entitlementChange],
            current: checkResponse,
            logSequence: 99,
            aliasesChanged: ["$anon:abc", "legacy-7"]
        ),
        recordTransaction,
        updateSubscriptionState,
        grantEntitlement,
        revokeGrant,
        linkAlias,
        deleteCustomer,
        SubmitPurchaseRequest(userId: "user-1", environment: .sandbox, purchase: .googlePlay(GooglePlayPurchase(packageName: "com.example.app", productId: "premium_sub", purchaseToken: "token-1"))),
        AppStorePurchase(signedTransaction: "eyJhbGciOiJFUzI1NiJ9.e30.c2ln", transactionId: "2000000123456789"),
        GooglePlayPurchase(packageName: "com.example.app", productId: "premium_sub", purchaseToken: "token-1"),
        SubmitPurchaseResponse(entitlements: checkResponse, logSequence: 42, changed: true, linkedAlias: "googleplay:token-1", environment: .sandbox, ignored: "pending", transactions: 3),
        WriteResponse(customerId: "user-1", logSequence: 12_345_678_901, changed: true, created: true),
        HealthRequest(),
        HealthResponse(status: .notServing, snapshotId: "snap-20261122", uptimeMs: 86_400_000, version: "1.0.0"),
        AuthenticateRequest(token: "0123456789abcdef0123456789abcdef"),
        AuthenticateResponse(check: true, write: false),
        CompactRequest(),
        CompactResponse(snapshotId: "snap-20261123", lastLogSequence: 4_000_000_000),
        CustomerHistoryRequest(userId: "$anon:abc", limit: 50, environment: .sandbox),
        CustomerHistoryResponse(
            userId: "$anon:abc",
            customerId: "user-1",
            entries: [historyEntry, HistoryEntry(date: 1_769_904_000_000, cause: .time, summary: "premium ended")],
            startsAfterLogSequence: 40,
            startsDate: 1_767_000_000_000,
            logSequence: 42,
            truncated: true
        ),
        historyEntry,
        product,
        catalog,
        CustomerRecord(
            id: "user-1",
            aliases: ["$anon:abc", "legacy-7"],
            transactions: [transaction],
            subscriptions: [subscriptionState],
            grants: [grant]
        ),
        SnapshotHeader(
            formatVersion: 1,
            snapshotId: "snap-20261122",
            createdDate: 1_767_225_600_000,
            recordCount: 1_000_000,
            catalog: catalog,
            lastLogSequence: 77,
            fleetEpoch: "0b9f4e7a-8f0e-4c71-9a55-1d2f3c4b5a69",
            fleetCommittedDate: 1_767_225_600_123
        ),
        LogRecord(sequence: 1, recordedDate: 1_767_225_600_000, source: source, mutation: .grantEntitlement(grantEntitlement)),
        customerChange,
        aliasChange,
        replicatedWrite,
        HealthCheckRequest(service: "entitlements.v1.EntitlementService"),
        HealthCheckResponse(status: .notServing),
    ]

    static let customerChange = CustomerChange(customerId: "user-1", record: CustomerRecord(id: "user-1", aliases: ["legacy-7"], grants: [grant]))
    static let aliasChange = AliasChange(alias: "legacy-7", customerId: "user-1")
    static let replicatedWrite = ReplicatedWrite(
        customerId: "user-1",
        created: true,
        customers: [customerChange, CustomerChange(customerId: "user-2")],
        aliases: [aliasChange, AliasChange(alias: "gone")],
        source: source
    )

    static let source = WriteSource(method: "stripe", caller: "webhooks", eventId: "evt_1NqX")
    static let historyEntry = HistoryEntry(
        date: 1_767_225_600_000,
        cause: .write,
        logSequence: 42,
        source: source,
        summary: "GrantEntitlement premium grant grant-7",
        changes: [entitlementChange],
        entitlements: [entitlement],
        deleted: true
    )

    /// One LogRecord per mutation case, so that every case of the oneof is exercised.
    static let logRecordsForEveryMutation: [LogRecord] = [
        .recordTransaction(recordTransaction),
        .updateSubscriptionState(updateSubscriptionState),
        .grantEntitlement(grantEntitlement),
        .revokeGrant(revokeGrant),
        .linkAlias(linkAlias),
        .deleteCustomer(deleteCustomer),
        .replicatedWrite(replicatedWrite),
    ].enumerated().map { index, mutation in
        LogRecord(sequence: UInt64(index + 1), recordedDate: 1_767_225_600_000 + Int64(index), mutation: mutation)
    }
}
