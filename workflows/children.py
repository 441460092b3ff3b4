"""A service's replica workflows: start one, ask one to stop, and tear down after one that is gone."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.failures import NO_OFFERS
    from models.run import Replica, ReplicaUpdate, ServiceState, Step, StopRequest, TeardownInput
    from workflows import lifecycle
    from workflows.jobs import job_spec, replica_input, replica_workflow_id
    from workflows.names import backend_queue
    from workflows.replica import ReplicaWorkflow

SA_SERVICE = SearchAttributeKey.for_keyword("DurastackService")
SA_GROUP = SearchAttributeKey.for_keyword("DurastackGroup")
TEARDOWN_RETRY = RetryPolicy(maximum_interval=timedelta(minutes=1))  # never gives up: a leak costs money


class Children:
    def __init__(self, state: ServiceState, heartbeat_seconds: int) -> None:
        self.state, self.heartbeat_seconds = state, heartbeat_seconds

    async def start(self, replica: Replica) -> list[lifecycle.Note]:
        """Start the replica's workflow; one that cannot start fails at once (and counts as a failure)."""
        state = self.state
        inp = replica_input(state.config, state.name, workflow.info().workflow_id, replica.group,
                            replica.replica_num, replica.submission_num, replica.deployment_num, replica.refs)
        inp.heartbeat_seconds = self.heartbeat_seconds
        inp.launch_on = [b for b in state.backends if inp.backends is None or b in inp.backends]
        if not inp.launch_on:  # the service names only backends this deployment has no configuration for
            return self._failed(replica, f"{NO_OFFERS}: backend {', '.join(inp.backends or [])} is not configured "
                                         f"($DURASTACK_HOME/config.yml; this deployment serves "
                                         f"{', '.join(state.backends) or 'none'})")
        try:
            await workflow.start_child_workflow(
                ReplicaWorkflow.run, inp, id=self._id(replica), parent_close_policy=ParentClosePolicy.ABANDON,
                static_summary=f"**{state.name}** group={replica.group} replica={replica.replica_num}",
                search_attributes=TypedSearchAttributes([SearchAttributePair(SA_SERVICE, state.name),
                                                         SearchAttributePair(SA_GROUP, replica.group)]))
        except Exception as e:  # noqa: BLE001 — e.g. an orphan with the same id is still running
            return self._failed(replica, f"could not start: {e}")
        return []

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
        """Tear down a replica whose workflow is gone; the teardown reports its end as a child's would.
        Without a placement nothing was made; without its group the reaper finds what is left."""
        state = self.state
        if replica.finished:
            return
        if replica.placement is None or state.config.group(replica.group) is None:
            replica.status, replica.finished_at = "failed" if request.failed else "terminated", workflow.now()
            return
        job = job_spec(state.config, state.name, replica.group, replica.replica_num, replica.submission_num)
        await workflow.execute_activity(
            interface.teardown_replica,
            TeardownInput(service_workflow_id=workflow.info().workflow_id, job=job, backend=replica.placement.backend,
                          instance=replica.instance, reason=request.reason,
                          final="failed" if request.failed else "terminated"),
            task_queue=backend_queue(workflow.info().task_queue, replica.placement.backend),
            start_to_close_timeout=timedelta(minutes=10), heartbeat_timeout=timedelta(seconds=self.heartbeat_seconds),
            retry_policy=TEARDOWN_RETRY, summary="tear down an orphan")

    def _id(self, replica: Replica) -> str:
        return replica_workflow_id(self.state.name, replica.group, replica.replica_num, replica.submission_num)
