"""nginx's workers run unprivileged when the gateway runs as root, and still reach replica sockets and temp files."""

import hashlib
import os
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from gateway.app import GatewayServer
from gateway.client import GatewayClient
from gateway.workers import ENV_USER, worker_identity
from tests.conftest import eventually, upstreams_for as allowed
from tests.fakes.upstream import serve

pytestmark = [pytest.mark.e2e]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="nginx switches its workers' user only when started as root")


def _uid(pid: int) -> int:
    line = next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("Uid:"))
    return int(line.split()[1])


@root_only
@pytest.mark.asyncio(loop_scope="session")
async def test_workers_run_as_nobody_and_reach_sockets_and_temp_files(tmpdir_short):
    os.chmod(tmpdir_short, 0o711)  # a home others may traverse, as the warning advises
    (Path(tmpdir_short) / "run").mkdir()
    sock = os.path.join(tmpdir_short, "run", "r.sock")

    async def echo(request: web.Request) -> web.Response:
        body = b"".join([c async for c in request.content.iter_any()])
        return web.Response(text=f"{len(body)} {hashlib.sha256(body).hexdigest()}")

    runner, address = await serve(echo, sock)
    os.chmod(sock, 0o700)  # a socket only its owner could connect to
    gw = GatewayServer(os.path.join(tmpdir_short, "gw"), upstreams=allowed(os.path.join(tmpdir_short, "gw")))
    assert gw.workers is not None and (gw.workers.user, gw.workers.uid) == ("nobody", 65534)
    await gw.start()
    try:
        async def workers_dropped_root() -> bool:
            children = Path(f"/proc/{gw._nginx.pid}/task/{gw._nginx.pid}/children").read_text().split()
            try:
                return bool(children) and {_uid(int(p)) for p in children} == {65534}
            except FileNotFoundError:  # one exited meanwhile: look again
                return False

        # A worker forked a moment ago is root until its start-up switches it to nobody (CI caught one there).
        await eventually(workers_dropped_root, 10)
        assert _uid(gw._nginx.pid) == 0
        async with GatewayClient(gw.control_url, token=gw.control_token) as c:
            await c.put_service("svc", auth=False)
            await c.register("svc", "svc/0/r0-s0", "0", address)
        big = os.urandom(3 << 20)  # streamed through the worker
        async with httpx.AsyncClient(timeout=30, trust_env=False) as h:
            assert (await h.get(f"{gw.url}/services/svc/")).text == f"0 {hashlib.sha256(b'').hexdigest()}"
            r = await h.post(f"{gw.url}/services/svc/", content=big)
            assert r.status_code == 200 and r.text == f"{len(big)} {hashlib.sha256(big).hexdigest()}"
        assert oct(gw.runtime_dir.stat().st_mode & 0o777) == "0o711"
        for name in ("state.json", "control.token", "nginx.conf"):
            assert (gw.runtime_dir / name).stat().st_mode & 0o077 == 0, name
    finally:
        await gw.stop()
        await runner.cleanup()


@root_only
def test_workers_stay_root_only_where_nobody_cannot_reach_the_sockets(tmp_path, caplog):
    private = tmp_path / "home"  # pytest's tmp_path is 0700: closed to nobody
    (private / "replicas").mkdir(parents=True)
    os.chmod(tmp_path, 0o700)
    ident = worker_identity([private / "replicas"], environ={})
    assert ident.uid == 0 and "cannot reach replica sockets" in caplog.text and str(tmp_path) in caplog.text
    assert worker_identity([private / "replicas"], environ={ENV_USER: "nobody:nogroup"}).uid == 65534
    with pytest.raises(ValueError, match=ENV_USER):
        worker_identity([], environ={ENV_USER: "no-such-user-here"})


@root_only
def test_a_private_home_is_opened_to_the_workers_group_for_search_only(tmpdir_short, caplog):
    above = Path(tmpdir_short)
    os.chmod(above, 0o711)
    home = above / "home"  # the server keeps its home 700: nginx's workers still run as nobody
    (home / "gateway").mkdir(parents=True)
    (home / "tunnels").mkdir(mode=0o700)
    os.chmod(home, 0o700)
    ident = worker_identity([home / "tunnels", home / "gateway"], environ={}, home=home)
    assert ident.user == "nobody" and "cannot reach" not in caplog.text
    for d in (home, home / "tunnels"):
        st = d.stat()
        assert st.st_mode & 0o777 == 0o710 and st.st_gid == ident.gid, d  # others still get nothing
    assert ident.blocked_at(home / "tunnels") is None
    # A directory above the home is not the gateway's to open: the workers stay root, and the log says why.
    os.chmod(above, 0o700)
    assert worker_identity([home / "tunnels"], environ={}, home=home).uid == 0
    assert above.stat().st_mode & 0o777 == 0o700 and "cannot reach replica sockets" in caplog.text
