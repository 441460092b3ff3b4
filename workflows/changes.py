"""What a new configuration changes in a running service, and how each change is applied (spec 6.1).

Pure: the CLI uses it to show the diff before asking, the workflow's update validator to refuse a
change it cannot apply, and the planner (through ``spec_hash``) to tell which replicas must roll.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from models.secrets import REVEAL
from models.service import ServiceConfiguration
from workflows.jobs import replica_input

# Applied by changing counts and decisions only: no replica restarts.
# `secrets` only changes which values are encrypted in history: what replicas run stays the same.
IN_PLACE = {"replicas", "groups", "scaling", "stop_duration", "cold_start_timeout", "secrets"}
# Applied by replacing the replicas whose job changes, one at a time per group.
ROLLING = {"port", "probes", "resources", "docker", "image", "privileged", "python", "nvcc", "env",
           "commands", "entrypoint", "working_dir", "user", "shell"}


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
                (changes.rolling if f in ROLLING else changes.in_place).append(where)
    changes.in_place += [f"{key}.{name} (removed)" for name in before]


def spec_hash(config: ServiceConfiguration, group: str) -> str:
    """Identity of what a replica of ``group`` runs; equal hashes mean no restart is needed."""
    inp = replica_input(config, "x", "x", group, 0, 0, 0)
    # Real values, without which of them are secret: marking a value secret restarts nothing.
    payload = inp.model_dump(mode="json", context=REVEAL,
                             exclude={"service_workflow_id": True, "deployment_num": True, "stop_duration": True,
                                      "job": {"secrets"}})
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
