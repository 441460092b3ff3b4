"""FakeCloud: every activity of a service run, faked and recorded, for the time-skipping workflow tests.

Shared by tests/test_service_workflow.py, tests/test_soak.py and tests/histories/capture.py. Each fake takes its
stub's name (``@implements``, activities/interface.py); the replica's activities run on ``<queue>-local``, the
backend ``served_backends`` names, and report to the service by signal as the real ones do (activities/report.py).

The time-skipping server does not skip time while an activity runs, so for long virtual waits the
watchers *poll* (``polling = True``): each attempt checks once and fails, and the retry is a server
timer. For a month of virtual time the fakes choose that retry's delay (``next_retry_delay``):
``poll_every`` for a replica's watch, and for the stats watcher ``traffic``, the gateway's request rate
as a function of virtual time (read with ``clock``), so it looks again exactly when the rate changes.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone
from typing import AsyncIterator, Awaitable, Callable, Optional

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory
from temporalio.service import RPCError
from temporalio.worker import Worker

from activities import interface
from activities.engines import changed as engines_changed
from activities.fleet import FleetWatch
from activities.fleet import ORPHANED_BY
from activities.interface import implements
from activities.references import resolve_late
from activities.report import FINISHED, PROVISIONED, PROVISIONING, SERVING, TERMINATING, replica_update, send_report
from activities.signals import judge_signal
from activities.stats import changed
from models.failures import NOT_READY_YET
from models.replica import LocalInstance
from models.router import RouterEntry, RouterState, RouterSyncInput, RouterView
from models.messages import (Down, EngineWatch, FleetInput, Launched, LaunchInput, LaunchStep, MonitorInput,
    RecordResult, ReplicaInput, ReplicaUpdate, RouteInput, ServiceRecord, StatsWatch, TeardownInput)
from models.state import EngineSnapshot, Placement, ReplicaSignal, StatsSnapshot
from models.views import Event, ServiceStatus
from workflows.fleet import FleetMonitorWorkflow
from rules.names import backend_queue
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunWorkflow

HUNG_IMAGE = "example/llm:latest"  # what a hung replica's pull says it pulls
# The request rate at a virtual time, and when it next changes.
Traffic = Callable[[datetime], tuple[float, datetime]]


class FakeCloud:
    """Fake activities that record every call, in order, so tests can check the lifecycle."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.instances: dict[str, str] = {}  # replica_id → state
        self.routed: set[str] = set()
        self.crash: dict[str, asyncio.Event] = {}
        self.provisions: dict[str, int] = {}
        self.commands: dict[str, list[str]] = {}  # replica_id → what it was provisioned to run
        self.envs: dict[str, dict[str, str]] = {}  # replica_id → the env it runs with
        self.inputs: dict[str, ReplicaInput] = {}  # replica_id → its launch's input, as the workflow gave it
        self.lost_reports: set[str] = set()  # replica ids whose launch's `serving` report never arrives
        self.served = ["local"]  # the backends the deployment says it serves: only local has a worker here
        self.rps: float | None = None  # what the fake gateway reports; None = no stats
        self.polling = False  # watchers check once per attempt (see the module doc)
        self.traffic: Optional[Traffic] = None  # overrides ``rps`` when set; needs ``clock``
        self.poll_every: Optional[timedelta] = None  # a polling replica watch's retry delay (None: its policy's)
        self.clock: Optional[Callable[[], Awaitable[datetime]]] = None  # the server's virtual time
        self.max_alive: dict[str, int] = {}  # most instances of a group alive at once
        self.log_by_seq: dict[int, Event] = {}  # the store's decision log (one service per test)
        self.rows: dict[str, ServiceStatus] = {}  # the store's read model
        self.routes: list[RouteInput] = []  # every route put on the gateway, in order
        self.refuse_routes = ""  # the gateway answers every route put with this 4xx message while set
        self.store_down = False  # the store refuses writes while set (record_service fails)
        self.record_calls = 0  # attempts to write the store, failed ones too
        self.queue = ""
        self.addresses = 0  # instances given an address so far
        self.ips: dict[str, str] = {}  # each instance's address (the order instances start in is a race)
        self.hang: set[str] = set()  # replica ids whose launch makes the instance, then its pull never ends
        self.router_lists: dict[str, dict[str, str]] = {}  # router replica id → worker url → worker type
        self.newest_sync: dict[str, float] = {}  # service → when its newest router sync was scheduled
        self.router_down: set[str] = set()  # router replica ids whose worker API does not answer
        self.engines: dict[str, float | str] = {}  # replica id → its engine signal, or why it cannot be read
        self.engine_default: float | str = "unreachable: ConnectError"  # a replica ``engines`` does not name
        self.pulls: dict[str, int] = {}  # replica id → start steps run (each would pull its image)
        self.started: dict[str, datetime] = {}  # replica id → when its commands started, virtual time
        self.loads: dict[str, timedelta] = {}  # replica id → how long its model loads before it is ready
        self.load_default = timedelta(0)
        self.load_poll: Optional[timedelta] = None  # a loading replica's readiness retry delay (None: its policy's)
        self.ready_attempts: dict[str, int] = {}  # replica id → readiness attempts while it loaded
        self.delayed: set[int] = set()  # the steps (``Step``) whose reports arrive late
        self.held: list[tuple[str, ReplicaUpdate]] = []  # reports held back: (service workflow id, report)
        self.vms: dict[str, str] = {}  # replica id → the VM it runs on (``vm-N``; a reused one runs two in turn)
        self.images: dict[str, int] = {}  # VM → image downloads on it (an image already there is no download)
        self.keeps = True  # the backend can keep an instance idle (a cloud's, over SSH)

    async def _report(self, service_workflow_id: str, job, seq: int, status: str, **fields) -> None:
        """As activities/report.py: a signal to the service. A report of a step in ``delayed`` is held back until
        ``deliver_held``: it arrives late, after the reports of later steps."""
        update = replica_update(job, seq, status, **fields)
        if seq in self.delayed:
            self.held.append((service_workflow_id, update))
            return
        try:
            await send_report(activity.client(), service_workflow_id, update)
        except RPCError as e:  # as the real one: never fails the activity
            self.log.append(("report_lost", f"{job.replica_id}: {e}"))

    async def deliver_held(self, client) -> int:
        """Send the reports held back so far; how many."""
        held, self.held = self.held, []
        for wid, update in held:
            await send_report(client, wid, update)
        return len(held)

    async def _now(self) -> datetime:
        """The server's time (virtual on the time-skipping server) when ``clock`` is set, else this attempt's
        schedule time, which the server set."""
        return await self.clock() if self.clock is not None else activity.info().current_attempt_scheduled_time

    @staticmethod
    def _poll_again(message: str, delay: Optional[timedelta]) -> ApplicationError:
        """A failed attempt; the retry comes after ``delay`` (None: the activity's retry policy decides).

        Benign: the worker logs it at debug level, not as a warning with a traceback per poll."""
        return ApplicationError(message, next_retry_delay=delay, category=ApplicationErrorCategory.BENIGN)

    @staticmethod
    def _off_grid(delay: Optional[timedelta]) -> Optional[timedelta]:
        """A monitor's next poll, half a second off the hourly grid the soak's steps (and so the service's
        restarts of its monitors) fall on. The time-skipping test server leaks its time lock when a polling
        activity's retry falls due in the same instant as the workflow task that cancels it (the retry is
        queued for an activity already gone, and virtual time stops for good); a real server drops it."""
        return delay + timedelta(milliseconds=500) if delay is not None else None

    async def _reading(self, watch: StatsWatch) -> tuple[Optional[float], bool, Optional[timedelta]]:
        """The rate now, whether the watcher's ``max_seconds`` are up, and when to look again."""
        if self.traffic is None:
            return self.rps, False, None
        assert self.clock is not None, "traffic needs a clock"
        now = await self.clock()
        rps, until = self.traffic(now)
        # As the real watcher: a snapshot after max_seconds even without a change.
        deadline = activity.info().scheduled_time + timedelta(seconds=watch.max_seconds)
        wait = min(until + timedelta(seconds=1), deadline) - now
        return rps, now >= deadline, max(timedelta(seconds=1), wait)

    async def _down(self, inp: MonitorInput) -> list[Down]:
        """Watched replicas whose instance crashed or whose workflow ended without tearing down."""
        downs = []
        for w in inp.replicas:
            if self.crash.setdefault(w.replica_id, asyncio.Event()).is_set():
                downs.append(Down(replica_num=w.replica_num, submission_num=w.submission_num, reason="exited (1)"))
                continue
            info = await activity.client().get_workflow_handle(w.workflow_id).describe()
            if info.status in ORPHANED_BY:
                downs.append(Down(replica_num=w.replica_num, submission_num=w.submission_num, workflow_closed=True,
                                  reason=f"replica workflow {info.status.name.lower()}"))
        for w in inp.replicas:
            if any(d.replica_num == w.replica_num and d.submission_num == w.submission_num for d in downs):
                self.routed.discard(w.replica_id)  # unrouted before the service hears of it
                self.log.append(("unregister", w.replica_id))
        return downs

    def replica_activities(self):
        """The replica's life on the fake backend (``local``): what ``<queue>-local`` runs."""

        @implements(interface.place_replica)
        async def place(inp: LaunchInput) -> Launched:
            r, rid = inp.replica, inp.replica.job.replica_id
            self.inputs[rid] = r
            await self._report(r.service_workflow_id, r.job, PROVISIONING, "provisioning")
            if any("crash" in c for c in r.job.commands):
                self.log.append(("crash", rid))
                raise ApplicationError("exited (1)", type="ReplicaExited", non_retryable=True)
            reused = r.reuse.replica_id if isinstance(r.reuse, LocalInstance) else None
            if reused is not None and self.instances.get(reused) in ("idle", "moved") and \
                    self.vms[reused].startswith(f"vm-{r.job.service}-{r.job.group}-"):  # never another's
                self.instances[reused] = "moved"  # as a retag: a second attempt finds it moved already
                self.vms[rid] = self.vms[reused]
                self.log.append(("reuse", rid))
            else:
                self.provisions[rid] = self.provisions.get(rid, 0) + 1
                self.vms[rid] = f"vm-{r.job.service}-{r.job.group}-{len(self.vms)}"
                self.log.append(("provision", rid))
            self.instances[rid] = "running"
            group = r.job.group
            alive = sum(1 for x, st in self.instances.items() if st == "running" and x.split("/")[1] == group)
            self.max_alive[group] = max(self.max_alive.get(group, 0), alive)
            # Each instance its own address, as a cloud gives: a replacement has a new one.
            self.addresses += 1
            self.ips[rid] = f"10.0.{self.addresses // 250}.{self.addresses % 250 + 1}"
            placement = Placement(backend="local", region="local", address=f"unix:/x/{rid}", ip=self.ips[rid],
                                  instance_id=self.vms[rid])
            instance = LocalInstance(replica_id=rid, pid=0, start_time=0, work_dir=f"/x/{rid}",
                                     address=placement.address, isolated=False, log_path=f"/x/{rid}/log")
            return Launched(placement=placement, instance=instance)

        @implements(interface.start_replica)
        async def start(inp: LaunchStep) -> Launched:
            r, rid = inp.replica, inp.replica.job.replica_id
            placement, instance = inp.launched.placement, inp.launched.instance
            self.pulls[rid] = self.pulls.get(rid, 0) + 1
            vm = self.vms.get(rid, rid)
            self.images[vm] = self.images.get(vm, 0) + (0 if vm in self.images else 1)
            if rid in self.hang:  # an image pull that never ends: heartbeating, so a cancellation reaches it
                try:
                    while True:
                        activity.heartbeat(f"{rid}: pulling {HUNG_IMAGE}: 1/3 layers")
                        await asyncio.sleep(0.1)
                except asyncio.CancelledError:
                    self.log.append(("launch_cancelled", rid))
                    raise
            await self._report(r.service_workflow_id, r.job, PROVISIONED, "running", placement=placement,
                               instance=instance)
            r, refs = await resolve_late(r, placement, instance)  # as the real launch: once placed
            self.commands[rid], self.envs[rid] = list(r.job.commands), dict(r.job.env)
            if self.loads.get(rid, self.load_default):  # its load is timed from here
                self.started[rid] = await self._now()
            return inp.launched.model_copy(update={"refs": refs, "done": "started"})

        @implements(interface.await_ready)
        async def await_ready(inp: LaunchStep) -> None:
            r, rid = inp.replica, inp.replica.job.replica_id
            loads = self.loads.get(rid, self.load_default)
            if loads:  # the server's clock says whether it has loaded: each attempt looks once
                self.ready_attempts[rid] = self.ready_attempts.get(rid, 0) + 1
                waited = await self._now() - self.started[rid]
                if waited < loads:  # as the real step's attempt ends (ProbeStreaks.not_yet)
                    raise ApplicationError(f"not ready yet (loading, {waited} of {loads})", type=NOT_READY_YET,
                                           next_retry_delay=self.load_poll, category=ApplicationErrorCategory.BENIGN)
            self.log.append(("ready", rid))
            if r.route:
                self.routed.add(rid)
                self.log.append(("register", rid))
            if rid not in self.lost_reports:  # a report is fire-and-forget: it may be lost
                launched = inp.launched
                await self._report(r.service_workflow_id, r.job, SERVING, "running", ready=True, registered=r.route,
                                   placement=launched.placement, instance=launched.instance, refs=launched.refs)

        @implements(interface.launch_replica)
        async def launch(inp: LaunchInput) -> Launched:
            """The three steps at once, as the worker runs them for runs recorded before the steps."""
            step = LaunchStep(replica=inp.replica, backend=inp.backend, launched=await place(inp))
            step = step.model_copy(update={"launched": await start(step)})
            await await_ready(step)
            return step.launched

        @implements(interface.teardown_replica)
        async def teardown(inp: TeardownInput) -> bool:
            rid = inp.job.replica_id
            if inp.idle:  # as CloudReplicas.stop_idle: left alone once another replica runs on it
                if self.instances.get(rid) == "idle":
                    self.instances[rid] = "terminated"
                    self.log.append(("terminate", rid))
                return False
            await self._report(inp.service_workflow_id, inp.job, TERMINATING, "terminating", reason=inp.reason)
            if inp.router is not None:  # the worker leaves the routers before it stops
                for target in inp.router.routers:
                    if self.router_lists.get(target.instance.replica_id, {}).pop(inp.router.url, None):
                        self.log.append(("router_leave", rid))
            if rid in self.routed:
                self.routed.discard(rid)
                self.log.append(("unregister", rid))
            if inp.keep and self.keeps and self.instances.get(rid) == "running":
                self.instances[rid] = "idle"
                self.log.append(("idle", rid))
                await self._report(inp.service_workflow_id, inp.job, FINISHED, inp.final, reason=inp.reason,
                                   instance=inp.instance, idle=True)
                return True
            if rid in self.instances:
                self.instances[rid] = "terminated"
                self.log.append(("terminate", rid))
            await self._report(inp.service_workflow_id, inp.job, FINISHED, inp.final, reason=inp.reason)
            return False

        @implements(interface.monitor_replicas)
        async def monitor(inp: MonitorInput) -> list[Down]:
            while True:
                downs = await self._down(inp)
                if downs:
                    return downs
                if self.polling:
                    raise self._poll_again("all serving; poll again", self._off_grid(self.poll_every))
                activity.heartbeat()
                await asyncio.sleep(0.2)

        @implements(interface.sync_router)
        async def sync_router(inp: RouterSyncInput) -> RouterView:
            """A router's worker list in memory: put right at once, each worker healthy, its type its group's name.
            An older sync stops acting once the service starts a newer one, as the real one does."""
            mine = activity.info().scheduled_time.timestamp()
            self.newest_sync[inp.service] = max(self.newest_sync.get(inp.service, 0.0), mine)
            while True:
                if self.newest_sync[inp.service] > mine:
                    return inp.known
                changes, routers = [], []
                for t in inp.routers:
                    rid = t.instance.replica_id
                    if rid in self.router_down:
                        routers.append(RouterState(replica_num=t.replica_num, submission_num=t.submission_num,
                                                   reachable=False, error="connection refused"))
                        continue
                    known = self.router_lists.setdefault(rid, {})
                    wanted = {w.url: w for w in inp.workers}
                    for url in [u for u in known if u not in wanted]:
                        del known[url]
                        changes.append(f"router r{t.replica_num}: removed {url}")
                        self.log.append(("router_remove", url))
                    for url, w in wanted.items():
                        if url not in known:
                            known[url] = w.group
                            changes.append(f"router r{t.replica_num}: added {w.group} replica {w.replica_num}")
                            self.log.append(("router_add", url))
                    routers.append(RouterState(replica_num=t.replica_num, submission_num=t.submission_num,
                                               workers=[RouterEntry(url=u, worker_type=k, healthy=True)
                                                        for u, k in sorted(known.items())]))
                view = RouterView(routers=routers, changes=changes)
                if changes or view.without_changes() != inp.known.without_changes():
                    # A real router's calls take a while: one returning the instant it starts races the service's
                    # cancel of it, which the time-skipping server cannot take (ACTIVITY_UNKNOWN).
                    await asyncio.sleep(0.3)
                    return view
                if self.polling:
                    raise self._poll_again("router in sync; poll again", self._off_grid(self.poll_every))
                activity.heartbeat()
                await asyncio.sleep(0.2)

        @implements(interface.watch_engines)
        async def watch_engines(inp: EngineWatch) -> EngineSnapshot:
            """Each replica's engine signal is ``engines[replica id]`` (a value, or a string: why it is unread),
            its window's value already; when it is told as the real watcher tells it (activities/engines.py)."""
            known = {(s.replica_num, s.submission_num): s for s in inp.known}
            while True:
                signals = []
                for w in inp.replicas:
                    got = self.engines.get(w.replica_id, self.engine_default)
                    signals.append(ReplicaSignal(replica_num=w.replica_num, submission_num=w.submission_num,
                                                 group=w.group, value=None if isinstance(got, str) else got,
                                                 error=got if isinstance(got, str) else ""))
                if engines_changed(inp.groups, signals, known):
                    await asyncio.sleep(0.3)  # as sync_router: a return at once races the service's cancel
                    return EngineSnapshot(backend=inp.backend, at=datetime.now(timezone.utc), replicas=signals)
                if self.polling:
                    raise self._poll_again("engines steady; poll again", self._off_grid(self.poll_every))
                activity.heartbeat()
                await asyncio.sleep(0.2)

        @implements(interface.watch_fleet)
        async def watch_fleet(inp: FleetInput) -> None:
            """The real fleet watch (activities/fleet.py) over this cloud: an instance is down once crashed."""
            await FleetWatch(inp, _FleetView(self), _FleetGateway(self), activity.client(),
                             activity.info().workflow_id).run()

        return [place, start, await_ready, launch, teardown, monitor, sync_router, watch_engines, watch_fleet]

    def activities(self):
        """The service's activities: what the main queue runs."""

        @implements(interface.served_backends)
        async def served_backends() -> list[str]:
            return list(self.served)

        @implements(interface.ensure_route)
        async def ensure_route(inp: RouteInput) -> None:
            if self.refuse_routes:
                raise ApplicationError(self.refuse_routes, type="RouteRefused", non_retryable=True)
            self.log.append(("route", inp.service))
            self.routes.append(inp)

        @implements(interface.remove_route)
        async def remove_route(inp: RouteInput) -> None:
            self.log.append(("unroute", inp.service))

        @implements(interface.watch_stats)
        async def watch_stats(watch: StatsWatch) -> StatsSnapshot:
            while True:
                rps, due, wait = await self._reading(watch)
                if rps is not None:
                    snap = StatsSnapshot(rps={w: rps for w in (30, 60, 300)})
                    if changed(watch, snap) or due:
                        return snap
                if self.polling:
                    raise self._poll_again("no change yet; poll again", wait)
                activity.heartbeat()
                await asyncio.sleep(0.1)

        @implements(interface.record_service)
        async def record(rec: ServiceRecord) -> Optional[RecordResult]:
            self.record_calls += 1
            if self.store_down:
                raise ApplicationError("attempt to write a readonly database", type="StoreUnavailable")
            # Local activities run at least once: the store keys entries by seq.
            first = min((e.seq for e in rec.events), default=0)
            last_before = max((seq for seq in self.log_by_seq if seq < first), default=0)
            self.log_by_seq.update({e.seq: e for e in rec.events})
            self.rows[rec.service] = rec.status
            return RecordResult(last_before=last_before)

        return [ensure_route, remove_route, watch_stats, record, served_backends, judge_signal]

    def running(self) -> set[str]:
        return {rid for rid, s in self.instances.items() if s == "running"}


class _FleetView:
    """FakeCloud as the fleet watch sees a backend."""

    min_poll_seconds = 0.0

    def __init__(self, cloud: FakeCloud) -> None:
        self.cloud = cloud

    async def adopt(self, service: str, watched: list) -> None:
        """Nothing held for a replica: no tunnel to open again."""

    async def down(self, instances: list) -> list[Optional[str]]:
        return ["exited (1)" if self.cloud.crash.setdefault(i.replica_id, asyncio.Event()).is_set() else None
                for i in instances]


class _FleetGateway:
    def __init__(self, cloud: FakeCloud) -> None:
        self.cloud = cloud

    async def unregister(self, service: str, replica_id: str) -> None:
        self.cloud.routed.discard(replica_id)
        self.cloud.log.append(("unregister", replica_id))


async def fake_cloud_worker(env, fake: Optional[FakeCloud] = None) -> AsyncIterator[FakeCloud]:
    """A FakeCloud and a worker running both workflows with it, on a task queue of their own."""
    fake = fake or FakeCloud()
    queue = f"tq-{uuid.uuid4()}"
    async with Worker(env.client, task_queue=queue, workflows=[ServiceRunWorkflow, ReplicaWorkflow, FleetMonitorWorkflow],
                      activities=fake.activities()), \
            Worker(env.client, task_queue=backend_queue(queue, "local"), activities=fake.replica_activities()):
        fake.queue = queue
        yield fake
    for event in fake.crash.values():
        event.set()
