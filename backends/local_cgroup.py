"""Limits of local replicas through cgroups: memory, CPU and a process cap, from the group's `resources`.

One fork bomb or leak in one replica must not take the machine from every service. Each replica gets a cgroup of
its own, under this worker's own cgroup, made by the worker (root) before the replica's launcher runs; the
launcher joins it first thing (``join_argv``), so everything the replica starts is in it. cgroup v2 (one
hierarchy with ``cgroup.controllers``) or v1 (the ``memory``, ``cpu`` and ``pids`` hierarchies), whichever the
host has. Where neither can be used (not root, read-only, controllers missing), ``Cgroups.reason`` says why, the
server's banner and each replica's log say it, and replicas run without limits.

The limit is what the group asks for at least (``memory: 8GB..`` is 8 GB, ``cpu: 2..`` 2 CPUs): offers are matched
on it, and on a shared machine it is the replica's share.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from models.resources import ResourcesSpec

PIDS_MAX = 4096  # processes and threads of one replica: a model server needs hundreds, a fork bomb more
CPU_PERIOD_US = 100_000
V1_CONTROLLERS = ("memory", "cpu", "pids")
# One line of the replica's launcher, as root with the launcher's fixed env: it joins each cgroup, then runs the rest.
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n - 1)); done; exec "$@"'


@dataclass(frozen=True)
class Limits:
    memory_bytes: Optional[int] = None
    cpus: Optional[float] = None
    pids: int = PIDS_MAX

    def summary(self) -> str:
        parts = [f"memory {self.memory_bytes / 2**30:g}GB"] if self.memory_bytes else []
        parts += [f"{self.cpus:g} CPUs"] if self.cpus else []
        return ", ".join(parts + [f"{self.pids} processes"])


def limits_for(resources: ResourcesSpec) -> Limits:
    memory = resources.memory.min
    cpus = resources.cpu.count.min
    return Limits(memory_bytes=int(memory * 2**30) if memory else None, cpus=float(cpus) if cpus else None)


def join_argv(procs: list[str]) -> list[str]:
    """The prefix that puts the process into the cgroups whose ``cgroup.procs`` files are ``procs``."""
    return ["/bin/sh", "-c", _JOIN, "sh", str(len(procs)), *procs] if procs else []


class Cgroups:
    """This host's cgroups as replicas can use them; ``reason`` is '' when they can."""

    def __init__(self, root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")):
        self.root, self.version, self.parents = root, 0, {}
        try:
            lines = [line.split(":", 2) for line in own.read_text().splitlines() if line.count(":") >= 2]
        except OSError as e:
            self.reason = f"cgroups off: {own}: {e.strerror}"
            return
        self.reason = self._detect({c: path for _, names, path in lines for c in names.split(",")})

    def _detect(self, own: dict[str, str]) -> str:
        if os.geteuid() != 0:
            return "cgroups off: not root (replicas run without memory, CPU and process limits)"
        if (self.root / "cgroup.controllers").exists():  # v2, one hierarchy
            parent = self.root / own.get("", "/").lstrip("/") / "durastack"
            missing = set(V1_CONTROLLERS) - set((self.root / "cgroup.controllers").read_text().split())
            if missing:
                return f"cgroups off: cgroup v2 lacks {', '.join(sorted(missing))}"
            try:
                parent.mkdir(exist_ok=True)
                for level in (parent.parent, parent):  # controllers for the replicas' cgroups, level by level
                    (level / "cgroup.subtree_control").write_text("+memory +cpu +pids")
            except OSError as e:
                return f"cgroups off: cgroup v2: cannot enable memory, cpu, pids under {parent.parent} ({e.strerror})"
            self.version, self.parents = 2, {"": parent}
            return ""
        parents = {c: self.root / c / own.get(c, "/").lstrip("/") / "durastack" for c in V1_CONTROLLERS}
        try:
            for path in parents.values():
                path.mkdir(exist_ok=True)
        except OSError as e:
            return f"cgroups off: cgroup v1: {e.filename}: {e.strerror}"
        self.version, self.parents = 1, parents
        return ""

    @staticmethod
    def name(work_dir: str) -> str:
        return "r" + hashlib.sha256(work_dir.encode()).hexdigest()[:16]

    def make(self, name: str, limits: Limits) -> list[str]:
        """Make the replica's cgroups with ``limits``; the ``cgroup.procs`` files its launcher joins."""
        if self.reason:
            return []
        files: dict[str, str] = {}
        if limits.memory_bytes:
            files["memory.max" if self.version == 2 else "memory/memory.limit_in_bytes"] = str(limits.memory_bytes)
        if limits.cpus:
            quota = int(limits.cpus * CPU_PERIOD_US)
            if self.version == 2:
                files["cpu.max"] = f"{quota} {CPU_PERIOD_US}"
            else:
                files.update({"cpu/cpu.cfs_period_us": str(CPU_PERIOD_US), "cpu/cpu.cfs_quota_us": str(quota)})
        files["pids.max" if self.version == 2 else "pids/pids.max"] = str(limits.pids)
        dirs = {c: p / name for c, p in self.parents.items()}
        for path in dirs.values():
            path.mkdir(exist_ok=True)
        for file, value in files.items():
            controller, _, leaf = file.rpartition("/")
            (dirs[controller] / leaf).write_text(value)
        return [str(path / "cgroup.procs") for path in dirs.values()]

    def remove(self, name: str) -> None:
        """Remove the replica's cgroups once its processes are gone (one still in use is left)."""
        for parent in self.parents.values():
            with contextlib.suppress(OSError):
                (parent / name).rmdir()
