import EntitlementsWire
import NIOCore

/// Why a call did not get an answer from the connection it was sent on.
enum CallFailure: Error {
    /// The server sent GOAWAY before processing the call: safe to send again elsewhere.
    case notProcessed
    /// The answer did not come within the call's timeout.
    case timedOut
    /// The connection failed or closed before the answer came.
    case connectionLost(String)
    /// The server reported a connection-level ERROR.
    case connectionError(StatusCode, String)
}

/// The client side of one connection: assigns increasing request ids, matches answers to
/// calls by id (they come back in completion order), answers PINGs and sends its own (a
/// PONG not back in time closes the connection), and on GOAWAY fails the calls the server
/// will not process so that they can be retried elsewhere.
/// Confined to the channel's event loop.
final class ClientConnectionHandler: ChannelInboundHandler {
    typealias InboundIn = Frame
    typealias OutboundOut = ByteBuffer

    private var nextRequestID: UInt64 = 1
    private var pending: [UInt64: (promise: EventLoopPromise<Frame>, timer: Scheduled<Void>?)] = [:]
    /// Open server streams: each message, then the end (status and message).
    private var streams: [UInt64: (message: (ByteBuffer) -> Void, end: (StatusCode, String) -> Void)] = [:]
    private var context: ChannelHandlerContext?
    /// Set once the server said GOAWAY (its last processed id) or the connection failed.
    private(set) var isDraining = false
    /// Why the connection failed (a TLS handshake, say), for calls made after it did.
    private var failure: String?
    /// PINGs sent and not yet answered, by the 8 bytes they carry, with their timers.
    private var pings: [UInt64: (promise: EventLoopPromise<Void>, timer: Scheduled<Void>)] = [:]
    private var nextPing: UInt64 = 1
    /// Set once the channel is inactive: a PING then fails at once.
    private var isClosed = false

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
    }

    /// Sends one call; the future completes with the answering RESPONSE frame (any status),
    /// or fails with a ``CallFailure``.
    func call(method: MethodID, payload: ByteBuffer, timeout: TimeAmount?) -> EventLoopFuture<Frame> {
        guard let context = self.context else {
            preconditionFailure("call before the handler was added")
        }
        let promise = context.eventLoop.makePromise(of: Frame.self)
        if let failure = self.failure {
            promise.fail(CallFailure.connectionLost(failure))
            return promise.futureResult
        }
        guard !self.isDraining else {
            promise.fail(CallFailure.notProcessed)
            return promise.futureResult
        }
        let id = self.nextRequestID
        self.nextRequestID += 1
        var timer: Scheduled<Void>?
        var timeoutMicroseconds: UInt32 = 0
        if let timeout {
            timeoutMicroseconds = UInt32(clamping: max(1, timeout.nanoseconds / 1_000))
            timer = context.eventLoop.assumeIsolated().scheduleTask(in: timeout) {
                guard let entry = self.pending.removeValue(forKey: id) else { return }
                entry.promise.fail(CallFailure.timedOut)
                self.send(Frame(type: .cancel, requestID: id))
            }
        }
        self.pending[id] = (promise, timer)
        self.send(.request(id: id, method: method, timeoutMicroseconds: timeoutMicroseconds, payload: payload))
        return promise.futureResult
    }

    /// Opens a server-streaming call: `message` gets each STREAM_MESSAGE payload, `end`
    /// the outcome (once). Returns the call's id, for ``cancelStream(_:)``.
    func openStream(
        method: MethodID,
        payload: ByteBuffer,
        message: @escaping (ByteBuffer) -> Void,
        end: @escaping (StatusCode, String) -> Void
    ) -> UInt64? {
        guard !self.isDraining else {
            end(.unavailable, "the connection is going away")
            return nil
        }
        let id = self.nextRequestID
        self.nextRequestID += 1
        self.streams[id] = (message, end)
        self.send(.request(id: id, method: method, payload: payload))
        return id
    }

    /// Sends a PING; the future succeeds when its PONG arrives (every frame the server sent
    /// before reading the PING has then been read). If it has not within `timeout` the
    /// connection is taken as dead (a partition or a hung server: nothing else would say
    /// so) and closed, its calls failing UNAVAILABLE, the next call opening a new one; the
    /// future then fails with ``CallFailure/timedOut``, or with the connection. Returns the
    /// PING's id too, for ``cancelPing(_:)``.
    func ping(timeout: TimeAmount) -> (id: UInt64, answered: EventLoopFuture<Void>) {
        guard let context = self.context else {
            preconditionFailure("ping before the handler was added")
        }
        let promise = context.eventLoop.makePromise(of: Void.self)
        let id = self.nextPing
        self.nextPing += 1
        if let failure = self.failure {
            promise.fail(CallFailure.connectionLost(failure))
            return (id, promise.futureResult)
        }
        guard !self.isClosed else {
            promise.fail(CallFailure.connectionLost("the connection closed"))
            return (id, promise.futureResult)
        }
        let timer = context.eventLoop.assumeIsolated().scheduleTask(in: timeout) {
            guard let ping = self.pings.removeValue(forKey: id) else { return }
            ping.promise.fail(CallFailure.timedOut)
            self.context?.close(promise: nil)
        }
        self.pings[id] = (promise, timer)
        self.send(Frame(type: .ping, requestID: id))
        return (id, promise.futureResult)
    }

    /// Stops waiting for a PING's PONG (its waiter was cancelled).
    func cancelPing(_ id: UInt64) {
        guard let ping = self.pings.removeValue(forKey: id) else { return }
        ping.timer.cancel()
        ping.promise.fail(CancellationError())
    }

    /// Cancels a stream the caller no longer reads.
    func cancelStream(_ id: UInt64) {
        guard self.streams.removeValue(forKey: id) != nil else {
            return
        }
        self.send(Frame(type: .cancel, requestID: id))
    }

    private func send(_ frame: Frame) {
        guard let context = self.context else { return }
        var buffer = context.channel.allocator.buffer(capacity: Frame.headerSize + frame.payload.readableBytes)
        buffer.writeFrame(frame)
        context.writeAndFlush(self.wrapOutboundOut(buffer), promise: nil)
    }

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        let frame = self.unwrapInboundIn(data)
        switch frame.type {
        case .streamMessage:
            self.streams[frame.requestID]?.message(frame.payload)
        case .endOfStream where self.streams[frame.requestID] != nil, .response where self.streams[frame.requestID] != nil:
            self.streams.removeValue(forKey: frame.requestID)?.end(frame.status, frame.message)
        case .response, .endOfStream:
            if let entry = self.pending.removeValue(forKey: frame.requestID) {
                entry.timer?.cancel()
                entry.promise.succeed(frame)
            }
        case .ping:
            self.send(Frame(type: .pong, requestID: frame.requestID))
        case .goAway:
            self.isDraining = true
            for (id, entry) in self.pending where id > frame.requestID {
                self.pending[id] = nil
                entry.timer?.cancel()
                entry.promise.fail(CallFailure.notProcessed)
            }
            for (id, stream) in self.streams where id > frame.requestID {
                self.streams[id] = nil
                stream.end(.unavailable, "the server is going away and did not start the stream")
            }
        case .error:
            self.failAll(CallFailure.connectionError(frame.status, frame.message))
            context.close(promise: nil)
        case .pong:
            if let ping = self.pings.removeValue(forKey: frame.requestID) {
                ping.timer.cancel()
                ping.promise.succeed()
            }
        case .request, .cancel:
            break
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        self.isClosed = true
        self.failAll(CallFailure.connectionLost("the connection closed"))
        context.fireChannelInactive()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        self.failure = self.failure ?? "\(error)"
        self.failAll(CallFailure.connectionLost("\(error)"))
        context.close(promise: nil)
    }

    private func failAll(_ failure: CallFailure) {
        self.isDraining = true
        let streams = self.streams
        self.streams.removeAll()
        for stream in streams.values {
            switch failure {
            case .connectionError(let status, let message): stream.end(status, message)
            default: stream.end(.unavailable, "the connection was lost")
            }
        }
        let pings = self.pings
        self.pings.removeAll()
        for ping in pings.values {
            ping.timer.cancel()
            ping.promise.fail(failure)
        }
        let calls = self.pending
        self.pending.removeAll()
        for entry in calls.values {
            entry.timer?.cancel()
            entry.promise.fail(failure)
        }
    }
}
