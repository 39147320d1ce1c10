import EntitlementsFormats
import EntitlementsMessages
import EntitlementsStore

/// The operations behind `entitlements snapshot build | generate | inspect`, as library
/// functions so that tests drive them directly.
public enum SnapshotTools {
    /// What a build or generate wrote.
    public struct BuildReport: Sendable {
        public var customers: UInt64
        public var snapshotId: String
        public var bytes: UInt64
    }

    /// Builds a snapshot from catalog.json and customers.jsonl, streaming the customers:
    /// memory holds one parsed line and 16 bytes of index per id and alias. Every line is
    /// validated (docs/data-formats.md); ids and aliases must be unique across the file.
    public static func build(
        catalogPath: String,
        customersPath: String,
        outputPath: String,
        createdDate: Int64,
        hotList: [String] = []
    ) throws -> BuildReport {
        let catalog = try CatalogFile.load(path: catalogPath)
        var writer = try SnapshotWriter(path: outputPath, catalog: catalog, createdDate: createdDate)
        try CustomersFile.forEachCustomer(path: customersPath) { record, _ in
            try writer.append(record)
        }
        return try Self.finish(writer, outputPath: outputPath, hotList: hotList)
    }

    /// Writes `count` synthetic customers (``SyntheticData``) to a snapshot.
    public static func generate(count: Int, seed: UInt64, now: Int64, outputPath: String) throws -> BuildReport {
        let data = SyntheticData(seed: seed, now: now)
        var writer = try SnapshotWriter(path: outputPath, catalog: SyntheticData.catalog, createdDate: now)
        for index in 0..<count {
            try writer.append(data.customer(index))
        }
        return try Self.finish(writer, outputPath: outputPath, hotList: SyntheticData.hotList(customers: count))
    }

    /// Writes `count` synthetic customers as customers.jsonl, and the catalog as catalog.json.
    public static func generateJSON(count: Int, seed: UInt64, now: Int64, customersPath: String, catalogPath: String) throws {
        let data = SyntheticData(seed: seed, now: now)
        var customers = try TextFileWriter(path: customersPath)
        for index in 0..<count {
            try customers.write(CustomersFile.jsonLine(data.customer(index)) + "\n")
        }
        try customers.close()
        var catalog = try TextFileWriter(path: catalogPath)
        try catalog.write(CatalogFile.json(SyntheticData.catalog) + "\n")
        try catalog.close()
    }

    private static func finish(_ writer: consuming SnapshotWriter, outputPath: String, hotList: [String]) throws -> BuildReport {
        let customers = writer.recordCount
        try writer.finish(hotList: hotList)
        let reader = try SnapshotReader(path: outputPath)
        return BuildReport(customers: customers, snapshotId: reader.header.snapshotId ?? "", bytes: reader.fileSize)
    }

    /// A description of the snapshot at `path` for people; with `verify`, every record's
    /// checksum and index entry is checked too (opening checks everything else).
    public static func inspect(path: String, verify: Bool) throws -> String {
        let reader = try SnapshotReader(path: path)
        let header = reader.header
        var lines = [
            "snapshot      \(path)",
            "id            \(header.snapshotId ?? "-")",
            "format        version \(header.formatVersion)",
            "created       \(header.createdDate.map(RFC3339.format) ?? "-")",
            "customers     \(header.recordCount)",
            "index keys    \(reader.keyCount) (ids and aliases)",
            "hot list      \(reader.hotList.count) customers",
            "log sequence  \(header.lastLogSequence)",
            "size          \(reader.fileSize) bytes"
                + (header.recordCount > 0 ? " (\(reader.fileSize / header.recordCount) per customer)" : ""),
            "catalog       \(reader.catalog.products.count) products, entitlements "
                + Set(reader.catalog.products.flatMap(\.entitlements)).sorted().joined(separator: ", "),
        ]
        if verify {
            let (records, keys) = try reader.verifyRecords()
            lines.append("checksums     ok: header, index, hot list, \(records) records, \(keys) keys")
        } else {
            lines.append("checksums     ok: header, index, hot list (records not read; use --verify)")
        }
        return lines.joined(separator: "\n")
    }
}
