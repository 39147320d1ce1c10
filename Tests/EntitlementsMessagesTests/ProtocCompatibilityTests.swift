import Foundation
import Testing

@testable import EntitlementsMessages

/// The bytes are standard protobuf: Google's `protoc` reads what we write, and we read
/// what it writes. Needs `protoc` on PATH (`make deps` installs protobuf-compiler).
@Suite("protoc compatibility")
struct ProtocCompatibilityTests {
    @Test("protoc --decode reads every field we encode, and we decode protoc --encode's bytes", arguments: Fixtures.all.indices)
    func protocRoundTrip(index: Int) throws {
        let message = Fixtures.all[index] as! any ProtobufCBacked
        try Self.check(message)
    }

    @Test("protoc decodes a CheckEntitlementsRequest to the expected text")
    func exactText() throws {
        let text = try Protoc.decode(Fixtures.checkRequest.serializedBytes(), as: CheckEntitlementsRequest.protoMessageName)
        #expect(
            text == """
                user_id: "user-1"
                entitlement_ids: "premium"
                entitlement_ids: "pro"
                at: 1767225600000
                environment: ENVIRONMENT_SANDBOX
                min_log_sequence: 42
                explain: true

                """
        )
    }

    @Test("we decode a message written by protoc --encode to the expected values")
    func decodesProtocText() throws {
        let bytes = try Protoc.encode(
            """
            id: "premium"
            is_active: true
            source: SOURCE_PLAYSTORE
            expiration_date: 0
            renew_state: RENEW_STATE_CANCELED
            renews_count: 3
            transactions { transaction_id: "t1" type: TRANSACTION_TYPE_TRIAL_STARTED }
            grace_period_expiration_date: -1
            """,
            as: Entitlement.protoMessageName
        )
        let entitlement = try Entitlement(serializedBytes: bytes)
        #expect(
            entitlement
                == Entitlement(
                    id: "premium",
                    isActive: true,
                    source: .playstore,
                    expirationDate: 0,
                    renewState: .canceled,
                    renewsCount: 3,
                    transactions: [Transaction(transactionId: "t1", type: .trialStarted)],
                    gracePeriodExpirationDate: -1
                )
        )
    }

    private static func check(_ message: some ProtobufCBacked) throws {
        let name = type(of: message).protoMessageName
        let text = try Protoc.decode(message.serializedBytes(), as: name)
        // Every field of the descriptor shows up in protoc's text (for LogRecord, one of
        // the oneof's members), so no field was dropped on the way out.
        let fields = type(of: message).protobufCFieldNames
        let topLevelNames = Set(
            text.split(separator: "\n").filter { !$0.hasPrefix(" ") }.compactMap {
                $0.split(whereSeparator: { $0 == ":" || $0 == " " }).first.map(String.init)
            }
        )
        let present = fields.filter { topLevelNames.contains($0) }
        if type(of: message) == LogRecord.self {
            #expect(present.count == fields.count - 6, "\(name):\n\(text)")
        } else if type(of: message) == SubmitPurchaseRequest.self {
            #expect(present.count == fields.count - 1, "\(name):\n\(text)")  // one member of its oneof
        } else {
            #expect(present == fields, "\(name) is missing \(Set(fields).subtracting(present).sorted()) in:\n\(text)")
        }
        // protoc re-encodes its own reading; we must decode that to the original value.
        let reencoded = try Protoc.encode(text, as: name)
        #expect(try type(of: message).init(serializedBytes: reencoded) == message, "\(name)")
    }
}

/// Runs Google's protoc on the schema in proto/.
enum Protoc {
    static let protoDirectory = URL(fileURLWithPath: #filePath)
        .deletingLastPathComponent().deletingLastPathComponent().deletingLastPathComponent()
        .appendingPathComponent("proto")
    static let files = ["types", "service", "storage"].map { "entitlements/v1/\($0).proto" } + ["grpc/health/v1/health.proto"]

    static func decode(_ bytes: [UInt8], as messageName: String) throws -> String {
        String(decoding: try self.run(["--decode=\(messageName)"], input: bytes), as: UTF8.self)
    }

    static func encode(_ text: String, as messageName: String) throws -> [UInt8] {
        try self.run(["--encode=\(messageName)"], input: Array(text.utf8))
    }

    struct Failure: Error, CustomStringConvertible {
        var description: String
    }

    private static func run(_ arguments: [String], input: [UInt8]) throws -> [UInt8] {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["protoc", "-I", self.protoDirectory.path] + arguments + self.files
        let stdin = Pipe()
        let stdout = Pipe()
        let stderr = Pipe()
        process.standardInput = stdin
        process.standardOutput = stdout
        process.standardError = stderr
        try process.run()
        // Small messages only: the pipes' buffers hold them, so writing before reading
        // cannot deadlock.
        stdin.fileHandleForWriting.write(Data(input))
        try stdin.fileHandleForWriting.close()
        let output = stdout.fileHandleForReading.readDataToEndOfFile()
        let errors = stderr.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        guard process.terminationStatus == 0 else {
            throw Failure(description: "protoc \(arguments.joined(separator: " ")) failed: \(String(decoding: errors, as: UTF8.self))")
        }
        return Array(output)
    }
}
