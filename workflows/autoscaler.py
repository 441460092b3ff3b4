"""RPS target tracking per replica group, as pure functions.

Where durastack differs from dstack (DESIGN.md): the delays count from *this group's* last
scaling event, not from any replica start or stop anywhere in the service; and a request held at
the gateway for a scaled-to-zero service counts as traffic, so the group wakes at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Optional

from models.service import ScalingSpec


@dataclass(frozen=True)
class Decision:
    new: int
    reason: str  # why `new` is what it is: "target", "clamped to max", "from zero", "up-delay holds", …

    def changed(self, current: int) -> bool:
        return self.new != current


def wanted(rps: float, target: float, lo: int, hi: int) -> tuple[int, str]:
    """ceil(rps / target), clamped to the group's range, and how it was clamped."""
    raw = math.ceil(rps / target) if rps > 0 else 0
    if raw > hi:
        return hi, f"clamped to max {hi}"
    if raw < lo:
        return lo, f"clamped to min {lo}"
    return raw, "target"


def decide(current: int, rps: Optional[float], scaling: ScalingSpec, lo: int, hi: int,
           last_scaled_at: Optional[datetime], now: datetime) -> Decision:
    """The group's desired count given the rate over its window. ``rps`` None means no stats: no change."""
    if rps is None:
        return Decision(current, "no stats")
    new, why = wanted(rps, scaling.target, lo, hi)
    since = (now - last_scaled_at).total_seconds() if last_scaled_at else None
    if new > current:
        if current == 0:
            return Decision(new, "from zero")
        if since is not None and since < scaling.scale_up_delay:
            return Decision(current, f"up-delay holds ({scaling.scale_up_delay}s)")
    elif new < current and since is not None and since < scaling.scale_down_delay:
        return Decision(current, f"down-delay holds ({scaling.scale_down_delay}s)")
    return Decision(new, why)


def next_check(current: int, rps: Optional[float], scaling: ScalingSpec, lo: int, hi: int,
               last_scaled_at: Optional[datetime]) -> Optional[float]:
    """Seconds after ``last_scaled_at`` at which a held decision becomes due, or None if none is held."""
    if rps is None or last_scaled_at is None:
        return None
    new, _ = wanted(rps, scaling.target, lo, hi)
    if new > current > 0:
        return scaling.scale_up_delay
    if new < current:
        return scaling.scale_down_delay
    return None
