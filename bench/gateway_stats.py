"""What the gateway's control app spends per logged request: StatsCollector.feed + GatewayMetrics.observe.

    .venv/bin/python -m bench.gateway_stats [--lines 200000] [--ticks 1] [--repeat 5]

No server, no nginx: synthetic lines in nginx's LOG_FORMAT (``$msec $ds_hit $status $request_time $ds_service
$upstream_addr``), fed as the control app's tick does (gateway/app.py ``collect``). Each workload gets a fresh
collector and metrics per run; the figures are the median of --repeat runs, in µs per line and lines/s.
--ticks N splits the lines into N consecutive reads of the log (the clock moving on by their span / N).

Workloads (5 s of traffic each):

* ``uniform``: one service, 4 upstream addresses, request times 0.001–0.009 s (the bench in the task that
  asked for this: many lines share everything but their milliseconds);
* ``varied``: two services, 6 addresses (1 in 10 after a retry, "a, b"), 200/401/503, request times from an
  exponential distribution (mean 50 ms, 3 decimals as nginx logs them), 1 in 20 handed to the activator;
* ``distinct``: request times uniform over 0–300 s, so that nearly every line differs from all others in more
  than its milliseconds (the worst case for the aggregation; such traffic has few requests per second).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter

from bench.stack import code_note, load_avg, load_note
from gateway.metrics import GatewayMetrics
from gateway.stats import StatsCollector

SPAN = 5.0  # seconds of traffic in each workload


class _Activator:  # GatewayMetrics reads it only at scrape time
    held: Counter = Counter()
    held_total: Counter = Counter()


def times(rng: random.Random, n: int, now: float) -> list[float]:
    """In the order nginx appends them (nearly: by completion); each line is then made in that order, as the
    tailer makes them (sorting made strings would scatter them in memory and cost time no tailer pays)."""
    return sorted(now - rng.random() * SPAN for _ in range(n))


def uniform(rng: random.Random, n: int, now: float) -> list[str]:
    return [f"{t:.3f} 1 200 0.00{rng.randint(1, 9)} svc unix:/x/r{rng.randint(0, 3)}.sock" for t in times(rng, n, now)]


def varied(rng: random.Random, n: int, now: float) -> list[str]:
    out = []
    for t in times(rng, n, now):
        svc = rng.choice(("svc", "svc", "svc", "other"))
        addr = f"unix:/x/{svc}{rng.randint(0, 2)}.sock"
        if rng.random() < 0.1:
            addr = f"unix:/x/{svc}{rng.randint(0, 2)}.sock, {addr}"
        status = rng.choices(("200", "401", "503"), (95, 4, 1))[0]
        hit = "0" if status == "401" else "2" if rng.random() < 0.05 else "1"
        out.append(f"{t:.3f} {hit} {status} {rng.expovariate(20):.3f} {svc} {addr}")
    return out


def distinct(rng: random.Random, n: int, now: float) -> list[str]:
    return [f"{t:.3f} 1 200 {rng.uniform(0, 300):.3f} svc unix:/x/r{rng.randint(0, 3)}.sock"
            for t in times(rng, n, now)]


WORKLOADS = {"uniform": uniform, "varied": varied, "distinct": distinct}


def run(lines: list[str], now: float, ticks: int) -> tuple[float, float]:
    """Seconds spent in feed and in observe, over all ticks."""
    collector = StatsCollector()
    for svc in ("svc", "other"):
        for i in range(4):
            collector.remember(svc, f"unix:/x/{svc}{i}.sock", f"g{i % 2}")
    for i in range(4):
        collector.remember("svc", f"unix:/x/r{i}.sock", "g")
    metrics = GatewayMetrics(_Activator(), lambda: ["svc", "other"], since=0)
    size = -(-len(lines) // ticks)
    feed = observe = 0.0
    for k in range(ticks):
        chunk, at = lines[k * size:(k + 1) * size], now - SPAN + SPAN * (k + 1) / ticks
        t0 = time.perf_counter()
        batch = collector.feed(chunk, at)
        t1 = time.perf_counter()
        metrics.observe(batch, collector.group_of)
        t2 = time.perf_counter()
        feed, observe = feed + t1 - t0, observe + t2 - t1
    metrics.exposition()  # not timed: once per scrape, not per line
    return feed, observe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lines", type=int, default=200_000)
    p.add_argument("--ticks", type=int, default=1, help="split the lines into this many reads of the log")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    args = p.parse_args(argv)
    started, load_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_note()
    rows = []
    for name in args.workloads.split(","):
        now = time.time()
        lines = WORKLOADS[name](random.Random(1), args.lines, now)
        runs = [run(lines, now, args.ticks) for _ in range(args.repeat)]
        feed = statistics.median(f for f, _ in runs) / len(lines) * 1e6
        observe = statistics.median(o for _, o in runs) / len(lines) * 1e6
        total = statistics.median(f + o for f, o in runs) / len(lines) * 1e6
        rows.append(f"{name:<10} {feed:>8.3f} {observe:>10.3f} {total:>8.3f} {1e6 / total:>12,.0f}")
        print(f"{name} done", file=sys.stderr)
    print(f"{started}, {code_note()}; {load_start} at the start, {load_avg()} at the end")
    print(f"{args.lines:,} lines in {args.ticks} read(s), median of {args.repeat} runs; µs per line")
    print(f"{'workload':<10} {'feed':>8} {'observe':>10} {'total':>8} {'lines/s':>12}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
