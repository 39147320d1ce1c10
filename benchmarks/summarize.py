#!/usr/bin/env python3
"""Writes summary.md (with ratios to Redis) and latency.png from the JSON summaries and
percentile distributions LoadGen left in a results folder. Used by run.sh."""
import glob
import json
import os
import platform
import subprocess
import sys

folder = sys.argv[1]
quick = "--quick" in sys.argv
runs = {}
for path in glob.glob(os.path.join(folder, "*.json")):
    with open(path) as file:
        summary = json.load(file)
    system, profile = os.path.basename(path)[:-5].split("-", 1)
    runs[(system, profile)] = summary

PROFILES = [
    ("p1", "1 connection x 1 in flight (latency floor)"),
    ("p2", "50 connections x 1 (throughput)"),
    ("p3", "50 connections x 16 pipelined"),
    ("p4", "open loop at 50% of the system's own p2 maximum"),
]


def cell(system, profile, key):
    run = runs.get((system, profile))
    if run is None:
        return None
    return run["throughput"] if key == "throughput" else run["latencyMicroseconds"][key]


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
    return f"{os.cpu_count()} CPUs ({cpu}){memory}, {platform.system()} {platform.release()}, {swift[0] if swift else 'swift ?'}"


lines = [
    "# Side by side: entitlements vs Redis GET of the same bytes",
    "",
    f"Machine: {machine()}.",
    "Each server pinned to CPU 0 (ours with `--threads 1 --resolvers 1`, as Redis runs one thread), the load generator (LoadGen, one event loop) to CPU 1.",
    f"{'QUICK RUN (2 s per profile, 10,000 customers): checks that the harness works, not figures.' if quick else 'Each profile: 2 s warm-up, 10 s measured, 100,000 customers, uniform keys.'}",
    "Latency in microseconds. Open loop (p4) latency is measured from each request's scheduled send time.",
    "The gRPC peer is not built yet: its column is missing (see benchmarks/README.md).",
    "",
    "| profile | system | requests/s | p50 | p90 | p99 | p99.9 | max | throughput vs Redis | p99 vs Redis |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
]
for profile, title in PROFILES:
    for system in ["redis", "entitlements"]:
        run = runs.get((system, profile))
        if run is None:
            continue
        latency = run["latencyMicroseconds"]
        ratio = p99_ratio = ""
        if system == "entitlements" and (redis := runs.get(("redis", profile))):
            ratio = f"{run['throughput'] / redis['throughput']:.2f}x"
            p99_ratio = f"{latency['p99'] / max(1, redis['latencyMicroseconds']['p99']):.2f}x"
        lines.append(
            f"| {profile}: {title} | {system} | {run['throughput']:,.0f} | {latency['p50']} | {latency['p90']} | "
            f"{latency['p99']} | {latency['p99.9']} | {latency['max']} | {ratio} | {p99_ratio} |"
        )
lines += ["", "This service only:", "", "| profile | requests/s | p50 | p99 | p99.9 |", "|---|---:|---:|---:|---:|"]
for profile, title in [("p6-mixed", "95% checks, 5% writes (group commit)"), ("p7-unix", "Unix socket, 50 x 1 (compare p2 over TCP)")]:
    run = runs.get(("entitlements", profile))
    if run:
        latency = run["latencyMicroseconds"]
        lines.append(f"| {title} | {run['throughput']:,.0f} | {latency['p50']} | {latency['p99']} | {latency['p99.9']} |")
rss = os.path.join(folder, "entitlements-rss-kib.txt")
if os.path.exists(rss):
    lines += ["", f"Peak resident memory of the read-only server: {int(open(rss).read().strip() or 0) / 1024:.0f} MiB."]
with open(os.path.join(folder, "summary.md"), "w") as file:
    file.write("\n".join(lines) + "\n")
print("\n".join(lines))

# The plot: latency by percentile, open loop (p4) and throughput (p2), both systems.
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
    for system, style in [("redis", "--"), ("entitlements", "-")]:
        path = os.path.join(folder, f"{system}-{profile}.hgrm")
        if os.path.exists(path):
            points = distribution(path)
            axis.plot([p[0] for p in points], [p[1] for p in points], style, label=system)
    axis.set_xscale("log")
    axis.set_xticks([1, 2, 10, 100, 1000, 10000])
    axis.set_xticklabels(["0%", "50%", "90%", "99%", "99.9%", "99.99%"])
    axis.set_xlabel("percentile")
    axis.set_ylabel("latency (µs)")
    axis.set_title(dict(PROFILES)[profile])
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
figure.tight_layout()
figure.savefig(os.path.join(folder, "latency.png"), dpi=110)
print(f"wrote {os.path.join(folder, 'latency.png')}")
