#!/usr/bin/env bash
# One command for the side-by-side benchmarks (benchmarks/README.md):
#
#   benchmarks/run.sh           # full: 10 s per profile, 100,000 customers
#   benchmarks/run.sh --quick   # 2 s per profile, 10,000 customers (CI, so this cannot rot)
#
# Installs what is missing (redis-server, matplotlib), builds release, generates the data
# set, starts each system pinned to one core (the load generator on another), runs the
# profiles against each in turn with the same keys and payload bytes, and writes
# benchmarks/results/<date>/ (or .build/bench-quick/ for --quick): summary.md with ratios,
# one JSON summary and one percentile distribution per run, and latency.png.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
if [ $QUICK = 1 ]; then
  DURATION=2; WARMUP=1; CUSTOMERS=10000; OUT=.build/bench-quick
else
  DURATION=10; WARMUP=2; CUSTOMERS=100000; OUT=benchmarks/results/$(date -u +%Y-%m-%d)
fi
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
PORT=7490; UNIX_SOCKET=/tmp/entitlements-bench.sock; REDIS_PORT=7491

# 1. What is missing.
make deps >/dev/null
missing=""
command -v redis-server >/dev/null || missing="$missing redis-server"
python3 -c 'import matplotlib' 2>/dev/null || missing="$missing python3-matplotlib"
if [ -n "$missing" ]; then
  echo "run.sh: installing$missing"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
# A python3 that is not Debian's (pyenv, venv) does not see apt's packages: use pip.
python3 -c 'import matplotlib' 2>/dev/null || python3 -m pip install --quiet matplotlib || true

# 2. Build.
swift build -c release --product entitlements
swift build -c release --package-path benchmarks --product LoadGen
ENT=.build/release/entitlements
LOAD=benchmarks/.build/release/LoadGen

# 3. Data: the same customers for every system.
WORK=$(mktemp -d)
mkdir -p "$OUT"
$ENT snapshot generate --customers $CUSTOMERS --seed 1 --output "$WORK/data.snap" >/dev/null

# 4. Pinning: servers on CPU 0, the load generator on CPU 1 (when there are two).
# Redis runs one thread; ours gets one event loop thread on its one core (--threads 1):
# more threads than cores only adds context switches (measured: 50 x 16 went from 72k to
# 150k requests/s on one pinned core).
if [ "$(nproc)" -ge 2 ]; then SERVER_CPU="taskset -c 0"; CLIENT_CPU="taskset -c 1"; THREADS="--threads 1 --resolvers 1"; else SERVER_CPU=""; CLIENT_CPU=""; THREADS=""; fi

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$WORK" "$UNIX_SOCKET"; }
trap cleanup EXIT

wait_for() { # file pattern
  for _ in $(seq 1 600); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "run.sh: timed out waiting for '$2' in $1" >&2; cat "$1" >&2; exit 1
}

load() { # system profile args...
  local system=$1 profile=$2; shift 2
  $CLIENT_CPU $LOAD run "$@" --duration $DURATION --warmup $WARMUP --customers $CUSTOMERS \
    --label "$system $profile" --json "$OUT/$system-$profile.json" --distribution "$OUT/$system-$profile.hgrm"
}

throughput() { python3 -c "import json,sys; print(int(json.load(open(sys.argv[1]))['throughput']))" "$1"; }

# 5. Redis: persistence off, each customer's encoded CheckEntitlementsResponse as a string.
$SERVER_CPU redis-server --port $REDIS_PORT --bind 127.0.0.1 --save "" --appendonly no > "$WORK/redis.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/redis.log" "Ready to accept connections"
$LOAD load-redis --port $REDIS_PORT --snapshot "$WORK/data.snap"
REDIS=(--target redis --port $REDIS_PORT)
load redis p1 "${REDIS[@]}" --connections 1 --in-flight 1
load redis p2 "${REDIS[@]}" --connections 50 --in-flight 1
load redis p3 "${REDIS[@]}" --connections 50 --in-flight 16
load redis p4 "${REDIS[@]}" --connections 50 --rate $(( $(throughput "$OUT/redis-p2.json") / 2 ))
kill "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=()

# 6. This service, read-only on the same snapshot, with its cache holding every customer.
$SERVER_CPU $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --unix $UNIX_SOCKET $THREADS > "$WORK/serve.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/serve.log" "listening on unix:"
OURS=(--target entitlements --port $PORT)
load entitlements p1 "${OURS[@]}" --connections 1 --in-flight 1
load entitlements p2 "${OURS[@]}" --connections 50 --in-flight 1
load entitlements p3 "${OURS[@]}" --connections 50 --in-flight 16
load entitlements p4 "${OURS[@]}" --connections 50 --rate $(( $(throughput "$OUT/entitlements-p2.json") / 2 ))
load entitlements p7-unix --target entitlements --unix $UNIX_SOCKET --connections 50 --in-flight 1
grep VmHWM "/proc/${PIDS[0]}/status" | awk '{print $2}' > "$OUT/entitlements-rss-kib.txt"
kill -INT "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=()

# 7. Profile 6: 95% checks, 5% writes, on a data directory (group commit).
$SERVER_CPU $ENT serve --data-dir "$WORK/data" --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT $THREADS > "$WORK/serve-writes.log" 2>&1 &
PIDS+=($!)
wait_for "$WORK/serve-writes.log" "listening on 127.0.0.1:$PORT"
load entitlements p6-mixed "${OURS[@]}" --connections 50 --in-flight 1 --write-percent 5
kill -INT "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=()

# 8. Summary, ratios and the plot.
python3 benchmarks/summarize.py "$OUT" $([ $QUICK = 1 ] && echo --quick)
echo "run.sh: results in $OUT"
