"""Router services (PD disaggregation) on the time-skipping server with the fake cloud: only the router group
is registered with the gateway, workers roll one at a time, and replica addresses in commands wait, are
substituted, and roll their referrers when they move."""

from __future__ import annotations

import asyncio
import json

import pytest

from models.loader import load_config_text
from models.messages import ApplyRequest, ScaleRequest
from models.state import ServiceState
from tests.conftest import eventually
from tests.fakes.cloud import fake_cloud_worker
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROUTER = "${{ groups[router].replicas[0].IP_ADDRESS }}:${{ groups[router].replicas[0].PORT }}"
PD = """
type: service
name: {name}
port: 8000
groups:
  - name: router
    replicas: 1
    router: {{type: sglang}}
    commands: ["route {version}"]
  - name: prefill
    replicas: 1
    commands: [{prefill}]
  - name: decode
    replicas: 1..2
    scaling: {{metric: rps, target: 2}}
    commands: [{decode}]
"""


def pd_config(name: str, version: str = "v1", decode: str = "decode v1", prefill: str = "prefill") -> dict:
    text = PD.format(name=name, version=version, decode=json.dumps(decode), prefill=json.dumps(prefill))
    result = load_config_text(text)
    assert result.valid, [str(e) for e in result.errors]
    return result.config.model_dump(mode="json")


@pytest.fixture
async def cloud(ts_env):
    async for fake in fake_cloud_worker(ts_env):
        yield fake


async def start(env, cloud, name: str, **kw):
    config = load_config_text(PD.format(name=name, version="v1", decode=json.dumps(kw.get("decode", "decode v1")),
                                        prefill=json.dumps(kw.get("prefill", "prefill")))).config
    return await env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config)),
        id=service_workflow_id(name), task_queue=cloud.queue)


async def status_of(handle):
    return await handle.query(ServiceRunWorkflow.status)


async def ready(handle, expected: dict[str, list[int]]):
    async def check():
        status = await status_of(handle)
        got = {g.name: sorted(r.replica for r in g.replicas if r.ready and r.status == "running")
               for g in status.groups}
        return status if got == expected else None
    return await eventually(check)


async def events(handle, kind: str = "") -> list[str]:
    return [e.message for e in await handle.query(ServiceRunWorkflow.events) if not kind or e.kind == kind]


async def test_only_the_router_group_is_registered_and_ps_says_which_routes(ts_env, cloud):
    handle = await start(ts_env, cloud, "pd-route")
    status = await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    assert [g.role for g in status.groups] == ["router", "worker", "worker"]
    assert cloud.routed == {"pd-route/router/r0-s0"}
    assert [op for op, rid in cloud.log if rid == "pd-route/decode/r2-s0"] == ["provision", "ready"]
    # Workers are watched as the router is: a dead worker is replaced (and never registered).
    cloud.crash.setdefault("pd-route/decode/r2-s0", asyncio.Event()).set()
    await eventually(lambda: _true("pd-route/decode/r2-s1" in cloud.provisions))
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    assert cloud.routed == {"pd-route/router/r0-s0"}
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def router_lists(handle, count: int):
    """The router replica lists ``count`` healthy workers (the workers serve only then)."""
    async def check():
        view = (await status_of(handle)).router
        return view is not None and [len(r.healthy()) for r in view.routers] == [count]
    await eventually(check)


async def test_workers_roll_one_at_a_time_behind_the_router(ts_env, cloud):
    handle = await start(ts_env, cloud, "pd-roll")
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    await router_lists(handle, 2)
    result = await handle.execute_update(ServiceRunWorkflow.apply,
                                         ApplyRequest(config=pd_config("pd-roll", decode="decode v2")))
    assert result.rolling == ["groups.decode.commands"] and (result.kept, result.replacing) == (2, 1)
    await eventually(lambda: _true(cloud.instances.get("pd-roll/decode/r2-s0") == "terminated"))
    status = await ready(handle, {"router": [0], "prefill": [1], "decode": [3]})
    assert cloud.max_alive["decode"] == 2  # desired 1 + surge 1
    # The ready old worker kept working until its replacement was ready, and no worker was ever registered.
    log = [(op, rid) for op, rid in cloud.log if "/decode/" in rid]
    assert log.index(("ready", "pd-roll/decode/r3-s0")) < log.index(("terminate", "pd-roll/decode/r2-s0"))
    assert cloud.routed == {"pd-roll/router/r0-s0"} and not any(g.rollout for g in status.groups)
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_a_reference_waits_for_an_address_and_is_substituted(ts_env, cloud):
    handle = await start(ts_env, cloud, "pd-refs", prefill=f"prefill --router {ROUTER}")
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    # The prefill worker started only after the router had an address, with it in its commands; decode, which
    # names nobody, waited too: all replicas go where the first one (the router) was placed.
    router_ip = cloud.ips["pd-refs/router/r0-s0"]
    assert cloud.commands["pd-refs/prefill/r1-s0"] == [f"prefill --router {router_ip}:8000"]
    assert cloud.log.index(("provision", "pd-refs/router/r0-s0")) < \
        cloud.log.index(("provision", "pd-refs/prefill/r1-s0"))
    waits = await events(handle, "wait")
    assert waits and waits[0].startswith("a replica cannot start yet: groups[router].replicas[0] ")
    assert any(m == f"replica 1 starts with groups[router].replicas[0].IP_ADDRESS = {router_ip}, "
                    "groups[router].replicas[0].PORT = 8000" for m in await events(handle, "replica"))
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_replacing_a_referenced_replica_rolls_its_referrers_and_says_why(ts_env, cloud):
    handle = await start(ts_env, cloud, "pd-move", prefill=f"prefill --router {ROUTER}")
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    await router_lists(handle, 2)
    # The router's configuration changes: it rolls, gets a new address, and the prefill worker follows it.
    result = await handle.execute_update(ServiceRunWorkflow.apply, ApplyRequest(config=pd_config(
        "pd-move", version="v2", prefill=f"prefill --router {ROUTER}")))
    # The plan says so: the router is replaced, and the prefill worker that names it rolls after it.
    assert (result.kept, result.replacing, result.following) == (2, 1, {"prefill": 1})
    assert "1 roll, then 1 in prefill naming them" in (await events(handle, "apply"))[-1]
    await eventually(lambda: _true(cloud.instances.get("pd-move/prefill/r1-s0") == "terminated"))
    status = await ready(handle, {"router": [3], "prefill": [4], "decode": [2]})
    assert status.groups[1].rollout == "" and status.groups[1].waiting == ""
    old_ip, new_ip = cloud.ips["pd-move/router/r0-s0"], cloud.ips["pd-move/router/r3-s0"]
    assert old_ip != new_ip and cloud.commands["pd-move/prefill/r4-s0"] == [f"prefill --router {new_ip}:8000"]
    rolls = [m for m in await events(handle, "rollout") if "replica their commands reference" in m]
    assert rolls == ["replicas roll: a replica their commands reference was replaced "
                     f"(groups[router].replicas[0].IP_ADDRESS {old_ip} → {new_ip})"]
    # The old worker kept working until the new one was ready (surge rules).
    assert cloud.log.index(("ready", "pd-move/prefill/r4-s0")) < cloud.log.index(("terminate", "pd-move/prefill/r1-s0"))
    assert cloud.provisions.get("pd-move/decode/r2-s0") == 1  # decode names nobody: untouched
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


MUTUAL = """
type: service
name: {name}
port: 8000
groups:
  - name: router
    replicas: 1
    router: {{type: dynamo}}
    commands: ["frontend --first-prefill ${{{{ groups[prefill].replicas[0].IP_ADDRESS }}}} --literal $${{{{ x }}}}"]
  - name: prefill
    replicas: 1
    commands: ["prefill --etcd $DSTACK_ROUTER_INTERNAL_IP"]
  - name: decode
    replicas: 2
    commands: ["decode --node0 ${{{{ groups[decode].replicas[0].IP_ADDRESS }}}}"]
"""


async def test_references_in_a_cycle_resolve_once_each_replica_is_placed(ts_env, cloud):
    # dstack's shapes: a Dynamo router and a worker naming each other ($DSTACK_ROUTER_INTERNAL_IP is the router's
    # address), and a group whose nodes all join its replicas[0], itself included.
    name = "pd-cycle"
    config = load_config_text(MUTUAL.format(name=name))
    assert config.valid, [str(e) for e in config.errors]
    handle = await ts_env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=config.config)),
        id=service_workflow_id(name), task_queue=cloud.queue)
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2, 3]})
    ip = {g: cloud.ips[f"{name}/{g}"] for g in ("router/r0-s0", "prefill/r1-s0", "decode/r2-s0", "decode/r3-s0")}
    assert cloud.commands[f"{name}/router/r0-s0"] == [f"frontend --first-prefill {ip['prefill/r1-s0']} "
                                                      "--literal ${{ x }}"]
    assert cloud.envs[f"{name}/prefill/r1-s0"]["DSTACK_ROUTER_INTERNAL_IP"] == ip["router/r0-s0"]
    assert cloud.envs[f"{name}/prefill/r1-s0"]["DURASTACK_ROUTER_INTERNAL_IP"] == ip["router/r0-s0"]
    assert cloud.commands[f"{name}/decode/r2-s0"] == [f"decode --node0 {ip['decode/r2-s0']}"]  # node 0: itself
    assert cloud.commands[f"{name}/decode/r3-s0"] == [f"decode --node0 {ip['decode/r2-s0']}"]
    started = await events(handle, "replica")
    assert f"replica 3 starts with groups[decode].replicas[0].IP_ADDRESS = {ip['decode/r2-s0']}" in started
    # Only decode waited to be launched, for the router (which does not name it back), as did all for one place.
    assert cloud.envs[f"{name}/decode/r3-s0"]["DSTACK_ROUTER_INTERNAL_IP"] == ip["router/r0-s0"]
    assert not [w for w in await events(handle, "wait") if "prefill" in w or "decode" in w], await events(handle)
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_the_first_replica_goes_to_a_place_apply_found_for_all_and_the_rest_follow_it(ts_env, cloud):
    name = "pd-places"
    config = load_config_text(PD.format(name=name, version="v1", decode='"decode"', prefill='"prefill"')).config
    # As `apply` plans it (backends/catalog/plan.one_place): the places that hold every group, cheapest first.
    state = ServiceState(name=name, config=config, places=["aws/us-west-2", "local/local"])
    handle = await ts_env.client.start_workflow(ServiceRunWorkflow.run, ServiceRunInput(state=state),
                                                id=service_workflow_id(name), task_queue=cloud.queue)
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    first = cloud.inputs[f"{name}/router/r0-s0"]  # this deployment serves local only: aws is not tried
    assert (first.launch_on, first.regions) == (["local"], ["us-west-2", "local"])
    assert [(i.launch_on, i.regions) for rid, i in cloud.inputs.items() if "router" not in rid] == \
        [(["local"], ["local"])] * 2  # where the first landed
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _true(value: bool) -> bool:
    return value


async def test_the_kept_router_learns_scale_steps_and_a_worker_leaves_it_before_it_stops(ts_env, cloud):
    handle = await start(ts_env, cloud, "pd-sync")
    await ready(handle, {"router": [0], "prefill": [1], "decode": [2]})
    await router_lists(handle, 2)
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=2))
    await router_lists(handle, 3)
    assert [m for m in await events(handle, "router") if "decode replica 3" in m] == [
        "router r0: added decode replica 3"]
    await handle.execute_update(ServiceRunWorkflow.scale, ScaleRequest(group="decode", count=1))
    await router_lists(handle, 2)
    victim = next(rid for op, rid in cloud.log if op == "terminate" and "/decode/" in rid)
    # It left the router before it stopped: by its own leave, or by the sync that no longer wants it (the two race;
    # whichever comes first removes it, the other finds it gone).
    left = [i for i, (op, x) in enumerate(cloud.log)
            if (op, x) == ("router_leave", victim) or (op == "router_remove" and f"//{cloud.ips[victim]}:" in x)]
    assert left and left[0] < cloud.log.index(("terminate", victim)), cloud.log
    assert ("router_add", f"http://{cloud.ips[victim]}:8000") not in cloud.log[left[0]:]  # an older sync put it back
    # A router that cannot be reached is said once and tried again; it is never restarted for it.
    cloud.router_down.add("pd-sync/router/r0-s0")
    await eventually(lambda: _any_event(handle, "router r0 not reached: connection refused (trying again)"))
    cloud.router_down.clear()
    await eventually(lambda: _any_event(handle, "router r0 reached again"))
    assert cloud.provisions["pd-sync/router/r0-s0"] == 1
    # Stop: the router leaves the gateway and stops first, then the workers behind it.
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()
    terminated = [rid for op, rid in cloud.log if op == "terminate"]
    assert terminated[-3] == "pd-sync/router/r0-s0" and len(terminated) == 4


async def _any_event(handle, message: str) -> bool:
    return message in await events(handle, "router")
