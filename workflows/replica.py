"""ReplicaWorkflow: the life of one replica submission.

launch → wait for a stop → teardown (leave the gateway, drain, terminate; retried until it succeeds,
because a leaked instance costs money every hour). The launch is three activities on the task queue of
the backend it tries, each with its own budget: place (an instance, booted), start (its image pulled,
its commands running), ready (probes until they pass, then the gateway); a step that ends at once goes on
with the next in the same activity (a local replica's launch is one).

A healthy replica costs its workflow nothing: no watch activity, no timers. The service's monitor
watches every serving replica and asks this workflow to stop when its process, container or instance
dies. Reports to the service come from the activities, fire-and-forget, each with the sequence number
of its lifecycle step, so this history holds about ten events until a local replica serves, about thirty
for a cloud one, however long it loads.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Optional

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import (ActivityError, ApplicationError, RetryState, TimeoutError as ActivityTimeout,
                                   TimeoutType)
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.failures import NO_CAPACITY_ERROR, NOT_READY_YET, FailureKind, not_ready_within
    from models.messages import (READY_ATTEMPT_SECONDS, Launched, LaunchInput, LaunchStep, PlacementRefusal, Release,
        ReplicaInput, ReplicaUpdate, Step, StopRequest, TeardownInput)
    from models.router import Instance
    from models.state import Placement, ReplicaStatus
    from rules.names import REPLICA_CHANGED, backend_queue
    from workflows.attributes import SA_BACKEND, SA_STATUS

# A cancelled replica's launch is cancelled and waited for before its teardown; runs recorded before it tore down
# beside a launch that went on.
CANCEL_LAUNCH_FIRST = "cancel-launch-first"
# Serving is told durably too, once the launch returned: the launch's own report is fire-and-forget, and a lost one
# left a routed replica "submitted", unwatched and never replaced.
DURABLE_SERVING = "durable-serving"
# A launch no worker ever took made nothing: its backend is not torn down (no worker would take that either, and the
# replica's end waited for it for ever). Runs recorded before it scheduled that teardown.
UNTAKEN_MADE_NOTHING = "untaken-made-nothing"
# Asked only by a replica asked to keep its instance idle (`idle_duration`): its teardown keeps it, and the workflow
# stays open, owning it, until the service releases it. No run recorded before it was ever asked to.
KEEP_IDLE = "keep-idle"
# A kept instance whose service never releases it (the service is gone) is terminated this long after its idle
# time, unless another replica runs on it by then.
IDLE_GRACE = timedelta(minutes=10)

# The launch in three steps, each its own activity and budget, so that a retry resumes at the step that failed, on
# the same instance, with its image and whatever it loaded. Runs recorded before it made one activity of all three.
LAUNCH_IN_STEPS = "launch-in-steps"
# The place step: an instance, and its boot (Docker, the GPU runtime, SSH). The single launch of older runs: this
# plus the group's `startup_timeout`.
BOOT_BUDGET = timedelta(minutes=30)
# The start step: its image pull (tens of GB for an inference image) and its commands.
PULL_BUDGET = timedelta(minutes=60)
# The ready step polls by retrying: each attempt probes for a minute (READY_ATTEMPT_SECONDS) and fails retryably
# until the replica is ready, within the group's `startup_timeout`. A retry is no history event.
READY_POLL = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=1.0,
                         maximum_interval=timedelta(seconds=1))
# Teardown never gives up: back off to one attempt a minute, forever.
FOREVER = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(minutes=1))
SHORT = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=30),
                    maximum_attempts=10)


def reason_of(error: BaseException) -> str:
    cause = error.cause if isinstance(error, ActivityError) and error.cause else error
    return str(cause.message if isinstance(cause, ApplicationError) else cause) or type(cause).__name__


def no_capacity_reason(refusals: list[PlacementRefusal]) -> str:
    """Why no backend placed the replica, as `ps` and `events` show it: "all offers failed: …" once some backend
    tried offers and each failed (the user may retry later), else "no offers: …" (nothing fits: the spec must
    change); each backend's reasons in the order the backends were tried."""
    if not refusals:
        return FailureKind.NO_BACKEND.value
    head = FailureKind.ALL_OFFERS_FAILED if any(r.tried for r in refusals) else FailureKind.NO_OFFERS
    return f"{head}: " + "; ".join("; ".join(r.reasons) or f"{r.backend}: no capacity" for r in refusals)


def unserved(error: ActivityError, backend: str, queue: str, seconds: int) -> Optional[PlacementRefusal]:
    """A launch no worker took in time (its schedule-to-start timeout: a cloud worker that is not running, a queue
    name that differs): that backend is given up, with why, and the next one tried, not waited on for ever."""
    if no_worker_took(error):
        return PlacementRefusal(backend=backend, tried=True, reasons=[
            f"{backend}: no worker took the launch within {seconds} s (is a worker serving {queue} running?)"])
    return None


def no_worker_took(error: ActivityError) -> bool:
    """Whether the activity timed out waiting for a worker (its schedule-to-start timeout)."""
    cause = error.cause
    return isinstance(cause, ActivityTimeout) and cause.type == TimeoutType.SCHEDULE_TO_START


def never_taken(error: ActivityError) -> bool:
    """Whether no attempt of the activity ever ran: no worker took it, and no earlier attempt failed (Temporal
    keeps an earlier attempt's failure as the timeout's cause)."""
    return no_worker_took(error) and error.cause.cause is None


def refusal_of(error: ActivityError) -> Optional[PlacementRefusal]:
    """The typed details of a backend that could not place the replica; None for any other failure."""
    cause = error.cause
    if isinstance(cause, ApplicationError) and cause.type == NO_CAPACITY_ERROR and cause.details:
        return PlacementRefusal.model_validate(cause.details[0])
    return None


@workflow.defn
class ReplicaWorkflow:
    @workflow.init
    def __init__(self, inp: ReplicaInput) -> None:
        self.inp = inp
        self.stop_request: Optional[StopRequest] = None
        self.launched: Optional[Launched] = None
        self.tried: list[str] = []  # backends a launch ran on: each may hold something to tear down
        self.released: Optional[Release] = None  # its idle instance's end, from the service
        self.stopped_again = False  # a stop while its instance is idle (the reaper's): terminate it

    @workflow.query
    def placement(self) -> Optional[Placement]:
        """Where the replica runs once its launch returned; None before. The reaper spares only that instance of
        the ones tagged for this replica (any other is a duplicate a lost launch attempt made)."""
        return self.launched.placement if self.launched else None

    @workflow.signal
    def stop(self, request: StopRequest) -> None:
        if self.stop_request is None:
            self.stop_request = request
        else:
            self.stopped_again = True

    @workflow.signal
    def release(self, release: Release) -> None:
        """Its idle instance's time is over (``Release``)."""
        if self.released is None:
            self.released = release

    @workflow.run
    async def run(self, inp: ReplicaInput) -> str:
        try:
            failure = await self._until_stopped(self._launch())
        except asyncio.CancelledError:
            # Cancelled from the Web UI or by an operator: tear down, then end as cancelled.
            await self._teardown(StopRequest(reason="cancelled"))
            raise
        await self._teardown(self.stop_request or StopRequest(reason=failure, failed=True))
        return (self.stop_request or StopRequest(reason=failure)).reason

    async def _launch(self) -> str:
        """Each backend in turn until one places the replica; '' once it serves, else why it failed."""
        refusals: list[PlacementRefusal] = []
        for backend in self.inp.launch_on:
            self.tried.append(backend)
            queue = backend_queue(workflow.info().task_queue, backend)
            try:
                if workflow.patched(LAUNCH_IN_STEPS):
                    failure = await self._steps(backend, queue)
                    if failure:
                        return failure
                else:
                    self.launched = await workflow.execute_activity(
                        interface.launch_replica, LaunchInput(replica=self.inp, backend=backend), task_queue=queue,
                        schedule_to_start_timeout=timedelta(seconds=self.inp.unserved_seconds),
                        start_to_close_timeout=BOOT_BUDGET + timedelta(seconds=self.inp.startup_timeout),
                        heartbeat_timeout=self._heartbeat(), retry_policy=SHORT,
                        cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                        summary=f"launch on {backend}")
                if workflow.patched(DURABLE_SERVING):
                    await self._report_serving(self.launched)
                return ""
            except ActivityError as e:
                details = refusal_of(e) or unserved(e, backend, queue, self.inp.unserved_seconds)
                if details is None:
                    return reason_of(e)
                if never_taken(e) and workflow.patched(UNTAKEN_MADE_NOTHING):
                    self.tried.remove(backend)
                refusals.append(details)
        return no_capacity_reason(refusals)

    async def _steps(self, backend: str, queue: str) -> str:
        """Place, start, wait until ready, on ``backend``; '' once it serves, else why not. Once placed, its
        instance is known (to the teardown, and to the reaper through ``placement``)."""
        options = dict(task_queue=queue, heartbeat_timeout=self._heartbeat(),
                       cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED)
        self.launched = await workflow.execute_activity(
            interface.place_replica, LaunchInput(replica=self.inp, backend=backend),
            schedule_to_start_timeout=timedelta(seconds=self.inp.unserved_seconds), start_to_close_timeout=BOOT_BUDGET,
            retry_policy=SHORT, summary=f"place on {backend}", **options)
        if self.launched.done == "placed":
            self.launched = await workflow.execute_activity(
                interface.start_replica, LaunchStep(replica=self.inp, backend=backend, launched=self.launched),
                start_to_close_timeout=PULL_BUDGET, retry_policy=SHORT, summary="pull the image, start", **options)
        if self.launched.done == "serving":
            return ""
        try:
            await workflow.execute_activity(
                interface.await_ready, LaunchStep(replica=self.inp, backend=backend, launched=self.launched),
                schedule_to_close_timeout=timedelta(seconds=self.inp.startup_timeout),
                start_to_close_timeout=self._ready_attempt(), retry_policy=READY_POLL, summary="until ready", **options)
        except ActivityError as e:
            if e.retry_state != RetryState.TIMEOUT:  # e.g. it exited: the failure says why
                raise
            # Out of time between two attempts (the last one's failure is the cause) or during one (the timeout's).
            last = e.cause.cause if isinstance(e.cause, ActivityTimeout) else e.cause
            said = last.message if isinstance(last, ApplicationError) and last.type != NOT_READY_YET else ""
            return not_ready_within(self.inp.startup_timeout, *([said] if said else []))
        self.launched = self.launched.model_copy(update={"done": "serving"})
        return ""

    def _ready_attempt(self) -> timedelta:
        """One readiness attempt's limit: its minute of probes, and a probe's whole streak under way at its end."""
        streak = max((p.ready_after * (p.interval + p.timeout) for p in self.inp.probes), default=0)
        return timedelta(seconds=READY_ATTEMPT_SECONDS + streak + 60)

    async def _until_stopped(self, launch) -> str:
        """Launch, then wait for a stop; a stop during the launch cancels it (and waits for that)."""
        task = asyncio.ensure_future(launch)
        try:
            await workflow.wait_condition(lambda: self.stop_request is not None or task.done())
        except asyncio.CancelledError:  # the workflow itself is cancelled: its teardown follows once the launch ended
            if workflow.patched(CANCEL_LAUNCH_FIRST):
                await self._end(task)
            raise
        if not task.done():
            await self._end(task)
            return ""
        failure = task.result()
        if not failure:
            await workflow.wait_condition(lambda: self.stop_request is not None)
        return failure

    @staticmethod
    async def _end(launch: asyncio.Future) -> None:
        """Cancel the launch and wait until it has stopped (its activity waits for the cancellation to complete):
        the teardown then finds whatever it made, and nothing is made after the teardown looked."""
        launch.cancel()
        try:
            await launch
        except (asyncio.CancelledError, ActivityError):
            pass

    async def _teardown(self, request: StopRequest) -> None:
        instance: Optional[Instance] = self.launched.instance if self.launched else None
        where = [self.launched.placement.backend] if self.launched else self.tried
        final: ReplicaStatus = "failed" if request.failed else "terminated"
        told = kept = False
        keep = self._may_keep(request)
        for backend in where:
            inp = TeardownInput(service_workflow_id=self.inp.service_workflow_id, job=self.inp.job, backend=backend,
                                instance=instance, drain_seconds=0 if request.failed else self.inp.stop_duration,
                                reason=request.reason, final=final, router=request.router, keep=keep)
            try:
                kept = await self._teardown_on(backend, inp, timedelta(seconds=self.inp.unserved_seconds))
            except ActivityError as e:
                if not no_worker_took(e):
                    raise
                # No worker of that backend takes it (its launch may have been waiting for one too): the service
                # hears of the end now, not when that worker comes back, and the teardown waits for it.
                await self._report_end(final, request.reason)
                told = True
                kept = await self._teardown_on(backend, inp, None)
        # Indexed once, at the end, so that the Web UI's list filters replicas by outcome and backend.
        workflow.upsert_search_attributes([SA_STATUS.value_set(final)] + (
            [SA_BACKEND.value_set(self.launched.placement.backend)] if self.launched else []))
        if not told:
            await self._report_end(final, request.reason, instance if kept else None)
        if kept:
            await self._idle(request, inp)

    def _may_keep(self, request: StopRequest) -> bool:
        """Whether its teardown may keep its instance idle: asked to (a scale-down or rolling replacement under
        `idle_duration`), and placed (what is not placed is found and terminated by its tags)."""
        return bool(request.idle_seconds and not request.failed and self.launched) and workflow.patched(KEEP_IDLE)

    async def _idle(self, request: StopRequest, inp: TeardownInput) -> None:
        """Own the idle instance until the service releases it: taken by another replica (or terminated by the
        service), nothing to do; else terminate it, unless its tags name another replica by now. Without word from
        the service (it is gone) it goes after its idle time; a stop meanwhile (the reaper's) ends it at once."""
        try:
            await workflow.wait_condition(lambda: self.released is not None or self.stopped_again,
                                          timeout=timedelta(seconds=request.idle_seconds) + IDLE_GRACE,
                                          timeout_summary="idle until released")
        except asyncio.TimeoutError:
            pass
        except asyncio.CancelledError:  # cancelled from the Web UI: its instance goes with it
            await self._terminate_idle(inp)
            raise
        if self.released is None or self.released.terminate:
            await self._terminate_idle(inp)

    async def _terminate_idle(self, inp: TeardownInput) -> None:
        await self._teardown_on(inp.backend, inp.model_copy(update={"keep": False, "idle": True, "drain_seconds": 0,
                                                                    "router": None}), None)

    async def _teardown_on(self, backend: str, inp: TeardownInput, unserved_after: Optional[timedelta]) -> bool:
        """Whether it kept the instance idle (asked to with ``keep``, and its backend can)."""
        return bool(await workflow.execute_activity(
            interface.teardown_replica, inp, task_queue=backend_queue(workflow.info().task_queue, backend),
            schedule_to_start_timeout=unserved_after,
            start_to_close_timeout=timedelta(seconds=self.inp.stop_duration + 600),
            heartbeat_timeout=self._heartbeat(), retry_policy=FOREVER,
            summary="leave the gateway, keep the instance idle" if inp.keep else "leave the gateway, terminate"))

    async def _report_serving(self, launched: Launched) -> None:
        """The launch's own `serving` report, again, durably (the same step number: the second one is dropped)."""
        job = self.inp.job
        await self._tell(ReplicaUpdate(replica_num=job.replica_num, submission_num=job.submission_num,
                                       status="running", ready=True, registered=self.inp.route, seq=Step.SERVING,
                                       placement=launched.placement, instance=launched.instance, refs=launched.refs))

    async def _tell(self, update: ReplicaUpdate) -> None:
        try:
            await workflow.get_external_workflow_handle(self.inp.service_workflow_id).signal(REPLICA_CHANGED, update)
        except Exception as e:  # noqa: BLE001 — the service run is gone: nobody to tell
            workflow.logger.info("report to %s not delivered: %s", self.inp.service_workflow_id, e)

    async def _report_end(self, final: ReplicaStatus, reason: str, idle: Optional[Instance] = None) -> None:
        """The end, told durably: the teardown's own report is fire-and-forget, and a service that missed it
        would wait for this replica for ever (its stop waits for every replica to finish). The same step
        number: whichever arrives second is dropped. ``idle``: the instance it kept idle."""
        job = self.inp.job
        await self._tell(ReplicaUpdate(replica_num=job.replica_num, submission_num=job.submission_num, status=final,
                                       seq=Step.FINISHED, reason=reason, instance=idle, idle=idle is not None))

    def _heartbeat(self) -> timedelta:
        """Without a heartbeat timeout, an attempt lost with its worker (SIGKILL) waits for its
        start-to-close timeout, minutes (activities/liveness.py)."""
        return timedelta(seconds=self.inp.heartbeat_seconds)
