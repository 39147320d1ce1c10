public import EntitlementsMessages

/// The catalog's products indexed by id: which entitlements a product unlocks.
public struct ProductCatalog: Sendable {
    private let entitlementsByProduct: [String: [String]]
    private let periodByProduct: [String: SubscriptionPeriod]

    /// Indexes `catalog`. Consumables unlock nothing, whatever their `entitlements` say
    /// (rule 5 of docs/entitlement-rules.md). A product listed twice keeps its last entry.
    public init(_ catalog: Catalog) {
        var index: [String: [String]] = [:]
        var periods: [String: SubscriptionPeriod] = [:]
        index.reserveCapacity(catalog.products.count)
        for product in catalog.products {
            guard let id = product.id else {
                continue
            }
            index[id] = product.type == .consumable ? [] : product.entitlements
            periods[id] = product.type == .subscription ? product.period : nil
        }
        self.entitlementsByProduct = index
        self.periodByProduct = periods
    }

    /// The number of products.
    public var count: Int { self.entitlementsByProduct.count }

    /// Whether the catalog lists `productId`.
    public func contains(_ productId: String) -> Bool {
        self.entitlementsByProduct[productId] != nil
    }

    /// The billing period of a subscription product; unspecified for other products and
    /// unknown ones.
    public func period(of productId: String?) -> SubscriptionPeriod {
        productId.flatMap { self.periodByProduct[$0] } ?? .unspecified
    }

    /// The entitlements `productId` unlocks; empty for consumables and unknown products.
    public func entitlements(unlockedBy productId: String?) -> [String] {
        guard let productId else {
            return []
        }
        return self.entitlementsByProduct[productId] ?? []
    }
}
