/// Requests in protobuf's JSON mapping (https://protobuf.dev/programming-guides/json/), as
/// the HTTP/JSON door reads them (docs/doors.md): field names in lowerCamelCase or as in the
/// .proto, 64-bit integers as JSON numbers or decimal strings, enum values by their full
/// name (`ENVIRONMENT_SANDBOX`) or number, `null` for absent.
///
/// One choice the mapping leaves open: an unknown field is an error that names it (a typo
/// in a field name would otherwise be a silently different request). The decoding of each
/// message is generated from proto/ (Generated/ProtoJSON.pb.swift).
public enum ProtoJSON {
    /// The deepest nesting of arrays and objects accepted (a request nests 3 deep at most).
    public static let maximumDepth = 32

    /// Decodes a message from a JSON document.
    public static func decode<Message: ProtoJSONDecodable>(_ type: Message.Type, from bytes: some Collection<UInt8>) throws(ProtoJSONError) -> Message {
        var parser = Parser(bytes: Array(bytes))
        let value = try parser.document()
        return try Message(protoJSON: value, path: "")
    }

    /// A parsed JSON value. Numbers keep their text, so that 64-bit integers are exact.
    public indirect enum Value: Sendable {
        case null
        case bool(Bool)
        case number(String)
        case string(String)
        case array([Value])
        case object([(String, Value)])

        var kind: String {
            switch self {
            case .null: "null"
            case .bool: "a boolean"
            case .number: "a number"
            case .string: "a string"
            case .array: "an array"
            case .object: "an object"
            }
        }
    }

    /// A strict RFC 8259 parser over bytes.
    struct Parser {
        let bytes: [UInt8]
        var index = 0
        var depth = 0

        init(bytes: [UInt8]) {
            self.bytes = bytes
        }

        mutating func document() throws(ProtoJSONError) -> Value {
            let value = try self.value()
            self.skipSpace()
            guard self.index == self.bytes.count else {
                throw self.error("unexpected \(self.describeNext()) after the JSON value")
            }
            return value
        }

        private func error(_ message: String) -> ProtoJSONError {
            ProtoJSONError("the body is not valid JSON: \(message) (at byte \(self.index))")
        }

        private func describeNext() -> String {
            guard self.index < self.bytes.count else {
                return "end of input"
            }
            let byte = self.bytes[self.index]
            return byte >= 0x20 && byte < 0x7F ? "'\(Character(UnicodeScalar(byte)))'" : "byte 0x\(String(byte, radix: 16))"
        }

        private mutating func skipSpace() {
            while self.index < self.bytes.count, [0x20, 0x09, 0x0A, 0x0D].contains(self.bytes[self.index]) {
                self.index += 1
            }
        }

        private mutating func literal(_ text: String, _ value: Value) throws(ProtoJSONError) -> Value {
            let utf8 = Array(text.utf8)
            guard self.bytes.count - self.index >= utf8.count, Array(self.bytes[self.index..<self.index + utf8.count]) == utf8 else {
                throw self.error("unexpected \(self.describeNext())")
            }
            self.index += utf8.count
            return value
        }

        private mutating func value() throws(ProtoJSONError) -> Value {
            self.skipSpace()
            guard self.index < self.bytes.count else {
                throw self.error("unexpected end of input")
            }
            switch self.bytes[self.index] {
            case UInt8(ascii: "{"): return try self.object()
            case UInt8(ascii: "["): return try self.array()
            case UInt8(ascii: "\""): return .string(try self.string())
            case UInt8(ascii: "t"): return try self.literal("true", .bool(true))
            case UInt8(ascii: "f"): return try self.literal("false", .bool(false))
            case UInt8(ascii: "n"): return try self.literal("null", .null)
            case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return try self.number()
            default: throw self.error("unexpected \(self.describeNext())")
            }
        }

        private mutating func nest() throws(ProtoJSONError) {
            self.depth += 1
            guard self.depth <= ProtoJSON.maximumDepth else {
                throw self.error("nested deeper than \(ProtoJSON.maximumDepth) levels")
            }
        }

        private mutating func object() throws(ProtoJSONError) -> Value {
            try self.nest()
            self.index += 1
            var members: [(String, Value)] = []
            self.skipSpace()
            if self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: "}") {
                self.index += 1
                self.depth -= 1
                return .object(members)
            }
            while true {
                self.skipSpace()
                guard self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: "\"") else {
                    throw self.error("expected a member name in quotes, found \(self.describeNext())")
                }
                let key = try self.string()
                self.skipSpace()
                guard self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: ":") else {
                    throw self.error("expected ':' after \"\(key)\", found \(self.describeNext())")
                }
                self.index += 1
                members.append((key, try self.value()))
                self.skipSpace()
                guard self.index < self.bytes.count else {
                    throw self.error("unexpected end of input in an object")
                }
                if self.bytes[self.index] == UInt8(ascii: ",") {
                    self.index += 1
                    continue
                }
                guard self.bytes[self.index] == UInt8(ascii: "}") else {
                    throw self.error("expected ',' or '}', found \(self.describeNext())")
                }
                self.index += 1
                self.depth -= 1
                return .object(members)
            }
        }

        private mutating func array() throws(ProtoJSONError) -> Value {
            try self.nest()
            self.index += 1
            var elements: [Value] = []
            self.skipSpace()
            if self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: "]") {
                self.index += 1
                self.depth -= 1
                return .array(elements)
            }
            while true {
                elements.append(try self.value())
                self.skipSpace()
                guard self.index < self.bytes.count else {
                    throw self.error("unexpected end of input in an array")
                }
                if self.bytes[self.index] == UInt8(ascii: ",") {
                    self.index += 1
                    continue
                }
                guard self.bytes[self.index] == UInt8(ascii: "]") else {
                    throw self.error("expected ',' or ']', found \(self.describeNext())")
                }
                self.index += 1
                self.depth -= 1
                return .array(elements)
            }
        }

        private mutating func number() throws(ProtoJSONError) -> Value {
            let start = self.index
            func digits(_ parser: inout Parser) -> Int {
                let from = parser.index
                while parser.index < parser.bytes.count, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(parser.bytes[parser.index]) {
                    parser.index += 1
                }
                return parser.index - from
            }
            if self.bytes[self.index] == UInt8(ascii: "-") {
                self.index += 1
            }
            let intStart = self.index
            let intDigits = digits(&self)
            guard intDigits > 0, !(intDigits > 1 && self.bytes[intStart] == UInt8(ascii: "0")) else {
                throw self.error("malformed number")
            }
            if self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: ".") {
                self.index += 1
                guard digits(&self) > 0 else {
                    throw self.error("malformed number")
                }
            }
            if self.index < self.bytes.count, self.bytes[self.index] | 0x20 == UInt8(ascii: "e") {
                self.index += 1
                if self.index < self.bytes.count, self.bytes[self.index] == UInt8(ascii: "+") || self.bytes[self.index] == UInt8(ascii: "-") {
                    self.index += 1
                }
                guard digits(&self) > 0 else {
                    throw self.error("malformed number")
                }
            }
            return .number(String(decoding: self.bytes[start..<self.index], as: UTF8.self))
        }

        private mutating func hex4() throws(ProtoJSONError) -> UInt32 {
            guard self.bytes.count - self.index >= 4 else {
                throw self.error("truncated \\u escape")
            }
            var value: UInt32 = 0
            for _ in 0..<4 {
                let byte = self.bytes[self.index]
                let digit: UInt8
                switch byte {
                case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
                case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
                case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
                default: throw self.error("bad \\u escape")
                }
                value = value << 4 | UInt32(digit)
                self.index += 1
            }
            return value
        }

        private mutating func string() throws(ProtoJSONError) -> String {
            self.index += 1  // the opening quote
            var out: [UInt8] = []
            while true {
                guard self.index < self.bytes.count else {
                    throw self.error("unterminated string")
                }
                let byte = self.bytes[self.index]
                self.index += 1
                switch byte {
                case UInt8(ascii: "\""):
                    guard let text = String(validating: out, as: UTF8.self) else {
                        throw self.error("a string is not valid UTF-8")
                    }
                    return text
                case UInt8(ascii: "\\"):
                    guard self.index < self.bytes.count else {
                        throw self.error("unterminated string")
                    }
                    let escape = self.bytes[self.index]
                    self.index += 1
                    switch escape {
                    case UInt8(ascii: "\""), UInt8(ascii: "\\"), UInt8(ascii: "/"): out.append(escape)
                    case UInt8(ascii: "b"): out.append(0x08)
                    case UInt8(ascii: "f"): out.append(0x0C)
                    case UInt8(ascii: "n"): out.append(0x0A)
                    case UInt8(ascii: "r"): out.append(0x0D)
                    case UInt8(ascii: "t"): out.append(0x09)
                    case UInt8(ascii: "u"):
                        var scalar = try self.hex4()
                        if (0xD800..<0xDC00).contains(scalar) {
                            guard self.bytes.count - self.index >= 6, self.bytes[self.index] == UInt8(ascii: "\\"), self.bytes[self.index + 1] == UInt8(ascii: "u") else {
                                throw self.error("a \\u surrogate without its pair")
                            }
                            self.index += 2
                            let low = try self.hex4()
                            guard (0xDC00..<0xE000).contains(low) else {
                                throw self.error("a \\u surrogate without its pair")
                            }
                            scalar = 0x10000 + (scalar - 0xD800) << 10 + (low - 0xDC00)
                        }
                        guard let unicode = Unicode.Scalar(scalar) else {
                            throw self.error("a \\u escape that is not a character")
                        }
                        out.append(contentsOf: Array(String(Character(unicode)).utf8))
                    default:
                        throw self.error("bad escape '\\\(Character(UnicodeScalar(escape)))'")
                    }
                case 0..<0x20:
                    throw self.error("a control character in a string")
                default:
                    out.append(byte)
                }
            }
        }
    }
}

extension Character {
    fileprivate var isASCIIDigitCharacter: Bool { ("0"..."9").contains(self) }
}

/// A request that is not valid JSON, or not the message the method takes.
public struct ProtoJSONError: Error, Sendable, CustomStringConvertible {
    public var description: String

    public init(_ description: String) {
        self.description = description
    }
}

/// A message decodable from protobuf's JSON mapping (generated for every message in proto/).
public protocol ProtoJSONDecodable {
    init(protoJSON value: ProtoJSON.Value, path: String) throws(ProtoJSONError)
}

/// An enum's values by their .proto names, for the JSON mapping (generated).
public protocol ProtoJSONEnum: RawRepresentable<Int32>, CaseIterable {
    static var protoJSONNames: [(String, Self)] { get }
}

/// Reads one JSON object as a message: each field by its JSON or .proto name, every member
/// accounted for. Used by the generated decoders.
public struct ProtoJSONObject {
    private var members: [(String, ProtoJSON.Value)]
    private var used: [Bool]
    private let path: String

    public init(_ value: ProtoJSON.Value, path: String, message: String) throws(ProtoJSONError) {
        guard case .object(let members) = value else {
            throw ProtoJSONError("\(path.isEmpty ? "the body" : path): expected an object (\(message)), found \(value.kind)")
        }
        self.members = members
        self.used = Array(repeating: false, count: members.count)
        self.path = path
    }

    private func field(_ name: String) -> String {
        self.path.isEmpty ? name : "\(self.path).\(name)"
    }

    /// The member named `json` or `proto`; nil when absent or null. Both names at once, or
    /// one twice, is an error.
    private mutating func take(_ json: String, _ proto: String) throws(ProtoJSONError) -> ProtoJSON.Value? {
        var found: ProtoJSON.Value?
        for (index, (key, value)) in self.members.enumerated() where key == json || key == proto {
            guard found == nil, !self.used[index] else {
                throw ProtoJSONError("\(self.field(json)): given more than once")
            }
            self.used[index] = true
            found = value
        }
        if case .null = found {
            return nil
        }
        return found
    }

    /// Fails on a member no field took.
    public func finish() throws(ProtoJSONError) {
        if let index = self.used.firstIndex(of: false) {
            throw ProtoJSONError("\(self.field(self.members[index].0)): no such field (unknown fields are refused; see docs/doors.md)")
        }
    }

    public mutating func string(_ json: String, _ proto: String) throws(ProtoJSONError) -> String? {
        guard let value = try self.take(json, proto) else {
            return nil
        }
        guard case .string(let text) = value else {
            throw ProtoJSONError("\(self.field(json)): expected a string, found \(value.kind)")
        }
        return text
    }

    public mutating func strings(_ json: String, _ proto: String) throws(ProtoJSONError) -> [String] {
        try self.array(json, proto).enumerated().map { (index, value) throws(ProtoJSONError) in
            guard case .string(let text) = value else {
                throw ProtoJSONError("\(self.field(json))[\(index)]: expected a string, found \(value.kind)")
            }
            return text
        }
    }

    public mutating func bool(_ json: String, _ proto: String) throws(ProtoJSONError) -> Bool {
        guard let value = try self.take(json, proto) else {
            return false
        }
        guard case .bool(let flag) = value else {
            throw ProtoJSONError("\(self.field(json)): expected true or false, found \(value.kind)")
        }
        return flag
    }

    public mutating func int64(_ json: String, _ proto: String) throws(ProtoJSONError) -> Int64? {
        guard let value = try self.take(json, proto) else {
            return nil
        }
        return try self.integer(value, json, Int64.self)
    }

    public mutating func uint64(_ json: String, _ proto: String) throws(ProtoJSONError) -> UInt64 {
        guard let value = try self.take(json, proto) else {
            return 0
        }
        return try self.integer(value, json, UInt64.self)
    }

    public mutating func uint32(_ json: String, _ proto: String) throws(ProtoJSONError) -> UInt32 {
        guard let value = try self.take(json, proto) else {
            return 0
        }
        return try self.integer(value, json, UInt32.self)
    }

    /// An integer given as a JSON number or a decimal string (the mapping writes 64-bit
    /// values as strings); an exponent or a fraction is refused unless it is whole.
    private func integer<T: FixedWidthInteger>(_ value: ProtoJSON.Value, _ json: String, _ type: T.Type) throws(ProtoJSONError) -> T {
        let text: String
        switch value {
        case .number(let number): text = number
        case .string(let string): text = string
        default: throw ProtoJSONError("\(self.field(json)): expected an integer, found \(value.kind)")
        }
        if let exact = T(text) ?? Self.wholeNumber(text, as: T.self) {
            return exact
        }
        throw ProtoJSONError("\(self.field(json)): \"\(text)\" is not a whole number from \(T.min) to \(T.max)")
    }

    /// A whole number written with a fraction or an exponent (`5.0`, `1e3`, `-2.50e1`), in
    /// exact decimal arithmetic: `[-]digits[.digits][e[+|-]digits]` and nothing else.
    static func wholeNumber<T: FixedWidthInteger>(_ text: String, as type: T.Type) -> T? {
        var rest = Substring(text)
        let negative = rest.first == "-"
        if negative {
            rest = rest.dropFirst()
        }
        var exponent = 0
        if let e = rest.firstIndex(where: { $0 == "e" || $0 == "E" }) {
            var power = rest[rest.index(after: e)...]
            if power.first == "+" {
                power = power.dropFirst()
            }
            guard let value = Int(power), (-400...400).contains(value) else {
                return nil
            }
            exponent = value
            rest = rest[..<e]
        }
        let parts = rest.split(separator: ".", maxSplits: 1, omittingEmptySubsequences: false)
        let whole = parts[0]
        let fraction = parts.count > 1 ? parts[1] : ""
        guard !whole.isEmpty, whole.allSatisfy(\.isASCIIDigitCharacter), fraction.allSatisfy(\.isASCIIDigitCharacter), parts.count == 1 || !fraction.isEmpty else {
            return nil
        }
        var digits = String(whole + fraction)
        let scale = exponent - fraction.count
        if scale < 0 {
            let dropped = digits.suffix(-scale)
            guard dropped.count == -scale, dropped.allSatisfy({ $0 == "0" }) else {
                return nil  // a fraction that is not zero
            }
            digits.removeLast(-scale)
        } else {
            guard scale <= 40 else {
                return nil
            }
            digits += String(repeating: "0", count: scale)
        }
        return T((negative ? "-" : "") + (digits.isEmpty ? "0" : digits))
    }

    public mutating func enumeration<E: ProtoJSONEnum>(_ json: String, _ proto: String, as type: E.Type) throws(ProtoJSONError) -> E? {
        guard let value = try self.take(json, proto) else {
            return nil
        }
        switch value {
        case .string(let name):
            if let match = E.protoJSONNames.first(where: { $0.0 == name }) {
                return match.1
            }
            throw ProtoJSONError("\(self.field(json)): \"\(name)\" is not one of \(E.protoJSONNames.map(\.0).joined(separator: ", "))")
        case .number(let text):
            if let number = Int32(text), let match = E(rawValue: number) {
                return match
            }
            throw ProtoJSONError("\(self.field(json)): \(text) is not a value of the enum")
        default:
            throw ProtoJSONError("\(self.field(json)): expected an enum value's name, found \(value.kind)")
        }
    }

    public mutating func message<M: ProtoJSONDecodable>(_ json: String, _ proto: String, as type: M.Type) throws(ProtoJSONError) -> M? {
        guard let value = try self.take(json, proto) else {
            return nil
        }
        return try M(protoJSON: value, path: self.field(json))
    }

    public mutating func messages<M: ProtoJSONDecodable>(_ json: String, _ proto: String, as type: M.Type) throws(ProtoJSONError) -> [M] {
        let field = self.field(json)
        return try self.array(json, proto).enumerated().map { (index, value) throws(ProtoJSONError) in
            try M(protoJSON: value, path: "\(field)[\(index)]")
        }
    }

    private mutating func array(_ json: String, _ proto: String) throws(ProtoJSONError) -> [ProtoJSON.Value] {
        guard let value = try self.take(json, proto) else {
            return []
        }
        guard case .array(let elements) = value else {
            throw ProtoJSONError("\(self.field(json)): expected an array, found \(value.kind)")
        }
        return elements
    }

    /// Fails when more than one member of a oneof is set.
    public func oneOf(_ name: String, _ setCount: Int) throws(ProtoJSONError) {
        if setCount > 1 {
            throw ProtoJSONError("\(self.field(name)): at most one of its fields may be set")
        }
    }
}
