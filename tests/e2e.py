"""Shared pieces of the end-to-end tests: a `durastack server` in a temp home, CLI calls, load."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.stack import port_env

BIN = Path(sys.executable).parent


def until(check, timeout: float = 60.0, interval: float = 0.2, what="condition"):
    """``what``: the condition's name, or a function that says it (and what explains its failure) when it fails."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what() if callable(what) else what} not met within {timeout}s (last: {last!r})")


def evidence(stack: "Stack", name: str) -> str:
    """What a failed wait is explained by: the service's events and the end of the worker's log."""
    events = stack.cli("events", name, timeout=60)
    log = stack.home / "logs" / "worker.log"
    tail = log.read_text(errors="replace").splitlines()[-80:] if log.exists() else []
    return "\n".join(["events:", events.stdout + events.stderr, "worker.log (end):", *tail])


class Stack:
    def __init__(self, home: Path, env: dict[str, str] | None = None):
        """``env``: more environment for the server and the CLI (e.g. DURASTACK_LOCAL_ISOLATION=off)."""
        self.home = home
        self.env = {**os.environ, **(env or {}), "DURASTACK_HOME": str(home), **port_env()}
        self.env.pop("DURASTACK_TEMPORAL_ADDRESS", None)
        self.log = open(home / "server.out", "wb")
        self.proc = subprocess.Popen([str(BIN / "durastack"), "server"], env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.gateway = f"http://127.0.0.1:{self.env['DURASTACK_GATEWAY_PORT']}"
        self.control = f"http://127.0.0.1:{self.env['DURASTACK_GATEWAY_CONTROL_PORT']}"
        self._token: str | None = None
        self._temporal_env: dict[str, str] | None = None

    def wait_up(self, what: str = "control plane up") -> None:
        """Until `ps` answers: slow beside a loaded suite; a server that exited, or never answered, says why."""
        until(lambda: self.proc.poll() is not None or self.cli("ps").returncode == 0, 180, 0.5,
              lambda: f"{what} (server {'exited' if self.proc.poll() is not None else 'running'}; its output:\n"
                      f"{(self.home / 'server.out').read_text(errors='replace')[-4000:]})")
        assert self.proc.poll() is None, (self.home / "server.out").read_text(errors="replace")[-4000:]

    def cli(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "durastack"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def temporal(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """Temporal's own CLI, pointed at this stack's Temporal as `eval "$(durastack temporal-env)"` does."""
        if self._temporal_env is None:
            printed = self.cli("temporal-env")
            assert printed.returncode == 0, printed.stderr
            self._temporal_env = dict(re.findall(r"^export (\w+)=(\S+)$", printed.stdout, re.M))
        return subprocess.run([str(BIN / "temporal"), *args], env={**self.env, **self._temporal_env},
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def token(self) -> str:
        """A gateway token of this stack's tests, added once with `durastack token add e2e`."""
        if self._token is None:
            result = self.cli("token", "add", "e2e")
            assert result.returncode == 0, result.stderr
            self._token = result.stdout.strip()
        return self._token

    def ps(self, name: str) -> dict:
        result = self.cli("ps", name, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def worker_pid(self) -> int | None:
        try:
            state = json.loads((self.home / "server.json").read_text())
            return state["children"]["worker"]["pid"]
        except (OSError, KeyError, ValueError, TypeError):
            return None

    def control_token(self) -> str:
        """The gateway control API's token, which the first start made in the home (as the CLI reads it)."""
        return (self.home / "gateway" / "control.token").read_text().strip()

    def routes(self) -> dict:
        return httpx.get(f"{self.control}/api/services", timeout=5,
                         headers={"Authorization": f"Bearer {self.control_token()}"}).json()["services"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


def ready(status: dict) -> dict[str, list[int]]:
    return {g["name"]: sorted(r["replica"] for r in g["replicas"] if r["ready"] and r["status"] == "running")
            for g in status["groups"]}


def replica_processes(home: Path) -> dict[str, int]:
    """Work dir → number of `http.server` processes of this home's replicas, read from /proc."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        marker = next((e[len(b"DURASTACK_WORK_DIR="):].decode() for e in env
                       if e.startswith(b"DURASTACK_WORK_DIR=")), None)
        if marker and marker.startswith(str(home)) and b"-m\0http.server" in cmdline:
            found[marker] = found.get(marker, 0) + 1
    return found


def python_scripts(home: Path, script: str) -> dict[int, dict[str, str]]:
    """PID → env of this home's replica processes running the Python script ``script`` (a stand-in), from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(e.split(b"=", 1) for e in (entry / "environ").read_bytes().split(b"\0") if b"=" in e)
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if env.get(b"DURASTACK_WORK_DIR", b"").decode().startswith(str(home)) and \
                b"python" in Path(argv[0].decode()).name.encode() and any(a.endswith(script.encode()) for a in argv):
            found[int(entry.name)] = {k.decode(): v.decode(errors="replace") for k, v in env.items()}
    return found


def isolated_stack(tmp_path_factory, env: dict[str, str], what: str):
    """``running_stack`` for a stand-in whose processes (``what``) must not listen on the host: skipped where
    replicas are not isolated."""
    from backends.local import isolation_available
    if not isolation_available():
        import pytest
        pytest.skip(f"replicas are not isolated on this machine (not root): {what} would listen on the host")
    yield from running_stack(tmp_path_factory, env)


def running_stack(tmp_path_factory, env: dict[str, str] | None = None):
    """A started stack for a test module; stopping it must leave no replica process behind."""
    s = Stack(tmp_path_factory.mktemp("home"), env)
    try:
        s.wait_up()
        yield s
    finally:
        s.stop()
    assert replica_processes(s.home) == {}


class Load:
    """A steady request rate from a thread (bounded by `stop`), counting statuses."""

    def __init__(self, url: str, token: str, rps: float):
        self.url, self.token, self.rps = url, token, rps
        self.counts: collections.Counter = collections.Counter()
        self.running = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> "Load":
        self.running.set()
        self.thread.start()
        return self

    def stop(self) -> collections.Counter:
        self.running.clear()
        self.thread.join(60)
        return self.counts

    async def _one(self, client: httpx.AsyncClient) -> None:
        try:
            self.counts[(await client.get(self.url)).status_code] += 1
        except httpx.HTTPError as e:
            self.counts[type(e).__name__] += 1

    async def _run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:
            tasks, start, i = [], time.monotonic(), 0
            while self.running.is_set() and i < self.rps * 600:  # bounded: at most 10 minutes
                await asyncio.sleep(max(0.0, start + i / self.rps - time.monotonic()))
                tasks.append(asyncio.create_task(self._one(client)))
                i += 1
            await asyncio.gather(*tasks)
