"""Gateway tokens, end to end: the control API, real nginx, a real upstream.

The gateway holds one global set of named tokens, hashed only; every route with auth accepts
exactly that set, and a revoke reaches nginx (re-render + reload) before the call returns.
"""

import asyncio
import json
import os
import stat
import time

import httpx
import pytest
from aiohttp import web

from gateway.app import GatewayServer
from gateway.client import GatewayClient, GatewayError
from models.gateway import CONTROL_TOKEN_FILE, GatewayToken, hash_token
from tests.conftest import eventually, upstreams_for as allowed
from tests.fakes.upstream import serve

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture
async def upstream(tmpdir_short):
    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    runner, address = await serve(ok, os.path.join(tmpdir_short, "up.sock"))
    yield address
    await runner.cleanup()


async def start(runtime: str, address: str, **kw) -> GatewayServer:
    """A gateway routing `svc` (auth) and `open` (no auth) to ``address``."""
    gw = GatewayServer(runtime, upstreams=allowed(runtime), **kw)
    await gw.start()
    async with GatewayClient(gw.control_url, token=gw.control_token) as c:
        for name, auth in (("svc", True), ("open", False)):
            await c.put_service(name, auth=auth)
            await c.register(name, f"{name}/0/r0-s0", "0", address)
    return gw


@pytest.fixture
async def gateway(tmpdir_short, upstream):
    gw = await start(os.path.join(tmpdir_short, "gw"), upstream)
    yield gw
    await gw.stop()


async def status(gw: GatewayServer, token: str | None, service: str = "svc") -> int:
    """One request on a fresh connection: a pooled one could sit on an nginx worker of an older config."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(timeout=10) as h:
        return (await h.get(f"{gw.url}/services/{service}/x", headers=headers)).status_code


async def test_a_token_is_shown_once_and_stored_hashed(gateway, client):
    assert await status(gateway, "anything") == 403 and await status(gateway, None) == 401  # no token yet
    new = await client.create_token("ci")
    assert new.name == "ci" and len(new.token) >= 40 and new.prefix == new.token[:6]
    assert await status(gateway, new.token) == 200  # accepted once the call returned
    assert await status(gateway, None, "open") == 200  # a route without auth takes none

    listed = await client.tokens()
    assert [(t.name, t.prefix) for t in listed] == [("ci", new.token[:6])] and "token" not in listed[0].model_dump()
    async with httpx.AsyncClient() as h:
        listing = await h.get(f"{gateway.control_url}/api/tokens",
                              headers={"Authorization": f"Bearer {gateway.control_token}"})
        assert listing.status_code == 200 and new.token not in listing.text
    saved = gateway.state_path.read_text()
    assert new.token not in saved and hash_token(new.token) in saved
    assert stat.S_IMODE(gateway.state_path.stat().st_mode) == 0o600
    assert new.token not in gateway._nginx.conf_path.read_text()


async def test_every_auth_route_accepts_exactly_the_current_set(gateway, client, upstream):
    a, b = (await client.create_token("a")).token, (await client.create_token("b")).token
    await client.put_service("later")  # a route made after the tokens accepts them too
    await client.register("later", "later/0/r0-s0", "0", upstream)
    for service in ("svc", "later"):
        assert [await status(gateway, t, service) for t in (a, b, "c", a[:-1])] == [200, 200, 403, 403]


async def test_a_token_scoped_to_services_opens_those_alone_and_wakes_no_other(gateway, client, upstream):
    await client.put_service("cold")  # scaled to zero: its requests go to the activator, which wakes it
    scoped = await client.create_token("svc-only", ["svc"])
    everything = (await client.create_token("all")).token
    assert scoped.services == ("svc",) and [t.services for t in await client.tokens()] == [None, ("svc",)]
    assert [await status(gateway, scoped.token, s) for s in ("svc", "open")] == [200, 200]
    await client.put_service("other")
    await client.register("other", "other/0/r0-s0", "0", upstream)
    assert await status(gateway, scoped.token, "other") == 403 and await status(gateway, everything, "other") == 200
    # A scoped token on a service at zero is refused by nginx, before the activator counts (or holds) it.
    assert await status(gateway, scoped.token, "cold") == 403
    assert (await client.stats()).services["cold"].held_total == 0
    # The control: an open token reaches the activator, which holds the request (and would wake the service).
    async with httpx.AsyncClient(timeout=1) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.get(f"{gateway.url}/services/cold/x", headers={"Authorization": f"Bearer {everything}"})
    assert (await client.stats()).services["cold"].held_total == 1
    # Saved with its scope: after a restart it still opens svc alone (an older state without scopes opens all).
    saved = json.loads(gateway.state_path.read_text())["tokens"]
    assert saved["svc-only"]["services"] == ["svc"] and saved["all"]["services"] is None
    older = {k: v for k, v in saved["svc-only"].items() if k != "services"}  # a state written before scopes
    assert GatewayToken.model_validate(older).services is None
    with pytest.raises(GatewayError) as e:
        await client.create_token("bad", ["Not_A_Service"])
    assert e.value.status == 400


async def test_token_api_errors(gateway, client):
    await client.create_token("ci")
    for call, code in ((client.create_token("ci"), 409), (client.revoke_token("nope"), 404),
                       (client.create_token("bad name"), 400), (client.create_token(""), 400)):
        with pytest.raises(GatewayError) as e:
            await call
        assert e.value.status == code
    assert [t.name for t in await client.tokens()] == ["ci"]


async def test_revoked_token_is_refused_within_2s(gateway, client):
    keep, gone = (await client.create_token("keep")).token, (await client.create_token("gone")).token
    # used first, so that its digest is in nginx's cache: revocation must not depend on the cache
    assert [await status(gateway, gone) for _ in range(3)] == [200] * 3
    start = time.monotonic()
    revoke = asyncio.create_task(client.revoke_token("gone"))
    await eventually(lambda: _is(status(gateway, gone), 403), timeout=10, interval=0.02)
    refused_after = time.monotonic() - start
    await revoke
    assert refused_after < 2.0, f"revoked token still accepted after {refused_after:.2f}s"
    assert [await status(gateway, gone) for _ in range(5)] == [403] * 5  # for good, on every worker
    assert await status(gateway, keep) == 200
    assert [t.name for t in await client.tokens()] == ["keep"]


async def test_tokens_and_revocations_survive_a_restart(tmpdir_short, upstream):
    runtime = os.path.join(tmpdir_short, "gw-restart")
    gw = await start(runtime, upstream)
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            kept, revoked = (await c.create_token("kept")).token, (await c.create_token("revoked")).token
            await c.revoke_token("revoked")
        port = gw.listen_port
    finally:
        await gw.stop()
    gw = GatewayServer(runtime, listen_port=port, upstreams=allowed(runtime))
    await gw.start()
    try:
        assert [await status(gw, t) for t in (kept, revoked)] == [200, 403]
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            assert [t.name for t in await c.tokens()] == ["kept"]
        assert list(json.loads(gw.state_path.read_text())["tokens"]) == ["kept"]
    finally:
        await gw.stop()


async def _is(value, expected) -> bool:
    return (await value) == expected


async def test_control_api_off_loopback_needs_its_token(tmpdir_short):
    with pytest.raises(ValueError, match="DURASTACK_GATEWAY_CONTROL_TOKEN"):
        GatewayServer(f"{tmpdir_short}/open", host="0.0.0.0")
    gw = GatewayServer(f"{tmpdir_short}/guarded", host="0.0.0.0", control_token="ctl-secret")
    await gw.start()
    try:
        async with GatewayClient(gw.control_url) as anonymous:
            with pytest.raises(GatewayError) as refused:
                await anonymous.create_token("intruder")
            assert refused.value.status == 401
            with pytest.raises(GatewayError):
                await anonymous.put_service("svc")
        assert not (gw.runtime_dir / CONTROL_TOKEN_FILE).exists()  # a given token: no file to read it from
        async with GatewayClient(gw.control_url, token="ctl-secret") as worker:
            await worker.put_service("svc")
            assert "intruder" not in [t.name for t in await worker.tokens()]
        assert "svc" in gw.state.services
    finally:
        await gw.stop()


def _control_calls(gw: GatewayServer) -> list[tuple[str, str]]:
    """(method, path) of every route of the control app, placeholders filled in."""
    from gateway.api import make_app

    calls = []
    for route in make_app(gw).router.routes():
        path = route.resource.canonical.replace("{replica_id}", "svc/0/r0-s0")
        for name in ("name", "service", "tail"):
            path = path.replace("{%s}" % name, "svc")
        calls.append((route.method if route.method != "*" else "GET", path))
    return calls


async def test_control_api_on_loopback_needs_its_token_too(tmpdir_short, upstream):
    """A loopback gateway makes its control token (mode 600) and refuses every control call without it."""
    from models.settings import Settings

    runtime = os.path.join(tmpdir_short, "gateway")
    gw = await start(runtime, upstream)
    token_file = gw.runtime_dir / CONTROL_TOKEN_FILE
    try:
        assert token_file.read_text().strip() == gw.control_token and len(gw.control_token) >= 40
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert gw.control_token not in gw._nginx.conf_path.read_text()
        calls = _control_calls(gw)
        assert len(calls) >= 12
        async with httpx.AsyncClient(timeout=10, trust_env=False) as h:
            for method, path in calls:
                if path == "/healthz" or path.startswith("/activator/"):
                    continue  # open: a generation number; the activator is checked in test_gateway_activator
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": gw.control_token}):
                    r = await h.request(method, f"{gw.control_url}{path}", headers=headers)
                    assert r.status_code == 401, (method, path, headers, r.status_code)
            assert (await h.get(f"{gw.control_url}/healthz")).status_code == 200
        assert "svc" in gw.state.services and gw.state.services["svc"].upstreams  # nothing changed
        # The CLI and the worker of this home find it; the environment variable still wins.
        home = Settings.from_env({"DURASTACK_HOME": tmpdir_short})
        assert home.control_token == gw.control_token
        assert "DURASTACK_GATEWAY_CONTROL_TOKEN" not in home.to_env()  # the file is not spread to children
        given = Settings.from_env({"DURASTACK_HOME": tmpdir_short, "DURASTACK_GATEWAY_CONTROL_TOKEN": "t"})
        assert given.control_token == "t"
        async with GatewayClient(gw.control_url, token=home.control_token) as c:
            assert [t.name for t in await c.tokens()] == []
        port = gw.listen_port
    finally:
        await gw.stop()
    again = GatewayServer(runtime, listen_port=port, upstreams=allowed(runtime))  # the same token after a restart
    await again.start()
    try:
        assert again.control_token == gw.control_token
    finally:
        await again.stop()


async def test_control_api_refuses_foreign_hosts_and_origins(gateway):
    """DNS rebinding (a foreign Host on our port) and cross-site pages (a foreign Origin) get 403, with the token."""
    token = {"Authorization": f"Bearer {gateway.control_token}"}
    url, port = f"{gateway.control_url}/api/services", gateway.control_port
    async with httpx.AsyncClient(timeout=10, trust_env=False) as h:
        assert (await h.get(url, headers=token)).status_code == 200
        assert (await h.get(url.replace("127.0.0.1", "localhost"), headers=token)).status_code == 200
        for host in (f"evil.example:{port}", "evil.example", "127.0.0.1", f"127.0.0.1:{port + 1}"):
            assert (await h.get(url, headers={**token, "Host": host})).status_code == 403, host
            assert (await h.get(f"{gateway.control_url}/healthz", headers={"Host": host})).status_code == 403
        for origin in ("http://evil.example", "null", f"http://127.0.0.1:{gateway.listen_port}"):
            r = await h.put(f"{url}/intruder", json={"auth": False}, headers={**token, "Origin": origin})
            assert r.status_code == 403, origin
        assert "intruder" not in gateway.state.services
        own = f"http://127.0.0.1:{port}"
        assert (await h.get(url, headers={**token, "Origin": own})).status_code == 200
        # Through nginx (which passes the client's Host on): its health probe still answers.
        assert (await h.get(f"{gateway.url}/healthz")).status_code == 200


# What reached svc's replica through the /healthz location before: nginx resolved the dot segments to /healthz and
# passed the raw path, with its secret, to the control app, whose activator forwarded it to the replica.
SMUGGLED = [
    "/activator/svc/x/../../../healthz",
    "/activator/svc/x/%2e%2e/%2e%2e/%2e%2e/healthz",
    "/activator/svc/x/%2E%2E/%2E%2E/%2E%2E/healthz",
    "/activator/svc/x/..%2f..%2f..%2fhealthz",
    "//activator//svc//x/../../../healthz",
    "/activator/svc/x/../../..//healthz",
    "/activator%2fsvc%2fx/../../healthz",
    "/services/svc/../../healthz",
    "/services/open/../svc/x",
    "/services/open/../../activator/svc/x",
    "/healthz/../activator/svc/x",
    "/activator/svc/x",
]


async def raw_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """GET ``path`` exactly as written (no client normalizes it), on a connection of its own."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_no_spelling_of_a_path_reaches_a_replica_without_a_token(gateway, client):
    for path in SMUGGLED:
        code, body = await raw_get(gateway.listen_port, path)
        assert code in (401, 403, 404), (path, code, body)
    for path in ("/x/../healthz", "/x/%2e%2e/healthz", "/activator/svc/x"):  # svc's own host: its auth
        assert (await raw_get(gateway.listen_port, path, "svc.localhost"))[0] == 401, path
    # what must still work: the health probe, a token's requests, the open service
    token = (await client.create_token("ci")).token
    code, body = await raw_get(gateway.listen_port, "/healthz?probe=1")
    assert code == 200 and json.loads(body)["status"] == "ok"
    assert await status(gateway, token) == 200 and await status(gateway, None, "open") == 200
