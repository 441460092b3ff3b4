"""The lean replica lifecycle's figures, on a real `durastack server` with local replicas.

    .venv/bin/python -m bench.lifecycle [--history-replicas 4] [--apply-n 16] [--apply-repeat 2] [--own-repeat 3]
                                        [--kills 3] [--moves 1] [--orphan-replicas 2] [--orphan-wait 60]
                                        [--skip history,apply,kill,move,orphans] [--keep]

1. **history**: one service of N replicas (``--history-replicas``); from each ReplicaWorkflow's history, the
   events up to the completion of its launch's last step (the replica is ready and routed then; a local replica's
   launch is one step), and the workflow tasks among them; and the service workflow's events from its first child started to the workflow
   task that saw the last replica ready, per replica.
2. **apply**: `durastack apply -y` of one group of ``--apply-n`` replicas, minus own(N), the same app started N
   times at once without durastack (``bench.control_plane``, which this reuses; see bench/README.md).
3. **kill**: SIGKILL to a serving replica's app (one replica per service, ``--kills`` services); the time until
   the gateway's control API no longer routes to it, until it routes to the replacement, and until a request
   through the gateway gets a 200.
4. **move**: a second worker joins the server's Temporal; SIGKILL to the worker whose watch covers the service
   (the local fleet monitor's ``watch_fleet``), then at once SIGKILL to a replica's app; the time until that
   replica is unrouted, which waits for the watch to move to the other worker at its heartbeat timeout
   (``FleetInput.heartbeat_seconds``, 24 s).
5. **orphans**: a service terminated as the Web UI's button does, and another reset to its first workflow task;
   what still runs (app processes) and is routed ``--orphan-wait`` s later, and when it was last more than one
   replica per slot (the reaper's quick pass and the reset run's takeover, not a test hook, clean up).

Progress goes to stderr, the figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import httpx

from activities import interface
from backends.local_host import MARKER
from cli.inspect import watchers_of
from bench.control_plane import SERVICE, own_start, run_once
from bench.stack import ROOT, BenchStack, code_note, load_avg, load_note, median, until
from rules.jobs import replica_workflow_id
from workflows.service import service_workflow_id

LAUNCH_STEPS = {f.__name__ for f in (interface.place_replica, interface.start_replica, interface.await_ready)}
GROUP = "app"  # bench.control_plane.SERVICE's group
POLL = 0.01  # seconds between looks at the gateway's routes


def log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _kind(event) -> str:
    return event.WhichOneof("attributes")


# ---- 1. history per replica start ------------------------------------------------------------------


async def history_figures(stack: BenchStack, name: str, n: int) -> dict:
    client = await stack.temporal()
    per_replica = []
    for r in range(n):
        events = (await client.get_workflow_handle(replica_workflow_id(name, GROUP, r, 0)).fetch_history()).events
        steps = {e.event_id for e in events if _kind(e) == "activity_task_scheduled_event_attributes"
                 and e.activity_task_scheduled_event_attributes.activity_type.name in LAUNCH_STEPS}
        done = max(e.event_id for e in events if _kind(e) == "activity_task_completed_event_attributes"
                   and e.activity_task_completed_event_attributes.scheduled_event_id in steps)
        tasks = sum(1 for e in events[:done] if _kind(e) == "workflow_task_completed_event_attributes")
        per_replica.append((done, tasks, len(events)))
    svc = (await client.get_workflow_handle(service_workflow_id(name)).fetch_history()).events
    first_child = next(e.event_id for e in svc if _kind(e) == "start_child_workflow_execution_initiated_event_attributes")
    ready: set[int] = set()
    last_ready = None
    for e in svc:
        if _kind(e) == "workflow_execution_signaled_event_attributes" and \
                e.workflow_execution_signaled_event_attributes.signal_name == "replica_changed":
            update = json.loads(e.workflow_execution_signaled_event_attributes.input.payloads[0].data)
            if update["ready"] and update["status"] == "running":
                ready.add(update["replica_num"])
                if len(ready) == n:
                    last_ready = e.event_id
                    break
    if last_ready is None:
        raise RuntimeError(f"{name}: the service's history shows {len(ready)} of {n} replicas ready")
    seen = next(e.event_id for e in svc if e.event_id > last_ready
                and _kind(e) == "workflow_task_completed_event_attributes")
    span = [e for e in svc if first_child <= e.event_id <= seen]
    return {
        "replica_events": [d for d, _, _ in per_replica], "replica_tasks": [t for _, t, _ in per_replica],
        "replica_total": [t for _, _, t in per_replica],
        "service_events": len(span), "service_setup": first_child - 1,
        "service_tasks": sum(1 for e in span if _kind(e) == "workflow_task_completed_event_attributes"),
        "service_signals": sum(1 for e in span if _kind(e) == "workflow_execution_signaled_event_attributes"),
    }


def run_history(stack: BenchStack, n: int) -> list[str]:
    name = "lc-history"
    stack.check("apply", "-f", str(stack.write(f"{name}.yml", SERVICE.format(name=name, n=n))), "-y", timeout=600)
    h = asyncio.run(history_figures(stack, name, n))
    stack.stop_service(name)
    ev, tasks = h["replica_events"], h["replica_tasks"]
    return [
        f"history per replica start ({n} replicas of one group, one apply):",
        f"  ReplicaWorkflow, up to its launch's completion (ready and routed): {min(ev)}-{max(ev)} events, "
        f"{min(tasks)}-{max(tasks)} workflow tasks (goal ≤ 15 events, ≤ 3 tasks); whole history while it serves: "
        f"{min(h['replica_total'])}-{max(h['replica_total'])} events",
        f"  ServiceRunWorkflow, first child started → all {n} seen ready: {h['service_events']} events "
        f"({h['service_events'] / n:.1f} per replica; {h['service_signals']} report signals, {h['service_tasks']} "
        f"workflow tasks); {h['service_setup']} events before that (start, backends, route)",
    ]


# ---- 2. apply of N replicas ------------------------------------------------------------------------


def run_apply(stack: BenchStack, n: int, repeat: int, own_repeat: int) -> list[str]:
    own = median([own_start(n) for _ in range(own_repeat)])
    runs = []
    for i in range(repeat):
        r = run_once(stack, n, 100 + i)
        log(f"apply N={n}: T_ready {r.t_ready:.2f}s T_apply {r.t_apply:.2f}s " +
            " ".join(f"{k}={v:.2f}" for k, v in r.phases.items()))
        runs.append(r)
    ready, applied = [r.t_ready for r in runs], [r.t_apply for r in runs]
    keys = ["submitted", "route", "children", "registered", "ready"]
    return [
        f"apply -y of one group of {n} local replicas ({repeat} runs; own({n}) = {own:.2f} s, the same app started "
        f"{n} times at once without durastack, median of {own_repeat}):",
        f"  beyond the replicas' own start: T_ready − own = {median(ready) - own:.2f} s median, "
        f"{max(ready) - own:.2f} s max (goal ≤ 1.5 s); T_apply − own = {median(applied) - own:.2f} s median "
        f"(the blocking CLI, its start and 0.5 s polls included)",
        "  milestones (median s after apply): " + ", ".join(f"{k} {median([r.phases[k] for r in runs]):.2f}"
                                                           for k in keys),
    ]


# ---- 3 and 4. killed replicas ------------------------------------------------------------------------


def routes(stack: BenchStack, name: str) -> Optional[set[str]]:
    """The replica ids the gateway routes ``name`` to, from its control API; None while it does not answer."""
    try:
        r = httpx.get(f"{stack.control}/api/services", timeout=2, trust_env=False,
                      headers={"Authorization": f"Bearer {stack.settings.control_token}"})
        services = r.json()["services"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return {u["replica_id"] for u in services.get(name, {}).get("upstreams", [])}


def apps() -> dict[str, int]:
    """The replicas' apps that run: the work dir of each (the backend's marker in its environment) → the pid of
    its `http.server` python."""
    prefix = f"{MARKER}=".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"http.server" not in (entry / "cmdline").read_bytes().split(b"\0"):
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        found.update({e[len(prefix):].decode(): int(entry.name) for e in env if e.startswith(prefix)})
    return found


def app_pid(work_dir: str) -> int:
    """The replica's app: the `http.server` python carrying the backend's marker of that work dir."""
    pid = apps().get(work_dir)
    if pid is None:
        raise RuntimeError(f"no app process of {work_dir}")
    return pid


def status(url: str, token: str) -> Optional[int]:
    try:
        return httpx.get(url, timeout=2, trust_env=False, headers={"Authorization": f"Bearer {token}"}).status_code
    except httpx.HTTPError:
        return None


def kill_and_follow(stack: BenchStack, name: str, replica: int, serve: bool = True,
                    before_kill=lambda: None) -> dict[str, float]:
    """SIGKILL replica ``replica``'s app; seconds until it is unrouted, a replacement is routed and (``serve``)
    a request through the gateway answers 200."""
    rid = f"{name}/{GROUP}/r{replica}-s0"
    pid = app_pid(stack.instance(name, GROUP, replica)["work_dir"])
    before = until(lambda: (lambda now: now if now and rid in now else None)(routes(stack, name)), 30, POLL,
                   f"{rid} routed")
    token, url = stack.token(), f"{stack.gateway}/services/{name}/"  # made before the clock starts
    before_kill()
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    out: dict[str, float] = {}
    until(lambda: (lambda now: now is not None and rid not in now)(routes(stack, name)), 120, POLL, f"{rid} unrouted")
    out["unrouted"] = time.monotonic() - t0
    until(lambda: (lambda now: now is not None and now - before)(routes(stack, name)), 120, POLL,
          f"{name}: a replacement routed")
    out["replacement routed"] = time.monotonic() - t0
    if serve:
        until(lambda: status(url, token) == 200, 60, POLL, f"{name} answering")
        out["serving (200)"] = time.monotonic() - t0
    return out


def run_kills(stack: BenchStack, kills: int) -> list[str]:
    results = []
    for k in range(kills):
        name = f"lc-kill-{k}"
        stack.check("apply", "-f", str(stack.write(f"{name}.yml", SERVICE.format(name=name, n=1))), "-y", timeout=600)
        r = kill_and_follow(stack, name, 0)
        log(f"{name}: " + ", ".join(f"{k} {v:.2f}s" for k, v in r.items()))
        results.append(r)
        stack.stop_service(name)
    keys = list(results[0])
    return [f"kill -9 of a replica's app (one replica per service, {kills} services, each its group's first failure):",
            "  " + " · ".join(f"{k} {median([r[k] for r in results]):.2f} s median "
                              f"({min(r[k] for r in results):.2f}-{max(r[k] for r in results):.2f})" for k in keys)
            + " (goal ≤ 2 s to unroute)"]


def _worker_env(stack: BenchStack) -> dict[str, str]:
    """The supervised worker's environment, without its metrics port (one process per port)."""
    raw = Path(f"/proc/{supervised_worker(stack)}/environ").read_bytes().split(b"\0")
    env = dict(e.decode().split("=", 1) for e in raw if b"=" in e)
    env["DURASTACK_WORKER_METRICS_PORT"] = "0"
    return env


def supervised_worker(stack: BenchStack) -> Optional[int]:
    try:
        return json.loads((stack.home / "server.json").read_text())["children"]["worker"]["pid"]
    except (OSError, KeyError, ValueError, TypeError):
        return None


async def monitor_holders(stack: BenchStack, name: str) -> set[int]:
    """Pids of the workers watching the service's replicas (cli.inspect.watchers_of)."""
    client = await stack.temporal()
    return {int(w.split("@", 1)[0]) for w in await watchers_of(client, stack.settings.task_queue, name)}


def run_moves(stack: BenchStack, moves: int) -> list[str]:
    lines = []
    worker_log = open(stack.tmp / "worker2.log", "ab")
    second = subprocess.Popen([sys.executable, "-m", "worker"], cwd=ROOT, env=_worker_env(stack), stdout=worker_log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        until(lambda: b"worker polling" in (stack.tmp / "worker2.log").read_bytes(), 60, 0.1, "second worker up")
        for m in range(moves):
            name = f"lc-move-{m}"
            stack.check("apply", "-f", str(stack.write(f"{name}.yml", SERVICE.format(name=name, n=2))), "-y",
                        timeout=600)
            (holder,) = until(lambda: asyncio.run(monitor_holders(stack, name)), 60, 0.2, "a monitor running")
            which = "the second worker" if holder == second.pid else "the supervised worker"
            log(f"{name}: the monitor runs on {which} ({holder}); killing it")
            r = kill_and_follow(stack, name, 0, serve=False, before_kill=lambda: os.kill(holder, signal.SIGKILL))
            after = asyncio.run(monitor_holders(stack, name))
            log(f"{name}: " + ", ".join(f"{k} {v:.2f}s" for k, v in r.items()) + f"; monitor now on {after}")
            lines.append(f"  {name}: killed {which}; replica unrouted {r['unrouted']:.2f} s after both kills, "
                         f"replacement routed {r['replacement routed']:.2f} s (goal ≤ 30 s)")
            stack.stop_service(name)
            if holder == second.pid:
                break  # the second worker is gone: one more run would measure the supervised worker alone
    finally:
        if second.poll() is None:
            second.kill()
        second.wait(30)
        worker_log.close()
    return ["kill -9 of the worker running the service's monitor (two workers), then of a replica's app:", *lines]


# ---- 5. terminate and reset ---------------------------------------------------------------------------


def live_apps(stack: BenchStack, name: str) -> set[str]:
    """The work dirs (``group/rN-sM``) of ``name``'s replicas whose app runs."""
    prefix = f"{stack.home / 'replicas' / name}/"
    return {wd[len(prefix):] for wd in apps() if wd.startswith(prefix)}


async def _terminate(stack: BenchStack, name: str) -> None:
    client = await stack.temporal()
    await client.get_workflow_handle(service_workflow_id(name)).terminate(reason="the Web UI's button")


async def _reset_to_first_task(stack: BenchStack, name: str) -> None:
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.enums.v1 import EventType
    from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest

    client = await stack.temporal()
    handle = client.get_workflow_handle(service_workflow_id(name))
    first = next(e.event_id for e in (await handle.fetch_history()).events
                 if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    await client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
        namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id),
        reason="the Web UI's reset", workflow_task_finish_event_id=first, request_id=str(uuid.uuid4())))


def _left_after(stack: BenchStack, name: str, wait: float, settled) -> tuple[Optional[float], set[str], set[str]]:
    """Seconds until ``settled(apps, routed)`` (None: not within ``wait``), and what runs and is routed at
    ``wait`` seconds."""
    t0, took = time.monotonic(), None
    while time.monotonic() - t0 < wait:
        if took is None and settled(live_apps(stack, name), routes(stack, name) or set()):
            took = time.monotonic() - t0
        time.sleep(0.5)
    return took, live_apps(stack, name), routes(stack, name) or set()


def run_orphans(stack: BenchStack, n: int, wait: float) -> list[str]:
    """Terminate a service of ``n`` replicas as the Web UI's button does, and reset another to its first workflow
    task; what still runs or is routed ``wait`` s later."""
    lines = [f"terminate and reset of a service of {n} local replicas, what is left {wait:.0f} s later "
             "(goal: 0 within 60 s):"]
    for name, act in (("lc-terminated", _terminate), ("lc-reset", _reset_to_first_task)):
        stack.check("apply", "-f", str(stack.write(f"{name}.yml", SERVICE.format(name=name, n=n))), "-y", timeout=600)
        until(lambda: len(routes(stack, name) or ()) == n, 60, 0.1, f"{name}: {n} routed")
        asyncio.run(act(stack, name))
        if name == "lc-terminated":
            took, apps, routed = _left_after(stack, name, wait, lambda a, r: not a and not r)
            lines.append(f"  terminate: {len(apps)} replica(s) running and {len(routed)} routed after {wait:.0f} s; "
                         f"none after {took:.1f} s" if took is not None else "  terminate: not cleaned up")
        else:  # the reset's run serves again: one replica per slot, the old run's gone
            one_per_slot = lambda a, r: len(a) == n and len(r) == n and all(x.endswith("-s1") for x in a)  # noqa
            took, apps, routed = _left_after(stack, name, wait, one_per_slot)
            extra = len(apps) - n
            lines.append(f"  reset to the first task: {max(extra, 0)} replica(s) beyond one per slot running and "
                         f"{max(len(routed) - n, 0)} routed after {wait:.0f} s ({len(apps)} running, {len(routed)} "
                         f"routed); one per slot after {took:.1f} s" if took is not None else
                         f"  reset: not settled ({sorted(apps)} running, {sorted(routed)} routed)")
            stack.stop_service(name)
        log(lines[-1].strip())
    return lines


# ---- main --------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="durastack: the lean replica lifecycle's figures")
    p.add_argument("--history-replicas", type=int, default=4)
    p.add_argument("--apply-n", type=int, default=16)
    p.add_argument("--apply-repeat", type=int, default=2)
    p.add_argument("--own-repeat", type=int, default=3)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--moves", type=int, default=1)
    p.add_argument("--orphan-replicas", type=int, default=2)
    p.add_argument("--orphan-wait", type=float, default=60.0)
    p.add_argument("--skip", default="", help="Comma list of parts to skip: history, apply, kill, move, orphans.")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    started, load_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_note()
    figures: list[str] = []
    with BenchStack(keep=args.keep, log=log) as stack:
        if "history" not in skip:
            figures += run_history(stack, args.history_replicas)
        if "apply" not in skip:
            figures += run_apply(stack, args.apply_n, args.apply_repeat, args.own_repeat)
        if "kill" not in skip:
            figures += run_kills(stack, args.kills)
        if "move" not in skip:
            figures += run_moves(stack, args.moves)
        if "orphans" not in skip:
            figures += run_orphans(stack, args.orphan_replicas, args.orphan_wait)
    print(f"\n{started}, {code_note()}; {load_start} at the start, {load_avg()} at the end")
    print("\n".join(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
