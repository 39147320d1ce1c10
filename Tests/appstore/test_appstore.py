"""The App Store Server API end to end (docs/ingestion.md, "The App Store Server API"): the
real `entitlements serve`, with a real data directory, against fake_apple.py, the loopback
stand-in for Apple built from its documents. The certificate chain (with Apple's OIDs) and
the in-app purchase key are made with openssl here; Apple's JWS are signed with them.

Covers: SubmitPurchase's first answer with the renewal state read from Apple (grace, auto-
renew off), submission and notification in either order, the store's record completing
what the app wrote, a backfill of 45 transactions over three pages (run twice), the
recheck recovering a missed renewal and a missed expiry, bad input of every kind, and
the same in fleet mode on a real PostgreSQL.

Usage: python3 Tests/appstore/test_appstore.py path/to/entitlements
Talks to loopback only; stops the servers it started, by pid."""
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

from cryptography.hazmat.primitives import serialization
from cryptography import x509

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "storeharness"))
sys.path.insert(0, os.path.join(HERE, "..", "doors"))
import grpc  # noqa: E402
from fake_apple import AppleSigner, FakeApple  # noqa: E402
from harness import FAILURES, Postgres, admin_metric, check, post  # noqa: E402
from stubs import service_pb2_grpc, svc  # noqa: E402  (the gRPC stubs, generated from proto/ now)

ENT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".build/debug/entitlements")
BUNDLE = "com.example.app"
MONTHLY = "com.example.premium.monthly"
LIFETIME = "com.example.lifetime"
COINS = "com.example.coins"
KEY_ID = "ABC123DEFG"
ISSUER = "57246542-96fe-1a63-e053-0824d011072a"
DAY = 86_400_000
MINUTE = 60_000
NOW = int(time.time() * 1000)
WORK = tempfile.mkdtemp(prefix="appstore-")


# MARK: Apple's chain and our API key, made with openssl

def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=WORK)


def make_chain():
    """Root, WWDR-like intermediate and leaf with Apple's OIDs, valid from 90 days ago
    (notifications signed in the past must verify at their signedDate): `openssl ca` is
    the openssl tool that sets a start date."""
    with open(os.path.join(WORK, "ca.cnf"), "w") as f:
        f.write("""[ca]
default_ca = test
[test]
dir = .
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = anything
copy_extensions = none
[anything]
commonName = supplied
[root]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign
[wwdr]
basicConstraints = critical,CA:TRUE,pathlen:0
keyUsage = critical,keyCertSign,cRLSign
1.2.840.113635.100.6.2.1 = ASN1:NULL
[leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature
1.2.840.113635.100.6.11.1 = ASN1:NULL
""")
    open(os.path.join(WORK, "index.txt"), "w").close()
    with open(os.path.join(WORK, "serial"), "w") as f:
        f.write("1000\n")
    start = time.strftime("%Y%m%d%H%M%SZ", time.gmtime(time.time() - 90 * 86400))
    end = time.strftime("%Y%m%d%H%M%SZ", time.gmtime(time.time() + 30 * 86400))
    for name, issuer, section in (("root", None, "root"), ("wwdr", "root", "wwdr"), ("leaf", "wwdr", "leaf")):
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name + ".key")
        openssl("req", "-new", "-key", name + ".key", "-out", name + ".csr", "-subj", "/CN=Test " + name)
        signing = ["-selfsign", "-keyfile", "root.key"] if issuer is None else ["-cert", issuer + ".pem", "-keyfile", issuer + ".key"]
        openssl("ca", "-batch", "-config", "ca.cnf", *signing, "-in", name + ".csr", "-out", name + ".pem", "-startdate", start, "-enddate", end,
                "-extensions", section, "-notext")
    ders = []
    for name in ("leaf", "wwdr", "root"):
        with open(os.path.join(WORK, name + ".pem"), "rb") as f:
            ders.append(x509.load_pem_x509_certificate(f.read()).public_bytes(serialization.Encoding.DER))
    with open(os.path.join(WORK, "leaf.key"), "rb") as f:
        leaf = serialization.load_pem_private_key(f.read(), None)
    return AppleSigner(leaf, ders)


signer = make_chain()
# The in-app purchase key, as App Store Connect issues it: an EC P-256 key in PKCS#8 PEM (.p8).
openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "SubscriptionKey.p8")
with open(os.path.join(WORK, "SubscriptionKey.p8"), "rb") as f:
    api_public = serialization.load_pem_private_key(f.read(), None).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
fake = FakeApple(signer, KEY_ID, ISSUER, api_public, BUNDLE)

with open(os.path.join(WORK, "catalog.json"), "w") as f:
    json.dump({"products": [
        {"id": MONTHLY, "type": "subscription", "period": "monthly", "entitlements": ["premium"]},
        {"id": LIFETIME, "type": "nonConsumable", "entitlements": ["lifetime"]},
    ]}, f)
open(os.path.join(WORK, "customers.jsonl"), "w").close()
subprocess.run([ENT, "snapshot", "build", "--catalog", os.path.join(WORK, "catalog.json"), "--customers", os.path.join(WORK, "customers.jsonl"),
                "--output", os.path.join(WORK, "seed.snap")], check=True, capture_output=True)


SERVERS = []


class Server:
    def __init__(self, data="data", extra=(), key_id=KEY_ID, recheck="1s"):
        SERVERS.append(self)
        self.log = open(os.path.join(WORK, "serve-%s.log" % time.time()), "w+")
        args = [ENT, "serve", "--data-dir", os.path.join(WORK, data), "--snapshot", os.path.join(WORK, "seed.snap"), "--listen", "127.0.0.1:0", *extra,
                "--grpc-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--webhooks-listen", "127.0.0.1:0",
                "--appstore-root-cert", os.path.join(WORK, "root.pem"), "--appstore-bundle-id", BUNDLE,
                "--appstore-api-key", os.path.join(WORK, "SubscriptionKey.p8"), "--appstore-key-id", key_id, "--appstore-issuer-id", ISSUER,
                "--appstore-api-url", fake.url, "--appstore-sandbox-api-url", fake.sandbox_url] + (["--appstore-recheck-interval", recheck] if recheck else [])
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(300):
            self.log.seek(0)
            text = self.log.read()
            if "webhooks listening on" in text and "grpc listening on" in text and "appstore recheck" in text:
                break
            if self.process.poll() is not None:
                raise SystemExit("serve exited:\n" + text)
            time.sleep(0.1)
        ports = dict(re.findall(r"^(grpc |admin |webhooks |)listening on 127\.0\.0\.1:(\d+)", text, re.M))
        self.tcp, self.grpc, self.admin, self.webhooks = int(ports[""]), int(ports["grpc "]), int(ports["admin "]), int(ports["webhooks "])
        self.said = text

    def stop(self, sig=signal.SIGTERM):
        self.process.send_signal(sig)
        self.process.wait(timeout=30)


# MARK: Apple's payloads

def transaction(tid, original, purchased, expires=None, product=MONTHLY, token=None, kind="Auto-Renewable Subscription", env="Production",
                price=9990, revoked=None):
    t = {"transactionId": str(tid), "originalTransactionId": str(original), "bundleId": BUNDLE, "productId": product, "purchaseDate": purchased,
         "originalPurchaseDate": purchased, "quantity": 1, "type": kind, "inAppOwnershipType": "PURCHASED", "environment": env,
         "transactionReason": "PURCHASE" if str(tid) == str(original) else "RENEWAL", "storefront": "USA", "currency": "USD", "price": price}
    if expires is not None:
        t["expiresDate"] = expires
    if token:
        t["appAccountToken"] = token
    if revoked:
        t["revocationDate"] = revoked
        t["revocationReason"] = 0
    return t


def renewal(renews=True, retrying=False, grace=None, intent=None):
    r = {"autoRenewProductId": MONTHLY, "productId": MONTHLY, "autoRenewStatus": 1 if renews else 0, "isInBillingRetryPeriod": retrying}
    if grace:
        r["gracePeriodExpiresDate"] = grace
    if intent:
        r["expirationIntent"] = intent
    return r


def signed(payload, at=None):
    return signer.sign(dict(payload, signedDate=at or int(time.time() * 1000)))


def notify(kind, t, r=None, at=None, subtype=None, to=None):
    at = at or int(time.time() * 1000)
    data = {"bundleId": BUNDLE, "environment": t.get("environment", "Production"), "signedTransactionInfo": signed(t, at)}
    if r is not None:
        data["signedRenewalInfo"] = signed(dict(r, originalTransactionId=t["originalTransactionId"], environment=t.get("environment", "Production")), at)
    global last_notification_uuid
    last_notification_uuid = str(uuid.uuid4())
    payload = {"notificationType": kind, "notificationUUID": last_notification_uuid, "data": data, "version": "2.0", "signedDate": at}
    if subtype:
        payload["subtype"] = subtype
    return post((to or server).webhooks, "/webhooks/appstore", {"signedPayload": signer.sign(payload)})


def history(user):
    """The customer's history through the JSON door (docs/PROTOCOL.md, "History")."""
    status, answer = post(server.grpc, "/entitlements.v1.EntitlementService/CustomerHistory", {"userId": user})
    assert status == 200, (status, answer)
    return answer["entries"]


def submit(user, jws=None, transaction_id=None, environment=None, on=None):
    purchase = {"signedTransaction": jws} if jws is not None else {"transactionId": transaction_id}
    body = {"userId": user, "appStore": purchase}
    if environment:
        body["environment"] = environment
    return post((on or server).grpc, "/entitlements.v1.EntitlementService/SubmitPurchase", body)


def check_user(user, on=None, at=None):
    status, answer = post((on or server).grpc, "/entitlements.v1.EntitlementService/CheckEntitlements", {"userId": user, "at": str(at or int(time.time() * 1000))})
    assert status == 200, (status, answer)
    return answer


def premium(user, **kwargs):
    return check_user(user, **kwargs).get("entitlements", {}).get("premium")


def metric(name, **labels):
    return admin_metric(server.admin, name, **labels)


def ent(*args):
    return subprocess.run([ENT, *args, "--server", "127.0.0.1:%d" % server.tcp], capture_output=True, text=True, timeout=60)


def iso(ms):
    """An instant as the JSON door writes it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + ".%03dZ" % (ms % 1000)


def shape(e):
    """An entitlement without the ids that differ between two customers."""
    if not e:
        return e
    return {k: v for k, v in e.items() if k not in ("transactions",)}


server = Server()
try:
    check("appstore recheck every 1s, at most 60 reads a minute" in server.said, "serve says the recheck runs")

    # MARK: The first answer is right: renewal state read from Apple
    ada = str(uuid.uuid4())
    fake.add("Production", "acct-ada", transaction(1000001, 1000001, NOW - 35 * DAY, NOW - 5 * DAY, token=ada))
    fake.set_renewal("Production", "1000001", renewal(renews=True, retrying=True, grace=NOW + 3 * DAY))
    status, answer = submit(ada, signed(transaction(1000001, 1000001, NOW - 35 * DAY, NOW - 5 * DAY, token=ada)))
    p = (answer or {}).get("entitlements", {}).get("entitlements", {}).get("premium", {})
    check(status == 200 and p.get("isActive") and p.get("isInGracePeriod") and p.get("isInBillingRetry") and answer.get("transactions") == 1,
          "a submitted period that ended is active in the first answer: Apple says billing retry with grace: %r" % (answer,))
    # (the 1 s recheck may also have read the chain between the submission's two writes)
    check(fake.calls_to("/inApps/v1/subscriptions/1000001") >= 1 and not fake.refused, "Get All Subscription Statuses was called, with a token Apple accepts: %r" % (fake.refused,))
    bea = str(uuid.uuid4())
    fake.add("Production", "acct-bea", transaction(1100001, 1100001, NOW - 10 * DAY, NOW + 20 * DAY, token=bea))
    fake.set_renewal("Production", "1100001", renewal(renews=False))
    status, answer = submit(bea, signed(transaction(1100001, 1100001, NOW - 10 * DAY, NOW + 20 * DAY, token=bea)))
    p = (answer or {}).get("entitlements", {}).get("entitlements", {}).get("premium", {})
    check(status == 200 and p.get("isActive") and p.get("willRenew") is False and p.get("cancellationReason") == "customer",
          "the first answer says auto-renew is off: %r" % (p,))
    status, again = submit(bea, signed(transaction(1100001, 1100001, NOW - 10 * DAY, NOW + 20 * DAY, token=bea)))
    check(status == 200 and again.get("changed") is False, "the same JWS again changes nothing")

    # Apple's API down: the transaction alone is recorded, and the answer says it is active.
    fake.fail["/inApps/v1/subscriptions/1200001"] = 503
    cyd = str(uuid.uuid4())
    fake.add("Production", "acct-cyd", transaction(1200001, 1200001, NOW - DAY, NOW + 29 * DAY, token=cyd))
    status, answer = submit(cyd, signed(transaction(1200001, 1200001, NOW - DAY, NOW + 29 * DAY, token=cyd)))
    check(status == 200 and answer["entitlements"]["entitlements"]["premium"]["isActive"] and metric("entitlements_appstore_api_requests_total", call="statuses", outcome="store_unavailable") == 1,
          "Apple unreachable: the verified transaction alone is recorded, and the failure counted: %r" % (answer,))
    del fake.fail["/inApps/v1/subscriptions/1200001"]
    time.sleep(1.1)  # Apple's 503 backs off every call to Apple's production host for a second

    # Apple's sandbox failing does not hold back production: two hosts, two back-offs.
    fake.fail["Sandbox:"] = 503
    eve = str(uuid.uuid4())
    fake.add("Sandbox", "acct-eve", transaction(1250001, 1250001, NOW - DAY, NOW + 29 * DAY, token=eve, env="Sandbox"))
    status, _ = submit(eve, signed(transaction(1250001, 1250001, NOW - DAY, NOW + 29 * DAY, token=eve, env="Sandbox")))
    sandbox_failed = metric("entitlements_appstore_api_requests_total", call="statuses", outcome="store_unavailable")
    check(status == 200 and sandbox_failed >= 2, "a sandbox purchase while the sandbox fails: recorded alone, the failure counted: %r" % (sandbox_failed,))
    gus = str(uuid.uuid4())
    fake.add("Production", "acct-gus", transaction(1260001, 1260001, NOW - DAY, NOW + 29 * DAY, token=gus))
    fake.set_renewal("Production", "1260001", renewal(renews=False))
    status, answer = submit(gus, signed(transaction(1260001, 1260001, NOW - DAY, NOW + 29 * DAY, token=gus)))
    p = (answer or {}).get("entitlements", {}).get("entitlements", {}).get("premium", {})
    check(status == 200 and p.get("willRenew") is False and fake.calls_to("/inApps/v1/subscriptions/1260001") >= 1,
          "production is asked at once while the sandbox backs off: Apple's renewal state is in the first answer: %r" % (p,))
    del fake.fail["Sandbox:"]
    time.sleep(1.1)

    # MARK: Submission and notification, in either order, end the same
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    for user, base in ((first, 1300001), (second, 1400001)):
        fake.add("Production", "acct-" + user, transaction(base, base, NOW - 40 * DAY, NOW - 10 * DAY, token=user))
        fake.add("Production", "acct-" + user, transaction(base + 1, base, NOW - 10 * DAY, NOW + 20 * DAY, token=user))
        fake.set_renewal("Production", str(base), renewal(renews=True))
    s1 = submit(first, signed(transaction(1300002, 1300001, NOW - 10 * DAY, NOW + 20 * DAY, token=first)))
    n1 = notify("DID_RENEW", transaction(1300002, 1300001, NOW - 10 * DAY, NOW + 20 * DAY, token=first), renewal(renews=True))
    n2 = notify("DID_RENEW", transaction(1400002, 1400001, NOW - 10 * DAY, NOW + 20 * DAY, token=second), renewal(renews=True))
    s2 = submit(second, signed(transaction(1400002, 1400001, NOW - 10 * DAY, NOW + 20 * DAY, token=second)))
    check(all(s == 200 for s, _ in (s1, n1, n2, s2)), "submit then notify, notify then submit: all answered 200: %r" % ([s1, n1, n2, s2],))
    a, b = premium(first), premium(second)
    check(shape(a) == shape(b) and a["isActive"] and a["willRenew"], "both orders end in the same state: %r / %r" % (shape(a), shape(b)))

    # MARK: The store's record completes what the app wrote
    dan = str(uuid.uuid4())
    status, _ = post(server.grpc, "/entitlements.v1.EntitlementService/RecordTransaction", {"userId": dan, "transaction": {
        "transactionId": "1500001", "originalTransactionId": "1500001", "store": "SOURCE_APPSTORE", "productId": MONTHLY, "type": "TRANSACTION_TYPE_SUBSCRIPTION_STARTED",
        "transactionDate": str(NOW - DAY), "expirationDate": str(NOW + 6 * DAY), "environment": "ENVIRONMENT_PRODUCTION"}})
    check(status == 200 and premium(dan)["expirationDate"] == iso(NOW + 6 * DAY) and premium(dan).get("priceMicros") is None, "the app's backend records a guess: no price, a week")
    fake.add("Production", "acct-dan", transaction(1500001, 1500001, NOW - DAY, NOW + 29 * DAY, token=dan, price=4990))
    fake.set_renewal("Production", "1500001", renewal())
    status, answer = submit(dan, signed(transaction(1500001, 1500001, NOW - DAY, NOW + 29 * DAY, token=dan, price=4990)))
    p = premium(dan)
    check(status == 200 and p["expirationDate"] == iso(NOW + 29 * DAY) and p.get("priceMicros") == 4990000 and p["transactions"][0].get("verified") is True,
          "Apple's verified record replaces it: its expiry and price, marked verified: %r" % (p,))
    sources = [(e["source"] or {}).get("method") for e in history(dan) if e["cause"] == "write"]
    check(sources[0] == "RecordTransaction" and "SubmitPurchase" in sources
          and any("verified by the store" in e["summary"] and e["source"]["caller"] == "grpc anonymous" for e in history(dan)),
          "the history says who wrote what: the backend's guess, then SubmitPurchase's verified record: %r" % (sources,))
    status, answer = post(server.grpc, "/entitlements.v1.EntitlementService/RecordTransaction", {"userId": dan, "transaction": {
        "transactionId": "1500001", "originalTransactionId": "1500001", "store": "SOURCE_APPSTORE", "productId": MONTHLY, "type": "TRANSACTION_TYPE_SUBSCRIPTION_STARTED",
        "transactionDate": str(NOW - DAY), "expirationDate": str(NOW + 6 * DAY), "environment": "ENVIRONMENT_PRODUCTION"}})
    check(status == 200 and answer.get("changed") is False and premium(dan)["expirationDate"] == iso(NOW + 29 * DAY),
          "the app's write again: answered, and the store's record stands: %r" % (answer,))
    status, answer = post(server.grpc, "/entitlements.v1.EntitlementService/RecordTransaction", {"userId": dan, "transaction": {
        "transactionId": "1500009", "store": "SOURCE_APPSTORE", "productId": MONTHLY, "type": "TRANSACTION_TYPE_SUBSCRIPTION_STARTED",
        "transactionDate": str(NOW), "expirationDate": str(NOW + DAY), "verified": True}})
    check(status == 400 and "transaction.verified" in answer.get("message", ""), "a caller cannot claim a verified record: %r" % (answer,))

    # MARK: Bad input: a clear status, nothing written, counted by reason
    other = dict(transaction(1600001, 1600001, NOW, NOW + 30 * DAY), bundleId="com.other.app")
    forged = signed(transaction(1600002, 1600002, NOW, NOW + 30 * DAY))
    forged = forged[:-8] + ("AAAAAAAA" if not forged.endswith("AAAAAAAA") else "BBBBBBBB")
    cases = [
        ("another app's transaction", submit("eve", signed(other)), 400, "invalid_argument", "com.other.app"),
        ("a forged signature", submit("eve", forged), 400, "invalid_argument", "signature"),
        ("not a JWS", submit("eve", "not.a.jws.at.all"), 400, "invalid_argument", "compact JWS"),
        ("an unknown transaction id", submit("eve", transaction_id="9999999"), 404, "not_found", "does not know this transaction"),
        ("an id that is not Apple's", submit("eve", transaction_id="abc"), 404, "not_found", "does not know this transaction"),
        ("both a JWS and an id", post(server.grpc, "/entitlements.v1.EntitlementService/SubmitPurchase",
                                      {"userId": "eve", "appStore": {"signedTransaction": forged, "transactionId": "1"}}), 400, "invalid_argument", "not both"),
        ("neither", post(server.grpc, "/entitlements.v1.EntitlementService/SubmitPurchase", {"userId": "eve", "appStore": {}}), 400, "invalid_argument", "is required"),
        ("another customer's token", submit("eve", signed(transaction(1100001, 1100001, NOW - 10 * DAY, NOW + 20 * DAY, token=bea))), 403, "permission_denied", "another customer"),
    ]
    for what, (status, answer), want_status, want_code, words in cases:
        check(status == want_status and (answer or {}).get("code") == want_code and words in (answer or {}).get("message", ""),
              "%s: %d %s (%s)" % (what, status, (answer or {}).get("code"), (answer or {}).get("message")))
    check(check_user("eve").get("customerId") is None, "and nothing was written for eve")
    check(metric("entitlements_submitted_purchases_total", store="appstore", outcome="rejected", reason="unknown_transaction") == 2
          and metric("entitlements_submitted_purchases_total", store="appstore", outcome="rejected", reason="bad_signature") == 1,
          "refusals are counted by reason")
    wrong = Server(data="wrong-key", key_id="WRONGKEY99", recheck="off")
    try:
        fake.add("Production", "acct-gil", transaction(1700001, 1700001, NOW, NOW + 30 * DAY))
        status, answer = post(wrong.grpc, "/entitlements.v1.EntitlementService/SubmitPurchase", {"userId": "gil", "appStore": {"transactionId": "1700001"}})
        check(status == 503 and "Apple refused the token" in answer.get("message", "") and any("kid" in why for why in fake.refused),
              "a key id Apple does not know: UNAVAILABLE, saying what to check: %r" % (answer,))
        logged = open(wrong.log.name).read()
        check("BEGIN" not in logged and "eyJ" not in logged, "neither the key nor a token made with it appears in the log")
    finally:
        wrong.stop()

    bad = subprocess.run([ENT, "serve", "--data-dir", os.path.join(WORK, "bad-key"), "--snapshot", os.path.join(WORK, "seed.snap"),
                          "--appstore-root-cert", os.path.join(WORK, "root.pem"), "--appstore-bundle-id", BUNDLE, "--appstore-api-key", os.path.join(WORK, "root.pem"),
                          "--appstore-key-id", KEY_ID, "--appstore-issuer-id", ISSUER], capture_output=True, text=True, timeout=30)
    check(bad.returncode == 64 and "not an EC P-256 private key in PEM" in bad.stderr, "a key file that is not a key: refused at start, saying which: %s" % bad.stderr.strip()[-200:])

    # MARK: Backfill: 45 transactions over three pages, twice
    fay = "fay"
    start = NOW - 40 * 30 * DAY + 10 * DAY
    for i in range(40):
        fake.add("Production", "acct-fay", transaction(2000001 + i, 2000001, start + i * 30 * DAY, start + (i + 1) * 30 * DAY))
    for i in range(3):
        fake.add("Production", "acct-fay", transaction(2100001 + i, 2100001 + i, start + i * DAY, product=COINS, kind="Consumable"))
    fake.add("Production", "acct-fay", transaction(2200001, 2200001, start, product=LIFETIME, kind="Non-Consumable"))
    fake.add("Production", "acct-fay", transaction(2200002, 2200002, start + DAY, product=LIFETIME, kind="Non-Consumable", revoked=start + 2 * DAY))
    fake.set_renewal("Production", "2000001", renewal())
    before = fake.calls_to("/inApps/v2/history/")
    result = ent("appstore", "sync", "--user", fay, "--transaction-id", "2000005", "--json")
    answer = json.loads(result.stdout) if result.returncode == 0 else {}
    check(result.returncode == 0 and answer.get("transactions") == 42 and answer.get("changed") is True and fake.calls_to("/inApps/v2/history/") - before == 3,
          "appstore sync reads three pages and records 42 of 45 transactions (three consumables): %s %s" % (result.stdout[:300], result.stderr))
    ents = answer.get("entitlements", {}).get("entitlements", {})
    check(ents.get("premium", {}).get("isActive") and ents.get("premium", {}).get("renewsCount") == 39 and ents.get("lifetime", {}).get("isActive"),
          "the backfilled customer has premium (39 renewals) and the lifetime purchase: %r" % ({k: (v.get("isActive"), v.get("renewsCount")) for k, v in ents.items()},))
    result = ent("appstore", "sync", "--user", fay, "--transaction-id", "2000005")
    check(result.returncode == 0 and "history recorded already, 42 transactions" in result.stdout, "run twice, the second changes nothing: %s" % result.stdout.splitlines()[:1])
    result = ent("appstore", "sync", "--user", fay)
    check(result.returncode != 0 and "--transaction-id" in result.stderr, "the CLI says what sync needs")
    fake.add("Sandbox", "acct-sandy", transaction(2300001, 2300001, NOW, NOW + 30 * DAY, env="Sandbox"))
    status, answer = submit("sandy", transaction_id="2300001")
    check(status == 200 and answer.get("environment") == "sandbox" and answer["entitlements"]["entitlements"]["premium"]["isActive"],
          "a sandbox history is found after production and answered for the sandbox: %r" % ((answer or {}).get("environment"),))

    # MARK: The same through the gRPC door, with Python's grpcio
    with grpc.insecure_channel("127.0.0.1:%d" % server.grpc) as channel:
        stub = service_pb2_grpc.EntitlementServiceStub(channel)
        jay = str(uuid.uuid4())
        fake.add("Production", "acct-jay", transaction(1800001, 1800001, NOW - DAY, NOW + 29 * DAY, token=jay))
        fake.set_renewal("Production", "1800001", renewal(renews=False))
        response = stub.SubmitPurchase(svc.SubmitPurchaseRequest(user_id=jay, app_store=svc.AppStorePurchase(
            signed_transaction=signed(transaction(1800001, 1800001, NOW - DAY, NOW + 29 * DAY, token=jay)))), timeout=30)
        got = {e.id: e for e in response.entitlements.entitlements}
        check(response.changed and response.transactions == 1 and response.linked_alias == "appstore:1800001" and got["premium"].is_active
              and not got["premium"].will_renew and got["premium"].transactions[0].verified, "gRPC: SubmitPurchase with Apple's state: %s" % response)
        response = stub.SubmitPurchase(svc.SubmitPurchaseRequest(user_id="fay", app_store=svc.AppStorePurchase(transaction_id="2000001")), timeout=30)
        check(response.transactions == 42 and not response.changed, "gRPC: the backfill again, by another of its ids: %d transactions, nothing changed" % response.transactions)
        try:
            stub.SubmitPurchase(svc.SubmitPurchaseRequest(user_id="not-fay", app_store=svc.AppStorePurchase(transaction_id="2000001")), timeout=30)
            check(False, "gRPC: another user's backfill of fay's history is refused")
        except grpc.RpcError as error:
            check(error.code() == grpc.StatusCode.PERMISSION_DENIED, "gRPC: another user's backfill of fay's history is PERMISSION_DENIED: %s" % error.details())
        try:
            stub.SubmitPurchase(svc.SubmitPurchaseRequest(user_id="kim", app_store=svc.AppStorePurchase(transaction_id="9999999")), timeout=30)
            check(False, "gRPC: an unknown transaction id is refused")
        except grpc.RpcError as error:
            check(error.code() == grpc.StatusCode.NOT_FOUND and "does not know this transaction" in error.details(), "gRPC: an unknown transaction id is NOT_FOUND: %s" % error.details())

    # MARK: The recheck recovers a missed renewal and a missed expiry
    gus = str(uuid.uuid4())
    fake.add("Production", "acct-gus", transaction(3000001, 3000001, NOW - 32 * DAY, NOW - 2 * DAY, token=gus))
    fake.add("Production", "acct-gus", transaction(3000002, 3000001, NOW - 2 * DAY, NOW + 28 * DAY, token=gus))
    fake.set_renewal("Production", "3000001", renewal())
    status, _ = notify("SUBSCRIBED", transaction(3000001, 3000001, NOW - 32 * DAY, NOW - 2 * DAY, token=gus), renewal(), at=NOW - 32 * DAY, subtype="INITIAL_BUY")
    check(status == 200, "a subscription's first notice, its renewal's never sent")
    first = [e for e in history(gus) if e["cause"] == "write"][0]
    check(first["source"] == {"method": "appstore", "caller": "webhooks", "eventId": last_notification_uuid},
          "the history names the notification a write came from (its notificationUUID): %r" % (first["source"],))
    hal = str(uuid.uuid4())
    fake.add("Production", "acct-hal", transaction(3100001, 3100001, NOW - 33 * DAY, NOW - 3 * DAY - MINUTE, token=hal))
    fake.set_renewal("Production", "3100001", renewal(renews=False, intent=2))
    status, _ = notify("DID_FAIL_TO_RENEW", transaction(3100001, 3100001, NOW - 33 * DAY, NOW - 3 * DAY - MINUTE, token=hal),
                       renewal(renews=True, retrying=True, grace=NOW + 10 * DAY), at=NOW - 3 * DAY, subtype="GRACE_PERIOD")
    check(status == 200, "a subscription in grace, its expiry notice never sent")
    deadline = time.time() + 20
    while time.time() < deadline and not (premium(gus)["isActive"] and not premium(hal)["isActive"]):
        time.sleep(0.2)
    check(premium(gus)["isActive"] and premium(gus)["expirationDate"] == iso(NOW + 28 * DAY), "the recheck recorded the missed renewal: %r" % (shape(premium(gus)),))
    check(not premium(hal)["isActive"] and not premium(hal).get("isInGracePeriod"), "the recheck recorded the missed expiry: %r" % (shape(premium(hal)),))
    # hal is billing_retry, or missed_period_end when a scan fell between its notification's two writes
    while time.time() < deadline and metric("entitlements_appstore_rechecks_total", outcome="applied") < 2:
        time.sleep(0.1)
    check(metric("entitlements_appstore_rechecks_total", reason="missed_period_end", outcome="applied") >= 1
          and metric("entitlements_appstore_rechecks_total", outcome="applied") >= 2, "rechecks are counted by reason and outcome")
    calls = fake.calls_to("/inApps/v1/subscriptions/")
    time.sleep(2.5)
    check(fake.calls_to("/inApps/v1/subscriptions/") == calls, "once read, a chain is not read again (no reads in 2.5 s of 1 s scans)")

    # kill -9 right after an answer: the backfill is still there.
    server.stop(signal.SIGKILL)
    server = Server(recheck="off")
    check(premium(fay)["renewsCount"] == 39 and premium(gus)["isActive"], "after kill -9 every answered write is still applied")
    server.stop()

    # MARK: Fleet mode: two servers on one PostgreSQL
    postgres = Postgres()
    try:
        subprocess.run([ENT, "db", "migrate", "--postgres", postgres.url], check=True, capture_output=True)
        subprocess.run([ENT, "db", "import", "--postgres", postgres.url, "--snapshot", os.path.join(WORK, "seed.snap")], check=True, capture_output=True)
        fleet = ["--postgres", postgres.url, "--fleet-poll-interval", "50ms"]
        a = server = Server(data="fleet-a", extra=fleet)
        b = Server(data="fleet-b", extra=fleet, recheck=None)
        check("appstore recheck off (fleet mode" in b.said and "appstore recheck every 1s" in a.said, "fleet: the recheck runs only on the node given the interval")
        ivy = str(uuid.uuid4())
        fake.add("Production", "acct-ivy", transaction(4000001, 4000001, NOW - 5 * DAY, NOW + 25 * DAY, token=ivy))
        fake.set_renewal("Production", "4000001", renewal(renews=False))
        status, answer = submit(ivy, signed(transaction(4000001, 4000001, NOW - 5 * DAY, NOW + 25 * DAY, token=ivy)), on=a)
        check(status == 200 and answer["entitlements"]["entitlements"]["premium"]["willRenew"] is False, "fleet: A answers the submission with Apple's state: %r" % (answer,))
        seen = None
        for _ in range(100):
            seen = premium(ivy, on=b)
            if seen:
                break
            time.sleep(0.05)
        check(seen is not None and seen["isActive"] and seen["willRenew"] is False, "fleet: B answers it from PostgreSQL")
        status, answer = notify("DID_CHANGE_RENEWAL_STATUS", transaction(4000001, 4000001, NOW - 5 * DAY, NOW + 25 * DAY, token=ivy), renewal(renews=False),
                                at=NOW - DAY, subtype="AUTO_RENEW_DISABLED", to=b)
        p = premium(ivy, on=b)
        check(status == 200 and p["willRenew"] is False and p["isActive"] and p["autoRenewDisableDate"] == iso(NOW - DAY),
              "fleet: a late notification through B adds when auto-renew went off, and Apple's newer state stays: %r" % (shape(p),))
        status, answer = submit("fay-fleet", transaction_id="2000001", on=b)
        check(status == 200 and answer.get("transactions") == 42, "fleet: a backfill through B: %r" % ((answer or {}).get("transactions"),))
        status, answer = submit("fay-fleet", transaction_id="2000001", on=a)
        check(status == 200 and answer.get("changed") is False, "fleet: and again through A changes nothing")
        a.stop()
        b.stop()
    finally:
        postgres.remove()
finally:
    for s in SERVERS:
        try:
            if s.process.poll() is None:
                s.stop()
        except Exception:  # noqa: BLE001
            pass
    fake.stop()
    if FAILURES:
        for name in sorted(os.listdir(WORK)):
            if name.startswith("serve-"):
                print("---- " + name)
                print(open(os.path.join(WORK, name)).read()[-4000:])
    shutil.rmtree(WORK, ignore_errors=True)

print("appstore: %d failed" % len(FAILURES) if FAILURES else "appstore: all passed")
sys.exit(1 if FAILURES else 0)
