#!/usr/bin/env bash
# The gRPC door against the grpc-swift-2 peer with h2load (Debian nghttp2-client) as the
# client: LoadGen's gRPC client (grpc-swift-2, a task per call) is the limit for the door in
# run.sh, so this measures what each server does when the client is not.
#
#   benchmarks/door-h2load.sh [--rounds N] [--requests N]
#
# Each server pinned to CPU 0 with one event loop, h2load on CPU 1 (one thread), the same
# CheckEntitlements request for user-1 (a cache hit) over and over, 50 connections with 1
# and with 16 concurrent streams each; systems alternate within each round. h2load counts
# HTTP statuses, not grpc-status: the request is valid, and the door's own tests check the
# answers. Prints one line per run; results/<date>/door-h2load.txt keeps them.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=3; REQUESTS=200000
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift ;;
    --requests) REQUESTS=$2; shift ;;
    *) echo "door-h2load.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
command -v h2load >/dev/null || { sudo=$([ "$(id -u)" = 0 ] || echo sudo); $sudo apt-get install -y -qq nghttp2-client >/dev/null; }
swift build -c release --product entitlements
swift build -c release --package-path benchmarks --product GRPCPeer
ENT=.build/release/entitlements; PEER=benchmarks/.build/release/GRPCPeer
WORK=$(mktemp -d); PID=""
cleanup() { [ -n "$PID" ] && kill "$PID" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
OUT=benchmarks/results/$(date -u +%Y-%m-%d); mkdir -p "$OUT"
$ENT snapshot generate --customers 100000 --seed 1 --output "$WORK/data.snap" >/dev/null
# The gRPC message: CheckEntitlementsRequest{user_id: "user-1"} behind its 5-byte prefix.
printf '\x00\x00\x00\x00\x08\x0a\x06user-1' > "$WORK/request.bin"

wait_for() { for _ in $(seq 1 300); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; cat "$1" >&2; exit 1; }
load() { # system port
  for shape in "50 1" "50 16"; do
    set -- $1 $2 $shape
    rate=$(taskset -c 1 h2load -n "$REQUESTS" -c $3 -m $4 -t 1 --data="$WORK/request.bin" \
      -H 'content-type: application/grpc' -H 'te: trailers' \
      "http://127.0.0.1:$2/entitlements.v1.EntitlementService/CheckEntitlements" \
      | awk '/^finished in/ {print int($4)} /^requests:/ && $10 != 0 {print "FAILED " $0 > "/dev/stderr"}')
    echo "$1 ${3}x${4} round $ROUND: $rate requests/s"
  done
}
{
  for ROUND in $(seq 1 $ROUNDS); do
    taskset -c 0 $ENT serve --snapshot "$WORK/data.snap" --listen 127.0.0.1:7480 --grpc-listen 127.0.0.1:7481 --threads 1 --resolvers 1 > "$WORK/door.log" 2>&1 &
    PID=$!; wait_for "$WORK/door.log" "^grpc listening"
    load door 7481
    kill -INT $PID; wait $PID 2>/dev/null || true; PID=""
    taskset -c 0 $PEER --snapshot "$WORK/data.snap" --port 7482 --threads 1 > "$WORK/peer.log" 2>&1 &
    PID=$!; wait_for "$WORK/peer.log" "listening on"
    load grpc-swift-2 7482
    kill -INT $PID; wait $PID 2>/dev/null || true; PID=""
  done
} | tee "$OUT/door-h2load.txt"
