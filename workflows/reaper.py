"""ReaperWorkflow (id ``durastack/reaper``): every few minutes, terminate cloud instances no replica owns, and
stop replica workflows no service run owns (a terminated or reset service's); between those passes, every
``closed_seconds``, a quick one stops the replicas of services whose run closed (terminated from the Web UI).

One long-lived workflow rather than a Schedule: it is started by the worker (``start_workflow`` with
USE_EXISTING, so every worker start is idempotent) and reconfigured by signal, and its pass is one activity per
target queue — the worker holding that cloud's credentials (activities/reaper.py has the rules). A pass that
fails is reported in ``last`` and retried at the next interval; nothing here can stop the loop.
About 10 history events per pass, 6 per quick pass; continue-as-new when the server suggests it.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Awaitable, Callable

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from models.reaper import ReaperInput, ReapRequest, ReapResult, ReapTarget, ReplicaReapResult
    from activities import interface

REAPER_ID = "durastack/reaper"
REAP_REPLICAS = "reap-replicas"  # patch: each pass also stops replica workflows no service run owns
REAP_CLOSED = "reap-closed"  # patch: between passes, a quick one over the replicas of services whose run closed
HISTORY_LIMIT = 5000
# A pass's activity: a few quick tries, then the next pass tries again.
REAP_RETRY = RetryPolicy(initial_interval=timedelta(seconds=5), maximum_attempts=3)


@workflow.defn
class ReaperWorkflow:
    @workflow.init
    def __init__(self, inp: ReaperInput) -> None:
        self.inp = inp
        self.reconfigured = False
        self.results: list[ReapResult] = []
        self.replicas = ReplicaReapResult()

    @workflow.signal
    def configure(self, inp: ReaperInput) -> None:
        """New targets or timings (a worker restarted with another config.yml); applied at once."""
        self.inp, self.reconfigured = inp, True

    @workflow.query
    def last(self) -> list[ReapResult]:
        return self.results

    @workflow.query
    def last_replicas(self) -> ReplicaReapResult:
        return self.replicas

    @workflow.run
    async def run(self, inp: ReaperInput) -> None:
        while True:
            self.reconfigured = False
            self.results = list(await asyncio.gather(*(self._reap(t) for t in self.inp.targets)))
            if self.inp.replicas_queue and workflow.patched(REAP_REPLICAS):
                self.replicas = await self._reap_replicas(interface.reap_replicas, [self.inp.grace_seconds],
                                                          "stop replicas no service run owns")
            await self._until_next_pass()
            info = workflow.info()
            if info.is_continue_as_new_suggested() or info.get_current_history_length() > HISTORY_LIMIT:
                workflow.continue_as_new(self.inp)

    async def _until_next_pass(self) -> None:
        """Wait out the interval (or a reconfiguration); meanwhile, every ``closed_seconds``, the quick pass over the
        replicas of services whose run closed without stopping them: a terminated service's replicas go within
        about that, not an interval and a grace later (a reset's wait for the full pass)."""
        end = workflow.now() + timedelta(seconds=self.inp.interval_seconds)
        quick = bool(self.inp.replicas_queue) and workflow.patched(REAP_CLOSED)
        while (left := (end - workflow.now()).total_seconds()) > 0:
            if not await self._wait(min(left, self.inp.closed_seconds) if quick else left) or not quick \
                    or workflow.now() >= end:
                return
            closed = await self._reap_replicas(interface.reap_closed, [], "stop replicas of closed services")
            if closed.stopped or closed.error:
                self.replicas = closed

    async def _wait(self, seconds: float) -> bool:
        """Whether ``seconds`` went by without a reconfiguration."""
        try:
            await workflow.wait_condition(lambda: self.reconfigured, timeout=timedelta(seconds=seconds))
        except asyncio.TimeoutError:
            return True
        return False

    async def _reap_replicas(self, activity: Callable[..., Awaitable[ReplicaReapResult]], args: list,
                             summary: str) -> ReplicaReapResult:
        try:
            return await workflow.execute_activity(
                activity, args=args,
                task_queue=self.inp.replicas_queue,
                schedule_to_close_timeout=timedelta(seconds=max(60, self.inp.interval_seconds)),
                start_to_close_timeout=timedelta(minutes=10),
                retry_policy=REAP_RETRY, summary=summary)
        except ActivityError as e:
            return ReplicaReapResult(error=str(getattr(e.cause or e, "message", e.cause or e)))

    async def _reap(self, target: ReapTarget) -> ReapResult:
        try:
            return await workflow.execute_activity(
                interface.reap_orphans, ReapRequest(backends=target.backends, grace_seconds=self.inp.grace_seconds),
                task_queue=target.task_queue,
                # Bounded: a target whose worker is gone must not hold up the others' next pass.
                schedule_to_close_timeout=timedelta(seconds=max(60, self.inp.interval_seconds)),
                start_to_close_timeout=timedelta(minutes=10),
                retry_policy=REAP_RETRY,
                summary=f"reap {', '.join(target.backends)}")
        except ActivityError as e:
            cause = e.cause or e
            workflow.logger.warning("reap on %s failed: %s", target.task_queue, cause)
            return ReapResult(task_queue=target.task_queue, error=str(getattr(cause, "message", cause)))
