"""The simulated VPC (tests/fakes/vpc.py) refuses what the cloud's firewall refuses: SSH from a source the security
group / firewall rule does not name, any port of an instance from another service's instance, the service port
from the gateway; and lets a service's instances reach each other on any port, as the service's own rule says.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from backends.aws import AWSBackend
from backends.gcp import GCPBackend
from models.backends import AWSConfig, GCPConfig, provisioning_key
from models.offers import InstanceOffer
from models.replica import JobSpec
from tests.fakes import vpc as vpcs
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))

AWS_M5 = InstanceOffer(backend="aws", instance_type="m5.large", region="us-east-1", zones=["us-east-1a"], cpus=2,
                       memory_gb=8.0, price=0.096)
GCP_N2 = InstanceOffer(backend="gcp", instance_type="n2-standard-2", region="us-central1", zones=["us-central1-a"],
                       cpus=2, memory_gb=8.0, price=0.097)
LISTEN = ("import socket, sys, time\n"
          "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind(('0.0.0.0', 9000)); s.listen(16); print('ready', flush=True)\n"
          "while True:\n    c, _ = s.accept(); c.sendall(b'hi'); c.close()\n")
DIAL = ("import socket, sys\n"
        "try:\n    c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5); print(c.recv(2) or b'ok')\n"
        "except OSError as e:\n    print('refused', e)\n")


def job(service: str, replica: int = 0) -> JobSpec:
    return JobSpec(service=service, group="web", replica_num=replica, submission_num=0, port=8000, commands=["true"])


@pytest.fixture
def vpc(tmp_path):
    v = vpcs.SimulatedVPC(tmp_path / "vpc")
    yield v
    v.close()


def boot_all(vpc, instances) -> dict[str, vpcs.SimHost]:
    with vpcs.Booter(vpc, instances) as booter:
        deadline = time.monotonic() + 60
        while len(vpc.hosts) < len(instances()) and time.monotonic() < deadline and not booter.errors:
            time.sleep(0.2)
        time.sleep(0.5)  # one more pass: every host's firewall brought to the peers booted after it
    assert not booter.errors, booter.errors
    return vpc.hosts


def reaches(src: str | None, host: vpcs.SimHost, port: int, vpc) -> bool:
    """Whether a TCP connection from host netns ``src`` (None: the gateway's side) to ``host``:``port`` goes through."""
    netns = src or vpc.netns
    out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", DIAL, host.address, str(port)],
                         capture_output=True, text=True, timeout=30).stdout
    return "refused" not in out


@pytest.fixture
def listeners():
    procs = []

    def listen(host: vpcs.SimHost) -> None:
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, sys.executable, "-c", LISTEN],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"

    yield listen
    for proc in procs:
        proc.kill()
        proc.wait(10)


def check(vpc, listen, a1, a2, b1, narrowed) -> None:
    for host in (a1, a2, b1, narrowed):
        listen(host)
    assert reaches(None, a1, 22, vpc)  # the gateway's SSH: admitted from its range
    assert not reaches(None, a1, 9000, vpc)  # the service port: never from outside
    assert reaches(a2.netns, a1, 9000, vpc) and reaches(a1.netns, a2, 9000, vpc)  # one network per service
    assert not reaches(b1.netns, a1, 9000, vpc) and not reaches(a1.netns, b1, 9000, vpc)  # not another service's
    assert not reaches(None, narrowed, 22, vpc)  # gateway_cidrs naming another address shuts this gateway out


def test_aws_security_groups_are_honoured(fake_ec2, vpc, listeners):
    fake_ec2.seed_amis("us-east-1")
    config = dict(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    aws = AWSBackend(AWSConfig(**config))
    for service, replica in [("a", 0), ("a", 1), ("b", 0)]:
        aws.create(job(service, replica), AWS_M5, provisioning_key(service, "web", replica, 0, AWS_M5))
    elsewhere = AWSBackend(AWSConfig(**config, gateway_cidrs=["203.0.113.7/32"]))
    elsewhere.create(job("c"), AWS_M5, provisioning_key("c", "web", 0, 0, AWS_M5))
    hosts = boot_all(vpc, vpcs.moto_instances)
    by = {(i.owner[0], i.owner[2]): hosts[i.instance_id] for i in aws.list_tagged()}
    check(vpc, listeners, by[("a", "r0-s0")], by[("a", "r1-s0")], by[("b", "r0-s0")], by[("c", "r0-s0")])


def test_gcp_firewall_rules_are_honoured(gce, vpc, listeners):
    config = dict(project_id="proj", regions=["us-central1"], endpoint=gce.url, public_ip=False)
    gcp = GCPBackend(GCPConfig(**config), installation="h-one")
    for service, replica in [("a", 0), ("a", 1), ("b", 0)]:
        gcp.create(job(service, replica), GCP_N2, provisioning_key(service, "web", replica, 0, GCP_N2, "h-one"))
    elsewhere = GCPBackend(GCPConfig(**config, gateway_cidrs=["203.0.113.7/32"]), installation="h-two")
    elsewhere.create(job("c"), GCP_N2, provisioning_key("c", "web", 0, 0, GCP_N2, "h-two"))
    hosts = boot_all(vpc, lambda: vpcs.gce_instances(gce))
    by = {(i.owner[0], i.owner[2]): hosts[i.instance_id] for i in gcp.list_tagged() + elsewhere.list_tagged()
          if i.tags.get("durastack-installation") in ("h-one", "h-two")}
    check(vpc, listeners, by[("a", "r0-s0")], by[("a", "r1-s0")], by[("b", "r0-s0")], by[("c", "r0-s0")])


def test_a_terminated_instance_powers_off_and_stops_answering(fake_ec2, vpc):
    """As a cloud's: once the instance is terminated its host no longer answers, and its address is free."""
    import boto3

    from tests.e2e import until

    fake_ec2.seed_amis("us-east-1")
    aws = AWSBackend(AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False))
    aws.create(job("a"), AWS_M5, provisioning_key("a", "web", 0, 0, AWS_M5))
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        (host,) = until(lambda: list(vpc.hosts.values()), 60, 0.2, "the instance booted")
        assert reaches(None, host, 22, vpc)
        boto3.client("ec2", region_name="us-east-1").terminate_instances(InstanceIds=[host.name])
        until(lambda: host.name not in vpc.hosts, 60, 0.2, "the host powered off")
    assert not booter.errors, booter.errors
    assert host.server.poll() is not None and not reaches(None, host, 22, vpc)
    assert host.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
