"""ServiceRunWorkflow: one long-lived workflow per service (id ``service/<name>``).

Messages change the state; the loop acts on it. Each pass: judge waiting signals, take what the
watchers saw, autoscale, start or stop replicas as the planner says, then sleep until something
changes. The rules live in pure modules (``lifecycle``, ``planner``, ``autoscaler``, ``admission``);
what the service shows in ``views``; the long watchers in ``watchers``. Children are started with
``ParentClosePolicy.ABANDON`` so that they live through continue-as-new; stopping is explicit.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any, Optional

from pydantic import BaseModel, Field
from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.messages import (AddressAnswer, AddressQuery, ApplyRequest, ApplyResult, Down, FleetDowns,
        ReplicaUpdate, ScaleRequest, SignalInput, StopRequest)
    from models.state import Replica, ServiceState
    from models.views import Event, ServiceStatus
    from models.service import ServiceConfiguration
    from rules import addresses, idle, lifecycle, routers
    from workflows import views
    from rules.admission import Refused, check_apply, check_scale
    from workflows.children import Children
    from rules.jobs import replica_workflow_id
    from rules.planner import Plan, Stop, prune, reconcile, sync_groups
    from rules.names import RECORD_EVENT, REPLICA_CHANGED
    from workflows.replica import KEEP_IDLE  # asked only by services with `idle_duration` (rules/idle.py)
    from workflows.route import Route
    from workflows.watchers import Watchers



# Patches (CONTRIBUTING.md): ids of changes that histories recorded before them must not take.
ROUTE_BESIDE_REPLICAS = "route-beside-replicas"  # the gateway route is put beside the replicas' starts
WATCH_CHILDREN = "watch-children"  # a replica workflow that closes before its replica finished is torn down
CONTINUE_WHEN_SETTLED = "continue-when-settled"  # a continue-as-new waits until no replica is between steps
ROUTE_UNAVAILABLE = "route-unavailable"  # the route says why the service cannot serve: the gateway answers 503
ONE_PLACE = "one-place"  # the replicas of a service that reach each other all go where its first one landed
# The idle wait never cancels its timer: it keeps one for its next deadline and leaves it running when news wake the
# loop first (a later wait reuses it; an earlier deadline adds one, and the stale one just fires). A timer started and
# cancelled in one workflow task that a signal then made fail (UnhandledCommand) was cancelled again on the retry,
# unknown to the server (BadCancelTimerAttributes), failing every retry after; it also cost two events a pass.
IDLE_TIMER_KEPT = "idle-timer-kept"
HISTORY_BYTES = "history-bytes"  # a run continues as new past history_bytes_limit too, not only past an event count
VALIDATE_START = "validate-start"  # each run judges its own configuration first: a start that skipped apply too
JUDGED_ONCE = "judged-once"  # asked only by continued runs: they are not judged again
ROUTER_SYNC = "router-sync"  # an sglang router's worker list is kept; workers leave it before they stop
FLEET_MONITOR = "fleet-monitor"  # serving replicas are watched by their backend's fleet monitor (workflows/fleet.py)
STEADY_DOWN = "steady-down"  # a scale-down waits for the metric to ask for fewer over its whole down-delay
# What a replica may leave its instance idle for: its group shrank or rolled, so a replica of it may soon need one.
IDLE_REASONS = ("scaled_down", "replaced")


def service_workflow_id(name: str) -> str:
    return f"service/{name}"


class ServiceRunInput(BaseModel):
    state: ServiceState
    safety_tick_seconds: int = Field(3600, description=(
        "Longest sleep between passes when nothing happens (every wake-up that matters has its own: a message, a "
        "watcher's news, a back-off or delay ending). An idle service the worker's cache let go replays its "
        "history at each tick, so it is long (bench/scale_out.py)."))
    history_limit: int = Field(8000, description="Continue-as-new past this many events (or when suggested).")
    history_bytes_limit: int = Field(4 * 2**20, description=(
        "Continue-as-new once the run's history grew by this many bytes: large configurations (long commands, many "
        "env values) travel in many events, and Temporal refuses a history past 50 MB."))
    heartbeat_seconds: int = Field(
        20, description="Heartbeat timeout of the long activities: how soon a dead worker's launches, teardowns "
                        "and watchers are taken over by another worker (each heartbeats every third of it).")
    unserved_seconds: int = Field(60, description=(
        "A launch no worker of its backend takes within this is given up on that backend (a cloud worker not "
        "running): said in `events` and `ps`, and the next backend tried. A live worker takes a launch at once "
        "(its activity slots are never full), so a minute is only ever a missing worker."))
    store_retry_seconds: float = Field(
        30, description="While the store fails, try it again this often (each try costs a few history events).")
    fleet_monitor: bool = Field(False, description=(
        "Serving replicas are watched by each backend's fleet monitor (workflows/fleet.py, started by the workers), "
        "one heartbeating activity for every service, rather than by a monitor of this service's own per backend. "
        "`durastack apply` sets it; a backend whose fleet monitor does not run gets the service's own."))


@workflow.defn
class ServiceRunWorkflow:
    @workflow.init
    def __init__(self, inp: ServiceRunInput) -> None:
        self.inp, self.state = inp, inp.state
        self.dirty = True
        self.signals: list[tuple[str, Any]] = []  # raw `scale`/`apply` signals, judged by the loop
        self.watchers = Watchers(timedelta(seconds=inp.heartbeat_seconds))
        self.children = Children(self.state, inp.heartbeat_seconds, inp.unserved_seconds)
        self.publisher = views.Publisher()
        self.route = Route()
        self.route_beside = False  # the route is put beside the pass's replica starts (set in _begin)
        self.settle_first = False  # a continue-as-new waits for lifecycle.settled (set in _begin)
        self.router_sync = False  # an sglang router's worker list is kept (set in _begin)
        self.bytes_bound = False  # history bytes count toward continue-as-new too (set in _begin)
        self.keep_timer = False  # the idle timer is kept, never cancelled (set in _begin)
        self.steady_down = False  # a scale-down waits out its delay below the target (set in _begin)
        self.tick: Optional[asyncio.Future] = None  # that timer, and when it fires
        self.tick_at: Optional[datetime] = None
        self.start_bytes = 0  # the history's size when this run began (its carried state)

    # --- messages ---------------------------------------------------------------------------------

    @workflow.query
    def status(self) -> ServiceStatus:
        return views.status_view(self.state, asked=True)

    @workflow.query
    def config(self) -> ServiceConfiguration:
        return self.state.config

    @workflow.query
    def events(self) -> list[Event]:
        return list(self.state.events)

    @workflow.query
    def owned(self) -> list[str]:
        """The replica workflows this run owns (not finished, or owning an idle instance): the reaper stops any other
        of this service's."""
        state = self.state
        return [replica_workflow_id(state.name, r.group, r.replica_num, r.submission_num)
                for r in state.replicas if not r.finished] + \
            [replica_workflow_id(state.name, i.group, i.replica_num, i.submission_num) for i in idle.owners(state)]

    @workflow.query
    def addresses(self, query: AddressQuery) -> AddressAnswer:
        """The late references of a placed replica, asked by its launch (activities/references.py)."""
        found = addresses.resolve_keys(self.state, query.keys)
        asking = self.state.find(query.replica_num, query.submission_num)
        return AddressAnswer(values=found.values, missing=found.missing,
                             placed=asking is not None and asking.placement is not None)

    @workflow.signal
    def stop(self) -> None:
        if not self.state.stopping:
            self.state.stopping = True
            self._note([lifecycle.Note("stop", "stop requested")])
            self.dirty = True

    @workflow.signal(name=RECORD_EVENT)
    def record_event(self, event: Event) -> None:
        """An event from outside the workflow (e.g. the reaper), kept in the decision log."""
        lifecycle.log(self.state, event)
        self.dirty = True

    @workflow.signal(name=REPLICA_CHANGED)
    def replica_changed(self, update: ReplicaUpdate) -> None:
        self._note(lifecycle.on_replica_update(self.state, update, workflow.now()))
        self.dirty = True

    @workflow.update
    def scale(self, request: ScaleRequest) -> int:
        self._note(lifecycle.rescale(self.state, request.group, request.count, workflow.now()))
        self.dirty = True
        return request.count

    @scale.validator
    def _validate_scale(self, request: ScaleRequest) -> None:
        _refuse(lambda: check_scale(self.state.config, self.state.stopping, request))

    @workflow.update
    def apply(self, request: ApplyRequest) -> ApplyResult:
        """A new configuration: counts apply at once, changed jobs roll out replica by replica."""
        result, notes = lifecycle.deploy(self.state, request.config)
        self._note(notes)
        self.dirty = True
        return result

    @apply.validator
    def _validate_apply(self, request: ApplyRequest) -> None:
        _refuse(lambda: check_apply(self.state.name, self.state.config, self.state.stopping, request.config))

    @workflow.update
    def rollback(self) -> ApplyResult:
        """Back to the configuration before the last apply."""
        assert self.state.previous_config is not None
        return self.apply(ApplyRequest(config=self.state.previous_config))

    @rollback.validator
    def _validate_rollback(self) -> None:
        if self.state.previous_config is None:
            raise ApplicationError("nothing to roll back to: the service has had one configuration",
                                   type="NoPrevious")
        self._validate_apply(ApplyRequest(config=self.state.previous_config))

    # The same scale and apply as signals, for tools that can only signal (the Web UI, `temporal workflow
    # signal`). A signal cannot answer and arrives raw: the loop has it judged by a local activity, whose
    # verdict history keeps; a refused one becomes a `rejected` event and changes nothing.

    @workflow.signal(name="replicas_down")
    def replicas_down(self, news: FleetDowns) -> None:
        """A backend's fleet monitor saw these serving replicas go down, and unrouted them."""
        self.watchers.heard(news)

    @workflow.signal(name="scale")
    def scale_signal(self, payload: Any) -> None:
        self.signals.append(("scale", payload))
        self.dirty = True

    @workflow.signal(name="apply")
    def apply_signal(self, payload: Any) -> None:
        self.signals.append(("apply", payload))
        self.dirty = True

    # --- the loop ---------------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: ServiceRunInput) -> str:
        await self._begin()
        try:
            while not self.state.stopping:
                await self._pass()
                await self._idle()
                if self._should_continue() and not self.state.stopping:
                    await workflow.wait_condition(workflow.all_handlers_finished)
                    self.state.replicas = prune(self.state.replicas)
                    workflow.continue_as_new(inp.model_copy(update={"state": self.state}))
        except asyncio.CancelledError:
            self.state.stopping = True
            await self._shutdown()
            raise
        await self._shutdown()
        return "failed" if self.state.failure else "stopped"

    async def _begin(self) -> None:
        state = self.state
        # The patches (CONTRIBUTING.md), asked first: their markers are then the run's first commands, ahead of the
        # local activity below. Runs recorded before them put the route first and started the replicas a workflow
        # task later (a replica registers only once it answers, long after the route is there), noticed only
        # serving replicas' workflows closing, and continued as new as soon as they were past the limit.
        self.route_beside = workflow.patched(ROUTE_BESIDE_REPLICAS)
        self.children.watch = workflow.patched(WATCH_CHILDREN)
        self.settle_first = workflow.patched(CONTINUE_WHEN_SETTLED)
        self.route.say_unavailable = workflow.patched(ROUTE_UNAVAILABLE)
        self.bytes_bound = workflow.patched(HISTORY_BYTES)
        self.keep_timer = workflow.patched(IDLE_TIMER_KEPT)
        # Asked of every service, scaled or not: an apply may give a group `scaling` later in the run.
        self.steady_down = workflow.patched(STEADY_DOWN)
        self.start_bytes = workflow.info().get_current_history_size()
        if routers.synced(state.config) is not None:  # asked only where it matters: no marker in other services
            self.router_sync = self.watchers.sync_router = workflow.patched(ROUTER_SYNC)
        if self.inp.fleet_monitor:  # asked only where it matters: no marker in services that watch on their own
            self.watchers.fleet = workflow.patched(FLEET_MONITOR)
        if addresses.one_place(state.config):  # the same: only services whose replicas reach each other
            state.one_place = workflow.patched(ONE_PLACE)
        workflow.set_current_details(views.details(views.status_view(state)))  # a new run shows it at once
        if workflow.patched(VALIDATE_START) and not self._judged_before():
            await self._judge_start()
        if state.submitted_at is None:
            state.submitted_at = workflow.now()
            self._note([lifecycle.Note("apply", f"service submitted, deployment {state.deployment_num}")])
        state.groups = sync_groups(state.config, state.groups)
        state.backends = await workflow.execute_local_activity(
            interface.served_backends, start_to_close_timeout=timedelta(seconds=10), summary="backends")
        if not self.route_beside:
            self._note(await self.route.sync(state))

    async def _pass(self) -> None:
        self.dirty = False  # cleared before the pass, so a message during it is never lost
        expired = lifecycle.expire(self.state, workflow.now())
        if expired:  # `max_duration` reached: the loop ends and the shutdown follows
            self._note(expired)
            return
        await self._judge_signals()
        if self.route_beside:  # the route and the replicas' starts go out in one workflow task
            routing = asyncio.ensure_future(self.route.sync(self.state))
            try:
                await self._act()
            finally:
                self._note(await routing)
        else:
            self._note(await self.route.sync(self.state))
            await self._act()
        if self.route.say_unavailable:  # what _act saw (a replica down, a back-off over) may change the reason
            self._note(await self.route.sync(self.state))
        if self.state.failure:  # a failure `retry` does not cover, in this pass or by signal: the shutdown follows
            return
        if not self._should_continue():  # a watcher started now would only be abandoned by the hop
            self.watchers.refresh(self.state)
        await self.publisher.publish(self.state)

    async def _act(self) -> None:
        """What the watchers saw, then the planner's starts and stops."""
        snapshot, downs, view, engines = self.watchers.take()
        downs += self.children.closed()  # the monitor watches serving replicas only, and their workflows every 5 s
        if snapshot is not None:
            self.state.stats = snapshot
        self._note(lifecycle.on_engines(self.state, engines))
        if view is not None:
            self._note(routers.on_view(self.state, view))
        for down in downs:
            await self._replace(down)
        await self._release_idle()
        if self.state.failure:
            return
        lifecycle.end_backoffs(self.state, workflow.now())
        self._note(lifecycle.autoscale(self.state, workflow.now(), fresh=snapshot is not None or bool(engines),
                                       steady=self.steady_down))
        plan = reconcile(self.state, workflow.now())
        self._note(lifecycle.remember_waits(self.state, plan))
        if plan:
            await self._apply(plan)

    async def _idle(self) -> None:
        """Sleep until a message, a watcher's news, a continue-as-new, or a back-off, a delay or `max_duration`
        ending."""
        now = workflow.now()
        due = lifecycle.next_due(self.state, now)
        wait = min(self.inp.safety_tick_seconds, (due - now).total_seconds() if due else float("inf"),
                   views.store_retry_seconds(self.state, self.inp.store_retry_seconds) or float("inf"))
        def news() -> bool:
            return self.dirty or self.state.stopping or self._should_continue() or self.watchers.done() or \
                self.children.any_closed()

        if self.keep_timer:
            at = now + timedelta(seconds=max(1.0, wait))
            if self.tick is None or self.tick.done() or self.tick_at is None or at < self.tick_at:
                self.tick, self.tick_at = asyncio.ensure_future(asyncio.sleep((at - now).total_seconds())), at
            tick = self.tick
            await workflow.wait_condition(lambda: news() or tick.done())
            return
        try:
            await workflow.wait_condition(news, timeout=timedelta(seconds=max(1.0, wait)),
                                          timeout_summary="until something changes")
        except asyncio.TimeoutError:
            pass  # the safety tick, a back-off, a scaling delay or `max_duration` has ended: decide again

    def _should_continue(self) -> bool:
        """Past the history limit in events or bytes (or suggested), once the replicas are settled; at twice the
        limit regardless."""
        info = workflow.info()
        length, size = info.get_current_history_length(), info.get_current_history_size()
        size -= self.start_bytes  # the run's own growth: a large state carried over must not make it hop at once
        heavy = self.bytes_bound and size > self.inp.history_bytes_limit
        if not (info.is_continue_as_new_suggested() or length > self.inp.history_limit or heavy):
            return False
        return not self.settle_first or lifecycle.settled(self.state) or length > 2 * self.inp.history_limit or \
            (self.bytes_bound and size > 2 * self.inp.history_bytes_limit)

    @staticmethod
    def _judged_before() -> bool:
        """A continued run's configuration was judged when the service began, or by the `apply` that brought it:
        judged again at every hop, a rule tightened by a release would fail a running service."""
        return workflow.info().continued_run_id is not None and workflow.patched(JUDGED_ONCE)

    async def _judge_start(self) -> None:
        """The run's configuration passes the rules `apply` runs, or the service stops, failed, with why."""
        verdict = await workflow.execute_local_activity(
            interface.judge_signal, SignalInput(kind="start", service=self.state.name, config=self.state.config),
            start_to_close_timeout=timedelta(seconds=10), summary="judge the configuration")
        if verdict.reason:
            self.state.failure, self.state.stopping = verdict.reason, True
            self._note([lifecycle.Note("rejected", verdict.reason)])

    async def _judge_signals(self) -> None:
        while self.signals:
            kind, payload = self.signals.pop(0)
            verdict = await workflow.execute_local_activity(
                interface.judge_signal, SignalInput(kind=kind, payload=payload, service=self.state.name,
                                                    config=self.state.config, stopping=self.state.stopping),
                start_to_close_timeout=timedelta(seconds=10), summary=f"judge a {kind} signal")
            if verdict.reason:
                self._note([lifecycle.Note("rejected", f"{kind} signal refused: {verdict.reason}")])
            elif verdict.scale is not None:
                self.scale(verdict.scale)
            elif verdict.apply is not None:
                self.apply(verdict.apply)

    async def _replace(self, down: Down) -> None:
        """A serving replica died (the monitor already unrouted it): stop it as failed; the planner replaces it."""
        replica, notes = lifecycle.on_down(self.state, down, workflow.now())
        self._note(notes)
        if replica is None:
            return
        request = StopRequest(reason=down.reason, failed=True, router=self._leave(replica))
        if down.workflow_closed:  # terminated from the Web UI: nobody else will tear its instance down
            await self.children.teardown_orphan(replica, request)
        else:
            await self.children.stop(replica, request)

    async def _apply(self, plan: Plan) -> None:
        state = self.state
        added, notes = lifecycle.add_replicas(state, plan, workflow.now())
        self._note(notes)
        if self.router_sync:
            routers.await_listing(state, added)
        work = [self._start(replica) for replica in added]
        for s in plan.stop:
            replica = state.find(s.replica_num, s.submission_num)
            if replica is not None:
                replica.stop_requested, replica.reason = True, s.reason
                work.append(self.children.stop(replica, StopRequest(reason=s.reason, router=self._leave(replica),
                                                                    idle_seconds=self._idle_seconds(replica, s))))
        await asyncio.gather(*work)

    def _idle_seconds(self, replica: Replica, stop: Stop) -> int:
        """How long a stopping replica may keep its instance idle (`idle_duration`, the patch asked only then): a
        scale-down or a rolling replacement of a replica started under it (the key its successors must match)."""
        seconds = self.state.config.idle_duration or 0
        if seconds and stop.reason in IDLE_REASONS and replica.placement_key and workflow.patched(KEEP_IDLE):
            return seconds
        return 0

    async def _release_idle(self) -> None:
        """Tell the replicas that left instances idle what became of them: taken by the replica placed there, or
        terminated (unplaced there, past `idle_duration`, of a removed group)."""
        state, now = self.state, workflow.now()
        if not idle.pending(state):
            return
        ends = idle.settled(state) + [(i, False) for i in idle.due(state, now)]
        for instance, taken in ends:
            if not taken:
                self._note([lifecycle.Note("replica", f"idle instance of replica {instance.replica_num} terminated",
                                           instance.group)])
        await asyncio.gather(*[self.children.release(i, terminate=not taken) for i, taken in ends])

    async def _start(self, replica: Replica) -> None:
        self._note(await self.children.start(replica))

    async def _shutdown(self) -> None:
        """Stop every replica, wait until each has torn down, then drop the gateway route. Behind a kept router, the
        router first: once it left the gateway and finished its requests, the workers behind it stop."""
        self.watchers.stop()
        if self.route.say_unavailable and self.state.failure:  # 503 with why, not held until the route goes
            self._note(await self.route.sync(self.state))
        router = routers.synced(self.state.config) if self.router_sync else None
        if router is not None:
            await self._stop_all(lambda r: r.group == router)
            await workflow.wait_condition(lambda: all(r.finished for r in self.state.replicas if r.group == router)
                                          or self.children.any_closed())
        await self._stop_all(lambda r: True)
        def finished() -> bool:
            return all(r.finished for r in self.state.replicas)

        while not finished():  # a replica whose workflow closes meanwhile is torn down here
            await workflow.wait_condition(lambda: finished() or self.children.any_closed())
            for down in self.children.closed():
                replica = self.state.find(down.replica_num, down.submission_num)
                await self.children.teardown_orphan(replica, StopRequest(reason=replica.reason or down.reason))
        await self._terminate_idle()
        await self.route.remove(self.state)
        self._note([lifecycle.Note("stop", "service stopped (failed)" if self.state.failure else "service stopped")])
        await self.publisher.publish(self.state)

    async def _terminate_idle(self) -> None:
        """A stopped service leaves no instance behind: its idle ones are terminated before the run ends."""
        state = self.state
        if not idle.pending(state):
            return
        taken = idle.settled(state)
        left, state.idle = state.idle + [i for i, took in taken if not took], []
        await asyncio.gather(*[self.children.release(i, terminate=False) for i, took in taken if took],
                             *[self.children.terminate_idle(i) for i in left])
        if left:
            self._note([lifecycle.Note("stop", f"{len(left)} idle instance(s) terminated")])

    async def _stop_all(self, which) -> None:
        leaving = [r for r in self.state.replicas if not r.finished and not r.stop_requested and which(r)]
        for replica in leaving:
            replica.stop_requested, replica.reason = True, "stopped"
        await asyncio.gather(*[self.children.stop(r, StopRequest(reason="stopped")) for r in leaving])
        await self.publisher.publish(self.state)

    def _leave(self, replica: Replica):
        """How a worker leaves the kept router before it stops (None: it is behind none)."""
        return routers.leave(self.state, replica) if self.router_sync else None

    # --- what the service shows and records -------------------------------------------------------

    def _note(self, notes: list[lifecycle.Note]) -> None:
        for note in notes:
            lifecycle.log(self.state, Event(at=workflow.now(), kind=note.kind, group=note.group,
                                            message=note.message))

def _refuse(check) -> None:
    """Run an admission rule in a validator: a refusal becomes the update's typed error."""
    try:
        check()
    except Refused as e:
        raise ApplicationError(str(e), type=e.kind) from None
