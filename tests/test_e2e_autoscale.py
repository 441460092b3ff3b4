"""End to end: the seed's autoscaling flow on this machine, with real HTTP load through the gateway.

The seed service with short delays (examples/replica-groups-autoscale.yml: window 30 s, delays
10 s / 20 s): both groups start at zero; load makes each group get one replica, then group
replica-1 reaches 2 and replica-2 reaches 3 (clamped); without traffic both go back to zero; and a
request sent while every group is at zero is held by the gateway and answered 200, not 503.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e import Load, Stack, ready, replica_processes, running_stack, until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "replica-groups-autoscale.yml"
NAME = "replica-groups-test"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def counts(stack: Stack) -> dict[str, int]:
    return {g: len(r) for g, r in ready(stack.ps(NAME)).items()}


def test_seed_scales_from_zero_up_to_the_clamps_and_back_to_zero(stack: Stack):
    result = stack.cli("apply", "-f", str(CONFIG), "-y")
    assert result.returncode == 0, result.stdout + result.stderr
    assert counts(stack) == {"replica-1": 0, "replica-2": 0}
    token = stack.token()
    url = f"{stack.gateway}/services/{NAME}/"

    load = Load(url, token, rps=8).start()
    try:
        # First each group gets one replica (the window's rate is still small) ...
        until(lambda: counts(stack) == {"replica-1": 1, "replica-2": 1}, 60, 0.3, "one replica per group")
        # ... then, after the up-delay, the clamps: 8 rps / target 2 = 4 → 2 and 3.
        until(lambda: counts(stack) == {"replica-1": 2, "replica-2": 3}, 120, 0.5, "scaled to 2 and 3")
        text = stack.cli("ps").stdout
        assert "group=replica-1 replica=0" in text and "group=replica-2 replica=1" in text
        assert re.search(r"group=replica-2 scales on rps [\d.]+ over 30s, target 2", stack.cli("ps", NAME, "-v").stdout)
    finally:
        statuses = load.stop()
    assert set(statuses) == {200}, statuses  # the first requests were held, not refused
    events = json.loads(stack.cli("events", NAME, "--json").stdout)
    messages = [e["message"] for e in events if e["kind"] == "scale"]
    assert any("0 → 1: from zero" in m for m in messages), messages
    assert any("→ 3:" in m and "over 30s, target 2" in m for m in messages), messages

    # No traffic: back to zero after the window empties and the down-delay passes.
    until(lambda: counts(stack) == {"replica-1": 0, "replica-2": 0}, 150, 1.0, "scaled to zero")
    until(lambda: not [wd for wd in replica_processes(stack.home) if f"/{NAME}/" in wd], 60, 0.5, "processes gone")

    # A request while every group is at zero is held until a replica is ready: 200, not 503.
    started = time.monotonic()
    response = httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=120)
    assert response.status_code == 200
    print(f"scale-from-zero first byte after {time.monotonic() - started:.2f}s")
    assert stack.cli("stop", NAME, "-y").returncode == 0
