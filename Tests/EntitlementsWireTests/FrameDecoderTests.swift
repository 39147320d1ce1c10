import NIOCore
import NIOEmbedded
import NIOTestUtils
import Testing

@testable import EntitlementsWire

@Suite("frame codec")
struct FrameDecoderTests {
    static let sampleFrames: [Frame] = [
        .request(id: 1, method: .checkEntitlements, timeoutMicroseconds: 250_000, payload: ByteBuffer(bytes: [0x0A, 0x01, 0x75])),
        .response(id: 1, payload: ByteBuffer(bytes: [0x0A, 0x01, 0x75]), flags: .fromCache),
        .failure(id: 2, status: .invalidArgument, message: "user_id: must not be empty"),
        Frame(type: .streamMessage, requestID: 3, payload: ByteBuffer(bytes: [1, 2, 3])),
        Frame(type: .endOfStream, status: .resourceExhausted, requestID: 3, payload: ByteBuffer(string: "watcher too slow")),
        Frame(type: .cancel, requestID: 4),
        Frame(type: .ping, requestID: 0xDEAD_BEEF_CAFE_F00D),
        Frame(type: .pong, requestID: 0xDEAD_BEEF_CAFE_F00D),
        .goAway(lastRequestID: 41, message: "draining"),
        .error(status: .invalidArgument, message: "bad frame"),
        // A zero-length payload is valid (HealthRequest encodes to nothing).
        .request(id: UInt64.max, method: .health, payload: ByteBuffer()),
    ]

    @Test("the header has the byte layout of docs/PROTOCOL.md")
    func exactBytes() {
        var buffer = ByteBuffer()
        let written = buffer.writeFrame(
            .request(id: 7, method: .checkEntitlements, timeoutMicroseconds: 5_000, payload: ByteBuffer(bytes: [0x0A, 0x01, 0x75]))
        )
        #expect(written == 27)
        #expect(
            Array(buffer.readableBytesView) == [
                0x45, 0x4E,  // magic "EN"
                0x01,  // version
                0x01,  // type REQUEST
                0x00,  // flags
                0x00,  // status OK
                0x00, 0x01,  // method 1 CheckEntitlements
                0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x07,  // request id 7
                0x00, 0x00, 0x13, 0x88,  // timeout 5000 us
                0x00, 0x00, 0x00, 0x03,  // payload length 3
                0x0A, 0x01, 0x75,  // payload: CheckEntitlementsRequest { user_id: "u" }
            ]
        )
    }

    @Test("every frame type round-trips through encoder and decoder")
    func roundTrip() throws {
        var buffer = ByteBuffer()
        for frame in Self.sampleFrames {
            buffer.writeFrame(frame)
        }
        var decoder = FrameDecoder()
        var decoded: [Frame] = []
        while let frame = try decoder.decode(buffer: &buffer) {
            decoded.append(frame)
        }
        #expect(decoded == Self.sampleFrames)
        #expect(buffer.readableBytes == 0)
        #expect(decoder.streamOffset == Self.sampleFrames.map { Frame.headerSize + $0.payload.readableBytes }.reduce(0, +))
    }

    @Test("NIO's decoder verifier: byte by byte, all at once, and in random chunks")
    func verifier() throws {
        let pairs = Self.sampleFrames.map { frame -> (ByteBuffer, [Frame]) in
            var buffer = ByteBuffer()
            buffer.writeFrame(frame)
            return (buffer, [frame])
        }
        try ByteToMessageDecoderVerifier.verifyDecoder(inputOutputPairs: pairs) { FrameDecoder() }
    }

    @Test("a frame delivered one byte at a time decodes once, after its last byte")
    func oneByteAtATime() throws {
        let channel = EmbeddedChannel(handler: ByteToMessageHandler(FrameDecoder()))
        var buffer = ByteBuffer()
        buffer.writeFrame(Self.sampleFrames[0])
        let bytes = Array(buffer.readableBytesView)
        for (index, byte) in bytes.enumerated() {
            try channel.writeInbound(ByteBuffer(bytes: [byte]))
            let frame = try channel.readInbound(as: Frame.self)
            #expect((frame != nil) == (index == bytes.count - 1))
            if let frame {
                #expect(frame == Self.sampleFrames[0])
            }
        }
        #expect(try channel.finish().isClean)
    }

    @Test("1,000 frames in one read all come out, in order")
    func thousandFramesInOneRead() throws {
        let channel = EmbeddedChannel(handler: ByteToMessageHandler(FrameDecoder()))
        var buffer = ByteBuffer()
        for id in 1...1_000 {
            buffer.writeFrame(.request(id: UInt64(id), method: .checkEntitlements, payload: ByteBuffer(string: "user-\(id)")))
        }
        try channel.writeInbound(buffer)
        for id in 1...1_000 {
            let frame = try #require(try channel.readInbound(as: Frame.self))
            #expect(frame.requestID == UInt64(id))
            #expect(String(buffer: frame.payload) == "user-\(id)")
        }
        #expect(try channel.readInbound(as: Frame.self) == nil)
        #expect(try channel.finish().isClean)
    }

    @Test("a length over the maximum is rejected from the header alone, before its payload arrives")
    func oversizedLength() throws {
        var decoder = FrameDecoder(maximumPayloadSize: 1_024)
        var header = ByteBuffer()
        header.writeFrameHeader(type: .request, method: .checkEntitlements, requestID: 1, payloadLength: 0xFFFF_FFFF)
        // Only the 24 header bytes exist: a decoder that tried to read or reserve the
        // 4 GiB payload would wait (return nil) or fail to allocate instead of throwing.
        let capacityBefore = header.capacity
        #expect {
            try decoder.decode(buffer: &header)
        } throws: { error in
            let error = error as! FrameError
            return error.code == .payloadTooLarge && error.status == .resourceExhausted
                && error.description
                    == "REQUEST frame declares a 4294967295-byte payload; the maximum is 1024 bytes (at stream offset 0)"
        }
        #expect(header.capacity == capacityBefore)
    }

    @Test("a zero-length payload is a valid frame with an empty payload")
    func zeroLengthPayload() throws {
        var decoder = FrameDecoder()
        var buffer = ByteBuffer()
        buffer.writeFrame(.request(id: 9, method: .health, payload: ByteBuffer()))
        #expect(buffer.readableBytes == Frame.headerSize)
        let frame = try #require(try decoder.decode(buffer: &buffer))
        #expect(frame.type == .request && frame.method == .health && frame.requestID == 9)
        #expect(frame.payload.readableBytes == 0)
    }

    @Test("FrameEncoder in a pipeline writes exactly what writeFrame writes")
    func encoderInPipeline() throws {
        let channel = EmbeddedChannel(handler: MessageToByteHandler(FrameEncoder()))
        for frame in Self.sampleFrames {
            try channel.writeOutbound(frame)
        }
        var expected = ByteBuffer()
        for frame in Self.sampleFrames {
            expected.writeFrame(frame)
        }
        var written = ByteBuffer()
        while var chunk = try channel.readOutbound(as: ByteBuffer.self) {
            written.writeBuffer(&chunk)
        }
        #expect(written == expected)
        #expect(try channel.finish().isClean)
    }

    @Test("the maximum itself is accepted")
    func lengthAtMaximum() throws {
        var decoder = FrameDecoder(maximumPayloadSize: 16)
        var buffer = ByteBuffer()
        buffer.writeFrame(.response(id: 1, payload: ByteBuffer(repeating: 7, count: 16)))
        #expect(try decoder.decode(buffer: &buffer)?.payload.readableBytes == 16)
    }

    @Test("a frame truncated at EOF is an error naming what was missing")
    func truncatedAtEOF() throws {
        let channel = EmbeddedChannel(handler: ByteToMessageHandler(FrameDecoder()))
        var buffer = ByteBuffer()
        buffer.writeFrame(Self.sampleFrames[0])
        buffer.moveWriterIndex(to: buffer.writerIndex - 1)
        try channel.writeInbound(buffer)
        #expect(try channel.readInbound(as: Frame.self) == nil)
        #expect {
            try channel.finish()
        } throws: { error in
            let error = error as! FrameError
            return error.code == .truncated
                && error.description == "connection ended after 26 bytes of a 27-byte frame (at stream offset 0)"
        }
    }

    @Test("a stream truncated inside the header is an error too")
    func truncatedHeaderAtEOF() throws {
        var decoder = FrameDecoder()
        var buffer = ByteBuffer(bytes: [0x45, 0x4E, 0x01, 0x01, 0x00])
        #expect {
            try decoder.decodeLast(buffer: &buffer, seenEOF: true)
        } throws: { error in
            (error as? FrameError)?.description
                == "connection ended after 5 bytes of a 24-byte frame header (at stream offset 0)"
        }
    }

    struct BadHeader: Sendable, CustomStringConvertible {
        var description: String
        var bytes: [UInt8]
        var code: FrameError.Code
        var message: String
    }

    static let badHeaders: [BadHeader] = [
        BadHeader(
            description: "HTTP instead of frames",
            bytes: Array("GET / HTTP/1.1\r\n".utf8),
            code: .badMagic,
            message: "frame starts with 0x4745, not the magic 0x454E (\"EN\"): the peer does not speak the entitlements protocol (at stream offset 0)"
        ),
        BadHeader(
            description: "an unknown version",
            bytes: [0x45, 0x4E, 0x02],
            code: .unsupportedVersion,
            message: "frame has protocol version 2; this side speaks version 1 (at stream offset 0)"
        ),
        BadHeader(
            description: "an unknown frame type",
            bytes: [0x45, 0x4E, 0x01, 0x0A],
            code: .unknownFrameType,
            message: "frame has unknown type 10; types are 1 to 9 (at stream offset 0)"
        ),
        BadHeader(
            description: "frame type zero",
            bytes: [0x45, 0x4E, 0x01, 0x00],
            code: .unknownFrameType,
            message: "frame has unknown type 0; types are 1 to 9 (at stream offset 0)"
        ),
        BadHeader(
            description: "an unknown status code",
            bytes: [0x45, 0x4E, 0x01, 0x02, 0x00, 17] + [UInt8](repeating: 0, count: 18),
            code: .unknownStatusCode,
            message: "RESPONSE frame has status byte 17; status codes are 0 to 16 (at stream offset 0)"
        ),
        BadHeader(
            description: "a PING with a payload",
            bytes: [0x45, 0x4E, 0x01, 0x06] + [UInt8](repeating: 0, count: 19) + [0x08],
            code: .unexpectedPayload,
            message: "PING frame carries a 8-byte payload; it must be empty (at stream offset 0)"
        ),
    ]

    @Test("malformed headers fail as early as their bytes allow, with a clear message", arguments: badHeaders)
    func malformedHeader(testCase: BadHeader) {
        var decoder = FrameDecoder()
        var buffer = ByteBuffer(bytes: testCase.bytes)
        #expect {
            try decoder.decode(buffer: &buffer)
        } throws: { error in
            let error = error as! FrameError
            return error.code == testCase.code && error.description == testCase.message
        }
    }

    @Test("an error names the stream offset of the bad frame, after good ones")
    func errorOffset() {
        var decoder = FrameDecoder()
        var buffer = ByteBuffer()
        buffer.writeFrame(Frame(type: .ping, requestID: 1))
        buffer.writeBytes([0x45, 0x4E, 0x01, 0x63])
        #expect(throws: FrameError.self) {
            _ = try decoder.decode(buffer: &buffer)
            _ = try decoder.decode(buffer: &buffer)
        }
        #expect(decoder.streamOffset == 24)
    }

    @Test("unknown flag bits are carried, not rejected")
    func unknownFlags() throws {
        var decoder = FrameDecoder()
        var buffer = ByteBuffer()
        buffer.writeFrame(Frame(type: .response, flags: FrameFlags(rawValue: 0xFF), requestID: 1))
        #expect(try decoder.decode(buffer: &buffer)?.flags.rawValue == 0xFF)
    }

    @Test("the payload is a slice of the input, not a copy")
    func payloadIsASlice() throws {
        var decoder = FrameDecoder()
        var buffer = ByteBuffer()
        buffer.writeFrame(.response(id: 1, payload: ByteBuffer(repeating: 1, count: 4_096)))
        let inputBase = buffer.withUnsafeReadableBytes { $0.baseAddress! }
        let frame = try #require(try decoder.decode(buffer: &buffer))
        let payloadBase = frame.payload.withUnsafeReadableBytes { $0.baseAddress! }
        #expect(payloadBase == inputBase + Frame.headerSize)
    }
}
