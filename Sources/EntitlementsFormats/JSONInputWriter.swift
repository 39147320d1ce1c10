public import EntitlementsMessages

// Writing the input formats (docs/data-formats.md): what `entitlements snapshot generate
// --jsonl` emits, and what CatalogFile and CustomersFile read back unchanged.

extension CatalogFile {
    /// catalog.json for `catalog`, pretty-printed.
    public static func json(_ catalog: Catalog) -> String {
        JSONValue.object([
            ("products", .array(catalog.products.map { product in
                var members: [(String, JSONValue)] = [
                    ("id", .string(product.id)),
                    ("type", .name(product.type)),
                ]
                if product.type == .subscription {
                    members.append(("period", .name(product.period)))
                }
                members.append(("entitlements", .array(product.entitlements.map { .string($0) })))
                return .object(members)
            }))
        ]).serialized(pretty: true)
    }
}

extension CustomersFile {
    /// One customers.jsonl line (without the newline) for `record`.
    public static func jsonLine(_ record: CustomerRecord) -> String {
        JSONValue.object([
            ("id", .string(record.id)),
            ("aliases", .array(record.aliases.map { .string($0) })),
            ("transactions", .array(record.transactions.map { transaction in
                .object([
                    ("store", .name(transaction.store)),
                    ("productId", .string(transaction.productId)),
                    ("transactionId", .string(transaction.transactionId)),
                    ("originalTransactionId", .string(transaction.originalTransactionId)),
                    ("type", .name(transaction.type)),
                    ("transactionDate", .date(transaction.transactionDate)),
                    ("expirationDate", .date(transaction.expirationDate)),
                    ("revocationDate", .date(transaction.revocationDate)),
                    ("environment", .name(transaction.environment)),
                    ("ownershipType", .name(transaction.ownershipType)),
                    ("offerCode", .string(transaction.offerCode)),
                    ("priceMicros", transaction.priceMicros.map { .int($0) } ?? .null),
                    ("currency", .string(transaction.currency)),
                    ("verified", transaction.verified == true ? .bool(true) : .null),
                ])
            })),
            ("subscriptions", .array(record.subscriptions.map { state in
                .object([
                    ("store", .name(state.store)),
                    ("originalTransactionId", .string(state.originalTransactionId)),
                    ("autoRenewEnabled", .bool(state.autoRenewEnabled)),
                    ("autoRenewDisabledDate", .date(state.autoRenewDisabledDate)),
                    ("billingIssueDetectedDate", .date(state.billingIssueDetectedDate)),
                    ("gracePeriodExpirationDate", .date(state.gracePeriodExpirationDate)),
                    ("isInBillingRetry", .bool(state.isInBillingRetry)),
                    ("cancellationReason", .name(state.cancellationReason)),
                    ("priceConsentStatus", .name(state.priceConsentStatus)),
                ])
            })),
            ("grants", .array(record.grants.map { grant in
                .object([
                    ("grantId", .string(grant.grantId)),
                    ("entitlementId", .string(grant.entitlementId)),
                    ("grantedDate", .date(grant.grantedDate)),
                    ("expirationDate", .date(grant.expirationDate)),
                    ("revokedDate", .date(grant.revokedDate)),
                    ("reason", .string(grant.reason)),
                ])
            })),
        ]).serialized(pretty: false)
    }
}
