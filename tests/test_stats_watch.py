"""The stats watchers of one worker process share one gateway read per second, whatever their number."""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.testing import ActivityEnvironment

from activities.stats import SharedRead, StatsActivities
from models.gateway import ServiceStats, StatsReport, StatsWindow
from models.messages import GroupWatch, StatsWatch

SERVICES = [f"svc{n}" for n in range(20)]


def _report(rps: float) -> StatsReport:
    windows = {w: StatsWindow(requests=int(rps * w)) for w in (30, 60, 300)}
    return StatsReport(collected_at=time.time(),
                       services={s: ServiceStats(service=s, windows=windows) for s in SERVICES})


async def test_twenty_watchers_polling_ten_times_a_second_read_the_gateway_once_a_second():
    reads: list[float] = []
    started = time.monotonic()

    async def read() -> StatsReport:
        reads.append(time.monotonic())
        await asyncio.sleep(0.05)  # a read takes a while: the others await it rather than start their own
        # From 2 s on, enough traffic for a second replica of every service: each watcher returns.
        return _report(10.0 if time.monotonic() - started >= 2.0 else 0.0)

    acts = StatsActivities(read)
    watches = [StatsWatch(service=s, poll_seconds=0.1, groups=[
        GroupWatch(name="g", target=5.0, window=30, lo=1, hi=4, wanted=1)]) for s in SERVICES]
    snaps = await asyncio.wait_for(asyncio.gather(*(ActivityEnvironment().run(acts.watch_stats, w)
                                                    for w in watches)), 20)
    assert all(s.rate(30) == pytest.approx(10.0) for s in snaps)
    elapsed = time.monotonic() - started
    # One read per second (and the first at once), not 20 watchers × 10 polls a second.
    assert len(reads) <= elapsed + 2, (len(reads), elapsed)
    assert all(b - a >= 0.95 for a, b in zip(reads, reads[1:])), reads


async def test_a_failed_read_reaches_every_waiter_and_the_next_second_reads_again():
    calls = 0

    async def read() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        if calls == 1:
            raise RuntimeError("gateway down")
        return calls

    shared = SharedRead(read, max_age=0.2)
    first = await asyncio.gather(*(shared() for _ in range(5)), return_exceptions=True)
    assert [type(r) for r in first] == [RuntimeError] * 5 and calls == 1
    await asyncio.sleep(0.25)
    assert await asyncio.gather(*(shared() for _ in range(5))) == [2] * 5


async def test_a_cancelled_watcher_does_not_cancel_the_others_read():
    release = asyncio.Event()

    async def read() -> str:
        await release.wait()
        return "report"

    shared = SharedRead(read)
    first, second = asyncio.ensure_future(shared()), asyncio.ensure_future(shared())
    await asyncio.sleep(0.05)
    first.cancel()
    release.set()
    assert await asyncio.wait_for(second, 5) == "report"
    assert first.cancelled()
