"""End to end: rolling deployments of the seed service under a constant load, on this machine.

Two groups × two replicas serve 8 rps through the gateway; a new configuration changes both
groups' commands; every replica is replaced one at a time and no request fails. Then a rollout
whose new replicas crash: the old ones keep serving everything, and rollback restores them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.e2e import Load, Stack, ready, running_stack

pytestmark = pytest.mark.e2e

NAME = "rolling-seed"
SERVICE = """
type: service
name: rolling-seed
port: 8000
replicas:
  - count: 2
    commands:
      - echo "Group 1 - Version {v}" > /tmp/version.txt
      - {cmd}
    resources: {{cpu: 1, memory: 1GB..}}
  - count: 2
    commands:
      - echo "Group 2 - Version {v}" > /tmp/version.txt
      - {cmd}
    resources: {{cpu: 1, memory: 1GB..}}
"""
SERVE = "python3 -m http.server 8000"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def write(tmp: Path, version: int, cmd: str = SERVE) -> Path:
    path = tmp / f"v{version}.yml"
    path.write_text(SERVICE.format(v=version, cmd=cmd))
    return path


def versions(stack: Stack) -> dict[int, str]:
    status = stack.ps(NAME)
    out = {}
    for g in status["groups"]:
        for r in g["replicas"]:
            if r["status"] == "running" and r["ready"]:
                result = stack.cli("exec", NAME, "--replica", str(r["replica"]), "--", "cat", "/tmp/version.txt")
                out[r["replica"]] = result.stdout.strip()
    return out


def test_rolling_update_under_load_drops_no_request(stack: Stack, tmp_path: Path):
    assert stack.cli("apply", "-f", str(write(tmp_path, 0)), "-y").returncode == 0
    assert ready(stack.ps(NAME)) == {"0": [0, 1], "1": [2, 3]}
    token = stack.token()
    load = Load(f"{stack.gateway}/services/{NAME}/", token, rps=8).start()
    try:
        began = time.monotonic()
        result = stack.cli("apply", "-f", str(write(tmp_path, 1)), "-y")
        rollout = time.monotonic() - began
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"Active run {NAME} already exists. Detected changes that can be updated in-place:" in result.stdout
        assert "- Configuration properties:\n  - groups" in result.stdout
        status = stack.ps(NAME)
        assert status["deployment"] == 1
        assert all(r["deployment"] == 1 for g in status["groups"] for r in g["replicas"] if r["status"] == "running")
    finally:
        statuses = load.stop()
    assert set(statuses) == {200}, statuses  # zero failed requests
    assert sum(statuses.values()) >= 0.75 * 8 * rollout, (statuses, rollout)  # and the load ran all along
    assert sorted(set(versions(stack).values())) == ["Group 1 - Version 1", "Group 2 - Version 1"]
    text = stack.cli("ps", "-v").stdout
    assert "terminated" in text and "deployment=1" in text  # old replicas stay listed as terminated
    events = stack.cli("events", NAME).stdout
    assert "deployment 1: changed groups.0.commands, groups.1.commands; 0 replica(s) kept" in events


def test_failed_rollout_keeps_serving_and_rollback_restores(stack: Stack, tmp_path: Path):
    before = versions(stack)
    token = stack.token()
    load = Load(f"{stack.gateway}/services/{NAME}/", token, rps=8).start()
    try:
        result = stack.cli("apply", "-f", str(write(tmp_path, 2, cmd="exit 3")), "-y")
        assert result.returncode == 1 and "rollout stopped" in result.stderr, result.stdout + result.stderr
        assert "exited (3)" in result.stderr
        assert versions(stack) == before  # the old replicas serve on
        status = stack.ps(NAME)
        assert status["deployment"] == 2
        result = stack.cli("rollback", NAME)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "deployment 3" in result.stdout
    finally:
        statuses = load.stop()
    assert set(statuses) == {200}, statuses
    status = stack.ps(NAME)
    assert status["deployment"] == 3 and versions(stack) == before  # same replicas, bumped in place
    assert stack.cli("stop", NAME, "-y").returncode == 0


def test_apply_of_a_service_that_keeps_exiting_says_why_and_returns(stack: Stack, tmp_path: Path):
    """Not a table redrawn for ever: once its replicas failed twice in a row, `apply` exits 1 with the exit, and
    `events` has each failure with the last output, the env's values masked."""
    path = tmp_path / "crashing.yml"
    path.write_text("type: service\nname: crashing\nport: 8000\nenv:\n  HF_TOKEN: hf_e2e_crash_123\ncommands:\n"
                    "  - echo loading\n  - 'echo \"refused: $HF_TOKEN\" >&2'\n  - exit 7\n")
    result = stack.cli("apply", "-f", str(path), "-y")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "service crashing cannot serve: group '0': replica 0 exited (7)" in result.stderr
    events = stack.cli("events", "crashing").stdout
    assert "exited (7); last output: loading | refused: ***" in events and "hf_e2e_crash_123" not in events
    assert stack.cli("stop", "crashing", "-y").returncode == 0

