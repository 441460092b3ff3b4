"""Target tracking per replica group, as pure functions: on the gateway's request rate, or on a signal of the
replicas' engines.

Every metric comes down to one total to divide by the target: the rate for `rps`; the sum over the group's
replicas of their waiting (`queue`) or in-flight (`running`) requests; and for an average (`kv_cache`) or a
latency (`ttft`, `itl`), replicas × the mean, which is the same sum of each replica's value. A replica whose engine
could not be read counts as an average one of those that were: neither idle nor saturated; one not read yet
(just started) is not counted.

Where durastack differs from dstack (DESIGN.md): the delays count from *this group's* last
scaling event, not from any replica start or stop anywhere in the service; a scale-down also waits until the
group has wanted fewer replicas for the whole down-delay, and then goes to the most it wanted in that time
(a short dip, or a reading just under the target, does not take a replica away that the next second needs
back: the replica removed would come back only after its cold start); and a request held at the gateway for a
scaled-to-zero service counts as traffic, so the group wakes at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from models.service import ReplicaGroup, ScalingSpec


@dataclass(frozen=True)
class Decision:
    new: int
    reason: str  # why `new` is what it is: "target", "clamped to max", "from zero", "up-delay holds", …


def bounds(group: ReplicaGroup) -> tuple[int, int]:
    """The group's replica count range as the rules read it: an unset end is 0."""
    return group.count.min or 0, group.count.max or 0


def wanted(total: float, target: float, lo: int, hi: int) -> tuple[int, str]:
    """ceil(total / target), clamped to the group's range, and how it was clamped (a total that is the target's
    multiple up to float error, e.g. 3 × 0.1 / 0.1, asks for that multiple, not one more)."""
    raw = math.ceil(total / target - 1e-9) if total > 0 else 0
    if raw > hi:
        return hi, f"clamped to max {hi}"
    if raw < lo:
        return lo, f"clamped to min {lo}"
    return raw, "target"


def engine_total(read_sum: float, read: int, counted: int) -> Optional[float]:
    """The group's total from the replicas read (``read`` of them summing to ``read_sum``), the rest of the
    ``counted`` ones (whose engine could not be read) as their average; None when none could be read. A replica
    never read yet is not counted: it has taken no load yet, and counting it as loaded as the others would scale
    a latency target up again on every replica just added."""
    if read <= 0:
        return None
    return read_sum * max(counted, read) / read


@dataclass(frozen=True)
class Below:
    """Since when a group has wanted fewer replicas than it has, without a break, and the most it wanted since."""
    since: datetime
    most: int


@dataclass(frozen=True)
class GroupScaler:
    """One group's autoscaler: its `scaling` and its count range, fixed by the configuration it runs."""
    scaling: ScalingSpec
    lo: int
    hi: int

    @classmethod
    def of(cls, group: ReplicaGroup) -> GroupScaler:
        """The scaler of a group that has `scaling`."""
        assert group.scaling is not None, group.name
        return cls(group.scaling, *bounds(group))

    def wanted(self, total: float) -> tuple[int, str]:
        return wanted(total, self.scaling.target, self.lo, self.hi)

    def below(self, prev: Optional[Below], current: int, total: Optional[float], now: datetime) -> Optional[Below]:
        """The span ``prev`` carried on by this reading: None once the group wants as many as it has (or has no
        reading)."""
        if total is None:
            return None
        new, _ = self.wanted(total)
        if new >= current:
            return None
        return Below(now, new) if prev is None else Below(prev.since, max(prev.most, new))

    def decide(self, current: int, total: Optional[float], last_scaled_at: Optional[datetime], now: datetime,
               span: Optional[Below] = None, steady: bool = False) -> Decision:
        """The group's desired count given its metric's total over its window. None means no reading: no change.
        ``steady``: a scale-down waits until the group has wanted fewer for the whole down-delay (``span``, from
        ``below``) and goes to the most it wanted meanwhile; without it (histories written before), the
        down-delay counts from the last scaling event only."""
        if total is None:
            return Decision(current, "no stats")
        scaling = self.scaling
        new, why = self.wanted(total)
        since = (now - last_scaled_at).total_seconds() if last_scaled_at else None
        if new > current:
            if current == 0:
                return Decision(new, "from zero")
            if since is not None and since < scaling.scale_up_delay:
                return Decision(current, f"up-delay holds ({scaling.scale_up_delay}s)")
        elif new < current:
            if since is not None and since < scaling.scale_down_delay:
                return Decision(current, f"down-delay holds ({scaling.scale_down_delay}s)")
            if steady:
                low = (now - span.since).total_seconds() if span is not None else 0.0
                if low < scaling.scale_down_delay:
                    return Decision(current, f"down-delay holds ({scaling.scale_down_delay}s below the target: "
                                             f"{low:.0f}s so far)")
                if span.most > new:
                    return Decision(span.most, f"the most wanted over the last {scaling.scale_down_delay}s")
        return Decision(new, why)

    def next_check(self, current: int, total: Optional[float], last_scaled_at: Optional[datetime],
                   span: Optional[Below] = None) -> Optional[float]:
        """Seconds after ``last_scaled_at`` at which a held decision becomes due, or None if none is held. ``span``
        (a steady scale-down's, from ``below``): the down-delay counts from its start too."""
        if total is None or last_scaled_at is None:
            return None
        scaling = self.scaling
        new, _ = self.wanted(total)
        if new > current > 0:
            return scaling.scale_up_delay
        if new < current:
            if span is not None:
                return max(scaling.scale_down_delay,
                           (span.since - last_scaled_at).total_seconds() + scaling.scale_down_delay)
            return scaling.scale_down_delay
        return None
