"""The replica lifecycle against a real `durastack server`, as a user meets it: a replica's workflow
terminated with Temporal's own CLI (what the Web UI's Terminate does), and a broken command fixed while its
group waits on a back-off."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.e2e import Stack, ready, replica_processes, running_stack, until

pytestmark = pytest.mark.e2e

SERVICE = """
type: service
name: {name}
port: 8000
auth: false
replicas:
  - name: web
    count: 1
    commands: [{command}]
    resources: {{cpu: 1, memory: 1GB..}}
"""
SERVE = "python3 -m http.server 8000"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def apply(stack: Stack, tmp_path: Path, name: str, command: str, *extra: str) -> None:
    path = tmp_path / f"{name}.yml"
    path.write_text(SERVICE.format(name=name, command=command))
    result = stack.cli("apply", "-f", str(path), "-y", *extra)
    assert result.returncode == 0, result.stdout + result.stderr


def submissions(stack: Stack, name: str) -> list[tuple[int, str, bool]]:
    return [(r["submission"], r["status"], r["ready"]) for g in stack.ps(name)["groups"] for r in g["replicas"]]


def test_a_replica_workflow_terminated_from_outside_is_replaced_and_leaves_nothing(stack: Stack, tmp_path: Path):
    name = "term"
    apply(stack, tmp_path, name, SERVE)
    assert ready(stack.ps(name)) == {"web": [0]}
    workdir = next(wd for wd in replica_processes(stack.home) if wd.endswith(f"/{name}/web/r0-s0"))
    terminated = stack.temporal("workflow", "terminate", "--workflow-id", f"service/{name}/web/r0-s0",
                                "--reason", "from the Web UI")
    assert terminated.returncode == 0, terminated.stderr
    t0 = time.monotonic()
    until(lambda: (1, "running", True) in submissions(stack, name), 60, 0.3, "replaced by submission 1")
    replaced = time.monotonic() - t0
    # The orphan's process is gone and no route points at it; the new one serves.
    until(lambda: workdir not in replica_processes(stack.home), 30, 0.2, "the orphan's process gone")
    upstreams = [u["replica_id"] for u in stack.routes()[name]["upstreams"]]
    assert upstreams == [f"{name}/web/r0-s1"], upstreams
    events = stack.cli("events", name).stdout
    assert "replica 0 down: replica workflow terminated; unrouted, replacing" in events, events
    print(f"\nterminated replica workflow → replacement serving: {replaced:.1f} s")


def test_a_fix_applied_during_a_back_off_serves_at_once(stack: Stack, tmp_path: Path):
    name = "fix"
    apply(stack, tmp_path, name, "exit 3", "--detach")

    def back_off_ends() -> datetime | None:
        """When the group's back-off ends, once it has 20 s or more to go (failures 3+ in a row: 30 s, 60 s…)."""
        retry_after = stack.ps(name)["groups"][0]["retry_after"]
        if retry_after is None:
            return None
        ends = datetime.fromisoformat(retry_after)
        return ends if (ends - datetime.now(timezone.utc)).total_seconds() >= 20 else None
    ends = until(back_off_ends, 120, 0.5, "a back-off of 20 s or more after failures in a row")
    assert "waits on a back-off until" in stack.cli("ps", name).stdout
    t0 = time.monotonic()
    apply(stack, tmp_path, name, SERVE)  # blocks until the service serves
    served_at, fixed = datetime.now(timezone.utc), time.monotonic() - t0
    status = stack.ps(name)
    assert ready(status) == {"web": [0]} and status["groups"][0]["retry_after"] is None
    assert served_at < ends, "the fix waited for the back-off to end"
    print(f"\nfix applied during a back-off → serving: {fixed:.1f} s (the back-off had "
          f"{(ends - served_at).total_seconds() + fixed:.0f} s to go)")
    for n in ("term", "fix"):
        assert stack.cli("stop", n, "-y").returncode == 0
