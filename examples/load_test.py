"""The seed's load test (PR #3408, step 3) with options: a steady request rate, then status counts.

    python examples/load_test.py --url http://127.0.0.1:8000/services/NAME/ --token TOKEN --rps 8 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import aiohttp


async def send(session: aiohttp.ClientSession, method: str, url: str, counts: collections.Counter,
               verbose: bool, idx: int) -> None:
    try:
        async with session.request(method, url) as resp:
            text = await resp.text()
            counts[resp.status] += 1
            if verbose:
                print(f"[{idx}] Status: {resp.status} {text[:80].strip()!r}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        counts[f"error: {type(e).__name__}"] += 1
        if verbose:
            print(f"[{idx}] Error: {e!r}")


async def run(url: str, token: str, rps: float, duration: float, method: str, verbose: bool,
              timeout: float) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
    total = int(rps * duration)  # bounded: exactly this many requests
    start = time.perf_counter()
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        tasks = []
        for i in range(total):
            # Paced against the clock, so a slow response never lowers the rate.
            await asyncio.sleep(max(0.0, start + i / rps - time.perf_counter()))
            tasks.append(asyncio.create_task(send(session, method, url, counts, verbose, i + 1)))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    print(f"Sent {total} requests in {elapsed:.2f}s (~{total / elapsed:.2f} RPS)")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="Service URL, e.g. http://127.0.0.1:8000/services/NAME/")
    parser.add_argument("--token", default="", help="Bearer token (`durastack token`).")
    parser.add_argument("--rps", type=float, default=8, help="Requests per second (default 8).")
    parser.add_argument("--duration", type=float, default=60, help="Seconds to send for (default 60).")
    parser.add_argument("--method", default="GET", help="HTTP method (default GET).")
    parser.add_argument("--timeout", type=float, default=330, help="Per-request timeout in seconds.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Print every response.")
    args = parser.parse_args()
    counts = asyncio.run(run(args.url, args.token, args.rps, args.duration, args.method, args.verbose,
                             args.timeout))
    print("Status counts:", ", ".join(f"{k}: {v}" for k, v in sorted(counts.items(), key=str)))


if __name__ == "__main__":
    main()
