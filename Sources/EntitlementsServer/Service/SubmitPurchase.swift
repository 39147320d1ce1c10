public import EntitlementsMessages
public import NIOCore

/// What verifies a purchase the app holds with its store and records it (SubmitPurchase,
/// docs/ingestion.md, "A purchase the app just made"). The stores are another module's
/// (EntitlementsIngestion); the server is given one at start and knows only this.
public protocol PurchaseVerifier: Sendable {
    /// Verifies `request`'s purchase and records it for `request.userId` through
    /// ``EntitlementMethods/write(_:_:)``: its writes are durable when this returns
    /// success. A failure's message says what to do about it.
    func submit(_ request: SubmitPurchaseRequest, methods: EntitlementMethods, on eventLoop: any EventLoop) async -> Result<SubmittedPurchase, ServiceError>
}

/// A purchase recorded by a ``PurchaseVerifier``.
public struct SubmittedPurchase: Sendable, Hashable {
    /// The log sequence of its last write that changed something; 0 when none did.
    public var logSequence: UInt64
    /// The log sequence the answer's check must have applied: the highest any of its writes
    /// answered (in fleet mode an unchanged write names the customer's last).
    public var readSequence: UInt64
    public var changed: Bool
    /// The store's alias of the purchase, now linked to the customer.
    public var linkedAlias: String?
    /// The environment the purchase counts in (a test purchase: sandbox).
    public var environment: Environment
    /// Why the purchase was not recorded, when it was not.
    public var ignored: String?
    /// How many of the store's transactions were read and recorded (or found recorded).
    public var transactions: UInt32

    public init(
        logSequence: UInt64, readSequence: UInt64, changed: Bool, linkedAlias: String?, environment: Environment, ignored: String? = nil,
        transactions: UInt32 = 0
    ) {
        self.logSequence = logSequence
        self.readSequence = readSequence
        self.changed = changed
        self.linkedAlias = linkedAlias
        self.environment = environment
        self.ignored = ignored
        self.transactions = transactions
    }
}

extension EntitlementMethods {
    /// SubmitPurchase: the purchase verified and recorded, then the customer's entitlements
    /// as CheckEntitlements answers them, read at least as fresh as the purchase's writes.
    func submitPurchase(_ request: SubmitPurchaseRequest, _ context: CallContext) -> MethodResult<SubmitPurchaseResponse> {
        if let problem = Validation.problem(userId: request.userId, field: "user_id") {
            return .failure(.invalidArgument, problem)
        }
        guard request.purchase != nil else {
            return .failure(.invalidArgument, "purchase: set app_store (a StoreKit 2 signed transaction) or google_play (package, product and purchase token)")
        }
        guard let verifier = self.purchases else {
            return .failure(
                .failedPrecondition,
                "this server verifies no store's purchases: start it with --appstore-root-cert and --appstore-bundle-id (App Store) or the --googleplay-* settings (Google Play)"
            )
        }
        let eventLoop = context.eventLoop
        // The answer's check runs on the caller's loop, where the futures below complete.
        let call = NIOLoopBound(context, eventLoop: eventLoop)
        let submitted = eventLoop.makePromise(of: Result<SubmittedPurchase, ServiceError>.self)
        let source = WriteSource(method: "SubmitPurchase", caller: context.access.callerDescription)
        submitted.completeWithTask {
            await CallContext.$storeSource.withValue(source) { await verifier.submit(request, methods: self, on: eventLoop) }
        }
        let answer = submitted.futureResult.flatMap { result -> EventLoopFuture<Result<SubmitPurchaseResponse, ServiceError>> in
            switch result {
            case .failure(let error):
                return eventLoop.makeSucceededFuture(.failure(error))
            case .success(let purchase):
                let environment = request.environment == .unspecified ? purchase.environment : request.environment
                let check = CheckEntitlementsRequest(userId: request.userId, environment: environment, minLogSequence: purchase.readSequence)
                let checked: EventLoopFuture<Result<CheckAnswer, ServiceError>> =
                    switch self.checkEntitlements(check, call.value) {
                    case .now(let result): eventLoop.makeSucceededFuture(result)
                    case .later(let future): future
                    }
                return checked.map { result in
                    result.flatMap { answer in
                        do {
                            return .success(
                                SubmitPurchaseResponse(
                                    entitlements: try answer.response(), logSequence: purchase.logSequence, changed: purchase.changed,
                                    linkedAlias: purchase.linkedAlias, environment: environment, ignored: purchase.ignored,
                                    transactions: purchase.transactions
                                )
                            )
                        } catch {
                            return .failure(ServiceError(.internalError, "cannot read the answer back: \(error)"))
                        }
                    }
                }
            }
        }
        return .later(answer)
    }
}
