"""A route's own settings on a real nginx: rate limits (429 past the burst, per key), strip_prefix both ways,
and handing the client's Authorization header to the replica only when the route says so."""

import asyncio
import os

import httpx
import pytest
from aiohttp import web
from temporalio.exceptions import ApplicationError

from activities.replica import ReplicaActivities
from gateway.app import GatewayServer
from gateway.client import GatewayClient
from models.gateway import RouteRateLimit
from models.loader import load_config_text
from models.messages import RouteInput
from models.state import ServiceState
from tests.conftest import eventually, upstreams_for as allowed
from tests.fakes.upstream import serve
from rules import lifecycle

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture
async def upstream(tmpdir_short):
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"path": request.rel_url.raw_path_qs,
                                  "authorization": request.headers.get("Authorization"),
                                  "prefix": request.headers.get("X-Forwarded-Prefix")})

    runner, address = await serve(echo, os.path.join(tmpdir_short, "up.sock"))
    yield address
    await runner.cleanup()


@pytest.fixture
async def gateway(tmpdir_short):
    runtime = os.path.join(tmpdir_short, "gw")
    gw = GatewayServer(runtime, upstreams=allowed(runtime))
    await gw.start()
    yield gw
    await gw.stop()


async def route(client: GatewayClient, upstream: str | None, name: str = "svc", **kw) -> None:
    await client.put_service(name, **kw)
    if upstream:
        await client.register(name, f"{name}/0/r0-s0", "0", upstream)


async def get(gw: GatewayServer, path: str, headers: dict | None = None, host: str | None = None) -> httpx.Response:
    # A fresh connection each time: a pooled one could sit on an nginx worker of an older configuration.
    headers = {**(headers or {}), **({"Host": host} if host else {})}
    async with httpx.AsyncClient(timeout=10) as h:
        return await h.get(f"{gw.url}{path}", headers=headers)


async def test_past_the_burst_one_key_gets_429_while_another_passes(gateway, client, upstream):
    # One request a minute: within the test only the burst refills nothing, so the counts are exact.
    limits = [RouteRateLimit(prefix="/v1", key="header", header="X-Key", rps=1 / 60, burst=2),
              RouteRateLimit(prefix="/ip", rps=1 / 60, burst=1)]
    await route(client, upstream, auth=False, rate_limits=limits)
    codes = [(await get(gateway, "/services/svc/v1/chat", {"X-Key": "a"})).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]  # the rate's one plus a burst of two, then refused at once
    assert (await get(gateway, "/services/svc/v1/chat", {"X-Key": "b"})).status_code == 200  # another key
    assert (await get(gateway, "/services/svc/other")).status_code == 200  # outside every prefix
    # Per client address: everything here comes from 127.0.0.1, one key.
    assert [(await get(gateway, "/services/svc/ip/x")).status_code for _ in range(3)] == [200, 200, 429]
    # The same limits on the <name>.localhost server, which counts in the same zone.
    assert (await get(gateway, "/v1/chat", {"X-Key": "a"}, host="svc.localhost")).status_code == 429
    assert (await get(gateway, "/v1/chat", {"X-Key": "c"}, host="svc.localhost")).status_code == 200

    # Lifted by a new put: the route has no limit any more.
    await route(client, None, auth=False)
    assert (await get(gateway, "/services/svc/v1/chat", {"X-Key": "a"})).status_code == 200


@pytest.mark.parametrize("strip", [True, False])
async def test_strip_prefix_both_ways(gateway, client, upstream, strip):
    await route(client, upstream, auth=False, strip_prefix=strip,
                rate_limits=[RouteRateLimit(prefix="/v1", rps=1000, burst=100)])
    kept = "" if strip else "/services/svc"
    for path in ("/a/b?q=1", "/v1/chat?x=%2F", "/"):
        seen = (await get(gateway, f"/services/svc{path}")).json()
        assert seen["path"] == kept + path
        assert seen["prefix"] == ("/services/svc" if strip else None)  # nginx sends no empty header
    # By host name there is no prefix to strip.
    assert (await get(gateway, "/v1/chat", host="svc.localhost")).json()["path"] == "/v1/chat"


@pytest.mark.parametrize("strip", [True, False])
async def test_strip_prefix_through_the_activator(gateway, client, upstream, strip):
    await route(client, None, auth=False, strip_prefix=strip, cold_start_timeout=30)
    held = asyncio.create_task(get(gateway, "/services/svc/v1/x?y=1"))

    async def holding():
        return (await client.stats()).services["svc"].held >= 1
    await eventually(holding)  # the activator holds it until a replica registers
    await client.register("svc", "svc/0/r0-s0", "0", upstream)
    answer = await held
    assert answer.status_code == 200
    assert answer.json()["path"] == ("" if strip else "/services/svc") + "/v1/x?y=1"


@pytest.mark.parametrize("passed", [True, False])
async def test_the_authorization_header_reaches_the_replica_only_when_the_route_says_so(gateway, client, upstream,
                                                                                          passed):
    token = (await client.create_token("t")).token
    await route(client, upstream, auth=True, pass_authorization=passed)
    seen = (await get(gateway, "/services/svc/x", {"Authorization": f"Bearer {token}"})).json()
    assert seen["authorization"] == (f"Bearer {token}" if passed else None)
    assert (await get(gateway, "/services/svc/x")).status_code == 401  # auth still checked either way


async def test_from_the_service_file_to_nginx(gateway, client, upstream):
    """The whole way: a service file, the route the workflow asks for (lifecycle.route), the ensure_route
    activity, the control API, nginx."""
    text = ("type: service\nname: svc\nport: 8000\nreplicas: 1\ncommands: [serve]\nauth: false\n"
            "strip_prefix: false\nrate_limits:\n  - {prefix: /v1, key: {type: header, header: X-Key}, rps: 0.1}\n")
    state = ServiceState(name="svc", config=load_config_text(text).config)
    await ReplicaActivities(None, client).ensure_route(lifecycle.route(state))
    await client.register("svc", "svc/0/r0-s0", "0", upstream)
    first = await get(gateway, "/services/svc/v1/a", {"X-Key": "k"})
    assert first.status_code == 200 and first.json()["path"] == "/services/svc/v1/a"
    assert (await get(gateway, "/services/svc/v1/a", {"X-Key": "k"})).status_code == 429


async def test_nginx_takes_the_extreme_values_validation_allows(gateway, client, upstream):
    limits = [RouteRateLimit(prefix="/", rps=1_000_000, burst=1_000_000),
              RouteRateLimit(prefix="/a", rps=1 / 60, burst=0),
              RouteRateLimit(prefix="/b.c~d%20e!f&g(h)*+,=:@-/", key="header", header="X_Weird-Name", rps=2.5)]
    await route(client, upstream, auth=False, rate_limits=limits)  # a refused configuration would answer 503
    assert (await get(gateway, "/services/svc/x")).status_code == 200


async def test_a_limit_can_change_its_key_rate_and_prefix(gateway, client, upstream):
    # nginx refuses a reload in which a zone keeps its name but changes its key: each key has a zone of its own.
    first = [RouteRateLimit(prefix="/v1", rps=1 / 60), RouteRateLimit(prefix="/v2", key="header", header="A", rps=1)]
    await route(client, upstream, auth=False, rate_limits=first)
    assert [(await get(gateway, "/services/svc/v1/x")).status_code for _ in range(2)] == [200, 429]
    changed = [RouteRateLimit(prefix="/v1", key="header", header="B", rps=1 / 60),
               RouteRateLimit(prefix="/v2", rps=2)]
    await route(client, None, auth=False, rate_limits=changed)
    assert (await get(gateway, "/services/svc/v1/x")).status_code == 200  # no header B: not limited
    assert [(await get(gateway, "/services/svc/v1/x", {"B": "k"})).status_code for _ in range(2)] == [200, 429]
    await route(client, None, auth=False, rate_limits=changed[1:])
    assert (await get(gateway, "/services/svc/v1/x", {"B": "k"})).status_code == 200


async def test_a_route_the_gateway_refuses_is_not_retried(gateway, client):
    with pytest.raises(ApplicationError) as info:
        await ReplicaActivities(None, client).ensure_route(RouteInput(service="Not_A_Name"))
    assert info.value.non_retryable and info.value.type == "RouteRefused" and "gateway answered 4" in str(info.value)
