"""The door over TLS with a token file (docs/security.md, docs/doors.md), driven by real
clients: grpcio with TLS channel credentials and bearer metadata, the standard health
client, and HTTPS JSON from the standard library. Tests/doors/run.sh starts the server
(--tls-cert, --auth-token-file) and passes SECURE_PORT, CA (the CA's PEM file) and TOKEN
(a write token)."""
import http.client
import json
import os
import ssl
import unittest

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

PORT = int(os.environ["SECURE_PORT"])
CA = os.environ["CA"]
TOKEN = os.environ["TOKEN"]
AT = 1769904000000  # user-1's subscription is active then (docs/examples)

from stubs import service_pb2_grpc, svc, types  # noqa: E402


class SecureDoorTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(CA, "rb") as file:
            credentials = grpc.ssl_channel_credentials(root_certificates=file.read())
        cls.channel = grpc.secure_channel("localhost:%d" % PORT, credentials)
        cls.stub = service_pb2_grpc.EntitlementServiceStub(cls.channel)

    @classmethod
    def tearDownClass(cls):
        cls.channel.close()

    def grant(self, grant_id, metadata=None):
        request = svc.GrantEntitlementRequest(user_id="tls-user", grant=types.Grant(grant_id=grant_id, entitlement_id="beta"))
        return self.stub.GrantEntitlement(request, metadata=metadata, timeout=10)

    def test_checks_over_tls_need_no_token(self):
        answer = self.stub.CheckEntitlements(svc.CheckEntitlementsRequest(user_id="user-1", at=AT), timeout=10)
        self.assertTrue({e.id: e for e in answer.entitlements}["premium"].is_active)

    def test_health_over_tls(self):
        answer = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        self.assertEqual(answer.status, health_pb2.HealthCheckResponse.SERVING)

    def test_a_write_without_a_token_is_unauthenticated(self):
        with self.assertRaises(grpc.RpcError) as caught:
            self.grant("g-none")
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        self.assertIn("present a token", caught.exception.details())

    def test_a_write_with_the_token_is_written(self):
        answer = self.grant("g-token", metadata=[("authorization", "Bearer " + TOKEN)])
        self.assertTrue(answer.changed)

    def test_a_wrong_token_is_refused_even_for_a_check(self):
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.CheckEntitlements(svc.CheckEntitlementsRequest(user_id="user-1", at=AT),
                                        metadata=[("authorization", "Bearer not-the-token-at-all")], timeout=10)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
        self.assertEqual(caught.exception.details(), "the token presented is not one of --auth-token-file's")

    def test_a_plain_text_client_cannot_call_a_tls_door(self):
        channel = grpc.insecure_channel("127.0.0.1:%d" % PORT)
        stub = service_pb2_grpc.EntitlementServiceStub(channel)
        with self.assertRaises(grpc.RpcError) as caught:
            stub.CheckEntitlements(svc.CheckEntitlementsRequest(user_id="user-1", at=AT), timeout=5)
        self.assertEqual(caught.exception.code(), grpc.StatusCode.UNAVAILABLE)
        channel.close()

    def test_https_json_with_and_without_the_token(self):
        context = ssl.create_default_context(cafile=CA)
        body = json.dumps({"userId": "json-tls-user", "grant": {"grantId": "g-json", "entitlementId": "beta"}})
        for headers, status in [({}, 401), ({"Authorization": "Bearer " + TOKEN}, 200)]:
            connection = http.client.HTTPSConnection("localhost", PORT, context=context, timeout=10)
            connection.request("POST", "/entitlements.v1.EntitlementService/GrantEntitlement", body=body,
                               headers=dict({"Content-Type": "application/json"}, **headers))
            response = connection.getresponse()
            text = response.read().decode()
            self.assertEqual(response.status, status, text)
            if status == 401:
                self.assertEqual(json.loads(text)["code"], "unauthenticated")
            connection.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
