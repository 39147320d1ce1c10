"""What the store ingestion's end-to-end tests share (Tests/googleplay, Tests/appstore):
a checklist that reports every failure, JSON over loopback HTTP, and a real PostgreSQL
started by the test itself. Talks to loopback only; stops only what it started."""
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request

FAILURES = []


def check(condition, what):
    print(("ok   " if condition else "FAIL ") + what)
    if not condition:
        FAILURES.append(what)


def post(port, path, body, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, body=data, headers=dict({"Content-Type": "application/json"}, **(headers or {})))
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    try:
        return response.status, json.loads(payload) if payload else None
    except ValueError:
        return response.status, payload


def start_serve(args, log, ready):
    """Starts `entitlements serve` with `args`, its output into the file `log`, and waits until
    every line in `ready` is in it; returns the process, the output so far and the listeners'
    ports by kind ("" for the framed one, "grpc ", "admin ", "webhooks ")."""
    import re
    import time
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(300):
        log.seek(0)
        text = log.read()
        if all(line in text for line in ready):
            break
        if process.poll() is not None:
            raise SystemExit("serve exited:\n" + text)
        time.sleep(0.1)
    ports = {kind: int(port) for kind, port in re.findall(r"^(grpc |admin |webhooks |)listening on 127\.0\.0\.1:(\d+)", text, re.M)}
    return process, text, ports


def admin_metric(admin_port, name, **labels):
    """The sum of a Prometheus metric's series with these labels, from the admin listener."""
    text = urllib.request.urlopen("http://127.0.0.1:%d/metrics" % admin_port, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all('%s="%s"' % (k, v) in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Postgres:
    """A real PostgreSQL for the fleet part: initdb into a temporary directory (as the
    postgres user when this runs as root, since initdb refuses root), pg_ctl on a free port."""

    def __init__(self):
        versions = sorted(os.listdir("/usr/lib/postgresql"), key=lambda v: int(v) if v.isdigit() else 0) if os.path.isdir("/usr/lib/postgresql") else []
        self.bin = next(("/usr/lib/postgresql/%s/bin" % v for v in reversed(versions) if os.path.exists("/usr/lib/postgresql/%s/bin/initdb" % v)), None)
        if self.bin is None:
            raise SystemExit("PostgreSQL's server is not installed: apt-get install -y postgresql")
        self.dir = tempfile.mkdtemp(prefix="store-pg-")
        os.chmod(self.dir, 0o777)
        import socket
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        with open(self.dir + "/pw", "w") as f:
            f.write("secret")
        os.chmod(self.dir + "/pw", 0o644)
        self.run("initdb", "-D", self.dir + "/data", "-U", "postgres", "--auth=scram-sha-256", "--pwfile=" + self.dir + "/pw", "-E", "UTF8", "--no-sync")
        self.start()
        self.url = "postgres://postgres:secret@127.0.0.1:%d/postgres" % self.port

    def run(self, tool, *args):
        command = [self.bin + "/" + tool, *args]
        if os.getuid() == 0:
            command = ["/usr/sbin/runuser", "-u", "postgres", "--"] + command
        subprocess.run(command, check=True, capture_output=True, stdin=subprocess.DEVNULL)

    def start(self):
        self.run("pg_ctl", "-D", self.dir + "/data", "-l", self.dir + "/log", "-w", "-t", "60",
                 "-o", "-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off" % (self.port, self.dir), "start")

    def stop(self, mode="fast"):
        self.run("pg_ctl", "-D", self.dir + "/data", "-m", mode, "-w", "stop")

    def remove(self):
        try:
            self.stop("immediate")
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
