#!/usr/bin/env bash
# One command for the side-by-side benchmarks (benchmarks/README.md):
#
#   benchmarks/run.sh             # full: 3 rounds, 10 s per profile, 100,000 customers
#   benchmarks/run.sh --quick     # 1 round, 2 s per profile, 10,000 customers, the server's debug build (CI, so this cannot rot)
#   benchmarks/run.sh --runs 5    # more rounds; the summary reports the median of each cell
#
# Installs what is missing (redis-server, matplotlib), builds release, generates the data
# sets, starts each system pinned to one core (the load generator on another), runs the
# profiles against each in turn with the same keys and payload bytes, and writes
# benchmarks/results/<date>/ (or .build/bench-quick/ for --quick): summary.md with ratios
# to Redis and to grpc-go, the targets, one JSON summary and one percentile distribution per
# run, and latency.png. The gRPC peers (peers/: grpc-go and gRPC C++ from Debian's packages,
# the grpc-swift-2 peer) answer the same bytes Redis holds.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0; RUNS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1; RUNS=1 ;;
    --runs) [ $# -ge 2 ] && [ "$2" -ge 1 ] 2>/dev/null || { echo "run.sh: --runs takes a whole number >= 1" >&2; exit 2; }; RUNS=$2; shift ;;
    *) echo "run.sh: unknown argument '$1' (use --quick or --runs N)" >&2; exit 2 ;;
  esac
  shift
done
if [ $QUICK = 1 ]; then
  DURATION=2; WARMUP=1; CUSTOMERS=10000; OUT=.build/bench-quick
  COLD_CUSTOMERS=200000; COLD_CACHE=2MiB
else
  DURATION=10; WARMUP=2; CUSTOMERS=100000; OUT=benchmarks/results/$(date -u +%Y-%m-%d)
  COLD_CUSTOMERS=5000000; COLD_CACHE=64MiB
fi
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
PORT=7490; UNIX_SOCKET=/tmp/entitlements-bench.sock; REDIS_PORT=7491; GRPC_PORT=7493; DOOR_PORT=7494; GO_PORT=7495; CPP_PORT=7496; ADMIN_PORT=7497

# 1. What is missing.
make deps >/dev/null
missing=""
command -v redis-server >/dev/null || missing="$missing redis-server"
python3 -c 'import matplotlib' 2>/dev/null || missing="$missing python3-matplotlib"
# The gRPC C++ peer (make deps already brings grpc-go and its protobuf runtime).
pkg-config --exists grpc++ 2>/dev/null || missing="$missing libgrpc++-dev"
command -v g++ >/dev/null || missing="$missing g++"
if [ -n "$missing" ]; then
  echo "run.sh: installing$missing"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
# A python3 that is not Debian's (pyenv, venv) does not see apt's packages: use pip.
python3 -c 'import matplotlib' 2>/dev/null || python3 -m pip install --quiet matplotlib || true

# 2. Build. --quick serves with the debug build `make test` leaves (its figures mean nothing,
# and a release build of the server would add 9 minutes to CI); the load tools are release.
SERVER_CONFIG=$([ $QUICK = 1 ] && echo debug || echo release)
swift build -c $SERVER_CONFIG --product entitlements
swift build -c release --package-path benchmarks --product LoadGen
swift build -c release --package-path benchmarks --product GRPCPeer
swift build -c release --package-path benchmarks --product NearCacheLoad
swift build -c release --package-path benchmarks --product WatchFanout
ENT=.build/$SERVER_CONFIG/entitlements
LOAD=benchmarks/.build/release/LoadGen
GRPC=benchmarks/.build/release/GRPCPeer
WORK=$(mktemp -d)
# The Go and C++ peers, from Debian's packages (GOPATH mode: Debian's grpc-go is not a module).
mkdir -p "$WORK/go/src/grpcgopeer"
cp benchmarks/peers/grpc-go/main.go "$WORK/go/src/grpcgopeer/"
GO111MODULE=off GOPATH="$WORK/go:/usr/share/gocode" GOCACHE="$WORK/go/cache" go build -o "$WORK/grpc-go-peer" grpcgopeer
g++ -O2 -std=c++17 benchmarks/peers/grpc-cpp/peer.cc -o "$WORK/grpc-cpp-peer" $(pkg-config --cflags --libs grpc++)

# 3. Data: the same customers for every system; a large set for the cold profile.
# Only this harness's files: fleet.sh and security.sh keep theirs in folders of the same
# date, door-h2load.sh its door-h2load.txt beside them.
mkdir -p "$OUT"
find "$OUT" -maxdepth 1 -type f \( -name '*-run*.json' -o -name '*-run*.hgrm' -o -name '*-rss-kib.txt' \
  -o -name '*-cache-run*.txt' -o -name 'nearcache-run*.json' -o -name 'watchfanout-run*.json' -o -name summary.md -o -name latency.png -o -name redis-benchmark-get.csv \) -delete
$ENT snapshot generate --customers $CUSTOMERS --seed 1 --output "$WORK/data.snap" >/dev/null
$ENT snapshot generate --customers $COLD_CUSTOMERS --seed 2 --output "$WORK/cold.snap" >/dev/null
# The answers the gRPC peers serve: the bytes Redis holds (LoadGen export-answers).
$LOAD export-answers --snapshot "$WORK/data.snap" --output "$WORK/answers.bin" >/dev/null
# A CA and a server certificate for 127.0.0.1 (ECDSA P-256), and a token, for the TLS rows.
dev/make-test-certificates.sh "$WORK"
TOKEN=$(openssl rand -hex 32); echo "$TOKEN check" > "$WORK/tokens"

# 4. Pinning: servers on CPU 0, the load generator on CPU 1 (when there are two).
# Redis runs one thread; ours and the gRPC peer get one event loop thread on their one core
# (--threads 1): more threads than cores only adds context switches (measured: 50 x 16
# went from 72k to 150k requests/s on one pinned core).
if [ "$(nproc)" -ge 2 ]; then SERVER_CPU="taskset -c 0"; CLIENT_CPU="taskset -c 1"; THREADS="--threads 1 --resolvers 1"; GRPC_THREADS="--threads 1"; else SERVER_CPU=""; CLIENT_CPU=""; THREADS=""; GRPC_THREADS=""; fi

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done; rm -rf "$WORK" "$UNIX_SOCKET"; }
trap cleanup EXIT

wait_for() { # file pattern
  for _ in $(seq 1 3000); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done
  echo "run.sh: timed out waiting for '$2' in $1" >&2; cat "$1" >&2; exit 1
}
stop() { kill -INT "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=(); }

load() { # system profile args...
  local system=$1 profile=$2; shift 2
  $CLIENT_CPU $LOAD run "$@" --duration $DURATION --warmup $WARMUP --server-pid "${PIDS[0]}" \
    --label "$system $profile (run $ROUND)" --json "$OUT/$system-$profile-run$ROUND.json" --distribution "$OUT/$system-$profile-run$ROUND.hgrm"
}
throughput() { python3 -c "import json,sys; print(int(json.load(open(sys.argv[1]))['throughput']))" "$1"; }

# The four shared profiles against one system: p4's rate is half its own p2 maximum.
shared_profiles() { # system args...
  local system=$1; shift
  load $system p1 "$@" --customers $CUSTOMERS --connections 1 --in-flight 1
  load $system p2 "$@" --customers $CUSTOMERS --connections 50 --in-flight 1
  load $system p3 "$@" --customers $CUSTOMERS --connections 50 --in-flight 16
  load $system p4 "$@" --customers $CUSTOMERS --connections 50 --rate $(( $(throughput "$OUT/$system-p2-run$ROUND.json") / 2 ))
}

for ROUND in $(seq 1 $RUNS); do
  echo "run.sh: round $ROUND of $RUNS"

  # 5. Redis: persistence off, each customer's encoded CheckEntitlementsResponse as a string.
  $SERVER_CPU redis-server --port $REDIS_PORT --bind 127.0.0.1 --save "" --appendonly no > "$WORK/redis.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/redis.log" "Ready to accept connections"
  $LOAD load-redis --port $REDIS_PORT --snapshot "$WORK/data.snap"
  shared_profiles redis --target redis --port $REDIS_PORT
  load redis p8-batch --target redis --port $REDIS_PORT --customers $CUSTOMERS --connections 50 --in-flight 1 --batch 100
  if [ $ROUND = 1 ]; then
    # The cross-check: redis-benchmark GETs one customer's bytes, 50 x 1, against LoadGen's p2.
    $CLIENT_CPU redis-benchmark -p $REDIS_PORT -c 50 -P 1 -n $(( QUICK == 1 ? 50000 : 500000 )) --csv GET user-1 \
      > "$OUT/redis-benchmark-get.csv" 2>/dev/null || true
  fi
  stop

  # 6. This service, read-only on the same snapshot, with its cache holding every customer.
  $SERVER_CPU $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --unix $UNIX_SOCKET $THREADS > "$WORK/serve.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/serve.log" "listening on unix:"
  shared_profiles entitlements --target entitlements --port $PORT
  load entitlements p7-unix --target entitlements --unix $UNIX_SOCKET --customers $CUSTOMERS --connections 50 --in-flight 1
  load entitlements p8-batch --target entitlements --port $PORT --customers $CUSTOMERS --connections 50 --in-flight 1 --batch 100
  grep VmHWM "/proc/${PIDS[0]}/status" | awk '{print $2}' > "$OUT/entitlements-rss-kib.txt"
  stop

  # 6b. Security (docs/security.md): the same server with a token file, the load generator
  # authenticating each connection first; then also over TLS. p2 and p3 only.
  $SERVER_CPU $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --auth-token-file "$WORK/tokens" $THREADS > "$WORK/serve-token.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/serve-token.log" "listening on 127.0.0.1:$PORT"
  load framed_token p2 --target entitlements --port $PORT --token "$TOKEN" --customers $CUSTOMERS --connections 50 --in-flight 1
  load framed_token p3 --target entitlements --port $PORT --token "$TOKEN" --customers $CUSTOMERS --connections 50 --in-flight 16
  stop
  $SERVER_CPU $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --auth-token-file "$WORK/tokens" \
    --tls-cert "$WORK/server.pem" --tls-key "$WORK/server.key" $THREADS > "$WORK/serve-tls.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/serve-tls.log" "listening on 127.0.0.1:$PORT"
  load framed_tls p2 --target entitlements --port $PORT --tls-ca "$WORK/ca.pem" --token "$TOKEN" --customers $CUSTOMERS --connections 50 --in-flight 1
  load framed_tls p3 --target entitlements --port $PORT --tls-ca "$WORK/ca.pem" --token "$TOKEN" --customers $CUSTOMERS --connections 50 --in-flight 16
  stop

  # 7. The gRPC peers: grpc-go (one OS thread for Go code: GOMAXPROCS=1) and gRPC C++
  # answering the stored bytes; grpc-swift-2 in front of our resolvers and cache.
  GOMAXPROCS=1 $SERVER_CPU "$WORK/grpc-go-peer" -answers "$WORK/answers.bin" -addr 127.0.0.1:$GO_PORT > "$WORK/grpc-go.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/grpc-go.log" "listening on"
  shared_profiles grpc_go --target grpc --port $GO_PORT
  stop
  $SERVER_CPU "$WORK/grpc-cpp-peer" "$WORK/answers.bin" 127.0.0.1:$CPP_PORT > "$WORK/grpc-cpp.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/grpc-cpp.log" "listening on"
  shared_profiles grpc_cpp --target grpc --port $CPP_PORT
  stop
  $SERVER_CPU $GRPC --snapshot "$WORK/data.snap" --port $GRPC_PORT $GRPC_THREADS > "$WORK/grpc.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/grpc.log" "listening on"
  shared_profiles grpc_swift --target grpc --port $GRPC_PORT
  stop

  # 7b. Our own gRPC door (docs/doors.md, swift-nio-http2) on the same snapshot, driven by
  # the same gRPC client as the peers: the same methods behind HTTP/2 instead of frames.
  $SERVER_CPU $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT --grpc-listen 127.0.0.1:$DOOR_PORT $THREADS > "$WORK/serve-door.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/serve-door.log" "grpc listening on"
  shared_profiles door --target grpc --port $DOOR_PORT
  stop

  # 8. Profile 6: 95% checks, 5% writes, on a data directory (group commit).
  rm -rf "$WORK/data"
  $SERVER_CPU $ENT serve --data-dir "$WORK/data" --snapshot "$WORK/data.snap" --listen 127.0.0.1:$PORT $THREADS > "$WORK/serve-writes.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/serve-writes.log" "listening on 127.0.0.1:$PORT"
  load entitlements p6-mixed --target entitlements --port $PORT --customers $CUSTOMERS --connections 50 --in-flight 1 --write-percent 5
  stop

  # 9. Profile 5, cold: Zipf keys over the large set, a cache far smaller than it.
  # The admin listener's /metrics says how many checks missed the cache, and how many of
  # those misses were read on the cold-read threads (their pages not in memory).
  $SERVER_CPU $ENT serve --snapshot "$WORK/cold.snap" --listen 127.0.0.1:$PORT --cache-bytes $COLD_CACHE --admin 127.0.0.1:$ADMIN_PORT $THREADS > "$WORK/serve-cold.log" 2>&1 &
  PIDS+=($!)
  wait_for "$WORK/serve-cold.log" "listening on 127.0.0.1:$PORT"
  load entitlements p5-cold --target entitlements --port $PORT --customers $COLD_CUSTOMERS --keys zipf --connections 50 --in-flight 1
  grep VmHWM "/proc/${PIDS[0]}/status" | awk '{print $2}' > "$OUT/entitlements-p5-rss-kib.txt"
  python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:$ADMIN_PORT/metrics', timeout=10).read().decode())" 2>/dev/null \
    | grep -E '^entitlements_(cache_hits|cache_misses|cold_reads)_total ' > "$OUT/entitlements-p5-cache-run$ROUND.txt" || true
  stop

  # 9b. The Swift client's near-cache on p5's keys: it starts (and kills, by pid) its own
  # writable server on the large set, pinned like the others; share answered locally, the
  # lag of invalidations under load, and stale answers with the server gone.
  rm -rf "$WORK/nc-data"
  $CLIENT_CPU benchmarks/.build/release/NearCacheLoad --entitlements $ENT --snapshot "$WORK/cold.snap" --data-dir "$WORK/nc-data" \
    --port $PORT $( [ -n "$SERVER_CPU" ] && echo --server-cpu 0 ) --customers $COLD_CUSTOMERS --duration $DURATION --warmup $WARMUP \
    --budget-mib $([ $QUICK = 1 ] && echo 2 || echo 32) --writes $([ $QUICK = 1 ] && echo 20 || echo 200) --json "$OUT/nearcache-run$ROUND.json"

  # 9c. Writes under watches of every customer (what each near-cache client holds): the
  # writes' rate and the server's CPU per write as the watches keep more customers.
  rm -rf "$WORK/wf-data"
  $CLIENT_CPU benchmarks/.build/release/WatchFanout --entitlements $ENT --snapshot "$WORK/cold.snap" --data-dir "$WORK/wf-data" \
    --port $PORT $( [ -n "$SERVER_CPU" ] && echo --server-cpu 0 ) --watches 8 --writes $([ $QUICK = 1 ] && echo 2000 || echo 20000) \
    --json "$OUT/watchfanout-run$ROUND.json"
done

# 10. Summary (medians over the rounds), ratios and the plot.
python3 benchmarks/summarize.py "$OUT" --cold-customers $COLD_CUSTOMERS --cold-cache $COLD_CACHE $([ $QUICK = 1 ] && echo --quick)
echo "run.sh: results in $OUT"
