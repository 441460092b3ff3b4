"""History events an idle service costs per hour, read from Temporal (goal ≤ 60).

    .venv/bin/python -m bench.idle_history [--minutes 60]

One service with a fixed group (1 replica, running and watched) and an autoscaled group at zero
(its stats watcher running), with no traffic. After it settles, the events of the service
workflow and of every replica workflow are counted at the start and the end of the idle period;
the difference is scaled to one hour. Measure a full hour (the default): the safety tick (an hour)
and the stats watcher's renewal (50 min) are coarse, so short runs over- or under-count.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from temporalio.client import Client

from bench.stack import BenchStack, until
from connect.connection import client_options

SERVICE = """
type: service
name: idle
port: 8000
replicas:
  - name: fixed
    count: 1
    commands: [python3 -m http.server 8000]
    resources: {cpu: 1, memory: 1GB..}
  - name: auto
    count: 0..2
    scaling: {metric: rps, target: 5}
    commands: [python3 -m http.server 8000]
    resources: {cpu: 1, memory: 1GB..}
"""


async def event_counts(client: Client) -> dict[str, int]:
    """Events in the current run of the service workflow and of each of its replica workflows."""
    counts = {}
    async for wf in client.list_workflows("WorkflowId STARTS_WITH 'service/idle'"):
        if wf.status is not None and wf.status.name == "RUNNING":
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            counts[wf.id] = len(history.events)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60)
    args = parser.parse_args()
    with BenchStack() as stack, tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "idle.yml").write_text(SERVICE)
        stack.check("apply", "-f", str(Path(tmp) / "idle.yml"), "-y")
        until(lambda: stack.ps("idle")["groups"][0]["replicas"][0]["ready"], 60, 0.5, "replica ready")
        time.sleep(15)  # settle: the first stats snapshot, route registration (a measurement, not a test)

        async def measure() -> tuple[dict, dict, float]:
            client = await Client.connect(**client_options(stack.settings))
            before, start = await event_counts(client), time.monotonic()
            await asyncio.sleep(args.minutes * 60)
            return before, await event_counts(client), time.monotonic() - start

        before, after, elapsed = asyncio.run(measure())
    hours = elapsed / 3600
    total = 0
    print(f"idle for {elapsed / 60:.1f} min; events added per workflow:")
    for wid in sorted(after):
        added = after[wid] - before.get(wid, 0)
        total += added
        print(f"  {wid:<40} {added:>5}  ({added / hours:.1f}/h)")
    print(f"idle service (1 running replica + 1 group at zero): {total / hours:.1f} history events per hour "
          f"(goal ≤ 60)")


if __name__ == "__main__":
    main()
