"""The cloud half of a replica's activities: place on AWS/GCP offers, readiness, liveness, terminate.

``ReplicaActivities`` (activities/replica.py) runs launch, teardown and monitor for every backend and hands a
cloud replica's instance work to ``CloudReplicas``: on the main worker for the clouds it serves itself, on a
``worker.py --backends aws`` worker for that cloud alone (each on ``<queue>-<cloud>``). Cloud calls block, so
they run in threads. Only ``CloudInstance``/``Placement`` values leave these activities: never the job's env,
the user-data or a credential.

With ``ssh`` (backends/ssh.py) a replica is reached over SSH only: once the instance runs, the launch waits for
its SSH (pinned to the host key durastack made for it), sends the job (env in a mode-600 file) and starts its
container, and opens the tunnel whose Unix socket is the replica's gateway address; the monitor checks the
container over the same SSH every few seconds, and keeps the tunnels of the replicas it watches (after a worker
restart it opens them again). A lost tunnel unroutes the replica until it is back.

With a cloud's ``data_path: private`` (a control plane inside the VPC) there is no tunnel: the gateway's upstream and
the readiness probes are the instance's ``<private IP>:<port>``, which its firewall admits from the gateway alone.
SSH (to the private IP) still sends the job and its env, and the monitor checks the container over a plain SSH
connection of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Callable, Optional

import asyncssh

from temporalio.exceptions import ApplicationError

from activities.cloud import (OffersExhausted, activity_error, heartbeat_from_thread, placement_of, provision_cloud,
                              terminate_cloud, terminate_replica)
from activities.data_path import DOWN, DataPath, DirectPath, PrivatePath, Route, TunnelPath
from activities.interface import refusal_error
from activities.liveness import progress
from activities.metrics import provisioning_failed
from activities.probes import ProbeStreaks, answers_http
from activities.report import record_event
from activities.volume_mounts import ReplicaVolumes
from backends.base import Backend
from backends.catalog import load_catalog
from backends.cloud import CloudBackend, reservation_in
from backends.cloud_errors import CloudError, ErrorKind
from backends.ssh import CONTAINER_CHECK_SECONDS, NotReady, PullDenied, SSHClient, SSHTarget, booted_driver, \
    clear_job, container_state, logs_command, replace_host_key, run, ssh_target, start_job, wait_booted
from gateway.client import GatewayClient
from models.backends import CLOUDS, TAG_NAMES, BackendsConfig, CloudInstance, owner
from models.failures import FailureKind
from models.offers import InstanceOffer, describe_mismatch, match_offers
from models.replica import JobSpec
from models.reservations import ReservationLookup
from models.messages import PlacementRefusal
from models.messages import ReplicaInput
from models.state import Placement
from models.service import ProbeSpec
from store import StoreLedger

log = logging.getLogger("durastack.replica_cloud")
PROBE_SECONDS = 1.0  # between readiness probes of a booted instance


def booted(job: JobSpec, instance: CloudInstance, offer: InstanceOffer, driver: str) -> str:
    """The launch's event of a booted instance: which image it booted, and on a GPU which NVIDIA driver it runs."""
    said = f"replica {job.replica_num}: {instance.backend} {instance.instance_id} booted image " \
           f"{instance.image or '(not tagged)'}"
    return said + (f", NVIDIA driver {driver or '(not read)'}" if offer.gpu_count else "")


class CloudReplicas(Backend):
    def __init__(self, config: BackendsConfig, backends: dict[str, CloudBackend], ledger: StoreLedger, *,
                 catalog: Optional[list[InstanceOffer]] = None,
                 address: Optional[Callable[[CloudInstance], str]] = None, poll_seconds: float = 15.0,
                 boot_timeout: float = 900.0, ssh: Optional[SSHClient] = None, ssh_keys=None,
                 home: Optional[Path] = None, container_poll_seconds: float = 2.0,
                 gateway: Optional[GatewayClient] = None):
        """``backends``: the clouds this worker calls itself. ``ssh`` + ``ssh_keys`` (backends.ssh_keys) + ``home``:
        the SSH data paths (activities/data_path.py; tunnels under ``home/tunnels``). Without them (older tests),
        ``address`` says where the gateway and the probes reach an instance's app — default its own ``address``.
        ``poll_seconds``: how often an instance's cloud state is read (cloud APIs are rate-limited and slow);
        ``container_poll_seconds``: how often its container is checked over SSH. ``gateway``: where its tunnels unroute a replica while down and
        route it back (none: they leave the routes alone)."""
        self.config, self.backends, self.ledger = config, backends, ledger
        self._catalog = catalog
        self.ssh, self.ssh_keys, self.home = ssh, ssh_keys, home
        self.routes: dict[str, Route] = {}  # instance id → (service, replica id, group) once routed
        self.gateway = gateway
        self._cloud_checked: dict[str, tuple[float, CloudInstance]] = {}
        # The data path of each cloud, chosen once from its configuration (``data_path``).
        if ssh is None:
            self._paths: dict[str, DataPath] = {name: DirectPath(address) for name in CLOUDS}
            self.tunnels, self.controls = {}, {}
        else:
            tunnel = TunnelPath(ssh, home, self._target, gateway, self.routes, self._current)
            private = PrivatePath(ssh, self._target)
            self._paths = {name: private if self._private_configured(name) else tunnel for name in CLOUDS}
            self.tunnels, self.controls = tunnel.tunnels, private.controls
        self.poll_seconds, self.boot_timeout = poll_seconds, boot_timeout
        self.container_poll_seconds = container_poll_seconds
        self.volumes = ReplicaVolumes(backends, getattr(ledger, "store", None))

    one_activity = False  # an instance boots and pulls for minutes: each step has its own activity and budget

    @property
    def min_poll_seconds(self) -> float:
        return self.container_poll_seconds if self.ssh is not None else self.poll_seconds

    # --- the data path -------------------------------------------------------------------------------

    def _private_configured(self, backend: str) -> bool:
        """Whether the cloud's ``data_path`` is ``private``: reached at its private address, no tunnel."""
        cfg = getattr(self.config, backend, None)
        return bool(cfg and getattr(cfg, "data_path", "ssh") == "private")

    def data_path(self, instance: CloudInstance) -> DataPath:
        return self._paths[instance.backend]

    def address(self, instance: CloudInstance) -> str:
        """The gateway's upstream: the tunnel's socket, or ``<private IP>:<port>`` with ``data_path: private``."""
        return self.data_path(instance).address(instance)

    def reach(self, instance: CloudInstance):
        """Where this worker reaches the app (as the probes do): the tunnel's socket, or its private address."""
        path = self.data_path(instance)
        return path.address(instance), path.connect(instance)

    def _target(self, instance: CloudInstance, booting: bool = False) -> SSHTarget:
        """How to reach the instance's sshd, and which host key to trust: the one made after boot; while
        ``booting`` (the launch, until it has replaced it), also the one its boot data carries."""
        host = self.data_path(instance).ssh_host(instance, self.config_public(instance))
        return ssh_target(self.ssh_keys, host, instance.key, instance.host_key_after_boot, booting)

    def config_public(self, instance: CloudInstance) -> bool:
        cfg = getattr(self.config, instance.backend, None)
        return bool(cfg and cfg.public_ip)

    def _boot_timeout(self, instance: CloudInstance, state: str, detail: str) -> CloudError:
        """An instance that did not come up in time: retryable, the next attempt adopts it and waits again."""
        provisioning_failed(instance.backend, "not_running")
        return CloudError(ErrorKind.TRANSIENT, f"{instance.instance_id}{state} after {self.boot_timeout:g}s "
                                               f"({detail})", code="BootTimeout")

    async def _boot(self, inp: ReplicaInput, instance: CloudInstance) -> str:
        """Wait (bounded) for the instance's SSH and its boot; then its sshd serves the key made after boot. Returns
        the NVIDIA driver the boot found ('' without a GPU)."""
        target = self._target(instance, booting=True)
        deadline = time.monotonic() + self.boot_timeout
        said = ""
        while True:
            try:
                conn = await self.ssh.connect(target)
                try:
                    booted = await wait_booted(conn)
                except (OSError, asyncio.TimeoutError, asyncssh.Error) as e:  # e.g. sshd restarted by the boot
                    booted, e_text = False, str(e) or type(e).__name__
                else:
                    e_text = "booting (Docker, GPU runtime)"
                if booted:
                    break
                conn.close()
                why = e_text
            except NotReady as e:
                why = str(e)
            if time.monotonic() > deadline:
                raise self._boot_timeout(instance, ": no SSH", why)
            if why != said:  # a boot that never answers is explained in the worker's log, once per reason
                log.info("%s: %s: waiting for SSH: %s", inp.job.replica_id, instance.instance_id, why)
                said = why
            progress(f"{instance.instance_id}: {why}")
            await asyncio.sleep(min(self.poll_seconds, 2.0))
        try:
            if instance.host_key_after_boot:
                after = self.ssh_keys.host_key(instance.key, after_boot=True)
                await replace_host_key(conn, after.private_openssh, after.public_openssh)
            return await booted_driver(conn)
        except RuntimeError as e:
            raise CloudError(ErrorKind.TRANSIENT, f"{instance.instance_id}: {e}", code="BootFailed") from e
        finally:
            conn.close()

    async def _ssh_start(self, inp: ReplicaInput, instance: CloudInstance, gpu: bool) -> None:
        """Send the job, pull its image and start its container, over SSH: once (a container an earlier attempt
        started is kept)."""
        try:
            conn = await self.ssh.connect(self._target(instance))
        except NotReady as e:  # booted a moment ago: a network blip, retried
            raise CloudError(ErrorKind.TRANSIENT, str(e), code="NoSSH") from e
        try:
            started = await start_job(conn, inp.job, gpu=gpu, replica_ip=instance.private_ip,
                                      said=lambda text: progress(f"{instance.instance_id}: {text}"))
            if not started:
                log.info("%s: %s: kept the container an earlier attempt started", inp.job.replica_id,
                         instance.instance_id)
        except PullDenied as e:  # the same credentials would be refused again: the replica fails, saying why
            why = "check `image` and `registry_auth`" if inp.job.registry_auth else \
                "a private image needs `registry_auth`"
            raise ApplicationError(f"{e} ({why})", type="ImagePullDenied", non_retryable=True) from e
        except RuntimeError as e:  # docker pull or run failed: the message is docker's, never the env
            raise CloudError(ErrorKind.TRANSIENT, f"{instance.instance_id}: {e}", code="StartFailed") from e
        finally:
            conn.close()

    def routed(self, instance: CloudInstance, service: str, replica_id: str, group: str) -> None:
        """The launch registered the replica: a tunnel that comes back routes it again."""
        self.routes[instance.instance_id] = (service, replica_id, group)

    def unroute(self, instance: Optional[CloudInstance]) -> None:
        """The teardown unregisters it: a tunnel coming back must not route it again."""
        if instance is not None:
            self.routes.pop(instance.instance_id, None)

    async def adopt(self, service: str, watched: list) -> None:
        """The monitor's replicas: reached again (their tunnels opened) if this worker holds nothing for them."""
        for w in watched:
            if isinstance(w.instance, CloudInstance):
                await self.data_path(w.instance).adopt(w.instance, (service, w.replica_id, w.group))

    async def _close(self, instance_id: str) -> None:
        """Let go of what reaches the instance (its tunnel, or the monitor's SSH connection). Unrouted first: a
        tunnel that closes must not unregister a replica again."""
        self.routes.pop(instance_id, None)
        for path in dict.fromkeys(self._paths.values()):
            await path.close(instance_id)

    # --- place ------------------------------------------------------------------------------------

    async def place(self, inp: ReplicaInput, backend: str) -> tuple[Placement, CloudInstance]:
        """Walk ``backend``'s offers for the replica, cheapest first; an instance an earlier attempt made is
        adopted (the walker's provisioning keys), so a retried launch never makes a second one."""
        if backend not in self.backends:
            raise refusal_error(PlacementRefusal(backend=backend, tried=False, reasons=[
                f"backend {backend} is not configured on this worker ($DURASTACK_HOME/config.yml)"]))
        pool = [o for o in (self._catalog or load_catalog()) if o.backend == backend and self.config.allows(o)]
        regions, zones = await self.volumes.where(inp, backend)  # a network volume's zone, if it mounts one
        filters = dict(spot_policy=inp.spot_policy, max_price=inp.max_price, regions=regions,
                       instance_types=inp.instance_types, zones=zones,
                       reservation=await self._reservation(inp, backend))
        offers = match_offers(pool, inp.resources, **filters)
        if not offers:
            provisioning_failed(backend, "no_offers")
            raise refusal_error(PlacementRefusal(backend=backend, tried=False, reasons=[
                describe_mismatch(pool, inp.resources, **filters) or inp.resources.summary()]))
        if isinstance(inp.reuse, CloudInstance) and inp.reuse.backend == backend:
            reused = await self._reuse(inp, inp.reuse, offers)
            if reused is not None:
                return reused
        try:
            offer, instance = await asyncio.to_thread(
                provision_cloud, inp.job, inp.resources, offers, backends={backend: self.backends[backend]},
                ledger=self.ledger, max_offers=self.config.max_offers, progress=heartbeat_from_thread())
            instance = await self._until_running(instance)
            if self.ssh is not None:
                said = booted(inp.job, instance, offer, await self._boot(inp, instance))
                await record_event(inp.service_workflow_id, inp.job, "replica", said)
        except OffersExhausted as e:
            raise refusal_error(PlacementRefusal(backend=backend, tried=e.tried, reasons=e.reasons)) from e
        except CloudError as e:
            raise activity_error(e) from e
        placement = placement_of(offer, instance).model_copy(update={"address": self.address(instance)})
        log.info("%s: provisioned %s %s in %s", inp.job.replica_id, instance.backend, instance.instance_id,
                 instance.zone or instance.region)
        return placement, instance

    async def _reservation(self, inp: ReplicaInput, backend: str) -> Optional[ReservationLookup]:
        """What ``backend`` says now of the replica's reservation, in the regions it may use there."""
        if not inp.reservation:
            return None
        try:
            return await asyncio.to_thread(reservation_in, self.backends[backend], inp.reservation, inp.regions)
        except CloudError as e:
            raise activity_error(e) from e

    async def _reuse(self, inp: ReplicaInput, idle: CloudInstance, offers: list[InstanceOffer]
                     ) -> Optional[tuple[Placement, CloudInstance]]:
        """Place the replica on the idle instance its service gave it: tagged for it, no boot to wait for (its sshd
        already serves the host key made after boot). None when it is gone, no longer runs, or is not its group's
        (never another service's): the offer walk follows."""
        job = inp.job
        try:
            current = await asyncio.to_thread(self._backend(idle).get, idle)
            mine = owner(idle.backend, job.service, job.group, job.replica_num, job.submission_num)
            ours = current is not None and current.owner[:2] == mine[:2] and \
                current.owner[2] in (idle.owner[2], mine[2])  # a retried attempt finds it retagged already
            if current is None or current.state != "running" or not ours:
                log.info("%s: idle instance %s is %s: placing anew", job.replica_id, idle.instance_id,
                         "gone" if current is None else current.state if ours else "not this group's")
                return None
            progress(f"{idle.instance_id}: reused (idle)")
            await asyncio.to_thread(self._backend(idle).retag, current, job)
        except CloudError as e:
            raise activity_error(e) from e
        current = current.model_copy(update={"tags": {**current.tags, TAG_NAMES[idle.backend]["replica"]: mine[2]}})
        offer = next((o for o in offers if (o.instance_type, o.region, o.spot) ==
                      (current.instance_type, current.region, current.spot)), None)
        placement = placement_of(offer, current) if offer else Placement(  # an offer the catalog lost since
            backend=current.backend, region=current.region, instance_type=current.instance_type, price=idle.price,
            spot=current.spot, instance_id=current.instance_id, ip=current.private_ip)
        log.info("%s: placed on idle %s %s", job.replica_id, current.backend, current.instance_id)
        return placement.model_copy(update={"address": self.address(current)}), \
            current.model_copy(update={"price": placement.price})

    async def start(self, inp: ReplicaInput, instance: CloudInstance) -> None:
        """Start the job on the running instance, over SSH (without SSH, its user data started it at boot)."""
        if self.ssh is None:
            if inp.late_refs or inp.job.volumes:
                raise ApplicationError(f"{inp.job.replica_id}: commands naming replicas placed after it, and volumes, "
                                       "need the SSH path to start", type="Unsupported", non_retryable=True)
            return
        gpu = any(o.gpu_count for o in (self._catalog or load_catalog())
                  if o.backend == instance.backend and o.instance_type == instance.instance_type)
        try:
            for said in await self.volumes.attach(inp.job, instance, lambda: self.ssh.connect(self._target(instance))):
                await record_event(inp.service_workflow_id, inp.job, "replica", f"replica {inp.job.replica_num}: {said}")
            await self._ssh_start(inp, instance, gpu=gpu)
        except CloudError as e:
            raise activity_error(e) from e

    async def _until_running(self, instance: CloudInstance) -> CloudInstance:
        """Wait (bounded) until the instance runs with an address: a pending AWS instance has no public IP yet,
        and that address is what SSH (or, without it, the gateway) connects to."""
        deadline = time.monotonic() + self.boot_timeout
        def reachable(i: CloudInstance) -> bool:  # over SSH, at its own address; else at the mapped one
            return self.data_path(i).reachable(i)

        while not reachable(instance):
            if time.monotonic() > deadline:
                raise self._boot_timeout(instance, " is not running", instance.state)
            progress(f"{instance.instance_id} is {instance.state}")
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

    # --- readiness and liveness ---------------------------------------------------------------------

    async def wait_ready(self, instance: CloudInstance, probes: list[ProbeSpec], until: Optional[float] = None) -> None:
        """Ready = the instance runs and its app answers the probes (or any HTTP without probes); past ``until``,
        not yet. Its instance and its container are checked as the monitor checks them: a command that exits
        before it is ready fails the launch at once, as on the local backend, rather than after its timeout."""
        await self.data_path(instance).open(instance)
        streaks = ProbeStreaks(probes)
        checked = float("-inf")
        while True:
            now = time.monotonic()
            if now - checked >= self.min_poll_seconds:  # the container every few seconds, the cloud API less
                checked = now
                why = await self._down(instance)
                if why is not None:
                    raise ApplicationError(why, type="ReplicaExited", non_retryable=True)
                instance = self._cloud_checked.get(instance.instance_id, (now, instance))[1]
            address, connect = self.reach(instance)
            if instance.state == "running" and address:
                if streaks.probes:
                    await streaks.run_due(address, now, connect)
                    if streaks.ready():
                        return
                elif await answers_http(address, connect=connect) is not None:
                    return
            streaks.end_attempt_past(until)
            progress(streaks.said() if instance.state == "running" else f"{instance.instance_id} is {instance.state}")
            await asyncio.sleep(PROBE_SECONDS)

    async def down(self, instances: list[CloudInstance]) -> list[Optional[str]]:
        """For each instance, why it is down (its container exited, preempted, deleted outside durastack), or None
        while it runs. The container is checked over SSH at every call; the cloud API every ``poll_seconds``."""
        return list(await asyncio.gather(*(self._down(i) for i in instances)))

    async def _down(self, instance: CloudInstance) -> Optional[str]:
        now = time.monotonic()
        checked = self._cloud_checked.get(instance.instance_id)
        if self.ssh is None or checked is None or now - checked[0] >= self.poll_seconds:
            current = await self._current(instance)
            self._cloud_checked[instance.instance_id] = (now, current)
        else:
            current = checked[1]
        if current.state in DOWN:
            # A spot instance going away is the cloud taking its capacity back: said so in the event.
            return f"{FailureKind.SPOT_INTERRUPTION} (instance {current.state})" if instance.spot else f"instance {current.state}"
        connection = await self.data_path(instance).connection(instance)
        if connection is None:
            return None  # no SSH now (a lost tunnel reconnects; the replica is unrouted meanwhile)
        try:
            state = await container_state(connection)
        except (OSError, asyncio.TimeoutError, Exception) as e:  # noqa: BLE001 — the connection broke mid-check
            log.info("%s: container check: %s", instance.instance_id, e)
            self.data_path(instance).drop(instance.instance_id, connection)
            return None
        return f"container {state}" if state else None

    async def last_output(self, instance: CloudInstance, lines: int) -> str:
        connection = await self.data_path(instance).connection(instance)
        if connection is None:
            return ""
        try:
            _, out, _ = await run(connection, logs_command(follow=False, tail=lines) + " 2>&1",
                                  timeout=CONTAINER_CHECK_SECONDS)
        except (OSError, asyncio.TimeoutError, asyncssh.Error) as e:
            log.info("%s: last output: %s", instance.instance_id, e)
            return ""
        return out

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

    # --- keep idle, terminate -------------------------------------------------------------------------

    async def keep_idle(self, job: JobSpec, instance: Optional[CloudInstance]) -> bool:
        """Leave the instance running without the replica (`idle_duration`): its tunnel closed, its container and
        job files removed over SSH, its network volumes detached, its image and instance volumes kept. False when
        that cannot be done (no SSH path, the instance unreachable or gone): the caller terminates it as usual."""
        if self.ssh is None or instance is None:
            return False
        await self._close(instance.instance_id)
        self._cloud_checked.pop(instance.instance_id, None)
        try:
            conn = await self.ssh.connect(self._target(instance))
        except (NotReady, OSError, asyncssh.Error) as e:
            log.info("%s: %s not kept idle: %s", job.replica_id, instance.instance_id, e)
            return False
        try:
            await clear_job(conn)
        except (RuntimeError, OSError, asyncio.TimeoutError, asyncssh.Error) as e:
            log.info("%s: %s not kept idle: %s", job.replica_id, instance.instance_id, e)
            return False
        finally:
            conn.close()
        # Its network volumes go free at once, as at a termination: the next replica may be placed elsewhere.
        await self.volumes.release(job, instance, lambda: self.ssh.connect(self._target(instance)))
        log.info("%s: %s kept idle", job.replica_id, instance.instance_id)
        return True

    async def stop_idle(self, job: JobSpec, backend: str, instance: CloudInstance) -> None:
        """Terminate an instance the replica kept idle, unless its tags name another replica now (one took it)."""
        try:
            current = await asyncio.to_thread(self._backend(instance).get, instance)
        except CloudError as e:
            raise activity_error(e, teardown=True) from e
        if current is not None and current.owner != owner(backend, job.service, job.group, job.replica_num,
                                                          job.submission_num):
            log.info("%s: idle %s runs %s now: left to it", job.replica_id, instance.instance_id, current.owner[2])
            return
        await self.stop(job, backend, instance)


    async def stop(self, job: JobSpec, backend: str, instance: Optional[CloudInstance]) -> None:
        """Terminate the replica's instance; without a record (a launch died before it returned), every instance
        tagged for this replica submission on ``backend``. Already gone is success."""
        if instance is not None:
            await self._close(instance.instance_id)
            self._cloud_checked.pop(instance.instance_id, None)
        try:
            connect = (lambda: self.ssh.connect(self._target(instance))) if self.ssh is not None else None
            await self.volumes.release(job, instance, connect)  # free for the next replica at once
            if instance is not None:
                await asyncio.to_thread(terminate_cloud, instance, backends=self.backends, ledger=self.ledger)
            elif backend in self.backends:
                await asyncio.to_thread(terminate_replica, job, backends={backend: self.backends[backend]},
                                        ledger=self.ledger)
            else:
                raise CloudError(ErrorKind.FATAL, f"backend {backend} is not configured; cannot look for "
                                 f"{job.replica_id}'s instance", code="NotConfigured")
        except CloudError as e:
            raise activity_error(e, teardown=True) from e
        await self._release(job.service, backend)

    async def _release(self, service: str, backend: str) -> None:
        """Once the service has no instance left there: its security groups (AWS), the SSH firewall rule if no
        instance of this control plane is left (GCP). Best effort, but a group still held by an instance that is
        shutting down fails the teardown retryably: it is retried until the group goes."""
        cloud = self.backends.get(backend)
        if cloud is None:
            return
        try:
            await asyncio.to_thread(cloud.release, service)
        except CloudError as e:
            if e.kind is ErrorKind.TRANSIENT and e.code == "DependencyViolation":
                raise activity_error(e, teardown=True) from e  # retried until the group can go
            log.info("releasing %s's network rules on %s: %s (left for later)", service, backend, e.message)

    # --- helpers ---------------------------------------------------------------------------------

    def _backend(self, instance: CloudInstance) -> CloudBackend:
        backend = self.backends.get(instance.backend)
        if backend is None:
            raise ApplicationError(f"backend {instance.backend} is not configured on this worker", type="NotConfigured")
        return backend


__all__ = ["CloudReplicas"]
