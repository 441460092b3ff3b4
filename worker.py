"""The durastack worker: runs ServiceRunWorkflow, ReplicaWorkflow and their activities.

`durastack server` starts it as `python -m worker`; at scale, run as many as you like against one
Temporal server (they share the task queue). Settings come from the environment (models.settings).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from activities.local import LocalBackend
from activities.replica import ReplicaActivities
from activities.stats import StatsActivities
from gateway.client import GatewayClient
from models.settings import Settings, load_or_create_token
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunWorkflow

log = logging.getLogger("durastack.worker")


async def connect(settings: Settings) -> Client:
    return await Client.connect(settings.address, namespace=settings.namespace,
                                data_converter=pydantic_data_converter)


def build_worker(client: Client, settings: Settings, gateway: GatewayClient) -> Worker:
    local = LocalBackend(settings.home)
    if not local.isolated:
        log.warning("replica isolation is off (%s): each replica gets its own PORT", local.isolation_reason)
    acts = ReplicaActivities(local, gateway, tokens=lambda: [load_or_create_token(settings.home)])
    stats = StatsActivities(gateway.stats)
    return Worker(client, task_queue=settings.task_queue, workflows=[ServiceRunWorkflow, ReplicaWorkflow],
                  activities=[*acts.all(), stats.watch_stats], max_concurrent_activities=500)


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    client = await connect(settings)
    async with GatewayClient(settings.gateway_control_url) as gateway:
        worker = build_worker(client, settings, gateway)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with worker:
            log.info("worker polling %s on %s", settings.task_queue, settings.address)
            await stop.wait()


if __name__ == "__main__":
    asyncio.run(main())
