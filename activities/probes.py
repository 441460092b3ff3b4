"""HTTP readiness probes against a replica's address: ``unix:/path.sock`` or ``host:port``."""

from __future__ import annotations

import time
from typing import Optional

import httpx

from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from backends.http import Connect, client_for
from models.failures import NOT_READY_YET
from models.service import ProbeSpec


async def run_probe(address: str, probe: ProbeSpec, connect: Optional[Connect] = None) -> bool:
    """One probe run: True on a 2xx answer."""
    client, base = client_for(address, probe.timeout, connect)
    async with client:
        try:
            response = await client.request(
                probe.method.upper(), base + probe.url, headers={h.name: h.value for h in probe.headers},
                content=probe.body.encode() if probe.body is not None else None)
        except httpx.HTTPError:
            return False
    return 200 <= response.status_code < 300


async def answers_http(address: str, timeout: float = 2.0, connect: Optional[Connect] = None) -> Optional[int]:
    """The status of ``GET /``, or None when nothing answers HTTP yet.

    A replica without probes is ready once its app answers HTTP at all (any status): the spec's
    "ready when running" would send the first requests to an app that is still starting.
    """
    client, base = client_for(address, timeout, connect)
    async with client:
        try:
            return (await client.get(base + "/")).status_code
        except httpx.HTTPError:
            return None


# Until a probe first passes, it runs again this soon, doubling up to its interval: an app that was not up yet at
# the first probe is seen about when it comes up, not a whole interval (15 s by default) later.
FIRST_RETRY_SECONDS = 0.1


class ProbeStreaks:
    """Success streaks of a replica's probes; ready when every streak reaches its ``ready_after``."""

    def __init__(self, probes: list[ProbeSpec]):
        self.probes = probes
        self.streaks = [0] * len(probes)
        self.due = [0.0] * len(probes)  # monotonic time each probe runs next
        self.retry: list[Optional[float]] = [FIRST_RETRY_SECONDS] * len(probes)  # None once it has passed

    def ready(self) -> bool:
        return all(s >= p.ready_after for s, p in zip(self.streaks, self.probes))

    async def run_due(self, address: str, now: float, connect: Optional[Connect] = None) -> None:
        for i, probe in enumerate(self.probes):
            if now >= self.due[i]:
                ok = await (run_probe(address, probe, connect) if connect else run_probe(address, probe))
                self.streaks[i] = self.streaks[i] + 1 if ok else 0
                retry = self.retry[i]
                if ok or retry is None:
                    self.retry[i], self.due[i] = None, now + probe.interval
                else:
                    self.retry[i], self.due[i] = retry * 2, now + min(retry, probe.interval)

    def end_attempt_past(self, until: Optional[float]) -> None:
        """Raise ``not_yet`` once the monotonic clock is past ``until`` (None: never) and no streak is under way: a
        readiness attempt may end there and a later one start again without losing one."""
        if until is not None and time.monotonic() >= until and \
                not any(s and s < p.ready_after for s, p in zip(self.streaks, self.probes)):
            raise self.not_yet()

    def said(self) -> str:
        """How far readiness is, for people (`ps -v`, the Web UI's pending activity)."""
        return f"not ready: probes {self.summary()}" if self.probes else "not ready: no HTTP answer yet"

    def not_yet(self) -> ApplicationError:
        """The end of one readiness attempt: retried by the workflow's policy, within the group's
        `startup_timeout`. Benign: a model that loads for an hour is no warning each minute."""
        return ApplicationError(self.said(), type=NOT_READY_YET, category=ApplicationErrorCategory.BENIGN)

    def summary(self) -> str:
        return " ".join("✓" if s >= p.ready_after else ("~" if s else "×")
                        for s, p in zip(self.streaks, self.probes))
