"""FleetMonitorWorkflow (id ``durastack/monitor/<task queue>-<backend>``): one replica monitor for every service on a backend.

A service's own monitor is an activity that heartbeats for the service's whole life: with a heartbeat every
third of a 20 s timeout, 1,000 idle services sent 150 heartbeats a second, and Temporal spent most of a core
writing them (bench/scale_out.py). Here each service tells the fleet monitor what it watches (signal ``watch``,
its ``MonitorInput``, whenever that changes; no replicas: nothing) and one activity on the backend's queue
watches them all, heartbeating every 8 s against a 24 s timeout: a dead worker's watch moves to another, and
looks again, within 30 s. The activity asks this workflow what changed (query ``changes``, every few seconds) and tells each
service what went down (signal ``replicas_down`` to ``service/<name>``), as the service's own monitor returned it.

Started by each worker that serves the backend (``start_workflow`` with USE_EXISTING); a service that cannot
signal it (not started, terminated) runs its own monitor instead (workflows/watchers.py). About 4 history events
per change a service tells; continue-as-new when the server suggests it, carrying the watched set.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.messages import FleetChanges, FleetInput, MonitorInput
    from rules.names import backend_queue



@workflow.defn
class FleetMonitorWorkflow:
    @workflow.init
    def __init__(self, inp: FleetInput) -> None:
        self.inp = inp
        self.watched: dict[str, MonitorInput] = {w.service: w for w in inp.watched if w.replicas}
        # Versions count within a run: the activity is started again by each run, and first asks for all (since 0).
        self.version = 0
        self.changed: dict[str, int] = {service: 0 for service in self.watched}  # service → version of its change

    @workflow.signal
    def watch(self, inp: MonitorInput) -> None:
        """What ``inp.service`` watches on this backend now (the same again changes nothing)."""
        known = self.watched.get(inp.service)
        if known == inp or (known is None and not inp.replicas):
            return
        self.version += 1
        self.changed[inp.service] = self.version
        if inp.replicas:
            self.watched[inp.service] = inp
        else:
            self.watched.pop(inp.service, None)

    @workflow.query
    def changes(self, since: int) -> FleetChanges:
        """Each service whose watched set changed after version ``since`` (0: all that are watched)."""
        if since <= 0:
            return FleetChanges(version=self.version, full=True, watched=list(self.watched.values()))
        return FleetChanges(version=self.version, full=False, watched=[
            self.watched.get(s) or MonitorInput(service=s, backend=self.inp.backend, replicas=[])
            for s, v in self.changed.items() if v > since])

    @workflow.run
    async def run(self, inp: FleetInput) -> None:
        watch = workflow.start_activity(
            interface.watch_fleet, inp.model_copy(update={"watched": []}),
            task_queue=backend_queue(workflow.info().task_queue, inp.backend),
            start_to_close_timeout=timedelta(days=3650), heartbeat_timeout=timedelta(seconds=inp.heartbeat_seconds),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=10)),
            cancellation_type=ActivityCancellationType.TRY_CANCEL, summary=f"watch replicas on {inp.backend}")
        await workflow.wait_condition(lambda: self._should_continue(inp.history_limit) or watch.done())
        watch.cancel()  # the next run starts its own, which first asks for the whole set
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(inp.model_copy(update={"watched": list(self.watched.values())}))

    @staticmethod
    def _should_continue(limit: int) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > limit
