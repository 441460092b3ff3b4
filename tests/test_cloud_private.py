"""`data_path: private`: cloud replicas reached at their private address, no tunnel (a control plane inside the VPC).

On moto's EC2 and the fake Compute server, every instance booted as a simulated host (tests/fakes/vpc.py): the
replica is launched over SSH (to its private IP), its gateway upstream is ``<private IP>:<port>``, the readiness
probes and a request reach it there from inside the VPC, no tunnel socket is made, the firewall admits that port
from the gateway alone, the monitor sees a dead container over SSH, and the teardown leaves no rule behind. The
configuration refuses, naming the setting, a private data path that cannot work.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import boto3
import pytest
from pydantic import ValidationError

from activities.replica import ReplicaActivities
from backends.aws import AWSBackend
from backends.gcp import GCPBackend
from backends.http import client_for
from models.backends import AWSConfig, BackendsConfig, GCPConfig, backends_config_from
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.messages import LaunchInput, MonitorInput, ReplicaInput, TeardownInput, Watched
from tests.fakes import vpc as vpcs
from tests.fakes.activity_env import FakeClient, activity_env
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from tests.test_cloud_ssh import _cloud, ledger, vpc  # noqa: F401  (fixtures)
from tests.test_ssh_path import APP, SECRET

needs_vpc = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))

# The app listens on every address of the instance: the gateway connects to its private one.
APP_ALL = APP.replace('("127.0.0.1", int(os.environ["PORT"]))', '("0.0.0.0", int(os.environ["PORT"]))')
assert APP_ALL != APP
GATEWAY = f"{vpcs.BRIDGE_ADDRESS}/32"  # where the simulated VPC's connections come from
GCE_GATEWAY = f"{vpcs.GCE_GATEWAY_ADDRESS}/32"  # and to hosts in GCE's 10.0.0.0/8
CPU = ResourcesSpec.model_validate({"cpu": "2..", "memory": "4GB.."})



def job() -> JobSpec:
    return JobSpec(service="svc", group="web", replica_num=0, submission_num=0, port=8000,
                   commands=[APP_ALL], env={"HF_TOKEN": SECRET, "MODEL": "tiny"}, secrets=["HF_TOKEN"])


# --- configuration: refused where it cannot work, naming the setting ----------------------------------------------

@pytest.mark.parametrize("cloud, settings, says", [
    ("aws", {}, "backends.aws.data_path: private needs gateway_cidrs or gateway_security_group"),
    ("aws", {"gateway_cidrs": ["203.0.113.7/32"]}, "gateway_cidrs has 203.0.113.7/32, not within a private range"),
    ("aws", {"gateway_cidrs": ["0.0.0.0/0"]}, "gateway_cidrs has 0.0.0.0/0"),
    ("gcp", {}, "backends.gcp.data_path: private needs gateway_cidrs"),
    ("gcp", {"gateway_cidrs": ["10.0.0.0/8", "198.51.100.0/24"]}, "gateway_cidrs has 198.51.100.0/24"),
])
def test_a_private_data_path_that_cannot_work_is_refused(cloud, settings, says):
    base = {"project_id": "proj"} if cloud == "gcp" else {}
    with pytest.raises(ValidationError) as e:
        backends_config_from({"backends": {cloud: {**base, "data_path": "private", **settings}}}, {})
    assert says in str(e.value)


def test_the_default_stays_the_ssh_tunnel_and_a_gateway_group_needs_the_private_path():
    assert AWSConfig().data_path == "ssh" and GCPConfig(project_id="p").data_path == "ssh"
    assert AWSConfig(gateway_cidrs=["203.0.113.7/32"]).data_path == "ssh"  # a laptop's gateway: the tunnel
    with pytest.raises(ValidationError, match="backends.aws.gateway_security_group is used only with data_path"):
        AWSConfig(gateway_security_group="sg-0123abcd")
    assert AWSConfig(data_path="private", gateway_security_group="sg-0123abcd").gateway_cidrs == []
    with pytest.raises(ValidationError, match="gateway_security_group"):
        AWSConfig(data_path="private", gateway_security_group="my-group")


# --- the data path -------------------------------------------------------------------------------------------------

async def _get(vpc, address: str):
    """A request to ``address`` made inside the VPC, as the gateway there makes it."""
    client, base = client_for(address, 5.0, vpc.socket_factory)
    async with client:
        return await client.get(base + "/")


async def _lifecycle(acts: ReplicaActivities, backend: str, vpc, booter, home) -> None:
    client, gateway, cloud = FakeClient(), acts.gateway, acts.cloud
    inp = ReplicaInput(service_workflow_id="service/svc", job=job(), resources=CPU, backends=[backend])
    launched = await activity_env(client).run(acts.launch, LaunchInput(backend=backend, replica=inp))
    assert not booter.errors, booter.errors
    instance = launched.instance
    host = vpc.hosts[instance.instance_id]
    # The upstream is the private address; ready through probes sent there; no tunnel, no socket.
    address = launched.placement.address
    assert address == f"{instance.private_ip}:8000" == f"{host.address}:8000"
    assert gateway.routed == {job().replica_id: address}
    assert cloud.tunnels == {} and not (home / "tunnels").exists()
    response = await _get(vpc, address)
    assert response.status_code == 200 and response.text == f"tiny {len(SECRET)}"

    # SSH cut off: the container cannot be checked, but that holds up no check (its connection is made in the
    # background) and unroutes nothing (the upstream does not depend on SSH); once back, checks resume.
    vpc.cut(host)
    started = time.monotonic()
    assert await cloud.down([instance]) == [None]
    assert time.monotonic() - started < 3 and gateway.routed == {job().replica_id: address}
    vpc.heal(host)
    deadline = time.monotonic() + 30
    while instance.instance_id not in cloud.controls:
        assert time.monotonic() < deadline, "no SSH connection after the cut healed"
        await cloud.down([instance])
        await asyncio.sleep(0.5)

    # A container that exits: the monitor sees it over its own SSH connection, and unroutes it.
    watched = [Watched(replica_num=0, submission_num=0, group="web", workflow_id="service/svc/web/r0-s0",
                       replica_id=job().replica_id, instance=instance)]
    monitor = asyncio.ensure_future(activity_env(client).run(acts.monitor, MonitorInput(
        service="svc", backend=backend, replicas=watched, poll_seconds=0.5, workflow_check_seconds=60)))
    await asyncio.sleep(1.0)
    assert list(cloud.controls) == [instance.instance_id] and cloud.tunnels == {}
    killed = time.monotonic()
    os.kill(host.container_pid(), signal.SIGKILL)
    down = await asyncio.wait_for(monitor, 20)
    assert [(d.replica_num, d.reason) for d in down] == [(0, "container exited (137)")]
    assert time.monotonic() - killed < 5 and gateway.routed == {}

    await activity_env(client).run(acts.teardown, TeardownInput(
        service_workflow_id="service/svc", job=job(), backend=backend, instance=instance,
        reason="exited", drain_seconds=0))
    assert cloud.controls == {} and cloud.tunnels == {} and not (home / "tunnels").exists()


@needs_vpc
async def test_aws_replica_serves_at_its_private_address(fake_ec2, vpc, ledger, tmp_path):
    fake_ec2.seed_amis("us-east-1")
    ec2 = boto3.client("ec2", region_name="us-east-1")
    default_vpc = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    gateway_group = ec2.create_security_group(GroupName="gateway", Description="the gateway",
                                              VpcId=default_vpc)["GroupId"]
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False, data_path="private",
                       gateway_cidrs=[GATEWAY], gateway_security_group=gateway_group)
    home = tmp_path / "home"
    acts = _cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, home)
    # The rules are read while the service's group exists: when the teardown releases it.
    checked = []
    real_release = acts.cloud._release

    async def release(service, backend):
        (group,) = ec2.describe_security_groups(
            Filters=[{"Name": "group-name", "Values": ["durastack-svc"]}])["SecurityGroups"]
        checked.append((group["GroupId"], {p.get("FromPort", p["IpProtocol"]): p for p in group["IpPermissions"]}))
        await real_release(service, backend)

    acts.cloud._release = release
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        await _lifecycle(acts, "aws", vpc, booter, home)
    ((group_id, rules),) = checked
    assert sorted(rules, key=str) == ["-1", 22, 8000]
    assert [g["GroupId"] for g in rules["-1"]["UserIdGroupPairs"]] == [group_id]  # the service's own instances
    assert [r["CidrIp"] for r in rules[8000]["IpRanges"]] == [GATEWAY]  # the gateway alone
    assert [g["GroupId"] for g in rules[8000]["UserIdGroupPairs"]] == [gateway_group]
    assert [r["CidrIp"] for r in rules[22]["IpRanges"]] == [GATEWAY]
    assert not ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": ["durastack-svc"]}])[
        "SecurityGroups"]  # released with its last instance


@needs_vpc
async def test_gcp_replica_serves_at_its_private_address(gce, vpc, ledger, tmp_path):
    config = GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url, public_ip=False,
                       data_path="private", gateway_cidrs=[GCE_GATEWAY])
    home = tmp_path / "home"
    backend = GCPBackend(config)
    acts = _cloud("gcp", backend, BackendsConfig(gcp=config), ledger, vpc, home)
    checked = []  # the rules, read when the teardown releases them
    real_release = acts.cloud._release

    async def release(service, name):
        checked.append({r["name"]: r for r in gce.firewall_rules()})
        await real_release(service, name)

    acts.cloud._release = release
    tags, real_resource = [], backend._resource

    def resource(*args, **kw):
        made = real_resource(*args, **kw)
        tags.append(list(made.tags.items))
        return made

    backend._resource = resource
    with vpcs.Booter(vpc, lambda: vpcs.gce_instances(gce)) as booter:
        await _lifecycle(acts, "gcp", vpc, booter, home)
    (rules,) = checked
    tag = backend.service_tag("svc")
    port_rule = rules[backend.gateway_rule("svc")]
    assert port_rule["sourceRanges"] == [GCE_GATEWAY] and port_rule["targetTags"] == [tag]
    assert [(a["IPProtocol"], a["ports"]) for a in port_rule["allowed"]] == [("tcp", ["8000"])]
    ssh_rule = rules[backend.firewall_name]
    assert [(a["IPProtocol"], a["ports"]) for a in ssh_rule["allowed"]] == [("tcp", ["22"])]
    own = rules[tag]  # the service's instances to each other
    assert own["sourceTags"] == own["targetTags"] == [tag]
    assert sorted(rules) == sorted([backend.firewall_name, tag, backend.gateway_rule("svc")])
    assert all(backend.service_tag("svc") in t for t in tags) and tags
    assert gce.firewall_rules() == []  # every rule went with the last instance


def test_with_a_public_ip_the_private_path_still_addresses_the_private_one():
    """A public IP (egress without NAT) changes nothing: the gateway, exec and logs reach the private address."""
    aws = AWSBackend(AWSConfig(data_path="private", gateway_cidrs=["10.0.0.0/16"]))
    raw = {"InstanceId": "i-1", "InstanceType": "m5.large", "State": {"Name": "running"},
           "PublicIpAddress": "198.51.100.9", "PrivateIpAddress": "10.0.3.4",
           "Tags": [{"Key": "durastack:port", "Value": "8000"}]}
    assert aws._instance(raw, "us-east-1").address == "10.0.3.4:8000"
    assert AWSBackend(AWSConfig())._instance(raw, "us-east-1").address == "198.51.100.9:8000"  # the SSH path
