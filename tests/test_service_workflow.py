"""ServiceRunWorkflow + ReplicaWorkflow on the time-skipping server, with fake activities."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.service import RPCError
from temporalio.testing import ActivityEnvironment
from temporalio.worker import Worker

from activities.reaper import ReaperActivities
from cli.control import deliver
from cli.inspect import with_progress
from models.loader import load_config_file, load_config_text
from models.reaper import ReaperInput
from models.messages import ApplyRequest, ScaleRequest, Step, StopRequest
from models.state import ServiceState
from models.views import ServiceStatus
from models.service import ServiceConfiguration
from tests.conftest import eventually, last_run_result
from tests.fakes.cloud import HUNG_IMAGE, fake_cloud_worker
from rules.jobs import replica_input
from workflows.reaper import ReaperWorkflow
from workflows.replica import ReplicaWorkflow
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONFIG = """
type: service
name: {name}
port: 8000
replicas:
  - count: 1
    commands: [echo "Group 1 - Version 0" > /tmp/version.txt, python3 -m http.server 8000]
  - count: 0..3
    scaling: {{metric: rps, target: 2}}
    commands: [echo "Group 2 - Version 0" > /tmp/version.txt, python3 -m http.server 8000]
"""


@pytest.fixture
async def cloud(ts_env):
    async for fake in fake_cloud_worker(ts_env):
        yield fake


@pytest.fixture
async def cloud_alone(ts_env_alone):
    async for fake in fake_cloud_worker(ts_env_alone):
        yield fake


async def start(env, cloud, name: str, **kwargs):
    config = load_config_text(CONFIG.format(name=name)).config
    state = ServiceState(name=name, config=config)
    return await env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=state, **kwargs), id=service_workflow_id(name),
        task_queue=cloud.queue)


def ready_replicas(status: ServiceStatus) -> dict[str, list[int]]:
    return {g.name: sorted(r.replica for r in g.replicas if r.ready and r.status == "running")
            for g in status.groups}


async def status_of(handle) -> ServiceStatus:
    return await handle.query(ServiceRunWorkflow.status, rpc_timeout=timedelta(seconds=3))


async def wait_ready(handle, expected: dict[str, list[int]]) -> ServiceStatus:
    async def check():
        status = await status_of(handle)
        return status if ready_replicas(status) == expected else None
    return await eventually(check)


async def test_groups_start_at_min_with_run_global_numbers(ts_env, cloud):
    handle = await start(ts_env, cloud, "svc-start")
    status = await wait_ready(handle, {"0": [0], "1": []})
    assert status.status == "running"
    assert [g.desired for g in status.groups] == [1, 0]
    assert ("route", "svc-start") in cloud.log
    # The replica registered with the gateway only after it was ready.
    rid = "svc-start/0/r0-s0"
    assert cloud.log.index(("ready", rid)) < cloud.log.index(("register", rid))
    # The route and the first replica's start went out in one workflow task: the route (a gateway reload) does
    # not delay the replicas, which register only once they answer.
    kinds = [e.WhichOneof("attributes") for e in (await handle.fetch_history()).events]
    route = kinds.index("activity_task_scheduled_event_attributes")
    child = kinds.index("start_child_workflow_execution_initiated_event_attributes")
    assert "workflow_task_completed_event_attributes" not in kinds[min(route, child):max(route, child)], kinds
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_scale_up_and_down_removes_newest_after_leaving_gateway(ts_env, cloud):
    handle = await start(ts_env, cloud, "svc-scale")
    await wait_ready(handle, {"0": [0], "1": []})
    assert await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=3)) == 3
    await wait_ready(handle, {"0": [0], "1": [1, 2, 3]})
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=1))
    await wait_ready(handle, {"0": [0], "1": [1]})
    for rid in ("svc-scale/1/r2-s0", "svc-scale/1/r3-s0"):
        await eventually(lambda: _true(cloud.instances[rid] == "terminated"))
        # The gateway stopped routing to it before its instance was terminated.
        assert cloud.log.index(("unregister", rid)) < cloud.log.index(("terminate", rid))
    assert cloud.running() == {"svc-scale/0/r0-s0", "svc-scale/1/r1-s0"}
    # A new scale-up reuses the group's free replica numbers (new submission), never another group's.
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=2))
    await wait_ready(handle, {"0": [0], "1": [1, 2]})
    assert "svc-scale/1/r2-s1" in cloud.running()
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_invalid_scale_is_refused_and_changes_nothing(ts_env, cloud):
    handle = await start(ts_env, cloud, "svc-refuse")
    await wait_ready(handle, {"0": [0], "1": []})
    for request, text in [(ScaleRequest(group="nope", count=1), "no replica group 'nope'"),
                          (ScaleRequest(group="1", count=4), "takes 0..3 replicas, not 4"),
                          (ScaleRequest(group="0", count=-1), "not -1")]:
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await handle.execute_update(ServiceRunWorkflow.scale, request)
        assert text in str(info.value.cause)
    # A rejected update leaves no trace in the history.
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.HasField("workflow_execution_update_accepted_event_attributes")]
    assert [g.desired for g in (await status_of(handle)).groups] == [1, 0]
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_run_started_without_apply_is_judged_by_the_same_rules(ts_env, cloud):
    # Started as `temporal workflow start` could: a group of 500 replicas, which `validate` refuses (a bound, not a
    # type: the input decodes). The run judges its own configuration first and stops, failed, having started none.
    name = "svc-direct"
    raw = load_config_text(CONFIG.format(name=name)).config.model_dump(mode="json")
    raw["groups"][1]["count"] = {"min": 0, "max": 500}
    state = ServiceState(name=name, config=ServiceConfiguration.model_validate(raw))
    handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, ServiceRunInput(state=state),
                                                id=service_workflow_id(name), task_queue=cloud.queue)
    assert await handle.result() == "failed"
    rejected = [e.message for e in await handle.query(ServiceRunWorkflow.events) if e.kind == "rejected"]
    assert len(rejected) == 1 and rejected[0].startswith("invalid configuration: ") and "at most 64" in rejected[0]
    assert not [rid for rid in cloud.provisions if rid.startswith(name)]


async def test_a_run_started_past_a_models_bound_is_judged_too(ts_env, cloud):
    """A bound the models themselves hold (a port): the worker reads such an input (history is read without
    today's rules, models/history.py), and the run's own judge refuses it, naming the field."""
    name = "svc-direct-port"
    raw = ServiceRunInput(state=ServiceState(name=name, config=load_config_text(CONFIG.format(name=name)).config)
                          ).model_dump(mode="json")
    raw["state"]["config"]["port"]["container_port"] = 70000
    handle = await ts_env.client.start_workflow("ServiceRunWorkflow", raw, id=service_workflow_id(name),
                                                task_queue=cloud.queue)
    assert await handle.result() == "failed"
    rejected = [e.message for e in await handle.query(ServiceRunWorkflow.events) if e.kind == "rejected"]
    assert rejected == ["invalid configuration: port.container_port: Input should be less than or equal to 65535"]
    assert not [rid for rid in cloud.provisions if rid.startswith(name)]


async def test_scale_and_apply_by_signal_log_what_they_refuse(ts_env, cloud):
    """For tools that can only signal (the Web UI): the same scale and apply; a refused one is an event."""
    name = "svc-signal"
    handle = await start(ts_env, cloud, name)
    await wait_ready(handle, {"0": [0], "1": []})

    def config(text: str = CONFIG) -> dict:
        return load_config_text(text.format(name=name)).config.model_dump(mode="json")
    bad = config()
    bad["groups"][1]["commands"] = []
    refused = [("scale", {"group": "nope", "count": 1}, "scale signal refused: no replica group 'nope'"),
               ("scale", {"group": "1", "count": 4}, "scale signal refused: group '1' takes 0..3 replicas, not 4"),
               ("scale", {"group": "1", "count": "many"}, "scale signal refused: count: Input should be a valid "
                                                          "integer"),
               ("scale", ["1", 2], "scale signal refused: payload: Input should be a valid dictionary"),
               ("apply", {"config": bad}, "apply signal refused: invalid configuration: groups[1]: replica group '1'"),
               ("apply", {"config": config()}, "apply signal refused: no changes")]
    for signal, payload, _ in refused:
        await handle.signal(signal, payload)

    async def rejected() -> list[str]:
        messages = [e.message for e in await handle.query(ServiceRunWorkflow.events) if e.kind == "rejected"]
        return messages if len(messages) == len(refused) else []
    for message, (_, _, text) in zip(await eventually(rejected), refused):
        assert message.startswith(text), message
    status = await status_of(handle)
    assert status.deployment == 0 and [g.desired for g in status.groups] == [1, 0]
    assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING

    await handle.signal("scale", {"group": "1", "count": 2})
    await wait_ready(handle, {"0": [0], "1": [1, 2]})
    await handle.signal("apply", {"config": config(CONFIG.replace("Version 0", "Version 1"))})
    await eventually(lambda: _rolled_out(handle, 1))
    assert [e.message for e in await handle.query(ServiceRunWorkflow.events) if e.kind == "apply"][-1].startswith(
        "deployment 1: changed groups.0.commands, groups.1.commands")
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _rolled_out(handle, deployment: int) -> bool:
    status = await status_of(handle)
    live = [r for g in status.groups for r in g.replicas if r.status != "terminated"]
    return status.deployment == deployment and all(r.deployment == deployment and r.ready for r in live) and \
        len(live) == 3


async def test_crashed_replica_is_unrouted_and_replaced_then_backs_off(ts_env, cloud):
    handle = await start(ts_env, cloud, "svc-crash")
    await wait_ready(handle, {"0": [0], "1": []})
    await eventually(lambda: _true("svc-crash/0/r0-s0" in cloud.crash))
    cloud.crash["svc-crash/0/r0-s0"].set()
    # The first failure is replaced at once; the monitor unrouted it before its teardown.
    await eventually(lambda: _true("svc-crash/0/r0-s1" in cloud.routed))
    await wait_ready(handle, {"0": [0], "1": []})
    assert cloud.log.index(("unregister", "svc-crash/0/r0-s0")) < cloud.log.index(("terminate", "svc-crash/0/r0-s0"))
    # A second failure in a row waits on the group's back-off (15 s), which `ps` shows.
    cloud.crash.setdefault("svc-crash/0/r0-s1", asyncio.Event()).set()
    await eventually(lambda: _true(cloud.instances["svc-crash/0/r0-s1"] == "terminated"))
    status = await status_of(handle)
    assert status.groups[0].retry_after is not None and "svc-crash/0/r0-s2" not in cloud.provisions
    await ts_env.sleep(timedelta(seconds=20))  # the back-off is skipped
    await eventually(lambda: _true("svc-crash/0/r0-s2" in cloud.routed))
    status = await wait_ready(handle, {"0": [0], "1": []})
    assert [r.submission for r in status.groups[0].replicas] == [2] and status.groups[0].retry_after is None
    messages = [e.message for e in await handle.query(ServiceRunWorkflow.events)]
    assert "replica 0 down: exited (1); unrouted, replacing" in messages
    assert any(m.startswith("2 failures in a row: next replica after") for m in messages)
    assert any("replica 0 failed: exited (1)" in m for m in messages)
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_stop_terminates_everything_then_completes(ts_env, cloud):
    handle = await start(ts_env, cloud, "svc-stop")
    await wait_ready(handle, {"0": [0], "1": []})
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=2))
    await wait_ready(handle, {"0": [0], "1": [1, 2]})
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"
    assert cloud.running() == set() and cloud.routed == set()
    assert cloud.log[-1] == ("unroute", "svc-stop")


async def test_cancel_from_the_ui_tears_down_too(ts_env, cloud):
    handle = await start(ts_env, cloud, "svc-cancel")
    await wait_ready(handle, {"0": [0], "1": []})
    await handle.cancel()
    await eventually(lambda: _status_is(handle, WorkflowExecutionStatus.CANCELED))
    assert cloud.running() == set() and ("unroute", "svc-cancel") in cloud.log


@pytest.fixture
async def cloud_dev(dev_env):
    async for fake in fake_cloud_worker(dev_env):
        yield fake


# Each its own name: a stopped run's replica workflows close a workflow task after the run (children.py).
@pytest.mark.parametrize("name,limit", [("svc-hops", {"history_limit": 60}),
                                        ("svc-hops-bytes", {"history_bytes_limit": 30_000})], ids=["events", "bytes"])
async def test_continue_as_new_hops_keep_replicas_alive(dev_env, cloud_dev, name, limit):
    """On the dev server: the time-skipping one can lose a hop's last events (tests/conftest.py). A run hops past
    an event count, or past a size in bytes (a large configuration fills a history in fewer events)."""
    ts_env, cloud = dev_env, cloud_dev
    handle = await start(ts_env, cloud, name, **limit)
    await wait_ready(handle, {"0": [0], "1": []})
    runs = {(await handle.describe()).run_id}
    for count in (1, 2, 3, 2, 1, 2, 3):
        # A scale meeting a hop is answered WorkflowNotReady: asked again, as the CLI does.
        await deliver(lambda: handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=count)))
        await eventually(lambda: _group_ready(handle, "1", count))
        runs.add((await handle.describe()).run_id)
    assert len(runs) >= 2, "expected continue-as-new hops"
    # The newest run shows the service in the Web UI's details from its first task on.
    meta = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    assert meta.current_details.startswith(f"**{name}** running"), meta.current_details
    status = await status_of(handle)
    assert ready_replicas(status)["0"] == [0]
    # Nothing was provisioned twice, and the first replica survived every hop.
    assert all(n == 1 for n in cloud.provisions.values())
    assert f"{name}/0/r0-s0" in cloud.running()
    await handle.signal(ServiceRunWorkflow.stop)
    assert await last_run_result(ts_env.client, handle.id) == "stopped"
    assert cloud.running() == set()
    # The store's decision log got every decision once, in order, across the hops; its `ps` row is final.
    mine = [cloud.log_by_seq[seq] for seq in sorted(cloud.log_by_seq)]
    assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
    scales = [e.message.split(" (")[0] for e in mine if e.kind == "scale"]
    assert scales == ["0 → 1", "1 → 2", "2 → 3", "3 → 2", "2 → 1", "1 → 2", "2 → 3"]
    assert [e.at for e in mine] == sorted(e.at for e in mine)
    assert mine[-1].message == "service stopped" and cloud.rows[name].status == "terminated"


async def test_a_continued_run_is_not_judged_again(dev_env, cloud_dev, monkeypatch):
    """A service's configuration is judged when it begins and at each apply, not at each continue-as-new: a
    release whose rules refuse what a running service was admitted with must not fail it at its next hop."""
    import activities.signals
    from models.validation import Issue
    env, cloud = dev_env, cloud_dev
    handle = await start(env, cloud, "svc-judged-once", history_limit=60)
    await wait_ready(handle, {"0": [0], "1": []})
    first = (await handle.describe()).run_id
    monkeypatch.setattr(activities.signals, "validate_service", lambda config: [Issue(("port",), "a new rule")])
    for count in (1, 2, 3, 2, 1, 2, 3):
        await deliver(lambda: handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=count)))
        await eventually(lambda: _group_ready(handle, "1", count))
        if (await handle.describe()).run_id != first:
            break
    assert (await handle.describe()).run_id != first, "expected a continue-as-new hop"
    status = await status_of(handle)
    assert status.status == "running" and ready_replicas(status)["0"] == [0]
    events = await handle.query(ServiceRunWorkflow.events)
    assert not [e for e in events if e.kind == "rejected"], [e.message for e in events]
    await handle.signal(ServiceRunWorkflow.stop)
    assert await last_run_result(env.client, handle.id) == "stopped"


async def test_seed_autoscaling_with_real_default_delays(ts_env_alone, cloud_alone):
    """Spec seed 004: 8 rps, target 2, delays 5 min / 10 min, groups 0..2 and 0..3."""
    ts_env, cloud = ts_env_alone, cloud_alone
    config = load_config_file(Path(__file__).resolve().parent.parent / "examples" / "replica-groups-service.yml").config
    name = "svc-seed"
    cloud.polling = True
    handle = await ts_env.client.start_workflow(
        # Long heartbeat timeouts: skipped virtual time must not time out the fakes' real-time heartbeats.
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config), heartbeat_seconds=86400),
        id=service_workflow_id(name), task_queue=cloud.queue)
    await ts_env.sleep(timedelta(seconds=30))
    assert [g.desired for g in (await status_of(handle)).groups] == [0, 0]
    # The first requests: a small rate over the window, so each group gets one replica, at once.
    cloud.rps = 1
    await ts_env.sleep(timedelta(seconds=40))
    await wait_ready(handle, {"replica-1": [0], "replica-2": [1]})
    # The full load: both groups want ceil(8 / 2) = 4, but the up-delay (5 min) holds them.
    cloud.rps = 8
    await ts_env.sleep(timedelta(seconds=40))
    await eventually(lambda: _has_event(handle, "hold", "up-delay"))
    assert [g.desired for g in (await status_of(handle)).groups] == [1, 1]
    await ts_env.sleep(timedelta(minutes=5))
    await wait_ready(handle, {"replica-1": [0, 2], "replica-2": [1, 3, 4]})
    events = await handle.query(ServiceRunWorkflow.events)
    scale = [e.message for e in events if e.kind == "scale"]
    assert any(m.startswith("0 → 1: from zero") for m in scale)
    assert any(m.startswith("1 → 2: clamped to max 2; rps 8.00 over 60s, target 2") for m in scale)
    assert any(m.startswith("1 → 3: clamped to max 3") for m in scale)
    # Traffic stops: after the down-delay (10 min since the last scaling) both go back to zero.
    cloud.rps = 0
    await ts_env.sleep(timedelta(seconds=40))
    await eventually(lambda: _has_event(handle, "hold", "down-delay"))
    assert [g.desired for g in (await status_of(handle)).groups] == [2, 3]
    await ts_env.sleep(timedelta(minutes=10))
    await wait_ready(handle, {"replica-1": [], "replica-2": []})
    await eventually(lambda: _true(not cloud.running()))
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _has_event(handle, kind: str, text: str) -> bool:
    return any(e.kind == kind and text in e.message for e in await handle.query(ServiceRunWorkflow.events))


async def _true(value: bool) -> bool:
    return value


async def _status_is(handle, expected) -> bool:
    return (await handle.describe()).status == expected


async def _group_ready(handle, group: str, count: int) -> bool:
    status = await status_of(handle)
    g = next(g for g in status.groups if g.name == group)
    return sum(1 for r in g.replicas if r.ready and r.status == "running") == count and \
        not any(r.status == "terminating" for r in g.replicas)


ROLLING = """
type: service
name: {name}
port: 8000
replicas:
  - name: a
    count: 2
    commands: ["{cmd_a}"]
  - name: b
    count: 1
    commands: [serve b]
"""


def rolling_config(name: str, cmd_a: str = "serve a") -> dict:
    return load_config_text(ROLLING.format(name=name, cmd_a=cmd_a)).config.model_dump(mode="json")


async def start_rolling(env, cloud, name: str):
    config = load_config_text(ROLLING.format(name=name, cmd_a="serve a")).config
    handle = await env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config)),
        id=service_workflow_id(name), task_queue=cloud.queue)
    await wait_ready(handle, {"a": [0, 1], "b": [2]})
    return handle


def deployments(status: ServiceStatus) -> dict[str, list[tuple[int, int]]]:
    return {g.name: sorted((r.replica, r.deployment) for r in g.replicas if r.status == "running" and r.ready)
            for g in status.groups}


async def test_count_change_applies_in_place_without_restarts(ts_env, cloud):
    handle = await start_rolling(ts_env, cloud, "svc-inplace")
    provisions = dict(cloud.provisions)
    config = rolling_config("svc-inplace")
    config["groups"][1]["count"] = {"min": 2, "max": 2}
    result = await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config))
    assert result.deployment == 1 and result.in_place == ["groups.b.count"] and result.rolling == []
    assert (result.kept, result.replacing) == (3, 0)
    status = await wait_ready(handle, {"a": [0, 1], "b": [2, 3]})
    assert deployments(status)["a"] == [(0, 1), (1, 1)]  # bumped, not replaced
    assert all(cloud.provisions[rid] == n for rid, n in provisions.items())
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_rolling_replaces_each_changed_replica_one_at_a_time(ts_env, cloud):
    handle = await start_rolling(ts_env, cloud, "svc-roll")
    result = await handle.execute_update(ServiceRunWorkflow.apply,
                                         ApplyRequest(config=rolling_config("svc-roll", "serve a v2")))
    assert (result.kept, result.replacing) == (1, 2)  # group b kept, group a's two replicas roll
    async def rolled():
        status = await status_of(handle)
        d = deployments(status)
        return status if [dep for _, dep in d["a"]] == [1, 1] and len(d["a"]) == 2 \
            and not any(g.rollout for g in status.groups) else None
    status = await eventually(rolled)
    assert deployments(status)["b"] == [(2, 1)]  # group b's job did not change: bumped, not restarted
    assert cloud.provisions["svc-roll/b/r2-s0"] == 1
    assert cloud.max_alive["a"] <= 3  # desired 2 + surge 1
    for old in ("svc-roll/a/r0-s0", "svc-roll/a/r1-s0"):
        await eventually(lambda: _true(cloud.instances[old] == "terminated"))
    # Each old replica left the gateway only after some new replica had registered.
    first_new = min(i for i, (op, rid) in enumerate(cloud.log) if op == "register" and "/a/" in rid
                    and rid not in ("svc-roll/a/r0-s0", "svc-roll/a/r1-s0"))
    assert all(cloud.log.index(("unregister", old)) > first_new for old in ("svc-roll/a/r0-s0",))
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_failed_rollout_keeps_old_replicas_and_rollback_restores(ts_env, cloud):
    handle = await start_rolling(ts_env, cloud, "svc-fail")
    await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=rolling_config("svc-fail", "crash")))
    async def failed():
        status = await status_of(handle)
        return status if status.groups[0].rollout.startswith("failed") else None
    status = await eventually(failed)
    assert "exited (1)" in status.groups[0].rollout
    assert cloud.running() >= {"svc-fail/a/r0-s0", "svc-fail/a/r1-s0", "svc-fail/b/r2-s0"}
    events = await handle.query(ServiceRunWorkflow.events)
    assert any(e.kind == "rollout" and "old replicas keep serving" in e.message for e in events)
    result = await handle.execute_update(ServiceRunWorkflow.rollback)
    assert result.deployment == 2
    status = await eventually(lambda: _rollout_done(handle))
    assert deployments(status)["a"] == [(0, 2), (1, 2)]  # the old replicas, kept in place
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _rollout_done(handle):
    status = await status_of(handle)
    return status if not any(g.rollout for g in status.groups) and deployments(status)["a"] else None


async def test_invalid_update_is_refused_and_changes_nothing(ts_env, cloud):
    handle = await start_rolling(ts_env, cloud, "svc-badapply")
    bad = rolling_config("svc-badapply")
    bad["groups"][0]["image"] = "x"
    bad["groups"][0]["nvcc"] = True
    missing = rolling_config("svc-badapply")
    missing["groups"][1]["commands"] = []
    auth = rolling_config("svc-badapply")
    auth["auth"] = False
    for config, text in [(bad, "groups[0].nvcc: `image` and `nvcc` are mutually exclusive"),
                         (missing, "groups[1]: replica group 'b': either `commands` or `image`"),
                         (auth, "cannot be updated in place: auth")]:
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config))
        assert text in str(info.value.cause)
    status = await status_of(handle)
    assert status.deployment == 0 and deployments(status) == {"a": [(0, 0), (1, 0)], "b": [(2, 0)]}
    history = await handle.fetch_history()
    assert not [e for e in history.events if e.HasField("workflow_execution_update_accepted_event_attributes")]
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_manual_scale_of_an_autoscaled_group_holds_until_its_delay(ts_env_alone, cloud_alone):
    ts_env, cloud = ts_env_alone, cloud_alone
    config = load_config_file(Path(__file__).resolve().parent.parent / "examples" / "replica-groups-service.yml").config
    cloud.polling, cloud.rps = True, 1
    handle = await ts_env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name="svc-manual", config=config),
                                                heartbeat_seconds=86400),
        id=service_workflow_id("svc-manual"), task_queue=cloud.queue)
    await ts_env.sleep(timedelta(seconds=40))
    await wait_ready(handle, {"replica-1": [0], "replica-2": [1]})
    assert await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="replica-2", count=3)) == 3
    await ts_env.sleep(timedelta(minutes=5))  # the autoscaler wants 1, but the down-delay (10 min) holds
    assert [g.desired for g in (await status_of(handle)).groups] == [1, 3]
    await ts_env.sleep(timedelta(minutes=6))
    await eventually(lambda: _desired(handle, [1, 1]))
    events = [e.message for e in await handle.query(ServiceRunWorkflow.events) if e.group == "replica-2"]
    assert any("1 → 3 (manual scale)" in m for m in events) and any(m.startswith("3 → 1: target") for m in events)
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _desired(handle, expected: list[int]) -> bool:
    return [g.desired for g in (await status_of(handle)).groups] == expected


async def test_a_replica_workflow_terminated_from_outside_is_torn_down_and_replaced(ts_env, cloud):
    """As `temporal workflow terminate` or the Web UI's Terminate: nothing runs in the child any more."""
    handle = await start(ts_env, cloud, "svc-term")
    await wait_ready(handle, {"0": [0], "1": []})
    child = ts_env.client.get_workflow_handle("service/svc-term/0/r0-s0")
    await child.terminate(reason="from the Web UI")
    await eventually(lambda: _true("svc-term/0/r0-s1" in cloud.routed))
    status = await wait_ready(handle, {"0": [0], "1": []})
    assert [r.submission for r in status.groups[0].replicas] == [1]
    # The service tore the orphan down itself: unrouted, then its instance terminated.
    assert cloud.instances["svc-term/0/r0-s0"] == "terminated" and "svc-term/0/r0-s0" not in cloud.routed
    assert cloud.log.index(("unregister", "svc-term/0/r0-s0")) < cloud.log.index(("terminate", "svc-term/0/r0-s0"))
    messages = [e.message for e in await handle.query(ServiceRunWorkflow.events)]
    assert "replica 0 down: replica workflow terminated; unrouted, replacing" in messages
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_replica_workflow_terminated_before_it_serves_is_torn_down_and_replaced(dev_env, cloud_dev):
    """Terminated from the Web UI while its launch seems stuck: the monitor, which watches serving replicas only,
    never sees it, but the service sees its child close, tears down what the launch made (before it reported
    where) and starts another. On the dev server: the time-skipping one never tells a parent its child was
    terminated."""
    env, cloud = dev_env, cloud_dev
    rid = "svc-stuck/0/r0-s0"
    cloud.hang.add(rid)
    handle = await start(env, cloud, "svc-stuck")
    await eventually(lambda: _true(cloud.instances.get(rid) == "running"))
    await env.client.get_workflow_handle(f"service/{rid}").terminate(reason="from the Web UI")
    status = await wait_ready(handle, {"0": [0], "1": []})
    assert [r.submission for r in status.groups[0].replicas] == [1]
    assert cloud.instances[rid] == "terminated"
    messages = [e.message for e in await handle.query(ServiceRunWorkflow.events)]
    assert "replica 0 down: replica workflow terminated; unrouted, replacing" in messages
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _reason_is(client, handle, said: str) -> bool:
    status = await with_progress(client, await status_of(handle))
    return status.groups[0].replicas[0].reason == said


async def test_a_replica_cancelled_during_its_launch_tears_down_only_once_the_launch_stopped(dev_env, cloud_dev):
    """Cancelled from the Web UI while its launch seems stuck: the launch is cancelled and waited for, then the
    teardown looks; it never runs beside a launch that could still make an instance or a route. (On the dev
    server: the time-skipping one does not tell a parent that its child closed.)"""
    ts_env, cloud = dev_env, cloud_dev
    rid = "svc-cancel/0/r0-s0"
    cloud.hang.add(rid)
    handle = await start(ts_env, cloud, "svc-cancel")
    await eventually(lambda: _true(cloud.instances.get(rid) == "running"))
    # `ps -v` says how far its pull is: the step's heartbeat, from the replica workflow's pending activity.
    said = f"start_replica: {rid}: pulling {HUNG_IMAGE}: 1/3 layers"
    await eventually(lambda: _reason_is(ts_env.client, handle, said))
    await ts_env.client.get_workflow_handle(f"service/{rid}").cancel()
    await eventually(lambda: _true(cloud.instances.get(rid) == "terminated"))
    ops = [op for op, r in cloud.log if r == rid]
    assert ops.index("launch_cancelled") < ops.index("terminate"), ops
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_backend_whose_worker_is_missing_is_said_and_the_next_one_tried(dev_env, cloud_dev):
    """The deployment says it serves aws, but no worker polls its queue: after `unserved_seconds` the launch moves
    on to the next backend, instead of a replica submitted for ever. (On the dev server, in real time: the
    time-skipping one does not skip while an activity waits in a queue.)"""
    env, cloud = dev_env, cloud_dev
    cloud.served = ["aws", "local"]
    handle = await start(env, cloud, "svc-unserved", unserved_seconds=2)
    status = await wait_ready(handle, {"0": [0], "1": []})
    inp = cloud.inputs["svc-unserved/0/r0-s0"]
    assert inp.launch_on == ["aws", "local"] and status.groups[0].replicas[0].backend == "local"
    history = await env.client.get_workflow_handle("service/svc-unserved/0/r0-s0").fetch_history()
    timeouts = [e for e in history.events if e.HasField("activity_task_timed_out_event_attributes")]
    assert len(timeouts) == 1  # the aws launch, given up after UNSERVED; local then served it
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_backend_with_no_worker_at_all_is_said_in_events_and_ps(dev_env, cloud_dev):
    """Its only backend has no worker: within `unserved_seconds` (60 s by default) `events` and `ps` say which queue
    has no worker. Before, it took 10 minutes, and then the replica stayed submitted for good: its end waited for a
    teardown on that backend, which no worker took either, though its launch had made nothing there."""
    assert ServiceRunInput.model_fields["unserved_seconds"].default <= 60
    env, cloud = dev_env, cloud_dev
    cloud.served = ["aws"]
    handle = await start(env, cloud, "svc-no-worker", unserved_seconds=2)
    missing = f"aws: no worker took the launch within 2 s (is a worker serving {cloud.queue}-aws running?)"

    async def said():
        status = await status_of(handle)
        return status if any(missing in r.reason for r in status.groups[0].replicas) else None
    status = await eventually(said)
    assert not any(r.ready for r in status.groups[0].replicas)
    events = await handle.query(ServiceRunWorkflow.events)
    assert any(missing in e.message for e in events), [e.message for e in events]
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_service_stopped_while_its_launch_waits_for_a_missing_worker_stops(dev_env, cloud_dev):
    """Stopped while its replica's launch waits for a backend no worker serves: the launch is cancelled and the
    teardown on that backend waits for a worker too, but the service hears of the replica's end within
    `unserved_seconds` and stops, instead of waiting for that worker for good."""
    env, cloud = dev_env, cloud_dev
    cloud.served = ["aws"]
    handle = await start(env, cloud, "svc-stop-unserved", unserved_seconds=3)
    replica = env.client.get_workflow_handle("service/svc-stop-unserved/0/r0-s0")

    async def launching() -> bool:
        with contextlib.suppress(RPCError):
            return any(a.activity_type.name == "place_replica"
                       for a in (await replica.describe()).raw_description.pending_activities)
        return False
    await eventually(launching)
    await handle.signal(ServiceRunWorkflow.stop)
    assert await asyncio.wait_for(last_run_result(env.client, handle.id), 30) == "stopped"
    # The teardown still waits for an aws worker, which would find nothing there to stop.
    pending = (await replica.describe()).raw_description.pending_activities
    assert [a.activity_type.name for a in pending] == ["teardown_replica"]
    await replica.terminate()


async def test_each_launch_step_has_its_own_budget_and_readiness_the_groups_startup_timeout(ts_env, cloud):
    """A 70B model's weights take most of an hour: its readiness has the group's `startup_timeout`, apart from the
    30 minutes for the instance and its boot and the hour for the image pull. Before, one activity held all three,
    and a retry started over."""
    name = "svc-big-model"
    text = CONFIG.format(name=name).replace("  - count: 1\n", "  - count: 1\n    startup_timeout: 2h\n")
    config = load_config_text(text).config
    assert config.groups[0].startup_timeout == 7200, text
    handle = await ts_env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config)),
        id=service_workflow_id(name), task_queue=cloud.queue)
    await wait_ready(handle, {"0": [0], "1": []})
    events = (await ts_env.client.get_workflow_handle(f"service/{name}/0/r0-s0").fetch_history()).events
    steps = {e.activity_task_scheduled_event_attributes.activity_type.name: e.activity_task_scheduled_event_attributes
             for e in events if e.HasField("activity_task_scheduled_event_attributes")}
    assert steps["place_replica"].start_to_close_timeout.ToTimedelta() == timedelta(minutes=30)
    assert steps["start_replica"].start_to_close_timeout.ToTimedelta() == timedelta(minutes=60)
    assert steps["await_ready"].schedule_to_close_timeout.ToTimedelta() == timedelta(hours=2)
    assert "launch_replica" not in steps
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _lone_replica(env, cloud, name: str, load: timedelta, poll: timedelta, startup_timeout: str = ""):
    """One replica workflow alone (no service: no watcher runs, so the test server skips time while it loads),
    whose model loads for ``load`` of virtual time."""
    extra = f"    startup_timeout: {startup_timeout}\n" if startup_timeout else ""
    config = load_config_text(CONFIG.format(name=name).replace("  - count: 1\n", "  - count: 1\n" + extra)).config
    cloud.clock, cloud.load_poll = env.get_current_time, poll
    cloud.loads[f"{name}/0/r0-s0"] = load
    return await env.client.start_workflow(
        ReplicaWorkflow.run, replica_input(config, name, service_workflow_id(name), "0", 0, 0, 0),
        id=f"service/{name}/0/r0-s0", task_queue=cloud.queue)


async def test_a_model_that_loads_for_45_minutes_becomes_ready_on_one_instance_with_one_pull(ts_env_alone,
                                                                                            cloud_alone):
    """The readiness step polls by retrying (no history event per poll): 45 virtual minutes of loading end in a
    serving replica, placed once and started once. Before, the launch's one activity waited in the worker, and
    every retry placed and pulled again. A server of its own: another test's running activity stops its clock."""
    ts_env, cloud = ts_env_alone, cloud_alone
    rid = "svc-slow-load/0/r0-s0"
    replica = await _lone_replica(ts_env, cloud, "svc-slow-load", timedelta(minutes=45), timedelta(minutes=1))
    await ts_env.sleep(timedelta(minutes=40))  # the server skips its virtual time meanwhile
    assert ("ready", rid) not in cloud.log
    await ts_env.sleep(timedelta(minutes=10))
    await eventually(lambda: _true(("register", rid) in cloud.log))
    assert (cloud.provisions[rid], cloud.pulls[rid]) == (1, 1)
    assert cloud.ready_attempts[rid] >= 45
    events = (await replica.fetch_history()).events
    assert len(events) < 40, [EventType.Name(e.event_type) for e in events]  # 45 polls: retries, not events
    print(f"45-minute load: ready after {cloud.ready_attempts[rid]} readiness attempts; "
          f"{cloud.provisions[rid]} instance, {cloud.pulls[rid]} pull, {len(events)} replica history events")
    await replica.signal(ReplicaWorkflow.stop, StopRequest(reason="test over"))
    assert await replica.result() == "test over"
    assert cloud.instances[rid] == "terminated"


async def test_a_model_slower_than_its_startup_timeout_fails_with_why(ts_env_alone, cloud_alone):
    ts_env, cloud = ts_env_alone, cloud_alone
    replica = await _lone_replica(ts_env, cloud, "svc-too-slow", timedelta(hours=3), timedelta(minutes=5), "20m")
    assert await replica.result() == "not ready within 20m (startup_timeout): its probes never passed"
    assert cloud.instances["svc-too-slow/0/r0-s0"] == "terminated"


@pytest.mark.parametrize("step", [Step.PROVISIONING, Step.PROVISIONED, Step.SERVING, Step.TERMINATING, Step.FINISHED],
                         ids=lambda step: step.name.lower())
async def test_a_report_that_arrives_late_changes_nothing(ts_env, cloud, step):
    """Each report held back until the replica has moved past its step (serving, or terminated), then delivered:
    the service drops it. A scale up and down goes through every step."""
    name = f"svc-late-{step.name.lower()}"
    cloud.delayed.add(step)
    handle = await start(ts_env, cloud, name)
    await wait_ready(handle, {"0": [0], "1": []})
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=1))
    await wait_ready(handle, {"0": [0], "1": [1]})
    if step <= Step.SERVING:
        await _changes_nothing(ts_env.client, cloud, handle, await status_of(handle))
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=0))
    await eventually(lambda: _true(cloud.instances.get(f"{name}/1/r1-s0") == "terminated"))
    terminated = await eventually(lambda: _terminated(handle, 1))
    if step > Step.SERVING:
        await _changes_nothing(ts_env.client, cloud, handle, terminated)
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"


async def _changes_nothing(client, cloud, handle, status: ServiceStatus) -> None:
    """Deliver the held reports (at least one): the service's state and events stay as they are."""
    events = [e.message for e in await handle.query(ServiceRunWorkflow.events)]
    assert await cloud.deliver_held(client) >= 1
    # An update sent after the late signals is handled after them (history order): the state then includes them.
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="1", count=len(_group(status, "1"))))
    assert await status_of(handle) == status
    assert [e.message for e in await handle.query(ServiceRunWorkflow.events)] == events


def _group(status: ServiceStatus, name: str) -> list:
    return [r for g in status.groups if g.name == name for r in g.replicas if r.status != "terminated"]


async def _terminated(handle, replica: int) -> Optional[ServiceStatus]:
    status = await status_of(handle)
    return status if [r.status for g in status.groups for r in g.replicas if r.replica == replica] == \
        ["terminated"] else None


async def test_a_lost_serving_report_is_made_good_by_the_replica_workflow(ts_env, cloud):
    """The launch's reports are fire-and-forget; once it returned, its workflow tells `serving` again, durably: the
    service never keeps a routed replica it thinks is still starting (unwatched, never replaced)."""
    cloud.lost_reports.add("svc-lost/0/r0-s0")
    handle = await start(ts_env, cloud, "svc-lost")
    status = await wait_ready(handle, {"0": [0], "1": []})
    assert status.groups[0].replicas[0].status == "running"
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_the_reaper_stops_replicas_no_service_run_owns(dev_env, cloud_dev):
    """Children are abandoned by design (they outlive a continue-as-new), so a service reset past their start, or
    terminated from the Web UI, left them running and routed for good. The reaper's pass stops them."""
    env, cloud = dev_env, cloud_dev
    name = "svc-orphans"
    handle = await start(env, cloud, name)
    await wait_ready(handle, {"0": [0], "1": []})
    # A replica workflow of this service that its run does not own (what a reset past its start leaves).
    config = load_config_text(CONFIG.format(name=name)).config
    stray = replica_input(config, name, service_workflow_id(name), "0", 9, 0, 0)
    await env.client.start_workflow(ReplicaWorkflow.run, stray, id=f"service/{name}/0/r9-s0", task_queue=cloud.queue)
    await eventually(lambda: _true(cloud.instances.get(f"{name}/0/r9-s0") == "running"))
    routes = Routes()
    reaper = ReaperActivities(env.client, {}, None, gateway=routes)
    result = await ActivityEnvironment().run(reaper.reap_replicas, 0)
    mine = [s for s in result.stopped if s.startswith(f"service/{name}/")]  # the server is shared by other tests
    assert mine == [f"service/{name}/0/r9-s0: its service run does not own it (reset past its start?)"]
    await eventually(lambda: _true(cloud.instances.get(f"{name}/0/r9-s0") == "terminated"))
    assert cloud.instances[f"{name}/0/r0-s0"] == "running"  # owned: untouched
    # Terminated from the Web UI: its replicas go too, at the next pass.
    await handle.terminate(reason="from the Web UI")
    result = await ActivityEnvironment().run(reaper.reap_replicas, 0)
    assert f"service/{name}/0/r0-s0: its service run is terminated" in result.stopped
    await eventually(lambda: _true(cloud.instances.get(f"{name}/0/r0-s0") == "terminated"))
    assert name in routes.deleted  # and its route, which nobody else would remove


async def test_a_taken_workflow_id_starts_the_next_submission(ts_env, cloud):
    """A stopped run's replica workflows close a workflow task after it: `apply` of the same name at once found
    their ids taken, and the service failed. Now the holder is asked to stop, the replica takes the next
    submission, and nothing failed."""
    name = "svc-taken"
    config = load_config_text(CONFIG.format(name=name)).config
    holder = await ts_env.client.start_workflow(  # on a queue nobody serves: it stays open
        ReplicaWorkflow.run, replica_input(config, name, service_workflow_id(name), "0", 0, 0, 0),
        id=f"service/{name}/0/r0-s0", task_queue=f"{cloud.queue}-unserved")
    handle = await start(ts_env, cloud, name)
    status = await wait_ready(handle, {"0": [0], "1": []})
    assert [(r.replica, r.submission) for g in status.groups for r in g.replicas] == [(0, 1)]
    assert cloud.instances == {f"{name}/0/r0-s1": "running"} and status.status == "running"
    # The holder, which no run owns, was asked to stop (it would serve beside the new submission).
    signals = [e.workflow_execution_signaled_event_attributes.signal_name
               for e in (await holder.fetch_history()).events if e.HasField("workflow_execution_signaled_event_attributes")]
    assert signals == ["stop"]
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"
    await holder.terminate()


async def test_a_reset_to_the_first_task_leaves_one_replica_per_slot(dev_env, cloud_dev):
    """Reset from the Web UI to the run's first workflow task: the new run starts its replicas again, finds their
    ids held by the old run's (abandoned) children, stops those and serves with the next submission. (On a loaded
    machine the reaper's quick pass may stop the orphan first: its id is then free, and the slot starts over as
    submission 0. One replica per slot either way.)"""
    env, cloud, name = dev_env, cloud_dev, "svc-reset"
    handle = await start(env, cloud, name)
    await wait_ready(handle, {"0": [0], "1": []})
    first_task = next(e.event_id for e in (await handle.fetch_history()).events
                      if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)
    await env.client.workflow_service.reset_workflow_execution(ResetWorkflowExecutionRequest(
        namespace=env.client.namespace, workflow_execution=WorkflowExecution(workflow_id=handle.id),
        reason="from the Web UI", workflow_task_finish_event_id=first_task, request_id=str(uuid.uuid4())))
    handle = env.client.get_workflow_handle(handle.id)  # the reset's run
    status = await wait_ready(handle, {"0": [0], "1": []})
    ((replica, submission),) = [(r.replica, r.submission) for g in status.groups for r in g.replicas]
    assert (replica, submission) in ((0, 1), (0, 0))
    await eventually(lambda: _true(cloud.running() == {f"{name}/0/r0-s{submission}"}))
    if submission == 1:
        assert cloud.instances[f"{name}/0/r0-s0"] == "terminated"
    await handle.signal(ServiceRunWorkflow.stop)
    assert await last_run_result(env.client, handle.id) == "stopped"
    assert cloud.running() == set()


async def test_a_terminated_services_replicas_go_at_the_reapers_quick_pass(dev_env, cloud_dev):
    """Terminated from the Web UI, a service left its (abandoned) replicas running and routed until the reaper's
    full pass, up to an interval and a grace later (20 min by default). The quick pass, every `closed_seconds`,
    stops them however young; an open service's replicas stay."""
    env, cloud = dev_env, cloud_dev
    gone, alive = await start(env, cloud, "svc-terminated"), await start(env, cloud, "svc-open")
    await wait_ready(gone, {"0": [0], "1": []})
    await wait_ready(alive, {"0": [0], "1": []})
    await gone.terminate(reason="from the Web UI")
    routes, queue = Routes(), f"reaper-{uuid.uuid4()}"
    reaper = ReaperActivities(env.client, {}, None, gateway=routes)
    async with Worker(env.client, task_queue=queue, workflows=[ReaperWorkflow],
                      activities=[reaper.reap_replicas, reaper.reap_closed]):
        handle = await env.client.start_workflow(ReaperWorkflow.run, ReaperInput(
            replicas_queue=queue, interval_seconds=3600, grace_seconds=3600, closed_seconds=1),
            id=f"reaper-{queue}", task_queue=queue)
        await eventually(lambda: _true(cloud.instances.get("svc-terminated/0/r0-s0") == "terminated"))
        stopped = (await handle.query(ReaperWorkflow.last_replicas)).stopped
        assert "service/svc-terminated/0/r0-s0: its service run is terminated" in stopped
        assert "svc-terminated" in routes.deleted and "svc-open" not in routes.deleted
        await handle.terminate("test over")
    assert cloud.instances["svc-open/0/r0-s0"] == "running"
    await alive.signal(ServiceRunWorkflow.stop)
    assert await last_run_result(env.client, alive.id) == "stopped"


class Routes:
    """The gateway's route removal, as the reaper calls it."""

    def __init__(self):
        self.deleted: list[str] = []

    async def delete_service(self, service: str) -> None:
        self.deleted.append(service)


async def test_a_fix_applied_during_a_back_off_starts_at_once(ts_env, cloud):
    """A broken command crash-loops into the longest back-off; the corrected file is applied: it serves
    without waiting for the back-off to end, and `ps` showed the wait while it lasted."""
    name = "svc-fix"
    broken = load_config_text(ROLLING.format(name=name, cmd_a="crash")).config
    handle = await ts_env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=broken)),
        id=service_workflow_id(name), task_queue=cloud.queue)

    async def waiting() -> Optional[ServiceStatus]:
        status = await status_of(handle)
        return status if status.groups[0].retry_after is not None else None

    status = await eventually(waiting)
    assert status.status == "running"  # group b serves; group a waits on its back-off
    result = await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=rolling_config(name)))
    assert result.changed and result.deployment == 1
    status = await wait_ready(handle, {"a": [0, 1], "b": [2]})  # no time skipped: the back-off was lifted
    assert status.groups[0].retry_after is None
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_reapplying_the_running_configuration_is_a_no_op(ts_env, cloud):
    handle = await start_rolling(ts_env, cloud, "svc-same")
    result = await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=rolling_config("svc-same")))
    assert not result.changed and result.deployment == 0
    assert (await status_of(handle)).deployment == 0
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_the_status_says_once_the_gateway_has_the_route(ts_env, cloud):
    """`durastack apply` follows a service until this is set, so a first request after it is never a 404."""
    handle = await start(ts_env, cloud, "svc-routed")
    status = await eventually(lambda: _routed(handle))
    assert ("route", "svc-routed") in cloud.log and status.routed is True
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _routed(handle) -> Optional[ServiceStatus]:
    status = await status_of(handle)
    return status if status.routed is not None else None


async def test_a_failure_retry_does_not_cover_fails_the_service(ts_env, cloud):
    """`retry: {on_events: [no-capacity]}`: a replica that exits is not replaced; the service gives up as dstack
    does, tears every replica down, drops its route and ends as failed, with the reason in its log."""
    name = "svc-giveup"
    config = load_config_text(ROLLING.format(name=name, cmd_a="serve a") + "retry: {on_events: [no-capacity]}\n")
    handle = await ts_env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config.config)),
        id=service_workflow_id(name), task_queue=cloud.queue)
    await wait_ready(handle, {"a": [0, 1], "b": [2]})
    await eventually(lambda: _true(f"{name}/a/r1-s0" in cloud.crash))
    cloud.crash[f"{name}/a/r1-s0"].set()
    await eventually(lambda: _status_is(handle, WorkflowExecutionStatus.COMPLETED))
    assert await handle.result() == "failed"
    assert cloud.running() == set() and cloud.routed == set() and cloud.log[-1] == ("unroute", name)
    assert f"{name}/a/r1-s1" not in cloud.provisions  # not replaced
    messages = [e.message for _, e in sorted(cloud.log_by_seq.items())]
    assert "replica 1 down: exited (1); unrouted, not replaced" in messages
    assert "service failed: replica 1 exited (1); not retried: 'error' is not in retry.on_events" in messages
    assert messages[-1] == "service stopped (failed)" and cloud.rows[name].status == "failed"


async def test_max_duration_stops_the_service_by_itself(ts_env_alone, cloud_alone):
    ts_env, cloud = ts_env_alone, cloud_alone
    name = "svc-maxdur"
    config = load_config_text(CONFIG.format(name=name) + "max_duration: 2h\n").config
    cloud.polling = True  # the monitor polls by server timers, so virtual time can pass
    handle = await ts_env.client.start_workflow(
        # Long heartbeat timeouts: skipped virtual time must not time out the fakes' real-time heartbeats.
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config), heartbeat_seconds=86400),
        id=service_workflow_id(name), task_queue=cloud.queue)
    submitted = (await wait_ready(handle, {"0": [0], "1": []})).submitted_at
    await ts_env.sleep(timedelta(hours=1, minutes=50))
    assert (await status_of(handle)).status == "running" and cloud.running() == {f"{name}/0/r0-s0"}
    await ts_env.sleep(timedelta(minutes=15))
    await eventually(lambda: _status_is(handle, WorkflowExecutionStatus.COMPLETED))
    assert await handle.result() == "stopped"
    assert cloud.running() == set() and cloud.log[-1] == ("unroute", name)
    events = [e for _, e in sorted(cloud.log_by_seq.items())]
    (reached,) = [e for e in events if e.message == "max_duration 2h reached: stopping the service"]
    assert reached.kind == "stop" and timedelta(hours=2) <= reached.at - submitted < timedelta(hours=2, minutes=1)
    assert events[-1].message == "service stopped" and cloud.rows[name].status == "terminated"
