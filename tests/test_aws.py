"""AWS backend: boto3 against moto on 127.0.0.1, behind the fault + ClientToken middleware (tests/fakes).

Covers the launch itself (type, AMI, tags, user-data, disk, spot, security group), exactly-once under lost
responses and killed workers, the offer walk on capacity and quota errors, error classes, listing, and stop.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError
from temporalio.exceptions import ApplicationError

from activities.cloud import OffersExhausted, provision_cloud, terminate_cloud, terminate_replica, terminate_service
from activities.replica import ReplicaActivities
from activities.replica_cloud import CloudReplicas, booted
from backends.aws import AWSBackend
from backends.cloud_errors import CloudError, ErrorKind
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, cloud_init
from models.backends import AWSConfig, BackendsConfig, provisioning_key
from models.offers import InstanceOffer, describe_mismatch, match_offers
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.messages import LaunchInput, MonitorInput, ReplicaInput, TeardownInput, Watched
from store import Store, StoreLedger
from tests.fakes.activity_env import FakeClient, FakeGateway, activity_env, app_server, refusal_of
from tests.fakes.ec2_faults import CPU_AMI, GPU_AMI, ec2_server, fake_ec2  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent
CHILD = [sys.executable, "-m", "tests.fakes.provision_child"]
GPU = ResourcesSpec.model_validate({"gpu": "1..", "disk": "150GB"})


def offer(instance_type: str, price: float, *, region="us-east-1", gpu=("A10G", 24.0, 1), spot=False,
          cpus=4, memory=16.0) -> InstanceOffer:
    name, mem, count = gpu or (None, 0.0, 0)
    return InstanceOffer(backend="aws", instance_type=instance_type, region=region, zones=[f"{region}a"], cpus=cpus,
                         memory_gb=memory, gpu_vendor="nvidia" if gpu else None, gpu_name=name, gpu_memory_gb=mem,
                         gpu_count=count, spot=spot, price=price)


G4 = offer("g4dn.xlarge", 0.526, gpu=("T4", 16.0, 1))
G5 = offer("g5.xlarge", 1.006)
G5_WEST = offer("g5.xlarge", 1.1, region="us-west-2")
P4 = offer("p4d.24xlarge", 21.96, gpu=("A100", 40.0, 8), cpus=96, memory=1152.0)
M5 = offer("m5.xlarge", 0.192, gpu=None)


def job(replica=0, submission=0, service="svc", group="llm") -> JobSpec:
    return JobSpec(service=service, group=group, replica_num=replica, submission_num=submission, port=8000,
                   commands=["vllm serve Qwen/Qwen2.5-0.5B --port 8000"], env={"HF_TOKEN": "hf_x"})


@pytest.fixture
def aws(fake_ec2):
    fake_ec2.seed_amis("us-east-1", "us-west-2")
    return AWSBackend(AWSConfig(regions=["us-east-1", "us-west-2"], ami_owners=["self"],
                                gateway_cidrs=["203.0.113.7/32"]))


@pytest.fixture
def ledger(tmp_path):
    return StoreLedger(Store(f"sqlite:///{tmp_path}/store.db"))


def ec2(region="us-east-1"):
    return boto3.client("ec2", region_name=region)


def all_instances(region="us-east-1", states=("pending", "running")) -> list[dict]:
    res = ec2(region).describe_instances(Filters=[{"Name": "instance-state-name", "Values": list(states)}])
    return [i for r in res["Reservations"] for i in r["Instances"]]


def walk(aws_backend, ledger, offers, j=None, **kw):
    return provision_cloud(j or job(), GPU, offers, backends={"aws": aws_backend}, ledger=ledger, max_offers=25, **kw)


# --- the launch -----------------------------------------------------------------------------------

def test_gpu_group_comes_up_with_type_ami_tags_userdata_disk(aws, ledger, fake_ec2):
    chosen, inst = walk(aws, ledger, [G5, P4])
    assert chosen.instance_type == inst.instance_type == "g5.xlarge" and inst.state in ("pending", "running")
    (raw,) = all_instances()
    assert raw["InstanceId"] == inst.instance_id and raw["InstanceType"] == "g5.xlarge"
    key = provisioning_key("svc", "llm", 0, 0, chosen)
    tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
    assert tags == {"Name": "durastack-svc-llm-r0-s0", "durastack:service": "svc", "durastack:group": "llm",
                    "durastack:replica": "r0-s0", "durastack:key": key, "durastack:port": "8000",
                    "durastack:host-key": "after-boot", "durastack:image": raw["ImageId"]}
    image = ec2().describe_images(ImageIds=[raw["ImageId"]])["Images"][0]
    assert image["Name"] == GPU_AMI and inst.image == raw["ImageId"]
    user_data = ec2().describe_instance_attribute(InstanceId=inst.instance_id, Attribute="userData")
    text = base64.b64decode(user_data["UserData"]["Value"]).decode()
    keys = SSHKeys.of_home(Path("/nonexistent"))  # DURASTACK_SSH_DIR (tests/conftest.py)
    host = keys.host_key(key)
    assert text == cloud_init(job(), gpu=True, keys=BootKeys(host.private_openssh, host.public_openssh,
                                                             keys.client_public()))
    # The instance gets its host key and the installation's key; env and commands come over SSH later.
    assert host.public_openssh in text and keys.client_public() in text
    assert "hf_x" not in text and "vllm serve" not in text
    assert raw["MetadataOptions"]["HttpTokens"] == "required"  # IMDSv2 only
    volumes = ec2().describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [inst.instance_id]}])
    assert [v["Size"] for v in volumes["Volumes"]] == [150]
    run = fake_ec2.run_requests[-1]
    assert run["ClientToken"] == key and run["MinCount"] == run["MaxCount"] == "1"
    assert run["InstanceInitiatedShutdownBehavior"] == "terminate"
    assert inst.address == f"{raw['PublicIpAddress']}:8000" and inst.price == 1.006
    assert [e["phase"] for e in ledger.entries(key)] == ["intent", "created"]
    assert "hf_x" not in json.dumps(ledger.entries())  # env values (secrets) never reach the ledger


def sg_rules(group_id: str, region: str = "us-east-1") -> set[tuple]:
    """(protocol, port, CIDRs, source groups) of each ingress rule of a group."""
    (sg,) = ec2(region).describe_security_groups(GroupIds=[group_id])["SecurityGroups"]
    return {(p["IpProtocol"], p.get("FromPort"), tuple(sorted(r["CidrIp"] for r in p.get("IpRanges", []))),
             tuple(g["GroupId"] for g in p.get("UserIdGroupPairs", []))) for p in sg["IpPermissions"]}


def group_of(raw: dict) -> dict:
    # The groups are the primary interface's (moto does not copy them to the instance's own list).
    (sg_ref,) = raw["SecurityGroups"] or raw["NetworkInterfaces"][0]["Groups"]
    return sg_ref


def test_security_group_opens_ssh_to_the_gateway_and_everything_to_the_service_itself(aws, fake_ec2):
    inst = aws.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    (raw,) = all_instances()
    sg_ref = group_of(raw)
    assert sg_ref["GroupName"] == "durastack-svc"
    # SSH from the gateway; never the service port from outside; any port from the service's own instances
    # (one network per service: a router reaches its workers on their private IPs).
    assert sg_rules(sg_ref["GroupId"]) == {("tcp", 22, ("203.0.113.7/32",), ()),
                                           ("-1", None, (), (sg_ref["GroupId"],))}
    # In the zone's default subnet, with a public IP as configured (the default: yes).
    run = fake_ec2.run_requests[-1]
    assert run["Placement.AvailabilityZone"] == "us-east-1a" and run["NetworkInterface.1.SubnetId"]
    assert run["NetworkInterface.1.AssociatePublicIpAddress"] == "true"
    aws.create(job(replica=1), G5, provisioning_key("svc", "llm", 1, 0, G5))  # reused, not duplicated
    assert fake_ec2.count("CreateSecurityGroup") == 1 and inst
    assert {group_of(r)["GroupId"] for r in all_instances()} == {sg_ref["GroupId"]}


def test_default_config_admits_ssh_from_anywhere_since_the_gateway_dials_the_public_ip(fake_ec2, caplog):
    """public_ip (the default) and no gateway_cidrs: the worker connects to the instance's PUBLIC address from
    wherever it runs, so the VPC's range would shut it out; SSH is open to all (key-only, host keys pinned), and
    the log says gateway_cidrs narrows it."""
    fake_ec2.seed_amis("us-east-1")
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], ssh_cidrs=["198.51.100.0/24"]))
    backend.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    group_id = group_of(all_instances()[0])["GroupId"]
    assert ("tcp", 22, ("0.0.0.0/0", "198.51.100.0/24"), ()) in sg_rules(group_id)
    assert "backends.aws.gateway_cidrs" in caplog.text and "0.0.0.0/0" in caplog.text


def test_an_existing_group_is_brought_to_the_configured_sources(fake_ec2):
    """A group made under the default (SSH from anywhere) is narrowed once gateway_cidrs is set: the next launch
    (a new worker, say) revokes what is no longer configured and adds only what is missing."""
    fake_ec2.seed_amis("us-east-1")
    config = dict(regions=["us-east-1"], ami_owners=["self"])
    AWSBackend(AWSConfig(**config)).create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    group_id = group_of(all_instances()[0])["GroupId"]
    assert ("tcp", 22, ("0.0.0.0/0",), ()) in sg_rules(group_id)
    narrowed = AWSBackend(AWSConfig(**config, gateway_cidrs=["203.0.113.7/32"], ssh_cidrs=["198.51.100.0/24"]))
    narrowed.create(job(1), G5, provisioning_key("svc", "llm", 1, 0, G5))
    assert sg_rules(group_id) == {("tcp", 22, ("198.51.100.0/24", "203.0.113.7/32"), ()), ("-1", None, (), (group_id,))}
    AWSBackend(AWSConfig(**config, gateway_cidrs=["203.0.113.7/32", "192.0.2.0/24"])).create(
        job(2), G5, provisioning_key("svc", "llm", 2, 0, G5))  # one range kept, one added, one revoked
    assert ("tcp", 22, ("192.0.2.0/24", "203.0.113.7/32"), ()) in sg_rules(group_id)


def test_private_addresses_admit_ssh_from_the_vpc_only(fake_ec2):
    fake_ec2.seed_amis("us-east-1")
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], ssh_cidrs=["198.51.100.0/24"],
                                   public_ip=False))
    backend.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    group_id = group_of(all_instances()[0])["GroupId"]
    vpc = ec2().describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]
    assert ("tcp", 22, tuple(sorted([vpc["CidrBlock"], "198.51.100.0/24"])), ()) in sg_rules(group_id)
    assert fake_ec2.run_requests[-1]["NetworkInterface.1.AssociatePublicIpAddress"] == "false"


# --- the VPC and its subnets ----------------------------------------------------------------------

def drop_default_vpc(region: str) -> None:
    client = ec2(region)
    (vpc,) = client.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
    for subnet in client.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc["VpcId"]]}])["Subnets"]:
        client.delete_subnet(SubnetId=subnet["SubnetId"])
    client.delete_vpc(VpcId=vpc["VpcId"])


def own_vpc(region: str, zones: list[str]) -> tuple[str, list[str]]:
    client = ec2(region)
    vpc_id = client.create_vpc(CidrBlock="10.20.0.0/16")["Vpc"]["VpcId"]
    subnets = [client.create_subnet(VpcId=vpc_id, CidrBlock=f"10.20.{n}.0/24", AvailabilityZone=z)["Subnet"]["SubnetId"]
               for n, z in enumerate(zones)]
    return vpc_id, subnets


def test_a_region_without_a_default_vpc_fails_naming_the_setting(fake_ec2, ledger):
    fake_ec2.seed_amis("us-east-1")
    drop_default_vpc("us-east-1")
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"]))
    with pytest.raises(CloudError) as raised:
        backend.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    assert raised.value.kind is ErrorKind.FATAL and raised.value.code == "NoDefaultVpc"  # not retried
    assert "backends.aws.vpc_id" in raised.value.message and "config.yml" in raised.value.message
    assert all_instances() == [] and fake_ec2.run_requests == []


def test_a_configured_vpc_is_used_and_its_subnets_walked_across_zones(fake_ec2, ledger):
    fake_ec2.seed_amis("us-east-1")
    drop_default_vpc("us-east-1")
    vpc_id, (sub_a, sub_b) = own_vpc("us-east-1", ["us-east-1a", "us-east-1b"])
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], vpc_id=vpc_id))
    fake_ec2.fail("InsufficientInstanceCapacity", zone="us-east-1a")
    two_zones = G5.model_copy(update={"zones": ["us-east-1a", "us-east-1b"]})
    chosen, inst = walk(backend, ledger, [two_zones])
    assert [(r["Placement.AvailabilityZone"], r["NetworkInterface.1.SubnetId"]) for r in fake_ec2.run_requests] == \
        [("us-east-1a", sub_a), ("us-east-1b", sub_b)]
    (raw,) = all_instances()
    assert raw["VpcId"] == vpc_id and inst.zone == "us-east-1b"
    (sg,) = ec2().describe_security_groups(GroupIds=[group_of(raw)["GroupId"]])["SecurityGroups"]
    assert sg["VpcId"] == vpc_id
    # An offer without zones walks the VPC's subnets by zone.
    fake_ec2.middleware.faults.clear()
    backend.create(job(1), G5.model_copy(update={"zones": []}), provisioning_key("svc", "llm", 1, 0, G5))
    assert fake_ec2.run_requests[-1]["NetworkInterface.1.SubnetId"] == sub_a


def test_configured_subnets_are_the_only_ones_tried(fake_ec2, ledger):
    fake_ec2.seed_amis("us-east-1")
    vpc_id, (sub_a, sub_b, sub_c) = own_vpc("us-east-1", ["us-east-1a", "us-east-1b", "us-east-1c"])
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], vpc_id={"us-east-1": vpc_id},
                                   subnet_ids=[sub_c, sub_b]))
    three = G5.model_copy(update={"zones": ["us-east-1a", "us-east-1b", "us-east-1c"]})
    fake_ec2.fail("InsufficientInstanceCapacity", zone="us-east-1b")
    walk(backend, ledger, [three])
    assert [r["NetworkInterface.1.SubnetId"] for r in fake_ec2.run_requests] == [sub_b, sub_c]
    # An offer in a zone none of them is in moves on (capacity), saying which setting.
    with pytest.raises(CloudError) as raised:
        backend.create(job(1), G5, provisioning_key("svc", "llm", 1, 0, G5))  # us-east-1a
    assert raised.value.kind is ErrorKind.CAPACITY and "backends.aws.subnet_ids" in raised.value.message


def test_a_bare_vpc_id_needs_exactly_one_region():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="backends.aws.vpc_id"):
        AWSConfig(regions=["us-east-1", "us-west-2"], vpc_id="vpc-1")
    assert AWSConfig(regions=["us-east-1"], vpc_id="vpc-1").vpc_for("us-east-1") == "vpc-1"
    mapped = AWSConfig(vpc_id={"us-west-2": "vpc-2"})
    assert mapped.vpc_for("us-west-2") == "vpc-2" and mapped.vpc_for("us-east-1") is None


def test_capacity_in_one_zone_moves_to_the_next_zone_before_the_next_offer(aws, ledger, fake_ec2):
    two_zones = G5.model_copy(update={"zones": ["us-east-1a", "us-east-1b"]})
    fake_ec2.fail("InsufficientInstanceCapacity", zone="us-east-1a")
    chosen, inst = walk(aws, ledger, [two_zones, P4])
    assert chosen.instance_type == "g5.xlarge" and inst.zone == "us-east-1b"
    zones = [r.get("Placement.AvailabilityZone") for r in fake_ec2.run_requests]
    assert zones == ["us-east-1a", "us-east-1b"]


def test_a_full_subnet_moves_to_the_next_zone(aws, ledger, fake_ec2):
    two_zones = G5.model_copy(update={"zones": ["us-east-1a", "us-east-1b"]})
    fake_ec2.fail("InsufficientFreeAddressesInSubnet", zone="us-east-1a",
                  message="There are not enough free addresses in subnet 'subnet-1' to satisfy the requested number "
                          "of instances.")
    chosen, inst = walk(aws, ledger, [two_zones, P4])
    assert chosen.instance_type == "g5.xlarge" and inst.zone == "us-east-1b"


@pytest.mark.parametrize("code", ["OptInRequired", "PendingVerification"])
def test_a_region_the_account_cannot_use_yet_is_skipped_and_said(aws, ledger, fake_ec2, code):
    fake_ec2.fail(code, region="us-east-1")
    chosen, _ = walk(aws, ledger, [G4, G5, G5_WEST])
    assert (chosen.instance_type, chosen.region) == ("g5.xlarge", "us-west-2")
    assert [r["region"] for r in fake_ec2.run_requests] == ["us-east-1", "us-west-2"]  # g5 there skipped
    with pytest.raises(OffersExhausted) as e:
        walk(aws, ledger, [G4, G5], j=job(1))
    first, second = e.value.reasons
    assert code in first and "the region is skipped" in first  # what to do, after the cloud's own words
    assert second == f"aws g5.xlarge in us-east-1 ($1.006/h): skipped, {code} for aws us-east-1 (all)"


def test_root_volume_is_at_least_the_ami_snapshot(aws, fake_ec2):
    image = aws._ami("us-east-1", G5)
    small = G5.model_copy(update={"disk_gb": 1.0})
    snapshot = next(m["Ebs"]["VolumeSize"] for m in image.get("BlockDeviceMappings", [])
                    if m["DeviceName"] == image.get("RootDeviceName")) if image.get("BlockDeviceMappings") else 8
    aws.create(job(), small, provisioning_key("svc", "llm", 0, 0, small))
    run = fake_ec2.run_requests[-1]
    assert int(run["BlockDeviceMapping.1.Ebs.VolumeSize"]) == max(8, snapshot)


def test_a_group_released_after_the_launch_looked_it_up_is_made_again_on_the_retry(aws, fake_ec2):
    """A spot replacement launching while the teardown of the replica it replaces releases the service's group
    (its last instance gone): EC2 refuses RunInstances with the deleted group; the launch fails retryably and
    its retry makes the group again, with its rules."""
    first = aws.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    aws.terminate(first)
    AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"])).release("svc")  # the teardown's worker
    key = provisioning_key("svc", "llm", 0, 1, G5)
    with pytest.raises(CloudError) as refused:
        aws.create(job(submission=1), G5, key)  # this worker still has the group it looked up
    assert refused.value.code == "InvalidGroup.NotFound" and refused.value.kind is ErrorKind.TRANSIENT
    assert aws.create(job(submission=1), G5, key)
    (raw,) = all_instances()
    group = group_of(raw)["GroupId"]
    assert sg_rules(group) == {("tcp", 22, ("203.0.113.7/32",), ()), ("-1", None, (), (group,))}


def test_the_fake_refuses_deleting_a_group_an_instance_holds_as_ec2_does(aws, fake_ec2):
    """A teardown's release racing a launch into the group: EC2 refuses, the teardown retries, sees the instance
    and keeps the group (moto alone deleted it and left the instance with no rules)."""
    from botocore.exceptions import ClientError

    aws.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    group = group_of(all_instances()[0])["GroupId"]
    with pytest.raises(ClientError) as refused:
        ec2().delete_security_group(GroupId=group)
    assert refused.value.response["Error"]["Code"] == "DependencyViolation"


def test_spot_offer_uses_instance_market_options(aws, fake_ec2):
    spot = offer("g5.xlarge", 0.41, spot=True)
    inst = aws.create(job(), spot, provisioning_key("svc", "llm", 0, 0, spot))
    assert inst.spot and all_instances()[0]["InstanceLifecycle"] == "spot"
    assert fake_ec2.run_requests[-1]["InstanceMarketOptions.MarketType"] == "spot"


def test_cpu_instance_gets_the_cpu_ami_and_no_gpu_flag(aws):
    inst = aws.create(job(), M5, provisioning_key("svc", "llm", 0, 0, M5))
    raw = all_instances()[0]
    assert ec2().describe_images(ImageIds=[raw["ImageId"]])["Images"][0]["Name"] == CPU_AMI
    text = base64.b64decode(ec2().describe_instance_attribute(InstanceId=inst.instance_id, Attribute="userData")
                            ["UserData"]["Value"]).decode()
    assert "--gpus" not in text


def test_ami_lookup_is_cached_and_overridable(aws, fake_ec2):
    aws.create(job(0), G5, provisioning_key("svc", "llm", 0, 0, G5))
    aws.create(job(1), G5, provisioning_key("svc", "llm", 1, 0, G5))
    assert fake_ec2.count("DescribeImages") == 1
    image_id = ec2().register_image(Name="my-own-image")["ImageId"]
    custom = AWSBackend(AWSConfig(regions=["us-east-1"], ami_id=image_id))
    inst = custom.create(job(2), G5, provisioning_key("svc", "llm", 2, 0, G5))
    assert next(i for i in all_instances() if i["InstanceId"] == inst.instance_id)["ImageId"] == image_id


def test_gpu_instances_get_the_newest_ubuntu_24_04_base_oss_ami_of_their_arch(fake_ec2):
    # Registered oldest first, none seeded before: moto dates each image when it is registered (to the second),
    # and the lookup takes the newest date, then the greatest name (DLAMI names end in their date).
    ids = {name: ec2().register_image(Name=name, Description=name)["ImageId"] for name in (
        "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20260929",  # older, same line
        GPU_AMI,  # 24.04, 20261006
        "Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261006",
        "Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 22.04) 20261110")}  # newer, the older Ubuntu
    aws = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], gateway_cidrs=["203.0.113.7/32"]))
    assert aws._ami("us-east-1", G5)["ImageId"] == ids[GPU_AMI]
    arm = G5.model_copy(update={"instance_type": "g5g.xlarge", "cpu_arch": "arm"})
    assert aws._ami("us-east-1", arm)["ImageId"] == \
        ids["Deep Learning ARM64 Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261006"]
    # A newer release of the line takes over once published (the lookup is cached for AMI_TTL).
    newer = ec2().register_image(Name="Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) 20261201")
    aws._amis.clear()
    inst = aws.create(job(), G5, provisioning_key("svc", "llm", 0, 0, G5))
    assert inst.image == newer["ImageId"] == all_instances()[0]["ImageId"]
    # What the replica's events say once it booted (the driver as its boot script read it from nvidia-smi).
    assert booted(job(), aws.get(inst), G5, "595.91.07, CUDA 13.2") == \
        f"replica 0: aws {inst.instance_id} booted image {newer['ImageId']}, NVIDIA driver 595.91.07, CUDA 13.2"


def test_missing_ami_is_fatal_with_a_clear_message(fake_ec2):
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"]))  # nothing registered
    with pytest.raises(CloudError, match="no AMI 'Deep Learning Base OSS") as e:
        backend.create(job(), G5, "k")
    assert e.value.kind is ErrorKind.FATAL


# --- exactly once -----------------------------------------------------------------------------------

def test_same_key_returns_the_same_instance(aws, fake_ec2):
    key = provisioning_key("svc", "llm", 0, 0, G5)
    first = aws.create(job(), G5, key)
    again = aws.create(job(), G5, key)
    assert again.instance_id == first.instance_id and len(all_instances()) == 1
    assert len(fake_ec2.run_requests) == 2  # both calls reached EC2; the token made the second a no-op


def test_lost_responses_ten_times_then_one_instance(aws, ledger, fake_ec2):
    """RunInstances succeeds but its answer is lost (503) ten times in a row; each retry carries the same token."""
    key = provisioning_key("svc", "llm", 0, 0, G5)
    fake_ec2.lose_responses(10)
    for _ in range(10):
        with pytest.raises(CloudError) as e:
            aws.create(job(), G5, key)
        assert e.value.kind is ErrorKind.TRANSIENT
    inst = aws.create(job(), G5, key)
    assert [i["InstanceId"] for i in all_instances()] == [inst.instance_id]
    assert len(fake_ec2.run_requests) == 11  # botocore did not retry on its own


def test_walker_retries_the_unresolved_key_first(aws, ledger, fake_ec2):
    """Cheapest offer out of capacity, the next launched but its answer lost; when capacity is back, the retry
    must not launch the cheaper one: it finds the launched instance instead."""
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g4dn.xlarge", times=1)
    fake_ec2.lose_responses(1)
    with pytest.raises(CloudError) as e:
        walk(aws, ledger, [G4, G5])
    assert e.value.kind is ErrorKind.TRANSIENT
    for _ in range(10):
        chosen, inst = walk(aws, ledger, [G4, G5])
        assert chosen.instance_type == "g5.xlarge"
    assert [i["InstanceType"] for i in all_instances()] == ["g5.xlarge"]


def test_parameter_mismatch_after_a_new_ami_adopts_the_instance(aws, fake_ec2):
    key = provisioning_key("svc", "llm", 0, 0, G5)
    first = aws.create(job(), G5, key)
    # A newer DLAMI replaces the old one (deregistered, so the lookup cannot tie on creation time).
    ec2().deregister_image(ImageId=fake_ec2.run_requests[0]["ImageId"])
    ec2().register_image(Name=GPU_AMI.replace("20250101", "20991231"))
    fresh = AWSBackend(aws.config)  # another worker: no AMI cache
    again = fresh.create(job(), G5, key)
    assert again.instance_id == first.instance_id and len(all_instances()) == 1
    assert fake_ec2.run_requests[-1]["ImageId"] != fake_ec2.run_requests[0]["ImageId"]


def _spec(tmp_path, fake_ec2, n: int, kill: bool) -> Path:
    spec = {"config": {"aws": {"regions": ["us-east-1"], "ami_owners": ["self"]}},
            "job": job().model_dump(mode="json"), "resources": GPU.model_dump(mode="json"),
            "offers": [o.model_dump(mode="json") for o in (G4, G5)], "store": f"sqlite:///{tmp_path}/store.db",
            "kill": kill}
    path = tmp_path / f"spec{n}.json"
    path.write_text(json.dumps(spec))
    return path


def test_worker_killed_after_the_cloud_call_ten_times_leaves_one_instance(aws, tmp_path, fake_ec2):
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g4dn.xlarge", times=1)
    for n in range(10):
        proc = subprocess.run([*CHILD, str(_spec(tmp_path, fake_ec2, n, True))], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    proc = subprocess.run([*CHILD, str(_spec(tmp_path, fake_ec2, 99, False))], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    result = json.loads(proc.stdout)
    (raw,) = all_instances()
    assert raw["InstanceId"] == result["instance"]["instance_id"] and raw["InstanceType"] == "g5.xlarge"
    assert len(fake_ec2.run_requests) == 2  # g4dn (no capacity) and g5 once: later workers adopted it
    # The first child's intent survived its SIGKILL; each later child recorded the instance it adopted.
    ledger = StoreLedger(Store(f"sqlite:///{tmp_path}/store.db"))
    phases = [e["phase"] for e in ledger.entries(provisioning_key("svc", "llm", 0, 0, G5))]
    assert phases == ["intent"] + ["created"] * 10


# --- the offer walk ---------------------------------------------------------------------------------

def test_capacity_error_on_the_cheapest_offer_uses_the_next(aws, ledger, fake_ec2):
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g4dn.xlarge")
    chosen, inst = walk(aws, ledger, [G5, G4])
    assert chosen.instance_type == inst.instance_type == "g5.xlarge"
    types = [r["InstanceType"] for r in fake_ec2.run_requests]
    assert types == ["g4dn.xlarge", "g5.xlarge"]  # one request per offer: botocore's retries are off for HTTP 500
    last = ledger.entries(provisioning_key("svc", "llm", 0, 0, G4))[-1]
    assert last["data"]["code"] == "InsufficientInstanceCapacity"


@pytest.mark.parametrize("code", ["SpotMaxPriceTooLow", "Unsupported"])
def test_other_capacity_codes_move_on(aws, ledger, fake_ec2, code):
    fake_ec2.fail(code, instance_type="g4dn.xlarge")
    assert walk(aws, ledger, [G4, G5])[0].instance_type == "g5.xlarge"


@pytest.mark.parametrize("code", ["VcpuLimitExceeded", "InstanceLimitExceeded"])
def test_quota_error_skips_the_region_and_class(aws, ledger, fake_ec2, code):
    fake_ec2.fail(code, region="us-east-1")
    chosen, _ = walk(aws, ledger, [G4, G5, G5_WEST])
    assert (chosen.instance_type, chosen.region) == ("g5.xlarge", "us-west-2")
    assert [(r["InstanceType"], r["region"]) for r in fake_ec2.run_requests] == \
        [("g4dn.xlarge", "us-east-1"), ("g5.xlarge", "us-west-2")]  # g5 in us-east-1 (same G quota) skipped


def test_quota_of_one_class_does_not_skip_another(aws, ledger, fake_ec2):
    fake_ec2.fail("VcpuLimitExceeded", instance_type="g4dn.xlarge")
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g5.xlarge")
    chosen, _ = walk(aws, ledger, [G4, G5, P4])
    assert chosen.instance_type == "p4d.24xlarge"  # the P quota is separate from the G quota


def test_all_offers_failed_lists_the_reasons(aws, ledger, fake_ec2):
    fake_ec2.fail("InsufficientInstanceCapacity")
    with pytest.raises(OffersExhausted, match=r"^all offers failed: aws g4dn.xlarge in us-east-1 \(\$0.526/h\): .*"
                                         r"InsufficientInstanceCapacity.*; aws g5.xlarge"):
        walk(aws, ledger, [G4, G5])


@pytest.mark.parametrize("code,kind", [("AuthFailure", ErrorKind.FATAL), ("UnauthorizedOperation", ErrorKind.FATAL),
                                       ("RequestLimitExceeded", ErrorKind.TRANSIENT),
                                       ("InternalError", ErrorKind.TRANSIENT)])
def test_fatal_and_transient_errors_stop_the_walk(aws, ledger, fake_ec2, code, kind):
    fake_ec2.fail(code, instance_type="g4dn.xlarge", message=f"{code} for you")
    with pytest.raises(CloudError, match=f"{code}: {code} for you") as e:
        walk(aws, ledger, [G4, G5])
    assert e.value.kind is kind
    assert [r["InstanceType"] for r in fake_ec2.run_requests] == ["g4dn.xlarge"]


def test_missing_credentials_fail_the_replica_with_that_message(aws, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    backend = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"]))
    with pytest.raises(CloudError, match="credentials") as e:
        backend.create(job(), G5, "k")
    assert e.value.kind is ErrorKind.FATAL


# --- listing, termination, stop ---------------------------------------------------------------------

def test_list_tagged_sees_only_durastack_instances_in_every_region(aws, ledger):
    walk(aws, ledger, [G5], j=job(0))
    walk(aws, ledger, [G5_WEST], j=job(1, service="other"))
    untagged = ec2().run_instances(ImageId=all_instances()[0]["ImageId"], InstanceType="t3.micro", MinCount=1,
                                   MaxCount=1)["Instances"][0]["InstanceId"]
    listed = aws.list_tagged()
    assert sorted((i.region, i.owner) for i in listed) == [("us-east-1", ("svc", "llm", "r0-s0")),
                                                           ("us-west-2", ("other", "llm", "r1-s0"))]
    assert untagged not in {i.instance_id for i in listed}
    assert [i.region for i in aws.list_tagged(service="other")] == ["us-west-2"]


def test_terminating_a_gone_instance_is_success(aws, ledger):
    _, inst = walk(aws, ledger, [G5])
    terminate_cloud(inst, backends={"aws": aws}, ledger=ledger)
    assert aws.get(inst) is None
    terminate_cloud(inst, backends={"aws": aws}, ledger=ledger)  # again
    aws.terminate(inst.model_copy(update={"instance_id": "i-0123456789abcdef0"}))  # never existed
    assert ledger.entries(inst.key)[-1]["phase"] == "terminated"


def test_stopping_the_service_leaves_no_instance_tagged_for_it(aws, ledger):
    for n in range(3):
        walk(aws, ledger, [G5 if n % 2 else G5_WEST], j=job(n))
    walk(aws, ledger, [G5], j=job(9, service="keep"))
    assert terminate_service({"aws": aws}, "svc", ledger=ledger) == 3
    assert aws.list_tagged(service="svc") == []
    assert [i.owner[0] for i in aws.list_tagged()] == ["keep"]
    running = [i for r in ("us-east-1", "us-west-2") for i in all_instances(r)
               if {"Key": "durastack:service", "Value": "svc"} in i.get("Tags", [])]
    assert running == []


def test_a_group_held_by_an_instance_shutting_down_is_retried_not_left(aws, ledger, monkeypatch):
    """Real EC2 keeps a terminated instance's interface (and so its security group) for a while: DeleteSecurityGroup
    answers DependencyViolation. moto terminates at once, so the error is injected; release must not swallow it
    (nothing else would delete the group), but raise it as retryable for the teardown to try again."""
    from botocore.exceptions import ClientError

    inst = walk(aws, ledger, [G5], j=job(0))
    terminate_service({"aws": aws}, "svc", ledger=ledger)  # moto: terminated at once, the group deleted
    walk(aws, ledger, [G5], j=job(1))
    aws.terminate(aws.list_tagged(service="svc")[0])
    client = aws.client("us-east-1")
    real = client.delete_security_group
    calls = []

    def held(**kw):
        calls.append(kw)
        if len(calls) == 1:
            raise ClientError({"Error": {"Code": "DependencyViolation", "Message": "resource has a dependent object"},
                               "ResponseMetadata": {"HTTPStatusCode": 400}}, "DeleteSecurityGroup")
        return real(**kw)

    monkeypatch.setattr(client, "delete_security_group", held)
    with pytest.raises(CloudError) as raised:
        aws.release("svc")
    assert raised.value.kind is ErrorKind.TRANSIENT and raised.value.code == "DependencyViolation"
    aws.release("svc")  # the teardown's retry, once the instance is gone
    groups = ec2().describe_security_groups(Filters=[{"Name": "group-name", "Values": ["durastack-svc"]}])
    assert groups["SecurityGroups"] == [] and inst


def test_two_control_planes_share_an_account_without_touching_each_other(aws, ledger, fake_ec2):
    """A laptop and a cluster on one AWS account, each with a service `svc`: keys, adoption, listing (the
    reaper's view), stop and replica teardown each see only their own instances — and untagged old ones."""
    config = aws.config
    laptop, cluster = (AWSBackend(config, installation=i) for i in ("h-laptop", "t-cluster"))
    old = walk(aws, ledger, [G5], j=job(5))[1]  # from before installations were tagged
    chosen, mine = walk(laptop, ledger, [G5])
    _, theirs = walk(cluster, ledger, [G5])  # the same service, group, replica and offer: not adopted
    assert mine.instance_id != theirs.instance_id and mine.key != theirs.key
    assert mine.key == provisioning_key("svc", "llm", 0, 0, chosen, "h-laptop") != provisioning_key(
        "svc", "llm", 0, 0, chosen)
    raw = next(i for i in all_instances() if i["InstanceId"] == mine.instance_id)
    assert {"Key": "durastack:installation", "Value": "h-laptop"} in raw["Tags"]
    groups = raw["SecurityGroups"] or raw["NetworkInterfaces"][0]["Groups"]  # moto lists the interface's only
    assert [g["GroupName"] for g in groups] == ["durastack-h-laptop-svc"]  # not the cluster's
    assert {i.instance_id for i in laptop.list_tagged()} == {mine.instance_id, old.instance_id}
    assert [i.instance_id for i in laptop.find_replica(job())] == [mine.instance_id]
    assert terminate_replica(job(), backends={"aws": cluster}) == 1
    assert terminate_service({"aws": laptop}, "svc", ledger=ledger) == 2  # its own and the untagged one
    assert laptop.get(mine) is None and laptop.get(old) is None and cluster.get(theirs) is None
    _, again = walk(cluster, ledger, [G5], j=job(1))
    assert terminate_service({"aws": laptop}, "svc", ledger=ledger) == 0 and cluster.get(again) is not None


def test_make_backends_from_config_uses_catalog_regions_when_none_configured():
    from backends.cloud import make_backends

    backends = make_backends(BackendsConfig(aws=AWSConfig()), catalog=[G5, G5_WEST])
    assert list(backends) == ["aws"] and backends["aws"].regions == ["us-east-1", "us-west-2"]


# --- the replica activities on AWS: launch, monitor, teardown ---------------------------------------

def _replica_activities(aws_backend, ledger, gateway, address: str, catalog=(G4, G5)) -> ReplicaActivities:
    config = BackendsConfig(aws=AWSConfig(regions=aws_backend.regions, ami_owners=["self"]))
    cloud = CloudReplicas(config, {"aws": aws_backend}, ledger, catalog=list(catalog),
                          address=lambda _: address, poll_seconds=0.1, gateway=gateway)
    return ReplicaActivities(None, gateway, cloud=cloud, quick_seconds=0)  # moto places in milliseconds


def _launch_input(j=None) -> LaunchInput:
    return LaunchInput(backend="aws", replica=ReplicaInput(service_workflow_id="service/svc", job=j or job(),
                                                           resources=GPU, backends=["aws"]))


async def test_launch_on_aws_places_once_registers_and_a_retry_adopts_the_instance(aws, ledger, fake_ec2):
    server, address = await app_server()
    gateway, client = FakeGateway(), FakeClient()
    acts = _replica_activities(aws, ledger, gateway, address)
    async with server:
        first = await activity_env(client).run(acts.launch, _launch_input())
        again = await activity_env(client).run(acts.launch, _launch_input())  # its first result was lost
    assert first.instance.kind == "cloud" and first.placement.instance_type == "g4dn.xlarge"
    assert again.instance.instance_id == first.instance.instance_id and len(all_instances()) == 1
    assert gateway.routed == {job().replica_id: address}
    assert client.reports() == [(1, "provisioning", False, False), (2, "running", False, False),
                                (3, "running", True, True)] * 2


async def test_instance_types_and_zones_of_the_service_decide_where_it_is_placed(aws, ledger, fake_ec2):
    # The cheaper g4dn is not among the types asked for; g5 is offered in two zones, and only the second is asked.
    server, address = await app_server()
    two_zones = G5.model_copy(update={"zones": ["us-east-1a", "us-east-1b"]})
    acts = _replica_activities(aws, ledger, FakeGateway(), address, catalog=(G4, two_zones))
    inp = _launch_input()
    inp.replica.instance_types, inp.replica.zones = ["g5.xlarge"], ["us-east-1b"]
    async with server:
        launched = await activity_env(FakeClient()).run(acts.launch, inp)
    assert (launched.placement.instance_type, launched.instance.zone) == ("g5.xlarge", "us-east-1b")
    assert [r.get("Placement.AvailabilityZone") for r in fake_ec2.run_requests] == ["us-east-1b"]


async def test_no_capacity_on_aws_says_whether_offers_were_tried(aws, ledger, fake_ec2):
    acts = _replica_activities(aws, ledger, FakeGateway(), "127.0.0.1:1")
    fake_ec2.fail("InsufficientInstanceCapacity")
    with pytest.raises(ApplicationError) as failed:
        await activity_env(FakeClient()).run(acts.launch, _launch_input())
    details = refusal_of(failed.value)
    assert details.backend == "aws" and details.tried and len(details.reasons) == 2
    assert all("InsufficientInstanceCapacity" in r for r in details.reasons)

    cpu_only = _replica_activities(aws, ledger, FakeGateway(), "127.0.0.1:1", catalog=[M5])
    with pytest.raises(ApplicationError) as unmatched:
        await activity_env(FakeClient()).run(cpu_only.launch, _launch_input())
    details = refusal_of(unmatched.value)
    assert details.backend == "aws" and not details.tried and details.reasons


async def test_an_instance_terminated_outside_is_down_and_teardown_without_a_record_finds_the_rest(aws, ledger,
                                                                                                    fake_ec2):
    server, address = await app_server()
    gateway, client = FakeGateway(), FakeClient()
    acts = _replica_activities(aws, ledger, gateway, address)
    async with server:
        launched = [await activity_env(client).run(acts.launch, _launch_input(job(replica=n))) for n in range(2)]
    watched = [Watched(replica_num=n, submission_num=0, group="llm", workflow_id=f"service/svc/llm/r{n}-s0",
                       replica_id=job(replica=n).replica_id, instance=li.instance) for n, li in enumerate(launched)]
    monitor = asyncio.ensure_future(activity_env(client).run(acts.monitor, MonitorInput(
        service="svc", backend="aws", replicas=watched, poll_seconds=0.1)))
    ec2().terminate_instances(InstanceIds=[launched[0].instance.instance_id])  # preempted, or deleted by hand
    down = await asyncio.wait_for(monitor, 20)
    assert [(d.replica_num, d.reason) for d in down] == [(0, "instance terminated")]
    assert list(gateway.routed) == [job(replica=1).replica_id]

    # Replica 1's launch died before it returned: its teardown finds the instance by the replica's tags.
    await activity_env(client).run(acts.teardown, TeardownInput(
        service_workflow_id="service/svc", job=job(replica=1), backend="aws", instance=None, reason="stopped"))
    assert all_instances() == [] and gateway.routed == {}
    assert [(u.seq, u.status) for _, _, u in client.signals[-2:]] == [(10, "terminating"), (11, "terminated")]


# --- capacity reservations and Capacity Blocks ------------------------------------------------------

G5_ZONES = G5.model_copy(update={"zones": ["us-east-1a", "us-east-1b", "us-east-1c"]})


def reserved_walk(aws_backend, ledger, reservation_id: str, offers=(G4, G5_ZONES), j=None):
    lookup = aws_backend.find_reservation(reservation_id)
    return walk(aws_backend, ledger, match_offers(list(offers), GPU, reservation=lookup), j)


def free_in(reservation_id: str) -> int:
    (found,) = ec2().describe_capacity_reservations(CapacityReservationIds=[reservation_id])["CapacityReservations"]
    return found["AvailableInstanceCount"]


def test_a_capacity_reservation_takes_its_type_on_demand_in_its_zone_only(aws, ledger, fake_ec2):
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1b", count=2)
    lookup = aws.find_reservation(rid)
    (found,) = lookup.found
    assert (found.region, found.zone, found.kind, found.state, found.free) == \
        ("us-east-1", "us-east-1b", "capacity-reservation", "active", 2)
    # The cheaper g4dn and the spot g5 are not what it holds; the g5 offer is narrowed to the reservation's zone.
    spot = G5_ZONES.model_copy(update={"spot": True, "price": 0.4})
    kept = match_offers([G4, G5_ZONES, spot], GPU, spot_policy="auto", reservation=lookup)
    assert [(o.instance_type, o.spot, o.zones, o.reservation) for o in kept] == \
        [("g5.xlarge", False, ["us-east-1b"], rid)]

    chosen, inst = walk(aws, ledger, kept)
    run = fake_ec2.run_requests[-1]
    assert run["CapacityReservationSpecification.CapacityReservationTarget.CapacityReservationId"] == rid
    assert run["Placement.AvailabilityZone"] == "us-east-1b" and "InstanceMarketOptions.MarketType" not in run
    assert "Placement.Tenancy" not in run
    (raw,) = all_instances()
    assert raw["CapacityReservationId"] == rid and raw.get("InstanceLifecycle") is None and not inst.spot
    assert inst.zone == "us-east-1b" and free_in(rid) == 1


def test_a_capacity_block_launches_with_its_market_type_and_a_dedicated_tenancy_is_copied(aws, ledger, fake_ec2):
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1c", kind="capacity-block", tenancy="dedicated")
    _, inst = reserved_walk(aws, ledger, rid)
    run = fake_ec2.run_requests[-1]
    assert run["InstanceMarketOptions.MarketType"] == "capacity-block" and run["Placement.Tenancy"] == "dedicated"
    assert "InstanceMarketOptions.SpotOptions.SpotInstanceType" not in run
    (raw,) = all_instances()
    assert raw["InstanceLifecycle"] == "capacity-block" and raw["Placement"]["Tenancy"] == "dedicated"
    assert raw["CapacityReservationId"] == rid and not inst.spot and inst.zone == "us-east-1c"


def test_a_full_reservation_fails_the_walk_with_ec2s_code_and_says_what_it_means(aws, ledger, fake_ec2):
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1a")
    reserved_walk(aws, ledger, rid)
    with pytest.raises(OffersExhausted) as full:
        reserved_walk(aws, ledger, rid, j=job(replica=1))
    (reason,) = full.value.reasons
    assert f"reservation {rid}" in reason and "ReservationCapacityExceeded" in reason
    assert "no free instance of this type in this zone" in reason  # the hint names the setting's meaning
    assert full.value.tried and len(all_instances()) == 1

    # Once its instance is gone, the place is free again.
    ec2().terminate_instances(InstanceIds=[all_instances()[0]["InstanceId"]])
    assert free_in(rid) == 1
    reserved_walk(aws, ledger, rid, j=job(replica=2))
    assert free_in(rid) == 0


@pytest.mark.parametrize("state", ["expired", "cancelled"])
def test_an_ended_reservation_leaves_no_offer_and_says_why(aws, ledger, fake_ec2, state):
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1a")
    fake_ec2.set_reservation_state(rid, state)
    lookup = aws.find_reservation(rid)
    assert not match_offers([G4, G5_ZONES], GPU, reservation=lookup)
    assert describe_mismatch([G4, G5_ZONES], GPU, reservation=lookup) == \
        f"no offer has reservation {rid} open to launches (us-east-1a: it is {state})"
    # Ended between the lookup and the launch: EC2 refuses it, and the walk says so.
    fake_ec2.set_reservation_state(rid, "active")
    kept = match_offers([G5_ZONES], GPU, reservation=aws.find_reservation(rid))
    fake_ec2.set_reservation_state(rid, state)
    with pytest.raises(OffersExhausted, match="ReservationCapacityExceeded"):
        walk(aws, ledger, kept)
    assert all_instances() == []


def test_a_reservation_no_region_has_is_said_with_where_it_was_looked_for(aws):
    lookup = aws.find_reservation("cr-0123456789abcdef0")
    assert lookup.found == [] and lookup.notes == ["aws: not found in us-east-1, us-west-2"]
    assert describe_mismatch([G5_ZONES], GPU, reservation=lookup) == \
        "no offer has reservation cr-0123456789abcdef0 (aws: not found in us-east-1, us-west-2)"
    assert aws.find_reservation("my-gcp-reservation").notes == ["aws: not an EC2 Capacity Reservation id (cr-…)"]


def test_the_fake_refuses_what_ec2_refuses_for_a_reservation(aws, fake_ec2):
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1a")
    image = ec2().describe_images(Owners=["self"])["Images"][0]["ImageId"]

    def launch(target: str, **extra):
        params = dict(ImageId=image, InstanceType="g5.xlarge", MinCount=1, MaxCount=1,
                      Placement={"AvailabilityZone": "us-east-1a"},
                      CapacityReservationSpecification={"CapacityReservationTarget": {"CapacityReservationId": target}})
        with pytest.raises(ClientError) as refused:
            ec2().run_instances(**{**params, **extra})
        return refused.value.response["Error"]["Code"]

    assert launch("cr-123") == "InvalidCapacityReservationId.Malformed"
    assert launch("cr-0123456789abcdef0") == "InvalidCapacityReservationId.NotFound"
    assert launch(rid, InstanceType="g4dn.xlarge") == "ReservationCapacityExceeded"  # another type
    assert launch(rid, Placement={"AvailabilityZone": "us-east-1b"}) == "ReservationCapacityExceeded"
    assert launch(rid, InstanceMarketOptions={"MarketType": "capacity-block"}) == "ReservationCapacityExceeded"
    with pytest.raises(ClientError, match="InvalidCapacityReservationId.NotFound"):
        ec2().describe_capacity_reservations(CapacityReservationIds=["cr-0123456789abcdef0"])
    fake_ec2.set_reservation_state(fake_ec2.add_reservation("g5.xlarge", "us-east-1a"), "expired")
    active = ec2().describe_capacity_reservations(Filters=[{"Name": "state", "Values": ["active"]}])
    assert [r["CapacityReservationId"] for r in active["CapacityReservations"]] == [rid]
    assert all_instances() == [] and free_in(rid) == 1


async def test_launch_into_a_reservation_places_there_and_one_no_cloud_has_is_no_capacity(aws, ledger, fake_ec2):
    server, address = await app_server()
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1b")
    acts = _replica_activities(aws, ledger, FakeGateway(), address, catalog=(G4, G5_ZONES))
    inp = _launch_input()
    inp.replica.reservation = rid
    async with server:
        launched = await activity_env(FakeClient()).run(acts.launch, inp)
    assert (launched.placement.instance_type, launched.instance.zone) == ("g5.xlarge", "us-east-1b")
    assert all_instances()[0]["CapacityReservationId"] == rid

    inp = _launch_input(job(replica=1))
    inp.replica.reservation = "cr-0123456789abcdef0"
    with pytest.raises(ApplicationError) as failed:
        await activity_env(FakeClient()).run(acts.launch, inp)
    details = refusal_of(failed.value)
    assert not details.tried and details.reasons == [
        "no offer has reservation cr-0123456789abcdef0 (aws: not found in us-east-1, us-west-2)"]


def test_offers_with_a_reservation_flag_or_file_look_it_up_in_the_configured_cloud(fake_ec2, tmp_path):
    from typer.testing import CliRunner

    from cli.main import app

    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1c", count=2)
    (tmp_path / "config.yml").write_text("backends:\n  aws:\n    regions: [us-east-1]\n")
    env = {"DURASTACK_HOME": str(tmp_path), "COLUMNS": "200"}
    result = CliRunner().invoke(app, ["offers", "--gpu", "1..", "--reservation", rid, "--json", "--limit", "0"],
                                env=env)
    assert result.exit_code == 0, result.output
    (group,) = json.loads(result.stdout)["groups"]
    assert [(o["instance_type"], o["zones"], o["reservation"], o["spot"]) for o in group["offers"]] == \
        [("g5.xlarge", ["us-east-1c"], rid, False)]
    assert group["reservation"]["found"][0]["zone"] == "us-east-1c"

    service = tmp_path / "svc.yml"
    service.write_text(f"type: service\nname: svc\nport: 8000\nbackends: [aws]\nreservation: {rid}\n"
                       "commands: [x]\nresources:\n  gpu: A10G\n")
    plan = CliRunner().invoke(app, ["offers", "-f", str(service)], env=env)
    assert plan.exit_code == 0 and f"reservation {rid}: g5.xlarge in us-east-1c, 2 of 2 free" in plan.stdout
