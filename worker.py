"""The durastack worker: runs ServiceRunWorkflow, ReplicaWorkflow, ReaperWorkflow and their activities.

`durastack server` starts it as `python -m worker`; at scale, run as many as you like against one
Temporal server (they share the task queue). Settings come from the environment (models.settings), the
clouds from ``$DURASTACK_HOME/config.yml`` (models.backends); credentials from each cloud's standard chain.

Which backends a worker calls (``--backends`` or ``DURASTACK_WORKER_BACKENDS``, a comma list):

* unset — the default, and the embedded stack: one worker runs everything on the task queue — workflows,
  gateway activities, this machine, and every configured cloud.
* a list with ``local`` (``local``, ``local,aws``): the same main worker, calling only the clouds listed; a
  replica that needs another configured cloud is delegated to that cloud's queue, ``<queue>-<cloud>``.
* a list without ``local`` (``aws``, ``aws,gcp``): a cloud worker. No workflows; only each cloud's instance
  activities (provision, probes, watch, terminate) and ``reap_orphans``, on ``<queue>-<cloud>``. Run it
  where that cloud's credentials are.

Routing: ReplicaWorkflow schedules PROVISION on its own queue. The main worker provisions there (this machine,
or a cloud it calls), or answers with a delegation: the workflow then schedules PROVISION for one cloud on that
cloud's queue and keeps the instance's later activities there (workflows/replica.py). The main worker starts
the reaper (workflows/reaper.py) with one target per queue that serves a cloud.
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
from typing import Mapping, Optional

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.cloud import CloudBackend, make_backends
from activities.ledger import Ledger
from activities.local import LocalBackend
from activities.reaper import ReaperActivities
from activities.replica import ReplicaActivities
from activities.replica_cloud import CloudReplicas
from activities.stats import StatsActivities
from gateway.client import GatewayClient
from models.backends import BackendsConfig, load_backends_config
from models.reaper import ReaperInput, ReapTarget
from models.settings import Settings, load_or_create_token
from workflows import names
from workflows.reaper import REAPER_ID, ReaperWorkflow
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunWorkflow

log = logging.getLogger("durastack.worker")


@dataclass
class Clouds:
    """The configured clouds as one worker sees them, built once at start-up."""

    config: BackendsConfig
    backends: dict[str, CloudBackend]  # the clouds this worker calls itself
    ledger: Ledger
    queues: dict[str, str] = field(default_factory=dict)  # configured clouds other workers serve → their queue


async def connect(settings: Settings) -> Client:
    return await Client.connect(settings.address, namespace=settings.namespace,
                                data_converter=pydantic_data_converter)


def worker_backends(argv: Optional[list[str]] = None, environ: Mapping[str, str] = os.environ) -> Optional[list[str]]:
    parser = argparse.ArgumentParser(prog="python -m worker", description="The durastack worker.")
    parser.add_argument("--backends", help="Comma list of the backends this worker calls (see the module doc).")
    value = parser.parse_args(argv).backends or environ.get("DURASTACK_WORKER_BACKENDS")
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def load_clouds(settings: Settings, serves: Optional[list[str]] = None,
                environ: Mapping[str, str] = os.environ) -> Clouds:
    config = load_backends_config(environ)
    every = make_backends(config)
    held = every if serves is None else {c: b for c, b in every.items() if c in serves}
    main = serves is None or "local" in serves
    queues = {c: names.backend_queue(settings.task_queue, c) for c in every if c not in held} if main else {}
    return Clouds(config, held, Ledger(settings.home / "ledger" / "instances.jsonl"), queues)


def build_worker(client: Client, settings: Settings, gateway: GatewayClient,
                 clouds: Optional[Clouds] = None) -> Worker:
    """The main worker: every workflow, the gateway activities, this machine and the clouds it calls."""
    clouds = clouds or load_clouds(settings)
    local = LocalBackend(settings.home)
    if not local.isolated:
        log.warning("replica isolation is off (%s): each replica gets its own PORT", local.isolation_reason)
    cloud = CloudReplicas(clouds.config, clouds.backends, clouds.ledger, queues=clouds.queues)
    acts = ReplicaActivities(local, gateway, tokens=lambda: [load_or_create_token(settings.home)], cloud=cloud)
    stats = StatsActivities(gateway.stats)
    reaper = ReaperActivities(client, clouds.backends, clouds.ledger)
    return Worker(client, task_queue=settings.task_queue,
                  workflows=[ServiceRunWorkflow, ReplicaWorkflow, ReaperWorkflow],
                  activities=[*acts.all(), stats.watch_stats, reaper.reap_orphans], max_concurrent_activities=500)


def build_cloud_workers(client: Client, settings: Settings, clouds: Clouds) -> list[Worker]:
    """One worker per cloud this process serves, each on ``<queue>-<cloud>`` with that cloud alone."""
    workers = []
    for name, backend in clouds.backends.items():
        cloud = CloudReplicas(clouds.config, {name: backend}, clouds.ledger)
        reaper = ReaperActivities(client, {name: backend}, clouds.ledger)
        workers.append(Worker(client, task_queue=names.backend_queue(settings.task_queue, name),
                              activities=[*cloud.all(), reaper.reap_orphans], max_concurrent_activities=500))
    return workers


def reaper_input(settings: Settings, clouds: Clouds, environ: Mapping[str, str] = os.environ) -> Optional[ReaperInput]:
    """The reaper's targets: the clouds this worker calls on its queue, each delegated cloud on its own."""
    targets = [ReapTarget(task_queue=settings.task_queue, backends=sorted(clouds.backends))] if clouds.backends else []
    targets += [ReapTarget(task_queue=q, backends=[c]) for c, q in sorted(clouds.queues.items())]
    if not targets:
        return None
    minutes = {k: float(environ.get(f"DURASTACK_REAPER_{k.upper()}_MINUTES") or 10) for k in ("interval", "grace")}
    return ReaperInput(targets=targets, interval_seconds=max(1, round(minutes["interval"] * 60)),
                       grace_seconds=round(minutes["grace"] * 60))


async def start_reaper(client: Client, settings: Settings, inp: ReaperInput) -> None:
    """Start the reaper unless it runs already; either way give it this worker's targets."""
    handle = await client.start_workflow(ReaperWorkflow.run, inp, id=REAPER_ID, task_queue=settings.task_queue,
                                         id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                                         static_summary="terminates cloud instances no replica owns")
    await handle.signal(ReaperWorkflow.configure, inp)


async def main(argv: Optional[list[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serves = worker_backends(argv)
    settings = Settings.from_env()
    clouds = load_clouds(settings, serves)
    log.info("%s", clouds.config.summary())
    cloud_only = serves is not None and "local" not in serves
    missing = sorted(set(serves or ()) - set(clouds.backends) - {"local"})
    if missing:
        sys.exit(f"worker: backend {', '.join(missing)} is not configured ($DURASTACK_HOME/config.yml)")
    client = await connect(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with contextlib.AsyncExitStack() as stack:
        if cloud_only:
            for worker in build_cloud_workers(client, settings, clouds):
                await stack.enter_async_context(worker)
                log.info("worker polling %s on %s", worker.task_queue, settings.address)
        else:
            gateway = await stack.enter_async_context(GatewayClient(settings.gateway_control_url))
            await stack.enter_async_context(build_worker(client, settings, gateway, clouds))
            log.info("worker polling %s on %s", settings.task_queue, settings.address)
            reaper = reaper_input(settings, clouds)
            if reaper is not None:
                try:
                    await start_reaper(client, settings, reaper)
                except Exception:  # noqa: BLE001 — replicas can run without it; say so loudly
                    log.exception("could not start the reaper %s", REAPER_ID)
        await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
