"""Network volumes in the clouds: EBS against moto (behind tests/fakes/ec2_faults.py, which refuses what EC2 refuses)
and persistent disks against the fake Compute server: made once, registered, attached to one instance at a time,
detached, deleted; and a replica's launch waiting for a volume its service's previous replica still holds."""

from __future__ import annotations

import asyncio
import threading
import time

import boto3
import pytest
from botocore.exceptions import ClientError
from google.cloud import compute_v1
from temporalio.exceptions import ApplicationError

from activities import volume_mounts
from activities.volume_mounts import ReplicaVolumes
from backends.aws import AWSBackend
from backends.cloud_errors import CloudError
from backends.gcp import GCPBackend
from backends.volumes import AWSDisks, GCPDisks, VolumeBusy, VolumeError
from models.backends import AWSConfig, GCPConfig, provisioning_key
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.messages import ReplicaInput
from models.volumes import VolumeConfiguration, VolumeMount
from store import Store
from store.volumes import VolumeStore
from tests.fakes.activity_env import FakeClient, activity_env, refusal_of
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)


def job(replica=0, service="svc", volumes=("my-cache:/data",)) -> JobSpec:
    mounts = [VolumeMount.model_validate(dict(zip(("name", "path"), v.split(":")))) for v in volumes]
    return JobSpec(service=service, group="0", replica_num=replica, submission_num=0, port=8000, commands=["x"],
                   volumes=mounts)


def volume(backend: str, region: str, zone: str, **kw) -> VolumeConfiguration:
    return VolumeConfiguration(type="volume", backend=backend, region=region, availability_zone=zone, **kw)


# --- AWS ------------------------------------------------------------------------------------------------------

@pytest.fixture
def aws(fake_ec2):
    fake_ec2.seed_amis("us-east-1")
    return AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], gateway_cidrs=["203.0.113.7/32"]),
                      installation="t-vol")


def aws_instance(aws: AWSBackend, replica: int, zone: str, service="svc"):
    offer = InstanceOffer(backend="aws", instance_type="m5.large", region="us-east-1", zones=[zone], cpus=2,
                          memory_gb=8, price=0.1)
    made = aws.create(job(replica, service), offer, provisioning_key(service, "0", replica, 0, offer, "t-vol"))
    return aws.get(made)  # described once: moto's instance runs from then on


def test_aws_volume_attaches_to_one_instance_at_a_time(aws, fake_ec2):
    disks = AWSDisks(aws)
    cfg = volume("aws", "us-east-1", "us-east-1a", size=10)
    made = disks.create("my-cache", cfg)
    assert disks.create("my-cache", cfg).cloud_id == made.cloud_id  # one volume: its ClientToken
    ec2 = boto3.client("ec2", region_name="us-east-1")
    (raw,) = ec2.describe_volumes(Filters=[{"Name": "tag:durastack:volume", "Values": ["my-cache"]}])["Volumes"]
    assert (raw["Size"], raw["VolumeType"], raw["AvailabilityZone"], raw["State"]) == (10, "gp3", "us-east-1a",
                                                                                       "available")
    assert {t["Key"]: t["Value"] for t in raw["Tags"]} == {"Name": "durastack-my-cache", "durastack:volume": "my-cache",
                                                           "durastack:installation": "t-vol"}
    a, b = aws_instance(aws, 0, "us-east-1a"), aws_instance(aws, 1, "us-east-1a")

    devices = disks.attach(made, a)
    assert devices[0] == f"disk/by-id/nvme-Amazon_Elastic_Block_Store_{made.cloud_id.replace('-', '')}"
    attaches = fake_ec2.count("AttachVolume")
    assert disks.attach(made, a) == devices and fake_ec2.count("AttachVolume") == attaches  # there already
    with pytest.raises(VolumeBusy) as busy:
        disks.attach(made, b)
    assert busy.value.holder == a.instance_id
    assert disks.holder_service(made, a.instance_id) == ("svc", "running")
    # EC2 itself refuses a second attachment (the fake as EC2 does), and a deletion while attached.
    with pytest.raises(ClientError) as refused:
        ec2.attach_volume(VolumeId=made.cloud_id, InstanceId=b.instance_id, Device="/dev/sdg")
    assert refused.value.response["Error"] == {"Code": "VolumeInUse", "Message": f"{made.cloud_id} is already "
                                                                                 "attached to an instance"}
    with pytest.raises(VolumeBusy, match=f"is attached to {a.instance_id}"):
        disks.delete(made)

    disks.detach(made, a)
    assert disks.holder(made) is None
    disks.detach(made, a)  # detached already: done
    elsewhere = aws_instance(aws, 2, "us-east-1b")
    with pytest.raises(VolumeError, match="volume my-cache is in us-east-1a, and instance .* in us-east-1b"):
        disks.attach(made, elsewhere)
    disks.attach(made, b)
    aws.terminate(b)  # EC2 detaches a terminated instance's volumes (they are not deleted with it)
    assert disks.holder(made) is None
    assert disks.holder_service(made, b.instance_id)[1] == "terminated"
    disks.delete(made)
    disks.delete(made)  # gone already: done
    with pytest.raises(VolumeError, match="no longer exists"):
        disks.holder(made)


def test_aws_registers_an_existing_volume_where_it_is(aws):
    ec2 = boto3.client("ec2", region_name="us-east-1")
    existing = ec2.create_volume(AvailabilityZone="us-east-1c", Size=50)["VolumeId"]
    disks = AWSDisks(aws)
    kept = disks.register("old-data", volume("aws", "us-east-1", None, volume_id=existing))
    assert (kept.zone, kept.size_gb, kept.registered, kept.cloud_id) == ("us-east-1c", 50, True, existing)
    with pytest.raises(VolumeError, match="is in us-east-1c, not us-east-1a"):
        disks.register("old-data", volume("aws", "us-east-1", "us-east-1a", volume_id=existing))
    with pytest.raises(VolumeError, match="no EBS volume vol-0123456789abcdef0 in us-east-1"):
        disks.register("x-y", volume("aws", "us-east-1", None, volume_id="vol-0123456789abcdef0"))
    # Without a zone, a new one goes to the region's first.
    assert disks.create("fresh", volume("aws", "us-east-1", None, size=1)).zone == "us-east-1a"


# --- GCP ------------------------------------------------------------------------------------------------------

@pytest.fixture
def gcp(gce):
    return GCPBackend(GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url), installation="t-vol")


def gcp_instance(gcp: GCPBackend, replica: int, zone: str, service="svc"):
    offer = InstanceOffer(backend="gcp", instance_type="e2-standard-4", region="us-central1", zones=[zone], cpus=4,
                          memory_gb=16, price=0.1)
    return gcp.create(job(replica, service), offer, provisioning_key(service, "0", replica, 0, offer, "t-vol"))


def test_gcp_disk_attaches_read_write_to_one_instance_at_a_time(gcp, gce):
    disks = GCPDisks(gcp)
    cfg = volume("gcp", "us-central1", "us-central1-a", size=10)
    made = disks.create("my-cache", cfg)
    assert (made.cloud_id, made.zone, made.size_gb) == ("ds-t-vol-my-cache", "us-central1-a", 10)
    assert disks.create("my-cache", cfg).cloud_id == made.cloud_id  # the same disk (409: adopted by its label)
    (disk,) = gce.all_disks()
    assert disk["labels"] == {"managed-by": "durastack", "durastack-volume": "my-cache",
                              "durastack-installation": "t-vol"}
    assert disk["type"].endswith("/zones/us-central1-a/diskTypes/pd-balanced")
    with pytest.raises(CloudError, match="Disk size cannot be smaller than 10 GB"):  # as Compute refuses it
        disks.create("tiny", volume("gcp", "us-central1", "us-central1-a", size=5))
    a, b = gcp_instance(gcp, 0, "us-central1-a"), gcp_instance(gcp, 1, "us-central1-a")

    assert disks.attach(made, a) == ["disk/by-id/google-ds-my-cache"]
    (attached,) = [d for d in gce.all_instances() if d["name"] == a.instance_id][0]["disks"][1:]
    assert (attached["deviceName"], attached["mode"], attached["autoDelete"]) == ("ds-my-cache", "READ_WRITE", False)
    with pytest.raises(VolumeBusy) as busy:
        disks.attach(made, b)
    assert busy.value.holder == a.instance_id
    assert disks.holder_service(made, a.instance_id) == ("svc", "running")
    # Compute refuses a second read-write attachment in the attach's operation, with its reason.
    instances, _ = gcp.clients()
    op = instances.attach_disk_unary(project="proj", zone="us-central1-a", instance=b.instance_id,
                                     attached_disk_resource=compute_v1.AttachedDisk(
                                         source=f"projects/proj/zones/us-central1-a/disks/{made.cloud_id}"))
    with pytest.raises(CloudError) as refused:
        gcp.wait_operation("us-central1-a", op, "attachDisk")
    assert refused.value.code == "RESOURCE_IN_USE_BY_ANOTHER_RESOURCE"
    assert f"is already being used by 'projects/proj/zones/us-central1-a/instances/{a.instance_id}'" in \
        refused.value.message
    with pytest.raises(VolumeBusy):
        disks.delete(made)

    disks.detach(made, a)
    assert disks.holder(made) is None
    disks.detach(made, a)
    with pytest.raises(CloudError, match="must be in the same zone as the instance"):
        disks.attach(made, gcp_instance(gcp, 2, "us-central1-b"))
    disks.attach(made, b)
    gcp.terminate(b)  # deleting an instance leaves its (not auto-deleted) disk, detached
    assert disks.holder(made) is None
    disks.delete(made)
    assert gce.all_disks() == []
    disks.delete(made)


def test_gcp_registers_an_existing_disk_in_its_zone(gcp, gce):
    disks = GCPDisks(gcp)
    kept = disks.create("someone", volume("gcp", "us-central1", "us-central1-c", size=20))
    found = disks.register("theirs", volume("gcp", "us-central1", None, volume_id=kept.cloud_id))
    assert (found.zone, found.size_gb, found.registered) == ("us-central1-c", 20, True)
    with pytest.raises(VolumeError, match="no persistent disk nope in us-central1-a"):
        disks.register("x-y", volume("gcp", "us-central1", "us-central1-a", volume_id="nope"))


# --- a replica's launch --------------------------------------------------------------------------------------

def launch(zones=None) -> ReplicaInput:
    return ReplicaInput(service_workflow_id="service/svc", job=job(), zones=zones)


def run(env, fn, *args):
    return asyncio.run(env.run(fn, *args))


@pytest.fixture
def store(tmp_path):
    return Store(f"sqlite:///{tmp_path}/store.db")


def test_a_replica_is_placed_where_its_volume_is(aws, store):
    volumes = ReplicaVolumes({"aws": aws}, store)
    env = activity_env(FakeClient())
    with pytest.raises(ApplicationError, match="volume my-cache does not exist"):
        run(env, volumes.where, launch(), "aws")
    VolumeStore(store).add(AWSDisks(aws).create("my-cache", volume("aws", "us-east-1", "us-east-1b", size=1)))
    assert run(env, volumes.where, launch(), "aws") == (["us-east-1"], ["us-east-1b"])
    with pytest.raises(ApplicationError) as elsewhere:
        run(env, volumes.where, launch(), "gcp")
    assert refusal_of(elsewhere.value).reasons == ["volume my-cache is on aws"]
    with pytest.raises(ApplicationError) as narrowed:
        run(env, volumes.where, launch(zones=["us-east-1a"]), "aws")
    assert refusal_of(narrowed.value).reasons == ["volume my-cache is in aws us-east-1b, and "
                                                      "`availability_zones` names us-east-1a"]


def test_a_launch_waits_for_its_services_previous_replica_only(aws, store, monkeypatch):
    monkeypatch.setattr(volume_mounts, "HOLDER_POLL_SECONDS", 0.2)
    disks = AWSDisks(aws)
    made = VolumeStore(store).add(disks.create("my-cache", volume("aws", "us-east-1", "us-east-1a", size=1)))
    volumes = ReplicaVolumes({"aws": aws}, store)
    env = activity_env(FakeClient())
    old, new = aws_instance(aws, 0, "us-east-1a"), aws_instance(aws, 1, "us-east-1a")
    other = aws_instance(aws, 0, "us-east-1a", service="other")

    disks.attach(made, other)  # another service's: refused at once, naming it
    started = time.monotonic()
    with pytest.raises(ApplicationError, match="attached to i-.* \\(a replica of service other\\): AWS attaches a "
                                               "volume read-write to one instance at a time; stop that first"):
        run(env, volumes._attach_one, job(1), made, new)
    assert time.monotonic() - started < 5
    disks.detach(made, other)

    disks.attach(made, old)  # this service's previous replica, being stopped: waited for
    threading.Timer(1.5, disks.detach, (made, old)).start()
    assert run(env, volumes._attach_one, job(1), made, new)[0].startswith("disk/by-id/nvme-")
    assert disks.holder(made) == new.instance_id
