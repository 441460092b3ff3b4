"""A route that says why its service cannot serve (a crash-looping router, a failed service), end to end with
real nginx and the control app: 503 with the reason at once, held requests released, no token no reason; and a
route without a reason still holds until a replica registers (scale from zero)."""

import asyncio
import os
import time

import httpx
import pytest

from gateway.activator import UNAVAILABLE_HEADER
from gateway.app import GatewayServer
from tests.conftest import upstreams_for as allowed
from tests.test_gateway_activator import Upstream, bearer, held

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]

WHY = "router group 'router': replica 3 exited (1); next attempt at 17:02:11 UTC"


@pytest.fixture
async def gateway(tmpdir_short):
    runtime = os.path.join(tmpdir_short, "gw")
    gw = GatewayServer(runtime, upstreams=allowed(runtime))
    await gw.start()
    yield gw
    await gw.stop()


@pytest.fixture
async def upstream(tmpdir_short):
    u = await Upstream("A").start(os.path.join(tmpdir_short, "a.sock"))
    yield u
    await u.runner.cleanup()


async def test_an_unavailable_service_answers_503_with_why_at_once_and_releases_held_requests(gateway, client,
                                                                                               upstream):
    auth = await bearer(client)
    await client.put_service("svc")  # default cold start: 300 s
    async with httpx.AsyncClient(timeout=30) as h:
        waiting = asyncio.create_task(h.get(f"{gateway.url}/services/svc/echo/held", headers=auth))
        await held(client, n=1)
        t0 = time.monotonic()
        route = await client.put_service("svc", unavailable=WHY)
        released = await asyncio.wait_for(waiting, 5)
        took_release = time.monotonic() - t0
        t0 = time.monotonic()
        fresh = await h.get(f"{gateway.url}/services/svc/echo/x", headers=auth)
        took_fresh = time.monotonic() - t0
        anonymous = await h.get(f"{gateway.url}/services/svc/echo/x")
    assert route.unavailable == WHY
    for resp in (released, fresh):
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
        assert resp.json()["reason"] == WHY and resp.json()["service"] == "svc"
        assert resp.headers[UNAVAILABLE_HEADER] == WHY
    assert took_release < 1 and took_fresh < 1, (took_release, took_fresh)
    # The route's own auth still comes first: without a token, nginx answers and the reason stays in.
    assert anonymous.status_code == 401 and WHY not in anonymous.text
    assert await held(client) == (0, 1) and upstream.paths == []


async def test_a_reason_cleared_holds_again_until_a_replica_registers(gateway, client, upstream):
    auth = await bearer(client)
    await client.put_service("svc", unavailable="service failed: replica 0 exited (1) → not retried")
    async with httpx.AsyncClient(timeout=30) as h:
        resp = await h.get(f"{gateway.url}/services/svc/echo/x", headers=auth)
        assert resp.status_code == 503 and resp.json()["reason"].endswith("→ not retried")
        assert resp.headers[UNAVAILABLE_HEADER].endswith("? not retried")  # a header carries printable ASCII
        assert (await client.put_service("svc")).unavailable == ""  # omitted: no reason, hold (scale from zero)
        waiting = asyncio.create_task(h.get(f"{gateway.url}/services/svc/echo/later", headers=auth))
        await held(client, n=1)
        assert not waiting.done()
        await client.register("svc", "svc/0/r0-s0", "0", upstream.address)
        resp = await asyncio.wait_for(waiting, 10)
    assert resp.status_code == 200 and resp.json()["raw_path"] == "/echo/later"


async def test_a_reason_with_a_replica_registered_changes_nothing(gateway, client, upstream):
    """nginx routes to registered replicas directly; a stale reason must not turn their traffic away."""
    auth = await bearer(client)
    await client.put_service("svc", unavailable=WHY)
    await client.register("svc", "svc/0/r0-s0", "0", upstream.address)
    async with httpx.AsyncClient(timeout=10) as h:
        resp = await h.get(f"{gateway.url}/services/svc/echo/x", headers=auth)
    assert resp.status_code == 200 and resp.json()["replica"] == "A"


async def test_the_gateway_refuses_a_reason_too_long(gateway, client):
    from gateway.client import GatewayError
    with pytest.raises(GatewayError) as e:
        await client.put_service("svc", unavailable="x" * 1025)
    assert e.value.status == 400 and "unavailable" in str(e.value)
