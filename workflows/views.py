"""What a service shows: the `ps` view, the Web UI's details and search attribute, the worker's gauges,
and the store's `ps` row and decision log (written by ``Publisher``, the only part with effects)."""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.messages import ServiceRecord
    from models.state import Replica, ServiceState
    from models.views import GroupView, ReplicaView, ServiceStatus
    from rules import lifecycle
    from rules.autoscaler import bounds
    from workflows.attributes import SA_SERVICE, SA_STATUS

RECORD_RETRY = RetryPolicy(maximum_attempts=3, maximum_interval=timedelta(seconds=2))

# Replicas that hold (or will hold) an instance; finished ones leave the gauges.
LIVE_STATES = ("submitted", "provisioning", "running", "terminating")


class Publisher:
    def __init__(self) -> None:
        self.published: Optional[str] = None  # the status search attribute last upserted
        self.recorded: Optional[ServiceStatus] = None  # the `ps` row last written to the store

    async def publish(self, state: ServiceState) -> None:
        """Search attribute (only on change: each upsert is a history event), UI details, gauges, and the
        store: new events and a changed `ps` row, by a local activity. A store that stays unreachable does
        not stop the service: the events wait in state for the next pass."""
        view = status_view(state)
        if view.status != self.published:
            workflow.upsert_search_attributes([SA_SERVICE.value_set(state.name), SA_STATUS.value_set(view.status)])
            self.published = view.status
        workflow.set_current_details(details(view))
        set_gauges(state)
        # The row as it will be once this write succeeds: nothing waiting, no outage.
        row = view.model_copy(update={"unrecorded": 0, "store_failing_since": None, "store_error": ""})
        if not state.unrecorded and row == self.recorded:
            return
        if await self._record(state, row):
            await self._record(state, row)  # the stretch the store turned out to have lost, from state.events

    async def _record(self, state: ServiceState, row: ServiceStatus) -> bool:
        """Write what waits; True when the store turned out to have lost a stretch, now queued again. Decided
        from the activity's recorded result alone: events that signal handlers add while it runs wait for the
        next pass, so a replay, which may apply those signals at another point, takes the same path."""
        events = list(state.unrecorded)
        try:
            result = await workflow.execute_local_activity(
                interface.record_service, ServiceRecord(service=state.name, events=events, status=row),
                start_to_close_timeout=timedelta(seconds=10), retry_policy=RECORD_RETRY, summary="decision log")
        except Exception as e:  # noqa: BLE001 — kept for the next pass
            workflow.logger.warning("recording to the store failed: %s", e)
            if state.store_failing_since is None:
                state.store_failing_since = workflow.now()
            state.store_error = _reason(e)
            return False
        del state.unrecorded[:len(events)]
        state.store_failing_since, state.store_error = None, ""
        self.recorded = row
        if not events or result is None:
            return False
        # A store that came back empty (a deleted SQLite file made anew) or behind: refill what state still has.
        first = events[0].seq
        lost = [e for e in state.events if result.last_before < e.seq < first]
        state.unrecorded[:0] = lost
        return bool(lost)


def _reason(error: BaseException) -> str:
    """The root cause of a failed local activity, in one line (the store's own message)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return str(error).splitlines()[0][:300] if str(error) else type(error).__name__


def store_retry_seconds(state: ServiceState, every: float) -> Optional[float]:
    """How soon to try the store again while it fails (``every``), so that the waiting events are written
    without waiting for another reason to pass. None while it takes writes."""
    return every if state.store_failing_since is not None and not state.stopping else None


_ROLES = {"": "", "router": " (router: the gateway routes here)", "worker": " (worker behind the router)"}


def status_view(state: ServiceState, asked: bool = False) -> ServiceStatus:
    """``asked``: for the `status` query, which may show what changes too often to publish (an `rps` rate)."""
    latest = state.latest()
    groups = [_group_view(state, spec.name, latest, asked) for spec in state.config.replica_groups]
    names = {g.name for g in state.config.replica_groups}
    return ServiceStatus(name=state.name, status=_service_status(state), deployment=state.deployment_num,
                         auth=state.config.auth, submitted_at=state.submitted_at, groups=groups,
                         extra_replicas=[_replica_view(r) for r in latest if r.group not in names],
                         unrecorded=len(state.unrecorded), store_failing_since=state.store_failing_since,
                         store_error=state.store_error, routed=state.routed, router=state.router_view, place=state.place,
                         unavailable=lifecycle.unavailable(state))


def details(view: ServiceStatus) -> str:
    """The Web UI's current details of the service workflow (markdown)."""
    lines = [f"**{view.name}** {view.status} · deployment {view.deployment}"]
    if view.store_failing_since is not None:
        lines.append(f"store failing since {view.store_failing_since:%H:%M:%S} UTC: {view.unrecorded} events wait")
    if view.unavailable:
        lines.append(f"cannot serve: {view.unavailable}")
    for g in view.groups:
        ready = sum(1 for r in g.replicas if r.ready and r.status == "running")
        wait = f" · back-off until {g.retry_after:%H:%M:%S}" if g.retry_after else ""
        wait += f" · waits: {g.waiting}" if g.waiting else ""
        lines.append(f"group={g.name}{_ROLES[g.role]} ready {ready}/{g.desired}{wait}")
    return "\n\n".join(lines)


def set_gauges(state: ServiceState) -> None:
    """The worker's Prometheus gauges of this service: replicas by group and state, ready, desired.

    Replay-safe: the workflow meter emits nothing while a history replays. Every state of every group
    is set, zeros too, so a replica that moved on leaves no stale count behind.
    """
    meter = workflow.metric_meter().with_additional_attributes({"service": state.name})
    replicas = meter.create_gauge("durastack_replicas", "Live replicas of a replica group, by state.")
    ready = meter.create_gauge("durastack_replicas_ready", "Replicas of a replica group that are ready to serve.")
    desired = meter.create_gauge("durastack_desired_replicas", "Replicas a group should have (0 once stopping).")
    groups = [g.name for g in state.config.replica_groups]
    groups += sorted({r.group for r in state.replicas} - set(groups))  # e.g. a group removed by an apply
    for group in groups:
        live = [_shown_status(r) for r in state.replicas if r.group == group and not r.finished]
        for name in LIVE_STATES:
            replicas.set(sum(1 for status in live if status == name), {"group": group, "state": name})
        ready.set(sum(1 for r in state.replicas if r.group == group and r.serves), {"group": group})
        spec = state.groups.get(group)
        desired.set(spec.desired if spec is not None and not state.stopping else 0, {"group": group})


def _group_view(state: ServiceState, name: str, latest: list[Replica], asked: bool = False) -> GroupView:
    spec, g = state.config.group(name), state.groups.get(name)
    assert spec is not None
    rollout = ""
    if state.rolling(name):
        rollout = f"failed: {g.rollout_failed}" if g and g.rollout_failed else "rolling"
    router = state.config.router_group
    role = "" if router is None else "router" if name == router else "worker"
    lo, hi = bounds(spec)
    return GroupView(name=name, desired=g.desired if g else 0, min=lo, max=hi,
                     resources=spec.resources.summary(), rollout=rollout, retry_after=g.retry_after if g else None,
                     role=role, waiting=g.waiting if g else "", signal=_signal(state, name, asked),
                     idle=[f"{i.instance_id} until {i.until:%H:%M:%S} UTC" for i in state.idle if i.group == name],
                     replicas=[_replica_view(r) for r in latest if r.group == name])


def _signal(state: ServiceState, name: str, asked: bool) -> str:
    """A scaled group's metric as last read, and when an engine watcher read it (it tells the service only of
    changes). An `rps` group's only when ``asked``: its rate changes with every snapshot, and a published status
    would be written to the store each time."""
    spec = state.config.group(name)
    if spec is None or spec.scaling is None or name not in state.groups or not (spec.scaling.engine or asked):
        return ""
    seen = lifecycle.group_signal(state, name)[1]
    if spec.scaling.engine and state.engines and seen:
        seen += f"; values read at {max(e.at for e in state.engines.values()):%H:%M:%S} UTC"
    return seen


def _service_status(state: ServiceState) -> str:
    if state.stopping:  # asked to, `max_duration` reached, or failed (a failure `retry` does not cover)
        if not all(r.finished for r in state.replicas):
            return "terminating"
        return "failed" if state.failure else "terminated"
    latest = [r for r in state.latest() if r.active]
    for status in ("running", "provisioning", "submitted"):
        if any(r.status == status for r in latest):
            return status
    return "pending"


def _shown_status(r: Replica) -> str:
    return "terminating" if r.stop_requested and not r.finished else r.status


def _replica_view(r: Replica) -> ReplicaView:
    p = r.placement
    return ReplicaView(replica=r.replica_num, submission=r.submission_num, deployment=r.deployment_num,
                       group=r.group, status=_shown_status(r), ready=r.ready, backend=p.backend if p else "",
                       region=p.region if p else "", instance_type=p.instance_type if p else "",
                       price=p.price if p else 0.0, address=p.address if p else "", gpu=p.gpu if p else "",
                       submitted_at=r.submitted_at,
                       reason=r.reason, **_ssh_of(r))


def _ssh_of(r: Replica) -> dict:
    i = r.instance
    if i is None or getattr(i, "kind", "") != "cloud":
        return {}
    return {"ssh_host": i.address.rpartition(":")[0], "instance_key": i.key, "host_key_after_boot": i.host_key_after_boot}
