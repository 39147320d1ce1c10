import EntitlementsMessages
import Foundation
import Testing

@testable import EntitlementsStore

/// Replay never loses an acknowledged write in silence: each damaged byte either stops
/// start-up with the file and offset, or changes nothing.
@Suite("log replay")
struct LogReplayTests {
    static func grant(_ index: Int) -> LogRecord.Mutation {
        WriteAheadLogTests.grant(index)
    }

    /// A segment of three batches (each append alone, so each is its own fsync), every
    /// write acknowledged.
    static func smallSegment() async throws -> (bytes: Data, records: [LogRecord]) {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let (log, _) = try WriteAheadLog.open(directory: directory)
        for index in 0..<3 {
            _ = try await log.append(Self.grant(index), recordedDate: now + Int64(index))
        }
        log.closeAndWait()
        let (reopened, replay) = try WriteAheadLog.open(directory: directory)
        reopened.closeAndWait()
        return (try Data(contentsOf: URL(fileURLWithPath: directory + "/log-00000000000000000001.wal")), replay.records)
    }

    @Test("every byte of a small segment flipped in turn: start-up refuses naming file and offset, or every acknowledged write is there", arguments: [0xFF, 0x01] as [UInt8])
    func everyByteFlipped(mask: UInt8) async throws {
        let (intact, acknowledged) = try await Self.smallSegment()
        #expect(acknowledged.count == 3)
        var refused = 0
        for index in 0..<intact.count {
            let scratch = try ScratchDirectory()
            let directory = scratch.file("log")
            try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
            let path = directory + "/log-00000000000000000001.wal"
            var damaged = intact
            damaged[index] ^= mask
            try damaged.write(to: URL(fileURLWithPath: path))
            do {
                let (log, replay) = try WriteAheadLog.open(directory: directory)
                log.closeAndWait()
                #expect(replay.records == acknowledged, "byte \(index) ^ \(mask): start-up went on with \(replay.records.count) of 3 writes")
                #expect(replay.tornOffset == nil, "byte \(index) ^ \(mask): bytes were set aside")
            } catch let error as SnapshotError {
                refused += 1
                #expect(error.path == path && error.offset != nil, "byte \(index) ^ \(mask): \(error)")
                #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == damaged, "byte \(index) ^ \(mask): the refused segment was changed")
            }
        }
        // Only the header's reserved bytes may be flipped without consequence.
        #expect(refused == intact.count - 4)
    }

    /// Writes a segment of format version 1 (batch: length, payload checksum, payload).
    static func versionOneSegment(_ records: [LogRecord], batches: [Range<Int>]) throws -> [UInt8] {
        var bytes = WriteAheadLog.magic
        bytes.appendLittleEndian(UInt32(1))
        bytes.appendLittleEndian(UInt32(0))
        for batch in batches {
            var payload: [UInt8] = []
            for record in records[batch] {
                let encoded = try record.serializedBytes()
                payload.appendLittleEndian(UInt32(encoded.count))
                payload += encoded
            }
            bytes.appendLittleEndian(UInt32(payload.count))
            bytes.appendLittleEndian(payload.withUnsafeBytes { CRC32C.checksum($0) })
            bytes += payload
        }
        return bytes
    }

    static let records = (0..<6).map { LogRecord(sequence: UInt64($0 + 1), recordedDate: now, mutation: Self.grant($0)) }

    @Test("a log of format 1 still replays; appends then go to a new segment of format 2")
    func versionOneReplays() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let old = directory + "/log-00000000000000000001.wal"
        try Data(try Self.versionOneSegment(Self.records, batches: [0..<2, 2..<3, 3..<6])).write(to: URL(fileURLWithPath: old))
        let (log, replay) = try WriteAheadLog.open(directory: directory)
        #expect(replay.records == Self.records)
        #expect(try await log.append(Self.grant(6), recordedDate: now) == 7)
        #expect(log.segmentPaths == [old, directory + "/log-00000000000000000007.wal"])
        log.closeAndWait()
        let (again, all) = try WriteAheadLog.open(directory: directory)
        again.closeAndWait()
        #expect(all.records.map(\.sequence) == Array(1...7))
        #expect(all.version == 2)
    }

    @Test("format 1: a flipped length in the last segment is refused (a valid batch follows), not taken for a torn tail")
    func versionOneFlippedLength() throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let path = directory + "/log-00000000000000000001.wal"
        var bytes = try Self.versionOneSegment(Self.records, batches: [0..<2, 2..<3, 3..<6])
        let firstBatchLength = Int(bytes.withUnsafeBytes { $0.littleEndian(at: 16, as: UInt32.self) })
        let second = 16 + 8 + firstBatchLength
        bytes[second + 1] ^= 0x01  // the length now points past the end, still under the cap
        try Data(bytes).write(to: URL(fileURLWithPath: path))
        #expect {
            try WriteAheadLog.open(directory: directory)
        } throws: { error in
            let error = error as! SnapshotError
            return error.offset == UInt64(second) && "\(error)".contains("a valid batch follows at offset")
        }
        #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == Data(bytes), "a refused segment is left as it was")
    }

    @Test("format 1: a last batch failing its checksum with nothing after it is set aside as possibly acknowledged")
    func versionOneTailPossiblyAcknowledged() throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        let path = directory + "/log-00000000000000000001.wal"
        var bytes = try Self.versionOneSegment(Self.records, batches: [0..<2, 2..<6])
        bytes[bytes.count - 3] ^= 0x40
        try Data(bytes).write(to: URL(fileURLWithPath: path))
        let (log, replay) = try WriteAheadLog.open(directory: directory)
        log.closeAndWait()
        #expect(replay.records.map(\.sequence) == [1, 2])
        #expect(replay.torn == .possiblyAcknowledged)
        let side = try #require(replay.tornSideFile)
        #expect(try Data(contentsOf: URL(fileURLWithPath: side)) == Data(bytes[Int(replay.tornOffset!)...]))
    }
}
