"""The cloud half of a replica's activities: provision on AWS/GCP offers, readiness, watch, terminate.

``ReplicaActivities`` (activities/replica.py) hands every non-local replica to ``CloudReplicas``; a worker
started with ``--backends aws`` registers ``CloudReplicas.all()`` alone on ``<queue>-aws`` (worker.py), under
the same activity names. Cloud calls block, so they run in threads. Only ``CloudInstance``/``Placement``
values leave these activities: never the job's env, the user-data or a credential.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.catalog import load_catalog
from activities.cloud import (CloudBackend, NoCapacity, activity_error, heartbeat_from_thread, placement_of,
                              provision_cloud, terminate_cloud, terminate_replica)
from activities.liveness import keeps_alive
from activities.metrics import NO_BACKEND, provisioning_failed
from activities.probes import ProbeStreaks, answers_http
from activities.store import StoreLedger
from activities.watch import watch_until_down
from models.backends import CLOUDS, BackendsConfig, CloudError, CloudInstance, ErrorKind
from models.offers import InstanceOffer, describe_mismatch, match_offers
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.run import Delegation, InstanceRef, Provisioned, ReadyInput, ReplicaInput
from models.service import ProbeSpec
from workflows import names

log = logging.getLogger("durastack.replica_cloud")
PROBE_SECONDS = 1.0  # between readiness probes of a booted instance
DOWN = ("stopping", "stopped", "terminated")


class CloudReplicas:
    def __init__(self, config: BackendsConfig, backends: dict[str, CloudBackend], ledger: StoreLedger, *,
                 queues: Optional[dict[str, str]] = None, catalog: Optional[list[InstanceOffer]] = None,
                 address: Optional[Callable[[CloudInstance], str]] = None, poll_seconds: float = 15.0,
                 boot_timeout: float = 900.0):
        """``backends``: the clouds this worker calls itself. ``queues``: configured clouds that workers of their
        own serve (backend → task queue); replicas are delegated there. ``address``: where the gateway and the
        probes reach an instance's app — default its own ``address``; tests map it to a server they run."""
        self.config, self.backends, self.ledger = config, backends, ledger
        self.queues = dict(queues or {})
        self._catalog = catalog
        self.address = address or (lambda instance: instance.address)
        self.poll_seconds, self.boot_timeout = poll_seconds, boot_timeout

    def all(self) -> list:
        return [self.provision, self.wait_ready, self.watch, self.terminate]

    def configured(self) -> list[str]:
        return [c for c in CLOUDS if c in self.backends or c in self.queues]

    def usable(self, inp: ReplicaInput) -> tuple[list[str], list[str]]:
        """(clouds the replica may use that are configured, a note for each one it names that is not)."""
        wanted = [c for c in CLOUDS if inp.backends is None or c in inp.backends]
        usable = [c for c in wanted if c in self.configured()]
        notes = [f"backend {c} is not configured ($DURASTACK_HOME/config.yml)"
                 for c in wanted if c not in usable and inp.backends is not None]
        return usable, notes

    # --- provision --------------------------------------------------------------------------------

    @activity.defn(name=names.PROVISION)
    @keeps_alive
    async def provision(self, inp: ReplicaInput) -> Provisioned:
        return await self.provision_with(inp)

    async def provision_with(self, inp: ReplicaInput, notes: tuple[str, ...] = ()) -> Provisioned:
        """Walk the offers this worker can serve, or delegate to the workers of the clouds it cannot.
        ``notes``: why other backends (this machine) were not used, for a ``no offers`` message."""
        resources = ResourcesSpec.model_validate(inp.resources)
        clouds, unconfigured = self.usable(inp)
        pool = [o for o in (self._catalog or load_catalog()) if o.backend in clouds and self.config.allows(o)]
        filters = dict(spot_policy=inp.spot_policy, max_price=inp.max_price, regions=inp.regions)
        offers = match_offers(pool, resources, **filters) if clouds else []
        if not offers:
            reasons = [f"{'/'.join(clouds)}: {describe_mismatch(pool, resources, **filters)}"] if clouds else []
            reasons += [*notes, *unconfigured]
            provisioning_failed(NO_BACKEND, "no_offers")
            raise activity_error(NoCapacity("no offers: " + (
                "; ".join(reasons) or "no cloud backend is configured ($DURASTACK_HOME/config.yml)")))
        order = list(dict.fromkeys(o.backend for o in offers))  # cheapest offer first
        if any(b not in self.backends for b in order):
            here = activity.info().task_queue
            return Provisioned(delegate=[Delegation(backend=b, task_queue=self.queues.get(b, here)) for b in order])
        progress = heartbeat_from_thread()
        try:
            offer, instance = await asyncio.to_thread(
                provision_cloud, inp.job, resources, offers, backends=self.backends, ledger=self.ledger,
                max_offers=self.config.max_offers, progress=progress)
            instance = await self._until_running(instance)
        except (NoCapacity, CloudError) as e:
            raise activity_error(e) from e
        placement = placement_of(offer, instance).model_copy(update={"address": self.address(instance)})
        log.info("%s: provisioned %s %s in %s", inp.job.replica_id, instance.backend, instance.instance_id,
                 instance.zone or instance.region)
        return Provisioned(placement=placement, instance=instance.model_dump(mode="json"))

    async def _until_running(self, instance: CloudInstance) -> CloudInstance:
        """Wait (bounded) until the instance runs with an address: a pending AWS instance has no public IP yet,
        and the placement's address is what the gateway will route to."""
        deadline = time.monotonic() + self.boot_timeout
        while not (instance.state == "running" and self.address(instance)):
            if time.monotonic() > deadline:  # retryable: the next attempt adopts the instance and waits again
                provisioning_failed(instance.backend, "not_running")
                raise CloudError(ErrorKind.TRANSIENT, f"{instance.instance_id} is not running after "
                                 f"{self.boot_timeout:g}s ({instance.state})", code="BootTimeout")
            activity.heartbeat(f"{instance.instance_id} is {instance.state}")
            await asyncio.sleep(min(self.poll_seconds, 5.0))
            current = await asyncio.to_thread(self._backend(instance).get, instance)
            if current is None or current.state in DOWN:
                if current is not None:  # a stopped VM still bills for its disk
                    await asyncio.to_thread(terminate_cloud, current, backends=self.backends, ledger=self.ledger)
                provisioning_failed(instance.backend, "not_running")
                raise CloudError(ErrorKind.TRANSIENT, f"{instance.instance_id} went away before it ran",
                                 code="Vanished")
            instance = current
        return instance

    # --- readiness and watch ---------------------------------------------------------------------

    @activity.defn(name=names.WAIT_READY)
    async def wait_ready(self, inp: ReadyInput) -> None:
        """Ready = the instance runs and its app answers the probes (or any HTTP without probes)."""
        instance = self._cloud_instance(inp.ref)
        streaks = ProbeStreaks([ProbeSpec.model_validate(p) for p in inp.probes])
        checked = float("-inf")
        while True:
            now = time.monotonic()
            if now - checked >= self.poll_seconds:
                instance, checked = await self._current(instance), now
                if instance.state in DOWN:
                    raise ApplicationError(f"instance {instance.instance_id} is {instance.state}",
                                           type="ReplicaExited", non_retryable=True)
            address = self.address(instance)
            if instance.state == "running" and address:
                if streaks.probes:
                    await streaks.run_due(address, now)
                    if streaks.ready():
                        return
                elif await answers_http(address) is not None:
                    return
            activity.heartbeat(streaks.summary() or instance.state)
            await asyncio.sleep(PROBE_SECONDS)

    @activity.defn(name=names.WATCH)
    async def watch(self, ref: InstanceRef) -> str:
        """Heartbeat while the instance runs; return why it stopped (preempted, deleted outside durastack)."""
        instance = self._cloud_instance(ref)

        async def down() -> Optional[str]:
            nonlocal instance
            instance = await self._current(instance)
            return f"instance {instance.state}" if instance.state in DOWN else None

        return await watch_until_down(down, self.poll_seconds)

    async def _current(self, instance: CloudInstance) -> CloudInstance:
        """The instance now (state ``terminated`` once gone); the last known state on a transient error."""
        try:
            current = await asyncio.to_thread(self._backend(instance).get, instance)
        except CloudError as e:
            if e.kind is ErrorKind.FATAL:  # e.g. expired credentials: retried (a running replica stays up)
                raise activity_error(e, teardown=True) from e
            log.warning("%s: %s (keeps watching)", instance.instance_id, e.message)
            return instance
        return current or instance.model_copy(update={"state": "terminated"})

    # --- terminate ---------------------------------------------------------------------------------

    @activity.defn(name=names.TERMINATE)
    @keeps_alive
    async def terminate(self, ref: InstanceRef) -> None:
        """Terminate the replica's instance; without a record (provision never returned), every instance
        tagged for this replica submission. Retried until it works: a leak costs money every hour."""
        try:
            if ref.instance and ref.backend in CLOUDS:
                await asyncio.to_thread(terminate_cloud, self._cloud_instance(ref), backends=self.backends,
                                        ledger=self.ledger)
            else:
                await asyncio.to_thread(terminate_replica, ref.job, backends=self.backends, ledger=self.ledger)
        except (NoCapacity, CloudError) as e:
            raise activity_error(e, teardown=True) from e

    async def terminate_unrecorded(self, job: JobSpec) -> int:
        """For a local teardown without a record: an in-process cloud walk this worker's ledger saw for this
        replica may have launched something. Checking the ledger first keeps pure-local replicas off the cloud."""
        if not self.backends:
            return 0
        entries = await asyncio.to_thread(self.ledger.entries)
        if not any((e.get("data") or {}).get("replica_id") == job.replica_id for e in entries):
            return 0
        try:
            return await asyncio.to_thread(terminate_replica, job, backends=self.backends, ledger=self.ledger)
        except CloudError as e:
            raise activity_error(e, teardown=True) from e

    # --- helpers ---------------------------------------------------------------------------------

    def _backend(self, instance: CloudInstance) -> CloudBackend:
        backend = self.backends.get(instance.backend)
        if backend is None:
            raise ApplicationError(f"backend {instance.backend} is not configured on this worker", type="NotConfigured")
        return backend

    @staticmethod
    def _cloud_instance(ref: InstanceRef) -> CloudInstance:
        if ref.backend not in CLOUDS or not ref.instance:
            raise ApplicationError(f"unknown instance on backend {ref.backend}", type="UnknownInstance",
                                   non_retryable=True)
        return CloudInstance.model_validate(ref.instance)


__all__ = ["CloudReplicas"]
