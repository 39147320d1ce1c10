public import EntitlementsMessages

/// The names the JSON formats (docs/data-formats.md) use for enum values: the proto value
/// without its prefix, in lower camel case (`SOURCE_APPSTORE` is `appstore`,
/// `RENEW_STATE_WILL_RENEW` is `willRenew`). Values that mean "unspecified" have no name
/// and are written as null.
public protocol JSONNamedEnum: CaseIterable, Hashable, Sendable {
    /// The JSON name, or nil for the unspecified value.
    var jsonName: String? { get }
}

extension JSONNamedEnum {
    /// The value whose JSON name is `name`.
    public init?(jsonName name: String) {
        guard let value = Self.allCases.first(where: { $0.jsonName == name }) else {
            return nil
        }
        self = value
    }
}

extension Source: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unknown: "unknown"
        case .appstore: "appstore"
        case .playstore: "playstore"
        case .stripe: "stripe"
        case .manual: "manual"
        }
    }
}

extension Environment: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .production: "production"
        case .sandbox: "sandbox"
        }
    }
}

extension OwnershipType: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .owner: "owner"
        case .familySharing: "familySharing"
        }
    }
}

extension TransactionType: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .subscriptionStarted: "subscriptionStarted"
        case .subscriptionRenewed: "subscriptionRenewed"
        case .trialStarted: "trialStarted"
        case .introStarted: "introStarted"
        case .introRenewed: "introRenewed"
        case .nonConsumablePurchase: "nonConsumablePurchase"
        }
    }
}

extension RenewState: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unknown: "unknown"
        case .nonRenewable: "nonRenewable"
        case .willRenew: "willRenew"
        case .billingIssue: "billingIssue"
        case .canceled: "canceled"
        }
    }
}

extension GrantType: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .purchase: "purchase"
        case .familySharing: "familySharing"
        case .offerCode: "offerCode"
        case .manual: "manual"
        }
    }
}

extension PeriodType: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .normal: "normal"
        case .trial: "trial"
        case .intro: "intro"
        }
    }
}

extension CancellationReason: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .customer: "customer"
        case .billingError: "billingError"
        case .developer: "developer"
        case .priceIncrease: "priceIncrease"
        case .productUnavailable: "productUnavailable"
        case .replaced: "replaced"
        case .unknown: "unknown"
        }
    }
}

extension PriceConsentStatus: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .notified: "notified"
        case .agreed: "agreed"
        }
    }
}

/// The one exception to lower camel case: `past_due`, as Stripe and the subscription
/// views this field comes from spell it.
extension SubscriptionStatus: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .active: "active"
        case .trialing: "trialing"
        case .pastDue: "past_due"
        case .canceled: "canceled"
        }
    }
}

extension ProductType: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .subscription: "subscription"
        case .nonConsumable: "nonConsumable"
        case .consumable: "consumable"
        }
    }
}

extension SubscriptionPeriod: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unspecified: nil
        case .weekly: "weekly"
        case .monthly: "monthly"
        case .quarterly: "quarterly"
        case .semiannual: "semiannual"
        case .annual: "annual"
        }
    }
}

extension ServingStatus: JSONNamedEnum {
    public var jsonName: String? {
        switch self {
        case .unknown: nil
        case .serving: "serving"
        case .notServing: "notServing"
        }
    }
}
