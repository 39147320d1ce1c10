#!/usr/bin/env bash
# The fleet profile (benchmarks/README.md, "Fleet"): PostgreSQL and two fleet servers on
# this machine. Acknowledged writes per second through server A (several concurrent
# writers), and the propagation lag from a write's acknowledgement on A to its watch event
# on B, with LISTEN and with polling only; then the check path of B (fleet) against an
# embedded server on the same data (LoadGen, p2: 50 connections x 1).
#
#   benchmarks/fleet.sh            # 3 rounds of 10 s each, medians
#   benchmarks/fleet.sh --quick    # 1 round of 2 s, the server's debug build (CI, so this cannot rot)
#
# PostgreSQL runs with its defaults (fsync on, synchronous_commit on): the write figures
# include a real commit. Everything listens on loopback, and everything started here is
# stopped by pid at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=0; ROUNDS=3; SECONDS_EACH=10; CUSTOMERS=10000
if [ "${1:-}" = "--quick" ]; then QUICK=1; ROUNDS=1; SECONDS_EACH=2; CUSTOMERS=2000; fi
OUT=$([ $QUICK = 1 ] && echo .build/bench-quick/fleet || echo benchmarks/results/$(date -u +%Y-%m-%d)/fleet)
rm -rf "$OUT"; mkdir -p "$OUT"

make deps >/dev/null
# --quick serves with the debug build `make test` leaves (see run.sh); the tools are release.
SERVER_CONFIG=$([ $QUICK = 1 ] && echo debug || echo release)
swift build -c $SERVER_CONFIG --product entitlements
swift build -c release --package-path benchmarks --product FleetLoad
swift build -c release --package-path benchmarks --product LoadGen
ENT=.build/$SERVER_CONFIG/entitlements
FLEETLOAD=benchmarks/.build/release/FleetLoad
LOAD=benchmarks/.build/release/LoadGen

PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
WORK=$(mktemp -d /tmp/entitlements-fleet-bench-XXXXXX)
AS_PG=""; [ "$(id -u)" = 0 ] && { chown postgres "$WORK"; AS_PG="runuser -u postgres --"; }
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  $AS_PG "$PGBIN/pg_ctl" -D "$WORK/pg" -m fast stop >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'; }
PGPORT=$(free_port)
echo "bench" > "$WORK/pw"; chmod 644 "$WORK/pw"
$AS_PG "$PGBIN/initdb" -D "$WORK/pg" -U postgres --auth=scram-sha-256 --pwfile="$WORK/pw" >/dev/null
$AS_PG "$PGBIN/pg_ctl" -D "$WORK/pg" -l "$WORK/pg.log" -w -o "-p $PGPORT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
URL="postgres://postgres:bench@127.0.0.1:$PGPORT/postgres"

$ENT snapshot generate --customers $CUSTOMERS --seed 1 --output "$WORK/data.snap" >/dev/null
$ENT db migrate --postgres "$URL" >/dev/null
$ENT db import --postgres "$URL" --snapshot "$WORK/data.snap" >/dev/null
$ENT snapshot export --postgres "$URL" --output "$WORK/fleet.snap" >/dev/null

# Starts serve with the given flags; waits for its listening line; sets PORT_OUT and adds its pid.
start_serve() {
  local log="$1"; shift
  local port; port=$(free_port)
  "$@" --listen 127.0.0.1:$port --threads 1 > "$log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 600); do grep -q "listening on 127.0.0.1:$port" "$log" && break; sleep 0.05; done
  grep -q "listening on 127.0.0.1:$port" "$log" || { echo "fleet.sh: serve did not start:"; cat "$log"; exit 1; }
  PORT_OUT=$port
}
stop_last() { local pid=${PIDS[-1]}; kill "$pid"; wait "$pid" 2>/dev/null || true; unset 'PIDS[-1]'; }

for mode in listen poll; do
  listen=$([ $mode = listen ] && echo true || echo false)
  start_serve "$WORK/a-$mode.log" taskset -c 0 $ENT serve --postgres "$URL" --data-dir "$WORK/a-$mode" --snapshot "$WORK/fleet.snap" --fleet-listen $listen
  A=$PORT_OUT
  start_serve "$WORK/b-$mode.log" taskset -c 0 $ENT serve --postgres "$URL" --data-dir "$WORK/b-$mode" --snapshot "$WORK/fleet.snap" --fleet-listen $listen
  B=$PORT_OUT
  # Both start from the export, behind what the previous mode wrote: measure only once
  # each has caught up with the change log's head.
  HEAD=$(PGPASSWORD=bench psql -h 127.0.0.1 -p $PGPORT -U postgres -tAc "SELECT seq FROM change_head")
  for port in $A $B; do
    for _ in $(seq 1 600); do
      $ENT check --server 127.0.0.1:$port --user user-1 --min-seq $HEAD >/dev/null 2>&1 && break
      sleep 0.1
    done
  done
  for round in $(seq 1 $ROUNDS); do
    # Throughput: 32 callers as fast as they go (the lag then includes the queueing of a
    # saturated machine); then the lag at a steady 1,000 writes/s, below saturation.
    taskset -c 1 $FLEETLOAD --writer 127.0.0.1:$A --watcher 127.0.0.1:$B --callers 32 --seconds $SECONDS_EACH \
      --customers $CUSTOMERS --label "$mode" | tee -a "$OUT/fleet-$mode.jsonl"
    taskset -c 1 $FLEETLOAD --writer 127.0.0.1:$A --watcher 127.0.0.1:$B --callers 8 --rate 1000 --seconds $SECONDS_EACH \
      --customers $CUSTOMERS --label "$mode at 1000/s" | tee -a "$OUT/fleet-$mode-paced.jsonl"
  done
  if [ $mode = listen ]; then
    # The check path in fleet mode against an embedded server with the same customers.
    for round in $(seq 1 $ROUNDS); do
      for target in fleet embedded; do
        if [ $target = fleet ]; then PORT=$B; else
          start_serve "$WORK/embedded.log" taskset -c 0 $ENT serve --snapshot "$WORK/data.snap"
          PORT=$PORT_OUT
        fi
        taskset -c 1 $LOAD run --target entitlements --port $PORT --connections 50 --in-flight 1 --duration $SECONDS_EACH \
          --warmup 1 --customers $CUSTOMERS --label "$target p2" --json "$OUT/p2-$target-$round.json" >/dev/null
        [ $target = embedded ] && stop_last
      done
    done
  fi
  stop_last; stop_last
done

python3 - "$OUT" <<'PY'
import json, statistics, sys, glob, os
out = sys.argv[1]
lines = ["# Fleet profile", ""]
def median(values):
    return statistics.median(values) if values else float("nan")
for mode in ("listen", "poll"):
    runs = [json.loads(l) for l in open(os.path.join(out, f"fleet-{mode}.jsonl")) if l.startswith("{")]
    lines.append(f"- {mode}: {median([r['writes_per_second'] for r in runs]):,.0f} acknowledged writes/s "
                 f"({runs[0]['callers']} callers), lag A ack -> B watch p50 {median([r['lag_p50_ms'] for r in runs]):.1f} ms, "
                 f"p99 {median([r['lag_p99_ms'] for r in runs]):.1f} ms, max {max(r['lag_max_ms'] for r in runs):.1f} ms; "
                 f"failures {sum(r['failures'] for r in runs)}, writes with no watch event on B (the answer did not change) {sum(r['lag_missing'] for r in runs)}")
    paced = [json.loads(l) for l in open(os.path.join(out, f"fleet-{mode}-paced.jsonl")) if l.startswith("{")]
    lines.append(f"- {mode} at a steady 1,000 writes/s ({paced[0]['callers']} callers): {median([r['writes_per_second'] for r in paced]):,.0f} writes/s, "
                 f"lag p50 {median([r['lag_p50_ms'] for r in paced]):.1f} ms, p99 {median([r['lag_p99_ms'] for r in paced]):.1f} ms, "
                 f"max {max(r['lag_max_ms'] for r in paced):.1f} ms; failures {sum(r['failures'] for r in paced)}")
def p2(target):
    values = []
    for path in glob.glob(os.path.join(out, f"p2-{target}-*.json")):
        data = json.load(open(path))
        values.append(data["throughput"])
    return median(values)
fleet, embedded = p2("fleet"), p2("embedded")
def round_ratio(index):
    paths = [os.path.join(out, f"p2-{target}-{index}.json") for target in ("fleet", "embedded")]
    if not all(os.path.exists(p) for p in paths):
        return None
    fleet_round, embedded_round = (json.load(open(p))["throughput"] for p in paths)
    return fleet_round / embedded_round
ratios = [r for r in (round_ratio(i) for i in range(1, 10)) if r is not None]
lines.append(f"- checks, 50 connections x 1: fleet server {fleet:,.0f}/s, embedded {embedded:,.0f}/s ({fleet / embedded:.2f}x; "
             f"round by round {', '.join(f'{r:.2f}x' for r in ratios)})")
open(os.path.join(out, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
