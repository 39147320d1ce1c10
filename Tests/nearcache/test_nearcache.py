#!/usr/bin/env python3
"""The near-cache correctness test under load (docs/PROTOCOL.md, "Keeping answers"),
driving the Python reference (near_cache.py) as Tests/EntitlementsServerTests/
NearCacheTests.swift drives the Swift client's: random grants (each of its own
entitlement, some ending by time alone within 400 ms), revocations and moves of an alias
between customers, and two restarts of the server, while threads check through the
near-cache. Every answer is checked exactly: its entitlements must be those the writes up
to its log_sequence give at its request_date, its customer the alias's owner at that
sequence, and it may be older than a write that concerns it only within the allowed lag
after that write's acknowledgment. Starts its own server on loopback; stops it by pid.

    python3 Tests/nearcache/test_nearcache.py .build/debug/entitlements"""
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "doors"))
sys.path.insert(0, os.path.join(HERE, "..", "storeharness"))
import near_cache as reference  # noqa: E402
from near_cache import NearCache, now_ms  # noqa: E402
from stubs import svc, types, service_pb2_grpc  # noqa: E402
from harness import FAILURES, check  # noqa: E402

LAG_MS = 250
ALIAS = "py-alias"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def problem(obs, writes, lag=LAG_MS):
    """What is wrong with an observation, or None (as NearCacheLoadTests.problem)."""
    answer, sequence = obs["answer"], obs["answer"].log_sequence
    up_to = [w for w in writes if w["sequence"] <= sequence]
    # A customer's id names it; an alias names its last owner; an id never linked, no one.
    owner = obs["user"] if re.match(r"^py-load-\d+$", obs["user"]) else ""
    for w in up_to:
        if w["kind"] == "move" and w["alias"] == obs["user"]:
            owner = w["user"]
    if (answer.customer_id if answer.HasField("customer_id") else "") != owner:
        return "customer %r, the owner of %s at %d is %r" % (answer.customer_id, obs["user"], sequence, owner)
    if not owner:
        return "an unknown user with entitlements at %d" % sequence if len(answer.entitlements) else None
    grants = {}
    for w in up_to:
        if w["user"] != owner:
            continue
        if w["kind"] == "grant":
            grants[w["grant"]] = [w["from"], w["until"], None]
        elif w["kind"] == "revoke" and w["grant"] in grants:
            grants[w["grant"]][2] = w["at"]         # its revokedDate: active before it (rule 4)
    instant = answer.request_date
    # Entitlement rule 4: from grantedDate, before expirationDate and before revokedDate (a
    # check that read its instant before a revocation was written, and the record after,
    # rightly shows the grant active at that instant).
    expected = {g for g, (start, until, revoked) in grants.items()
                if start <= instant and (until is None or instant < until) and (revoked is None or instant < revoked)} | {"base"}
    active = {e.id for e in answer.entitlements if e.is_active}
    if active != expected:
        return "at %d with writes up to %d: active %s, expected %s" % (instant, sequence, sorted(active), sorted(expected))
    missed = oldest_missed(obs, writes, owner)
    if missed is not None and missed["acked"] < obs["before"] - lag:
        return "answer at %d asked %d ms after write %d was acknowledged" % (sequence, obs["before"] - missed["acked"], missed["sequence"])
    return None


def judge_self_check():
    """The judge itself, on made-up answers: a revoked grant counts before its revokedDate."""
    answer = svc.CheckEntitlementsResponse(user_id="py-load-1", customer_id="py-load-1", request_date=1000, log_sequence=3)
    answer.entitlements.add(id="base", is_active=True)
    answer.entitlements.add(id="p1", is_active=True)
    writes = [dict(user="py-load-1", kind="grant", sequence=1, acked=0, names={"py-load-1"}, grant="base", **{"from": 0, "until": None}),
              dict(user="py-load-1", kind="grant", sequence=2, acked=0, names={"py-load-1"}, grant="p1", **{"from": 900, "until": None}),
              dict(user="py-load-1", kind="revoke", sequence=3, acked=0, names={"py-load-1"}, grant="p1", at=1002)]
    obs = {"user": "py-load-1", "before": 1000, "answer": answer}
    check(problem(obs, writes) is None, "the judge: a grant revoked from 1002 is active at 1000")
    answer.request_date = 1002
    check(problem(obs, writes) is not None, "the judge: and not at 1002")


def oldest_missed(obs, writes, owner):
    names = {obs["user"], owner or obs["user"]}
    for w in writes:
        if w["sequence"] > obs["answer"].log_sequence and names & w["names"]:
            return w
    return None


class Server:
    def __init__(self, binary, work):
        self.binary, self.work = binary, work
        self.port, self.grpc_port = free_port(), free_port()
        self.process = None

    def start(self):
        log = self.work + "/serve.log"
        self.process = subprocess.Popen(
            [self.binary, "serve", "--data-dir", self.work + "/data", "--snapshot", self.work + "/seed.snap",
             "--listen", "127.0.0.1:%d" % self.port, "--grpc-listen", "127.0.0.1:%d" % self.grpc_port],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        for _ in range(300):
            if re.search(r"^grpc listening on", open(log).read(), re.M):
                return
            time.sleep(0.05)
        raise SystemExit("serve did not start: " + open(log).read())

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


class FreezingProxy:
    """A loopback TCP proxy that can go silent: frozen, it drops every byte either way and
    closes nothing, as a partition or a hung server looks to a client."""

    def __init__(self, target_port):
        self.frozen = False
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.target_port = target_port
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return
            outbound = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [inbound, outbound]
            for source, sink in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source, sink):
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if not self.frozen:
                    sink.sendall(data)
        except OSError:
            pass
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
        self.listener.close()
        for s in self.sockets:
            s.close()


def not_before_kept(cache):
    """Rule 1's other end: a kept answer is not served for an instant before it arrived.
    Under load, one thread reads the clock, then another keeps an answer that includes a
    grant starting after that instant: served at the first thread's instant, it would say
    the grant was active before it began."""
    user = "py-load-0"
    cache.check(user)
    hits = cache.hits
    cache.check(user)
    check(cache.hits == hits + 1, "a kept answer is served")
    kept_at = cache.kept[user][1]
    real = reference.now_ms
    reference.now_ms = lambda: kept_at - 1      # the clock as the other thread read it
    try:
        answer = cache.check(user)
    finally:
        reference.now_ms = real
    check(cache.hits == hits + 1 and answer.request_date >= kept_at,
          "a kept answer is not served for an instant before it was kept (asked at %d, kept at %d: %s)"
          % (kept_at - 1, kept_at, "went to the server" if cache.hits == hits + 1 else "served"))


def silent_connection(server, writer_stub):
    """Rule 6: a watch whose connection goes silent is lost, and nothing kept is served."""
    proxy = FreezingProxy(server.grpc_port)
    channel = grpc.insecure_channel("127.0.0.1:%d" % proxy.port)
    cache = NearCache(service_pb2_grpc.EntitlementServiceStub(channel), liveness=0.5)
    user = "py-silent"
    cache.check(user)
    deadline = time.time() + 5
    while not cache.live and time.time() < deadline:
        time.sleep(0.01)
    cache.check(user)
    check(cache.live and cache.hits == 1, "a kept answer is served while the channel answers")
    proxy.frozen = True
    writer_stub.GrantEntitlement(svc.GrantEntitlementRequest(
        user_id=user, grant=types.Grant(grant_id="py-silent", entitlement_id="beta")), timeout=5)
    deadline = time.time() + 5
    while cache.live and time.time() < deadline:
        time.sleep(0.01)
    check(not cache.live, "a watch whose connection is silent is lost (rule 6: a Health call on its channel fails)")
    try:
        answer = cache.check(user, timeout=0.3)
        check(False, "the kept answer is not served once the watch is lost: got %r" % answer)
    except grpc.RpcError:
        check(cache.hits == 1, "the kept answer is not served once the watch is lost")
    cache.close()
    channel.close()
    proxy.close()


def main():
    binary = os.path.abspath(sys.argv[1])
    judge_self_check()
    work = tempfile.mkdtemp(prefix="nearcache-test-")
    subprocess.run([binary, "snapshot", "generate", "--customers", "10", "--seed", "1", "--output", work + "/seed.snap"], check=True, capture_output=True)
    server = Server(binary, work)
    server.start()
    try:
        channel = grpc.insecure_channel("127.0.0.1:%d" % server.grpc_port)
        stub = service_pb2_grpc.EntitlementServiceStub(channel)
        cache = NearCache(stub)
        # Enough customers that each is written about every half second or less often: an
        # event missed leaves a kept answer wrong for longer than the lag allowed.
        users = ["py-load-%d" % i for i in range(48)]
        writes = []

        def wrote(user, kind, response, names=None, **fields):
            writes.append(dict(user=user, kind=kind, sequence=response.log_sequence, acked=now_ms(), names=names or {user}, **fields))

        # An unknown user is kept as unknown, then linked: never answered as unknown again
        # once the event has come.
        check(not cache.check(ALIAS).HasField("customer_id"), "an unknown user is answered and kept")
        for user in users:
            base = types.Grant(grant_id="base", entitlement_id="base", granted_date=now_ms() - 1000)
            response = stub.GrantEntitlement(svc.GrantEntitlementRequest(user_id=user, grant=base), timeout=5)
            wrote(user, "grant", response, grant="base", **{"from": base.granted_date, "until": None})
        response = stub.LinkAlias(svc.LinkAliasRequest(user_id=users[0], alias=ALIAS), timeout=5)
        wrote(users[0], "move", response, names={users[0], ALIAS}, alias=ALIAS)
        deadline = time.time() + 5
        while cache.check(ALIAS).customer_id != users[0] and time.time() < deadline:
            time.sleep(0.005)
        check(cache.check(ALIAS).customer_id == users[0], "an alias linked by a write is answered as its customer")
        check(cache.live, "the reference's watch connects")
        not_before_kept(cache)

        done = threading.Event()
        observations, failures, lock = [], [0], threading.Lock()

        def writer():
            live, counter, owner = {}, 0, users[0]
            start = now_ms()
            try:
                while now_ms() < start + 30_000 and (counter < 150 or now_ms() < start + 3000):
                    if counter in (50, 100):
                        server.stop()               # every watch and connection drops
                        server.start()
                        while True:                 # a connection again before writing
                            try:
                                stub.CheckEntitlements(svc.CheckEntitlementsRequest(user_id="probe"), timeout=1)
                                break
                            except grpc.RpcError:
                                time.sleep(0.01)
                        # An id the near-cache keeps as unknown as its new watch starts, then
                        # linked to a customer at once.
                        alias = "py-fresh-%d" % counter
                        try:
                            cache.check(alias, timeout=2)
                        except grpc.RpcError:
                            pass
                        user = random.choice(users)
                        response = stub.LinkAlias(svc.LinkAliasRequest(user_id=user, alias=alias), timeout=5)
                        wrote(user, "move", response, names={user, alias}, alias=alias)
                    counter += 1
                    user = random.choice(users)
                    sent = now_ms()
                    roll = random.randrange(10)
                    if roll == 0 and user != owner:
                        response = stub.LinkAlias(svc.LinkAliasRequest(user_id=user, alias=ALIAS, transfer=True), timeout=5)
                        wrote(user, "move", response, names={user, owner, ALIAS}, alias=ALIAS)
                        owner = user
                    elif roll < 5 and live.get(user):
                        grant = random.choice(live[user])
                        response = stub.RevokeGrant(svc.RevokeGrantRequest(user_id=user, grant_id=grant, revoked_date=sent), timeout=5)
                        live[user].remove(grant)
                        wrote(user, "revoke", response, grant=grant, at=sent)
                    else:
                        grant = "p%d" % counter
                        until = sent + random.randint(30, 400) if random.random() < 0.5 else None
                        g = types.Grant(grant_id=grant, entitlement_id=grant, granted_date=sent)
                        if until:
                            g.expiration_date = until
                        response = stub.GrantEntitlement(svc.GrantEntitlementRequest(user_id=user, grant=g), timeout=5)
                        live.setdefault(user, []).append(grant)
                        wrote(user, "grant", response, grant=grant, **{"from": sent, "until": until})
                    time.sleep(random.uniform(0.001, 0.008))
            finally:
                time.sleep(0.3)
                done.set()

        def checker():
            seen, failed = [], 0
            while not done.is_set():
                user = random.choice(users + [ALIAS, "py-fresh-50", "py-fresh-100"])
                before = now_ms()
                try:
                    seen.append({"user": user, "before": before, "answer": cache.check(user, timeout=2)})
                except grpc.RpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                    failed += 1                     # the server restarting, or this machine slow
                time.sleep(0.0002)  # leave the writer its share of the interpreter
            with lock:
                observations.extend(seen)
                failures[0] += failed

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=checker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wrong = [(o["user"], p) for o in observations for p in [problem(o, writes)] if p]
        print("nearcache (Python reference) under load: %d writes, 2 restarts, %d checks (%d unavailable while restarting or timed out), "
              "%d hits, %d invalidations, %d watches, %d wrong (lag allowed %d ms)"
              % (len(writes), len(observations), failures[0], cache.hits, cache.invalidations, cache.watches, len(wrong), LAG_MS))
        check(not wrong, "every answer is exact at its log_sequence and within %d ms of the writes after it: %r" % (LAG_MS, wrong[:3]))
        check(cache.hits > 0 and cache.watches >= 3 and len(writes) > 100, "the cache answered checks itself while writes and restarts went on")

        silent_connection(server, stub)

        # The server gone: nothing is served (the reference has no stale-if-error).
        server.stop()
        deadline = time.time() + 5
        while cache.live and time.time() < deadline:
            time.sleep(0.01)
        check(not cache.live, "the watch is lost when the server goes")
        try:
            cache.check(users[1], timeout=1)
            check(False, "nothing is served while the server is away")
        except grpc.RpcError:
            check(True, "nothing is served while the server is away")
        cache.close()
        channel.close()
    finally:
        server.stop()
    if FAILURES:
        print("nearcache: %d failed" % len(FAILURES))
        sys.exit(1)
    print("nearcache: all passed")


if __name__ == "__main__":
    main()
