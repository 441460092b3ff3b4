"""Control-plane overhead: from `durastack apply` to all N replicas ready, minus the replicas' own start time.

    .venv/bin/python -m bench.control_plane [--replicas 1,4,16] [--repeat 3] [--own-repeat 5]

For each N, one service with one group of N fixed replicas, each `python3 -m http.server 8000` (cpu: 1,
memory: 1GB..). Per run:

* T_ready: from invoking `durastack apply -y -f FILE` (blocking, no --detach) to the moment the
  service workflow has all N replicas ready and running, i.e. what `durastack ps NAME --json` would
  show from then on. Read afterwards from the Temporal histories (the completion of the workflow task
  that handled the last "ready" report), so no polling CLI competes for the 2 CPUs during the run.
* T_apply: wall time of that `apply` command, which returns once it sees every replica ready; it
  polls every 0.5 s and includes the CLI's own start and exit (what a user waits for).
* own(N): the same command started N times at once directly (no durastack; python3 from the
  backend's PATH, a free 127.0.0.1 port) until all N answer HTTP 200, median of --own-repeat tries.
* overhead = T_ready - own(N) (and T_apply - own(N)). See bench/README.md for why.

After each run the service is stopped with `durastack stop NAME -y`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

from bench.stack import (BASE_PATH, BenchStack, code_note, cpu_spent, free_port, load_avg, load_note, median,
                         ready_replicas, replica_python, stack_cpu)
from activities.report import SERVING
from rules import names

SERVICE = """\
type: service
name: {name}
port: 8000
replicas:
  - name: app
    count: {n}
    commands: [python3 -m http.server 8000]
    resources: {{cpu: 1, memory: 1GB..}}
"""

# ---- the replicas' own start time ----------------------------------------------------------------


def _answers_200(port: int) -> Optional[bool]:
    """True on an HTTP 200 from 127.0.0.1:port, None while nothing listens there."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            head = b""
            while b"\r\n" not in head:
                chunk = s.recv(256)
                if not chunk:
                    break
                head += chunk
    except OSError:
        return None
    return head.split(b" ", 2)[1:2] == [b"200"]


def own_start(n: int, poll: float = 0.005, timeout: float = 60.0) -> float:
    """Seconds from spawning n copies of the replica command at once until all n answered HTTP 200."""
    python = replica_python()
    cwd = tempfile.mkdtemp(prefix="dsbench-own-")  # a small directory, like a replica's work dir
    env = {"PATH": BASE_PATH, "HOME": os.environ.get("HOME", "/"), "LANG": "C.UTF-8"}
    procs: dict[int, subprocess.Popen] = {}
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            port = free_port()
            procs[port] = subprocess.Popen([python, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                           cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pending = set(procs)
        while pending:
            for port in list(pending):
                if _answers_200(port):
                    pending.discard(port)
                elif procs[port].poll() is not None:
                    raise RuntimeError(f"{python} -m http.server {port} exited with {procs[port].returncode}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{len(pending)} of {n} servers did not answer within {timeout}s")
            if pending:
                time.sleep(poll)
        return time.perf_counter() - t0
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(cwd, ignore_errors=True)


# ---- reading the histories -----------------------------------------------------------------------


@dataclass
class Run:
    n: int
    name: str
    t_apply: float  # wall time of the blocking `apply`
    t_ready: float  # apply invoked -> service workflow has all n ready (what ps shows)
    phases: dict[str, float] = field(default_factory=dict)  # seconds after apply invoked
    t_stop: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds each part of the stack spent on the apply


def _events(history) -> list[tuple[int, float, str, object]]:
    out = []
    for e in history.events:
        kind = e.WhichOneof("attributes")
        out.append((e.event_id, e.event_time.seconds + e.event_time.nanos / 1e9, kind, getattr(e, kind)))
    return out


def _activities_done(events) -> dict[str, float]:
    """Activity name -> completion time (the last completion of that name)."""
    scheduled = {eid: a.activity_type.name for eid, _, kind, a in events
                 if kind == "activity_task_scheduled_event_attributes"}
    return {scheduled[a.scheduled_event_id]: t for _, t, kind, a in events
            if kind == "activity_task_completed_event_attributes"}


async def phases(stack: BenchStack, name: str, n: int, t0: float) -> dict[str, float]:
    """Milestones of one apply, in seconds after t0 (wall clock), from the service's history."""
    client = await stack.temporal()
    svc = _events(await client.get_workflow_handle(f"service/{name}").fetch_history())
    out = {"submitted": next(t for _, t, k, _ in svc if k == "workflow_execution_started_event_attributes") - t0}
    out["route"] = _activities_done(svc)[names.ENSURE_ROUTE] - t0
    out["children"] = max(t for _, t, k, _ in svc if k == "child_workflow_execution_started_event_attributes") - t0
    # The launch activity reports its milestones to the service by signal (activities/report.py): the last
    # replica's "serving" (probes passed, registered) report. (A replica ready within a second sends no
    # "provisioned" report before it.)
    reports = [(t, json.loads(a.input.payloads[0].data)) for _, t, k, a in svc
               if k == "workflow_execution_signaled_event_attributes" and a.signal_name == "replica_changed"]
    out["registered"] = max(t for t, u in reports if u.get("seq") == SERVING) - t0
    # The service workflow knows all n are ready once the workflow task that handled the last ready report ends.
    ready: set[int] = set()
    last_signal = None
    for eid, _, kind, a in svc:
        if kind == "workflow_execution_signaled_event_attributes" and a.signal_name == "replica_changed":
            update = json.loads(a.input.payloads[0].data)
            if update["ready"] and update["status"] == "running":
                ready.add(update["replica_num"])
                if len(ready) == n:
                    last_signal = eid
                    break
    if last_signal is None:
        raise RuntimeError(f"{name}: the history shows {len(ready)} of {n} replicas ready")
    out["ready"] = next(t for eid, t, k, _ in svc
                        if eid > last_signal and k == "workflow_task_completed_event_attributes") - t0
    return out


# ---- one run -------------------------------------------------------------------------------------


def run_once(stack: BenchStack, n: int, i: int) -> Run:
    name = f"cp-n{n}-{i}"
    path = stack.write(f"{name}.yml", SERVICE.format(name=name, n=n))
    cpu0 = stack_cpu(stack.home)
    t0 = time.time()
    result = stack.cli("apply", "-f", str(path), "-y", timeout=600)
    t_apply = time.time() - t0
    cpu = cpu_spent(cpu0, stack_cpu(stack.home))
    if result.returncode != 0:
        raise RuntimeError(f"apply {name} exited {result.returncode}:\n{result.stdout}{result.stderr}")
    status = stack.ps(name)
    if ready_replicas(status) != n:  # `apply` returned, so `ps --json` must show all n ready
        raise RuntimeError(f"{name}: apply returned but ps shows {ready_replicas(status)} of {n} ready")
    ph = asyncio.run(phases(stack, name, n, t0))
    t = time.time()
    stack.stop_service(name)
    return Run(n=n, name=name, t_apply=t_apply, t_ready=ph["ready"], phases=ph, t_stop=time.time() - t, cpu=cpu)


# ---- main ----------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return f"{x:6.2f}"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description="durastack control-plane overhead (apply -> all replicas ready)")
    p.add_argument("--replicas", default="1,4,16", help="Comma-separated replica counts (default 1,4,16).")
    p.add_argument("--repeat", type=int, default=3, help="Runs per replica count (default 3).")
    p.add_argument("--own-repeat", type=int, default=5, help="Tries of the direct start per count (default 5).")
    p.add_argument("--keep", action="store_true", help="Keep the temp home (logs, histories are in Temporal's db).")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.replicas.split(",") if x.strip()]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    started, load_start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_note()
    log(f"replica command: {replica_python()} -m http.server 8000; {load_note()}")
    own = {}
    for n in sorted(set(counts) | {1}):
        tries = [own_start(n) for _ in range(args.own_repeat)]
        own[n] = median(tries)
        log(f"own start, {n} at once: median {own[n]:.3f}s  (tries {', '.join(f'{x:.3f}' for x in tries)})")

    runs: list[Run] = []
    with BenchStack(keep=args.keep, log=log) as stack:
        for i in range(args.repeat):  # round-robin over the counts, so slow drift hits every N alike
            for n in counts:
                r = run_once(stack, n, i)
                runs.append(r)
                log(f"{r.name}: T_ready {r.t_ready:.2f}s  T_apply {r.t_apply:.2f}s  stop {r.t_stop:.2f}s  "
                    + " ".join(f"{k}={v:.2f}" for k, v in r.phases.items()))
    log(f"done; {load_note()}")

    print(f"\n{started}, {code_note()}; {load_start} at the start, {load_avg()} at the end")
    print(f"control plane: apply -> all N replicas ready (seconds; {args.repeat} runs per N; own = median "
          f"start-to-200 of N direct starts at once; overhead = T - own)")
    print(f"{'N':>3} {'own':>6} | {'T_ready':>13} {'overhead':>13} | {'T_apply':>13} {'overhead':>13}")
    print((f"{'':>3} {'':>6} | " + f"{'med':>6} {'max':>6} " * 2 + "| " + f"{'med':>6} {'max':>6} " * 2).rstrip())
    for n in counts:
        rs = [r for r in runs if r.n == n]
        ready = [r.t_ready for r in rs]
        applied = [r.t_apply for r in rs]
        print(f"{n:>3} {_fmt(own[n])} | {_fmt(median(ready))} {_fmt(max(ready))} "
              f"{_fmt(median(ready) - own[n])} {_fmt(max(ready) - own[n])} | "
              f"{_fmt(median(applied))} {_fmt(max(applied))} "
              f"{_fmt(median(applied) - own[n])} {_fmt(max(applied) - own[n])}")
    for n in counts:
        ready = [r.t_ready for r in runs if r.n == n]
        print(f"N={n}: durastack adds {median(ready) - own[n]:.2f} s (median; max {max(ready) - own[n]:.2f} s) beyond "
              f"the replicas' own start of {own[n]:.2f} s" + (" (goal ≤ 1.5 s)" if n == 16 else ""))
    keys = ["submitted", "route", "children", "registered", "ready"]
    print("\nmilestones, median seconds after `apply` was invoked (last replica for registered)")
    print(f"{'N':>3} " + " ".join(f"{k:>10}" for k in keys) + f" {'stop':>10}")
    for n in counts:
        rs = [r for r in runs if r.n == n]
        print(f"{n:>3} " + " ".join(f"{median([r.phases[k] for r in rs]):>10.2f}" for k in keys)
              + f" {median([r.t_stop for r in rs]):>10.2f}")
    print(f"\nCPU seconds the stack spent on one apply (median; the blocking CLI, until all ready; {os.cpu_count()} "
          "CPUs: at best wall = total / CPUs)")
    for n in counts:
        rs = [r for r in runs if r.n == n]
        spent = {k: median([r.cpu[k] for r in rs]) for k in rs[0].cpu}
        print(f"N={n}: total {median([sum(r.cpu.values()) for r in rs]):.2f} s: "
              + ", ".join(f"{k} {v:.2f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
