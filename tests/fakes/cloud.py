"""FakeCloud: every activity of a service run, faked and recorded, for the time-skipping workflow tests.

Shared by tests/test_service_workflow.py, tests/test_soak.py and tests/histories/capture.py.

The time-skipping server does not skip time while an activity runs, so for long virtual waits the
watchers *poll* (``polling = True``): each attempt checks once and fails, and the retry is a server
timer. For a month of virtual time the fakes choose that retry's delay (``next_retry_delay``):
``poll_every`` for a replica's watch, and for the stats watcher ``traffic``, the gateway's request rate
as a function of virtual time (read with ``clock``), so it looks again exactly when the rate changes.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta
from typing import AsyncIterator, Awaitable, Callable, Optional

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.worker import Worker

from activities.stats import changed
from models.run import (Event, InstanceRef, Placement, Provisioned, ReadyInput, Registration, ReplicaInput,
                        RouteInput, ServiceRecord, ServiceStatus, StatsSnapshot, StatsWatch)
from workflows import names
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunWorkflow

# The request rate at a virtual time, and when it next changes.
Traffic = Callable[[datetime], tuple[float, datetime]]


class FakeCloud:
    """Fake activities that record every call, in order, so tests can check the lifecycle."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.instances: dict[str, str] = {}  # replica_id → state
        self.routed: set[str] = set()
        self.crash: dict[str, asyncio.Event] = {}
        self.provisions: dict[str, int] = {}
        self.commands: dict[str, list[str]] = {}  # replica_id → what it was provisioned to run
        self.rps: float | None = None  # what the fake gateway reports; None = no stats
        self.polling = False  # watchers check once per attempt (see the module doc)
        self.traffic: Optional[Traffic] = None  # overrides ``rps`` when set; needs ``clock``
        self.poll_every: Optional[timedelta] = None  # a polling replica watch's retry delay (None: its policy's)
        self.clock: Optional[Callable[[], Awaitable[datetime]]] = None  # the server's virtual time
        self.max_alive: dict[str, int] = {}  # most instances of a group alive at once
        self.log_by_seq: dict[int, Event] = {}  # the store's decision log (one service per test)
        self.rows: dict[str, ServiceStatus] = {}  # the store's read model
        self.queue = ""

    @staticmethod
    def _poll_again(message: str, delay: Optional[timedelta]) -> ApplicationError:
        """A failed attempt; the retry comes after ``delay`` (None: the activity's retry policy decides).

        Benign: the worker logs it at debug level, not as a warning with a traceback per poll."""
        return ApplicationError(message, next_retry_delay=delay, category=ApplicationErrorCategory.BENIGN)

    async def _reading(self, watch: StatsWatch) -> tuple[Optional[float], bool, Optional[timedelta]]:
        """The rate now, whether the watcher's ``max_seconds`` are up, and when to look again."""
        if self.traffic is None:
            return self.rps, False, None
        assert self.clock is not None, "traffic needs a clock"
        now = await self.clock()
        rps, until = self.traffic(now)
        # As the real watcher: a snapshot after max_seconds even without a change.
        deadline = activity.info().scheduled_time + timedelta(seconds=watch.max_seconds)
        wait = min(until + timedelta(seconds=1), deadline) - now
        return rps, now >= deadline, max(timedelta(seconds=1), wait)

    def activities(self):
        @activity.defn(name=names.PROVISION)
        async def provision(inp: ReplicaInput) -> Provisioned:
            rid = inp.job.replica_id
            if any("crash" in c for c in inp.job.commands):
                self.log.append(("crash", rid))
                raise ApplicationError("exited (1)", non_retryable=True)
            self.provisions[rid] = self.provisions.get(rid, 0) + 1
            self.commands[rid] = list(inp.job.commands)
            self.instances[rid] = "running"
            self.log.append(("provision", rid))
            group = inp.job.group
            alive = sum(1 for r, st in self.instances.items() if st == "running" and r.split("/")[1] == group)
            self.max_alive[group] = max(self.max_alive.get(group, 0), alive)
            return Provisioned(placement=Placement(backend="local", region="local", address=f"unix:/x/{rid}"),
                               instance={"id": rid})

        @activity.defn(name=names.WAIT_READY)
        async def wait_ready(inp: ReadyInput) -> None:
            self.log.append(("ready", inp.ref.job.replica_id))

        @activity.defn(name=names.REGISTER)
        async def register(reg: Registration) -> None:
            self.routed.add(reg.replica_id)
            self.log.append(("register", reg.replica_id))

        @activity.defn(name=names.UNREGISTER)
        async def unregister(reg: Registration) -> None:
            self.routed.discard(reg.replica_id)
            self.log.append(("unregister", reg.replica_id))

        @activity.defn(name=names.WATCH)
        async def watch(ref: InstanceRef) -> str:
            event = self.crash.setdefault(ref.job.replica_id, asyncio.Event())
            if self.polling and not event.is_set():
                raise self._poll_again("still running; poll again", self.poll_every)
            while not event.is_set():
                activity.heartbeat()
                try:
                    await asyncio.wait_for(event.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
            return "exited (1)"

        @activity.defn(name=names.TERMINATE)
        async def terminate(ref: InstanceRef) -> None:
            self.instances[ref.job.replica_id] = "terminated"
            self.log.append(("terminate", ref.job.replica_id))

        @activity.defn(name=names.ENSURE_ROUTE)
        async def ensure_route(inp: RouteInput) -> None:
            self.log.append(("route", inp.service))

        @activity.defn(name=names.REMOVE_ROUTE)
        async def remove_route(inp: RouteInput) -> None:
            self.log.append(("unroute", inp.service))

        @activity.defn(name=names.WATCH_STATS)
        async def watch_stats(watch: StatsWatch) -> StatsSnapshot:
            while True:
                rps, due, wait = await self._reading(watch)
                if rps is not None:
                    snap = StatsSnapshot(rps={w: rps for w in (30, 60, 300)})
                    if changed(watch, snap) or due:
                        return snap
                if self.polling:
                    raise self._poll_again("no change yet; poll again", wait)
                activity.heartbeat()
                await asyncio.sleep(0.1)

        @activity.defn(name=names.RECORD_SERVICE)
        async def record(rec: ServiceRecord) -> None:
            # Local activities run at least once: the store keys entries by seq.
            self.log_by_seq.update({e.seq: e for e in rec.events})
            self.rows[rec.service] = rec.status

        return [provision, wait_ready, register, unregister, watch, terminate, ensure_route, remove_route,
                watch_stats, record]

    def running(self) -> set[str]:
        return {rid for rid, s in self.instances.items() if s == "running"}


async def fake_cloud_worker(env) -> AsyncIterator[FakeCloud]:
    """A FakeCloud and a worker running both workflows with it, on a task queue of their own."""
    fake = FakeCloud()
    queue = f"tq-{uuid.uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[ServiceRunWorkflow, ReplicaWorkflow],
                      activities=fake.activities()):
        fake.queue = queue
        yield fake
    for event in fake.crash.values():
        event.set()
