"""A cloud replica's volumes through its life (``CloudReplicas`` calls these):

* placing it (``where``): the store says where each network volume is, and the offer walk gets that backend, region
  and zone only (``models.volumes.placement``: one rule for the plan and the launch);
* starting it (``attach``): each network volume is attached to its instance once it runs — after its holder lets it
  go, when that is a replica of the same service being stopped (a rollout's, a replacement's) — then mounted over SSH
  under ``/opt/durastack/volumes/<name>``: formatted ext4 only when ``blkid`` finds nothing on it, never a disk that
  holds a filesystem or a partition table. ``docker run -v`` then gives it to the container
  (backends/runtime.py), and refuses to start while one is not mounted (backends/userdata.py);
* stopping it (``release``): the container is stopped, the volumes unmounted and detached, before the instance is
  terminated, so the next replica can attach them at once.

Instance volumes need none of this: ``docker run -v`` binds the instance's directory, made if missing.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from typing import Awaitable, Callable, Optional

import asyncssh
from temporalio.exceptions import ApplicationError

from activities.liveness import progress
from backends.cloud_errors import CloudError, ErrorKind
from backends.runtime import CONTAINER_NAME
from backends.ssh import run
from backends.volumes import VolumeBusy, VolumeError, disks_of
from models.backends import CloudInstance, slug
from models.replica import JobSpec
from models.messages import ReplicaInput
from models.volumes import VolumeRecord, Where, network_names, placement

log = logging.getLogger("durastack.volumes")
WAIT_FOR_HOLDER_SECONDS = 900.0  # a replica of the same service being stopped lets a volume go within this
HOLDER_POLL_SECONDS = 5.0
DEVICE_WAIT_STEPS = 120  # × 0.5 s: a device appears within seconds of its attach (udev)
Connect = Callable[[], Awaitable[asyncssh.SSHClientConnection]]

_MOUNTED = "mounted"  # what the mount script says last: "formatted" first for a new disk


def mount_script(name: str, devices: list[str]) -> str:
    """Mount volume ``name`` from the first of ``devices`` (paths under /dev, ``$DURASTACK_DEV`` on simulated hosts)
    that appears. A disk on which ``blkid`` finds nothing (exit 2) is new: it is formatted ext4; one it fails to
    read is left alone (exit 4); a mount point already mounted (an earlier attempt) is kept. Exit 3: no device."""
    candidates = " ".join(shlex.quote(d) for d in devices)
    return f"""set -e
D="${{DURASTACK_DEV:-/dev}}"; M="${{DURASTACK_DIR:-/opt/durastack}}/volumes/{name}"
mkdir -p "$M"
if mountpoint -q "$M"; then echo {_MOUNTED}; exit 0; fi
DEV=""
for i in $(seq {DEVICE_WAIT_STEPS}); do
  for c in {candidates}; do if [ -e "$D/$c" ]; then DEV="$D/$c"; break 2; fi; done
  sleep 0.5
done
if [ -z "$DEV" ]; then echo "no device for volume {name} (looked for {candidates} under $D)" >&2; exit 3; fi
set +e; blkid -p -o value -s TYPE -s PTTYPE "$DEV" >/dev/null 2>&1; found=$?; set -e
if [ "$found" -eq 2 ]; then mkfs.ext4 -q "$DEV"; echo formatted
elif [ "$found" -ne 0 ]; then echo "blkid cannot read $DEV ($found): not formatting it" >&2; exit 4; fi
mount "$DEV" "$M"
echo {_MOUNTED}
"""


def unmount_script(names: list[str]) -> str:
    """Stop the container (it holds the mounts), then unmount each volume that is mounted."""
    points = " ".join(shlex.quote(n) for n in names)
    return (f"docker stop -t 30 {CONTAINER_NAME} >/dev/null 2>&1 || true; sync; "
            f'for n in {points}; do M="${{DURASTACK_DIR:-/opt/durastack}}/volumes/$n"; '
            'if mountpoint -q "$M"; then umount "$M"; fi; done')


class ReplicaVolumes:
    def __init__(self, backends: dict, store):
        """``backends``: the clouds this worker calls (``CloudReplicas.backends``); ``store``: the store."""
        self.backends, self.store = backends, store

    def _records(self, job: JobSpec) -> list[VolumeRecord]:
        from store.volumes import VolumeStore

        volumes = VolumeStore(self.store)
        records = []
        for name in network_names(job.volumes):
            record = volumes.get(name)
            if record is None:
                raise ApplicationError(f"volume {name} does not exist (deleted since the service was applied?): "
                                       "`durastack volume list`", type="VolumeError", non_retryable=True)
            records.append(record)
        return records

    async def where(self, inp: ReplicaInput, backend: str) -> tuple[Optional[list[str]], Optional[list[str]]]:
        """The regions and zones the replica may be placed in on ``backend``: its own, narrowed to its network
        volumes' zone. A backend its volumes are not on has nothing (``NoCapacity``: the next backend is tried)."""
        if not network_names(inp.job.volumes):
            return inp.regions, inp.zones
        from activities.interface import refusal_error
        from models.messages import PlacementRefusal

        records = await asyncio.to_thread(self._records, inp.job)
        where, why = placement(Where(backends=inp.backends, regions=inp.regions, zones=inp.zones), records)
        if why is None and backend not in (where.backends or []):
            why = f"volume {records[0].name} is on {records[0].backend}"
        if why is not None:
            raise refusal_error(PlacementRefusal(backend=backend, tried=False, reasons=[why]))
        return where.regions, where.zones

    async def attach(self, job: JobSpec, instance: CloudInstance, connect: Connect) -> list[str]:
        """Attach and mount each network volume; what was done, one line each (for the replica's events)."""
        done = []
        for record in await asyncio.to_thread(self._records, job):
            devices = await self._attach_one(job, record, instance)
            progress(f"{instance.instance_id}: mounting volume {record.name}")
            conn = await connect()
            try:
                status, out, err = await run(conn, mount_script(record.name, devices), timeout=DEVICE_WAIT_STEPS + 300)
            finally:
                conn.close()
            if status == 3:  # the device did not show up yet: the step is retried
                raise CloudError(ErrorKind.TRANSIENT, f"volume {record.name}: {err.strip()[-300:]}", code="NoDevice")
            if status != 0:
                raise ApplicationError(f"volume {record.name}: mounting failed ({status}): {err.strip()[-300:]}",
                                       type="VolumeError", non_retryable=True)
            formatted = " (new: formatted ext4)" if "formatted" in out.split() else ""
            done.append(f"volume {record.name} ({record.cloud_id}) attached to {instance.instance_id} and "
                        f"mounted{formatted}")
        return done

    async def _attach_one(self, job: JobSpec, record: VolumeRecord, instance: CloudInstance) -> list[str]:
        disks = self._disks(record)
        deadline = time.monotonic() + WAIT_FOR_HOLDER_SECONDS
        said = ""
        while True:
            try:
                return await asyncio.to_thread(disks.attach, record, instance)
            except VolumeBusy as busy:
                why = await self._busy(job, record, busy, disks)
                if why is not None or time.monotonic() > deadline:
                    raise ApplicationError(
                        why or f"{busy}: still attached after {WAIT_FOR_HOLDER_SECONDS:g}s; a network volume is "
                               "attached to one instance at a time", type="VolumeInUse", non_retryable=True) from None
                text = f"volume {record.name}: waiting for {busy.holder} to let it go (a replica of {job.service} " \
                       "being stopped)"
                if text != said:
                    log.info("%s: %s", job.replica_id, text)
                    said = text
                progress(text)
                await asyncio.sleep(HOLDER_POLL_SECONDS)
            except VolumeError as e:
                raise ApplicationError(str(e), type="VolumeError", non_retryable=True) from None

    @staticmethod
    async def _busy(job: JobSpec, record: VolumeRecord, busy: VolumeBusy, disks) -> Optional[str]:
        """None when the holder is going (a replica of this service, or an instance no longer running): worth
        waiting for; else why not."""
        if not busy.holder:
            return None
        service, state = await asyncio.to_thread(disks.holder_service, record, busy.holder)
        if service in (job.service, slug(job.service)) or state not in ("pending", "running"):
            return None
        owner = f"a replica of service {service}" if service else "an instance durastack did not make"
        return (f"{busy} ({owner}): {record.backend.upper()} attaches a volume read-write to one instance at a "
                "time; stop that first")

    async def release(self, job: JobSpec, instance: Optional[CloudInstance], connect: Optional[Connect]) -> None:
        """Unmount (over SSH, when it answers) and detach the replica's network volumes before its instance goes.
        Best effort: nothing here may keep the instance from being terminated (it costs money), and terminating it
        detaches its volumes too, only later."""
        names = network_names(job.volumes)
        if not names or instance is None or instance.backend not in self.backends:
            return
        if connect is not None:
            try:
                conn = await asyncio.wait_for(connect(), 30)
                try:
                    status, _, err = await run(conn, unmount_script(names), timeout=120)
                finally:
                    conn.close()
                if status != 0:
                    log.warning("%s: unmounting %s: %s", job.replica_id, ", ".join(names), err.strip()[-300:])
            except Exception as e:  # noqa: BLE001 — unreachable or gone: terminating detaches the volumes too
                log.info("%s: volumes not unmounted (%s): detached as they are", job.replica_id, e)
        try:
            records = await asyncio.to_thread(self._records_left, names)
        except Exception as e:  # noqa: BLE001 — the store down: the termination detaches them
            log.warning("%s: volumes not detached (store: %s)", job.replica_id, e)
            return
        for record in records:
            progress(f"{instance.instance_id}: detaching volume {record.name}")
            try:
                await asyncio.to_thread(self._disks(record).detach, record, instance)
            except (CloudError, VolumeError, ApplicationError) as e:
                log.warning("%s: volume %s not detached before the termination: %s", job.replica_id, record.name, e)

    def _records_left(self, names: list[str]) -> list[VolumeRecord]:
        from store.volumes import VolumeStore

        volumes = VolumeStore(self.store)
        return [r for r in (volumes.get(n) for n in names) if r is not None]

    def _disks(self, record: VolumeRecord):
        backend = self.backends.get(record.backend)
        if backend is None:
            raise ApplicationError(f"volume {record.name} is on {record.backend}, which this worker does not serve",
                                   type="VolumeError", non_retryable=True)
        return disks_of(backend)


__all__ = ["ReplicaVolumes", "mount_script", "unmount_script"]
