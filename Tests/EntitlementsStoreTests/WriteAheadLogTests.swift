import EntitlementsMessages
import Foundation
import Testing

@testable import EntitlementsStore

@Suite("write-ahead log")
struct WriteAheadLogTests {
    static func grant(_ index: Int) -> LogRecord.Mutation {
        .grantEntitlement(GrantEntitlementRequest(userId: "user-\(index)", grant: Grant(grantId: "g\(index)", entitlementId: "premium", grantedDate: now)))
    }

    @Test("appends are durable, numbered in order, and replay after reopening")
    func appendAndReplay() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let path = directory + "/log-00000000000000000001.wal"
        let (log, first) = try WriteAheadLog.open(directory: directory)
        #expect(first.records.isEmpty && first.tornBytes == 0)
        var sequences: [UInt64] = []
        for index in 0..<10 {
            sequences.append(try await log.append(Self.grant(index), recordedDate: now + Int64(index)))
        }
        #expect(sequences == Array(1...10))
        log.closeAndWait()
        let (reopened, replay) = try WriteAheadLog.open(directory: directory)
        #expect(replay.records.map(\.sequence) == Array(1...10))
        #expect(replay.records[3].mutation == Self.grant(3))
        #expect(replay.records[3].recordedDate == now + 3)
        // Sequences continue after the replayed ones.
        #expect(try await reopened.append(Self.grant(10), recordedDate: now) == 11)
        reopened.close()
    }

    @Test("concurrent appends share fsyncs (group commit), and every one is acknowledged once")
    func groupCommit() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let path = directory + "/log-00000000000000000001.wal"
        let (log, _) = try WriteAheadLog.open(directory: directory)
        let sequences = try await withThrowingTaskGroup(of: UInt64.self) { group in
            for index in 0..<500 {
                group.addTask { try await log.append(Self.grant(index), recordedDate: now) }
            }
            var all: [UInt64] = []
            for try await sequence in group {
                all.append(sequence)
            }
            return all
        }
        #expect(sequences.sorted() == Array(1...500))
        log.closeAndWait()
        let (_, replay) = try WriteAheadLog.open(directory: directory)
        #expect(replay.records.count == 500)
        #expect(replay.batches < 500, "500 concurrent appends took \(replay.batches) fsyncs")
    }

    @Test("a torn last batch is dropped and cut off; every complete batch survives", arguments: [1, 5, 9, 30])
    func tornTail(cut: Int) async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let path = directory + "/log-00000000000000000001.wal"
        let (log, _) = try WriteAheadLog.open(directory: directory)
        for index in 0..<3 {
            _ = try await log.append(Self.grant(index), recordedDate: now)
        }
        log.closeAndWait()
        let intact = try Data(contentsOf: URL(fileURLWithPath: path))
        // Simulate a crash in the middle of appending a fourth batch.
        let (again, _) = try WriteAheadLog.open(directory: directory)
        _ = try await again.append(Self.grant(3), recordedDate: now)
        again.closeAndWait()
        let full = try Data(contentsOf: URL(fileURLWithPath: path))
        let torn = full.prefix(intact.count + cut)
        try torn.write(to: URL(fileURLWithPath: path))
        let (reopened, replay) = try WriteAheadLog.open(directory: directory)
        #expect(replay.records.map(\.sequence) == [1, 2, 3])
        #expect(replay.tornOffset == UInt64(intact.count))
        #expect(replay.tornBytes == UInt64(cut))
        #expect(replay.torn == .neverAcknowledged)
        #expect(try Data(contentsOf: URL(fileURLWithPath: path)) == intact)
        // The cut bytes are kept beside the segment, never deleted.
        #expect(replay.tornSideFile == "\(path).torn-\(intact.count)")
        #expect(try Data(contentsOf: URL(fileURLWithPath: "\(path).torn-\(intact.count)")) == torn.dropFirst(intact.count))
        #expect(try await reopened.append(Self.grant(9), recordedDate: now) == 4)
        reopened.close()
    }

    @Test("damage before the end stops start-up, naming file and offset")
    func corruptionBeforeTail() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let path = directory + "/log-00000000000000000001.wal"
        let (log, _) = try WriteAheadLog.open(directory: directory)
        for index in 0..<3 {
            _ = try await log.append(Self.grant(index), recordedDate: now)
        }
        log.closeAndWait()
        var bytes = try Data(contentsOf: URL(fileURLWithPath: path))
        bytes[WriteAheadLog.headerSize + 12 + 10] ^= 0x01  // inside the first batch's payload
        try bytes.write(to: URL(fileURLWithPath: path))
        #expect {
            try WriteAheadLog.open(directory: directory)
        } throws: { error in
            let error = error as! SnapshotError
            return error.code == .corrupt && error.offset == UInt64(WriteAheadLog.headerSize)
                && "\(error)".hasPrefix("\(path): offset 16: log batch checksum mismatch")
                && "\(error)".contains("a valid batch follows at offset")
        }
    }

    @Test("a file that is not a log is refused")
    func notALog() throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let path = directory + "/log-00000000000000000001.wal"
        try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        try Data("hello, this is not a log file".utf8).write(to: URL(fileURLWithPath: path))
        #expect {
            try WriteAheadLog.open(directory: directory)
        } throws: { error in
            "\(error)" == "\(path): offset 0: not a write-ahead log (no ENTWAL magic)"
        }
    }

    @Test("rotation starts a new segment; removing covered segments keeps every later write")
    func rotationAndRemoval() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let (log, _) = try WriteAheadLog.open(directory: directory)
        for index in 0..<3 {
            _ = try await log.append(Self.grant(index), recordedDate: now)
        }
        #expect(try await log.rotate() == 4)
        for index in 3..<5 {
            _ = try await log.append(Self.grant(index), recordedDate: now)
        }
        #expect(log.segmentPaths.count == 2)
        // A snapshot holding up to 2 covers nothing whole; up to 3 covers the first segment.
        #expect(try log.removeSegments(coveredBy: 2).isEmpty)
        #expect(try log.removeSegments(coveredBy: 3).count == 1)
        log.closeAndWait()
        let (reopened, replay) = try WriteAheadLog.open(directory: directory, lastSnapshotSequence: 3)
        #expect(replay.records.map(\.sequence) == [4, 5])
        #expect(try await reopened.append(Self.grant(5), recordedDate: now) == 6)
        reopened.closeAndWait()
    }

    @Test("segments that do not reach back to the snapshot are missing writes: start-up stops")
    func missingSegment() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let (log, _) = try WriteAheadLog.open(directory: directory)
        _ = try await log.append(Self.grant(0), recordedDate: now)
        _ = try await log.rotate()
        _ = try await log.append(Self.grant(1), recordedDate: now)
        log.closeAndWait()
        try FileManager.default.removeItem(atPath: directory + "/log-00000000000000000001.wal")
        #expect {
            try WriteAheadLog.open(directory: directory, lastSnapshotSequence: 0)
        } throws: { error in
            "\(error)".contains("writes 1 to 1 are missing")
        }
    }

    @Test("damage at the end of a segment that is not the last stops start-up and cuts nothing")
    func tornMiddleSegment() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let (log, _) = try WriteAheadLog.open(directory: directory)
        _ = try await log.append(Self.grant(0), recordedDate: now)
        _ = try await log.append(Self.grant(1), recordedDate: now)
        _ = try await log.rotate()
        _ = try await log.append(Self.grant(2), recordedDate: now)
        log.closeAndWait()
        let first = directory + "/log-00000000000000000001.wal"
        let bytes = try Data(contentsOf: URL(fileURLWithPath: first))
        try bytes.dropLast(2).write(to: URL(fileURLWithPath: first))
        #expect {
            try WriteAheadLog.open(directory: directory)
        } throws: { error in
            "\(error)".contains("a damaged batch at the end of a segment that is not the last")
        }
        #expect(try Data(contentsOf: URL(fileURLWithPath: first)).count == bytes.count - 2)
    }

    @Test("zeros after the last batch are a crash's leftovers; zeros with a batch after them are damage")
    func zeroTail() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let path = directory + "/log-00000000000000000001.wal"
        let (log, _) = try WriteAheadLog.open(directory: directory)
        _ = try await log.append(Self.grant(0), recordedDate: now)
        log.closeAndWait()
        let intact = try Data(contentsOf: URL(fileURLWithPath: path))
        try (intact + Data(repeating: 0, count: 4096)).write(to: URL(fileURLWithPath: path))
        let (reopened, replay) = try WriteAheadLog.open(directory: directory)
        #expect(replay.records.count == 1 && replay.tornBytes == 4096)
        reopened.closeAndWait()
        try (intact + Data(repeating: 0, count: 8) + intact.dropFirst(WriteAheadLog.headerSize)).write(to: URL(fileURLWithPath: path))
        #expect {
            try WriteAheadLog.open(directory: directory)
        } throws: { error in
            "\(error)".contains("header checksum mismatch") && "\(error)".contains("a valid batch follows at offset \(intact.count + 8)")
        }
    }

    @Test("fsync always: one batch per write, and every write durable")
    func syncAlways() async throws {
        let scratch = try ScratchDirectory()
        let directory = scratch.file("log")
        let (log, _) = try WriteAheadLog.open(directory: directory, syncMode: .always)
        try await withThrowingTaskGroup(of: UInt64.self) { group in
            for index in 0..<50 {
                group.addTask { try await log.append(Self.grant(index), recordedDate: now) }
            }
            try await group.waitForAll()
        }
        log.closeAndWait()
        let (_, replay) = try WriteAheadLog.open(directory: directory)
        #expect(replay.records.count == 50)
        #expect(replay.batches == 50)
    }
}
