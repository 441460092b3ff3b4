"""Volumes, as dstack has them: a service's ``volumes`` (mount points) and a ``type: volume`` file (a network volume).

A mount point is either a **network volume** (``name``: a cloud disk made beforehand with ``durastack apply -f`` of a
``type: volume`` file, attached to the replica's instance and mounted at ``path`` in its container) or an **instance
volume** (``instance_path``: a directory of the instance, bound at ``path``, kept with the instance). Short forms:
``NAME:PATH`` and ``/HOST/PATH:PATH``.

Pure: the store keeps what a network volume is (``VolumeRecord``), ``backends/volumes.py`` does the cloud calls and
the mount over SSH, and the rules that span fields (at most one replica per network volume, unique paths) are in
``models.validation``.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import PurePosixPath
from typing import Annotated, Any, Iterable, Literal, Optional

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from models.common import Model, parse_size_gb

VOLUME_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{1,40}$")  # dstack's resource names
MAX_VOLUMES = 16  # mount points per service (EBS and PD attach at most a few dozen disks per instance)
MAX_PATH = 1024
CONTAINER_JOB_DIR = "/durastack"  # where a cloud container finds its job's files (backends/runtime.py)
# Paths of an instance a container must not be given: writing there runs code as root on the instance, outside the
# container's cgroup, where the metadata service durastack closes to containers is open (and durastack's own files).
SYSTEM_PATHS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/opt/durastack", "/proc",
                "/run", "/sbin", "/sys", "/usr", "/var/lib/docker", "/var/run", "/var/spool")
# Sizes each cloud's default volume type takes, in GB: EBS gp3, PD pd-balanced.
SIZE_LIMITS = {"aws": (1, 16384), "gcp": (10, 65536)}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _volume_name(value: Any) -> Any:
    if isinstance(value, list):
        raise ValueError("give one volume's name: a list (one of several volumes, picked by region) is not "
                         "supported yet")
    if isinstance(value, str) and not VOLUME_NAME_RE.fullmatch(value):
        raise ValueError(f"a volume name matches ^[a-z][a-z0-9-]{{1,40}}$ (lowercase letters, digits and '-'), "
                         f"got {value!r}")
    return value


VolumeName = Annotated[str, BeforeValidator(_volume_name)]


def _absolute(value: str) -> str:
    """An absolute, normalized POSIX path, as Docker's ``-v`` takes it: no ``..``, no ``:``, no control character."""
    if _CONTROL.search(value):
        raise ValueError("a path may not hold control characters")
    if len(value) > MAX_PATH:
        raise ValueError(f"a path is at most {MAX_PATH} characters")
    if not value.startswith("/"):
        raise ValueError(f"must be an absolute path, got {value!r}")
    if ":" in value:
        raise ValueError(f"may not hold ':' (Docker's -v separator), got {value!r}")
    if ".." in PurePosixPath(value).parts:
        raise ValueError(f"may not hold '..', got {value!r}")
    return str(PurePosixPath(value))


def within(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _container_path(value: str) -> str:
    if value == "/":
        raise ValueError("cannot mount over the container's root `/`")
    if within(value, CONTAINER_JOB_DIR):
        raise ValueError(f"{CONTAINER_JOB_DIR} holds the job's own files; mount elsewhere")
    return value


def _instance_path(value: str) -> str:
    if value == "/" or any(within(value, top) for top in SYSTEM_PATHS) or ".ssh" in PurePosixPath(value).parts:
        raise ValueError(f"{value} is a system path of the instance: a container given it could take the instance "
                         "over (outside its cgroup, where the metadata service is open); use a directory of your "
                         "own, e.g. /mnt/cache or /root/.cache")
    return value


ContainerPath = Annotated[str, AfterValidator(_absolute), AfterValidator(_container_path)]
InstancePath = Annotated[str, AfterValidator(_absolute), AfterValidator(_instance_path)]


def _short_form(value: Any) -> Any:
    """``NAME:PATH`` (a network volume) or ``/HOST/PATH:PATH`` (an instance volume), as dstack reads them."""
    if not isinstance(value, str):
        return value
    source, sep, path = value.partition(":")
    if not sep or not source or ":" in path:
        raise ValueError(f"expected NAME:PATH (a network volume) or /INSTANCE/PATH:PATH (an instance volume), "
                         f"got {value!r}")
    return {"instance_path": source, "path": path} if "/" in source else {"name": source, "path": path}


class VolumeMount(Model):
    """One entry of a service's ``volumes``: a network volume (``name``) or an instance volume (``instance_path``)."""

    name: Optional[VolumeName] = Field(None, description=(
        "A network volume to mount at `path`: the name of a volume made beforehand (`durastack apply -f` of a "
        "`type: volume` file; `durastack volume list`). It is attached to the replica's instance, which is placed in "
        "the volume's zone, and to one instance at a time: the service runs at most one replica."))
    instance_path: Optional[InstancePath] = Field(None, description=(
        "An instance volume: this directory of the instance (made if missing) is bound at `path`. It stays with the "
        "instance: a cache, not storage (a replacement replica may run on another instance)."))
    path: ContainerPath = Field(description="Where the container sees it: an absolute path.")
    optional: bool = Field(False, description=(
        "With `instance_path`: on a backend without instances to bind from (the local backend), run without this "
        "volume instead of refusing the replica there."))

    @model_validator(mode="after")
    def _one_source(self) -> "VolumeMount":
        if (self.name is None) == (self.instance_path is None):
            raise ValueError("give either `name` (a network volume) or `instance_path` (an instance volume)")
        if self.optional and self.name is not None:
            raise ValueError("`optional` is for instance volumes; a network volume is always mounted")
        return self

    @property
    def network(self) -> bool:
        return self.name is not None

    def __str__(self) -> str:
        return f"{self.name or self.instance_path}:{self.path}"


Mount = Annotated[VolumeMount, BeforeValidator(_short_form)]


def network_names(mounts: Iterable[VolumeMount]) -> list[str]:
    """The network volumes among ``mounts``, in order."""
    return [m.name for m in mounts if m.name is not None]


def single_attach(mounts: Iterable[VolumeMount]) -> bool:
    """Whether replicas with these mounts hold a volume that EBS and PD attach read-write to one instance at a time:
    no two of them can run at once, so a rollout stops the old replica before its replacement (rules/planner.py)."""
    return bool(network_names(mounts))


def _size(value: Any) -> Any:
    if value is None:
        return value
    gb = parse_size_gb(value)
    if gb != int(gb):
        raise ValueError(f"a whole number of GB, got {gb:g}GB")
    return int(gb)


class VolumeConfiguration(Model):
    """A ``type: volume`` file: a network volume made (``size``) or registered (``volume_id``) by ``durastack apply``."""

    type: Literal["volume"] = Field(description="Always `volume`.")
    name: Optional[VolumeName] = Field(None, description=(
        "The name services mount it by (`volumes: [NAME:PATH]`); default the file's name."))
    backend: Literal["aws", "gcp"] = Field(description="The cloud it is on: `aws` (an EBS volume) or `gcp` (a "
                                                       "persistent disk).")
    region: str = Field(min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$", description="Its region.")
    availability_zone: Optional[str] = Field(None, min_length=1, max_length=64, pattern=r"^[a-z0-9-]+$", description=(
        "Its zone, where every replica mounting it is placed: pick one that has your instance type "
        "(`durastack offers`). Default: the region's first zone."))
    size: Annotated[Optional[int], BeforeValidator(_size)] = Field(None, description=(
        "Its size, e.g. 100GB, to create a new one (formatted ext4 when first mounted). EBS gp3 takes 1GB..16384GB, "
        "PD pd-balanced 10GB..65536GB."))
    volume_id: Optional[str] = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9-]+$", description=(
        "Register an existing volume instead (AWS `vol-…`, a GCP disk's name): durastack mounts it (formatting it "
        "only if it holds no filesystem) and never deletes it, `durastack volume delete` only forgets it."))


class VolumeRecord(Model):
    """A network volume as the store keeps it."""

    name: str = Field(description="The name services mount it by.")
    backend: Literal["aws", "gcp"] = Field(description="Its cloud.")
    region: str = Field(description="Its region.")
    zone: str = Field(description="Its zone: replicas mounting it are placed there.")
    cloud_id: str = Field(description="The cloud's id: AWS `vol-…`, the GCP disk's name.")
    size_gb: int = Field(ge=0, description="Its size in GB.")
    registered: bool = Field(False, description="Registered (`volume_id`), not made by durastack: never deleted.")
    created_at: Optional[datetime] = Field(None, description="When durastack made or registered it.")

    def summary(self) -> str:
        return f"{self.backend} {self.zone} {self.cloud_id} ({self.size_gb}GB)"


class Where(Model):
    """Where a replica may be placed: the service's own narrowing, and that of the volumes it mounts."""

    backends: Optional[list[str]] = None
    regions: Optional[list[str]] = None
    zones: Optional[list[str]] = None


def placement(where: Where, records: list[VolumeRecord]) -> tuple[Where, Optional[str]]:
    """``where`` narrowed to the one backend, region and zone of the network volumes ``records`` (a replica attaches
    volumes of its own zone only), and why nothing is left (None when a place is)."""
    if not records:
        return where, None
    first = records[0]
    for other in records[1:]:
        if (other.backend, other.zone) != (first.backend, first.zone):
            return where, (f"volumes {first.name} ({first.backend} {first.zone}) and {other.name} ({other.backend} "
                           f"{other.zone}) are in different zones; a replica attaches volumes of its own zone only")
    said = f"volume {first.name} is in {first.backend} {first.zone}"
    if where.backends is not None and first.backend not in where.backends:
        return where, f"{said}, and `backends` names {', '.join(where.backends)}"
    if where.regions is not None and first.region not in where.regions:
        return where, f"{said}, and `regions` names {', '.join(where.regions)}"
    if where.zones is not None and first.zone not in where.zones:
        return where, f"{said}, and `availability_zones` names {', '.join(where.zones)}"
    return Where(backends=[first.backend], regions=[first.region], zones=[first.zone]), None


__all__ = ["CONTAINER_JOB_DIR", "MAX_VOLUMES", "Mount", "SIZE_LIMITS", "SYSTEM_PATHS", "VOLUME_NAME_RE",
           "VolumeConfiguration", "VolumeMount", "VolumeRecord", "Where", "network_names", "placement",
           "single_attach", "within"]
