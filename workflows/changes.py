"""What a new configuration changes in a running service, and how each change is applied (spec 6.1).

Pure: the CLI uses it to show the diff before asking, the workflow's update validator to refuse a
change it cannot apply, and the planner (through ``spec_hash``) to tell which replicas must roll.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from models.service import ServiceConfiguration
from workflows.jobs import replica_input

# Applied by changing counts and decisions only: no replica restarts.
IN_PLACE = {"replicas", "groups", "scaling", "stop_duration", "cold_start_timeout"}
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
    a, b = old.model_dump(mode="json"), new.model_dump(mode="json")
    for name in sorted(set(a) | set(b)):
        if a.get(name) == b.get(name):
            continue
        if name in IN_PLACE:
            changes.in_place.append(name)
        elif name in ROLLING:
            changes.rolling.append(name)
        else:
            changes.not_updatable.append(name)
    return changes


def spec_hash(config: ServiceConfiguration, group: str) -> str:
    """Identity of what a replica of ``group`` runs; equal hashes mean no restart is needed."""
    inp = replica_input(config, "x", "x", group, 0, 0, 0)
    payload = inp.model_dump(mode="json", exclude={"service_workflow_id", "deployment_num", "stop_duration"})
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
