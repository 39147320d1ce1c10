import NIOCore
import Testing

@testable import EntitlementsMessages

@Suite("protobuf's wire format by hand: the writer, the reader, and protobuf-c agree")
struct ProtobufWireTests {
    static let values: [UInt64] = [0, 1, 127, 128, 300, 16_383, 16_384, UInt64(UInt32.max), 1 << 62, UInt64.max]

    @Test("varints round-trip through the writer and the reader, in 1 to 10 bytes")
    func varints() {
        var out = [UInt8](repeating: 0, count: Self.values.count * ProtobufWriter.maximumVarintBytes)
        let written = out.withUnsafeMutableBytes { raw in
            var writer = ProtobufWriter(out: raw)
            for value in Self.values {
                writer.varint(value)
            }
            return writer.position
        }
        #expect(written == 1 + 1 + 1 + 2 + 2 + 2 + 3 + 5 + 9 + 10)
        out.withUnsafeBytes { raw in
            var reader = ProtobufReader(bytes: UnsafeRawBufferPointer(rebasing: raw[..<written]))
            for value in Self.values {
                #expect(reader.varint() == value)
            }
            #expect(reader.isAtEnd)
        }
    }

    @Test("the reader refuses a varint cut short, one of 11 bytes, and a length past the end")
    func malformed() {
        for bytes: [UInt8] in [[0x80], [0xFF, 0xFF], [UInt8](repeating: 0xFF, count: 10) + [0x01]] {
            bytes.withUnsafeBytes { raw in
                var reader = ProtobufReader(bytes: raw)
                #expect(reader.varint() == nil, "\(bytes)")
            }
        }
        [UInt8]([0x05, 1, 2]).withUnsafeBytes { raw in
            var reader = ProtobufReader(bytes: raw)
            #expect(reader.lengthDelimited() == nil)
        }
    }

    @Test("a string field and an embedded message field as protobuf-c encodes them")
    func fields() throws {
        // HealthResponse.snapshot_id is field 2, a string; BatchCheckEntitlementsResponse
        // .results is field 1, embedded CheckEntitlementsResponse messages.
        var id = "snap-é-1"
        var out = [UInt8](repeating: 0, count: 64)
        let written = out.withUnsafeMutableBytes { raw in
            var writer = ProtobufWriter(out: raw)
            writer.string(field: 2, &id)
            return writer.position
        }
        #expect(try HealthResponse(buffer: ByteBuffer(bytes: out[..<written])).snapshotId == id)
        let single = CheckEntitlementsResponse(userId: "user-1", requestDate: 5)
        var batch = ByteBuffer()
        for _ in 0..<2 {
            var encoded = ByteBuffer()
            try single.serialize(into: &encoded)
            batch.writeProtobufField(1, encoded)
        }
        #expect(try BatchCheckEntitlementsResponse(buffer: batch).results == [single, single])
    }
}
