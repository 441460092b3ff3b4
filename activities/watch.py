"""The watch loop every backend's ``watch_replica`` runs: poll the instance, heartbeat only as often as needed.

A watch lives as long as its replica, so one worker holds thousands of them (bench/scale_out.py). Each
``activity.heartbeat()`` costs the worker about 0.1 ms of CPU (the SDK encodes, schedules a task and calls
its core), while the core sends at most one heartbeat per 0.8 × heartbeat timeout anyway: heartbeating on
every 1 s liveness poll made 6,000 watches cost most of a core. The loop heartbeats every half heartbeat
timeout, whatever the poll cadence.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional

from temporalio import activity

SLACK = 0.05  # a sleep may end a little early: a check or heartbeat that is that close to due is due


def heartbeat_every(poll_seconds: float) -> float:
    """Seconds between heartbeats: half the activity's heartbeat timeout (the poll cadence without one)."""
    timeout = activity.info().heartbeat_timeout
    return timeout.total_seconds() / 2 if timeout else poll_seconds


async def watch_until_down(check: Callable[[], Awaitable[Optional[str]]], poll_seconds: float) -> str:
    """Call ``check`` every ``poll_seconds`` until it returns why the instance is down; heartbeat meanwhile."""
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
