"""Capture the workflow histories that tests/test_replay.py replays against the current workflow code.

Regenerate (about a minute; the time-skipping test server and the fakes of tests/fakes/cloud.py, nothing else):

    .venv/bin/python -m tests.histories.capture                # rewrites tests/histories/<scenario>.json
    .venv/bin/python -m tests.histories.capture --tag v2       # writes <scenario>.v2.json next to the old ones

Each scenario runs a representative service life and saves ``(await handle.fetch_history()).to_json()``:

* ``service_scale_crash_stop`` — start, scale a group up and down by hand, a replica crashes and is
  replaced, stop; with ``replica_crashed`` and ``replica_scaled_down``, the
  ReplicaWorkflow histories of the crashed replica and of one the scale-down stopped;
* ``service_rolling_rollback`` — a rolling update, a failed rollout (old replicas keep serving), rollback, stop;
* ``service_autoscale_hop.run1`` / ``.last`` — autoscaling on a traffic curve with a manual override, the
  first run (it ends in continue-as-new) and the last one (it ends with the stop);
* ``service_signalled_apply`` — an `apply` and a `scale` sent as signals and judged by the local activity,
  one refused signal, stop;
* ``service_taken_id`` — a replica whose workflow id is held by a workflow no run owns starts as its next
  submission; ``replica_untaken`` — a replica whose only backend no worker serves fails, nothing torn down;
* ``reaper_passes`` — the ReaperWorkflow: full passes, quick passes and a reconfiguration;
* ``service_idle_reuse`` — `idle_duration`: a scaled-down replica's instance taken by the next scale-up, one
  terminated past its idle time, one terminated by the stop; with ``replica_idle_taken`` and
  ``replica_idle_expired``, the ReplicaWorkflow histories of the replica whose instance was taken and of the one
  whose instance expired;
* ``service_fleet_watched`` / ``fleet_monitor`` — a service watched by the fleet monitor, a crash replaced through
  its signal, and the fleet monitor's history; ``service_fleet_missing`` — a service whose backend has no fleet
  monitor, watching on its own.

When to re-capture: while the workflow code is still young, after any change (this session); once services
run for real, only after an intentional change behind ``workflow.patched`` — and then with ``--tag``, keeping
the old files, so that the replay test proves old histories still replay (CONTRIBUTING.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from datetime import timedelta
from pathlib import Path
from typing import AsyncIterator, Optional

from temporalio.client import WorkflowExecutionStatus
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from activities import interface
from activities.interface import implements
from models.loader import load_config_text
from models.reaper import ReapAction, ReaperInput, ReapRequest, ReapResult, ReapTarget, ReplicaReapResult
from models.messages import ApplyRequest, FleetInput, ScaleRequest
from models.state import ServiceState
from models.views import ServiceStatus
from models.settings import SEARCH_ATTRIBUTES
from tests.conftest import DATA_CONVERTER, _time_skipping_env, eventually, last_run_result, run_histories, tool
from tests.fakes.cloud import FakeCloud, fake_cloud_worker
from tests.fakes.timeskip import ChildLocks
from rules import names
from rules.jobs import replica_input
from workflows.fleet import FleetMonitorWorkflow
from workflows.reaper import REAPER_ID, ReaperWorkflow
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

HERE = Path(__file__).resolve().parent

GROUPS = """
type: service
name: {name}
port: 8000
replicas:
  - name: router
    count: 1
    commands: [serve router]
  - name: decode
    count: 0..3
    scaling: {{metric: rps, target: 2}}
    commands: [serve decode]
"""
ROLLING = """
type: service
name: {name}
port: 8000
replicas:
  - name: a
    count: 2
    commands: ["{cmd}"]
  - name: b
    count: 1
    commands: [serve b]
"""


class Capture:
    def __init__(self, out: Path, tag: Optional[str]) -> None:
        self.out, self.tag = out, tag
        self.saved: list[tuple[str, int]] = []

    async def save(self, name: str, history) -> None:
        path = self.out / (f"{name}.{self.tag}.json" if self.tag else f"{name}.json")
        path.write_text(history.to_json() + "\n")
        self.saved.append((path.name, len(history.events)))


@contextlib.asynccontextmanager
async def fake_cloud() -> AsyncIterator[tuple[object, FakeCloud]]:
    """A test server of its own, a polling FakeCloud, and the lock keeper for replicas that outlive a hop."""
    env = await _time_skipping_env()
    try:
        async for cloud in fake_cloud_worker(env):
            cloud.polling = True
            async with ChildLocks(env, lambda: {f"service/{rid}" for rid, st in cloud.instances.items()
                                                if st == "terminated"}) as locks:
                yield env, cloud
            assert locks.error is None, locks.error
    finally:
        await env.shutdown()


@contextlib.asynccontextmanager
async def dev_cloud() -> AsyncIterator[tuple[object, FakeCloud]]:
    """The dev server of its own (a launch waiting for a worker times out in real time there; the test server
    never skips that wait), and a FakeCloud."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=tool("temporal"), ip="127.0.0.1", data_converter=DATA_CONVERTER,
        search_attributes=[SearchAttributeKey.for_keyword(n) for n in SEARCH_ATTRIBUTES])
    try:
        async for cloud in fake_cloud_worker(env):
            yield env, cloud
    finally:
        await env.shutdown()


async def start(env, cloud: FakeCloud, name: str, text: str, **kwargs):
    config = load_config_text(text.format(name=name, cmd="serve a")).config
    # Long heartbeat timeouts: skipped virtual time must not time out the fakes' real-time heartbeats.
    inp = ServiceRunInput(state=ServiceState(name=name, config=config), heartbeat_seconds=86400, **kwargs)
    return await env.client.start_workflow(ServiceRunWorkflow.run, inp, id=service_workflow_id(name),
                                           task_queue=cloud.queue)


async def settled(handle, counts: dict[str, int]) -> ServiceStatus:
    """Each group has its count of ready replicas on the current deployment, none in between states."""
    async def check() -> Optional[ServiceStatus]:
        status = await handle.query(ServiceRunWorkflow.status)
        for g in status.groups:
            ready = [r for r in g.replicas if r.ready and r.status == "running" and r.deployment == status.deployment]
            busy = [r for r in g.replicas if r.status in ("submitted", "provisioning", "terminating")]
            if len(ready) != counts.get(g.name, g.desired) or busy or g.rollout:
                return None
        return status
    return await eventually(check)


async def scale_crash_stop(capture: Capture) -> None:
    async with fake_cloud() as (env, cloud):
        name = "hist-scale"
        handle = await start(env, cloud, name, GROUPS)
        await settled(handle, {"router": 1, "decode": 0})
        await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=3))
        await settled(handle, {"decode": 3})
        await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=1))
        await settled(handle, {"decode": 1})
        scaled_down = next(rid for op, rid in cloud.log if op == "terminate")
        crashed = f"{name}/router/r0-s0"
        cloud.crash[crashed].set()
        await env.sleep(timedelta(minutes=3))  # the monitor's next poll; the first failure is replaced at once
        status = await settled(handle, {"router": 1, "decode": 1})
        assert status.groups[0].replicas[0].submission == 1, status
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await capture.save("service_scale_crash_stop", await handle.fetch_history())
        for saved_as, rid in (("replica_crashed", crashed), ("replica_scaled_down", scaled_down)):
            await capture.save(saved_as, await env.client.get_workflow_handle(f"service/{rid}").fetch_history())


async def rolling_rollback(capture: Capture) -> None:
    async with fake_cloud() as (env, cloud):
        name = "hist-rolling"

        def config(cmd: str) -> dict:
            return load_config_text(ROLLING.format(name=name, cmd=cmd)).config.model_dump(mode="json")

        handle = await start(env, cloud, name, ROLLING)
        await settled(handle, {"a": 2, "b": 1})
        await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config("serve a v2")))
        await settled(handle, {"a": 2, "b": 1})
        await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config("crash")))

        async def failed() -> bool:
            status = await handle.query(ServiceRunWorkflow.status)
            return status.groups[0].rollout.startswith("failed")
        await eventually(failed)
        await handle.execute_update(ServiceRunWorkflow.rollback)
        await settled(handle, {"a": 2, "b": 1})
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await capture.save("service_rolling_rollback", await handle.fetch_history())


async def autoscale_hop(capture: Capture) -> None:
    async with fake_cloud() as (env, cloud):
        name = "hist-autoscale"
        begin = await env.get_current_time()
        curve = [0, 1, 8, 8, 3, 0, 0]  # rps by hour since the start

        def traffic(t):
            hour = min(int((t - begin) // timedelta(hours=1)), len(curve) - 1)
            return float(curve[hour]), begin + timedelta(hours=hour + 1)
        cloud.traffic, cloud.clock, cloud.poll_every = traffic, env.get_current_time, timedelta(minutes=20)
        handle = await start(env, cloud, name, GROUPS, safety_tick_seconds=3600, history_limit=150)
        await env.sleep(timedelta(hours=1, minutes=30))
        # By hand against the autoscaler: held until the group's down-delay, then taken back.
        await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=3))
        await env.sleep(begin + timedelta(hours=len(curve)) - await env.get_current_time())
        await settled(handle, {"router": 1, "decode": 0})
        await handle.signal(ServiceRunWorkflow.stop)
        await last_run_result(env.client, handle.id)
        runs = await run_histories(env.client, handle.id)
        assert len(runs) >= 2, "expected a continue-as-new"
        await capture.save("service_autoscale_hop.run1", runs[0])
        await capture.save("service_autoscale_hop.last", runs[-1])


async def signalled_apply(capture: Capture) -> None:
    """A new configuration and a scale sent as signals (the Web UI's way), one refused signal, then stop."""
    async with fake_cloud() as (env, cloud):
        name = "hist-signals"
        handle = await start(env, cloud, name, GROUPS)
        await settled(handle, {"router": 1, "decode": 0})
        new = load_config_text(GROUPS.format(name=name).replace("serve router", "serve router v2")).config
        await handle.signal("apply", {"config": new.model_dump(mode="json")})
        await handle.signal("scale", {"group": "decode", "count": 2})
        await handle.signal("scale", {"group": "nope", "count": 2})

        async def judged() -> bool:
            events = await handle.query(ServiceRunWorkflow.events)
            return any(e.kind == "rejected" for e in events) and any(e.kind == "scale" for e in events)
        await eventually(judged)
        await settled(handle, {"router": 1, "decode": 2})
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await capture.save("service_signalled_apply", await handle.fetch_history())


async def taken_and_untaken(capture: Capture) -> None:
    """A replica whose workflow id a workflow no run owns holds (the next submission starts, `next-submission`),
    and one whose only backend no worker serves (its launch is given up, nothing torn down there,
    `untaken-made-nothing`)."""
    async with dev_cloud() as (env, cloud):
        name = "hist-taken"
        config = load_config_text(GROUPS.format(name=name)).config
        holder = await env.client.start_workflow(  # on a queue nobody serves: it stays open
            ReplicaWorkflow.run, replica_input(config, name, service_workflow_id(name), "router", 0, 0, 0),
            id=f"service/{name}/router/r0-s0", task_queue=f"{cloud.queue}-unserved")
        handle = await start(env, cloud, name, GROUPS)
        await settled(handle, {"router": 1, "decode": 0})
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await holder.terminate()
        await capture.save("service_taken_id", await handle.fetch_history())
        name = "hist-untaken"
        cloud.served = ["aws"]
        handle = await start(env, cloud, name, GROUPS, unserved_seconds=2)
        replica = env.client.get_workflow_handle(f"service/{name}/router/r0-s0")

        async def ended() -> bool:
            with contextlib.suppress(RPCError):  # not started yet
                return (await replica.describe()).status != WorkflowExecutionStatus.RUNNING
            return False
        await eventually(ended)
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await capture.save("replica_untaken", await replica.fetch_history())


async def reaper_passes(capture: Capture) -> None:
    """The reaper: two full passes (an orphan instance terminated on one target, the other target's worker away)
    with the replicas' pass (`reap-replicas`), quick passes between them (`reap-closed`), one of which stops a
    closed service's replica, and a reconfiguration that cuts an interval short."""
    env, queue = await _time_skipping_env(), "reaper-history"
    try:
        quick = iter([ReplicaReapResult(), ReplicaReapResult(stopped=["service/gone/web/r0-s0: closed"])])

        @implements(interface.reap_orphans)
        async def reap_orphans(req: ReapRequest) -> ReapResult:
            if "gcp" in req.backends:
                raise ApplicationError("no credentials for gcp here", non_retryable=True)
            return ReapResult(task_queue=queue, checked=2, terminated=[ReapAction(
                service="gone", backend="aws", instance_id="i-0abc", region="us-east-1", owner="r0-s0",
                reason="no replica owns it")])

        @implements(interface.reap_replicas)
        async def reap_replicas(grace_seconds: int) -> ReplicaReapResult:
            return ReplicaReapResult()

        @implements(interface.reap_closed)
        async def reap_closed() -> ReplicaReapResult:
            return next(quick, ReplicaReapResult())

        inp = ReaperInput(targets=[ReapTarget(task_queue=queue, backends=["aws"]),
                                   ReapTarget(task_queue=queue, backends=["gcp"])],
                          replicas_queue=queue, interval_seconds=120, grace_seconds=60, closed_seconds=30)
        async with Worker(env.client, task_queue=queue, workflows=[ReaperWorkflow],
                          activities=[reap_orphans, reap_replicas, reap_closed]):
            handle = await env.client.start_workflow(ReaperWorkflow.run, inp, id=REAPER_ID, task_queue=queue)
            await env.sleep(150)  # the first pass, its quick passes, the second pass
            await handle.signal(ReaperWorkflow.configure, inp.model_copy(update={"interval_seconds": 90}))
            await env.sleep(100)
            await handle.terminate("history captured")
            history = await handle.fetch_history()
            kinds = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                     if e.HasField("activity_task_scheduled_event_attributes")]
            assert {k: kinds.count(k) >= 2 for k in ("reap_orphans", "reap_replicas", "reap_closed")} \
                == dict.fromkeys(("reap_orphans", "reap_replicas", "reap_closed"), True), kinds
            await capture.save("reaper_passes", history)
    finally:
        await env.shutdown()


async def fleet_watched(capture: Capture) -> None:
    """Services watched by the fleet monitor (`fleet-monitor`): one whose replica crashes and is replaced through
    the fleet's signal, then stops; one on a backend with no fleet monitor, which watches on its own; and the fleet
    monitor's own history (its watch, the services' signals)."""
    async with dev_cloud() as (env, cloud):
        fleet = await env.client.start_workflow(
            FleetMonitorWorkflow.run, FleetInput(backend="local", query_seconds=0.5),
            id=names.fleet_workflow_id(cloud.queue, "local"), task_queue=cloud.queue)
        name = "hist-fleet"
        handle = await start(env, cloud, name, GROUPS, fleet_monitor=True)
        await settled(handle, {"router": 1, "decode": 0})
        crashed = f"{name}/router/r0-s0"
        await eventually(lambda: _watched(fleet, name))
        cloud.crash.setdefault(crashed, asyncio.Event()).set()
        await eventually(lambda: _replaced(handle))
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await capture.save("service_fleet_watched", await handle.fetch_history())
        await fleet.terminate("history captured")
        await capture.save("fleet_monitor", await fleet.fetch_history())
        name = "hist-no-fleet"
        handle = await start(env, cloud, name, GROUPS, fleet_monitor=True)
        await settled(handle, {"router": 1, "decode": 0})
        await eventually(lambda: _scheduled(handle, "monitor_replicas"))  # its own, once the fleet was not found
        await handle.signal(ServiceRunWorkflow.stop)
        await handle.result()
        await capture.save("service_fleet_missing", await handle.fetch_history())


async def _watched(fleet, service: str) -> bool:
    return any(w.service == service for w in (await fleet.query(FleetMonitorWorkflow.changes, 0)).watched)


async def _scheduled(handle, activity_type: str) -> bool:
    return any(e.activity_task_scheduled_event_attributes.activity_type.name == activity_type
               for e in (await handle.fetch_history()).events if e.HasField("activity_task_scheduled_event_attributes"))


async def _replaced(handle) -> bool:
    status = await handle.query(ServiceRunWorkflow.status)
    return any(r.submission == 1 and r.ready for g in status.groups for r in g.replicas)


async def idle_reuse(capture: Capture) -> None:
    async with fake_cloud() as (env, cloud):
        name = "hist-idle"
        handle = await start(env, cloud, name, GROUPS + "idle_duration: 10m\n")
        await settled(handle, {"router": 1, "decode": 0})
        for count in (2, 1, 2, 1):  # the second scale-up starts replica 2 on the instance replica 2 left idle
            await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=count))
            await settled(handle, {"decode": count})
        await eventually(lambda: _true(("reuse", f"{name}/decode/r2-s1") in cloud.log))
        await env.sleep(timedelta(minutes=11))  # r2-s1's instance, idle since the last scale-down, is terminated
        await eventually(lambda: _true(cloud.instances[f"{name}/decode/r2-s1"] == "terminated"))
        await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=0))
        await eventually(lambda: _true(cloud.instances[f"{name}/decode/r1-s0"] == "idle"))
        await handle.signal(ServiceRunWorkflow.stop)  # terminates r1-s0's idle instance before the run ends
        await handle.result()
        await capture.save("service_idle_reuse", await handle.fetch_history())
        for saved_as, rid in (("replica_idle_taken", "r2-s0"), ("replica_idle_expired", "r2-s1")):
            replica = env.client.get_workflow_handle(f"service/{name}/decode/{rid}")
            await replica.result()
            await capture.save(saved_as, await replica.fetch_history())


async def _true(value: bool) -> Optional[bool]:
    return value or None


SCENARIOS = [scale_crash_stop, rolling_rollback, autoscale_hop, signalled_apply, taken_and_untaken, reaper_passes,
             fleet_watched, idle_reuse]


async def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.histories.capture", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="Where the JSON files go (default: tests/histories).")
    parser.add_argument("--tag", help="Suffix for new files, keeping the old ones (e.g. the patch id).")
    parser.add_argument("--only", action="append", choices=[s.__name__ for s in SCENARIOS],
                        help="Run only this scenario (repeatable).")
    args = parser.parse_args(argv)
    capture = Capture(args.out, args.tag)
    for scenario in SCENARIOS:
        if args.only and scenario.__name__ not in args.only:
            continue
        await scenario(capture)
    for name, events in capture.saved:
        print(f"{events:5d} events  {args.out / name}")


if __name__ == "__main__":
    asyncio.run(main())
