import NIOCore
import NIOHPACK

/// `--target grpc`: a gRPC client written on raw HTTP/2 frames (RFC 9113), so that the load
/// generator is not the limit of any gRPC server it measures. grpc-swift-2's client (a task
/// per call) used its whole core at 15,000 calls/s, below every gRPC server here.
///
/// What it does per call: one HEADERS frame whose HPACK block is encoded once at start
/// (static-table indices and literals without indexing, so it never touches the dynamic
/// table and can be sent again as is) and one DATA frame with END_STREAM (the gRPC message:
/// a flag byte, a length, CheckEntitlementsRequest{user_id}), written together. Answers: the
/// response HEADERS and the trailers are HPACK-decoded (swift-nio-http2's decoder: the
/// server's dynamic table must be followed), DATA is counted, not decoded; a call is OK when
/// its trailers say `grpc-status: 0`. The connection work a client owes is done: SETTINGS
/// and PING are acknowledged, the connection's receive window is topped up, the server's
/// WINDOW_UPDATEs are tracked. Streams are odd ids counting up, one per call.
struct H2Client {
    private var decoder = HPACKDecoder(allocator: ByteBufferAllocator())
    private let headerBlock: [UInt8]
    private var nextStream: UInt32 = 1
    /// DATA bytes received since the last WINDOW_UPDATE we sent for the connection.
    private var unacknowledged = 0
    /// What the server lets us send on the connection (requests are small; servers top it up).
    private var sendWindow = 65_535
    /// A header block split over CONTINUATION frames: the stream, END_STREAM, the fragments.
    private var continued: (stream: UInt32, endStream: Bool, block: ByteBuffer)?

    static let path = "/entitlements.v1.EntitlementService/CheckEntitlements"
    /// The window we open for the connection at start, and top up by when half is used.
    static let connectionWindow = 1 << 30

    init(authority: String) {
        var block: [UInt8] = [0x83, 0x86]  // :method POST, :scheme http (static 3 and 6)
        func literal(nameIndex prefix: [UInt8], _ value: String) {
            block += prefix + [UInt8(value.utf8.count)] + Array(value.utf8)
        }
        literal(nameIndex: [0x04], Self.path)  // :path (static 4), not indexed
        literal(nameIndex: [0x01], authority)  // :authority (static 1)
        literal(nameIndex: [0x0F, 0x10], "application/grpc")  // content-type (static 31)
        block += [0x00, 0x02] + Array("te".utf8)  // te: a new name, not indexed
        block += [0x08] + Array("trailers".utf8)
        self.headerBlock = block
    }

    /// The connection preface, our SETTINGS (the defaults) and a larger connection window.
    func preface(into out: inout ByteBuffer) {
        out.writeString("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        Self.frameHeader(length: 0, type: 4, flags: 0, stream: 0, into: &out)
        Self.frameHeader(length: 4, type: 8, flags: 0, stream: 0, into: &out)
        out.writeInteger(UInt32(Self.connectionWindow - 65_535))
    }

    /// One call: HEADERS and DATA (END_STREAM). Returns its stream id.
    mutating func request(user: String, into out: inout ByteBuffer) -> UInt32 {
        let stream = self.nextStream
        self.nextStream += 2
        Self.frameHeader(length: self.headerBlock.count, type: 1, flags: 0x4, stream: stream, into: &out)
        out.writeBytes(self.headerBlock)
        let length = user.utf8.count
        let message = 2 + length
        Self.frameHeader(length: 5 + message, type: 0, flags: 0x1, stream: stream, into: &out)
        out.writeInteger(UInt8(0))
        out.writeInteger(UInt32(message))
        out.writeInteger(UInt8(0x0A))
        out.writeInteger(UInt8(length))
        out.writeString(user)
        self.sendWindow -= 5 + message
        return stream
    }

    /// Whether the server's window has room for another call (else the caller waits for a
    /// WINDOW_UPDATE; never seen with the servers here, checked all the same).
    var canSend: Bool { self.sendWindow > 256 }

    struct ProtocolError: Error, CustomStringConvertible {
        var description: String
    }

    /// Reads the complete frames in `buffer`: control frames are answered into `reply`, and
    /// each finished call is reported to `finished(stream, ok)`.
    mutating func read(_ buffer: inout ByteBuffer, reply: inout ByteBuffer, finished: (UInt32, Bool) -> Void) throws {
        while buffer.readableBytes >= 9 {
            let start = buffer.readerIndex
            let length = Int(buffer.getInteger(at: start, as: UInt32.self)! >> 8)
            guard buffer.readableBytes >= 9 + length else {
                return
            }
            let type = buffer.getInteger(at: start + 3, as: UInt8.self)!
            let flags = buffer.getInteger(at: start + 4, as: UInt8.self)!
            let stream = buffer.getInteger(at: start + 5, as: UInt32.self)! & 0x7FFF_FFFF
            buffer.moveReaderIndex(forwardBy: 9)
            var payload = buffer.readSlice(length: length)!
            switch type {
            case 0:  // DATA: counted for the connection's window; the message is not decoded.
                self.unacknowledged += length
                if self.unacknowledged >= Self.connectionWindow / 2 {
                    Self.frameHeader(length: 4, type: 8, flags: 0, stream: 0, into: &reply)
                    reply.writeInteger(UInt32(self.unacknowledged))
                    self.unacknowledged = 0
                }
                if flags & 0x1 != 0 {
                    finished(stream, false)  // ended without trailers: not gRPC
                }
            case 1:  // HEADERS
                if flags & 0x8 != 0 {
                    let padding = Int(payload.readInteger(as: UInt8.self)!)
                    payload = payload.getSlice(at: payload.readerIndex, length: payload.readableBytes - padding)!
                }
                if flags & 0x20 != 0 {
                    payload.moveReaderIndex(forwardBy: 5)
                }
                if flags & 0x4 != 0 {
                    try self.headers(&payload, stream: stream, endStream: flags & 0x1 != 0, finished: finished)
                } else {
                    self.continued = (stream, flags & 0x1 != 0, payload)
                }
            case 9:  // CONTINUATION
                guard var continued = self.continued, continued.stream == stream else {
                    throw ProtocolError(description: "CONTINUATION on stream \(stream) without HEADERS")
                }
                continued.block.writeBuffer(&payload)
                if flags & 0x4 != 0 {
                    self.continued = nil
                    try self.headers(&continued.block, stream: stream, endStream: continued.endStream, finished: finished)
                } else {
                    self.continued = continued
                }
            case 3:  // RST_STREAM
                finished(stream, false)
            case 4:  // SETTINGS: acknowledged (ours are the defaults; theirs need nothing here)
                if flags & 0x1 == 0 {
                    Self.frameHeader(length: 0, type: 4, flags: 0x1, stream: 0, into: &reply)
                }
            case 6:  // PING: answered with the same 8 bytes (grpc-go measures bandwidth with them)
                if flags & 0x1 == 0 {
                    Self.frameHeader(length: 8, type: 6, flags: 0x1, stream: 0, into: &reply)
                    reply.writeBuffer(&payload)
                }
            case 7:  // GOAWAY
                let code = payload.getInteger(at: payload.readerIndex + 4, as: UInt32.self) ?? 0
                throw ProtocolError(description: "the server sent GOAWAY, error code \(code)")
            case 8:  // WINDOW_UPDATE
                if stream == 0, let increment = payload.readInteger(as: UInt32.self) {
                    self.sendWindow += Int(increment & 0x7FFF_FFFF)
                }
            default:
                break  // PRIORITY, unknown types: ignored, as RFC 9113 says
            }
        }
    }

    private mutating func headers(_ block: inout ByteBuffer, stream: UInt32, endStream: Bool, finished: (UInt32, Bool) -> Void) throws {
        let headers = try self.decoder.decodeHeaders(from: &block)
        if endStream {
            finished(stream, headers.first(name: "grpc-status") == "0")
        }
    }

    private static func frameHeader(length: Int, type: UInt8, flags: UInt8, stream: UInt32, into out: inout ByteBuffer) {
        out.writeInteger(UInt32(length) << 8 | UInt32(type))
        out.writeInteger(flags)
        out.writeInteger(stream)
    }
}
