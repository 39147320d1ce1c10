import EntitlementsIngestion

/// JSON written by hand for the tests: Stripe's events in the shapes its API versions send.
indirect enum JSON: ExpressibleByDictionaryLiteral, ExpressibleByStringLiteral, ExpressibleByIntegerLiteral, ExpressibleByBooleanLiteral,
    ExpressibleByArrayLiteral, ExpressibleByNilLiteral
{
    case object([(String, JSON)])
    case array([JSON])
    case string(String)
    case integer(Int64)
    case bool(Bool)
    case null

    init(dictionaryLiteral elements: (String, JSON)...) { self = .object(elements) }
    init(stringLiteral value: String) { self = .string(value) }
    init(integerLiteral value: Int64) { self = .integer(value) }
    init(booleanLiteral value: Bool) { self = .bool(value) }
    init(arrayLiteral elements: JSON...) { self = .array(elements) }
    init(nilLiteral: ()) { self = .null }

    var text: String {
        switch self {
        case .object(let fields): "{" + fields.map { "\"\($0.0)\":\($0.1.text)" }.joined(separator: ",") + "}"
        case .array(let elements): "[" + elements.map(\.text).joined(separator: ",") + "]"
        case .string(let value): "\"\(value)\""
        case .integer(let value): "\(value)"
        case .bool(let value): value ? "true" : "false"
        case .null: "null"
        }
    }

    var bytes: [UInt8] { Array(self.text.utf8) }
}

/// Stripe objects, in the acacia shape (2025-02-24 and before) or the basil one (2025-03-31 on).
enum StripeFixture {
    static let day: Int64 = 86_400
    static let start: Int64 = 1_793_577_600  // 2026-11-02T00:00:00Z, seconds

    static func metadata(_ user: String?) -> JSON {
        guard let user else {
            return [:]
        }
        return ["user_id": .string(user)]
    }

    static func optional(_ value: Int64?) -> JSON {
        value.map { .integer($0) } ?? .null
    }

    static func event(_ id: String, _ type: String, created: Int64, _ object: JSON, basil: Bool = false) -> JSON {
        [
            "id": .string(id), "object": "event", "type": .string(type), "created": .integer(created), "livemode": false,
            "api_version": basil ? "2025-03-31.basil" : "2024-06-20", "data": ["object": object],
        ]
    }

    static func customer(_ id: String, user: String?) -> JSON {
        ["id": .string(id), "object": "customer", "metadata": metadata(user)]
    }

    static func subscription(
        _ id: String, customer: String, user: String? = nil, status: String, periodStart: Int64, periodEnd: Int64,
        cancelAtPeriodEnd: Bool = false, canceledAt: Int64? = nil, endedAt: Int64? = nil, cancellationReason: String? = nil, basil: Bool = false
    ) -> JSON {
        var fields: [(String, JSON)] = [
            ("id", .string(id)), ("object", "subscription"), ("customer", .string(customer)), ("status", .string(status)),
            ("metadata", metadata(user)), ("cancel_at_period_end", .bool(cancelAtPeriodEnd)), ("cancel_at", nil),
            ("canceled_at", optional(canceledAt)), ("ended_at", optional(endedAt)),
            ("cancellation_details", ["reason": cancellationReason.map { .string($0) } ?? .null]),
        ]
        let item: JSON = ["id": "si_1", "price": ["id": "price_monthly", "product": "prod_premium"]]
        if basil {
            fields.append(("items", ["data": [.object([("current_period_start", .integer(periodStart)), ("current_period_end", .integer(periodEnd))] + (item.fields))]]))
        } else {
            fields += [("current_period_start", .integer(periodStart)), ("current_period_end", .integer(periodEnd)), ("items", ["data": [item]])]
        }
        return .object(fields)
    }

    static func invoice(
        _ id: String, subscription: String, customer: String, user: String? = nil, price: String = "price_monthly",
        periodStart: Int64, periodEnd: Int64, reason: String, amountPaid: Int64 = 999, basil: Bool = false
    ) -> JSON {
        let metadata = Self.metadata(user)
        if basil {
            return [
                "id": .string(id), "object": "invoice", "customer": .string(customer), "livemode": false, "billing_reason": .string(reason),
                "amount_paid": .integer(amountPaid), "currency": "usd",
                "parent": ["type": "subscription_details", "subscription_details": ["subscription": .string(subscription), "metadata": metadata]],
                "lines": ["data": [[
                    "id": "il_1", "amount": .integer(amountPaid), "period": ["start": .integer(periodStart), "end": .integer(periodEnd)],
                    "parent": ["type": "subscription_item_details"],
                    "pricing": ["type": "price_details", "price_details": ["price": .string(price), "product": "prod_premium"]],
                ]]],
            ]
        }
        return [
            "id": .string(id), "object": "invoice", "customer": .string(customer), "livemode": false, "billing_reason": .string(reason),
            "amount_paid": .integer(amountPaid), "currency": "usd", "subscription": .string(subscription), "subscription_details": ["metadata": metadata],
            "lines": ["data": [[
                "id": "il_1", "type": "subscription", "amount": .integer(amountPaid), "period": ["start": .integer(periodStart), "end": .integer(periodEnd)],
                "price": ["id": .string(price), "product": "prod_premium"],
            ]]],
        ]
    }

    static func charge(_ id: String, customer: String, invoice: String?, refunded: Bool = true) -> JSON {
        ["id": .string(id), "object": "charge", "customer": .string(customer), "invoice": invoice.map { .string($0) } ?? .null, "refunded": .bool(refunded), "metadata": [:]]
    }
}

extension JSON {
    var fields: [(String, JSON)] {
        if case .object(let fields) = self { fields } else { [] }
    }
}
