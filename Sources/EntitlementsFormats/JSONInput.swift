public import EntitlementsMessages
import Foundation

// The input formats of docs/data-formats.md: catalog.json and one customers.jsonl line.
// JSON is decoded with Foundation's JSONDecoder into the private `*JSON` shapes below,
// then validated and converted to the proto types the rest of the service uses. Every
// error carries the path of the offending field.

/// Reads `catalog.json`.
public enum CatalogFile {
    /// Parses a catalog document; `file` names it in errors.
    public static func parse(_ bytes: [UInt8], file: String = "catalog.json") throws -> Catalog {
        do {
            let json: CatalogJSON = try decodeJSON(bytes)
            return try json.validated()
        } catch let error as FieldError {
            throw error.located(file: file, line: nil)
        }
    }

    /// Reads and parses the catalog at `path`.
    public static func load(path: String) throws -> Catalog {
        guard let data = FileManager.default.contents(atPath: path) else {
            throw InputError(file: path, reason: "cannot read the file")
        }
        return try Self.parse(Array(data), file: path)
    }
}

/// Reads `customers.jsonl`: one customer object per line.
public enum CustomersFile {
    /// Parses one line into a customer record, validated on its own. Errors name `file`
    /// and `line`.
    public static func parseLine(_ bytes: [UInt8], file: String = "customers.jsonl", line: Int? = nil) throws -> CustomerRecord {
        do {
            let json: CustomerJSON = try decodeJSON(bytes)
            return try json.validated()
        } catch let error as FieldError {
            throw error.located(file: file, line: line)
        }
    }

    /// Streams the customers at `path`, calling `body` with each record and its line
    /// number. Blank lines are skipped. Memory stays constant however long the file is.
    public static func forEachCustomer(
        path: String,
        _ body: (CustomerRecord, _ line: Int) throws -> Void
    ) throws {
        var reader = try LineReader(path: path)
        while let bytes = reader.nextLine() {
            if bytes.allSatisfy({ $0 == 0x20 || $0 == 0x09 }) {
                continue
            }
            let record = try Self.parseLine(bytes, file: path, line: reader.lineNumber)
            try body(record, reader.lineNumber)
        }
    }
}

// MARK: Decoding

private func decodeJSON<Value: Decodable>(_ bytes: [UInt8]) throws -> Value {
    do {
        return try JSONDecoder().decode(Value.self, from: Data(bytes))
    } catch let error as DecodingError {
        throw FieldError(decodingError: error)
    }
}

extension FieldError {
    init(decodingError: DecodingError) {
        switch decodingError {
        case .keyNotFound(let key, let context):
            self.init(field: Self.path(context.codingPath + [key]), reason: "missing")
        case .valueNotFound(_, let context):
            self.init(field: Self.path(context.codingPath), reason: "must not be null")
        case .typeMismatch(let type, let context):
            self.init(field: Self.path(context.codingPath), reason: "expected \(Self.describe(type))")
        case .dataCorrupted(let context):
            if context.codingPath.isEmpty {
                let detail = (context.underlyingError as? NSError)?.userInfo[NSDebugDescriptionErrorKey] as? String
                self.init(field: "", reason: "not valid JSON" + (detail.map { " (\($0))" } ?? ""))
            } else {
                self.init(field: Self.path(context.codingPath), reason: context.debugDescription)
            }
        @unknown default:
            self.init(field: "", reason: "\(decodingError)")
        }
    }

    static func path(_ codingPath: [any CodingKey]) -> String {
        var path = ""
        for key in codingPath {
            if let index = key.intValue {
                path += "[\(index)]"
            } else {
                path += path.isEmpty ? key.stringValue : "." + key.stringValue
            }
        }
        return path
    }

    private static func describe(_ type: Any.Type) -> String {
        switch type {
        case is String.Type: "a string"
        case is Bool.Type: "true or false"
        case is [Any].Type: "an array"
        case is Dictionary<String, Any>.Type: "an object"
        default: "a \(type)".replacingOccurrences(of: "Array<", with: "array of ").replacingOccurrences(of: ">", with: "")
        }
    }
}

/// An RFC 3339 date-time string, decoded to Unix milliseconds.
private struct JSONDate: Decodable {
    var milliseconds: Int64

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        let text = try container.decode(String.self)
        guard let milliseconds = RFC3339.parse(text) else {
            throw DecodingError.dataCorruptedError(in: container, debugDescription: "not an RFC 3339 date")
        }
        self.milliseconds = milliseconds
    }
}

/// An enum value by its JSON name (JSONNames.swift).
private struct JSONName<Value: JSONNamedEnum>: Decodable {
    var value: Value

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        let name = try container.decode(String.self)
        guard let value = Value(jsonName: name) else {
            let expected = Value.allCases.compactMap(\.jsonName).joined(separator: ", ")
            throw DecodingError.dataCorruptedError(in: container, debugDescription: "unknown value \"\(name)\"; expected one of \(expected)")
        }
        self.value = value
    }
}

private struct CatalogJSON: Decodable {
    var products: [ProductJSON]
}

private struct ProductJSON: Decodable {
    var id: String
    var type: JSONName<ProductType>
    var period: JSONName<SubscriptionPeriod>?
    var entitlements: [String]
}

private struct CustomerJSON: Decodable {
    var id: String
    var aliases: [String]?
    var transactions: [TransactionJSON]?
    var subscriptions: [SubscriptionJSON]?
    var grants: [GrantJSON]?
}

private struct TransactionJSON: Decodable {
    var store: JSONName<Source>
    var productId: String
    var transactionId: String
    var originalTransactionId: String
    var type: JSONName<TransactionType>
    var transactionDate: JSONDate
    var expirationDate: JSONDate?
    var revocationDate: JSONDate?
    var environment: JSONName<Environment>?
    var ownershipType: JSONName<OwnershipType>?
    var offerCode: String?
    var priceMicros: Int64?
    var currency: String?
    /// Written by the store's own record (exported data); a hand-made file leaves it out.
    var verified: Bool?
}

private struct SubscriptionJSON: Decodable {
    var store: JSONName<Source>
    var originalTransactionId: String
    var autoRenewEnabled: Bool
    var autoRenewDisabledDate: JSONDate?
    var billingIssueDetectedDate: JSONDate?
    var gracePeriodExpirationDate: JSONDate?
    var isInBillingRetry: Bool?
    var cancellationReason: JSONName<CancellationReason>?
    var priceConsentStatus: JSONName<PriceConsentStatus>?
}

private struct GrantJSON: Decodable {
    var grantId: String
    var entitlementId: String
    var grantedDate: JSONDate
    var expirationDate: JSONDate?
    var revokedDate: JSONDate?
    var reason: String?
}

// MARK: Validation

/// An id (customer, alias, product, entitlement, transaction, grant) follows the
/// protocol's ``IdRule``: 1 to 256 bytes, in NFC.
private func checkId(_ value: String, _ field: String) throws {
    if let problem = IdRule.problem(value) {
        throw FieldError(field: field, reason: problem)
    }
    try checkText(value, field)
}

private func checkText(_ value: String, _ field: String) throws {
    guard !value.utf8.contains(0) else {
        throw FieldError(field: field, reason: "must not contain a NUL character")
    }
}

private let storeNames = "appstore, playstore or stripe"

private func checkStore(_ store: Source, _ field: String) throws {
    guard store == .appstore || store == .playstore || store == .stripe else {
        throw FieldError(field: field, reason: "must be \(storeNames), got \"\(store.jsonName ?? "")\"")
    }
}

extension CatalogJSON {
    fileprivate func validated() throws -> Catalog {
        var seen: [String: Int] = [:]
        var catalog = Catalog()
        catalog.products.reserveCapacity(self.products.count)
        for (index, product) in self.products.enumerated() {
            let path = "products[\(index)]"
            try checkId(product.id, path + ".id")
            if let first = seen[product.id] {
                throw FieldError(field: path + ".id", reason: "duplicate product \"\(product.id)\" (first at products[\(first)])")
            }
            seen[product.id] = index
            let period = product.period?.value ?? .unspecified
            if product.type.value == .subscription, period == .unspecified {
                throw FieldError(field: path + ".period", reason: "missing; a subscription needs weekly, monthly, quarterly, semiannual or annual")
            }
            if product.type.value != .subscription, product.period != nil {
                throw FieldError(field: path + ".period", reason: "only subscriptions have a period")
            }
            for (entitlementIndex, entitlement) in product.entitlements.enumerated() {
                try checkId(entitlement, path + ".entitlements[\(entitlementIndex)]")
            }
            catalog.products.append(
                Product(id: product.id, type: product.type.value, period: period, entitlements: product.entitlements)
            )
        }
        return catalog
    }
}

extension CustomerJSON {
    fileprivate func validated() throws -> CustomerRecord {
        try checkId(self.id, "id")
        var record = CustomerRecord(id: self.id)

        var aliases = Set<String>()
        for (index, alias) in (self.aliases ?? []).enumerated() {
            let field = "aliases[\(index)]"
            try checkId(alias, field)
            guard alias != self.id else {
                throw FieldError(field: field, reason: "an alias cannot be the customer's own id")
            }
            guard aliases.insert(alias).inserted else {
                throw FieldError(field: field, reason: "duplicate alias \"\(alias)\"")
            }
            record.aliases.append(alias)
        }

        var transactionIds: [String: Int] = [:]
        for (index, json) in (self.transactions ?? []).enumerated() {
            let path = "transactions[\(index)]"
            let transaction = try json.validated(path: path)
            let key = "\(transaction.store.rawValue)/\(json.transactionId)"
            if let first = transactionIds[key] {
                throw FieldError(field: path + ".transactionId", reason: "duplicate transaction \"\(json.transactionId)\" in \(json.store.value.jsonName ?? "") (first at transactions[\(first)])")
            }
            transactionIds[key] = index
            record.transactions.append(transaction)
        }

        var chains: [String: Int] = [:]
        for (index, json) in (self.subscriptions ?? []).enumerated() {
            let path = "subscriptions[\(index)]"
            try checkStore(json.store.value, path + ".store")
            try checkId(json.originalTransactionId, path + ".originalTransactionId")
            let key = "\(json.store.value.rawValue)/\(json.originalTransactionId)"
            if let first = chains[key] {
                throw FieldError(field: path + ".originalTransactionId", reason: "a second state for chain \"\(json.originalTransactionId)\" (first at subscriptions[\(first)])")
            }
            chains[key] = index
            record.subscriptions.append(
                SubscriptionState(
                    store: json.store.value,
                    originalTransactionId: json.originalTransactionId,
                    autoRenewEnabled: json.autoRenewEnabled,
                    autoRenewDisabledDate: json.autoRenewDisabledDate?.milliseconds,
                    billingIssueDetectedDate: json.billingIssueDetectedDate?.milliseconds,
                    gracePeriodExpirationDate: json.gracePeriodExpirationDate?.milliseconds,
                    isInBillingRetry: json.isInBillingRetry ?? false,
                    cancellationReason: json.cancellationReason?.value ?? .unspecified,
                    priceConsentStatus: json.priceConsentStatus?.value ?? .unspecified
                )
            )
        }

        var grantIds: [String: Int] = [:]
        for (index, json) in (self.grants ?? []).enumerated() {
            let path = "grants[\(index)]"
            try checkId(json.grantId, path + ".grantId")
            if let first = grantIds[json.grantId] {
                throw FieldError(field: path + ".grantId", reason: "duplicate grant \"\(json.grantId)\" (first at grants[\(first)])")
            }
            grantIds[json.grantId] = index
            try checkId(json.entitlementId, path + ".entitlementId")
            if let reason = json.reason {
                try checkText(reason, path + ".reason")
            }
            if let expiration = json.expirationDate, expiration.milliseconds <= json.grantedDate.milliseconds {
                throw FieldError(field: path + ".expirationDate", reason: "must be after grantedDate")
            }
            record.grants.append(
                Grant(
                    grantId: json.grantId,
                    entitlementId: json.entitlementId,
                    grantedDate: json.grantedDate.milliseconds,
                    expirationDate: json.expirationDate?.milliseconds,
                    revokedDate: json.revokedDate?.milliseconds,
                    reason: json.reason
                )
            )
        }
        return record
    }
}

extension TransactionJSON {
    fileprivate func validated(path: String) throws -> Transaction {
        try checkStore(self.store.value, path + ".store")
        try checkId(self.productId, path + ".productId")
        try checkId(self.transactionId, path + ".transactionId")
        try checkId(self.originalTransactionId, path + ".originalTransactionId")
        if let offerCode = self.offerCode {
            try checkText(offerCode, path + ".offerCode")
        }
        switch (self.priceMicros, self.currency) {
        case (nil, nil):
            break
        case (let micros?, let currency?):
            if micros < 0 {
                throw FieldError(field: path + ".priceMicros", reason: "must not be negative")
            }
            if currency.utf8.count != 3 || !currency.utf8.allSatisfy({ (0x41...0x5A).contains($0) }) {
                throw FieldError(field: path + ".currency", reason: "must be an ISO 4217 code in upper case, such as \"USD\"")
            }
        default:
            throw FieldError(field: path + (self.currency == nil ? ".currency" : ".priceMicros"), reason: "priceMicros and currency go together")
        }
        if self.type.value == .nonConsumablePurchase {
            if self.expirationDate != nil {
                throw FieldError(field: path + ".expirationDate", reason: "must be null for a nonConsumablePurchase")
            }
        } else {
            guard let expiration = self.expirationDate else {
                throw FieldError(field: path + ".expirationDate", reason: "missing; only a nonConsumablePurchase has none")
            }
            if expiration.milliseconds <= self.transactionDate.milliseconds {
                throw FieldError(field: path + ".expirationDate", reason: "must be after transactionDate")
            }
        }
        return Transaction(
            originalTransactionId: self.originalTransactionId,
            transactionId: self.transactionId,
            store: self.store.value,
            productId: self.productId,
            offerCode: self.offerCode,
            transactionDate: self.transactionDate.milliseconds,
            expirationDate: self.expirationDate?.milliseconds,
            revocationDate: self.revocationDate?.milliseconds,
            environment: self.environment?.value ?? .production,
            ownershipType: self.ownershipType?.value ?? .owner,
            type: self.type.value,
            priceMicros: self.priceMicros,
            currency: self.currency,
            verified: self.verified ?? false
        )
    }
}
