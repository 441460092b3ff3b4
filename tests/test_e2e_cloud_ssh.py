"""From the CLI to a cloud replica and back, with moto's EC2 and with the fake Compute server: `durastack server`
(the Temporal dev server, the worker, the nginx gateway) with an AWS or GCP backend in config.yml; every instance
the fake cloud runs is booted as a simulated host on a simulated VPC (tests/fakes/vpc.py), which the worker
reaches only over SSH (``DURASTACK_SSH_NETNS``: its connections are made inside the VPC's namespace).

`durastack apply -y` of a two-group service (a GPU group and a CPU group) brings up the right instance types,
every replica becomes ready through the SSH data path, authenticated traffic through the gateway gets 200s,
`exec` and `logs` work, no secret value appears in user data, metadata or history; a killed container is
unrouted and replaced; a cut tunnel is unrouted and reconnected; a spot instance the cloud takes back is replaced
and named in `durastack events`; `stop` leaves no instance, security group or firewall rule.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap

import boto3
import httpx
import pytest

from tests.e2e import Stack, evidence, until
from tests.fakes import vpc as vpcs
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from tests.test_ssh_path import APP

pytestmark = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))

SECRET = "hf_e2e-cloud-secret-5678"
SERVICE = """\
type: service
name: cloudsvc
port: 8000
backends: [{backend}]
env:
  HF_TOKEN: {secret}
  MODEL: tiny
groups:
  - name: llm
    replicas: 1
    resources:
      gpu: {gpu}
    commands:
      - |
{app}
  - name: router
    replicas: 1
    resources:
      cpu: 2
      memory: 8GB
    commands:
      - |
{app}
"""


@pytest.fixture
def vpc(tmp_path):
    v = vpcs.SimulatedVPC(tmp_path / "vpc")
    yield v
    v.close()


def _stack(tmp_path, monkeypatch, vpc, config: str, *, inside: bool = False) -> Stack:
    """A `durastack server` whose worker dials the instances from the VPC's own namespace, as a gateway outside
    it would (or, ``inside``, from this machine linked into the VPC: a control plane inside it)."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (home / "config.yml").write_text(config)
    if not inside:
        monkeypatch.setenv("DURASTACK_SSH_NETNS", vpc.netns)
    return Stack(home)


def _service(tmp_path, backend: str, gpu: str):
    path = tmp_path / "cloudsvc.yml"
    path.write_text(SERVICE.format(backend=backend, secret=SECRET, gpu=gpu,
                                   app=textwrap.indent(APP, " " * 10)))
    return path


def _replicas(stack: Stack) -> dict[str, dict]:
    status = stack.ps("cloudsvc")
    return {g["name"]: r for g in status["groups"] for r in g["replicas"]
            if r["status"] == "running" and r["ready"]}


def _requests(stack: Stack, n: int) -> list[int]:
    headers = {"Authorization": f"Bearer {stack.token()}"}
    return [httpx.get(f"{stack.gateway}/services/cloudsvc/", headers=headers, timeout=10).status_code
            for _ in range(n)]


def _history_has(stack: Stack, text: str) -> bool:
    """Whether any workflow history of the stack's Temporal holds ``text`` as stored (no codec: as the server
    keeps it)."""
    from temporalio.client import Client

    async def scan() -> bool:
        from connect.connection import client_options
        from models.settings import Settings

        options = client_options(Settings.from_env(stack.env), stack.env)
        del options["data_converter"]  # the default one: payloads as stored
        client = await Client.connect(**options)
        async for wf in client.list_workflows():
            history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
            if text in history.to_json():
                return True
        return False

    return asyncio.run(scan())


def _apply(stack: Stack, path) -> None:
    """`apply -y` once the control plane answers; a worker slow to start can time the first one out, and the same
    file again is the same update."""
    stack.wait_up()
    result = stack.cli("apply", "-f", str(path), "-y", timeout=600)
    if result.returncode == 2 and "Applying the same file again is safe" in result.stderr:
        result = stack.cli("apply", "-f", str(path), "-y", timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def _scenario(stack: Stack, vpc, booter, service, types: dict[str, str], network=None) -> None:
    """``network()``: asserts the service's own network rules while it runs."""
    try:
        _apply(stack, service)
        assert not booter.errors, booter.errors
        replicas = until(lambda: (lambda r: r if len(r) == 2 else None)(_replicas(stack)), 120, 0.5, "2 ready")
        assert {g: r["instance_type"] for g, r in replicas.items()} == types
        assert all(r["address"].startswith("unix:") and "/tunnels/" in r["address"] for r in replicas.values())
        assert set(_requests(stack, 10)) == {200}
        if network is not None:
            network()

        llm = replicas["llm"]
        done = stack.cli("exec", "cloudsvc", "--replica", str(llm["replica"]), "--", "sh", "-c", "echo $MODEL")
        assert done.returncode == 0 and done.stdout == "tiny\n", done.stdout + done.stderr
        logs = stack.cli("logs", "cloudsvc", "--replica", str(llm["replica"]))
        assert logs.returncode == 0 and "request /" in logs.stdout
        assert not _history_has(stack, SECRET)
        assert booter.user_data and not any(SECRET in text for text in booter.user_data.values())
        # Each instance serves the host key durastack put in place after boot, which no boot data holds; `exec`
        # and `logs` above trusted that one alone.
        for host in vpc.hosts.values():
            served = (host.root / "etc/ssh/durastack_host_ed25519_key.pub").read_text().split()[:2]
            assert served and " ".join(served) not in booter.user_data[host.name]
            assert (host.root / "opt/host_key_after_boot").exists()

        # A cut tunnel: unrouted while down, routed again once it reconnects.
        host = vpc.hosts[list(vpc.hosts)[0]]
        routes = lambda: {u["replica_id"] for u in stack.routes().get("cloudsvc", {}).get("upstreams", [])}  # noqa
        before = routes()
        assert len(before) == 2
        vpc.cut(host)
        until(lambda: len(routes()) == 1, 60, 0.5, "the cut replica unrouted")
        vpc.heal(host)
        until(lambda: routes() == before, 90, 0.5, "the tunnel back and routed")

        # A container that exits: unrouted and replaced by a new submission.
        old = {g: (r["replica"], r["submission"]) for g, r in _replicas(stack).items()}
        victim = vpc.hosts[list(vpc.hosts)[0]]
        os.kill(victim.container_pid(), signal.SIGKILL)
        until(lambda: (lambda r: len(r) == 2 and {g: (x["replica"], x["submission"]) for g, x in r.items()} != old)(
            _replicas(stack)), 180, 0.5, "a replacement ready")
        assert set(_requests(stack, 6)) == {200}

        result = stack.cli("stop", "cloudsvc", "-y", timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
    finally:
        stack.stop()


def _live_instances(ec2) -> list[dict]:
    live = ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i for r in live["Reservations"] for i in r["Instances"]]


def _aws_network() -> None:
    """One group for the service's instances, admitting SSH and everything from itself."""
    ec2 = boto3.client("ec2", region_name="us-east-1")
    (group,) = [g for g in ec2.describe_security_groups()["SecurityGroups"] if g["GroupName"].startswith("durastack")]
    assert {(p["IpProtocol"], tuple(g["GroupId"] for g in p.get("UserIdGroupPairs", [])))
            for p in group["IpPermissions"]} == {("tcp", ()), ("-1", (group["GroupId"],))}


def _gcp_network(gce) -> None:
    """Two rules: SSH, and the service's tag to itself, which both groups' instances carry."""
    rules = gce.firewall_rules()
    (own,) = [r for r in rules if r.get("sourceTags")]
    assert len(rules) == 2 and own["sourceTags"] == own["targetTags"]
    assert all(own["targetTags"][0] in i["tags"]["items"] for i in gce.all_instances())


def test_aws_two_groups_from_the_cli(tmp_path, monkeypatch, fake_ec2, vpc):
    fake_ec2.seed_amis("us-east-1")
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n")
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        _scenario(stack, vpc, booter, _service(tmp_path, "aws", "A10G"),
                  {"llm": "g5.xlarge", "router": _cheapest_cpu("aws", "us-east-1")}, network=_aws_network)
    ec2 = boto3.client("ec2", region_name="us-east-1")
    assert _live_instances(ec2) == []
    groups = ec2.describe_security_groups()["SecurityGroups"]
    assert [g["GroupName"] for g in groups if g["GroupName"].startswith("durastack")] == []


def test_gcp_two_groups_from_the_cli(tmp_path, monkeypatch, gce, vpc):
    stack = _stack(tmp_path, monkeypatch, vpc, f"backends:\n  gcp:\n    project_id: proj\n"
                                               f"    regions: [us-central1]\n    endpoint: {gce.url}\n"
                                               f"    public_ip: false\n")
    with vpcs.Booter(vpc, lambda: vpcs.gce_instances(gce)) as booter:
        _scenario(stack, vpc, booter, _service(tmp_path, "gcp", "L4"),
                  {"llm": "g2-standard-4", "router": _cheapest_cpu("gcp", "us-central1")},
                  network=lambda: _gcp_network(gce))
    assert gce.all_instances() == [] and gce.firewall_rules() == []
    assert all(SECRET not in json.dumps(r) for r in gce.requests)


def _cheapest_cpu(backend: str, region: str) -> str:
    from backends.catalog import load_catalog
    from models.offers import match_offers
    from models.resources import ResourcesSpec

    found = match_offers([o for o in load_catalog() if o.backend == backend and o.region == region],
                         ResourcesSpec.model_validate({"cpu": 2, "memory": "8GB"}))
    return found[0].instance_type


SPOT_SERVICE = """\
type: service
name: spotsvc
port: 8000
backends: [aws]
spot_policy: spot
env:
  MODEL: tiny
resources:
  cpu: 2
  memory: 8GB
replicas: 1
commands:
  - |
{app}
"""


def test_aws_spot_interruption_is_replaced_and_named(tmp_path, monkeypatch, fake_ec2, vpc):
    """The cloud takes a spot instance back behind durastack's back (terminated in moto, powered off in the VPC):
    the monitor sees it, a replacement comes up on a new instance and serves through the gateway, and
    `durastack events` names the spot interruption."""
    fake_ec2.seed_amis("us-east-1")
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n")
    path = tmp_path / "spotsvc.yml"
    path.write_text(SPOT_SERVICE.format(app=textwrap.indent(APP, " " * 4)))
    ec2 = boto3.client("ec2", region_name="us-east-1")
    headers = lambda: {"Authorization": f"Bearer {stack.token()}"}  # noqa: E731

    def serving() -> list[dict]:
        return [r for g in stack.ps("spotsvc")["groups"] for r in g["replicas"]
                if r["status"] == "running" and r["ready"]]

    def instance_of(replica: dict) -> str:
        res = ec2.describe_instances(Filters=[
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
            {"Name": "tag:durastack:replica", "Values": [f"r{replica['replica']}-s{replica['submission']}"]},
            {"Name": "tag:durastack:service", "Values": ["spotsvc"]}])
        (found,) = [i for r in res["Reservations"] for i in r["Instances"]]
        assert found.get("InstanceLifecycle") == "spot", found
        return found["InstanceId"]

    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        try:
            _apply(stack, path)
            (first,) = until(lambda: serving() or None, 120, 0.5, "the spot replica ready")
            victim = instance_of(first)

            ec2.terminate_instances(InstanceIds=[victim])  # the spot market takes it back

            def replaced():
                now = serving()
                return now if now and (now[0]["replica"], now[0]["submission"]) != (
                    first["replica"], first["submission"]) else None

            try:
                (second,) = until(replaced, 180, 0.5, "a replacement ready")
            except AssertionError as e:
                raise AssertionError("\n".join([str(e), stack.cli("ps", "spotsvc", "-v").stdout,
                                                 f"booter: {booter.errors}", f"hosts: {list(vpc.hosts)}",
                                                 evidence(stack, "spotsvc")])) from None
            assert instance_of(second) != victim
            until(lambda: httpx.get(f"{stack.gateway}/services/spotsvc/", headers=headers(),
                                    timeout=10).status_code == 200, 60, 0.5, "the replacement serving")
            assert httpx.get(f"{stack.gateway}/services/spotsvc/", headers=headers(), timeout=10).text == "tiny 0"
            events = stack.cli("events", "spotsvc")
            assert events.returncode == 0, events.stderr
            assert "spot interruption" in events.stdout, events.stdout
            assert not booter.errors, booter.errors

            result = stack.cli("stop", "spotsvc", "-y", timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
        finally:
            stack.stop()
    assert _live_instances(ec2) == []


PRIVATE_SERVICE = """\
type: service
name: cloudsvc
port: 8000
backends: [aws]
env:
  HF_TOKEN: {secret}
  MODEL: tiny
groups:
  - name: router
    replicas: 1
    resources:
      cpu: 2
      memory: 8GB
    commands:
      - |
{app}
"""


def test_aws_private_data_path_from_the_cli(tmp_path, monkeypatch, fake_ec2, vpc):
    """`data_path: private`, the control plane inside the VPC (this machine linked into the simulated one): nginx
    connects to the replica's private address, with no tunnel; exec and logs still go over SSH; `stop` leaves no
    instance or security group. (A container that exits on this path: tests/test_cloud_private.py.)"""
    fake_ec2.seed_amis("us-east-1")
    source = vpc.link_machine()
    monkeypatch.setenv("DURASTACK_LOCAL_REPLICAS", "off")  # nginx in this machine's namespace, not the home's
    monkeypatch.setenv("DURASTACK_GATEWAY_UPSTREAM_NETS", "172.31.0.0/16")  # the VPC's range, as a cluster sets
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n"
                                               f"    data_path: private\n    gateway_cidrs: [{source}]\n",
                   inside=True)
    app = APP.replace('("127.0.0.1", int(os.environ["PORT"]))', '("0.0.0.0", int(os.environ["PORT"]))')
    service = tmp_path / "cloudsvc.yml"
    service.write_text(PRIVATE_SERVICE.format(secret=SECRET, app=textwrap.indent(app, " " * 10)))
    ec2 = boto3.client("ec2", region_name="us-east-1")
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        try:
            _apply(stack, service)
            replicas = until(lambda: (lambda r: r if len(r) == 1 else None)(_replicas(stack)), 120, 0.5, "ready")
            (router,) = replicas.values()
            (host,) = vpc.hosts.values()
            assert router["address"] == f"{host.address}:8000"  # the private address, no tunnel
            upstreams = stack.routes()["cloudsvc"]["upstreams"]
            assert [u["address"] for u in upstreams] == [f"{host.address}:8000"]
            assert not (stack.home / "tunnels").exists() or not any((stack.home / "tunnels").iterdir())
            assert set(_requests(stack, 10)) == {200}
            (group,) = [g for g in ec2.describe_security_groups()["SecurityGroups"]
                        if g["GroupName"].startswith("durastack")]
            port = [p for p in group["IpPermissions"] if p.get("FromPort") == 8000]
            assert [[r["CidrIp"] for r in p["IpRanges"]] for p in port] == [[source]]

            done = stack.cli("exec", "cloudsvc", "--replica", str(router["replica"]), "--", "sh", "-c", "echo $MODEL")
            assert done.returncode == 0 and done.stdout == "tiny\n", done.stdout + done.stderr
            logs = stack.cli("logs", "cloudsvc", "--replica", str(router["replica"]))
            assert logs.returncode == 0 and "request /" in logs.stdout


            result = stack.cli("stop", "cloudsvc", "-y", timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
        finally:
            stack.stop()
    assert not booter.errors, booter.errors
    assert _live_instances(ec2) == []
    groups = ec2.describe_security_groups()["SecurityGroups"]
    assert [g["GroupName"] for g in groups if g["GroupName"].startswith("durastack")] == []


def test_aws_public_path_from_the_cli(tmp_path, monkeypatch, fake_ec2, vpc):
    """The README's default: `public_ip: true`, no `gateway_cidrs`, the gateway on the internet. Its worker reaches
    instances only at their public addresses (a private one is not routed there, as on the internet), SSH is open
    to 0.0.0.0/0 (key-only, host key pinned) and nothing else from outside; the replica serves through its tunnel."""
    from backends.ssh import netns_socket_factory

    fake_ec2.seed_amis("us-east-1")
    monkeypatch.setenv("DURASTACK_SSH_NETNS", vpc.internet())
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n    ami_owners: [self]\n",
                   inside=True)
    service = tmp_path / "cloudsvc.yml"
    service.write_text(PRIVATE_SERVICE.format(secret=SECRET, app=textwrap.indent(APP, " " * 10)))
    ec2 = boto3.client("ec2", region_name="us-east-1")
    reach = netns_socket_factory(vpc.internet())
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        try:
            _apply(stack, service)
            until(lambda: len(_replicas(stack)) == 1, 120, 0.5, "ready over the public path")
            assert set(_requests(stack, 10)) == {200}
            (host,) = vpc.hosts.values()
            (raw,) = _live_instances(ec2)
            assert host.public == raw["PublicIpAddress"] and host.address == raw["PrivateIpAddress"]
            (group,) = [g for g in ec2.describe_security_groups()["SecurityGroups"]
                        if g["GroupName"].startswith("durastack")]
            outside = [(p.get("FromPort"), [r["CidrIp"] for r in p["IpRanges"]]) for p in group["IpPermissions"]
                       if p["IpRanges"]]
            assert outside == [(22, ["0.0.0.0/0"])]
            # The fake is the internet: the public address answers SSH, the private one is not even routed.
            asyncio.run(reach(host.public, 22)).close()
            with pytest.raises(OSError):
                asyncio.run(reach(host.address, 22)).close()
            result = stack.cli("stop", "cloudsvc", "-y", timeout=300)
            assert result.returncode == 0, result.stdout + result.stderr
        finally:
            stack.stop()
    assert not booter.errors, booter.errors
    assert _live_instances(ec2) == []


RESERVED_SERVICE = """\
type: service
name: reservedsvc
port: 8000
backends: [{backend}]
env:
  MODEL: tiny
groups:
  - name: llm
    replicas: 1
    reservation: {reservation}
    resources:
      gpu: {gpu}
    commands:
      - |
{app}
"""


def _reserved_scenario(tmp_path, stack: Stack, booter, backend: str, reservation: str, gpu: str) -> dict:
    """`apply -y` of a one-group service with ``reservation``: the plan names the reservation, the replica serves
    through the gateway; `stop` ends it. Returns the replica as `ps` showed it ready."""
    path = tmp_path / "reservedsvc.yml"
    path.write_text(RESERVED_SERVICE.format(backend=backend, reservation=reservation, gpu=gpu,
                                            app=textwrap.indent(APP, " " * 10)))
    try:
        stack.wait_up()
        applied = stack.cli("apply", "-f", str(path), "-y", timeout=600)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert f"in reservation {reservation}: " in applied.stdout, applied.stdout
        ready = lambda: [r for g in stack.ps("reservedsvc")["groups"] for r in g["replicas"]  # noqa: E731
                         if r["status"] == "running" and r["ready"]]
        try:
            (replica,) = until(ready, 120, 0.5, "the reserved replica ready")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{evidence(stack, 'reservedsvc')}") from None
        headers = {"Authorization": f"Bearer {stack.token()}"}
        assert httpx.get(f"{stack.gateway}/services/reservedsvc/", headers=headers, timeout=10).status_code == 200
        assert not booter.errors, booter.errors
        stopped = stack.cli("stop", "reservedsvc", "-y", timeout=300)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        return replica
    finally:
        stack.stop()


def test_aws_a_service_with_a_reservation_runs_in_it(tmp_path, monkeypatch, fake_ec2, vpc):
    fake_ec2.seed_amis("us-east-1")
    rid = fake_ec2.add_reservation("g5.xlarge", "us-east-1b")
    stack = _stack(tmp_path, monkeypatch, vpc, "backends:\n  aws:\n    regions: [us-east-1]\n"
                                               "    ami_owners: [self]\n    public_ip: false\n")
    ec2 = boto3.client("ec2", region_name="us-east-1")
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        replica = _reserved_scenario(tmp_path, stack, booter, "aws", rid, "A10G")
    assert replica["instance_type"] == "g5.xlarge"
    (instance,) = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    assert instance["CapacityReservationId"] == rid and instance["Placement"]["AvailabilityZone"] == "us-east-1b"
    assert instance["State"]["Name"] in ("shutting-down", "terminated")  # `stop` took it down
    (described,) = ec2.describe_capacity_reservations(CapacityReservationIds=[rid])["CapacityReservations"]
    assert described["AvailableInstanceCount"] == 1  # free again


def test_gcp_a_service_with_a_reservation_runs_in_it(tmp_path, monkeypatch, gce, vpc):
    gce.add_reservation("proj", "us-central1-c", "l4-pool", "g2-standard-4")
    stack = _stack(tmp_path, monkeypatch, vpc, f"backends:\n  gcp:\n    project_id: proj\n"
                                               f"    regions: [us-central1]\n    endpoint: {gce.url}\n"
                                               f"    public_ip: false\n")
    with vpcs.Booter(vpc, lambda: vpcs.gce_instances(gce)) as booter:
        replica = _reserved_scenario(tmp_path, stack, booter, "gcp", "l4-pool", "L4")
    assert replica["instance_type"] == "g2-standard-4"
    (insert,) = gce.inserts()
    assert "/zones/us-central1-c/" in insert["path"]
    assert insert["body"]["reservationAffinity"]["values"] == ["projects/proj/reservations/l4-pool"]
    assert gce.all_instances() == []  # `stop` deleted it
    assert gce.reservation("proj", "us-central1-c", "l4-pool")["specificReservation"]["inUseCount"] == "0"
