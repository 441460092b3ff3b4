"""The activities of a replica's life, and of a service's gateway route.

A replica's life is three activities, each on its backend's task queue ``<queue>-<backend>``
(``rules.names.backend_queue``), so the workflow picks the backend by picking the queue:

* the launch, in three steps: ``place_replica`` (exactly once: a retried attempt reuses what an earlier one made),
  ``start_replica`` (its image and commands, once), ``await_ready`` (probes, then the gateway) — reporting to the
  service as they go (activities/report.py); ``launch_replica``, all three at once, for runs recorded before;
* ``monitor_replicas``: one per service and backend, heartbeating while every watched replica serves;
* ``teardown_replica``: leave the gateway, drain, terminate, report the end. Idempotent.

What differs per backend (placing, readiness, liveness, terminating) is behind ``LocalReplicas`` (below) and
``CloudReplicas`` (activities/replica_cloud.py). Dependencies are injected, so tests can swap any of them.
Errors that retrying cannot fix are raised non-retryable, with a message a person can act on; everything
else is left to Temporal's retries.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import interface
from activities.engines import EngineActivities
from activities.fleet import FleetWatch, closed_workflows, down_of, merged
from activities.interface import implements, refusal_error
from activities.liveness import heartbeating, keeps_alive, progress
from activities.metrics import provisioning_failed
from activities.probes import ProbeStreaks, answers_http
from activities.references import resolve_late
from activities.replica_cloud import CloudReplicas
from activities.report import FINISHED, PROVISIONING, SERVING, TERMINATING, report, report_placed, unless_quick
from activities.router import RouterActivities
from activities.watch import SLACK, watch_until_down
from backends.base import Backend
from backends.catalog import local_offer
from backends.local import OWN_LINES, LocalBackend, UnsupportedJobError
from backends.local_cgroup import Limits, limits_for
from backends.runtime import local_limits
from gateway.client import GatewayClient, GatewayError
from models.backends import CLOUDS
from models.failures import LAST_LINES, NOT_READY_YET, not_ready_within, with_output
from models.offers import describe_mismatch, match_offers
from models.replica import JobSpec, LocalInstance
from models.reservations import ReservationLookup
from models.messages import (READY_ATTEMPT_SECONDS, Down, FleetInput, Launched, LaunchInput, LaunchStep, MonitorInput,
    PlacementRefusal, ReplicaInput, RouteInput, TeardownInput, Watched)
from models.router import Instance
from models.state import Placement
from models.service import ProbeSpec

log = logging.getLogger("durastack.replica")
QUICK_SECONDS = 1.0  # see ReplicaActivities
READY_POLL_SECONDS = 0.2  # an app that just started answers within a few of these
# The first polls come sooner, growing to READY_POLL_SECONDS: most apps answer within a second of their spawn, and
# a fixed 0.2 s poll added 0.1 s on average (up to 0.2 s) to every replica's readiness.
FIRST_READY_POLL_SECONDS = 0.05
# A poll unanswered within this is given up and made again on a new connection, its timeout doubling up to
# ANSWER_TIMEOUT_SECONDS (a slow app is still seen). While a local replica's link comes up on its service's bridge,
# the stream proxy's first SYN to it can be lost, and TCP sends it again only after 1 s: 4-5 of the 16 replicas of
# an apply waited that second (bench.control_plane, probes answered after 1.03-1.11 s); a new connection is a new SYN.
FIRST_ANSWER_TIMEOUT_SECONDS = 0.3
ANSWER_TIMEOUT_SECONDS = 2.0
# Threads for the local backend's blocking start and stop. Not asyncio's default pool: that one has cpus + 4
# threads (6 here), and 16 starts of an apply (or stops, which wait up to their grace period) filled it, so the
# liveness checks of replicas already started, which also run there, queued behind them.
LOCAL_THREADS = 64
# Tolerated difference between the Temporal server's clock (a launch's scheduled time) and this machine's.
CLOCK_SKEW_SECONDS = 5.0
DRAIN_POLL_SECONDS = 0.2
HEADER_LINES = 8  # at most, at the top of a local replica's log (backends/local.py)


class LocalReplicas(Backend):
    """Replicas as process trees on this machine (backends/local.py)."""

    min_poll_seconds = 0.0  # reading /proc is cheap
    one_activity = True  # a process tree starts in milliseconds

    def __init__(self, local: LocalBackend, enabled: bool = True):
        """``enabled``: False on cluster workers, whose own machine the gateway cannot reach."""
        self.local, self.enabled = local, enabled
        self._pool = ThreadPoolExecutor(LOCAL_THREADS, thread_name_prefix="local-replicas")

    async def _blocking(self, fn, *args):
        """``fn(*args)`` on this backend's own threads (see ``LOCAL_THREADS``)."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(ctx.run, fn, *args))

    async def place(self, inp: ReplicaInput, backend: str) -> tuple[Placement, LocalInstance]:
        if not self.enabled:
            raise refusal_error(PlacementRefusal(backend="local", tried=False, reasons=[
                "this worker runs no replicas on its own machine (DURASTACK_LOCAL_REPLICAS=off)"]))
        # The local machine has no spot market: the spot policy does not apply to it.
        offers = [local_offer()]
        filters = dict(spot_policy="auto", max_price=inp.max_price, backends=["local"], regions=inp.regions,
                       instance_types=inp.instance_types, zones=inp.zones,
                       reservation=ReservationLookup(name=inp.reservation, notes=["this machine has no reservations"])
                       if inp.reservation else None)
        if not match_offers(offers, inp.resources, **filters):
            provisioning_failed("local", "no_offers")
            why = describe_mismatch(offers, inp.resources, **filters)
            raise refusal_error(PlacementRefusal(backend="local", tried=False, reasons=[
                f"this machine does not fit ({why or inp.resources.summary()})"]))
        job = inp.job
        cannot, _ = local_limits({**{n: (getattr(job, n), n) for n in ("docker", "privileged", "nvcc", "image",
                                                                       "volumes")},
                                  "commands": (job.commands, "commands")})
        if cannot:  # said at plan time too (`durastack apply`); here for a service submitted another way
            provisioning_failed("local", "unsupported")
            raise refusal_error(PlacementRefusal(backend="local", tried=False, reasons=cannot))
        since = activity.info().scheduled_time.timestamp() - CLOCK_SKEW_SECONDS  # the launch's first attempt
        try:  # with late references, its commands wait in the replica for ``start``
            instance = await self._blocking(self._start_once, inp.job, since, bool(inp.late_refs),
                                            limits_for(inp.resources))
        except UnsupportedJobError as e:
            provisioning_failed("local", "unsupported")
            raise refusal_error(PlacementRefusal(backend="local", tried=False, reasons=[str(e)])) from e
        placement = Placement(backend="local", region="local", instance_type="local", price=0.0,
                              address=self.local.upstream(job, instance), instance_id=str(instance.pid),
                              ip=instance.ip)
        return placement, instance

    async def start(self, inp: ReplicaInput, instance: LocalInstance) -> None:
        if inp.late_refs:
            await self._blocking(self.local.give_commands, inp.job)

    def _start_once(self, job: JobSpec, since: float, later: bool, limits: Limits) -> LocalInstance:
        """The instance an earlier attempt of this launch started (recorded ``since`` its first attempt) if it has
        exited since: starting it again would run the submission twice, and the readiness wait reports the exit
        instead, unless its commands never ran (``never_ran``). Otherwise ``start``, which adopts a live one and
        finishes its setup: the earlier attempt may have died before linking it to the gateway (it would then run,
        unreachable, and never be ready)."""
        recorded = self.local.find(job)
        if (recorded is not None and (self.local.recorded_at(job) or 0) >= since
                and self.local.status(recorded).state != "running" and not self.local.never_ran(recorded)):
            return recorded
        return self.local.start(job, later, limits)

    def reach(self, instance: LocalInstance) -> tuple[str, None]:
        """Where this worker reaches the app (as the probes do): its socket on the host."""
        return instance.address, None

    async def wait_ready(self, instance: LocalInstance, probes: list[ProbeSpec], until: Optional[float] = None) -> None:
        """Probe until ready, or until ``until`` (then not yet); fail (not retried) if the app exits first."""
        streaks = ProbeStreaks(probes)
        poll, timeout = FIRST_READY_POLL_SECONDS, FIRST_ANSWER_TIMEOUT_SECONDS
        while True:
            (exited,) = await self.down([instance])
            if exited is not None:
                raise ApplicationError(exited, type="ReplicaExited", non_retryable=True)
            if streaks.probes:
                await streaks.run_due(instance.address, time.monotonic())
                if streaks.ready():
                    return
            else:
                asked = time.monotonic()
                if await answers_http(instance.address, timeout) is not None:
                    return
                if time.monotonic() - asked >= timeout:  # no answer at all (a refusal is quick): wait longer next
                    timeout = min(timeout * 2, ANSWER_TIMEOUT_SECONDS)
            streaks.end_attempt_past(until)
            progress(streaks.said())
            await asyncio.sleep(poll)
            poll = min(poll * 1.5, READY_POLL_SECONDS)

    async def down(self, instances: list[LocalInstance]) -> list[Optional[str]]:
        def statuses() -> list[Optional[str]]:
            found = [self.local.status(i) for i in instances]
            return [None if s.state == "running" else _exit_reason(s.state, s.exit_code) for s in found]

        return await asyncio.to_thread(statuses)

    async def last_output(self, instance: LocalInstance, lines: int) -> str:
        """Its last lines, without the header durastack wrote at the top of its log (how it started, its limits);
        what its init said later (a namespace that could not be set up) stays: it is why it exited."""
        read = lines + HEADER_LINES
        got = (await asyncio.to_thread(self.local.logs, instance, read)).splitlines()
        if len(got) < read:  # the whole log: it begins with the header
            while got and got[0].startswith(OWN_LINES):
                got.pop(0)
        return "\n".join(got[-lines:])

    async def stop(self, job: JobSpec, backend: str, instance: Optional[LocalInstance]) -> None:
        """Stop the replica's processes; none (never started, or already gone) is success."""
        instance = instance or self.local.find(job)
        if instance is not None:
            await self._blocking(self.local.stop, instance)

    async def stop_idle(self, job: JobSpec, backend: str, instance: Optional[LocalInstance]) -> None:
        await self.stop(job, backend, instance)  # never kept idle (``keep_idle`` says no): stopped as any


class ReplicaActivities:
    def __init__(self, local: Optional[LocalBackend], gateway: GatewayClient, cloud: Optional[CloudReplicas] = None,
                 local_replicas: bool = True, quick_seconds: float = QUICK_SECONDS):
        """``local``: this machine (None on a cloud-only worker). ``cloud``: the clouds this worker calls itself
        (worker.py builds it). ``local_replicas``: False on cluster workers (DURASTACK_LOCAL_REPLICAS=off).
        ``quick_seconds``: a launch step shorter than this is not reported on its own."""
        self.quick_seconds = quick_seconds
        self.local = LocalReplicas(local, local_replicas) if local is not None else None
        self.gateway = gateway
        self.cloud = cloud
        self.router = RouterActivities(self._reach)
        self.engines = EngineActivities(self._reach)

    def backend_activities(self) -> list:
        """What a ``<queue>-<backend>`` worker runs: the replica's life on that backend."""
        return [self.place, self.start, self.ready, self.launch, self.teardown, self.monitor, self.watch_fleet,
                self.router.sync, self.engines.watch]

    def route_activities(self) -> list:
        """What the main queue runs: the service's gateway route."""
        return [self.ensure_route, self.remove_route]

    # --- launch -------------------------------------------------------------------------------------
    # Three steps, each its own activity with its own budget (workflows/replica.py): place (instance and boot),
    # start (image pull and commands), ready (probes, then the gateway). A retry resumes at the step that failed,
    # on the same instance: the image, the container and whatever it has loaded are kept.

    @implements(interface.place_replica)
    @keeps_alive
    async def place(self, inp: LaunchInput) -> Launched:
        if self._backend(inp.backend, launching=True).one_activity:
            # Its start and a first readiness attempt too: a local replica is started in milliseconds and its app
            # usually answers within a second; three activities would only add their round trips.
            return await self._all_steps(inp, until=time.monotonic() + READY_ATTEMPT_SECONDS)
        return await self._place(inp)

    @implements(interface.start_replica)
    @keeps_alive
    async def start(self, inp: LaunchStep) -> Launched:
        return await self._start(inp)

    @implements(interface.await_ready)
    @keeps_alive
    async def ready(self, inp: LaunchStep) -> None:
        await self._ready(inp, until=time.monotonic() + READY_ATTEMPT_SECONDS)

    @implements(interface.launch_replica)
    @keeps_alive
    async def launch(self, inp: LaunchInput) -> Launched:
        """The three steps in one attempt, for runs recorded before the launch had steps."""
        return await self._all_steps(inp, timeout=inp.replica.startup_timeout)

    async def _all_steps(self, inp: LaunchInput, until: Optional[float] = None,
                         timeout: Optional[int] = None) -> Launched:
        """Place, start and wait until ready here; `started` when the app still loads ``until`` then."""
        placed = LaunchStep(replica=inp.replica, backend=inp.backend, launched=await self._place(inp))
        started = placed.model_copy(update={"launched": await self._start(placed)})
        try:
            await self._ready(started, until, timeout)
        except ApplicationError as e:
            if e.type != NOT_READY_YET:
                raise
            return started.launched  # still loading: the readiness step goes on
        return started.launched.model_copy(update={"done": "serving"})

    async def _place(self, inp: LaunchInput) -> Launched:
        r = inp.replica
        # Each report is a round trip to Temporal (10–100 ms on a loaded machine), so it goes out while the step
        # runs rather than before it; and only when the step takes a while (a cloud instance), not for a local
        # process that starts at once: the next report then says it all.
        provisioning = unless_quick(self.quick_seconds, lambda: report(r.service_workflow_id, r.job, PROVISIONING,
                                                                   "provisioning"))
        try:
            if r.backends is not None and inp.backend not in r.backends:
                raise refusal_error(PlacementRefusal(backend=inp.backend, tried=False, reasons=[
                    f"the service's backends ({', '.join(r.backends)}) do not include {inp.backend}"]))
            placement, instance = await self._backend(inp.backend, launching=True).place(r, inp.backend)
        finally:
            await provisioning()
        return Launched(placement=placement, instance=instance, done="placed")

    async def _start(self, inp: LaunchStep) -> Launched:
        launched = inp.launched
        r, refs = await resolve_late(inp.replica, launched.placement, launched.instance)  # before its commands run
        await self._backend(inp.backend).start(r, launched.instance)
        return launched.model_copy(update={"refs": refs, "done": "started"})

    async def _ready(self, inp: LaunchStep, until: Optional[float] = None, timeout: Optional[int] = None) -> None:
        """Wait until its probes pass (one attempt ``until`` then, or at most ``timeout`` seconds), register it,
        report `serving`."""
        r, job = inp.replica, inp.replica.job
        placement, instance, refs = inp.launched.placement, inp.launched.instance, inp.launched.refs
        backend = self._backend(inp.backend)
        # `placed` goes out while it loads, told until the service has it (resolve_late has told it already, for
        # a replica with late references); a later attempt asks first.
        placed = (lambda: asyncio.sleep(0)) if r.late_refs else (lambda: report_placed(
            r.service_workflow_id, job, placement, instance, ask_first=activity.info().attempt > 1))
        sent = unless_quick(self.quick_seconds, placed)
        try:
            await self._wait_ready(backend, job, instance, r.probes, until, timeout)
            if r.route:  # a worker behind the service's router group is reached by the router alone
                await self.gateway.register(job.service, job.replica_id, job.group, placement.address)
                backend.routed(instance, job.service, job.replica_id, job.group)
        finally:
            await sent()
        await report(r.service_workflow_id, job, SERVING, "running", ready=True, registered=r.route,
                     placement=placement, instance=instance, refs=refs)
        log.info("%s: serving on %s at %s%s", job.replica_id, placement.backend, placement.address,
                 "" if r.route else " (behind the router group)")

    @staticmethod
    async def _wait_ready(backend: Backend, job: JobSpec, instance, probes: list[ProbeSpec], until: Optional[float],
                          timeout: Optional[int]) -> None:
        """The backend's readiness wait: one attempt, ending ``until`` then (NotReadyYet), or at most ``timeout``
        seconds (the group's `startup_timeout`, not retried). A replica that exits first fails with its last lines
        of output."""
        try:
            await asyncio.wait_for(backend.wait_ready(instance, probes, until), timeout)
        except TimeoutError:
            raise ApplicationError(not_ready_within(timeout), type="NotReady", non_retryable=True) from None
        except ApplicationError as e:
            if e.type != "ReplicaExited":
                raise
            try:
                output = await backend.last_output(instance, LAST_LINES)
            except Exception as why:  # noqa: BLE001 — the exit is the news: never lose it for want of its output
                log.info("%s: last output unread: %s", job.replica_id, why)
                output = ""
            raise ApplicationError(with_output(e.message, output, job.env.values()), type="ReplicaExited",
                                   non_retryable=True) from None

    # --- teardown -----------------------------------------------------------------------------------

    @implements(interface.teardown_replica)
    @keeps_alive
    async def teardown(self, inp: TeardownInput) -> bool:
        job = inp.job
        backend = self._backend(inp.backend)
        if inp.idle:  # an instance the replica kept idle: it left the gateway and reported its end long ago
            await backend.stop_idle(job, inp.backend, inp.instance)
            return False
        await report(inp.service_workflow_id, job, TERMINATING, "terminating", reason=inp.reason)
        if inp.router is not None and inp.instance is not None:  # behind a synced router: out of it, then drain
            await self.router.leave(inp.backend, inp.router, inp.drain_seconds, inp.instance)
        backend.unroute(inp.instance)  # a tunnel coming back during the drain must not route it again
        # Unregistering returns once nginx serves a configuration without this replica; requests already in
        # flight on it are finished by nginx's old workers (a graceful reload): wait for those, within the
        # drain time, before the replica may be stopped. Unknown replicas are no error: a retry repeats this.
        await self.gateway.unregister(job.service, job.replica_id)
        deadline = time.monotonic() + inp.drain_seconds
        while time.monotonic() < deadline and not await self.gateway.drained():
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if inp.keep and await backend.keep_idle(job, inp.instance):
            await report(inp.service_workflow_id, job, FINISHED, inp.final, reason=inp.reason, instance=inp.instance,
                         idle=True)
            return True
        await backend.stop(job, inp.backend, inp.instance)
        await report(inp.service_workflow_id, job, FINISHED, inp.final, reason=inp.reason)
        return False

    # --- monitor ------------------------------------------------------------------------------------

    @implements(interface.monitor_replicas)
    async def monitor(self, inp: MonitorInput) -> list[Down]:
        backend = self._backend(inp.backend)
        await backend.adopt(inp.service, inp.replicas)  # e.g. cloud replicas' SSH tunnels, after a restart
        poll = max(inp.poll_seconds, backend.min_poll_seconds)
        tick = min(poll, inp.workflow_check_seconds)
        polled = described = float("-inf")

        async def check() -> Optional[list[Down]]:
            nonlocal polled, described
            now, down = time.monotonic(), []
            if now - polled >= poll - SLACK:
                polled = now
                reasons = await backend.down([w.instance for w in inp.replicas])
                down += [down_of(w, why) for w, why in zip(inp.replicas, reasons) if why is not None]
            if now - described >= inp.workflow_check_seconds - SLACK:
                described = now
                down = merged(down, await closed_workflows(activity.client(), inp.replicas))
            return down or None

        try:
            down = await watch_until_down(check, tick)
            # Unrouted here, all at once, not after a round trip through the workflow: requests stop going to a
            # dead replica within a poll of its death.
            by_num = {(w.replica_num, w.submission_num): w for w in inp.replicas}
            await heartbeating(asyncio.gather(*(
                self.gateway.unregister(inp.service, by_num[d.replica_num, d.submission_num].replica_id)
                for d in down)))
        except asyncio.CancelledError:
            # The workflow abandons a monitor whose watched set changed and starts another: nothing to undo.
            log.debug("monitor of %s on %s cancelled", inp.service, inp.backend)
            raise
        log.info("%s on %s: %s", inp.service, inp.backend,
                 "; ".join(f"r{d.replica_num}-s{d.submission_num} {d.reason}" for d in down))
        return down

    @implements(interface.watch_fleet)
    async def watch_fleet(self, inp: FleetInput) -> None:
        await FleetWatch(inp, self._backend(inp.backend), self.gateway, activity.client(),
                         activity.info().workflow_id).run()

    # --- gateway routes -----------------------------------------------------------------------------

    @implements(interface.ensure_route)
    async def ensure_route(self, inp: RouteInput) -> None:
        # The gateway's own tokens (`durastack token`) guard every route with auth.
        try:
            await self.gateway.put_service(inp.service, auth=inp.auth, cold_start_timeout=inp.cold_start_timeout,
                                           pass_authorization=inp.pass_authorization, strip_prefix=inp.strip_prefix,
                                           rate_limits=inp.rate_limits, unavailable=inp.unavailable)
        except GatewayError as e:
            if 400 <= e.status < 500:  # e.g. an older gateway without a route setting: asking again changes nothing
                raise ApplicationError(str(e), type="RouteRefused", non_retryable=True) from None
            raise

    @implements(interface.remove_route)
    async def remove_route(self, inp: RouteInput) -> None:
        await self.gateway.delete_service(inp.service)

    # --- helpers ------------------------------------------------------------------------------------

    def _reach(self, name: str):
        try:
            return self._backend(name).reach
        except ApplicationError:
            return None

    def _backend(self, name: str, launching: bool = False) -> Backend:
        if name == "local" and self.local is not None:
            return self.local
        if name in CLOUDS and self.cloud is not None and name in self.cloud.backends:
            return self.cloud
        why = f"backend {name} is not served by this worker"
        if launching:  # the workflow tries the next backend
            raise refusal_error(PlacementRefusal(backend=name, tried=False, reasons=[why]))
        # Teardown and monitor: a worker that serves it may poll this queue later (a misrouted task).
        raise ApplicationError(why, type="NotServed")


class BackendsServed:
    """The answer of ``served_backends``, fixed when the worker starts."""

    def __init__(self, backends: list[str]):
        self.backends = list(backends)

    @implements(interface.served_backends)
    async def served_backends(self) -> list[str]:
        return list(self.backends)


def _exit_reason(state: str, code: Optional[int]) -> str:
    return f"exited ({code})" if state == "exited" and code is not None else state
