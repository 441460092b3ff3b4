"""The wrapper process of one local replica (PID 1 of its PID namespace when isolated).

Run by path as ``python -I local_init.py <launch.json>`` with cwd = the work dir and the replica's
environment; stdout/stderr are already ``replica.log``. Stdlib only, since ``-I`` hides the project.

It sets up the namespaces' insides (loopback up, private /tmp, the Unix-socket bridge), runs the
commands with ``/bin/sh -e -c``, forwards termination signals, and writes the commands' exit code
to ``exit_code`` *before* exiting, so the backend can tell "exited with 3" from "killed".
``--selftest`` does only the namespace setup, to check that isolation works on this machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

_MS_BIND, _MS_REC = 0x1000, 0x4000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_PR_SET_CHILD_SUBREAPER = 36


def log(msg: str) -> None:
    print(f"[durastack] {msg}", file=sys.stderr, flush=True)


def loopback_up() -> None:
    """``ip link set lo up`` without needing iproute2: a new network namespace starts with lo down."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)  # struct ifreq is 40 bytes
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def bind_mount(src: str, dst: str, flags: int = _MS_BIND | _MS_REC) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(src.encode(), dst.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount --bind {src} {dst}: {os.strerror(err)}")


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
        os.makedirs(path, exist_ok=True)  # inside the new /tmp
        bind_mount(f"/proc/self/fd/{fd}", path, _MS_BIND)
        os.close(fd)


def _write_exit_code(code: int) -> None:
    with open("exit_code.tmp", "w") as f:
        f.write(f"{code}\n")
    os.replace("exit_code.tmp", "exit_code")  # atomic: readers never see a half-written file


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


def main() -> int:
    if sys.argv[1:] == ["--selftest"]:
        loopback_up()
        bind_mount("/tmp", "/tmp")  # harmless: the mount namespace is private and dies with us
        return 0
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    isolated = cfg["isolated"]
    signals = _Signals(isolated)  # PID 1 of a namespace ignores signals it has no handler for
    if isolated:
        try:
            loopback_up()
            private_tmp(os.path.abspath("tmp"), [os.getcwd(), *cfg["keep"]])
        except OSError as e:
            log(f"namespace setup failed: {e}")
            _write_exit_code(125)
            return 125
        with open(os.path.join(".durastack", "bridge.log"), "ab") as blog:
            subprocess.Popen([cfg["python"], "-I", cfg["bridge"], "--socket", "replica.sock",
                              "--port", str(cfg["port"])], stdin=subprocess.DEVNULL, stdout=blog, stderr=blog)
        open(os.path.join(".durastack", "ns_ready"), "w").close()  # exec may enter from now on
    else:
        # Orphans of the app (its background jobs) become our children rather than the host init's.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if signals.received:
        _write_exit_code(128 + signals.received)
        return 128 + signals.received
    app = subprocess.Popen(["/bin/sh", "-e", "-c", cfg["script"]], stdin=subprocess.DEVNULL, process_group=0)
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
