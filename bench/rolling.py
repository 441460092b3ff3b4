"""Rolling deployment: time to roll N replicas minus N × the replica's own start time, and failures.

    .venv/bin/python -m bench.rolling [--replicas 1,4,8] [--rps 8]

One group of N replicas serves a steady load through the gateway; a new configuration changes the
group's commands; the blocking `durastack apply` returns when every replica runs the new version
and no rollout is left. Replacing one at a time (surge 1), the ideal is N × own start time, so the
overhead is T − N × own. Every request of the load is counted: the goal is zero failures.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from bench.autoscale import load, own_start_seconds
from bench.stack import BenchStack

SERVICE = """
type: service
name: roll
port: 8000
replicas:
  - name: web
    count: {n}
    commands: ["echo v{v} > /tmp/v", "python3 -m http.server 8000"]
    resources: {{cpu: 1, memory: 1GB..}}
"""


def roll(stack: BenchStack, n: int, rps: float, tmp: Path) -> tuple[float, dict]:
    for v in (0, 1):
        (tmp / f"v{v}.yml").write_text(SERVICE.format(n=n, v=v))
    stack.check("apply", "-f", str(tmp / "v0.yml"), "-y")
    token = stack.token()
    stop, counts = threading.Event(), {}
    thread = threading.Thread(target=load, args=(f"{stack.gateway}/services/roll/", token, rps, stop, counts))
    thread.start()
    try:
        start = time.monotonic()
        stack.check("apply", "-f", str(tmp / "v1.yml"), "-y")
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        thread.join(120)
    stack.check("stop", "roll", "-y")
    return elapsed, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="1,4,8")
    parser.add_argument("--rps", type=float, default=8)
    args = parser.parse_args()
    own = own_start_seconds()
    rows = []
    with BenchStack() as stack, tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.replicas.split(",")):
            elapsed, counts = roll(stack, n, args.rps, Path(tmp))
            failed = sum(v for k, v in counts.items() if k != 200)
            rows.append((n, elapsed, elapsed - n * own, sum(counts.values()), failed))
    print(f"replica's own start: {own:.2f} s")
    print(f"{'N':>3} {'roll s':>8} {'overhead s':>11} {'requests':>9} {'failed':>7}")
    for n, elapsed, overhead, total, failed in rows:
        print(f"{n:>3} {elapsed:>8.2f} {overhead:>11.2f} {total:>9} {failed:>7}")


if __name__ == "__main__":
    main()
