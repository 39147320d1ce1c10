public import NIOCore

/// Splits a byte stream into ``Frame``s (docs/PROTOCOL.md, "Frames").
///
/// Each header is validated as soon as its bytes arrive, and the payload length is checked
/// against ``maximumPayloadSize`` before anything is allocated for it, so an oversized or
/// garbage stream is rejected after at most 24 bytes. Payloads are zero-copy slices of the
/// input. Use it with `ByteToMessageHandler(FrameDecoder())`, or call ``decode(buffer:)``.
public struct FrameDecoder: NIOSingleStepByteToMessageDecoder {
    public typealias InboundOut = Frame

    /// The largest payload accepted; larger frames fail with `.payloadTooLarge`.
    public let maximumPayloadSize: Int
    /// Bytes of the stream consumed so far: the offset of the next frame, for error messages.
    public private(set) var streamOffset = 0

    /// Creates a decoder that accepts payloads of at most `maximumPayloadSize` bytes.
    public init(maximumPayloadSize: Int = Frame.defaultMaximumPayloadSize) {
        precondition(maximumPayloadSize >= 0 && maximumPayloadSize <= Int(UInt32.max))
        self.maximumPayloadSize = maximumPayloadSize
    }

    public mutating func decode(buffer: inout ByteBuffer) throws -> Frame? {
        let start = buffer.readerIndex
        try self.validatePrefix(of: buffer, at: start)
        guard
            let (_, _, rawType, rawFlags, rawStatus, method, requestID, timeout, length) = buffer.getMultipleIntegers(
                at: start,
                as: (UInt16, UInt8, UInt8, UInt8, UInt8, UInt16, UInt64, UInt32, UInt32).self
            )
        else {
            return nil
        }
        // validatePrefix checked magic, version and type once 4 bytes were there.
        let type = FrameType(rawValue: rawType)!
        guard let status = StatusCode(rawValue: rawStatus) else {
            throw self.error(.unknownStatusCode, "\(type) frame has status byte \(rawStatus); status codes are 0 to 16")
        }
        guard length <= self.maximumPayloadSize else {
            throw self.error(
                .payloadTooLarge,
                "\(type) frame declares a \(length)-byte payload; the maximum is \(self.maximumPayloadSize) bytes"
            )
        }
        if type.requiresEmptyPayload && length != 0 {
            throw self.error(.unexpectedPayload, "\(type) frame carries a \(length)-byte payload; it must be empty")
        }
        let frameSize = Frame.headerSize + Int(length)
        guard buffer.readableBytes >= frameSize else {
            return nil
        }
        buffer.moveReaderIndex(forwardBy: Frame.headerSize)
        let payload = buffer.readSlice(length: Int(length))!
        self.streamOffset += frameSize
        return Frame(
            type: type,
            flags: FrameFlags(rawValue: rawFlags),
            status: status,
            method: MethodID(rawValue: method),
            requestID: requestID,
            timeoutMicroseconds: timeout,
            payload: payload
        )
    }

    public mutating func decodeLast(buffer: inout ByteBuffer, seenEOF: Bool) throws -> Frame? {
        if let frame = try self.decode(buffer: &buffer) {
            return frame
        }
        guard buffer.readableBytes > 0 else {
            return nil
        }
        let expected: String
        if let length = buffer.getInteger(at: buffer.readerIndex + 20, as: UInt32.self) {
            expected = "\(Frame.headerSize + Int(length))-byte frame"
        } else {
            expected = "\(Frame.headerSize)-byte frame header"
        }
        throw self.error(
            .truncated,
            "connection ended after \(buffer.readableBytes) bytes of a \(expected)"
        )
    }

    /// Rejects a stream as early as its first bytes allow: a peer speaking another
    /// protocol (HTTP, TLS) is told so without waiting for a whole header.
    private func validatePrefix(of buffer: ByteBuffer, at start: Int) throws {
        if let magic = buffer.getInteger(at: start, as: UInt16.self), magic != Frame.magic {
            throw self.error(
                .badMagic,
                "frame starts with 0x\(String(magic, radix: 16, uppercase: true)), not the magic 0x454E (\"EN\"): "
                    + "the peer does not speak the entitlements protocol"
            )
        }
        if let version = buffer.getInteger(at: start + 2, as: UInt8.self), version != Frame.version {
            throw self.error(
                .unsupportedVersion,
                "frame has protocol version \(version); this side speaks version \(Frame.version)"
            )
        }
        if let rawType = buffer.getInteger(at: start + 3, as: UInt8.self), FrameType(rawValue: rawType) == nil {
            throw self.error(.unknownFrameType, "frame has unknown type \(rawType); types are 1 to 9")
        }
    }

    private func error(_ code: FrameError.Code, _ description: String) -> FrameError {
        FrameError(code: code, description: "\(description) (at stream offset \(self.streamOffset))", streamOffset: self.streamOffset)
    }
}

/// Writes ``Frame``s: use it with `MessageToByteHandler(FrameEncoder())`.
public struct FrameEncoder: MessageToByteEncoder {
    public typealias OutboundIn = Frame

    /// Creates an encoder.
    public init() {}

    public func encode(data frame: Frame, out: inout ByteBuffer) throws {
        out.writeFrame(frame)
    }
}
