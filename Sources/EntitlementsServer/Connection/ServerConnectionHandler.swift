import EntitlementsMessages
import EntitlementsSecurity
import EntitlementsCache
import EntitlementsStore
import EntitlementsWire
import NIOCore
import NIOExtras

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The server side of one connection (docs/PROTOCOL.md): turns REQUEST frames into work
/// for the resolver pool, and answers in completion order. It enforces the protocol's
/// rules for this connection only: a violation gets an ERROR frame and closes this
/// connection, never another.
///
/// Runs on the connection's event loop; all its state is confined there.
final class ServerConnectionHandler: ChannelInboundHandler {
    typealias InboundIn = ByteBuffer
    typealias OutboundOut = ByteBuffer

    /// The methods this transport carries (the service layer).
    private let methods: EntitlementMethods
    /// The methods' services and settings, held here too: read on every frame.
    private let services: ServerServices
    private let configuration: ServerConfiguration
    /// Frames are decoded here, not by a ByteToMessageHandler before this handler: no
    /// pipeline hop and no NIOAny box per frame.
    private let frames: NIOSingleStepByteToMessageProcessor<FrameDecoder>
    /// Bytes read from the socket, and bytes of complete frames, for the slow-sender guard.
    private var received = 0
    private var consumed = 0
    /// Where the frame being handled starts in the stream, for connection errors.
    private var frameOffset = 0
    private var slowSenderTimer: Scheduled<Void>?
    private var consumedWhenArmed = 0
    /// When bytes last arrived, for the idle timeout (a partial frame counts; the
    /// slow-sender guard, with its shorter timeout, deals with those).
    private var lastActivity = NIODeadline.now()
    /// Checks answered OK during the current read from its own frames: counted, with one
    /// clock read for all of them, when the read's frames are done (a clock read and a lock
    /// per answer were 3 to 4% of the server's CPU at 50 x 16).
    private var checksAnsweredInRead = 0
    private var idleTimer: Scheduled<Void>?
    /// Armed once the sending side is shut down (see `closeGracefully`).
    private var lingerTimer: Scheduled<Void>?

    /// A call whose answer comes later. The router times it out; a routed call has a scope
    /// of its own, which CANCEL closes (the router then counts it CANCELLED and its queued
    /// work is skipped); a check, the specialised path, is counted here.
    private struct Pending {
        var start: NIODeadline
        /// The routed call's own scope; nil for a check.
        var scope: ConnectionScope?
        /// A check's own scope, with tracing on only (its span ends CANCELLED when a CANCEL
        /// closes it); the check is still counted here.
        var checkScope: ConnectionScope? = nil
    }

    /// Calls accepted and not yet answered, by request id: held for CANCEL, backpressure
    /// and the drain.
    private var pending: [UInt64: Pending] = [:]
    /// The method and read time of the request being handled (set by `request(_:)`).
    private var current = (method: MethodID(rawValue: 0), start: NIODeadline.uptimeNanoseconds(0))
    /// Open WatchEntitlements streams by request id (not in `pending`: they never end on
    /// their own).
    private var watches: [UInt64: WatchStream] = [:]
    private var lastRequestID: UInt64 = 0
    /// Open, draining, closing or closed; whether reads are paused (FramedConnectionState).
    private var state = FramedConnectionState()
    /// Tells resolvers on other loops when this connection has closed.
    private let scope: ConnectionScope
    /// Who the client is, and what it may do (docs/security.md).
    private let credentials: ConnectionCredentials
    private var inReadBatch = false
    private var needsFlush = false
    /// This loop's end-of-tick flush, and whether this connection is on its list.
    private var tickFlush: TickFlush!
    private var flushQueued = false
    /// Whether a read's answers may wait for the end of the tick: not under TLS (below).
    private var defersFlush = false
    /// Whether the last read filled NIO's buffer (NIO then read again at once).
    private var lastReadFilledBuffer = false
    /// Frames not yet handed to the channel (see `sendOutgoing`).
    private var outgoing = ByteBuffer()
    private var context: ChannelHandlerContext!

    /// The context of a call without a deadline, made once (and again when the
    /// connection's access changes): a check passes it as it is, so the hot path retains
    /// neither the loop nor the scope.
    private var plainCall: CallContext
    /// The credentials' access version that `plainCall` carries.
    private var accessVersion = -1

    init(methods: EntitlementMethods, eventLoop: any EventLoop, credentials: ConnectionCredentials) {
        self.methods = methods
        self.credentials = credentials
        self.scope = ConnectionScope(peer: credentials.peer)
        self.plainCall = CallContext(eventLoop: eventLoop, deadline: nil, scope: self.scope, access: credentials.access)
        self.services = methods.services
        self.configuration = methods.configuration
        self.frames = NIOSingleStepByteToMessageProcessor(FrameDecoder(maximumPayloadSize: methods.configuration.maximumPayloadSize))
    }

    func handlerAdded(context: ChannelHandlerContext) {
        self.context = context
        self.tickFlush = TickFlush.current(on: context.eventLoop)
        self.defersFlush = self.credentials.security.tls == nil
        self.outgoing = context.channel.allocator.buffer(capacity: Self.outgoingInitialCapacity)
        self.armIdleTimer(at: NIODeadline.now() + self.configuration.idleTimeout)
    }

    /// Closes the connection once it has been idle (nothing in flight, no watch, no frame)
    /// for the idle timeout: GOAWAY first, so the client knows why.
    private func armIdleTimer(at deadline: NIODeadline) {
        self.idleTimer = self.context.eventLoop.assumeIsolated().scheduleTask(deadline: deadline) {
            guard self.context != nil, self.state.acceptsCalls else {
                return
            }
            let idleUntil = self.lastActivity + self.configuration.idleTimeout
            if idleUntil > NIODeadline.now() || !self.pending.isEmpty || !self.watches.isEmpty {
                self.armIdleTimer(at: max(idleUntil, NIODeadline.now() + .nanoseconds(self.configuration.idleTimeout.nanoseconds / 4)))
                return
            }
            guard case .goAway = self.state.drain(inFlight: 0) else {
                return
            }
            let seconds = Double(self.configuration.idleTimeout.nanoseconds) / 1e9
            self.write(header: .goAway, requestID: self.lastRequestID, payload: ByteBuffer(string: "idle for \(seconds) s; reconnect when needed"))
            self.closeGracefully(waitForReader: false)
        }
    }

    func handlerRemoved(context: ChannelHandlerContext) {
        self.scope.close()  // routed calls still being worked on count as CANCELLED
        for call in self.pending.values where call.scope == nil {
            self.methods.recordAnswers(.checkEntitlements, .cancelled, since: call.start)
        }
        self.pending.removeAll()
        for watch in self.watches.values {
            watch.abandon()
        }
        self.watches.removeAll()
        self.idleTimer?.cancel()
        self.idleTimer = nil
        self.slowSenderTimer?.cancel()
        self.slowSenderTimer = nil
        self.lingerTimer?.cancel()
        self.lingerTimer = nil
        self.context = nil
        self.state.closed()
    }

    // MARK: Reading

    func channelRead(context: ChannelHandlerContext, data: NIOAny) {
        guard self.state.isReadingFrames else {
            return
        }
        let bytes = self.unwrapInboundIn(data)
        self.lastReadFilledBuffer = bytes.writableBytes == 0
        if self.received == self.consumed {
            self.prefetchChecks(bytes)  // the read starts with a frame: no part of one is held
        }
        self.received += bytes.readableBytes
        self.inReadBatch = true
        // One clock read per read: the idle clock and the latency start of its frames.
        self.lastActivity = NIODeadline.now()
        do {
            try self.frames.process(buffer: bytes) { frame in
                self.handle(frame)
            }
        } catch {
            self.frameError(error)
        }
        if self.checksAnsweredInRead > 0 {
            self.methods.recordAnswers(.checkEntitlements, .ok, count: self.checksAnsweredInRead, since: self.lastActivity)
            self.checksAnsweredInRead = 0
        }
        self.guardAgainstSlowSender()
    }

    /// Before a read's frames are handled one by one, the CheckEntitlements requests among
    /// them are peeked at (their user ids, without decoding) and their cache entries
    /// prefetched together, so that their memory misses overlap (``CachePeek``). Changes no
    /// answer; allocates nothing.
    private func prefetchChecks(_ bytes: ByteBuffer) {
        // Only a read of two frames or more: one check's entry has nothing to overlap with
        // (its lookup overlaps its own misses), and peeking would hash its key twice.
        guard bytes.readableBytes >= 2 * Frame.headerSize,
            let firstLength = bytes.getInteger(at: bytes.readerIndex + Frame.headerSize - 4, as: UInt32.self),
            Int(firstLength) <= bytes.readableBytes - 2 * Frame.headerSize
        else {
            return
        }
        bytes.withUnsafeReadableBytes { raw in
            withUnsafeTemporaryAllocation(of: CachePeek.self, capacity: Self.prefetchLimit) { peeks in
                var count = 0
                FramePeek.forEachComplete(in: raw) { frame in
                    if frame.isRequest(.checkEntitlements),
                        let peek = CachePeek(checkRequest: frame.payload, longestUserId: Validation.maximumUserIdBytes)
                    {
                        peeks.initializeElement(at: count, to: peek)
                        count += 1
                    }
                    return count < Self.prefetchLimit
                }
                if count > 1 {
                    self.methods.prefetch(UnsafeBufferPointer(rebasing: peeks[..<count]))
                }
            }
        }
    }

    /// The most checks of one read whose cache entries are prefetched together.
    private static let prefetchLimit = 64

    private func handle(_ frame: Frame) {
        guard self.state.isReadingFrames else {
            return
        }
        self.frameOffset = self.consumed
        self.consumed += Frame.headerSize + frame.payload.readableBytes
        switch frame.type {
        case .request:
            self.request(frame)
        case .cancel:
            self.cancel(frame.requestID)
        case .ping:
            self.write(header: .pong, requestID: frame.requestID, payload: nil)
        case .pong:
            break
        case .error:
            // The client gave up on the connection: nothing it sent after this is read, and
            // what was sent to it goes out before the FIN.
            self.closeGracefully(waitForReader: false)
        case .response, .streamMessage, .endOfStream, .goAway:
            self.connectionError(.invalidArgument, "a client must not send \(frame.type) frames (at stream offset \(self.frameOffset))", requestID: frame.requestID)
        }
    }

    /// A malformed frame: ERROR with the decoder's reason, then close.
    private func frameError(_ error: any Error) {
        if let error = error as? FrameError {
            self.connectionError(error.status, error.description, requestID: 0)
        } else {
            self.connectionError(.invalidArgument, "\(error)", requestID: 0)
        }
    }

    func channelInactive(context: ChannelHandlerContext) {
        self.scope.close()  // checks still queued on other loops for this connection are skipped
        // The peer closed: a frame it left unfinished is reported (logged), not answered.
        if self.state.isReadingFrames {
            do {
                try self.frames.finishProcessing(seenEOF: true) { _ in }
            } catch {
                self.services.logger.info(
                    "connection error",
                    metadata: ["peer": "\(context.remoteAddress.map { "\($0)" } ?? "unix")", "error": "\(error)"]
                )
            }
        }
        context.fireChannelInactive()
    }

    func channelReadComplete(context: ChannelHandlerContext) {
        let read = self.inReadBatch
        self.inReadBatch = false
        guard self.needsFlush else {
            context.fireChannelReadComplete()
            return
        }
        if read, self.defersFlush, !self.lastReadFilledBuffer {
            // The read's answers go out with the other connections' of this loop tick, once
            // every read of the tick is handled (``TickFlush``).
            if !self.flushQueued {
                self.flushQueued = true
                self.tickFlush.flushLater(self)
            }
        } else {
            // NIO may close the channel right after this read complete, and what waits for
            // the tick's end would then be lost: answers made before a client's FIN go out
            // before the server's, as when every read was flushed at its end. That is when
            // no read came before it (NIO's read complete at a FIN), when the read filled
            // NIO's buffer (NIO read again at once, and may have found the FIN), and under
            // TLS (NIOSSLHandler passes on no read complete at a FIN, and closes right after
            // the read that carried a close_notify).
            self.flushIfNeeded()
        }
        context.fireChannelReadComplete()
    }

    /// ``TickFlush``'s call at the end of the loop tick in which this connection read or
    /// was told a watch event.
    func flushAtTickEnd() {
        self.flushQueued = false
        if self.context != nil {
            self.flushIfNeeded()
        }
    }

    func channelWritabilityChanged(context: ChannelHandlerContext) {
        if context.channel.isWritable {
            for watch in self.watches.values {
                watch.resume()
            }
        }
        self.updateReading()
        context.fireChannelWritabilityChanged()
    }

    func errorCaught(context: ChannelHandlerContext, error: any Error) {
        self.services.logger.info(
            "connection error",
            metadata: ["peer": "\(context.remoteAddress.map { "\($0)" } ?? "unix")", "error": "\(error)"]
        )
        context.close(promise: nil)
    }

    func userInboundEventTriggered(context: ChannelHandlerContext, event: Any) {
        if event is ChannelShouldQuiesceEvent {
            self.drain()
        } else {
            context.fireUserInboundEventTriggered(event)
        }
    }

    // MARK: Requests

    private func request(_ frame: Frame) {
        self.current = (frame.method, self.lastActivity)  // read by channelRead for this frame
        guard frame.requestID > self.lastRequestID else {
            self.connectionError(
                .invalidArgument,
                "request id \(frame.requestID) is not greater than the previous one (\(self.lastRequestID)); ids must increase (at stream offset \(self.frameOffset))",
                requestID: frame.requestID
            )
            return
        }
        self.lastRequestID = frame.requestID
        if !self.state.acceptsCalls {
            return  // after GOAWAY: not processed, no answer; the client retries elsewhere
        }
        let deadline = frame.timeoutMicroseconds > 0
            ? self.current.start + .microseconds(Int64(frame.timeoutMicroseconds)) : nil
        if self.credentials.accessChanged(since: &self.accessVersion) {
            self.plainCall.access = self.credentials.access
        }
        switch frame.method {
        case .checkEntitlements where Self.asksToExplain(frame.payload):
            self.route(frame, deadline: deadline)  // not the hot path: its answer is a message, not a cached answer
        case .checkEntitlements:
            self.check(frame, deadline: deadline)
        case .watchEntitlements:
            self.watch(frame)
        case .authenticate:
            self.authenticate(frame)
        default:
            self.route(frame, deadline: deadline)
        }
    }

    /// Whether a CheckEntitlementsRequest's bytes set `explain` (field 6; the last one
    /// counts, as protobuf reads it); malformed bytes say no (the check's own decoding
    /// refuses them). A few nanoseconds over a check's few bytes.
    private static func asksToExplain(_ payload: ByteBuffer) -> Bool {
        payload.withUnsafeReadableBytes { bytes in
            var reader = ProtobufReader(bytes: bytes)
            var explain = false
            while !reader.isAtEnd {
                guard let tag = reader.varint() else { return false }
                switch tag & 7 {
                case 0:
                    guard let value = reader.varint() else { return false }
                    if tag >> 3 == 6 { explain = value != 0 }
                case 1, 5:
                    reader.position += tag & 7 == 1 ? 8 : 4  // fixed64, fixed32: unknown fields
                    if reader.position > bytes.count { return false }
                case 2:
                    guard reader.lengthDelimited() != nil else { return false }
                default:
                    return false
                }
            }
            return explain
        }
    }

    /// The call's context: this connection's loop, scope and access, the frame's read time
    /// and deadline.
    private func callContext(_ deadline: NIODeadline?) -> CallContext {
        CallContext(
            eventLoop: self.context.eventLoop,
            deadline: deadline,
            scope: self.scope,
            access: self.plainCall.access,
            start: self.current.start,
            draining: !self.state.acceptsCalls
        )
    }

    /// Every method but the check, the watch and Authenticate: through the service's router,
    /// which applies the per-call rules.
    private func route(_ frame: Frame, deadline: NIODeadline?) {
        let requestID = frame.requestID
        var call = self.callContext(deadline)
        call.scope = ConnectionScope(within: self.scope)  // closed by a CANCEL of this call
        switch self.methods.unary(frame.method, frame.payload, call, codec: .framed) {
        case .now(.success(let answer)):
            self.answer(requestID, answer)
        case .now(.failure(let error)):
            self.fail(requestID, error.status, error.message)
        case .later(let future):
            self.accept(requestID, scope: call.scope)
            self.completeLater(requestID, future) { answer, buffer in
                buffer.writeImmutableBuffer(answer)
                return []
            }
        }
    }

    /// Authenticate (method 5): a token from --auth-token-file gives this connection its
    /// permissions, for the calls after it (pipelined ones included: frames are handled in
    /// order). A wrong token is refused and changes nothing.
    private func authenticate(_ frame: Frame) {
        let request: AuthenticateRequest
        do {
            request = try AuthenticateRequest(buffer: frame.payload)
        } catch {
            self.refuse(frame.requestID, .invalidArgument, "\(error)")
            return
        }
        switch self.credentials.authenticate(token: (request.token ?? "").utf8) {
        case .success(let permissions):
            var response = ByteBuffer()
            try? AuthenticateResponse(check: permissions.contains(.check), write: permissions.contains(.write)).serialize(into: &response)
            self.methods.recordAnswers(.authenticate, .ok, since: self.current.start)
            self.answer(frame.requestID, response)
        case .failure(let refusal):
            self.methods.recordRefusal(refusal, listener: self.credentials.security.policy.name, peer: self.credentials.peer)
            self.refuse(frame.requestID, refusal.status, refusal.message)
        }
    }

    /// CheckEntitlements, the one specialised path: an answer ready at once is written
    /// straight into the outgoing bytes and counted with the rest of its read.
    private func check(_ frame: Frame, deadline: NIODeadline?) {
        let requestID = frame.requestID  // not the frame: its payload pins the read buffer
        let result: MethodResult<CheckAnswer>
        // With tracing on, a check gets a scope of its own, which its CANCEL closes.
        let checkScope = self.methods.isTracing ? ConnectionScope(within: self.scope) : nil
        if deadline == nil, checkScope == nil {
            self.plainCall.start = self.current.start
            result = self.methods.check(frame.payload, self.plainCall)
        } else {
            var call = self.callContext(deadline)
            call.scope = checkScope ?? call.scope
            result = self.methods.check(frame.payload, call)
        }
        switch result {
        case .now(.success(let answer)):
            // The hot path: written straight into the outgoing bytes, nothing pending. Nothing
            // else to do after it: the calls in flight are as they were, a change of
            // writability comes as its own event (channelWritabilityChanged), and the
            // connection was open to take the call, so no drain waits for it.
            self.answerCheck(requestID, answer)
        case .now(.failure(let error)):
            self.refuse(requestID, error.status, error.message)
        case .later(let future):
            self.accept(requestID, scope: nil, checkScope: checkScope)
            self.completeLater(requestID, future) { answer, buffer in
                answer.write(into: &buffer)
                return answer.fromCache ? .fromCache : []
            }
        }
    }

    /// Answers an accepted call when its result arrives (a call no longer pending, being
    /// cancelled meanwhile, is dropped). The router has checked its size, and counted it
    /// unless it is a check.
    private func completeLater<Value>(
        _ requestID: UInt64,
        _ future: EventLoopFuture<Result<Value, ServiceError>>,
        encode: @escaping (Value, inout ByteBuffer) -> FrameFlags
    ) {
        future.assumeIsolated().whenSuccess { result in
            guard self.context != nil, let call = self.pending.removeValue(forKey: requestID) else {
                return
            }
            switch result {
            case .success(let value):
                self.writeResponse(requestID) { encode(value, &$0) }
            case .failure(let error):
                self.outgoing.writeFrame(.failure(id: requestID, status: error.status, message: error.message))
                self.sendOutgoing()
            }
            if call.scope == nil {
                // Its connection may be closing (handlerRemoved comes a tick later): CANCELLED
                // then, as the router counts a routed call.
                self.methods.recordAnswers(.checkEntitlements, self.scope.isClosed ? .cancelled : result.status, since: call.start)
            }
            self.afterCompletion()
        }
    }

    // MARK: Watch

    private func endWatch(_ requestID: UInt64, _ status: StatusCode, _ message: String) {
        self.outgoing.writeFrame(Frame(type: .endOfStream, status: status, requestID: requestID, payload: ByteBuffer(string: message)))
        self.sendOutgoing()
    }

    private func watch(_ frame: Frame) {
        let requestID = frame.requestID
        let deadline = frame.timeoutMicroseconds > 0 ? self.current.start + .microseconds(Int64(frame.timeoutMicroseconds)) : nil
        let sink = WatchSink(
            send: { [unowned self] event in
                self.outgoing.writeFrameHeader(type: .streamMessage, requestID: requestID, payloadLength: UInt32(event.readableBytes))
                self.outgoing.writeImmutableBuffer(event)
                self.sendEvent()
                return self.context?.channel.isWritable ?? false
            },
            end: { [unowned self] status, message in
                self.watches[requestID] = nil
                self.endWatch(requestID, status, message)
            }
        )
        switch self.methods.watch(frame.payload, self.callContext(deadline), codec: .framed, sink: sink) {
        case .success(let watch):
            if !watch.isFinished {
                self.watches[requestID] = watch
            }
        case .failure(let error):
            self.endWatch(requestID, error.status, error.message)  // counted by the router
        }
    }

    private func cancel(_ requestID: UInt64) {
        if let watch = self.watches[requestID] {
            watch.cancel()
            return
        }
        guard let call = self.pending[requestID] else {
            return  // already answered, or never existed: harmless
        }
        if let scope = call.scope {
            scope.close()  // the router counts it CANCELLED when its work ends
        } else {
            call.checkScope?.close()  // its queued work is skipped; its span ends CANCELLED
            self.methods.recordAnswers(.checkEntitlements, .cancelled, since: call.start)
        }
        self.fail(requestID, .cancelled, "cancelled by the client")
    }

    // MARK: Answering

    /// Holds the place of a call whose answer comes later, and applies backpressure.
    private func accept(_ requestID: UInt64, scope: ConnectionScope?, checkScope: ConnectionScope? = nil) {
        self.pending[requestID] = Pending(start: self.current.start, scope: scope, checkScope: checkScope)
        self.updateReading()
    }

    /// Pauses reading when too many calls are in flight or the socket is not writable;
    /// resumes when neither holds.
    private func updateReading() {
        guard let context = self.context else {
            return
        }
        switch self.state.reading(inFlight: self.pending.count, limit: self.configuration.maximumInFlightPerConnection, writable: context.channel.isWritable) {
        case .pause:
            context.channel.setOption(ChannelOptions.autoRead, value: false).whenComplete { _ in }
        case .resume:
            context.channel.setOption(ChannelOptions.autoRead, value: true).whenComplete { _ in }
            context.read()
        case .unchanged:
            break
        }
    }

    /// The hot path's answer, ready at once and not yet counted: written in place, held to
    /// ``AnswerLimit`` here (the router never saw its bytes), and counted with its read.
    /// Its length is known before it is written: the header goes first, once.
    private func answerCheck(_ requestID: UInt64, _ answer: CheckAnswer) {
        let length = answer.byteCount
        if let refusal = AnswerLimit.refusal(byteCount: length) {
            self.outgoing.writeFrame(.failure(id: requestID, status: refusal.status, message: refusal.message))
            self.sendOutgoing()
            self.methods.recordAnswers(.checkEntitlements, refusal.status, since: self.current.start)
            return
        }
        self.outgoing.writeFrameHeader(type: .response, flags: answer.fromCache ? .fromCache : [], requestID: requestID, payloadLength: UInt32(length))
        answer.write(into: &self.outgoing)
        self.sendOutgoing()
        if self.inReadBatch {
            self.checksAnsweredInRead += 1  // counted at the end of this read
        } else {
            self.methods.recordAnswers(.checkEntitlements, .ok, since: self.current.start)
        }
    }

    /// An OK answer the router made (and counted) at once.
    private func answer(_ requestID: UInt64, _ payload: ByteBuffer) {
        self.writeResponse(requestID) { buffer in
            buffer.writeImmutableBuffer(payload)
            return []
        }
        self.afterCompletion()
    }

    /// Writes an OK RESPONSE frame straight into the outgoing bytes: no buffer of its own.
    /// `body` writes the payload and returns the frame's flags. An answer over
    /// ``AnswerLimit`` is replaced by its RESOURCE_EXHAUSTED failure, which is returned.
    @discardableResult
    private func writeResponse(_ requestID: UInt64, _ body: (inout ByteBuffer) -> FrameFlags) -> ServiceError? {
        let frameStart = self.outgoing.writerIndex
        self.outgoing.writeRepeatingByte(0, count: Frame.headerSize)  // the header, once the length is known
        let flags = body(&self.outgoing)
        let payloadLength = self.outgoing.writerIndex - frameStart - Frame.headerSize
        if let refusal = AnswerLimit.refusal(byteCount: payloadLength) {
            self.outgoing.moveWriterIndex(to: frameStart)
            self.outgoing.writeFrame(.failure(id: requestID, status: refusal.status, message: refusal.message))
            self.sendOutgoing()
            return refusal
        }
        let end = self.outgoing.writerIndex
        self.outgoing.moveWriterIndex(to: frameStart)
        self.outgoing.writeFrameHeader(type: .response, flags: flags, requestID: requestID, payloadLength: UInt32(payloadLength))
        self.outgoing.moveWriterIndex(to: end)
        self.sendOutgoing()
        return nil
    }

    /// Fails a call with a status the router gave (and counted), or a cancelled one.
    private func fail(_ requestID: UInt64, _ status: StatusCode, _ message: String) {
        self.pending.removeValue(forKey: requestID)
        self.outgoing.writeFrame(.failure(id: requestID, status: status, message: message))
        self.sendOutgoing()
        self.afterCompletion()
    }

    /// Fails a call this transport refuses before any method ran (its request does not
    /// decode, a wrong token): counted here, since the router never saw it.
    private func refuse(_ requestID: UInt64, _ status: StatusCode, _ message: String) {
        self.methods.recordAnswers(self.current.method, status, since: self.current.start)
        self.fail(requestID, status, message)
    }

    private func write(header type: FrameType, requestID: UInt64, payload: ByteBuffer?) {
        self.outgoing.writeFrame(Frame(type: type, requestID: requestID, payload: payload ?? ByteBuffer()))
        self.sendOutgoing()
    }

    private func send(_ buffer: ByteBuffer) {
        self.outgoing.writeImmutableBuffer(buffer)
        self.sendOutgoing()
    }

    /// Frames written into `outgoing` during read batches go out with one write and one
    /// flush at the end of the loop tick (``TickFlush``; several reads of one tick share it),
    /// or as soon as 16 KiB are waiting; outside a read batch (a hop's answer, a timer) at
    /// once, with whatever the tick's reads left waiting. Watch events: ``sendEvent()``.
    private func sendOutgoing() {
        if !self.state.isReadingFrames {
            // The connection's last frame (the final answer, a GOAWAY or an ERROR) is out:
            // nothing follows it, not even a late answer from another loop.
            self.outgoing.clear()
            return
        }
        if self.inReadBatch {
            self.needsFlush = true
            if self.outgoing.readableBytes >= Self.outgoingFlushThreshold {
                self.flushOutgoing()  // bounded memory, and writability sees the bytes
            }
        } else {
            self.flushOutgoing()
        }
    }

    /// A watch event told to this connection outside a read (a write committed, a timer):
    /// written with the rest of the loop tick's output, so that the events of several writes
    /// committed together usually share one `write` rather than take one each
    /// (benchmarks/README.md, "Watches of every customer"); at once under TLS, as answers
    /// are, or when 16 KiB wait.
    private func sendEvent() {
        guard !self.inReadBatch, self.defersFlush, self.state.isReadingFrames else {
            self.sendOutgoing()
            return
        }
        self.needsFlush = true
        if self.outgoing.readableBytes >= Self.outgoingFlushThreshold {
            self.flushOutgoing()  // bounded memory, and the watch sees the socket fill
        } else if !self.flushQueued {
            self.flushQueued = true
            self.tickFlush.flushLater(self)
        }
    }

    /// Writes and flushes the outgoing bytes, then makes `outgoing` ready for more. When the
    /// socket took every byte, the channel has let go of the storage and `clear` reuses it
    /// (no allocation next time); otherwise the channel still holds it and `outgoing` gets
    /// new storage (writing into shared storage would copy all of it), as large as this
    /// batch was, so that a steady pipelined load does not grow it again by doubling (a
    /// `realloc` each time). A buffer grown by a large answer is not kept.
    private func flushOutgoing() {
        self.needsFlush = false  // whatever waited goes now
        let batch = self.outgoing.readableBytes
        if batch > 0 {
            let bytes = self.outgoing
            // Past them before the channel has them: a frame added while it flushes (a watch
            // resumed by the writability change a flush can fire) is neither sent twice nor
            // cleared below; whoever added it asked for a flush of its own.
            self.outgoing.moveReaderIndex(forwardBy: batch)
            self.context.write(self.wrapOutboundOut(bytes), promise: nil)
        }
        self.context.flush()
        guard self.outgoing.readableBytes == 0 else {
            return
        }
        let next = min(max(batch, Self.outgoingInitialCapacity), Self.outgoingFlushThreshold / 2)
        if self.outgoing.capacity >= Self.outgoingFlushThreshold {
            self.outgoing = self.context.channel.allocator.buffer(capacity: next)
        } else {
            self.outgoing.clear(minimumCapacity: next)
        }
    }

    /// Outgoing bytes are flushed once this many wait in a read batch; a buffer this large
    /// is not kept.
    private static let outgoingFlushThreshold = 16 * 1024
    private static let outgoingInitialCapacity = 1_024

    private func flushIfNeeded() {
        if self.needsFlush {
            self.needsFlush = false
            self.flushOutgoing()
        }
    }

    private func afterCompletion() {
        self.updateReading()
        if self.state.closesAfterCall(inFlight: self.pending.count) {
            self.closeGracefully()  // the rest of this read batch is not processed
        }
    }

    /// Ends the connection without losing a byte sent: the outgoing bytes are written, the
    /// sending side is shut down once NIO has handed every pending write to the socket (a
    /// FIN after the last answer), and the connection is read and discarded until the
    /// client closes it, or for at most `closeLinger`. Closing at once instead, with
    /// answers still queued or input unread, makes the kernel reset the connection and
    /// drop what the client had not yet received (the GOAWAY and answers included).
    ///
    /// `waitForReader`: a drain waits for a slow reader to take every answer (serve's
    /// --drain-timeout bounds it); an idle or broken connection gets `closeLinger` in all.
    private func closeGracefully(waitForReader: Bool = true) {
        guard let context = self.context, self.state.close() else {
            return  // already closing
        }
        self.flushOutgoing()
        self.updateReading()
        let linger = self.configuration.closeLinger
        if !waitForReader {
            self.lingerTimer = context.eventLoop.assumeIsolated().scheduleTask(in: linger) {
                self.context?.close(promise: nil)
            }
        }
        context.close(mode: .output).assumeIsolated().whenComplete { result in
            guard let context = self.context else {
                return
            }
            if case .failure = result {
                context.close(promise: nil)
                return
            }
            guard self.lingerTimer == nil else {
                return  // already bounded
            }
            self.lingerTimer = context.eventLoop.assumeIsolated().scheduleTask(in: linger) {
                self.context?.close(promise: nil)
            }
        }
    }

    // MARK: Connection-level

    /// GOAWAY with the last accepted id; finish what is pending; then close.
    private func drain() {
        guard case .goAway(let closeNow) = self.state.drain(inFlight: self.pending.count) else {
            return
        }
        self.write(header: .goAway, requestID: self.lastRequestID, payload: ByteBuffer(string: "server shutting down"))
        for watch in Array(self.watches.values) {
            watch.finish(.unavailable, "the server is shutting down; resubscribe")
        }
        self.updateReading()  // paused reads resume: input after GOAWAY is read and dropped
        self.flushIfNeeded()
        if closeNow {
            self.closeGracefully()  // a frame left unread is ours to drop, not the client's error
        }
    }

    private func connectionError(_ status: StatusCode, _ message: String, requestID: UInt64) {
        guard let context = self.context else {
            return
        }
        guard self.state.isReadingFrames else {
            return
        }
        // One line per connection error; requests are never logged at the default level.
        self.services.logger.info(
            "connection error",
            metadata: ["peer": "\(context.remoteAddress.map { "\($0)" } ?? "unix")", "status": "\(status)", "error": "\(message)"]
        )
        // Answers already written go first; the ERROR is the last frame.
        self.outgoing.writeFrame(.error(id: requestID, status: status, message: message))
        self.closeGracefully(waitForReader: false)
    }

    // MARK: Slow senders

    /// Cuts off a sender that starts a frame and does not finish it within the frame
    /// timeout (slowloris: holding a connection with a trickle of bytes). Armed while a
    /// frame is partial; time the server itself stopped reading is not held against it.
    private func guardAgainstSlowSender() {
        if self.received > self.consumed {
            if self.slowSenderTimer == nil {
                self.armSlowSenderTimer()
            }
        } else {
            self.slowSenderTimer?.cancel()
            self.slowSenderTimer = nil
        }
    }

    private func armSlowSenderTimer() {
        self.consumedWhenArmed = self.consumed
        self.slowSenderTimer = self.context.eventLoop.assumeIsolated().scheduleTask(in: self.configuration.frameTimeout) {
            self.slowSenderTimer = nil
            self.slowSenderTimerFired()
        }
    }

    private func slowSenderTimerFired() {
        guard self.context != nil, self.state.isReadingFrames, self.received > self.consumed else {
            return  // nothing partial
        }
        if self.state.readsPaused || self.consumed != self.consumedWhenArmed {
            self.armSlowSenderTimer()  // frames completed meanwhile, or we stopped reading
            return
        }
        let seconds = Double(self.configuration.frameTimeout.nanoseconds) / 1e9
        self.connectionError(
            .deadlineExceeded,
            "a frame started \(seconds) s ago has not arrived in full (\(self.received - self.consumed) bytes so far); closing (at stream offset \(self.consumed))",
            requestID: 0
        )
    }
}
