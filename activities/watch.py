"""The watch loop ``monitor_replicas`` runs: poll the instances, heartbeat only as often as needed.

A monitor lives as long as its service's replicas on one backend, so one worker holds thousands of them
(bench/scale_out.py). Each
``activity.heartbeat()`` costs the worker about 0.1 ms of CPU (the SDK encodes, schedules a task and calls
its core), while the core sends at most one heartbeat per 0.8 × heartbeat timeout anyway: heartbeating on
every 1 s liveness poll made 6,000 per-replica watches cost most of a core. The loop heartbeats every third of the
heartbeat timeout (``liveness.HEARTBEATS_PER_TIMEOUT``), whatever the poll cadence.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional, TypeVar

from temporalio import activity

from activities.liveness import heartbeat_interval

T = TypeVar("T")

SLACK = 0.05  # a sleep may end a little early: a check or heartbeat that is that close to due is due


def heartbeat_every(poll_seconds: float) -> float:
    """Seconds between heartbeats: a third of the activity's heartbeat timeout (the poll cadence without one)."""
    every = heartbeat_interval(activity.info().heartbeat_timeout)
    return poll_seconds if every is None else every


async def watch_until_down(check: Callable[[], Awaitable[Optional[T]]], poll_seconds: float) -> T:
    """Call ``check`` every ``poll_seconds`` until it returns something (what is down); heartbeat meanwhile."""
    every = heartbeat_every(poll_seconds)
    polled = beat = float("-inf")
    while True:
        now = time.monotonic()
        if now - polled >= poll_seconds - SLACK:
            down = await check()
            if down is not None:
                return down
            polled = now
        if now - beat >= every - SLACK:
            activity.heartbeat()
            beat = now
        await asyncio.sleep(min(poll_seconds, every))
