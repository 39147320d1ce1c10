import ArgumentParser
import Foundation
import EntitlementsClient
import EntitlementsFormats
import EntitlementsMessages
import EntitlementsWire

/// The write commands: one per write method (docs/PROTOCOL.md), each printing the
/// server's WriteResponse, or its error and exit status 1.
protocol WriteCommand: AsyncParsableCommand {
    var connection: ServerOptions { get }
    var json: Bool { get }
    associatedtype Request: ProtobufMessage
    var method: MethodID { get }
    func request() throws -> Request
}

extension WriteCommand {
    func run() async throws {
        let client = try self.connection.makeClient()
        do {
            let response: WriteResponse = try await client.call(self.method, self.request(), timeout: self.connection.timeout)
            await client.close()
            print(Self.render(response, json: self.json))
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }

    static func render(_ response: WriteResponse, json: Bool) -> String {
        if json {
            return EntitlementsOutput.json(response)
        }
        let what = response.created ? "created" : response.changed ? "changed" : "unchanged (it was so already)"
        return "customer \(response.customerId ?? "?"): \(what)" + (response.logSequence > 0 ? ", log sequence \(response.logSequence)" : "")
    }
}

/// A date option: RFC 3339, validated.
private func date(_ text: String?, _ flag: String) throws -> Int64? {
    guard let text else {
        return nil
    }
    guard let value = RFC3339.parse(text) else {
        throw ValidationError("\(flag) \"\(text)\" is not an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z")
    }
    return value
}

/// A transaction's or subscription state's store: the schema allows APPSTORE, PLAYSTORE or
/// STRIPE only (access given by hand is a grant); the server checks it too.
private func storeName(_ text: String) throws -> Source {
    let store = try named(text, "--store", as: Source.self)
    guard [.appstore, .playstore, .stripe].contains(store) else {
        throw ValidationError("--store must be appstore, playstore or stripe, got \"\(text)\" (access given by hand is `entitlements grant`)")
    }
    return store
}

/// An enum option by its JSON name.
private func named<E: JSONNamedEnum>(_ text: String, _ flag: String, as type: E.Type) throws -> E {
    guard let value = E(jsonName: text) else {
        let names = E.allCases.compactMap(\.jsonName).joined(separator: ", ")
        throw ValidationError("\(flag) must be one of \(names), got \"\(text)\"")
    }
    return value
}

struct RecordTransactionCommand: WriteCommand {
    static let configuration = CommandConfiguration(
        commandName: "record-transaction",
        abstract: "Record a purchase or renewal (idempotent by store and transaction id; a new --revoked is a refund)."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias (a new id creates the customer).") var user: String
    @Option(help: "appstore, playstore or stripe.") var store: String
    @Option(help: "The store's transaction id.") var transactionId: String
    @Option(help: "The chain's first transaction id; default: --transaction-id.") var originalTransactionId: String?
    @Option(help: "The product (must be in the catalog).") var product: String
    @Option(help: "When it was bought, RFC 3339.") var purchased: String
    @Option(help: "When it expires, RFC 3339; required unless --type nonConsumablePurchase.") var expires: String?
    @Option(help: "When the store refunded or revoked it, RFC 3339.") var revoked: String?
    @Option(help: "production or sandbox.") var environment: String = "production"
    @Option(help: "subscriptionStarted, subscriptionRenewed, trialStarted, introStarted, introRenewed or nonConsumablePurchase.") var type: String
    @Option(help: "The offer code redeemed.") var offerCode: String?
    @Option(help: "What was paid for the period, in millionths of --currency (9.99 is 9990000).") var priceMicros: Int64?
    @Option(help: "The price's currency, ISO 4217 in upper case (USD); with --price-micros.") var currency: String?
    @Flag(help: "Print JSON.") var json = false
    var method: MethodID { .recordTransaction }

    func validate() throws { _ = try self.request() }

    func request() throws -> RecordTransactionRequest {
        RecordTransactionRequest(
            userId: self.user,
            transaction: Transaction(
                originalTransactionId: self.originalTransactionId,
                transactionId: self.transactionId,
                store: try storeName(self.store),
                productId: self.product,
                offerCode: self.offerCode,
                transactionDate: try date(self.purchased, "--purchased"),
                expirationDate: try date(self.expires, "--expires"),
                revocationDate: try date(self.revoked, "--revoked"),
                environment: try named(self.environment, "--environment", as: Environment.self),
                type: try named(self.type, "--type", as: TransactionType.self),
                priceMicros: self.priceMicros,
                currency: self.currency
            )
        )
    }
}

struct UpdateSubscriptionCommand: WriteCommand {
    static let configuration = CommandConfiguration(
        commandName: "update-subscription",
        abstract: "Set a subscription chain's renewal state (auto-renew, billing issue, grace period)."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias.") var user: String
    @Option(help: "appstore, playstore or stripe.") var store: String
    @Option(help: "The chain's first transaction id.") var originalTransactionId: String
    @Option(help: "Whether the subscription renews: true or false.") var autoRenew: Bool?
    @Option(help: "When auto-renew was turned off, RFC 3339.") var autoRenewDisabled: String?
    @Option(help: "When the store found a billing issue, RFC 3339.") var billingIssue: String?
    @Option(help: "When the grace period ends, RFC 3339.") var gracePeriodExpires: String?
    @Flag(help: "The store is retrying the payment.") var billingRetry = false
    @Option(help: "Why it stopped renewing: customer, billingError, developer, priceIncrease, productUnavailable, replaced or unknown.") var cancellationReason: String?
    @Option(help: "The answer to a price increase: notified or agreed.") var priceConsent: String?
    @Flag(help: "Print JSON.") var json = false
    var method: MethodID { .updateSubscriptionState }

    func validate() throws { _ = try self.request() }

    func request() throws -> UpdateSubscriptionStateRequest {
        UpdateSubscriptionStateRequest(
            userId: self.user,
            state: SubscriptionState(
                store: try storeName(self.store),
                originalTransactionId: self.originalTransactionId,
                autoRenewEnabled: self.autoRenew ?? false,
                autoRenewDisabledDate: try date(self.autoRenewDisabled, "--auto-renew-disabled"),
                billingIssueDetectedDate: try date(self.billingIssue, "--billing-issue"),
                gracePeriodExpirationDate: try date(self.gracePeriodExpires, "--grace-period-expires"),
                isInBillingRetry: self.billingRetry,
                cancellationReason: try self.cancellationReason.map { try named($0, "--cancellation-reason", as: CancellationReason.self) } ?? .unspecified,
                priceConsentStatus: try self.priceConsent.map { try named($0, "--price-consent", as: PriceConsentStatus.self) } ?? .unspecified
            )
        )
    }
}

struct GrantCommand: WriteCommand {
    static let configuration = CommandConfiguration(
        commandName: "grant",
        abstract: "Grant an entitlement by hand (a grant id names one grant; granting it again replaces it)."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias (a new id creates the customer).") var user: String
    @Option(help: "Names this grant.") var grantId: String
    @Option(help: "The entitlement granted.") var entitlement: String
    @Option(help: "From when, RFC 3339; default: now.") var granted: String?
    @Option(help: "Until when, RFC 3339; default: forever.") var expires: String?
    @Option(help: "Why, for people.") var reason: String?
    @Flag(help: "Print JSON.") var json = false
    var method: MethodID { .grantEntitlement }

    func validate() throws { _ = try self.request() }

    func request() throws -> GrantEntitlementRequest {
        GrantEntitlementRequest(
            userId: self.user,
            grant: Grant(
                grantId: self.grantId,
                entitlementId: self.entitlement,
                grantedDate: try date(self.granted, "--granted"),
                expirationDate: try date(self.expires, "--expires"),
                reason: self.reason
            )
        )
    }
}

struct RevokeGrantCommand: WriteCommand {
    static let configuration = CommandConfiguration(
        commandName: "revoke-grant",
        abstract: "End a grant."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias.") var user: String
    @Option(help: "The grant to end.") var grantId: String
    @Option(help: "From when, RFC 3339; default: now.") var revoked: String?
    @Flag(help: "Print JSON.") var json = false
    var method: MethodID { .revokeGrant }

    func validate() throws { _ = try self.request() }

    func request() throws -> RevokeGrantRequest {
        RevokeGrantRequest(userId: self.user, grantId: self.grantId, revokedDate: try date(self.revoked, "--revoked"))
    }
}

struct LinkAliasCommand: WriteCommand {
    static let configuration = CommandConfiguration(
        commandName: "link-alias",
        abstract: "Make an id (e.g. an anonymous app-user id) answer for a customer."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias (a new id creates the customer).") var user: String
    @Option(help: "The alias.") var alias: String
    @Flag(help: "Move the alias if another customer has it.") var transfer = false
    @Flag(help: "Print JSON.") var json = false
    var method: MethodID { .linkAlias }

    func request() throws -> LinkAliasRequest {
        LinkAliasRequest(userId: self.user, alias: self.alias, transfer: self.transfer)
    }
}

struct DeleteCustomerCommand: WriteCommand {
    static let configuration = CommandConfiguration(
        commandName: "delete-customer",
        abstract: "Delete a customer and its aliases."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias.") var user: String
    @Flag(help: "Print JSON.") var json = false
    var method: MethodID { .deleteCustomer }

    func request() throws -> DeleteCustomerRequest {
        DeleteCustomerRequest(userId: self.user)
    }
}

/// `entitlements submit-purchase`: a purchase the app holds, verified by the server with its
/// store and recorded; prints the user's entitlements after it (docs/ingestion.md).
struct SubmitPurchaseCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "submit-purchase",
        abstract: "Verify a purchase the app holds with its store, record it, and print the user's entitlements after it."
    )
    @OptionGroup var connection: ServerOptions
    @Option(help: "The customer id or alias (a new id creates the customer).") var user: String
    @Option(help: "A StoreKit 2 transaction's jwsRepresentation, in a file, or - for standard input.") var appstoreJws: String?
    @Option(help: "A Google Play purchase token.") var googleplayToken: String?
    @Option(help: "The Google Play product id (with --googleplay-token).") var product: String?
    @Option(help: "The Android package name (with --googleplay-token).") var package: String?
    @Option(help: "The entitlements' environment in the answer: production or sandbox; default: the purchase's own.") var environment: String?
    @Flag(help: "Print JSON.") var json = false

    func validate() throws {
        _ = try self.request(readingJWS: false)
    }

    /// The request; `readingJWS` false checks the flags only (standard input is read once,
    /// by the run).
    func request(readingJWS: Bool = true) throws -> SubmitPurchaseRequest {
        var request = SubmitPurchaseRequest(userId: self.user)
        if let environment = self.environment {
            guard let value = Environment(jsonName: environment), value != .unspecified else {
                throw ValidationError("--environment must be production or sandbox, got \"\(environment)\"")
            }
            request.environment = value
        }
        switch (self.appstoreJws, self.googleplayToken) {
        case (let path?, nil):
            guard self.product == nil, self.package == nil else {
                throw ValidationError("--product and --package go with --googleplay-token, not --appstore-jws")
            }
            request.purchase = .appStore(AppStorePurchase(signedTransaction: readingJWS ? try Self.read(path) : nil))
        case (nil, let token?):
            guard let product = self.product, let package = self.package else {
                throw ValidationError("--googleplay-token needs --product (the product id) and --package (the app's package name)")
            }
            request.purchase = .googlePlay(GooglePlayPurchase(packageName: package, productId: product, purchaseToken: token))
        case (nil, nil):
            throw ValidationError("give the purchase: --appstore-jws FILE (or - for standard input), or --googleplay-token TOKEN with --product and --package")
        default:
            throw ValidationError("--appstore-jws and --googleplay-token are two kinds of purchase: give one")
        }
        return request
    }

    /// The JWS in `path` (`-`: standard input), without surrounding whitespace.
    private static func read(_ path: String) throws -> String {
        let text: String?
        if path == "-" {
            text = String(data: FileHandle.standardInput.readDataToEndOfFile(), encoding: .utf8)
        } else {
            text = FileManager.default.contents(atPath: path).flatMap { String(data: $0, encoding: .utf8) }
        }
        guard let jws = text?.trimmingCharacters(in: .whitespacesAndNewlines), !jws.isEmpty else {
            throw ValidationError("--appstore-jws \(path): cannot read a JWS from it")
        }
        return jws
    }

    func run() async throws {
        try await Self.submit(try self.request(), connection: self.connection, json: self.json, what: "purchase")
    }

    /// Sends `request` and prints the answer; `what` names the purchase in the text.
    static func submit(_ request: SubmitPurchaseRequest, connection: ServerOptions, json: Bool, what: String) async throws {
        let client = try connection.makeClient()
        do {
            let response = try await client.submitPurchase(request, timeout: connection.timeout)
            await client.close()
            if json {
                print(EntitlementsOutput.json(response))
            } else {
                let outcome =
                    if let ignored = response.ignored {
                        "not recorded (\(ignored))"
                    } else if response.changed {
                        "recorded, log sequence \(response.logSequence)"
                    } else {
                        "recorded already"
                    }
                let count = response.transactions == 1 ? ", 1 transaction" : ", \(response.transactions) transactions"
                print("\(what) \(outcome)\(count)" + (response.linkedAlias.map { "; \($0) linked to the customer" } ?? ""))
                if response.environment == .sandbox {
                    print("sandbox entitlements (a test purchase):")
                }
                print(EntitlementsOutput.table(response.entitlements ?? CheckEntitlementsResponse()))
            }
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}

/// `entitlements appstore`: the App Store calls that are not a single purchase.
struct AppStoreCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "appstore",
        abstract: "App Store work a server does with the App Store Server API.",
        subcommands: [Sync.self]
    )

    /// `entitlements appstore sync`: SubmitPurchase with `app_store.transaction_id`.
    struct Sync: AsyncParsableCommand {
        static let configuration = CommandConfiguration(
            abstract: "Record a customer's whole App Store history, read by the server from Apple (Get Transaction History); safe to run again."
        )
        @OptionGroup var connection: ServerOptions
        @Option(help: "The customer id or alias the history is recorded for (a new id creates the customer).") var user: String
        @Option(help: "Any App Store transaction id of the customer (an original transaction id will do).") var transactionId: String
        @Option(help: "Where Apple is asked, and the entitlements' environment in the answer: production or sandbox; default: production, then the sandbox. (--timeout-ms defaults to 120000 here.)")
        var environment: String?
        @Flag(help: "Print JSON.") var json = false

        func validate() throws {
            _ = try self.request()
        }

        func request() throws -> SubmitPurchaseRequest {
            var request = SubmitPurchaseRequest(userId: self.user, purchase: .appStore(AppStorePurchase(transactionId: self.transactionId)))
            if let environment = self.environment {
                guard let value = Environment(jsonName: environment), value != .unspecified else {
                    throw ValidationError("--environment must be production or sandbox, got \"\(environment)\"")
                }
                request.environment = value
            }
            guard !self.transactionId.isEmpty else {
                throw ValidationError("--transaction-id: give an App Store transaction id of the customer")
            }
            return request
        }

        func run() async throws {
            var connection = self.connection
            if !CommandLine.arguments.contains(where: { $0.hasPrefix("--timeout-ms") }) {
                connection.timeoutMs = 120_000  // a history is many pages and writes, not one check
            }
            try await SubmitPurchaseCommand.submit(try self.request(), connection: connection, json: self.json, what: "history")
        }
    }
}

struct CompactCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "compact",
        abstract: "Ask a server to write a new snapshot holding every write and drop the log it covers."
    )
    @OptionGroup var connection: ServerOptions

    func run() async throws {
        let client = try self.connection.makeClient()
        do {
            let response: CompactResponse = try await client.call(.compact, CompactRequest(), timeout: self.connection.timeout)
            await client.close()
            print("compacted: snapshot \(response.snapshotId ?? "-") holds writes up to log sequence \(response.lastLogSequence)")
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}

/// `entitlements health`: exit 0 when the server answers Health with SERVING, 1 otherwise
/// (for container HEALTHCHECKs and exec probes).
struct HealthCommand: AsyncParsableCommand {
    static let configuration = CommandConfiguration(
        commandName: "health",
        abstract: "Ask a server whether it serves; exit status 0 if it does."
    )
    @OptionGroup var connection: ServerOptions

    func run() async throws {
        let client = try self.connection.makeClient()
        do {
            let response = try await client.health(timeout: self.connection.timeout)
            await client.close()
            let serving = response.status == .serving
            print("\(serving ? "serving" : "not serving"): snapshot \(response.snapshotId ?? "-"), up \(response.uptimeMs / 1_000) s, version \(response.version ?? "-")")
            if !serving {
                throw ExitCode(1)
            }
        } catch let exit as ExitCode {
            throw exit
        } catch {
            await client.close()
            print("error: \(error)")
            throw ExitCode(1)
        }
    }
}
