"""Whether a running service takes a `scale` or an `apply` (pure).

One place for the rules, used by the update validators (which never replay) and by the judge of
signals (a local activity, whose verdict is recorded). No handler runs them: tightening a rule here
never changes how an old history replays.
"""

from __future__ import annotations

from models.loader import render_path
from models.messages import ScaleRequest
from models.service import ServiceConfiguration
from models.validation import validate_service
from rules.autoscaler import bounds
from rules.changes import classify


class Refused(Exception):
    """A refused message: ``kind`` is the ApplicationError type the CLI shows, ``str()`` the reason."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def check_scale(config: ServiceConfiguration, stopping: bool, request: ScaleRequest) -> None:
    if stopping:
        raise Refused("Stopping", "the service is stopping")
    spec = config.group(request.group)
    if spec is None:
        known = ", ".join(g.name for g in config.replica_groups)
        raise Refused("UnknownGroup", f"no replica group '{request.group}' (groups: {known})")
    lo, hi = bounds(spec)
    if not lo <= request.count <= hi:
        raise Refused("OutOfRange", f"group '{request.group}' takes {lo}..{hi} replicas, not {request.count}")


def check_apply(name: str, config: ServiceConfiguration, stopping: bool, new: ServiceConfiguration) -> None:
    """Refuse what cannot be applied in place. Re-applying the running configuration is not refused: it is
    a no-op the caller is told about, so a retried `durastack apply` succeeds."""
    if stopping:
        raise Refused("Stopping", "the service is stopping")
    issues = validate_service(new)
    if issues:
        raise Refused("InvalidConfiguration", "invalid configuration: " + "; ".join(
            f"{render_path(i.path)}: {i.message}" for i in issues))
    if new.name not in (None, name):
        raise Refused("InvalidConfiguration", f"name: the configuration is for {new.name!r}, not {name!r}")
    changes = classify(config, new)
    if changes.not_updatable:
        raise Refused("NotUpdatable", "cannot be updated in place: " + ", ".join(changes.not_updatable)
                      + "; stop the service and apply again")
