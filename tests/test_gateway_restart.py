"""The gateway outlives its nginx: a killed nginx master is replaced, on the routes the control app holds."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from gateway.app import GatewayServer
from gateway.client import GatewayClient
from tests.conftest import eventually
from tests.fakes.upstream import serve

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _workers(master: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{master}/task/{master}/children").read_text().split()]


async def test_killed_nginx_master_is_replaced_with_the_same_routes(tmpdir_short):
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"{request.match_info['tail']} from a")

    async def other(request: web.Request) -> web.Response:
        return web.Response(text="b")

    runner_a, address_a = await serve(hello, os.path.join(tmpdir_short, "a.sock"))
    runner_b, address_b = await serve(other)
    gw = GatewayServer(os.path.join(tmpdir_short, "gw"))
    await gw.start()
    endpoints = gw.runtime_dir / "endpoints.json"
    try:
        async with GatewayClient(gw.control_url) as client, httpx.AsyncClient(timeout=10, trust_env=False) as http:
            await client.put_service("svc", auth=False)
            await client.register("svc", "svc/0/r0-s0", "0", address_a)
            assert (await http.get(f"{gw.url}/services/svc/x")).text == "x from a"
            master = json.loads(endpoints.read_text())["nginx_pid"]
            old_workers = _workers(master)
            assert old_workers

            os.kill(master, signal.SIGKILL)
            killed = time.monotonic()

            async def new_master() -> int:
                pid = json.loads(endpoints.read_text())["nginx_pid"]
                return pid if pid != master and _alive(pid) else 0
            await eventually(new_master, timeout=30)
            back = time.monotonic() - killed
            # The orphaned workers (still serving the old configuration, beyond any reload) are gone.
            assert not any(map(_alive, old_workers))
            assert (await http.get(f"{gw.url}/services/svc/y")).text == "y from a"
            # And changes reach the new nginx.
            await client.unregister("svc", "svc/0/r0-s0")
            await client.register("svc", "svc/0/r1-s0", "0", address_b)
            assert [(await http.get(f"{gw.url}/services/svc/z")).text for _ in range(3)] == ["b"] * 3
            print(f"nginx master killed → a new one serves the routes in {back:.2f}s")
            assert back < 10
    finally:
        await gw.stop()
        for runner in (runner_a, runner_b):
            await runner.cleanup()
    assert not _alive(json.loads(endpoints.read_text())["nginx_pid"])
