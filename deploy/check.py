#!/usr/bin/env python3
"""Checks deploy/ against the code, as far as this machine can (no container runtime):

- the Kubernetes manifest parses, probes point at the admin endpoints, the grace period
  covers preStop plus the drain, the socket volume is shared, and the sidecar's flags and
  environment are accepted by `entitlements serve --print-config`;
- the Dockerfile builds with the Makefile's packages and command, runs as non-root with
  libprotobuf-c1, has a HEALTHCHECK through the CLI, and its CMD is valid;
- the systemd unit passes `systemd-analyze verify` (when systemd-analyze exists) and its
  config file is valid.

Usage: deploy/check.py ENTITLEMENTS_BINARY
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BINARY = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(ROOT, ".build/debug/entitlements")
problems = []


def problem(text):
    problems.append(text)


def serve_accepts(args, env=None, what=""):
    """Runs serve --print-config with `args`; returns the effective settings."""
    environment = dict(os.environ)
    environment.update(env or {})
    result = subprocess.run([BINARY, "serve", *args, "--print-config"], capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        problem(f"{what}: serve refuses its settings: {result.stdout.strip()} {result.stderr.strip()}")
        return {}
    settings = {}
    for line in result.stdout.splitlines():
        key, _, rest = line.partition(" = ")
        settings[key] = rest.split("  #")[0]
    return settings


# Files a Secret provides (docs/security.md), made here for `serve --print-config` to load:
# a token file and a self-signed certificate. Never the manifest's own placeholders.
SECRET_FILES = tempfile.mkdtemp(prefix="deploy-check-")


def secret_file(path):
    """A stand-in for the Secret file at `path`, or `path` when it is not one."""
    name = os.path.basename(path)
    if not path.startswith(("/etc/entitlements/", "/run/secrets/")):
        return path
    if name == "entitlements-tokens":
        name = "tokens"
    local = os.path.join(SECRET_FILES, name)
    if not os.path.exists(local):
        if name == "tokens":
            with open(local, "w") as file:
                file.write(os.urandom(32).hex() + " check,write\n" + os.urandom(32).hex() + " check\n")
        elif name in ("tls.crt", "tls.key"):
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                 "-keyout", os.path.join(SECRET_FILES, "tls.key"), "-out", os.path.join(SECRET_FILES, "tls.crt"),
                 "-days", "1", "-subj", "/CN=entitlements"],
                check=True, capture_output=True)
    return local


def with_secret_files(args):
    out = []
    for arg in args:
        flag, equals, value = arg.partition("=")
        out.append(flag + equals + secret_file(value) if equals else secret_file(arg))
    return out


def seconds(text):
    match = re.fullmatch(r"(\d+)(ms|s|m|h)", text)
    if not match:
        return None
    value, unit = int(match.group(1)), match.group(2)
    return value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]


# What a Secret's value stands for when the flags are checked (never connected to).
SECRET_PLACEHOLDERS = {"ENTITLEMENTS_POSTGRES_URL": "postgres://user:password@db.invalid:5432/entitlements"}


def environment_of(container, path):
    """A container's environment; values from a Secret become placeholders."""
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry.get("valueFrom", {}):
            if entry["name"] not in SECRET_PLACEHOLDERS:
                problem(f"{path}: {entry['name']} comes from a Secret, and check.py has no placeholder for it")
            env[entry["name"]] = SECRET_PLACEHOLDERS.get(entry["name"], "")
    return env


def check_fleet_jobs(documents, path):
    """The fleet manifest's Job and CronJob run real commands with the Secret's URL."""
    for document in documents:
        kind = document.get("kind")
        if kind not in ("Job", "CronJob"):
            continue
        spec = document["spec"]["jobTemplate"]["spec"] if kind == "CronJob" else document["spec"]
        for container in spec["template"]["spec"]["containers"]:
            env = environment_of(container, path)
            if "ENTITLEMENTS_POSTGRES_URL" not in env:
                problem(f"{path}: {kind} {document['metadata']['name']} has no ENTITLEMENTS_POSTGRES_URL")
            script = " ".join(container.get("args", []))
            for command in ["db migrate", "snapshot export", "db prune"]:
                if command in script:
                    words = command.split()
                    result = subprocess.run([BINARY, *words, "--help"], capture_output=True, text=True)
                    if result.returncode != 0:
                        problem(f"{path}: `entitlements {command}` does not exist: {result.stderr.strip()}")


def check_kubernetes(name):
    path = os.path.join(ROOT, "deploy/kubernetes", name)
    with open(path) as file:
        documents = [d for d in yaml.safe_load_all(file) if d]
    deployment = next((d for d in documents if d.get("kind") == "Deployment"), None)
    if deployment is None:
        return problem(f"{path}: no Deployment")
    spec = deployment["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    sidecar = containers.get("entitlements")
    if sidecar is None:
        return problem(f"{path}: no container named entitlements")
    env = environment_of(sidecar, path)
    settings = serve_accepts(with_secret_files(sidecar["args"][1:]), env, what=path)
    check_fleet_jobs(documents, path)
    admin_port = next((p["containerPort"] for p in sidecar.get("ports", []) if p.get("name") == "admin"), None)
    if settings.get("admin", "").rpartition(":")[2] != str(admin_port):
        problem(f"{path}: --admin {settings.get('admin')} does not listen on the admin port {admin_port}")
    for probe, expected in [("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")]:
        grpc = sidecar.get(probe, {}).get("grpc")
        if grpc is not None:
            # grpc.health.v1 on the door (docs/doors.md): the door must be on, on that port.
            door = settings.get("grpc-listen", "").replace("(none)", "")
            if probe != "readinessProbe" or door.rpartition(":")[2] != str(grpc.get("port")):
                problem(f"{path}: {probe} speaks gRPC to port {grpc.get('port')}, but --grpc-listen is {door or 'off'}")
            continue
        get = sidecar.get(probe, {}).get("httpGet", {})
        if get.get("path") != expected or get.get("port") != "admin":
            problem(f"{path}: {probe} should GET {expected} on the admin port, has {get}")
    drain = seconds(settings.get("drain-timeout", "")) or 0
    pre_stop = sidecar.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = int(pre_stop[1]) if len(pre_stop) == 2 and pre_stop[0] == "sleep" else 0
    grace = spec.get("terminationGracePeriodSeconds", 30)
    if grace < drain + pause:
        problem(f"{path}: terminationGracePeriodSeconds {grace} is shorter than preStop {pause} s + drain {drain} s")
    socket = settings.get("unix", "")
    if socket in ("", "(none)"):
        return check_limits(sidecar, path)
    mounts = {c: {m["name"]: m["mountPath"] for m in containers[c].get("volumeMounts", [])} for c in containers}
    shared = [name for name, mount in mounts["entitlements"].items() if socket.startswith(mount + "/")]
    if not shared or not all(mounts[c].get(shared[0]) == mounts["entitlements"][shared[0]] for c in containers):
        problem(f"{path}: the socket {socket} is not on a volume every container mounts at the same path")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    if shared and "emptyDir" not in volumes.get(shared[0], {}):
        problem(f"{path}: the socket volume should be an emptyDir")
    check_limits(sidecar, path)


def check_limits(sidecar, path):
    memory = sidecar.get("resources", {}).get("limits", {}).get("memory", "")
    if not memory:
        problem(f"{path}: the sidecar has no memory limit")


def check_dockerfile():
    path = os.path.join(ROOT, "deploy/Dockerfile")
    text = open(path).read()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    if len(stages) != 2:
        return problem(f"{path}: expected two stages (build, runtime), found {len(stages)}")
    build, runtime = stages
    for package in ["libprotobuf-c-dev", "pkg-config"]:
        if package not in makefile:
            problem(f"Makefile no longer installs {package}; update deploy/check.py")
        if package not in build:
            problem(f"{path}: the build stage does not install {package}, which the Makefile's build needs")
    make_build = re.search(r"\$\(SWIFT\) build -c release --product entitlements", makefile)
    if not make_build:
        problem("Makefile: no `swift build -c release --product entitlements`")
    if "swift build -c release --product entitlements" not in build:
        problem(f"{path}: the build command differs from the Makefile's `swift build -c release --product entitlements`")
    if "--static-swift-stdlib" not in build:
        problem(f"{path}: the binary should link the Swift standard library statically")
    if "libprotobuf-c1" not in runtime:
        problem(f"{path}: the runtime stage lacks libprotobuf-c1")
    user = re.search(r"^USER (\S+)", runtime, flags=re.M)
    if not user or user.group(1) in ("root", "0"):
        problem(f"{path}: the runtime stage must run as a non-root user")
    if not re.search(r'^HEALTHCHECK .*"entitlements", "health"', runtime, flags=re.S | re.M):
        problem(f"{path}: HEALTHCHECK should run `entitlements health`")
    cmd = re.search(r"^CMD (\[.*\])", runtime, flags=re.M)
    if cmd:
        arguments = json.loads(cmd.group(1))
        serve_accepts(with_secret_files(arguments[1:]), what=f"{path} CMD")
    else:
        problem(f"{path}: no CMD")


def check_systemd():
    unit = os.path.join(ROOT, "deploy/systemd/entitlements.service")
    config = os.path.join(ROOT, "deploy/systemd/serve.json")
    serve_accepts(["--config", config], what=config)
    text = open(unit).read()
    if "--config /etc/entitlements/serve.json" not in text:
        problem(f"{unit}: ExecStart should read /etc/entitlements/serve.json")
    drain = 30
    stop = re.search(r"^TimeoutStopSec=(\d+)", text, flags=re.M)
    if not stop or int(stop.group(1)) < drain:
        problem(f"{unit}: TimeoutStopSec must cover the 30 s drain")
    analyze = shutil.which("systemd-analyze")
    if not analyze:
        print("systemd-analyze not installed: unit not verified")
        return
    with tempfile.TemporaryDirectory() as directory:
        copy = os.path.join(directory, "entitlements.service")
        # verify checks that ExecStart exists: point it at the binary under test.
        with open(copy, "w") as file:
            file.write(text.replace("/usr/local/bin/entitlements", BINARY))
        result = subprocess.run([analyze, "verify", copy], capture_output=True, text=True)
        if result.returncode != 0:
            problem(f"{unit}: systemd-analyze verify: {result.stderr.strip()}")


check_kubernetes("sidecar.yaml")
check_kubernetes("fleet-sidecar.yaml")
check_kubernetes("grpc-sidecar.yaml")
check_kubernetes("sidecar-secure.yaml")
check_dockerfile()
check_systemd()
if problems:
    print("deploy/ does not match the code:")
    for text in problems:
        print(f"  - {text}")
    sys.exit(1)
print("deploy/: Kubernetes manifest, Dockerfile and systemd unit are consistent with the code")
