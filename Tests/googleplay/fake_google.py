"""A loopback stand-in for the Google services the server calls, built from Google's
published documents, and as strict as they are about what it is sent:

- OAuth 2.0 token endpoint for service accounts (developers.google.com/identity/protocols/
  oauth2/service-account): a form POST with grant_type jwt-bearer and an RS256 assertion,
  verified with the service account's public key: iss the account's email, aud the token
  URI, a scope, iat/exp at most an hour apart and current, kid the key's id.
- Google's JWKS (oauth2/v3/certs) with the keys that sign the Pub/Sub push tokens, served
  with Cache-Control max-age; the test rotates keys.
- The Play Developer API (androidpublisher v3): purchases.subscriptionsv2.get,
  purchases.products.get, purchases.voidedpurchases.list (startTime, type, maxResults,
  token pages of two), purchases.subscriptions.acknowledge and
  purchases.products.acknowledge, every call needing a bearer token it issued; the
  resources are set per token by the test, and can be made to fail (404, 410, 429, 503).
- Pub/Sub's REST pull and acknowledge (projects.subscriptions.pull / .acknowledge): messages
  published by the test are handed out with ack ids and handed out again after an ack
  deadline unless acknowledged.

Tokens and keys are made by the test with openssl; nothing here talks beyond 127.0.0.1."""
import base64
import json
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text):
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_jwt(private_key, kid, claims, alg="RS256"):
    """An RS256 JWT, as Google signs its OIDC tokens."""
    header = b64url(json.dumps({"alg": alg, "kid": kid, "typ": "JWT"}).encode())
    payload = b64url(json.dumps(claims).encode())
    signature = private_key.sign((header + "." + payload).encode(), padding.PKCS1v15(), hashes.SHA256())
    return header + "." + payload + "." + b64url(signature)


def jwk(public_key, kid):
    numbers = public_key.public_numbers()
    n = numbers.n.to_bytes((numbers.n.bit_length() + 7) // 8, "big")
    e = numbers.e.to_bytes((numbers.e.bit_length() + 7) // 8, "big")
    return {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": kid, "n": b64url(n), "e": b64url(e)}


class FakeGoogle:
    ACK_DEADLINE = 1.5

    def __init__(self, account_email, account_key_id, account_public_pem):
        self.lock = threading.Lock()
        self.account_email = account_email
        self.account_key_id = account_key_id
        self.account_public = serialization.load_pem_public_key(account_public_pem)
        self.access_tokens = set()
        self.token_exchanges = 0
        self.token_failures = []  # why each refused exchange was refused
        self.jwks_keys = []  # (public_key, kid)
        self.jwks_fetches = 0
        self.subscriptions = {}  # (package, token) -> resource
        self.products = {}  # (package, product, token) -> resource
        self.voided = []  # (package, VoidedPurchase resource)
        self.api_calls = {}  # path -> count
        self.fail = {}  # path fragment -> HTTP status to answer instead
        self.delay = {}  # path fragment -> seconds to take before answering (Google's latency)
        self.acknowledged = []  # paths
        self.ack_bodies = []
        self.pubsub = {}  # ack_id -> [message, handed_out_at or None]
        self.pubsub_acks = 0
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = "http://127.0.0.1:%d" % self.port
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    # What the test sets.

    def set_subscription(self, package, token, resource):
        with self.lock:
            self.subscriptions[(package, token)] = resource

    def set_product(self, package, product, token, resource):
        with self.lock:
            self.products[(package, product, token)] = resource

    def publish(self, data_bytes):
        """Puts a message on the pull subscription."""
        with self.lock:
            ack_id = "ack-" + secrets.token_hex(8)
            message = {"data": base64.b64encode(data_bytes).decode(), "messageId": secrets.token_hex(6), "publishTime": "2026-01-01T00:00:00Z"}
            self.pubsub[ack_id] = [message, None]
        return ack_id

    def calls(self, fragment):
        with self.lock:
            return sum(count for path, count in self.api_calls.items() if fragment in path)

    # The server.

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body, headers=None):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status, message):
                self._send(status, {"error": {"code": status, "message": message, "status": "ERROR"}})

            def _body(self):
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _authorized(self):
                auth = self.headers.get("Authorization", "")
                with fake.lock:
                    ok = auth.startswith("Bearer ") and auth[7:] in fake.access_tokens
                if not ok:
                    self._error(401, "Request had invalid authentication credentials.")
                return ok

            def _admitted(self, path):
                """An API call with one of our access tokens, counted; false when it was
                answered already (401, or the failure the test set for the path)."""
                if not self._authorized():
                    return False
                with fake.lock:
                    fake.api_calls[path] = fake.api_calls.get(path, 0) + 1
                    failing = [status for fragment, status in fake.fail.items() if fragment in path]
                    delays = [seconds for fragment, seconds in fake.delay.items() if fragment in path]
                if delays:
                    time.sleep(delays[0])
                if failing:
                    self._error(failing[0], "failing as the test asked")
                    return False
                return True

            def do_GET(self):
                path = urllib.parse.urlparse(self.path).path
                if path == "/oauth2/v3/certs":
                    with fake.lock:
                        fake.jwks_fetches += 1
                        keys = [jwk(public, kid) for public, kid in fake.jwks_keys]
                    return self._send(200, {"keys": keys}, {"Cache-Control": "public, max-age=3600"})
                if not self._admitted(path):
                    return
                parts = [urllib.parse.unquote(p) for p in path.split("/")]
                # /androidpublisher/v3/applications/PKG/purchases/voidedpurchases
                if len(parts) == 7 and parts[5:7] == ["purchases", "voidedpurchases"]:
                    return self._voided(parts[4])
                # /androidpublisher/v3/applications/PKG/purchases/subscriptionsv2/tokens/TOKEN
                if len(parts) == 9 and parts[1:4] == ["androidpublisher", "v3", "applications"] and parts[5:8] == ["purchases", "subscriptionsv2", "tokens"]:
                    with fake.lock:
                        resource = fake.subscriptions.get((parts[4], parts[8]))
                    if resource is None:
                        return self._error(404, "The purchase token was not found.")
                    return self._send(200, resource)
                # /androidpublisher/v3/applications/PKG/purchases/products/PRODUCT/tokens/TOKEN
                if len(parts) == 10 and parts[5:7] == ["purchases", "products"] and parts[8] == "tokens":
                    with fake.lock:
                        resource = fake.products.get((parts[4], parts[7], parts[9]))
                    if resource is None:
                        return self._error(404, "The purchase token was not found.")
                    return self._send(200, resource)
                self._error(404, "no such resource: " + path)

            def do_POST(self):
                path = urllib.parse.urlparse(self.path).path
                body = self._body()
                if path == "/token":
                    return self._token(body)
                if not self._admitted(path):
                    return
                if path.endswith(":acknowledge") and path.startswith("/androidpublisher/"):
                    return self._acknowledge(path, body)
                if path.endswith(":pull"):
                    return self._pull(body)
                if path.endswith(":acknowledge") and path.startswith("/v1/"):
                    ack_ids = json.loads(body)["ackIds"]
                    with fake.lock:
                        for ack_id in ack_ids:
                            fake.pubsub.pop(ack_id, None)
                        fake.pubsub_acks += len(ack_ids)
                    return self._send(200, {})
                self._error(404, "no such method: " + path)

            def _voided(self, package):
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                try:
                    start = int(query["startTime"][0])
                    if query.get("type") != ["1"] or int(query.get("maxResults", ["1000"])[0]) > 1000:
                        raise ValueError
                    page = int(query.get("token", ["0"])[0])
                except (KeyError, ValueError):
                    return self._error(400, "Invalid value for startTime, type or maxResults.")
                with fake.lock:
                    listed = [v for p, v in fake.voided if p == package and int(v["voidedTimeMillis"]) >= start]
                chunk = listed[page * 2: page * 2 + 2]  # pages of two, to make the server follow them
                body = {"voidedPurchases": chunk}
                if len(listed) > page * 2 + 2:
                    body["tokenPagination"] = {"nextPageToken": str(page + 1)}
                self._send(200, body)

            def _token(self, body):
                form = urllib.parse.parse_qs(body.decode())
                why = None
                try:
                    if self.headers.get("Content-Type", "").split(";")[0] != "application/x-www-form-urlencoded":
                        raise ValueError("not a form")
                    if form.get("grant_type") != ["urn:ietf:params:oauth:grant-type:jwt-bearer"]:
                        raise ValueError("grant_type")
                    header_b64, claims_b64, signature_b64 = form["assertion"][0].split(".")
                    header = json.loads(unb64url(header_b64))
                    claims = json.loads(unb64url(claims_b64))
                    if header.get("alg") != "RS256" or header.get("kid") != fake.account_key_id:
                        raise ValueError("header %r" % header)
                    fake.account_public.verify(unb64url(signature_b64), (header_b64 + "." + claims_b64).encode(), padding.PKCS1v15(), hashes.SHA256())
                    now = time.time()
                    if claims.get("iss") != fake.account_email or claims.get("aud") != fake.url + "/token":
                        raise ValueError("iss/aud %r" % claims)
                    if "https://www.googleapis.com/auth/androidpublisher" not in claims.get("scope", "").split():
                        raise ValueError("scope")
                    if not (claims["iat"] - 300 <= now < claims["exp"] and claims["exp"] - claims["iat"] <= 3600):
                        raise ValueError("iat/exp")
                except Exception as error:  # noqa: BLE001 - every failure is a refused grant
                    why = str(error) or type(error).__name__
                if why:
                    with fake.lock:
                        fake.token_failures.append(why)
                    return self._send(400, {"error": "invalid_grant", "error_description": "Invalid JWT Signature."})
                token = "ya29." + secrets.token_urlsafe(24)
                with fake.lock:
                    fake.access_tokens.add(token)
                    fake.token_exchanges += 1
                self._send(200, {"access_token": token, "expires_in": 3599, "token_type": "Bearer"})

            def _acknowledge(self, path, body):
                try:
                    json.loads(body or b"{}")
                except ValueError:
                    return self._error(400, "the body is not JSON")
                parts = [urllib.parse.unquote(p) for p in path[: -len(":acknowledge")].split("/")]
                package, kind, product, token = parts[4], parts[6], parts[7], parts[9]
                with fake.lock:
                    if kind == "subscriptions":
                        resource = fake.subscriptions.get((package, token))
                        if resource is None or all(item.get("productId") != product for item in resource.get("lineItems", [])):
                            return self._error(404, "The purchase token was not found.")
                        resource["acknowledgementState"] = "ACKNOWLEDGEMENT_STATE_ACKNOWLEDGED"
                    else:
                        resource = fake.products.get((package, product, token))
                        if resource is None:
                            return self._error(404, "The purchase token was not found.")
                        resource["acknowledgementState"] = 1
                    fake.acknowledged.append(path)
                self._send(200, {})

            def _pull(self, body):
                maximum = json.loads(body).get("maxMessages", 1)
                now = time.time()
                out = []
                with fake.lock:
                    for ack_id, entry in fake.pubsub.items():
                        if len(out) >= maximum:
                            break
                        if entry[1] is None or now - entry[1] > FakeGoogle.ACK_DEADLINE:
                            entry[1] = now
                            out.append({"ackId": ack_id, "message": entry[0], "deliveryAttempt": 1})
                self._send(200, {"receivedMessages": out} if out else {})

        return Handler
