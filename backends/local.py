"""Local compute backend: each replica is a process tree on this machine.

Layout of a replica's work dir ``<home>/replicas/<service>/<group>/r<N>-s<M>/``: ``replica.log``
(stdout+stderr), ``tmp/`` (the replica's /tmp when isolated) and ``.durastack/`` (the instance
record, the launch file, ``exit_code`` written by the wrapper when the commands end,
``replica.sock`` served by the bridge when isolated, python wrappers, the bridge's log, a lock).
``.durastack`` is root's and only walkable by the replica: a confined replica writes in its work dir (root's,
sticky, its group's to write), and must not be able to plant a symlink where root (or nginx, connecting to the
socket) later follows it, nor rename ``.durastack`` or ``tmp`` away and put its own in their place.

When isolation is available every replica runs under ``unshare`` in new network, mount and PID
namespaces, so the seeds' "every replica binds port 8000 and writes /tmp/version.txt" runs unchanged.
As root, the replicas of one service share a private network (``local_net``): each has an address there
(``DURASTACK_REPLICA_IP``). The gateway's nginx, in the home's gateway namespace, connects to the app there
(listening on that address, or on all); the host reaches it through a Unix socket on which the service's nginx
stream proxy listens. Without root each replica is alone in its
namespace, and ``bridge.py`` serves that socket from inside it, to the app's 127.0.0.1 port.
Otherwise replicas share the host's network and /tmp, and each gets its own ``PORT``.

When the backend runs as root with namespaces, every replica is also *confined* (see
``local_host.probe_confinement``): its commands run as a non-root host user with no capabilities,
the control plane's home is covered by a tmpfs in its mount namespace (its own work dir put back),
durastack's code and venv are read-only, and /dev/shm is its own. ``confinement_reason()`` says
whether that is so here, for the server's banner.

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

from backends import local_net
from backends.local_cgroup import Cgroups, Limits, join_argv
from backends.local_host import (BASE_PATH, BRIDGE_SCRIPT, INIT_SCRIPT, MARKER, Account,
                                   NoOffersError, account_for, check_resources, children,
                                   default_python, drop_argv, find_python, find_tree, free_port, is_alive,
                                   probe_confinement, probe_isolation, proc_stat, process_group, replica_account,
                                   send_signal, service_account, unshare_argv, user_refusal)
from backends.local_init import COMMANDS_FILE, env_script, with_env
from models.replica import InstanceStatus, JobSpec, LocalInstance

ENV_ISOLATION = "DURASTACK_LOCAL_ISOLATION"  # "0"/"off" forces isolation off, e.g. to test that mode
POLL = 0.05
# How durastack's own lines in a replica's log begin (here and in local_init.py): the rest is the replica's output.
OWN_LINES = "[durastack] "
KILL_WAIT = 5.0
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes including the NUL
_REPLICA_ID = re.compile(r"(?P<service>[A-Za-z0-9][A-Za-z0-9._-]*)/(?P<group>[A-Za-z0-9][A-Za-z0-9._-]*)"
                         r"/(?P<dir>r\d+-s\d+)")

__all__ = ["LocalBackend", "LocalBackendError", "UnsupportedJobError", "NoOffersError",
           "isolation_available", "isolation_reason", "confinement_available", "confinement_reason", "network_reason",
           "private_home", "check_resources"]
CODE_DIR = str(Path(__file__).resolve().parent.parent)  # durastack's own code: read-only for confined replicas


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


def confinement_available() -> bool:
    return isolation_available() and probe_confinement()[0]


def confinement_reason() -> str:
    """One line saying whether replicas are confined here (non-root, no capabilities, home hidden), or why not."""
    off = _forced_off()
    return f"confinement off: replicas run as this user ({off})" if off else probe_confinement()[1]


def networks_available() -> bool:
    """Whether a backend made here gives each service a private network (and so the gateway a namespace to join)."""
    return isolation_available() and local_net.probe()[0]


def network_reason() -> str:
    """One line saying whether the replicas of a service share a private network here, or why not."""
    if not isolation_available():
        return "service networks off: isolation off, replicas share the host's network"
    return local_net.probe()[1]


def private_home(home: Union[Path, str]) -> Path:
    """Make the home (if needed) and keep it mode 700: it holds the codec key, the gateway's token
    hashes, the store, the logs and every replica's work dir. 710 stays: the gateway opens it to the group
    of nginx's unprivileged workers for search only (gateway/workers.py)."""
    path = Path(home)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if (st.st_mode & 0o700 != 0o700 or st.st_mode & 0o067) and st.st_uid == os.geteuid():  # not ours to fix else
        path.chmod(0o700)
    return path


# Leaders we spawned are our children: poll them so that ended ones do not linger as zombies.
_spawned: dict[int, subprocess.Popen] = {}
_spawned_lock = threading.Lock()


def _reap() -> None:
    with _spawned_lock:
        for pid, proc in list(_spawned.items()):
            if proc.poll() is not None:
                del _spawned[pid]


def _open_log(path: Path) -> int:
    """The replica's log, appended to, mode 600. A confined replica owns the directory it is in, so
    what is there may be its doing: a symlink or a hard link is replaced, never written through."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError:  # ELOOP (a symlink), ENXIO (a FIFO), EISDIR, …: not ours
            _remove(path)
            continue
        st = os.fstat(fd)
        if st.st_nlink == 1 and (st.st_mode & 0o170000) == 0o100000 and st.st_uid == os.geteuid():
            os.fchmod(fd, 0o600)
            os.set_blocking(fd, True)
            return fd
        os.close(fd)
        _remove(path)
    raise LocalBackendError(f"cannot create {path}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _root_dir(path: Path, mode: int, owner: Optional[Account] = None) -> None:
    """A directory at ``path`` (not a symlink planted there), with ``mode`` and ``owner`` (else ours). One of
    ours found owned by someone else was made by a replica (whatever is in it is its doing): made anew."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif owner is None and path.is_dir() and path.stat().st_uid != os.geteuid():
        shutil.rmtree(path)  # does not follow the links in it
    path.mkdir(exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if owner is not None:
            os.fchown(fd, owner.uid, owner.gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    # may hold the job's secrets; O_NOFOLLOW: never write through a link, whoever planted it
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
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
        """``isolation``: None = use it when available; False = never; True = require it.
        Replicas are confined whenever they are isolated and this machine allows it."""
        self.home = private_home(Path(home).absolute())
        if isolation is None:
            self.isolated = isolation_available()
            self.isolation_reason = isolation_reason()
        elif isolation and not isolation_available():
            raise LocalBackendError(isolation_reason())
        else:
            self.isolated = isolation
            self.isolation_reason = isolation_reason() if isolation else "isolation off: disabled for this backend"
        self.account: Optional[Account] = replica_account() if self.isolated and probe_confinement()[0] else None
        self.confined = self.account is not None
        self.confinement_reason = confinement_reason() if self.isolated else \
            "confinement off: replicas run as this user (isolation off)"
        # Isolated replicas of one service share a private network, reached through an nginx stream proxy;
        # without root, each replica is alone in its namespace, reached through bridge.py.
        self.networked, self.network_reason = local_net.probe() if self.isolated else \
            (False, "service networks off: isolation off, replicas share the host's network")
        if self.networked:
            local_net.reap_all(self.home)  # networks whose replicas all died with an earlier worker
        self.cgroups = Cgroups()

    def network(self, service: str) -> local_net.ServiceNetwork:
        return local_net.ServiceNetwork(self.home, service)

    def upstream(self, job: JobSpec, inst: LocalInstance) -> str:
        """Where the gateway reaches the app: its address on the service's network when the gateway's nginx runs in
        the namespace linked to that network (no proxy in between); else its socket on the host."""
        if self.networked and inst.ip and self.network(job.service).gateway_linked(job.replica_id):
            return f"{inst.ip}:{job.port}"
        return inst.address

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

    def never_ran(self, inst: LocalInstance) -> bool:
        """Whether the instance ended before its commands could run: an isolated one whose namespace was never ready
        (its worker died between spawning it and linking it into its service's network, and the link never came)."""
        ready = Path(inst.work_dir) / ".durastack" / "ns_ready"
        return inst.isolated and not ready.exists() and self.status(inst).state != "running"

    def recorded_at(self, job: JobSpec) -> Optional[float]:
        """When ``job``'s instance was last recorded (Unix time), or None: tells this run's record from one a
        service of the same name left behind (work dirs outlive their replicas, for their logs)."""
        with contextlib.suppress(FileNotFoundError):
            return (self.work_dir(job) / ".durastack" / "instance.json").stat().st_mtime
        return None

    # ---- start -------------------------------------------------------------------------------

    def start(self, job: JobSpec, later: bool = False, limits: Limits = Limits()) -> LocalInstance:
        """Start the replica (adopting one an earlier attempt started). ``later``: its commands wait in the replica,
        on a network of its own already, until ``give_commands`` (its late references need its address first).
        ``limits``: its memory, CPU and processes, where this host's cgroups allow (local_cgroup.py)."""
        if not job.commands:
            if job.image:
                raise UnsupportedJobError(
                    f"{job.replica_id}: the local backend cannot run images (image={job.image!r}); "
                    "give the group commands, or use a cloud backend")
            raise UnsupportedJobError(f"{job.replica_id}: no commands to run")
        self.run_as(job)  # refused before anything is made
        self.commands_dir(job)
        wd = self.work_dir(job)
        meta = wd / ".durastack"
        meta.mkdir(parents=True, exist_ok=True)
        with _locked(meta / "lock"):
            inst = self._find_running(wd)
            net = self.network(job.service) if self.networked and (inst is None or inst.ip) else None
            # The service's lock only while its leases and namespace change: from the lease until the process
            # that keeps it alive is recorded (a release of the last other replica would tear the namespace down
            # under a lease without one). Linking and the proxy come after it, so that the replicas of an apply
            # start side by side, not one after the other.
            with net.locked() if net is not None else contextlib.nullcontext():
                if inst is None:
                    inst = self._spawn(job, wd, meta, later, limits)
                elif net is not None:  # an earlier attempt may have died between spawning and linking it
                    net.lease(job.replica_id, str(wd), str(self._socket_path(wd)), job.port)
                if net is not None:
                    net.ensure_namespace()
            if net is not None:
                try:
                    local_net.wait_unshared(inst.pid)
                    net.link(job.replica_id, inst.pid, inst.ip)  # idempotent, like the rest
                    net.link_gateway(job.replica_id, inst.pid, inst.ip)
                    net.serve()
                except local_net.NetworkError as e:
                    raise LocalBackendError(f"{job.replica_id}: {e}") from e
            return inst

    def _find_running(self, wd: Path) -> Optional[LocalInstance]:
        meta = wd / ".durastack"
        _reap()
        with contextlib.suppress(FileNotFoundError, ValueError):
            inst = LocalInstance.model_validate_json((meta / "instance.json").read_text())
            if is_alive(inst.pid, inst.start_time):
                return inst
        if not (meta / "launch.json").exists():
            # Never spawned here: every spawn writes it first and it is never removed (.durastack is root's, out of a
            # confined replica's reach). So no tree to look for, and no scan of every process's environment, which
            # 16 starts of an apply each did at once in the worker.
            return None
        # A tree without a live record: the starter died between spawning and recording it.
        tree = find_tree(str(wd))
        for pid, started in tree.items():
            st = proc_stat(pid)
            if st and st.session == pid and INIT_SCRIPT in _cmdline(pid):  # the session leader we spawned
                launch = json.loads((meta / "launch.json").read_text())
                inst = LocalInstance(replica_id=launch["replica_id"], pid=pid, start_time=started, work_dir=str(wd),
                                     address=launch["address"], isolated=launch["isolated"],
                                     log_path=str(wd / "replica.log"), ip=launch.get("ip", ""))
                _write_private(meta / "instance.json", inst.model_dump_json())
                return inst
        for pid, started in tree.items():  # fragments of an earlier run must not squat the replica
            send_signal(pid, started, signal.SIGKILL)
        return None

    def run_as(self, job: JobSpec) -> Optional[Account]:
        """The host user the job's commands run as (None: this process's own), or UnsupportedJobError."""
        refusal = user_refusal(job.user, self.account if self.confined else None)
        if refusal is not None:
            why = f" ({self.confinement_reason})" if not self.confined else ""
            raise UnsupportedJobError(f"{job.replica_id}: {refusal}{why}")
        if not self.confined:
            return None
        return service_account(self.home, job.service) if job.user is None else account_for(job.user)

    def commands_dir(self, job: JobSpec) -> str:
        """Where the commands run: ``working_dir`` inside the work dir, or the work dir itself."""
        wd = str(self.work_dir(job))
        if not job.working_dir:
            return wd
        path = os.path.normpath(os.path.join(wd, job.working_dir))  # an absolute working_dir stays as it is
        if path != wd and not path.startswith(wd + os.sep):
            raise UnsupportedJobError(
                f"{job.replica_id}: working_dir {job.working_dir!r} is outside the replica's work dir ({wd}); "
                "give a path relative to it")
        return path

    def give_commands(self, job: JobSpec) -> None:
        """The commands (and env) of a replica started with ``later``, its late references filled in: the replica's
        ``local_init`` waits for this file. In .durastack, root's, where the replica cannot write."""
        meta = self.work_dir(job) / ".durastack"
        _write_private(meta / COMMANDS_FILE, json.dumps({"script": "\n".join(job.commands), "env": job.env}))

    def _spawn(self, job: JobSpec, wd: Path, meta: Path, later: bool = False, limits: Limits = Limits()
               ) -> LocalInstance:
        log_path = wd / "replica.log"
        account = self.run_as(job)
        (meta / "exit_code").unlink(missing_ok=True)
        (wd / "exit_code").unlink(missing_ok=True)
        (meta / "ns_ready").unlink(missing_ok=True)
        (meta / COMMANDS_FILE).unlink(missing_ok=True)
        if self.confined:
            # The commands' own to write in, but root's, sticky: its user may rename or remove only what it made.
            # Owning it, it could rename root's .durastack away and put a directory of its own there, whose
            # links root would then write through (exit_code, the launch file's scrub).
            _root_dir(wd, 0o1770, Account("root", os.geteuid(), account.gid))
            _root_dir(meta, 0o711)  # root's; the replica may only walk through it (python wrappers)
        _root_dir(wd / "tmp", 0o1777)  # it becomes the replica's /tmp
        port = job.port if self.isolated else free_port()
        address = f"unix:{self._socket_path(wd)}" if self.isolated else f"127.0.0.1:{port}"
        net = self.network(job.service) if self.networked else None
        # The address other replicas of the service reach it at: on its service's network; on the host's
        # loopback when replicas share the host's network; none when each is alone in its namespace.
        ip = net.lease(job.replica_id, str(wd), str(self._socket_path(wd)), port) if net else \
            ("" if self.isolated else "127.0.0.1")
        env, notes = self._env(job, wd, meta, port, ip, account)
        try:
            env_script(env)
        except ValueError as e:
            raise UnsupportedJobError(f"{job.replica_id}: {e}") from None
        if job.image:
            notes.append(f"image {job.image!r} is ignored: the local backend runs the commands on this machine")
        launch = {"replica_id": job.replica_id, "isolated": self.isolated, "port": port, "address": address, "ip": ip,
                  "script": "" if later else "\n".join(job.commands), "later": later, "runner": job.runner("/bin/sh"),
                  "python": sys.executable, "bridge": BRIDGE_SCRIPT, "env": env,
                  "cwd": self.commands_dir(job),
                  # what must stay visible if it lives under the host's /tmp (hidden by the private /tmp)
                  # or under the home (hidden from a confined replica)
                  "keep": [CODE_DIR, sys.prefix, sys.base_prefix, *self._python_homes(job)]}
        if net is not None:
            launch["net"] = {"dev": local_net.REPLICA_DEV, "ip": ip, "prefix": local_net.PREFIX}
            notes.append(f"address {ip} on the network of service {job.service} ({net.net}); the host reaches "
                         f"port {port} there through the service's stream proxy")
        if self.confined and account is not None:
            launch.update(hide=str(self.home), readonly=[CODE_DIR, sys.prefix], drop=drop_argv(account))
            notes.append(f"commands run as {account.name} (uid {account.uid}), confined")
        _write_private(meta / "launch.json", json.dumps(launch))
        # -S: local_init needs the standard library alone; Python's site step (the venv's .pth files, durastack's
        # editable finder) cost 14 ms of CPU per replica, which the replicas of an apply pay all at once.
        argv = [sys.executable, "-I", "-S", INIT_SCRIPT, str(meta / "launch.json")]
        if self.isolated:
            argv = unshare_argv() + argv
        argv = join_argv(self.cgroups.make(Cgroups.name(str(wd)), limits)) + argv  # before anything of it runs
        notes.append(f"limits: {limits.summary()} (cgroup v{self.cgroups.version})" if not self.cgroups.reason
                     else self.cgroups.reason)
        with os.fdopen(_open_log(log_path), "ab") as log:
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            for line in [f"{now} starting {job.replica_id} ({self.isolation_reason}; {self.confinement_reason}) "
                         f"at {address}", *notes]:
                log.write(f"{OWN_LINES}{line}\n".encode())
            log.flush()
            # A new session: the tree outlives the worker and is not hit by signals sent to the worker's group.
            # The launcher's env is fixed: unshare and local_init run as root in the host's namespaces, and the
            # job's env (in the launch file) is applied by the commands' own shell, after the drop.
            proc = subprocess.Popen(argv, cwd=wd, env=self.launcher_env(wd), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        started = proc_stat(proc.pid)  # read before registering: until then nobody can reap it
        with _spawned_lock:
            _spawned[proc.pid] = proc
        if started is None:
            raise LocalBackendError(f"{job.replica_id}: the leader vanished at once; see {log_path}")
        inst = LocalInstance(replica_id=job.replica_id, pid=proc.pid, start_time=started.start, work_dir=str(wd),
                             address=address, isolated=self.isolated, log_path=str(log_path), ip=ip)
        _write_private(meta / "instance.json", inst.model_dump_json())
        return inst  # linked to its service's network by ``start``

    def _socket_path(self, wd: Path) -> Path:
        sock = wd / ".durastack" / "replica.sock"
        if len(str(sock)) <= _SUN_PATH_MAX:
            return sock
        # Deep work dirs exceed sun_path. With a stream proxy it listens at a short path itself; else clients
        # connect through a short symlink to the bridge's socket (connect follows it).
        short = self.home / "run" / (hashlib.sha1(str(wd).encode()).hexdigest()[:16] + ".sock")
        if len(str(short)) > _SUN_PATH_MAX:
            raise LocalBackendError(f"home {self.home} is too long for Unix socket paths; use a shorter one")
        short.parent.mkdir(parents=True, exist_ok=True)
        if not self.networked:
            short.unlink(missing_ok=True)
            short.symlink_to(sock)
        elif short.is_symlink():  # left by a run without the proxy: binding there would fail
            short.unlink()
        return short

    @staticmethod
    def launcher_env(wd: Union[Path, str]) -> dict[str, str]:
        """The whole env of the root processes that start and enter a replica (unshare, local_init, nsenter,
        setpriv): an allow-list of our own values, nothing of the service's. The marker lets a /proc scan find
        them with the replica's tree."""
        return {"PATH": BASE_PATH, "LANG": "C.UTF-8", MARKER: str(wd)}

    def _env(self, job: JobSpec, wd: Path, meta: Path, port: int, ip: str = "",
             account: Optional[Account] = None) -> tuple[dict[str, str], list[str]]:
        notes: list[str] = []
        # A confined replica cannot see this user's home (nor has one of its own): its work dir is its HOME.
        home = str(wd) if self.confined else os.environ.get("HOME") or str(Path.home())
        env = {"PATH": BASE_PATH, "HOME": home, "LANG": "C.UTF-8"}
        if account is not None:  # its uid may have no passwd entry: what getpass.getuser() and shells read instead
            env["USER"] = env["LOGNAME"] = account.name
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
        # Its own coordinates (after the job's env: a service file cannot fake them).
        env.update({"DURASTACK_SERVICE": job.service, "DURASTACK_GROUP": job.group,
                    "DURASTACK_REPLICA": str(job.replica_num), "DURASTACK_REPLICA_NUM": str(job.replica_num),
                    "DURASTACK_REPLICA_IP": ip, "PORT": str(port), MARKER: str(wd)})
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
        bindir.chmod(0o755)  # a confined replica's user runs them, whatever the umask
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
            if self.networked and inst.isolated and inst.ip and (m := _REPLICA_ID.fullmatch(inst.replica_id)):
                # Watched replicas are asked often: the way in to them comes back soon after it died.
                with contextlib.suppress(local_net.NetworkError):
                    self.network(m["service"]).ensure_proxy()
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
            # O_NOFOLLOW: a confined replica owns the log's directory, and could link the log to a file
            # it may not read, for `durastack logs` to read it out as root.
            fd = os.open(inst.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return ""
        st = os.fstat(fd)
        if (st.st_mode & 0o170000) != 0o100000 or st.st_uid != os.geteuid():
            os.close(fd)
            return ""
        try:
            with os.fdopen(fd, "rb") as f:
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
        launch = json.loads((Path(wd) / ".durastack" / "launch.json").read_text())
        env, cwd = launch["env"], launch.get("cwd", wd)
        if not os.path.isdir(cwd):
            cwd = wd  # the commands have not made it (yet)
        inner_argv, enter = list(argv), []
        if inst.isolated:
            inner = self._namespace_init(inst)
            ns = ["-n", "-m", "-p", "-i", "-u"]
            if os.readlink(f"/proc/{inner[0]}/ns/user") != os.readlink("/proc/self/ns/user"):
                ns = ["-U", "--preserve-credentials", *ns]  # unprivileged: its user namespace holds the others
            # Into a confined replica only as what its commands run as: as root, `exec` would undo it all.
            drop = launch.get("drop", [])
            enter = [shutil.which("nsenter") or "nsenter", "-t", str(inner[0]), *ns, "--", *drop]
            # cd inside, not nsenter's --wd: that one is opened before entering, so the cwd would be the
            # host's view of the directory, which the namespace's root cannot name.
            inner_argv = ["/bin/sh", "-c", 'cd -- "$0" && exec "$@"', cwd, *argv]
        # The env is applied by the shell that runs argv, after the drop: nsenter and setpriv run as root.
        loaded, env_fd = with_env(inner_argv, env)
        cmd = [*enter, *loaded]
        try:
            proc = subprocess.Popen(cmd, cwd=cwd, env=self.launcher_env(wd), stdin=env_fd,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            os.close(env_fd)
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
        if self.networked and inst.isolated and inst.ip:
            m = _REPLICA_ID.fullmatch(inst.replica_id)
            if m:
                self.network(m["service"]).release(inst.replica_id)
        self.cgroups.remove(Cgroups.name(inst.work_dir))
        meta = Path(inst.work_dir) / ".durastack"
        if killed and _read_exit_code(Path(inst.work_dir)) is None and meta.is_dir():
            _write_private(meta / "exit_code", f"{128 + signal.SIGKILL}\n")  # the wrapper died before recording one
        _scrub_launch(meta / "launch.json")


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
    # wd/exit_code: where wrappers started before .durastack/exit_code existed still write it.
    for path in (wd / ".durastack" / "exit_code", wd / "exit_code"):
        if path.is_symlink():  # wd is a confined replica's: never read through its links
            continue
        try:
            return int(path.read_text().strip())
        except (FileNotFoundError, ValueError):
            continue
    return None


def _scrub_launch(path: Path) -> None:
    """Drop the job's env (its secrets, in clear) from the launch file once nothing runs: what is left
    (id, address) is all a later ``start`` needs to adopt a tree, and a stopped one has none."""
    try:
        launch = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return
    if launch.get("env"):
        _write_private(path, json.dumps({**launch, "env": {}}))

