/// CRC-32C (Castagnoli), the checksum of the snapshot format: table-driven, slicing by 8.
/// `CRC32C.checksum("123456789".utf8) == 0xE306_9283`.
public enum CRC32C {
    /// Eight 256-entry tables, one after the other: entry `slice * 256 + byte`.
    private static let table: [UInt32] = {
        var table = [UInt32](repeating: 0, count: 8 * 256)
        for byte in 0..<256 {
            var crc = UInt32(byte)
            for _ in 0..<8 {
                crc = crc & 1 == 1 ? (crc >> 1) ^ 0x82F6_3B78 : crc >> 1
            }
            table[byte] = crc
        }
        for byte in 0..<256 {
            var crc = table[byte]
            for slice in 1..<8 {
                crc = (crc >> 8) ^ table[Int(crc & 0xFF)]
                table[slice * 256 + byte] = crc
            }
        }
        return table
    }()

    /// The CRC-32C of `bytes`, continuing from `crc` (the CRC of what came before).
    public static func checksum(_ bytes: UnsafeRawBufferPointer, continuing crc: UInt32 = 0) -> UInt32 {
        guard let base = bytes.baseAddress else {
            return crc
        }
        var crc = ~crc
        var index = 0
        let count = bytes.count
        Self.table.withUnsafeBufferPointer { table in
            let t = table.baseAddress!
            while count - index >= 8 {
                let word = UInt64(littleEndian: base.loadUnaligned(fromByteOffset: index, as: UInt64.self)) ^ UInt64(crc)
                crc = t[7 * 256 + Int(word & 0xFF)] ^ t[6 * 256 + Int((word >> 8) & 0xFF)]
                    ^ t[5 * 256 + Int((word >> 16) & 0xFF)] ^ t[4 * 256 + Int((word >> 24) & 0xFF)]
                    ^ t[3 * 256 + Int((word >> 32) & 0xFF)] ^ t[2 * 256 + Int((word >> 40) & 0xFF)]
                    ^ t[256 + Int((word >> 48) & 0xFF)] ^ t[Int(word >> 56)]
                index += 8
            }
            while index < count {
                crc = (crc >> 8) ^ t[Int((crc ^ UInt32(base.load(fromByteOffset: index, as: UInt8.self))) & 0xFF)]
                index += 1
            }
        }
        return ~crc
    }

    /// The CRC-32C of a byte sequence.
    public static func checksum(_ bytes: some Sequence<UInt8>, continuing crc: UInt32 = 0) -> UInt32 {
        Array(bytes).withUnsafeBytes { Self.checksum($0, continuing: crc) }
    }
}
