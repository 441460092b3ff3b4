"""Why a replica failed, as durastack spells it, and which `retry` event each reason is: one rule, one place.

The code that detects a failure builds its reason from a ``FailureKind`` (workflows/replica.py and
workflows/children.py: no capacity; activities/cloud.py: the cloud's offers; activities/replica_cloud.py:
a spot interruption); the service reads a reason back with ``retry_event`` to decide whether the
configuration's `retry` replaces the replica (rules/lifecycle.py).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Iterable, Literal, Optional

from models.common import format_duration
from models.secrets import REDACTED

RetryEvent = Literal["no-capacity", "interruption", "error"]
RETRY_EVENTS: tuple[RetryEvent, ...] = ("no-capacity", "interruption", "error")


class FailureKind(StrEnum):
    """The kinds of replica failure `retry` tells apart, each the prefix its reason starts with: a reason is a
    plain string in history and the store (``Replica.reason``, events), so old ones are read back by prefix."""

    NO_OFFERS = "no offers"  # nothing fits the replica: "no offers: <why>"
    ALL_OFFERS_FAILED = "all offers failed"  # offers were tried and each failed: "all offers failed: <why>"
    NO_BACKEND = "no backend serves this replica"  # this deployment serves none of the backends it may use
    SPOT_INTERRUPTION = "spot interruption"  # the cloud took a spot instance back: "spot interruption (instance …)"

    @classmethod
    def of(cls, reason: str) -> Optional["FailureKind"]:
        """The kind ``reason`` is, by its prefix; None: any other failure (an error)."""
        return next((kind for kind in cls if reason.startswith(kind.value)), None)

    @property
    def retry_event(self) -> RetryEvent:
        return "interruption" if self is FailureKind.SPOT_INTERRUPTION else "no-capacity"


NO_CAPACITY_ERROR = "NoCapacity"  # the type of the error a launch raises when its backend cannot place it
NOT_READY_YET = "NotReadyYet"  # the type of a readiness attempt's end: still loading, try again
LAST_LINES = 5  # of a replica's output, told with the reason it exited before it was ready
LAST_OUTPUT_CHARS = 400
OUTPUT = "; last output: "


def with_output(reason: str, output: str, hide: Iterable[str] = ()) -> str:
    """``reason`` ("exited (1)") and the replica's last lines of output, on one line (it goes to `events`), with
    every value in ``hide`` (the replica's env) masked: a command that dies may print its configuration."""
    for value in sorted((v for v in hide if len(v) >= 4), key=len, reverse=True):
        output = output.replace(value, REDACTED)
    said = " | ".join(line.strip() for line in output.splitlines() if line.strip())
    said = said if len(said) <= LAST_OUTPUT_CHARS else "…" + said[-(LAST_OUTPUT_CHARS - 1):]
    return f"{reason}{OUTPUT}{said}" if said else reason


def not_ready_within(seconds: int, said: str = "its probes never passed") -> str:
    """A replica whose readiness took longer than its group's `startup_timeout` (``seconds``)."""
    return f"not ready within {format_duration(seconds)} (startup_timeout): {said}"


def without_output(reason: str) -> str:
    """The reason alone, for what others see (the gateway's 503 to clients): the output stays in `events`."""
    return reason.split(OUTPUT, 1)[0]


def retry_event(reason: str) -> RetryEvent:
    """The `retry.on_events` event a replica's failure reason is: no-capacity, interruption, else error."""
    kind = FailureKind.of(reason)
    return kind.retry_event if kind else "error"
