"""Gateway throughput and latency against the same replica reached directly, in one run.

    .venv/bin/python -m bench.gateway [--requests 2000] [--concurrency 16] [--warmup 200] [--rounds 2]
                                      [--client aiohttp|httpx] [--no-bare] [--keep]

One service, one group, `count: 1`, auth on. Its replica runs APP below (stdlib asyncio HTTP/1.1 with
keep-alive, body `ok <pid>`), written by the commands into the replica's private /tmp.
Paths, each with keep-alive and at most --concurrency requests in flight:

* gateway: http://127.0.0.1:<gateway port>/services/<name>/ with `Authorization: Bearer <token>`
  (nginx: auth, access log, proxy to the replica's Unix socket, bridge, app);
* direct:  the replica's Unix socket from its instance record (``address: unix:...``; bridge, app);
* bare:    a reference only: the same app script run on this host at 127.0.0.1:<free port>, no
  durastack, no bridge (the floor of what the client and the app can do on this machine).

Every path first gets --warmup requests; then each gets --requests, in --rounds alternating blocks
so that drift in the machine's load hits every path alike. Latency is per request, from sending to
having read the body.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from bench.stack import (BASE_PATH, BenchStack, code_note, free_port, http_status, load_avg, load_note,
                         percentile, replica_python, until)

NAME = "gw-bench"

APP = r'''
"""A small, fast HTTP/1.1 server (stdlib asyncio, keep-alive): 200 "ok <pid>" for every request."""
import asyncio, os, signal, sys

BODY = b"ok %d\n" % os.getpid()
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n" % len(BODY)


async def handle(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            i = lower.find(b"\r\ncontent-length:")
            if i >= 0:
                await reader.readexactly(int(lower[i + 17:lower.index(b"\r\n", i + 2)]))
            close = b"\r\nconnection: close" in lower or (
                head.split(b"\r\n", 1)[0].endswith(b"HTTP/1.0") and b"\r\nconnection: keep-alive" not in lower)
            writer.write(HEAD + (b"Connection: close\r\n\r\n" if close else b"\r\n")
                         + (b"" if head.startswith(b"HEAD ") else BODY))
            await writer.drain()
            if close:
                break
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main(port):
    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=1024)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"app: pid {os.getpid()} on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    server.close()


asyncio.run(main(int(sys.argv[1])))
'''


def service_yaml() -> str:
    # The replica's /tmp is private to it (its work dir's tmp/), so the commands write the app there.
    # JSON strings are YAML strings: no quoting surprises in the heredoc.
    commands = [f"cat > /tmp/app.py <<'EOF'\n{APP.strip()}\nEOF", "exec python3 /tmp/app.py 8000"]
    return (f"type: service\nname: {NAME}\nport: 8000\n"
            f"replicas:\n  - name: app\n    count: 1\n    commands: {json.dumps(commands)}\n"
            f"    resources: {{cpu: 1, memory: 1GB..}}\n")


# ---- load ----------------------------------------------------------------------------------------

@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)  # seconds, successful requests
    errors: int = 0
    elapsed: float = 0.0  # seconds of measured wall time
    bodies: set[bytes] = field(default_factory=set)

    def add(self, other: "Result") -> None:
        self.latencies += other.latencies
        self.errors += other.errors
        self.elapsed += other.elapsed
        self.bodies |= other.bodies


Get = Callable[[], Awaitable[tuple[int, bytes]]]  # one GET: (status, body)


async def load(gets: list[Get], requests: int) -> Result:
    """`requests` GETs by len(gets) workers (so that many in flight at most), pulling from a shared budget."""
    res = Result()
    left = requests

    async def worker(get: Get) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            try:
                status, body = await get()
            except Exception:  # noqa: BLE001 — timeouts, resets: counted, never fatal
                res.errors += 1
                continue
            if status == 200:
                res.latencies.append(time.perf_counter() - t)
                res.bodies.add(body)
            else:
                res.errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(g) for g in gets))
    res.elapsed = time.perf_counter() - t0
    return res


class Clients:
    """Keep-alive clients per path; `async with` gives {path: one GET function per worker}.

    aiohttp: one session per path with a pool of `concurrency` connections. httpx: one client (one
    connection) per worker, because a shared httpx pool is much slower than the paths measured here
    under concurrency (encode/httpx#3215); the client is still the bottleneck then.
    """

    def __init__(self, kind: str, concurrency: int, uds: str, gateway_url: str, token: str, bare_url: str):
        self.kind, self.concurrency = kind, concurrency
        self.uds, self.gateway_url, self.token, self.bare_url = uds, gateway_url, token, bare_url
        self._closers: list[Callable[[], Awaitable[None]]] = []

    async def __aenter__(self) -> dict[str, list[Get]]:
        auth = {"Authorization": f"Bearer {self.token}"}
        n = self.concurrency
        if self.kind == "httpx":
            import httpx

            def getter(url, headers=None, **transport) -> Get:
                c = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(**transport), timeout=30, trust_env=False)
                self._closers.append(c.aclose)

                async def get():
                    r = await c.get(url, headers=headers)
                    return r.status_code, r.content
                return get

            return {"gateway": [getter(self.gateway_url, auth) for _ in range(n)],
                    "direct": [getter("http://replica/", uds=self.uds) for _ in range(n)],
                    "bare": [getter(self.bare_url) for _ in range(n)]}
        import aiohttp

        def getter(connector, url, headers=None) -> Get:
            s = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30), trust_env=False)
            self._closers.append(s.close)

            async def get():
                async with s.get(url, headers=headers) as r:
                    return r.status, await r.read()
            return get

        return {"gateway": [getter(aiohttp.TCPConnector(limit=n), self.gateway_url, auth)] * n,
                "direct": [getter(aiohttp.UnixConnector(self.uds, limit=n), "http://replica/")] * n,
                "bare": [getter(aiohttp.TCPConnector(limit=n), self.bare_url)] * n}

    async def __aexit__(self, *exc) -> None:
        for close in self._closers:
            await close()


async def measure(clients: Clients, paths: list[str], requests: int, warmup: int, rounds: int) -> dict[str, Result]:
    results = {p: Result() for p in paths}
    async with clients as gets:
        for p in paths:
            warm = await load(gets[p], warmup)
            if warm.errors:
                print(f"warning: {warm.errors} errors during the warm-up of {p}", file=sys.stderr)
        per_round = [requests // rounds + (1 if i < requests % rounds else 0) for i in range(rounds)]
        for n in per_round:
            for p in paths:
                results[p].add(await load(gets[p], n))
    return results


# ---- main ----------------------------------------------------------------------------------------

def start_bare_app(stack: BenchStack) -> tuple[subprocess.Popen, str]:
    port = free_port()
    script = stack.write("bare_app.py", APP)
    proc = subprocess.Popen([replica_python(), str(script), str(port)], cwd=stack.tmp, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={"PATH": BASE_PATH, "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"})
    url = f"http://127.0.0.1:{port}/"
    until(lambda: proc.poll() is not None or http_status(url) == 200, 30, 0.05, "bare app up")
    if proc.poll() is not None:
        raise RuntimeError(f"the bare app exited with {proc.returncode}")
    return proc, url


def stop_proc(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="durastack gateway vs direct: throughput and latency")
    p.add_argument("--requests", type=int, default=2000, help="Measured requests per path (default 2000).")
    p.add_argument("--concurrency", type=int, default=16, help="Requests in flight per path (default 16).")
    p.add_argument("--warmup", type=int, default=200, help="Warm-up requests per path (default 200).")
    p.add_argument("--rounds", type=int, default=2, help="Alternating measured blocks per path (default 2).")
    p.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                   help="HTTP client (default aiohttp; httpx is the bottleneck here, see Clients).")
    p.add_argument("--no-bare", action="store_true", help="Skip the bare-app reference path.")
    p.add_argument("--keep", action="store_true", help="Keep the temp home.")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--requests, --concurrency and --rounds must be >= 1, --warmup >= 0")
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    started, load_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_note()
    log(load_note())

    with BenchStack(keep=args.keep, log=log) as stack:
        config = stack.write(f"{NAME}.yml", service_yaml())
        stack.check("apply", "-f", str(config), "-y", timeout=300)
        token = stack.token()
        inst = stack.instance(NAME, "app")
        address = inst["address"]
        if not address.startswith("unix:"):
            raise RuntimeError(f"the replica is not isolated (address {address}); the direct path expects a socket")
        uds = address[len("unix:"):]
        bare, bare_url = (None, "") if args.no_bare else start_bare_app(stack)
        try:
            clients = Clients(args.client, args.concurrency, uds, f"{stack.gateway}/services/{NAME}/", token,
                              bare_url)
            paths = ["direct", "gateway"] + ([] if args.no_bare else ["bare"])
            results = asyncio.run(measure(clients, paths, args.requests, args.warmup, args.rounds))
        finally:
            if bare is not None:
                stop_proc(bare)
        stack.stop_service(NAME)
    log(f"done; {load_note()}")

    same = results["direct"].bodies == results["gateway"].bodies and len(results["direct"].bodies) == 1
    print(f"\n{started}, {code_note()}; {load_start} at the start, {load_avg()} at the end")
    print(f"gateway vs direct: {args.requests} requests per path, concurrency {args.concurrency}, "
          f"warm-up {args.warmup}, {args.rounds} rounds, client {args.client}, keep-alive on")
    answers = sorted(b.decode(errors="replace").strip() for b in results["direct"].bodies | results["gateway"].bodies)
    print(f"one replica ({inst['replica_id']}, socket {uds}); both paths answered by the same app process: "
          f"{'yes' if same else 'NO'} (bodies {answers}; the PID is the app's in the replica's PID namespace)")
    print(f"{'path':<8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7}")
    stats = {}
    for path in paths:
        r = results[path]
        lat = sorted(r.latencies)
        stats[path] = (len(lat) / r.elapsed if r.elapsed else 0.0, percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3)
        print(f"{path:<8} {stats[path][0]:>8.0f} {stats[path][1]:>8.2f} {stats[path][2]:>8.2f} {r.errors:>7}")
    g, d = stats["gateway"], stats["direct"]
    ratio = f"{g[0] / d[0] - 1:+.0%}" if d[0] else "n/a"
    print(f"gateway adds: p50 {g[1] - d[1]:+.2f} ms, p99 {g[2] - d[2]:+.2f} ms; throughput {ratio}")
    return 0 if same and not any(r.errors for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
