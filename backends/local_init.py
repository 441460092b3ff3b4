"""The wrapper process of one local replica (PID 1 of its PID namespace when isolated).

Run by path as ``python -I -S local_init.py <launch.json>`` with cwd = the work dir and the backend's fixed
launcher environment (nothing of the service's); stdout/stderr are already ``replica.log``. Stdlib only, since ``-I`` hides the project (and ``-S``
skips site-packages, whose setup cost more than the rest of this script's start).

It sets up the namespaces' insides (loopback up, private /tmp, the Unix-socket bridge and, when the
replica is confined, the mounts that hide the control plane), runs the commands with
``/bin/sh -e -c`` (as the replica's own user when confined), forwards termination signals, and
writes the commands' exit code to ``.durastack/exit_code`` *before* exiting, so the backend can
tell "exited with 3" from "killed". It stays root itself: the commands, under another uid and
without capabilities, can neither signal nor trace it. The job's env reaches the commands only through
``with_env`` (below), after the drop: no root process ever carries it.
``--selftest`` does only the namespace setup, to check that isolation works on this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import re
import shlex
import signal
import socket
import struct
import subprocess
import sys
import time

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x4000
# Runs the commands in their working dir, made by the replica's own user (so a symlink it planted
# there earlier leads nowhere it could not already go).
_IN_DIR = 'mkdir -p -- "$1" && cd -- "$1" && shift && exec "$@"'
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_SIOCSIFADDR, _SIOCSIFNETMASK = 0x8916, 0x891C
_SIOCADDRT, _RTF_UP, _RTF_HOST = 0x890B, 0x1, 0x4
NET_WAIT = 30.0  # how long the backend may take to move the replica's end of its veth in
_PR_SET_CHILD_SUBREAPER = 36
# The replica's env is applied by its own shell, started with the launcher's fixed env: it reads an export
# script on its stdin, then runs the rest with stdin /dev/null. The root processes before it (unshare, this
# wrapper, nsenter, setpriv) never carry a service's variables: an LD_PRELOAD or GCONV_PATH among them would run
# its code as root in the host's namespaces.
ENV_LOADER = '. /dev/stdin && exec "$@" </dev/null'
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


COMMANDS_FILE = "commands.json"  # see _await_commands


def env_script(env: dict) -> bytes:
    """The shell script that exports ``env`` (names were validated with the service; checked again, since a
    name is not quoted)."""
    bad = sorted(k for k in env if not _ENV_NAME.fullmatch(k))
    if bad:
        raise ValueError(f"invalid environment variable names: {', '.join(bad)}")
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()).encode()


def with_env(argv: list, env: dict) -> tuple:
    """(argv that runs ``argv`` with ``env`` set by the loader shell, the descriptor to give it as stdin). The
    script is in an anonymous memory file: nothing on disk, not in any argv, gone once the shell is done."""
    script = env_script(env)
    fd = os.memfd_create("durastack-env")
    while script:
        script = script[os.write(fd, script):]
    os.lseek(fd, 0, os.SEEK_SET)
    return ["/bin/sh", "-c", ENV_LOADER, "sh", *argv], fd


def log(msg: str) -> None:
    print(f"[durastack] {msg}", file=sys.stderr, flush=True)


def loopback_up() -> None:
    """``ip link set lo up`` without needing iproute2: a new network namespace starts with lo down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)  # struct ifreq is 40 bytes
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def _link_up(s: socket.socket, dev: bytes) -> None:
    flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH22x", dev, 0)))[1]
    fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", dev, flags | _IFF_UP))


def service_link(dev: str, ip: str, prefix: int) -> None:
    """Give ``dev`` (the replica's end of its veth, which the backend moves in once we exist) the replica's
    address on its service's network, and bring it up; the kernel adds the route to that network alone."""
    deadline = time.monotonic() + NET_WAIT
    while True:
        try:
            socket.if_nametoindex(dev)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise OSError(f"{dev} did not appear within {NET_WAIT}s") from None
            time.sleep(0.01)
    mask = (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = dev.encode()
        # struct ifreq with a sockaddr_in: name, family, port, address, padding (40 bytes).
        fcntl.ioctl(s, _SIOCSIFADDR, struct.pack("16sHH4s8x8x", name, socket.AF_INET, 0, socket.inet_aton(ip)))
        fcntl.ioctl(s, _SIOCSIFNETMASK, struct.pack("16sHH4s8x8x", name, socket.AF_INET, 0, struct.pack("!I", mask)))
        _link_up(s, name)


class _RtEntry(ctypes.Structure):
    """struct rtentry (route.h), for SIOCADDRT; ctypes lays it out as the C compiler does."""
    _fields_ = [("pad1", ctypes.c_ulong), ("dst", ctypes.c_ubyte * 16), ("gateway", ctypes.c_ubyte * 16),
                ("genmask", ctypes.c_ubyte * 16), ("flags", ctypes.c_ushort), ("pad2", ctypes.c_short),
                ("pad3", ctypes.c_ulong), ("pad4", ctypes.c_void_p), ("metric", ctypes.c_short),
                ("dev", ctypes.c_char_p), ("mtu", ctypes.c_ulong), ("window", ctypes.c_ulong), ("irtt", ctypes.c_ushort)]


def _sockaddr_in(ip: str):
    return (ctypes.c_ubyte * 16).from_buffer_copy(struct.pack("HH4s8x", socket.AF_INET, 0, socket.inet_aton(ip)))


def host_route(dev: str, ip: str) -> None:
    """``ip link set dev up; ip route replace ip/32 dev dev``, by ioctl, in the calling thread's network
    namespace: no process to spawn (the backend links 16 replicas at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        _link_up(s, dev.encode())
        name = ctypes.c_char_p(dev.encode())
        route = _RtEntry(dst=_sockaddr_in(ip), genmask=_sockaddr_in("255.255.255.255"),
                         flags=_RTF_UP | _RTF_HOST, dev=name)
        try:
            fcntl.ioctl(s, _SIOCADDRT, route)
        except FileExistsError:
            pass  # routed by an earlier attempt


def _mount(src, dst: str, fstype, flags: int, data, what: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = (lambda v: v.encode() if isinstance(v, str) else v)
    if libc.mount(enc(src), dst.encode(), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} {dst}: {os.strerror(err)}")


def bind_mount(src: str, dst: str, flags: int = _MS_BIND | _MS_REC) -> None:
    _mount(src, dst, None, flags, None, f"mount --bind {src}")


def read_only(path: str) -> None:
    """Make the bind mount at ``path`` read-only (a bind mount takes its flags only from a remount)."""
    _mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY, None, "remount read-only")


def tmpfs(path: str, mode: str) -> None:
    _mount("tmpfs", path, "tmpfs", _MS_NOSUID | _MS_NODEV, f"mode={mode}", "mount tmpfs on")


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _closed_ancestor(path: str) -> str | None:
    """The topmost ancestor of ``path`` that others cannot enter (e.g. /root), or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & 0o001:
            return ancestor
    return None


def confine_mounts(home: str, work_dir: str, keep: list[str], readonly: list[str]) -> None:
    """Hide the control plane's home but for this replica's own work dir; durastack's code read-only.

    A tmpfs covers the home, or its topmost ancestor that others cannot enter (/root for
    /root/.durastack), and so does any such ancestor of what the replica needs (a pyenv Python under
    /root): the replica's user must be able to walk down to its work dir and to those, and through a
    tmpfs it can; they are bound back in it (read-only, but for the work dir), nothing else is.
    Made by the namespace's root; the commands, without CAP_SYS_ADMIN, cannot unmount any of it
    (nor from a nested user namespace: mounts inherited from a more privileged one come locked).
    """
    home = os.path.realpath(home)
    readonly = sorted({os.path.realpath(p) for p in readonly if os.path.isdir(p)})
    for path in readonly:
        bind_mount(path, path)
        read_only(path)
    needed = sorted({os.path.realpath(p) for p in keep + readonly if os.path.isdir(p)})
    covers = {_closed_ancestor(home) or home} | {a for p in needed if (a := _closed_ancestor(p))}
    covers = {c for c in covers if not any(c != o and _under(c, o) for o in covers)}
    visible = [p for p in needed if p not in covers and any(_under(p, c) for c in covers)]
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in visible}  # taken before they are covered
    own = os.open(work_dir, os.O_PATH | os.O_DIRECTORY)
    for cover in sorted(covers):
        tmpfs(cover, "755")
    for path, fd in handles.items():
        os.makedirs(path, exist_ok=True)
        bind_mount(f"/proc/self/fd/{fd}", path)
        read_only(path)
        os.close(fd)
    os.makedirs(work_dir, exist_ok=True)
    bind_mount(f"/proc/self/fd/{own}", work_dir)
    os.close(own)
    tmpfs("/dev/shm", "1777")  # the host's is shared by every replica (and anyone else)
    if os.path.isdir("/var/tmp"):
        bind_mount("/tmp", "/var/tmp", _MS_BIND)  # the other world-writable place: the replica's own /tmp
    os.chdir(work_dir)  # through the new mount, so that the work dir's path resolves for the commands


def fresh_run(keep: list[str]) -> None:
    """An empty /run (and /var/run where it is a directory of its own): the host's sockets live there (a database
    trusting local connections, Docker's, a user's session bus) and are no replica's business. The resolver's
    file is put back read-only when /etc/resolv.conf points in there, and so is anything in ``keep``."""
    resolver = os.path.dirname(os.path.realpath("/etc/resolv.conf"))
    runs = [d for d in ("/run", "/var/run") if os.path.isdir(d) and not os.path.islink(d)]
    back = sorted({p for p in [resolver, *map(os.path.realpath, keep)]
                   if os.path.isdir(p) and any(_under(p, r) and p != r for r in runs)})
    handles = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in back}  # taken before they are covered
    for run in runs:
        tmpfs(run, "755")
    for path, fd in handles.items():
        os.close(_makedirs_nofollow(path))
        bind_mount(f"/proc/self/fd/{fd}", path)
        read_only(path)
        os.close(fd)


def private_tmp(src: str, keep: list[str]) -> None:
    """Mount ``src`` on /tmp, then put back the paths of ``keep`` that lived under the host's /tmp.

    Without that, a work dir (or the interpreter) under /tmp would vanish from the replica's view:
    its cwd would no longer resolve by name.
    """
    under = sorted({os.path.realpath(p) for p in keep
                    if os.path.realpath(p).startswith("/tmp/") and os.path.isdir(p)})
    outer = [p for p in under if not any(p.startswith(q + "/") for q in under)]
    fds = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in outer}  # handles on the host's inodes
    bind_mount(src, "/tmp")
    for path, fd in fds.items():
        where = _makedirs_nofollow(path)  # inside the new /tmp: the replica's own, from an earlier run
        bind_mount(f"/proc/self/fd/{fd}", f"/proc/self/fd/{where}", _MS_BIND)
        os.close(fd)
        os.close(where)


def _makedirs_nofollow(path: str) -> int:
    """``mkdir -p path`` that never follows a symlink, as an O_PATH handle on the last directory.

    The new /tmp is the replica's own directory: a (confined) replica may have left symlinks there
    in an earlier run, and root must not make directories, nor mount, where they point.
    """
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY)
    for part in [p for p in path.split("/") if p]:
        with contextlib.suppress(FileExistsError):
            os.mkdir(part, 0o755, dir_fd=fd)
        try:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _write_exit_code(code: int) -> None:
    # In .durastack, which the replica's user cannot write: in the work dir, it could plant a
    # symlink there for root to write through.
    path = os.path.join(".durastack", "exit_code")
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(f"{code}\n")
    os.replace(path + ".tmp", path)  # atomic: readers never see a half-written file


def _scrub_launch(launch: str) -> None:
    """The commands are over: the job's env (its secrets) need not stay on disk."""
    with contextlib.suppress(OSError, ValueError):
        with open(launch) as f:
            cfg = json.load(f)
        cfg["env"] = {}
        fd = os.open(launch + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(cfg, f)
        os.replace(launch + ".tmp", launch)


def _reap_all() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def _end_group(pgid: int, grace: float = 2.0) -> None:
    """Without a PID namespace, leftovers of the app (backgrounded jobs) are ended here."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            _reap_all()  # as subreaper we are their parent; unreaped zombies would still count as members
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


class _Signals:
    """Termination signals are forwarded to the app exactly once (a second SIGTERM means
    "quit now" to servers like uvicorn); one that arrives before the app exists cancels its start."""

    def __init__(self, isolated: bool):
        self.isolated, self.app_pid, self.received, self.forwarded = isolated, None, None, False
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.handle)

    def handle(self, signum, _frame=None) -> None:
        self.received = self.received or signum
        if self.app_pid is None or self.forwarded:
            return
        self.forwarded = True
        with contextlib.suppress(ProcessLookupError):
            if self.isolated:
                os.kill(-1, signum)  # as PID 1 of the namespace: every other process in it, bridge included
            else:
                os.killpg(self.app_pid, signum)


def _await_commands(cfg: dict, signals: "_Signals") -> None:
    """A replica whose commands name replicas placed after it (or itself) is started without them: they come in
    COMMANDS_FILE once every address is known (activities/references.py). A stop meanwhile ends the wait."""
    path = os.path.join(".durastack", COMMANDS_FILE)
    while not signals.received:
        try:
            with open(path) as f:
                given = json.load(f)
        except (FileNotFoundError, ValueError):  # not yet (the worker replaces it whole, never half-written)
            time.sleep(0.02)
            continue
        cfg["script"] = given["script"]
        cfg["env"].update(given["env"])
        return


def main() -> int:
    if sys.argv[1:] == ["--selftest"]:
        loopback_up()
        bind_mount("/tmp", "/tmp")  # harmless: the mount namespace is private and dies with us
        return 0
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    isolated = cfg["isolated"]
    signals = _Signals(isolated)  # PID 1 of a namespace ignores signals it has no handler for
    os.umask(0o022)  # what it makes (the tmpfs's directories) the replica's user must be able to walk
    if isolated:
        try:
            loopback_up()
            if cfg.get("net"):
                service_link(cfg["net"]["dev"], cfg["net"]["ip"], cfg["net"]["prefix"])
            work_dir = os.getcwd()
            private_tmp(os.path.abspath("tmp"), [work_dir, *cfg["keep"]])
            fresh_run([work_dir, *cfg["keep"]])
            if cfg.get("hide"):
                confine_mounts(cfg["hide"], work_dir, cfg["keep"], cfg.get("readonly", []))
        except OSError as e:
            log(f"namespace setup failed: {e}")
            _write_exit_code(125)
            return 125
        if not cfg.get("net"):  # without a service network (not root): the socket is served from in here
            fd = os.open(os.path.join(".durastack", "bridge.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "ab") as blog:
                subprocess.Popen([cfg["python"], "-I", cfg["bridge"], "--socket", os.path.join(".durastack", "replica.sock"),
                                  "--port", str(cfg["port"])], stdin=subprocess.DEVNULL, stdout=blog, stderr=blog)
        open(os.path.join(".durastack", "ns_ready"), "w").close()  # exec may enter from now on
    else:
        # Orphans of the app (its background jobs) become our children rather than the host init's.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if cfg.get("later"):
        _await_commands(cfg, signals)
    if signals.received:
        _write_exit_code(128 + signals.received)
        return 128 + signals.received
    argv = [*cfg.get("runner", ["/bin/sh", "-e", "-c"]), cfg["script"]]
    if cfg.get("cwd") and os.path.realpath(cfg["cwd"]) != os.path.realpath(os.getcwd()):
        argv = ["/bin/sh", "-c", _IN_DIR, "sh", cfg["cwd"], *argv]
    try:
        argv, env_fd = with_env(argv, cfg["env"])
    except (OSError, ValueError) as e:
        log(f"cannot pass the replica its env: {e}")
        _write_exit_code(125)
        return 125
    try:
        app = subprocess.Popen([*cfg.get("drop", []), *argv], stdin=env_fd, process_group=0)
    finally:
        os.close(env_fd)
    signals.app_pid = app.pid
    if signals.received:
        signals.handle(signals.received)  # it came while the app was being spawned
    code = None
    while code is None:
        # PID 1 inherits orphans: reap everything, stop when the app itself ends.
        pid, status = os.waitpid(-1, 0)
        if pid == app.pid:
            code = os.waitstatus_to_exitcode(status)
    code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as shells report it
    _write_exit_code(code)
    _scrub_launch(sys.argv[1])
    if signals.received:
        # Being stopped: the shell died at once, but the server it ran (which got the signal too) may
        # still be draining, and so may the bridge. Wait for all of them; the backend bounds the wait
        # with SIGKILL. Every leftover is our child, as PID 1 or as subreaper.
        with contextlib.suppress(ChildProcessError):
            while True:
                os.waitpid(-1, 0)
    elif not isolated:
        _end_group(app.pid)
    return code  # when isolated, our exit makes the kernel kill what is left in the namespace


if __name__ == "__main__":
    sys.exit(main())
