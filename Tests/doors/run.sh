#!/usr/bin/env bash
# The doors' foreign-client tests (docs/doors.md), run by `make test` (test-doors):
# starts `entitlements serve` with --grpc-listen on the docs/examples data (a data
# directory, so writes work), then drives it with
#   - Python: grpcio, stubs generated from proto/ now, the standard health client, hyper-h2
#     (Tests/doors/test_doors.py), and HTTP/1.1 JSON;
#   - Go: grpc-go from Debian, built in GOPATH mode with messages generated from proto/ now
#     (Tests/doors/go/client.go);
#   - curl: the README's JSON line;
#   - every method through every transport (framed TCP, Unix and TLS, gRPC, JSON over
#     HTTP/2 and HTTP/1.1, plain and TLS) against one table of permissions and limits
#     (Tests/doors/test_every_door.py, which starts two servers of its own);
#   - tracing: spans sent to an OTLP/HTTP receiver the test runs (Tests/doors/test_tracing.py).
# Usage: Tests/doors/run.sh [path/to/entitlements]   (default .build/debug/entitlements)
# Talks to loopback only; stops the server it started, by its pid.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
ENT="${1:-.build/debug/entitlements}"
work="$(mktemp -d /tmp/entitlements-doors-XXXXXX)"
pid=""
cleanup() { if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi; rm -rf "$work"; }
trap cleanup EXIT

"$ENT" snapshot build --catalog docs/examples/catalog.json --customers docs/examples/customers.jsonl --output "$work/seed.snap" >/dev/null
# --min-sequence-wait 30s: the deadline tests wait on a sequence never reached, so only
# the call's own deadline can end them.
"$ENT" serve --data-dir "$work/data" --snapshot "$work/seed.snap" --listen 127.0.0.1:0 --grpc-listen 127.0.0.1:0 \
  --admin 127.0.0.1:0 --min-sequence-wait 30s > "$work/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do grep -q "^grpc listening on" "$work/serve.log" 2>/dev/null && break; sleep 0.1; done
grep -q "^grpc listening on" "$work/serve.log" || { echo "doors: serve did not start:" >&2; cat "$work/serve.log" >&2; exit 1; }
port="$(grep "^grpc listening on" "$work/serve.log" | sed 's/.*://')"
admin="$(grep "^admin listening on" "$work/serve.log" | sed 's/.*://')"

echo "doors: Python (grpcio, grpcio-health-checking, h2, HTTP/1.1 JSON) against 127.0.0.1:$port"
DOOR_PORT=$port ADMIN_PORT=$admin python3 Tests/doors/test_doors.py

echo "doors: Go (grpc-go $(dpkg-query -W -f='${Version}' golang-google-grpc-dev 2>/dev/null || echo '?'))"
gopath="$work/go"
mkdir -p "$gopath/src/example.com/entitlementsv1" "$gopath/src/doorclient"
protoc -Iproto --go_out="$gopath/src/example.com/entitlementsv1" --go_opt=paths=source_relative \
  --go_opt=Mentitlements/v1/types.proto=example.com/entitlementsv1 \
  --go_opt=Mentitlements/v1/service.proto=example.com/entitlementsv1 \
  entitlements/v1/types.proto entitlements/v1/service.proto
mv "$gopath/src/example.com/entitlementsv1/entitlements/v1/"*.go "$gopath/src/example.com/entitlementsv1/"
cp Tests/doors/go/client.go "$gopath/src/doorclient/"
GO111MODULE=off GOPATH="$gopath:/usr/share/gocode" GOCACHE="$work/gocache" GOFLAGS=-mod=mod go build -o "$work/go-client" doorclient
"$work/go-client" -addr "127.0.0.1:$port"

echo "doors: curl (the README's line)"
answer="$(curl -sS -X POST -H 'Content-Type: application/json' -d '{"userId": "user-1", "at": "1769904000000"}' \
  "http://127.0.0.1:$port/entitlements.v1.EntitlementService/CheckEntitlements")"
echo "$answer" | python3 -c 'import json,sys; a=json.load(sys.stdin); assert a["entitlements"]["premium"]["isActive"], a; print("curl: premium active")'
code="$(curl -sS -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' -d '{"userId": ' \
  "http://127.0.0.1:$port/entitlements.v1.EntitlementService/CheckEntitlements")"
[ "$code" = 400 ] || { echo "doors: curl with a broken body: want HTTP 400, got $code" >&2; exit 1; }

# The drain: a watch and a health watch open over gRPC, then SIGTERM. The watch must end
# UNAVAILABLE, the health watch say NOT_SERVING and end, and the server exit 0, drained.
DOOR_PORT=$port ADMIN_PORT=$admin python3 Tests/doors/test_doors.py --drain-watch > "$work/drain.out" 2>&1 &
watcher=$!
for _ in $(seq 1 300); do grep -q "^watching" "$work/drain.out" 2>/dev/null && break; sleep 0.1; done
grep -q "^watching" "$work/drain.out" || { echo "doors: the drain watcher did not start:" >&2; cat "$work/drain.out" >&2; exit 1; }
kill -TERM "$pid"
status=0; wait "$pid" || status=$?
pid=""
[ $status = 0 ] || { echo "doors: serve exited $status after SIGTERM" >&2; cat "$work/serve.log" >&2; exit 1; }
wait "$watcher" || true
cat "$work/drain.out"
grep -q "watch ended UNAVAILABLE; health watch ended UNAVAILABLE after SERVING -> NOT_SERVING" "$work/drain.out" \
  || { echo "doors: the drain did not end the watches as docs/doors.md says" >&2; exit 1; }
# TLS and tokens (docs/security.md): a second server with --tls-cert and --auth-token-file,
# its certificate made here by openssl for localhost and 127.0.0.1.
dev/make-test-certificates.sh "$work"
token="$(openssl rand -hex 32)"
echo "$token check,write" > "$work/tokens"
"$ENT" serve --data-dir "$work/secure-data" --snapshot "$work/seed.snap" --listen 127.0.0.1:0 --grpc-listen 127.0.0.1:0 \
  --auth-token-file "$work/tokens" --tls-cert "$work/server.pem" --tls-key "$work/server.key" > "$work/secure.log" 2>&1 &
pid=$!
for _ in $(seq 1 300); do grep -q "^grpc listening on" "$work/secure.log" 2>/dev/null && break; sleep 0.1; done
grep -q "^grpc listening on" "$work/secure.log" || { echo "doors: the TLS server did not start:" >&2; cat "$work/secure.log" >&2; exit 1; }
secure_port="$(grep "^grpc listening on" "$work/secure.log" | sed 's/.*://')"
echo "doors: Python over TLS with a token (grpcio secure channel, HTTPS JSON) against localhost:$secure_port"
SECURE_PORT=$secure_port CA="$work/ca.pem" TOKEN="$token" python3 Tests/doors/test_secure_door.py
kill -TERM "$pid"; wait "$pid" || true
pid=""
echo "doors: every method through every transport, with and without tokens, plain and TLS (Python)"
python3 Tests/doors/test_every_door.py "$ENT"
echo "doors: tracing, against an OTLP/HTTP receiver (opentelemetry-proto)"
python3 Tests/doors/test_tracing.py "$ENT"
echo "doors: all foreign clients passed"
