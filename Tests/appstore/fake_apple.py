"""A loopback stand-in for Apple's App Store Server API, built from Apple's published
documents (developer.apple.com/documentation/appstoreserverapi), and as strict as Apple is
about what it is sent:

- Every call needs `Authorization: Bearer` with a JWT as "Generating JSON Web Tokens for API
  requests" describes: header alg ES256, kid the key's id, typ JWT; payload iss the issuer
  id, aud appstoreconnect-v1, bid the app's bundle id, iat not in the future, exp after now
  and at most 60 minutes after iat; signed with the in-app purchase key (.p8) the test made
  with openssl. Anything else is 401, with the reason kept for the test to read.
- GET /inApps/v1/subscriptions/{transactionId} (Get All Subscription Statuses): the
  customer's subscriptions grouped by subscriptionGroupIdentifier, each chain's latest
  transaction and renewal info as JWS, and its status (1 active, 2 expired, 3 billing
  retry, 4 grace period, 5 revoked).
- GET /inApps/v2/history/{transactionId} (Get Transaction History v2): every transaction
  of the customer, `sort` ASCENDING or DESCENDING, 20 a page, `revision` the opaque token
  of the next page, `hasMore`.
- Transaction ids are digits (400 errorCode 4000006 otherwise); an unknown one is 404
  errorCode 4040010. Production is served at /, the sandbox at /sandbox (two hosts at
  Apple); a transaction lives in one of them.
- The test can make calls fail (429 errorCode 4290000, 500), by a fragment of
  "Production:/path" or "Sandbox:/path" (a path alone fails it in both), and reads the
  calls made.

The JWS are signed as Apple signs them: ES256 with an x5c chain (leaf, intermediate, root)
made by the test with openssl. Nothing here talks beyond 127.0.0.1."""
import base64
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text):
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class AppleSigner:
    """Signs JWS as Apple does: ES256, the x5c chain in the header."""

    def __init__(self, leaf_key, chain_der):
        self.key = leaf_key
        self.x5c = [base64.b64encode(der).decode() for der in chain_der]

    def sign(self, payload, key=None, x5c=None, alg="ES256"):
        header = b64url(json.dumps({"alg": alg, "x5c": x5c or self.x5c}).encode())
        body = b64url(json.dumps(payload).encode())
        der = (key or self.key).sign((header + "." + body).encode(), ec.ECDSA(hashes.SHA256()))
        r, s = decode_dss_signature(der)
        return header + "." + body + "." + b64url(r.to_bytes(32, "big") + s.to_bytes(32, "big"))


class FakeApple:
    PAGE = 20

    def __init__(self, signer, key_id, issuer_id, api_public_pem, bundle_id):
        self.lock = threading.Lock()
        self.signer = signer
        self.key_id = key_id
        self.issuer_id = issuer_id
        self.api_public = serialization.load_pem_public_key(api_public_pem)
        self.bundle_id = bundle_id
        # environment ("Production", "Sandbox") -> list of transaction payloads, each with
        # "_account" (the Apple account) and, for subscriptions, "_group"
        self.transactions = {"Production": [], "Sandbox": []}
        self.renewals = {}  # (environment, originalTransactionId) -> renewal payload
        self.calls = []  # (environment, path)
        self.refused = []  # why each refused token was refused
        self.fail = {}  # path fragment -> HTTP status
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = "http://127.0.0.1:%d" % self.port
        self.sandbox_url = self.url + "/sandbox"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def add(self, environment, account, transaction, group=None):
        with self.lock:
            self.transactions[environment].append(dict(transaction, _account=account, _group=group))

    def set_renewal(self, environment, original, renewal):
        with self.lock:
            self.renewals[(environment, original)] = renewal

    def calls_to(self, fragment):
        with self.lock:
            return sum(1 for _, path in self.calls if fragment in path)

    # MARK: Authentication

    def authenticate(self, header):
        """Why the bearer token is refused, or None."""
        if not header or not header.startswith("Bearer "):
            return "no bearer token"
        parts = header[len("Bearer "):].split(".")
        if len(parts) != 3:
            return "not a JWT"
        try:
            head = json.loads(unb64url(parts[0]))
            claims = json.loads(unb64url(parts[1]))
            raw = unb64url(parts[2])
        except ValueError:
            return "not a JWT"
        if head.get("alg") != "ES256" or head.get("typ") != "JWT":
            return "header alg %r typ %r" % (head.get("alg"), head.get("typ"))
        if head.get("kid") != self.key_id:
            return "kid %r" % head.get("kid")
        if len(raw) != 64:
            return "signature is not r||s"
        try:
            der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
            self.api_public.verify(der, (parts[0] + "." + parts[1]).encode(), ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return "bad signature"
        now = time.time()
        if claims.get("iss") != self.issuer_id:
            return "iss %r" % claims.get("iss")
        if claims.get("aud") != "appstoreconnect-v1":
            return "aud %r" % claims.get("aud")
        if claims.get("bid") != self.bundle_id:
            return "bid %r" % claims.get("bid")
        iat, exp = claims.get("iat"), claims.get("exp")
        if not isinstance(iat, int) or not isinstance(exp, int) or iat > now + 60 or exp <= now or exp - iat > 3600:
            return "iat %r exp %r" % (iat, exp)
        return None

    # MARK: The API

    def signed(self, payload):
        clean = {k: v for k, v in payload.items() if not k.startswith("_")}
        clean["signedDate"] = int(time.time() * 1000)
        return self.signer.sign(clean)

    def customer_of(self, environment, transaction_id):
        for t in self.transactions[environment]:
            if t["transactionId"] == transaction_id or t["originalTransactionId"] == transaction_id:
                return t["_account"]
        return None

    def status(self, environment, latest, renewal):
        now = time.time() * 1000
        if latest.get("revocationDate"):
            return 5
        if latest.get("expiresDate", 0) > now:
            return 1
        if renewal and renewal.get("isInBillingRetryPeriod"):
            return 4 if renewal.get("gracePeriodExpiresDate", 0) > now else 3
        return 2

    def statuses(self, environment, account):
        groups = {}
        chains = {}
        for t in self.transactions[environment]:
            if t["_account"] == account and t.get("type") == "Auto-Renewable Subscription":
                known = chains.get(t["originalTransactionId"])
                if known is None or t["expiresDate"] > known["expiresDate"]:
                    chains[t["originalTransactionId"]] = t
        for original, latest in sorted(chains.items()):
            renewal = self.renewals.get((environment, original))
            item = {"originalTransactionId": original, "status": self.status(environment, latest, renewal),
                    "signedTransactionInfo": self.signed(latest)}
            if renewal:
                item["signedRenewalInfo"] = self.signed(dict(renewal, originalTransactionId=original, environment=environment))
            groups.setdefault(latest.get("_group") or "group-1", []).append(item)
        return {"environment": environment, "bundleId": self.bundle_id, "appAppleId": 1234567890,
                "data": [{"subscriptionGroupIdentifier": g, "lastTransactions": items} for g, items in sorted(groups.items())]}

    def history(self, environment, account, query):
        mine = [t for t in self.transactions[environment] if t["_account"] == account]
        mine.sort(key=lambda t: (t["purchaseDate"], t["transactionId"]), reverse=query.get("sort", ["ASCENDING"])[0] == "DESCENDING")
        start = 0
        if "revision" in query:
            try:
                start = int(unb64url(query["revision"][0]).decode().split(":")[1])
            except (ValueError, IndexError):
                return 400, {"errorCode": 4000005, "errorMessage": "Invalid revision."}
        page = mine[start:start + self.PAGE]
        more = start + self.PAGE < len(mine)
        return 200, {"revision": b64url(("offset:%d" % (start + len(page))).encode()), "hasMore": more, "bundleId": self.bundle_id,
                     "appAppleId": 1234567890, "environment": environment, "signedTransactions": [self.signed(t) for t in page]}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status, body=None):
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                url = urllib.parse.urlsplit(self.path)
                path = url.path
                environment = "Production"
                if path.startswith("/sandbox/"):
                    environment, path = "Sandbox", path[len("/sandbox"):]
                query = urllib.parse.parse_qs(url.query)
                with fake.lock:
                    fake.calls.append((environment, path))
                    failing = next((status for fragment, status in fake.fail.items() if fragment in environment + ":" + path), None)
                why = fake.authenticate(self.headers.get("Authorization"))
                if why:
                    with fake.lock:
                        fake.refused.append(why)
                    return self.answer(401)
                if failing:
                    return self.answer(failing, {"errorCode": 4290000 if failing == 429 else 5000000, "errorMessage": "Rate limit exceeded." if failing == 429 else "An unknown error occurred."})
                for prefix, kind in (("/inApps/v1/subscriptions/", "statuses"), ("/inApps/v2/history/", "history")):
                    if path.startswith(prefix):
                        transaction_id = urllib.parse.unquote(path[len(prefix):])
                        break
                else:
                    return self.answer(404, {"errorCode": 4040000, "errorMessage": "Not found."})
                if not transaction_id.isdigit():
                    return self.answer(400, {"errorCode": 4000006, "errorMessage": "Invalid transaction id."})
                with fake.lock:
                    account = fake.customer_of(environment, transaction_id)
                    if account is None:
                        return self.answer(404, {"errorCode": 4040010, "errorMessage": "Transaction id not found."})
                    if kind == "statuses":
                        return self.answer(200, fake.statuses(environment, account))
                    status, body = fake.history(environment, account, query)
                return self.answer(status, body)

        return Handler
