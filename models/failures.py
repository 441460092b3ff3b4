"""Why a replica failed, as durastack spells it, and which `retry` event each reason is: one rule, one place.

The code that detects a failure builds its reason from these prefixes (workflows/replica.py and
workflows/children.py: no capacity; activities/cloud.py: the cloud's offers; activities/replica_cloud.py:
a spot interruption); the service reads a reason back with ``retry_event`` to decide whether the
configuration's `retry` replaces the replica (workflows/lifecycle.py).
"""

from __future__ import annotations

from typing import Literal

RetryEvent = Literal["no-capacity", "interruption", "error"]
RETRY_EVENTS: tuple[RetryEvent, ...] = ("no-capacity", "interruption", "error")

NO_OFFERS = "no offers"  # nothing fits the replica: "no offers: <why>"
ALL_OFFERS_FAILED = "all offers failed"  # offers were tried and each failed: "all offers failed: <why>"
NO_BACKEND = "no backend serves this replica"  # this deployment serves none of the backends it may use
SPOT_INTERRUPTION = "spot interruption"  # the cloud took a spot instance back: "spot interruption (instance …)"

_NO_CAPACITY = (NO_OFFERS, ALL_OFFERS_FAILED, NO_BACKEND)


def retry_event(reason: str) -> RetryEvent:
    """The `retry.on_events` event a replica's failure reason is: no-capacity, interruption, else error."""
    if reason.startswith(_NO_CAPACITY):
        return "no-capacity"
    if reason.startswith(SPOT_INTERRUPTION):
        return "interruption"
    return "error"
