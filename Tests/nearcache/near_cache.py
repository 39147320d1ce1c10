"""A reference near-cache in Python, written from docs/PROTOCOL.md, "Keeping answers", alone:
what a service in another language needs to answer checks without a round trip, exactly.
It speaks gRPC (the door, docs/doors.md) with grpcio stubs; the eviction here is a plain
least-recently-used bound (the rules make a cache correct; how it chooses what to keep
when full is its own affair: the Swift client uses the server's Window TinyLFU). Like the
Swift client's, it keeps production answers only (one watch; a sandbox check goes to the
server).

    cache = NearCache(stub)          # an EntitlementServiceStub
    answer = cache.check("user-1")   # a CheckEntitlementsResponse
    cache.close()

Rule 6 (the watch must be known alive): while its watch is open it calls Health on the
same channel every `liveness` seconds with that deadline, and takes a call that fails as a
lost watch (rule 4). gRPC's own keepalive would be the HTTP/2 PING, but with
keepalive_time_ms and keepalive_timeout_ms at 1000 and keepalive_permit_without_calls,
grpcio 1.85 did not fail a watch whose connection went silent within 10 s in this test
(its keepalive trace showed no PING started on that connection): a call with a deadline is
what a client controls. It costs one Health call a second per cache (counted in the
server's request metrics, and traced when tracing is on). A gRPC channel may put that call
on another HTTP/2 connection than the watch's (after a GOAWAY, or with several addresses);
with one address and a live connection it uses that one.
"""
import collections
import threading
import time

import grpc

import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "doors"))
from stubs import svc  # noqa: E402

PRODUCTION = 1


def now_ms():
    return int(time.time() * 1000)


class NearCache:
    RING = 4096  # names of recent events remembered, to judge answers that were in flight

    def __init__(self, stub, max_entries=10_000, liveness=1.0):
        self.stub = stub
        self.max_entries = max_entries
        self.liveness = liveness   # rule 6: seconds between proofs that the watch's channel answers
        self.lock = threading.Lock()
        self.kept = collections.OrderedDict()           # user id -> (CheckEntitlementsResponse, kept at)
        self.alias_keys = collections.defaultdict(set)  # customer id -> other user ids kept for it
        self.epoch = 0             # bumped whenever everything kept is forgotten for a new watch
        self.watch_from = None     # rule 2: S, the first kept answer's log_sequence
        self.live = False          # the watch is open: kept answers may be served
        self.lost = False          # rule 4: the watch ended; serve nothing, start afresh
        self.lowest_start = 0      # a watch from below this was refused (FAILED_PRECONDITION)
        self.watch_started_at = 0.0
        self.short_watches = 0     # watches in a row that ended within a second
        self.next_watch_at = 0.0   # and when the next may start (monotonic)
        self.events = 0
        self.ring = collections.deque(maxlen=self.RING)  # (events count, name) per name an event carried
        self.call = None
        self.closed = False
        self.hits = self.misses = self.invalidations = self.watches = 0

    # MARK: Checks

    def check(self, user, environment=PRODUCTION, entitlement_ids=(), min_log_sequence=0, timeout=5):
        if environment not in (0, PRODUCTION):
            return self.stub.CheckEntitlements(svc.CheckEntitlementsRequest(
                user_id=user, environment=environment, entitlement_ids=entitlement_ids, min_log_sequence=min_log_sequence), timeout=timeout)
        instant = now_ms()
        with self.lock:
            kept = self.kept.get(user) if self.live and not self.lost else None
            answer = kept[0] if kept is not None else None
            if answer is not None and answer.HasField("valid_until") and instant >= answer.valid_until:
                del self.kept[user]                 # rule 1: never past validUntil
                answer = None
            if answer is not None and instant < kept[1]:
                answer = None                       # rule 1: nor before it arrived (another thread's clock read)
            if answer is not None and min_log_sequence > answer.log_sequence:
                answer = None                       # rule 5
            if answer is not None:
                self.kept.move_to_end(user)
                self.hits += 1
            else:
                self.misses += 1
            ticket = (self.epoch, self.watch_from is not None and not self.lost, self.events)
        if answer is not None:
            return self._shaped(answer, instant, entitlement_ids)
        try:
            whole = self.stub.CheckEntitlements(
                svc.CheckEntitlementsRequest(user_id=user, environment=PRODUCTION, min_log_sequence=min_log_sequence), timeout=timeout)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                with self.lock:                     # the watch cannot be trusted either
                    self._mark_lost(self.epoch)
            raise
        self._keep(user, whole, ticket)
        return self._shaped(whole, whole.request_date, entitlement_ids)

    @staticmethod
    def _shaped(answer, instant, entitlement_ids):
        shaped = svc.CheckEntitlementsResponse()
        shaped.CopyFrom(answer)
        shaped.request_date = instant
        if entitlement_ids:
            del shaped.entitlements[:]
            shaped.entitlements.extend(e for e in answer.entitlements if e.id in entitlement_ids)
        return shaped

    def _keep(self, user, answer, ticket):
        if answer.stale_for_ms:                     # a fleet server behind: nothing kept holds
            with self.lock:
                self._mark_lost(self.epoch)
            return
        sequence = answer.log_sequence
        start = None
        with self.lock:
            if self.closed:
                return
            if self.lost and time.monotonic() < self.next_watch_at:
                return                              # watches keep ending at once: wait a little
            if self.lost:                           # rule 4: a new start
                self.invalidations += len(self.kept)
                self.kept.clear()
                self.alias_keys.clear()
                self.epoch += 1
                self.watch_from, self.lost, self.live = None, False, False
                if self.call is not None:
                    self.call.cancel()
                    self.call = None
            if self.watch_from is None:
                if sequence < self.lowest_start:
                    return
                self.watch_from = sequence
                self.watch_started_at = time.monotonic()
                self.watches += 1
                start = (self.epoch, sequence)
            epoch, started, events = ticket
            # Served after S: its own sequence is at least S, or it was asked after S was set.
            covered = sequence >= self.watch_from or (epoch == self.epoch and started)
            customer = answer.customer_id if answer.HasField("customer_id") else user
            # Rule 3: no event that names it arrived while it was in flight.
            if covered and self._unnamed_since(events, {user, customer}):
                self.kept[user] = (answer, now_ms())   # served from now on (rule 1)
                self.kept.move_to_end(user)
                if customer != user:
                    self.alias_keys[customer].add(user)
                while len(self.kept) > self.max_entries:
                    self.kept.popitem(last=False)
                if len(self.alias_keys) > 2 * self.max_entries:   # evicted answers leave it
                    self.alias_keys = collections.defaultdict(set)
                    for kept_user, (kept, _) in self.kept.items():
                        if kept.HasField("customer_id") and kept.customer_id != kept_user:
                            self.alias_keys[kept.customer_id].add(kept_user)
        if start is not None:
            threading.Thread(target=self._watch, args=start, daemon=True).start()

    def _unnamed_since(self, events, names):
        if self.events == events:
            return True
        if len(self.ring) == self.RING and self.ring[0][0] > events:
            return False                            # the ring no longer reaches back: refuse
        return not any(count > events and name in names for count, name in self.ring)

    # MARK: The watch

    def _watch(self, epoch, sequence):
        try:
            call = self.stub.WatchEntitlements(svc.WatchEntitlementsRequest(
                all_customers=True, environment=PRODUCTION, after_log_sequence=sequence))
            with self.lock:
                if epoch != self.epoch or self.closed:
                    call.cancel()
                    return
                self.call = call
                if not self.lost:
                    self.live = True
            threading.Thread(target=self._prove_alive, args=(epoch, call), daemon=True).start()
            for event in call:
                if not self._apply(event, epoch):
                    return
            refused = False
        except grpc.RpcError as error:
            refused = error.code() == grpc.StatusCode.FAILED_PRECONDITION
        with self.lock:
            if epoch == self.epoch:
                if refused:
                    self.lowest_start = max(self.lowest_start, sequence + 1)
                if time.monotonic() - self.watch_started_at < 1:   # short-lived: back off
                    self.short_watches = min(self.short_watches + 1, 7)
                    self.next_watch_at = time.monotonic() + 0.05 * 2 ** (self.short_watches - 1)
                else:
                    self.short_watches = 0
            self._mark_lost(epoch)

    def _prove_alive(self, epoch, call):
        # Rule 6: a channel that stops answering (a partition, a hung server) shows nothing
        # on the watch; a call on it with a deadline does.
        while True:
            time.sleep(self.liveness)
            with self.lock:
                if epoch != self.epoch or self.closed or not call.is_active():
                    return
            try:
                self.stub.Health(svc.HealthRequest(), timeout=self.liveness)
            except Exception:  # an RpcError, or a channel closed meanwhile (ValueError)
                with self.lock:
                    self._mark_lost(epoch)
                call.cancel()
                return

    def _mark_lost(self, epoch):
        if epoch == self.epoch and self.watch_from is not None:
            self.live, self.lost = False, True

    def _apply(self, event, epoch):
        # Every cause (WRITE, RESUMED, TIME: a time event may carry a write) forgets what it names.
        with self.lock:
            if epoch != self.epoch or self.closed:
                return False
            self.events += 1
            customer = event.customer_id
            self._forget(customer)
            for user in self.alias_keys.pop(customer, ()):
                self._forget(user)
            self.ring.append((self.events, customer))
            for alias in event.aliases_changed:
                self._forget(alias)
                self.ring.append((self.events, alias))
            return True

    def _forget(self, user):
        if self.kept.pop(user, None) is not None:
            self.invalidations += 1

    def close(self):
        with self.lock:
            self.closed, self.live = True, False
            if self.call is not None:
                self.call.cancel()
