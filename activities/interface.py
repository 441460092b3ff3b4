"""The activities the workflows call, by reference: typed stubs that import nothing but models.

Workflows schedule ``workflow.execute_activity(interface.place_replica, LaunchInput(...))`` and never
spell an activity's name; the worker registers the implementations (``activities/replica.py`` and the
others), each bound to its stub with ``@implements(stub)``, which gives it the stub's name. A test
checks that every stub has exactly one implementation with the same signature. Keeping the stubs
here keeps the workflow sandbox and the CLI free of boto3, google-cloud and the gateway client.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from models.failures import NO_CAPACITY_ERROR
from models.reaper import ReapRequest, ReapResult, ReplicaReapResult
from models.messages import (FleetInput, EngineWatch, Down, Launched, LaunchInput, LaunchStep, MonitorInput, PlacementRefusal,
    RouteInput, RecordResult, ServiceRecord, SignalInput, StatsWatch, TeardownInput, Verdict)
from models.state import EngineSnapshot, StatsSnapshot

from models.router import RouterSyncInput, RouterView

F = TypeVar("F", bound=Callable)


def implements(stub: Callable) -> Callable[[F], F]:
    """Register the decorated function or method as the implementation of ``stub`` (its name)."""
    name = activity._Definition.must_from_callable(stub).name

    def bind(fn: F) -> F:
        return activity.defn(name=name)(fn)

    return bind


def refusal_error(details: PlacementRefusal) -> ApplicationError:
    """The error ``place_replica`` raises when its backend cannot place the replica. The workflow reads
    ``PlacementRefusal.model_validate(error.details[0])`` (never the message, which is for people) and tries the next
    backend; non-retryable, because nothing was made and asking the same backend again gives the same answer."""
    what = "every offer failed" if details.tried else "nothing fits"
    message = f"{details.backend}: {what}" + (f": {'; '.join(details.reasons)}" if details.reasons else "")
    return ApplicationError(message, details.model_dump(mode="json"), type=NO_CAPACITY_ERROR, non_retryable=True)


@activity.defn
async def launch_replica(inp: LaunchInput) -> Launched:
    """The three launch steps in one activity, as runs recorded before the launch had steps schedule it:
    provision on ``inp.backend`` (exactly once, by the job's key), wait until the probes pass (at most the group's
    `startup_timeout`), register with the gateway. Raises ``NoCapacity`` as ``place_replica`` does,
    ``ReplicaExited`` when the app exits before it is ready."""
    raise NotImplementedError


@activity.defn
async def place_replica(inp: LaunchInput) -> Launched:
    """The launch's first step: an instance on ``inp.backend`` (exactly once, by the job's key), booted. Reports
    `provisioning` when it takes a while. Raises ``NoCapacity`` (as ``launch_replica``) when the backend cannot
    place it."""
    raise NotImplementedError


@activity.defn
async def start_replica(inp: LaunchStep) -> Launched:
    """Pull the image (its progress in the heartbeat details) and start the replica's commands, once: a retry keeps
    a container an earlier attempt started. Returns the late references it was started with."""
    raise NotImplementedError


@activity.defn
async def await_ready(inp: LaunchStep) -> None:
    """Probe the replica for a while; once its probes pass, register it with the gateway and report `serving`.
    Still loading: a retryable ``NotReadyYet`` (the workflow's retry policy polls, within the group's
    `startup_timeout`); ``ReplicaExited`` when it exits first."""
    raise NotImplementedError


@activity.defn
async def teardown_replica(inp: TeardownInput) -> bool:
    """Unregister and drain, terminate the instance (or whatever a launch made for this job), then report
    ``inp.final`` to the service. Idempotent: retried until it succeeds. With ``keep``, keeps the instance idle
    instead if its backend can (True: kept, reported with the end); with ``idle``, only terminates the instance
    kept idle, unless another replica took it."""
    raise NotImplementedError


@activity.defn
async def monitor_replicas(inp: MonitorInput) -> list[Down]:
    """Heartbeat while every watched replica serves; return those that stopped (their process, container or
    instance died, or their workflow closed), each already unrouted."""
    raise NotImplementedError


@activity.defn
async def watch_fleet(inp: FleetInput) -> None:
    """Watch every service's serving replicas on ``inp.backend`` (asking the fleet monitor workflow what they are,
    workflows/fleet.py) and heartbeat; unroute each that stopped and signal its service ``replicas_down``.
    Never returns: cancelled at the workflow's continue-as-new."""
    raise NotImplementedError


@activity.defn
async def sync_router(inp: RouterSyncInput) -> RouterView:
    """Keep each router replica's worker list equal to ``inp.workers`` (adding with the role each worker's engine
    reports, removing the rest); return once what the routers know differs from ``inp.known`` or the sync changed
    something. Heartbeats meanwhile; a router that cannot be reached is retried, and said in the view."""
    raise NotImplementedError


@activity.defn
async def watch_engines(watch: EngineWatch) -> EngineSnapshot:
    """Read the engine signal of each replica in ``watch`` every second, over its group's window; return once a
    group's wanted count changes, a replica is read for the first time or its error changes (or after a long
    while). Heartbeats meanwhile; on the replicas' backend queue."""
    raise NotImplementedError


@activity.defn
async def watch_stats(watch: StatsWatch) -> StatsSnapshot:
    """Return the service's request rates once some group's wanted count changes (or after a long while)."""
    raise NotImplementedError


@activity.defn
async def ensure_route(inp: RouteInput) -> None:
    """Create or update the service's gateway route."""
    raise NotImplementedError


@activity.defn
async def remove_route(inp: RouteInput) -> None:
    """Remove the service's gateway route."""
    raise NotImplementedError


@activity.defn
async def record_service(record: ServiceRecord) -> Optional[RecordResult]:
    """Write new decision-log entries and the `ps` row to the store (a local activity); says whether the store
    misses entries just before them (None from an older worker: unknown)."""
    raise NotImplementedError


@activity.defn
async def served_backends() -> list[str]:
    """The backends this deployment launches replicas on, in the order to try them: ``local`` when this
    machine runs replicas, then each configured cloud (served by this worker or by a worker of its own on
    ``<queue>-<backend>``). A local activity: the answer is recorded, so replay never asks again."""
    raise NotImplementedError


@activity.defn
async def judge_signal(inp: SignalInput) -> Verdict:
    """Validate a `scale` or `apply` signal's raw payload as the updates' validators would. A local
    activity: its verdict is recorded, so replay never judges the signal again with newer rules."""
    raise NotImplementedError


@activity.defn
async def reap_orphans(req: ReapRequest) -> ReapResult:
    """Terminate the cloud instances of ``req.backends`` no replica owns (older than its grace); on the main queue
    and on each cloud worker's queue, for the clouds it holds the credentials of."""


@activity.defn
async def reap_replicas(grace_seconds: int) -> ReplicaReapResult:
    """Stop the replica workflows no service run owns (started more than ``grace_seconds`` ago)."""


@activity.defn
async def reap_closed() -> ReplicaReapResult:
    """Stop at once the replica workflows of services whose run closed without stopping them."""
