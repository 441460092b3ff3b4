"""The fleet monitor (workflows/fleet.py, activities/fleet.py) on the dev server: one activity watches every
service's serving replicas on a backend; a service without one watches on its own.

The fleet watch here is the real one over FakeCloud (a crashed instance is down); its queries, its signals to
the services and its visibility listing of closed replica workflows go to the real dev server."""

from __future__ import annotations

import asyncio

import pytest

from models.replica import LocalInstance
from models.messages import FleetChanges, FleetInput, MonitorInput, Watched
from tests.conftest import eventually
from tests.fakes.cloud import fake_cloud_worker
from tests.test_service_workflow import _true, start, wait_ready
from workflows.fleet import FleetMonitorWorkflow
from rules.names import fleet_workflow_id
from workflows.service import ServiceRunWorkflow

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
async def cloud(dev_env):
    async for fake in fake_cloud_worker(dev_env):
        yield fake


async def start_fleet(env, cloud, **kw):
    """The fleet monitor; its handle follows the latest run."""
    started = await env.client.start_workflow(
        FleetMonitorWorkflow.run, FleetInput(backend="local", query_seconds=0.5, closed_check_seconds=1, **kw),
        id=fleet_workflow_id(cloud.queue, "local"), task_queue=cloud.queue)
    return env.client.get_workflow_handle(started.id)


async def watched(fleet) -> dict[str, list[str]]:
    changes: FleetChanges = await fleet.query(FleetMonitorWorkflow.changes, 0)
    return {w.service: sorted(r.replica_id for r in w.replicas) for w in changes.watched}


async def activities_of(handle) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name
            for e in (await handle.fetch_history()).events if e.HasField("activity_task_scheduled_event_attributes")]


async def test_one_fleet_watch_serves_every_service_and_a_crash_is_replaced(dev_env, cloud):
    fleet = await start_fleet(dev_env, cloud)
    a = await start(dev_env, cloud, "fleet-a", fleet_monitor=True)
    b = await start(dev_env, cloud, "fleet-b", fleet_monitor=True)
    await wait_ready(a, {"0": [0], "1": []})
    await wait_ready(b, {"0": [0], "1": []})
    both = {"fleet-a": ["fleet-a/0/r0-s0"], "fleet-b": ["fleet-b/0/r0-s0"]}
    await eventually(lambda: _is(watched(fleet), both))

    cloud.crash.setdefault("fleet-a/0/r0-s0", asyncio.Event()).set()
    await wait_ready(a, {"0": [0], "1": []})
    await eventually(lambda: _true("fleet-a/0/r0-s1" in cloud.routed))
    assert cloud.log.index(("unregister", "fleet-a/0/r0-s0")) < cloud.log.index(("terminate", "fleet-a/0/r0-s0"))
    messages = [e.message for e in await a.query(ServiceRunWorkflow.events)]
    assert "replica 0 down: exited (1); unrouted, replacing" in messages
    await eventually(lambda: _is(watched(fleet), {"fleet-a": ["fleet-a/0/r0-s1"], "fleet-b": ["fleet-b/0/r0-s0"]}))

    await a.signal(ServiceRunWorkflow.stop)
    assert await a.result() == "stopped"
    await eventually(lambda: _is(watched(fleet), {"fleet-b": ["fleet-b/0/r0-s0"]}))
    # Neither service ran a monitor of its own; the fleet ran one watch for both.
    assert "monitor_replicas" not in await activities_of(a) + await activities_of(b)
    assert await activities_of(fleet) == ["watch_fleet"]
    scheduled = next(e.activity_task_scheduled_event_attributes for e in (await fleet.fetch_history()).events
                     if e.HasField("activity_task_scheduled_event_attributes"))
    assert scheduled.heartbeat_timeout.ToSeconds() == 24  # a dead worker's watch moves, and looks, within 30 s
    await b.signal(ServiceRunWorkflow.stop)
    await b.result()
    await fleet.terminate()


async def test_a_serving_replica_of_an_earlier_run_terminated_from_outside_is_found_by_the_fleet(dev_env, cloud):
    """The service hears of its own children closing; a replica an earlier run started is no child of this one,
    and only the fleet's listing of closed replica workflows finds it."""
    fleet = await start_fleet(dev_env, cloud)
    started = await start(dev_env, cloud, "fleet-term", fleet_monitor=True, history_limit=60)
    handle = dev_env.client.get_workflow_handle(started.id)
    first = (await handle.describe()).run_id
    await wait_ready(handle, {"0": [0], "1": []})
    await eventually(lambda: _hopped(handle, first))
    await eventually(lambda: _is(watched(fleet), {"fleet-term": ["fleet-term/0/r0-s0"]}))
    rid = "fleet-term/0/r0-s0"
    await dev_env.client.get_workflow_handle(f"service/{rid}").terminate(reason="from the Web UI")
    await eventually(lambda: _true("fleet-term/0/r0-s1" in cloud.routed))
    await eventually(lambda: _true(cloud.instances[rid] == "terminated"))
    messages = [e.message for e in await handle.query(ServiceRunWorkflow.events)]
    assert "replica 0 down: replica workflow terminated; unrouted, replacing" in messages
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()
    await fleet.terminate()


async def test_the_watched_set_outlives_the_fleets_continue_as_new(dev_env, cloud):
    fleet = await start_fleet(dev_env, cloud, history_limit=8)  # past it at the first signal
    first = (await fleet.describe()).run_id
    handles = [await start(dev_env, cloud, f"fleet-hop{i}", fleet_monitor=True) for i in range(3)]
    for h in handles:
        await wait_ready(h, {"0": [0], "1": []})
    await eventually(lambda: _hopped(fleet, first))
    want = {f"fleet-hop{i}": [f"fleet-hop{i}/0/r0-s0"] for i in range(3)}
    await eventually(lambda: _is(watched(fleet), want))
    cloud.crash.setdefault("fleet-hop1/0/r0-s0", asyncio.Event()).set()  # seen by the new run's watch
    await eventually(lambda: _true("fleet-hop1/0/r0-s1" in cloud.routed))
    for h in handles:
        await h.signal(ServiceRunWorkflow.stop)
        await h.result()
    await eventually(lambda: _is(watched(fleet), {}))
    await fleet.terminate()


async def test_a_fleet_of_6000_replicas_continues_as_new_and_answers_whole(dev_env, cloud):
    """Its carried set is 2.3 MB of JSON, past Temporal's 2 MB limit on one payload: sent compressed
    (connect/codec.py), 1,000 services × 6 replicas start, hop and answer."""
    services = [MonitorInput(service=f"svc-{i:04d}", backend="gcp", replicas=[_watched(f"svc-{i:04d}", r)
                                                                             for r in range(6)]) for i in range(1000)]
    assert len(FleetInput(backend="gcp", watched=services).model_dump_json()) > 2 * 2**20
    # On a backend no worker here serves: its watch waits unstarted, and only the workflow is looked at.
    started = await dev_env.client.start_workflow(
        FleetMonitorWorkflow.run, FleetInput(backend="gcp", watched=services, history_limit=3),
        id=fleet_workflow_id(cloud.queue, "gcp"), task_queue=cloud.queue)
    fleet = dev_env.client.get_workflow_handle(started.id)
    late = MonitorInput(service="svc-late", backend="gcp", replicas=[_watched("svc-late", 0)])
    await fleet.signal(FleetMonitorWorkflow.watch, late)  # its task finds the history past the limit
    await eventually(lambda: _hopped(fleet, started.result_run_id))
    got = await watched(fleet)
    assert len(got) == 1001 and got["svc-0999"] == [f"svc-0999/decode/r{r}-s0" for r in range(6)]
    assert got["svc-late"] == ["svc-late/decode/r0-s0"]
    await fleet.terminate()


def _watched(service: str, replica: int) -> Watched:
    rid = f"{service}/decode/r{replica}-s0"
    return Watched(replica_num=replica, submission_num=0, group="decode", workflow_id=f"service/{rid}",
                   replica_id=rid, instance=LocalInstance(replica_id=rid, pid=4000 + replica, start_time=1, isolated=True,
                                                          work_dir=f"/srv/{rid}", address=f"unix:/srv/{rid}.sock",
                                                          log_path=f"/srv/{rid}/log", ip=f"10.0.{replica}.2"))


async def test_without_a_fleet_monitor_the_service_watches_on_its_own(dev_env, cloud):
    handle = await start(dev_env, cloud, "fleet-none", fleet_monitor=True)
    await wait_ready(handle, {"0": [0], "1": []})
    await eventually(lambda: _has(activities_of(handle), "monitor_replicas"))
    cloud.crash.setdefault("fleet-none/0/r0-s0", asyncio.Event()).set()
    await eventually(lambda: _true("fleet-none/0/r0-s1" in cloud.routed))
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"


async def _is(got, want) -> bool:
    return await got == want


async def _has(got, item):
    return item in await got or None


async def _hopped(handle, first: str):
    return (await handle.describe()).run_id != first or None
