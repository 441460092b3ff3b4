"""A service's replica workflows: start one, ask one to stop, and tear down after one that is gone."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import exceptions, workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes
from temporalio.workflow import ChildWorkflowHandle, ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.failures import FailureKind
    from models.messages import Down, Release, ReplicaInput, ReplicaUpdate, Step, StopRequest, TeardownInput
    from models.state import IdleInstance, Replica, ServiceState
    from rules import idle, lifecycle
    from rules.jobs import job_spec, placement_key, replica_input, replica_workflow_id
    from rules.names import backend_queue
    from workflows.attributes import SA_GROUP, SA_SERVICE
    from workflows.replica import ReplicaWorkflow

TEARDOWN_RETRY = RetryPolicy(maximum_interval=timedelta(minutes=1))  # never gives up: a leak costs money
# Patch (CONTRIBUTING.md): a replica whose workflow id is taken starts as its next submission; before, it failed.
NEXT_SUBMISSION = "next-submission"
TAKEN_IDS = 5  # submissions tried in a row before the replica fails (each taken id is a workflow left running)


class Children:
    def __init__(self, state: ServiceState, heartbeat_seconds: int, unserved_seconds: int) -> None:
        self.state, self.heartbeat_seconds, self.unserved_seconds = state, heartbeat_seconds, unserved_seconds
        self.handles: dict[tuple[int, int], ChildWorkflowHandle] = {}  # this run's children, until they close
        # Whether closed children are noticed and torn down even before they were placed (patch watch-children,
        # set by the service's run: runs recorded before it never did).
        self.watch = False

    async def start(self, replica: Replica) -> list[lifecycle.Note]:
        """Start the replica's workflow; one that cannot start fails at once (and counts as a failure). An id still
        held by a workflow of an earlier run of this name (a service stopped and applied again at once, whose
        replicas' workflows were a task away from closing; a reset's or a terminated run's orphan) is no failure:
        that workflow is asked to stop, and the replica takes the next submission."""
        state, inp = self.state, self._input(replica)
        if state.config.idle_duration:  # its instance may be kept idle when it stops, and it may start on one
            replica.placement_key = placement_key(inp)
            replica.reuse = idle.take(state, replica.group, replica.placement_key, workflow.now())
            if replica.reuse is not None:  # its backend first: the others would place it anew
                inp.reuse = replica.reuse.instance
                inp.launch_on.sort(key=lambda backend: backend != replica.reuse.backend)
        if not inp.launch_on:  # the service names only backends this deployment has no configuration for
            return self._failed(replica, f"{FailureKind.NO_OFFERS}: backend {', '.join(inp.backends or [])} is not configured "
                                         f"($DURASTACK_HOME/config.yml; this deployment serves "
                                         f"{', '.join(state.backends) or 'none'})")
        for _ in range(TAKEN_IDS):
            try:
                self.handles[replica.key] = await workflow.start_child_workflow(
                    ReplicaWorkflow.run, inp, id=self._id(replica), parent_close_policy=ParentClosePolicy.ABANDON,
                    static_summary=f"**{state.name}** group={replica.group} replica={replica.replica_num}",
                    search_attributes=TypedSearchAttributes([SearchAttributePair(SA_SERVICE, state.name),
                                                             SearchAttributePair(SA_GROUP, replica.group)]))
                return []
            except exceptions.WorkflowAlreadyStartedError as e:
                if not workflow.patched(NEXT_SUBMISSION):
                    return self._failed(replica, f"could not start: {e}")
                await self._supersede(self._id(replica))
                replica.submission_num += 1
                inp = self._input(replica).model_copy(update={"reuse": inp.reuse})
            except Exception as e:  # noqa: BLE001 — the child could not start
                return self._failed(replica, f"could not start: {e}")
        return self._failed(replica, f"could not start: {TAKEN_IDS} workflow ids in a row are taken, up to "
                                     f"{self._id(replica)}")

    @staticmethod
    async def _supersede(workflow_id: str) -> None:
        """Stop the replica workflow that holds an id this run starts: no run of the service owns it any more (this
        one knows every replica it started), so it would only serve beside its slot's new submission."""
        workflow.logger.info("%s is taken: stopped, the replica starts as the next submission", workflow_id)
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal(ReplicaWorkflow.stop, StopRequest(
                reason="superseded: the service's current run started its slot again"))
        except Exception as e:  # noqa: BLE001 — it closed meanwhile
            workflow.logger.info("stop of %s not delivered: %s", workflow_id, e)

    def _input(self, replica: Replica) -> ReplicaInput:
        state = self.state
        inp = replica_input(state.config, state.name, workflow.info().workflow_id, replica.group,
                            replica.replica_num, replica.submission_num, replica.deployment_num, replica.refs)
        inp.heartbeat_seconds, inp.unserved_seconds = self.heartbeat_seconds, self.unserved_seconds
        inp.launch_on = self._launch_on()
        # One place: where the service's first replica landed, or, for the first, a place `apply` found for all.
        places = [state.place] if state.place else state.places if state.one_place else []
        if places:
            where = [p.split("/", 1) for p in places]
            inp.launch_on = [b for b in dict.fromkeys(backend for backend, _ in where) if b in inp.launch_on]
            inp.regions = list(dict.fromkeys(region for _, region in where))  # region names are each cloud's own
        return inp

    def closed(self) -> list[Down]:
        """Replicas whose workflow closed before they finished (terminated from the Web UI, failed), serving or not:
        their workflow tore nothing down. Only this run's children; after a continue-as-new the monitor still
        finds those that serve."""
        downs: list[Down] = []
        for key, handle in list(self.handles.items()):
            if not handle.done():
                continue
            del self.handles[key]  # also in runs without the patch: they would keep every child's handle
            failure = handle.exception() if not handle.cancelled() else None
            if self.watch and not self._finished(key) and failure is not None:
                downs.append(Down(replica_num=key[0], submission_num=key[1], workflow_closed=True,
                                  reason=f"replica workflow {_closed_how(failure)}"))
        return downs

    def any_closed(self) -> bool:
        """Whether :meth:`closed` has news (a child that ended after its replica finished is none)."""
        return self.watch and any(handle.done() and not self._finished(key) for key, handle in self.handles.items())

    def _finished(self, key: tuple[int, int]) -> bool:
        replica = self.state.find(*key)
        return replica is None or replica.finished

    def _launch_on(self) -> list[str]:
        """The backends a replica may be launched on: this deployment's, narrowed by the service's `backends`."""
        wanted = self.state.config.backends
        return [b for b in self.state.backends if not wanted or b in wanted]

    def _failed(self, replica: Replica, reason: str) -> list[lifecycle.Note]:
        """A replica that never got a workflow: failed at once, counted as a failure like any other."""
        return lifecycle.on_replica_update(self.state, ReplicaUpdate(
            replica_num=replica.replica_num, submission_num=replica.submission_num, status="failed",
            seq=Step.FINISHED, reason=reason), workflow.now())

    async def stop(self, replica: Replica, request: StopRequest) -> None:
        """Ask the replica's workflow to stop; if it is gone, tear its instance down ourselves."""
        try:
            await workflow.get_external_workflow_handle(self._id(replica)).signal(ReplicaWorkflow.stop, request)
        except Exception as e:  # noqa: BLE001 — the child has already ended (or never started)
            workflow.logger.info("stop of %s not delivered: %s", self._id(replica), e)
            await self.teardown_orphan(replica, request)

    async def teardown_orphan(self, replica: Replica, request: StopRequest) -> None:
        """Tear down a replica whose workflow is gone; the teardown reports its end as a child's would. Without a
        placement, on every backend it may have been launched on (its launch may have made something before it
        reported: each backend finds that by the replica's tags); without its group the reaper finds what is left."""
        state = self.state
        if replica.finished:
            return
        backends = [replica.placement.backend] if replica.placement else self._launch_on() if self.watch else []
        if not backends or state.config.group(replica.group) is None:
            replica.status, replica.finished_at = "failed" if request.failed else "terminated", workflow.now()
            return
        job = job_spec(state.config, state.name, replica.group, replica.replica_num, replica.submission_num)
        await asyncio.gather(*[self._teardown(
            TeardownInput(service_workflow_id=workflow.info().workflow_id, job=job, backend=backend,
                          instance=replica.instance, reason=request.reason,
                          final="failed" if request.failed else "terminated", router=request.router),
            "tear down an orphan") for backend in backends])

    async def _teardown(self, inp: TeardownInput, summary: str) -> bool:
        """The service's own teardown of a replica's instance, on its backend's queue (the replica's workflow is
        gone or never owned it)."""
        return await workflow.execute_activity(
            interface.teardown_replica, inp, task_queue=backend_queue(workflow.info().task_queue, inp.backend),
            start_to_close_timeout=timedelta(minutes=10), heartbeat_timeout=timedelta(seconds=self.heartbeat_seconds),
            retry_policy=TEARDOWN_RETRY, summary=summary)

    async def release(self, instance: IdleInstance, terminate: bool) -> None:
        """Tell the replica that left ``instance`` idle that its idle time is over (see ``Release``)."""
        wid = replica_workflow_id(self.state.name, instance.group, instance.replica_num, instance.submission_num)
        try:
            await workflow.get_external_workflow_handle(wid).signal(ReplicaWorkflow.release, Release(
                terminate=terminate))
        except Exception as e:  # noqa: BLE001 — it closed meanwhile (its own time ran out): it terminated it
            workflow.logger.info("release of %s not delivered: %s", wid, e)

    async def terminate_idle(self, instance: IdleInstance) -> None:
        """Terminate an idle instance from the service itself (its stop: none may outlive the run), unless its tags
        name another replica by now; then tell the replica that left it that it is over."""
        state = self.state
        if state.config.group(instance.group) is None:  # its group was removed: only its replica knows its job
            await self.release(instance, terminate=True)
            return
        job = job_spec(state.config, state.name, instance.group, instance.replica_num, instance.submission_num)
        await self._teardown(
            TeardownInput(service_workflow_id=workflow.info().workflow_id, job=job, backend=instance.backend,
                          instance=instance.instance, reason="stopped", idle=True),
            "terminate an idle instance")
        await self.release(instance, terminate=False)

    def _id(self, replica: Replica) -> str:
        return replica_workflow_id(self.state.name, replica.group, replica.replica_num, replica.submission_num)


def _closed_how(failure: BaseException) -> str:
    """"terminated", "cancelled", "timed out" or "failed: …": how a child workflow closed, from its failure."""
    cause = failure.cause if isinstance(failure, exceptions.ChildWorkflowError) and failure.cause else failure
    for kind, how in ((exceptions.TerminatedError, "terminated"), (exceptions.CancelledError, "cancelled"),
                      (exceptions.TimeoutError, "timed out")):
        if isinstance(cause, kind):
            return how
    return f"failed: {getattr(cause, 'message', None) or cause}"
