"""The activities of a replica's life and of a service's gateway route.

Dependencies (the local backend, the gateway client, the token source) are injected, so tests can
swap any of them. Errors that retrying cannot fix are raised non-retryable, with a message a
person can act on; everything else is left to Temporal's retries.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Optional

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.catalog import local_offer
from activities.local import LocalBackend, UnsupportedJobError
from activities.probes import ProbeStreaks, answers_http
from gateway.client import GatewayClient
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
    def __init__(self, local: LocalBackend, gateway: GatewayClient, tokens: Callable[[], list[str]]):
        self.local = local
        self.gateway = gateway
        self.tokens = tokens

    def all(self) -> list:
        return [self.provision, self.wait_ready, self.watch, self.terminate, self.register, self.unregister,
                self.ensure_route, self.remove_route]

    # --- instances ------------------------------------------------------------------------------

    @activity.defn(name=names.PROVISION)
    async def provision(self, inp: ReplicaInput) -> Provisioned:
        backends = inp.backends or ["local"]
        if "local" not in backends:
            raise _fatal(f"no offers: backends {backends} are not configured on this control plane; "
                         "only `local` is", "NoOffers")
        resources = ResourcesSpec.model_validate(inp.resources)
        # The local machine has no spot market: the spot policy does not apply to it.
        offers = [local_offer()]
        if not match_offers(offers, resources, spot_policy="auto", max_price=inp.max_price, backends=["local"],
                            regions=inp.regions):
            why = describe_mismatch(offers, resources, spot_policy="auto", max_price=inp.max_price,
                                    backends=["local"], regions=inp.regions)
            raise _fatal(f"no offers: this machine does not fit ({why or resources.summary()})", "NoOffers")
        try:
            instance = await asyncio.to_thread(self.local.start, inp.job)
        except UnsupportedJobError as e:
            raise _fatal(str(e), "Unsupported") from e
        placement = Placement(backend="local", region="local", instance_type="local", price=0.0,
                              address=instance.address, instance_id=str(instance.pid))
        return Provisioned(placement=placement, instance=instance.model_dump(mode="json"))

    @activity.defn(name=names.WAIT_READY)
    async def wait_ready(self, inp: ReadyInput) -> None:
        """Probe until ready; fail (not retried) if the app exits first."""
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
        instance = self._instance(ref)
        while True:
            status = await asyncio.to_thread(self.local.status, instance)
            if status.state != "running":
                return _exit_reason(status.state, status.exit_code)
            activity.heartbeat()
            await asyncio.sleep(POLL_SECONDS)

    @activity.defn(name=names.TERMINATE)
    async def terminate(self, ref: InstanceRef) -> None:
        """Stop the replica's processes; one that is already gone is success."""
        instance = self._instance(ref) if ref.instance else self._recorded(ref.job)
        if instance is not None:
            await asyncio.to_thread(self.local.stop, instance)

    # --- gateway --------------------------------------------------------------------------------

    @activity.defn(name=names.REGISTER)
    async def register(self, reg: Registration) -> None:
        await self.gateway.register(reg.service, reg.replica_id, reg.group, reg.address)

    @activity.defn(name=names.UNREGISTER)
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
        await self.gateway.put_service(inp.service, auth=inp.auth, tokens=self.tokens(),
                                       cold_start_timeout=inp.cold_start_timeout)

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
