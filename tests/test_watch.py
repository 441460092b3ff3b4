"""The watch loop: polls at its backend's cadence, heartbeats only every third of the heartbeat timeout."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Optional

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.watch import watch_until_down


def _env(heartbeat_timeout: Optional[timedelta]) -> tuple[ActivityEnvironment, list]:
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=heartbeat_timeout)
    beats: list = []
    env.on_heartbeat = lambda *details: beats.append(details)
    return env, beats


def _watch(polls: int, poll_seconds: float):
    """A watch whose instance goes down at the ``polls``-th check; returns (activity, checks made)."""
    checks: list[int] = []

    async def down() -> Optional[str]:
        checks.append(1)
        return "exited (3)" if len(checks) >= polls else None

    @activity.defn
    async def watch() -> str:
        return await watch_until_down(down, poll_seconds)

    return watch, checks


async def test_polls_often_but_heartbeats_every_third_of_the_timeout():
    watch, checks = _watch(polls=30, poll_seconds=0.02)
    env, beats = _env(timedelta(seconds=0.6))  # a heartbeat every 0.2 s, a check every 0.02 s
    assert await env.run(watch) == "exited (3)"
    assert len(checks) == 30
    assert 2 <= len(beats) <= 5, beats  # about 0.6 s of watching: not one heartbeat per check


async def test_heartbeats_within_the_timeout_when_polls_are_rarer():
    watch, checks = _watch(polls=2, poll_seconds=0.6)
    env, beats = _env(timedelta(seconds=0.3))  # the poll cadence alone would miss this timeout
    assert await env.run(watch) == "exited (3)"
    assert len(checks) == 2
    assert len(beats) >= 5, beats  # every 0.1 s over the 0.6 s between the two checks


async def test_without_a_heartbeat_timeout_it_heartbeats_at_each_poll():
    watch, checks = _watch(polls=4, poll_seconds=0.01)
    env, beats = _env(None)
    assert await env.run(watch) == "exited (3)"
    assert len(beats) == 3  # the fourth check found it down
