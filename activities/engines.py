"""Reading the replicas' engines for groups that scale on an engine signal (`queue`, `running`, `kv_cache`, `ttft`,
`itl`).

``watch_engines`` is one long activity per service and backend, on the backend's queue, as the monitor: it
reads each replica's Prometheus endpoint every second, the way the probes reach the replica (a local one through
its socket, a cloud one over its SSH tunnel or private path), and returns only when some group's wanted count
changes, a replica is read for the first time or its error changes, so a steady service writes no history.

Each replica's readings are kept by the worker, not by one watcher: a watcher restarted because the replicas
changed goes on with the window its predecessor filled.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from datetime import datetime, timezone
from typing import Callable, Optional

import httpx
from temporalio import activity

from activities import interface
from activities.interface import implements
from activities.watch import watch_until_down
from backends.engine_metrics import Reading, UnknownNames, over_window, read
from backends.http import Connect, client_for
from models.messages import EngineGroupWatch, EngineWatch, Watched
from models.state import NOT_READ_YET, EngineSnapshot, ReplicaSignal
from rules.autoscaler import engine_total, wanted

TIMEOUT = 2.0
FORGET_SECONDS = 600.0  # a replica no watcher read for this long is forgotten

Reach = Callable[[object], tuple[str, Optional[Connect]]]


class EngineActivities:
    def __init__(self, reach: Callable[[str], Optional[Reach]]):
        """``reach(backend)``: how this worker reaches an instance's app on that backend (None: not served here)."""
        self.reach = reach
        self.readings: dict[str, deque[Reading]] = {}  # replica id → its readings, oldest first
        self.last_read: dict[str, float] = {}

    @implements(interface.watch_engines)
    async def watch(self, inp: EngineWatch) -> EngineSnapshot:
        reach = self.reach(inp.backend)
        if reach is None:
            raise RuntimeError(f"backend {inp.backend} is not served by this worker")
        groups = {g.name: g for g in inp.groups}
        known = {(s.replica_num, s.submission_num): s for s in inp.known}
        deadline = time.monotonic() + inp.max_seconds

        async def check() -> Optional[EngineSnapshot]:
            signals = await asyncio.gather(*[self._signal(w, groups[w.group], reach) for w in inp.replicas])
            self._forget()
            if changed(inp.groups, signals, known) or time.monotonic() >= deadline:
                return EngineSnapshot(backend=inp.backend, at=datetime.now(timezone.utc), replicas=signals)
            return None

        return await watch_until_down(check, inp.poll_seconds)

    async def _signal(self, w: Watched, group: EngineGroupWatch, reach: Reach) -> ReplicaSignal:
        signal = ReplicaSignal(replica_num=w.replica_num, submission_num=w.submission_num, group=w.group)
        now = time.monotonic()
        try:
            text = await scrape(*reach(w.instance), group.path)
            reading = read(group.metric, text, now)
        except (UnknownNames, ScrapeError) as e:
            signal.error = str(e)
            return signal
        except ValueError:
            signal.error = f"{group.path} is not in Prometheus's text format"
            return signal
        history = self.readings.setdefault(w.replica_id, deque())
        history.append(reading)
        while len(history) > 1 and history[1].at <= now - group.window:  # one reading older than the window stays
            history.popleft()
        self.last_read[w.replica_id] = now
        signal.value = over_window(group.metric, list(history), group.window)
        if signal.value is None:
            signal.error = NOT_READ_YET
        return signal

    def _forget(self) -> None:
        stale = [rid for rid, at in self.last_read.items() if time.monotonic() - at > FORGET_SECONDS]
        for rid in stale:
            self.readings.pop(rid, None)
            self.last_read.pop(rid, None)


class ScrapeError(Exception):
    pass


async def scrape(address: str, connect: Optional[Connect], path: str) -> str:
    """The engine's exposition text at ``path``; ScrapeError says why not."""
    client, base = client_for(address, TIMEOUT, connect)
    async with client:
        try:
            r = await client.get(base + path)
        except httpx.HTTPError as e:
            raise ScrapeError(f"unreachable: {type(e).__name__} {e}".strip()) from None
    if r.status_code != 200:
        raise ScrapeError(f"{path} answered HTTP {r.status_code}")
    return r.text


def changed(groups: list[EngineGroupWatch], signals: list[ReplicaSignal],
            known: dict[tuple[int, int], ReplicaSignal]) -> bool:
    """Whether the service should hear of these readings: a group's wanted count moved, or a replica was read
    for the first time or its error changed."""
    for s in signals:
        was = known.get((s.replica_num, s.submission_num))
        if was is None and s.error == NOT_READ_YET:  # a second later it is read: said then, once
            continue
        if was is None or not was.same_kind(s):
            return True
    for g in groups:
        read = [s.value for s in signals if s.group == g.name and s.value is not None]
        unreadable = sum(1 for s in signals if s.group == g.name and s.unreadable)
        total = engine_total(sum(read) + g.others, len(read) + g.others_read,
                             len(read) + unreadable + g.others_counted)
        if total is not None and wanted(total, g.target, g.lo, g.hi)[0] != g.wanted:
            return True
    return False
