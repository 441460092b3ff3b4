"""The stats watcher: one long, heartbeating activity per autoscaled service.

It reads the gateway's request rates every second in-process and *returns only when some group's
wanted count changes*, so an idle service adds no history events (DESIGN.md, "History economy"),
while a change reaches the workflow about a second after the window's rate crosses a threshold.

The gateway's report holds every service's stats, so the watchers of one worker process share one read per
``poll_seconds`` (``SharedRead``): one watcher per service each reading every service's stats would cost the
gateway work that grows with the square of the number of services.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Generic, Optional, TypeVar

from temporalio import activity

from activities import interface
from activities.interface import implements
from models.gateway import StatsReport
from models.messages import StatsWatch
from models.state import StatsSnapshot
from rules.autoscaler import wanted

T = TypeVar("T")


class SharedRead(Generic[T]):
    """One ``read()`` at a time, shared: a caller within ``max_age`` seconds of the last read's start gets that
    read's result (awaiting it if it is still under way) instead of starting another."""

    def __init__(self, read: Callable[[], Awaitable[T]], max_age: float = 1.0):
        self._read, self.max_age = read, max_age
        self._last: Optional[asyncio.Future] = None
        self._started = float("-inf")

    async def __call__(self) -> T:
        now = time.monotonic()
        if self._last is None or now - self._started >= self.max_age:
            self._started, self._last = now, asyncio.ensure_future(self._read())
            # A failed read whose callers were all cancelled must not log "exception never retrieved".
            self._last.add_done_callback(lambda f: f.cancelled() or f.exception())
        # Shielded: one watcher cancelled (its service stopped) must not cancel the others' read.
        return await asyncio.shield(self._last)


def snapshot_of(report: StatsReport, service: str) -> Optional[StatsSnapshot]:
    stats = report.services.get(service)
    if stats is None:
        return None
    rps = {w: s.requests / w for w, s in stats.windows.items()}
    return StatsSnapshot(rps=rps, held=getattr(stats, "held", 0))


def changed(watch: StatsWatch, snap: StatsSnapshot) -> bool:
    return any(wanted(snap.rate(g.window), g.target, g.lo, g.hi)[0] != g.wanted for g in watch.groups)


class StatsActivities:
    def __init__(self, read_stats: Callable[[], Awaitable[StatsReport]], max_age: float = 1.0):
        """``max_age``: how old a shared report may be; every watcher of this process reads through it."""
        self.read_stats = SharedRead(read_stats, max_age)

    @implements(interface.watch_stats)
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
