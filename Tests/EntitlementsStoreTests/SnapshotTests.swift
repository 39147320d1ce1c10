import EntitlementsFormats
import EntitlementsMessages
import EntitlementsResolver
import EntitlementsTools
import Foundation
import Testing

@testable import EntitlementsStore

/// A scratch directory per test, removed afterwards.
struct ScratchDirectory: ~Copyable {
    let path: String

    init() throws {
        self.path = FileManager.default.temporaryDirectory.appendingPathComponent("snapshot-tests-\(UUID().uuidString)").path
        try FileManager.default.createDirectory(atPath: self.path, withIntermediateDirectories: true)
    }

    deinit {
        try? FileManager.default.removeItem(atPath: self.path)
    }

    func file(_ name: String) -> String {
        self.path + "/" + name
    }

    var contents: [String] {
        (try? FileManager.default.contentsOfDirectory(atPath: self.path))?.sorted() ?? []
    }
}

let now: Int64 = 1_795_305_600_000  // 2026-11-22T00:00:00Z
let day: Int64 = 86_400_000

@Suite("snapshot file")
struct SnapshotTests {
    @Test("CRC-32C matches the standard check value")
    func crc32c() {
        #expect(CRC32C.checksum(Array("123456789".utf8)) == 0xE306_9283)
        #expect(CRC32C.checksum([UInt8]()) == 0)
        // Continuing a checksum equals checksumming the concatenation.
        let whole = CRC32C.checksum(Array("hello, world".utf8))
        #expect(CRC32C.checksum(Array(", world".utf8), continuing: CRC32C.checksum(Array("hello".utf8))) == whole)
    }

    @Test("build -> open -> lookup finds every generated customer and alias, and resolves as the JSON input does")
    func roundTripAgainstJSON() throws {
        let scratch = try ScratchDirectory()
        try SnapshotTools.generateJSON(
            count: 1_500, seed: 42, now: now,
            customersPath: scratch.file("customers.jsonl"), catalogPath: scratch.file("catalog.json")
        )
        let report = try SnapshotTools.build(
            catalogPath: scratch.file("catalog.json"),
            customersPath: scratch.file("customers.jsonl"),
            outputPath: scratch.file("data.snap"),
            createdDate: now,
            hotList: ["user-3", "user-1"]
        )
        #expect(report.customers == 1_500)

        let directory = try CustomerDirectory.load(path: scratch.file("customers.jsonl"))
        let catalog = try CatalogFile.load(path: scratch.file("catalog.json"))
        let reader = try SnapshotReader(path: scratch.file("data.snap"))
        #expect(reader.header.recordCount == 1_500)
        #expect(reader.catalog == catalog)
        #expect(reader.hotList == ["user-3", "user-1"])
        let resolver = EntitlementResolver(catalog: reader.catalog)
        let jsonResolver = EntitlementResolver(catalog: catalog)
        var aliases = 0
        for expected in directory.customers {
            for key in [expected.id!] + expected.aliases {
                let found = try reader.customer(for: key)
                #expect(found == expected, "\(key)")
                for instant in [now, now + 40 * day] {
                    #expect(resolver.resolve(found, at: instant) == jsonResolver.resolve(directory.customer(for: key), at: instant))
                }
            }
            aliases += expected.aliases.count
        }
        #expect(aliases > 100)  // the generator gives a quarter of customers an alias
        #expect(reader.keyCount == UInt64(1_500 + aliases))
        #expect(try reader.customer(for: "nobody") == nil)
        #expect(try reader.customer(for: "") == nil)
        #expect(try reader.verifyRecords() == (1_500, UInt64(1_500 + aliases)))
    }

    @Test("an empty snapshot opens and knows no one")
    func empty() throws {
        let scratch = try ScratchDirectory()
        let writer = try SnapshotWriter(path: scratch.file("empty.snap"), catalog: Catalog(), createdDate: now)
        try writer.finish()
        let reader = try SnapshotReader(path: scratch.file("empty.snap"))
        #expect(reader.header.recordCount == 0)
        #expect(reader.keyCount == 0)
        #expect(try reader.customer(for: "user-1") == nil)
        #expect(try reader.verifyRecords() == (0, 0))
    }

    @Test("a lookup that may not wait for the disk (RWF_NOWAIT) finds what a waiting one finds once the file is in memory")
    func lookupWithoutWaiting() throws {
        let scratch = try ScratchDirectory()
        _ = try SnapshotTools.generate(count: 200, seed: 3, now: now, outputPath: scratch.file("data.snap"))
        let reader = try SnapshotReader(path: scratch.file("data.snap"))
        // Just written and read once: its pages are in the page cache.
        for index in 0..<200 {
            let id = SyntheticData.customerId(index)
            let waited = try reader.customer(for: id)
            #expect(waited?.id == id)
            #expect(try reader.customer(for: id, mayWait: false) == waited)
        }
        #expect(try reader.customer(for: "nobody", mayWait: false) == nil)
    }

    @Test("hash collisions are resolved by comparing the keys themselves")
    func collisionsAreChecked() throws {
        // Not a real collision (none is known for this hash), but the same mechanism:
        // a lookup for a key that shares a bucket must not return another customer.
        let scratch = try ScratchDirectory()
        var writer = try SnapshotWriter(path: scratch.file("data.snap"), catalog: Catalog(), createdDate: now)
        for index in 0..<5_000 {
            try writer.append(CustomerRecord(id: "customer-\(index)", aliases: ["alias-\(index)"]))
        }
        try writer.finish()
        let reader = try SnapshotReader(path: scratch.file("data.snap"))
        for index in stride(from: 0, to: 5_000, by: 97) {
            #expect(try reader.customer(for: "alias-\(index)")?.id == "customer-\(index)")
            #expect(try reader.customer(for: "customer-\(index)x") == nil)
        }
    }

    @Test("two customers claiming one alias fail the build, and nothing is written")
    func duplicateAlias() throws {
        let scratch = try ScratchDirectory()
        var writer = try SnapshotWriter(path: scratch.file("data.snap"), catalog: Catalog(), createdDate: now)
        try writer.append(CustomerRecord(id: "a", aliases: ["shared"]))
        try writer.append(CustomerRecord(id: "b", aliases: ["shared"]))
        do {
            try writer.finish()
            Issue.record("finish() accepted an alias claimed twice")
        } catch {
            #expect("\(error)" == #"\#(scratch.file("data.snap")): "shared" is claimed by customer "a" and by customer "b"; ids and aliases must be unique"#)
        }
        #expect(scratch.contents.isEmpty)
    }

    @Test("a writer that fails or is abandoned leaves the previous snapshot and no temporary file")
    func crashSafeReplace() throws {
        let scratch = try ScratchDirectory()
        let path = scratch.file("data.snap")
        var first = try SnapshotWriter(path: path, catalog: Catalog(), createdDate: now)
        try first.append(CustomerRecord(id: "old"))
        try first.finish()
        do {
            var abandoned = try SnapshotWriter(path: path, catalog: Catalog(), createdDate: now)
            try abandoned.append(CustomerRecord(id: "new"))
            #expect(scratch.contents.count == 2)  // data.snap and the temporary file
        }
        #expect(scratch.contents == ["data.snap"])
        #expect(try SnapshotReader(path: path).customer(for: "old") != nil)
        var second = try SnapshotWriter(path: path, catalog: Catalog(), createdDate: now)
        try second.append(CustomerRecord(id: "new"))
        try second.finish()
        let reader = try SnapshotReader(path: path)
        #expect(try reader.customer(for: "new") != nil && reader.customer(for: "old") == nil)
        #expect(scratch.contents == ["data.snap"])
    }
}

@Suite("snapshot corruption")
struct SnapshotCorruptionTests {
    /// A small snapshot and where its sections are.
    static func makeSnapshot(in scratch: borrowing ScratchDirectory) throws -> (path: String, bytes: [UInt8]) {
        let path = scratch.file("data.snap")
        var writer = try SnapshotWriter(path: path, catalog: SyntheticData.catalog, createdDate: now, snapshotId: "snap-test")
        let data = SyntheticData(seed: 3, now: now)
        for index in 0..<50 {
            try writer.append(data.customer(index))
        }
        try writer.finish(hotList: ["user-1", "user-2"])
        return (path, Array(try Data(contentsOf: URL(fileURLWithPath: path))))
    }

    static func sections(_ bytes: [UInt8]) -> [String: SectionRange] {
        bytes.withUnsafeBytes { raw in
            var result: [String: SectionRange] = [:]
            for (index, name) in ["header", "records", "index", "hot list"].enumerated() {
                result[name] = SectionRange(
                    offset: raw.littleEndian(at: 16 + index * 16, as: UInt64.self),
                    length: raw.littleEndian(at: 24 + index * 16, as: UInt64.self)
                )
            }
            return result
        }
    }

    static func write(_ bytes: [UInt8], to path: String) throws {
        try Data(bytes).write(to: URL(fileURLWithPath: path))
    }

    @Test("a flipped byte in each section is detected at open, naming file, offset and problem", arguments: [
        ("file header", "file header checksum mismatch"),
        ("header", "header section checksum mismatch"),
        ("index", "index section checksum mismatch"),
        ("index fanout", "index section checksum mismatch"),
        ("hot list", "hot list section checksum mismatch"),
    ])
    func flippedByteAtOpen(section: String, problem: String) throws {
        let scratch = try ScratchDirectory()
        let (path, original) = try Self.makeSnapshot(in: scratch)
        var bytes = original
        let ranges = Self.sections(bytes)
        let position: Int
        let reportedOffset: UInt64
        switch section {
        case "file header":
            position = 40
            reportedOffset = 0
        case "index fanout":
            position = Int(ranges["index"]!.offset) + 8 + 4 * 1_000
            reportedOffset = ranges["index"]!.offset
        case "index":
            position = Int(ranges["index"]!.end) - 20  // inside the last entry
            reportedOffset = ranges["index"]!.offset
        default:
            position = Int(ranges[section]!.offset) + 1
            reportedOffset = ranges[section]!.offset
        }
        bytes[position] ^= 0x40
        try Self.write(bytes, to: path)
        #expect {
            try SnapshotReader(path: path)
        } throws: { error in
            let error = error as! SnapshotError
            let ok = error.code == .corrupt && error.offset == reportedOffset
                && "\(error)".hasPrefix("\(path): offset \(reportedOffset): \(problem)")
            if !ok { Issue.record("got: \(error)") }
            return ok
        }
    }

    @Test("a flipped byte in a record is detected when the record is read, and by inspect")
    func flippedByteInRecord() throws {
        let scratch = try ScratchDirectory()
        let (path, original) = try Self.makeSnapshot(in: scratch)
        let reader = try SnapshotReader(path: path)
        // Find user-7's record and corrupt a byte of its payload.
        var target: UInt64 = 0
        try reader.forEachRecord { record, offset in
            if record.id == "user-7" { target = offset }
        }
        var bytes = original
        bytes[Int(target) + 8 + 2] ^= 0x01
        try Self.write(bytes, to: path)
        let corrupted = try SnapshotReader(path: path)  // records are verified lazily
        #expect(try corrupted.customer(for: "user-8") == reader.customer(for: "user-8"))
        #expect {
            try corrupted.customer(for: "user-7")
        } throws: { error in
            "\(error)".hasPrefix("\(path): offset \(target): record checksum mismatch")
        }
        #expect(throws: SnapshotError.self) {
            try SnapshotTools.inspect(path: path, verify: true)
        }
    }

    @Test("a zeroed record header is corruption, not an unknown user")
    func zeroedRecordHeader() throws {
        let scratch = try ScratchDirectory()
        let (path, original) = try Self.makeSnapshot(in: scratch)
        var target: UInt64 = 0
        try SnapshotReader(path: path).forEachRecord { record, offset in
            if record.id == "user-7" { target = offset }
        }
        var bytes = original
        for index in 0..<8 {
            bytes[Int(target) + index] = 0
        }
        try Self.write(bytes, to: path)
        #expect {
            try SnapshotReader(path: path).customer(for: "user-7")
        } throws: { error in
            "\(error)" == "\(path): offset \(target): record with length 0"
        }
    }

    @Test("bytes after the last section are refused")
    func trailingBytes() throws {
        let scratch = try ScratchDirectory()
        let (path, original) = try Self.makeSnapshot(in: scratch)
        var bytes = original + [UInt8](repeating: 0xAB, count: 10)
        // Make the file header claim the new length, with a valid checksum.
        let length = UInt64(bytes.count)
        for index in 0..<8 {
            bytes[80 + index] = UInt8(truncatingIfNeeded: length >> (8 * UInt64(index)))
        }
        let crc = CRC32C.checksum(Array(bytes[0..<92]))
        for index in 0..<4 {
            bytes[92 + index] = UInt8(truncatingIfNeeded: crc >> (8 * UInt32(index)))
        }
        try Self.write(bytes, to: path)
        #expect {
            try SnapshotReader(path: path)
        } throws: { error in
            "\(error)" == "\(path): offset \(original.count): the sections end at offset \(original.count), but the file has \(bytes.count) bytes"
        }
    }

    @Test("a truncated file is refused with the sizes")
    func truncated() throws {
        let scratch = try ScratchDirectory()
        let (path, bytes) = try Self.makeSnapshot(in: scratch)
        try Self.write(Array(bytes.dropLast()), to: path)
        #expect {
            try SnapshotReader(path: path)
        } throws: { error in
            let error = error as! SnapshotError
            return error.code == .truncated
                && "\(error)" == "\(path): offset \(bytes.count - 1): the header says the file has \(bytes.count) bytes, but it has \(bytes.count - 1) (truncated)"
        }
        try Self.write(Array(bytes.prefix(50)), to: path)
        #expect {
            try SnapshotReader(path: path)
        } throws: { error in
            "\(error)" == "\(path): offset 50: the file has 50 bytes, fewer than the 96-byte file header"
        }
    }

    @Test("a snapshot of another format version is refused")
    func wrongVersion() throws {
        let scratch = try ScratchDirectory()
        let (path, original) = try Self.makeSnapshot(in: scratch)
        var bytes = original
        bytes[8] = 2
        try Self.write(bytes, to: path)
        #expect {
            try SnapshotReader(path: path)
        } throws: { error in
            (error as? SnapshotError)?.code == .unsupportedVersion
                && "\(error)" == "\(path): offset 8: format version 2; this build reads version 1"
        }
    }

    @Test("a file that is not a snapshot, and a missing file, are refused clearly")
    func notASnapshot() throws {
        let scratch = try ScratchDirectory()
        let path = scratch.file("customers.jsonl")
        try Self.write(Array(String(repeating: "{\"id\":\"user-1\"}\n", count: 20).utf8), to: path)
        #expect {
            try SnapshotReader(path: path)
        } throws: { error in
            "\(error)" == "\(path): offset 0: not a snapshot file (no ENTSNAP magic)"
        }
        #expect {
            try SnapshotReader(path: scratch.file("missing.snap"))
        } throws: { error in
            "\(error)" == "\(scratch.file("missing.snap")): cannot open: No such file or directory"
        }
    }
}
