public import EntitlementsWire

/// What a caller may do (docs/security.md). Every method needs exactly one of these.
public struct Permissions: OptionSet, Sendable, Hashable, CustomStringConvertible {
    public var rawValue: UInt8

    public init(rawValue: UInt8) {
        self.rawValue = rawValue
    }

    /// Reads: CheckEntitlements, BatchCheckEntitlements, WatchEntitlements, Health, CustomerHistory (and
    /// grpc.health.v1, and the admin listener's /metrics).
    public static let check = Permissions(rawValue: 1)
    /// The write methods (RecordTransaction ... DeleteCustomer, SubmitPurchase) and Compact.
    public static let write = Permissions(rawValue: 2)
    public static let none: Permissions = []
    public static let all: Permissions = [.check, .write]

    /// The permission `method` needs; nil for Authenticate (anyone may try) and for
    /// methods this server does not know (they answer UNIMPLEMENTED).
    public static func required(by method: MethodID) -> Permissions? {
        switch method {
        case .checkEntitlements, .batchCheckEntitlements, .watchEntitlements, .health, .customerHistory:
            .check
        case .recordTransaction, .updateSubscriptionState, .grantEntitlement, .revokeGrant, .linkAlias, .deleteCustomer, .submitPurchase, .compact:
            .write
        default:
            nil
        }
    }

    /// `none`, `check`, `write` or `check,write`, as flags and files write them.
    public var description: String {
        switch self {
        case .none: "none"
        case .check: "check"
        case .write: "write"
        default: "check,write"
        }
    }

    /// Parses `none`, `check`, `write`, `check,write` (or `write,check`); nil otherwise.
    public init?(parsing text: some StringProtocol) {
        if text == "none" {
            self = .none
            return
        }
        var permissions = Permissions.none
        for word in text.split(separator: ",", omittingEmptySubsequences: false) {
            switch word {
            case "check": permissions.insert(.check)
            case "write": permissions.insert(.write)
            default: return nil
            }
        }
        self = permissions
    }

    /// What a parse error says the accepted forms are.
    public static let accepted = "none, check, write or check,write"
}
