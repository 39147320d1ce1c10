import NIOCore
import NIOPosix

/// The framed connections of one event loop whose answers wait to be flushed, flushed
/// together once the loop tick's reads are all handled (a task run after the tick's I/O
/// events and the tasks queued before it, before the loop waits again), as Redis writes
/// its clients' replies before it sleeps. Each connection still gets one `write` per tick
/// in which it read; what changes is that they go out in a burst rather than one between
/// each two reads: the client, woken by the first, finds the rest ready instead of going
/// back to sleep between them, and waking a sleeping client is a large part of a loopback
/// `write` (benchmarks/README.md, "One flush per loop tick"). Watch events told to a
/// connection in a tick wait for it too: the events of writes committed together then
/// usually share one `write` ("Watches of every customer").
///
/// One per event loop thread, used only on it (`@unchecked Sendable` because a
/// `ThreadSpecificVariable` asks for it: each value is reached only from its own thread,
/// which ``current(on:)`` checks, and ``flushLater(_:)`` in debug builds).
final class TickFlush: @unchecked Sendable {
    private static let perThread = ThreadSpecificVariable<TickFlush>()

    /// The one of `eventLoop`, on its thread; made on first use (and made again when the
    /// thread now runs another loop, as test loops may: a list it still holds keeps it
    /// alive until its tick ends, since its connections hold it too).
    static func current(on eventLoop: any EventLoop) -> TickFlush {
        eventLoop.preconditionInEventLoop()
        if let flush = Self.perThread.currentValue, flush.eventLoop === eventLoop {
            return flush
        }
        let flush = TickFlush(eventLoop: eventLoop)
        Self.perThread.currentValue = flush
        return flush
    }

    private let eventLoop: any EventLoop
    private var waiting: [ServerConnectionHandler] = []
    /// Made once, so that a tick's flush allocates nothing. Unowned: while the task is
    /// queued the list is not empty, and its connections hold this object.
    private lazy var task: @Sendable () -> Void = { [unowned self] in self.flushAll() }

    private init(eventLoop: any EventLoop) {
        self.eventLoop = eventLoop
    }

    /// Flushes `handler` at the end of this loop tick (the caller asks once per tick).
    func flushLater(_ handler: ServerConnectionHandler) {
        self.eventLoop.assertInEventLoop()
        if self.waiting.isEmpty {
            self.eventLoop.execute(self.task)
        }
        self.waiting.append(handler)
    }

    private func flushAll() {
        // By index: a handler added while the list is flushed (a watch event sent from a
        // writability change that a flush fired) is flushed too, not dropped with the list.
        var index = 0
        while index < self.waiting.count {
            self.waiting[index].flushAtTickEnd()
            index += 1
        }
        self.waiting.removeAll(keepingCapacity: true)
    }
}
