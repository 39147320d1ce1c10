"""Distributed tracing (docs/tracing.md) against an OTLP/HTTP receiver started here: a
minimal collector that accepts only what the OTLP/HTTP specification allows (POST
/v1/traces, Content-Type application/x-protobuf, an ExportTraceServiceRequest body that
decodes with opentelemetry-proto), answers as a collector does, and keeps the spans.

It starts `entitlements serve --otlp-endpoint ... --trace-sample-ratio 1` with the gRPC door
and calls it over gRPC (grpcio, with a W3C traceparent), JSON over HTTP/1.1 (with one), the
framed protocol (`entitlements check`: no trace context, so a root span; and a raw framed
check cancelled while it waits), a refused call, a call whose caller's trace is not sampled,
and a read-your-writes wait, then checks the
spans the server sent: names, kind, parents, attributes and statuses.

Usage: python3 Tests/doors/test_tracing.py path/to/entitlements
Talks to loopback only; stops the server it started, by pid."""
import http.client
import http.server
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".build/debug/entitlements"))
WORK = tempfile.mkdtemp(prefix="tracing-")
AT = 1769904000000  # user-1's subscription is active then (docs/examples)
SERVICE = "entitlements.v1.EntitlementService"

from stubs import svc  # noqa: E402


class Collector(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP's trace receiver, as strict as the specification
    (https://opentelemetry.io/docs/specs/otlp/#otlphttp): anything else is refused, and
    recorded as a problem the test then fails on."""
    spans = []
    problems = []
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        problem = None
        if self.path != "/v1/traces":
            problem = "POST %s: OTLP/HTTP traces go to /v1/traces" % self.path
        elif self.headers.get("Content-Type") != "application/x-protobuf":
            problem = "Content-Type %r: OTLP/HTTP protobuf is application/x-protobuf" % self.headers.get("Content-Type")
        request = trace_service_pb2.ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as error:  # noqa: BLE001
            problem = problem or "the body is not an ExportTraceServiceRequest: %s" % error
        with Collector.lock:
            if problem:
                Collector.problems.append(problem)
            else:
                for resource_spans in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            Collector.spans.append((resource, span))
        if problem:
            self.send_response(400)
            self.end_headers()
            return
        answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def attributes(span):
    values = {}
    for attribute in span.attributes:
        value = attribute.value
        kind = value.WhichOneof("value")
        values[attribute.key] = getattr(value, kind) if kind else None
    return values


class Tracing(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
        threading.Thread(target=cls.collector.serve_forever, daemon=True).start()
        subprocess.run([ENT, "snapshot", "build", "--catalog", os.path.join(ROOT, "docs/examples/catalog.json"),
                        "--customers", os.path.join(ROOT, "docs/examples/customers.jsonl"),
                        "--output", os.path.join(WORK, "seed.snap")], check=True, stdout=subprocess.DEVNULL)
        cls.log = open(os.path.join(WORK, "serve.log"), "w+")
        cls.server = subprocess.Popen(
            [ENT, "serve", "--data-dir", os.path.join(WORK, "data"), "--snapshot", os.path.join(WORK, "seed.snap"),
             "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0",
             "--otlp-endpoint", "http://127.0.0.1:%d" % cls.collector.server_address[1], "--trace-sample-ratio", "1",
             "--min-sequence-wait", "5s"],
            stdout=cls.log, stderr=subprocess.STDOUT)
        cls.tcp = cls.door = None
        for _ in range(300):
            with open(os.path.join(WORK, "serve.log")) as log:
                text = log.read()
            for line in text.splitlines():
                if line.startswith("listening on "):
                    cls.tcp = int(line.rsplit(":", 1)[1])
                if line.startswith("grpc listening on "):
                    cls.door = int(line.rsplit(":", 1)[1])
            if cls.tcp and cls.door:
                break
            time.sleep(0.1)
        if not (cls.tcp and cls.door):
            cls.server.kill()
            cls.log.seek(0)
            raise SystemExit("serve did not start:\n" + cls.log.read())
        cls.channel = grpc.insecure_channel("127.0.0.1:%d" % cls.door)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()
        cls.server.terminate()
        cls.server.wait(timeout=30)
        cls.log.close()
        cls.collector.shutdown()
        cls.collector.server_close()

    def unary(self, method, request, response, metadata=()):
        call = self.channel.unary_unary("/%s/%s" % (SERVICE, method), request_serializer=request.SerializeToString,
                                        response_deserializer=response.FromString)
        return call(request, metadata=list(metadata), timeout=10)

    def spans_of(self, trace_id=None, method=None, system=None, count=1):
        """The spans sent for a trace (or a method and rpc.system), waiting up to 15 s for
        `count` of them (the exporter sends every second)."""
        deadline = time.time() + 15
        while True:
            with Collector.lock:
                found = [span for _, span in Collector.spans
                         if (trace_id is None or span.trace_id.hex() == trace_id)
                         and (method is None or attributes(span).get("rpc.method") == method)
                         and (system is None or attributes(span).get("rpc.system") == system)]
            if len(found) >= count or time.time() > deadline:
                return found
            time.sleep(0.2)

    def test_a_grpc_call_is_a_child_of_its_callers_trace(self):
        trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
        self.unary("CheckEntitlements", svc.CheckEntitlementsRequest(user_id="user-1", at=AT), svc.CheckEntitlementsResponse,
                   [("traceparent", "00-%s-%s-01" % (trace_id, parent))])
        spans = self.spans_of(trace_id)
        self.assertEqual(len(spans), 1, spans)
        span = spans[0]
        self.assertEqual(span.name, SERVICE + "/CheckEntitlements")
        self.assertEqual(span.kind, trace_pb2.Span.SPAN_KIND_SERVER)
        self.assertEqual(span.parent_span_id.hex(), parent)
        values = attributes(span)
        self.assertEqual(values["rpc.system"], "grpc")
        self.assertEqual(values["rpc.service"], SERVICE)
        self.assertEqual(values["rpc.method"], "CheckEntitlements")
        self.assertEqual(values["rpc.grpc.status_code"], 0)
        self.assertIn(values["entitlements.cache"], ("hit", "miss"))
        self.assertIn(values["entitlements.cold_read"], (True, False))
        self.assertNotEqual(span.status.code, trace_pb2.Status.STATUS_CODE_ERROR)
        self.assertGreater(span.end_time_unix_nano, span.start_time_unix_nano)
        # The same user again: the answer is cached now.
        second = "5bf92f3577b34da6a3ce929d0e0e4736"
        self.unary("CheckEntitlements", svc.CheckEntitlementsRequest(user_id="user-1", at=AT), svc.CheckEntitlementsResponse,
                   [("traceparent", "00-%s-%s-01" % (second, parent))])
        cached = attributes(self.spans_of(second)[0])
        self.assertEqual(cached["entitlements.cache"], "hit")
        self.assertIs(cached["entitlements.cold_read"], False)
        resource = [resource for resource, s in Collector.spans if s.trace_id.hex() == trace_id][0]
        self.assertEqual(resource.get("service.name"), "entitlements")

    def test_a_refused_call_has_an_error_status_with_its_message(self):
        trace_id = "6bf92f3577b34da6a3ce929d0e0e4736"
        with self.assertRaises(grpc.RpcError) as raised:
            self.unary("CheckEntitlements", svc.CheckEntitlementsRequest(), svc.CheckEntitlementsResponse,
                       [("traceparent", "00-%s-00f067aa0ba902b7-01" % trace_id)])
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        span = self.spans_of(trace_id)[0]
        self.assertEqual(attributes(span)["rpc.grpc.status_code"], 3)
        self.assertEqual(span.status.code, trace_pb2.Status.STATUS_CODE_ERROR)
        self.assertIn("user_id", span.status.message)

    def test_a_json_call_over_http1_is_traced_with_its_traceparent(self):
        trace_id = "7bf92f3577b34da6a3ce929d0e0e4736"
        connection = http.client.HTTPConnection("127.0.0.1", self.door, timeout=10)
        connection.request("POST", "/%s/Health" % SERVICE, body="{}",
                           headers={"Content-Type": "application/json",
                                    "traceparent": "00-%s-00f067aa0ba902b7-01" % trace_id})
        self.assertEqual(connection.getresponse().status, 200)
        connection.close()
        span = self.spans_of(trace_id)[0]
        self.assertEqual(span.name, SERVICE + "/Health")
        self.assertEqual(attributes(span)["rpc.system"], "connect_rpc")

    def test_a_framed_call_starts_a_trace_of_its_own(self):
        subprocess.run([ENT, "check", "--server", "127.0.0.1:%d" % self.tcp, "--user", "user-2"],
                       check=True, stdout=subprocess.DEVNULL)
        spans = self.spans_of(method="CheckEntitlements", system="entitlements_framed")
        self.assertGreaterEqual(len(spans), 1)
        self.assertEqual(spans[0].parent_span_id, b"")
        self.assertEqual(attributes(spans[0])["rpc.grpc.status_code"], 0)

    def test_a_caller_trace_not_sampled_is_not_recorded(self):
        trace_id = "8bf92f3577b34da6a3ce929d0e0e4736"
        self.unary("Health", svc.HealthRequest(), svc.HealthResponse, [("traceparent", "00-%s-00f067aa0ba902b7-00" % trace_id)])
        marker = "9bf92f3577b34da6a3ce929d0e0e4736"
        self.unary("Health", svc.HealthRequest(), svc.HealthResponse, [("traceparent", "00-%s-00f067aa0ba902b7-01" % marker)])
        self.assertTrue(self.spans_of(marker), "the sampled call after it was exported")
        self.assertEqual(self.spans_of(trace_id, count=0), [])

    def test_a_wait_for_the_log_is_on_the_span(self):
        trace_id = "abf92f3577b34da6a3ce929d0e0e4736"
        # A sequence this server has not reached: the check waits until its deadline (1 s,
        # before --min-sequence-wait's 5 s); its span says what it waited for.
        with self.assertRaises(grpc.RpcError) as raised:
            call = self.channel.unary_unary("/%s/CheckEntitlements" % SERVICE, request_serializer=svc.CheckEntitlementsRequest.SerializeToString,
                                            response_deserializer=svc.CheckEntitlementsResponse.FromString)
            call(svc.CheckEntitlementsRequest(user_id="user-1", at=AT, min_log_sequence=1 << 40), timeout=1,
                 metadata=[("traceparent", "00-%s-00f067aa0ba902b7-01" % trace_id)])
        self.assertEqual(raised.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        span = self.spans_of(trace_id)[0]
        self.assertEqual(attributes(span)["entitlements.min_log_sequence"], 1 << 40)
        self.assertIn("waiting for the log to reach min_log_sequence", [event.name for event in span.events])

    def test_a_framed_check_cancelled_while_it_waits_ends_cancelled(self):
        # docs/PROTOCOL.md: 24-byte big-endian headers; REQUEST 1, RESPONSE 2, CANCEL 5.
        header = struct.Struct(">HBBBBHQII")
        sequence = 1 << 41
        request = svc.CheckEntitlementsRequest(user_id="user-1", at=AT, min_log_sequence=sequence).SerializeToString()
        with socket.create_connection(("127.0.0.1", self.tcp), timeout=10) as sock:
            sock.sendall(header.pack(0x454E, 1, 1, 0, 0, 1, 1, 0, len(request)) + request)
            time.sleep(0.3)  # it waits for a sequence this server never reaches (--min-sequence-wait 5s)
            sock.sendall(header.pack(0x454E, 1, 5, 0, 0, 0, 1, 0, 0))
            answer = b""
            while len(answer) < 24:
                answer += sock.recv(24 - len(answer))
            _, _, kind, _, status, _, request_id, _, _ = header.unpack(answer)
            self.assertEqual((kind, status, request_id), (2, 1, 1), "RESPONSE CANCELLED for call 1")
        deadline = time.time() + 15
        while time.time() < deadline:
            with Collector.lock:
                found = [s for _, s in Collector.spans if attributes(s).get("entitlements.min_log_sequence") == sequence]
            if found:
                break
            time.sleep(0.2)
        self.assertEqual(len(found), 1, found)
        self.assertEqual(attributes(found[0])["rpc.system"], "entitlements_framed")
        self.assertEqual(attributes(found[0])["rpc.grpc.status_code"], 1, "CANCELLED, as the client was answered")

    def test_zz_the_collector_saw_nothing_malformed(self):
        self.assertTrue(Collector.spans)
        self.assertEqual(Collector.problems, [])


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]], verbosity=2)
