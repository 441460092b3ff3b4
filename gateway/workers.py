"""Who nginx's worker processes run as.

nginx's master must start as whoever runs the gateway; its workers parse every client request, so when that is
root they switch to an unprivileged user: ``nobody``/``nogroup`` (``DURASTACK_GATEWAY_WORKER_USER=user[:group]``
names another; ``root`` keeps root, on purpose only). Not being root, a worker needs, besides what the master
opens for it (listening sockets, log files, the configuration):

* the temp dirs under the runtime dir: nginx chowns them to the worker user; the runtime dir becomes 0711
  (traverse only: its files stay 600 or hold nothing secret);
* every replica socket: connect(2) needs write permission on the socket and search permission on each
  directory above it. The gateway gives the socket to the workers' group (:meth:`WorkerIdentity.grant`) when it
  is registered. The home (mode 700) and the directories in it are opened to the workers' group for search only
  (710: others still get nothing). It does not open directories outside the home: when a socket directory's
  ancestor is closed to the worker user (``/root`` is 0700, and so is a home under it), the workers stay root and
  the log says which directory blocks and what to change.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

log = logging.getLogger("durastack.gateway")
ENV_USER = "DURASTACK_GATEWAY_WORKER_USER"
UNPRIVILEGED = ("nobody", "nogroup")


@dataclass(frozen=True)
class WorkerIdentity:
    user: str
    group: str
    uid: int
    gid: int

    @property
    def privileged(self) -> bool:
        return self.uid == 0

    def directive(self) -> str:
        return f"user {self.user} {self.group};\n"

    def blocked_at(self, path: Path) -> Optional[Path]:
        """The first directory on the way to ``path`` (it or its nearest existing ancestor) that this identity
        may not search, or None."""
        path = Path(os.path.realpath(path))
        while not path.exists() and path != path.parent:
            path = path.parent
        for d in [*reversed(path.parents), path]:
            if d.is_dir() and not self._may(d.stat(), stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
                return d
        return None

    def grant(self, socket_path: str) -> None:
        """Let the workers connect to ``socket_path``: its group becomes theirs, with read and write. Only for an
        unprivileged identity when we are root (else the workers are us, or we could not chown)."""
        if self.privileged or os.geteuid() != 0:
            return
        real = os.path.realpath(socket_path)
        try:
            st = os.stat(real)
            if not stat.S_ISSOCK(st.st_mode) or self._may(st, stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH):
                return
            os.chown(real, -1, self.gid)
            os.chmod(real, stat.S_IMODE(st.st_mode) | stat.S_IRGRP | stat.S_IWGRP)
        except OSError as e:  # not there yet, or gone: nginx will say it cannot connect
            log.warning("could not open %s to nginx's workers (%s): %s", real, self.user, e)

    def open_to(self, directory: Path, home: Path) -> bool:
        """Let the workers' group search ``directory`` (not list or read it) if it is ``home`` or in it and ours;
        False if it is not ours to open."""
        home = Path(os.path.realpath(home))
        if self.privileged or not (directory == home or directory.is_relative_to(home)):
            return False
        st = directory.stat()
        if st.st_uid != os.geteuid() or (st.st_gid != self.gid and st.st_mode & 0o070):
            return False  # a group of someone else's choosing: not ours to change
        os.chown(directory, -1, self.gid)
        os.chmod(directory, stat.S_IMODE(st.st_mode) | stat.S_IXGRP)
        log.info("%s opened to nginx's workers (group %s) for search only", directory, self.group)
        return True

    def _may(self, st: os.stat_result, u: int, g: int, o: int) -> bool:
        if st.st_uid == self.uid:
            return bool(st.st_mode & u)
        if st.st_gid == self.gid or st.st_gid in _groups(self.user):
            return bool(st.st_mode & g)
        return bool(st.st_mode & o)


def _groups(user: str) -> set[int]:
    return {g.gr_gid for g in grp.getgrall() if user in g.gr_mem}


def _identity(user: str, group: Optional[str]) -> WorkerIdentity:
    pw = pwd.getpwnam(user)
    if group is None:
        gid = pw.pw_gid
        group = grp.getgrgid(gid).gr_name
    else:
        gid = grp.getgrnam(group).gr_gid
    return WorkerIdentity(user, group, pw.pw_uid, gid)


def worker_identity(socket_dirs: Iterable[Path], environ: Optional[Mapping[str, str]] = None,
                    home: Optional[Path] = None) -> Optional[WorkerIdentity]:
    """Who nginx's workers run as: None when we are not root (they run as us; nginx ignores ``user`` then).
    Directories in ``home`` that stand in their way are opened to their group for search (:meth:`open_to`)."""
    if os.geteuid() != 0:
        return None
    env = os.environ if environ is None else environ
    wanted = env.get(ENV_USER)
    if wanted:
        user, _, group = wanted.partition(":")
        try:
            return _identity(user, group or None)
        except KeyError:
            raise ValueError(f"{ENV_USER}={wanted}: no such user or group") from None
    try:
        ident = _identity(*UNPRIVILEGED)
    except KeyError:
        try:
            ident = _identity("nobody", None)
        except KeyError:
            log.warning("no user 'nobody' on this machine: nginx's workers run as root; set %s", ENV_USER)
            return _identity("root", None)
    for d in socket_dirs:
        blocked = ident.blocked_at(d)
        while blocked is not None and home is not None and ident.open_to(blocked, home):
            blocked = ident.blocked_at(d)
        if blocked is not None:
            log.warning("nginx's workers run as root: %s (user %s) cannot reach replica sockets under %s, since "
                        "%s is closed to it. Put DURASTACK_HOME where others may traverse (e.g. /var/lib/durastack), "
                        "or set %s", ident.user, ident.user, d, blocked, ENV_USER)
            return _identity("root", None)
    return ident
