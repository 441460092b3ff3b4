"""Gateway end to end: control app + real nginx + real upstream HTTP servers (unix socket and TCP)."""

import asyncio
import inspect
import json
import os
import signal
import sys
import time

import aiohttp
import httpx
import pytest
from aiohttp import web

from gateway.app import GatewayServer
from tests.conftest import upstreams_for as allowed
from tests.fakes.upstream import serve
from gateway.client import GatewayClient, GatewayError
from gateway.nginx import fetch_generation

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


class Replica:
    """A tiny upstream: counts what reaches it; /stream streams, /ws echoes."""

    def __init__(self, name: str):
        self.name = name
        self.hits: list[tuple[str, str, dict]] = []
        self.release = asyncio.Event()
        self.stream_done = False
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append((request.path, request.query_string, dict(request.headers)))
        if request.path == "/ws":
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            async for msg in ws:
                await ws.send_str(f"{self.name}:{msg.data}")
            return ws
        if request.path == "/stream":
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"first\n")
            await asyncio.wait_for(self.release.wait(), 10)  # the test reads "first" before releasing
            await resp.write(b"second\n")
            self.stream_done = True
            await resp.write_eof()
            return resp
        return web.Response(text=f"{self.name} {request.path} {request.query_string}")

    async def start(self, unix_path: str | None = None) -> "Replica":
        self.runner, self.address = await serve(self.handle, unix_path)
        return self

    def paths(self) -> list[str]:
        return [h[0] for h in self.hits]


@pytest.fixture
async def replicas(tmpdir_short):
    a = await Replica("A").start(os.path.join(tmpdir_short, "a.sock"))
    b = await Replica("B").start()
    yield a, b
    for r in (a, b):
        r.release.set()
        await r.runner.cleanup()


async def started(runtime_dir: str, **kw) -> GatewayServer:
    gw = GatewayServer(runtime_dir, upstreams=allowed(runtime_dir), **kw)
    await gw.start()
    return gw


@pytest.fixture
async def gateway(tmpdir_short):
    gw = await started(os.path.join(tmpdir_short, "gw"))
    pid = gw._nginx.pid
    yield gw
    await gw.stop()
    assert not os.path.exists(f"/proc/{pid}")  # ended and reaped


async def bearer(client: GatewayClient, name: str = "test") -> dict[str, str]:
    """The header of a new gateway token, made by the control API (which keeps only its hash)."""
    return {"Authorization": f"Bearer {(await client.create_token(name)).token}"}


@pytest.fixture
async def auth(client) -> dict[str, str]:
    return await bearer(client)


async def serve_two(client, replicas, service="svc", auth=True):
    await client.put_service(service, auth=auth)
    for i, r in enumerate(replicas):
        await client.register(service, f"{service}/{i}/r{i}-s0", str(i), r.address)


async def burst(url: str, n: int, headers: dict, **kw) -> list[httpx.Response]:
    # Fresh client: pooled connections must not hide which nginx worker answers.
    async with httpx.AsyncClient(timeout=10) as h:
        return [await h.get(url, headers=headers, **kw) for _ in range(n)]


async def poll(cond, timeout: float = 10.0, interval: float = 0.05):
    """Bounded wait for ``cond()`` (sync or async) to be truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval)


async def test_path_and_host_routes_reach_both_replicas(gateway, client, replicas, auth):
    a, b = replicas
    await serve_two(client, replicas)
    resps = await burst(f"{gateway.url}/services/svc/x?q=1", 12, auth)
    assert all(r.status_code == 200 for r in resps)
    assert a.paths() and b.paths() and set(a.paths() + b.paths()) == {"/x"}  # prefix stripped
    assert {h[1] for h in a.hits + b.hits} == {"q=1"}
    assert a.hits[0][2]["X-Forwarded-Prefix"] == "/services/svc"
    a.hits.clear(), b.hits.clear()
    resps = await burst(f"{gateway.url}/y", 12, headers={**auth, "Host": "svc.localhost:9999"})
    assert all(r.status_code == 200 for r in resps)
    assert a.paths() and b.paths() and set(a.paths() + b.paths()) == {"/y"}
    # a second token works too; unknown services are 404
    assert (await burst(f"{gateway.url}/services/svc/z", 1, await bearer(client, "other")))[0].status_code == 200
    assert (await burst(f"{gateway.url}/services/nope/z", 1, auth))[0].status_code == 404
    assert (await burst(f"{gateway.url}/z", 1, {"Host": "nope.localhost"}))[0].status_code == 404


async def test_auth_rejections_never_reach_replicas(gateway, client, replicas, auth):
    a, b = replicas
    await serve_two(client, replicas)
    for url, extra in ((f"{gateway.url}/services/svc/x", {}), (f"{gateway.url}/x", {"Host": "svc.localhost"})):
        missing = (await burst(url, 3, headers={**extra, "X": "1"}))
        wrong = (await burst(url, 3, headers={**extra, "Authorization": "Bearer nope"}))
        basic = (await burst(url, 1, headers={**extra, "Authorization": "Basic dG9rLTEyMw=="}))
        assert {r.status_code for r in missing} == {401} and "Bearer" in missing[0].headers["www-authenticate"]
        assert {r.status_code for r in wrong + basic} == {403}
    assert a.hits == [] and b.hits == []


async def test_the_gateway_token_never_reaches_a_replica_unless_the_route_asks(gateway, client, replicas, auth):
    """The gateway token opens every service: nginx drops it before the replica, on both routings and through
    the activator; a route with pass_authorization gets it, and a route without auth gets the client's own."""
    a, b = replicas

    def seen() -> list:
        got = [h[2].get("Authorization") for h in a.hits + b.hits]
        a.hits.clear(), b.hits.clear()
        return got

    await serve_two(client, replicas)
    await burst(f"{gateway.url}/services/svc/x", 4, auth)
    await burst(f"{gateway.url}/x", 4, {**auth, "Host": "svc.localhost"})
    assert seen() == [None] * 8
    await client.put_service("cold", cold_start_timeout=30)  # through the activator
    held = asyncio.create_task(burst(f"{gateway.url}/services/cold/x", 1, auth))
    await poll(lambda: _held(client, "cold"))
    await client.register("cold", "cold/0/r0-s0", "0", a.address)
    assert [r.status_code for r in await held] == [200] and seen() == [None]

    await client.put_service("svc", pass_authorization=True)  # the route asks for it
    assert (await client.services()).services["svc"].pass_authorization
    await burst(f"{gateway.url}/services/svc/x", 2, auth)
    assert seen() == [auth["Authorization"]] * 2
    await client.put_service("svc")  # and by default, again not
    await burst(f"{gateway.url}/services/svc/x", 2, auth)
    assert seen() == [None] * 2
    await serve_two(client, replicas, service="open", auth=False)  # no gateway auth: the header is the client's
    await burst(f"{gateway.url}/services/open/x", 2, {"Authorization": "Basic b3duOmNyZWQ="})
    assert seen() == ["Basic b3duOmNyZWQ="] * 2


async def _held(client, service: str) -> bool:
    return (await client.stats()).services[service].held == 1


async def test_auth_false_serves_without_token(gateway, client, replicas):
    await serve_two(client, replicas, service="open", auth=False)
    resps = await burst(f"{gateway.url}/services/open/x", 4, headers={"X": "no auth"})
    assert {r.status_code for r in resps} == {200}


async def test_unregister_stops_traffic_once_the_call_returns(gateway, client, replicas, auth):
    a, b = replicas
    await serve_two(client, replicas)
    await burst(f"{gateway.url}/services/svc/x", 6, auth)
    assert b.hits
    await client.unregister("svc", "svc/1/r1-s0")
    before = len(b.hits)
    resps = await burst(f"{gateway.url}/services/svc/x", 40, auth)
    assert {r.status_code for r in resps} == {200}
    assert len(b.hits) == before and len(a.paths()) >= 40
    # idempotent: again, an unknown replica, an unknown service, a repeated registration
    gen = (await client.services()).generation
    await client.unregister("svc", "svc/1/r1-s0")
    await client.unregister("nope", "x/0/r0-s0")
    await client.register("svc", "svc/0/r0-s0", "0", a.address)
    assert (await client.services()).generation == gen


async def test_streaming_response_arrives_incrementally(gateway, client, replicas, auth):
    a, b = replicas
    await client.put_service("st")
    await client.register("st", "st/0/r0-s0", "0", a.address)
    async with httpx.AsyncClient(timeout=10) as h:
        async with h.stream("GET", f"{gateway.url}/services/st/stream", headers=auth) as resp:
            chunks = resp.aiter_raw()
            first = await asyncio.wait_for(chunks.__anext__(), 5)
            assert first == b"first\n" and not a.stream_done  # the upstream has not finished yet
            a.release.set()
            rest = b"".join([c async for c in chunks])
    assert rest == b"second\n" and a.stream_done


async def test_websocket_echo_passes_through(gateway, client, replicas, auth):
    await serve_two(client, replicas)
    async with aiohttp.ClientSession() as s:
        for url, headers in ((f"{gateway.url}/services/svc/ws", auth), (f"{gateway.url}/ws", {**auth, "Host": "svc.localhost"})):
            async with s.ws_connect(url, headers=headers, timeout=aiohttp.ClientWSTimeout(ws_close=5)) as ws:
                await ws.send_str("hello")
                msg = await asyncio.wait_for(ws.receive(), 5)
                assert msg.type == aiohttp.WSMsgType.TEXT and msg.data.endswith(":hello")


async def test_stats_count_hits_not_rejections(gateway, client, replicas, auth):
    await serve_two(client, replicas)
    await client.put_service("idle", cold_start_timeout=0)  # no replica, no hold: 503s count
    await burst(f"{gateway.url}/services/svc/x", 7, auth)
    await burst(f"{gateway.url}/services/svc/x", 3, headers={"X": "1"})  # 401
    await burst(f"{gateway.url}/services/svc/x", 2, headers={"Authorization": "Bearer bad"})  # 403
    idle = await burst(f"{gateway.url}/services/idle/x", 2, auth)
    assert {r.status_code for r in idle} == {503} and idle[0].headers["retry-after"] == "5"
    await burst(f"{gateway.url}/services/unknown/x", 2, auth)  # 404, counted nowhere

    async def counted():
        report = (await client.stats()).model_dump(mode="json")
        svc, idle_ = report["services"]["svc"], report["services"]["idle"]
        return report if (svc["windows"]["30"]["requests"], idle_["windows"]["300"]["requests"]) == (7, 2) else None

    report = await poll(counted)
    assert report, (await client.stats())
    stats = await client.stats()
    assert set(stats.services) == {"svc", "idle"}
    svc = stats.services["svc"]
    assert {w: v.requests for w, v in svc.windows.items()} == {30: 7, 60: 7, 300: 7}
    assert sum(g[30].requests for g in svc.per_group.values()) == 7 and set(svc.per_group) <= {"0", "1"}
    assert stats.services["idle"].per_group is None


async def test_concurrent_changes_are_serialized_and_coalesced(gateway, client, replicas):
    a, _ = replicas
    await client.put_service("many")
    gen, reloads = (await client.services()).generation, gateway.reloads
    await asyncio.gather(*(client.register("many", f"many/0/r{i}-s0", "0", a.address) for i in range(10)))
    state = await client.services()
    assert len(state.services["many"].upstreams) == 10 and state.generation == gen + 10
    assert gateway.reloads - reloads < 10
    assert await fetch_generation(gateway.listen_port) == state.generation


async def test_client_errors(gateway, client):
    with pytest.raises(GatewayError) as e:
        await client.register("ghost", "ghost/0/r0-s0", "0", "127.0.0.1:1")
    assert e.value.status == 404
    await client.put_service("svc")
    for args in (("svc", "svc/0/r0-s0", "0", "localhost:80"), ("svc", "bad id!", "0", "127.0.0.1:1")):
        with pytest.raises(GatewayError) as e:
            await client.register(*args)
        assert e.value.status == 400
    with pytest.raises(GatewayError) as e:
        await client.put_service("Bad_Name")
    assert e.value.status == 400
    async with httpx.AsyncClient() as h:
        assert (await h.get(f"{gateway.url}/healthz")).json()["status"] == "ok"


async def test_restart_restores_routes(tmpdir_short, replicas):
    a, _ = replicas
    runtime = os.path.join(tmpdir_short, "gw-restart")
    gw = await started(runtime)
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            await c.put_service("svc")
            auth = await bearer(c)
            await c.register("svc", "svc/0/r0-s0", "0", a.address)
        gen, port, pid = gw.state.generation, gw.listen_port, gw._nginx.pid
    finally:
        await gw.stop()
    assert not os.path.exists(f"/proc/{pid}")
    gw = await started(runtime, listen_port=port)
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            state = await c.services()
        assert state.generation == gen and [u.address for u in state.services["svc"].upstreams] == [a.address]
        resps = await burst(f"{gw.url}/services/svc/after-restart", 2, auth)
        assert {r.status_code for r in resps} == {200} and "/after-restart" in a.paths()
        assert (await burst(f"{gw.url}/services/svc/x", 1, {"X": "1"}))[0].status_code == 401  # tokens restored too
    finally:
        await gw.stop()


async def test_access_log_rotation_keeps_counting(tmpdir_short, replicas):
    a, _ = replicas
    gw = await started(os.path.join(tmpdir_short, "gw-rot"), rotate_bytes=1, tick=0.05)
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            await c.put_service("svc", auth=False)
            await c.register("svc", "svc/0/r0-s0", "0", a.address)
            await burst(f"{gw.url}/services/svc/x", 3, {})
            assert await poll(gw.access_log.with_name("access.log.1").exists)
            await burst(f"{gw.url}/services/svc/x", 4, {})  # nginx reopened its log: a new file

            async def seven():
                return (await c.stats()).services["svc"].windows[60].requests == 7
            assert await poll(seven)
            # rotate_bytes=1 rotates again at every tick with new lines: the file comes back once nginx reopens.
            assert await poll(gw.access_log.exists)
    finally:
        await gw.stop()


async def test_python_m_gateway_runs_until_sigterm(tmpdir_short):
    runtime = os.path.join(tmpdir_short, "gw-proc")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "--runtime-dir", runtime,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    try:
        endpoints = os.path.join(runtime, "endpoints.json")
        assert await poll(lambda: os.path.exists(endpoints), timeout=20)
        info = json.loads(open(endpoints).read())
        async with httpx.AsyncClient() as h:
            assert (await h.get(f"http://127.0.0.1:{info['listen_port']}/healthz")).json()["status"] == "ok"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        assert await poll(lambda: not os.path.exists(f"/proc/{info['nginx_pid']}"))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()



async def test_drained_waits_for_in_flight_requests_on_old_workers(tmp_path):
    """After an unregister, /api/drained stays false while a request to the removed replica runs."""
    arrived, release = asyncio.Event(), asyncio.Event()

    async def slow(request):
        arrived.set()
        await release.wait()
        return web.Response(text="done")

    runner, address = await serve(slow, str(tmp_path / "slow.sock"))
    gw = GatewayServer(tmp_path / "gw", upstreams=allowed(tmp_path / "gw"))
    await gw.start()
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as client, httpx.AsyncClient(timeout=30) as http:
            await client.put_service("svc", auth=False)
            await client.register("svc", "svc/0/r0-s0", "0", address)
            in_flight = asyncio.create_task(http.get(f"{gw.url}/services/svc/x"))
            await asyncio.wait_for(arrived.wait(), 10)
            await client.unregister("svc", "svc/0/r0-s0")
            assert await client.drained() is False  # an old worker still serves the slow request
            release.set()
            assert (await in_flight).text == "done"
            deadline = time.monotonic() + 15
            while not await client.drained():
                assert time.monotonic() < deadline, "old nginx workers never finished"
                await asyncio.sleep(0.05)
    finally:
        await gw.stop()
        await runner.cleanup()
