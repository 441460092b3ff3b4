"""Pure decisions of a service run: which replicas to start and which to stop.

No Temporal, no I/O: functions of the state and the time, so every rule is testable on its own.
The ServiceRunWorkflow applies what these return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Optional

from models.state import GroupState, Replica, ServiceState
from models.service import ServiceConfiguration
from models.volumes import single_attach
from rules.addresses import late, readdressed, resolve
from rules.autoscaler import bounds

# Resubmission back-off after failures in a row of a group. The first is
# replaced at once (a replica that served for hours and crashed should not wait); from the second in a
# row on, the group waits these many seconds. A failure more than FAILURE_MEMORY after the end of the last
# back-off starts a new row.
BACKOFF = (15, 30, 60, 120, 300, 600)
FAILURE_MEMORY = timedelta(minutes=10)
KEEP_FINISHED = 50  # finished rows kept for `ps` (the latest submission of each replica wins)


@dataclass(frozen=True)
class Start:
    group: str
    replica_num: int
    submission_num: int


@dataclass(frozen=True)
class Stop:
    replica_num: int
    submission_num: int
    reason: str


@dataclass
class Plan:
    start: list[Start] = field(default_factory=list)
    stop: list[Stop] = field(default_factory=list)
    # Not actions: what the workflow records. The addresses each group's new replicas start with; why a
    # group cannot start the replicas it needs; why a group's current replicas roll (an address moved).
    refs: dict[str, dict[str, str]] = field(default_factory=dict)
    waits: dict[str, str] = field(default_factory=dict)
    readdressed: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.start or self.stop)


def sync_groups(config: ServiceConfiguration, groups: dict[str, GroupState]) -> dict[str, GroupState]:
    """Groups of ``config``: new ones start at their min, known ones keep their desired count (clamped)."""
    out = {}
    for g in config.replica_groups:
        lo, hi = bounds(g)
        old = groups.get(g.name)
        if old is None:
            out[g.name] = GroupState(name=g.name, desired=lo)
        else:
            out[g.name] = old.model_copy(update={"desired": min(max(old.desired, lo), hi)})
    return out


def importance(replica: Replica) -> int:
    """3 serving, 2 running but not serving, 1 provisioning, 0 submitted."""
    if replica.status == "running":
        return 3 if replica.serves else 2
    return 1 if replica.status == "provisioning" else 0


def removal_order(replicas: list[Replica], deployment_num: int, stale: frozenset = frozenset()) -> list[Replica]:
    """Most important first; victims are taken from the end (out-of-date, least important, newest).
    ``stale``: keys of replicas out of date though of the current deployment (an address they use moved)."""
    return sorted(replicas, key=lambda r: (r.deployment_num < deployment_num or r.key in stale, -importance(r),
                                           r.replica_num))


def reconcile(state: ServiceState, now: datetime) -> Plan:
    """Per group, in config order: roll it if it has out-of-date replicas, otherwise scale it."""
    plan = Plan()
    numbers = iter(range(state.next_replica_num, 1 << 62))
    latest = state.latest()
    names = [g.name for g in state.config.replica_groups]
    for name in names:
        group = state.groups[name]
        mine = [r for r in latest if r.group == name]
        # A replica whose commands name another replica starts only once that one has an address (but for the
        # late references, resolved by its launch once it is placed itself).
        addresses = resolve(state, name)
        moved = {r.key: why for r in mine if r.active and (why := readdressed(r, addresses, state))}
        addresses = addresses.before_launch(late(state.config, name))
        can_start = (group.retry_after is None or group.retry_after <= now) and not addresses.missing
        # One place: until the first replica is placed, the others wait for where it lands.
        placing = state.one_place and not state.place and (plan.start or any(r.active for r in latest))
        can_start = can_start and not placing
        needed = 0
        if state.rolling(name) or moved:
            if not group.rollout_failed:  # a failed rollout stops here: the old replicas keep serving
                needed = _roll(plan, state, group, mine, numbers, can_start, frozenset(moved))
        else:
            needed = _scale(plan, state, group, mine, numbers, can_start)
        if needed and addresses.missing:
            plan.waits[name] = addresses.why_waiting()
        elif needed and placing:
            plan.waits[name] = "waits for the service's first replica to be placed (all of them go to one place)"
        if addresses.values:
            plan.refs[name] = addresses.values
        if moved:
            plan.readdressed[name] = "; ".join(sorted(set(moved.values())))
    for r in latest:
        if r.active and r.group not in names:
            plan.stop.append(Stop(r.replica_num, r.submission_num, "group removed"))
    return plan


def _starts(name: str, mine: list[Replica], count: int, numbers) -> list[Start]:
    """Reuse the group's inactive replica numbers first (a new submission), then allocate new ones."""
    reuse = sorted((r for r in mine if not r.active), key=lambda r: r.replica_num)[:count]
    starts = [Start(name, r.replica_num, r.submission_num + 1) for r in reuse]
    return starts + [Start(name, next(numbers), 0) for _ in range(count - len(reuse))]


def _scale(plan: Plan, state: ServiceState, group: GroupState, mine: list[Replica], numbers, can_start) -> int:
    """Start or stop replicas toward the desired count; returns how many it needed to start."""
    active = [r for r in mine if r.active]
    diff = group.desired - len(active)
    if diff > 0 and can_start:
        plan.start += _starts(group.name, mine, diff, numbers)
    elif diff < 0:
        for r in removal_order(active, state.deployment_num)[diff:]:
            plan.stop.append(Stop(r.replica_num, r.submission_num, "scaled_down"))
    return max(0, diff)


def _roll(plan: Plan, state: ServiceState, group: GroupState, mine: list[Replica], numbers, can_start,
          stale: frozenset = frozenset()) -> int:
    """A rollout surges by at most one extra replica; an old one stops only when a new one serves. Old: of an earlier
    deployment, or ``stale`` (an address it was started with moved). Returns how many it needed to start.

    But replicas that mount a network volume, which attaches to one instance at a time, cannot run beside their
    replacement: the old one is stopped first, and the next pass starts its replacement as for any replica stopped
    (whose launch attaches the volume once the old one's teardown has detached it)."""
    # Replicas still terminating count, also when a newer submission reuses their number.
    unfinished = {r.replica_num for r in state.replicas if r.group == group.name and not r.finished}
    extra = 0 if single_attach(state.config.volumes) else 1
    surge = group.desired + extra - len(unfinished)
    if surge > 0 and can_start:
        plan.start += _starts(group.name, mine, surge, numbers)
    active = [r for r in mine if r.active]
    old = [r for r in active if r.deployment_num < state.deployment_num or r.key in stale]
    idle_old = [r for r in old if not r.serves]
    serving_now = [r for r in active if r.serves]
    to_stop = len(idle_old) + max(0, len(serving_now) - group.desired)
    if not extra and not to_stop and surge <= 0:
        to_stop = min(1, len(old))  # stop first: it makes room for its replacement
    if to_stop:
        for r in removal_order(active, state.deployment_num, stale)[-to_stop:]:
            plan.stop.append(Stop(r.replica_num, r.submission_num, "replaced"))
    return max(0, surge)


def count_failure(group: GroupState, now: datetime) -> None:
    """A replica of the group failed: count it in a row with the last one, or start a new row."""
    in_row = _in_row(group, now)
    group.failures = group.failures + 1 if in_row else 1
    if not in_row or group.failing_since is None:
        group.failing_since = now  # where `retry.duration` counts from
    group.last_failed_at = now
    group.retry_after = backoff_until(group, now)


def _in_row(group: GroupState, now: datetime) -> bool:
    """A failure continues the row if it comes within FAILURE_MEMORY of the end of the back-off the last one
    set: waiting out a back-off is no time without failures (else a group that fails at every attempt would
    start a new row after each 10-minute back-off, and be replaced at once again)."""
    if group.last_failed_at is None:
        return False
    waited = backoff_until(group, group.last_failed_at) or group.last_failed_at
    return now - waited <= FAILURE_MEMORY


def backoff_until(group: GroupState, now: datetime) -> Optional[datetime]:
    if group.failures <= 1:
        return None
    return now + timedelta(seconds=BACKOFF[min(group.failures - 1, len(BACKOFF)) - 1])


def prune(replicas: list[Replica]) -> list[Replica]:
    """Drop finished rows superseded by a newer submission, and all but the newest finished ones."""
    newest: dict[int, int] = {}
    for r in replicas:
        newest[r.replica_num] = max(newest.get(r.replica_num, -1), r.submission_num)
    kept = [r for r in replicas if not r.finished or r.submission_num == newest[r.replica_num]]
    finished = sorted((r for r in kept if r.finished), key=lambda r: r.finished_at or r.submitted_at)
    drop = {id(r) for r in finished[:-KEEP_FINISHED]} if len(finished) > KEEP_FINISHED else set()
    return [r for r in kept if id(r) not in drop]
