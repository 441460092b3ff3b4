"""ReplicaWorkflow: the life of one replica submission.

provision → probes until ready → register with the gateway → watch → on stop (or when the app
exits): unregister, drain, terminate — the teardown is retried until it succeeds, because a
leaked instance costs money every hour.

Task queues: every activity runs on this workflow's own queue, unless PROVISION answers with a
delegation (only when clouds are served by workers of their own, ``worker.py --backends``): then each
delegated backend is tried on its queue in turn, and the instance's later activities (probes, watch,
terminate) go to the queue that provisioned it. The local path schedules exactly what it always did.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Optional

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from models.run import (
        Delegation,
        InstanceRef,
        Placement,
        Provisioned,
        ReadyInput,
        ReplicaInput,
        ReplicaStatus,
        ReplicaUpdate,
        Registration,
    )
    from workflows import names

SA_BACKEND = SearchAttributeKey.for_keyword("DurastackBackend")
SA_STATUS = SearchAttributeKey.for_keyword("DurastackStatus")

# Teardown never gives up: back off to one attempt a minute, forever.
FOREVER = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=1))
SHORT = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                    maximum_attempts=10)


def _reason(error: BaseException) -> str:
    cause = error.cause if isinstance(error, (ActivityError, ChildWorkflowError)) and error.cause else error
    return str(cause.message if isinstance(cause, ApplicationError) else cause) or type(cause).__name__


def _combined(reasons: list[str]) -> str:
    """One ``no offers: …`` / ``all offers failed: …`` message from the delegated backends' own."""
    prefixes = ("no offers: ", "all offers failed: ")
    parts = [next((r[len(p):] for p in prefixes if r.startswith(p)), r) for r in reasons]
    failed = any(r.startswith(prefixes[1]) for r in reasons)
    return ("all offers failed: " if failed else "no offers: ") + "; ".join(parts)


@workflow.defn
class ReplicaWorkflow:
    @workflow.init
    def __init__(self, inp: ReplicaInput) -> None:
        self.inp = inp
        self.stop_reason: Optional[str] = None
        self.status: ReplicaStatus = "submitted"
        self.placement: Optional[Placement] = None
        self.instance: Optional[dict] = None
        self.ready = False
        self.registered = False
        self.queue: Optional[str] = None  # where this instance's activities run; None: this workflow's queue

    @workflow.signal
    def stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason or "stopped"

    @workflow.query
    def state(self) -> ReplicaUpdate:
        return self._update()

    @workflow.run
    async def run(self, inp: ReplicaInput) -> str:
        failure = ""
        try:
            await self._report("provisioning")
            provisioned = await self._provision()
            self.placement, self.instance = provisioned.placement, provisioned.instance
            await self._report("running")
            if self.stop_reason is None:
                failure = await self._until_stopped(self._serve())
        except asyncio.CancelledError:
            # Cancelled from the Web UI or by an operator: tear down, then end as cancelled.
            self.stop_reason = self.stop_reason or "cancelled"
            await self._teardown(self.stop_reason)
            raise
        except (ActivityError, ApplicationError) as e:
            failure = _reason(e)
        await self._teardown(self.stop_reason or failure or "exited")
        return self.stop_reason or failure

    async def _provision(self) -> Provisioned:
        # Not interrupted by stop: a provision in flight must finish so that its instance is torn down.
        provisioned = await self._provision_on(self.inp, None)
        reasons = []
        for d in provisioned.delegate:
            self.queue = d.task_queue  # a failure below is torn down where an instance may have been made
            try:
                return await self._provision_on(self.inp.model_copy(update={"backends": [d.backend]}), d)
            except ActivityError as e:
                if not (isinstance(e.cause, ApplicationError) and e.cause.type == "NoCapacity"):
                    raise
                reasons.append(_reason(e))
        if provisioned.delegate:
            raise ApplicationError(_combined(reasons), type="NoCapacity", non_retryable=True)
        return provisioned

    async def _provision_on(self, inp: ReplicaInput, where: Optional[Delegation]) -> Provisioned:
        return await workflow.execute_activity(
            names.PROVISION, inp, result_type=Provisioned, task_queue=where.task_queue if where else None,
            start_to_close_timeout=timedelta(minutes=30), heartbeat_timeout=self._liveness(), retry_policy=SHORT,
            summary=f"provision {self.inp.job.replica_id}" + (f" on {where.backend}" if where else ""))

    async def _serve(self) -> str:
        ref = self._ref()
        await workflow.execute_activity(
            names.WAIT_READY, ReadyInput(ref=ref, probes=self.inp.probes), task_queue=self.queue,
            start_to_close_timeout=timedelta(minutes=20), heartbeat_timeout=timedelta(seconds=self.inp.heartbeat_seconds),
            retry_policy=SHORT, summary="probes until ready")
        self.ready = True
        await workflow.execute_activity(
            names.REGISTER, self._registration(), start_to_close_timeout=timedelta(seconds=60),
            heartbeat_timeout=self._liveness(),
            retry_policy=SHORT, summary="register with the gateway")
        self.registered = True
        await self._report("running")
        # One heartbeating activity while healthy: no history events until the app exits.
        return await workflow.execute_activity(
            names.WATCH, ref, result_type=str, task_queue=self.queue, start_to_close_timeout=timedelta(days=3650),
            heartbeat_timeout=timedelta(seconds=max(self.inp.heartbeat_seconds, self.inp.watch_heartbeat_seconds)),
            retry_policy=FOREVER, summary="watch")

    async def _until_stopped(self, work) -> str:
        """Run ``work`` until it ends (its result is a failure reason) or a stop is requested."""
        task = asyncio.ensure_future(work)
        try:
            await workflow.wait_condition(lambda: self.stop_reason is not None or task.done())
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return ""
        except (ActivityError, ApplicationError) as e:
            return _reason(e)

    async def _teardown(self, reason: str) -> None:
        failed = self.stop_reason is None
        await self._report("terminating", reason)
        if self.registered:
            await workflow.execute_activity(
                names.UNREGISTER, self._registration(drain=True), start_to_close_timeout=timedelta(
                    seconds=self.inp.stop_duration + 60), heartbeat_timeout=self._liveness(), retry_policy=FOREVER,
                summary="leave the gateway, drain")
            self.registered = False
        await workflow.execute_activity(
            names.TERMINATE, self._ref(), task_queue=self.queue, start_to_close_timeout=timedelta(minutes=10),
            heartbeat_timeout=self._liveness(), retry_policy=FOREVER, summary="terminate")
        await self._report("failed" if failed else "terminated", reason)

    def _liveness(self) -> timedelta:
        """Heartbeat timeout of the short activities too: without one, an attempt lost with its worker
        (SIGKILL) would wait for its start-to-close timeout, minutes (activities/liveness.py)."""
        return timedelta(seconds=self.inp.heartbeat_seconds)

    def _ref(self) -> InstanceRef:
        backend = self.placement.backend if self.placement else "local"
        return InstanceRef(backend=backend, job=self.inp.job, instance=self.instance)

    def _registration(self, drain: bool = False) -> Registration:
        job = self.inp.job
        return Registration(service=job.service, replica_id=job.replica_id, group=job.group,
                            address=self.placement.address if self.placement else "",
                            drain_seconds=self.inp.stop_duration if drain else 0)

    def _update(self, reason: str = "") -> ReplicaUpdate:
        job = self.inp.job
        return ReplicaUpdate(replica_num=job.replica_num, submission_num=job.submission_num, status=self.status,
                             ready=self.ready, registered=self.registered, placement=self.placement, reason=reason)

    async def _report(self, status: ReplicaStatus, reason: str = "") -> None:
        self.status = status
        where = f" on {self.placement.backend} {self.placement.instance_type}" if self.placement else ""
        workflow.set_current_details(f"**{status}**{where} {reason}".strip())
        # Indexed so that the Web UI's list filters replicas by status and backend.
        workflow.upsert_search_attributes([SA_STATUS.value_set(status)] + (
            [SA_BACKEND.value_set(self.placement.backend)] if self.placement else []))
        try:
            await workflow.get_external_workflow_handle(self.inp.service_workflow_id).signal(
                "replica_changed", self._update(reason))
        except Exception as e:  # noqa: BLE001 — the service run is gone: nothing to tell
            workflow.logger.warning("could not report to %s: %s", self.inp.service_workflow_id, e)
