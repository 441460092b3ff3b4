"""What the embedded Temporal's door (cli/door.py) costs a client: the same gRPC calls, through the door from the
host, and straight to the dev server from inside its namespace, in turns, on one `durastack server`.

    .venv/bin/python -m bench.door [--calls 2000] [--rounds 3] [--rate 300]

Each run is a fresh client process that connects, then makes ``--calls`` sequential ``GetSystemInfo`` calls
(a cheap call: what is measured is the path, not the server's work), paced at ``--rate`` a second (the dev
server refuses faster clients). Prints per-call latency (p50, p99, mean) for each path, and the door's ratio.
Needs root (the door needs network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from bench.stack import ROOT, BenchStack, load_avg, percentile

KEY_ENV = "BENCH_DOOR_API_KEY"


async def _measure(address: str, namespace: str, api_key: str | None, calls: int, rate: float) -> dict:
    from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
    from temporalio.client import Client

    client = await Client.connect(address, namespace=namespace, api_key=api_key, tls=False)
    request = GetSystemInfoRequest()
    await client.workflow_service.get_system_info(request)  # warm the connection
    latencies = []
    start = time.perf_counter()
    for n in range(calls):
        # Paced: the dev server's frontend refuses a client that goes faster than its rate limit.
        await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
        t0 = time.perf_counter()
        await client.workflow_service.get_system_info(request)
        latencies.append(time.perf_counter() - t0)
    latencies.sort()
    return {"p50_ms": percentile(latencies, 50) * 1e3, "p99_ms": percentile(latencies, 99) * 1e3,
            "mean_ms": sum(latencies) / len(latencies) * 1e3}


def _run(prefix: list[str], address: str, namespace: str, api_key: str | None, calls: int, rate: float) -> dict:
    argv = [*prefix, sys.executable, "-m", "bench.door", "--measure", address, "--namespace", namespace,
            "--calls", str(calls), "--rate", str(rate)]
    env = {**os.environ, KEY_ENV: api_key or ""}  # not in argv: every local user can read those
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:len(prefix) + 4])}: exit {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=300.0, help="Calls a second (under the server's limit).")
    parser.add_argument("--measure", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--namespace", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(asyncio.run(_measure(args.measure, args.namespace, os.environ.get(KEY_ENV) or None,
                                              args.calls, args.rate))), flush=True)
        os._exit(0)  # the SDK's threads can abort an interpreter that finalizes (as cli.main.entry does)

    from backends import local_net
    from cli.door import possible
    from connect.connection import embedded_api_key

    if not possible()[0]:
        sys.exit(f"no door here: {possible()[1]}")
    with BenchStack() as stack:
        s = stack.settings
        key = embedded_api_key(s, stack.env)
        inside = ["nsenter", f"--net={local_net.NETNS_DIR / local_net.temporal_nsname(s.home)}", "--"]
        print(f"door vs direct: {args.calls} sequential GetSystemInfo calls per run at {args.rate:g}/s, "
              f"{args.rounds} rounds (load {load_avg()})")
        results: dict[str, list[dict]] = {"door": [], "direct": []}
        for _ in range(args.rounds):  # in turns, so that the machine's drift hits both
            results["door"].append(_run([], s.address, s.namespace, key, args.calls, args.rate))
            results["direct"].append(_run(inside, s.address, s.namespace, None, args.calls, args.rate))
        for path, runs in results.items():
            print(f"  {path:6} p50 " + " / ".join(f"{r['p50_ms']:.3f}" for r in runs) + " ms   p99 "
                  + " / ".join(f"{r['p99_ms']:.3f}" for r in runs) + " ms   mean "
                  + " / ".join(f"{r['mean_ms']:.3f}" for r in runs) + " ms")
        ratios = [d["mean_ms"] / r["mean_ms"] for d, r in zip(results["door"], results["direct"])]
        extra = [d["p50_ms"] - r["p50_ms"] for d, r in zip(results["door"], results["direct"])]
        print(f"  door/direct mean latency: {' / '.join(f'{x:.2f}x' for x in ratios)}; p50 added: "
              + " / ".join(f"{x:+.3f} ms" for x in extra) + f" (load {load_avg()})")


if __name__ == "__main__":
    main()
