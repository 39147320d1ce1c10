#!/usr/bin/env bash
# The cost of security (docs/security.md) on the framed protocol, in one run: p2 (50 x 1)
# and p3 (50 x 16) against the same server plain, with a token file (each connection
# authenticates first), and over TLS with the token; rounds interleaved, pinned as
# run.sh pins (server CPU 0, LoadGen CPU 1). run.sh has the same rows in its full summary;
# this runs only them, in a few minutes.
#
#   benchmarks/security.sh [--runs 3] [--seconds 10]
#
# Writes benchmarks/results/<date>/security/ (summary.md by summarize.py).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=3; DURATION=10; WARMUP=2; CUSTOMERS=100000; PORT=7496
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) RUNS=$2; shift ;;
    --seconds) DURATION=$2; shift ;;
    *) echo "security.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
swift build -c release --product entitlements >/dev/null
swift build -c release --package-path benchmarks --product LoadGen >/dev/null
ENT=.build/release/entitlements; LOAD=benchmarks/.build/release/LoadGen
OUT=benchmarks/results/$(date -u +%Y-%m-%d)/security
mkdir -p "$OUT"; rm -f "$OUT"/*.json "$OUT"/*.hgrm
WORK=$(mktemp -d)
PID=""
trap '[ -n "$PID" ] && kill "$PID" 2>/dev/null; rm -rf "$WORK"' EXIT
$ENT snapshot generate --customers $CUSTOMERS --seed 1 --output "$WORK/data.snap" >/dev/null
dev/make-test-certificates.sh "$WORK"
TOKEN=$(openssl rand -hex 32); echo "$TOKEN check" > "$WORK/tokens"

run_system() { # system serve-args -- load-args
  local system=$1; shift
  local serve=() load=()
  while [ "$1" != "--" ]; do serve+=("$1"); shift; done; shift
  load=("$@")
  taskset -c 0 $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --threads 1 --resolvers 1 "${serve[@]}" > "$WORK/serve.log" 2>&1 &
  PID=$!
  for _ in $(seq 1 300); do grep -q "listening on 127.0.0.1:$PORT" "$WORK/serve.log" && break; sleep 0.1; done
  for profile in p2 p3; do
    local inflight=$([ $profile = p2 ] && echo 1 || echo 16)
    taskset -c 1 $LOAD run --target entitlements --port $PORT --customers $CUSTOMERS --connections 50 --in-flight $inflight \
      --duration $DURATION --warmup $WARMUP --server-pid $PID "${load[@]}" \
      --label "$system $profile (run $ROUND)" --json "$OUT/$system-$profile-run$ROUND.json" --distribution "$OUT/$system-$profile-run$ROUND.hgrm"
  done
  kill -INT $PID; wait $PID 2>/dev/null || true; PID=""
}

for ROUND in $(seq 1 $RUNS); do
  echo "security.sh: round $ROUND of $RUNS"
  run_system entitlements --
  run_system framed_token --auth-token-file "$WORK/tokens" -- --token "$TOKEN"
  run_system framed_tls --auth-token-file "$WORK/tokens" --tls-cert "$WORK/server.pem" --tls-key "$WORK/server.key" -- \
    --token "$TOKEN" --tls-ca "$WORK/ca.pem"
done
python3 benchmarks/summarize.py "$OUT" >/dev/null
echo "security.sh: results in $OUT/summary.md"
