#!/usr/bin/env bash
# Inputs of the fleet scale model (docs/fleet.md, "Scale"), measured on this machine with
# PostgreSQL's defaults (fsync on): how many tail polls per second one PostgreSQL serves
# (pgbench running the tailer's two queries from many connections), how many writes per
# second the change_head row lets through (pgbench running the write's sequence step and
# change_log insert), and export time and snapshot size for N customers.
#
#   benchmarks/fleet-scale.sh [CUSTOMERS]     # default 100000
set -euo pipefail
cd "$(dirname "$0")/.."
CUSTOMERS=${1:-100000}
make deps >/dev/null
swift build -c release --product entitlements
ENT=$PWD/.build/release/entitlements
PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
WORK=$(mktemp -d /tmp/entitlements-fleet-scale-XXXXXX)
AS_PG=""; [ "$(id -u)" = 0 ] && { chown postgres "$WORK"; AS_PG="runuser -u postgres --"; }
cleanup() { $AS_PG "$PGBIN/pg_ctl" -D "$WORK/pg" -m fast stop >/dev/null 2>&1 || true; rm -rf "$WORK"; }
trap cleanup EXIT
PGPORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()')
echo scale > "$WORK/pw"; chmod 644 "$WORK/pw"
$AS_PG "$PGBIN/initdb" -D "$WORK/pg" -U postgres --auth=scram-sha-256 --pwfile="$WORK/pw" >/dev/null
$AS_PG "$PGBIN/pg_ctl" -D "$WORK/pg" -l "$WORK/pg.log" -w -o "-p $PGPORT -k $WORK -c listen_addresses=127.0.0.1 -c max_connections=300" start >/dev/null
URL="postgres://postgres:scale@127.0.0.1:$PGPORT/postgres"
export PGPASSWORD=scale
BENCH="$PGBIN/pgbench -h 127.0.0.1 -p $PGPORT -U postgres -n -M prepared -j 2 -T 10 postgres"

$ENT snapshot generate --customers $CUSTOMERS --seed 1 --output "$WORK/data.snap" >/dev/null
$ENT db migrate --postgres "$URL" >/dev/null
start=$(date +%s.%N); $ENT db import --postgres "$URL" --snapshot "$WORK/data.snap" >/dev/null; end=$(date +%s.%N)
echo "import of $CUSTOMERS customers: $(python3 -c "print(round($end - $start, 1))") s"
start=$(date +%s.%N); $ENT snapshot export --postgres "$URL" --output "$WORK/fleet.snap" >/dev/null; end=$(date +%s.%N)
echo "export of $CUSTOMERS customers: $(python3 -c "print(round($end - $start, 2))") s, $(stat -c %s "$WORK/fleet.snap") bytes"
echo "database size: $(psql -h 127.0.0.1 -p $PGPORT -U postgres -tAc "SELECT pg_size_pretty(pg_database_size('postgres'))")"

# The tailer's poll when it is current: one query, the head row with the commit time of
# the row at its cursor (FleetTailer.head); with nothing new it reads no more.
cat > "$WORK/poll.sql" <<'SQL'
SELECT h.epoch::text, h.seq, (SELECT (extract(epoch FROM l.committed_at) * 1000)::bigint FROM change_log l WHERE l.seq = h.seq) FROM change_head h;
SQL
# The part of a write that holds the change_head row lock: sequence, change_log row, NOTIFY, COMMIT.
cat > "$WORK/write.sql" <<'SQL'
BEGIN;
WITH head AS (UPDATE change_head SET seq = seq + 1 RETURNING seq),
     logged AS (INSERT INTO change_log (seq, customer_id, record) SELECT seq, 'user-1', '\x0a06757365722d31'::bytea FROM head RETURNING seq),
     notified AS (SELECT pg_notify('entitlements_changes', seq::text) FROM logged)
SELECT logged.seq FROM logged, notified;
COMMIT;
SQL
for clients in 16 64 200; do
  echo "polls, $clients connections: $($BENCH -c $clients -f "$WORK/poll.sql" 2>/dev/null | grep -E '^tps' | head -1)"
done
for clients in 1 8 32; do
  echo "change_head writes, $clients connections: $($BENCH -c $clients -f "$WORK/write.sql" 2>/dev/null | grep -E '^tps' | head -1)"
done
