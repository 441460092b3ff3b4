"""Cloud replicas that really serve: the replica activities on moto's EC2 and on the fake Compute server, each
instance booted as a simulated host (tests/fakes/vpc.py) from the user data durastack gave it, reached over SSH
only: launched, routed at the tunnel's Unix socket, checked over SSH by the monitor, rerouted after a lost
tunnel, torn down.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from temporalio.exceptions import ApplicationError

from activities.replica import ReplicaActivities
from activities.replica_cloud import CloudReplicas
from backends.aws import AWSBackend
from backends.gcp import GCPBackend
from backends.runtime import runtime_of
from backends.ssh import SSHClient
from backends.ssh_keys import SSHKeys
from models.backends import AWSConfig, BackendsConfig, GCPConfig
from models.failures import retry_event
from models.offers import InstanceOffer
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.messages import LaunchInput, LaunchStep, MonitorInput, ReplicaInput, TeardownInput, Watched
from store import Store, StoreLedger
from tests.fakes import vpc as vpcs
from tests.fakes.activity_env import FakeClient, FakeGateway, activity_env
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from tests.test_ssh_path import APP, SECRET

pytestmark = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))

CPU = ResourcesSpec.model_validate({"cpu": "2..", "memory": "4GB.."})
AWS_M5 = InstanceOffer(backend="aws", instance_type="m5.large", region="us-east-1", zones=["us-east-1a"], cpus=2,
                       memory_gb=8.0, price=0.096)
GCP_N2 = InstanceOffer(backend="gcp", instance_type="n2-standard-2", region="us-central1", zones=["us-central1-a"],
                       cpus=2, memory_gb=8.0, price=0.097)


def job(replica: int = 0) -> JobSpec:
    return JobSpec(service="svc", group="web", replica_num=replica, submission_num=0, port=8000,
                   commands=[APP], env={"HF_TOKEN": SECRET, "MODEL": "tiny"}, secrets=["HF_TOKEN"])


@pytest_asyncio.fixture
async def vpc(tmp_path):
    v = vpcs.SimulatedVPC(tmp_path / "vpc")
    yield v
    await asyncio.to_thread(v.close)


@pytest.fixture
def ledger(tmp_path):
    return StoreLedger(Store(f"sqlite:///{tmp_path}/store.db"))


def _cloud(name, backend, config, ledger, vpc, home, poll_seconds=0.2) -> ReplicaActivities:
    keys = SSHKeys.of_home(home)  # the session's DURASTACK_SSH_DIR: the backends put its public half in user data
    gateway = FakeGateway()
    cloud = CloudReplicas(config, {name: backend}, ledger, catalog=[AWS_M5, GCP_N2], poll_seconds=poll_seconds,
                          boot_timeout=60, ssh=SSHClient.from_keys(keys, socket_factory=vpc.socket_factory),
                          ssh_keys=keys, home=home, gateway=gateway)
    return ReplicaActivities(None, gateway, cloud=cloud)


async def _get(address: str) -> httpx.Response:
    assert address.startswith("unix:")
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address[5:]), timeout=5) as c:
        return await c.get("http://replica/")


async def _until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _lifecycle(acts: ReplicaActivities, backend: str, vpc, booter) -> None:
    client, gateway = FakeClient(), acts.gateway
    inp = ReplicaInput(service_workflow_id="service/svc", job=job(), resources=CPU, backends=[backend])
    launched = await activity_env(client).run(acts.launch, LaunchInput(backend=backend, replica=inp))
    assert not booter.errors, booter.errors
    # The service's log says what the instance booted (a CPU offer: no driver), from its tags or labels.
    assert launched.instance.image and client.events() == [
        f"replica 0: {backend} {launched.instance.instance_id} booted image {launched.instance.image}"]
    address = launched.placement.address
    assert address.startswith("unix:") and "/tunnels/" in address  # the tunnel's local end, as nginx's upstream
    assert gateway.routed == {job().replica_id: address}
    response = await _get(address)
    assert response.status_code == 200 and response.text == f"tiny {len(SECRET)}"
    host = vpc.hosts[launched.instance.instance_id]
    # Nothing of the instance but SSH answers, even from inside its VPC.
    with pytest.raises(OSError):
        await asyncio.to_thread(vpc.connect, host.address, 8000, 2.0)

    # A lost tunnel: unrouted, reconnected, routed again at the same socket.
    cloud = acts.cloud
    cloud.tunnels[launched.instance.instance_id].connection.abort()
    await _until(lambda: [c[0] for c in gateway.calls][-2:] == ["unregister", "register"], what="rerouting")
    assert gateway.routed == {job().replica_id: address} and (await _get(address)).status_code == 200

    # A container that exits: the monitor sees it over SSH within seconds, and unroutes it.
    watched = [Watched(replica_num=0, submission_num=0, group="web", workflow_id="service/svc/web/r0-s0",
                       replica_id=job().replica_id, instance=launched.instance)]
    monitor = asyncio.ensure_future(activity_env(client).run(acts.monitor, MonitorInput(
        service="svc", backend=backend, replicas=watched, poll_seconds=0.5, workflow_check_seconds=60)))
    await asyncio.sleep(0.5)
    killed = time.monotonic()
    os.kill(host.container_pid(), signal.SIGKILL)
    down = await asyncio.wait_for(monitor, 20)
    assert [(d.replica_num, d.reason) for d in down] == [(0, "container exited (137)")]
    assert time.monotonic() - killed < 5 and gateway.routed == {}

    await activity_env(client).run(acts.teardown, TeardownInput(
        service_workflow_id="service/svc", job=job(), backend=backend, instance=launched.instance,
        reason="exited", drain_seconds=0))
    assert not Path(address[5:]).exists() and cloud.tunnels == {}


async def test_aws_replica_serves_over_ssh(fake_ec2, vpc, ledger, tmp_path):
    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    acts = _cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, tmp_path / "home")
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        await _lifecycle(acts, "aws", vpc, booter)


async def test_gcp_replica_serves_over_ssh(gce, vpc, ledger, tmp_path):
    config = GCPConfig(project_id="proj", regions=["us-central1"], endpoint=gce.url, public_ip=False)
    acts = _cloud("gcp", GCPBackend(config), BackendsConfig(gcp=config), ledger, vpc, tmp_path / "home")
    with vpcs.Booter(vpc, lambda: vpcs.gce_instances(gce)) as booter:
        await _lifecycle(acts, "gcp", vpc, booter)
    assert gce.firewall_rules() == []  # its last instance gone, the SSH rule went with it


async def test_a_command_that_exits_before_it_is_ready_fails_the_launch_at_once(fake_ec2, vpc, ledger, tmp_path):
    """As on the local backend: the launch watches the container it started while it waits for readiness, and
    fails with the container's exit and its last lines (the env's values masked), not after the launch's 30-minute
    timeout. The container is checked every few seconds, whatever the cloud API's (here hour-long) poll."""
    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    acts = _cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, tmp_path / "home",
                  poll_seconds=3600)
    broken = job().model_copy(update={
        "commands": ["echo starting", "sleep 1", "echo \"no model at $MODEL\"", "exit 3"],
        "env": {"HF_TOKEN": SECRET, "MODEL": "s3://secret-bucket/m"}})
    inp = ReplicaInput(service_workflow_id="service/svc", job=broken, resources=CPU, backends=["aws"])
    with vpcs.Booter(vpc, vpcs.moto_instances):
        with pytest.raises(ApplicationError) as e:
            await asyncio.wait_for(activity_env(FakeClient()).run(acts.launch, LaunchInput(backend="aws", replica=inp)),
                                   60)
    assert e.value.type == "ReplicaExited" and e.value.non_retryable
    assert e.value.message == "container exited (3); last output: starting | no model at ***"


async def test_a_retried_step_resumes_on_the_same_instance_with_one_pull(fake_ec2, vpc, ledger, tmp_path):
    """The launch in steps: place (instance, boot), start (pull, container), ready (tunnel, probes, route). A start
    retried after its container ran keeps it; the readiness step on another worker (no tunnel of its own, as after
    a worker restart) opens the tunnel and routes the replica. One instance, one pull, one container start; the
    pull's layers were told in the step's heartbeats (what `ps -v` and the Web UI show)."""
    import boto3

    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    home = tmp_path / "home"
    first, second = (_cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, home) for _ in "12")
    client = FakeClient()
    inp = ReplicaInput(service_workflow_id="service/svc", job=job(), resources=CPU, backends=["aws"])
    said: list = []
    env = activity_env(client)
    env.on_heartbeat = lambda *details: said.extend(details)
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        placed = await env.run(first.place, LaunchInput(backend="aws", replica=inp))
        step = LaunchStep(replica=inp, backend="aws", launched=placed)
        started = await env.run(first.start, step)
        host = vpc.hosts[placed.instance.instance_id]
        container = host.container_pid()
        assert (await env.run(first.start, step)) == started  # a retry: the container goes on
        assert host.container_pid() == container
        assert first.cloud.tunnels == {}  # the readiness step opens it, wherever it runs
        await env.run(second.ready, step.model_copy(update={"launched": started}))
        assert not booter.errors, booter.errors
    image = runtime_of(job()).image
    assert (host.root / "containers" / "pulls").read_text().splitlines() == [image]
    assert f"{placed.instance.instance_id}: pulling {image}: 3/3 layers" in said
    assert second.gateway.routed == {job().replica_id: started.placement.address}
    assert (await _get(started.placement.address)).status_code == 200
    running = [i for r in boto3.client("ec2", region_name="us-east-1").describe_instances()["Reservations"]
               for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    assert len(running) == 1
    await env.run(second.teardown, TeardownInput(service_workflow_id="service/svc", job=job(), backend="aws",
                                                 instance=started.instance, reason="done", drain_seconds=0))


async def test_an_image_docker_refuses_fails_the_start_step_with_dockers_words(fake_ec2, vpc, ledger, tmp_path):
    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    acts = _cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, tmp_path / "home")
    inp = ReplicaInput(service_workflow_id="service/svc", job=job().model_copy(update={"image": "Example/LLM:latest"}),
                       resources=CPU, backends=["aws"])
    env = activity_env(FakeClient())
    with vpcs.Booter(vpc, vpcs.moto_instances):
        placed = await env.run(acts.place, LaunchInput(backend="aws", replica=inp))
        with pytest.raises(ApplicationError) as refused:
            await env.run(acts.start, LaunchStep(replica=inp, backend="aws", launched=placed))
    assert "docker pull Example/LLM:latest failed (1): invalid reference format" in refused.value.message
    await env.run(acts.teardown, TeardownInput(service_workflow_id="service/svc", job=inp.job, backend="aws",
                                               instance=placed.instance, reason="done", drain_seconds=0))


async def test_a_spot_interruption_is_named_as_such(fake_ec2, vpc, ledger, tmp_path):
    import boto3

    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    acts = _cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, tmp_path / "home")
    acts.cloud._catalog = [AWS_M5.model_copy(update={"spot": True, "price": 0.03})]
    client = FakeClient()
    inp = ReplicaInput(service_workflow_id="service/svc", job=job(), resources=CPU, backends=["aws"],
                       spot_policy="spot")
    with vpcs.Booter(vpc, vpcs.moto_instances):
        launched = await activity_env(client).run(acts.launch, LaunchInput(backend="aws", replica=inp))
    assert launched.instance.spot
    watched = [Watched(replica_num=0, submission_num=0, group="web", workflow_id="service/svc/web/r0-s0",
                       replica_id=job().replica_id, instance=launched.instance)]
    monitor = asyncio.ensure_future(activity_env(client).run(acts.monitor, MonitorInput(
        service="svc", backend="aws", replicas=watched, poll_seconds=0.2, workflow_check_seconds=60)))
    await asyncio.sleep(0.3)
    boto3.client("ec2", region_name="us-east-1").terminate_instances(InstanceIds=[launched.instance.instance_id])
    down = await asyncio.wait_for(monitor, 20)
    assert [d.reason for d in down] == ["spot interruption (instance terminated)"]
    assert retry_event(down[0].reason) == "interruption"  # what `retry.on_events` calls it
    await activity_env(client).run(acts.teardown, TeardownInput(
        service_workflow_id="service/svc", job=job(), backend="aws", instance=launched.instance,
        reason=down[0].reason, drain_seconds=0))


PEER_APP = """cat > peer.py <<'PY'
import http.server, os, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ.get("DURASTACK_REPLICA_IP", "-").encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
side = http.server.HTTPServer(("0.0.0.0", 9100), H)  # a port of its own, not the service's
threading.Thread(target=side.serve_forever, daemon=True).start()
http.server.HTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
PY
exec python3 peer.py"""


async def test_replicas_of_a_service_reach_each_other_at_their_private_ips(fake_ec2, vpc, ledger, tmp_path):
    """PD disaggregation: a router and its workers reach each other at their private addresses on any port.
    The container is on the instance's network (no published port), knows its own private address, and the
    gateway still reaches the service's port through the SSH tunnel."""
    fake_ec2.seed_amis("us-east-1")
    config = AWSConfig(regions=["us-east-1"], ami_owners=["self"], public_ip=False)
    acts = _cloud("aws", AWSBackend(config), BackendsConfig(aws=config), ledger, vpc, tmp_path / "home")
    client = FakeClient()
    launched = []
    with vpcs.Booter(vpc, vpcs.moto_instances) as booter:
        for n in (0, 1):
            inp = ReplicaInput(service_workflow_id="service/svc",
                               job=job(n).model_copy(update={"commands": [PEER_APP]}), resources=CPU,
                               backends=["aws"])
            launched.append(await activity_env(client).run(acts.launch, LaunchInput(backend="aws", replica=inp)))
        assert not booter.errors, booter.errors
    ips = [out.placement.ip for out in launched]
    assert all(ips) and ips[0] != ips[1]
    assert ips == [out.instance.private_ip for out in launched]  # what ${{ …IP_ADDRESS }} resolves to
    for out, ip in zip(launched, ips):
        host = vpc.hosts[out.instance.instance_id]
        spec = json.loads((host.root / "containers" / "durastack-job" / "spec.json").read_text())
        assert "--network=host" in spec["flags"] and "-p" not in spec["opts"], spec
        assert spec["env"]["DURASTACK_REPLICA_IP"] == ip
        response = await _get(out.placement.address)  # the tunnel to 127.0.0.1:<port> on the instance
        assert response.status_code == 200 and response.text == ip

    def fetch(from_host, url: str) -> str:
        return subprocess.run(
            ["ip", "netns", "exec", from_host.netns, sys.executable, "-c",
             f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=5).read().decode())"],
            capture_output=True, text=True, timeout=30, check=True).stdout.strip()

    first, second = (vpc.hosts[out.instance.instance_id] for out in launched)
    assert await asyncio.to_thread(fetch, first, f"http://{ips[1]}:9100/") == ips[1]
    assert await asyncio.to_thread(fetch, second, f"http://{ips[0]}:9100/") == ips[0]
    assert await asyncio.to_thread(fetch, second, f"http://{ips[0]}:8000/") == ips[0]
    for n, out in enumerate(launched):
        await activity_env(client).run(acts.teardown, TeardownInput(
            service_workflow_id="service/svc", job=job(n), backend="aws", instance=out.instance,
            reason="done", drain_seconds=0))
