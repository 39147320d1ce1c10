"""The messages and gRPC stubs of proto/entitlements/v1, generated now from the .proto files
with grpcio-tools (so the tests always speak the committed protocol) into a temporary
folder put on sys.path. Every door test imports them from here:

    from stubs import svc, types, service_pb2_grpc"""
import os
import sys
import tempfile

from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = tempfile.mkdtemp(prefix="door-stubs-")

if protoc.main(["protoc", "-I" + os.path.join(ROOT, "proto"), "--python_out=" + OUT, "--grpc_python_out=" + OUT,
                "entitlements/v1/types.proto", "entitlements/v1/service.proto"]) != 0:
    raise SystemExit("grpc_tools.protoc failed on proto/")
sys.path.insert(0, OUT)
from entitlements.v1 import service_pb2 as svc  # noqa: E402,F401
from entitlements.v1 import service_pb2_grpc  # noqa: E402,F401
from entitlements.v1 import types_pb2 as types  # noqa: E402,F401
