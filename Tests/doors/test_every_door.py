"""Every method through every transport, against one table of permissions and limits
(docs/architecture.md, "One set of rules"): so that a rule cannot be missing from one door.

It starts two servers of the binary it is given (a plain one, and one with --tls-cert), both
with --auth-token-file and no anonymous permissions anywhere, and calls every method of
docs/PROTOCOL.md section 8 through

  - the framed protocol over TCP (plain and TLS) and over the Unix socket, with a client
    written here from docs/PROTOCOL.md alone (Authenticate, then the call);
  - gRPC (grpcio, plain and TLS), `authorization: Bearer TOKEN`;
  - JSON over HTTP/2 (hyper-h2, plain and TLS) and over HTTP/1.1 (http.client, plain and
    HTTPS), the same header;

each without credentials, with a check token and with a write token. Every call must end
with the status the table says, the same on every transport; the answer-size limit and a
deadline must hold on every transport too; and /metrics must count each call exactly once.

Usage: python3 Tests/doors/test_every_door.py path/to/entitlements
Talks to loopback only; stops the servers it started, by pid."""
import http.client
import json
import os
import re
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request
from collections import Counter

import grpc
import h2.config
import h2.connection
import h2.events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".build/debug/entitlements"))
WORK = tempfile.mkdtemp(prefix="every-door-")
CHECK_TOKEN = "c" * 40
WRITE_TOKEN = "w" * 40
AT = 1769904000000  # user-1's subscription is active then (docs/examples)
SERVICE = "/entitlements.v1.EntitlementService/"

from stubs import svc, types  # noqa: E402

# The status codes of docs/PROTOCOL.md section 5, by number, as every transport names them.
STATUS = {0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED", 5: "NOT_FOUND",
          6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED", 9: "FAILED_PRECONDITION",
          10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED", 13: "INTERNAL", 14: "UNAVAILABLE",
          15: "DATA_LOSS", 16: "UNAUTHENTICATED"}
# Connect's HTTP status for each (docs/doors.md), which the JSON door must pair with the code.
HTTP_STATUS = {"OK": 200, "INVALID_ARGUMENT": 400, "DEADLINE_EXCEEDED": 504, "NOT_FOUND": 404, "PERMISSION_DENIED": 403,
               "RESOURCE_EXHAUSTED": 429, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "UNAUTHENTICATED": 401,
               "FAILED_PRECONDITION": 400, "INTERNAL": 500}


# MARK: The methods, their permission, and what an allowed call of each answers.

def methods(tag):
    """(name, method id, request message, permission, status when allowed): every method of
    PROTOCOL.md section 8 but Authenticate. `tag` keeps each call's customer its own."""
    user = "door-" + tag
    return [
        ("CheckEntitlements", 1, svc.CheckEntitlementsRequest(user_id="user-1", at=AT), "check", "OK"),
        ("BatchCheckEntitlements", 2, svc.BatchCheckEntitlementsRequest(user_ids=["user-1", "user-2"], at=AT), "check", "OK"),
        # Allowed, a watch runs until its timeout: DEADLINE_EXCEEDED is its normal end.
        ("WatchEntitlements", 3, svc.WatchEntitlementsRequest(user_ids=["user-1"]), "check", "DEADLINE_EXCEEDED"),
        ("Health", 4, svc.HealthRequest(), "check", "OK"),
        ("CustomerHistory", 6, svc.CustomerHistoryRequest(user_id="user-1"), "check", "OK"),
        # No transaction: the write's own validation answers, after the permission.
        ("RecordTransaction", 16, svc.RecordTransactionRequest(user_id=user), "write", "INVALID_ARGUMENT"),
        ("UpdateSubscriptionState", 17, svc.UpdateSubscriptionStateRequest(user_id=user), "write", "INVALID_ARGUMENT"),
        ("GrantEntitlement", 18, svc.GrantEntitlementRequest(
            user_id=user, grant=types.Grant(grant_id="g-" + tag, entitlement_id="beta")), "write", "OK"),
        ("RevokeGrant", 19, svc.RevokeGrantRequest(user_id=user, grant_id="never-granted"), "write", "NOT_FOUND"),
        ("LinkAlias", 20, svc.LinkAliasRequest(user_id=user, alias="alias-" + tag), "write", "OK"),
        ("DeleteCustomer", 21, svc.DeleteCustomerRequest(user_id=user), "write", "OK"),
        # These servers verify no store's purchases: refused after the permission, saying so.
        ("SubmitPurchase", 22, svc.SubmitPurchaseRequest(user_id=user, google_play=svc.GooglePlayPurchase(
            package_name="com.example.app", product_id="premium", purchase_token="token-" + tag)), "write", "FAILED_PRECONDITION"),
        ("Compact", 32, svc.CompactRequest(), "write", "OK"),
    ]


def json_body(message):
    """A request in protobuf's JSON mapping (lowerCamelCase names, 64-bit integers as
    strings); bytes are sent as they are."""
    if isinstance(message, bytes):
        return message
    from google.protobuf import json_format
    return json.dumps(json_format.MessageToDict(message)).encode()


def protobuf(message):
    """A request's protobuf bytes; bytes are sent as they are."""
    return message if isinstance(message, bytes) else message.SerializeToString()


# MARK: Servers

class Server:
    def __init__(self, name, tls):
        self.name, self.tls = name, tls
        extra = ["--tls-cert", WORK + "/server.pem", "--tls-key", WORK + "/server.key"] if tls else []
        self.unix = None if tls else WORK + "/%s.sock" % name
        if self.unix:
            extra += ["--unix", self.unix]
        self.log = open(WORK + "/%s.log" % name, "w+")  # closed by stop()
        self.process = subprocess.Popen([
            ENT, "serve", "--data-dir", WORK + "/%s-data" % name, "--snapshot", WORK + "/seed.snap",
            "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0",
            "--auth-token-file", WORK + "/tokens", "--listen-anonymous", "none", "--unix-anonymous", "none",
            "--grpc-anonymous", "none", "--max-batch", "100000", "--min-sequence-wait", "3s", "--frame-timeout", "3s",
        ] + extra, stdout=self.log, stderr=subprocess.STDOUT)
        text = ""
        for _ in range(300):
            self.log.seek(0)
            text = self.log.read()
            if "grpc listening on" in text and "admin listening on" in text:
                break
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        ports = {kind: int(port) for kind, port in re.findall(r"^(grpc |admin |)listening on 127\.0\.0\.1:(\d+)", text, re.M)}
        if len(ports) != 3:
            raise SystemExit("serve (%s) did not start:\n%s" % (name, text))
        self.framed, self.door, self.admin = ports[""], ports["grpc "], ports["admin "]

    def stop(self):
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()

    def ssl_context(self):
        context = ssl.create_default_context(cafile=WORK + "/ca.pem")
        return context

    def metrics(self):
        # The admin listener speaks HTTPS when the server has --tls-cert (docs/security.md).
        scheme = "https" if self.tls else "http"
        url = "%s://localhost:%d/metrics" % (scheme, self.admin)
        text = urllib.request.urlopen(url, timeout=10, context=self.ssl_context() if self.tls else None).read().decode()
        counts = Counter()
        for method, status, value in re.findall(
                r'^entitlements_requests_total\{method="(\w+)",status="(\w+)"\} (\S+)$', text, re.M):
            counts[(method, status)] += int(float(value))
        latencies = {method: int(float(value)) for method, value in re.findall(
            r'^entitlements_request_duration_seconds_count\{method="(\w+)"\} (\S+)$', text, re.M)}
        in_flight = float(re.search(r"^entitlements_requests_in_flight (\S+)$", text, re.M).group(1))
        return counts, latencies, in_flight


# MARK: Transports: each calls one method and says (status, answer bytes or error message).

class Framed:
    """The framed protocol, written from docs/PROTOCOL.md: 24-byte big-endian headers."""
    HEADER = struct.Struct(">HBBBBHQII")

    def __init__(self, name, connect):
        self.name, self.connect = name, connect

    def frame(self, kind, request_id, method=0, payload=b"", timeout_us=0):
        return self.HEADER.pack(0x454E, 1, kind, 0, 0, method, request_id, timeout_us, len(payload)) + payload

    @staticmethod
    def read_exactly(sock, count):
        data = b""
        while len(data) < count:
            chunk = sock.recv(count - len(data))
            if not chunk:
                raise AssertionError("the server closed the connection")
            data += chunk
        return data

    def call(self, method_id, message, token, timeout=None):
        sock = self.connect()
        try:
            sock.settimeout(30)
            out = b""
            if token:
                out += self.frame(1, 1, 5, svc.AuthenticateRequest(token=token).SerializeToString())
            out += self.frame(1, 2, method_id, protobuf(message), int(timeout * 1e6) if timeout else 0)
            sock.sendall(out)
            while True:
                header = self.HEADER.unpack(self.read_exactly(sock, 24))
                _, _, kind, _, status, _, request_id, _, length = header
                payload = self.read_exactly(sock, length)
                if kind == 2 and request_id == 1 and status != 0:
                    raise AssertionError("Authenticate refused: %s" % payload.decode())
                if request_id == 2 and kind in (2, 4):  # RESPONSE, or END_OF_STREAM of a watch
                    return STATUS[status], payload if status == 0 else payload.decode()
                if kind == 9:
                    raise AssertionError("connection error %s: %s" % (STATUS[status], payload.decode()))
        finally:
            sock.close()


class GRPC:
    def __init__(self, name, target, credentials):
        self.name = name
        self.channel = grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)

    def call(self, method_name, message, token, timeout=None):
        metadata = [("authorization", "Bearer " + token)] if token else None
        path = SERVICE + method_name
        serialize, parse = protobuf, (lambda b: b)
        try:
            if method_name == "WatchEntitlements":
                stream = self.channel.unary_stream(path, request_serializer=serialize, response_deserializer=parse)
                for _ in stream(message, metadata=metadata, timeout=timeout or 0.5):
                    pass
                return "OK", b""
            unary = self.channel.unary_unary(path, request_serializer=serialize, response_deserializer=parse)
            return "OK", unary(message, metadata=metadata, timeout=timeout or 30)
        except grpc.RpcError as error:
            return error.code().name, error.details()


def h2_request(port, context, path, headers, body, end=True, reset=False, drop=False):
    """One request on a new HTTP/2 connection (hyper-h2): its response headers and
    trailers merged (names as text), and its data. `end=False` sends the headers and body
    but never ends the request, and then the server must reset the stream after its
    answer; `reset=True` resets the stream once it is sent, and `drop=True` closes the
    connection then, each returning (None, None) after a PING round trip, so the server
    has seen the request."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    if context:
        context.set_alpn_protocols(["h2"])
        raw = context.wrap_socket(raw, server_hostname="localhost")
    try:
        connection = h2.connection.H2Connection(config=h2.config.H2Configuration(client_side=True))
        connection.initiate_connection()
        connection.send_headers(1, [(":method", "POST"), (":scheme", "https" if context else "http"), (":path", path),
                                    (":authority", "localhost")] + headers)
        # A body larger than the flow-control window goes out as the window opens.
        sent, response, data = 0, {}, b""
        if not body and end:
            connection.end_stream(1)
        while True:
            window = min(connection.local_flow_control_window(1), connection.max_outbound_frame_size)
            while sent < len(body) and window > 0:
                piece = body[sent:sent + window]
                sent += len(piece)
                connection.send_data(1, piece, end_stream=end and sent == len(body))
                window = min(connection.local_flow_control_window(1), connection.max_outbound_frame_size)
            if (reset is True or drop is True) and sent == len(body):
                if reset:
                    connection.reset_stream(1)
                connection.ping(b"12345678")
                reset, drop = ("sent" if reset else False), ("sent" if drop else False)
            raw.sendall(connection.data_to_send())
            chunk = raw.recv(65536)
            if not chunk:
                raise AssertionError("the server closed the connection")
            for event in connection.receive_data(chunk):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    response.update({k.decode(): v.decode() for k, v in event.headers})
                elif isinstance(event, h2.events.DataReceived):
                    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    data += event.data
                elif isinstance(event, h2.events.StreamEnded) and end:
                    return response, data
                elif isinstance(event, h2.events.StreamEnded):
                    pass  # answered while the request is still open: the server must reset it now
                elif isinstance(event, h2.events.PingAckReceived) and "sent" in (reset, drop):
                    return None, None
                elif isinstance(event, h2.events.StreamReset) and not end and response:
                    return response, data
                elif isinstance(event, h2.events.StreamReset) and reset != "sent":
                    raise AssertionError("the server reset the stream")
    finally:
        raw.close()


class JSONOverHTTP2:
    """Connect-style JSON calls on HTTP/2 streams, one connection per call."""

    def __init__(self, name, port, context):
        self.name, self.port, self.context = name, port, context

    def call(self, method_name, message, token, timeout=None):
        headers = [("content-type", "application/json")]
        if token:
            headers.append(("authorization", "Bearer " + token))
        if timeout:
            headers.append(("connect-timeout-ms", str(int(timeout * 1000))))
        response, data = h2_request(self.port, self.context, SERVICE + method_name, headers, json_body(message))
        return json_answer(int(response[":status"]), data)


class GRPCOverHTTP2:
    """gRPC by hand, for what grpcio will not do: a server deadline the client does not
    race, a body that never ends, an empty or compressed message."""

    def __init__(self, name, port, context):
        self.name, self.port, self.context = name, port, context

    def call(self, method_name, message, token, timeout=None, end=True, framing=None):
        headers = [("content-type", "application/grpc"), ("te", "trailers")]
        if token:
            headers.append(("authorization", "Bearer " + token))
        if timeout:
            headers.append(("grpc-timeout", "%dm" % int(timeout * 1000)))
        payload = protobuf(message)
        body = framing if framing is not None else b"\x00" + len(payload).to_bytes(4, "big") + payload
        response, _ = h2_request(self.port, self.context, SERVICE + method_name, headers, body, end=end)
        return STATUS[int(response["grpc-status"])], response.get("grpc-message", "")


class JSONOverHTTP1:
    def __init__(self, name, port, context):
        self.name, self.port, self.context = name, port, context

    def call(self, method_name, message, token, timeout=None):
        if self.context:
            connection = http.client.HTTPSConnection("localhost", self.port, context=self.context, timeout=30)
        else:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = "Bearer " + token
        if timeout:
            headers["Connect-Timeout-Ms"] = str(int(timeout * 1000))
        try:
            connection.request("POST", SERVICE + method_name, body=json_body(message), headers=headers)
            response = connection.getresponse()
            return json_answer(response.status, response.read())
        finally:
            connection.close()


def json_answer(http_status, data):
    """(status, answer or message) of a JSON door answer; checks the HTTP status matches."""
    if http_status == 200:
        return "OK", data
    error = json.loads(data)
    code = error["code"].upper()
    if HTTP_STATUS.get(code) != http_status:
        raise AssertionError("%s answered with HTTP %d (Connect's is %s)" % (code, http_status, HTTP_STATUS.get(code)))
    return code, error["message"]


def transports(server):
    def tcp():
        return socket.create_connection(("127.0.0.1", server.framed))

    def tls():
        return server.ssl_context().wrap_socket(socket.create_connection(("127.0.0.1", server.framed)), server_hostname="localhost")

    def unix():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(server.unix)
        return sock

    door = "127.0.0.1:%d" % server.door
    if server.tls:
        with open(WORK + "/ca.pem", "rb") as ca:
            credentials = grpc.ssl_channel_credentials(root_certificates=ca.read())
        return [Framed("framed TLS", tls),
                GRPC("gRPC TLS", "localhost:%d" % server.door, credentials),
                JSONOverHTTP2("JSON HTTP/2 TLS", server.door, server.ssl_context()),
                JSONOverHTTP1("JSON HTTPS/1.1", server.door, server.ssl_context())]
    return [Framed("framed TCP", tcp), Framed("framed Unix", unix), GRPC("gRPC", door, None),
            JSONOverHTTP2("JSON HTTP/2", server.door, None), JSONOverHTTP1("JSON HTTP/1.1", server.door, None)]


def limit_transports(server):
    """The transports for the limits: grpcio replaced by gRPC by hand, whose client does
    not race the server's deadline."""
    return [GRPCOverHTTP2(t.name, server.door, server.ssl_context() if server.tls else None) if isinstance(t, GRPC) else t
            for t in transports(server)]


def http1_partial(server, method, headers, read=True):
    """An HTTP/1.1 POST whose Content-Length (100) its body never reaches: what the server
    sends until it closes the connection, or nothing when `read` is False (the client
    closes at once)."""
    sock = socket.create_connection(("127.0.0.1", server.door), timeout=30)
    if server.tls:
        sock = server.ssl_context().wrap_socket(sock, server_hostname="localhost")
    sock.sendall(("POST %s%s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%s"
                  "Content-Length: 100\r\n\r\n{" % (SERVICE, method, headers)).encode())
    received = b""
    while read:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    sock.close()
    return received


def is_json(transport):
    return transport.name.startswith("JSON")


def do_call(transport, name, method_id, message, token, timeout=None):
    if isinstance(transport, Framed):
        return transport.call(method_id, message, token, timeout)
    return transport.call(name, message, token, timeout)


# MARK: The tests

class EveryDoor(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        subprocess.run([os.path.join(ROOT, "dev/make-test-certificates.sh"), WORK], check=True)
        with open(WORK + "/tokens", "w") as tokens:
            tokens.write("%s check\n%s check,write\n" % (CHECK_TOKEN, WRITE_TOKEN))
        subprocess.run([ENT, "snapshot", "build", "--catalog", os.path.join(ROOT, "docs/examples/catalog.json"),
                        "--customers", os.path.join(ROOT, "docs/examples/customers.jsonl"),
                        "--output", WORK + "/seed.snap"], check=True, stdout=subprocess.DEVNULL)
        cls.servers = [Server("plain", tls=False), Server("tls", tls=True)]
        # What each server should have counted: (method, status) -> calls.
        cls.expected_counts = {server.name: Counter() for server in cls.servers}

    @classmethod
    def tearDownClass(cls):
        for server in cls.servers:
            server.stop()

    def call(self, server, transport, name, method_id, message, token, timeout=None):
        """Calls `name` and notes what the server should count for it."""
        status, said = do_call(transport, name, method_id, message, token, timeout)
        if token and isinstance(transport, Framed):
            self.expected_counts[server.name][("Authenticate", "OK")] += 1  # one per connection
        self.record(server, name, status, transport)
        return status, said

    def record(self, server, name, status, transport):
        # A watch that ran is a stream, not an answered call (docs/operations.md).
        if not (name == "WatchEntitlements" and status == "DEADLINE_EXCEEDED" and not is_json(transport)):
            self.expected_counts[server.name][(name, status)] += 1

    def test_1_permissions_on_every_transport(self):
        for server in self.servers:
            for transport in transports(server):
                for credential, token in [("none", None), ("check", CHECK_TOKEN), ("write", WRITE_TOKEN)]:
                    tag = "%s-%s-%s" % (server.name, re.sub(r"\W", "", transport.name), credential)
                    for name, method_id, message, permission, allowed in methods(tag):
                        with self.subTest(server=server.name, transport=transport.name, credential=credential, method=name):
                            if name == "WatchEntitlements" and is_json(transport):
                                want = "UNIMPLEMENTED"  # the JSON door serves unary calls only
                            elif credential == "none":
                                want = "UNAUTHENTICATED"
                            elif credential == "check" and permission == "write":
                                want = "PERMISSION_DENIED"
                            else:
                                want = allowed
                            status, said = self.call(server, transport, name, method_id, message, token,
                                                     timeout=0.3 if name == "WatchEntitlements" else None)
                            self.assertEqual(status, want, "%s %s with %s: %s" % (transport.name, name, credential, said))
                            if want == "UNAUTHENTICATED":
                                self.assertIn("present a token", said)
                            if want == "PERMISSION_DENIED":
                                self.assertIn("needs the write permission", said)

    def test_2_answer_limit_on_every_transport(self):
        # 60,000 unknown users: the request is under 1 MiB in protobuf and JSON, the answer
        # over it in both.
        message = svc.BatchCheckEntitlementsRequest(user_ids=["u%07d" % i for i in range(60_000)], at=AT)
        for server in self.servers:
            for transport in limit_transports(server):
                with self.subTest(server=server.name, transport=transport.name):
                    status, said = self.call(server, transport, "BatchCheckEntitlements", 2, message, CHECK_TOKEN)
                    self.assertEqual(status, "RESOURCE_EXHAUSTED", said)
                    self.assertIn("an answer carries at most 1048576", said)

    def test_2b_permission_before_the_request_is_read(self):
        # A payload that does not decode: refused for its missing permission first.
        garbage = {False: b"\xff\xff\xff", True: b"{not json"}
        for server in self.servers:
            for transport in limit_transports(server):
                for credential, token, want in [("none", None, "UNAUTHENTICATED"), ("check", CHECK_TOKEN, "INVALID_ARGUMENT")]:
                    with self.subTest(server=server.name, transport=transport.name, credential=credential):
                        status, said = self.call(server, transport, "CheckEntitlements", 1, garbage[is_json(transport)], token)
                        self.assertEqual(status, want, said)
            # gRPC's own framing: no message at all, and a compressed one.
            grpc_by_hand = GRPCOverHTTP2("gRPC by hand", server.door, server.ssl_context() if server.tls else None)
            for framing, allowed in [(b"", "INVALID_ARGUMENT"), (b"\x01\x00\x00\x00\x00", "UNIMPLEMENTED")]:
                for credential, token, want in [("none", None, "UNAUTHENTICATED"), ("check", CHECK_TOKEN, allowed)]:
                    with self.subTest(server=server.name, framing=framing, credential=credential):
                        status, said = grpc_by_hand.call("CheckEntitlements", b"", token, framing=framing)
                        self.record(server, "CheckEntitlements", status, grpc_by_hand)
                        self.assertEqual(status, want, said)

    def test_3_deadline_on_every_transport(self):
        # A sequence the server does not reach within --min-sequence-wait (3 s): only the
        # call's own 200 ms deadline can end it sooner.
        message = svc.CheckEntitlementsRequest(user_id="user-1", min_log_sequence=10**12)
        for server in self.servers:
            for transport in limit_transports(server):
                with self.subTest(server=server.name, transport=transport.name):
                    status, said = self.call(server, transport, "CheckEntitlements", 1, message, CHECK_TOKEN, timeout=0.2)
                    self.assertEqual(status, "DEADLINE_EXCEEDED", said)
                    self.assertIn("the deadline passed before the answer was ready", said)

    def test_3b_deadline_while_the_request_arrives(self):
        # Headers with a 200 ms deadline and a body that never ends.
        for server in self.servers:
            context = server.ssl_context() if server.tls else None
            grpc_by_hand = GRPCOverHTTP2("gRPC by hand", server.door, context)
            status, said = grpc_by_hand.call("CheckEntitlements", svc.CheckEntitlementsRequest(user_id="user-1"),
                                             CHECK_TOKEN, timeout=0.2, end=False)
            self.record(server, "CheckEntitlements", status, grpc_by_hand)
            self.assertEqual((status, said), ("DEADLINE_EXCEEDED", "the deadline passed before the request arrived in full"))
            response, data = h2_request(server.door, context, SERVICE + "CheckEntitlements",
                                        [("content-type", "application/json"), ("authorization", "Bearer " + CHECK_TOKEN),
                                         ("connect-timeout-ms", "200")], b'{"userId": ', end=False)
            self.expected_counts[server.name][("CheckEntitlements", "DEADLINE_EXCEEDED")] += 1
            self.assertEqual(json_answer(int(response[":status"]), data),
                             ("DEADLINE_EXCEEDED", "the deadline passed before the request arrived in full"))
            # HTTP/1.1: a Content-Length the body never reaches; answered, then closed.
            received = http1_partial(server, "CheckEntitlements", "Authorization: Bearer %s\r\nConnect-Timeout-Ms: 200\r\n" % CHECK_TOKEN)
            self.expected_counts[server.name][("CheckEntitlements", "DEADLINE_EXCEEDED")] += 1
            self.assertTrue(received.startswith(b"HTTP/1.1 504"), received)
            self.assertIn(b"the deadline passed before the request arrived in full", received)
            # No deadline: --frame-timeout (3 s here) bounds a request's arrival, on both doors.
            status, said = grpc_by_hand.call("CheckEntitlements", svc.CheckEntitlementsRequest(user_id="user-1"), CHECK_TOKEN, end=False)
            self.record(server, "CheckEntitlements", status, grpc_by_hand)
            self.assertEqual(status, "DEADLINE_EXCEEDED")
            self.assertTrue(said.startswith("the request did not arrive in full within --frame-timeout"), said)
            # Refused at once (an unknown method), its body never finished: answered, then the
            # HTTP/1.1 connection is closed at the limit rather than held for the body.
            received = http1_partial(server, "NoSuchMethod", "")
            self.expected_counts[server.name][("unknown", "UNIMPLEMENTED")] += 1
            self.assertTrue(received.startswith(b"HTTP/1.1 404"), received)

    def test_3c_cancelled_calls(self):
        # Calls that wait (min_log_sequence) and are cancelled: each counts once, CANCELLED.
        waiting_check = svc.CheckEntitlementsRequest(user_id="user-1", min_log_sequence=10**12)
        waiting_batch = svc.BatchCheckEntitlementsRequest(user_ids=["user-1"], min_log_sequence=10**12)
        for server in self.servers:
            # Framed: CANCEL of a check (the specialised path) and of a batch (routed).
            framed = [t for t in transports(server) if isinstance(t, Framed)][0]
            sock = framed.connect()
            sock.settimeout(30)
            sock.sendall(framed.frame(1, 1, 5, svc.AuthenticateRequest(token=CHECK_TOKEN).SerializeToString())
                         + framed.frame(1, 2, 1, waiting_check.SerializeToString())
                         + framed.frame(1, 3, 2, waiting_batch.SerializeToString())
                         + framed.frame(5, 2) + framed.frame(5, 3))
            answers = {}
            while len(answers) < 3:
                _, _, kind, _, status, _, request_id, _, length = Framed.HEADER.unpack(Framed.read_exactly(sock, 24))
                Framed.read_exactly(sock, length)
                answers[request_id] = STATUS[status]
            sock.close()
            self.assertEqual(answers, {1: "OK", 2: "CANCELLED", 3: "CANCELLED"})
            counts = self.expected_counts[server.name]
            counts[("Authenticate", "OK")] += 1
            counts[("CheckEntitlements", "CANCELLED")] += 1
            counts[("BatchCheckEntitlements", "CANCELLED")] += 1
            # HTTP/2: a stream reset while its call waits, gRPC and JSON.
            context = server.ssl_context() if server.tls else None
            body = waiting_check.SerializeToString()
            h2_request(server.door, context, SERVICE + "CheckEntitlements",
                       [("content-type", "application/grpc"), ("te", "trailers"), ("authorization", "Bearer " + CHECK_TOKEN)],
                       b"\x00" + len(body).to_bytes(4, "big") + body, reset=True)
            h2_request(server.door, context, SERVICE + "CheckEntitlements",
                       [("content-type", "application/json"), ("authorization", "Bearer " + CHECK_TOKEN)],
                       json_body(waiting_check), reset=True)
            counts[("CheckEntitlements", "CANCELLED")] += 2
            # Connections dropped while a request is still arriving (never routed): HTTP/2
            # and HTTP/1.1 count the call CANCELLED too.
            h2_request(server.door, context, SERVICE + "CheckEntitlements",
                       [("content-type", "application/json"), ("authorization", "Bearer " + CHECK_TOKEN)],
                       b'{"userId": ', end=False, drop=True)
            http1_partial(server, "CheckEntitlements", "Authorization: Bearer %s\r\n" % CHECK_TOKEN, read=False)
            counts[("CheckEntitlements", "CANCELLED")] += 2

    def test_4_every_call_counted_once(self):
        # After the others (unittest runs them in name order): once nothing is in flight
        # (the cancelled calls end within --min-sequence-wait), /metrics has counted each
        # call once, and the latency histogram each answered call.
        for server in self.servers:
            with self.subTest(server=server.name):
                for _ in range(100):
                    counted, latencies, in_flight = server.metrics()
                    if in_flight == 0:
                        break
                    time.sleep(0.1)
                self.assertEqual(in_flight, 0, "calls still in flight 10 s after the last one")
                expected = self.expected_counts[server.name]
                self.assertTrue(expected, "no calls were made")
                wrong = ["%s %s: counted %d, made %d" % (key + (counted.get(key, 0), expected.get(key, 0)))
                         for key in sorted(set(counted) | set(expected)) if counted.get(key, 0) != expected.get(key, 0)]
                self.assertEqual(wrong, [], "entitlements_requests_total differs from the calls made")
                per_method = Counter()
                for (method, _), count in counted.items():
                    if method != "unknown":  # no method, no latency series
                        per_method[method] += count
                self.assertEqual({m: c for m, c in latencies.items() if c}, {m: c for m, c in per_method.items() if c},
                                 "the latency histogram's counts differ from entitlements_requests_total")

if __name__ == "__main__":
    program = unittest.main(argv=[sys.argv[0], "-v"], exit=False)
    sys.exit(0 if program.result.wasSuccessful() else 1)
