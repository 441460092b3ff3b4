"""The gateway route follows the configuration: put at start, and again when an apply changes its settings."""

from __future__ import annotations

import pytest

from models.loader import load_config_text
from models.messages import ApplyRequest
from models.state import ServiceState
from tests.conftest import eventually
from tests.fakes.cloud import fake_cloud_worker
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

CONFIG = "type: service\nname: {name}\nport: 8000\nreplicas: 1\ncommands: [serve]\n"
ROUTED = CONFIG + ("strip_prefix: false\npass_authorization: true\ncold_start_timeout: 30s\nrate_limits:\n"
                   "  - {{prefix: /v1, key: {{type: header, header: X-Key}}, rps: 2, burst: 4}}\n")


@pytest.fixture
async def cloud(ts_env):
    async for fake in fake_cloud_worker(ts_env):
        yield fake


def config(text: str, name: str):
    return load_config_text(text.format(name=name)).config


async def test_an_apply_that_changes_route_settings_puts_the_route_again(ts_env, cloud):
    name = "svc-route"
    state = ServiceState(name=name, config=config(CONFIG, name))
    handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, ServiceRunInput(state=state),
                                                id=service_workflow_id(name), task_queue=cloud.queue)
    await eventually(lambda: _true(len(cloud.routes) == 1))
    first = cloud.routes[0]
    assert first.strip_prefix and not first.pass_authorization and first.rate_limits == []

    result = await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config(ROUTED, name)))
    assert result.changed and result.rolling == []  # route settings restart no replica
    await eventually(lambda: _true(len(cloud.routes) == 2))
    route = cloud.routes[1]
    assert not route.strip_prefix and route.pass_authorization and route.cold_start_timeout == 30
    assert [(r.prefix, r.key, r.header, r.rps, r.burst) for r in route.rate_limits] == [("/v1", "header", "X-Key", 2, 4)]

    # The same configuration again, or a change of counts only, puts nothing.
    await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config(ROUTED, name)))
    await handle.execute_update(ServiceRunWorkflow.apply,
                                ApplyRequest(config=config(ROUTED.replace("replicas: 1", "replicas: 2"), name)))
    await eventually(lambda: _true(cloud.running() == {f"{name}/0/r0-s0", f"{name}/0/r1-s0"}))
    assert len(cloud.routes) == 2
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_route_the_gateway_refuses_is_noted_and_the_service_goes_on(ts_env, cloud):
    name = "svc-route-refused"
    state = ServiceState(name=name, config=config(CONFIG, name))
    handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, ServiceRunInput(state=state),
                                                id=service_workflow_id(name), task_queue=cloud.queue)
    await eventually(lambda: _true(cloud.running() == {f"{name}/0/r0-s0"}))
    cloud.refuse_routes = "gateway answered 422: rate_limits: extra inputs are not permitted"
    await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config(ROUTED, name)))

    async def noted():
        events = await handle.query(ServiceRunWorkflow.events)
        return [e.message for e in events if e.kind == "rejected"]
    assert "422" in (await eventually(noted))[0]
    cloud.refuse_routes = ""
    # Not asked again for the same settings; the loop goes on (a scale still works).
    await handle.execute_update(ServiceRunWorkflow.apply,
                                ApplyRequest(config=config(ROUTED.replace("replicas: 1", "replicas: 2"), name)))
    await eventually(lambda: _true(len(cloud.running()) == 2))
    assert len(cloud.routes) == 1
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_crash_looping_service_puts_why_on_its_route_and_a_fix_clears_it(ts_env, cloud):
    """The gateway answers 503 with the reason instead of holding requests for replicas that keep failing; the
    route is put once per change of the reason, not at every pass."""
    name = "svc-route-crash"
    state = ServiceState(name=name, config=config(CONFIG.replace("[serve]", "[crash]"), name))
    handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, ServiceRunInput(state=state),
                                                id=service_workflow_id(name), task_queue=cloud.queue)
    await eventually(lambda: _true(any("next attempt at" in r.unavailable for r in cloud.routes)))
    assert cloud.routes[0].unavailable == ""  # put at start, before any failure: a first start is held
    why = next(r.unavailable for r in cloud.routes if r.unavailable)
    assert why.startswith("group '0': replica 0 exited (1)"), why
    events = await handle.query(ServiceRunWorkflow.events)
    assert any(e.kind == "route" and "503" in e.message for e in events)
    reasons = [r.unavailable for r in cloud.routes]
    assert all(a != b for a, b in zip(reasons, reasons[1:])), reasons  # each put says something new

    await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=config(CONFIG, name)))
    await eventually(lambda: _true(len(cloud.running()) == 1))
    await eventually(lambda: _true(cloud.routes[-1].unavailable == ""))  # the fix: held, then served
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _true(value: bool):
    return value or None
