"""Give back the time-skipping locks the Java test server leaks when a child outlives its parent's run.

When a child workflow closes, the test server locks time skipping until the parent has been told
(``process{Complete,Fail,Cancel}WorkflowExecution``: "notify parent", "unlocked by the parent"). A parent
run that has continued-as-new is closed: the notice fails with NOT_FOUND, nobody unlocks, and virtual time
stops for good. durastack's replicas outlive their service's continue-as-new by design
(``ParentClosePolicy.ABANDON``), so a test that skips time across hops hands each such lock back:
``ChildLocks`` watches the children it is told about and, once one has closed after the run that started it
had closed, calls UnlockTimeSkipping once for it.

The same leak follows a run the test server half-closed (``check_half_closed``): its lock, and those of
the children it started, are given back too.

``sleep_watched`` skips long stretches of virtual time that take long in wall time too.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Awaitable, Callable, Iterable, Optional

from temporalio.api.filter.v1 import WorkflowExecutionFilter
from temporalio.api.testservice.v1 import SleepRequest, UnlockTimeSkippingRequest
from temporalio.api.workflowservice.v1 import ListOpenWorkflowExecutionsRequest
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

HALF_CLOSED_GRACE = 2.0  # seconds a superseded run must stay listed open to count as half-closed
# More locks ``unstick`` may give back per half-closed run. CI once spent 3 and stayed stuck (day 25 of the soak,
# after an "invalid history builder state for action" from the test server). Each is given only after a 30 s stall,
# and the server refuses an unlock when nothing is locked.
HALF_CLOSED_EXTRA = 8
# Locks ``unstick`` may give back when no half-closed run explains a stall. CI once stalled for good right after a
# service's continue-as-new, both new watchers' second attempts listed as started, no run half-closed and no
# workflow task pending. A lock still held after a 30 s stall in a test whose activities poll is leaked.
STALL_EXTRA = 4


class ChildLocks:
    def __init__(self, env, children: Callable[[], Iterable[str]], parents: Iterable[str] = (),
                 poll_seconds: float = 0.05) -> None:
        self.env = env
        self.children = children  # workflow ids of children that may have closed
        self.parents = list(parents)  # workflow ids of the parents, which continue-as-new
        self.poll_seconds = poll_seconds
        self.seen: set[str] = set()  # closed children, looked at once
        self.given_back: list[str] = []  # whose leaked lock was given back: children, and half-closed runs
        self.half_closed: dict[str, float] = {}  # run id → when it was first seen half-closed (monotonic)
        self.extra = 0  # locks given back by ``unstick``
        self.error: Optional[BaseException] = None
        self._task: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "ChildLocks":
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass

    async def _run(self) -> None:
        try:
            while True:
                try:
                    await self.check_half_closed()
                    await self.check()
                except RPCError as e:  # the test server's listing races its own writes (ConcurrentModification…)
                    print(f"ChildLocks: look again after {e!r}", flush=True)
                await asyncio.sleep(self.poll_seconds)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 — surfaced by the test (see ``error``)
            self.error = e
            print(f"ChildLocks stopped: {e!r}", flush=True)  # virtual time may stall from here on

    async def check(self) -> None:
        client = self.env.client
        for wid in sorted(set(self.children()) - self.seen):
            child = await client.get_workflow_handle(wid).describe()
            if child.status == WorkflowExecutionStatus.RUNNING:
                continue
            parent = child.raw_description.workflow_execution_info.parent_execution
            if not parent.run_id:
                self.seen.add(wid)
                continue
            run = await client.get_workflow_handle(parent.workflow_id, run_id=parent.run_id).describe()
            if run.status == WorkflowExecutionStatus.RUNNING:
                # Closed all the same if a newer run exists (a half-closed run, see check_half_closed).
                closed_first = await self._latest_run(parent.workflow_id) != parent.run_id
            elif run.close_time is None:  # half-closed: it has no close time, its children all closed after it
                closed_first = True
            else:
                closed_first = run.close_time is not None and child.close_time is not None and \
                    run.close_time <= child.close_time
            self.seen.add(wid)  # looked at once, after every call that may fail (then: again next time)
            if closed_first:
                await client.test_service.unlock_time_skipping(UnlockTimeSkippingRequest())
                self.given_back.append(wid)

    async def check_half_closed(self) -> None:
        """A run whose continue-as-new raced a signal: the test server starts the new run and answers the old
        run's worker "workflow execution already completed", yet keeps the old run listed open, with the
        workflow task it never completed holding a lock. Once such a run has stayed so for HALF_CLOSED_GRACE
        (not the instant of a regular hop), its lock is given back once."""
        client = self.env.client
        for wid in self.parents:
            latest = await self._latest_run(wid)
            listed = await client.workflow_service.list_open_workflow_executions(ListOpenWorkflowExecutionsRequest(
                namespace=client.namespace, maximum_page_size=100,
                execution_filter=WorkflowExecutionFilter(workflow_id=wid)))
            for e in listed.executions:
                rid = e.execution.run_id
                if rid == latest or f"{wid} run {rid}" in self.given_back:
                    continue
                first = self.half_closed.setdefault(rid, time.monotonic())
                if time.monotonic() - first >= HALF_CLOSED_GRACE:
                    await client.test_service.unlock_time_skipping(UnlockTimeSkippingRequest())
                    self.given_back.append(f"{wid} run {rid}")
                    print(f"ChildLocks: gave back the lock of half-closed run {rid} of {wid}", flush=True)

    async def unstick(self) -> bool:
        """Virtual time stopped: besides a half-closed run's workflow task lock, others its failed completion would
        have released stay taken (seen: one more; the server does not say whose), and a stall was once seen with no
        half-closed run at all. Give back one more, at most HALF_CLOSED_EXTRA per half-closed run and STALL_EXTRA
        besides; False when there is none to give."""
        budget = HALF_CLOSED_EXTRA * sum(1 for g in self.given_back if " run " in g) + STALL_EXTRA
        if self.extra >= budget:
            return False
        self.extra += 1
        try:
            await self.env.client.test_service.unlock_time_skipping(UnlockTimeSkippingRequest())
        except RPCError as e:  # nothing was locked after all ("Unbalanced lock and unlock calls")
            print(f"ChildLocks: no lock to give back: {e}", flush=True)
            return False
        self.given_back.append(f"extra lock {self.extra}")
        print(f"ChildLocks: gave back extra lock {self.extra} after a stall", flush=True)
        return True

    async def _latest_run(self, workflow_id: str) -> str:
        return (await self.env.client.get_workflow_handle(workflow_id).describe()).run_id


async def describe_open(env, workflow_ids: Iterable[str]) -> str:
    """What the open ones of these workflows wait on: pending activities (attempt, next retry), children.

    Printed by a test whose virtual time stopped, to find which lock the test server kept."""
    client, lines = env.client, [f"virtual time {await env.get_current_time()}"]
    for wid in workflow_ids:
        d = await client.get_workflow_handle(wid).describe()
        if d.status != WorkflowExecutionStatus.RUNNING:
            continue
        raw = d.raw_description
        lines.append(f"{wid} run {d.run_id[:8]} started {d.start_time}")
        for a in raw.pending_activities:
            lines.append(f"  activity {a.activity_type.name} id={a.activity_id} state={a.state} attempt={a.attempt} "
                         f"scheduled={a.scheduled_time.ToDatetime()} "
                         f"next={_next_attempt(a)} "
                         f"last_failure={a.last_failure.message[:60]!r}")
        for c in raw.pending_children:
            lines.append(f"  child {c.workflow_id} run {c.run_id[:8]}")
        if raw.HasField("pending_workflow_task"):
            t = raw.pending_workflow_task
            lines.append(f"  workflow task state={t.state} scheduled={t.scheduled_time.ToDatetime()} "
                         f"attempt={t.attempt}")
    return "\n".join(lines)



def _next_attempt(a):
    return a.next_attempt_schedule_time.ToDatetime() if a.HasField("next_attempt_schedule_time") else None


async def sleep_watched(env, duration: timedelta, workflow_ids: Callable[[], Iterable[str]],
                        on_stall: Optional[Callable[[], Awaitable[bool]]] = None, stall_seconds: float = 30,
                        rpc_timeout: timedelta = timedelta(minutes=20)) -> None:
    """``env.sleep`` that may take long in wall time, and says so when virtual time stops skipping.

    ``env.sleep`` is one RPC with the client's default timeout (30 s): a long virtual sleep full of
    activity attempts (each skips no time while it runs) outlasts it on a busy machine, and the sleep fails
    with "Timeout expired". Here the RPC gets ``rpc_timeout``, and whenever virtual time has moved no faster
    than wall time for ``stall_seconds`` (a lock is held: time runs, but is not skipped), what the open
    workflows wait on is printed, and ``on_stall`` called (e.g. ``ChildLocks.unstick``)."""
    req = SleepRequest()
    req.duration.FromTimedelta(duration)
    task = asyncio.ensure_future(env.client.test_service.unlock_time_skipping_with_sleep(req, timeout=rpc_timeout))
    last = await env.get_current_time()
    while True:
        done, _ = await asyncio.wait({task}, timeout=stall_seconds)
        if done:
            task.result()
            return
        now = await env.get_current_time()
        if now - last <= timedelta(seconds=2 * stall_seconds):
            print(f"virtual time moved {now - last} in {stall_seconds} s:\n"
                  f"{await describe_open(env, workflow_ids())}", flush=True)
            if on_stall is not None:
                await on_stall()
        last = now
