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
from tests.conftest import eventually, upstreams_for as allowed
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
    gw = GatewayServer(os.path.join(tmpdir_short, "gw"), upstreams=allowed(tmpdir_short + "/gw"))
    await gw.start()
    endpoints = gw.runtime_dir / "endpoints.json"
    try:
        async with GatewayClient(gw.control_url, token=gw.control_token) as client, httpx.AsyncClient(timeout=10, trust_env=False) as http:
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


async def test_nginx_outlives_a_killed_control_app_and_is_adopted(tmpdir_short):
    """kill -9 of the control app under load: nginx serves on, with no request refused; the next control app
    adopts that same nginx (its pid file) and drives it; a normal stop then ends it."""
    import asyncio
    import subprocess
    import sys

    from gateway.app import free_port
    from gateway.nginx import master_of

    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    runner, address = await serve(hello)
    runtime = Path(tmpdir_short) / "gateway"
    port, control = free_port(), free_port()
    argv = [sys.executable, "-m", "gateway", "--runtime-dir", str(runtime), "--port", str(port),
            "--control-port", str(control)]
    log = open(Path(tmpdir_short) / "gateway.log", "ab")

    def launch() -> subprocess.Popen:
        return subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)

    async def up(proc: subprocess.Popen) -> bool:
        assert proc.poll() is None, (Path(tmpdir_short) / "gateway.log").read_text()[-2000:]
        try:
            ends = json.loads((runtime / "endpoints.json").read_text())
        except (OSError, ValueError):
            return False
        return ends["pid"] == proc.pid

    first = launch()
    second = None
    try:
        await eventually(lambda: up(first), timeout=30)
        token = (runtime / "control.token").read_text().strip()
        async with GatewayClient(f"http://127.0.0.1:{control}", token=token) as c:
            await c.put_service("svc", auth=False)
            await c.register("svc", "svc/0/r0-s0", "0", address)
        nginx = json.loads((runtime / "endpoints.json").read_text())["nginx_pid"]
        assert master_of(runtime) == nginx

        statuses: list = []
        killed = asyncio.Event()
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            async def load(n: int) -> None:
                for _ in range(n):
                    try:
                        statuses.append((await http.get(f"http://127.0.0.1:{port}/services/svc/x")).status_code)
                    except httpx.HTTPError as e:
                        statuses.append(repr(e))
                    if len(statuses) == 60 and not killed.is_set():
                        killed.set()
                        os.kill(first.pid, signal.SIGKILL)
                    await asyncio.sleep(0)

            await asyncio.gather(*(load(75) for _ in range(4)))
            assert killed.is_set() and first.wait(timeout=10) == -signal.SIGKILL
            assert _alive(nginx)  # no parent-death signal took it along
            second = launch()  # restarted while nginx serves on
            more = asyncio.gather(*(load(25) for _ in range(4)))
            await eventually(lambda: up(second), timeout=30)
            await more
        assert len(statuses) == 400 and [s for s in statuses if s != 200] == []
        # Adopted: the same nginx, under the new control app, which changes its routes.
        assert json.loads((runtime / "endpoints.json").read_text())["nginx_pid"] == nginx
        async with GatewayClient(f"http://127.0.0.1:{control}", token=token) as c:
            await c.unregister("svc", "svc/0/r0-s0")
            await c.put_service("svc", auth=False, cold_start_timeout=0)
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/services/svc/x")).status_code == 503
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
        assert not _alive(nginx)  # a normal stop ends the adopted nginx too
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        left = master_of(runtime)
        if left:
            os.kill(left, signal.SIGKILL)
        log.close()
        await runner.cleanup()
