"""The PD-disaggregation stand-in (examples/pd-disaggregation/standin.yml) end to end on the local backend:
every request through the gateway enters the router, which reaches workers of both groups; a killed decode
worker is replaced and served from; the decode group scales on the service's rate.

The workers reach the router at its replica address, so replicas must reach each other. Without isolation
they all share the host's loopback (each with its own PORT); isolated (as root) they share their service's
private network. Isolated without a service network (no root), the workers wait: that variant skips and says why.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from activities.local import isolation_available
from tests.e2e import Load, Stack, ready, running_stack, until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd-disaggregation"
STANDIN = EXAMPLE / "standin.yml"
NAME = "pd-standin"


@pytest.fixture(scope="module")
def loopback_stack(tmp_path_factory):
    """Replicas without isolation: on the host's loopback, each on a port of its own."""
    stack_gen = running_stack(tmp_path_factory, {"DURASTACK_LOCAL_ISOLATION": "off", "PD_EXAMPLE": str(EXAMPLE)})
    stack = next(stack_gen)
    yield stack
    next(stack_gen, None)
    assert stand_in_processes(stack.home) == {}


def stand_in_processes(home: Path) -> dict[int, str]:
    """PID → group of this home's stand-in programs, read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(e.split(b"=", 1) for e in (entry / "environ").read_bytes().split(b"\0") if b"=" in e)
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv = cmdline.split(b"\0")
        # The program itself, not the shell that runs the commands.
        if env.get(b"DURASTACK_WORK_DIR", b"").decode().startswith(str(home)) and b"python" in \
                Path(argv[0].decode()).name.encode() and any(a.endswith((b"worker.py", b"router.py")) for a in argv):
            found[int(entry.name)] = env.get(b"DURASTACK_GROUP", b"").decode()
    return found


def ask(stack: Stack, n: int = 1) -> list[dict]:
    url = f"{stack.gateway}/services/{NAME}/generate"
    headers = {"Authorization": f"Bearer {stack.token()}"}
    with httpx.Client(timeout=10, headers=headers) as client:
        responses = [client.get(url) for _ in range(n)]
    return [r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text} for r in responses]


def serving(stack: Stack) -> bool:
    answers = ask(stack, 3)
    return all("decode" in a for a in answers)


def test_stand_in_serves_through_the_router_replaces_a_worker_and_scales(loopback_stack):
    stack = loopback_stack
    applied = stack.cli("apply", "-f", str(STANDIN), "-y")
    assert applied.returncode == 0, applied.stderr
    until(lambda: ready(stack.ps(NAME)) == {"router": [0], "prefill": [2], "decode": [1]}
          or ready(stack.ps(NAME)) == {"router": [0], "prefill": [1], "decode": [2]}, 120, 0.5, "all groups ready")
    status = stack.ps(NAME)
    assert [g["role"] for g in status["groups"]] == ["router", "worker", "worker"]
    # Only the router is an upstream of the gateway.
    assert [u["replica_id"] for u in stack.routes()[NAME]["upstreams"]] == [f"{NAME}/router/r0-s0"]
    until(lambda: serving(stack), 30, 0.5, "the router reaches both groups")
    answers = ask(stack, 5)
    assert {a["router"].split("#")[0] for a in answers} == {"router/r0"}
    assert all(a["prefill"].startswith("prefill/") and a["decode"].startswith("decode/") for a in answers)
    old_decode = answers[0]["decode"]

    # Kill the decode worker: it is replaced, and the router serves from the new one.
    pids = [p for p, group in stand_in_processes(stack.home).items() if group == "decode"]
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    until(lambda: any(a.get("decode", old_decode) != old_decode for a in ask(stack, 2)), 90, 0.5,
          "served by the replacement decode worker")
    events = stack.cli("events", NAME).stdout
    assert "down: exited" in events or "failed" in events, events

    # Traffic enters through the router alone; the decode group scales on the service's rate.
    load = Load(f"{stack.gateway}/services/{NAME}/generate", stack.token(), rps=16).start()
    try:
        until(lambda: len(ready(stack.ps(NAME))["decode"]) >= 2, 90, 1.0, "decode scaled up")
    finally:
        counts = load.stop()
    assert counts[200] > 0 and set(counts) <= {200, 503}, counts
    events = stack.cli("events", NAME).stdout
    assert "the service's rate: all its traffic enters through router group 'router'" in events, events
    assert stack.cli("stop", NAME, "-y").returncode == 0
    until(lambda: not stand_in_processes(stack.home), 60, 0.5, "stand-in processes gone")


def test_isolated_replicas_need_a_service_network(tmp_path_factory):
    if not isolation_available():
        pytest.skip("replicas are not isolated on this machine: the loopback test covers this case")
    gen = running_stack(tmp_path_factory, {"PD_EXAMPLE": str(EXAMPLE)})
    stack = next(gen)
    try:
        applied = stack.cli("apply", "-f", str(STANDIN), "-y")
        # `apply` follows until every group is ready, and gives up on workers that cannot start by themselves.
        assert applied.returncode == 0 or "isolated with no service network" in applied.stderr + applied.stdout, \
            applied.stderr

        def outcome():
            status = stack.ps(NAME)
            waiting = {g["name"]: g.get("waiting", "") for g in status["groups"]}
            if "isolated with no service network" in waiting.get("prefill", ""):
                return "isolated"
            return "ready" if all(ready(status).values()) and len(ready(status)) == 3 else None
        if until(outcome, 120, 0.5, "the workers start or wait for a network") == "isolated":
            pytest.skip("replicas are isolated without a service network (not root): the workers "
                        "cannot reach the router's address (run with DURASTACK_LOCAL_ISOLATION=off)")
        until(lambda: serving(stack), 30, 0.5, "the router reaches both groups")
    finally:
        stack.cli("stop", NAME, "-y")
        next(gen, None)
