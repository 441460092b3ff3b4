"""Local compute backend: each replica is a process tree on this machine.

Layout of a replica's work dir ``<home>/replicas/<service>/<group>/r<N>-s<M>/``: ``replica.log``
(stdout+stderr), ``replica.sock`` (the bridge, when isolated), ``exit_code`` (written by the wrapper
when the commands end), ``tmp/`` (the replica's /tmp when isolated) and ``.durastack/`` (the
instance record, the launch file, python wrappers, the bridge's log, a lock).

When isolation is available every replica runs under ``unshare`` in new network, mount and PID
namespaces, so the seeds' "every replica binds port 8000 and writes /tmp/version.txt" runs unchanged;
the host reaches the app through a Unix socket served by ``bridge.py`` inside the namespace.
Otherwise replicas share the host's network and /tmp, and each gets its own ``PORT``.

All methods are blocking and idempotent, so they can back synchronous Temporal activities that
may be retried after the worker died at any point.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Optional, Union

import httpx

from activities.local_host import (BASE_PATH, BRIDGE_SCRIPT, INIT_SCRIPT, MARKER, NoOffersError, check_resources,
                                   children, default_python, find_python, find_tree, free_port, is_alive,
                                   probe_isolation, proc_stat, process_group, send_signal, unshare_argv)
from models.replica import InstanceStatus, JobSpec, LocalInstance

ENV_ISOLATION = "DURASTACK_LOCAL_ISOLATION"  # "0"/"off" forces isolation off, e.g. to test that mode
POLL = 0.05
KILL_WAIT = 5.0
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the NUL
_REPLICA_ID = re.compile(r"(?P<service>[A-Za-z0-9][A-Za-z0-9._-]*)/(?P<group>[A-Za-z0-9][A-Za-z0-9._-]*)"
                         r"/(?P<dir>r\d+-s\d+)")

__all__ = ["LocalBackend", "LocalBackendError", "UnsupportedJobError", "NoOffersError",
           "isolation_available", "isolation_reason", "check_resources"]


class LocalBackendError(RuntimeError):
    pass


class UnsupportedJobError(LocalBackendError):
    """The job needs something this backend cannot do (e.g. a container image). Not retryable."""


def _forced_off() -> Optional[str]:
    value = os.environ.get(ENV_ISOLATION, "").strip().lower()
    return f"isolation off: disabled by {ENV_ISOLATION}={value}" if value in ("0", "off", "false", "no") else None


def isolation_available() -> bool:
    return _forced_off() is None and probe_isolation()[0]


def isolation_reason() -> str:
    """One line saying whether replicas are isolated here, and why not when they are not."""
    return _forced_off() or probe_isolation()[1]


# Leaders we spawned are our children: poll them so that ended ones do not linger as zombies.
_spawned: dict[int, subprocess.Popen] = {}
_spawned_lock = threading.Lock()


def _reap() -> None:
    with _spawned_lock:
        for pid, proc in list(_spawned.items()):
            if proc.poll() is not None:
                del _spawned[pid]


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold the job's secrets
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # two overlapping attempts of one activity start one replica
        yield


class LocalBackend:
    def __init__(self, home: Union[Path, str], isolation: Optional[bool] = None):
        """``isolation``: None = use it when available; False = never; True = require it."""
        self.home = Path(home).absolute()
        if isolation is None:
            self.isolated = isolation_available()
            self.isolation_reason = isolation_reason()
        elif isolation and not isolation_available():
            raise LocalBackendError(isolation_reason())
        else:
            self.isolated = isolation
            self.isolation_reason = isolation_reason() if isolation else "isolation off: disabled for this backend"

    def work_dir(self, job: JobSpec) -> Path:
        return self.home / "replicas" / job.service / job.group / f"r{job.replica_num}-s{job.submission_num}"

    check_resources = staticmethod(check_resources)

    def find_instance(self, replica_id: str) -> Optional[LocalInstance]:
        """The recorded instance of ``service/group/rN-sM`` (alive or not), or None if none was started."""
        m = _REPLICA_ID.fullmatch(replica_id)
        if not m or ".." in replica_id:
            return None
        wd = self.home / "replicas" / m["service"] / m["group"] / m["dir"]
        with contextlib.suppress(FileNotFoundError, ValueError):
            return LocalInstance.model_validate_json((wd / ".durastack" / "instance.json").read_text())
        return None

    def instances(self) -> list[LocalInstance]:
        """Every instance recorded under this home, alive or not."""
        found = []
        for record in sorted((self.home / "replicas").glob("*/*/*/.durastack/instance.json")):
            with contextlib.suppress(FileNotFoundError, ValueError):
                found.append(LocalInstance.model_validate_json(record.read_text()))
        return found

    def stop_all(self, grace_seconds: float = 10.0) -> None:
        """Stop every replica of this home (when the embedded stack shuts down), in parallel."""
        from concurrent.futures import ThreadPoolExecutor

        live = [inst for inst in self.instances() if find_tree(inst.work_dir, None)]
        with ThreadPoolExecutor(max(1, min(32, len(live)))) as pool:
            list(pool.map(lambda inst: self.stop(inst, grace_seconds), live))

    def find(self, job: JobSpec) -> Optional[LocalInstance]:
        """What an earlier attempt to start ``job`` recorded (a worker may die before reporting it)."""
        return self.find_instance(job.replica_id)

    # ---- start -------------------------------------------------------------------------------

    def start(self, job: JobSpec) -> LocalInstance:
        if not job.commands:
            if job.image:
                raise UnsupportedJobError(
                    f"{job.replica_id}: the local backend cannot run images (image={job.image!r}); "
                    "give the group commands, or use a cloud backend")
            raise UnsupportedJobError(f"{job.replica_id}: no commands to run")
        wd = self.work_dir(job)
        meta = wd / ".durastack"
        meta.mkdir(parents=True, exist_ok=True)
        with _locked(meta / "lock"):
            existing = self._find_running(wd)
            if existing is not None:
                return existing
            return self._spawn(job, wd, meta)

    def _find_running(self, wd: Path) -> Optional[LocalInstance]:
        meta = wd / ".durastack"
        _reap()
        with contextlib.suppress(FileNotFoundError, ValueError):
            inst = LocalInstance.model_validate_json((meta / "instance.json").read_text())
            if is_alive(inst.pid, inst.start_time):
                return inst
        # A tree without a live record: the starter died between spawning and recording it.
        tree = find_tree(str(wd))
        for pid, started in tree.items():
            st = proc_stat(pid)
            if st and st.session == pid and INIT_SCRIPT in _cmdline(pid):  # the session leader we spawned
                launch = json.loads((meta / "launch.json").read_text())
                inst = LocalInstance(replica_id=launch["replica_id"], pid=pid, start_time=started, work_dir=str(wd),
                                     address=launch["address"], isolated=launch["isolated"],
                                     log_path=str(wd / "replica.log"))
                _write_private(meta / "instance.json", inst.model_dump_json())
                return inst
        for pid, started in tree.items():  # fragments of an earlier run must not squat the replica
            send_signal(pid, started, signal.SIGKILL)
        return None

    def _spawn(self, job: JobSpec, wd: Path, meta: Path) -> LocalInstance:
        log_path = wd / "replica.log"
        (wd / "exit_code").unlink(missing_ok=True)
        (meta / "ns_ready").unlink(missing_ok=True)
        tmp = wd / "tmp"
        tmp.mkdir(exist_ok=True)
        tmp.chmod(0o1777)  # it becomes the replica's /tmp
        port = job.port if self.isolated else free_port()
        address = f"unix:{self._socket_path(wd)}" if self.isolated else f"127.0.0.1:{port}"
        env, notes = self._env(job, wd, meta, port)
        if job.image:
            notes.append(f"image {job.image!r} is ignored: the local backend runs the commands on this machine")
        launch = {"replica_id": job.replica_id, "isolated": self.isolated, "port": port, "address": address,
                  "script": "\n".join(job.commands), "python": sys.executable, "bridge": BRIDGE_SCRIPT, "env": env,
                  # what must stay visible if it lives under the host's /tmp (hidden by the private /tmp)
                  "keep": [os.path.dirname(BRIDGE_SCRIPT), sys.prefix, sys.base_prefix, *self._python_homes(job)]}
        _write_private(meta / "launch.json", json.dumps(launch))
        argv = [sys.executable, "-I", INIT_SCRIPT, str(meta / "launch.json")]
        if self.isolated:
            argv = unshare_argv() + argv
        with open(log_path, "ab") as log:
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            for line in [f"{now} starting {job.replica_id} ({self.isolation_reason}) at {address}", *notes]:
                log.write(f"[durastack] {line}\n".encode())
            log.flush()
            # A new session: the tree outlives the worker and is not hit by signals sent to the worker's group.
            proc = subprocess.Popen(argv, cwd=wd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started = proc_stat(proc.pid)  # read before registering: until then nobody can reap it
        with _spawned_lock:
            _spawned[proc.pid] = proc
        if started is None:
            raise LocalBackendError(f"{job.replica_id}: the leader vanished at once; see {log_path}")
        inst = LocalInstance(replica_id=job.replica_id, pid=proc.pid, start_time=started.start, work_dir=str(wd),
                             address=address, isolated=self.isolated, log_path=str(log_path))
        _write_private(meta / "instance.json", inst.model_dump_json())
        return inst

    def _socket_path(self, wd: Path) -> Path:
        sock = wd / "replica.sock"
        if len(str(sock)) <= _SUN_PATH_MAX:
            return sock
        # Deep work dirs exceed sun_path; clients connect through a short symlink (connect follows it).
        link = self.home / "run" / (hashlib.sha1(str(wd).encode()).hexdigest()[:16] + ".sock")
        if len(str(link)) > _SUN_PATH_MAX:
            raise LocalBackendError(f"home {self.home} is too long for Unix socket paths; use a shorter one")
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(sock)
        return link

    def _env(self, job: JobSpec, wd: Path, meta: Path, port: int) -> tuple[dict[str, str], list[str]]:
        notes: list[str] = []
        env = {"PATH": BASE_PATH, "HOME": os.environ.get("HOME") or str(Path.home()), "LANG": "C.UTF-8"}
        if not self.isolated:
            env["TMPDIR"] = str(wd / "tmp")  # /tmp is shared with the host; well-behaved tools use TMPDIR
        env.update(job.env)
        if job.python:
            exe = find_python(job.python)
            if exe:
                env["PATH"] = f"{self._python_wrappers(meta, job.python, exe)}:{env['PATH']}"
                notes.append(f"python {job.python}: {exe}")
            else:
                notes.append(f"python {job.python} is not installed on this machine; "
                             f"using the default python3 ({default_python() or 'none found'})")
        env.update({"DURASTACK_SERVICE": job.service, "DURASTACK_GROUP": job.group,
                    "DURASTACK_REPLICA_NUM": str(job.replica_num), "PORT": str(port), MARKER: str(wd)})
        return env, notes

    @staticmethod
    def _python_homes(job: JobSpec) -> list[str]:
        exe = find_python(job.python) if job.python else None
        return [os.path.dirname(os.path.dirname(exe))] if exe else []

    @staticmethod
    def _python_wrappers(meta: Path, version: str, exe: str) -> Path:
        """python/python3/pip wrappers for the wanted interpreter (scripts, not symlinks, so venvs keep working)."""
        bindir = meta / "bin"
        bindir.mkdir(exist_ok=True)
        scripts = {n: f'exec {shlex.quote(exe)} "$@"' for n in ("python", "python3", f"python{version}")}
        scripts.update({n: f'exec {shlex.quote(exe)} -m pip "$@"' for n in ("pip", "pip3")})
        for name, body in scripts.items():
            (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bindir / name).chmod(0o755)
        return bindir

    # ---- observe -----------------------------------------------------------------------------

    def status(self, inst: LocalInstance) -> InstanceStatus:
        _reap()
        if is_alive(inst.pid, inst.start_time):
            return InstanceStatus(state="running", message=f"pid {inst.pid}")
        code = _read_exit_code(Path(inst.work_dir))
        if code is not None:
            return InstanceStatus(state="exited", exit_code=code, message=f"commands exited with code {code}")
        if not Path(inst.work_dir).is_dir():
            return InstanceStatus(state="gone", message=f"no work dir {inst.work_dir}")
        return InstanceStatus(state="gone", message=f"pid {inst.pid} ended without recording an exit code (failed "
                                                    f"to start, killed, or the machine restarted); see {inst.log_path}")

    def logs(self, inst: LocalInstance, tail: Optional[int] = None) -> str:
        """The replica's output, or its last ``tail`` lines (read from the end: logs of servers grow)."""
        if tail is not None and tail <= 0:
            return ""
        try:
            with open(inst.log_path, "rb") as f:
                if tail is None:
                    return f.read().decode(errors="replace")
                pos = f.seek(0, os.SEEK_END)
                data = b""
                while pos > 0 and data.count(b"\n") <= tail:
                    step = min(pos, 64 * 1024)
                    pos -= step
                    f.seek(pos)
                    data = f.read(step) + data
        except FileNotFoundError:
            return ""
        return "".join(data.decode(errors="replace").splitlines(keepends=True)[-tail:])

    def probe(self, inst: LocalInstance, path: str = "/", timeout: float = 5.0) -> Optional[int]:
        """HTTP GET through the replica's address; the status code, or None when nothing answered."""
        if inst.address.startswith("unix:"):
            transport, url = httpx.HTTPTransport(uds=inst.address[len("unix:"):]), f"http://localhost{path}"
        else:
            transport, url = None, f"http://{inst.address}{path}"
        try:
            # trust_env=False: an http_proxy setting must not capture loopback probes.
            with httpx.Client(transport=transport, timeout=timeout, trust_env=False) as client:
                return client.get(url).status_code
        except httpx.HTTPError:
            return None

    def exec(self, inst: LocalInstance, argv: list[str], timeout: float = 60.0) -> tuple[int, str]:
        """Run argv inside the replica (its namespaces, cwd and env); returns (exit code, stdout+stderr)."""
        if not is_alive(inst.pid, inst.start_time):
            raise LocalBackendError(f"{inst.replica_id} is not running")
        wd = inst.work_dir
        env = json.loads((Path(wd) / ".durastack" / "launch.json").read_text())["env"]
        cmd = list(argv)
        if inst.isolated:
            inner = self._namespace_init(inst)
            ns = ["-n", "-m", "-p"]
            if os.readlink(f"/proc/{inner[0]}/ns/user") != os.readlink("/proc/self/ns/user"):
                ns = ["-U", "--preserve-credentials", *ns]  # unprivileged: its user namespace holds the others
            cmd = [shutil.which("nsenter") or "nsenter", "-t", str(inner[0]), *ns, f"--wd={wd}", "--", *argv]
        proc = subprocess.Popen(cmd, cwd=wd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            out = self._kill_exec(proc, inst.isolated)
            return 124, out.decode(errors="replace") + f"\n[durastack] timed out after {timeout}s\n"
        return proc.returncode, out.decode(errors="replace")

    @staticmethod
    def _kill_exec(proc: subprocess.Popen, isolated: bool) -> bytes:
        for pid, started in process_group(proc.pid).items():
            # nsenter must outlive its child to reap it: an orphan would go to the host's init, and
            # the namespace cannot end before that init gets round to reaping it.
            if not (isolated and pid == proc.pid):
                send_signal(pid, started, signal.SIGKILL)
        try:
            return proc.communicate(timeout=KILL_WAIT)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.communicate()[0]

    @staticmethod
    def _namespace_init(inst: LocalInstance, timeout: float = 10.0) -> list[int]:
        """Host PID of the namespace's PID 1 once it has set up lo, /tmp and the bridge."""
        ready = Path(inst.work_dir) / ".durastack" / "ns_ready"
        deadline = time.monotonic() + timeout
        while is_alive(inst.pid, inst.start_time):
            inner = children(inst.pid)  # the only child of the unshare leader
            if inner and ready.exists():
                return inner
            if time.monotonic() > deadline:
                break
            time.sleep(POLL)
        raise LocalBackendError(f"{inst.replica_id}: its namespaces are not ready (starting or shutting down)")

    # ---- stop --------------------------------------------------------------------------------

    def stop(self, inst: LocalInstance, grace_seconds: float = 10.0) -> None:
        """SIGTERM the tree (through its wrapper, so the app gets it once and may drain), SIGKILL what is
        left after the grace period. Stopping a replica that is already gone is fine."""
        deadline = time.monotonic() + grace_seconds
        termed: set[int] = set()
        killed = False
        while True:
            _reap()
            leader = inst.pid if is_alive(inst.pid, inst.start_time) else None
            tree = find_tree(inst.work_dir, leader)
            if not tree:
                break
            now = time.monotonic()
            if now > deadline + KILL_WAIT:
                raise LocalBackendError(f"{inst.replica_id}: processes {sorted(tree)} survived SIGKILL")
            if now >= deadline:
                for pid, started in tree.items():
                    killed |= send_signal(pid, started, signal.SIGKILL)
            elif leader is None:  # no wrapper left to forward it: everyone gets SIGTERM, once
                for pid in set(tree) - termed:
                    send_signal(pid, tree[pid], signal.SIGTERM)
                    termed.add(pid)
            else:
                # Repeated, because a wrapper that has just started may not handle it yet (a namespace's
                # PID 1 ignores it then); the wrapper itself forwards only the first one.
                for pid in self._wrappers(inst, leader, tree):
                    send_signal(pid, tree[pid], signal.SIGTERM)
            time.sleep(POLL)
        exit_file = Path(inst.work_dir) / "exit_code"
        if killed and not exit_file.exists():
            exit_file.write_text(f"{128 + signal.SIGKILL}\n")  # the wrapper died before it could record one


    @staticmethod
    def _wrappers(inst: LocalInstance, leader: int, tree: dict[int, int]) -> list[int]:
        """The local_init process: the namespace's PID 1 under the unshare leader (which ignores SIGTERM),
        or the leader itself without isolation."""
        return [p for p in children(leader) if p in tree] if inst.isolated else [leader]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _read_exit_code(wd: Path) -> Optional[int]:
    try:
        return int((wd / "exit_code").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None

