"""The activities of a replica's life and of a service's gateway route.

Dependencies (the local backend, the gateway client, the cloud backends) are
injected, so tests can swap any of them. Errors that retrying cannot fix are raised non-retryable,
with a message a person can act on; everything else is left to Temporal's retries.

A replica runs on this machine when its service allows ``local`` and the machine fits; otherwise on
the configured clouds (``activities/replica_cloud.py``). The instance activities dispatch on
``ref.backend``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Optional

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.catalog import local_offer
from activities.liveness import keeps_alive
from activities.local import LocalBackend, UnsupportedJobError
from activities.metrics import NO_BACKEND, provisioning_failed
from activities.probes import ProbeStreaks, answers_http
from activities.replica_cloud import CloudReplicas
from activities.store import StoreLedger
from activities.watch import watch_until_down
from gateway.client import GatewayClient
from models.backends import CLOUDS, BackendsConfig
from models.offers import describe_mismatch, match_offers
from models.replica import JobSpec, LocalInstance
from models.resources import ResourcesSpec
from models.run import InstanceRef, Placement, Provisioned, ReadyInput, Registration, ReplicaInput, RouteInput
from models.service import ProbeSpec
from workflows import names

POLL_SECONDS = 1.0  # process liveness
READY_POLL_SECONDS = 0.2  # an app that just started answers within a few of these


def _fatal(message: str, kind: str) -> ApplicationError:
    return ApplicationError(message, type=kind, non_retryable=True)


class ReplicaActivities:
    def __init__(self, local: LocalBackend, gateway: GatewayClient, cloud: Optional[CloudReplicas] = None,
                 local_replicas: bool = True):
        """``cloud``: the clouds of ``$DURASTACK_HOME/config.yml`` (worker.py builds it); None: local only.
        ``local_replicas``: False on cluster workers, whose own machine the gateway cannot reach."""
        self.local, self.local_replicas = local, local_replicas
        self.gateway = gateway
        self.cloud = cloud or CloudReplicas(BackendsConfig(), {}, StoreLedger())

    def all(self) -> list:
        return [self.provision, self.wait_ready, self.watch, self.terminate, self.register, self.unregister,
                self.ensure_route, self.remove_route]

    # --- instances ------------------------------------------------------------------------------

    @activity.defn(name=names.PROVISION)
    @keeps_alive
    async def provision(self, inp: ReplicaInput) -> Provisioned:
        notes: tuple[str, ...] = ()
        if not self.local_replicas and (inp.backends is None or "local" in inp.backends):
            notes = ("this worker runs no replicas on its own machine (DURASTACK_LOCAL_REPLICAS=off)",)
        elif inp.backends is None or "local" in inp.backends:
            resources = ResourcesSpec.model_validate(inp.resources)
            # The local machine has no spot market: the spot policy does not apply to it.
            offers = [local_offer()]
            if match_offers(offers, resources, spot_policy="auto", max_price=inp.max_price, backends=["local"],
                            regions=inp.regions):
                return await self._provision_local(inp)
            why = describe_mismatch(offers, resources, spot_policy="auto", max_price=inp.max_price,
                                    backends=["local"], regions=inp.regions)
            notes = (f"this machine does not fit ({why or resources.summary()})",)
        clouds, unconfigured = self.cloud.usable(inp)
        if not clouds:
            provisioning_failed(NO_BACKEND, "no_offers")
            raise _fatal("no offers: " + "; ".join(notes + tuple(unconfigured)), "NoOffers")
        return await self.cloud.provision_with(inp, notes)

    async def _provision_local(self, inp: ReplicaInput) -> Provisioned:
        try:
            instance = await asyncio.to_thread(self.local.start, inp.job)
        except UnsupportedJobError as e:
            provisioning_failed("local", "unsupported")
            raise _fatal(str(e), "Unsupported") from e
        placement = Placement(backend="local", region="local", instance_type="local", price=0.0,
                              address=instance.address, instance_id=str(instance.pid))
        return Provisioned(placement=placement, instance=instance.model_dump(mode="json"))

    @activity.defn(name=names.WAIT_READY)
    async def wait_ready(self, inp: ReadyInput) -> None:
        """Probe until ready; fail (not retried) if the app exits first."""
        if inp.ref.backend in CLOUDS:
            return await self.cloud.wait_ready(inp)
        instance = self._instance(inp.ref)
        streaks = ProbeStreaks([ProbeSpec.model_validate(p) for p in inp.probes])
        while True:
            await self._alive_or_fail(instance)
            if streaks.probes:
                await streaks.run_due(instance.address, time.monotonic())
                if streaks.ready():
                    return
            elif await answers_http(instance.address) is not None:
                return
            activity.heartbeat(streaks.summary())
            await asyncio.sleep(READY_POLL_SECONDS)

    @activity.defn(name=names.WATCH)
    async def watch(self, ref: InstanceRef) -> str:
        """Heartbeat while the app runs; return why it stopped. No history events while healthy."""
        if ref.backend in CLOUDS:
            return await self.cloud.watch(ref)
        instance = self._instance(ref)

        async def exited() -> Optional[str]:
            status = await asyncio.to_thread(self.local.status, instance)
            return None if status.state == "running" else _exit_reason(status.state, status.exit_code)

        return await watch_until_down(exited, POLL_SECONDS)

    @activity.defn(name=names.TERMINATE)
    @keeps_alive
    async def terminate(self, ref: InstanceRef) -> None:
        """Stop the replica's processes (or its cloud instance); one that is already gone is success."""
        if ref.backend in CLOUDS:
            return await self.cloud.terminate(ref)
        instance = self._instance(ref) if ref.instance else self._recorded(ref.job)
        if instance is not None:
            await asyncio.to_thread(self.local.stop, instance)
        if not ref.instance:  # provision never returned: it may have been walking cloud offers
            await self.cloud.terminate_unrecorded(ref.job)

    # --- gateway --------------------------------------------------------------------------------

    @activity.defn(name=names.REGISTER)
    @keeps_alive
    async def register(self, reg: Registration) -> None:
        await self.gateway.register(reg.service, reg.replica_id, reg.group, reg.address)

    @activity.defn(name=names.UNREGISTER)
    @keeps_alive
    async def unregister(self, reg: Registration) -> None:
        # Returns once nginx serves a configuration without this replica; requests already in flight
        # on it are finished by nginx's old workers (a graceful reload): wait for those, within
        # the service's stop_duration, before the replica may be stopped.
        await self.gateway.unregister(reg.service, reg.replica_id)
        deadline = time.monotonic() + reg.drain_seconds
        while time.monotonic() < deadline and not await self.gateway.drained():
            activity.heartbeat("draining")
            await asyncio.sleep(0.2)

    @activity.defn(name=names.ENSURE_ROUTE)
    async def ensure_route(self, inp: RouteInput) -> None:
        # The gateway's own tokens (`durastack token`) guard every route with auth.
        await self.gateway.put_service(inp.service, auth=inp.auth, cold_start_timeout=inp.cold_start_timeout)

    @activity.defn(name=names.REMOVE_ROUTE)
    async def remove_route(self, inp: RouteInput) -> None:
        await self.gateway.delete_service(inp.service)

    # --- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _instance(ref: InstanceRef) -> LocalInstance:
        if ref.backend != "local" or ref.instance is None:
            raise _fatal(f"unknown instance on backend {ref.backend}", "UnknownInstance")
        return LocalInstance.model_validate(ref.instance)

    def _recorded(self, job: JobSpec) -> Optional[LocalInstance]:
        """The instance a provision attempt may have started before it could report back."""
        return self.local.find(job)

    async def _alive_or_fail(self, instance: LocalInstance) -> None:
        status = await asyncio.to_thread(self.local.status, instance)
        if status.state != "running":
            raise _fatal(_exit_reason(status.state, status.exit_code), "ReplicaExited")


def _exit_reason(state: str, code: Optional[int]) -> str:
    return f"exited ({code})" if state == "exited" and code is not None else state
