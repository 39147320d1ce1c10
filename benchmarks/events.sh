#!/usr/bin/env bash
# What outbound events (docs/events.md) cost the checks: p1 (1 x 1) and p2 (50 x 1) against
# the same server with writes going on (50 grants a second through the JSON door), without
# events, and with events POSTed to a destination that answers slowly (each POST held 1 s,
# so deliveries back up); rounds interleaved, pinned as run.sh pins (server CPU 0, LoadGen,
# the writer and the receiver CPU 1).
#
#   benchmarks/events.sh [--runs 3] [--seconds 10]
#
# Writes benchmarks/results/<date>/events/ (summary.md by summarize.py).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=3; DURATION=10; WARMUP=2; CUSTOMERS=100000; PORT=7498; DOOR=7499; RECEIVER=7500
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift ;;
    --seconds) DURATION=$2; shift ;;
    *) echo "events.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
swift build -c release --product entitlements >/dev/null
swift build -c release --package-path benchmarks --product LoadGen >/dev/null
ENT=.build/release/entitlements; LOAD=benchmarks/.build/release/LoadGen
OUT=benchmarks/results/$(date -u +%Y-%m-%d)/events
mkdir -p "$OUT"; rm -f "$OUT"/*.json "$OUT"/*.hgrm
WORK=$(mktemp -d)
PIDS=()
trap 'for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$WORK"' EXIT
$ENT snapshot generate --customers $CUSTOMERS --seed 1 --output "$WORK/data.snap" >/dev/null
openssl rand -hex 32 > "$WORK/secret"

# The slow destination: takes each POST, answers 200 after 1 s.
cat > "$WORK/receiver.py" <<'EOF'
import http.server, sys, time
class Slow(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        time.sleep(1)
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Slow)
server.daemon_threads = True
server.serve_forever()
EOF
# The writer: 50 grants a second, each to another customer, through the JSON door.
cat > "$WORK/writer.py" <<'EOF'
import http.client, json, sys, time
door, customers = int(sys.argv[1]), int(sys.argv[2])
connection = http.client.HTTPConnection("127.0.0.1", door, timeout=10)
n, start = 0, time.time()
while True:
    body = json.dumps({"userId": "user-%d" % (n * 7919 % customers), "grant": {"grantId": "bench-%d" % n, "entitlementId": "bench", "grantedDate": int(time.time() * 1000)}})
    connection.request("POST", "/entitlements.v1.EntitlementService/GrantEntitlement", body=body, headers={"Content-Type": "application/json"})
    connection.getresponse().read()
    n += 1
    time.sleep(max(0, start + n / 50 - time.time()))
EOF
taskset -c 1 python3 "$WORK/receiver.py" $RECEIVER & PIDS+=($!)

run_system() { # system serve-args...
  local system=$1; shift
  rm -rf "$WORK/data"
  taskset -c 0 $ENT serve --data-dir "$WORK/data" --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --grpc-listen 127.0.0.1:$DOOR \
    --threads 1 --resolvers 1 "$@" > "$WORK/serve.log" 2>&1 &
  local server=$!
  for _ in $(seq 1 300); do grep -q "listening on 127.0.0.1:$PORT" "$WORK/serve.log" && break; sleep 0.1; done
  taskset -c 1 python3 "$WORK/writer.py" $DOOR $CUSTOMERS & local writer=$!
  for profile in p1 p2; do
    local connections=$([ $profile = p1 ] && echo 1 || echo 50)
    taskset -c 1 $LOAD run --target entitlements --port $PORT --customers $CUSTOMERS --connections $connections --in-flight 1 \
      --duration $DURATION --warmup $WARMUP --server-pid $server \
      --label "$system $profile (run $ROUND)" --json "$OUT/$system-$profile-run$ROUND.json" --distribution "$OUT/$system-$profile-run$ROUND.hgrm"
  done
  kill $writer; wait $writer 2>/dev/null || true
  grep -E "^events:" "$WORK/serve.log" || true
  kill -INT $server; wait $server 2>/dev/null || true
}

for ROUND in $(seq 1 $RUNS); do
  echo "events.sh: round $ROUND of $RUNS"
  run_system entitlements
  run_system events_slow --event-webhook http://127.0.0.1:$RECEIVER/hook --event-webhook-secret-file "$WORK/secret"
done
python3 benchmarks/summarize.py "$OUT" >/dev/null || true
echo "events.sh: results in $OUT"
