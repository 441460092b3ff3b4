"""Give back the time-skipping locks the Java test server leaks when a child outlives its parent's run.

When a child workflow closes, the test server locks time skipping until the parent has been told
(``process{Complete,Fail,Cancel}WorkflowExecution``: "notify parent", "unlocked by the parent"). A parent
run that has continued-as-new is closed: the notice fails with NOT_FOUND, nobody unlocks, and virtual time
stops for good. durastack's replicas outlive their service's continue-as-new by design
(``ParentClosePolicy.ABANDON``), so a test that skips time across hops hands each such lock back:
``ChildLocks`` watches the children it is told about and, once one has closed after the run that started it
had closed, calls UnlockTimeSkipping once for it.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable, Optional

from temporalio.api.testservice.v1 import UnlockTimeSkippingRequest
from temporalio.client import WorkflowExecutionStatus


class ChildLocks:
    def __init__(self, env, children: Callable[[], Iterable[str]], poll_seconds: float = 0.05) -> None:
        self.env = env
        self.children = children  # workflow ids of children that may have closed
        self.poll_seconds = poll_seconds
        self.seen: set[str] = set()  # closed children, looked at once
        self.given_back: list[str] = []  # the children whose leaked lock was given back
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
                await self.check()
                await asyncio.sleep(self.poll_seconds)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 — surfaced by the test (see ``error``)
            self.error = e

    async def check(self) -> None:
        client = self.env.client
        for wid in sorted(set(self.children()) - self.seen):
            child = await client.get_workflow_handle(wid).describe()
            if child.status == WorkflowExecutionStatus.RUNNING:
                continue
            self.seen.add(wid)
            parent = child.raw_description.workflow_execution_info.parent_execution
            if not parent.run_id:
                continue
            run = await client.get_workflow_handle(parent.workflow_id, run_id=parent.run_id).describe()
            closed_first = run.close_time is not None and child.close_time is not None and \
                run.close_time <= child.close_time
            if run.status != WorkflowExecutionStatus.RUNNING and closed_first:
                await client.test_service.unlock_time_skipping(UnlockTimeSkippingRequest())
                self.given_back.append(wid)
