/// A frame seen in raw bytes before the decoder reads it: its type, method and payload
/// bytes, with nothing validated or copied. For a look ahead that changes nothing (the
/// server prefetches the cache entries of a read's checks before it handles them); the
/// frames are still decoded and validated in full, one by one, by ``FrameDecoder``.
public struct FramePeek {
    /// The header's type byte (``FrameType``'s raw value, if it is a valid one).
    public let type: UInt8
    /// The header's method field (``MethodID``'s raw value).
    public let method: UInt16
    /// The payload's bytes, within the bytes peeked at.
    public let payload: UnsafeRawBufferPointer

    /// Whether this is a REQUEST calling `method`.
    @inlinable
    public func isRequest(_ method: MethodID) -> Bool {
        self.type == FrameType.request.rawValue && self.method == method.rawValue
    }

    /// Calls `body` with each frame complete in `bytes`, from the start, in order, until it
    /// returns false or the next frame is not complete. The header layout is
    /// docs/PROTOCOL.md's: type at byte 3, method at 6 and 7, payload length at 20 to 23.
    @inlinable
    public static func forEachComplete(in bytes: UnsafeRawBufferPointer, _ body: (FramePeek) -> Bool) {
        var offset = 0
        while bytes.count - offset >= Frame.headerSize {
            let length = Int(UInt32(bigEndian: bytes.loadUnaligned(fromByteOffset: offset + 20, as: UInt32.self)))
            guard length <= bytes.count - offset - Frame.headerSize else {
                return
            }
            let start = offset + Frame.headerSize
            let peek = FramePeek(
                type: bytes[offset + 3],
                method: UInt16(bytes[offset + 6]) << 8 | UInt16(bytes[offset + 7]),
                payload: UnsafeRawBufferPointer(rebasing: bytes[start..<(start + length)])
            )
            guard body(peek) else {
                return
            }
            offset = start + length
        }
    }

    @usableFromInline
    init(type: UInt8, method: UInt16, payload: UnsafeRawBufferPointer) {
        self.type = type
        self.method = method
        self.payload = payload
    }
}
