// The floor of a framed server on swift-nio: the least work any NIO server speaking
// docs/PROTOCOL.md's frames can do per request. One handler; each frame (LoadGen sends
// only REQUESTs) gets an OK RESPONSE with one fixed payload, 250 bytes by default (the
// size of a typical cached answer); the answers of one read go out with one write and one
// flush, as the server's do. No cache, no decoding, no metrics, no checks of the
// protocol's rules: what is left is NIO's event loop, channel and pipeline, and the
// kernel. Run LoadGen's entitlements target against it to see how close to Redis a server
// on NIO can come (benchmarks/README.md, "The NIO floor").
//
//   NIOFloor PORT [PAYLOAD_BYTES]
import EntitlementsWire
import NIOCore
import NIOPosix

final class FloorHandler: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    private let payload: ByteBuffer
    private var pending = ByteBuffer()
    private var outgoing = ByteBuffer()
    private var needsFlush = false

    init(payload: ByteBuffer) {
        self.payload = payload
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        var bytes = self.unwrapInboundIn(data)
        if self.pending.readableBytes == 0 {
            self.answer(&bytes)
            if bytes.readableBytes > 0 {
                self.pending.writeBuffer(&bytes)
            }
        } else {
            self.pending.writeBuffer(&bytes)
            self.answer(&self.pending)
            self.pending.discardReadBytes()
        }
    }

    /// Answers every complete frame at the front of `bytes`, consuming them.
    private func answer(_ bytes: inout ByteBuffer) {
        while bytes.readableBytes >= Frame.headerSize,
            let length = bytes.getInteger(at: bytes.readerIndex + 20, as: UInt32.self),
            bytes.readableBytes >= Frame.headerSize + Int(length)
        {
            let requestID = bytes.getInteger(at: bytes.readerIndex + 8, as: UInt64.self)!
            bytes.moveReaderIndex(forwardBy: Frame.headerSize + Int(length))
            self.outgoing.writeFrameHeader(type: .response, requestID: requestID, payloadLength: UInt32(self.payload.readableBytes))
            self.outgoing.writeImmutableBuffer(self.payload)
            self.needsFlush = true
        }
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        guard self.needsFlush else {
            return
        }
        self.needsFlush = false
        context.writeAndFlush(self.wrapOutboundOut(self.outgoing), promise: nil)
        self.outgoing.clear()
    }
}

let arguments = CommandLine.arguments
guard arguments.count >= 2, let port = Int(arguments[1]) else {
    print("usage: NIOFloor PORT [PAYLOAD_BYTES]")
    exit(2)
}
let payloadBytes = arguments.count >= 3 ? Int(arguments[2]) ?? 250 : 250
let payload = ByteBuffer(repeating: 0x2A, count: payloadBytes)
let group = MultiThreadedEventLoopGroup(numberOfThreads: 1)
let channel = try await ServerBootstrap(group: group)
    .serverChannelOption(.backlog, value: 1_024)
    .serverChannelOption(.socketOption(.so_reuseaddr), value: 1)
    .childChannelOption(.socketOption(.tcp_nodelay), value: 1)
    .childChannelOption(.maxMessagesPerRead, value: 16)
    .childChannelInitializer { channel in
        channel.eventLoop.makeCompletedFuture {
            try channel.pipeline.syncOperations.addHandler(FloorHandler(payload: payload))
        }
    }
    .bind(host: "127.0.0.1", port: port)
    .get()
print("NIOFloor listening on 127.0.0.1:\(port), \(payloadBytes)-byte answers")
try await channel.closeFuture.get()
