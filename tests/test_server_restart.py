"""`durastack server` killed with SIGKILL (the supervisor alone: its children live on) and started again under
load through the gateway: the new server ends the old worker and Temporal, kills the old gateway's control app
as if it had crashed, and its new gateway adopts the nginx that kept serving. No request is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from gateway.nginx import master_of
from tests.e2e import BIN, Load, Stack, ready, replica_processes, until

pytestmark = [pytest.mark.e2e, pytest.mark.long]

SERVICE = """
type: service
name: steady
port: 8000
replicas: 1
commands: [python3 -m http.server 8000]
"""


def children(stack: Stack) -> dict:
    try:
        return json.loads((stack.home / "server.json").read_text())["children"]
    except (OSError, KeyError, ValueError):
        return {}


def end_leftovers(pids: list[int]) -> None:
    """Teardown after a failure: what the killed server left, by the PIDs it recorded."""
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_a_killed_server_restarts_under_load_without_refusing_a_request(tmp_path):
    stack = Stack(tmp_path)
    leftovers: list[int] = []
    try:
        stack.wait_up()
        (tmp_path / "steady.yml").write_text(SERVICE)
        applied = stack.cli("apply", "-f", str(tmp_path / "steady.yml"), "-y")
        assert applied.returncode == 0, applied.stderr
        until(lambda: ready(stack.ps("steady")) == {"0": [0]}, 90, 0.5, "the replica ready")
        load = Load(f"{stack.gateway}/services/steady/", stack.token(), rps=20).start()
        until(lambda: load.counts[200] >= 20, 30, 0.1, "load flowing")

        old = children(stack)
        leftovers = [rec["pid"] for rec in old.values()]
        nginx = master_of(stack.home / "gateway")
        assert nginx is not None
        os.kill(stack.proc.pid, signal.SIGKILL)  # the supervisor only: its children run in sessions of their own
        stack.proc.wait(10)
        killed_at = load.counts[200]

        stack.proc = subprocess.Popen([str(BIN / "durastack"), "server"], env=stack.env, stdout=stack.log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        until(lambda: (c := children(stack)).get("worker") and c["gateway"]["pid"] != old["gateway"]["pid"],
              90, 0.2, "the new server's children")
        leftovers = []
        stack.wait_up("control plane back")
        until(lambda: ready(stack.ps("steady")) == {"0": [0]}, 90, 0.5, "the replica still ready")
        until(lambda: load.counts[200] >= killed_at + 40, 30, 0.1, "load flowing after the restart")
        counts = load.stop()

        print(f"\nserver killed and restarted under 20 rps: {sum(counts.values()) - counts[200]} of "
              f"{sum(counts.values())} requests refused")
        assert set(counts) == {200}, counts
        assert master_of(stack.home / "gateway") == nginx  # adopted, never restarted
        assert "goes on serving, for the new gateway" in (tmp_path / "server.out").read_text()
        assert not any(os.path.exists(f"/proc/{pid}") and _same(pid, old) for pid in
                       [rec["pid"] for name, rec in old.items()])
    finally:
        end_leftovers(leftovers)
        stack.stop()
    assert replica_processes(stack.home) == {}


def _same(pid: int, old: dict) -> bool:
    """``pid`` is still the process the old server started (not a reuse of its number)."""
    from cli.stack import _start_ticks

    return any(rec["pid"] == pid and rec.get("start") == _start_ticks(pid) for rec in old.values())
