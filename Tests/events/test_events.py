"""Outbound events end to end (docs/events.md): the real `entitlements serve` with a data
directory POSTs signed events to receiver.py, a real HTTP receiver that verifies every
signature. Writes come through the gRPC door (grpcio) and Stripe's webhook (signed as
Stripe signs).

Covers: every event type from the write calls and from a store's webhook; a time-driven
expiry within a second of its time; a receiver that fails for a while, then everything in
order per customer; kill -9 of the server between a write and its delivery, and during a
delivery (the same id again); two destinations with different filters; a secret being
rolled; 410 Gone; `entitlements events list` and `redeliver`; the metrics.

Usage: python3 Tests/events/test_events.py path/to/entitlements
Talks to loopback only; stops the servers it started, by pid."""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "storeharness"))
sys.path.insert(0, os.path.join(HERE, "..", "doors"))
import grpc  # noqa: E402
from harness import FAILURES, Postgres, admin_metric, check, post, start_serve  # noqa: E402
from receiver import Receiver  # noqa: E402
from stubs import service_pb2_grpc, svc, types  # noqa: E402

ENT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".build/debug/entitlements")
WORK = tempfile.mkdtemp(prefix="events-")
DAY = 86_400_000
SECRETS = ["evt-secret-old-0123456789abcdef", "evt-secret-new-fedcba9876543210"]
STRIPE_SECRET = "whsec_events_test"

with open(os.path.join(WORK, "catalog.json"), "w") as f:
    json.dump({"products": [
        {"id": "monthly", "type": "subscription", "period": "monthly", "entitlements": ["premium"]},
        {"id": "annual", "type": "subscription", "period": "annual", "entitlements": ["premium"]},
        {"id": "lifetime", "type": "nonConsumable", "entitlements": ["lifetime"]},
        {"id": "price_monthly", "type": "subscription", "period": "monthly", "entitlements": ["premium"]},
    ]}, f)
open(os.path.join(WORK, "customers.jsonl"), "w").close()
subprocess.run([ENT, "snapshot", "build", "--catalog", os.path.join(WORK, "catalog.json"), "--customers", os.path.join(WORK, "customers.jsonl"),
                "--output", os.path.join(WORK, "seed.snap")], check=True, capture_output=True)
with open(os.path.join(WORK, "secrets"), "w") as f:
    f.write("# rolled: both sign every event\n" + "\n".join(SECRETS) + "\n")
with open(os.path.join(WORK, "stripe"), "w") as f:
    f.write(STRIPE_SECRET + "\n")

SERVERS = []


def now_ms():
    return int(time.time() * 1000)


class Server:
    """`entitlements serve` on DATA with the event destinations of `events` (flags)."""

    def __init__(self, data, events):
        SERVERS.append(self)
        self.log = open(os.path.join(WORK, "serve-%s.log" % time.time()), "w+")
        args = [ENT, "serve", "--data-dir", os.path.join(WORK, data), "--snapshot", os.path.join(WORK, "seed.snap"), "--listen", "127.0.0.1:0",
                "--grpc-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--webhooks-listen", "127.0.0.1:0",
                "--stripe-webhook-secret-file", os.path.join(WORK, "stripe"), *events]
        self.process, _, ports = start_serve(args, self.log, ["webhooks listening on", "grpc listening on"])
        self.grpc, self.admin, self.webhooks = ports["grpc "], ports["admin "], ports["webhooks "]
        self.channel = grpc.insecure_channel("127.0.0.1:%d" % self.grpc)
        self.stub = service_pb2_grpc.EntitlementServiceStub(self.channel)

    def output(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig=signal.SIGTERM):
        self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)

    def cli(self, *args, token=None):
        extra = ["--token-file", token] if token else []
        return subprocess.run([ENT, "events", *args, "--admin", "127.0.0.1:%d" % self.admin, *extra], capture_output=True, text=True, timeout=30)

    # The write calls, through the gRPC door.
    def transaction(self, user, tid, chain, product="monthly", at=None, expires=None, kind=types.TRANSACTION_TYPE_SUBSCRIPTION_STARTED,
                    revoked=None, environment=types.ENVIRONMENT_PRODUCTION):
        at = at or now_ms() - 1000
        t = types.Transaction(original_transaction_id=chain, transaction_id=tid, store=types.SOURCE_APPSTORE, product_id=product,
                              transaction_date=at, environment=environment, ownership_type=types.OWNERSHIP_TYPE_OWNER, type=kind)
        if expires is not None:
            t.expiration_date = expires
        if revoked is not None:
            t.revocation_date = revoked
        return self.stub.RecordTransaction(svc.RecordTransactionRequest(user_id=user, transaction=t), timeout=10)

    def subscription(self, user, chain, renews, billing_retry=False):
        state = types.SubscriptionState(store=types.SOURCE_APPSTORE, original_transaction_id=chain, auto_renew_enabled=renews,
                                        is_in_billing_retry=billing_retry)
        if not renews:
            state.auto_renew_disabled_date = now_ms()
        return self.stub.UpdateSubscriptionState(svc.UpdateSubscriptionStateRequest(user_id=user, state=state), timeout=10)

    def grant(self, user, grant_id, entitlement="pro", expires=None):
        g = types.Grant(grant_id=grant_id, entitlement_id=entitlement, granted_date=now_ms() - 1000)
        if expires is not None:
            g.expiration_date = expires
        return self.stub.GrantEntitlement(svc.GrantEntitlementRequest(user_id=user, grant=g), timeout=10)


def types_of(events):
    return [e["type"] for e in events]


def in_log_order(events):
    """Whether each customer's events first arrived in log order (time events by their
    instant); an event that comes again (the same id, after a crash) is not counted again."""
    last = {}
    seen = set()
    for e in events:
        if e["id"] in seen:
            continue
        seen.add(e["id"])
        key = (e["logSequence"], e["occurredAt"], e["id"])
        if e["customerId"] in last and key < last[e["customerId"]]:
            return False
        last[e["customerId"]] = key
    return True


def stripe(server, event):
    body = json.dumps(event).encode()
    t = int(time.time())
    import hashlib
    import hmac
    signature = hmac.new(STRIPE_SECRET.encode(), str(t).encode() + b"." + body, hashlib.sha256).hexdigest()
    return post(server.webhooks, "/webhooks/stripe", body, {"Stripe-Signature": "t=%d,v1=%s" % (t, signature)})


def stripe_event(eid, kind, obj):
    return {"id": eid, "object": "event", "type": kind, "created": int(time.time()), "livemode": True, "api_version": "2024-06-20",
            "data": {"object": obj}}


def test_every_type(receiver):
    """Every event type from the write calls, and from Stripe's webhook; all signed by both
    secrets (each receiver path knows one), ids unique, each customer's in log order."""
    server = Server("every", ["--event-webhook", receiver.url("/old"), "--event-webhook-secret-file", os.path.join(WORK, "secrets")])
    now = now_ms()
    server.transaction("ann", "a1", "chain-a", kind=types.TRANSACTION_TYPE_TRIAL_STARTED, at=now - 2 * DAY, expires=now + 5 * DAY)
    server.transaction("ann", "a2", "chain-a", kind=types.TRANSACTION_TYPE_SUBSCRIPTION_RENEWED, at=now - DAY, expires=now + 30 * DAY)
    server.transaction("ann", "a3", "chain-a", kind=types.TRANSACTION_TYPE_SUBSCRIPTION_RENEWED, at=now - 1000, expires=now + 31 * DAY)
    server.transaction("ann", "a4", "chain-a", product="annual", kind=types.TRANSACTION_TYPE_SUBSCRIPTION_RENEWED, at=now - 500, expires=now + 365 * DAY)
    server.subscription("ann", "chain-a", renews=False)
    server.subscription("ann", "chain-a", renews=True)
    server.subscription("ann", "chain-a", renews=True, billing_retry=True)
    server.transaction("bob", "b1", "chain-b", product="lifetime", kind=types.TRANSACTION_TYPE_NON_CONSUMABLE_PURCHASE, at=now - 1000)
    server.transaction("bob", "b1", "chain-b", product="lifetime", kind=types.TRANSACTION_TYPE_NON_CONSUMABLE_PURCHASE, at=now - 1000, revoked=now_ms())
    server.stub.RecordTransaction(svc.RecordTransactionRequest(user_id="bob", transaction=types.Transaction(
        original_transaction_id="chain-b", transaction_id="b1", store=types.SOURCE_APPSTORE, product_id="lifetime", transaction_date=now - 1000,
        environment=types.ENVIRONMENT_PRODUCTION, ownership_type=types.OWNERSHIP_TYPE_OWNER, type=types.TRANSACTION_TYPE_NON_CONSUMABLE_PURCHASE)),
        timeout=10)  # the refund reversed
    server.grant("cyd", "g1")
    server.stub.RevokeGrant(svc.RevokeGrantRequest(user_id="cyd", grant_id="g1", revoked_date=now_ms()), timeout=10)
    server.stub.LinkAlias(svc.LinkAliasRequest(user_id="cyd", alias="cyd-device"), timeout=10)
    server.grant("dee", "g2")
    server.stub.LinkAlias(svc.LinkAliasRequest(user_id="dee", alias="cyd-device", transfer=True), timeout=10)
    server.stub.DeleteCustomer(svc.DeleteCustomerRequest(user_id="dee"), timeout=10)
    # A Stripe subscription, through the store's webhook.
    sub = {"id": "sub_e1", "object": "subscription", "customer": "cus_e1", "status": "active", "metadata": {"user_id": "eve"},
           "cancel_at_period_end": False, "cancel_at": None, "canceled_at": None, "ended_at": None, "cancellation_details": {"reason": None},
           "current_period_start": int(time.time()) - 60, "current_period_end": int(time.time()) + 30 * 86400,
           "items": {"data": [{"id": "si_1", "price": {"id": "price_monthly", "product": "prod_premium"}}]}}
    invoice = {"id": "in_e1", "object": "invoice", "customer": "cus_e1", "livemode": True, "billing_reason": "subscription_create",
               "amount_paid": 999, "currency": "usd", "subscription": "sub_e1", "subscription_details": {"metadata": {"user_id": "eve"}},
               "lines": {"data": [{"id": "il_1", "type": "subscription", "amount": 999,
                                   "period": {"start": int(time.time()) - 60, "end": int(time.time()) + 30 * 86400},
                                   "price": {"id": "price_monthly", "product": "prod_premium"}}]}}
    for event in (stripe_event("evt_s1", "customer.subscription.created", sub), stripe_event("evt_i1", "invoice.paid", invoice),
                  stripe_event("evt_s2", "customer.subscription.updated", dict(sub, cancel_at_period_end=True, canceled_at=int(time.time()),
                                                                                cancellation_details={"reason": "cancellation_requested"}))):
        status, answer = stripe(server, event)
        check(status == 200, "stripe %s accepted (%s %s)" % (event["type"], status, answer))

    wanted = {"TRIAL_STARTED", "TRIAL_CONVERTED", "RENEWAL", "PRODUCT_CHANGE", "CANCELLATION", "UNCANCELLATION", "BILLING_ISSUE",
              "INITIAL_PURCHASE", "REFUND", "REFUND_REVERSED", "GRANT", "GRANT_REVOKED", "TRANSFER", "CUSTOMER_DELETED",
              "ENTITLEMENT_ACTIVATED", "ENTITLEMENT_DEACTIVATED"}
    # Customers' events are delivered side by side (one at a time per customer): every
    # type having arrived says nothing of each customer's last one, so those are waited for.
    got = receiver.wait(lambda r: wanted <= set(types_of(r.events("/old"))) and
                        {"INITIAL_PURCHASE", "CANCELLATION"} <= {e["type"] for e in r.events("/old", "eve")} and
                        len(r.events("/old", "bob")) >= 6 and
                        len([e for e in r.events("/old", "cyd") if e["type"] == "TRANSFER"]) >= 2 and
                        "CUSTOMER_DELETED" in types_of(r.events("/old", "dee")))
    events = receiver.events("/old")
    check(got, "every write type arrived: missing %s" % sorted(wanted - set(types_of(events))))
    check(not receiver.rejected, "every signature verified (%d rejected)" % len(receiver.rejected))
    check(len({e["id"] for e in events}) == len(events), "ids are unique")
    check(in_log_order(events), "each customer's events arrived in log order")
    ann = types_of(receiver.events("/old", "ann"))
    check(ann[:2] == ["TRIAL_STARTED", "ENTITLEMENT_ACTIVATED"], "ann: a trial, then premium on: %s" % ann)
    check(ann[2:6] == ["TRIAL_CONVERTED", "RENEWAL", "PRODUCT_CHANGE", "CANCELLATION"], "ann: converted, renewed, changed product, cancelled: %s" % ann)
    bob = types_of(receiver.events("/old", "bob"))
    check(bob == ["INITIAL_PURCHASE", "ENTITLEMENT_ACTIVATED", "REFUND", "ENTITLEMENT_DEACTIVATED", "REFUND_REVERSED", "ENTITLEMENT_ACTIVATED"],
          "bob: purchase, refund, reversal with the entitlement following: %s" % bob)
    dee = receiver.events("/old", "dee")
    check([e["type"] for e in dee][-2:] == ["CUSTOMER_DELETED", "ENTITLEMENT_DEACTIVATED"] or "CUSTOMER_DELETED" in types_of(dee),
          "dee: deleted: %s" % types_of(dee))
    transfer = [e for e in receiver.events("/old", "cyd") if e["type"] == "TRANSFER"]
    check(len(transfer) == 2 and all(e["aliases"] == ["cyd-device"] for e in transfer), "cyd: the alias linked, then moved away: %s" % transfer)
    eve = receiver.events("/old", "eve")
    first = next((e for e in eve if e["type"] == "INITIAL_PURCHASE"), None)
    check(first is not None and first["store"] == "stripe" and first["environment"] == "production" and first["productId"] == "price_monthly",
          "eve: Stripe's payment is an INITIAL_PURCHASE of price_monthly in production: %s" % first)
    activated = next((e for e in eve if e["type"] == "ENTITLEMENT_ACTIVATED"), None)
    check(activated is not None and activated["entitlementsAfter"]["premium"]["isActive"] and not activated["entitlementsBefore"],
          "eve: the entitlements before and after, as check --json shows them")
    check(admin_metric(server.admin, "entitlements_events_delivered_total") >= len(events), "delivered_total counts them")
    server.stop()


def test_time_expiry(receiver):
    """A grant ending in 2 s, and a subscription: their deactivation and expiry arrive within
    a second of their time, with no write."""
    server = Server("time", ["--event-webhook", receiver.url("/time"), "--event-webhook-secret-file", os.path.join(WORK, "secrets")])
    ends = now_ms() + 2000
    server.grant("fay", "short", expires=ends)
    server.transaction("gus", "t1", "chain-g", at=now_ms() - DAY, expires=ends + 500)
    got = receiver.wait(lambda r: "ENTITLEMENT_DEACTIVATED" in types_of(r.events("/time", "fay")) and types_of(r.events("/time", "gus"))[-1:] == ["ENTITLEMENT_DEACTIVATED"], 10)
    check(got, "the time events arrived")
    for user, end in (("fay", ends), ("gus", ends + 500)):
        with receiver.lock:
            arrivals = [r for r in receiver.received if r["path"] == "/time" and r["event"]["customerId"] == user
                        and r["event"]["type"] in ("ENTITLEMENT_DEACTIVATED", "EXPIRATION")]
        late = [r["at"] * 1000 - end for r in arrivals]
        check(arrivals and all(r["event"]["occurredAt"] == time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(end / 1000)) + ".%03dZ" % (end % 1000)
                               for r in arrivals), "%s: occurredAt is the instant it ended" % user)
        check(arrivals and all(0 <= x < 1000 for x in late), "%s: arrived within a second of its time (%s ms late)" % (user, [int(x) for x in late]))
    gus = types_of(receiver.events("/time", "gus"))
    check(gus[-2:] == ["EXPIRATION", "ENTITLEMENT_DEACTIVATED"], "gus: EXPIRATION then ENTITLEMENT_DEACTIVATED: %s" % gus)
    server.stop()


def test_outage_and_order(receiver):
    """The receiver answers 500 for a while: the events are retried, listed as failed, and
    once it is back every event arrives, each customer's in log order."""
    receiver.mode["/flaky"] = "fail"
    server = Server("flaky", ["--event-webhook", receiver.url("/flaky"), "--event-webhook-secret-file", os.path.join(WORK, "secrets")])
    for n in range(3):
        server.grant("hal", "h%d" % n, entitlement="e%d" % n)
        server.grant("ivy", "i%d" % n, entitlement="e%d" % n)
    failed, deadline = [], time.time() + 15  # each customer's first event tried and failed
    while time.time() < deadline:
        listed = server.cli("list", "--failed", "--json")
        failed = json.loads(listed.stdout)["events"] if listed.returncode == 0 else []
        if len({e["customerId"] for e in failed}) == 2:
            break
        time.sleep(0.25)
    check(failed and all(d["status"] == "retrying" and d["lastResult"] == "HTTP 500" for e in failed for d in e["deliveries"]),
          "events list --failed shows them retrying after HTTP 500 (%s)" % listed.stdout.strip()[:200])
    check(len({e["customerId"] for e in failed}) == 2 and len(failed) == 2, "one event per customer is tried at a time: %s" % [e["id"] for e in failed])
    check(admin_metric(server.admin, "entitlements_events_retried_total") >= 2, "retried_total counts the failures")
    receiver.mode["/flaky"] = "ok"
    got = receiver.wait(lambda r: len(r.events("/flaky")) == 12, 20)
    check(got, "all 12 events arrived once the receiver was back (%d)" % len(receiver.events("/flaky")))
    check(in_log_order(receiver.events("/flaky")), "in log order per customer")
    check(server.cli("list", "--failed").stdout.strip().endswith("no failed events"), "nothing is listed as failed any more")
    server.stop()


def test_kill_between_write_and_delivery(receiver):
    """kill -9 after a write was acknowledged but before its event was delivered, then
    during a delivery: after the restart each event arrives, with the same id."""
    receiver.mode["/crash"] = "fail"
    args = ["--event-webhook", receiver.url("/crash"), "--event-webhook-secret-file", os.path.join(WORK, "secrets")]
    server = Server("crash", args)
    written = server.grant("jon", "j1")
    server.stop(signal.SIGKILL)
    receiver.mode["/crash"] = "ok"
    server = Server("crash", args)
    got = receiver.wait(lambda r: {"evt_%d_0" % written.log_sequence, "evt_%d_1" % written.log_sequence} <= {e["id"] for e in r.events("/crash")}, 15)
    check(got, "killed before delivery: both events of write %d arrived after the restart" % written.log_sequence)
    # During a delivery: the receiver holds the POST, the server dies mid-request.
    receiver.mode["/crash"] = "hang"
    written = server.grant("kim", "k1")
    check(receiver.wait(lambda r: r.hanging > 0, 10), "the receiver holds a delivery")
    server.stop(signal.SIGKILL)
    receiver.mode["/crash"] = "ok"
    receiver.release.set()
    server = Server("crash", args)
    ids = {"evt_%d_0" % written.log_sequence, "evt_%d_1" % written.log_sequence}
    got = receiver.wait(lambda r: ids <= {e["id"] for e in r.events("/crash")}, 15)
    check(got, "killed during a delivery: the event came again with the same id after the restart")
    receiver.release.clear()
    server.stop()


def test_filters_gone_and_redeliver(receiver):
    """Two destinations from the config file with different filters; a destination that
    answers 410 is disabled and says so; redeliver sends an event again."""
    config = os.path.join(WORK, "events.json")
    with open(config, "w") as f:
        json.dump({"event-webhooks": [
            {"name": "grants", "url": receiver.url("/grants"), "secret-file": os.path.join(WORK, "secrets"), "types": ["GRANT", "GRANT_REVOKED"]},
            {"name": "sandbox", "url": receiver.url("/sandbox"), "secret-file": os.path.join(WORK, "secrets"), "environment": "sandbox"},
            {"name": "gone", "url": receiver.url("/gone"), "secret-file": os.path.join(WORK, "secrets"), "types": ["GRANT"]},
        ]}, f)
    receiver.mode["/gone"] = "gone"
    tokens = os.path.join(WORK, "tokens")
    with open(tokens, "w") as f:
        f.write("operator-token-0123456789 check,write\nreader-token-0123456789 check\n")
    for name in ("operator", "reader"):
        with open(os.path.join(WORK, name), "w") as f:
            f.write("%s-token-0123456789\n" % name)
    # Tokens guard the admin listener; the writes of this test stay anonymous on loopback.
    server = Server("filters", ["--config", config, "--auth-token-file", tokens, "--listen-anonymous", "check,write", "--grpc-anonymous", "check,write"])
    server.grant("lea", "l1")
    server.transaction("lea", "s1", "chain-l", environment=types.ENVIRONMENT_SANDBOX, expires=now_ms() + DAY)
    server.transaction("lea", "p1", "chain-p", expires=now_ms() + DAY)
    got = receiver.wait(lambda r: len(r.events("/grants")) >= 1 and len(r.events("/sandbox")) >= 3, 10)
    check(got, "both filtered destinations got their events")
    check(types_of(receiver.events("/grants")) == ["GRANT"], "grants: only GRANT (%s)" % types_of(receiver.events("/grants")))
    sandbox = receiver.events("/sandbox")
    check(all(e["environment"] in ("sandbox", None) for e in sandbox) and any(e["environment"] == "sandbox" for e in sandbox),
          "sandbox: only sandbox events and those of no environment: %s" % [(e["type"], e["environment"]) for e in sandbox])
    check(receiver.wait(lambda r: "disabled" in server.output() and "410" in server.output(), 10), "a 410 disables the destination, loudly")
    listed = server.cli("list")
    check("DISABLED" in listed.stdout, "events list says the destination is disabled")
    event_id = receiver.events("/grants")[0]["id"]
    refused = server.cli("redeliver", "--id", event_id, token=os.path.join(WORK, "reader"))
    check(refused.returncode != 0 and "needs the write permission" in refused.stdout, "redeliver needs a write token: %s" % refused.stdout.strip()[:160])
    done = server.cli("redeliver", "--id", event_id, token=os.path.join(WORK, "operator"))
    check(done.returncode == 0 and receiver.wait(lambda r: [e["id"] for e in r.events("/grants")].count(event_id) == 2, 10),
          "redeliver --id sends the event again, same id (%s)" % done.stdout.strip())
    missing = server.cli("redeliver", "--id", "evt_999_0", token=os.path.join(WORK, "operator"))
    check(missing.returncode != 0 and "no event evt_999_0" in missing.stdout, "redeliver of an unknown id says so: %s" % missing.stdout.strip())
    server.stop()


def holder(server):
    return "this server delivers the fleet's events" in server.output()


def test_fleet(receiver):
    """Three sidecars on a real PostgreSQL: each event is delivered by the lease's holder
    only. The holder is killed (kill -9) while the receiver holds one of its deliveries:
    another takes the lease within the documented time and delivers everything; an event
    comes twice only if the killed holder had sent it (in flight, or its outcome not yet
    recorded in PostgreSQL), and then with the same id."""
    postgres = Postgres()
    try:
        subprocess.run([ENT, "db", "migrate", "--postgres", postgres.url], check=True, capture_output=True)
        subprocess.run([ENT, "db", "import", "--postgres", postgres.url, "--snapshot", os.path.join(WORK, "seed.snap")], check=True, capture_output=True)
        args = ["--postgres", postgres.url, "--fleet-poll-interval", "50ms",
                "--event-webhook", receiver.url("/fleet"), "--event-webhook-secret-file", os.path.join(WORK, "secrets")]
        sidecars = [Server("fleet-%d" % n, args) for n in range(3)]
        check(receiver.wait(lambda r: sum(holder(s) for s in sidecars) == 1, 15), "exactly one sidecar takes the lease")
        for n in range(10):
            sidecars[n % 3].grant("fleet-user-%d" % (n % 4), "f%d" % n, entitlement="fe%d" % n)
        check(receiver.wait(lambda r: len(r.events("/fleet")) == 20, 15), "10 writes through three sidecars: 20 events (%d)" % len(receiver.events("/fleet")))
        ids = [e["id"] for e in receiver.events("/fleet")]
        check(len(set(ids)) == len(ids), "each delivered once, by one sidecar, while none failed")
        check(in_log_order(receiver.events("/fleet")), "in log order per customer")
        leader = next(s for s in sidecars if holder(s))
        others = [s for s in sidecars if s is not leader]
        # The holder is killed while the receiver holds a delivery.
        receiver.mode["/fleet"] = "hang"
        written = others[0].grant("fleet-user-9", "f-kill", entitlement="fk")
        check(receiver.wait(lambda r: r.hanging > 0, 10), "the holder is delivering (the receiver holds it)")
        for n in range(4):
            others[n % 2].grant("fleet-user-%d" % n, "g%d" % n, entitlement="fg%d" % n)
        killed_at = time.time()
        leader.stop(signal.SIGKILL)
        dead_at = time.time()
        receiver.mode["/fleet"] = "ok"
        receiver.release.set()
        expected = 20 + 2 + 8
        got = receiver.wait(lambda r: len({e["id"] for e in r.events("/fleet")}) == expected, 30)
        took = time.time() - killed_at
        check(got, "after the kill every event arrived (%d of %d distinct)" % (len({e["id"] for e in receiver.events("/fleet")}), expected))
        check(took < 15, "another sidecar took over within 15 s (%.1f s; the lease lasts 10 s)" % took)
        check(sum(holder(s) for s in others) >= 1, "a surviving sidecar says it delivers now")
        with receiver.lock:
            arrivals = [(r["event"]["id"], r["at"]) for r in receiver.received if r["path"] == "/fleet"]
        ids = [i for i, _ in arrivals]
        repeated = {i for i in ids if ids.count(i) > 1}
        first = {i: min(at for j, at in arrivals if j == i) for i in repeated}
        # In flight at the kill: held by the receiver, taken in after it.
        held = {i for path, i in receiver.held_ids if path == "/fleet"}
        check(all(first[i] <= dead_at or i in held for i in repeated),
              "an event came twice only if the killed holder had sent it (its outcome not yet recorded), with the same id: %s" % sorted(repeated))
        check(in_log_order(receiver.events("/fleet")), "in log order per customer across the takeover")
        receiver.release.clear()
        for sidecar in others:
            sidecar.stop()
    finally:
        postgres.remove()


def test_bad_settings():
    """Settings a person gets wrong are refused at start, saying what to fix."""
    cases = [
        (["--event-webhook", "http://127.0.0.1:9/x"], "needs --event-webhook-secret-file"),
        (["--event-webhook", "ftp://x", "--event-webhook-secret-file", os.path.join(WORK, "secrets")], "is not an http:// or https:// URL"),
        (["--event-webhook", "http://127.0.0.1:9/x", "--event-webhook-secret-file", os.path.join(WORK, "nope")], "--event-webhook-secret-file"),
    ]
    for extra, message in cases:
        result = subprocess.run([ENT, "serve", "--data-dir", os.path.join(WORK, "bad"), "--snapshot", os.path.join(WORK, "seed.snap"),
                                 "--listen", "127.0.0.1:0", *extra], capture_output=True, text=True, timeout=30)
        check(result.returncode != 0 and message in result.stdout + result.stderr, "refused: %s (%s)" % (message, (result.stdout + result.stderr).strip()[-200:]))
    result = subprocess.run([ENT, "serve", "--snapshot", os.path.join(WORK, "seed.snap"), "--listen", "127.0.0.1:0",
                             "--event-webhook", "http://127.0.0.1:9/x", "--event-webhook-secret-file", os.path.join(WORK, "secrets")],
                            capture_output=True, text=True, timeout=30)
    check(result.returncode != 0 and "needs --data-dir" in result.stdout + result.stderr, "refused without --data-dir")


def main():
    receiver = Receiver([SECRETS[0]])
    try:
        if os.environ.get("EVENTS_ONLY") == "fleet":  # for working on fleet mode alone
            test_fleet(receiver)
            return
        test_bad_settings()
        test_every_type(receiver)
        test_time_expiry(receiver)
        test_outage_and_order(receiver)
        test_kill_between_write_and_delivery(receiver)
        test_filters_gone_and_redeliver(receiver)
        test_fleet(receiver)
        other = Receiver([SECRETS[1]])
        server = Server("rolled", ["--event-webhook", other.url("/new"), "--event-webhook-secret-file", os.path.join(WORK, "secrets")])
        server.grant("max", "m1")
        check(other.wait(lambda r: len(r.events("/new")) == 2, 10) and not other.rejected, "a receiver that knows only the new secret verifies too")
        server.stop()
        other.stop()
    finally:
        for server in SERVERS:
            if server.process.poll() is None:
                server.process.kill()
                server.process.wait()
        receiver.stop()
    if FAILURES:
        print("%d failed; the servers' output is in %s" % (len(FAILURES), WORK))
        sys.exit(1)
    shutil.rmtree(WORK, ignore_errors=True)
    print("events: all passed")


if __name__ == "__main__":
    main()
