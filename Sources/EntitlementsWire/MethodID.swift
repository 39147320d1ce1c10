/// The number that names an RPC in a REQUEST frame (docs/PROTOCOL.md, "Methods").
///
/// The frame codec carries any number; a server answers numbers it does not serve with
/// `UNIMPLEMENTED`.
public struct MethodID: RawRepresentable, Sendable, Hashable, CustomStringConvertible {
    public var rawValue: UInt16

    public init(rawValue: UInt16) {
        self.rawValue = rawValue
    }

    /// `CheckEntitlementsRequest` -> `CheckEntitlementsResponse`.
    public static let checkEntitlements = MethodID(rawValue: 1)
    /// `BatchCheckEntitlementsRequest` -> `BatchCheckEntitlementsResponse`.
    public static let batchCheckEntitlements = MethodID(rawValue: 2)
    /// `WatchEntitlementsRequest` -> a stream of `EntitlementsChangedEvent`.
    public static let watchEntitlements = MethodID(rawValue: 3)
    /// `HealthRequest` -> `HealthResponse`.
    public static let health = MethodID(rawValue: 4)
    /// `AuthenticateRequest` -> `AuthenticateResponse`: the framed protocol's way to present
    /// a token (docs/PROTOCOL.md, "Authentication").
    public static let authenticate = MethodID(rawValue: 5)
    /// `CustomerHistoryRequest` -> `CustomerHistoryResponse`.
    public static let customerHistory = MethodID(rawValue: 6)
    /// `RecordTransactionRequest` -> `WriteResponse`.
    public static let recordTransaction = MethodID(rawValue: 16)
    /// `UpdateSubscriptionStateRequest` -> `WriteResponse`.
    public static let updateSubscriptionState = MethodID(rawValue: 17)
    /// `GrantEntitlementRequest` -> `WriteResponse`.
    public static let grantEntitlement = MethodID(rawValue: 18)
    /// `RevokeGrantRequest` -> `WriteResponse`.
    public static let revokeGrant = MethodID(rawValue: 19)
    /// `LinkAliasRequest` -> `WriteResponse`.
    public static let linkAlias = MethodID(rawValue: 20)
    /// `DeleteCustomerRequest` -> `WriteResponse`.
    public static let deleteCustomer = MethodID(rawValue: 21)
    /// `SubmitPurchaseRequest` -> `SubmitPurchaseResponse`.
    public static let submitPurchase = MethodID(rawValue: 22)
    /// `CompactRequest` -> `CompactResponse`.
    public static let compact = MethodID(rawValue: 32)

    /// Every method of protocol version 1, in method-id order.
    public static let all: [MethodID] = [
        .checkEntitlements, .batchCheckEntitlements, .watchEntitlements, .health, .authenticate, .customerHistory,
        .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant,
        .linkAlias, .deleteCustomer, .submitPurchase, .compact,
    ]

    /// The RPC's name, e.g. `CheckEntitlements`, or `method N` for an unknown number.
    public var description: String {
        switch self {
        case .checkEntitlements: "CheckEntitlements"
        case .batchCheckEntitlements: "BatchCheckEntitlements"
        case .watchEntitlements: "WatchEntitlements"
        case .health: "Health"
        case .authenticate: "Authenticate"
        case .customerHistory: "CustomerHistory"
        case .recordTransaction: "RecordTransaction"
        case .updateSubscriptionState: "UpdateSubscriptionState"
        case .grantEntitlement: "GrantEntitlement"
        case .revokeGrant: "RevokeGrant"
        case .linkAlias: "LinkAlias"
        case .deleteCustomer: "DeleteCustomer"
        case .submitPurchase: "SubmitPurchase"
        case .compact: "Compact"
        default: "method \(self.rawValue)"
        }
    }
}
