import Foundation

/// A parsed JSON document, read by path: `event["data"]["object"]["id"].string`. A store's
/// event changes shape between its API versions, so the mappings read the fields they
/// need wherever each version puts them, and a missing field is nil, not a decoding error.
enum EventJSON: Decodable, Sendable {
    case null
    case bool(Bool)
    case integer(Int64)
    case number(Double)
    case string(String)
    case array([EventJSON])
    case object([String: EventJSON])

    /// Parses `bytes`; throws a rejection for anything but a JSON object.
    init(parsing bytes: [UInt8]) throws(IngestionRejection) {
        let parsed: EventJSON
        do {
            parsed = try JSONDecoder().decode(EventJSON.self, from: Data(bytes))
        } catch {
            throw IngestionRejection(.malformedJSON, "the body is not JSON")
        }
        guard case .object = parsed else {
            throw IngestionRejection(.malformedJSON, "the body is JSON but not an object")
        }
        self = parsed
    }

    init(from decoder: any Decoder) throws {
        let container = try decoder.singleValueContainer()
        if container.decodeNil() {
            self = .null
        } else if let value = try? container.decode(Bool.self) {
            self = .bool(value)
        } else if let value = try? container.decode(Int64.self) {
            self = .integer(value)
        } else if let value = try? container.decode(Double.self) {
            self = .number(value)
        } else if let value = try? container.decode(String.self) {
            self = .string(value)
        } else if let value = try? container.decode([EventJSON].self) {
            self = .array(value)
        } else {
            self = .object(try container.decode([String: EventJSON].self))
        }
    }

    subscript(key: String) -> EventJSON {
        if case .object(let fields) = self, let value = fields[key] {
            return value
        }
        return .null
    }

    subscript(index: Int) -> EventJSON {
        if case .array(let elements) = self, elements.indices.contains(index) {
            return elements[index]
        }
        return .null
    }

    var isNull: Bool {
        if case .null = self { true } else { false }
    }

    var string: String? {
        if case .string(let value) = self { value } else { nil }
    }

    /// A whole number (not one with a fraction).
    var int64: Int64? {
        if case .integer(let value) = self { value } else { nil }
    }

    var bool: Bool? {
        if case .bool(let value) = self { value } else { nil }
    }

    var array: [EventJSON] {
        if case .array(let elements) = self { elements } else { [] }
    }

    /// The string values of an object of strings (Stripe's `metadata`).
    var strings: [String: String] {
        guard case .object(let fields) = self else {
            return [:]
        }
        return fields.compactMapValues(\.string)
    }
}
