"""The stats watcher: one long, heartbeating activity per autoscaled service.

It reads the gateway's request rates every second in-process and *returns only when some group's
wanted count changes*, so an idle service adds no history events (DESIGN.md, "History economy"),
while a change reaches the workflow about a second after the window's rate crosses a threshold.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from temporalio import activity

from models.gateway import StatsReport
from models.run import StatsSnapshot, StatsWatch
from workflows import names
from workflows.autoscaler import wanted


def snapshot_of(report: StatsReport, service: str) -> Optional[StatsSnapshot]:
    stats = report.services.get(service)
    if stats is None:
        return None
    rps = {w: s.requests / w for w, s in stats.windows.items()}
    return StatsSnapshot(rps=rps, held=getattr(stats, "held", 0))


def changed(watch: StatsWatch, snap: StatsSnapshot) -> bool:
    return any(wanted(snap.rate(g.window), g.target, g.lo, g.hi)[0] != g.wanted for g in watch.groups)


class StatsActivities:
    def __init__(self, read_stats: Callable[[], Awaitable[StatsReport]]):
        self.read_stats = read_stats

    @activity.defn(name=names.WATCH_STATS)
    async def watch_stats(self, watch: StatsWatch) -> StatsSnapshot:
        deadline = time.monotonic() + watch.max_seconds
        last: Optional[StatsSnapshot] = None
        while True:
            try:
                last = snapshot_of(await self.read_stats(), watch.service) or last
            except Exception as e:  # noqa: BLE001 — no stats means no change; keep watching
                activity.logger.info("gateway stats unavailable: %s", e)
            if last is not None and (changed(watch, last) or time.monotonic() >= deadline):
                return last
            activity.heartbeat()
            await asyncio.sleep(watch.poll_seconds)
