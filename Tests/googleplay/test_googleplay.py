"""Google Play ingestion end to end (docs/ingestion.md, "Google Play"): the real
`entitlements serve`, with a real data directory, against fake_google.py, the loopback
stand-in for Google built from its documents. Keys are made with openssl here; push tokens
are signed with them as Google signs its OIDC tokens.

Usage: python3 Tests/googleplay/test_googleplay.py path/to/entitlements
Talks to loopback only; stops the servers it started, by pid."""
import base64
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from cryptography.hazmat.primitives import serialization

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "storeharness"))
from fake_google import FakeGoogle, sign_jwt  # noqa: E402
from harness import FAILURES, Postgres, admin_metric, check, post  # noqa: E402

ENT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".build/debug/entitlements")
PACKAGE = "com.example.app"
AUDIENCE = "https://entitlements.example.com/webhooks/googleplay"
PUSHER = "pubsub-push@example-project.iam.gserviceaccount.com"
ACCOUNT = "play-reader@example-project.iam.gserviceaccount.com"
SUBSCRIPTION = "projects/example-project/subscriptions/play-rtdn"
DAY = 86_400_000
NOW = int(time.time() * 1000)
WORK = tempfile.mkdtemp(prefix="googleplay-")
def openssl_key(name):
    path = os.path.join(WORK, name + ".pem")
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", path], check=True, capture_output=True)
    with open(path, "rb") as f:
        pem = f.read()
    return pem, serialization.load_pem_private_key(pem, None)


def rfc3339(ms):
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + ".%03dZ" % (ms % 1000)


# MARK: Keys, the fake, the server

account_pem, account_key = openssl_key("service-account")
push_pem, push_key = openssl_key("push-signer")
rotated_pem, rotated_key = openssl_key("push-signer-2")
stranger_pem, stranger_key = openssl_key("stranger")
account_public = account_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
fake = FakeGoogle(ACCOUNT, "key-1", account_public)
fake.jwks_keys = [(push_key.public_key(), "push-1")]
with open(os.path.join(WORK, "service-account.json"), "w") as f:
    json.dump({"type": "service_account", "project_id": "example-project", "private_key_id": "key-1", "private_key": account_pem.decode(),
               "client_email": ACCOUNT, "client_id": "1", "token_uri": fake.url + "/token"}, f)

CATALOG = {"products": [
    {"id": "premium_sub", "type": "subscription", "period": "monthly", "entitlements": ["premium"]},
    {"id": "premium_sub:yearly", "type": "subscription", "period": "annual", "entitlements": ["premium", "pro"]},
    {"id": "lifetime", "type": "nonConsumable", "entitlements": ["premium"]},
    {"id": "addon_pro", "type": "subscription", "period": "monthly", "entitlements": ["pro"]},
]}
with open(os.path.join(WORK, "catalog.json"), "w") as f:
    json.dump(CATALOG, f)
open(os.path.join(WORK, "customers.jsonl"), "w").close()
subprocess.run([ENT, "snapshot", "build", "--catalog", os.path.join(WORK, "catalog.json"), "--customers", os.path.join(WORK, "customers.jsonl"),
                "--output", os.path.join(WORK, "seed.snap")], check=True, capture_output=True)


class Server:
    def __init__(self, data="data", pull=True, extra=()):
        self.log = open(os.path.join(WORK, "serve-%s.log" % time.time()), "w+")
        args = [ENT, "serve", "--data-dir", os.path.join(WORK, data), "--snapshot", os.path.join(WORK, "seed.snap"), "--listen", "127.0.0.1:0", *extra,
                "--grpc-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--webhooks-listen", "127.0.0.1:0",
                "--googleplay-package", PACKAGE, "--googleplay-service-account", os.path.join(WORK, "service-account.json"),
                "--googleplay-api-url", fake.url, "--googleplay-jwks-url", fake.url + "/oauth2/v3/certs",
                "--googleplay-push-audience", AUDIENCE, "--googleplay-push-service-account", PUSHER]
        if pull:
            args += ["--googleplay-pubsub-subscription", SUBSCRIPTION, "--googleplay-pubsub-url", fake.url]
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(300):
            self.log.seek(0)
            text = self.log.read()
            if "webhooks listening on" in text and "grpc listening on" in text:
                break
            if self.process.poll() is not None:
                raise SystemExit("serve exited:\n" + text)
            time.sleep(0.1)
        ports = dict(re.findall(r"^(grpc |admin |webhooks |)listening on 127\.0\.0\.1:(\d+)", text, re.M))
        self.tcp, self.grpc, self.admin, self.webhooks = int(ports[""]), int(ports["grpc "]), int(ports["admin "]), int(ports["webhooks "])

    def stop(self, sig=signal.SIGTERM):
        self.process.send_signal(sig)
        self.process.wait(timeout=30)


server = Server()


def push_token(key=None, kid="push-1", **overrides):
    claims = {"iss": "https://accounts.google.com", "aud": AUDIENCE, "azp": "1234", "email": PUSHER, "email_verified": True,
              "sub": "1234", "iat": int(time.time()), "exp": int(time.time()) + 3600}
    claims.update(overrides)
    return sign_jwt(key or push_key, kid, claims)


def envelope(notification):
    global last_message_id
    data = base64.b64encode(json.dumps(notification).encode()).decode()
    last_message_id = "m-%d" % time.time_ns()
    return {"message": {"data": data, "messageId": last_message_id, "publishTime": rfc3339(NOW)}, "subscription": SUBSCRIPTION}


def push(notification, token=None, raw=None, auth=None, to=None):
    headers = {"Authorization": auth if auth is not None else "Bearer " + (token or push_token())}
    return post((to or server).webhooks, "/webhooks/googleplay", raw if raw is not None else envelope(notification), headers)


def rtdn(kind, body, package=PACKAGE):
    return {"version": "1.0", "packageName": package, "eventTimeMillis": str(NOW), kind: body}


def sub_note(token, type_):
    return rtdn("subscriptionNotification", {"version": "1.0", "notificationType": type_, "purchaseToken": token})


def subscription(state, expiry, order, start=None, account=None, ack="ACKNOWLEDGEMENT_STATE_PENDING", product="premium_sub", base_plan="monthly",
                 auto_renew=True, phase="basePrice", linked=None, canceled=None, test=False, price=("9", 990000000, "USD")):
    item = {"productId": product, "expiryTime": rfc3339(expiry), "latestSuccessfulOrderId": order,
            "autoRenewingPlan": {"autoRenewEnabled": auto_renew, "recurringPrice": {"currencyCode": price[2], "units": price[0], "nanos": price[1]}},
            "offerDetails": {"basePlanId": base_plan, "offerTags": []}, "offerPhase": {phase: {}}}
    resource = {"kind": "androidpublisher#subscriptionPurchaseV2", "regionCode": "US", "startTime": rfc3339(start or NOW - 10 * DAY),
                "subscriptionState": state, "acknowledgementState": ack, "lineItems": [item]}
    if account:
        resource["externalAccountIdentifiers"] = {"obfuscatedExternalAccountId": account}
    if linked:
        resource["linkedPurchaseToken"] = linked
    if canceled:
        resource["canceledStateContext"] = {canceled: {"cancelTime": rfc3339(NOW - DAY)} if canceled == "userInitiatedCancellation" else {}}
    if test:
        resource["testPurchase"] = {}
    return resource


def check_user(user, at=None, environment="ENVIRONMENT_PRODUCTION", on=None):
    status, answer = post((on or server).grpc, "/entitlements.v1.EntitlementService/CheckEntitlements",
                          {"userId": user, "at": str(at or NOW), "environment": environment})
    assert status == 200, (status, answer)
    return answer


def premium(user, **kwargs):
    return check_user(user, **kwargs).get("entitlements", {}).get("premium")


def metric(name, **labels):
    return admin_metric(server.admin, name, **labels)


def link(user, alias):
    status, answer = post(server.grpc, "/entitlements.v1.EntitlementService/LinkAlias", {"userId": user, "alias": alias, "transfer": True})
    assert status == 200, (status, answer)


try:
    # MARK: Authentication and envelopes: nothing is written
    status, answer = push(rtdn("testNotification", {"version": "1.0"}))
    check(status == 200 and answer.get("ignored") == "test", "a test notification is answered 200, ignored: %r" % (answer,))
    fake.set_subscription(PACKAGE, "tok-auth", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.0000-0000-0000-00001", account="mallory"))
    note = sub_note("tok-auth", 4)
    for what, kwargs, expected in [
        ("no Authorization", {"auth": ""}, 401),
        ("a token signed by another key under Google's kid", {"token": push_token(key=stranger_key)}, 401),
        ("an expired token", {"token": push_token(exp=int(time.time()) - 10)}, 401),
        ("a token of another issuer", {"token": push_token(iss="https://evil.example.com")}, 401),
        ("alg none", {"auth": "Bearer " + base64.urlsafe_b64encode(b'{"alg":"none","kid":"push-1"}').decode().rstrip("=") + "." + base64.urlsafe_b64encode(json.dumps({"aud": AUDIENCE, "email": PUSHER}).encode()).decode().rstrip("=") + "."}, 401),
        ("a wrong audience", {"token": push_token(aud="https://other.example.com")}, 403),
        ("a wrong service account", {"token": push_token(email="someone@example.com")}, 403),
        ("an unverified email", {"token": push_token(email_verified=False)}, 403),
    ]:
        status, answer = push(note, **kwargs)
        check(status == expected and "error" in answer, "%s: %d, %r" % (what, status, answer))
    check(fake.calls("tok-auth") == 0 and "premium" not in check_user("mallory").get("entitlements", {}), "a refused push reads and writes nothing")
    for what, raw, reason in [
        ("not JSON", b"{oops", "malformed_json"),
        ("no message.data", {"message": {"messageId": "1"}}, "missing_field"),
        ("data not base64", {"message": {"data": "%%%", "messageId": "1"}}, "malformed_json"),
        ("data not a notification", {"message": {"data": base64.b64encode(b'{"a":1}').decode()}}, "missing_field"),
    ]:
        status, answer = push(None, raw=raw)
        check(status == 400 and answer.get("reason") == reason, "malformed envelope, %s: 400 %s (%r)" % (what, reason, answer))
    status, answer = push(rtdn("subscriptionNotification", {"notificationType": 4, "purchaseToken": "tok-auth"}, package="com.other.app"))
    check(status == 400 and answer.get("reason") == "other_app", "another package is refused: %r" % (answer,))

    # MARK: A purchase, from notification to an active entitlement, acknowledged
    expiry = NOW + 20 * DAY
    fake.set_subscription(PACKAGE, "tok-alice", subscription("SUBSCRIPTION_STATE_ACTIVE", expiry, "GPA.1111-2222-3333-44444", account="alice"))
    status, answer = push(sub_note("tok-alice", 4))
    check(status == 200 and answer.get("changed") is True and answer.get("customerId") == "alice", "SUBSCRIPTION_PURCHASED applies: %r" % (answer,))
    status, told = post(server.grpc, "/entitlements.v1.EntitlementService/CustomerHistory", {"userId": "alice"})
    sources = [e["source"] for e in (told or {}).get("entries", []) if e["cause"] == "write"]
    check(status == 200 and sources and all(s == {"method": "googleplay", "caller": "webhooks", "eventId": last_message_id} for s in sources),
          "the history names the Pub/Sub message the writes came from: %r" % (sources,))
    entitlement = premium("alice")
    check(entitlement and entitlement["isActive"] and entitlement["source"] == "playstore" and entitlement["productId"] == "premium_sub",
          "alice has premium from Play: %r" % (entitlement,))
    check(entitlement and entitlement.get("priceMicros") == 9990000 and entitlement.get("currency") == "USD", "the price comes from the line item")
    check(fake.acknowledged == ["/androidpublisher/v3/applications/com.example.app/purchases/subscriptions/premium_sub/tokens/tok-alice:acknowledge"],
          "the purchase is acknowledged once its writes are durable: %r" % fake.acknowledged)
    status, answer = push(sub_note("tok-alice", 4))
    check(status == 200 and answer.get("changed") is False and len(fake.acknowledged) == 1, "a redelivery changes nothing and acknowledges nothing again")
    check(fake.token_exchanges == 1 and not fake.token_failures, "one token exchange, its assertion verified: %d %r" % (fake.token_exchanges, fake.token_failures))

    # Every notification type, and one not known yet, reads the purchase back and applies it.
    calls = fake.calls("subscriptionsv2/tokens/tok-alice")
    answers = [push(sub_note("tok-alice", type_)) for type_ in [*range(1, 14), *range(17, 23), 99]]
    check(all(status == 200 and answer.get("changed") is False for status, answer in answers) and fake.calls("subscriptionsv2/tokens/tok-alice") == calls + 20,
          "notification types 1 to 13, 17 to 22 and 99 each read the purchase back: %r" % sorted({status for status, _ in answers}))

    # The lifecycle of one subscription, each notification refetched.
    renewed = NOW + 50 * DAY
    fake.set_subscription(PACKAGE, "tok-alice", subscription("SUBSCRIPTION_STATE_ACTIVE", renewed, "GPA.1111-2222-3333-44444..0", account="alice",
                                                             ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"))
    status, answer = push(sub_note("tok-alice", 2))
    entitlement = premium("alice", at=NOW + 25 * DAY)
    check(status == 200 and entitlement["expirationDate"] == rfc3339(renewed) and entitlement.get("renewsCount") == 1, "a renewal records the new period: %r" % (entitlement,))
    fake.set_subscription(PACKAGE, "tok-alice", subscription("SUBSCRIPTION_STATE_CANCELED", renewed, "GPA.1111-2222-3333-44444..0", account="alice",
                                                             ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED", auto_renew=False, canceled="userInitiatedCancellation"))
    push(sub_note("tok-alice", 3))
    entitlement = premium("alice", at=NOW + 25 * DAY)
    check(entitlement["isActive"] and entitlement.get("cancellationReason") == "customer" and entitlement.get("renewState") == "canceled",
          "canceled: access until expiry, reason customer: %r" % ({k: entitlement.get(k) for k in ("isActive", "cancellationReason", "renewState")},))

    # Grace, hold, recovery.
    grace_end = NOW + 3 * DAY
    fake.set_subscription(PACKAGE, "tok-bob", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + DAY, "GPA.2000-0000-0000-00001", account="bob"))
    push(sub_note("tok-bob", 4))
    fake.set_subscription(PACKAGE, "tok-bob", subscription("SUBSCRIPTION_STATE_IN_GRACE_PERIOD", grace_end, "GPA.2000-0000-0000-00001", account="bob",
                                                           ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"))
    push(sub_note("tok-bob", 6))
    entitlement = premium("bob", at=NOW + 2 * DAY)
    check(entitlement["isActive"] and entitlement.get("gracePeriodExpirationDate") == rfc3339(grace_end) and entitlement.get("renewState") == "billingIssue",
          "in grace: active past the period's end, billing issue: %r" % ({k: entitlement.get(k) for k in ("isActive", "gracePeriodExpirationDate", "renewState")},))
    fake.set_subscription(PACKAGE, "tok-bob", subscription("SUBSCRIPTION_STATE_ON_HOLD", grace_end, "GPA.2000-0000-0000-00001", account="bob",
                                                           ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"))
    push(sub_note("tok-bob", 5))
    entitlement = premium("bob", at=NOW + 4 * DAY)
    check(not entitlement["isActive"] and entitlement["renewState"] == "billingIssue" and entitlement["status"] == "past_due",
          "on hold: no access after the grace period, a billing issue, past due: %r" % ({k: entitlement.get(k) for k in ("isActive", "renewState", "status")},))
    fake.set_subscription(PACKAGE, "tok-bob", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 33 * DAY, "GPA.2000-0000-0000-00001..0", account="bob",
                                                           ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"))
    push(sub_note("tok-bob", 1))
    entitlement = premium("bob", at=NOW + 4 * DAY)
    check(entitlement["isActive"] and entitlement.get("renewState") == "willRenew", "recovered: active again, will renew: %r" % (entitlement.get("renewState"),))

    # Pause, expiry, revocation.
    fake.set_subscription(PACKAGE, "tok-carol", subscription("SUBSCRIPTION_STATE_PAUSED", NOW - DAY, "GPA.3000-0000-0000-00001", account="carol"))
    push(sub_note("tok-carol", 10))
    entitlement = premium("carol")
    check(not entitlement["isActive"] and entitlement["renewState"] == "willRenew" and entitlement["isInBillingRetry"] is False,
          "paused: no access, resumes by itself (will renew), no billing issue: %r" % ({k: entitlement.get(k) for k in ("isActive", "renewState")},))
    fake.set_subscription(PACKAGE, "tok-dave", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.4000-0000-0000-00001", account="dave"))
    push(sub_note("tok-dave", 4))
    fake.set_subscription(PACKAGE, "tok-dave", subscription("SUBSCRIPTION_STATE_EXPIRED", NOW - 1000, "GPA.4000-0000-0000-00001", account="dave", auto_renew=False,
                                                            canceled="developerInitiatedCancellation", ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"))
    push(sub_note("tok-dave", 12))
    entitlement = premium("dave")
    check(not entitlement["isActive"] and entitlement.get("cancellationReason") == "developer",
          "revoked (expired before its period's end): no access, reason developer: %r" % ({k: entitlement.get(k) for k in ("isActive", "isRevoked", "cancellationReason")},))

    # Trials, intro offers, the base plan in the catalog, test purchases.
    fake.set_subscription(PACKAGE, "tok-trial", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 7 * DAY, "GPA.5000-0000-0000-00001", account="erin", phase="freeTrial"))
    push(sub_note("tok-trial", 4))
    entitlement = premium("erin")
    check(entitlement["periodType"] == "trial" and entitlement.get("priceMicros") == 0, "a free trial: period type trial, price 0: %r" % (entitlement.get("periodType"),))
    fake.set_subscription(PACKAGE, "tok-intro", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.5100-0000-0000-00001", account="frank", phase="introductoryPrice"))
    push(sub_note("tok-intro", 4))
    entitlement = premium("frank")
    check(entitlement["periodType"] == "intro" and entitlement.get("priceMicros") is None, "an intro offer: period type intro, no price: %r" % (entitlement.get("periodType"),))
    fake.set_subscription(PACKAGE, "tok-yearly", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 300 * DAY, "GPA.5200-0000-0000-00001", account="gina", base_plan="yearly"))
    push(sub_note("tok-yearly", 4))
    answer = check_user("gina")
    check("pro" in answer["entitlements"] and answer["entitlements"]["pro"]["productId"] == "premium_sub:yearly", "PRODUCT:BASEPLAN in the catalog is the product")
    fake.set_subscription(PACKAGE, "tok-test", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.5300-0000-0000-00001", account="hank", test=True))
    push(sub_note("tok-test", 4))
    check("premium" not in check_user("hank")["entitlements"] and premium("hank", environment="ENVIRONMENT_SANDBOX")["isActive"], "a test purchase is a sandbox one")

    # Upgrade with a linked token: same customer, the old chain ends where the new starts.
    fake.set_subscription(PACKAGE, "tok-old", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.6000-0000-0000-00001", start=NOW - 10 * DAY))
    link("ivan", "googleplay:tok-old")
    push(sub_note("tok-old", 4))
    fake.set_subscription(PACKAGE, "tok-new", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 365 * DAY, "GPA.6001-0000-0000-00001", start=NOW - DAY,
                                                           base_plan="yearly", linked="tok-old"))
    status, answer = push(sub_note("tok-new", 4))
    check(status == 200 and answer.get("customerId") == "ivan", "the upgrade finds the customer through the linked token: %r" % (answer,))
    answer = check_user("ivan")
    check(answer["entitlements"]["premium"]["productId"] == "premium_sub:yearly" and answer["entitlements"]["pro"]["isActive"], "the new plan gives premium and pro")
    # A downgrade: the new plan ends before the old one would have; the old chain still ends
    # where the new one starts, so the new plan is the answer (the old one would win by its
    # later expiry otherwise).
    fake.set_subscription(PACKAGE, "tok-down-old", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 300 * DAY, "GPA.6100-0000-0000-00001", start=NOW - 60 * DAY,
                                                                base_plan="yearly", account="jack"))
    push(sub_note("tok-down-old", 4))
    fake.set_subscription(PACKAGE, "tok-down-new", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 25 * DAY, "GPA.6101-0000-0000-00001", start=NOW - 5 * DAY,
                                                                linked="tok-down-old", account="jack"))
    push(sub_note("tok-down-new", 4))
    answer = check_user("jack")
    check(answer["entitlements"]["premium"]["productId"] == "premium_sub" and not answer["entitlements"]["pro"]["isActive"]
          and answer["entitlements"]["pro"]["isRevoked"] and answer["entitlements"]["pro"]["cancellationReason"] == "replaced",
          "a downgrade ends the old chain at the new start (revoked, replaced): %r" % ({k: (v["productId"], v["isActive"]) for k, v in answer["entitlements"].items()},))
    before = check_user("jack", at=NOW - 10 * DAY)
    check(before["entitlements"]["pro"]["isActive"], "before the new start the old plan still counts")

    # An add-on: two line items billed by one order are two chains, both recorded; a void of
    # the order revokes both.
    addon = subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.6200-0000-0000-00001", account="kim")
    addon["lineItems"].append(dict(addon["lineItems"][0], productId="addon_pro", offerDetails={"basePlanId": "monthly"}))
    fake.set_subscription(PACKAGE, "tok-addon", addon)
    status, answer = push(sub_note("tok-addon", 4))
    answer = check_user("kim")
    check(answer["entitlements"]["premium"]["isActive"] and answer["entitlements"]["pro"]["isActive"]
          and answer["entitlements"]["pro"]["transactions"][0]["transactionId"] == "GPA.6200-0000-0000-00001:addon_pro", "an add-on line item is recorded beside its base plan")
    fake.voided.append((PACKAGE, {"purchaseToken": "tok-addon", "orderId": "GPA.6200-0000-0000-00001", "voidedTimeMillis": str(NOW - 1000), "refundType": 1}))
    push(rtdn("voidedPurchaseNotification", {"purchaseToken": "tok-addon", "orderId": "GPA.6200-0000-0000-00001", "productType": 1, "refundType": 1}))
    answer = check_user("kim")
    check(answer["entitlements"]["premium"]["isRevoked"] and answer["entitlements"]["pro"]["isRevoked"], "a void of the order revokes the base plan and its add-on")

    # One-time products.
    fake.set_product(PACKAGE, "lifetime", "tok-life", {"kind": "androidpublisher#productPurchase", "purchaseTimeMillis": str(NOW - DAY), "purchaseState": 0,
                                                       "consumptionState": 0, "acknowledgementState": 0, "orderId": "GPA.7000-0000-0000-00001",
                                                       "obfuscatedExternalAccountId": "judy", "regionCode": "US"})
    status, answer = push(rtdn("oneTimeProductNotification", {"version": "1.0", "notificationType": 1, "purchaseToken": "tok-life", "sku": "lifetime"}))
    entitlement = premium("judy")
    check(status == 200 and entitlement["isActive"] and entitlement.get("expirationDate") is None, "a one-time purchase: active, never expires: %r" % (answer,))
    check(any("/purchases/products/lifetime/tokens/tok-life:acknowledge" in p for p in fake.acknowledged), "the one-time purchase is acknowledged")
    fake.set_product(PACKAGE, "lifetime", "tok-pending", {"purchaseTimeMillis": str(NOW), "purchaseState": 2, "acknowledgementState": 0, "obfuscatedExternalAccountId": "kate"})
    status, answer = push(rtdn("oneTimeProductNotification", {"notificationType": 1, "purchaseToken": "tok-pending", "sku": "lifetime"}))
    check(status == 200 and answer.get("ignored") == "pending" and "premium" not in check_user("kate")["entitlements"], "a pending purchase writes nothing")
    fake.set_product(PACKAGE, "lifetime", "tok-pending", {"purchaseTimeMillis": str(NOW), "purchaseState": 1, "acknowledgementState": 0, "obfuscatedExternalAccountId": "kate"})
    status, answer = push(rtdn("oneTimeProductNotification", {"notificationType": 2, "purchaseToken": "tok-pending", "sku": "lifetime"}))
    check(status == 200 and answer.get("ignored") == "canceled", "a canceled pending purchase writes nothing")

    # Voided purchases, confirmed with purchases.voidedpurchases.list: a full refund revokes
    # at Google's void time, a partial one does not; one Google does not list waits.
    void_note = {"purchaseToken": "tok-life", "orderId": "GPA.7000-0000-0000-00001", "productType": 2, "refundType": 1}
    status, answer = push(rtdn("voidedPurchaseNotification", void_note))
    check(status == 503 and answer.get("reason") == "not_recorded_yet" and premium("judy")["isActive"], "a void Google does not list yet is refused 503: %r" % (answer,))
    for number in range(3):  # other voids first: the server follows the list's pages
        fake.voided.append((PACKAGE, {"kind": "androidpublisher#voidedPurchase", "purchaseToken": "tok-other-%d" % number, "orderId": "GPA.0-%d" % number,
                                      "purchaseTimeMillis": str(NOW - 5 * DAY), "voidedTimeMillis": str(NOW - 2 * DAY + number), "voidedSource": 0, "voidedReason": 1}))
    fake.voided.append((PACKAGE, {"kind": "androidpublisher#voidedPurchase", "purchaseToken": "tok-life", "orderId": "GPA.7000-0000-0000-00001",
                                  "purchaseTimeMillis": str(NOW - DAY), "voidedTimeMillis": str(NOW - DAY // 2), "voidedSource": 0, "voidedReason": 1, "refundType": 2}))
    status, answer = push(rtdn("voidedPurchaseNotification", void_note))
    check(status == 200 and answer.get("ignored") == "partial_refund" and premium("judy")["isActive"], "a partial refund (as Google lists it) leaves access: %r" % (answer,))
    fake.voided[-1][1]["refundType"] = 1
    status, answer = push(rtdn("voidedPurchaseNotification", void_note))
    entitlement = premium("judy")
    check(status == 200 and not entitlement["isActive"] and entitlement["isRevoked"], "a full refund revokes: %r" % (answer,))
    check(entitlement["transactions"][-1]["revocationDate"] == rfc3339(NOW - DAY // 2), "at Google's voidedTimeMillis, not the notification's time")

    # Identity: no account id and no alias waits (503), and applies once the alias is linked.
    fake.set_subscription(PACKAGE, "tok-anon", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.8000-0000-0000-00001"))
    status, answer = push(sub_note("tok-anon", 4))
    check(status == 503 and answer.get("reason") == "unknown_identity", "a purchase naming nobody is refused 503: %r" % (answer,))
    check(not any("tok-anon" in p for p in fake.acknowledged), "and it is not acknowledged")
    link("leo", "googleplay:tok-anon")
    status, answer = push(sub_note("tok-anon", 4))
    check(status == 200 and answer.get("customerId") == "leo" and premium("leo")["isActive"], "linked, the redelivery applies")

    # Unknown tokens.
    status, answer = push(sub_note("tok-nobody", 4))
    check(status == 400 and answer.get("reason") == "unknown_token", "a token Google does not know (404): %r" % (answer,))
    fake.set_subscription(PACKAGE, "tok-gone", subscription("SUBSCRIPTION_STATE_EXPIRED", NOW - 90 * DAY, "GPA.8100-0000-0000-00001", account="mia"))
    fake.fail["tok-gone"] = 410
    status, answer = push(sub_note("tok-gone", 13))
    check(status == 400 and answer.get("reason") == "unknown_token", "a token no longer valid (410): %r" % (answer,))
    del fake.fail["tok-gone"]

    # A failing acknowledgement: the writes stay, the answer asks for the redelivery, which acknowledges.
    fake.set_subscription(PACKAGE, "tok-nick", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9000-0000-0000-00001", account="nick"))
    fake.fail["tok-nick:acknowledge"] = 400
    status, answer = push(sub_note("tok-nick", 4))
    check(status == 503 and answer.get("reason") == "acknowledge_failed" and premium("nick")["isActive"], "a failed acknowledgement answers 503, the writes durable: %r" % (answer,))
    check(metric("entitlements_googleplay_acknowledgements_total", outcome="failed") >= 1, "and is counted")
    del fake.fail["tok-nick:acknowledge"]
    status, answer = push(sub_note("tok-nick", 4))
    check(status == 200 and answer.get("changed") is False and any("tok-nick:acknowledge" in p for p in fake.acknowledged), "the redelivery acknowledges it")

    # Google down: 503, then a back-off during which Google is not called.
    fake.set_subscription(PACKAGE, "tok-olga", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9100-0000-0000-00001", account="olga"))
    fake.fail["/androidpublisher/"] = 503
    status, answer = push(sub_note("tok-olga", 4))
    calls = fake.calls("tok-olga")
    status2, answer2 = push(sub_note("tok-olga", 4))
    check(status == 503 and answer.get("reason") == "store_unavailable", "the API down: 503 store_unavailable: %r" % (answer,))
    check(status2 == 503 and fake.calls("tok-olga") == calls, "during the back-off Google is not called: %r" % (answer2,))
    fake.fail.clear()
    time.sleep(1.2)
    status, answer = push(sub_note("tok-olga", 4))
    check(status == 200 and premium("olga")["isActive"], "after the back-off the redelivery applies: %r" % (answer,))
    fake.fail["/androidpublisher/"] = 429
    status, answer = push(sub_note("tok-olga", 2))
    check(status == 503 and answer.get("reason") == "store_unavailable", "a quota error (429) backs off too")
    fake.fail.clear()
    time.sleep(1.2)

    # Concurrent notifications for one token share the API's answer. Google takes 0.5 s to
    # answer here, so that all 12 arrive while the first call is out even on a loaded
    # machine (answered at once, a late thread's notification came after it: a call more).
    fake.set_subscription(PACKAGE, "tok-burst", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9200-0000-0000-00001", account="pete"))
    fake.delay["subscriptionsv2/tokens/tok-burst"] = 0.5
    results = []
    threads = [threading.Thread(target=lambda: results.append(push(sub_note("tok-burst", 4))[0])) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    check(results == [200] * 12 and fake.calls("subscriptionsv2/tokens/tok-burst") <= 2, "12 concurrent notifications: %d API calls" % fake.calls("subscriptionsv2/tokens/tok-burst"))
    fake.delay.clear()

    # Every order of a chain's notifications ends in the same state. Google's answer is the
    # state when the notification is read: notification k is sent once state k is reached,
    # and read when it is delivered, by which time the state is the latest of those sent
    # before it was delivered. So each order reads a different sequence of states; all
    # must end where the subscription is. (Which periods a late reader saw differs: the
    # history fields are left out of the comparison.)
    def state_k(k):
        return [
            subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 5 * DAY, "GPA.9300-0000-0000-00001", start=NOW - 25 * DAY),
            subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 35 * DAY, "GPA.9300-0000-0000-00001..0", start=NOW - 25 * DAY, ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"),
            subscription("SUBSCRIPTION_STATE_CANCELED", NOW + 35 * DAY, "GPA.9300-0000-0000-00001..0", start=NOW - 25 * DAY, auto_renew=False,
                         canceled="userInitiatedCancellation", ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"),
            subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 35 * DAY, "GPA.9300-0000-0000-00001..0", start=NOW - 25 * DAY, ack="ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"),
        ][k]
    types = [4, 2, 3, 7]  # purchased, renewed, canceled, restarted
    history = ("transactions", "renewsCount", "startedDate", "firstPurchaseDate", "lastPurchaseDate", "trialStartDate", "billingIssueDetectedDate")
    answers = set()
    reads = set()
    for number, order in enumerate(itertools.permutations(range(4))):
        token, user = "tok-perm-%02d" % number, "perm-%02d" % number
        seen = []
        for k in order:
            latest = max([k] + seen)
            seen.append(k)
            resource = state_k(latest)
            resource["externalAccountIdentifiers"] = {"obfuscatedExternalAccountId": user}
            fake.set_subscription(PACKAGE, token, resource)
            status, _ = push(sub_note(token, types[k]))
            assert status == 200
        reads.add(tuple(max(seen[:i + 1]) for i in range(4)))
        answer = check_user(user, at=NOW + 30 * DAY)
        answers.add(json.dumps({k: {f: v for f, v in e.items() if f not in history} for k, e in answer["entitlements"].items()}, sort_keys=True).replace(token, "TOKEN"))
    check(len(answers) == 1 and len(reads) > 4, "24 orders of four notifications, reading %d different sequences of states, end in one state (%d distinct)" % (len(reads), len(answers)))

    # Pull: the same notification through Pub/Sub; acknowledged to Pub/Sub once applied.
    fake.set_subscription(PACKAGE, "tok-pull", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9400-0000-0000-00001", account="quinn"))
    fake.publish(json.dumps(sub_note("tok-pull", 4)).encode())
    fake.set_subscription(PACKAGE, "tok-pull-anon", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9500-0000-0000-00001"))
    waiting = fake.publish(json.dumps(sub_note("tok-pull-anon", 4)).encode())
    for _ in range(100):
        if "premium" in check_user("quinn")["entitlements"]:
            break
        time.sleep(0.1)
    for _ in range(100):                     # the acknowledgement follows the write
        with fake.lock:
            left = list(fake.pubsub)
        if left == [waiting]:
            break
        time.sleep(0.1)
    check(premium("quinn")["isActive"], "a pulled notification is applied")
    check(left == [waiting], "the applied message is acknowledged to Pub/Sub, the retried one is not: %r" % left)
    link("rosa", "googleplay:tok-pull-anon")
    for _ in range(100):
        with fake.lock:
            if not fake.pubsub:
                break
        time.sleep(0.1)
    check(premium("rosa") and premium("rosa")["isActive"] and not fake.pubsub, "the retried message is pulled again after its deadline and applied")

    # JWKS rotation: a token under a new kid refetches Google's keys once.
    fetches = fake.jwks_fetches
    fake.jwks_keys = [(push_key.public_key(), "push-1"), (rotated_key.public_key(), "push-2")]
    status, answer = push(rtdn("testNotification", {}), token=push_token(key=rotated_key, kid="push-2"))
    check(status == 200 and fake.jwks_fetches == fetches + 1, "an unknown kid refetches the JWKS: %d -> %d" % (fetches, fake.jwks_fetches))
    status, answer = push(rtdn("testNotification", {}), token=push_token(key=stranger_key, kid="push-3"))
    check(status == 401 and fake.jwks_fetches == fetches + 1, "another unknown kid within 5 s does not refetch")

    # Metrics by store, outcome and reason.
    check(metric("entitlements_webhook_events_total", store="googleplay", outcome="applied") >= 10, "applied events are counted")
    check(metric("entitlements_webhook_events_total", store="googleplay", outcome="rejected", reason="unauthenticated") >= 5, "401s are counted by reason")
    check(metric("entitlements_webhook_events_total", store="googleplay", outcome="retry", reason="unknown_identity") >= 1, "retries are counted by reason")

    # SubmitPurchase: the token the app holds, read back from Google, recorded, answered.
    def submit(user, token, product="premium_sub", package=PACKAGE, on=None):  # noqa: E306
        return post((on or server).grpc, "/entitlements.v1.EntitlementService/SubmitPurchase",
                    {"userId": user, "googlePlay": {"packageName": package, "productId": product, "purchaseToken": token}})

    fake.set_subscription(PACKAGE, "tok-vera", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9900-0000-0000-00001"))
    acknowledged = len(fake.acknowledged)
    status, answer = submit("vera", "tok-vera")
    check(status == 200 and answer["changed"] is True and answer["linkedAlias"] == "googleplay:tok-vera" and answer["customerId"] == "vera"
          and answer["entitlements"]["entitlements"]["premium"]["isActive"], "SubmitPurchase records a Play subscription and answers at once: %r" % (answer,))
    check(len(fake.acknowledged) == acknowledged + 1, "and acknowledges it")
    status, answer = submit("vera", "tok-vera")
    check(status == 200 and answer["changed"] is False, "submitted again, it changes nothing")
    status, answer = push(sub_note("tok-vera", 2))
    check(status == 200 and answer.get("customerId") == "vera" and answer.get("changed") is False, "its notification then finds the user and changes nothing: %r" % (answer,))
    status, answer = submit("wes", "tok-alice")
    check(status == 403 and answer.get("code") == "permission_denied", "a purchase whose account id names another customer is refused: %r" % (answer,))
    status, answer = submit("alice", "tok-alice")
    check(status == 200 and answer["changed"] is False, "notified, then submitted by its customer: the same record")
    status, answer = submit("wes", "tok-nobody")
    check(status == 404 and answer.get("code") == "not_found", "a token Google does not know: not_found: %r" % (answer,))
    status, answer = submit("wes", "tok-vera", product="other_sub")
    check(status == 400 and "not to other_sub" in answer.get("message", ""), "a token of another product: invalid_argument: %r" % (answer,))
    status, answer = submit("wes", "tok-vera", package="com.other.app")
    check(status == 400 and "com.other.app" in answer.get("message", ""), "another package: invalid_argument: %r" % (answer,))
    # The account id must be the user or name the user's customer; a replaced purchase's
    # owner keeps the new one.
    fake.set_subscription(PACKAGE, "tok-zed", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9920-0000-0000-00001", account="hash-of-zed"))
    status, answer = submit("zed", "tok-zed")
    check(status == 403 and "names no customer" in answer.get("message", ""), "an account id that names nobody is refused: %r" % (answer,))
    link("zed", "hash-of-zed")
    status, answer = submit("zed", "tok-zed")
    check(status == 200 and answer["changed"] is True, "linked to the user first, it is taken")
    fake.set_subscription(PACKAGE, "tok-v1", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9930-0000-0000-00001", account="vince"))
    push(sub_note("tok-v1", 4))
    fake.set_subscription(PACKAGE, "tok-v2", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 50 * DAY, "GPA.9931-0000-0000-00001", linked="tok-v1", base_plan="yearly"))
    status, answer = submit("mallory", "tok-v2")
    check(status == 403 and "belongs to another customer" in answer.get("message", "") and "vince" not in answer.get("message", ""),
          "the upgrade of another customer's purchase is refused, the customer not named: %r" % (answer,))
    fake.set_subscription(PACKAGE, "tok-sandbox", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9940-0000-0000-00001", test=True))
    status, answer = submit("tina", "tok-sandbox")
    check(status == 200 and answer["environment"] == "sandbox" and answer["entitlements"]["entitlements"]["premium"]["isActive"],
          "a test purchase is answered for the sandbox, and says so: %r" % (answer.get("environment"),))
    fake.set_product(PACKAGE, "lifetime", "tok-pend", {"purchaseTimeMillis": str(NOW), "purchaseState": 2, "acknowledgementState": 0})
    status, answer = submit("tina", "tok-pend", product="lifetime")
    check(status == 200 and answer["changed"] is False and answer["ignored"] == "pending", "a pending purchase is not recorded, and the answer says why: %r" % (answer.get("ignored"),))
    result = subprocess.run([ENT, "submit-purchase", "--server", "127.0.0.1:%d" % server.tcp, "--user", "tina", "--appstore-jws", "-"],
                            input="eyJhbGciOiJFUzI1NiJ9.e30.c2ln\n", capture_output=True, text=True, timeout=30)
    check(result.returncode == 1 and "App Store purchases are not verified by this server" in result.stdout,
          "the CLI reads the JWS from standard input and the server says what it lacks: %s" % (result.stdout + result.stderr).strip())
    fake.set_product(PACKAGE, "lifetime", "tok-xena", {"purchaseTimeMillis": str(NOW - DAY), "purchaseState": 0, "acknowledgementState": 0, "orderId": "GPA.9910-0000-0000-00001"})
    result = subprocess.run([ENT, "submit-purchase", "--server", "127.0.0.1:%d" % server.tcp, "--user", "xena", "--googleplay-token", "tok-xena",
                             "--product", "lifetime", "--package", PACKAGE, "--json"], capture_output=True, text=True, timeout=30)
    answer = json.loads(result.stdout) if result.returncode == 0 else {}
    check(answer.get("changed") is True and answer["entitlements"]["entitlements"]["premium"]["isActive"], "the CLI submits a one-time product over the framed protocol: %s %s" % (result.stdout, result.stderr))
    result = subprocess.run([ENT, "submit-purchase", "--server", "127.0.0.1:%d" % server.tcp, "--user", "xena", "--googleplay-token", "tok-xena"], capture_output=True, text=True, timeout=30)
    check(result.returncode != 0 and "--googleplay-token needs --product" in result.stdout + result.stderr, "the CLI says what a Play purchase needs")
    check(metric("entitlements_submitted_purchases_total", store="googleplay", outcome="applied") >= 2
          and metric("entitlements_submitted_purchases_total", store="googleplay", outcome="rejected", reason="other_customer") == 3, "submissions are counted by outcome and reason")

    # kill -9 right after a notification was answered: nothing acknowledged is lost.
    fake.set_subscription(PACKAGE, "tok-sam", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9600-0000-0000-00001", account="sam"))
    status, answer = push(sub_note("tok-sam", 4))
    server.stop(signal.SIGKILL)
    server = Server(pull=False)
    check(status == 200 and premium("sam")["isActive"] and premium("alice")["isActive"] and premium("judy")["isRevoked"],
          "after kill -9 every answered notification is still applied")
    status, answer = push(sub_note("tok-sam", 4))
    check(status == 200 and answer.get("changed") is False, "and its redelivery changes nothing")
    server.stop()

    # MARK: Fleet mode: two servers on one PostgreSQL; answered only after the commit.
    postgres = Postgres()
    try:
        subprocess.run([ENT, "db", "migrate", "--postgres", postgres.url], check=True, capture_output=True)
        subprocess.run([ENT, "db", "import", "--postgres", postgres.url, "--snapshot", os.path.join(WORK, "seed.snap")], check=True, capture_output=True)
        fleet = ["--postgres", postgres.url, "--fleet-poll-interval", "50ms"]
        a = server = Server(data="fleet-a", pull=False, extra=fleet)
        b = Server(data="fleet-b", pull=False, extra=fleet)
        fake.set_subscription(PACKAGE, "tok-fleet", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9700-0000-0000-00001", account="tess"))
        acknowledged = len(fake.acknowledged)
        status, answer = push(sub_note("tok-fleet", 4), to=a)
        check(status == 200 and answer.get("changed") is True and len(fake.acknowledged) == acknowledged + 1, "fleet: a purchase through A is applied and acknowledged: %r" % (answer,))
        seen = None
        for _ in range(100):
            seen = check_user("tess", on=b).get("entitlements", {}).get("premium")
            if seen:
                break
            time.sleep(0.05)
        check(seen is not None and seen["isActive"], "fleet: B answers it from PostgreSQL")
        status, answer = push(sub_note("tok-fleet", 4), to=b)
        check(status == 200 and answer.get("changed") is False, "fleet: its redelivery to B changes nothing: %r" % (answer,))
        a.stop(signal.SIGKILL)
        server = b
        fake.set_subscription(PACKAGE, "tok-fleet-2", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9800-0000-0000-00001", account="uma"))
        postgres.stop()
        acknowledged = len(fake.acknowledged)
        status, answer = push(sub_note("tok-fleet-2", 4), to=b)
        check(status == 503 and answer.get("reason") == "write_failed" and len(fake.acknowledged) == acknowledged,
              "fleet: PostgreSQL down, the notification is refused 503 and the purchase not acknowledged: %r" % (answer,))
        postgres.start()
        for _ in range(100):
            status, answer = push(sub_note("tok-fleet-2", 4), to=b)
            if status == 200:
                break
            time.sleep(0.2)
        check(status == 200 and premium("uma", on=b)["isActive"] and len(fake.acknowledged) == acknowledged + 1,
              "fleet: PostgreSQL back, the redelivery applies and acknowledges: %r" % (answer,))
        fake.set_subscription(PACKAGE, "tok-fleet-3", subscription("SUBSCRIPTION_STATE_ACTIVE", NOW + 20 * DAY, "GPA.9810-0000-0000-00001"))
        status, answer = submit("yuri", "tok-fleet-3", on=b)
        check(status == 200 and answer["changed"] is True and answer["entitlements"]["entitlements"]["premium"]["isActive"],
              "fleet: SubmitPurchase answers after the PostgreSQL commit: %r" % (answer.get("logSequence"),))
        b.stop()
    finally:
        postgres.remove()
finally:
    try:
        server.stop()
    except Exception:  # noqa: BLE001
        pass
    fake.stop()
    if FAILURES:
        for name in sorted(os.listdir(WORK)):
            if name.startswith("serve-"):
                print("---- " + name)
                print(open(os.path.join(WORK, name)).read()[-4000:])
    shutil.rmtree(WORK, ignore_errors=True)

print("googleplay: %d failed" % len(FAILURES) if FAILURES else "googleplay: all passed")
sys.exit(1 if FAILURES else 0)
