public import EntitlementsMessages

/// The catalog's products indexed by id: which entitlements a product unlocks.
public struct ProductCatalog: Sendable {
    private let entitlementsByProduct: [String: [String]]

    /// Indexes `catalog`. Consumables unlock nothing, whatever their `entitlements` say
    /// (rule 5 of docs/entitlement-rules.md). A product listed twice keeps its last entry.
    public init(_ catalog: Catalog) {
        var index: [String: [String]] = [:]
        index.reserveCapacity(catalog.products.count)
        for product in catalog.products {
            guard let id = product.id else {
                continue
            }
            index[id] = product.type == .consumable ? [] : product.entitlements
        }
        self.entitlementsByProduct = index
    }

    /// The number of products.
    public var count: Int { self.entitlementsByProduct.count }

    /// Whether the catalog lists `productId`.
    public func contains(_ productId: String) -> Bool {
        self.entitlementsByProduct[productId] != nil
    }

    /// The entitlements `productId` unlocks; empty for consumables and unknown products.
    public func entitlements(unlockedBy productId: String?) -> [String] {
        guard let productId else {
            return []
        }
        return self.entitlementsByProduct[productId] ?? []
    }
}
