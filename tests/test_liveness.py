"""keeps_alive: an activity waiting on one slow call heartbeats, so a dead worker's attempt is retried soon."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.liveness import keeps_alive


def _env(heartbeat_timeout: timedelta | None) -> tuple[ActivityEnvironment, list]:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=heartbeat_timeout)
    beats: list = []
    env.on_heartbeat = lambda *details: beats.append(details)
    return env, beats


async def test_heartbeats_while_a_slow_call_runs_and_returns_its_result():
    release = threading.Event()

    @activity.defn
    @keeps_alive
    async def slow(x: int) -> int:
        await asyncio.to_thread(release.wait, 30)  # a blocking call, as local.stop or a cloud call
        return x * 2

    env, beats = _env(timedelta(seconds=0.2))
    run = asyncio.ensure_future(env.run(slow, 21))
    deadline = asyncio.get_running_loop().time() + 20
    while len(beats) < 3 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    assert len(beats) >= 3  # one every third of the heartbeat timeout
    release.set()
    assert await run == 42


async def test_heartbeats_leave_two_thirds_of_the_timeout_to_spare():
    """Two heartbeats may be late or lost before the timeout takes a live worker for dead."""
    release = threading.Event()

    @activity.defn
    @keeps_alive
    async def slow() -> None:
        await asyncio.to_thread(release.wait, 30)

    env, _ = _env(timedelta(seconds=1.2))
    times: list[float] = []
    env.on_heartbeat = lambda *details: times.append(time.monotonic())
    run = asyncio.ensure_future(env.run(slow))
    deadline = time.monotonic() + 20
    while len(times) < 4 and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    release.set()
    await run
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert len(gaps) >= 3 and gaps[len(gaps) // 2] < 0.5, gaps  # every 0.4 s; every half timeout would be 0.6 s


async def test_no_heartbeats_without_a_heartbeat_timeout_and_errors_pass_through():
    @activity.defn
    @keeps_alive
    async def fails() -> None:
        await asyncio.sleep(0.1)
        raise ValueError("boom")

    env, beats = _env(None)
    with pytest.raises(ValueError, match="boom"):
        await env.run(fails)
    assert beats == []
