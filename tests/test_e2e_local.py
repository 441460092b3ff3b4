"""End to end on this machine: `durastack server` (Temporal dev server, worker, nginx gateway), the CLI,
the local backend with real replica processes, and real HTTP through the gateway."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import Stack, ready, replica_processes, running_stack, until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FIXED = ROOT / "examples" / "replica-groups-fixed.yml"
NAME = "replica-groups-fixed"

SCALABLE = """
type: service
name: scalable
port: 8000
replicas:
  - name: router
    count: 1
    commands: [python3 -m http.server 8000]
    resources: {cpu: 1, memory: 1GB..}
  - name: workers
    count: 1..3
    scaling: {metric: rps, target: 100}
    commands: [python3 -m http.server 8000]
    resources: {cpu: 1, memory: 1GB..}
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)


def _status(url: str, **kw) -> int | None:
    try:
        return httpx.get(url, timeout=5, **kw).status_code
    except httpx.HTTPError:
        return None


def get(url: str, token: str | None, n: int = 1) -> list[int]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # No keep-alive: every request opens its own connection, as independent clients would.
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=10) as client:
        return [client.get(url, headers=headers).status_code for _ in range(n)]


def request_lines(stack: Stack, replica: int) -> int:
    result = stack.cli("logs", NAME, "--replica", str(replica))
    assert result.returncode == 0, result.stderr
    return result.stdout.count('"GET /')


def test_seed_service_groups_routes_auth_and_exec(stack: Stack):
    result = stack.cli("apply", "-f", str(FIXED), "-y")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{stack.gateway}/services/{NAME}/" in result.stdout
    token = stack.token()
    assert "`Authorization: Bearer <token>`" in result.stdout and token not in result.stdout  # never shown again
    status = stack.ps(NAME)
    assert ready(status) == {"0": [0], "1": [1, 2]}
    text = stack.cli("ps").stdout
    assert "group=0 replica=0" in text and "group=1 replica=1" in text and "replica=2" in text

    # Each replica ran its own group's commands, in its own /tmp.
    for replica, line in ((0, "Group 1 - Version 0"), (1, "Group 2 - Version 0"), (2, "Group 2 - Version 0")):
        out = stack.cli("exec", NAME, "--replica", str(replica), "--", "cat", "/tmp/version.txt")
        assert out.returncode == 0 and out.stdout.strip() == line

    url = f"{stack.gateway}/services/{NAME}/"
    host = httpx.get(f"{stack.gateway}/", headers={"Host": f"{NAME}.localhost", "Authorization": f"Bearer {token}"})
    assert host.status_code == 200
    before = {r: request_lines(stack, r) for r in (0, 1, 2)}
    assert get(url, token, 30) == [200] * 30
    after = {r: request_lines(stack, r) for r in (0, 1, 2)}
    assert sum(after.values()) - sum(before.values()) == 30
    assert all(after[r] > before[r] for r in (0, 1, 2)), (before, after)  # both groups served

    # Without the token, or with a wrong one, nothing reaches a replica.
    assert get(url, None, 5) == [401] * 5
    assert get(url, "wrong-token", 5) == [403] * 5
    assert {r: request_lines(stack, r) for r in (0, 1, 2)} == after


def test_gateway_tokens_from_the_cli(stack: Stack):
    url = f"{stack.gateway}/services/{NAME}/"
    # The first start printed a `default` token, once; it works like any other.
    default = re.search(r"Token +default: (\S+)", (stack.home / "server.out").read_text()).group(1)
    assert get(url, default, 2) == [200] * 2 and not (stack.home / "token").exists()
    listed = stack.cli("token", "list", "--json")
    assert listed.returncode == 0 and default not in listed.stdout
    prefixes = {t["name"]: t["prefix"] for t in json.loads(listed.stdout)}
    assert prefixes == {"default": default[:6], "e2e": stack.token()[:6]}

    added = stack.cli("token", "add", "ci")
    assert added.returncode == 0 and "not shown again" in added.stderr
    ci = added.stdout.strip()
    assert get(url, ci, 2) == [200] * 2
    again = stack.cli("token", "add", "ci")
    assert again.returncode == 1 and "durastack token add: a token named 'ci' exists already" in again.stderr

    assert stack.cli("token", "revoke", "ci").returncode == 0
    assert get(url, ci, 2) == [403] * 2  # at once: the command returned once nginx refuses it
    assert get(url, stack.token(), 2) == [200] * 2
    gone = stack.cli("token", "revoke", "ci")
    assert gone.returncode == 1 and "durastack token revoke: no token named 'ci'" in gone.stderr


def scrape(url: str, token: str | None = None) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10, headers=headers).text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_metrics_of_the_gateway_and_the_worker(stack: Stack):
    def value(metrics, name, **labels):
        return sum(v for found, v in metrics.get(name, []) if labels.items() <= found.items())

    assert get(f"{stack.gateway}/services/{NAME}/", stack.token(), 6) == [200] * 6
    assert get(f"{stack.gateway}/services/{NAME}/", "wrong", 1) == [403]
    gateway = scrape(f"{stack.control}/metrics", stack.control_token())
    served = {g: value(gateway, "durastack_gateway_requests_total", service=NAME, group=g, code="200") for g in "01"}
    assert served["0"] > 0 and served["1"] > 0  # both groups, known by their replicas' upstream addresses
    assert value(gateway, "durastack_gateway_requests_total", service=NAME, group="-", code="403") >= 1
    assert value(gateway, "durastack_gateway_request_duration_seconds_count", service=NAME) >= 6

    worker = scrape(f"http://127.0.0.1:{stack.env['DURASTACK_WORKER_METRICS_PORT']}/metrics")
    assert value(worker, "durastack_replicas", service=NAME, group="1", state="running") == 2
    assert value(worker, "durastack_replicas_ready", service=NAME, group="1") == 2
    assert value(worker, "durastack_desired_replicas", service=NAME, group="0") == 1
    assert any(name.startswith("temporal_") for name in worker)  # the SDK's own metrics, same endpoint


def test_worker_killed_during_provisioning_and_running(stack: Stack, tmp_path: Path):
    # While running: the replicas and their numbers survive a kill -9 of the worker.
    before = stack.ps(NAME)
    pid = stack.worker_pid()
    os.kill(pid, signal.SIGKILL)
    until(lambda: stack.worker_pid() not in (None, pid), 60, 0.2, "worker restarted")
    token = stack.token()
    assert get(f"{stack.gateway}/services/{NAME}/", token, 5) == [200] * 5
    assert stack.ps(NAME)["groups"] == before["groups"]

    # During provisioning: kill it right after the service is submitted.
    config = tmp_path / "scalable.yml"
    config.write_text(SCALABLE)
    assert stack.cli("apply", "-f", str(config), "-y", "--detach").returncode == 0
    os.kill(stack.worker_pid(), signal.SIGKILL)
    status = until(lambda: _ready_or_none(stack, "scalable", {"router": [0], "workers": [1]}), 120, 0.5,
                   "scalable ready after the worker restart")
    assert all(r["submission"] == 0 for g in status["groups"] for r in g["replicas"])
    # No replica was started twice: one app process per replica work dir.
    procs = {wd: n for wd, n in replica_processes(stack.home).items() if "/scalable/" in wd}
    assert sorted(procs.values()) == [1, 1] and len(procs) == 2


def _ready_or_none(stack: Stack, name: str, expected: dict) -> dict | None:
    result = stack.cli("ps", name, "--json")
    if result.returncode != 0:
        return None
    status = json.loads(result.stdout)
    return status if ready(status) == expected else None


def test_scale_up_and_down_leaves_the_gateway_before_the_process_ends(stack: Stack):
    result = stack.cli("scale", "scalable", "workers", "2")
    assert result.returncode == 0, result.stderr
    until(lambda: _ready_or_none(stack, "scalable", {"router": [0], "workers": [1, 2]}), 60, 0.3, "scaled up")
    assert len(stack.routes()["scalable"]["upstreams"]) == 3
    workdir = next(wd for wd in replica_processes(stack.home) if wd.endswith("/scalable/workers/r2-s0"))

    assert stack.cli("scale", "scalable", "workers", "1").returncode == 0
    observations = []  # (still routed, process alive), sampled until the process is gone
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        routed = any(u["replica_id"].endswith("/r2-s0") for u in stack.routes()["scalable"]["upstreams"])
        alive = workdir in replica_processes(stack.home)
        observations.append((routed, alive))
        if not alive and not routed:
            break
        time.sleep(0.02)
    assert observations[-1] == (False, False), "the removed replica did not go away"
    assert (True, False) not in observations, "a replica was still routed after its process ended"
    status = until(lambda: _ready_or_none(stack, "scalable", {"router": [0], "workers": [1]}), 30, 0.3)
    workers = next(g for g in status["groups"] if g["name"] == "workers")
    assert workers["desired"] == 1


def test_bad_input_changes_nothing(stack: Stack, tmp_path: Path):
    before = stack.ps(NAME)
    bad = tmp_path / "bad.yml"
    bad.write_text(f"type: service\nname: {NAME}\nport: 8000\nreplicas:\n  - count: 0..2\n")
    result = stack.cli("apply", "-f", str(bad), "-y")
    assert result.returncode == 1 and "replicas[0]" in result.stderr
    result = stack.cli("scale", NAME, "nope", "1")
    assert result.returncode == 1 and "no replica group 'nope'" in result.stderr
    result = stack.cli("scale", NAME, "1", "3")
    assert result.returncode == 1 and "takes 2..2 replicas, not 3" in result.stderr
    result = stack.cli("stop", "no-such-service", "-y")
    assert result.returncode == 1 and "no running service named 'no-such-service'" in result.stderr
    # The same scale as a signal from Temporal's own CLI (what the Web UI sends): refused, and said so.
    sent = stack.temporal("workflow", "signal", "--workflow-id", f"service/{NAME}", "--name", "scale",
                          "--input", '{"group": "1", "count": 3}')
    assert sent.returncode == 0, sent.stderr
    until(lambda: "scale signal refused: group '1' takes 2..2 replicas, not 3" in stack.cli("events", NAME).stdout,
          30, 0.5, "the refusal in events")
    assert stack.ps(NAME)["groups"] == before["groups"]


CYCLE = """
type: service
name: cycle
port: 8000
groups:
  - name: router
    replicas: 1
    commands:
      - echo "router - first worker at ${{ groups[worker].replicas[0].IP_ADDRESS }}:${{ groups[worker].replicas[0].PORT }}"
      - exec python3 -m http.server "$PORT"
  - name: worker
    replicas: 1
    commands:
      - echo "worker - router at ${{ groups[router].replicas[0].IP_ADDRESS }}:${{ groups[router].replicas[0].PORT }}"
      - exec python3 -m http.server "$PORT"
  - name: nodes
    replicas: 2
    commands:
      - echo "node at $DURASTACK_REPLICA_IP joins ${{ groups[nodes].replicas[0].IP_ADDRESS }}"
      - exec python3 -m http.server "$PORT"
"""


def test_references_in_a_cycle_resolve_when_each_replica_is_placed(stack: Stack, tmp_path: Path):
    path = tmp_path / "cycle.yml"
    path.write_text(CYCLE)
    result = stack.cli("apply", "-f", str(path), "-y")
    assert result.returncode == 0, result.stderr
    status = until(lambda: _ready_or_none(stack, "cycle", {"router": [0], "worker": [1], "nodes": [2, 3]}), 90, 0.3,
                   "all groups ready")

    def first_line(replica: int) -> str:
        logs = stack.cli("logs", "cycle", "--replica", str(replica)).stdout
        return next(line for line in logs.splitlines() if not line.startswith("[durastack]"))

    assert sorted(r["replica"] for g in status["groups"] for r in g["replicas"]) == [0, 1, 2, 3]
    router, worker, node0, node1 = (first_line(n) for n in range(4))
    # The router and the worker each ran with the other's address; node 0 with its own, node 1 with node 0's.
    addresses = re.findall(r"at ([0-9.]+):([0-9]+)", router + " " + worker)
    assert len(addresses) == 2 and addresses[0] != addresses[1], (router, worker)
    mine = re.match(r"node at ([0-9.]+) joins ([0-9.]+)", node0)
    assert mine and mine.group(1) == mine.group(2), node0
    assert node1.endswith(f"joins {mine.group(1)}"), node1
    assert "router replica 0 starts with groups[worker].replicas[0].IP_ADDRESS" in stack.cli("events", "cycle").stdout
    assert stack.cli("stop", "cycle", "-y").returncode == 0


def test_stop_leaves_nothing_running(stack: Stack):
    for name in (NAME, "scalable"):
        result = stack.cli("stop", name, "-y")
        assert result.returncode == 0, result.stderr
        assert name not in stack.routes()
    assert replica_processes(stack.home) == {}
    assert _status(f"{stack.gateway}/services/{NAME}/") == 404
