"""The activator, end to end: real nginx, control app, real upstream HTTP servers.

A request to a service without a ready replica is held until one registers, then forwarded by the
activator; held requests show in the stats and count in the rate windows once, when they arrive.
"""

import asyncio
import gzip
import hashlib
import inspect
import json
import os
import time

import aiohttp
import httpx
import pytest
from aiohttp import web

from gateway.app import GatewayServer
from tests.conftest import upstreams_for as allowed
from tests.fakes.upstream import serve
from gateway.client import GatewayClient

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


class Upstream:
    """A replica: /echo reports what reached it, /stream streams, /gz is pre-compressed, /ws echoes."""

    def __init__(self, name: str):
        self.name = name
        self.paths: list[str] = []
        self.release = asyncio.Event()
        self.stream_done = False
        self.runner: web.AppRunner | None = None
        self.address = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.paths.append(request.path)
        if request.path == "/ws":
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            async for msg in ws:
                await ws.send_str(f"{self.name}:{msg.data}")
            return ws
        if request.path == "/stream":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: first\n\n")
            await asyncio.wait_for(self.release.wait(), 10)  # the test reads "first" before releasing
            await resp.write(b"data: second\n\n")
            self.stream_done = True
            await resp.write_eof()
            return resp
        if request.path == "/broken":  # dies mid-body
            resp = web.StreamResponse()
            await resp.prepare(request)
            await resp.write(b"partial")
            request.transport.abort()
            return resp
        if request.path == "/gz":
            return web.Response(body=gzip.compress(b"zipped " * 100),
                                headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})
        body = b"".join([c async for c in request.content.iter_any()])  # no client_max_size
        resp = web.json_response({
            "replica": self.name, "method": request.method, "raw_path": request.rel_url.raw_path,
            "query": request.rel_url.raw_query_string, "body": body.decode(errors="replace"),
            "body_sha": hashlib.sha256(body).hexdigest(), "headers": dict(request.headers)})
        resp.headers["X-Replica"] = self.name
        resp.headers.add("Set-Cookie", "a=1")
        resp.headers.add("Set-Cookie", "b=2")
        return resp

    async def start(self, unix_path: str | None = None) -> "Upstream":
        self.runner, self.address = await serve(self.handle, unix_path)
        return self


@pytest.fixture
async def upstream(tmpdir_short):
    u = await Upstream("A").start(os.path.join(tmpdir_short, "a.sock"))
    yield u
    u.release.set()
    await u.runner.cleanup()


@pytest.fixture
async def gateway(tmpdir_short):
    gw = GatewayServer(os.path.join(tmpdir_short, "gw"), upstreams=allowed(tmpdir_short + "/gw"))
    await gw.start()
    pid = gw._nginx.pid
    yield gw
    await gw.stop()
    assert not os.path.exists(f"/proc/{pid}")


async def bearer(client: GatewayClient) -> dict[str, str]:
    """The header of a new gateway token, made by the control API (which keeps only its hash)."""
    return {"Authorization": f"Bearer {(await client.create_token('test')).token}"}


@pytest.fixture
async def auth(client) -> dict[str, str]:
    return await bearer(client)


async def poll(cond, timeout: float = 10.0, interval: float = 0.02):
    """Bounded wait for ``cond()`` (sync or async) to be truthy; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(interval)


async def held(client: GatewayClient, service: str = "svc", n: int | None = None):
    """The service's (held, held_total); with ``n``, first wait (bounded) until ``n`` are held."""
    async def get():
        s = (await client.stats()).services[service]
        return (s.held, s.held_total) if n is None or s.held == n else None
    return await poll(get) if n is not None else await get()


def activator_log_lines(gw: GatewayServer, service: str = "svc") -> int:
    if not gw.access_log.exists():
        return 0
    fields = (line.split(" ") for line in gw.access_log.read_text().splitlines())
    return sum(1 for f in fields if len(f) > 4 and f[1] == "2" and f[4] == service)


async def register(client: GatewayClient, upstream: Upstream, service: str = "svc", i: int = 0):
    await client.register(service, f"{service}/0/r{i}-s0", "0", upstream.address)


async def test_held_request_is_forwarded_once_a_replica_registers(gateway, client, upstream, auth):
    await client.put_service("svc")
    async with httpx.AsyncClient(timeout=30) as h:
        post = asyncio.create_task(h.post(
            f"{gateway.url}/services/svc/echo/a%20b?x=1&y=%2F", content=b"payload-1",
            headers={**auth, "X-Custom": "yes"}))
        by_host = asyncio.create_task(h.get(f"{gateway.url}/hosted", headers={**auth, "Host": "svc.localhost"}))
        assert await held(client, n=2) == (2, 2)
        assert not post.done() and not by_host.done() and upstream.paths == []
        await register(client, upstream)
        resp, resp2 = await asyncio.wait_for(asyncio.gather(post, by_host), 10)
    assert resp.status_code == 200 and resp2.status_code == 200
    got = resp.json()
    assert (got["replica"], got["method"], got["raw_path"], got["query"], got["body"]) == (
        "A", "POST", "/echo/a%20b", "x=1&y=%2F", "payload-1")  # prefix stripped, rest as sent
    hdrs = got["headers"]
    assert hdrs["X-Custom"] == "yes" and "Authorization" not in hdrs  # the gateway token stays at the gateway
    assert hdrs["X-Forwarded-Prefix"] == "/services/svc" and hdrs["Host"].startswith("127.0.0.1")
    assert "Upgrade" not in hdrs and "Keep-Alive" not in hdrs
    assert resp.headers["x-replica"] == "A" and resp.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert resp2.json()["raw_path"] == "/hosted" and resp2.json()["headers"]["Host"] == "svc.localhost"
    assert await held(client) == (0, 2)
    # now nginx routes straight to the replica, nothing more is held; the replica sees the same request
    async with httpx.AsyncClient(timeout=10) as h:
        direct = await h.post(f"{gateway.url}/services/svc/echo/a%20b?x=1&y=%2F", content=b"payload-1",
                              headers={**auth, "X-Custom": "yes"})
    assert direct.status_code == 200 and await held(client) == (0, 2)
    same = ("method", "raw_path", "query", "body")
    assert {k: direct.json()[k] for k in same} == {k: got[k] for k in same}
    skip = {"X-Real-Ip", "X-Forwarded-For"}  # same values; only compare the set of names
    assert set(direct.json()["headers"]) - skip == set(hdrs) - skip


async def test_twenty_held_requests_released_by_one_registration_count_once(gateway, client, upstream, auth):
    await client.put_service("svc")
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=50)) as h:
        tasks = [asyncio.create_task(h.get(f"{gateway.url}/services/svc/echo/{i}", headers=auth)) for i in range(20)]
        assert await held(client, n=20) == (20, 20)
        # counted when they arrived, while still held: this is what scales the service up from zero
        stats = (await client.stats()).services["svc"]
        assert {w: v.requests for w, v in stats.windows.items()} == {30: 20, 60: 20, 300: 20}
        assert activator_log_lines(gateway) == 0  # nginx logs them only when they complete
        await register(client, upstream)
        resps = await asyncio.wait_for(asyncio.gather(*tasks), 15)
    assert [r.status_code for r in resps] == [200] * 20
    assert sorted(r.json()["raw_path"] for r in resps) == sorted(f"/echo/{i}" for i in range(20))
    assert await held(client) == (0, 20)
    # nginx has written its 20 activator lines (hit "2"): they must not count a second time
    assert await poll(lambda: activator_log_lines(gateway) == 20)
    async with httpx.AsyncClient(timeout=10) as h:  # one direct request, logged with hit 1
        assert (await h.get(f"{gateway.url}/services/svc/echo/direct", headers=auth)).status_code == 200

    async def windows():
        w = (await client.stats()).services["svc"].windows
        return w if w[30].requests == 21 else None
    w = await poll(windows)
    assert w and {k: v.requests for k, v in w.items()} == {30: 21, 60: 21, 300: 21}
    assert (await client.stats()).services["svc"].windows[300].requests == 21  # stable
    assert w[30].request_time > 0  # the held requests' time was added when they completed


async def test_large_bodies_pass_chunked_or_with_length(gateway, client, upstream, auth):
    await client.put_service("svc")
    big = os.urandom(3 << 20)  # more than socket buffers hold while the request waits

    async def chunks():
        for i in range(0, len(big), 100_000):
            yield big[i:i + 100_000]

    async with httpx.AsyncClient(timeout=30) as h:
        chunked = asyncio.create_task(h.post(f"{gateway.url}/services/svc/echo/c", content=chunks(), headers=auth))
        sized = asyncio.create_task(h.put(f"{gateway.url}/services/svc/echo/s", content=big, headers=auth))
        await held(client, n=2)
        await register(client, upstream)
        resps = await asyncio.wait_for(asyncio.gather(chunked, sized), 20)
    sha = hashlib.sha256(big).hexdigest()
    (c, s) = (r.json() for r in resps)
    assert (c["method"], c["body_sha"], c["headers"].get("Transfer-Encoding")) == ("POST", sha, "chunked")
    assert (s["method"], s["body_sha"], s["headers"].get("Content-Length")) == ("PUT", sha, str(len(big)))


async def test_cold_start_timeout_answers_503_with_retry_after(gateway, client, upstream, auth):
    route = await client.put_service("svc", cold_start_timeout=1)
    assert route.cold_start_timeout == 1
    assert (await client.put_service("svc")).cold_start_timeout == 1  # omitted: kept
    assert "proxy_read_timeout 3601s;" in gateway._nginx.conf_path.read_text()
    async with httpx.AsyncClient(timeout=30) as h:
        t0 = time.monotonic()
        resp = await h.get(f"{gateway.url}/services/svc/echo/x", headers=auth)
        elapsed = time.monotonic() - t0
    assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
    assert resp.json()["service"] == "svc" and "1s" in resp.json()["error"]
    assert 0.9 <= elapsed < 10
    assert await held(client) == (0, 1)
    assert upstream.paths == []


async def test_stream_passes_through_the_activator_incrementally(gateway, client, upstream, auth):
    await client.put_service("svc")
    first_seen = asyncio.Event()

    async def read():
        async with httpx.AsyncClient(timeout=30) as h:
            async with h.stream("GET", f"{gateway.url}/services/svc/stream", headers=auth) as resp:
                chunks = resp.aiter_raw()
                first = await chunks.__anext__()
                first_seen.set()
                return resp, first, b"".join([c async for c in chunks])

    task = asyncio.create_task(read())
    await held(client, n=1)
    await register(client, upstream)
    await asyncio.wait_for(first_seen.wait(), 10)
    assert not upstream.stream_done  # the first event arrived while the replica was still streaming
    upstream.release.set()
    resp, first, rest = await asyncio.wait_for(task, 10)
    assert resp.status_code == 200 and resp.headers["content-type"] == "text/event-stream"
    assert (first, rest) == (b"data: first\n\n", b"data: second\n\n") and upstream.stream_done


async def test_client_that_disconnects_while_held_is_released(gateway, client, upstream, auth):
    await client.put_service("svc")
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.listen_port)
    writer.write(f"GET /services/svc/echo/gone HTTP/1.1\r\nHost: x\r\nAuthorization: {auth['Authorization']}\r\n\r\n".encode())
    await writer.drain()
    assert await held(client, n=1) == (1, 1)
    writer.close()
    await writer.wait_closed()
    assert await held(client, n=0) == (0, 1)
    await register(client, upstream)
    async with httpx.AsyncClient(timeout=10) as h:
        assert (await h.get(f"{gateway.url}/services/svc/echo/after", headers=auth)).status_code == 200
    assert upstream.paths == ["/echo/after"]  # the abandoned request never reached the replica


async def test_held_requests_are_bounded_per_service(tmpdir_short, upstream):
    gw = GatewayServer(os.path.join(tmpdir_short, "gw-bound"), max_held=2, upstreams=allowed(tmpdir_short + "/gw"))
    await gw.start()
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c, httpx.AsyncClient(timeout=30) as h:
            await c.put_service("svc")
            auth = await bearer(c)
            waiting = [asyncio.create_task(h.get(f"{gw.url}/services/svc/echo/{i}", headers=auth)) for i in range(2)]
            assert await held(c, n=2) == (2, 2)
            over = await h.get(f"{gw.url}/services/svc/echo/3", headers=auth)
            assert over.status_code == 503 and over.headers["retry-after"] == "5"
            await register(c, upstream)
            assert [r.status_code for r in await asyncio.wait_for(asyncio.gather(*waiting), 10)] == [200, 200]
            assert await held(c) == (0, 2)
    finally:
        await gw.stop()


async def test_websocket_is_held_then_bridged(gateway, client, upstream, auth):
    await client.put_service("svc")
    async with aiohttp.ClientSession() as s:
        connect = asyncio.create_task(s.ws_connect(f"{gateway.url}/services/svc/ws", headers=auth))
        assert await held(client, n=1) == (1, 1)
        await register(client, upstream)
        ws = await asyncio.wait_for(connect, 10)
        try:
            for text in ("hello", "again"):
                await ws.send_str(text)
                msg = await asyncio.wait_for(ws.receive(), 5)
                assert msg.type == aiohttp.WSMsgType.TEXT and msg.data == f"A:{text}"
        finally:
            await ws.close()


async def test_deleted_or_stopping_gateway_releases_held_requests(tmpdir_short, upstream):
    gw = GatewayServer(os.path.join(tmpdir_short, "gw-del"), upstreams=allowed(tmpdir_short + "/gw"))
    await gw.start()
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as c, httpx.AsyncClient(timeout=30) as h:
            await c.put_service("svc")
            await c.put_service("other")
            auth = await bearer(c)
            deleted = asyncio.create_task(h.get(f"{gw.url}/services/svc/echo/x", headers=auth))
            stopped = asyncio.create_task(h.get(f"{gw.url}/services/other/echo/x", headers=auth))
            await held(c, "svc", n=1)
            await held(c, "other", n=1)
            await c.delete_service("svc")
            assert (await asyncio.wait_for(deleted, 10)).status_code == 404
            t0 = time.monotonic()
            stop = asyncio.create_task(gw.stop())
            resp = await asyncio.wait_for(stopped, 10)
            assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
            await stop
            assert time.monotonic() - t0 < 8  # nginx did not wait for a held request
    finally:
        await gw.stop()


async def test_compressed_body_passes_untouched(gateway, client, upstream):
    await client.put_service("svc", auth=False)
    async with httpx.AsyncClient(timeout=30) as h:
        task = asyncio.create_task(h.get(f"{gateway.url}/services/svc/gz", headers={"Accept-Encoding": "gzip"}))
        await held(client, n=1)
        await register(client, upstream)
        resp = await asyncio.wait_for(task, 10)
    assert resp.status_code == 200 and resp.headers["content-encoding"] == "gzip"
    assert resp.text == "zipped " * 100  # decoded once, by the client


async def test_replica_breaking_off_mid_body_is_not_a_complete_response(gateway, client, upstream):
    await client.put_service("svc", auth=False)
    async with httpx.AsyncClient(timeout=30) as h:
        task = asyncio.create_task(h.get(f"{gateway.url}/services/svc/broken"))
        await held(client, n=1)
        await register(client, upstream)
        with pytest.raises(httpx.RemoteProtocolError):
            await asyncio.wait_for(task, 10)



async def test_activator_serves_only_what_nginx_passed_on(gateway, client, upstream, auth):
    """Straight to the control port, /activator/<service>/ is refused, whatever credential it carries; through
    nginx it serves after the route's auth, and nginx's secret reaches neither the client nor the replica."""
    await client.put_service("svc", cold_start_timeout=0)
    await register(client, upstream)
    await client.unregister("svc", "svc/0/r0-s0")
    direct = f"{gateway.control_url}/activator/svc/echo"
    forged = {"X-Durastack-Gateway": "0" * 64}
    async with httpx.AsyncClient(timeout=30, trust_env=False) as h:
        for headers in ({}, auth, forged, {"Authorization": f"Bearer {gateway.control_token}"}):
            assert (await h.get(direct, headers=headers)).status_code == 403
        # nginx with a client's forged header: replaced by nginx's own (empty off the activator path).
        await client.put_service("svc", cold_start_timeout=30)
        echo = asyncio.create_task(h.get(f"{gateway.url}/services/svc/echo", headers={**auth, **forged}))
        await held(client, n=1)
        await register(client, upstream)
        resp = await echo
        assert resp.status_code == 200 and resp.json()["replica"] == "A"
        seen = {k.lower() for k in resp.json()["headers"]}
        assert "x-durastack-gateway" not in seen
        assert not any(gateway.internal_secret in v for v in resp.headers.values())
        # Served by nginx straight to the replica now: a forged header does not pass either.
        resp = await h.get(f"{gateway.url}/services/svc/echo", headers={**auth, **forged})
        assert "x-durastack-gateway" not in {k.lower() for k in resp.json()["headers"]}
    assert gateway.control_token not in gateway._nginx.conf_path.read_text()


async def raw_request(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """GET ``path`` exactly as written (no client normalizes it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        lines = [f"GET {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close",
                 *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def test_nginx_secret_opens_only_its_own_services_activator(gateway, client, upstream):
    """Each location nginx sends to the control app carries the secret of its scope; the control app honours it on
    that scope's path alone: not the health probe's on the activator, not one service's on another's, not on a
    path whose raw form names another service."""
    from gateway.render import HEALTH_SCOPE, INTERNAL_HEADER, activator_scope, scoped_secret

    for name in ("svc", "other"):
        await client.put_service(name, cold_start_timeout=0)
        await register(client, upstream, name)
    secret = lambda scope: {INTERNAL_HEADER: scoped_secret(gateway.internal_secret, scope)}  # noqa: E731
    refused = [
        ("/activator/svc/echo", {INTERNAL_HEADER: gateway.internal_secret}),  # what nginx sent everywhere before
        ("/activator/svc/echo", secret(HEALTH_SCOPE)),
        ("/activator/svc/echo", secret(activator_scope("other"))),
        ("/activator/other/../svc/echo", secret(activator_scope("svc"))),
        ("/activator/other/%2e%2e/svc/echo", secret(activator_scope("svc"))),
        ("/healthz/../activator/svc/echo", secret(HEALTH_SCOPE)),
        ("//activator/svc/echo", secret(activator_scope("svc"))),
    ]
    for path, headers in refused:
        code, body = await raw_request(gateway.control_port, path, headers)
        assert code in (401, 403, 404) and b'"replica"' not in body, (path, code, body)
    code, body = await raw_request(gateway.control_port, "/activator/svc/echo", secret(activator_scope("svc")))
    assert code == 200 and json.loads(body)["replica"] == "A"  # the one place it opens
    conf = gateway._nginx.conf_path.read_text()
    assert gateway.internal_secret not in conf and scoped_secret(gateway.internal_secret, HEALTH_SCOPE) in conf


async def test_smuggled_paths_are_neither_held_nor_forwarded_for_a_service_at_zero(gateway, client, upstream, auth):
    await client.put_service("svc", cold_start_timeout=30)
    for path in ("/activator/svc/x/../../../healthz", "/activator/svc/x/%2e%2e/%2e%2e/%2e%2e/healthz",
                 "/services/svc/../../healthz", "/services/svc/x", "//activator//svc//x/../../../healthz"):
        code, body = await raw_request(gateway.listen_port, path, {})
        assert code in (401, 403, 404), (path, code, body)
    assert await held(client) == (0, 0)  # none reached the activator
    # an authenticated request still starts the service from zero
    async with httpx.AsyncClient(timeout=30, trust_env=False) as h:
        echo = asyncio.create_task(h.get(f"{gateway.url}/services/svc/echo", headers=auth))
        await held(client, n=1)
        await register(client, upstream)
        resp = await echo
    assert resp.status_code == 200 and resp.json()["replica"] == "A"
