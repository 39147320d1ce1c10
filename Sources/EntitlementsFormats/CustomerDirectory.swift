public import EntitlementsMessages

/// Customers held in memory, found by id or by alias (rule 11 of
/// docs/entitlement-rules.md). For the JSON input of tests, tools and the snapshot
/// builder; the server answers from the snapshot's own index.
public struct CustomerDirectory: Sendable {
    private var records: [String: CustomerRecord] = [:]
    /// alias -> canonical customer id
    private var owners: [String: String] = [:]
    /// id or alias -> the line that defined it, for error messages
    private var lines: [String: Int] = [:]

    /// An empty directory.
    public init() {}

    /// The number of customers.
    public var count: Int { self.records.count }

    /// Every customer, in no particular order.
    public var customers: some Collection<CustomerRecord> { self.records.values }

    /// Adds `record`. Throws when its id or an alias is already taken, by id or alias.
    public mutating func add(_ record: CustomerRecord, file: String = "customers.jsonl", line: Int? = nil) throws {
        let id = record.id ?? ""
        if let taken = self.claim(of: id) {
            throw InputError(file: file, line: line, field: "id", reason: "\"\(id)\" is already \(taken)")
        }
        for (index, alias) in record.aliases.enumerated() {
            if let taken = self.claim(of: alias) {
                throw InputError(file: file, line: line, field: "aliases[\(index)]", reason: "\"\(alias)\" is already \(taken)")
            }
        }
        self.records[id] = record
        self.lines[id] = line
        for alias in record.aliases {
            self.owners[alias] = id
            self.lines[alias] = line
        }
    }

    /// The customer whose id or alias is `userId`, or nil for an unknown user.
    public func customer(for userId: String) -> CustomerRecord? {
        if let record = self.records[userId] {
            return record
        }
        return self.owners[userId].flatMap { self.records[$0] }
    }

    /// Loads a customers.jsonl file, validating every line and the aliases across lines.
    public static func load(path: String) throws -> CustomerDirectory {
        var directory = CustomerDirectory()
        try CustomersFile.forEachCustomer(path: path) { record, line in
            try directory.add(record, file: path, line: line)
        }
        return directory
    }

    private func claim(of key: String) -> String? {
        let place = self.lines[key].map { " (line \($0))" } ?? ""
        if self.records[key] != nil {
            return "a customer id\(place)"
        }
        if let owner = self.owners[key] {
            return "an alias of customer \"\(owner)\"\(place)"
        }
        return nil
    }
}
