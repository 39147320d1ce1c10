import EntitlementsWire
import NIOCore

/// Bytes in, frames or a FrameError out; never a crash. The first byte picks a chunk size
/// so that headers and payloads also arrive split.

@_cdecl("LLVMFuzzerTestOneInput")
public func fuzz(_ data: UnsafePointer<UInt8>, _ size: Int) -> CInt {
    let bytes = UnsafeBufferPointer(start: data, count: size)
    guard let first = bytes.first else { return 0 }
    let chunk = Int(first % 32) + 1
    var decoder = FrameDecoder(maximumPayloadSize: 4_096)
    var buffer = ByteBuffer()
    var index = 1
    do {
        while index < bytes.count {
            let end = min(bytes.count, index + chunk)
            buffer.writeBytes(UnsafeBufferPointer(rebasing: bytes[index..<end]))
            index = end
            while let frame = try decoder.decode(buffer: &buffer) {
                // A decoded frame re-encodes to the bytes it came from.
                var again = ByteBuffer()
                again.writeFrame(frame)
                precondition(again.readableBytes == Frame.headerSize + frame.payload.readableBytes)
            }
        }
        _ = try decoder.decodeLast(buffer: &buffer, seenEOF: true)
    } catch is FrameError {
    } catch {
        fatalError("unexpected error \(error)")
    }
    return 0
}
