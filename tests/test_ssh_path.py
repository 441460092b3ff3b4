"""The SSH data path against a simulated host (tests/fakes/vpc.py): booted from the user data durastack makes,
it answers only the installation's key with the host key durastack made for it, runs the job durastack sends
over SSH, and is reachable only by SSH — the app only through the tunnel's Unix socket.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import pytest_asyncio

from backends.ssh import (NotReady, SSHClient, SSHTarget, Tunnel, container_state, replace_host_key, run, ssh_target,
                            start_job, wait_booted)
from backends.ssh_keys import SSHKeys
from backends.userdata import BootKeys, cloud_init, startup_script
from models.replica import JobSpec
from tests.fakes import vpc as vpcs

pytestmark = pytest.mark.skipif(vpcs.available() is not None, reason=str(vpcs.available()))

SECRET = "hf_do-not-leak-1234"
APP = """cat > app.py <<'PY'
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (os.environ.get("MODEL", "-") + " " + str(len(os.environ.get("HF_TOKEN", "")))).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        print("request", self.path, flush=True)
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), H).serve_forever()
PY
exec python3 app.py"""


def job(**kw) -> JobSpec:
    return JobSpec(**{**dict(service="svc", group="llm", replica_num=0, submission_num=0, port=8000,
                             commands=["echo starting", APP], env={"HF_TOKEN": SECRET, "MODEL": "tiny"},
                             secrets=["HF_TOKEN"]), **kw})


@pytest.fixture
def keys(tmp_path):
    return SSHKeys.at(tmp_path / "ssh")


@pytest_asyncio.fixture
async def vpc(tmp_path):
    v = vpcs.SimulatedVPC(tmp_path / "vpc")
    yield v
    await asyncio.to_thread(v.close)


def boot(vpc, keys, key: str, address: str, user_data_of=cloud_init, j=None):
    host = keys.host_key(key)
    boot_keys = BootKeys(host.private_openssh, host.public_openssh, keys.client_public())
    user_data = user_data_of(j or job(), gpu=False, keys=boot_keys)
    assert SECRET not in user_data and "app.py" not in user_data
    return vpc.boot(key, address, user_data), SSHTarget(address, host.public_openssh)


async def get(socket_path, path="/") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(socket_path)), timeout=5) as c:
        return await c.get(f"http://replica{path}")


async def until(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_job_runs_over_ssh_and_serves_only_through_the_tunnel(vpc, keys, tmp_path):
    host, target = boot(vpc, keys, "ds-svc-llm-r0s0-aaa", "172.31.5.10")
    client = SSHClient.from_keys(keys, socket_factory=vpc.socket_factory)
    conn = await client.connect(target)
    assert await wait_booted(conn)
    await start_job(conn, job(), gpu=False)
    # The env file on the instance is root's and mode 600; the secret went over SSH, not user data.
    status, out, _ = await run(conn, 'stat -c %a "$DURASTACK_DIR/job/env"; cat "$DURASTACK_DIR/job/env"')
    assert status == 0 and out.splitlines()[0] == "600" and f"HF_TOKEN={SECRET}" in out
    ups, downs = [], []

    async def up():
        ups.append(time.monotonic())

    async def down():
        downs.append(time.monotonic())

    sock = tmp_path / "tunnels" / "r0.sock"
    tunnel = Tunnel(client, target, sock, 8000, on_up=up, on_down=down).start()
    try:
        await tunnel.wait_up(20)
        response = await until(lambda: _ok(sock), what="the app through the tunnel")
        assert response.text == f"tiny {len(SECRET)}"
        assert await container_state(conn) is None
        # From inside the VPC, nothing but SSH answers on the instance: not the app's port.
        with pytest.raises(OSError):
            await asyncio.to_thread(vpc.connect, "172.31.5.10", 8000, 2.0)

        # A lost tunnel: unrouted (on_down), reconnected (on_up), serving again.
        tunnel.connection.abort()
        await until(lambda: _true(len(downs) == 1 and len(ups) == 2), what="the tunnel to reconnect")
        assert (await until(lambda: _ok(sock), what="serving again")).status_code == 200

        # A container that exits is noticed over SSH at once.
        os.kill(host.container_pid(), signal.SIGKILL)
        state = await until(lambda: container_state(conn), timeout=10, what="the exit to show")
        assert state.startswith("exited")
    finally:
        await tunnel.close()
        conn.close()
    assert not sock.exists()


async def _ok(sock):
    try:
        r = await get(sock)
    except httpx.HTTPError:
        return None
    return r if r.status_code == 200 else None


async def _true(value):
    return value


async def test_the_boot_host_key_opens_nothing_once_the_instance_has_booted(vpc, keys):
    # A GCP host: its startup script, with the boot key in it, stays in the instance's metadata and runs again at
    # every boot. Whoever can read it must not be able to pose as the instance once it has booted.
    key = "ds-svc-llm-r2s0-ccc"
    host, boot_target = boot(vpc, keys, key, "10.128.7.10", user_data_of=startup_script)
    client = SSHClient.from_keys(keys, socket_factory=vpc.socket_factory)
    conn = await client.connect(ssh_target(keys, boot_target.host, key, after_boot=True, booting=True))
    assert await wait_booted(conn)
    after = keys.host_key(key, after_boot=True)
    assert after.public_openssh != boot_target.host_key
    await replace_host_key(conn, after.private_openssh, after.public_openssh)
    assert (await run(conn, "echo still"))[1] == "still\n"  # the connection that replaced it goes on
    conn.close()
    later = ssh_target(keys, boot_target.host, key, after_boot=True)
    assert later.boot_key is None
    for _ in range(2):  # as booted, then after its boot script ran again (a reboot)
        with pytest.raises(NotReady, match="host key"):
            await client.connect(boot_target)  # the instance no longer serves the boot key
        (await client.connect(later)).close()
        host.boot_again()


async def test_only_the_installation_key_and_only_the_pinned_host_key(vpc, keys, tmp_path):
    # A GCP host: its guest agent wrote new default host keys after the startup script (tests/fakes/vpc.py); the
    # pinned key is served all the same, from durastack's own file.
    _, target = boot(vpc, keys, "ds-svc-llm-r1s0-bbb", "10.128.7.9", user_data_of=startup_script)
    # Another host key (e.g. the image's own, before the boot script ran; or another machine): refused.
    other = SSHTarget(target.host, keys.host_key("some-other-instance").public_openssh)
    with pytest.raises(NotReady, match="host key"):
        await SSHClient.from_keys(keys, socket_factory=vpc.socket_factory).connect(other)
    # Another installation's key: refused by the host.
    stranger = SSHKeys.at(tmp_path / "elsewhere")
    with pytest.raises(NotReady):
        await SSHClient.from_keys(stranger, socket_factory=vpc.socket_factory).connect(target)
    conn = await SSHClient.from_keys(keys, socket_factory=vpc.socket_factory).connect(target)
    conn.close()


async def test_a_retried_start_keeps_the_container_an_earlier_attempt_started(vpc, keys):
    """A worker that died while a model loaded: the launch's retry keeps that container (its load goes on, its
    exit is reported, it never runs twice), where it used to remove and start it again. Another submission on the
    instance, or a container that never started, is started anew."""
    _, target = boot(vpc, keys, "ds-svc-llm-r3s0-ddd", "172.31.9.4")
    client = SSHClient.from_keys(keys, socket_factory=vpc.socket_factory)
    conn = await client.connect(target)
    assert await wait_booted(conn)
    pid = 'cat "$FAKE_DOCKER_DIR/durastack-job/pid"'
    assert await start_job(conn, job(), gpu=False) is True
    first = (await run(conn, pid))[1]
    assert await start_job(conn, job(), gpu=False) is False
    assert (await run(conn, pid))[1] == first and await container_state(conn) is None
    assert await start_job(conn, job(submission_num=1), gpu=False) is True  # the next submission's own
    assert (await run(conn, pid))[1] != first
    conn.close()


async def test_exec_and_logs_reach_the_container_over_ssh(vpc, keys):
    import io

    from cli.inspect import cloud_exec

    _, target = boot(vpc, keys, "ds-svc-llm-r2s0-ccc", "172.31.9.3")
    client = SSHClient.from_keys(keys, socket_factory=vpc.socket_factory)
    conn = await client.connect(target)
    await start_job(conn, job(), gpu=False)
    conn.close()
    out = io.StringIO()
    assert await cloud_exec(client, target, ["sh", "-c", "echo $MODEL; exit 3"], stdout=out) == 3
    assert out.getvalue() == "tiny\n"
    logs = io.StringIO()
    await until(lambda: _logs_have(client, target, logs, "starting"), what="the job's output")
    assert SECRET not in logs.getvalue()


async def _logs_have(client, target, buffer, text) -> bool:
    import io

    from cli.inspect import cloud_logs

    out = io.StringIO()
    await cloud_logs(client, target, follow=False, stdout=out)
    buffer.write(out.getvalue())
    return text in out.getvalue()


async def test_a_tunnel_whose_instance_is_gone_ends(vpc, keys, tmp_path):
    host, target = boot(vpc, keys, "ds-svc-llm-r3s0-ddd", "172.31.9.4")
    client = SSHClient.from_keys(keys, socket_factory=vpc.socket_factory)
    gone = asyncio.Event()

    async def wanted() -> bool:
        return not gone.is_set()

    sock = tmp_path / "tunnels" / "r3.sock"
    tunnel = Tunnel(client, target, sock, 8000, still_wanted=wanted, backoff=(0.05, 0.2)).start()
    await tunnel.wait_up(20)
    host.stop()  # the instance is terminated (through another worker): its sshd goes away
    tunnel.connection.abort()
    gone.set()
    await asyncio.wait_for(tunnel._task, 20)
    assert not sock.exists()


async def test_aes_gcm_first_and_whatever_cipher_the_host_offers(keys):
    """AES-GCM first (chacha20-poly1305 cost asyncssh twice the CPU per request: bench/tunnel.py); a host
    without it still connects."""
    import asyncssh

    host = keys.host_key("ds-svc-llm-r4s0-eee")
    client = SSHClient(asyncssh.import_private_key(keys.client_key_path.read_bytes()))
    for offered, expected in ((None, "aes128-gcm@openssh.com"),
                              (["chacha20-poly1305@openssh.com"], "chacha20-poly1305@openssh.com")):
        server = await asyncssh.create_server(
            asyncssh.SSHServer, "127.0.0.1", 0, server_host_keys=[asyncssh.import_private_key(host.private_openssh)],
            authorized_client_keys=asyncssh.import_authorized_keys(keys.client_public()),
            **({"encryption_algs": offered} if offered else {}))
        try:
            conn = await client.connect(SSHTarget("127.0.0.1", host.public_openssh, port=server.get_port()))
            assert conn.get_extra_info("send_cipher") == expected
            conn.close()
        finally:
            server.close()
