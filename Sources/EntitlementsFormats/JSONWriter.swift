/// A JSON value with ordered object keys, and its serialisation. Output formats build
/// these so that key order is fixed (the schema's order) and output is byte-for-byte stable;
/// fleet mode builds the rows of its column tables with it.
public enum JSONValue {
    case null
    case bool(Bool)
    case int(Int64)
    case string(String)
    case array([JSONValue])
    case object([(String, JSONValue)])

    /// An instant as RFC 3339 UTC with milliseconds, or null when absent.
    public static func date(_ milliseconds: Int64?) -> JSONValue {
        milliseconds.map { .string(RFC3339.format($0)) } ?? .null
    }

    /// A string, or null when absent.
    public static func string(_ value: String?) -> JSONValue {
        value.map { .string($0) } ?? .null
    }

    /// An enum's JSON name, or null for its unset value.
    public static func name(_ value: some JSONNamedEnum) -> JSONValue {
        value.jsonName.map { .string($0) } ?? .null
    }

    /// Serialises the value: compact, or pretty with two-space indentation.
    public func serialized(pretty: Bool) -> String {
        var out = ""
        self.write(to: &out, pretty: pretty, indent: 0)
        return out
    }

    private func write(to out: inout String, pretty: Bool, indent: Int) {
        switch self {
        case .null: out += "null"
        case .bool(let value): out += value ? "true" : "false"
        case .int(let value): out += String(value)
        case .string(let value): Self.writeString(value, to: &out)
        case .array(let values):
            guard !values.isEmpty else {
                out += "[]"
                return
            }
            out += "["
            for (index, value) in values.enumerated() {
                if index > 0 { out += "," }
                Self.newline(&out, pretty: pretty, indent: indent + 1)
                value.write(to: &out, pretty: pretty, indent: indent + 1)
            }
            Self.newline(&out, pretty: pretty, indent: indent)
            out += "]"
        case .object(let members):
            guard !members.isEmpty else {
                out += "{}"
                return
            }
            out += "{"
            for (index, (key, value)) in members.enumerated() {
                if index > 0 { out += "," }
                Self.newline(&out, pretty: pretty, indent: indent + 1)
                Self.writeString(key, to: &out)
                out += pretty ? ": " : ":"
                value.write(to: &out, pretty: pretty, indent: indent + 1)
            }
            Self.newline(&out, pretty: pretty, indent: indent)
            out += "}"
        }
    }

    private static func newline(_ out: inout String, pretty: Bool, indent: Int) {
        if pretty {
            out += "\n" + String(repeating: "  ", count: indent)
        }
    }

    private static func writeString(_ value: String, to out: inout String) {
        // Most strings need no escape: appended whole, not scalar by scalar.
        if !value.utf8.contains(where: { $0 < 0x20 || $0 == UInt8(ascii: "\"") || $0 == UInt8(ascii: "\\") }) {
            out += "\""
            out += value
            out += "\""
            return
        }
        out += "\""
        for scalar in value.unicodeScalars {
            switch scalar {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\r": out += "\\r"
            case "\t": out += "\\t"
            case _ where scalar.value < 0x20:
                let hex = String(scalar.value, radix: 16)
                out += "\\u" + String(repeating: "0", count: 4 - hex.count) + hex
            default: out.unicodeScalars.append(scalar)
            }
        }
        out += "\""
    }
}
