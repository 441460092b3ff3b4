"""`make demo-pd`: PD disaggregation on this machine, with the stand-in of examples/pd-disaggregation.

Starts `durastack server` in a temporary home, validates the seed's GPU service, applies the runnable
stand-in (a router group the gateway routes to, a prefill group and an autoscaled decode group behind it,
the workers finding the router through its interpolated address), sends requests through the gateway and
shows which workers served them, kills a decode worker and shows the router serving from its replacement,
puts load on the service so that the decode group scales on the service's rate, then stops everything.

The workers reach the router at its replica address: on the service's private network when replicas are
isolated (as root), or on the host's loopback, each with its own PORT, with `--no-isolation`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.stack import BenchStack, step, until  # noqa: E402

EXAMPLE = ROOT / "examples" / "pd-disaggregation"
NAME = "pd-standin"


def ask(client: httpx.Client, url: str, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        r = client.get(url)
        out.append(r.json() if r.status_code == 200 else {"status": r.status_code})
    return out


def stand_in_pids(home: Path, group: str) -> list[int]:
    """The stand-in programs of ``group`` among this home's replicas (read from /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            env = dict(e.split(b"=", 1) for e in (entry / "environ").read_bytes().split(b"\0") if b"=" in e)
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, NotADirectoryError):
            continue
        if env.get(b"DURASTACK_WORK_DIR", b"").decode().startswith(str(home)) and \
                env.get(b"DURASTACK_GROUP") == group.encode() and b"python" in Path(argv[0].decode()).name.encode():
            pids.append(int(entry.name))
    return pids


def load(client: httpx.Client, url: str, rps: float, seconds: float) -> Counter:
    counts: Counter = Counter()
    start = time.monotonic()
    i = 0
    while time.monotonic() - start < seconds:
        time.sleep(max(0.0, start + i / rps - time.monotonic()))
        try:
            counts[client.get(url).status_code] += 1
        except httpx.HTTPError as e:
            counts[type(e).__name__] += 1
        i += 1
    return counts


def main() -> None:
    os.environ["PD_EXAMPLE"] = str(EXAMPLE)  # the stand-in's `env: [PD_EXAMPLE]`
    if "--no-isolation" in sys.argv:
        os.environ["DURASTACK_LOCAL_ISOLATION"] = "off"
    with BenchStack(log=lambda line: print(line, flush=True)) as stack:
        print(f"Web UI: {stack.settings.ui_url}   gateway: {stack.gateway}")
        step("durastack validate -f examples/pd-disaggregation/service.yml  (the seed's GPU service)")
        print(stack.check("validate", "-f", str(EXAMPLE / "service.yml")))
        step("durastack apply -f examples/pd-disaggregation/standin.yml -y")
        print(stack.check("apply", "-f", str(EXAMPLE / "standin.yml"), "-y"))
        step("durastack ps  (the router group is the only one the gateway routes to)")
        print(stack.check("ps"))
        token = stack.check("token", "add", "demo").strip()
        url = f"{stack.gateway}/services/{NAME}/generate"
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=10) as client:
            until(lambda: all("decode" in a for a in ask(client, url, 2)), 30, 0.5, "the router reaches its workers")
            step(f"6 requests through {url}: each enters the router, then a prefill and a decode worker")
            answers = ask(client, url, 6)
            for a in answers:
                print(json.dumps(a))
            step("kill the decode worker: it is replaced, and the router serves from the new one")
            old = answers[-1]["decode"]
            for pid in stand_in_pids(stack.home, "decode"):
                print(f"kill -9 {pid}")
                os.kill(pid, signal.SIGKILL)
            served = until(lambda: [a for a in ask(client, url, 2) if a.get("decode", old) != old], 90, 0.5,
                           "a new decode worker serving")
            print(f"before: {old}  now: {served[0]['decode']}")
            step("16 requests/s for 40 s: the decode group scales on the service's rate")
            print(dict(load(client, url, 16, 40)))
            print(stack.check("ps"))
            print(Counter(a.get("decode", "-").split("#")[0] for a in ask(client, url, 12)))
        step(f"durastack events {NAME}")
        print(stack.check("events", NAME))
        step(f"durastack stop {NAME}")
        print(stack.check("stop", NAME, "-y"))
    print("\nDone: the service, the replicas and the server are stopped.")


if __name__ == "__main__":
    main()
