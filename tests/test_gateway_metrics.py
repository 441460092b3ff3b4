"""Gateway /metrics (Prometheus text) from real traffic through real nginx to real upstreams."""

import asyncio
import os

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.activator import Activator
from gateway.app import GatewayServer
from gateway.metrics import GatewayMetrics
from gateway.stats import StatsCollector
from models.gateway import GatewayState
from tests.conftest import eventually, upstreams_for as allowed
from tests.fakes.upstream import serve

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


class Replica:
    def __init__(self):
        self.hits = 0
        self.runner = None
        self.address = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        return web.Response(text="ok")

    async def start(self, unix_path: str | None = None) -> "Replica":
        self.runner, self.address = await serve(self.handle, unix_path)
        return self


@pytest.fixture
async def replicas(tmpdir_short):
    rs = [await Replica().start(os.path.join(tmpdir_short, "router.sock")), await Replica().start()]
    yield rs
    for r in rs:
        await r.runner.cleanup()


@pytest.fixture
async def gateway(tmpdir_short):
    gw = GatewayServer(os.path.join(tmpdir_short, "gw"), upstreams=allowed(tmpdir_short + "/gw"))
    await gw.start()
    yield gw
    await gw.stop()


async def scrape(gw: GatewayServer) -> dict[str, dict[tuple, float]]:
    """GET /metrics as a real scraper would: sample name → {sorted label items: value}."""
    async with httpx.AsyncClient() as h:
        resp = await h.get(f"{gw.control_url}/metrics", headers={"Authorization": f"Bearer {gw.control_token}"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def requests(metrics: dict, service: str) -> dict[tuple[str, str], float]:
    """(group, code) → requests_total of ``service``."""
    return {(dict(k)["group"], dict(k)["code"]): v
            for k, v in metrics.get("durastack_gateway_requests_total", {}).items() if dict(k)["service"] == service}


def sample(metrics: dict, name: str, **labels) -> float | None:
    return metrics.get(name, {}).get(tuple(sorted(labels.items())))


async def get(url: str, n: int, headers: dict | None = None) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as h:  # fresh connections: any nginx worker may answer
        return [(await h.get(url, headers=headers or {})).status_code for _ in range(n)]


async def test_requests_by_service_group_and_code(gateway, client, replicas):
    router, worker = replicas
    await client.put_service("svc")
    await client.register("svc", "svc/router/r0-s0", "router", router.address)
    await client.register("svc", "svc/worker/r1-s0", "worker", worker.address)
    await client.put_service("idle", cold_start_timeout=0)  # no replica, no hold: the activator answers 503
    auth = {"Authorization": f"Bearer {(await client.create_token('m')).token}"}
    url = f"{gateway.url}/services/svc/x"
    assert await get(url, 12, auth) == [200] * 12
    assert await get(url, 3) == [401] * 3
    assert await get(url, 2, {"Authorization": "Bearer wrong"}) == [403] * 2
    assert await get(f"{gateway.url}/services/idle/x", 2, auth) == [503] * 2
    assert await get(f"{gateway.url}/services/unknown/x", 1, auth) == [404]
    assert router.hits + worker.hits == 12

    # Each group counts what its replica served; rejections and the activator's answers have no group.
    expected = {("router", "200"): router.hits, ("worker", "200"): worker.hits, ("-", "401"): 3, ("-", "403"): 2}
    expected = {k: v for k, v in expected.items() if v}
    metrics = await eventually(lambda: _when(scrape(gateway), lambda m: requests(m, "svc") == expected
                                             and requests(m, "idle") == {("-", "503"): 2}))
    assert not requests(metrics, "unknown")
    # The latency histogram holds the requests that passed auth only: 12, not the 5 rejected.
    count = "durastack_gateway_request_duration_seconds_count"
    assert sample(metrics, count, service="svc") == 12 and sample(metrics, count, service="idle") == 2
    assert sample(metrics, "durastack_gateway_request_duration_seconds_bucket", service="svc", le="+Inf") == 12
    assert sample(metrics, "durastack_gateway_request_duration_seconds_sum", service="svc") < 12 * 5
    assert sample(metrics, "durastack_gateway_held_requests", service="svc") == 0
    # A second scrape counts nothing twice.
    again = await scrape(gateway)
    assert requests(again, "svc") == expected and sample(again, count, service="svc") == 12


async def test_held_requests_show_while_the_activator_holds_them(gateway, client, replicas):
    router, _ = replicas
    await client.put_service("cold", auth=False)
    async with httpx.AsyncClient(timeout=30) as h:
        held = [asyncio.create_task(h.get(f"{gateway.url}/services/cold/x")) for _ in range(3)]
        m = await eventually(lambda: _when(scrape(gateway), lambda m: sample(
            m, "durastack_gateway_held_requests", service="cold") == 3))
        assert sample(m, "durastack_gateway_activator_requests_total", service="cold") == 3
        await client.register("cold", "cold/router/r0-s0", "router", router.address)
        assert [r.status_code for r in await asyncio.wait_for(asyncio.gather(*held), 10)] == [200] * 3
    # nginx logs them once they completed; the activator forwarded them, so no group is known
    m = await eventually(lambda: _when(scrape(gateway), lambda m: requests(m, "cold") == {("-", "200"): 3}))
    assert sample(m, "durastack_gateway_held_requests", service="cold") == 0
    assert sample(m, "durastack_gateway_activator_requests_total", service="cold") == 3
    assert sample(m, "durastack_gateway_request_duration_seconds_count", service="cold") == 3
    # Deleted, the service leaves no series behind; applied again, it counts from zero.
    await client.delete_service("cold")
    m = await scrape(gateway)
    assert not requests(m, "cold"), m
    assert all(dict(labels).get("service") != "cold" for samples in m.values() for labels in samples), m
    await client.put_service("cold", auth=False)
    m = await scrape(gateway)
    assert sample(m, "durastack_gateway_activator_requests_total", service="cold") == 0
    assert sample(m, "durastack_gateway_request_duration_seconds_count", service="cold") is None


async def test_lines_of_an_earlier_gateway_process_are_not_counted_again():
    collector = StatsCollector()
    metrics = GatewayMetrics(Activator(GatewayState, collector), lambda: ["svc"], since=1000.0)
    batch = collector.feed(["999.500 1 200 0.100 svc -", "1000.500 1 200 0.100 svc -"], 1001.0)
    metrics.observe(batch, collector.group_of)
    text = metrics.exposition().decode()
    assert 'durastack_gateway_requests_total{code="200",group="-",service="svc"} 1.0' in text


async def _when(value, check):
    v = await value
    return v if check(v) else None
