"""`durastack server`: the real stack (Temporal dev server, gateway with nginx, worker) in a temp home.

Every server runs as a subprocess on ephemeral 127.0.0.1 ports; teardown ends each process we
started by its PID (and the children the server recorded). Every wait is a bounded poll.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import grp
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer
from temporalio.service import RPCError, RPCStatusCode

from cli import client as cli_client
from cli import stack
from models.gateway import hash_token
from models.settings import SEARCH_ATTRIBUTES, Settings

DURASTACK = str(Path(sys.executable).with_name("durastack"))
TEMPORAL = str(Path(sys.executable).with_name("temporal"))
UP_TIMEOUT = 90.0
PERSIST_WF = "durastack-test-persist"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DURASTACK_")}
    env["DURASTACK_WORKER_METRICS_PORT"] = str(free_ports(1)[0])  # not the default: other stacks may run
    env.update(extra)
    return env


def alive(pid: int, start: int | None = None) -> bool:
    ticks = stack._start_ticks(pid)
    return ticks is not None and (start is None or ticks == start)


def wait_for(cond, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def http_status(port: int, path: str = "/healthz") -> int | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n".encode())
            return int(s.recv(64).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def temporal_cli(home: Path, port: int, *args: str) -> subprocess.CompletedProcess:
    """The `temporal` CLI with the home's key, as `durastack temporal-env` sets it (the embedded Temporal's door)."""
    from connect.connection import embedded_api_key

    key = embedded_api_key(Settings(home=home), {})  # the server has no DURASTACK_CODEC_KEY (clean_env)
    env = clean_env(**({"TEMPORAL_API_KEY": key, "TEMPORAL_TLS": "false"} if key else {}))
    return subprocess.run([TEMPORAL, *args, "--address", f"127.0.0.1:{port}"], capture_output=True, text=True,
                          timeout=30, env=env)


class Server:
    """One `durastack server` subprocess; remembers every child PID it ever recorded."""

    def __init__(self, home: Path, ports: dict[str, int], env: dict | None = None):
        self.home, self.ports = home, ports
        self.out_path = home.parent / f"{home.name}-server-{time.monotonic_ns()}.out"
        argv = [DURASTACK, "server", "--home", str(home)]
        for flag, port in ports.items():
            argv += [f"--{flag.replace('_', '-')}", str(port)]
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env or clean_env(), start_new_session=True)
        self.seen: dict[int, int] = {}  # pid -> start ticks, of children seen in server.json

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def state(self) -> dict:
        state = stack.read_state(self.home) or {}
        for rec in (state.get("children") or {}).values():
            if rec.get("pid") and rec.get("start") is not None:
                self.seen[rec["pid"]] = rec["start"]
        return state

    def child(self, name: str) -> dict | None:
        return (self.state().get("children") or {}).get(name)

    def wait_up(self) -> None:
        def up():
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.output}"
            worker = self.child("worker")
            return (worker and alive(worker["pid"]) and http_status(self.ports["gateway_port"]) == 200
                    and temporal_cli(self.home, self.ports["temporal_port"], "operator", "namespace", "list").returncode == 0)
        wait_for(up, UP_TIMEOUT, "the stack to come up")
        assert "durastack server is up" in self.output

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout)

    def kill_all(self) -> None:
        """Teardown: whatever survived, by PID."""
        if self.proc.poll() is None:
            try:
                self.stop(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for pid, start in self.seen.items():
            if alive(pid, start):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture(scope="module")
def servers():
    started: list[Server] = []
    yield started
    for s in started:
        s.kill_all()


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ds") / "home"


@pytest.fixture(scope="module")
def ports() -> dict[str, int]:
    return dict(zip(["temporal_port", "ui_port", "gateway_port", "gateway_control_port", "codec_port"], free_ports(5)))


@pytest.fixture(scope="module")
def running(home, ports, servers) -> Server:
    server = Server(home, ports)
    servers.append(server)
    server.wait_up()
    return server


# ---- the running stack -----------------------------------------------------------------------

@pytest.mark.e2e
def test_stack_up_with_search_attributes(running: Server):
    state = running.state()
    assert set(state["children"]) - {"door"} == {"temporal", "gateway", "worker"}
    assert state["pid"] == running.proc.pid
    res = temporal_cli(running.home, running.ports["temporal_port"], "operator", "search-attribute", "list", "-o", "json")
    assert res.returncode == 0, res.stderr
    for name in SEARCH_ATTRIBUTES:
        assert name in res.stdout
    for name in ("temporal", "gateway", "worker"):
        assert (running.home / "logs" / f"{name}.log").exists()
    assert f"http://127.0.0.1:{running.ports['ui_port']}" in running.output
    assert f"http://127.0.0.1:{running.ports['gateway_control_port']}/metrics" in running.output
    # The first start made the gateway's `default` token and showed it once; the gateway keeps its hash.
    token = re.search(r"Token +default: (\S+)", running.output).group(1)
    gateway_state = (running.home / "gateway" / "state.json").read_text()
    assert token not in gateway_state and hash_token(token) in gateway_state
    assert (running.home / "server.lock").read_text().strip() == str(running.proc.pid)


@pytest.mark.e2e
def test_home_logs_and_databases_are_private(running: Server):
    from backends.local import confinement_reason
    home = running.home.stat()
    # 700, or 710 with the group of nginx's unprivileged workers (search only), which then run as nobody
    assert home.st_mode & 0o777 == 0o700 or (home.st_mode & 0o777 == 0o710 and home.st_gid == grp.getgrnam("nogroup").gr_gid)
    made = [p for p in running.home.rglob("*") if p.is_file() and not p.is_symlink()
            and (p.suffix in (".log", ".db", ".json", ".key") or p.name.endswith(("-wal", "-shm")))]
    assert any(p.suffix == ".log" for p in made) and any(p.suffix == ".db" for p in made)
    for path in made:
        assert path.stat().st_mode & 0o007 == 0, f"{path} is world-accessible"
    assert f"; {confinement_reason()}" in running.output  # the banner's Replicas line


@pytest.mark.e2e
def test_second_server_same_home_says_already_running(running: Server):
    other = dict(zip(running.ports, free_ports(len(running.ports))))
    argv = [DURASTACK, "server", "--home", str(running.home)]
    for flag, port in other.items():
        argv += [f"--{flag.replace('_', '-')}", str(port)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=clean_env())
    assert res.returncode == 1
    assert f"durastack server is already running (pid {running.proc.pid}, home {running.home})" in \
        " ".join((res.stdout + res.stderr).split())


def _door(running: Server) -> bool:
    """Whether the embedded Temporal is behind its door (cli/door.py): wherever the machine allows one."""
    from cli.door import possible

    assert ("door" in running.state()["children"]) == possible()[0]
    return possible()[0]


@pytest.mark.e2e
def test_web_ui_decodes_secrets_through_the_stack_codec_server(running: Server):
    import base64

    import httpx
    from temporalio.api.common.v1 import Payload

    from cli import door
    from cli.codec_server import codec_endpoint
    from connect.codec import SecretCodec, load_keys
    from models.secrets import SECRET_MARK

    assert oct((running.home / "codec.key").stat().st_mode & 0o777) == "0o600"  # created by the server
    keys = load_keys(running.home, {})
    ui, codec_url = f"http://127.0.0.1:{running.ports['ui_port']}", f"http://127.0.0.1:{running.ports['codec_port']}"
    if _door(running):  # served by the door, behind the UI's login: no credential in the endpoint
        login = httpx.BasicAuth(door.UI_USER, door.ui_password(keys))
        endpoint = f"{ui}{door.CODEC_PATH}"
        assert f"Codec     {endpoint}, behind the Web UI's login" in running.output
        assert httpx.post(f"{endpoint}/decode", json={"payloads": []}, headers={"Origin": ui}).status_code == 401
        with pytest.raises(httpx.ConnectError):  # the codec server listens only in the door's namespace
            httpx.post(f"{codec_url}/decode", json={"payloads": []}, headers={"Origin": ui})
    else:  # the credential rides in the UI's URL
        login, endpoint = None, codec_endpoint(codec_url, keys)
        assert f"Codec     {codec_url}" in running.output
        assert httpx.post(f"{codec_url}/decode", json={"payloads": []}, headers={"Origin": ui}).status_code == 404
    assert httpx.get(f"{ui}/api/v1/settings", auth=login, timeout=5).json()["Codec"]["Endpoint"] == endpoint
    plain = Payload(metadata={"encoding": b"json/plain"},
                    data=json.dumps({"HF_TOKEN": SECRET_MARK + "hf_abc"}).encode())
    sealed = asyncio.run(SecretCodec(keys).encode([plain]))[0]
    assert b"hf_abc" not in sealed.data
    body = {"payloads": [{"metadata": {"encoding": base64.b64encode(b"json/plain").decode()},
                          "data": base64.b64encode(sealed.data).decode()}]}
    res = httpx.post(f"{endpoint}/decode", json=body, headers={"Origin": ui, "X-Namespace": "default"}, auth=login,
                     timeout=5)
    assert res.status_code == 200 and res.headers["Access-Control-Allow-Origin"] == ui
    assert json.loads(base64.b64decode(res.json()["payloads"][0]["data"])) == {"HF_TOKEN": SECRET_MARK + "hf_abc"}


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    """``argv`` run as another local user of the machine: nobody, with no group of ours."""
    return subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "env", "HOME=/tmp",
                           *argv], capture_output=True, text=True, timeout=30)


@pytest.mark.e2e
def test_another_local_user_cannot_use_the_embedded_temporal(running: Server):
    if not _door(running):
        pytest.skip("no door here (not root): the banner says Temporal is open to every local user")
    port = running.ports["temporal_port"]
    # The `temporal` CLI as nobody, and as anyone without the home's key: refused, UNAUTHENTICATED.
    for res in (_as_nobody(TEMPORAL, "workflow", "list", "--address", f"127.0.0.1:{port}"),
                subprocess.run([TEMPORAL, "workflow", "list", "--address", f"127.0.0.1:{port}"], capture_output=True,
                               text=True, timeout=30, env=clean_env())):
        assert res.returncode != 0 and "unauthenticated" in (res.stdout + res.stderr).lower(), res
    # With what `durastack temporal-env` prints, the owner's CLI gets in.
    printed = subprocess.run([DURASTACK, "temporal-env"], capture_output=True, text=True, timeout=30,
                             env=clean_env(DURASTACK_HOME=str(running.home), DURASTACK_TEMPORAL_PORT=str(port)))
    env = dict(re.findall(r"^export (\w+)=(\S+)$", printed.stdout, re.M))
    assert set(env) == {"TEMPORAL_ADDRESS", "TEMPORAL_NAMESPACE", "TEMPORAL_API_KEY", "TEMPORAL_TLS"}, printed
    res = subprocess.run([TEMPORAL, "workflow", "list"], capture_output=True, text=True, timeout=30, env=clean_env(**env))
    assert res.returncode == 0, res.stderr
    # The dev server itself is in a network namespace of its own: none of its ports is on this machine's loopback.
    temporal = running.child("temporal")["pid"]
    assert os.readlink(f"/proc/{temporal}/ns/net") != os.readlink("/proc/self/ns/net")
    # No process holds a key of the door in its arguments.
    from cli import door
    from cli.codec_server import codec_credential
    from connect.codec import load_keys
    from connect.connection import embedded_api_key

    keys = load_keys(running.home, {})
    secrets = [embedded_api_key(Settings(home=running.home), {}).encode(), door.ui_password(keys).encode(),
               codec_credential(keys.keys[0]).encode()]
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes() if entry.isdigit() else b""
        except OSError:
            continue
        assert not any(secret in cmdline for secret in secrets), f"pid {entry}: {cmdline[:200]!r}"


@pytest.mark.e2e
def test_a_client_of_another_home_is_refused_and_told_why(running: Server, tmp_path: Path):
    if not _door(running):
        pytest.skip("no door here (not root)")
    other = tmp_path / "other-home"
    res = subprocess.run([DURASTACK, "ps"], capture_output=True, text=True, timeout=60,
                         env=clean_env(DURASTACK_HOME=str(other), DURASTACK_TEMPORAL_PORT=str(running.ports["temporal_port"])))
    assert res.returncode == 2
    assert f"refused this client: it takes the key of the durastack home that runs it, and {other} is not that home" \
        in " ".join(res.stderr.split())
    res = subprocess.run([DURASTACK, "ui"], capture_output=True, text=True, timeout=60,
                         env=clean_env(DURASTACK_HOME=str(running.home), DURASTACK_UI_PORT=str(running.ports["ui_port"])))
    from cli import door
    from connect.codec import load_keys

    password = door.ui_password(load_keys(running.home, {}))
    assert f"password  {password}" in res.stdout and f"http://durastack:{password}@127.0.0.1:" in res.stdout


@pytest.mark.e2e
def test_the_web_ui_opens_to_its_login_its_host_and_its_origin(running: Server):
    if not _door(running):
        pytest.skip("no door here (not root)")
    from cli import door
    from connect.codec import load_keys

    ui = f"127.0.0.1:{running.ports['ui_port']}"
    password = door.ui_password(load_keys(running.home, {}))

    def status(*args: str, user: str | None = f"{door.UI_USER}:{password}") -> str:
        argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *(["-u", user] if user else []), *args]
        res = _as_nobody(*argv)  # from another local user: only what is sent matters
        assert res.returncode == 0, res.stderr
        return res.stdout

    page = f"http://{ui}/api/v1/namespaces/default/workflows"
    assert status(page, user=None) == "401"
    assert status(page, user=f"{door.UI_USER}:wrong") == "401"
    assert status(page) == "200"
    assert status("-H", f"Host: localhost:{running.ports['ui_port']}", page) == "200"
    assert status("-H", f"Host: rebound.example:{running.ports['ui_port']}", page) == "403"  # DNS rebinding
    signal_url = f"http://{ui}/api/v1/namespaces/default/workflows/x/signal/y"
    assert status("-X", "POST", "-H", "Origin: http://evil.example", signal_url) == "403"  # another site's page
    assert status("-X", "POST", signal_url) == "403"  # a change must come from the UI's own pages
    assert status("-X", "POST", "-H", f"Origin: http://{ui}", signal_url) not in ("401", "403")


@pytest.mark.e2e
def test_killed_worker_is_restarted(running: Server):
    old = running.child("worker")
    os.kill(old["pid"], signal.SIGKILL)
    new = wait_for(lambda: (w := running.child("worker")) and w["pid"] != old["pid"] and alive(w["pid"]) and w,
                   30, "a new worker")
    assert new["restarts"] == old["restarts"] + 1
    assert "worker (pid" in running.output and "restarting" in running.output


@pytest.mark.e2e
def test_killed_temporal_and_gateway_are_restarted(running: Server):
    killed = ("door", "temporal", "gateway") if _door(running) else ("temporal", "gateway")
    old = {name: running.child(name) for name in killed}
    for name in killed:
        os.kill(old[name]["pid"], signal.SIGKILL)

    def restarted(name):
        rec = running.child(name)
        return rec and rec["pid"] != old[name]["pid"] and alive(rec["pid"])
    wait_for(lambda: all(map(restarted, killed)), 60, f"{', '.join(killed)} to restart")
    running.wait_up()  # Temporal answers, /healthz through nginx, a live worker (which may have restarted)


@pytest.mark.e2e
def test_sigint_stops_all_then_restart_keeps_state(running: Server, home: Path, ports, servers):
    # A workflow on a task queue no one polls: it stays Running, so it must survive the restart.
    res = temporal_cli(home, ports["temporal_port"], "workflow", "start", "--type", "PersistCheck",
                       "--task-queue", "durastack-test-nobody", "--workflow-id", PERSIST_WF)
    assert res.returncode == 0, res.stderr
    children = {rec["pid"]: rec["start"] for rec in running.state()["children"].values()}
    gateway_pid = running.child("gateway")["pid"]
    nginx = json.loads((home / "gateway" / "endpoints.json").read_text()).get("nginx_pid")

    assert running.stop() == 0
    wait_for(lambda: not any(alive(p, s) for p, s in children.items()), 30, "every child to exit")
    if nginx:
        wait_for(lambda: not alive(nginx), 10, "nginx to exit")
    assert not stack._group_members(gateway_pid)
    assert not (home / "server.json").exists()
    from backends import local_net
    assert not (local_net.NETNS_DIR / local_net.temporal_nsname(home)).exists()  # the door's namespace is gone
    with open(home / "server.lock", "a") as f:  # the lock is free again
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(f, fcntl.LOCK_UN)
    assert "durastack: stopped" in running.output

    again = Server(home, ports)
    servers.append(again)
    again.wait_up()
    assert "Token " not in again.output  # the gateway kept its tokens: no new default
    res = temporal_cli(home, ports["temporal_port"], "workflow", "describe", "--workflow-id", PERSIST_WF, "-o", "json")
    assert res.returncode == 0, res.stderr
    assert "WORKFLOW_EXECUTION_STATUS_RUNNING" in res.stdout
    res = temporal_cli(home, ports["temporal_port"], "operator", "search-attribute", "list")
    assert all(name in res.stdout for name in SEARCH_ATTRIBUTES)
    temporal_cli(home, ports["temporal_port"], "workflow", "terminate", "--workflow-id", PERSIST_WF, "--reason", "test")
    assert again.stop() == 0


# ---- refusals: nothing is left running -------------------------------------------------------

@pytest.mark.e2e
def test_port_in_use_is_a_clear_error(tmp_path: Path, servers):
    ports = dict(zip(["temporal_port", "ui_port", "gateway_port", "gateway_control_port", "codec_port"], free_ports(5)))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports["gateway_port"]))
        busy.listen()
        server = Server(tmp_path / "home", ports)
        servers.append(server)
        assert server.proc.wait(timeout=30) == 1
    text = " ".join(server.output.split())
    assert f"port {ports['gateway_port']} (gateway) is already in use" in text
    assert "--gateway-port" in text and "DURASTACK_GATEWAY_PORT" in text
    assert not (tmp_path / "home" / "server.json").exists()
    assert http_status(ports["temporal_port"]) is None


@pytest.mark.e2e
def test_unreachable_external_temporal(tmp_path: Path, servers):
    ports = dict(zip(["gateway_port", "gateway_control_port"], free_ports(2)))
    address = f"127.0.0.1:{free_ports(1)[0]}"
    server = Server(tmp_path / "home", ports, env=clean_env(DURASTACK_TEMPORAL_ADDRESS=address))
    servers.append(server)
    assert server.proc.wait(timeout=60) == 1
    text = " ".join(server.output.split())
    assert f"the Temporal server at {address} (DURASTACK_TEMPORAL_ADDRESS) is not reachable" in text
    assert not (tmp_path / "home" / "logs").exists()  # no child was started


# ---- pieces ----------------------------------------------------------------------------------

def test_temporal_argv(tmp_path: Path):
    s = Settings.from_env({}, home=tmp_path, temporal_port=1234, ui_port=1235)
    argv = stack.temporal_argv(s, binary="temporal")
    assert argv[:5] == ["temporal", "server", "start-dev", "--ip", "127.0.0.1"]
    assert argv[argv.index("--port") + 1] == "1234" and argv[argv.index("--ui-port") + 1] == "1235"
    assert argv[argv.index("--db-filename") + 1] == str(tmp_path / "temporal.db")
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--sqlite-pragma"] == ["journal_mode=wal",
                                                                                 "synchronous=normal"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--search-attribute"] == \
        [f"{n}=Keyword" for n in SEARCH_ATTRIBUTES]


@pytest.mark.parametrize("door", [True, False])
def test_the_embedded_temporal_with_and_without_its_door(tmp_path: Path, monkeypatch, door):
    """Where namespaces can be made (root), the dev server starts in the door's namespace and the UI's codec
    endpoint is the door's, with no credential; elsewhere it listens on 127.0.0.1 itself and the endpoint carries
    the credential, as before the door."""
    from cli.codec_server import codec_credential
    from connect.codec import load_keys

    monkeypatch.setattr(stack, "door_possible", lambda: (door, "why"))
    s = Settings.from_env({}, home=tmp_path / "home", temporal_port=1234, ui_port=1235, codec_port=1236)
    s.home.mkdir()
    st = stack.Stack(s)
    st._check_secrets_and_tls()  # makes the codec key, then the UI's codec endpoint
    names = [c.name for c in st.children]
    assert names == (["door"] if door else []) + ["temporal", "gateway", "worker"]
    argv = st._child("temporal").argv
    endpoint = argv[argv.index("--ui-codec-endpoint") + 1]
    credential = codec_credential(load_keys(s.home).keys[0])  # the key the stack holds (this process's)
    if door:
        from backends import local_net
        assert argv[:2] == ["nsenter", f"--net={local_net.NETNS_DIR / local_net.temporal_nsname(s.home)}"]
        assert endpoint == "http://127.0.0.1:1235/_durastack/codec" and credential not in " ".join(argv)
    else:
        assert argv[0] != "nsenter" and endpoint == f"http://127.0.0.1:1236/{credential}"


def test_gateway_and_worker_argv(tmp_path: Path, monkeypatch):
    s = Settings.from_env({}, home=tmp_path, gateway_port=9000, gateway_control_port=9001)
    import backends.local as local
    # nginx joins the service networks exactly when the local backend makes them
    netns = ["--netns"] if local.networks_available() else []
    assert stack.gateway_argv(s) == [sys.executable, "-m", "gateway", "--runtime-dir", str(tmp_path / "gateway"),
                                     "--port", "9000", "--control-port", "9001", *netns]
    # A cloud reached at private addresses: nginx stays in the host's network, which reaches them.
    (tmp_path / "config.yml").write_text("backends:\n  aws:\n    data_path: private\n"
                                         "    gateway_cidrs: [10.0.0.5/32]\n")
    assert stack.gateway_argv(s)[-1] == "9001"
    (tmp_path / "config.yml").unlink()
    monkeypatch.setenv(local.ENV_ISOLATION, "off")
    assert stack.gateway_argv(s)[-1] == "9001"
    assert stack.worker_argv() == [sys.executable, "-m", "worker"]
    monkeypatch.setenv(stack.ENV_WORKER_CMD, "python -c 'import time; time.sleep(9)'")
    assert stack.worker_argv() == ["python", "-c", "import time; time.sleep(9)"]


def test_lock_is_exclusive(tmp_path: Path):
    fd = stack.acquire_lock(tmp_path)
    try:
        with pytest.raises(stack.AlreadyRunning, match=rf"already running \(pid {os.getpid()}, home {tmp_path}\)"):
            stack.acquire_lock(tmp_path)
    finally:
        stack.release_lock(fd)
    stack.release_lock(stack.acquire_lock(tmp_path))


def test_check_ports(tmp_path: Path):
    a, b = free_ports(2)
    s = Settings.from_env({}, home=tmp_path, gateway_port=a, gateway_control_port=a)
    with pytest.raises(stack.StackError, match="given to both"):
        stack.check_ports(s, ["gateway_port", "gateway_control_port"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", b))
        busy.listen()
        s = Settings.from_env({}, home=tmp_path, temporal_port=b)
        with pytest.raises(stack.StackError, match=rf"port {b} \(Temporal gRPC\).*--temporal-port or DURASTACK_TEMPORAL_PORT"):
            stack.check_ports(s, ["temporal_port"])


async def test_connect_raises_control_plane_down(tmp_path: Path):
    s = Settings.from_env({}, home=tmp_path, temporal_port=free_ports(1)[0])
    with pytest.raises(cli_client.ControlPlaneDown) as info:
        await cli_client.connect(s, timeout=5)
    assert str(info.value) == f"control plane not running at {s.address}; start it with `durastack server`"


async def test_rpc_maps_transport_errors_only(tmp_path: Path):
    s = Settings.from_env({}, home=tmp_path)

    async def fail(status):
        raise RPCError("boom", status, b"")

    with pytest.raises(cli_client.ControlPlaneDown):
        await cli_client.rpc(asyncio.sleep(5), s, timeout=0.05)
    with pytest.raises(cli_client.ControlPlaneDown):
        await cli_client.rpc(fail(RPCStatusCode.UNAVAILABLE), s)
    with pytest.raises(RPCError):  # an answer from a live server stays the command's business
        await cli_client.rpc(fail(RPCStatusCode.NOT_FOUND), s)
    assert await cli_client.rpc(asyncio.sleep(0, "ok"), s) == "ok"


def test_run_exits_2_when_down(tmp_path: Path):
    s = Settings.from_env({}, home=tmp_path, temporal_port=free_ports(1)[0])
    with pytest.raises(typer.Exit) as info:
        cli_client.run(cli_client.connect(s))
    assert info.value.exit_code == 2


def test_stop_local_replicas_hook(tmp_path: Path, monkeypatch):
    stack.stop_local_replicas(tmp_path)  # the real local backend, nothing to stop: a no-op
    import backends.local
    calls = []
    monkeypatch.setattr(backends.local, "stop_all", calls.append, raising=False)
    stack.stop_local_replicas(tmp_path)
    assert calls == [tmp_path]
