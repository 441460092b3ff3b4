"""Scale out: one worker process holding N services (3 groups × 2 replicas) on a fake instant backend.

    .venv/bin/python -m bench.scale_out [--services 1000] [--settle 30] [--idle 60] [--poll 15]
                                        [--heartbeat S] [--tick S] [--cache N] [--timeout 3600] [--keep]

A Temporal dev server (the venv's `temporal`, headless, SQLite in a temp dir, free ports, the durastack search
attributes: `cli.stack.temporal_argv`) and one worker **subprocess**: the real ServiceRunWorkflow and
ReplicaWorkflow in the real `worker.main_worker` and `worker.backend_worker` (their slots and sticky cache), with
fake activities bound to the real stubs. Launch is instant but reports to the service as the real one does; each
monitor is the product's loop (`activities.watch.watch_until_down`) with a status check that costs nothing, polled
at the cloud backends' cadence (`--poll`); `record_service` keeps rows in memory. Fixed counts, no autoscaling, so no stats watchers.
Measured from /proc/<pid>:

* start: the N services submitted (as `durastack apply` does), until monitors watch all 6N replicas and
  every service's `status` query answers with all replicas ready; CPU used by the worker and by Temporal;
* idle: RSS and CPU of the worker process over --idle seconds, after --settle seconds (and per service);
* restart: SIGKILL the worker, start a new one: time until every service's `status` answers all ready and
  every replica is watched again in the new process; then idle again.

Everything it started is stopped by PID at the end (the services are not stopped: their Temporal server and
its database go with the temp dir, which is removed unless --keep or on failure).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import httpx
from temporalio import activity
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from activities import interface
from activities.fleet import FleetWatch, closed_workflows
from activities.interface import implements
from activities.report import FINISHED, PROVISIONED, PROVISIONING, SERVING, TERMINATING, report
from activities.signals import judge_signal
from activities.watch import watch_until_down
from bench.stack import code_note, free_port, load_avg, load_note
from connect.codec import KEY_ENV, ensure_key_file
from connect.connection import client_options
from models.loader import load_config_text
from models.replica import LocalInstance
from models.messages import (Down, FleetInput, Launched, LaunchInput, MonitorInput, RouteInput, ServiceRecord,
    TeardownInput)
from models.state import Placement, ServiceState
from models.settings import Settings
from rules.names import backend_queue

GROUPS, PER_GROUP = ("router", "prefill", "decode"), 2
FLEET = 0  # InstantBackend.watching's key of the fleet watch
SERVICE = "type: service\nname: {name}\nport: 8000\nreplicas:\n" + "".join(
    f"  - name: {g}\n    count: {PER_GROUP}\n    commands: [python3 -m http.server 8000]\n" for g in GROUPS)
QUERY_CONCURRENCY = 16
START_CONCURRENCY = 16


def cloud_poll_seconds() -> float:
    """How often a cloud replica's monitor reads its instance (CloudReplicas' default)."""
    from activities.replica_cloud import CloudReplicas

    return inspect.signature(CloudReplicas).parameters["poll_seconds"].default


# ---- the worker subprocess ----------------------------------------------------------------------


class InstantBackend:
    """Replica activities that take no time but report as the real ones do; the monitor blocks and heartbeats
    like the real one."""

    def __init__(self, poll_seconds: float) -> None:
        self.poll_seconds = poll_seconds
        self.watching: dict[int, int] = {}  # monitor → replicas it watches
        self.watch_starts = 0
        self.rows: dict[str, int] = {}

    def activities(self) -> list:
        """The main queue's (with the product's own judge of the start, which does no I/O)."""
        return [self.ensure_route, self.remove_route, self.record, self.served_backends, judge_signal]

    def replica_activities(self) -> list:
        """``<queue>-local``'s."""
        return [self.place, self.teardown, self.monitor, self.watch_fleet]

    @implements(interface.place_replica)
    async def place(self, inp: LaunchInput) -> Launched:
        """The whole launch in its first step, as the local backend's (``one_activity``)."""
        r, rid = inp.replica, inp.replica.job.replica_id
        await report(r.service_workflow_id, r.job, PROVISIONING, "provisioning")
        placement = Placement(backend="local", region="local", instance_type="instant",
                              address=f"unix:/nonexistent/{rid}.sock")
        instance = LocalInstance(replica_id=rid, pid=0, start_time=0, work_dir="/nonexistent",
                                 address=placement.address, isolated=False, log_path="/nonexistent/log")
        await report(r.service_workflow_id, r.job, PROVISIONED, "running", placement=placement, instance=instance)
        await report(r.service_workflow_id, r.job, SERVING, "running", ready=True, registered=True,
                     placement=placement, instance=instance)
        return Launched(placement=placement, instance=instance, done="serving")

    @implements(interface.monitor_replicas)
    async def monitor(self, inp: MonitorInput) -> list[Down]:
        """A service's own monitor: the product's loop, an instance check that costs nothing, and the product's
        describe of each replica workflow every ``workflow_check_seconds``."""
        key = id(inp)
        self.watching[key] = len(inp.replicas)
        self.watch_starts += 1
        described = time.monotonic()

        async def check() -> Optional[list[Down]]:
            nonlocal described
            if time.monotonic() - described >= inp.workflow_check_seconds:
                described = time.monotonic()
                return await closed_workflows(activity.client(), inp.replicas) or None
            return None

        try:
            return await watch_until_down(check, min(self.poll_seconds, inp.workflow_check_seconds))
        finally:
            self.watching.pop(key, None)

    @implements(interface.watch_fleet)
    async def watch_fleet(self, inp: FleetInput) -> None:
        """The product's fleet watch (activities/fleet.py) over instances that never go down."""
        self.watch_starts += 1
        try:
            await FleetWatch(inp, self, self, activity.client(), activity.info().workflow_id).run()
        finally:
            self.watching.pop(FLEET, None)

    @property
    def min_poll_seconds(self) -> float:
        return self.poll_seconds

    async def adopt(self, service: str, watched: list) -> None:
        """The fleet watch's take-up after a restart: nothing is held for a replica here."""

    async def down(self, instances: list) -> list[Optional[str]]:
        """The fleet watch's instance check: it costs nothing; counts what is watched."""
        self.watching[FLEET] = len(instances)
        return [None] * len(instances)

    async def unregister(self, service: str, replica_id: str) -> None:
        return None

    @implements(interface.teardown_replica)
    async def teardown(self, inp: TeardownInput) -> None:
        await report(inp.service_workflow_id, inp.job, TERMINATING, "terminating", reason=inp.reason)
        await report(inp.service_workflow_id, inp.job, FINISHED, inp.final, reason=inp.reason)

    @implements(interface.ensure_route)
    async def ensure_route(self, inp: RouteInput) -> None:
        return None

    @implements(interface.remove_route)
    async def remove_route(self, inp: RouteInput) -> None:
        return None

    @implements(interface.record_service)
    async def record(self, rec: ServiceRecord) -> None:
        self.rows[rec.service] = len(rec.events)

    @implements(interface.served_backends)
    async def served_backends(self) -> list[str]:
        return ["local"]


async def run_worker(address: str, task_queue: str, metrics_port: int, poll: float, state: Path,
                     cache: Optional[int] = None) -> None:
    """The worker process: worker.main_worker with the instant backend (its sticky cache ``cache`` runs if given),
    until SIGTERM/SIGINT.

    Writes {"pid", "polling", "watching", "watch_starts"} to ``state`` (atomically) when it changes.
    """
    import worker

    if cache is not None:
        worker.MAX_CACHED_WORKFLOWS = cache

    settings = Settings.from_env(environ={}, home=state.parent, temporal_address=address, task_queue=task_queue,
                                 worker_metrics_port=metrics_port)
    client = await worker.connect(settings)
    backend = InstantBackend(poll)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    last = None
    async with worker.main_worker(client, settings.task_queue, backend.activities()), \
            worker.backend_worker(client, backend_queue(settings.task_queue, "local"), backend.replica_activities()):
        while not stop.is_set():
            now = {"pid": os.getpid(), "polling": True, "watching": sum(backend.watching.values()),
                   "watch_starts": backend.watch_starts}
            if now != last:
                tmp = state.with_suffix(".tmp")
                tmp.write_text(json.dumps(now))
                tmp.replace(state)
                last = now
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except asyncio.TimeoutError:
                pass


# ---- processes ----------------------------------------------------------------------------------


class Proc:
    """A child we started in its own session; stopped by its PID (SIGTERM, then SIGKILL to its group)."""

    def __init__(self, argv: list[str], log: Path, env: Optional[dict] = None):
        self.log = open(log, "ab")
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True)
        self.pid = self.popen.pid

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.popen.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait(30)

    def stop(self, grace: float = 20.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(30)
        self.log.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int, key: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def worker_metrics(port: int) -> dict[str, float]:
    """Counters of the worker's Prometheus endpoint (worker.metrics_runtime): workflow tasks run and the
    milliseconds they took, per workflow type, sticky cache misses, and heartbeats sent to the server."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("temporal_workflow_task_execution_latency_"):
            kind = "ms" if "_sum{" in name else "n" if "_count{" in name else None
            wf = name.split('workflow_type="', 1)[-1].split('"', 1)[0]
            if kind:
                out[f"{wf} {kind}"] = out.get(f"{wf} {kind}", 0) + float(value)
        elif name.startswith("temporal_request{") and 'operation="RecordActivityTaskHeartbeat"' in name:
            out["heartbeats"] = float(value)
        elif name.startswith("temporal_sticky_cache_miss{"):
            out["misses"] = out.get("misses", 0) + float(value)
    return out


def idle_work(before: dict[str, float], after: dict[str, float], seconds: float) -> str:
    """What the worker did while idle: workflow tasks per minute (and their mean ms), those that missed the sticky
    cache (each replayed its run's history), heartbeats per second."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    tasks = [f"{wf} {60 * d[f'{wf} n'] / seconds:.0f}/min ({d[f'{wf} ms'] / d[f'{wf} n']:.0f} ms)"
             for wf in ("ServiceRunWorkflow", "ReplicaWorkflow") if d.get(f"{wf} n")]
    return (f"workflow tasks: {', '.join(tasks) or 'none'}, replayed (not cached) {60 * d.get('misses', 0) / seconds:.0f}"
            f"/min; heartbeats sent {d.get('heartbeats', 0) / seconds:.1f}/s")


async def sample(pid: int, seconds: float) -> tuple[float, float]:
    """(CPU % of one core over ``seconds``, RSS MiB at the end)."""
    c0, t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return 100 * (cpu_seconds(pid) - c0) / (time.monotonic() - t0), rss_mib(pid)


# ---- the bench ----------------------------------------------------------------------------------


class Bench:
    def __init__(self, tmp: Path, services: int, poll: float, log, inputs: Optional[dict] = None,
                 cache: Optional[int] = None):
        self.tmp, self.n, self.poll, self.log, self.cache = tmp, services, poll, log, cache
        self.inputs = inputs or {}  # ServiceRunInput's fields for every service (None: its default)
        self.home = tmp / "home"
        self.home.mkdir()
        self.settings = Settings(home=self.home, temporal_port=free_port(), ui_port=free_port(), codec_port=0,
                                 worker_metrics_port=free_port(), task_queue="scale-out")
        ensure_key_file(self.home)  # the codec key the worker and this client share
        self.state = self.home / "worker.json"
        self.temporal: Optional[Proc] = None
        self.worker: Optional[Proc] = None
        self.client: Optional[Client] = None
        self.names = [f"svc-{i:04d}" for i in range(services)]

    # -- processes

    async def start_temporal(self, timeout: float = 60.0) -> None:
        from cli.stack import ensure_search_attributes, temporal_argv

        argv = temporal_argv(self.settings) + ["--headless"]
        self.temporal = Proc(argv, self.tmp / "temporal.log")
        self.log(f"temporal pid {self.temporal.pid} on {self.settings.address}")
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client = await asyncio.wait_for(Client.connect(**client_options(self.settings)), 3)
                await asyncio.wait_for(ensure_search_attributes(self.client, self.settings.namespace), 5)
                return
            except Exception:
                if self.temporal.popen.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"temporal did not start; see {self.tmp / 'temporal.log'}")
                await asyncio.sleep(0.5)

    async def start_worker(self, timeout: float = 60.0) -> float:
        """A new worker process; seconds until it polls."""
        self.state.unlink(missing_ok=True)
        t0 = time.monotonic()
        # The worker shares this process's codec key (the variable, else the home's file); no other setting.
        env = {k: v for k, v in os.environ.items() if not k.startswith("DURASTACK_") or k == KEY_ENV}
        self.worker = Proc([sys.executable, "-m", "bench.scale_out", "--as-worker", str(self.state),
                            "--address", self.settings.address, "--task-queue", self.settings.task_queue,
                            "--metrics-port", str(self.settings.worker_metrics_port), "--poll", str(self.poll)]
                           + (["--cache", str(self.cache)] if self.cache is not None else []),
                           self.tmp / "worker.log", env=env)
        await self.until(lambda: self.worker_state().get("pid") == self.worker.pid, timeout, "worker polling")
        return time.monotonic() - t0

    def worker_state(self) -> dict:
        if self.worker is not None and self.worker.popen.poll() is not None:
            raise RuntimeError(f"the worker exited with {self.worker.popen.returncode}; see {self.tmp / 'worker.log'}")
        try:
            return json.loads(self.state.read_text())
        except (OSError, ValueError):
            return {}

    def close(self, keep: bool) -> None:
        for proc in (self.worker, self.temporal):
            if proc is not None:
                proc.stop()
        if keep:
            self.log(f"kept {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    @staticmethod
    async def until(check, timeout: float, what: str, interval: float = 0.2) -> float:
        t0 = time.monotonic()
        while not check():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{what}: not within {timeout:g}s")
            await asyncio.sleep(interval)
        return time.monotonic() - t0

    # -- services

    async def submit(self) -> None:
        from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

        sem = asyncio.Semaphore(START_CONCURRENCY)
        extra = {k: v for k, v in self.inputs.items() if v is not None}

        async def one(name: str) -> None:
            config = load_config_text(SERVICE.format(name=name)).config
            async with sem:
                await self.client.start_workflow(
                    ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config), **extra),
                    id=service_workflow_id(name), task_queue=self.settings.task_queue,
                    id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, static_summary=f"service **{name}**")

        await asyncio.gather(*(one(n) for n in self.names))

    async def all_ready(self, timeout: float) -> float:
        """Seconds until every service's `status` query answers with all 6 replicas ready and running."""
        from workflows.service import ServiceRunWorkflow, service_workflow_id

        t0, pending = time.monotonic(), set(self.names)
        sem = asyncio.Semaphore(QUERY_CONCURRENCY)

        async def one(name: str) -> None:
            async with sem:
                try:
                    status = await self.client.get_workflow_handle(service_workflow_id(name)).query(
                        ServiceRunWorkflow.status, rpc_timeout=timedelta(seconds=10))
                except Exception:  # no worker yet, or a slow replay: asked again
                    return
            ready = sum(1 for g in status.groups for r in g.replicas if r.ready and r.status == "running")
            if ready == len(GROUPS) * PER_GROUP:
                pending.discard(name)

        while pending:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{len(pending)} services not all ready within {timeout:g}s")
            await asyncio.gather(*(one(n) for n in sorted(pending)))
            if pending:
                await asyncio.sleep(0.5)
        return time.monotonic() - t0

    async def watches(self, t0: float, timeout: float, what: str) -> float:
        """Seconds from t0 until the current worker runs all 6N watches; progress every 10 s."""
        want, last_note = self.n * len(GROUPS) * PER_GROUP, time.monotonic()
        while (got := self.worker_state().get("watching", 0)) < want:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"{what}: {got} of {want} watches within {timeout:g}s")
            if time.monotonic() - last_note > 10:
                self.log(f"  {what}: {got}/{want} watches after {time.monotonic() - t0:.0f}s")
                last_note = time.monotonic()
            await asyncio.sleep(0.2)
        return time.monotonic() - t0


async def bench(args, log) -> list[str]:
    tmp = Path(tempfile.mkdtemp(prefix="dsbench-scale-"))
    b = Bench(tmp, args.services, args.poll, log, {"heartbeat_seconds": args.heartbeat, "safety_tick_seconds": args.tick,
                                                   "fleet_monitor": not args.own_monitors}, args.cache)
    ok = False
    n, replicas = args.services, args.services * len(GROUPS) * PER_GROUP
    out = [f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {code_note()}; {load_note()} at the start"]
    try:
        await b.start_temporal()
        t_poll = await b.start_worker()
        if not args.own_monitors:  # as the worker does at its start
            import worker

            await worker.start_fleet_monitors(b.client, b.settings, [backend_queue(b.settings.task_queue, "local")])
        await asyncio.sleep(5)
        cpu0, rss0 = await sample(b.worker.pid, 10)
        log(f"worker pid {b.worker.pid} polling after {t_poll:.1f}s; empty: {rss0:.0f} MiB, {cpu0:.1f}% CPU")

        t0, w0, s0 = time.monotonic(), cpu_seconds(b.worker.pid), cpu_seconds(b.temporal.pid)
        await b.submit()
        t_submit = time.monotonic() - t0
        log(f"{n} services submitted in {t_submit:.1f}s")
        t_watch = await b.watches(t0, args.timeout, "start")
        t_ready = t_watch + await b.all_ready(args.timeout)
        w_start, s_start = cpu_seconds(b.worker.pid) - w0, cpu_seconds(b.temporal.pid) - s0
        log(f"start: all {replicas} watches at {t_watch:.1f}s, all status ready at {t_ready:.1f}s")

        await asyncio.sleep(args.settle)
        m0 = worker_metrics(b.settings.worker_metrics_port)
        (cpu, rss), (tcpu, trss) = await asyncio.gather(sample(b.worker.pid, args.idle),
                                                        sample(b.temporal.pid, args.idle))
        work = idle_work(m0, worker_metrics(b.settings.worker_metrics_port), args.idle)
        log(f"idle: worker {rss:.0f} MiB, {cpu:.1f}% CPU ({work}); temporal {trss:.0f} MiB, {tcpu:.1f}% CPU")

        t0 = time.monotonic()
        b.worker.kill()
        t_new = await b.start_worker()
        ready_task = asyncio.ensure_future(b.all_ready(args.timeout))
        t_rewatch = await b.watches(t0, args.timeout, "restart")
        t_reready = await ready_task + t_new
        log(f"restart: new worker polling at {t_new:.1f}s, all status ready at {t_reready:.1f}s, "
            f"all watches at {t_rewatch:.1f}s")
        await asyncio.sleep(args.settle)
        m0 = worker_metrics(b.settings.worker_metrics_port)
        cpu2, rss2 = await sample(b.worker.pid, args.idle)
        work2 = idle_work(m0, worker_metrics(b.settings.worker_metrics_port), args.idle)
        log(f"idle after restart: worker {rss2:.0f} MiB, {cpu2:.1f}% CPU ({work2})")
        ok = True
    finally:
        b.close(keep=args.keep or not ok)
    import worker
    from workflows.service import ServiceRunInput

    fields = ServiceRunInput.model_fields
    inp = {k: b.inputs.get(k) or fields[k].default for k in ("heartbeat_seconds", "safety_tick_seconds")}
    out += [
        f"scale out: {n} services × {len(GROUPS)} groups × {PER_GROUP} replicas = {replicas} replica workflows in "
        f"one worker process, instant fake backend ("
        f"{'each service its own monitor' if args.own_monitors else 'one fleet monitor'}, polling every "
        f"{args.poll:g} s; services' heartbeat timeout {inp['heartbeat_seconds']} s, safety tick {inp['safety_tick_seconds']} s; "
        f"worker: {worker.MAX_ACTIVITIES} activity slots, sticky cache {args.cache or worker.MAX_CACHED_WORKFLOWS}); "
        f"load avg (1 min) {load_avg()} at the end",
        f"  empty worker            {rss0:6.0f} MiB RSS  {cpu0:5.1f} % of one core",
        f"  start                   submitted {t_submit:.1f} s · all watches {t_watch:.1f} s · all status ready "
        f"{t_ready:.1f} s ({n / t_ready:.2f} services/s); CPU used: worker {w_start:.0f} s, Temporal {s_start:.0f} s",
        f"  idle ({args.idle:g} s)           {rss:6.0f} MiB RSS  {cpu:5.1f} % of one core   per service: "
        f"{1024 * (rss - rss0) / n:.0f} KiB above empty, {cpu / n:.4f} % of a core",
        f"                          {work}",
        f"  restart (SIGKILL)       new worker polling {t_new:.1f} s · all status ready {t_reready:.1f} s · "
        f"all watches running again {t_rewatch:.1f} s → reconciled in {max(t_rewatch, t_reready):.1f} s",
        f"  idle after restart      {rss2:6.0f} MiB RSS  {cpu2:5.1f} % of one core   ({work2})",
        f"  Temporal dev server     {trss:6.0f} MiB RSS  {tcpu:5.1f} % of one core at idle (the same {args.idle:g} s)",
        "  goal for 1,000 services at idle: the worker ≤ 512 MiB RSS and ≤ 5 % of one core, Temporal ≤ 10 %",
    ]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--services", type=int, default=1000, help="Services (each 3 groups × 2 replicas); default 1000.")
    p.add_argument("--settle", type=float, default=30, help="Seconds after all ready before measuring idle.")
    p.add_argument("--idle", type=float, default=60, help="Seconds of idle measurement.")
    p.add_argument("--timeout", type=float, default=3600, help="Bound on each wait (start, restart).")
    p.add_argument("--poll", type=float, default=cloud_poll_seconds(),
                   help="Seconds between the fake watch's status checks (default: the cloud backends' cadence).")
    p.add_argument("--heartbeat", type=int, help="ServiceRunInput.heartbeat_seconds, the monitors' too "
                                                  "(default: its default).")
    p.add_argument("--tick", type=int, help="ServiceRunInput.safety_tick_seconds (default: its default).")
    p.add_argument("--cache", type=int, help="The worker's sticky cache, in runs (default: worker.MAX_CACHED_WORKFLOWS).")
    p.add_argument("--own-monitors", action="store_true",
                   help="Each service watches its replicas with a monitor of its own, not the fleet monitor.")
    p.add_argument("--keep", action="store_true", help="Keep the temp dir (logs, temporal.db).")
    p.add_argument("--as-worker", metavar="STATE", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--task-queue", help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_worker:
        asyncio.run(run_worker(args.address, args.task_queue, args.metrics_port, args.poll, Path(args.as_worker),
                               args.cache))
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    print("\n".join(asyncio.run(bench(args, log))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
