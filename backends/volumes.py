"""Network volumes in the clouds: EBS volumes (boto3) and GCE persistent disks (google-cloud-compute). Blocking; the
activities call them through ``asyncio.to_thread``, the CLI (``durastack apply -f`` of a ``type: volume`` file,
``durastack volume``) directly.

Each cloud's ``Disks`` makes (once: an EBS volume tagged with the name, a persistent disk named after it, is adopted
by a second attempt; a call's own retries are safe by its ``ClientToken``, ``requestId``), registers, deletes,
attaches and detaches one volume. A request id is never derived from the names: a volume deleted and made again, or
attached to the same instance again after a detach, would be taken for the earlier request and ignored. They use the clouds'
backends (backends/aws.py, backends/gcp.py) for their clients, so one configuration (endpoint, credentials,
retries) serves instances and volumes alike. A volume attached elsewhere raises ``VolumeBusy`` with its holder: EBS
and PD attach a volume read-write to one instance at a time.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Optional, Union

from backends.aws import AWSBackend, api_errors as aws_errors
from backends.cloud_errors import CloudError, ErrorKind
from backends.gcp import GCPBackend, api_errors as gcp_errors
from models.backends import TAG_NAMES, CloudInstance, slug
from models.volumes import VolumeConfiguration, VolumeRecord

SETTLE_SECONDS = 180.0  # an attach or detach the cloud reports done within this, or the call fails (retried)
POLL_SECONDS = 1.0
AWS_DEVICES = [f"/dev/sd{c}" for c in "fghijklmnop"]  # the names EC2 recommends for EBS data volumes
VOLUME_TAG = {"aws": "durastack:volume", "gcp": "durastack-volume"}


class VolumeError(Exception):
    """What a person must act on (a volume gone, in another zone, attached elsewhere): the replica fails with it."""


class VolumeBusy(VolumeError):
    """The volume is attached to ``holder`` (an instance id or name), not to the instance that asked."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder


def _settled(what: str, check) -> None:
    """Poll ``check()`` until it is true, at most SETTLE_SECONDS; then a transient error (the caller's retry looks
    again)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while not check():
        if time.monotonic() > deadline:
            raise CloudError(ErrorKind.TRANSIENT, f"{what}: not done after {SETTLE_SECONDS:g}s", code="Timeout")
        time.sleep(POLL_SECONDS)


class AWSDisks:
    """EBS volumes (gp3), tagged with their name and the installation."""

    def __init__(self, backend: AWSBackend):
        self.backend = backend

    def _ec2(self, region: str):
        return self.backend.client(region)

    def _volume(self, region: str, volume_id: str) -> Optional[dict]:
        try:
            with aws_errors(f"DescribeVolumes {volume_id}"):
                found = self._ec2(region).describe_volumes(VolumeIds=[volume_id])["Volumes"]
        except CloudError as e:
            if e.code in ("InvalidVolume.NotFound", "InvalidVolume.Malformed"):
                return None
            raise
        return found[0] if found else None

    def create(self, name: str, cfg: VolumeConfiguration) -> VolumeRecord:
        """A new gp3 volume; one an earlier attempt made (tagged with the name, not yet kept by the store) is
        adopted. Its ClientToken makes botocore's retries of a call safe."""
        ec2 = self._ec2(cfg.region)
        zone = cfg.availability_zone or self._first_zone(cfg.region)
        made = self._tagged(cfg.region, name)
        if made is None:
            tags = [{"Key": "Name", "Value": f"durastack-{name}"}, {"Key": VOLUME_TAG["aws"], "Value": name}]
            if self.backend.installation:
                tags.append({"Key": TAG_NAMES["aws"]["installation"], "Value": self.backend.installation})
            with aws_errors(f"CreateVolume {name} in {zone}"):
                made = ec2.create_volume(AvailabilityZone=zone, Size=cfg.size, VolumeType="gp3",
                                         ClientToken=uuid.uuid4().hex,
                                         TagSpecifications=[{"ResourceType": "volume", "Tags": tags}])
        _settled(f"volume {made['VolumeId']} available",
                 lambda: (self._volume(cfg.region, made["VolumeId"]) or {}).get("State") in ("available", "in-use"))
        return self._record(name, cfg.region, made, registered=False)

    def _tagged(self, region: str, name: str) -> Optional[dict]:
        filters = [{"Name": f"tag:{VOLUME_TAG['aws']}", "Values": [name]},
                   {"Name": "status", "Values": ["creating", "available", "in-use"]}]
        if self.backend.installation:
            filters.append({"Name": f"tag:{TAG_NAMES['aws']['installation']}", "Values": [self.backend.installation]})
        with aws_errors(f"DescribeVolumes {name}"):
            found = self._ec2(region).describe_volumes(Filters=filters)["Volumes"]
        return found[0] if found else None

    def register(self, name: str, cfg: VolumeConfiguration) -> VolumeRecord:
        found = self._volume(cfg.region, cfg.volume_id or "")
        if found is None:
            raise VolumeError(f"volume_id: no EBS volume {cfg.volume_id} in {cfg.region}")
        if cfg.availability_zone and found["AvailabilityZone"] != cfg.availability_zone:
            raise VolumeError(f"availability_zone: {cfg.volume_id} is in {found['AvailabilityZone']}, not "
                              f"{cfg.availability_zone}")
        return self._record(name, cfg.region, found, registered=True)

    def _first_zone(self, region: str) -> str:
        with aws_errors(f"DescribeAvailabilityZones in {region}"):
            zones = self._ec2(region).describe_availability_zones(
                Filters=[{"Name": "state", "Values": ["available"]}, {"Name": "zone-type",
                                                                       "Values": ["availability-zone"]}])
        names = sorted(z["ZoneName"] for z in zones["AvailabilityZones"])
        if not names:
            raise VolumeError(f"region: no available zone in {region}")
        return names[0]

    @staticmethod
    def _record(name: str, region: str, raw: dict, registered: bool) -> VolumeRecord:
        return VolumeRecord(name=name, backend="aws", region=region, zone=raw["AvailabilityZone"],
                            cloud_id=raw["VolumeId"], size_gb=int(raw["Size"]), registered=registered,
                            created_at=datetime.now(timezone.utc))

    def delete(self, record: VolumeRecord) -> None:
        """Delete it; already gone is success, attached is a VolumeBusy."""
        try:
            with aws_errors(f"DeleteVolume {record.cloud_id}"):
                self._ec2(record.region).delete_volume(VolumeId=record.cloud_id)
        except CloudError as e:
            if e.code == "InvalidVolume.NotFound":
                return
            if e.code == "VolumeInUse":
                raise VolumeBusy(f"volume {record.name} ({record.cloud_id}) is attached to "
                                 f"{self.holder(record) or 'an instance'}", self.holder(record) or "") from e
            raise

    def holder(self, record: VolumeRecord) -> Optional[str]:
        """The instance it is attached to (or attaching, detaching), if any."""
        found = self._volume(record.region, record.cloud_id)
        if found is None:
            raise VolumeError(f"volume {record.name} ({record.cloud_id}) no longer exists in {record.region}")
        return next((a["InstanceId"] for a in found.get("Attachments", []) if a.get("State") != "detached"), None)

    def attach(self, record: VolumeRecord, instance: CloudInstance) -> list[str]:
        """Attach it to ``instance`` (already there is success) and wait until it is; returns where its device may
        appear, under /dev: Nitro instances show EBS volumes as NVMe devices named by the volume's id."""
        holder = self.holder(record)
        device = self._attached_as(record, instance)
        if holder is not None and holder != instance.instance_id:
            raise VolumeBusy(f"volume {record.name} ({record.cloud_id}) is attached to {holder}", holder)
        if device is None:
            device = self._free_device(instance)
            try:
                with aws_errors(f"AttachVolume {record.cloud_id} to {instance.instance_id}"):
                    self._ec2(record.region).attach_volume(VolumeId=record.cloud_id, InstanceId=instance.instance_id,
                                                            Device=device)
            except CloudError as e:
                raise self._attach_error(record, instance, e) from e
        _settled(f"volume {record.cloud_id} attached to {instance.instance_id}",
                 lambda: self._attached_as(record, instance, state="attached") is not None)
        short = device.rsplit("/", 1)[-1]
        return [f"disk/by-id/nvme-Amazon_Elastic_Block_Store_{record.cloud_id.replace('-', '')}", short,
                short.replace("sd", "xvd", 1)]

    def _attach_error(self, record: VolumeRecord, instance: CloudInstance, e: CloudError) -> Exception:
        if e.code == "VolumeInUse":
            holder = self.holder(record) or ""
            return VolumeBusy(f"volume {record.name} ({record.cloud_id}) is attached to {holder or 'an instance'}",
                              holder)
        if e.code == "InvalidVolume.ZoneMismatch":
            return VolumeError(f"volume {record.name} is in {record.zone}, and instance {instance.instance_id} in "
                               f"{instance.zone}")
        if e.code == "InvalidVolume.NotFound":
            return VolumeError(f"volume {record.name} ({record.cloud_id}) no longer exists")
        if e.code == "IncorrectState":  # the instance not running yet, or the volume still detaching
            return CloudError(ErrorKind.TRANSIENT, e.message, code=e.code)
        return e

    def _attached_as(self, record: VolumeRecord, instance: CloudInstance, state: Optional[str] = None
                     ) -> Optional[str]:
        found = self._volume(record.region, record.cloud_id) or {}
        return next((a["Device"] for a in found.get("Attachments", []) if a["InstanceId"] == instance.instance_id
                     and a.get("State") in ((state,) if state else ("attaching", "attached"))), None)

    def _free_device(self, instance: CloudInstance) -> str:
        with aws_errors(f"DescribeInstances {instance.instance_id}"):
            res = self._ec2(instance.region).describe_instances(InstanceIds=[instance.instance_id])
        used = {m["DeviceName"] for r in res["Reservations"] for i in r["Instances"]
                for m in i.get("BlockDeviceMappings", [])}
        free = [d for d in AWS_DEVICES if d not in used and d.replace("sd", "xvd", 1) not in used]
        if not free:
            raise VolumeError(f"instance {instance.instance_id} has no free device name for another volume")
        return free[0]

    def detach(self, record: VolumeRecord, instance: CloudInstance) -> None:
        """Detach it from ``instance`` and wait until it is; not attached there (anymore) is success."""
        try:
            with aws_errors(f"DetachVolume {record.cloud_id} from {instance.instance_id}"):
                self._ec2(record.region).detach_volume(VolumeId=record.cloud_id, InstanceId=instance.instance_id)
        except CloudError as e:
            if e.code in ("IncorrectState", "InvalidAttachment.NotFound", "InvalidVolume.NotFound",
                          "InvalidInstanceID.NotFound"):
                return
            raise
        _settled(f"volume {record.cloud_id} detached from {instance.instance_id}",
                 lambda: self._attached_as(record, instance) is None)

    def holder_service(self, record: VolumeRecord, holder: str) -> tuple[Optional[str], str]:
        """(the service tag, the state) of the instance holding it; (None, 'terminated') once it is gone."""
        try:
            with aws_errors(f"DescribeInstances {holder}"):
                res = self._ec2(record.region).describe_instances(InstanceIds=[holder])
        except CloudError as e:
            if e.code in ("InvalidInstanceID.NotFound", "InvalidInstanceID.Malformed"):
                return None, "terminated"
            raise
        raws = [i for r in res["Reservations"] for i in r["Instances"]]
        if not raws:
            return None, "terminated"
        tags = {t["Key"]: t["Value"] for t in raws[0].get("Tags", [])}
        return tags.get(TAG_NAMES["aws"]["service"]), raws[0]["State"]["Name"]


class GCPDisks:
    """Persistent disks (pd-balanced), named ``ds-<installation>-<name>``, labelled with their name."""

    def __init__(self, backend: GCPBackend):
        self.backend = backend
        self._disks = None

    @property
    def project(self) -> str:
        return self.backend.project

    def _client(self):
        if self._disks is None:
            from google.api_core.client_options import ClientOptions
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import compute_v1

            endpoint = self.backend.config.endpoint
            creds = self.backend._credentials
            if creds is None and endpoint and endpoint.startswith("http://"):
                creds = AnonymousCredentials()  # a fake: real tokens never go over http
            with gcp_errors("GCP disks client"):
                self._disks = compute_v1.DisksClient(
                    credentials=creds, transport="rest",
                    client_options=ClientOptions(api_endpoint=endpoint) if endpoint else None)
        return self._disks

    def disk_name(self, name: str) -> str:
        installation = self.backend.installation
        return slug(f"ds-{installation}-{name}" if installation else f"ds-{name}", 63)

    def _disk(self, zone: str, disk: str):
        try:
            with gcp_errors(f"get disk {disk}"):
                return self._client().get(project=self.project, zone=zone, disk=disk)
        except CloudError as e:
            if e.code == "notFound":
                return None
            raise

    def _zones(self, region: str) -> list[str]:
        self.backend.clients()
        with gcp_errors(f"get region {region}"):
            raw = self.backend._regions.get(project=self.project, region=region)
        return sorted(z.rsplit("/", 1)[-1] for z in raw.zones)

    def create(self, name: str, cfg: VolumeConfiguration) -> VolumeRecord:
        from google.cloud import compute_v1

        zones = self._zones(cfg.region)
        zone = cfg.availability_zone or (zones[0] if zones else "")
        if zone not in zones:
            raise VolumeError(f"availability_zone: {zone or 'no zone'} is not a zone of {cfg.region} "
                              f"({', '.join(zones) or 'none listed'})")
        disk = self.disk_name(name)
        labels = {"managed-by": "durastack", VOLUME_TAG["gcp"]: name}
        if self.backend.installation:
            labels[TAG_NAMES["gcp"]["installation"]] = self.backend.installation
        resource = compute_v1.Disk(name=disk, size_gb=cfg.size, type_=f"zones/{zone}/diskTypes/pd-balanced",
                                   labels=labels)
        try:
            with gcp_errors(f"insert disk {disk} in {zone}"):
                op = self._client().insert_unary(request=compute_v1.InsertDiskRequest(
                    project=self.project, zone=zone, disk_resource=resource, request_id=str(uuid.uuid4())))
            self.backend.wait_operation(zone, op, f"insert disk {disk}")
        except CloudError as e:
            if e.code != "alreadyExists":
                raise
        found = self._disk(zone, disk)
        if found is None or found.labels.get(VOLUME_TAG["gcp"]) != name:
            raise VolumeError(f"disk {disk} in {zone} is not durastack's volume {name}")
        return self._record(name, cfg.region, zone, found, registered=False)

    def register(self, name: str, cfg: VolumeConfiguration) -> VolumeRecord:
        zones = [cfg.availability_zone] if cfg.availability_zone else self._zones(cfg.region)
        for zone in zones:
            found = self._disk(zone, cfg.volume_id or "")
            if found is not None:
                return self._record(name, cfg.region, zone, found, registered=True)
        raise VolumeError(f"volume_id: no persistent disk {cfg.volume_id} in {', '.join(zones)}")

    @staticmethod
    def _record(name: str, region: str, zone: str, raw, registered: bool) -> VolumeRecord:
        return VolumeRecord(name=name, backend="gcp", region=region, zone=zone, cloud_id=raw.name,
                            size_gb=int(raw.size_gb), registered=registered, created_at=datetime.now(timezone.utc))

    def delete(self, record: VolumeRecord) -> None:
        try:
            with gcp_errors(f"delete disk {record.cloud_id}"):
                op = self._client().delete_unary(project=self.project, zone=record.zone, disk=record.cloud_id)
        except CloudError as e:
            if e.code == "notFound":
                return
            if e.code == "resourceInUseByAnotherResource":
                holder = self.holder(record) or ""
                raise VolumeBusy(f"volume {record.name} ({record.cloud_id}) is attached to {holder or 'an instance'}",
                                 holder) from e
            raise
        self.backend.wait_operation(record.zone, op, f"delete disk {record.cloud_id}")

    def holder(self, record: VolumeRecord) -> Optional[str]:
        found = self._disk(record.zone, record.cloud_id)
        if found is None:
            raise VolumeError(f"volume {record.name} ({record.cloud_id}) no longer exists in {record.zone}")
        return found.users[0].rsplit("/", 1)[-1] if found.users else None

    def device_name(self, record: VolumeRecord) -> str:
        return slug(f"ds-{record.name}", 63)

    def attach(self, record: VolumeRecord, instance: CloudInstance) -> list[str]:
        """Attach it read-write to ``instance`` (already there is success); returns where its device appears under
        /dev: GCE names it by the device name given here."""
        from google.cloud import compute_v1

        holder = self.holder(record)
        if holder is not None and holder != instance.instance_id:
            raise VolumeBusy(f"volume {record.name} ({record.cloud_id}) is attached to {holder}", holder)
        device = self.device_name(record)
        if holder is None:
            instances, _ = self.backend.clients()
            source = f"projects/{self.project}/zones/{record.zone}/disks/{record.cloud_id}"
            disk = compute_v1.AttachedDisk(source=source, device_name=device, mode="READ_WRITE", auto_delete=False)
            try:
                with gcp_errors(f"attachDisk {record.cloud_id} to {instance.instance_id}"):
                    op = instances.attach_disk_unary(request=compute_v1.AttachDiskInstanceRequest(
                        project=self.project, zone=instance.zone, instance=instance.instance_id,
                        attached_disk_resource=disk, request_id=str(uuid.uuid4())))
                self.backend.wait_operation(instance.zone, op, f"attachDisk {record.cloud_id}")
            except CloudError as e:
                if e.code in ("RESOURCE_IN_USE_BY_ANOTHER_RESOURCE", "resourceInUseByAnotherResource"):
                    holder = self.holder(record) or ""
                    raise VolumeBusy(f"volume {record.name} ({record.cloud_id}) is attached to "
                                     f"{holder or 'another instance'}", holder) from e
                if e.code == "notFound":
                    raise VolumeError(f"volume {record.name} ({record.cloud_id}) or instance "
                                      f"{instance.instance_id} no longer exists") from e
                raise
        return [f"disk/by-id/google-{device}"]

    def detach(self, record: VolumeRecord, instance: CloudInstance) -> None:
        if self.holder(record) != instance.instance_id:
            return
        instances, _ = self.backend.clients()
        try:
            with gcp_errors(f"detachDisk {record.cloud_id} from {instance.instance_id}"):
                op = instances.detach_disk_unary(project=self.project, zone=instance.zone,
                                                 instance=instance.instance_id, device_name=self.device_name(record))
        except CloudError as e:
            if e.code in ("notFound", "invalid"):  # the instance gone, or the disk detached meanwhile
                return
            raise
        self.backend.wait_operation(instance.zone, op, f"detachDisk {record.cloud_id}")

    def holder_service(self, record: VolumeRecord, holder: str) -> tuple[Optional[str], str]:
        found = self.backend._get(record.zone, holder)
        if found is None:
            return None, "terminated"
        return found.tags.get(TAG_NAMES["gcp"]["service"]), found.state


Disks = Union[AWSDisks, GCPDisks]


def disks_of(backend) -> Disks:
    """The volume calls of a cloud backend (``backends.cloud.make_backends``)."""
    return AWSDisks(backend) if backend.name == "aws" else GCPDisks(backend)


__all__ = ["AWSDisks", "Disks", "GCPDisks", "VolumeBusy", "VolumeError", "disks_of"]
