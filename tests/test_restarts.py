"""Restarts and scale-out, end to end on this machine (`make test-long`).

Each component `durastack server` supervises — the Temporal dev server, the worker, the gateway
(`python -m gateway`) and the gateway's nginx — is killed with SIGKILL, by the PID that started it,
once during a rolling update and once during a scale-up, both under a steady load. The supervisor
restarts the first three (cli/stack.py) — a restarted gateway adopts the nginx its predecessor left serving —
and the gateway restarts its nginx (gateway/app.py). Each time the
service must converge: every replica ready on the wanted deployment and count, `ps`, the local
backend's instances, the replica processes and the gateway's routes naming the same replicas, one live
submission per replica number, no orphan process. A worker killed while a replica's terminate runs shows
that activity retried within its heartbeat timeout (activities/liveness.py). Then two workers share one
Temporal server, and one of them dies as a rollout begins: the other finishes it, and takes over the service's
replica monitor at that activity's heartbeat timeout. Local replicas run in
sessions of their own, so they outlive the worker that started them; nothing replaces them for that.

Figures (convergence, routes back after a gateway restart, failed requests) are printed: run with -s.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import httpx
import pytest

from activities import interface
from backends.local import LocalBackend
from backends.local_host import MARKER, is_alive, proc_stat
from models.settings import Settings
from tests.e2e import Load, Stack, evidence, running_stack, until
from activities import interface
from rules.jobs import replica_workflow_id
from workflows.service import service_workflow_id

pytestmark = [pytest.mark.e2e, pytest.mark.long]

ROOT = Path(__file__).resolve().parent.parent
FINISHED = ("terminated", "failed")
RPS = 8
CONVERGE = 300  # seconds; generous: a lost activity is retried after its 20 s heartbeat timeout
# A monitor lost with its worker moves at its heartbeat timeout (ServiceRunInput.heartbeat_seconds, 20 s), or sooner
# when the rollout changes what it watches and the service starts another.
WATCH_TAKEOVER = 120
PLACE = interface.place_replica.__name__  # the stub's name
ROLLING = """
type: service
name: {name}
port: 8000
replicas:
  - name: g
    count: 2
    commands:
      - echo "version {v}" > /tmp/version.txt
      - python3 -m http.server 8000
    resources: {{cpu: 1, memory: 1GB..}}
"""
SCALABLE = """
type: service
name: {name}
port: 8000
replicas:
  - name: g
    count: 1..3
    scaling: {{metric: rps, target: 1000}}
    commands: [python3 -m http.server 8000]
    resources: {{cpu: 1, memory: 1GB..}}
"""
# An app that ignores SIGTERM (it only says so): stopping it takes the backend's whole grace period.
STUBBORN = """
type: service
name: {name}
port: 8000
replicas:
  - name: g
    count: 1..2
    scaling: {{metric: rps, target: 1000}}
    commands:
      - >-
        python3 -u -c 'import signal, http.server as h;
        signal.signal(signal.SIGTERM, lambda *a: print("got SIGTERM"));
        h.ThreadingHTTPServer(("", 8000), h.SimpleHTTPRequestHandler).serve_forever()'
    resources: {{cpu: 1, memory: 1GB..}}
"""
FIGURES: list[str] = []


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from running_stack(tmp_path_factory)
    print("\n".join(["", "restart figures:", *FIGURES]))


# ---- observation ---------------------------------------------------------------------------------

def child_pid(stack: Stack, component: str) -> Optional[int]:
    """PID of a supervised child (server.json), or of the gateway's nginx master (the gateway's endpoints.json)."""
    try:
        if component == "nginx":
            return json.loads((stack.home / "gateway" / "endpoints.json").read_text())["nginx_pid"]
        return json.loads((stack.home / "server.json").read_text())["children"][component]["pid"]
    except (OSError, KeyError, ValueError, TypeError):
        return None


def alive(pid: Optional[int]) -> bool:
    st = proc_stat(pid) if pid else None
    return st is not None and st.state not in "ZX"


def status_or_none(stack: Stack, name: str) -> Optional[dict]:
    """`ps NAME --json`, or None while the control plane does not answer (Temporal restarting)."""
    result = stack.cli("ps", name, "--json", timeout=60)
    return json.loads(result.stdout) if result.returncode == 0 else None


def routes_or_none(stack: Stack, name: str) -> Optional[set[str]]:
    try:
        services = httpx.get(f"{stack.control}/api/services", timeout=5, trust_env=False,
                             headers={"Authorization": f"Bearer {stack.control_token()}"}).json()["services"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None  # the gateway is restarting
    return {u["replica_id"] for u in services.get(name, {}).get("upstreams", [])}


def answers(url: str, token: str, timeout: float = 2.0) -> Optional[int]:
    try:
        return httpx.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout, trust_env=False).status_code
    except httpx.HTTPError:
        return None


def live_instances(stack: Stack, name: str) -> dict[str, object]:
    """Replica id → instance, for this service's instances that the local backend finds running."""
    backend = LocalBackend(stack.home, isolation=False)  # only reads its records: no isolation probe
    return {i.replica_id: i for i in backend.instances()
            if i.replica_id.startswith(f"{name}/") and backend.status(i).state == "running"}


class NotYet(str):
    """Why the service has not converged yet: falsy, so `until` goes on, and its repr names the part that
    disagrees when `until` gives up."""

    def __bool__(self) -> bool:
        return False


def converged(stack: Stack, name: str, count: int, deployment: int) -> dict | NotYet:
    """The service's picture once it is where it should be, else why not. Everyone must agree: `ps`, the
    backend's live instances, the replica processes (one app per work dir, none outside) and the gateway's
    routes."""
    status = status_or_none(stack, name)
    if status is None or status["deployment"] != deployment:
        return NotYet(f"ps: {status and status['deployment']!r}")
    (group,) = status["groups"]
    active = [r for r in group["replicas"] if r["status"] not in FINISHED]
    rows = [(r["replica"], r["submission"], r["status"], r["ready"], r["deployment"]) for r in group["replicas"]]
    if group["desired"] != count or len(active) != count:
        return NotYet(f"ps: desired {group['desired']}, rows {rows}")
    if not all(r["status"] == "running" and r["ready"] and r["deployment"] == deployment for r in active):
        return NotYet(f"ps: rows {rows}")
    in_ps = {f"{name}/{group['name']}/r{r['replica']}-s{r['submission']}" for r in active}
    live = live_instances(stack, name)
    procs = {wd: n for wd, n in app_processes(stack.home).items() if f"/replicas/{name}/" in wd}
    routes = routes_or_none(stack, name)
    numbers = Counter(rid.rsplit("/", 1)[1].split("-")[0] for rid in live)
    if set(live) != in_ps or routes != in_ps or any(n > 1 for n in numbers.values()):
        return NotYet(f"ps {sorted(in_ps)}, live {sorted(live)}, routes {routes and sorted(routes)}")
    if procs != {inst.work_dir: 1 for inst in live.values()}:  # one app per replica, no orphan
        return NotYet(f"apps {procs}")
    return {"status": status, "replicas": sorted(in_ps), "live": live}


def app_processes(home: Path) -> dict[str, int]:
    """Work dir → number of live replica apps (a python running http.server) of this home, from /proc."""
    found: Counter = Counter()
    marker = f"{MARKER}={home}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            if not (args[0].rsplit(b"/", 1)[-1].startswith(b"python") and any(b"http.server" in a for a in args[1:])):
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        wd = next((e[len(MARKER) + 1:].decode() for e in env if e.startswith(marker)), None)
        if wd and alive(int(entry.name)):
            found[wd] += 1
    return dict(found)


def burst(url: str, token: str, n: int = 30) -> list[int]:
    """``n`` requests, each on a fresh connection."""
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=30, trust_env=False,
                      headers={"Authorization": f"Bearer {token}"}) as client:
        return [client.get(url).status_code for _ in range(n)]


def failed(counts: Counter) -> int:
    return sum(n for status, n in counts.items() if status != 200)


# ---- killing -------------------------------------------------------------------------------------

def kill(stack: Stack, component: str) -> int:
    pid = child_pid(stack, component)
    assert pid and alive(pid), f"no live {component} to kill"
    os.kill(pid, signal.SIGKILL)
    return pid


def await_restart(stack: Stack, component: str, old: int, url: str, token: str, killed: float) -> str:
    """Wait for a new process of ``component`` to serve; for the gateway, time its routes coming back."""
    until(lambda: child_pid(stack, component) not in (None, old) and alive(child_pid(stack, component)),
          90, 0.02, f"{component} restarted")
    if component == "gateway":
        # The old control app died with its process: the first answer is the new one's.
        until(lambda: answers(f"{stack.control}/healthz", token, 1.0) == 200, 60, 0.01, "control API up")
        up = time.monotonic()
        until(lambda: answers(url, token) == 200, 30, 0.01, "service answering through nginx")
        back = time.monotonic() - up
        assert back < 2.0, f"routes came back {back:.2f}s after the control API"
        return f"control API up {up - killed:.2f}s after the kill, routes back {back:.2f}s later"
    if component == "nginx":
        until(lambda: answers(url, token) == 200, 30, 0.01, "service answering through the new nginx")
        return f"new nginx serving the routes {time.monotonic() - killed:.2f}s after the kill"
    return f"restarted (pid {child_pid(stack, component)}) {time.monotonic() - killed:.2f}s after the kill"


COMPONENTS = ["temporal", "worker", "gateway", "nginx"]
# Requests fail only while nginx is down: a killed control app leaves nginx serving (the next one adopts it).
DATA_PATH = ("nginx",)


def _run_case(stack: Stack, name: str, component: str, act, started, count: int, deployment: int) -> None:
    """Under load: ``act()``, wait for ``started(status)`` (the change is under way), kill ``component``, then
    wait for convergence to (count, deployment) and check that everything agrees and serves."""
    token = stack.token()
    url = f"{stack.gateway}/services/{name}/"
    load = Load(url, token, rps=RPS).start()
    run_id = asyncio.run(_service_run_id(stack, name))
    try:
        begun = time.monotonic()
        act()
        until(lambda: (lambda s: s is not None and started(s))(status_or_none(stack, name)), 120, 0.1,
              "the change under way")
        old = kill(stack, component)
        killed = time.monotonic()
        restart = await_restart(stack, component, old, url, token, killed)
        try:
            picture = until(lambda: converged(stack, name, count, deployment), CONVERGE, 0.5, "convergence")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{evidence(stack, name)}") from None
        done = time.monotonic()
    finally:
        counts = load.stop()
    assert set(burst(url, token)) == {200}  # after convergence every request succeeds
    figure = (f"{component:8} {name:22} converged {done - begun:5.1f}s after the change, {done - killed:5.1f}s "
              f"after the kill; {failed(counts)} of {sum(counts.values())} requests failed "
              f"{dict(counts) if failed(counts) else ''}; {restart}")
    FIGURES.append(figure)
    print(figure)
    if component not in DATA_PATH:  # the control plane restarting must not cost a request
        assert failed(counts) == 0, counts
    assert picture["status"]["groups"][0]["desired"] == count
    assert alive(child_pid(stack, component))
    # The same workflow run went on: a restarted dev server reopens its SQLite file (--db-filename in the home).
    assert asyncio.run(_service_run_id(stack, name)) == run_id


async def _service_run_id(stack: Stack, name: str) -> str:
    from cli.client import connect

    client = await connect(Settings.from_env(environ=stack.env))
    return (await client.get_workflow_handle(service_workflow_id(name)).describe()).run_id


def _stop(stack: Stack, name: str) -> None:
    result = stack.cli("stop", name, "-y")
    assert result.returncode == 0, result.stdout + result.stderr
    assert not any(f"/replicas/{name}/" in wd for wd in app_processes(stack.home))


def _apply(stack: Stack, path: Path, *extra: str) -> None:
    result = stack.cli("apply", "-f", str(path), "-y", *extra)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("component", COMPONENTS)
def test_kill_during_rolling_update(stack: Stack, tmp_path: Path, component: str):
    name = f"roll-{component}"
    for v in (0, 1):
        (tmp_path / f"v{v}.yml").write_text(ROLLING.format(name=name, v=v))
    _apply(stack, tmp_path / "v0.yml")
    _run_case(stack, name, component,
              act=lambda: _apply(stack, tmp_path / "v1.yml", "--detach"),
              started=lambda s: any(r["deployment"] == 1 for r in s["groups"][0]["replicas"]),
              count=2, deployment=1)
    versions = {stack.cli("exec", name, "--replica", str(r["replica"]), "--", "cat", "/tmp/version.txt").stdout.strip()
                for r in stack.ps(name)["groups"][0]["replicas"] if r["status"] not in FINISHED}
    assert versions == {"version 1"}
    _stop(stack, name)


@pytest.mark.parametrize("component", COMPONENTS)
def test_kill_during_scale_up(stack: Stack, tmp_path: Path, component: str):
    name = f"scale-{component}"
    (tmp_path / "s.yml").write_text(SCALABLE.format(name=name))
    _apply(stack, tmp_path / "s.yml")

    def scale():
        result = stack.cli("scale", name, "g", "3")
        assert result.returncode == 0, result.stdout + result.stderr

    _run_case(stack, name, component, act=scale,
              started=lambda s: len([r for r in s["groups"][0]["replicas"] if r["status"] not in FINISHED]) > 1,
              count=3, deployment=0)
    _stop(stack, name)


def test_worker_killed_while_a_replica_stops(stack: Stack, tmp_path: Path):
    """A terminate in flight on a worker that dies is retried within the heartbeat timeout, not after its
    10-minute start-to-close timeout: the replica's app ignores SIGTERM, so stopping it takes 10 s."""
    name = "stubborn"
    (tmp_path / "s.yml").write_text(STUBBORN.format(name=name))
    _apply(stack, tmp_path / "s.yml")
    assert stack.cli("scale", name, "g", "2").returncode == 0
    picture = until(lambda: converged(stack, name, 2, 0), CONVERGE, 0.5, "two replicas")
    assert stack.cli("scale", name, "g", "1").returncode == 0
    begun = time.monotonic()
    victim = picture["live"][f"{name}/g/r1-s0"]  # a scale-down removes the newest replica
    log = Path(victim.work_dir) / "replica.log"
    # Unregistered and told to stop: terminate is running (its local.stop waits out the grace period).
    until(lambda: "got SIGTERM" in log.read_text(errors="replace"), 60, 0.05, "terminate under way")
    worker = kill(stack, "worker")
    killed = time.monotonic()
    until(lambda: converged(stack, name, 1, 0), CONVERGE, 0.5, "scaled down")
    done = time.monotonic()
    assert not is_alive(victim.pid, victim.start_time)
    figure = (f"worker   {name:22} killed during a terminate: scaled down {done - killed:5.1f}s after the kill "
              f"({done - begun:5.1f}s after the scale; start-to-close would be 600 s)")
    FIGURES.append(figure)
    print(figure)
    assert child_pid(stack, "worker") != worker
    _stop(stack, name)


# ---- two workers ---------------------------------------------------------------------------------

def _worker_env(stack: Stack) -> dict[str, str]:
    """The supervised worker's own environment, without its metrics port (one process per port)."""
    raw = Path(f"/proc/{child_pid(stack, 'worker')}/environ").read_bytes().split(b"\0")
    env = dict(e.decode().split("=", 1) for e in raw if b"=" in e)
    env["DURASTACK_WORKER_METRICS_PORT"] = "0"
    return env


def _worker_pid(identity: str) -> int:
    return int(identity.split("@", 1)[0])  # the SDK's default identity: "<pid>@<host>"


async def _activity_workers(stack: Stack, replica_ids: list[str]) -> dict[str, dict[str, set[int]]]:
    """Replica id → activity name → pids of the workers that ran it: started events in the replica
    workflow's history (its launch and teardown)."""
    from cli.client import connect

    client = await connect(Settings.from_env(environ=stack.env))
    out: dict[str, dict[str, set[int]]] = {}
    for rid in replica_ids:
        service, group, rest = rid.split("/")
        replica, submission = (int(x[1:]) for x in rest.split("-"))
        handle = client.get_workflow_handle(replica_workflow_id(service, group, replica, submission))
        out[rid] = await _ran(handle)
    return out


async def _ran(handle) -> dict[str, set[int]]:
    """Activity name → pids of the workers that started it, from the workflow's history, and of pending
    activities (a long-running one such as the monitor) from its description."""
    ran: dict[str, set[int]] = {}
    scheduled: dict[int, str] = {}
    async for event in handle.fetch_history_events():
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.HasField("activity_task_started_event_attributes"):
            attrs = event.activity_task_started_event_attributes
            ran.setdefault(scheduled[attrs.scheduled_event_id], set()).add(_worker_pid(attrs.identity))
    return ran


async def _monitors(stack: Stack, name: str) -> set[int]:
    """Pids of the workers watching the service's replicas now (cli.inspect.watchers_of: the fleet monitor's
    watch, or the service's own monitors); one whose worker died stays pending on it until its heartbeat timeout."""
    from cli.client import connect
    from cli.inspect import watchers_of

    settings = Settings.from_env(environ=stack.env)
    client = await connect(settings)
    return {_worker_pid(w) for w in await watchers_of(client, settings.task_queue, name)}


# Replicas of the two-worker test: Temporal hands tasks to whichever worker polls first, so with few
# replicas one worker can get them all (seen with 4; 7 to 1 seen with 8).
SHARED = 8


def test_two_workers_share_the_work_and_one_finishes_a_rollout_alone(stack: Stack, tmp_path: Path):
    name = "shared"
    for v in (0, 1):
        (tmp_path / f"v{v}.yml").write_text(ROLLING.format(name=name, v=v).replace("count: 2", f"count: {SHARED}"))
    first = until(lambda: alive(child_pid(stack, "worker")) and child_pid(stack, "worker"), 60, 0.1, "worker up")
    log = open(tmp_path / "worker2.log", "wb")
    second = subprocess.Popen([sys.executable, "-m", "worker"], cwd=ROOT, env=_worker_env(stack), stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        until(lambda: b"worker polling" in (tmp_path / "worker2.log").read_bytes(), 60, 0.1, "second worker up")
        for attempt in range(3):  # tasks go to whichever worker polls first: rarely all to one; then again
            if attempt:
                _stop(stack, name)
            _apply(stack, tmp_path / "v0.yml")
            picture = until(lambda: converged(stack, name, SHARED, 0), CONVERGE, 0.5, "all replicas")

            # Both workers ran replica activities. The robust signal is the worker identity Temporal records
            # for each activity; the local backend agrees: a replica's leader is a child of the worker that ran
            # its launch (the process tree is started in a session of its own, so it outlives that worker).
            ran = asyncio.run(_activity_workers(stack, picture["replicas"]))
            everyone = set().union(*(pids for acts in ran.values() for pids in acts.values()))
            if len(everyone) == 2:
                break
        assert everyone == {first, second.pid}, ran
        owner = {}
        for rid, acts in ran.items():
            (provisioner,) = acts[PLACE]
            inst = picture["live"][rid]
            assert proc_stat(inst.pid).ppid == provisioner, (rid, acts)
            owner[rid] = provisioner
        FIGURES.append(f"two workers: activities of {SHARED} replicas ran on {sorted(everyone)}; launches per worker "
                       f"{dict(Counter(owner.values()))}")

        token = stack.token()
        url = f"{stack.gateway}/services/{name}/"
        load = Load(url, token, rps=RPS).start()
        try:
            _apply(stack, tmp_path / "v1.yml", "--detach")  # returns once deployment 1 is accepted
            second.kill()  # SIGKILL, by the PID we started, as the rollout begins
            second.wait(30)
            killed = time.monotonic()
            # Its replicas did not die with it: those it started still run, unless the rollout stopped them. Looked
            # at before `ps`, so that a stop the rollout makes meanwhile shows there (after, it raced the look).
            orphaned = [rid for rid, pid in owner.items() if pid == second.pid]
            gone = [rid for rid in orphaned if not is_alive(picture["live"][rid].pid, picture["live"][rid].start_time)]
            status = stack.ps(name)
            stopped = {f"{name}/g/r{r['replica']}-s{r['submission']}" for r in status["groups"][0]["replicas"]
                       if r["status"] in ("terminating", "terminated")}
            assert set(gone) <= stopped, (gone, status)
            until(lambda: converged(stack, name, SHARED, 1), CONVERGE, 0.5, "the rollout finished by the first")
            done = time.monotonic()
        finally:
            counts = load.stop()
        assert failed(counts) == 0, counts
        assert child_pid(stack, "worker") == first  # the supervised worker never restarted: it did it alone
        # The service's replicas are watched by the first worker: a monitor the second held moved at its
        # heartbeat timeout, or when the rollout changed what it watches (WATCH_TAKEOVER).
        until(lambda: asyncio.run(_monitors(stack, name)) == {first}, WATCH_TAKEOVER, 2.0,
              f"the service's monitor on the first worker ({first}; the second was {second.pid})")
        events = json.loads(stack.cli("events", name, "--json").stdout)
        assert not [e for e in events if re.match(r"replica \d+ failed", e["message"])], events
        figure = (f"two workers: second killed mid-rollout ({len(orphaned)} of its replicas still running); the "
                  f"first finished it {done - killed:.1f}s later; {failed(counts)} of {sum(counts.values())} "
                  f"requests failed")
        FIGURES.append(figure)
        print(figure)
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(30)
        log.close()
    _stop(stack, name)
