"""Facts about this machine for the local backend: processes in /proc, namespaces, Pythons, GPUs.

Kept apart from ``local.py`` so that the backend reads as orchestration only.
"""

from __future__ import annotations

import fcntl
import functools
import glob
import grp
import hashlib
import json
import os
import platform
import pwd
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

from models.resources import ResourcesSpec

INIT_SCRIPT = str(Path(__file__).with_name("local_init.py"))
BRIDGE_SCRIPT = str(Path(__file__).with_name("bridge.py"))
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
MARKER = "DURASTACK_WORK_DIR"  # set on every process of a replica, so a /proc scan finds the whole tree


class NoOffersError(RuntimeError):
    """This machine cannot satisfy the requested resources."""


# ---- processes -------------------------------------------------------------------------------

class ProcStat(NamedTuple):
    state: str
    ppid: int
    pgrp: int
    session: int
    start: int  # clock ticks after boot


def proc_stat(pid: int) -> Optional[ProcStat]:
    """Fields of /proc/<pid>/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:  # no such process, or it vanished while we read
        return None
    rest = raw[raw.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
    return ProcStat(rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))


def start_time(pid: int) -> Optional[int]:
    st = proc_stat(pid)
    return st.start if st else None


def is_alive(pid: int, started: int) -> bool:
    """True only for *our* process: same PID and start time, and not a zombie."""
    st = proc_stat(pid)
    return st is not None and st.start == started and st.state not in "ZX"


def _live() -> Iterator[tuple[int, ProcStat]]:
    for pid in _pids():
        st = proc_stat(pid)
        if st is not None and st.state not in "ZX":
            yield pid, st


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def find_tree(work_dir: str, leader: Optional[int] = None) -> dict[int, int]:
    """{pid: starttime} of live processes carrying the replica's marker, or in the leader's session."""
    marker = f"{MARKER}={work_dir}".encode()
    found: dict[int, int] = {}
    for pid, st in _live():
        if leader is not None and st.session == leader:
            found[pid] = st.start
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found[pid] = st.start
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def children(pid: int) -> list[int]:
    return [p for p, st in _live() if st.ppid == pid]


def process_group(pgid: int) -> dict[int, int]:
    return {p: st.start for p, st in _live() if st.pgrp == pgid}


def send_signal(pid: int, started: int, sig: int) -> bool:
    """Signal pid only if it is still the process that started at ``started``.

    A pidfd pins the process before the start time is checked, so a PID reused in between is
    never hit.
    """
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if start_time(pid) != started:
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


# ---- namespaces ------------------------------------------------------------------------------

def unshare_argv() -> list[str]:
    """New net, mount, PID, IPC and UTS namespaces (the host's SysV shared memory and semaphores, and its
    hostname, are not the replica's); --kill-child ties the namespace's PID 1 to the leader."""
    flags = ["--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]  # unprivileged user namespaces
    return [shutil.which("unshare") or "unshare", *flags, "--"]


@functools.lru_cache(maxsize=1)
def probe_isolation() -> tuple[bool, str]:
    """Try the real thing once (unshare + loopback up + bind mount) and cache the answer."""
    if not sys.platform.startswith("linux"):
        return False, "isolation off: namespaces need Linux"
    missing = [t for t in ("unshare", "nsenter") if not shutil.which(t)]
    if missing:
        return False, f"isolation off: {' and '.join(missing)} (util-linux) not found"
    try:
        r = subprocess.run([*unshare_argv(), sys.executable, "-I", INIT_SCRIPT, "--selftest"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"isolation off: unshare failed: {e}"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        return False, f"isolation off: cannot create namespaces here ({why})"
    return True, "isolation on: each replica gets its own network, mount and PID namespaces"


# ---- confinement -----------------------------------------------------------------------------
#
# Namespaces alone do not confine a replica started by root: it is still root on the host, with
# every capability, so it can unmount what hides the control plane, read any file, enter other
# namespaces. A confined replica's commands run under a non-root *host* uid (a uid mapped by a user
# namespace is not enough: the host still sees root), with an empty capability bounding set and
# no_new_privs (no setuid or file-capability binary can give any back). The mounts that hide the
# home are made by the namespace's root before it drops, so the replica cannot undo them: umount
# needs CAP_SYS_ADMIN in the user namespace that owns the mount namespace, which is the host's.

REPLICA_USER_ENV = "DURASTACK_REPLICA_USER"  # the host user confined replicas run as
DEFAULT_REPLICA_USER = "durastack-replica"
LOCAL_USERS_ENV = "DURASTACK_LOCAL_USERS"  # host users a service's `user:` may name (comma list)


class Account(NamedTuple):
    name: str
    uid: int
    gid: int


def replica_user() -> str:
    """The name of the host user confined replicas run as (unless a service names another)."""
    return os.environ.get(REPLICA_USER_ENV, "").strip() or DEFAULT_REPLICA_USER


def replica_account(create: bool = True) -> Optional[Account]:
    """The host user confined replicas run as; created (a system user, no home, no shell) when missing."""
    name = replica_user()
    for attempt in range(2):
        try:
            pw = pwd.getpwnam(name)
            return Account(pw.pw_name, pw.pw_uid, pw.pw_gid) if pw.pw_uid != 0 else None
        except KeyError:
            pass
        if attempt or not create or os.geteuid() != 0 or not shutil.which("useradd"):
            return None
        # Two workers may race here: the loser's useradd fails, and the lookup above finds the user.
        subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", "--comment", "durastack local replicas", name],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=30)
    return None


# Each service's replicas get a uid (and gid) of their own, above the ranges that users and the /etc/subuid ranges of
# rootless containers take; no passwd entry: nothing on the host names them, so nothing of the host is theirs.
SERVICE_UID_BASE = 0x70000000
SERVICE_UID_SLOTS = 1 << 20
SERVICE_UIDS_FILE = "uids.json"


def service_account(home: Path, service: str) -> Account:
    """The account the replicas of ``service`` run as (unless its ``user:`` names another): a uid no host user nor
    other service of the home has, kept in ``<home>/uids.json`` so that it stays the same for the service's life.
    Replicas of one service share files (a volume, their work dirs' group); those of two services share nothing,
    not even a uid's process count."""
    path = Path(home) / SERVICE_UIDS_FILE
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            uids = json.loads(path.read_text())
        except (OSError, ValueError):
            uids = {}
        if service not in uids:
            taken = set(uids.values())
            slot = int(hashlib.sha256(f"{home}\0{service}".encode()).hexdigest(), 16) % SERVICE_UID_SLOTS
            while SERVICE_UID_BASE + slot in taken or _uid_exists(SERVICE_UID_BASE + slot):
                slot = (slot + 1) % SERVICE_UID_SLOTS
            uids[service] = SERVICE_UID_BASE + slot
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(uids, indent=1, sort_keys=True))
            os.replace(tmp, path)
    uid = uids[service]
    return Account(f"durastack-{service}", uid, uid)


def _uid_exists(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def account_for(user: str) -> Optional[Account]:
    """A host user by name or uid, or None."""
    try:
        pw = pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except (KeyError, OverflowError):
        return None
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid)


def allowed_users() -> set[str]:
    return {u.strip() for u in os.environ.get(LOCAL_USERS_ENV, "").split(",") if u.strip()}


def user_refusal(user: Optional[str], replicas: Optional[Account]) -> Optional[str]:
    """Why the local backend would not run a service's commands as ``user`` (None: it would, or none is named).
    ``replicas``: the account confined replicas run as, or None when they run as this process's user."""
    if user is None:
        return None
    acct = account_for(user)
    if replicas is None:
        if acct is not None and acct.uid == os.geteuid():
            return None
        return f"cannot run the commands as user {user!r}: replicas run as this backend's own user here"
    if acct is None:
        return f"user {user!r}: no such user on this machine"
    if acct.uid == 0:
        return f"user {user!r}: the local backend never runs replicas as root"
    if acct.uid != replicas.uid and not {acct.name, str(acct.uid)} & allowed_users():
        # Running as any host user would hand a service file that user's files.
        return (f"user {user!r}: replicas run as {replicas.name}; to allow {acct.name}, list it in "
                f"{LOCAL_USERS_ENV} (comma-separated) where the worker runs")
    return None


def drop_argv(account: Account) -> list[str]:
    """argv prefix that runs what follows as ``account`` with no capability left, nor a way to gain one."""
    return [shutil.which("setpriv") or "setpriv", f"--reuid={account.uid}", f"--regid={account.gid}",
            "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


@functools.lru_cache(maxsize=1)
def probe_confinement() -> tuple[bool, str]:
    """Whether replicas can be confined here (see above), and a line saying so or why not."""
    isolated, why = probe_isolation()
    if not isolated:
        return False, f"confinement off: replicas run as this user ({why})"
    if os.geteuid() != 0:
        return False, ("confinement off: not running as root, so replicas run as this user and can read "
                       "its files, the home included")
    if not shutil.which("setpriv"):
        return False, "confinement off: setpriv (util-linux) not found; replicas run as root"
    account = replica_account()
    if account is None:
        return False, (f"confinement off: no non-root user for replicas (set {REPLICA_USER_ENV}, or install "
                       "useradd); replicas run as root")
    return True, (f"confinement on: replicas run as {account.name} (uid {account.uid}) without capabilities; "
                  "the home is hidden from them and durastack's code is read-only")


# ---- python, ports -----------------------------------------------------------------------------

def _in_our_venv(path: str) -> bool:
    # The worker's own venv holds durastack's dependencies; replicas must not use or pip into it.
    return sys.prefix != sys.base_prefix and os.path.realpath(path).startswith(os.path.realpath(sys.prefix) + os.sep)


@functools.lru_cache(maxsize=None)
def find_python(version: str) -> Optional[str]:
    """A working ``python<version>`` on this machine (PATH, then pyenv), or None."""
    name = f"python{version}"
    pyenv = os.path.join(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv")), "versions")
    # pyenv shims fail for versions that are not selected, so look at its installs directly too.
    installs = sorted(glob.glob(f"{pyenv}/{version}.*/bin/{name}") + glob.glob(f"{pyenv}/{version}/bin/{name}"),
                      key=lambda p: [int(x) if x.isdigit() else -1 for x in Path(p).parts[-3].split(".")],
                      reverse=True)
    dirs = BASE_PATH.split(":") + os.environ.get("PATH", "").split(":")
    for cand in [os.path.join(d, name) for d in BASE_PATH.split(":")] + installs + \
            [os.path.join(d, name) for d in dirs if d]:
        if not os.access(cand, os.X_OK) or _in_our_venv(cand):
            continue
        try:
            r = subprocess.run([cand, "-c", "import sys; print('%d.%d' % sys.version_info[:2]); print(sys.executable)"],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            continue
        lines = r.stdout.split("\n")
        if r.returncode == 0 and lines[0] == version and lines[1]:
            return lines[1]
    return None


def default_python() -> Optional[str]:
    return shutil.which("python3", path=BASE_PATH)


def free_port() -> int:
    """A currently free 127.0.0.1 port. Another process may still take it before the app binds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- resources ---------------------------------------------------------------------------------

def gpu_count() -> int:
    nvidia = len(glob.glob("/proc/driver/nvidia/gpus/*")) or len(glob.glob("/dev/nvidia[0-9]*"))
    amd = 0
    for path in glob.glob("/sys/class/kfd/kfd/topology/nodes/*/gpu_id"):
        try:
            amd += Path(path).read_text().strip() not in ("", "0")  # gpu_id 0 is a CPU node
        except OSError:
            pass
    return nvidia + amd


def total_memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


_ARCH = {"x86_64": "x86", "amd64": "x86", "i686": "x86", "aarch64": "arm", "arm64": "arm"}


def check_resources(resources: ResourcesSpec) -> None:
    """Raise NoOffersError when this machine cannot meet the minimums of ``resources``.

    Only lower bounds are checked: local replicas share the machine and are not limited to a size.
    GPU names and memory, and disk, are not checked.
    """
    gpus, need_gpus = gpu_count(), resources.gpu_count.min or 0
    if need_gpus > gpus:
        have = "no GPU" if gpus == 0 else f"{gpus} GPU(s)"
        raise NoOffersError(f"no offers: this machine has {have} (requested gpu={resources.gpu})")
    cpus = os.cpu_count() or 1
    if (resources.cpu.count.min or 0) > cpus:
        raise NoOffersError(f"no offers: this machine has {cpus} CPUs (requested cpu={resources.cpu})")
    arch = _ARCH.get(platform.machine().lower(), platform.machine())
    if resources.cpu.arch and resources.cpu.arch != arch:
        raise NoOffersError(f"no offers: this machine's CPU is {arch} (requested cpu={resources.cpu})")
    mem = total_memory_gb()
    if (resources.memory.min or 0) > mem:
        raise NoOffersError(f"no offers: this machine has {mem:.1f}GB of memory "
                            f"(requested memory={resources.memory}GB)")
