"""The gateway control app (aiohttp, 127.0.0.1 only): owns the routes, drives nginx, serves stats.

Every route change is applied to a copy of the state, rendered, and reloaded into nginx by a
single worker task; changes that queue up meanwhile go out together in the next reload
(coalescing). A caller gets its answer only once nginx serves a configuration containing its
change, so after ``DELETE .../replicas/r`` returns no new request reaches ``r``. The same task starts
nginx again if it dies; the routes survive a restart of the gateway itself in ``state.json``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import contextlib
import ipaddress
import json
import logging
import os
import random
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Callable

from aiohttp import web

from backends import local_net
from gateway.activator import MAX_HELD, Activator
from gateway.api import make_app
from gateway.metrics import GatewayMetrics
from gateway.nginx import Nginx, NginxError, fetch_generation
from gateway.render import render_config
from gateway.stats import LogTailer, StatsCollector
from gateway.upstreams import UpstreamPolicy, UpstreamRefused
from gateway.workers import worker_identity
from connect.files import write_once
from models.gateway import CONTROL_TOKEN_FILE, GatewayState, StatsReport

log = logging.getLogger("durastack.gateway")
NGINX_CHECK = 0.5  # seconds between checks that nginx still runs (a dead one is restarted)
Op = Callable[[GatewayState], GatewayState]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports of 127.0.0.1, below the kernel's ephemeral range, for servers started a little
    later. In that range a port let go is anyone's next random one: a stack's Temporal dev server, which picks
    random ports for its HTTP API, metrics and internal services, took the gateway's before it started. Each
    socket is held until all are chosen, so no port is given twice."""
    low = _ephemeral_low()
    tries = [random.randrange(PORTS_FROM, low) for _ in range(64 * n)] if low > PORTS_FROM else []
    with contextlib.ExitStack() as held:
        socks: list[socket.socket] = []
        for port in tries + [0] * n:  # 0: any free port, if none was found below the range
            if len(socks) == n:
                break
            s = held.enter_context(socket.socket())
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]


PORTS_FROM = 10000  # clear of the ports services are given by default (7233, 8000, 8233, …)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range, where bind(0) and outgoing connections draw from."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class GatewayServer:
    """Control app plus the nginx it drives. Ports of 0 are chosen at start; read them after."""

    def __init__(self, runtime_dir: str | os.PathLike, *, listen_port: int = 0, control_port: int = 0,
                 worker_processes: int = 2, rotate_bytes: int = 64 << 20, tick: float = 5.0,
                 max_held: int = MAX_HELD, host: str = "127.0.0.1", control_token: str | None = None,
                 upstreams: UpstreamPolicy | None = None, netns: bool = False):
        """``host``: where nginx and the control API listen. ``control_token``: the bearer token every control call
        needs; None: the one in ``<runtime_dir>/control.token``, made on the first start (loopback only: workers
        on other hosts cannot read that file, so off loopback it must be given). ``upstreams``: the addresses
        registrations may name; None: :meth:`UpstreamPolicy.default` (from the environment). ``netns``: nginx runs in
        the home's gateway namespace (``backends.local_net``), linked to the local backend's service networks, and
        connects to local replicas there directly; it still listens on ``host``, and reaches the control app on the
        namespace's own loopback."""
        if not _loopback(host) and not control_token:
            raise ValueError(f"the gateway listens on {host}: set DURASTACK_GATEWAY_CONTROL_TOKEN so that only "
                             "the workers and the CLI can change its routes and tokens")
        self.host, self.control_token = host, control_token
        self.runtime_dir = Path(runtime_dir).absolute()
        # The home's gateway namespace, made (if missing) by start.
        self.netns = local_net.NETNS_DIR / local_net.gateway_nsname(self.runtime_dir.parent) if netns else None
        self.upstreams = upstreams or UpstreamPolicy.default(
            self.runtime_dir, loopback=_loopback(host), service_networks=str(local_net.POOL) if netns else None)
        self.workers = worker_identity(self.upstreams.unix_dirs, home=self.runtime_dir.parent)
        self.listen_port, self.control_port = listen_port, control_port
        self.worker_processes, self.rotate_bytes, self.tick = worker_processes, rotate_bytes, tick
        self.access_log = self.runtime_dir / "access.log"
        self.state_path = self.runtime_dir / "state.json"
        self.state = GatewayState()
        self.collector = StatsCollector()
        self.activator = Activator(lambda: self.state, self.collector, max_held=max_held, netns=self.netns)
        self.metrics = GatewayMetrics(self.activator, lambda: self.state.services, since=time.time())
        self._tailer = LogTailer(self.access_log)
        self._nginx: Nginx | None = None
        self._runner: web.AppRunner | None = None
        self._pending: list[tuple[Op, asyncio.Future]] = []
        self._wakeup = asyncio.Event()
        self._attempted = 0  # highest generation ever sent to nginx, so a generation is never reused
        self._tasks: list[asyncio.Task] = []
        self.reloads = 0  # nginx reloads done: fewer than changes when they were coalesced

    @property
    def loopback(self) -> bool:
        return _loopback(self.host)

    @property
    def internal_secret(self) -> str:
        """What nginx sends the activator in ``X-Durastack-Gateway``: derived from the control token, so that it
        outlives a restart of this app (an nginx it adopts still sends the old value) and opens nothing else."""
        return hmac.new(self.control_token.encode(), b"durastack nginx to activator", hashlib.sha256).hexdigest()

    @property
    def url(self) -> str:
        return f"http://{_reachable(self.host)}:{self.listen_port}"

    @property
    def control_url(self) -> str:
        return f"http://{_reachable(self.host)}:{self.control_port}"

    async def start(self) -> None:
        self.runtime_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.workers is not None and not self.workers.privileged:
            os.chmod(self.runtime_dir, 0o711)  # the workers reach their temp dirs; nothing to list or read here
        if not self.control_token:
            # Every local user reaches 127.0.0.1: the control API authenticates there too. Written whole, then
            # linked: a CLI or worker reading it never sees half a token, and two starts agree on one.
            path = self.runtime_dir / CONTROL_TOKEN_FILE
            self.control_token = write_once(path, secrets.token_urlsafe(32) + "\n", 0o600).strip()
            os.chmod(path, 0o600)  # a copy restored with a wider mode is narrowed again
        if self.state_path.exists():
            self.state = self._allowed(GatewayState.model_validate_json(self.state_path.read_text()))
        self._attempted = self.state.generation
        self._remember(self.state)
        # Handler cancellation: a request held by the activator is released when its client goes.
        self._runner = web.AppRunner(make_app(self), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        if self.netns is not None:
            await asyncio.to_thread(local_net.gateway_namespace, self.runtime_dir.parent)
        previous = self._previous_endpoints()
        try:
            await self._listen_control(previous.get("control_port"))
            self.upstreams.own.add((self.host, self.control_port))
            if not await self._adopt_nginx(previous.get("listen_port")):
                await self._start_nginx()
        except BaseException:
            await self._runner.cleanup()
            raise
        self._tasks = [asyncio.create_task(self._apply_loop()), asyncio.create_task(self._tick_loop())]
        self._write_endpoints()

    def _previous_endpoints(self) -> dict:
        try:
            return json.loads((self.runtime_dir / "endpoints.json").read_text())
        except (OSError, ValueError):
            return {}

    async def _listen_control(self, previous: int | None) -> None:
        # An nginx left by a crashed run sends the activator's requests to the control port it knew: take that
        # one again when no port was asked for, so they reach us before the reload that adoption makes.
        if self.control_port == 0 and previous:
            try:
                await web.TCPSite(self._runner, self.host, previous).start()
                self.control_port = previous
            except OSError:
                pass
        if not self._runner.addresses:
            await web.TCPSite(self._runner, self.host, self.control_port).start()
            self.control_port = self._runner.addresses[0][1]
        if self.netns is not None:
            # nginx, in the gateway namespace, reaches the activator on that namespace's loopback, same port.
            sock = local_net.listener_in(self.netns, "127.0.0.1", self.control_port)
            await web.SockSite(self._runner, sock).start()

    async def _adopt_nginx(self, port: int | None) -> bool:
        """Take over the nginx a crashed control app left serving (True), and reload it with what we hold now."""
        if not port or self.listen_port not in (0, port):
            return False
        nginx = self._nginx_on(port)
        if not await nginx.adopt():
            return False
        self.listen_port, self._nginx = port, nginx
        self.upstreams.own.add((self.host, port))
        # A new generation: the adopted nginx may serve one later than our state (a crash mid-reload).
        served = await fetch_generation(port) or 0
        state = self.state.model_copy(update={"generation": max(self._attempted, served) + 1})
        self._attempted = state.generation
        try:
            await nginx.reload(self._render(state), state.generation)
        except NginxError as e:
            log.error("adopted nginx (pid %s) refused the reload, starting a new one: %s", nginx.pid, e)
            await nginx.stop()
            self._nginx = None
            return False
        self.state = state
        _write_private(self.state_path, state.model_dump_json(indent=1))
        log.info("adopted nginx (pid %s) on port %s, left serving by an earlier run; generation %s",
                 nginx.pid, port, state.generation)
        return True

    def _write_endpoints(self) -> None:
        endpoints = {"listen_port": self.listen_port, "control_port": self.control_port,
                     "pid": os.getpid(), "nginx_pid": self._nginx.pid}
        _write_private(self.runtime_dir / "endpoints.json", json.dumps(endpoints))

    async def _start_nginx(self) -> None:
        pick = self.listen_port == 0
        for attempt in range(3 if pick else 1):  # an ephemeral pick can race another process
            if pick:
                self.listen_port = free_port()
            self.upstreams.own.add((self.host, self.listen_port))
            self._nginx = self._nginx_on(self.listen_port)
            try:
                return await self._nginx.start(self._render(self.state), self.state.generation)
            except NginxError:
                if attempt == (2 if pick else 0):
                    raise

    def _nginx_on(self, port: int) -> Nginx:
        return Nginx(self.runtime_dir, port=port, user=self.workers.directive() if self.workers else None,
                     host=self.host, netns=self.netns)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        _fail(self._pending, NginxError("gateway stopping"))
        await self.activator.stop()  # held requests answer now: nginx need not wait for them
        if self._nginx is not None:
            await self._nginx.stop()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.netns is not None:
            await asyncio.to_thread(local_net.release_gateway_namespace, self.runtime_dir.parent)
        self._tailer.close()

    def draining(self) -> int:
        return self._nginx.draining() if self._nginx is not None else 0

    def _render(self, state: GatewayState) -> str:
        return render_config(state, listen_port=self.listen_port, runtime_dir=str(self.runtime_dir),
                             access_log=str(self.access_log), control_port=self.control_port,
                             worker_processes=self.worker_processes, host=self.host,
                             internal_secret=self.internal_secret)

    def _allowed(self, state: GatewayState) -> GatewayState:
        """``state`` without the upstreams the policy refuses: a state.json written before it, or by hand."""
        for route in list(state.services.values()):
            for u in route.upstreams:
                try:
                    self.admit(u.address)
                except UpstreamRefused as e:
                    log.warning("dropping %s of %s from the saved routes: %s", u.replica_id, route.name, e)
                    state = state.unregister(route.name, u.replica_id)
        return state

    def _remember(self, state: GatewayState) -> None:
        for route in state.services.values():
            for u in route.upstreams:
                self.collector.remember(route.name, u.address, u.group)

    def admit(self, address: str) -> None:
        """Before nginx routes to ``address``: refuse it (UpstreamRefused) unless allowed, and let the workers
        reach it (a replica's socket is made by the replica, for its own user)."""
        self.upstreams.check(address)
        if self.workers is not None and address.startswith("unix:"):
            self.workers.grant(address[len("unix:"):])

    async def apply(self, op: Op) -> GatewayState:
        """Queue a state change; return the state once nginx serves it (raises the op's error)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((op, fut))
        self._wakeup.set()
        # shield: a caller that goes away must not cancel a reload that others wait on
        return await asyncio.shield(fut)

    async def _apply_loop(self) -> None:
        while True:
            try:  # woken by a change, or every NGINX_CHECK seconds to see that nginx still runs
                await asyncio.wait_for(self._wakeup.wait(), NGINX_CHECK)
            except asyncio.TimeoutError:
                pass
            self._wakeup.clear()
            await self._revive_nginx()
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await self._apply_batch(batch)
                finally:  # cancelled by stop(): nobody may be left waiting
                    _fail(batch, NginxError("gateway stopping"))

    async def _revive_nginx(self) -> None:
        """nginx's master died (killed, crashed): start a new one on the routes we hold, so that nothing has to
        register again. Runs in the apply loop, so never during a reload."""
        if self._nginx.running():
            return
        log.error("nginx (pid %s) exited; starting it again with generation %s", self._nginx.pid,
                  self.state.generation)
        try:
            await self._nginx.restart(self._render(self.state), self.state.generation)
        except NginxError as e:  # tried again at the next check; meanwhile changes fail (503) and are retried
            log.error("nginx restart failed: %s", e)
            return
        self._write_endpoints()
        log.info("nginx serves again (pid %s)", self._nginx.pid)

    async def _apply_batch(self, batch: list[tuple[Op, asyncio.Future]]) -> None:
        state, errors = self.state, {}
        for op, fut in batch:
            try:
                state = op(state)
            except Exception as e:  # e.g. an unknown service: only that caller fails
                errors[fut] = e
        if state is not self.state:
            if state.generation <= self._attempted:
                state = state.model_copy(update={"generation": self._attempted + 1})
            self._attempted = state.generation
            try:
                await self._nginx.reload(self._render(state), state.generation)
            except Exception as e:
                log.error("gateway reload failed, keeping generation %s: %s", self.state.generation, e)
                errors = {fut: errors.get(fut, e) for _, fut in batch}
            else:
                self.reloads += 1
                self.state = state
                _write_private(self.state_path, state.model_dump_json(indent=1))
                self._remember(state)
                self.metrics.forget(state.services)
                self.activator.forget(state.services)
                await self.activator.notify()  # nginx serves the change: held requests may go
        for op, fut in batch:
            if fut in errors:
                _fail([(op, fut)], errors[fut])
            elif not fut.done():
                fut.set_result(self.state)

    def collect(self, now: float | None = None) -> StatsReport:
        now = time.time() if now is None else now
        batch = self.collector.feed(self._tailer.read_lines(), now)
        self.metrics.observe(batch, self.collector.group_of)
        held, total = self.activator.held, self.activator.held_total
        return StatsReport(collected_at=now, services={
            name: self.collector.service_stats(name, now).model_copy(
                update={"held": held[name], "held_total": total[name]})
            for name in sorted(self.state.services)})

    async def _tick_loop(self) -> None:
        # Keeps frames bounded between stats calls, and the access log from growing forever.
        while True:
            await asyncio.sleep(self.tick)
            try:
                self.collect()
                if self.access_log.exists() and self.access_log.stat().st_size > self.rotate_bytes:
                    os.replace(self.access_log, self.access_log.with_name("access.log.1"))
                    self._nginx.reopen_logs()
            except Exception:
                log.exception("gateway stats tick failed")


def _fail(batch: list[tuple[Op, asyncio.Future]], error: BaseException) -> None:
    for _, fut in batch:
        if not fut.done():
            fut.set_exception(error)
            fut.exception()  # retrieved here: its caller may have gone away


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _reachable(host: str) -> str:
    """An address of this machine that reaches a socket bound to ``host`` (a wildcard is reached on loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def run_gateway(runtime_dir: str | os.PathLike, listen_port: int, control_port: int,
                      host: str = "127.0.0.1", control_token: str | None = None, netns: bool = False) -> None:
    """Run until SIGINT/SIGTERM. Actual ports are written to ``<runtime_dir>/endpoints.json``."""
    server = GatewayServer(runtime_dir, listen_port=listen_port, control_port=control_port, host=host,
                           control_token=control_token, netns=netns)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    log.info("gateway on %s, control app on %s", server.url, server.control_url)
    try:
        await stopping.wait()
    finally:
        await server.stop()
