"""A `durastack server` for benchmarks: a temp home, free ports, the CLI, and a clean stop.

Same recipe as tests/test_e2e_local.py (which imports pytest, so it is not imported here)::

    with BenchStack() as stack:          # starts the server, waits for the control plane and gateway
        stack.cli("apply", "-f", path, "-y")
        ...
    # on exit: every running service is stopped, the server gets SIGINT (by its PID) and is waited
    # for, and no replica process of this home may be left; the temp dir is removed.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, TypeVar

import httpx

from backends.local_host import BASE_PATH, MARKER
from gateway.app import free_port, free_ports
from models.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def durastack_argv() -> list[str]:
    """The `durastack` console script next to this interpreter (run the benches with .venv/bin/python)."""
    script = Path(sys.executable).parent / "durastack"
    if os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-c", "from cli.main import entry; entry()"]


def replica_python() -> str:
    """The `python3` that local replicas run: the first one on the backend's fixed PATH."""
    found = shutil.which("python3", path=BASE_PATH)
    if not found:
        raise RuntimeError(f"no python3 on {BASE_PATH}")
    return found


def port_env() -> dict[str, str]:
    """The ports of a stack of its own (`durastack server`'s variables), free and distinct."""
    names = ("TEMPORAL", "UI", "GATEWAY", "GATEWAY_CONTROL", "WORKER_METRICS", "CODEC")
    return {f"DURASTACK_{name}_PORT": str(port) for name, port in zip(names, free_ports(len(names)))}


def step(title: str) -> None:
    """A titled step of a demo's output."""
    print(f"\n=== {title}", flush=True)


def until(check: Callable[[], T], timeout: float = 60.0, interval: float = 0.2, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout}s (last: {last!r})")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, -(-len(sorted_values) * q // 100))  # ceil(n*q/100), at least 1
    return sorted_values[int(rank) - 1]


def http_status(url: str, **kw) -> Optional[int]:
    try:
        return httpx.get(url, timeout=5, trust_env=False, **kw).status_code
    except httpx.HTTPError:
        return None


class BenchStack:
    def __init__(self, keep: bool = False, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)):
        self.keep, self.log_line = keep, log
        self.tmp = Path(tempfile.mkdtemp(prefix="dsbench-"))  # short: replica socket paths must fit sun_path
        self.home = self.tmp / "home"
        self.home.mkdir()
        self.env = {**os.environ, "DURASTACK_HOME": str(self.home)}
        # This tree's code, whatever the venv's editable install points at (another checkout): the server and the
        # worker it starts import from PYTHONPATH first.
        self.env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.env.pop("DURASTACK_TEMPORAL_ADDRESS", None)  # always the embedded Temporal of this home
        self._pick_ports()
        self.proc: Optional[subprocess.Popen] = None
        self._out = None
        self._token: Optional[str] = None

    # ---- life ------------------------------------------------------------------------------------

    def _pick_ports(self) -> None:
        self.env.update(port_env())
        self.settings = Settings.from_env(environ=self.env)
        self.gateway = self.settings.gateway_url
        self.control = self.settings.gateway_control_url

    def start(self, timeout: float = 120.0, attempts: int = 2) -> "BenchStack":
        """Start the server and wait for the control plane and the gateway. A free port can be taken by
        someone else before the server binds it, so a failed start is retried once with new ports. Once started,
        a second call changes nothing (`with BenchStack()` already starts it)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                return self
            except BaseException as e:  # Ctrl-C too: the server must not outlive us
                self._dump_logs()
                self._stop_server()
                if attempt == attempts or not isinstance(e, Exception):
                    self.keep = True  # for the logs
                    self.close()
                    raise
                self.log_line(f"durastack server did not start ({e}); again with other ports")
                self._pick_ports()
        return self

    def _start_once(self, timeout: float) -> None:
        self._out = open(self.tmp / "server.out", "ab")
        self.proc = subprocess.Popen([*durastack_argv(), "server"], env=self.env, stdout=self._out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.log_line(f"durastack server pid {self.proc.pid}, home {self.home}")
        until(lambda: self.proc.poll() is not None or self.cli("ps").returncode == 0, timeout, 0.5,
              "control plane up")
        if self.proc.poll() is not None:
            raise RuntimeError(f"durastack server exited with {self.proc.returncode}")
        until(lambda: http_status(f"{self.gateway}/healthz") == 200, 30, 0.2, "gateway up")

    def _dump_logs(self) -> None:
        for path in [self.tmp / "server.out", *sorted((self.home / "logs").glob("*.log"))]:
            try:
                tail = path.read_text(errors="replace").strip().splitlines()[-8:]
            except OSError:
                continue
            self.log_line(f"--- last lines of {path}:\n" + "\n".join(tail))

    def _stop_server(self) -> None:
        """SIGINT to the server's PID (it stops its children and the replicas), SIGKILL its group if stuck."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.log_line(f"warning: durastack server {self.proc.pid} ignored SIGINT for 90s; killing its group")
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self._out is not None:
            self._out.close()
            self._out = None

    def close(self) -> None:
        """Stop the services, then the server; check that no replica process is left."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                for name in self.running_services():
                    self.stop_service(name)
            except Exception as e:  # the server stops the replicas on its own too
                self.log_line(f"warning: stopping services failed: {e}")
        self._stop_server()
        left = self.replica_pids()
        if left:
            self.log_line(f"warning: replica processes left behind: {left}")
        elif not self.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            self.log_line(f"kept {self.tmp}")

    def __enter__(self) -> "BenchStack":
        # A bench ended by SIGTERM (kill, timeout) stops its stack as one ended by Ctrl-C does: through __exit__.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        return self.start()

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is not None:
            self.keep = True  # for the logs
        self.close()

    # ---- CLI -------------------------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*durastack_argv(), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def check(self, *args: str, timeout: float = 300) -> str:
        result = self.cli(*args, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"durastack {' '.join(args)} exited {result.returncode}:\n"
                               f"{result.stdout}{result.stderr}")
        return result.stdout

    def ps(self, name: str) -> dict:
        return json.loads(self.check("ps", name, "--json"))

    def running_services(self) -> list[str]:
        return [s["name"] for s in json.loads(self.check("ps", "--json"))]

    def token(self) -> str:
        """A gateway token for the benchmark's requests, added once (`durastack token add bench`)."""
        if self._token is None:
            self._token = self.check("token", "add", "bench").strip()
        return self._token

    def stop_service(self, name: str) -> None:
        self.check("stop", name, "-y")

    def write(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    # ---- observation -----------------------------------------------------------------------------

    def replica_pids(self) -> list[int]:
        """Live processes of this home's replicas (they carry the backend's work-dir marker)."""
        prefix = f"{MARKER}={self.home}/".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in "ZX" and any(e.startswith(prefix) for e in env):
                found.append(int(entry.name))
        return found

    def instance(self, service: str, group: str, replica: int = 0, submission: int = 0) -> dict:
        """The local backend's record of a replica: pid, address (``unix:/...sock``), work_dir, ..."""
        path = self.home / "replicas" / service / group / f"r{replica}-s{submission}" / ".durastack" / "instance.json"
        return json.loads(path.read_text())

    async def temporal(self):
        """A Temporal client of this stack, with the CLI's data converter."""
        from cli.client import connect

        return await connect(self.settings)


def ready_replicas(status: dict) -> int:
    """Replicas that `durastack ps --json` shows ready and running."""
    return sum(1 for g in status["groups"] for r in g["replicas"] if r["ready"] and r["status"] == "running")


def load_avg() -> str:
    """The 1-minute load average (other work on the machine skews every figure here)."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "?"


# What each process of a stack is, by its command line (first match).
PARTS = (("replica apps", "http.server"), ("temporal", "temporal"), ("temporal door", "door/nginx.conf"),
         ("worker", "-m worker"), ("gateway", "-m gateway"), ("nginx", "nginx"), ("server", " server"),
         ("replica wrappers", ""))


def stack_cpu(home: Path) -> dict[str, float]:
    """CPU seconds (user + system) each part of the stack of ``home`` has spent so far, with its reaped children
    (e.g. the `ip` runs of the worker), plus "cli": the benchmark's own reaped children (the CLI runs). The
    difference of two readings is what a step cost, whatever else the machine ran meanwhile. A process is the
    stack's if it names the home in its environment or command line, or its parent is the stack's (nginx's
    workers: nginx empties their environment)."""
    tick = os.sysconf("SC_CLK_TCK")
    mark = str(home).encode()
    procs: dict[int, tuple[int, str, bool, float]] = {}  # pid: (ppid, command line, marked, cpu)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or entry.name == str(os.getpid()):
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
            marked = mark in raw or mark in (entry / "environ").read_bytes()
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        procs[int(entry.name)] = (int(fields[1]), raw.replace(b"\0", b" ").decode(errors="replace"), marked, cpu)
    ours = {pid for pid, p in procs.items() if p[2]}
    while True:
        more = {pid for pid, p in procs.items() if pid not in ours and p[0] in ours}
        if not more:
            break
        ours |= more
    parts = {name: 0.0 for name, _ in PARTS}
    for pid in ours:
        _, cmd, _, cpu = procs[pid]
        parts[next(name for name, pattern in PARTS if pattern in cmd)] += cpu
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    parts["cli"] = own.ru_utime + own.ru_stime
    return parts


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each part spent between two readings (a process that ended meanwhile counts from 0 in the first)."""
    return {k: max(0.0, after[k] - before.get(k, 0.0)) for k in after}


def load_note() -> str:
    return f"{os.cpu_count()} CPUs, load avg (1 min) {load_avg()}"


def code_note() -> str:
    """The commit the figures were measured on, and whether the tree had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "commit unknown"
    return f"commit {head or 'unknown'}" + (" + uncommitted changes" if dirty else "")
