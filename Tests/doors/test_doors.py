"""The gRPC and HTTP/JSON doors (docs/doors.md) driven by real foreign clients: Python's
grpcio with stubs generated from proto/ at test time, the standard health client
(grpcio-health-checking), hyper-h2 for what grpcio will not send (a grpc-timeout the
client itself does not enforce, a client that never reads), and plain HTTP/1.1 for JSON.

Run by Tests/doors/run.sh, which starts `entitlements serve` on the docs/examples data and
passes its ports in DOOR_PORT and ADMIN_PORT.
"""

import http.client
import json
import os
import queue
import socket
import sys
import threading
import time
import unicodedata
import unittest
import urllib.request

import grpc
import h2.config
import h2.connection
import h2.events
from grpc_health.v1 import health_pb2, health_pb2_grpc

PORT = int(os.environ["DOOR_PORT"])
ADMIN = int(os.environ["ADMIN_PORT"])
SERVICE = "/entitlements.v1.EntitlementService/"


from stubs import service_pb2_grpc, svc, types  # noqa: E402

# 2026-02-01T00:00:00Z: user-1's monthly subscription (docs/examples) is active then.
AT = 1769904000000


def now_ms():
    return int(time.time() * 1000)


def metric(name, **labels):
    """A counter from the admin listener's /metrics (0 when absent)."""
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % ADMIN, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all('%s="%s"' % (k, v) in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def post_json(path, body, content_type="application/json", headers=None):
    """An HTTP/1.1 POST: (status, parsed JSON body)."""
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=10)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers=dict({"Content-Type": content_type}, **(headers or {})))
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, json.loads(payload) if payload else None


class RawH2:
    """A bare HTTP/2 connection (hyper-h2) for what grpcio will not do."""

    def __init__(self):
        self.sock = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        self.conn = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.flush()

    def flush(self):
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def call(self, method, message, headers=(), end=True):
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [
            (":method", "POST"), (":scheme", "http"), (":path", SERVICE + method),
            (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers"),
        ] + list(headers))
        self.conn.send_data(stream, b"\x00" + len(message).to_bytes(4, "big") + message, end_stream=end)
        self.flush()
        return stream

    def finish(self, stream, timeout=10):
        """Reads until `stream` ends: its headers and trailers merged, and its data."""
        headers, data = {}, b""
        deadline = time.time() + timeout
        while time.time() < deadline:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError("the server closed the connection")
            for event in self.conn.receive_data(chunk):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)) and event.stream_id == stream:
                    headers.update({k.decode(): v.decode() for k, v in event.headers})
                elif isinstance(event, h2.events.DataReceived):
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    if event.stream_id == stream:
                        data += event.data
                if isinstance(event, h2.events.StreamEnded) and event.stream_id == stream:
                    self.flush()
                    return headers, data
            self.flush()
        raise AssertionError("stream %d did not end in %s s" % (stream, timeout))

    def close(self):
        self.sock.close()


class GRPCDoor(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.channel = grpc.insecure_channel("127.0.0.1:%d" % PORT)
        cls.stub = service_pb2_grpc.EntitlementServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()

    def check(self, user_id, **fields):
        return self.stub.CheckEntitlements(svc.CheckEntitlementsRequest(user_id=user_id, **fields), timeout=10)

    def assert_status(self, code, text, call, *args, **kwargs):
        with self.assertRaises(grpc.RpcError) as raised:
            call(*args, **kwargs)
        self.assertEqual(raised.exception.code(), code, raised.exception.details())
        self.assertIn(text, raised.exception.details())
        return raised.exception

    def test_check_known_user(self):
        answer = self.check("user-1", at=AT)
        self.assertEqual(answer.customer_id, "user-1")
        self.assertEqual(answer.request_date, AT)
        premium = {e.id: e for e in answer.entitlements}["premium"]
        self.assertTrue(premium.is_active)
        self.assertEqual(premium.product_id, "com.app.monthly")

    def test_check_unknown_user(self):
        answer = self.check("nobody-at-all")
        self.assertFalse(answer.HasField("customer_id"))
        self.assertEqual(len(answer.entitlements), 0)

    def test_check_alias(self):
        answer = self.check("$anon:abc", at=AT)
        self.assertEqual(answer.user_id, "$anon:abc")
        self.assertEqual(answer.customer_id, "user-1")

    def test_explain(self):
        """docs/PROTOCOL.md, "Explain": the same answer, with every candidate and why;
        never from the cache (the plain check before it filled it)."""
        feb18 = 1771372800000  # docs/examples/user-2-at-2026-02-18.json
        plain = self.check("user-2", at=feb18)
        explained = self.check("user-2", at=feb18, explain=True)
        self.assertEqual(list(explained.entitlements), list(plain.entitlements))
        self.assertEqual(explained.valid_until, plain.valid_until)
        self.assertFalse(plain.HasField("explanation"))
        premium = {e.entitlement_id: e for e in explained.explanation.entitlements}["premium"]
        self.assertTrue(premium.candidates[0].won and premium.candidates[0].is_active)
        self.assertIn("in grace until", premium.candidates[0].reason)
        self.assertIn("rule 6", premium.decision)
        self.assertEqual(explained.explanation.valid_until_from, "gracePeriodExpirationDate of the state of stripe chain sub_1")
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": "user-2", "at": str(feb18), "explain": True})
        self.assertEqual(status, 200)
        self.assertEqual(list(body)[-1], "explanation")
        self.assertTrue(body["explanation"]["entitlements"][0]["candidates"][0]["won"])

    def test_batch(self):
        answer = self.stub.BatchCheckEntitlements(
            svc.BatchCheckEntitlementsRequest(user_ids=["user-1", "nobody-b", "$anon:abc"], at=AT), timeout=10)
        self.assertEqual([r.user_id for r in answer.results], ["user-1", "nobody-b", "$anon:abc"])
        self.assertEqual(answer.results[0].customer_id, "user-1")
        self.assertFalse(answer.results[1].HasField("customer_id"))
        self.assertEqual(answer.results[2].customer_id, "user-1")

    def test_bad_request(self):
        self.assert_status(grpc.StatusCode.INVALID_ARGUMENT, "user_id: must not be empty", self.check, "")
        # "Zoë" decomposed (e + U+0308): ids must be NFC (PROTOCOL.md, "Ids").
        self.assert_status(grpc.StatusCode.INVALID_ARGUMENT, "user_id: must be in Unicode Normalization Form C (NFC)",
                           self.check, "Zoe\u0308")
        self.check(unicodedata.normalize("NFC", "Zoe\u0308"))

    def test_every_write(self):
        user, now = "py-writes-%d" % now_ms(), now_ms()
        day = 86400000
        written = self.stub.RecordTransaction(svc.RecordTransactionRequest(user_id=user, transaction=types.Transaction(
            original_transaction_id=user + "-o", transaction_id=user + "-t1", store=types.SOURCE_APPSTORE,
            product_id="com.app.monthly", transaction_date=now - day, expiration_date=now + 30 * day,
            environment=types.ENVIRONMENT_PRODUCTION, ownership_type=types.OWNERSHIP_TYPE_OWNER,
            type=types.TRANSACTION_TYPE_SUBSCRIPTION_STARTED)), timeout=10)
        self.assertTrue(written.created)
        self.assertGreater(written.log_sequence, 0)
        premium = {e.id: e for e in self.check(user).entitlements}["premium"]
        self.assertTrue(premium.is_active)
        self.assertFalse(premium.HasField("auto_renew_disable_date"))

        state = self.stub.UpdateSubscriptionState(svc.UpdateSubscriptionStateRequest(user_id=user, state=types.SubscriptionState(
            store=types.SOURCE_APPSTORE, original_transaction_id=user + "-o", auto_renew_enabled=False,
            auto_renew_disabled_date=now)), timeout=10)
        self.assertTrue(state.changed)
        premium = {e.id: e for e in self.check(user).entitlements}["premium"]
        self.assertFalse(premium.will_renew)
        self.assertEqual(premium.auto_renew_disable_date, now)

        grant = self.stub.GrantEntitlement(svc.GrantEntitlementRequest(user_id=user, grant=types.Grant(
            grant_id="g-py", entitlement_id="pro", granted_date=now - 1000)), timeout=10)
        self.assertTrue(grant.changed)
        self.assertTrue({e.id: e for e in self.check(user).entitlements}["pro"].is_active)

        revoked = self.stub.RevokeGrant(svc.RevokeGrantRequest(user_id=user, grant_id="g-py", revoked_date=now), timeout=10)
        self.assertTrue(revoked.changed)
        pro = {e.id: e for e in self.check(user).entitlements}.get("pro")
        self.assertTrue(pro is None or not pro.is_active)

        linked = self.stub.LinkAlias(svc.LinkAliasRequest(user_id=user, alias=user + "-alias"), timeout=10)
        self.assertTrue(linked.changed)
        self.assertEqual(self.check(user + "-alias").customer_id, user)

        deleted = self.stub.DeleteCustomer(svc.DeleteCustomerRequest(user_id=user), timeout=10)
        self.assertTrue(deleted.changed)
        self.assertFalse(self.check(user).HasField("customer_id"))

        # A refused write: the status of the framed protocol, the message of the rules.
        self.assert_status(grpc.StatusCode.INVALID_ARGUMENT, "grant", self.stub.GrantEntitlement,
                           svc.GrantEntitlementRequest(user_id=user), timeout=10)

        # docs/PROTOCOL.md, "History": the six writes above, oldest first, each with the
        # method and the gRPC listener that took it; the deletion last.
        history = self.stub.CustomerHistory(svc.CustomerHistoryRequest(user_id=user), timeout=10)
        self.assertEqual(history.customer_id, user)
        self.assertEqual([e.cause for e in history.entries], [svc.CHANGE_CAUSE_WRITE] * 6)
        self.assertEqual([e.source.method for e in history.entries],
                         ["RecordTransaction", "UpdateSubscriptionState", "GrantEntitlement", "RevokeGrant", "LinkAlias", "DeleteCustomer"])
        self.assertTrue(all(e.source.caller.startswith("grpc ") for e in history.entries))
        self.assertEqual(history.entries[0].log_sequence, written.log_sequence)
        self.assertTrue(history.entries[-1].deleted)
        self.assertIn("auto-renew off", history.entries[1].summary)
        status, body = post_json(SERVICE + "CustomerHistory", {"userId": user, "limit": 2})
        self.assertEqual(status, 200)
        self.assertTrue(body["truncated"])
        self.assertEqual([e["source"]["method"] for e in body["entries"]], ["LinkAlias", "DeleteCustomer"])
        self.assertEqual(body["entries"][-1]["summary"], "customer deleted")
        self.assert_status(grpc.StatusCode.INVALID_ARGUMENT, "user_id", self.stub.CustomerHistory,
                           svc.CustomerHistoryRequest(user_id=""), timeout=10)

    def test_watch_write_event_then_time_event(self):
        user = "py-watch-%d" % now_ms()
        after = self.check(user).log_sequence
        call = self.stub.WatchEntitlements(svc.WatchEntitlementsRequest(user_ids=[user], after_log_sequence=after), timeout=30)
        events = queue.Queue()

        def read():
            try:
                for event in call:
                    events.put(event)
            except grpc.RpcError as error:
                events.put(error)

        threading.Thread(target=read, daemon=True).start()
        expires = now_ms() + 2500
        self.stub.GrantEntitlement(svc.GrantEntitlementRequest(user_id=user, grant=types.Grant(
            grant_id="g-watch", entitlement_id="premium", granted_date=now_ms() - 1000, expiration_date=expires)), timeout=10)
        first = events.get(timeout=10)
        self.assertNotIsInstance(first, grpc.RpcError)
        # WRITE, or RESUMED if the grant landed before the stream was registered
        # (after_log_sequence makes the watch miss nothing either way).
        self.assertIn(first.cause, (svc.CHANGE_CAUSE_WRITE, svc.CHANGE_CAUSE_RESUMED))
        self.assertTrue({e.id: e for e in first.current.entitlements}["premium"].is_active)
        second = events.get(timeout=15)
        self.assertNotIsInstance(second, grpc.RpcError)
        self.assertEqual(second.cause, svc.CHANGE_CAUSE_TIME)
        self.assertGreaterEqual(now_ms(), expires)
        self.assertFalse({e.id: e for e in second.current.entitlements}["premium"].is_active)
        call.cancel()

    def test_unknown_method(self):
        call = self.channel.unary_unary(SERVICE + "NoSuchMethod")
        self.assert_status(grpc.StatusCode.UNIMPLEMENTED, "unknown method", call, b"", timeout=10)

    def test_request_that_does_not_decode(self):
        call = self.channel.unary_unary(SERVICE + "CheckEntitlements")
        self.assert_status(grpc.StatusCode.INVALID_ARGUMENT, "", call, b"\xff\xff\xff\xff", timeout=10)

    def test_message_over_the_limit(self):
        self.assert_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "bytes", self.check, "x" * (2 << 20))
        self.assertEqual(self.check("user-1", at=AT).customer_id, "user-1")  # the channel goes on

    def test_health(self):
        health = health_pb2_grpc.HealthStub(self.channel)
        for service in ("", "entitlements.v1.EntitlementService"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            self.assertEqual(answer.status, health_pb2.HealthCheckResponse.SERVING)
        with self.assertRaises(grpc.RpcError) as raised:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        self.assertEqual(raised.exception.code(), grpc.StatusCode.NOT_FOUND)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
        self.assertEqual(next(watch).status, health_pb2.HealthCheckResponse.SERVING)
        watch.cancel()
        # The service's own Health method, over gRPC too.
        self.assertEqual(self.stub.Health(svc.HealthRequest(), timeout=10).status, svc.SERVING_STATUS_SERVING)

    def test_deadline_enforced_by_the_server(self):
        # A read that waits for a log sequence the server will not reach (the server runs
        # with --min-sequence-wait 30s): the server's own deadline (grpc-timeout 300m) ends
        # it, which grpcio cannot show (it enforces deadlines itself), so hyper-h2 sends it.
        raw = RawH2()
        try:
            request = svc.CheckEntitlementsRequest(user_id="user-1", min_log_sequence=10 ** 15).SerializeToString()
            stream = raw.call("CheckEntitlements", request, headers=[("grpc-timeout", "300m")])
            headers, _ = raw.finish(stream)
            self.assertEqual(headers.get("grpc-status"), "4", headers)
            self.assertIn("the deadline passed", headers.get("grpc-message", ""))
        finally:
            raw.close()
        # grpcio's deadline: the same status.
        self.assert_status(grpc.StatusCode.DEADLINE_EXCEEDED, "", self.stub.CheckEntitlements,
                           svc.CheckEntitlementsRequest(user_id="user-1", min_log_sequence=10 ** 15), timeout=0.3)

    def test_malformed_grpc_timeout(self):
        raw = RawH2()
        try:
            stream = raw.call("CheckEntitlements", svc.CheckEntitlementsRequest(user_id="user-1").SerializeToString(),
                              headers=[("grpc-timeout", "soon")])
            headers, _ = raw.finish(stream)
            self.assertEqual(headers.get("grpc-status"), "3", headers)
        finally:
            raw.close()

    def test_client_that_never_reads_does_not_affect_others(self):
        raw = RawH2()
        try:
            # Many streams whose answers are large (about 100 KB each), none read; small
            # requests, so that they fit the connection's flow-control window.
            request = svc.BatchCheckEntitlementsRequest(user_ids=["user-1"] * 100).SerializeToString()
            for _ in range(60):
                raw.call("BatchCheckEntitlements", request)
            for _ in range(20):  # each within its 10 s deadline, or the test fails
                self.assertEqual(self.check("user-1", at=AT).customer_id, "user-1")
        finally:
            raw.close()
        self.assertEqual(self.check("user-1", at=AT).customer_id, "user-1")


class JSONDoor(unittest.TestCase):
    def test_check_answers_like_check_json(self):
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": "user-1", "at": str(AT)})
        self.assertEqual(status, 200)
        self.assertEqual(body["requestDate"], "2026-02-01T00:00:00.000Z")
        self.assertTrue(body["entitlements"]["premium"]["isActive"])
        # proto field names and numbers for int64 are accepted too
        status, same = post_json(SERVICE + "CheckEntitlements", {"user_id": "user-1", "at": AT})
        self.assertEqual((status, same), (200, body))

    def test_write_then_read(self):
        user = "json-%d" % now_ms()
        status, body = post_json(SERVICE + "GrantEntitlement", {
            "userId": user, "grant": {"grantId": "g1", "entitlementId": "premium", "grantedDate": str(now_ms() - 1000)}})
        self.assertEqual(status, 200, body)
        self.assertTrue(body["created"])
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": user})
        self.assertTrue(body["entitlements"]["premium"]["isActive"])

    def test_errors(self):
        status, body = post_json(SERVICE + "CheckEntitlements", b"{not json")
        self.assertEqual((status, body["code"]), (400, "invalid_argument"))
        self.assertIn("not valid JSON", body["message"])
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": "u", "userID": "typo"})
        self.assertEqual((status, body["code"]), (400, "invalid_argument"))
        self.assertIn("userID: no such field", body["message"])
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": ""})
        self.assertEqual((status, body["code"]), (400, "invalid_argument"))
        status, body = post_json(SERVICE + "Nope", {})
        self.assertEqual((status, body["code"]), (404, "unimplemented"))
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": "u"}, content_type="text/plain")
        self.assertEqual(status, 415)
        status, body = post_json(SERVICE + "RevokeGrant", {"userId": "nobody-rev", "grantId": "none"})
        self.assertEqual((status, body["code"]), (404, "not_found"))
        status, body = post_json(SERVICE + "Health", b"")  # Health and Compact take an empty body
        self.assertEqual((status, body["status"]), (200, "serving"))
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": "u"}, headers={"Connect-Timeout-Ms": "-5"})
        self.assertEqual((status, body["code"]), (400, "invalid_argument"))

    def test_http1_grpc_request_is_refused_with_a_reason(self):
        status, body = post_json(SERVICE + "CheckEntitlements", b"\x00\x00\x00\x00\x00", content_type="application/grpc")
        self.assertEqual(status, 415)
        self.assertIn("HTTP/2", body["message"])

    def test_json_deadline(self):
        status, body = post_json(SERVICE + "CheckEntitlements", {"userId": "user-1", "minLogSequence": "1000000000000000"},
                                 headers={"Connect-Timeout-Ms": "200"})
        self.assertEqual((status, body["code"]), (504, "deadline_exceeded"))


class Metrics(unittest.TestCase):
    def test_door_calls_are_counted(self):
        before = metric("entitlements_requests_total", method="CheckEntitlements", status="OK")
        post_json(SERVICE + "CheckEntitlements", {"userId": "user-1"})
        self.assertGreater(metric("entitlements_requests_total", method="CheckEntitlements", status="OK"), before)


def drain_watch():
    """For run.sh's drain check: opens a watch and a health watch, says so, then prints how
    each ended once the server drains (SIGTERM)."""
    channel = grpc.insecure_channel("127.0.0.1:%d" % PORT)
    stub = service_pb2_grpc.EntitlementServiceStub(channel)
    watch = stub.WatchEntitlements(svc.WatchEntitlementsRequest(all_customers=True), timeout=60)
    health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    statuses = [next(health).status]
    print("watching", flush=True)
    ends = {}
    for name, call in (("watch", watch), ("health", health)):
        try:
            for message in call:
                if name == "health":
                    statuses.append(message.status)
            ends[name] = "OK"
        except grpc.RpcError as error:
            ends[name] = error.code().name
    print("watch ended %s; health watch ended %s after %s" % (
        ends["watch"], ends["health"], " -> ".join(health_pb2.HealthCheckResponse.ServingStatus.Name(s) for s in statuses)), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--drain-watch"]:
        drain_watch()
    else:
        unittest.main(verbosity=2)
