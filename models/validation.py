"""Rules that span fields or levels.

Each rule is a small function that yields ``Issue``s with the exact path it is about, so that the
loader can point at the YAML line and one file reports every mistake at once.
"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

from pydantic import BaseModel, ValidationError

from models.gateway import (MAX_RATE_LIMIT_BURST, MAX_RATE_LIMIT_RPS, RATE_LIMIT_HEADER_PATTERN,
                            RATE_LIMIT_PREFIX_PATTERN)
from models.interpolation import find, group_name
from models.registry import ENV_REF
from models.reservations import format_error
from models.resources import ResourcesSpec
from models.volumes import SIZE_LIMITS, VolumeConfiguration
from models.service import (
    ENGINE_METRICS,
    GROUP_NAME_RE,
    MAX_ENV_BYTES,
    MAX_GROUP_TEXT_BYTES,
    MAX_PROBES,
    MAX_REPLICAS_PER_GROUP,
    MAX_REPLICAS_PER_SERVICE,
    MAX_SERVICE_TEXT_BYTES,
    ReplicaGroup,
    ServiceConfiguration,
)

Path = tuple  # ("groups", 1, "count")


@dataclass(frozen=True)
class Issue:
    path: Path
    message: str
    about: tuple[Path, ...] = ()  # other paths the rule read, so an error there can mute it


def _set(value: object) -> bool:
    """Booleans count as set only when true; other fields when present."""
    return value is True if isinstance(value, bool) else value is not None


def validate_service(cfg: ServiceConfiguration) -> list[Issue]:
    rules = [_model_rules, _service_level, _probes_and_limits, _rate_limits, _secrets, _loader_env, _bounds,
             _not_supported, _reservations, _references, _registry_auth, _volumes]
    rules += [_groups] if cfg.groups is not None else [_homogeneous]
    return [issue for rule in rules for issue in rule(cfg)]


def warnings_for(cfg: ServiceConfiguration) -> list[Issue]:
    out = []
    if cfg.groups and cfg.resources != ResourcesSpec():
        out.append(Issue(("resources",), "ignored because replica groups are set; give each group its resources"))
    if cfg.pass_authorization and not cfg.auth:
        out.append(Issue(("pass_authorization",), "has no effect without `auth`: the client's Authorization "
                                                  "header always reaches the replicas then"))
    for i, group in enumerate(cfg.replica_groups):
        if group.count.max == 0:
            path = ("groups", i, "count") if cfg.groups else ("replicas",)
            out.append(Issue(path, "a fixed count of 0: this group never starts a replica"))
    return out


def broken_rules(error: ValidationError) -> str:
    """Where and which rule each failure of ``error`` breaks, never the value (it may be a secret)."""
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or 'payload'}: {err['msg']}"
                     for err in error.errors(include_input=False))


def _model_rules(cfg: ServiceConfiguration) -> Iterator[Issue]:
    """The models' own rules (bounds, patterns, field checks). A file met them when it was loaded, but a
    configuration read back from history was not held to them (models.history): an update or a start that
    arrives that way is judged here, as a file is."""
    try:
        type(cfg).model_validate(cfg.model_dump(mode="json"))
    except ValidationError as e:
        for err in e.errors(include_input=False):
            yield Issue(tuple(err["loc"]), err["msg"])


def _service_level(cfg: ServiceConfiguration) -> Iterator[Issue]:
    # V16, plus `image` + `nvcc: true`, which dstack accepts and then silently ignores nvcc.
    if cfg.image is not None and cfg.python is not None:
        yield Issue(("python",), "`image` and `python` are mutually exclusive fields")
    if cfg.image is not None and cfg.nvcc:
        yield Issue(("nvcc",), "`image` and `nvcc: true` are mutually exclusive (nvcc picks durastack's CUDA image)")
    if cfg.shell is not None and cfg.shell not in ("sh", "bash") and not cfg.shell.startswith("/"):
        yield Issue(("shell",), f"`shell: {cfg.shell}`: give sh, bash, or the absolute path of a shell")
    if cfg.entrypoint is not None:
        try:
            words = shlex.split(cfg.entrypoint)
        except ValueError as e:
            words, why = [], f"cannot be split into words ({e})"
        else:
            why = "is empty"
        if not words:
            yield Issue(("entrypoint",), f"`entrypoint` {why}")
        if cfg.shell is not None:
            yield Issue(("shell",), "`shell` and `entrypoint` are mutually exclusive: the entrypoint runs the "
                                    "commands (as its last argument), not the shell")
    if cfg.docker:
        for field in ("image", "python", "nvcc"):
            if _set(getattr(cfg, field)):
                yield Issue((field,), f"`{field}` and `docker: true` are mutually exclusive fields")
        if cfg.privileged is False:
            yield Issue(("privileged",), "`privileged: false` is incompatible with `docker: true`")


# Variables with which the dynamic loader or libc loads code, or reads or writes files, of the value's choosing: the
# names glibc itself ignores in a setuid program, but TMPDIR and TZDIR (settings of the app's own). Replicas get them
# only from their own shell, never a root process (backends/local_init.py), yet a service file has no use for
# them that a command cannot have: `export LD_LIBRARY_PATH=…` in `commands` sets one for the app alone.
LOADER_ENV_PREFIXES = ("LD_",)
LOADER_ENV = frozenset({"GLIBC_TUNABLES", "GCONV_PATH", "GETCONF_DIR", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
                        "MALLOC_TRACE", "NIS_PATH", "NLSPATH", "RES_OPTIONS", "RESOLV_HOST_CONF"})


def _loader_env(cfg: ServiceConfiguration) -> Iterator[Issue]:
    # A rule of the file, not of the model's type: a service running with one of these still reads its state back.
    for name in cfg.env:
        if name in LOADER_ENV or name.startswith(LOADER_ENV_PREFIXES):
            yield Issue(("env", name), f"{name} changes what the dynamic loader or libc loads or writes, and is "
                                       f"refused in `env`, as are LD_* and {', '.join(sorted(LOADER_ENV))}; if "
                                       f"the app needs it, set it in `commands` (`export {name}=…`)")


def _text_bytes(texts: list[str]) -> int:
    return sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)


def _bounds(cfg: ServiceConfiguration) -> Iterator[Issue]:
    # The limits and why they are what they are: models.service (MAX_*).
    groups = cfg.replica_groups
    over = False
    for i, group in enumerate(groups):
        if (group.count.max or 0) > MAX_REPLICAS_PER_GROUP:
            over = True
            yield Issue(("groups", i, "count") if cfg.groups else ("replicas",),
                        f"at most {MAX_REPLICAS_PER_GROUP} replicas per group are allowed, got {group.count.max}")
    total = sum(g.count.max or 0 for g in groups)
    if total > MAX_REPLICAS_PER_SERVICE and not over:
        yield Issue(("groups",) if cfg.groups else ("replicas",),
                    f"the groups' maximum replica counts add up to {total}; "
                    f"at most {MAX_REPLICAS_PER_SERVICE} replicas per service are allowed")
    env = _text_bytes([k for k in cfg.env] + [v for v in cfg.env.values() if v])
    service_text = env
    for i, group in enumerate(groups):
        size = _text_bytes(group.commands)
        service_text += size
        if size > MAX_GROUP_TEXT_BYTES:
            yield Issue(("groups", i, "commands") if cfg.groups else ("commands",),
                        f"the commands add up to {size} bytes; at most {MAX_GROUP_TEXT_BYTES} bytes per group "
                        "are allowed (put long scripts in a file the commands run)")
    if env <= MAX_ENV_BYTES and service_text > MAX_SERVICE_TEXT_BYTES:
        yield Issue((), f"commands and env add up to {service_text} bytes; "
                        f"at most {MAX_SERVICE_TEXT_BYTES} bytes per service are allowed")


def _rate_limits(cfg: ServiceConfiguration) -> Iterator[Issue]:
    # What the gateway's route takes (models.gateway.RouteRateLimit), checked here so that a file the gateway
    # would refuse is refused at apply, with its line, and never reaches a running service.
    for i, limit in enumerate(cfg.rate_limits):
        at = ("rate_limits", i)
        if not re.fullmatch(RATE_LIMIT_PREFIX_PATTERN, limit.prefix):
            yield Issue(at + ("prefix",), "a prefix may hold letters, digits and . _ ~ % ! & ( ) * + , = : @ / - "
                                          f"only, got {limit.prefix!r}")
        if limit.key.type == "header":
            if limit.key.header is None:
                yield Issue(at + ("key", "header"), "key type `header` needs the header's name (`header: X-API-Key`)")
            elif not re.fullmatch(RATE_LIMIT_HEADER_PATTERN, limit.key.header):
                yield Issue(at + ("key", "header"), "a header name of at most 64 letters, digits, '_' and '-'")
        elif limit.key.header is not None:
            yield Issue(at + ("key", "header"), "`header` is only for key type `header`; remove it or set "
                                                "`type: header`")
        if limit.rps > MAX_RATE_LIMIT_RPS:
            yield Issue(at + ("rps",), f"at most {MAX_RATE_LIMIT_RPS} requests per second, got {limit.rps:g}")
        if limit.burst > MAX_RATE_LIMIT_BURST:
            yield Issue(at + ("burst",), f"at most {MAX_RATE_LIMIT_BURST}, got {limit.burst}")


def _not_supported(cfg: ServiceConfiguration) -> Iterator[Issue]:
    # Accepting this and doing nothing would be worse than refusing it: the service would look served
    # over TLS while it is not.
    if cfg.https is True:
        yield Issue(("https",), "`https: true` needs a TLS certificate, and the gateway has no certificate "
                                "setting yet (it serves plain HTTP); use `https: false` or `auto`")


def _reservations(cfg: ServiceConfiguration) -> Iterator[Issue]:
    """A reservation is on AWS or GCP and holds on-demand instances: a value no cloud could have, spot-only
    offers, or only the local backend would leave its replicas with no offer at all."""
    if cfg.reservation is not None:
        yield from _reservation_rules(("reservation",), cfg.reservation, cfg.spot_policy, cfg)
    for i, group in enumerate(cfg.groups or []):
        if group.reservation is not None:
            yield from _reservation_rules(("groups", i, "reservation"), group.reservation,
                                          group.spot_policy or cfg.spot_policy, cfg)
        elif cfg.reservation is not None and group.spot_policy == "spot":
            yield Issue(("groups", i, "spot_policy"), f"`spot_policy: spot` in replica group '{group.name}': the "
                                                      "service's `reservation` takes on-demand instances only",
                        about=(("reservation",),))


def _reservation_rules(at: Path, value: str, spot_policy, cfg: ServiceConfiguration) -> Iterator[Issue]:
    why = format_error(value)
    if why:
        yield Issue(at, why)
    if spot_policy == "spot":
        yield Issue(at, "a reservation takes on-demand instances only, and `spot_policy: spot` keeps spot offers "
                        "only; use `on-demand` or `auto`", about=(("spot_policy",),))
    if cfg.backends is not None and not set(cfg.backends) & {"aws", "gcp"}:
        yield Issue(at, f"reservations are on AWS or GCP, and `backends` names {', '.join(cfg.backends)} only",
                    about=(("backends",),))


def _secrets(cfg: ServiceConfiguration) -> Iterator[Issue]:
    for i, name in enumerate(cfg.secrets):
        if name not in cfg.env:
            yield Issue(("secrets", i), f"{name} is not in `env`; list the names of `env` entries that are secret",
                        about=(("env",),))


def _registry_auth(cfg: ServiceConfiguration) -> Iterator[Issue]:
    """``${{ env.NAME }}`` is the one expression `registry_auth` takes, naming an `env` entry."""
    auth = cfg.registry_auth
    if auth is None:
        return
    for field in ("username", "password"):
        text = getattr(auth, field)
        if "${{" in ENV_REF.sub("", text):
            yield Issue(("registry_auth", field), "the only expression `registry_auth` takes is `${{ env.NAME }}`, "
                                                  "naming an `env` entry")
        for name in (m[1] for m in ENV_REF.finditer(text)):
            if name not in cfg.env:
                yield Issue(("registry_auth", field), f"`${{{{ env.{name} }}}}`: {name} is not in `env`; add it "
                                                      f"there (a bare `{name}` takes it from your environment)",
                            about=(("env",),))
    if not any(cfg.image or g.image for g in cfg.replica_groups):
        yield Issue(("registry_auth",), "no group sets `image`: the default images are public, nothing would use "
                                        "these credentials")


def _volumes(cfg: ServiceConfiguration) -> Iterator[Issue]:
    """A path is mounted once and a network volume once; and since EBS and PD attach a volume read-write to one
    instance at a time (dstack's rule: only RunPod and Kubernetes volumes attach to several), a service with a network
    volume runs one replica at most, over all its groups (every group mounts the service's volumes)."""
    paths: dict[str, int] = {}
    names: dict[str, int] = {}
    for i, mount in enumerate(cfg.volumes):
        if mount.path in paths:
            yield Issue(("volumes", i, "path"), f"{mount.path} is mounted already (volumes[{paths[mount.path]}])")
        paths.setdefault(mount.path, i)
        if mount.name is not None and mount.name in names:
            yield Issue(("volumes", i, "name"), f"volume {mount.name} is mounted already (volumes[{names[mount.name]}]); "
                                                "a volume has one mount point")
        names.setdefault(mount.name or "", i)
    most = sum(g.count.max or 0 for g in cfg.replica_groups)
    first = next((i for i, m in enumerate(cfg.volumes) if m.network), None)
    if first is not None and most > 1:
        yield Issue(("volumes", first, "name"), f"volume {cfg.volumes[first].name} is a network volume, which AWS and "
                                                "GCP attach read-write to one instance at a time: the service may run "
                                                f"one replica at most, and its groups' maximum counts add up to {most}",
                    about=(("replicas",), ("groups",)))


def validate_volume(cfg: VolumeConfiguration) -> list[Issue]:
    """The rules of a `type: volume` file that span its fields."""
    issues = []
    if cfg.size is None and cfg.volume_id is None:
        issues.append(Issue(("size",), "give `size` to make a new volume, or `volume_id` to register an existing one"))
    if cfg.size is not None and cfg.volume_id is not None:
        issues.append(Issue(("volume_id",), "`size` makes a new volume and `volume_id` registers an existing one: "
                                            "give one of them"))
    lo, hi = SIZE_LIMITS[cfg.backend]
    if cfg.size is not None and not lo <= cfg.size <= hi:
        kind = "an EBS gp3 volume" if cfg.backend == "aws" else "a pd-balanced persistent disk"
        issues.append(Issue(("size",), f"{kind} is {lo}GB..{hi}GB, got {cfg.size}GB"))
    zone = cfg.availability_zone
    if zone is not None and not (zone.startswith(cfg.region) and len(zone) > len(cfg.region)):
        issues.append(Issue(("availability_zone",), f"{zone} is not a zone of region {cfg.region}"))
    if cfg.backend == "aws" and cfg.volume_id is not None and not re.fullmatch(r"vol-[0-9a-f]{8,17}", cfg.volume_id):
        issues.append(Issue(("volume_id",), f"an EBS volume id is vol- and 8 or 17 hex digits, got {cfg.volume_id!r}"))
    if cfg.backend == "gcp" and cfg.volume_id is not None and \
            not re.fullmatch(r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?", cfg.volume_id):
        issues.append(Issue(("volume_id",), f"a persistent disk's name is lowercase letters, digits and '-', got "
                                            f"{cfg.volume_id!r}"))
    return issues


def _probes_and_limits(cfg: ServiceConfiguration) -> Iterator[Issue]:
    probes = cfg.probes or []
    if len(probes) > MAX_PROBES:
        yield Issue(("probes",), f"at most {MAX_PROBES} probes are allowed, got {len(probes)}")
    seen: set[str] = set()
    for i, probe in enumerate(probes):
        key = probe.model_dump_json()
        if key in seen:
            yield Issue(("probes", i), "probes must be unique; this one repeats an earlier probe")
        seen.add(key)
    counts = Counter(limit.prefix for limit in cfg.rate_limits)
    repeated = sorted(p for p, n in counts.items() if n > 1)
    if repeated:
        yield Issue(("rate_limits",), f"prefixes {repeated} are used more than once; each prefix may appear once")


def _count_rules(count_path: Path, scaling_path: Path, group: ReplicaGroup) -> Iterator[Issue]:
    # V2 / V3: a range needs scaling; scaling needs a range.
    rng = group.count
    if rng.min != rng.max and group.scaling is None:
        yield Issue(count_path, f"a range of replicas ({rng}) needs `scaling`; or use a fixed count", (scaling_path,))
    if rng.min == rng.max and group.scaling is not None:
        yield Issue(scaling_path, f"`scaling` needs a range of replicas (e.g. 1..4), but the count is fixed at {rng}",
                    (count_path,))


def _metrics_rules(at: Path, group: ReplicaGroup, cfg: ServiceConfiguration) -> Iterator[Issue]:
    """`metrics` is read for an engine scaling metric only, and on the one port a replica is reached on."""
    if group.metrics is None:
        return
    if group.scaling is None or not group.scaling.engine:
        metric = f"`{group.scaling.metric}`" if group.scaling else "no `scaling`"
        yield Issue(at + ("metrics",), f"`metrics` is read only to scale on an engine signal ({', '.join(ENGINE_METRICS)}), "
                                       f"but this group has {metric}; remove it or set `scaling.metric`",
                    (at + ("scaling",),))
    port = group.metrics.port
    if port is not None and port != cfg.port.container_port:
        yield Issue(at + ("metrics", "port"), f"port {port} is not one the group listens on: its replicas are "
                                              f"reached on the service's port {cfg.port.container_port} only; "
                                              "serve the metrics there (or leave `port` out)", (("port",),))


def _homogeneous(cfg: ServiceConfiguration) -> Iterator[Issue]:
    yield from _count_rules(("replicas",), ("scaling",), cfg.replica_groups[0])
    yield from _metrics_rules((), cfg.replica_groups[0], cfg)
    if not cfg.commands and cfg.image is None:
        # about `groups` too: when a bad `groups` was set aside, this is only its echo.
        yield Issue(("commands",), "either `commands` or `image` must be set", about=(("groups",),))


def _groups(cfg: ServiceConfiguration) -> Iterator[Issue]:
    groups = cfg.groups or []
    if not groups:
        yield Issue(("groups",), "`groups` cannot be an empty list")
        return
    if cfg.replicas is not None:
        yield Issue(("replicas",), "`replicas` (a count) and `groups` are mutually exclusive; "
                                   "give each group its own `replicas`")
    if cfg.scaling is not None:
        yield Issue(("scaling",), "top-level `scaling` is not allowed when groups are set; set it per group")
    if cfg.commands:
        yield Issue(("commands",), "top-level `commands` is not allowed when groups are set; set them per group")
    if cfg.metrics is not None:
        yield Issue(("metrics",), "top-level `metrics` is not allowed when groups are set; set it per group")
    yield from _group_names(groups)
    for i, group in enumerate(groups):
        at = ("groups", i)
        yield from _count_rules(at + ("count",), at + ("scaling",), group)
        yield from _metrics_rules(at, group, cfg)
        yield from _group_image_rules(at, group, cfg)
        yield from _cross_level(at, group, cfg)
    yield from _routers(groups)


def _group_names(groups: list[ReplicaGroup]) -> Iterator[Issue]:
    for i, group in enumerate(groups):
        if group.name is not None and not GROUP_NAME_RE.fullmatch(group.name):
            yield Issue(("groups", i, "name"), "must match ^[a-z0-9][a-z0-9-]{0,39}$ "
                                               "(lowercase letters, digits and '-', at most 40 characters)")
    counts = Counter(g.name for g in groups)
    duplicates = sorted(n for n, c in counts.items() if c > 1 and n is not None)
    if duplicates:
        yield Issue(("groups",), f"duplicate replica group names found: {duplicates}. "
                                 "Each replica group must have a unique name (unnamed groups are named by position)")


def _group_image_rules(at: Path, group: ReplicaGroup, cfg: ServiceConfiguration) -> Iterator[Issue]:
    # V11: every group must have something to run.
    if not group.commands and group.image is None and cfg.image is None:
        yield Issue(at, f"replica group '{group.name}': either `commands` or `image` must be set in the group, "
                        "or `image` at the service level")
    # V12 and the image + nvcc extension.
    pairs = [("image", "python"), ("image", "docker"), ("python", "docker"), ("nvcc", "docker"), ("image", "nvcc")]
    for a, b in pairs:
        if _set(getattr(group, a)) and _set(getattr(group, b)):
            yield Issue(at + (b,), f"`{a}` and `{b}` are mutually exclusive within a replica group")
    # V13.
    if group.docker and group.privileged is False:
        yield Issue(at + ("privileged",), "`privileged: false` is incompatible with `docker: true` "
                                          "within a replica group")


# V15: service-level field → group-level fields it conflicts with.
_CROSS_CONFLICTS = {
    "image": ("docker", "python", "nvcc"),
    "docker": ("image", "python", "nvcc"),
    "python": ("image", "docker"),
    "nvcc": ("image", "docker"),
}
# V14: fields that may be set in one place only.
_ONE_PLACE = ("image", "docker", "privileged", "python", "nvcc", "spot_policy", "reservation")


def _cross_level(at: Path, group: ReplicaGroup, cfg: ServiceConfiguration) -> Iterator[Issue]:
    for field in _ONE_PLACE:
        if _set(getattr(cfg, field)) and getattr(group, field) is not None:
            yield Issue(at + (field,), f"`{field}` is set at both the service level and in replica group "
                                       f"'{group.name}'; set it in one place only")
    for field, conflicts in _CROSS_CONFLICTS.items():
        if not _set(getattr(cfg, field)):
            continue
        for other in conflicts:
            if getattr(group, other) is not None:
                yield Issue(at + (other,), f"service-level `{field}` conflicts with group-level `{other}` "
                                           f"in replica group '{group.name}'")
    # dstack lets this through and then runs Docker-in-Docker unprivileged.
    if cfg.docker and group.privileged is False:
        yield Issue(at + ("privileged",), f"`privileged: false` in replica group '{group.name}' is incompatible "
                                          "with service-level `docker: true`")


def _routers(groups: list[ReplicaGroup]) -> Iterator[Issue]:
    with_router = [i for i, g in enumerate(groups) if g.router is not None]
    for i in with_router[1:]:
        yield Issue(("groups", i, "router"), "at most one replica group may specify `router`")
    for i in with_router:
        count = groups[i].count
        if not (count.min == count.max == 1):
            yield Issue(("groups", i, "count"), "the replica group with `router` must have exactly 1 replica")


def _references(cfg: ServiceConfiguration) -> Iterator[Issue]:
    """Replica addresses (``${{ groups[i].replicas[j].IP_ADDRESS }}``, models.interpolation): only in
    commands, of a replica that always exists. They may form cycles (a group naming its own replicas[0], a router
    and its workers naming each other): every replica has its address once placed, before its commands run
    (rules/addresses.py)."""
    for key, value in cfg.env.items():
        if value is not None and any(True for _ in find(value)):
            yield Issue(("env", key), "`${{ … }}` expressions may appear only in `commands`, never in `env`; "
                                      "use them in a command (e.g. `export NAME=${{ … }}`)")
    for path in _expressions_outside_commands(cfg, ()):
        field = next(p for p in reversed(path) if isinstance(p, str))
        yield Issue(path, f"`${{{{ … }}}}` expressions may appear only in `commands`: `{field}` would get it as "
                          "literal text")
    groups = cfg.replica_groups
    names = [g.name or str(i) for i, g in enumerate(groups)]
    for i, group in enumerate(groups):
        for k, command in enumerate(group.commands):
            at = ("groups", i, "commands", k) if cfg.groups else ("commands", k)
            for found in find(command):
                issue = _reference_issue(found, groups, names)
                if issue:
                    yield Issue(at, f"{found.text}: {issue}")


def _expressions_outside_commands(node: object, at: Path) -> Iterator[Path]:
    """Paths of the string fields holding ``${{`` other than ``commands`` and ``env`` (which has its own rule).
    No other form (``${{ secrets.X }}``; ``${{ env.X }}`` but in `registry_auth`, which has its own rule) is
    substituted anywhere: every one would reach the job as written."""
    if isinstance(node, str):
        if "${{" in node:
            yield at
    elif isinstance(node, BaseModel):
        for name in type(node).model_fields:
            if (not at and name in ("env", "registry_auth")) or name == "commands":
                continue
            yield from _expressions_outside_commands(getattr(node, name), at + (name,))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from _expressions_outside_commands(item, at + (i,))
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _expressions_outside_commands(value, at + (str(key),))


def _reference_issue(found, groups: list[ReplicaGroup], names: list[str]) -> str:
    if found.ref is None:
        return found.error
    name = group_name(names, found.ref.group)
    if name is None:
        what = f"index {found.ref.group}" if isinstance(found.ref.group, int) else f"name '{found.ref.group}'"
        return f"no replica group with {what} (groups: {', '.join(names)})"
    lo = groups[names.index(name)].count.min or 0
    if found.ref.replica >= lo:
        if lo == 0:
            return (f"group '{name}' scales to zero (its minimum is 0), so none of its replicas always exists "
                    "to be referenced")
        return (f"replica index {found.ref.replica} is out of range: group '{name}' always has {lo} replica(s) "
                f"(its minimum), replicas[0]..replicas[{lo - 1}]")
    return ""


