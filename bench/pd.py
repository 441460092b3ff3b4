"""PD disaggregation behind the real router, under load: failed requests and router restarts per event.

    python -m bench.pd [--rps 8]

Starts `durastack server` in a temporary home, applies examples/pd-disaggregation/standin.yml (SGLang's model
gateway `smg` as the router group, stand-in SGLang engines as prefill and decode workers), and, while a steady
`--rps` of `/v1/completions` goes through the gateway, drives each event in turn: decode 1 → 3, a rolling
update of prefill, of decode and of the router, kill -9 of one decode worker and of the prefill worker, decode
back to 1. For
each it prints the requests sent, the failed ones (anything but 200), the router's restarts (new submissions of
the router replica: a worker that moved never restarts it) and the router's worker list after it. `make demo-pd` runs the same with its story.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.stack import BenchStack, step, until  # noqa: E402

EXAMPLE = ROOT / "examples" / "pd-disaggregation"
NAME = "pd-standin"


class Load:
    """A steady rate of completions through the gateway, on a thread, counting answers by status."""

    def __init__(self, url: str, token: str, rps: float):
        self.url, self.token, self.rps = url, token, rps
        self.counts: Counter = Counter()
        self.workers: Counter = Counter()  # decode worker that answered (the router's header)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "Load":
        self.counts.clear()
        self.workers.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(60)

    def _run(self) -> None:
        start, i = time.monotonic(), 0
        with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {self.token}"}) as client:
            while not self._stop.is_set() and i < 100_000:
                time.sleep(max(0.0, start + i / self.rps - time.monotonic()))
                i += 1
                try:
                    r = client.post(self.url, json={"model": "standin", "prompt": f"request {i}", "max_tokens": 4})
                    self.counts[r.status_code] += 1
                    if r.status_code == 200:
                        self.workers[r.headers.get("x-smg-routed-worker-id", "?")] += 1
                except httpx.HTTPError as e:
                    self.counts[type(e).__name__] += 1

    @property
    def failed(self) -> int:
        return sum(n for k, n in self.counts.items() if k != 200)


def router_view(stack: BenchStack) -> list[dict]:
    return stack.ps(NAME).get("router") or []


def router_submissions(stack: BenchStack) -> int:
    group = next(g for g in stack.ps(NAME)["groups"] if g["name"] == "router")
    return max((r["submission"] for r in group["replicas"]), default=0)


def settled(stack: BenchStack) -> bool:
    """Every group has its desired count ready (the autoscaler's or a manual scale's), none of an older deployment and
    none stopping, and the router lists every worker healthy."""
    status = stack.ps(NAME)
    workers = 0
    for g in status["groups"]:
        live = [r for r in g["replicas"] if r["status"] != "terminated" and r["status"] != "failed"]
        if len(live) != g["desired"] or not all(r["ready"] and r["status"] == "running"
                                                and r["deployment"] == status["deployment"] for r in live):
            return False
        workers += g["desired"] if g["role"] == "worker" else 0
    view = status.get("router") or []
    return len(view) == 1 and sum(w["healthy"] for w in view[0]["workers"]) == workers


def engine_pids(stack: BenchStack, group: str) -> list[int]:
    """The stand-in engines of ``group`` among this home's replicas."""
    pids = []
    for pid in stack.replica_pids():
        try:
            env = dict(e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if env.get(b"DURASTACK_GROUP") == group.encode() and any(a.endswith(b"engine.py") for a in argv) \
                and b"python" in Path(argv[0].decode()).name.encode():
            pids.append(pid)
    return pids


def standin(**changes: str) -> str:
    """The stand-in's file, with a group's command changed (a rolling update)."""
    text = (EXAMPLE / "standin.yml").read_text()
    for group, extra in changes.items():
        marker = {"router": '--policy round_robin', "prefill": "--disaggregation-mode prefill",
                  "decode": "--disaggregation-mode decode"}[group]
        text = text.replace(marker, f"{marker} {extra}")
    return text


def run(stack: BenchStack, rps: float, say: Callable[[str], None] = print,
        hold: float = 2.0) -> list[tuple[str, Load, int, list]]:
    """Each event under load: (event, its load, router restarts during it, the router's list after it). The load
    goes on ``hold`` seconds after the service settled: longer, a failure rate counts over more requests. (One kill
    of each: the same group killed again within minutes backs off, as a crash-looping one must.)"""
    token = stack.check("token", "add", "pd").strip()
    load = Load(f"{stack.gateway}/services/{NAME}/v1/completions", token, rps)
    results = []

    def event(title: str, act: Callable[[], None], timeout: float = 180) -> None:
        step(title)
        restarts = router_submissions(stack)
        with load:
            time.sleep(2)
            act()
            time.sleep(3)  # the event takes effect (a kill is seen within a second)
            until(lambda: settled(stack), timeout, 0.5, f"the service settled after: {title}")
            time.sleep(hold)
        view = router_view(stack)
        restarts = router_submissions(stack) - restarts
        results.append((title, _copy(load), restarts, view))
        say(f"{sum(load.counts.values())} requests, {load.failed} failed {dict(load.counts)}; router restarts "
            f"{restarts}; decode workers that answered: {len(load.workers)}")
        for r in view:
            say(f"router replica={r['replica_num']} lists: " + ", ".join(
                f"{w['url']} {w['worker_type']}{'' if w['healthy'] else ' (unhealthy)'}" for w in r["workers"]))

    file = stack.write("standin.yml", standin())
    stack.check("apply", "-f", str(file), "-y")
    until(lambda: settled(stack), 120, 0.5, "the stand-in serving")
    event("decode 1 → 3 (durastack scale)", lambda: stack.check("scale", NAME, "decode", "3"))
    changed: dict[str, str] = {}
    for group in ("prefill", "decode", "router"):
        changed[group] = "--log-level info" if group == "router" else "--latency 0.021"
        file = stack.write("standin.yml", standin(**changed))
        event(f"rolling update of {group}", lambda f=file: stack.check("apply", "-f", str(f), "-y"))
    # One of several: the autoscaler may have taken decode back to 1 by now (then a kill empties the role).
    stack.check("scale", NAME, "decode", "3")
    until(lambda: settled(stack) and len(engine_pids(stack, "decode")) == 3, 120, 0.5, "three decode workers")
    event("kill -9 of one decode worker", lambda: os.kill(engine_pids(stack, "decode")[0], signal.SIGKILL))
    event("kill -9 of the prefill worker", lambda: os.kill(engine_pids(stack, "prefill")[0], signal.SIGKILL))
    event("decode → 1 (durastack scale)", lambda: stack.check("scale", NAME, "decode", "1"))
    return results


def _copy(load: Load) -> Load:
    snapshot = Load(load.url, load.token, load.rps)
    snapshot.counts, snapshot.workers = Counter(load.counts), Counter(load.workers)
    return snapshot


def setup_env() -> None:
    os.environ["PD_EXAMPLE"] = str(EXAMPLE)
    os.environ["SMG"] = str(Path(sys.executable).parent / "smg")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rps", type=float, default=8.0)
    p.add_argument("--hold", type=float, default=2.0,
                   help="Seconds of load after each event settled (longer: rates over more requests).")
    args = p.parse_args()
    setup_env()
    with BenchStack(log=lambda line: print(line, flush=True)) as stack:
        results = run(stack, args.rps, hold=args.hold)
        stack.stop_service(NAME)
    step(f"summary at {args.rps:g} req/s, {args.hold:g} s held after each event")
    print(f"{'event':40} {'requests':>8} {'failed':>6} {'router restarts':>15}")
    for title, load, restarts, _ in results:
        print(f"{title:40} {sum(load.counts.values()):>8} {load.failed:>6} {restarts:>15}")


if __name__ == "__main__":
    main()
