"""A real HTTP receiver of the outbound events, as an app's backend would write one from
docs/events.md: it verifies each POST's Entitlements-Signature (HMAC-SHA256 of
"TIMESTAMP.BODY" under one of its secrets, timestamp at most 5 minutes old) and records
what arrived. On demand it answers 500, 410, or holds the request (a hung backend).

Loopback only; a daemon thread, ended with stop()."""
import hashlib
import hmac
import http.server
import json
import threading
import time


def verify(header, body, secrets, now=None, tolerance=300):
    """The snippet docs/events.md gives for Python: True if any v1 matches any secret."""
    if not header:
        return False
    parts = [p.split("=", 1) for p in header.split(",")]
    timestamp = next((v for k, v in parts if k == "t"), None)
    signatures = [v for k, v in parts if k == "v1"]
    if timestamp is None or not timestamp.isdigit() or abs((now or time.time()) - int(timestamp)) > tolerance:
        return False
    signed = timestamp.encode() + b"." + body
    expected = [hmac.new(s.encode(), signed, hashlib.sha256).hexdigest() for s in secrets]
    return any(hmac.compare_digest(e, v) for e in expected for v in signatures)


class Receiver:
    def __init__(self, secrets):
        self.secrets = secrets
        self.lock = threading.Condition()
        self.received = []      # every POST whose signature verified: dict(path, event, at, headers)
        self.rejected = []      # POSTs whose signature did not verify
        self.mode = {}          # path -> "ok" | "fail" | "gone" | "hang" (held until release, then taken in)
        self.hanging = 0        # requests held now
        self.held_ids = set()   # (path, event id) of every request ever held
        self.release = threading.Event()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                ok = verify(self.headers.get("entitlements-signature"), body, receiver.secrets)
                mode = receiver.mode.get(self.path, "ok")
                if mode == "hang":
                    with receiver.lock:
                        receiver.hanging += 1
                        receiver.held_ids.add((self.path, self.headers.get("entitlements-event-id")))
                        receiver.lock.notify_all()
                    receiver.release.wait(60)
                    with receiver.lock:
                        receiver.hanging -= 1
                        # Held, then taken in: a backend that did its work but whose answer
                        # never reached the sender (it died meanwhile).
                        if ok:
                            receiver.received.append({"path": self.path, "event": json.loads(body), "at": time.time(),
                                                      "id_header": self.headers.get("entitlements-event-id")})
                        receiver.lock.notify_all()
                    try:
                        self.send_response(200)
                        self.send_header("content-length", "0")
                        self.end_headers()
                    except OSError:
                        pass
                    return
                with receiver.lock:
                    if not ok:
                        receiver.rejected.append((self.path, body))
                    elif mode == "ok":
                        receiver.received.append({"path": self.path, "event": json.loads(body), "at": time.time(),
                                                  "id_header": self.headers.get("entitlements-event-id")})
                    receiver.lock.notify_all()
                status = {"ok": 200, "fail": 500, "gone": 410}[mode] if ok else 400
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path):
        return "http://127.0.0.1:%d%s" % (self.port, path)

    def events(self, path=None, customer=None):
        with self.lock:
            return [r["event"] for r in self.received if (path is None or r["path"] == path)
                    and (customer is None or r["event"]["customerId"] == customer)]

    def wait(self, predicate, timeout=20):
        """Waits until predicate(self) holds; returns whether it did."""
        deadline = time.time() + timeout
        with self.lock:
            while not predicate(self):
                remaining = deadline - time.time()
                if remaining <= 0:
                    return False
                self.lock.wait(min(remaining, 0.2))
            return True

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
