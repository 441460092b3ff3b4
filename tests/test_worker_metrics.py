"""durastack's metrics on the worker's runtime: workflow gauges scraped from a Prometheus endpoint,
the provisioning-failure counter read from a metric buffer."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.runtime import MetricBuffer, PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.cloud import provision_cloud
from activities.metrics import PROVISIONING_FAILURES, provisioning_failed
from backends.cloud_errors import ErrorKind
from gateway.app import free_port
from models.loader import load_config_text
from models.messages import ScaleRequest
from models.state import ServiceState
from models.settings import SEARCH_ATTRIBUTES
from tests.conftest import DATA_CONVERTER, eventually, tool
from tests.fakes.cloud import fake_cloud_worker
from tests.test_cloud_walk import ANY, JOB, FakeBackend, err, ledger, offer  # noqa: F401 (ledger: a fixture)
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONFIG = """
type: service
name: svc-metrics
port: 8000
replicas:
  - count: 1
    commands: [python3 -m http.server 8000]
  - count: 0..3
    scaling: {metric: rps, target: 2}
    commands: [python3 -m http.server 8000]
"""


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def metrics_env():
    """A time-skipping test server whose client (so the worker too) runs on a runtime with a Prometheus endpoint."""
    port = free_port()
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{port}")))
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=tool("temporal-test-server"), data_converter=DATA_CONVERTER,
        runtime=runtime)
    await env.client.operator_service.add_search_attributes(AddSearchAttributesRequest(
        namespace=env.client.namespace,
        search_attributes={n: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for n in SEARCH_ATTRIBUTES}))
    env.metrics_url = f"http://127.0.0.1:{port}/metrics"
    yield env
    await env.shutdown()


@pytest.fixture
async def cloud(metrics_env):
    async for fake in fake_cloud_worker(metrics_env):
        yield fake


async def gauges(url: str, service: str) -> dict[tuple, float]:
    """(metric, group, state or None) → value, for the durastack gauges of ``service``."""
    async with httpx.AsyncClient() as h:
        text = (await h.get(url)).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("durastack_") and s.labels.get("service") == service:
                out[(s.name, s.labels["group"], s.labels.get("state"))] = s.value
    return out


def expect(group: str, desired: int, **states: int) -> dict[tuple, float]:
    counts = {s: states.get(s, 0) for s in ("submitted", "provisioning", "running", "terminating")}
    return {**{("durastack_replicas", group, s): n for s, n in counts.items()},
            ("durastack_replicas_ready", group, None): states.get("running", 0),
            ("durastack_desired_replicas", group, None): desired}


async def test_replica_gauges_follow_the_service(metrics_env, cloud):
    state = ServiceState(name="svc-metrics", config=load_config_text(CONFIG).config)
    handle = await metrics_env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=state), id=service_workflow_id("svc-metrics"),
        task_queue=cloud.queue)
    url = metrics_env.metrics_url

    async def seen(want):
        got = await gauges(url, "svc-metrics")
        return got if got == want else None

    await eventually(lambda: seen({**expect("0", 1, running=1), **expect("1", 0)}))
    assert await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=2)) == 2
    await eventually(lambda: seen({**expect("0", 1, running=1), **expect("1", 2, running=2)}))
    # Stopped: no live replica and nothing desired; no stale count is left behind.
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()
    await eventually(lambda: seen({**expect("0", 0), **expect("1", 0)}))


def counts(buffer: MetricBuffer) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = {}
    for u in buffer.retrieve_updates():
        if u.metric.name == PROVISIONING_FAILURES:
            key = (u.attributes["backend"], u.attributes["reason"])
            out[key] = out.get(key, 0) + u.value
    return out


async def test_provisioning_failures_are_counted_by_backend_and_reason(ledger):  # noqa: F811
    buffer = MetricBuffer(1000)
    env = ActivityEnvironment()
    env.metric_meter = Runtime(telemetry=TelemetryConfig(metrics=buffer)).metric_meter
    aws = FakeBackend("aws", ["us-east-1", "us-west-2"], {"a": err(ErrorKind.CAPACITY, "InsufficientInstanceCapacity"),
                                             "b": err(ErrorKind.QUOTA, "VcpuLimitExceeded")})
    gcp = FakeBackend("gcp", ["us-central1"], {"c": err(ErrorKind.CAPACITY, "ZONE_RESOURCE_POOL_EXHAUSTED")})
    offers = [offer("a", 1.0), offer("b", 2.0, spot=True), offer("c", 3.0, "gcp", "us-central1"),
              offer("d", 4.0, region="us-west-2")]

    async def walk():  # the walk runs in a worker thread, as in the provision activity
        return await asyncio.to_thread(provision_cloud, JOB, ANY, offers, backends={"aws": aws, "gcp": gcp},
                                       ledger=ledger)

    chosen, _ = await env.run(walk)
    assert chosen.instance_type == "d"
    assert counts(buffer) == {("aws", "capacity"): 1, ("aws", "quota"): 1, ("gcp", "capacity"): 1}
    provisioning_failed("aws", "capacity")  # outside an activity (the walker's unit tests): not counted, no error
    assert counts(buffer) == {}
