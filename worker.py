"""The durastack worker: runs ServiceRunWorkflow, ReplicaWorkflow, ReaperWorkflow and their activities.

`durastack server` starts it as `python -m worker`; at scale, run as many as you like against one
Temporal server (they share the task queue). Settings come from the environment (models.settings), the
clouds from ``$DURASTACK_HOME/config.yml`` (models.backends); credentials from each cloud's standard chain.

Which backends a worker calls (``--backends`` or ``DURASTACK_WORKER_BACKENDS``, a comma list):

* unset — the default, and the embedded stack: one worker process runs everything — workflows, gateway
  activities, this machine, and every configured cloud.
* a list with ``local`` (``local``, ``local,aws``): the same main worker, calling only the clouds listed; the
  other configured clouds are left to workers of their own.
* a list without ``local`` (``aws``, ``aws,gcp``): a cloud worker. No workflows; only each cloud's replica
  activities (launch, teardown, monitor) and ``reap_orphans``, on ``<queue>-<cloud>``. Run it where that cloud's
  credentials are; it reaches the gateway's control API too (it registers the replicas it launches).

Task queues: the main worker polls ``<queue>`` (workflows, gateway routes, stats, ``served_backends``, the
reaper, ``record_service``), ``<queue>-local`` unless ``DURASTACK_LOCAL_REPLICAS=off``, and ``<queue>-<cloud>``
for each cloud it calls itself. ``served_backends`` tells the workflows which backends exist, in the order to
try them, and the workflow schedules a replica's activities on that backend's queue. The main worker starts the
reaper (workflows/reaper.py) with one target per queue that serves a cloud.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Mapping, Optional

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker, WorkerDeploymentConfig
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.reaper import ReaperActivities
from activities.replica import BackendsServed, ReplicaActivities
from activities.replica_cloud import CloudReplicas
from activities.signals import judge_signal
from activities.stats import StatsActivities
from activities.store import StoreActivities
from backends.cloud import CloudBackend, make_backends
from backends.local import LocalBackend
from backends.ssh_keys import SSHKeys, SSHKeysError
from connect.codec import CodecKeyError
from connect.connection import TemporalConfigError, client_options, connect_failure
from connect.deployment import VersioningUnavailable, become_current, deployment_config
from connect.installation import installation_id
from gateway.client import GatewayClient
from models.backends import CLOUDS, BackendsConfig, load_backends_config
from models.reaper import ReaperInput, ReapTarget
from models.messages import FleetInput
from models.settings import Settings
from store import Store, StoreLedger, database_url
from rules import names
from workflows.fleet import FleetMonitorWorkflow
from workflows.reaper import REAPER_ID, ReaperWorkflow
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunWorkflow

log = logging.getLogger("durastack.worker")
# Each service holds a slot for its stats watcher on the main queue and one for each backend's monitor on that
# backend's queue for its whole life (an async activity costs a coroutine), so the slots are sized for thousands
# of services plus the launches and teardowns around them (bench/scale_out.py).
MAX_ACTIVITIES = 20_000
# The sticky cache keeps the workflows touched last. An idle workflow gets no task for an hour (a service's safety
# tick) or for days (a replica), so one the cache let go replays rarely (a service's history: about 90 ms of CPU);
# a cached service costs about 0.6 MB, most of it in the SDK's core. At 1,000 idle services (7,000 workflows) the
# worker took 721 MiB with 1,500 cached, 604 MiB with 500, 450 MiB with 250, at about 1 % of a core
# (bench/scale_out.py); 250 services changing at once still run from the cache.
MAX_CACHED_WORKFLOWS = 250
# The SDK sends an activity's heartbeats at most every 80% of its heartbeat timeout: every 16 s against the 20 s
# default, so a worker 4 s late (a busy loop, a slow network) timed a live launch out and a second one started.
# Sent as often as the activities beat (a third of the timeout, activities/liveness.py), two may be lost or late
# before the timeout, for any heartbeat timeout of 15 s or more.
HEARTBEAT_THROTTLE = timedelta(seconds=5)
# Workflow task polls open at once (the SDK's default is 5, one of them for new and evicted workflows): when
# thousands of replicas start, each poll waits on the server, and more of them start services sooner.
WORKFLOW_TASK_POLLS = 20
# The sandbox imports a workflow's module again for each run it holds, and with it builds that module's pydantic
# models again: 150 services (1,050 cached runs) took 425 MiB, 309 MiB with the modules shared (bench/scale_out.py).
# Our workflow modules and the rules they apply (rules/) keep no module-level state (their globals are constants).
# A shared module's calls are not checked (datetime.now() passes), so the tests' workers and the replayer keep the
# default sandbox: a forbidden call fails there.
SANDBOX = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules("workflows", "rules"))


@dataclass
class Clouds:
    """The configured clouds as one worker sees them, built once at start-up."""

    config: BackendsConfig
    backends: dict[str, CloudBackend]  # the clouds this worker calls itself
    ledger: StoreLedger  # in the store, which the main worker's record_service also writes
    queues: dict[str, str] = field(default_factory=dict)  # configured clouds other workers serve → their queue


def metrics_runtime(port: int, host: str = "127.0.0.1") -> Optional[Runtime]:
    """A Temporal runtime serving the SDK's metrics at <host>:<port>/metrics; None (the default runtime) for 0."""
    if not port:
        return None
    try:
        return Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"{host}:{port}")))
    except ValueError as e:  # e.g. the port is taken: metrics are not worth a worker that cannot start
        log.warning("no SDK metrics: %s (port %d; set DURASTACK_WORKER_METRICS_PORT, 0 for none)", e, port)
        return None


async def connect(settings: Settings) -> Client:
    """The worker's client: connect.connection's options (codec, TLS) and the metrics runtime."""
    options = client_options(settings)
    options["data_converter"].payload_codec.keys()  # no key: fail now, not at the first secret
    runtime = metrics_runtime(settings.worker_metrics_port, settings.bind_host)
    return await Client.connect(**options, **({"runtime": runtime} if runtime else {}))


def worker_backends(argv: Optional[list[str]] = None, environ: Mapping[str, str] = os.environ) -> Optional[list[str]]:
    parser = argparse.ArgumentParser(prog="python -m worker", description="The durastack worker.")
    parser.add_argument("--backends", help="Comma list of the backends this worker calls (see the module doc).")
    value = parser.parse_args(argv).backends or environ.get("DURASTACK_WORKER_BACKENDS")
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def load_clouds(settings: Settings, serves: Optional[list[str]] = None,
                environ: Mapping[str, str] = os.environ) -> Clouds:
    config = load_backends_config(environ)
    if (config.aws or config.gcp) and not config.installation:
        config = config.model_copy(update={"installation": installation_id(
            settings.temporal_address, settings.namespace, settings.home)})
    every = make_backends(config)
    held = every if serves is None else {c: b for c, b in every.items() if c in serves}
    main = serves is None or "local" in serves
    queues = {c: names.backend_queue(settings.task_queue, c) for c in every if c not in held} if main else {}
    return Clouds(config, held, StoreLedger(Store(database_url(settings.home, environ))), queues)


def served(settings: Settings, clouds: Clouds) -> list[str]:
    """What ``served_backends`` answers: this machine first (free, and the quickest to start), then each configured
    cloud, whoever serves it."""
    configured = set(clouds.backends) | set(clouds.queues)
    return (["local"] if settings.local_replicas else []) + [c for c in CLOUDS if c in configured]


def worker_activities(client: Client, settings: Settings, gateway: GatewayClient, clouds: Clouds) -> dict[str, list]:
    """What the main worker process runs, by task queue: every workflow and the service activities on the task
    queue (first), and the replica activities on the queue of each backend it serves itself."""
    local = LocalBackend(settings.home)
    if settings.local_replicas and not local.isolated:
        log.warning("replica isolation is off (%s): each replica gets its own PORT", local.isolation_reason)
    cloud = CloudReplicas(clouds.config, clouds.backends, clouds.ledger, gateway=gateway, **_ssh_path(settings))
    acts = ReplicaActivities(local, gateway, cloud=cloud, local_replicas=settings.local_replicas)
    stats = StatsActivities(gateway.stats)
    reaper = ReaperActivities(client, clouds.backends, clouds.ledger, gateway=gateway)
    record = StoreActivities(clouds.ledger.store).record_service  # a local activity: must be on this worker
    backends = BackendsServed(served(settings, clouds))
    own = (["local"] if settings.local_replicas else []) + sorted(clouds.backends)
    return {settings.task_queue: [*acts.route_activities(), stats.watch_stats, reaper.reap_orphans,
                                  reaper.reap_replicas, reaper.reap_closed, record,
                                  backends.served_backends, judge_signal],
            **{names.backend_queue(settings.task_queue, b): acts.backend_activities() for b in own}}


def cloud_worker_activities(client: Client, settings: Settings, gateway: GatewayClient,
                            clouds: Clouds) -> dict[str, list]:
    """What a cloud worker process (``--backends aws,gcp``) runs: each cloud alone on ``<queue>-<cloud>``."""
    queues = {}
    for name, backend in clouds.backends.items():
        cloud = CloudReplicas(clouds.config, {name: backend}, clouds.ledger, gateway=gateway, **_ssh_path(settings))
        acts = ReplicaActivities(None, gateway, cloud=cloud)
        reaper = ReaperActivities(client, {name: backend}, clouds.ledger)
        queues[names.backend_queue(settings.task_queue, name)] = [*acts.backend_activities(), reaper.reap_orphans]
    return queues


def _ssh_path(settings: Settings) -> dict:
    """Cloud replicas are reached over SSH with the home's keys (backends/ssh_keys.py), tunnels under the home."""
    from backends.ssh import SSHClient

    keys = SSHKeys.of_home(settings.home)
    return dict(ssh=SSHClient.from_keys(keys), ssh_keys=keys, home=settings.home)


def build_workers(client: Client, settings: Settings, gateway: GatewayClient, clouds: Optional[Clouds] = None,
                  deployment: Optional[WorkerDeploymentConfig] = None) -> list[Worker]:
    """The main worker process's workers (``worker_activities``); ``deployment``: the main one's build."""
    queues = worker_activities(client, settings, gateway, clouds or load_clouds(settings))
    return [main_worker(client, q, acts, deployment) if q == settings.task_queue else backend_worker(client, q, acts)
            for q, acts in queues.items()]


def main_worker(client: Client, task_queue: str, activities: list,
                deployment: Optional[WorkerDeploymentConfig] = None, workflows: Optional[list] = None) -> Worker:
    """The main worker's Worker and its tuning (bench/scale_out.py builds it with a fake backend); ``deployment``:
    its build in the Worker Deployment (connect/deployment.py), None unversioned."""
    return Worker(client, task_queue=task_queue, workflows=workflows or [ServiceRunWorkflow, ReplicaWorkflow,
                                                                         ReaperWorkflow, FleetMonitorWorkflow],
                  activities=activities, max_concurrent_activities=MAX_ACTIVITIES,
                  max_cached_workflows=MAX_CACHED_WORKFLOWS, max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                  workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(WORKFLOW_TASK_POLLS),
                  workflow_runner=SANDBOX, deployment_config=deployment)


def backend_worker(client: Client, task_queue: str, activities: list) -> Worker:
    """A worker of one backend's replica activities, on ``<queue>-<backend>``."""
    return Worker(client, task_queue=task_queue, activities=activities, max_concurrent_activities=MAX_ACTIVITIES,
                  max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE)


def build_cloud_workers(client: Client, settings: Settings, clouds: Clouds, gateway: GatewayClient) -> list[Worker]:
    """One worker per cloud this process serves, each on ``<queue>-<cloud>`` with that cloud alone."""
    return [backend_worker(client, q, acts)
            for q, acts in cloud_worker_activities(client, settings, gateway, clouds).items()]


def reaper_input(settings: Settings, clouds: Clouds, environ: Mapping[str, str] = os.environ) -> ReaperInput:
    """The reaper's targets: the clouds this worker calls on its queue, each delegated cloud on its own; and this
    queue, where replica workflows no service run owns are stopped."""
    targets = [ReapTarget(task_queue=settings.task_queue, backends=sorted(clouds.backends))] if clouds.backends else []
    targets += [ReapTarget(task_queue=q, backends=[c]) for c, q in sorted(clouds.queues.items())]
    minutes = {k: float(environ.get(f"DURASTACK_REAPER_{k.upper()}_MINUTES") or 10) for k in ("interval", "grace")}
    return ReaperInput(targets=targets, replicas_queue=settings.task_queue,
                       interval_seconds=max(1, round(minutes["interval"] * 60)), grace_seconds=round(minutes["grace"] * 60),
                       closed_seconds=max(1, int(environ.get("DURASTACK_REAPER_CLOSED_SECONDS") or 30)))


async def start_reaper(client: Client, settings: Settings, inp: ReaperInput) -> None:
    """Start the reaper unless it runs already; either way give it this worker's targets."""
    handle = await client.start_workflow(ReaperWorkflow.run, inp, id=REAPER_ID, task_queue=settings.task_queue,
                                         id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                                         static_summary="terminates cloud instances no replica owns, stops replicas no service owns")
    await handle.signal(ReaperWorkflow.configure, inp)


async def start_fleet_monitors(client: Client, settings: Settings, queues: list[str]) -> None:
    """Start the fleet monitor of each backend these workers serve, unless it runs already (workflows/fleet.py)."""
    prefix = settings.task_queue + "-"
    for queue in queues:
        if queue.startswith(prefix):
            backend = queue[len(prefix):]
            await client.start_workflow(FleetMonitorWorkflow.run, FleetInput(backend=backend),
                                        id=names.fleet_workflow_id(settings.task_queue, backend),
                                        task_queue=settings.task_queue,
                                        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                                        static_summary=f"watches every service's replicas on {backend}")


async def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: the router sync's reads every second
    serves = worker_backends(argv)
    settings = Settings.from_env()
    clouds = load_clouds(settings, serves)
    log.info("%s", clouds.config.summary())
    cloud_only = serves is not None and "local" not in serves
    missing = sorted(set(serves or ()) - set(clouds.backends) - {"local"})
    if missing:
        sys.exit(f"worker: backend {', '.join(missing)} is not configured ($DURASTACK_HOME/config.yml)")
    try:  # connect and migrate now, not in the first activity that needs the store
        await asyncio.to_thread(clouds.ledger.store.open)
    except Exception as e:  # noqa: BLE001 — no ledger, no launches: stop, saying which database
        sys.exit(f"worker: store {clouds.ledger.store.where()}: {e}")
    try:  # every worker holds them (_ssh_path): a Secret without them stops it here, saying so
        SSHKeys.of_home(settings.home)
    except SSHKeysError as e:
        sys.exit(f"worker: {e}")
    try:
        client = await connect(settings)
    except (CodecKeyError, TemporalConfigError) as e:
        sys.exit(f"worker: {e}")
    except RuntimeError as e:  # the SDK's "Failed client connect: ..."
        sys.exit(f"worker: {connect_failure(settings, e)}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        gateway = await stack.enter_async_context(GatewayClient(settings.gateway_control_url, token=settings.control_token))
        # The build is read once (the code's hash), so the version it polls as is the one it makes current.
        deployment = None if cloud_only else deployment_config(settings)
        if cloud_only:
            workers = build_cloud_workers(client, settings, clouds, gateway)
        else:
            workers = build_workers(client, settings, gateway, clouds, deployment)
        for worker in workers:
            await stack.enter_async_context(worker)
            log.info("worker polling %s on %s", worker.task_queue, settings.address)
        if deployment is not None:
            try:  # before the reaper: its tasks wait for a current build
                await become_current(client, deployment.version)
            except VersioningUnavailable as e:
                sys.exit(f"worker: Worker Versioning: {e}")
        try:  # without them, services watch their replicas on their own
            await start_fleet_monitors(client, settings, [w.task_queue for w in workers])
        except Exception:  # noqa: BLE001
            log.exception("could not start the fleet monitors")
        if not cloud_only:
            try:
                await start_reaper(client, settings, reaper_input(settings, clouds))
            except Exception:  # noqa: BLE001 — replicas can run without it; say so loudly
                log.exception("could not start the reaper %s", REAPER_ID)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
