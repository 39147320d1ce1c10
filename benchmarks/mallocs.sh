#!/usr/bin/env bash
# Heap allocations per request on the live server, counted by the kernel (uprobes on
# glibc's malloc, calloc, realloc and posix_memalign), not by an interposer:
#
#   benchmarks/mallocs.sh [--connections 50] [--in-flight 1] [--batch 1] [--seconds 5] [--token] [--tls] [--door]
#
# Needs root (perf probe) and release builds of `entitlements` and LoadGen (run.sh builds
# both). Starts `serve --threads 1 --resolvers 1` on 100,000 generated customers (every answer
# cached: each check is a cache hit), drives it with LoadGen, and divides the server's
# allocation calls in LoadGen's measured window (after a 2 s warm-up, the connections up)
# by the requests answered in it (with --batch B, a request is a BatchCheckEntitlements of
# B customers); the whole run's count, connection setup included, is printed too. ENT=path overrides the server binary (to compare two builds). --token: the
# server has a token file and each connection authenticates first (docs/security.md);
# --tls: and the connections are TLS (openssl-made certificate). --door: the checks go
# through the gRPC door (`serve --grpc-listen`, LoadGen's HTTP/2 client) instead.
set -euo pipefail
cd "$(dirname "$0")/.."
CONNECTIONS=50; IN_FLIGHT=1; BATCH=1; SECONDS_=5; TOKEN_=0; TLS_=0; DOOR_=0
while [ $# -gt 0 ]; do
  case "$1" in
    --connections) CONNECTIONS=$2; shift ;;
    --in-flight) IN_FLIGHT=$2; shift ;;
    --batch) BATCH=$2; shift ;;
    --seconds) SECONDS_=$2; shift ;;
    --token) TOKEN_=1 ;;
    --tls) TLS_=1; TOKEN_=1 ;;
    --door) DOOR_=1 ;;
    *) echo "mallocs.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
command -v perf >/dev/null || { echo "mallocs.sh: needs perf (apt-get install linux-perf)" >&2; exit 2; }
ENT=${ENT:-.build/release/entitlements}; LOAD=benchmarks/.build/release/LoadGen
[ -x $ENT ] && [ -x $LOAD ] || { echo "mallocs.sh: build first: benchmarks/run.sh --quick, or swift build -c release" >&2; exit 2; }
LIBC=$(ldd $ENT | awk '/libc.so.6/ {print $3}')
WORK=$(mktemp -d); PORT=7495; DOOR_PORT=7498
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
for function in malloc calloc realloc posix_memalign; do
  perf probe -q -x "$LIBC" "$function" 2>/dev/null || true
done
$ENT snapshot generate --customers 100000 --seed 1 --output "$WORK/data.snap" >/dev/null
SERVE_EXTRA=(); LOAD_EXTRA=()
if [ $TOKEN_ = 1 ]; then
  TOKEN=$(openssl rand -hex 32); echo "$TOKEN check" > "$WORK/tokens"
  SERVE_EXTRA+=(--auth-token-file "$WORK/tokens"); LOAD_EXTRA+=(--token "$TOKEN")
fi
if [ $TLS_ = 1 ]; then
  dev/make-test-certificates.sh "$WORK"
  SERVE_EXTRA+=(--tls-cert "$WORK/server.pem" --tls-key "$WORK/server.key"); LOAD_EXTRA+=(--tls-ca "$WORK/ca.pem")
fi
TARGET=(--target entitlements --port $PORT)
if [ $DOOR_ = 1 ]; then
  SERVE_EXTRA+=(--grpc-listen 127.0.0.1:$DOOR_PORT); TARGET=(--target grpc --port $DOOR_PORT)
fi
taskset -c 0 $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --threads 1 --resolvers 1 "${SERVE_EXTRA[@]}" > "$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do grep -q "^listening on" "$WORK/serve.log" && { [ $DOOR_ = 0 ] || grep -q "^grpc listening on" "$WORK/serve.log"; } && break; sleep 0.1; done
EVENTS=probe_libc:malloc,probe_libc:calloc,probe_libc:realloc,probe_libc:posix_memalign
# Two counts: the whole run (connection setup and the first answers included), and the
# steady state: LoadGen's measured window, after its 2 s warm-up, with the connections up.
perf stat -x, -o "$WORK/all.txt" -e $EVENTS -p $SERVER &
ALL=$!
sleep 0.5
taskset -c 1 $LOAD run "${TARGET[@]}" --connections $CONNECTIONS --in-flight $IN_FLIGHT --batch $BATCH \
  --duration $SECONDS_ --warmup 2 --customers 100000 --json "$WORK/run.json" --label "mallocs" "${LOAD_EXTRA[@]}" >/dev/null &
LOADGEN=$!
sleep 2
perf stat -x, -o "$WORK/stat.txt" -e $EVENTS -p $SERVER -- sleep "$SECONDS_" 2>/dev/null
wait $LOADGEN
sleep 0.5
kill -INT $ALL; wait $ALL 2>/dev/null || true
python3 - "$WORK/stat.txt" "$WORK/run.json" "$WORK/all.txt" <<'PY'
import json, sys
def counts(path):
    found = {}
    for line in open(path):
        parts = line.strip().split(",")
        if len(parts) > 2 and parts[0].isdigit():
            found[parts[2].split(":")[-1]] = int(parts[0])
    return found
steady, whole = counts(sys.argv[1]), counts(sys.argv[3])
requests = json.load(open(sys.argv[2]))["requests"]
print(f"steady state: {requests:,} requests answered in the measured window; server allocation calls: " + ", ".join(f"{k} {v:,}" for k, v in steady.items()))
print(f"{sum(steady.values()) / max(1, requests):.3f} allocations per request")
print(f"whole run (connections' setup and warm-up included): {sum(whole.values()):,} allocation calls")
PY
