"""The PD-disaggregation stand-in (examples/pd-disaggregation/standin.yml) end to end, from the CLI: SGLang's real
model gateway (`smg`) as the router group, started with no workers, and stand-in SGLang engines as the prefill and
decode groups. durastack fills the router's worker list; every request through the gateway enters the router,
which pairs a prefill and a decode worker; a decode scale step is learned by the router without restarting it;
a killed worker is replaced and the router serves from the replacement. A group of the stand-in engine with vLLM's
names scales on its engines' queue.

The replicas run isolated on their service's network (the default as root), so the router and the engines listen
inside their own namespaces, never on the host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e import Stack, isolated_stack, python_scripts, ready, until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd-disaggregation"
STANDIN = EXAMPLE / "standin.yml"
NAME = "pd-standin"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    smg = Path(sys.executable).parent / "smg"
    gen = isolated_stack(tmp_path_factory, {"PD_EXAMPLE": str(EXAMPLE), "SMG": str(smg)},
                         "the stand-in's router and engines")
    s = next(gen)
    yield s
    next(gen, None)
    assert engines(s.home) == {}


def engines(home: Path) -> dict[int, str]:
    """PID → group of this home's stand-in engines."""
    return {pid: env.get("DURASTACK_GROUP", "") for pid, env in python_scripts(home, "engine.py").items()}


def complete(stack: Stack, n: int = 1) -> list[httpx.Response]:
    url = f"{stack.gateway}/services/{NAME}/v1/completions"
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {stack.token()}"}) as client:
        return [client.post(url, json={"model": "standin", "prompt": f"hi {i}", "max_tokens": 4}) for i in range(n)]


def router_workers(stack: Stack) -> list[dict]:
    view = stack.ps(NAME).get("router") or []
    return [w for w in view[0]["workers"] if w["healthy"]] if len(view) == 1 else []


def test_the_real_router_learns_its_workers_scales_and_serves_from_a_replacement(stack):
    applied = stack.cli("apply", "-f", str(STANDIN), "-y")
    assert applied.returncode == 0, applied.stderr
    until(lambda: ready(stack.ps(NAME)) == {"router": [0], "prefill": [1], "decode": [2]}
          or ready(stack.ps(NAME)) == {"router": [0], "prefill": [2], "decode": [1]}, 120, 0.5, "all groups ready")
    status = stack.ps(NAME)
    assert [g["role"] for g in status["groups"]] == ["router", "worker", "worker"]
    assert [u["replica_id"] for u in stack.routes()[NAME]["upstreams"]] == [f"{NAME}/router/r0-s0"]
    assert sorted(w["worker_type"] for w in router_workers(stack)) == ["decode", "prefill"]
    answers = complete(stack, 4)
    assert [r.status_code for r in answers] == [200] * 4
    assert all(r.json()["choices"][0]["text"].startswith("decoded ") for r in answers)  # prefill's KV, then decode

    # decode 1 → 3: the router lists all three and sends requests to each, never restarted
    assert stack.cli("scale", NAME, "decode", "3").returncode == 0
    until(lambda: len(router_workers(stack)) == 4, 90, 0.5, "the router lists 3 decode workers")
    decoders = {r.headers["x-smg-routed-worker-id"] for r in complete(stack, 12)}
    assert len(decoders) == 3
    assert all(r["submission"] == 0 for g in stack.ps(NAME)["groups"] if g["name"] == "router"
               for r in g["replicas"])
    verbose = stack.cli("ps", NAME, "-v").stdout
    assert "router replica=0 knows 4 worker(s)" in verbose, verbose

    # kill -9 of one decode engine: unrouted from the router, replaced, and the replacement listed
    victim, env = next((pid, env) for pid, env in python_scripts(stack.home, "engine.py").items()
                       if env.get("DURASTACK_GROUP") == "decode")
    gone = f"http://{env['DURASTACK_REPLICA_IP']}:"
    os.kill(victim, signal.SIGKILL)
    until(lambda: any("replica" in m and "down: exited" in m for m in [stack.cli("events", NAME).stdout]), 30, 0.5,
          "the dead worker noticed")
    until(lambda: len(router_workers(stack)) == 4 and len(engines(stack.home)) == 4, 90, 0.5, "a replacement listed")
    assert [r.status_code for r in complete(stack, 6)] == [200] * 6
    # The dead worker left the router (its teardown leaves it, or the sync removes it: whichever comes first) and
    # the replacement was added.
    listed = [w["url"] for w in stack.ps(NAME)["router"][0]["workers"]]
    assert not any(url.startswith(gone) for url in listed), listed
    events = stack.cli("events", NAME).stdout
    assert "router r0: added decode replica" in events.split("down: exited")[-1], events
    assert stack.cli("stop", NAME, "-y").returncode == 0
    until(lambda: not engines(stack.home), 60, 0.5, "the engines gone")


QUEUED = """
type: service
name: queued
port: 8000
env: [PD_EXAMPLE]
replicas: 1..3
scaling: {metric: queue, target: 1, window: 30s, scale_up_delay: 0s, scale_down_delay: 10m}
commands:
  - >-
    python3 "$PD_EXAMPLE/engine.py" --metric-names vllm --max-running 1 --decode-seconds-per-token 0.05
    --host 0.0.0.0 --port "$PORT"
resources: {cpu: 1, memory: 1GB..}
"""


def test_a_group_scales_on_its_engines_queue_read_through_the_cli(stack, tmp_path):
    """The stand-in engine with vLLM's names, one request at a time (16 tokens × 50 ms): four clients at once keep
    three waiting, so the group goes past one replica on `vllm:num_requests_waiting` alone."""
    path = tmp_path / "queued.yml"
    path.write_text(QUEUED)
    assert stack.cli("validate", "-f", str(path)).stdout.count("queue target 1, window 30s") == 1
    applied = stack.cli("apply", "-f", str(path), "-y")
    assert applied.returncode == 0, applied.stderr
    url = f"{stack.gateway}/services/queued/v1/completions"
    token, stop, statuses = stack.token(), threading.Event(), []

    def client() -> None:
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {token}"}) as c:
            for i in range(400):  # bounded: ~0.8 s each while one replica serves
                if stop.is_set():
                    return
                statuses.append(c.post(url, json={"model": "standin", "prompt": f"hi {i}", "max_tokens": 16}).status_code)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in clients:
        t.start()
    try:
        until(lambda: len(ready(stack.ps("queued"))["0"]) >= 2, 120, 0.5, "a second replica on the queue")
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=60)
    assert statuses and set(statuses) == {200}
    scale = [e["message"] for e in json.loads(stack.cli("events", "queued", "--json").stdout) if e["kind"] == "scale"]
    assert any(re.search(r"1 → [23]: target; queue [\d.]+ over 30s \(r0 [\d.]+\), target 1", m) for m in scale), scale
    assert re.search(r"group=0 scales on queue [\d.]+ over 30s \(r0 [\d.]+", stack.cli("ps", "queued", "-v").stdout)
    assert stack.cli("stop", "queued", "-y").returncode == 0
