/// Why a message could not be decoded or encoded.
///
/// The description names the message, the field path and the problem, e.g.
/// `entitlements.v1.CheckEntitlementsResponse.entitlements[2].renew_state: unknown enum value 9`.
public struct ProtobufError: Error, Hashable, CustomStringConvertible {
    /// The kind of problem.
    public enum Code: Sendable, Hashable {
        /// The bytes are not a protobuf encoding of the message (truncated, bad tag or wire type).
        case malformed
        /// A string field is not UTF-8, or contains a NUL byte.
        case invalidString
        /// An enum field holds a number the schema does not define.
        case unknownEnumValue
        /// The message needs more memory than the decoder allows for one message.
        case tooLarge
    }

    /// The kind of problem.
    public var code: Code
    /// The fully qualified name of the outermost message, e.g. `entitlements.v1.Grant`.
    public var messageName: String
    /// The path to the offending field, e.g. `entitlements[2].renew_state`; empty for the
    /// message as a whole.
    public var fieldPath: String
    /// What is wrong, for people.
    public var reason: String

    /// Creates an error.
    public init(code: Code, messageName: String = "", fieldPath: String = "", reason: String) {
        self.code = code
        self.messageName = messageName
        self.fieldPath = fieldPath
        self.reason = reason
    }

    public var description: String {
        var location = self.messageName
        if !self.fieldPath.isEmpty {
            location += location.isEmpty ? self.fieldPath : "." + self.fieldPath
        }
        return location.isEmpty ? self.reason : "\(location): \(self.reason)"
    }

    /// The same error, one level further out: `field` (and `index`) is prepended to the path.
    func nested(in field: StaticString, index: Int? = nil) -> ProtobufError {
        var copy = self
        var prefix = "\(field)"
        if let index {
            prefix += "[\(index)]"
        }
        copy.fieldPath = copy.fieldPath.isEmpty ? prefix : prefix + "." + copy.fieldPath
        return copy
    }
}
