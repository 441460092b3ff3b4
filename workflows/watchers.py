"""The long activities a service keeps running while it serves: one stats watcher while some group
autoscales, one replica monitor per backend that has serving replicas, one engine watcher per backend that has
serving replicas of a group scaling on an engine signal, and one router sync while a router whose worker list
durastack keeps runs (``rules/routers.py``).

With the fleet monitor (``fleet``, workflows/fleet.py), a backend's monitor is not the service's activity: the
service tells the backend's fleet monitor what it watches and hears back by signal (``heard``); a backend whose
fleet monitor cannot be told (not started, terminated) gets the service's own monitor for the rest of the run.

Each returns only when something changed (a group's wanted count, a replica that died), so an idle
service writes no history. Each is restarted when what it watches changes, with a cancel request the
workflow does not wait for; at a continue-as-new none is cancelled: a watcher of a closed run learns it
at its next heartbeat and ends.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Optional

from temporalio import workflow
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from activities import interface
    from models.replica import replica_id
    from models.router import RouterView
    from models.messages import (Down, EngineGroupWatch, EngineWatch, FleetDowns, GroupWatch, MonitorInput, StatsWatch,
        Watched)
    from models.state import EngineSnapshot, ServiceState, StatsSnapshot
    from rules import routers
    from rules.autoscaler import GroupScaler, bounds, wanted
    from rules.lifecycle import group_signal
    from rules.jobs import replica_workflow_id
    from workflows.fleet import FleetMonitorWorkflow
    from rules.names import backend_queue, fleet_workflow_id
    from workflows.route import RETRY

ENGINES = "engines/"  # a backend's engine watcher's key


class Watchers:
    def __init__(self, heartbeat: timedelta) -> None:
        self.heartbeat = heartbeat
        # "stats", "router", "engines/<backend>" or a backend (its monitor) → (what, handle)
        self.running: dict[str, tuple[Any, ActivityHandle]] = {}
        self.sync_router = False  # whether a router's worker list is kept (patch router-sync, set by the service)
        self.fleet = False  # whether the backends' fleet monitors watch (patch fleet-monitor, set by the service)
        self.told: dict[str, MonitorInput] = {}  # backend → what its fleet monitor was told to watch (or will be)
        self.telling: dict[str, asyncio.Task] = {}  # backend → the signals going to its fleet monitor
        self.own: set[str] = set()  # backends whose fleet monitor could not be told: the service's own monitor
        self.heard_downs: list[Down] = []  # what the fleet monitors said is down, not yet taken
        self.fell_back = False  # a fleet monitor could not be told since the last ``take``

    def done(self) -> bool:
        return any(handle.done() for _, handle in self.running.values()) or bool(self.heard_downs) or self.fell_back

    def heard(self, news: FleetDowns) -> None:
        """A fleet monitor's news: these replicas are down (unrouted already)."""
        self.heard_downs += news.downs

    def take(self) -> tuple[Optional[StatsSnapshot], list[Down], Optional[RouterView], list[EngineSnapshot]]:
        """What the finished watchers saw; each is started again by the next ``refresh``."""
        snapshot, downs, view, engines = None, self.heard_downs, None, []
        self.heard_downs, self.fell_back = [], False
        for key, (_, handle) in list(self.running.items()):
            if not handle.done():
                continue
            del self.running[key]
            try:
                result = handle.result()
            except BaseException as e:  # noqa: BLE001 — cancelled, or failed for good: started again
                workflow.logger.warning("%s watcher ended: %s", key, e)
                continue
            if key == "stats":
                snapshot = result
            elif key == "router":
                view = result
            elif key.startswith(ENGINES):
                engines.append(result)
            else:
                downs += result
        return snapshot, downs, view, engines

    def refresh(self, state: ServiceState) -> None:
        """Start, restart or stop each watcher so that it watches what the state has now."""
        wanted_now = {} if state.stopping else _wanted(state, self.sync_router)
        if self.fleet:
            wanted_now = self._tell_fleets(state.name, wanted_now)
        for key in set(self.running) - set(wanted_now):
            self._cancel(key)
        for key, what in wanted_now.items():
            if key in self.running and self.running[key][0] == what:
                continue
            self._cancel(key)
            self.running[key] = (what, self._start(key, what))

    def stop(self) -> None:
        for key in list(self.running):
            self._cancel(key)
        for backend, told in list(self.told.items()):
            self._tell(backend, MonitorInput(service=told.service, backend=backend, replicas=[]))

    def _tell_fleets(self, service: str, wanted_now: dict[str, Any]) -> dict[str, Any]:
        """Tell each backend's fleet monitor what this service watches there; the rest is the service's own."""
        for backend in set(self.told) - set(wanted_now):
            self._tell(backend, MonitorInput(service=service, backend=backend, replicas=[]))
        for key, what in list(wanted_now.items()):
            if isinstance(what, MonitorInput) and key not in self.own:
                self._tell(key, what)
                del wanted_now[key]
        return wanted_now

    def _tell(self, backend: str, what: MonitorInput) -> None:
        if self.told.get(backend) == what or (backend not in self.told and not what.replicas):
            return
        self.told[backend] = what
        if backend not in self.telling or self.telling[backend].done():
            self.telling[backend] = asyncio.ensure_future(self._send(backend))

    async def _send(self, backend: str) -> None:
        """Signal the newest of what the backend's fleet monitor is to watch, in order, until it has it."""
        sent: Optional[MonitorInput] = None
        while backend in self.told and self.told[backend] != sent:
            what = self.told[backend]
            try:
                fleet = fleet_workflow_id(workflow.info().task_queue, backend)
                await workflow.get_external_workflow_handle(fleet).signal(
                    FleetMonitorWorkflow.watch, what)
            except Exception as e:  # noqa: BLE001 — no fleet monitor runs there: the service watches on its own
                workflow.logger.warning("fleet monitor of %s not told (%s): the service watches it itself", backend, e)
                self.own.add(backend)
                self.told.pop(backend, None)
                self.fell_back = True
                return
            sent = what

    def _cancel(self, key: str) -> None:
        entry = self.running.pop(key, None)
        if entry is not None and not entry[1].done():
            entry[1].cancel()
            entry[1].add_done_callback(_forget)

    def _start(self, key: str, what: Any) -> ActivityHandle:
        if key == "router":
            return workflow.start_activity(
                interface.sync_router, what, task_queue=backend_queue(workflow.info().task_queue, what.backend),
                start_to_close_timeout=timedelta(days=3650), heartbeat_timeout=self.heartbeat, retry_policy=RETRY,
                cancellation_type=ActivityCancellationType.TRY_CANCEL, summary="keep the router's worker list")
        if key.startswith(ENGINES):
            return workflow.start_activity(
                interface.watch_engines, what, task_queue=backend_queue(workflow.info().task_queue, what.backend),
                start_to_close_timeout=timedelta(days=3650), heartbeat_timeout=self.heartbeat, retry_policy=RETRY,
                cancellation_type=ActivityCancellationType.TRY_CANCEL, summary=f"read engines on {what.backend}")
        if key == "stats":
            return workflow.start_activity(
                interface.watch_stats, what, start_to_close_timeout=timedelta(hours=1),
                heartbeat_timeout=self.heartbeat, retry_policy=RETRY,
                cancellation_type=ActivityCancellationType.TRY_CANCEL, summary="watch gateway stats")
        return workflow.start_activity(
            interface.monitor_replicas, what, task_queue=backend_queue(workflow.info().task_queue, key),
            start_to_close_timeout=timedelta(days=3650), heartbeat_timeout=self.heartbeat, retry_policy=RETRY,
            cancellation_type=ActivityCancellationType.TRY_CANCEL, summary=f"watch replicas on {key}")


def _wanted(state: ServiceState, sync_router: bool = False) -> dict[str, Any]:
    """What each watcher should watch now: keys are "stats", "router" and the backends with serving replicas (and
    ready workers a router does not list yet)."""
    out: dict[str, Any] = {}
    stats = _stats_watch(state)
    if stats is not None:
        out["stats"] = stats
    sync = routers.sync_input(state) if sync_router else None
    if sync is not None:
        out["router"] = sync
    by_backend: dict[str, list[Watched]] = {}
    for r in state.replicas:
        up = r.serves or (r.synced is False and r.ready and r.active and r.status == "running")
        if up and r.instance is not None and r.placement is not None:
            by_backend.setdefault(r.placement.backend, []).append(Watched(
                replica_num=r.replica_num, submission_num=r.submission_num, group=r.group,
                workflow_id=replica_workflow_id(state.name, r.group, r.replica_num, r.submission_num),
                replica_id=replica_id(state.name, r.group, r.replica_num, r.submission_num), instance=r.instance))
    for backend, watched in by_backend.items():
        out[backend] = MonitorInput(service=state.name, backend=backend, replicas=watched)
    for backend, watch in _engine_watches(state, by_backend).items():
        out[ENGINES + backend] = watch
    return out


def _engine_watches(state: ServiceState, by_backend: dict[str, list[Watched]]) -> dict[str, EngineWatch]:
    """Per backend, its serving replicas of groups that scale on an engine signal, and what each group's other
    backends last read (the wanted count is the whole group's)."""
    specs = {g.name: g for g in state.config.replica_groups if g.scaling is not None and g.scaling.engine}
    if not specs:
        return {}
    serving = {name: {r.key for r in state.latest() if r.group == name and r.serves} for name in specs}
    out = {}
    for backend, watched in by_backend.items():
        mine = [w for w in watched if w.group in specs and (w.replica_num, w.submission_num) in serving[w.group]]
        if not mine:
            continue
        snap = state.engines.get(backend)
        groups = []
        for name, spec in specs.items():
            scaler = GroupScaler.of(spec)
            scaling = scaler.scaling
            others = [s for b, e in state.engines.items() if b != backend for s in e.replicas
                      if s.group == name and (s.replica_num, s.submission_num) in serving[name]]
            read = [s.value for s in others if s.value is not None]
            total = group_signal(state, name)[0]
            now = scaler.wanted(total)[0] if total is not None else -1
            groups.append(EngineGroupWatch(
                name=name, metric=scaling.metric, target=scaling.target, window=scaling.window, lo=scaler.lo,
                hi=scaler.hi, path=spec.metrics.path if spec.metrics else "/metrics",
                others=sum(read), others_read=len(read), others_counted=len(read) + sum(s.unreadable for s in others),
                wanted=now))
        known = [s for s in snap.replicas if (s.replica_num, s.submission_num) in serving.get(s.group, set())] \
            if snap is not None else []
        out[backend] = EngineWatch(service=state.name, backend=backend, groups=groups, replicas=mine, known=known)
    return out


def _stats_watch(state: ServiceState) -> Optional[StatsWatch]:
    snap = state.stats
    groups = []
    for g in state.config.replica_groups:
        if g.scaling is None:
            continue
        lo, hi = bounds(g)
        if g.scaling.engine:  # the gateway only says whether requests arrive, for a group that may sleep
            if lo != 0:
                continue
            hi = min(hi, 1)
        now = wanted(snap.rate(g.scaling.window), g.scaling.target, lo, hi)[0] if snap is not None else -1
        groups.append(GroupWatch(name=g.name, target=g.scaling.target, window=g.scaling.window, lo=lo, hi=hi,
                                 wanted=now))
    return StatsWatch(service=state.name, groups=groups) if groups else None


def _forget(handle: ActivityHandle) -> None:
    """A cancelled watcher's outcome is of no interest; reading it keeps asyncio from reporting it."""
    if not handle.cancelled():
        handle.exception()
