"""ServiceRunWorkflow: one long-lived workflow per service (id ``service/<name>``).

It owns the configuration, the deployment number, each group's desired count and the replica
table. Each pass: decide with the pure planner, start or stop ReplicaWorkflow children, then
sleep until something changes. Children report back by signal; they are started with
``ParentClosePolicy.ABANDON`` so that they live through continue-as-new, and stopping is explicit.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Optional

from pydantic import BaseModel, Field, ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from models.loader import load_config_data
    from models.run import (
        ApplyRequest,
        ApplyResult,
        Event,
        GroupWatch,
        StatsSnapshot,
        StatsWatch,
        GroupView,
        Replica,
        ReplicaUpdate,
        ReplicaView,
        RouteInput,
        ScaleRequest,
        ServiceRecord,
        ServiceState,
        ServiceStatus,
    )
    from models.service import ServiceConfiguration
    from workflows import names
    from workflows.jobs import replica_input, replica_workflow_id
    from workflows.autoscaler import decide, next_check, wanted
    from workflows.changes import classify, spec_hash
    from workflows.planner import Plan, backoff_until, prune, reconcile, sync_groups
    from workflows.replica import ReplicaWorkflow

SA_SERVICE = SearchAttributeKey.for_keyword("DurastackService")
SA_GROUP = SearchAttributeKey.for_keyword("DurastackGroup")
SA_STATUS = SearchAttributeKey.for_keyword("DurastackStatus")
MAX_EVENTS = 200  # the latest decisions kept in state; the store's decision log keeps them all
MAX_UNRECORDED = 2000  # while the store is unreachable; older ones are then dropped from the log


def service_workflow_id(name: str) -> str:
    return f"service/{name}"


class ServiceRunInput(BaseModel):
    state: ServiceState
    safety_tick_seconds: int = Field(600, description="Longest sleep between passes when nothing happens.")
    history_limit: int = Field(8000, description="Continue-as-new past this many events (or when suggested).")
    heartbeat_seconds: int = Field(
        30, description="Heartbeat timeout of long activities: how soon a dead worker's probes are taken over.")
    watch_heartbeat_seconds: int = Field(
        300, description="The replicas' watch heartbeat timeout, if longer: how soon a dead worker's watch is taken "
                         "over. Each watch heartbeats every half of it, so 6,000 watches at 30 s cost a worker "
                         "a quarter of a core (bench/scale_out.py).")


@workflow.defn
class ServiceRunWorkflow:
    @workflow.init
    def __init__(self, inp: ServiceRunInput) -> None:
        self.inp = inp
        self.state = inp.state
        self.dirty = True
        self.published_status: Optional[str] = None
        self.watcher: Optional[asyncio.Task] = None
        self.fresh_stats = False  # a new snapshot arrived since the last autoscaling pass
        self.recorded: Optional[ServiceStatus] = None  # the `ps` row last written to the store

    # --- messages ---------------------------------------------------------------------------------

    @workflow.query
    def status(self) -> ServiceStatus:
        return _status_view(self.state)

    @workflow.query
    def config(self) -> ServiceConfiguration:
        return self.state.config

    @workflow.query
    def events(self) -> list[Event]:
        return list(self.state.events)

    @workflow.signal
    def stop(self) -> None:
        if not self.state.stopping:
            self.state.stopping = True
            self._event("stop", "stop requested")

    @workflow.signal
    def record_event(self, event: Event) -> None:
        """An event from outside the workflow (e.g. the reaper), kept in the decision log."""
        self._log(event)
        self.dirty = True

    @workflow.signal
    def replica_changed(self, update: ReplicaUpdate) -> None:
        replica = self.state.find(update.replica_num, update.submission_num)
        if replica is None or replica.finished:
            return
        replica.status, replica.ready, replica.registered = update.status, update.ready, update.registered
        replica.placement = update.placement or replica.placement
        replica.reason = update.reason or replica.reason
        group = self.state.groups.get(replica.group)
        if update.status == "terminating" and not replica.stop_requested and group is not None:
            # A failure under way: back off before the planner reuses this replica number.
            group.failures += 1
            group.retry_after = backoff_until(group, workflow.now())
            if self._rolling(group.name) and replica.deployment_num == self.state.deployment_num:
                # A new replica of a rollout failed: stop the rollout, keep the old replicas serving.
                group.rollout_failed = update.reason or "failed"
                self._event("rollout", f"rollout to deployment {self.state.deployment_num} stopped: replica "
                                       f"{replica.replica_num} {group.rollout_failed}; old replicas keep serving "
                                       "(apply the previous file or `durastack rollback`)", group.name)
        if replica.finished:
            replica.finished_at = workflow.now()
            self._event("replica", f"replica {replica.replica_num} {replica.status}: {replica.reason}", replica.group)
        elif replica.ready and update.status == "running" and group is not None:
            # Only a replica that serves ends the back-off: a crashed one reports `terminating` still ready.
            group.failures, group.retry_after = 0, None
        self.dirty = True

    @workflow.update
    def scale(self, request: ScaleRequest) -> int:
        group = self.state.groups[request.group]
        if group.desired != request.count:
            self._event("scale", f"{group.desired} → {request.count} (manual scale)", group.name)
        group.desired = request.count
        group.last_scaled_at = workflow.now()
        self.dirty = True
        return group.desired

    @scale.validator
    def _validate_scale(self, request: ScaleRequest) -> None:
        if self.state.stopping:
            raise ApplicationError("the service is stopping", type="Stopping")
        spec = self.state.config.group(request.group)
        if spec is None:
            known = ", ".join(g.name for g in self.state.config.replica_groups)
            raise ApplicationError(f"no replica group '{request.group}' (groups: {known})", type="UnknownGroup")
        lo, hi = spec.count.min or 0, spec.count.max or 0
        if not lo <= request.count <= hi:
            raise ApplicationError(f"group '{request.group}' takes {lo}..{hi} replicas, not {request.count}",
                                   type="OutOfRange")

    @workflow.update
    def apply(self, request: ApplyRequest) -> ApplyResult:
        """A new configuration: counts apply at once, changed jobs roll out replica by replica."""
        state = self.state
        new = load_config_data(request.config).config
        assert new is not None  # the validator refused anything else
        changes = classify(state.config, new)
        state.previous_config, state.config = state.config, new
        state.deployment_num += 1
        state.groups = sync_groups(new, state.groups)
        for group in state.groups.values():
            group.rollout_failed = ""
        bumped = self._bump_in_place()
        changed = ", ".join(changes.in_place + changes.rolling) or "nothing"
        self._event("apply", f"deployment {state.deployment_num}: changed {changed}; "
                             f"{bumped} replica(s) kept, the others roll")
        self.dirty = True
        replacing = sum(1 for r in state.replicas if r.active and r.deployment_num < state.deployment_num)
        return ApplyResult(deployment=state.deployment_num, in_place=changes.in_place, rolling=changes.rolling,
                           kept=bumped, replacing=replacing)

    @apply.validator
    def _validate_apply(self, request: ApplyRequest) -> None:
        if self.state.stopping:
            raise ApplicationError("the service is stopping", type="Stopping")
        result = load_config_data(request.config)
        if result.errors:
            raise ApplicationError("invalid configuration: " + "; ".join(str(e) for e in result.errors),
                                   type="InvalidConfiguration")
        assert result.config is not None
        if result.config.name not in (None, self.state.name):
            raise ApplicationError(f"name: the configuration is for {result.config.name!r}, not {self.state.name!r}",
                                   type="InvalidConfiguration")
        changes = classify(self.state.config, result.config)
        if changes.not_updatable:
            raise ApplicationError("cannot be updated in place: " + ", ".join(changes.not_updatable)
                                   + "; stop the service and apply again", type="NotUpdatable")
        if not changes.any:
            raise ApplicationError("no changes", type="NoChanges")

    @workflow.update
    def rollback(self) -> ApplyResult:
        """Back to the configuration before the last apply."""
        previous = self.state.previous_config
        assert previous is not None
        return self.apply(ApplyRequest(config=previous.model_dump(mode="json")))

    @rollback.validator
    def _validate_rollback(self) -> None:
        if self.state.previous_config is None:
            raise ApplicationError("nothing to roll back to: the service has had one configuration",
                                   type="NoPrevious")
        self._validate_apply(ApplyRequest(config=self.state.previous_config.model_dump(mode="json")))

    # The same scale and apply as signals, for tools that can only signal (the Web UI, `temporal workflow
    # signal`, other workflows). A signal cannot answer, so a refused one becomes a `rejected` event that
    # says why, and nothing else changes. The payload arrives raw: a malformed one must not fail the task.

    @workflow.signal(name="scale")
    def scale_signal(self, payload: Any) -> None:
        request = self._accepted("scale", ScaleRequest, payload, self._validate_scale)
        if request is not None:
            self.scale(request)

    @workflow.signal(name="apply")
    def apply_signal(self, payload: Any) -> None:
        request = self._accepted("apply", ApplyRequest, payload, self._validate_apply)
        if request is not None:
            self.apply(request)

    def _accepted(self, what: str, model: type[BaseModel], payload: Any, validate) -> Any:
        try:
            request = model.model_validate(payload)
            validate(request)
        except ValidationError as e:
            reason = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'payload'}: {err['msg']}" for err in e.errors())
        except ApplicationError as e:
            reason = e.message
        else:
            return request
        self._event("rejected", f"{what} signal refused: {reason}")
        self.dirty = True
        return None

    def _bump_in_place(self) -> int:
        """Replicas whose job does not change join the new deployment without a restart (spec 6.4)."""
        hashes = {g.name: spec_hash(self.state.config, g.name) for g in self.state.config.replica_groups}
        bumped = 0
        for r in self.state.replicas:
            if not r.finished and r.deployment_num < self.state.deployment_num and hashes.get(r.group) == r.spec_hash:
                r.deployment_num = self.state.deployment_num
                bumped += 1
        return bumped

    # --- the loop ---------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: ServiceRunInput) -> str:
        state = self.state
        if state.submitted_at is None:
            state.submitted_at = workflow.now()
            self._event("apply", f"service submitted, deployment {state.deployment_num}")
        state.groups = sync_groups(state.config, state.groups)
        await workflow.execute_activity(
            names.ENSURE_ROUTE, RouteInput(service=state.name, auth=state.config.auth,
                                           cold_start_timeout=state.config.cold_start_timeout),
            start_to_close_timeout=timedelta(seconds=60), retry_policy=RetryPolicy(maximum_interval=timedelta(
                seconds=30)), summary="gateway route")
        try:
            while not state.stopping:
                self.dirty = False  # cleared before the pass, so a message during it is never lost
                self._take_snapshot()
                self._autoscale()
                await self._reconcile()
                self._watch_stats()
                await self._record(self._publish())
                try:
                    await workflow.wait_condition(
                        lambda: self.dirty or state.stopping or self._should_continue() or self._snapshot_ready(),
                        timeout=self._sleep(), timeout_summary="until something changes")
                except asyncio.TimeoutError:
                    pass  # the safety tick, a back-off or a scaling delay has ended: decide again
                if self._should_continue() and not state.stopping:
                    await self._stop_watching()
                    if workflow.patched("watcher-cancel-then-continue"):
                        # The watcher's cancellation and the continue-as-new in one workflow task stall the
                        # time-skipping test server for good (tests/test_soak.py); a real server minds neither.
                        await workflow.sleep(timedelta(seconds=1), summary="let the watcher's cancel land")
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    state.replicas = prune(state.replicas)
                    workflow.continue_as_new(inp.model_copy(update={"state": state}))
        except asyncio.CancelledError:
            state.stopping = True
            await self._stop_watching()
            await self._shutdown()
            raise
        await self._stop_watching()
        await self._shutdown()
        return "stopped"

    def _rolling(self, group: str) -> bool:
        return any(r.group == group and r.active and r.deployment_num < self.state.deployment_num
                   for r in self.state.replicas)

    def _should_continue(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > self.inp.history_limit

    def _sleep(self) -> timedelta:
        """The safety tick, or less when a back-off or a held scaling decision ends sooner."""
        now = workflow.now()
        dues = [g.retry_after for g in self.state.groups.values() if g.retry_after is not None]
        snap = self.state.stats
        for spec in self.state.config.replica_groups:
            group = self.state.groups[spec.name]
            if spec.scaling is None or snap is None or group.last_scaled_at is None:
                continue
            delay = next_check(group.desired, snap.rate(spec.scaling.window), spec.scaling, spec.count.min or 0,
                               spec.count.max or 0, group.last_scaled_at)
            if delay is not None:
                dues.append(group.last_scaled_at + timedelta(seconds=delay))
        waits = [(due - now).total_seconds() for due in dues if due > now]
        return timedelta(seconds=max(1.0, min([self.inp.safety_tick_seconds, *waits])))

    # --- autoscaling --------------------------------------------------------------------------------

    def _autoscale(self) -> None:
        """Apply the autoscaler to every group with `scaling`, logging each decision with its inputs."""
        snap, now = self.state.stats, workflow.now()
        for spec in self.state.config.replica_groups:
            if spec.scaling is None:
                continue
            group, scaling = self.state.groups[spec.name], spec.scaling
            rate = snap.rate(scaling.window) if snap is not None else None
            d = decide(group.desired, rate, scaling, spec.count.min or 0, spec.count.max or 0,
                       group.last_scaled_at, now)
            seen = f"rps {rate:.2f} over {scaling.window}s, target {scaling.target:g}" if rate is not None else ""
            if d.new != group.desired:
                self._event("scale", f"{group.desired} → {d.new}: {d.reason}; {seen}", group.name)
                group.desired, group.last_scaled_at = d.new, now
            elif self.fresh_stats and "delay" in d.reason:
                self._event("hold", f"stays at {group.desired}: {d.reason}; {seen}", group.name)
        self.fresh_stats = False

    def _watch_stats(self) -> None:
        """Keep one stats watcher running while some group autoscales."""
        groups = [g for g in self.state.config.replica_groups if g.scaling is not None]
        if not groups or self.watcher is not None or self.state.stopping:
            return
        snap = self.state.stats
        watch = StatsWatch(service=self.state.name, groups=[
            GroupWatch(name=g.name, target=g.scaling.target, window=g.scaling.window, lo=g.count.min or 0,
                       hi=g.count.max or 0,
                       wanted=wanted(snap.rate(g.scaling.window), g.scaling.target, g.count.min or 0,
                                     g.count.max or 0)[0] if snap is not None else -1)
            for g in groups if g.scaling is not None])
        self.watcher = asyncio.ensure_future(workflow.execute_activity(
            names.WATCH_STATS, watch, result_type=StatsSnapshot, start_to_close_timeout=timedelta(hours=1),
            heartbeat_timeout=timedelta(seconds=self.inp.heartbeat_seconds),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30)), summary="watch gateway stats"))

    def _snapshot_ready(self) -> bool:
        return self.watcher is not None and self.watcher.done()

    def _take_snapshot(self) -> None:
        if not self._snapshot_ready():
            return
        watcher, self.watcher = self.watcher, None
        try:
            self.state.stats = watcher.result()
            self.fresh_stats = True
        except Exception as e:  # noqa: BLE001 — no stats this time means no change
            workflow.logger.warning("stats watcher ended: %s", e)

    async def _stop_watching(self) -> None:
        if self.watcher is not None and not self.watcher.done():
            self.watcher.cancel()
            try:
                await self.watcher
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 — cancelled, as asked
                pass
        self.watcher = None

    async def _reconcile(self) -> None:
        plan = reconcile(self.state, workflow.now())
        if plan:
            await self._apply(plan)

    async def _apply(self, plan: Plan) -> None:
        state, now = self.state, workflow.now()
        starts = []
        for s in plan.start:
            replica = Replica(replica_num=s.replica_num, submission_num=s.submission_num, group=s.group,
                              deployment_num=state.deployment_num, submitted_at=now,
                              spec_hash=spec_hash(state.config, s.group))
            state.replicas.append(replica)
            state.next_replica_num = max(state.next_replica_num, s.replica_num + 1)
            starts.append(self._start_child(replica))
        for s in plan.stop:
            replica = state.find(s.replica_num, s.submission_num)
            if replica is not None:
                replica.stop_requested, replica.reason = True, s.reason
                starts.append(self._signal_stop(replica, s.reason))
        await asyncio.gather(*starts)

    async def _start_child(self, replica: Replica) -> None:
        state = self.state
        inp = replica_input(state.config, state.name, workflow.info().workflow_id, replica.group,
                            replica.replica_num, replica.submission_num, replica.deployment_num)
        inp.heartbeat_seconds = self.inp.heartbeat_seconds
        inp.watch_heartbeat_seconds = self.inp.watch_heartbeat_seconds
        try:
            await workflow.start_child_workflow(
                ReplicaWorkflow.run, inp,
                id=replica_workflow_id(state.name, replica.group, replica.replica_num, replica.submission_num),
                parent_close_policy=ParentClosePolicy.ABANDON,
                static_summary=f"**{state.name}** group={replica.group} replica={replica.replica_num}",
                search_attributes=TypedSearchAttributes([SearchAttributePair(SA_SERVICE, state.name),
                                                     SearchAttributePair(SA_GROUP, replica.group)]),
            )
        except Exception as e:  # noqa: BLE001 — e.g. an orphan with the same id is still running
            replica.status, replica.reason, replica.finished_at = "failed", f"could not start: {e}", workflow.now()
            self._event("replica", f"replica {replica.replica_num} could not start: {e}", replica.group)

    async def _signal_stop(self, replica: Replica, reason: str) -> None:
        wid = replica_workflow_id(self.state.name, replica.group, replica.replica_num, replica.submission_num)
        try:
            await workflow.get_external_workflow_handle(wid).signal(ReplicaWorkflow.stop, reason)
        except Exception as e:  # noqa: BLE001 — the child has already ended (or never started)
            workflow.logger.info("stop of %s not delivered: %s", wid, e)
            if not replica.finished:
                replica.status, replica.finished_at = "terminated", workflow.now()
                self.dirty = True

    async def _shutdown(self) -> None:
        """Stop every replica, wait until each has torn down, then drop the gateway route."""
        state = self.state
        stops = []
        for replica in state.replicas:
            if not replica.finished and not replica.stop_requested:
                replica.stop_requested, replica.reason = True, "stopped"
                stops.append(self._signal_stop(replica, "stopped"))
        await asyncio.gather(*stops)
        self._publish()
        await workflow.wait_condition(lambda: all(r.finished for r in state.replicas))
        await workflow.execute_activity(
            names.REMOVE_ROUTE, RouteInput(service=state.name), start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=30)), summary="remove gateway route")
        self._event("stop", "service stopped")
        await self._record(self._publish())

    # --- bookkeeping ------------------------------------------------------------------------------

    def _event(self, kind: str, message: str, group: Optional[str] = None) -> None:
        self._log(Event(at=workflow.now(), kind=kind, group=group, message=message))

    def _log(self, event: Event) -> None:
        self.state.last_seq += 1
        event.seq = self.state.last_seq
        self.state.events.append(event)
        del self.state.events[:-MAX_EVENTS]
        self.state.unrecorded.append(event)
        del self.state.unrecorded[:-MAX_UNRECORDED]

    async def _record(self, view: ServiceStatus) -> None:
        """Write new events and a changed `ps` row to the store: a local activity, only on change.

        A store that stays unreachable does not stop the service: the events wait in state for the next pass.
        """
        if not self.state.unrecorded and view == self.recorded:
            return
        events = list(self.state.unrecorded)
        try:
            await workflow.execute_local_activity(
                names.RECORD_SERVICE, ServiceRecord(service=self.state.name, events=events, status=view),
                start_to_close_timeout=timedelta(seconds=10),
                retry_policy=RetryPolicy(maximum_attempts=3, maximum_interval=timedelta(seconds=2)),
                summary="decision log")
        except Exception as e:  # noqa: BLE001 — kept for the next pass
            workflow.logger.warning("recording to the store failed: %s", e)
            return
        del self.state.unrecorded[:len(events)]
        self.recorded = view

    def _publish(self) -> ServiceStatus:
        """Search attribute, UI details and gauges (the upsert only on change: each is a history event).

        Returns the status view, which `_record` writes to the store when it changed."""
        view = _status_view(self.state)
        if view.status != self.published_status:
            workflow.upsert_search_attributes([SA_SERVICE.value_set(self.state.name),
                                               SA_STATUS.value_set(view.status)])
            self.published_status = view.status
        lines = [f"**{view.name}** {view.status} · deployment {view.deployment}"]
        for g in view.groups:
            ready = sum(1 for r in g.replicas if r.ready and r.status == "running")
            lines.append(f"group={g.name} ready {ready}/{g.desired}")
        workflow.set_current_details("\n\n".join(lines))
        _set_gauges(self.state)
        return view


# Replicas that hold (or will hold) an instance; finished ones leave the gauges.
LIVE_STATES = ("submitted", "provisioning", "running", "terminating")


def _set_gauges(state: ServiceState) -> None:
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
        live = [("terminating" if r.stop_requested else r.status, r.ready) for r in state.replicas
                if r.group == group and not r.finished]
        for name in LIVE_STATES:
            replicas.set(sum(1 for status, _ in live if status == name), {"group": group, "state": name})
        ready.set(sum(1 for status, is_ready in live if status == "running" and is_ready), {"group": group})
        spec = state.groups.get(group)
        desired.set(spec.desired if spec is not None and not state.stopping else 0, {"group": group})


def _service_status(state: ServiceState) -> str:
    if state.stopping:
        return "terminated" if all(r.finished for r in state.replicas) else "terminating"
    latest = [r for r in state.latest() if r.active]
    for status in ("running", "provisioning", "submitted"):
        if any(r.status == status for r in latest):
            return status
    return "pending"


def _view(r: Replica) -> ReplicaView:
    p = r.placement
    status = "terminating" if r.stop_requested and not r.finished else r.status
    return ReplicaView(replica=r.replica_num, submission=r.submission_num, deployment=r.deployment_num,
                       group=r.group, status=status, ready=r.ready, backend=p.backend if p else "",
                       region=p.region if p else "", instance_type=p.instance_type if p else "",
                       price=p.price if p else 0.0, address=p.address if p else "", submitted_at=r.submitted_at,
                       reason=r.reason)


def _status_view(state: ServiceState) -> ServiceStatus:
    config: ServiceConfiguration = state.config
    latest = state.latest()
    groups = []
    for spec in config.replica_groups:
        g = state.groups.get(spec.name)
        rolling = any(r.group == spec.name and r.active and r.deployment_num < state.deployment_num
                      for r in state.replicas)
        rollout = (f"failed: {g.rollout_failed}" if g and g.rollout_failed else "rolling") if rolling else ""
        groups.append(GroupView(name=spec.name, desired=g.desired if g else 0, min=spec.count.min or 0,
                                max=spec.count.max or 0, resources=spec.resources.summary(), rollout=rollout,
                                replicas=[_view(r) for r in latest if r.group == spec.name]))
    names_ = {g.name for g in config.replica_groups}
    return ServiceStatus(name=state.name, status=_service_status(state), deployment=state.deployment_num,
                         auth=config.auth, submitted_at=state.submitted_at, groups=groups,
                         extra_replicas=[_view(r) for r in latest if r.group not in names_])

