/// A problem in an input file, located precisely enough for a person to fix it:
/// `customers.jsonl:1042: transactions[3].expirationDate: not an RFC 3339 date`.
public struct InputError: Error, Hashable, CustomStringConvertible {
    /// The file's name as given (e.g. `customers.jsonl`).
    public var file: String
    /// The 1-based line, for line-oriented files; nil for a whole-file JSON document.
    public var line: Int?
    /// The path to the field, e.g. `transactions[3].expirationDate`; empty for the line itself.
    public var field: String
    /// What is wrong.
    public var reason: String

    /// Creates an error.
    public init(file: String, line: Int? = nil, field: String = "", reason: String) {
        self.file = file
        self.line = line
        self.field = field
        self.reason = reason
    }

    public var description: String {
        var text = self.file
        if let line = self.line {
            text += ":\(line)"
        }
        if !self.field.isEmpty {
            text += ": \(self.field)"
        }
        return text + ": " + self.reason
    }
}

/// A validation problem found inside one record, before its file and line are known.
struct FieldError: Error {
    var field: String
    var reason: String

    func located(file: String, line: Int?) -> InputError {
        InputError(file: file, line: line, field: self.field, reason: self.reason)
    }
}
