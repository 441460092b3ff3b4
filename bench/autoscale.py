"""Autoscaling benchmarks: reaction time and scale from zero, on the real embedded stack.

    .venv/bin/python -m bench.autoscale [--rps 12] [--burst 20]

* reaction: a group `1..3` with target 5 rps, window 30 s and no delays, at 1 replica; a steady
  load starts; the *threshold crossing* is the moment the gateway's 30 s window first holds more
  than target × 1 × 30 requests (read from /api/stats every 50 ms); the *reaction* is the time
  from there to the new replica's ReplicaWorkflow being started (the child's start event in the
  service workflow's history; same clock). Goal ≤ 2 s.
* scale from zero: a group `0..1` at zero; a burst of concurrent requests; time to first byte of
  the first answer, minus the replica's own start time (process start → first HTTP answer,
  measured without durastack), and the number of failed requests (goal 0).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import tempfile
import threading
import time
from datetime import timezone
from pathlib import Path

import httpx
from temporalio.client import Client

from bench.stack import BenchStack, free_port, median, replica_python, until
from connect.connection import client_options

REACTION = """
type: service
name: react
port: 8000
replicas:
  - name: web
    count: 1..3
    scaling: {metric: rps, target: 5, window: 30s, scale_up_delay: 0s, scale_down_delay: 10m}
    commands: [python3 -m http.server 8000]
    resources: {cpu: 1, memory: 1GB..}
"""

FROM_ZERO = """
type: service
name: cold
port: 8000
replicas:
  - name: web
    count: 0..1
    scaling: {metric: rps, target: 100, window: 30s, scale_up_delay: 0s, scale_down_delay: 10m}
    commands: [python3 -m http.server 8000]
    resources: {cpu: 1, memory: 1GB..}
"""


def load(url: str, token: str, rps: float, stop: threading.Event, counts: dict) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
            start, i, tasks = time.monotonic(), 0, []
            while not stop.is_set() and i < rps * 300:  # bounded: at most 5 minutes
                await asyncio.sleep(max(0.0, start + i / rps - time.monotonic()))
                tasks.append(asyncio.create_task(one(client)))
                i += 1
            await asyncio.gather(*tasks)

    async def one(client: httpx.AsyncClient) -> None:
        try:
            status = (await client.get(url)).status_code
        except httpx.HTTPError as e:
            status = type(e).__name__
        counts[status] = counts.get(status, 0) + 1

    asyncio.run(run())


def _routes(stack: BenchStack) -> dict:
    return httpx.get(f"{stack.control}/api/services", timeout=5, trust_env=False,
                     headers={"Authorization": f"Bearer {stack.settings.control_token}"}).json()["services"]


def window_requests(stack: BenchStack, service: str, window: int = 30) -> int:
    # The control API answers only with the gateway's control token (the home's control.token).
    stats = httpx.get(f"{stack.control}/api/stats", timeout=5, trust_env=False,
                      headers={"Authorization": f"Bearer {stack.settings.control_token}"}).json()["services"].get(service)
    return stats["windows"][str(window)]["requests"] if stats else 0


async def child_started_at(stack: BenchStack, service: str, replica_num: int) -> float:
    """When the service workflow started the ReplicaWorkflow of ``replica_num`` (epoch seconds)."""
    client = await Client.connect(**client_options(stack.settings))
    history = await client.get_workflow_handle(f"service/{service}").fetch_history()
    for event in history.events:
        if event.HasField("start_child_workflow_execution_initiated_event_attributes"):
            wid = event.start_child_workflow_execution_initiated_event_attributes.workflow_id
            if wid.endswith(f"/r{replica_num}-s0"):
                return event.event_time.ToDatetime().replace(tzinfo=timezone.utc).timestamp()
    raise RuntimeError(f"no child for replica {replica_num}")


def reaction(stack: BenchStack, rps: float, tmp: Path) -> float:
    (tmp / "react.yml").write_text(REACTION)
    stack.check("apply", "-f", str(tmp / "react.yml"), "-y")
    token = stack.token()
    stop, counts = threading.Event(), {}
    thread = threading.Thread(target=load, args=(f"{stack.gateway}/services/react/", token, rps, stop, counts))
    thread.start()
    try:
        threshold = 5 * 1 * 30  # target × current replicas × window
        until(lambda: window_requests(stack, "react") > threshold, 120, 0.05, "threshold crossing")
        crossed = time.time()
        until(lambda: len(stack.ps("react")["groups"][0]["replicas"]) >= 2, 30, 0.1, "second replica")
        started = asyncio.run(child_started_at(stack, "react", 1))
    finally:
        stop.set()
        thread.join(120)
    stack.check("stop", "react", "-y")
    print(f"  load statuses: {counts}")
    return started - crossed


def own_start_seconds(runs: int = 5) -> float:
    """The replica's own start time: process start → first HTTP answer, without durastack."""
    times = []
    for _ in range(runs):
        port = free_port()
        with tempfile.TemporaryDirectory() as cwd:
            start = time.monotonic()
            proc = subprocess.Popen([replica_python(), "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                    cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                until(lambda: _answers(f"http://127.0.0.1:{port}/"), 30, 0.005, "replica answers")
                times.append(time.monotonic() - start)
            finally:
                proc.terminate()
                proc.wait(10)
    return median(times)


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def from_zero(stack: BenchStack, burst: int, tmp: Path) -> tuple[float, dict]:
    (tmp / "cold.yml").write_text(FROM_ZERO)
    stack.check("apply", "-f", str(tmp / "cold.yml"), "-y")
    # `apply` returns once every group has its replicas, which at zero is at once, possibly before the service's
    # first workflow task has put its gateway route: a request then is nginx's 404, not a cold start.
    until(lambda: "cold" in _routes(stack), 60, 0.05, "the service's gateway route")
    token = stack.token()
    url = f"{stack.gateway}/services/cold/"

    async def burst_at_zero() -> tuple[float, dict]:
        counts: dict = {}
        first: list[float] = []
        start = time.monotonic()

        async def one(client: httpx.AsyncClient) -> None:
            try:
                response = await client.get(url)
                first.append(time.monotonic() - start)
                counts[response.status_code] = counts.get(response.status_code, 0) + 1
            except httpx.HTTPError as e:
                counts[type(e).__name__] = counts.get(type(e).__name__, 0) + 1

        headers = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(headers=headers, timeout=330) as client:
            await asyncio.gather(*(one(client) for _ in range(burst)))
        return min(first) if first else float("nan"), counts

    ttfb, counts = asyncio.run(burst_at_zero())
    stack.check("stop", "cold", "-y")
    return ttfb, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rps", type=float, default=12, help="load of the reaction run (target is 5 rps)")
    parser.add_argument("--burst", type=int, default=20, help="concurrent requests sent at zero")
    args = parser.parse_args()
    with BenchStack() as stack, tempfile.TemporaryDirectory() as tmp:
        react = reaction(stack, args.rps, Path(tmp))
        own = own_start_seconds()
        ttfb, counts = from_zero(stack, args.burst, Path(tmp))
    failed = sum(n for status, n in counts.items() if status != 200)
    print(f"reaction (threshold crossing → new replica submitted): {react:.2f} s   (goal ≤ 2 s)")
    print(f"scale from zero: first byte {ttfb:.2f} s, replica's own start {own:.2f} s, "
          f"overhead {ttfb - own:.2f} s; {args.burst} requests: {counts}; failed {failed} (goal 0)")


if __name__ == "__main__":
    main()
