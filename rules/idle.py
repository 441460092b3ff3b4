"""Instances kept idle for reuse (`idle_duration`), as pure rules on the service's state.

A replica scaled down or replaced in a rolling deployment may leave its cloud instance idle instead of terminating
it; the service keeps it in ``ServiceState.idle`` and gives it to the next replica of the same group whose
placement inputs are equal (rules.jobs.placement_key), so that the replica needs no new VM and no image pull.
The pool is the service's own: an instance never passes to another service.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Optional

from models.common import format_duration
from models.router import Instance
from models.state import IdleInstance, Replica, ServiceState

# An idle instance is given to a new replica only with this much of its idle time left: its launch must retag it
# before the replica that left it may terminate it.
MARGIN = timedelta(minutes=2)


def keep(state: ServiceState, replica: Replica, instance: Instance, now: datetime) -> str:
    """The replica ended and left ``instance`` idle: pooled for `idle_duration` (0 when it is off by now: released
    at the next pass). Returns the note."""
    seconds = state.config.idle_duration or 0
    placement = replica.placement
    state.idle.append(IdleInstance(group=replica.group, backend=placement.backend if placement else "local",
                                   instance_id=placement.instance_id if placement else "",
                                   replica_num=replica.replica_num,
                                   submission_num=replica.submission_num, instance=instance,
                                   placement_key=replica.placement_key, until=now + timedelta(seconds=seconds)))
    return f"its instance is kept idle for {format_duration(seconds)} for the group's next replica"


def take(state: ServiceState, group: str, key: str, now: datetime) -> Optional[IdleInstance]:
    """The idle instance a new replica of ``group`` with placement inputs ``key`` starts on, taken out of the pool:
    the oldest of that group with the same inputs and more than MARGIN left; None if there is none."""
    found = next((i for i in state.idle if i.group == group and key and i.placement_key == key
                  and i.until - now > MARGIN), None)
    if found is not None:
        state.idle.remove(found)
    return found


def settled(state: ServiceState) -> list[tuple[IdleInstance, bool]]:
    """Idle instances given to replicas whose launch has placed them, or which ended unplaced: each with whether
    that replica runs on it (its launch retagged it: the replica that left it may end), else it is terminated. A
    replica that left an instance is told only then, never before the instance is tagged for the one that took it:
    the reaper would take an instance no open replica workflow is tagged on for an orphan."""
    out = []
    for r in state.replicas:
        if r.reuse is not None and (r.placement is not None or r.finished):
            out.append((r.reuse, r.placement is not None and r.placement.instance_id == r.reuse.instance_id))
            r.reuse = None
    return out


def due(state: ServiceState, now: datetime) -> list[IdleInstance]:
    """Idle instances to terminate now, taken out of the pool: past their time, of a group the service no longer
    has, or all once `idle_duration` is off."""
    groups = {g.name for g in state.config.replica_groups}
    off = not state.config.idle_duration
    out = [i for i in state.idle if off or i.group not in groups or i.until <= now]
    state.idle = [i for i in state.idle if i not in out]
    return out


def owners(state: ServiceState) -> list[IdleInstance]:
    """Every idle instance whose replica's workflow still owns it: in the pool, or given to a replica not yet
    placed on it."""
    return state.idle + [r.reuse for r in state.replicas if r.reuse is not None]


def pending(state: ServiceState) -> bool:
    """Whether the service has an idle instance to look after."""
    return bool(owners(state))


def next_due(state: ServiceState) -> Optional[datetime]:
    """When the next idle instance is due; None without any."""
    return min((i.until for i in state.idle), default=None)
