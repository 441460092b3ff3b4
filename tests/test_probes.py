"""Readiness probes: how soon a probe that has not passed yet runs again."""

from __future__ import annotations

import asyncio

import pytest

from activities import probes
from activities.probes import FIRST_RETRY_SECONDS, ProbeStreaks
from models.service import ProbeSpec


def test_a_probe_is_retried_sooner_until_it_first_passes(monkeypatch):
    answers = iter([False, False, False, True, False, True])
    seen: list[float] = []

    async def run_probe(address, probe):
        return next(answers)

    monkeypatch.setattr(probes, "run_probe", run_probe)
    streaks = ProbeStreaks([ProbeSpec(type="http", interval=15, ready_after=2)])

    async def walk():
        now = 0.0
        while len(seen) < 6:
            await streaks.run_due("unix:/nowhere", now)
            seen.append(streaks.due[0] - now)
            now = streaks.due[0]
        return now

    asyncio.run(walk())
    # 0.1, 0.2, 0.4 s while it fails; the configured interval once it has passed, failing or not.
    assert seen == pytest.approx([FIRST_RETRY_SECONDS, 2 * FIRST_RETRY_SECONDS, 4 * FIRST_RETRY_SECONDS, 15, 15, 15])
    assert streaks.ready() is False and streaks.streaks == [1]


def test_the_retry_never_exceeds_the_interval(monkeypatch):
    async def run_probe(address, probe):
        return False

    monkeypatch.setattr(probes, "run_probe", run_probe)
    streaks = ProbeStreaks([ProbeSpec(type="http", interval=1)])
    gaps = []
    now = 0.0
    for _ in range(8):
        asyncio.run(streaks.run_due("unix:/nowhere", now))
        gaps.append(streaks.due[0] - now)
        now = streaks.due[0]
    assert max(gaps) == pytest.approx(1) and gaps[:5] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1])
