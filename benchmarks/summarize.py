#!/usr/bin/env python3
"""Writes summary.md (medians over the rounds, ratios to Redis and to grpc-go, the targets) and
latency.png from the JSON summaries and percentile distributions LoadGen left in a results
folder (<system>-<profile>-run<N>.json and .hgrm). Used by run.sh."""
import argparse
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("folder")
parser.add_argument("--quick", action="store_true")
parser.add_argument("--cold-customers", type=int, default=0)
parser.add_argument("--cold-cache", default="")
arguments = parser.parse_args()
folder = arguments.folder

# (system, profile) -> [summary of each round]
runs = {}
for path in sorted(glob.glob(os.path.join(folder, "*-run*.json"))):
    match = re.match(r"(\w+)-(.+)-run(\d+)\.json$", os.path.basename(path))
    if not match:
        continue
    with open(path) as file:
        summary = json.load(file)
    summary["path"] = path[:-5]
    runs.setdefault((match.group(1), match.group(2)), []).append(summary)

SYSTEMS = ["redis", "grpc_go", "grpc_cpp", "grpc_swift", "door", "entitlements"]
# A load generator above this share of its core may be what limits the server.
CLIENT_BOUND = 90
PROFILES = [
    ("p1", "1 connection x 1 in flight (latency floor)"),
    ("p2", "50 connections x 1 (throughput)"),
    ("p3", "50 connections x 16 pipelined"),
    ("p4", "open loop at 50% of the system's own p2 maximum"),
]
KEYS = ["p50", "p90", "p99", "p99.9", "max"]


def median(system, profile):
    """The median of each figure over the rounds (each figure separately), or None."""
    summaries = runs.get((system, profile))
    if not summaries:
        return None
    result = {"throughput": statistics.median(s["throughput"] for s in summaries), "rounds": len(summaries)}
    for key in KEYS:
        result[key] = statistics.median(s["latencyMicroseconds"][key] for s in summaries)
    result["each"] = [s["throughput"] for s in summaries]
    for side in ["server", "client"]:
        values = [s.get("cpuPercent", {}).get(side, -1) for s in summaries]
        values = [v for v in values if v >= 0]
        result["cpu_" + side] = statistics.median(values) if values else None
    # The round whose throughput is the median: its distribution goes in the plot.
    ordered = sorted(summaries, key=lambda s: s["throughput"])
    result["path"] = ordered[(len(ordered) - 1) // 2]["path"]
    return result


def machine():
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = ""
    try:
        kib = int(open("/proc/meminfo").readline().split()[1])
        memory = f", {kib / 1024 / 1024:.0f} GiB"
    except (OSError, ValueError):
        pass
    swift = subprocess.run(["swift", "--version"], capture_output=True, text=True).stdout.splitlines()
    redis = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    redis_version = next((word[2:] for word in redis if word.startswith("v=")), "?")

    def output(command):
        try:
            return subprocess.run(command, capture_output=True, text=True).stdout.strip() or "?"
        except OSError:
            return "?"

    go = output(["dpkg-query", "-W", "-f", "${Version}", "golang-google-grpc-dev"])
    golang = output(["go", "version"]).replace("go version ", "")
    cpp = output(["pkg-config", "--modversion", "grpc++"])
    return (
        f"{os.cpu_count()} CPUs ({cpu}){memory}, {platform.system()} {platform.release()}, "
        f"{swift[0] if swift else 'swift ?'}, Redis {redis_version}, grpc-go {go} (Debian's, from 2020; newer ones are faster) on {golang}, "
        f"gRPC C++ {cpp} (Debian's)"
    )


def cpu(run):
    if run.get("cpu_server") is None or run.get("cpu_client") is None:
        return ""
    bound = " **client-bound**" if run["cpu_client"] >= CLIENT_BOUND and run["cpu_server"] < CLIENT_BOUND else ""
    return f"{run['cpu_server']:.0f}%, {run['cpu_client']:.0f}%{bound}"


def ratio(value, reference, digits=2):
    return f"{value / reference:.{digits}f}x" if reference else ""


rounds = max((len(v) for v in runs.values()), default=0)
lines = [
    "# Side by side: entitlements vs Redis GET of the same bytes vs gRPC servers (grpc-go, gRPC C++, grpc-swift-2)",
    "",
    f"Machine: {machine()}.",
    "Each server pinned to CPU 0 (ours with `--threads 1 --resolvers 1`, grpc-go with GOMAXPROCS=1, gRPC C++ as it starts, "
    "the grpc-swift-2 peer with one event loop, Redis with its one thread), the load generator (LoadGen, one event loop) to CPU 1.",
    "QUICK RUN (1 round, 2 s per profile, 10,000 customers): checks that the harness works, not figures."
    if arguments.quick
    else f"Each profile: 2 s warm-up, 10 s measured, 100,000 customers, uniform keys; {rounds} rounds, systems in turn within each round. "
    "Every figure is the median over the rounds (each column separately); `runs` lists each round's throughput.",
    "Systems: `redis` (Redis, each answer's bytes as a string), `grpc_go` and `grpc_cpp` (grpc-go and gRPC C++ answering "
    "CheckEntitlements with the same bytes through a pass-through codec or a generic service; benchmarks/peers/), "
    "`grpc_swift` (our resolvers behind grpc-swift-2), `door` (this service's own gRPC door, `serve --grpc-listen`, on swift-nio-http2; "
    "docs/doors.md), `entitlements` (the framed protocol). Every gRPC row is driven by the same client: LoadGen's raw HTTP/2 frames.",
    "Latency in microseconds. Open loop (p4) latency is measured from each request's scheduled send time.",
    "",
    f"`CPU` is the share of one core the server and the load generator used in the measured window: a side near 100% was the limit; "
    f"a row whose client used {CLIENT_BOUND}% or more while its server did not is marked client-bound (its ratio understates the server).",
    "",
    "| profile | system | requests/s | p50 | p90 | p99 | p99.9 | max | vs Redis: throughput, p99 | vs grpc-go: throughput, p99 | CPU server, client | runs (requests/s) |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
]
for profile, title in PROFILES:
    redis, grpc = median("redis", profile), median("grpc_go", profile)
    for system in SYSTEMS:
        run = median(system, profile)
        if run is None:
            continue
        versus_redis = versus_grpc = ""
        if system != "redis" and redis:
            versus_redis = f"{ratio(run['throughput'], redis['throughput'])}, {ratio(run['p99'], redis['p99'])}"
        if system not in ("redis", "grpc_go") and grpc:
            versus_grpc = f"{ratio(run['throughput'], grpc['throughput'])}, {ratio(run['p99'], grpc['p99'])}"
        each = " / ".join(f"{t:,.0f}" for t in run["each"])
        lines.append(
            f"| {profile}: {title} | {system} | {run['throughput']:,.0f} | {run['p50']:.0f} | {run['p90']:.0f} | "
            f"{run['p99']:.0f} | {run['p99.9']:.0f} | {run['max']:.0f} | {versus_redis} | {versus_grpc} | {cpu(run)} | {each} |"
        )

# The targets of the performance issue, each as measured.
ours = {profile: median("entitlements", profile) for profile in ["p1", "p2", "p3", "p4", "p5-cold", "p8-batch"]}
redis = {profile: median("redis", profile) for profile in ["p1", "p2", "p3", "p4", "p8-batch"]}
grpc = {profile: median("grpc_go", profile) for profile, _ in PROFILES}


def target(name, value, goal, met):
    return f"| {name} | {value} | {goal} | {'met' if met else '**not met**'} |"


def compare(name, profile, key, peer, goal, at_least):
    if ours.get(profile) and peer.get(profile):
        value = ours[profile][key] / max(1, peer[profile][key])
        met = value >= goal if at_least else value <= goal
        lines.append(target(name, f"{value:.2f}x", f"{'>=' if at_least else '<='} {goal}x", met))


lines += ["", "Targets (medians above):", "", "| target | measured | goal | |", "|---|---:|---:|---|"]
compare("p1 one call, p50 vs Redis", "p1", "p50", redis, 1.0, False)
compare("p1 one call, p50 vs grpc-go", "p1", "p50", grpc, 1.0, False)
compare("p2 50 x 1 throughput vs Redis", "p2", "throughput", redis, 1.0, True)
compare("p2 50 x 1 throughput vs grpc-go", "p2", "throughput", grpc, 2.0, True)
compare("p3 50 x 16 throughput vs Redis", "p3", "throughput", redis, 0.85, True)
compare("p3 50 x 16 throughput vs grpc-go", "p3", "throughput", grpc, 5.0, True)
compare("p4 open loop p99 vs grpc-go", "p4", "p99", grpc, 0.5, False)
compare("p4 open loop p99 vs Redis", "p4", "p99", redis, 1.0, False)
compare("p8 batches of 100 vs Redis MGET", "p8-batch", "throughput", redis, 1.0, True)
if ours.get("p5-cold") and ours.get("p2"):
    value = ours["p5-cold"]["p99"] / max(1, ours["p2"]["p99"])
    lines.append(target("p5 cold p99 vs hot p2 p99", f"{value:.2f}x", "<= 2x", value <= 2))
    value = ours["p5-cold"]["throughput"] / max(1, ours["p2"]["throughput"])
    lines.append(target("p5 cold throughput vs p2", f"{value:.2f}x", ">= 0.5x", value >= 0.5))
cold_rss = os.path.join(folder, "entitlements-p5-rss-kib.txt")
cache = re.match(r"^(\d+)(KiB|MiB|GiB)$", arguments.cold_cache or "")
if os.path.exists(cold_rss) and cache:
    cache_mib = int(cache.group(1)) * {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[cache.group(2)]
    rss_mib = int(open(cold_rss).read().strip() or 0) / 1024
    lines.append(target("p5 cold peak RSS", f"{rss_mib:.0f} MiB", f"<= {cache_mib:.0f} + 40 MiB", rss_mib <= cache_mib + 40))
lines.append("| cache hit: server allocations per request | `make bench-check` (microbenchmark), benchmarks/mallocs.sh (real server) | 0 | see benchmarks/README.md |")

lines += ["", "This service only:", "", "| profile | requests/s | p50 | p99 | p99.9 | runs (requests/s) |", "|---|---:|---:|---:|---:|---|"]
cold = f"p5: cold, Zipf keys over {arguments.cold_customers:,} customers, {arguments.cold_cache} cache, 50 x 1"
for profile, title in [
    ("p5-cold", cold),
    ("p6-mixed", "p6: 95% checks, 5% writes (group commit), 50 x 1"),
    ("p7-unix", "p7: Unix socket, 50 x 1 (compare p2 over TCP)"),
]:
    run = median("entitlements", profile)
    if run:
        each = " / ".join(f"{t:,.0f}" for t in run["each"])
        lines.append(f"| {title} | {run['throughput']:,.0f} | {run['p50']:.0f} | {run['p99']:.0f} | {run['p99.9']:.0f} | {each} |")
# How cold p5 was: each round's cache counters (the server's /metrics after the run, warm-up
# included), as shares; the median of the rounds.
misses, cold_reads = [], []
for path in sorted(glob.glob(os.path.join(folder, "entitlements-p5-cache-run*.txt"))):
    counters = dict((name, float(value)) for name, value in (line.split() for line in open(path) if line.strip()))
    checks = counters.get("entitlements_cache_hits_total", 0) + counters.get("entitlements_cache_misses_total", 0)
    if checks > 0:
        misses.append(counters.get("entitlements_cache_misses_total", 0) / checks)
        cold_reads.append(counters.get("entitlements_cold_reads_total", 0) / max(1, counters.get("entitlements_cache_misses_total", 0)))
if misses:
    lines += ["", f"p5's cache (the server's counters over each whole run, warm-up included; median of {len(misses)} round{'s' if len(misses) != 1 else ''}): "
              f"{100 * statistics.median(misses):.1f}% of cache lookups missed (each a read of the snapshot, or a wait for one under way), "
              f"and reads on the cold-read threads (their pages not in memory) came to {100 * statistics.median(cold_reads):.2f}% of the misses."]
security = [(system, profile, median(system, profile)) for system in ("framed_token", "framed_tls") for profile in ("p2", "p3")]
if any(run for _, _, run in security):
    lines += [
        "",
        "Security (docs/security.md): the framed protocol with `--auth-token-file`, each connection sending Authenticate first "
        "(`framed_token`), and the same over TLS 1.3 (ECDSA P-256 certificate; `framed_tls`), against `entitlements` (plain, no token) of this run:",
        "",
        "| profile | system | requests/s | p50 | p99 | p99.9 | vs plain: throughput, p99 | CPU server, client | runs (requests/s) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for system, profile, run in security:
        plain = ours.get(profile)
        if run:
            versus = f"{ratio(run['throughput'], plain['throughput'])}, {ratio(run['p99'], plain['p99'])}" if plain else ""
            each = " / ".join(f"{t:,.0f}" for t in run["each"])
            lines.append(
                f"| {profile} | {system} | {run['throughput']:,.0f} | {run['p50']:.0f} | {run['p99']:.0f} | {run['p99.9']:.0f} | {versus} | {cpu(run)} | {each} |"
            )

ours_batch, redis_batch = median("entitlements", "p8-batch"), median("redis", "p8-batch")
if ours_batch:
    size = runs[("entitlements", "p8-batch")][0].get("batch", 1)
    lines += [
        "",
        f"Batches (p8): {size} uniform customers per request, 50 x 1; ours a BatchCheckEntitlements, Redis an MGET of the same bytes:",
        "",
        "| system | batches/s | customers/s | p50 | p99 | vs Redis: throughput, p99 | CPU server, client | runs (batches/s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for system, run in [("redis", redis_batch), ("entitlements", ours_batch)]:
        if run:
            versus = f"{ratio(run['throughput'], redis_batch['throughput'])}, {ratio(run['p99'], redis_batch['p99'])}" if system != "redis" and redis_batch else ""
            each = " / ".join(f"{t:,.0f}" for t in run["each"])
            lines.append(
                f"| {system} | {run['throughput']:,.0f} | {run['throughput'] * size:,.0f} | {run['p50']:.0f} | {run['p99']:.0f} | {versus} | {cpu(run)} | {each} |"
            )
# The Swift client's near-cache (NearCacheLoad, run.sh step 9b): the medians of the rounds.
near = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(folder, "nearcache-run*.json")))]
if near:
    def middle(key):
        return statistics.median(run[key] for run in near)

    def each(format_run):
        return " / ".join(format_run(run) for run in near)

    first = near[0]
    p5 = ours.get("p5-cold")
    versus = " (%s of p5 without it)" % ratio(middle("checksPerSecond"), p5["throughput"]) if p5 else ""
    lines += [
        "",
        "Near-cache (the Swift client's, docs/server.md; median of %d round%s): %d tasks checking p5's keys (Zipf s = %s over %s customers) "
        "through one client with a %d MiB near-cache, against a writable server on one core:"
        % (len(near), "s" if len(near) != 1 else "", first["tasks"], first["zipfS"], f"{first['customers']:,}", first["budgetBytes"] >> 20),
        "",
        "| figure | value | runs |",
        "|---|---:|---|",
        "| a hit through `checkEntitlements`, one task, no load (ns) | %.0f (%s of a dictionary lookup and copy of the same answers: %.0f) | |"
        % (middle("hitNs"), ratio(middle("hitNs"), middle("dictionaryNs")), middle("dictionaryNs")),
        "| checks answered locally | %.1f%% | %s |" % (100 * middle("localShare"), each(lambda run: "%.1f%%" % (100 * run["localShare"]))),
        "| checks/s%s | %s | %s |" % (versus, f"{middle('checksPerSecond'):,.0f}", each(lambda run: f"{run['checksPerSecond']:,.0f}")),
        "| check latency p50, p99 (µs) | %.1f, %.0f | |" % (middle("latencyP50Ns") / 1000, middle("latencyP99Ns") / 1000),
        "| write-to-invalidation lag p50, p99 (µs), no other load: from the acknowledgment; from the write's send | %.0f, %.0f; %.0f, %.0f | %s |"
        % (middle("quietLagP50Ns") / 1000, middle("quietLagP99Ns") / 1000, middle("quietLagFromSendP50Ns") / 1000, middle("quietLagFromSendP99Ns") / 1000,
           each(lambda run: "%.0f, %.0f" % (run["quietLagP50Ns"] / 1000, run["quietLagP99Ns"] / 1000))),
        "| write-to-invalidation lag p50, p99 (µs), under that load: from the acknowledgment; from the write's send | %.0f, %.0f; %.0f, %.0f | %s |"
        % (middle("lagP50Ns") / 1000, middle("lagP99Ns") / 1000, middle("lagFromSendP50Ns") / 1000, middle("lagFromSendP99Ns") / 1000,
           each(lambda run: "%.0f, %.0f" % (run["lagP50Ns"] / 1000, run["lagP99Ns"] / 1000))),
        "| server down, stale-if-error: a check's cost p50, p99 (ns) | %s, %s | %s |"
        % (f"{middle('downCostP50Ns'):,.0f}", f"{middle('downCostP99Ns'):,.0f}", each(lambda run: "%.0f%% answered" % (100 * run["downAnsweredShare"]))),
    ]
# Writes under watches of every customer (WatchFanout, run.sh step 9c): medians of the rounds.
fanout = [json.load(open(path)) for path in sorted(glob.glob(os.path.join(folder, "watchfanout-run*.json")))]
if fanout and all(len(run["quarters"]) == 4 for run in fanout):
    def quarter(index, key):
        return statistics.median(run["quarters"][index][key] for run in fanout)

    lines += [
        "",
        "Writes under watches of every customer (WatchFanout, benchmarks/README.md; median of %d round%s): %s grants, each to a new "
        "customer, from %d tasks, while %d `all_customers` watches, each on its own connection, keep every customer written:"
        % (len(fanout), "s" if len(fanout) != 1 else "", f"{fanout[0]['writes']:,}", fanout[0]["writers"], fanout[0]["watches"]),
        "",
        "| quarter of the writes | writes/s | server CPU per write (µs) |",
        "|---|---:|---:|",
    ] + [
        "| %d | %s | %.0f |" % (index + 1, f"{quarter(index, 'writesPerSecond'):,.0f}", quarter(index, "serverCpuMicrosecondsPerWrite"))
        for index in range(4)
    ] + [
        "",
        "Every watch had every event %.1f ms after the last write's acknowledgment." % statistics.median(run["deliveryAfterLastAckMilliseconds"] for run in fanout),
    ]
for name, text in [("entitlements-rss-kib.txt", "read-only server, 100,000 customers, all cached"), ("entitlements-p5-rss-kib.txt", "cold profile (p5)")]:
    path = os.path.join(folder, name)
    if os.path.exists(path):
        lines.append(f"\nPeak resident memory, {text}: {int(open(path).read().strip() or 0) / 1024:.0f} MiB (last round).")
crosscheck = os.path.join(folder, "redis-benchmark-get.csv")
if os.path.exists(crosscheck) and redis["p2"]:
    rows = [line.strip().split(",") for line in open(crosscheck) if line.strip()]
    values = [row[1].strip('"') for row in rows if len(row) > 1]
    numbers = [float(v) for v in values if re.match(r"^[0-9.]+$", v)]
    if numbers:
        lines.append(
            f"\nCross-check: `redis-benchmark -c 50 -P 1 GET user-1` (same pinning, round 1) gave {numbers[-1]:,.0f} requests/s; "
            f"LoadGen's Redis p2 median is {redis['p2']['throughput']:,.0f} ({ratio(redis['p2']['throughput'], numbers[-1])})."
        )
with open(os.path.join(folder, "summary.md"), "w") as file:
    file.write("\n".join(lines) + "\n")
print("\n".join(lines))

# The plot: latency by percentile, p2 (closed loop) and p4 (open loop), every system.
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("matplotlib missing: no latency.png")
    sys.exit(0)


def distribution(path):
    points = []
    for line in open(path):
        parts = line.split()
        if len(parts) == 4:
            try:
                value, percentile = float(parts[0]), float(parts[1])
            except ValueError:
                continue
            if percentile < 1:
                points.append((1 / (1 - percentile), value))
    return points


figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
for axis, profile in zip(axes, ["p2", "p4"]):
    for system, style in [("redis", "--"), ("grpc_go", ":"), ("grpc_cpp", (0, (1, 3))), ("grpc_swift", (0, (5, 2, 1, 2))), ("door", "-."), ("entitlements", "-")]:
        run = median(system, profile)
        if run and os.path.exists(run["path"] + ".hgrm"):
            points = distribution(run["path"] + ".hgrm")
            axis.plot([p[0] for p in points], [p[1] for p in points], linestyle=style, label=system)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xticks([2, 10, 100, 1000, 10000])
    axis.set_xticklabels(["50%", "90%", "99%", "99.9%", "99.99%"])
    axis.set_xlabel("percentile")
    axis.set_ylabel("latency (µs, log scale)")
    axis.set_title(dict(PROFILES)[profile] + " (median round)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
figure.tight_layout()
figure.savefig(os.path.join(folder, "latency.png"), dpi=110)
print(f"wrote {os.path.join(folder, 'latency.png')}")
