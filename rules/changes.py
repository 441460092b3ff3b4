"""What a new configuration changes in a running service, and how each change is applied.

Pure: the CLI uses it to show the diff before asking, the workflow's update validator to refuse a
change it cannot apply, and the planner (through ``spec_hash``) to tell which replicas must roll.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from models.secrets import REVEAL
from models.service import ServiceConfiguration
from models.messages import ReplicaInput
from rules.jobs import COORDINATES, replica_input

# Applied by changing counts and decisions only: no replica restarts.
# `secrets` only changes which values are encrypted in history: what replicas run stays the same.
# The gateway route's settings are put again on the route by the service's loop (lifecycle.route).
# `retry` and `max_duration` are the service's own decisions: the next failure, the next pass use the new ones.
# `idle_duration` is read by the next replica that stops.
# `registry_auth` is read by the next pull (a rotated token must not restart replicas that pulled already).
IN_PLACE = {"replicas", "groups", "scaling", "stop_duration", "startup_timeout", "cold_start_timeout", "secrets",
            "rate_limits", "strip_prefix", "pass_authorization", "retry", "max_duration", "registry_auth",
            "idle_duration"}
# Applied by replacing the replicas whose job changes, one at a time per group.
ROLLING = {"port", "probes", "resources", "docker", "image", "privileged", "python", "nvcc", "env",
           "commands", "entrypoint", "working_dir", "user", "shell", "volumes"}
# A group's reservation is where its replicas are placed: new ones go into the new one, one at a time, as dstack
# redeploys the jobs whose requirements change. The service's `reservation` is not updatable, as in dstack.
GROUP_ROLLING = {"reservation"}


@dataclass
class Changes:
    in_place: list[str] = field(default_factory=list)
    rolling: list[str] = field(default_factory=list)
    not_updatable: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.in_place or self.rolling or self.not_updatable)


def classify(old: ServiceConfiguration, new: ServiceConfiguration) -> Changes:
    changes = Changes()
    a, b = old.model_dump(mode="json", context=REVEAL), new.model_dump(mode="json", context=REVEAL)
    for name in sorted(set(a) | set(b)):
        if a.get(name) == b.get(name):
            continue
        if name in ("replicas", "groups") and isinstance(a.get(name), list) and isinstance(b.get(name), list):
            _classify_groups(a[name], b[name], name, changes)
        elif name in IN_PLACE:
            changes.in_place.append(name)
        elif name in ROLLING:
            changes.rolling.append(name)
        else:
            changes.not_updatable.append(name)
    # Which group routes decides which replicas the gateway knows: moving, adding or removing the router, or
    # changing its type, would leave running replicas registered (or not) against the new rule.
    routers = [(c.router_group, (c.group(c.router_group).router if c.router_group else None)) for c in (old, new)]
    if routers[0] != routers[1]:
        changes.not_updatable.append("router")
    return changes


def _classify_groups(old: list[dict], new: list[dict], key: str, changes: Changes) -> None:
    """Name what changed inside each group, so `apply` says which groups roll and why."""
    before = {g.get("name"): g for g in old}
    for g in new:
        prev = before.pop(g.get("name"), None)
        if prev is None:
            changes.in_place.append(f"{key}.{g.get('name')} (added)")
            continue
        for f in sorted(set(prev) | set(g)):
            if prev.get(f) != g.get(f):
                where = f"{key}.{g.get('name')}.{f}"
                (changes.rolling if f in ROLLING | GROUP_ROLLING else changes.in_place).append(where)
    changes.in_place += [f"{key}.{name} (removed)" for name in before]


# What a replica runs, for `spec_hash`: an explicit list, so a model that gains a field restarts nothing.
# Nested models are hashed without their default values, for the same reason. Bump SPEC_VERSION only for
# a change that must restart every replica on its next deployment.
SPEC_VERSION = 1
JOB_FIELDS = ("commands", "env", "port", "python", "image")
INPUT_FIELDS = ("resources", "probes", "backends", "regions", "spot_policy", "max_price")


def spec_hash(config: ServiceConfiguration, group: str, key: str = "") -> str:
    """Identity of what a replica of ``group`` runs; equal hashes mean no restart is needed. Keyed with ``key``
    (the service's ``hash_key``): the hash goes into history in clear, and secret values go into it."""
    return input_hash(replica_input(config, "x", "x", group, 0, 0, 0), key)


def input_hash(inp: ReplicaInput, key: str = "") -> str:
    # Real values, without which of them are secret: marking a value secret restarts nothing.
    fields = {f"job.{name}": getattr(inp.job, name) for name in JOB_FIELDS}
    # The replica's coordinates are not what it runs: a replica that predates them restarts for nothing.
    fields["job.env"] = {k: v for k, v in inp.job.env.items() if k not in COORDINATES}
    fields.update({name: getattr(inp, name) for name in INPUT_FIELDS})
    if inp.reservation:  # only when set: the hash of every replica without one stays what it was
        fields["reservation"] = inp.reservation
    if inp.job.volumes:  # likewise
        fields["job.volumes"] = inp.job.volumes
    payload = {"version": SPEC_VERSION, **{name: _plain(value) for name, value in fields.items()}}
    data = json.dumps(payload, sort_keys=True).encode()
    if key:
        return hmac.new(key.encode(), data, hashlib.sha256).hexdigest()[:16]
    return hashlib.sha256(data).hexdigest()[:16]


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True, context=REVEAL)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
