import NIOCore
import Testing

@testable import EntitlementsWire

@Suite("frame peek: frames seen in raw bytes, as the decoder reads them")
struct FramePeekTests {
    /// What the peek sees in `bytes`: each frame's type, method and payload.
    static func peeked(_ bytes: ByteBuffer, stopAfter limit: Int = .max) -> [(UInt8, UInt16, [UInt8])] {
        var seen: [(UInt8, UInt16, [UInt8])] = []
        bytes.withUnsafeReadableBytes { raw in
            FramePeek.forEachComplete(in: raw) { frame in
                seen.append((frame.type, frame.method, Array(frame.payload)))
                return seen.count < limit
            }
        }
        return seen
    }

    @Test("every complete frame, in order, with the decoder's type, method and payload; a partial last frame is not seen")
    func agreesWithTheDecoder() throws {
        var bytes = ByteBuffer()
        for frame in FrameDecoderTests.sampleFrames {
            bytes.writeFrame(frame)
        }
        let whole = Self.peeked(bytes)
        #expect(whole.count == FrameDecoderTests.sampleFrames.count)
        for (peek, frame) in zip(whole, FrameDecoderTests.sampleFrames) {
            #expect(peek.0 == frame.type.rawValue && peek.1 == frame.method.rawValue && peek.2 == Array(frame.payload.readableBytesView))
        }
        // Cut inside the last frame's header, then inside its payload.
        let last = FrameDecoderTests.sampleFrames.last!
        let lastSize = Frame.headerSize + last.payload.readableBytes
        for cut in [1, last.payload.readableBytes + 1] where cut < lastSize {  // in the payload, in the header
            let partial = bytes.getSlice(at: bytes.readerIndex, length: bytes.readableBytes - cut)!
            #expect(Self.peeked(partial).count == FrameDecoderTests.sampleFrames.count - 1)
        }
    }

    @Test("the body stops the walk; a REQUEST is told by its type and method")
    func stopsAndTellsRequests() {
        var bytes = ByteBuffer()
        bytes.writeFrame(.request(id: 1, method: .checkEntitlements, payload: ByteBuffer(bytes: [1])))
        bytes.writeFrame(.request(id: 2, method: .health, payload: ByteBuffer()))
        bytes.writeFrame(.response(id: 3, payload: ByteBuffer(bytes: [2])))
        #expect(Self.peeked(bytes, stopAfter: 2).count == 2)
        var checks = 0
        bytes.withUnsafeReadableBytes { raw in
            FramePeek.forEachComplete(in: raw) { frame in
                if frame.isRequest(.checkEntitlements) { checks += 1 }
                return true
            }
        }
        #expect(checks == 1)
    }

    @Test("a length past the bytes ends the walk without reading beyond them")
    func hugeLength() {
        var bytes = ByteBuffer()
        bytes.writeFrameHeader(type: .request, requestID: 1, payloadLength: UInt32.max)
        bytes.writeRepeatingByte(0, count: 100)
        #expect(Self.peeked(bytes).isEmpty)
    }
}
