"""`idle_duration` on the time-skipping server with the fake cloud: a replica scaled down leaves its instance idle,
the group's next replica starts on it; idle past `idle_duration`, or when the service stops, it is terminated; a
failed replica's instance is never kept."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from temporalio.client import WorkflowExecutionStatus

from models.loader import load_config_text
from models.messages import ScaleRequest
from models.state import ServiceState
from tests.conftest import eventually
from tests.fakes.cloud import fake_cloud_worker
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONFIG = """
type: service
name: {name}
port: 8000
image: example/llm:latest
{idle}
replicas:
  - name: w
    count: 1..3
    scaling: {{metric: rps, target: 2}}
    commands: [serve]
"""


@pytest.fixture
async def cloud(ts_env_alone):
    async for fake in fake_cloud_worker(ts_env_alone):
        yield fake


async def start(env, cloud, name: str, idle: str = "idle_duration: 10m"):
    config = load_config_text(CONFIG.format(name=name, idle=idle)).config
    cloud.polling = True  # the monitor polls by server timers, so virtual time can pass
    return await env.client.start_workflow(
        # Long heartbeat timeouts: skipped virtual time must not time out the fakes' real-time heartbeats.
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config), heartbeat_seconds=86400),
        id=service_workflow_id(name), task_queue=cloud.queue)


async def serving(handle, *expected: str) -> None:
    async def check():
        status = await handle.query(ServiceRunWorkflow.status)
        got = {f"r{r.replica}-s{r.submission}" for g in status.groups for r in g.replicas
               if r.ready and r.status == "running"}
        return got == set(expected) or None
    await eventually(check)


async def scale(handle, count: int) -> None:
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="w", count=count))


async def until(condition) -> None:
    async def check():
        return condition() or None
    await eventually(check)


async def scaled_down_to_idle(handle, cloud, name: str) -> str:
    """Two replicas, then one: replica 1 leaves its VM idle. Returns that VM."""
    await serving(handle, "r0-s0")
    await scale(handle, 2)
    await serving(handle, "r0-s0", "r1-s0")
    await scale(handle, 1)
    await until(lambda: cloud.instances.get(f"{name}/w/r1-s0") == "idle")
    return cloud.vms[f"{name}/w/r1-s0"]


async def test_a_scale_down_then_up_starts_the_new_replica_on_the_idle_instance(ts_env_alone, cloud):
    name = "idle-reuse"
    handle = await start(ts_env_alone, cloud, name)
    vm = await scaled_down_to_idle(handle, cloud, name)
    assert ("unregister", f"{name}/w/r1-s0") in cloud.log  # it left the gateway first, as any teardown
    (group,) = (await handle.query(ServiceRunWorkflow.status)).groups
    assert [i.split(" until ")[0] for i in group.idle] == [vm]  # what `ps` shows
    # Its workflow, open while it owns the idle instance, is the service's still: the reaper leaves it alone.
    assert f"service/{name}/w/r1-s0" in await handle.query(ServiceRunWorkflow.owned)
    await scale(handle, 2)
    await serving(handle, "r0-s0", "r1-s1")
    assert ("reuse", f"{name}/w/r1-s1") in cloud.log and cloud.vms[f"{name}/w/r1-s1"] == vm
    assert (await handle.query(ServiceRunWorkflow.status)).groups[0].idle == []
    assert sum(cloud.provisions.values()) == 2  # no third VM
    assert cloud.images[vm] == 1  # its image was pulled once, by the first replica
    assert cloud.inputs[f"{name}/w/r1-s1"].reuse is not None
    # The replica that left it ends without terminating it (its new replica runs there).
    old = ts_env_alone.client.get_workflow_handle(f"service/{name}/w/r1-s0")
    await until_closed(old)
    assert ("terminate", f"{name}/w/r1-s0") not in cloud.log
    assert (await handle.query(ServiceRunWorkflow.status)).status == "running"
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"
    assert cloud.running() == set()


async def test_idle_past_idle_duration_is_terminated(ts_env_alone, cloud):
    name = "idle-expire"
    handle = await start(ts_env_alone, cloud, name)
    await scaled_down_to_idle(handle, cloud, name)
    await ts_env_alone.sleep(timedelta(minutes=9))
    assert cloud.instances[f"{name}/w/r1-s0"] == "idle"
    await ts_env_alone.sleep(timedelta(minutes=2))
    await until(lambda: cloud.instances[f"{name}/w/r1-s0"] == "terminated")
    await until_closed(ts_env_alone.client.get_workflow_handle(f"service/{name}/w/r1-s0"))
    events = [e.message for e in await handle.query(ServiceRunWorkflow.events)]
    assert "idle instance of replica 1 terminated" in events
    # The next replica of the group gets a new VM.
    await scale(handle, 2)
    await serving(handle, "r0-s0", "r1-s1")
    assert ("provision", f"{name}/w/r1-s1") in cloud.log
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_stopping_the_service_terminates_its_idle_instances_before_it_ends(ts_env_alone, cloud):
    name = "idle-stop"
    handle = await start(ts_env_alone, cloud, name)
    await scaled_down_to_idle(handle, cloud, name)
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"
    # Terminated by the run itself, before it ended: nothing of the service is left running or idle.
    assert set(cloud.instances.values()) == {"terminated"}
    assert cloud.log.index(("terminate", f"{name}/w/r1-s0")) < cloud.log.index(("unroute", name))
    await until_closed(ts_env_alone.client.get_workflow_handle(f"service/{name}/w/r1-s0"))


async def test_a_failed_replica_is_not_kept_and_unset_idle_duration_keeps_none(ts_env_alone, cloud):
    name = "idle-failed"
    handle = await start(ts_env_alone, cloud, name)
    await serving(handle, "r0-s0")
    cloud.crash.setdefault(f"{name}/w/r0-s0", asyncio.Event()).set()
    await serving(handle, "r0-s1")
    assert cloud.instances[f"{name}/w/r0-s0"] == "terminated"
    assert ("provision", f"{name}/w/r0-s1") in cloud.log
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()

    name = "idle-unset"
    handle = await start(ts_env_alone, cloud, name, idle="")
    await serving(handle, "r0-s0")
    await scale(handle, 2)
    await serving(handle, "r0-s0", "r1-s0")
    await scale(handle, 1)
    await until(lambda: cloud.instances.get(f"{name}/w/r1-s0") == "terminated")
    assert not [e for e in cloud.log if e[0] == "idle"]
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def until_closed(handle) -> None:
    async def check():
        return (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED or None
    await eventually(check)


async def test_a_replica_cancelled_while_its_instance_is_idle_terminates_it(ts_env_alone, cloud):
    name = "idle-cancel"
    handle = await start(ts_env_alone, cloud, name)
    await scaled_down_to_idle(handle, cloud, name)
    old = ts_env_alone.client.get_workflow_handle(f"service/{name}/w/r1-s0")
    await old.cancel()  # from the Web UI, say
    await until(lambda: cloud.instances[f"{name}/w/r1-s0"] == "terminated")
    await handle.signal(ServiceRunWorkflow.stop)
    assert await handle.result() == "stopped"
