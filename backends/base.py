"""What every replica backend does: the instance work of one kind of backend, which the replica activities
(activities/replica.py) and the fleet watch (activities/fleet.py) call without knowing which kind it is.

``LocalReplicas`` (activities/replica.py) and ``CloudReplicas`` (activities/replica_cloud.py) implement it. The
hooks below the abstract methods have a default that does nothing: a backend overrides the ones it has work for
(the cloud's SSH tunnels route a replica again when they come back, the local backend has no tunnel)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

from backends.http import Connect
from models.replica import JobSpec
from models.messages import ReplicaInput
from models.router import Instance
from models.state import Placement
from models.service import ProbeSpec


class Backend(ABC):
    """The instance work of one kind of replica backend."""

    min_poll_seconds: float = 0.0  # liveness checks no more often than this (cloud APIs are slow and rate-limited)
    one_activity: bool = False  # its launch's steps are quick: place runs them all (and a first readiness attempt)

    @abstractmethod
    async def place(self, inp: ReplicaInput, backend: str) -> tuple[Placement, Instance]:
        """An instance for the replica, exactly once: a retried attempt gets what an earlier one made."""

    @abstractmethod
    async def start(self, inp: ReplicaInput, instance) -> None:
        """Its commands run once this returns."""

    @abstractmethod
    def reach(self, instance) -> tuple[str, Optional[Connect]]:
        """Where this worker reaches the app (as the probes do), and how it connects there (None: directly)."""

    @abstractmethod
    async def wait_ready(self, instance, probes: list[ProbeSpec], until: Optional[float] = None) -> None:
        """Its probes pass; past ``until`` (monotonic), between two probe streaks: ``ProbeStreaks.end_attempt_past``."""

    @abstractmethod
    async def down(self, instances: list) -> list[Optional[str]]:
        """For each instance, why it is down, or None while it serves."""

    @abstractmethod
    async def last_output(self, instance, lines: int) -> str:
        """Its last lines of output; '' when they cannot be read."""

    @abstractmethod
    async def stop(self, job: JobSpec, backend: str, instance) -> None:
        """Stop the replica's instance; none left is success."""

    @abstractmethod
    async def stop_idle(self, job: JobSpec, backend: str, instance) -> None:
        """An instance kept idle (``keep_idle``) is stopped, unless another replica took it."""

    # --- hooks: nothing to do unless a backend says otherwise ------------------------------------------

    def routed(self, instance, service: str, replica_id: str, group: str) -> None:
        """The launch registered the replica with the gateway."""

    def unroute(self, instance) -> None:
        """The teardown is about to unregister the replica: nothing may route it again."""

    async def keep_idle(self, job: JobSpec, instance) -> bool:
        """Keep the instance for a later replica (``idle_duration``) instead of stopping it: True if kept."""
        return False

    async def adopt(self, service: str, watched: list) -> None:
        """The monitor's replicas, after this worker may have restarted: take up what it held for them."""


__all__ = ["Backend"]
