"""Groups scaling on their engines' own signals, on the time-skipping server with the fake cloud: prefill and
decode behind a router scale apart, each on its replicas' readings; an unread replica counts as the average one;
an engine without the names is said once; a group at zero wakes on the first request and sleeps when idle."""

from __future__ import annotations

import pytest

from models.loader import load_config_text
from models.state import NOT_READ_YET, ServiceState
from tests.conftest import eventually
from tests.fakes.cloud import fake_cloud_worker
from workflows.service import ServiceRunInput, ServiceRunWorkflow, service_workflow_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

PD = """
type: service
name: {name}
port: 8000
groups:
  - name: router
    replicas: 1
    commands: ["route"]
  - name: prefill
    replicas: {prefill}..4
    scaling: {{metric: queue, target: 2, window: 30s, scale_up_delay: 0s, scale_down_delay: 0s}}
    commands: ["prefill"]
  - name: decode
    replicas: 1..4
    scaling: {{metric: itl, target: 0.05, window: 30s, scale_up_delay: 0s, scale_down_delay: 0s}}
    metrics: {{path: /engine/metrics}}
    commands: ["decode"]
"""
ASLEEP = """
type: service
name: {name}
port: 8000
replicas: 0..2
scaling: {{metric: running, target: 4, window: 10s, scale_up_delay: 0s, scale_down_delay: 0s}}
commands: ["serve"]
"""


@pytest.fixture
async def cloud(ts_env):
    async for fake in fake_cloud_worker(ts_env):
        yield fake


async def start(env, cloud, text: str, name: str, prefill: int = 1):
    result = load_config_text(text.format(name=name, prefill=prefill))
    assert result.valid, [str(e) for e in result.errors]
    return await env.client.start_workflow(
        ServiceRunWorkflow.run, ServiceRunInput(state=ServiceState(name=name, config=result.config)),
        id=service_workflow_id(name), task_queue=cloud.queue)


async def desired(handle) -> dict[str, int]:
    return {g.name: g.desired for g in (await handle.query(ServiceRunWorkflow.status)).groups}


async def events(handle, kind: str) -> list[str]:
    return [f"{e.group}: {e.message}" for e in await handle.query(ServiceRunWorkflow.events) if e.kind == kind]


def until_desired(handle, expected: dict[str, int]):
    async def check():
        return await desired(handle) == expected
    return eventually(check)


async def test_prefill_and_decode_scale_apart_on_their_own_engines(ts_env, cloud):
    name = "pd-engines"
    cloud.engine_default = NOT_READ_YET  # a replica just started, as a latency's first reading leaves it
    handle = await start(ts_env, cloud, PD, name)
    cloud.engines.update({f"{name}/prefill/r1-s0": 1.0, f"{name}/decode/r2-s0": 0.02})
    await until_desired(handle, {"router": 1, "prefill": 1, "decode": 1})
    # Prefill's queue grows to 7 waiting: ceil(7 / 2) = 4. Decode's ITL is within its target: it stays.
    cloud.engines[f"{name}/prefill/r1-s0"] = 7.0
    await until_desired(handle, {"router": 1, "prefill": 4, "decode": 1})
    scale = await events(handle, "scale")
    assert "prefill: 1 → 4: target; queue 7 over 30s (r1 7), target 2" in scale, scale
    # Decode's p90 ITL at 0.12 s on its one replica: ceil(1 × 0.12 / 0.05) = 3; prefill drains to 1 waiting each.
    for rid in cloud.provisions:
        if "/prefill/" in rid:
            cloud.engines[rid] = 0.5
    cloud.engines[f"{name}/decode/r2-s0"] = 0.12
    await until_desired(handle, {"router": 1, "prefill": 1, "decode": 3})
    scale = await events(handle, "scale")
    assert "decode: 1 → 3: target; itl 1 × 0.12 over 30s (r2 0.12), target 0.05" in scale, scale
    assert any(m.startswith("prefill: 4 → 1: target; queue 2 over 30s (r1 0.5, r") for m in scale), scale
    # The new decode replicas were not counted until read (they had taken no load); read, with the load spread
    # to 0.04 s each, the group holds at ceil(3 × 0.04 / 0.05) = 3 rather than chase its own growth.
    decode = [rid for rid in cloud.provisions if "/decode/" in rid]
    cloud.engines.update({rid: 0.04 for rid in decode})
    await eventually(lambda: _signal_reads(handle, "decode", "itl 3 × 0.04 over 30s"))
    assert await desired(handle) == {"router": 1, "prefill": 1, "decode": 3}
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def test_an_unread_replica_counts_as_the_average_and_is_said(ts_env, cloud):
    name = "pd-unread"
    cloud.engine_default = 1.0
    cloud.engines[f"{name}/decode/r3-s0"] = 0.02
    handle = await start(ts_env, cloud, PD, name, prefill=2)
    await until_desired(handle, {"router": 1, "prefill": 2, "decode": 1})
    first, second = f"{name}/prefill/r1-s0", f"{name}/prefill/r2-s0"
    # The second prefill cannot be read; the first reads 3 waiting: the group counts 2 × 3 = 6 → 3 replicas.
    cloud.engines.update({first: 3.0, second: "unreachable: ConnectError"})
    await until_desired(handle, {"router": 1, "prefill": 3, "decode": 1})
    said = await events(handle, "engine")
    assert "prefill: replica 2: engine not read: unreachable: ConnectError (counted as the group's average)" in said
    assert any("prefill: 2 → 3: target; queue 6 over 30s (r1 3, r2 unread (unreachable: ConnectError); 1 unread "
               "counted as the average)" in m for m in await events(handle, "scale")), await events(handle, "scale")
    cloud.engines[second] = 1.0
    await eventually(lambda: _said(handle, "prefill: replica 2: engine read again"))
    # An engine without the names is said once for the group, however many replicas say it.
    cloud.engines[f"{name}/decode/r3-s0"] = \
        "none of vllm:inter_token_latency_seconds (a histogram) in the engine's metrics"
    await eventually(lambda: _said(handle, "decode: the engines expose none of the names"))
    assert len([m for m in await events(handle, "engine") if m.startswith("decode:") and "expose none" in m]) == 1
    status = await handle.query(ServiceRunWorkflow.status)
    signals = {g.name: g.signal for g in status.groups}
    assert signals["prefill"].startswith("queue ") and signals["decode"].startswith("itl: no replica read")
    assert signals["router"] == ""
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()


async def _signal_reads(handle, group: str, start: str) -> bool:
    status = await handle.query(ServiceRunWorkflow.status)
    return next(g.signal for g in status.groups if g.name == group).startswith(start)


async def _said(handle, start: str) -> bool:
    return any(m.startswith(start) for m in await events(handle, "engine"))


async def test_a_group_at_zero_wakes_on_the_first_request_and_sleeps_when_idle(ts_env, cloud):
    name = "asleep"
    handle = await start(ts_env, cloud, ASLEEP, name)
    await until_desired(handle, {"0": 0})
    # the gateway holds the first request: the group wakes (an engine metric alone never would), on the gateway's
    # shortest window that holds the engine's 10 s
    cloud.rps = 0.5
    await until_desired(handle, {"0": 1})
    assert any("0 → 1: from zero; a request arrived" in m for m in await events(handle, "scale"))
    cloud.engines[f"{name}/0/r0-s0"] = 9.0  # 9 in flight: ceil(9 / 4) = 3, clamped to 2
    await until_desired(handle, {"0": 2})
    for rid in list(cloud.provisions):  # idle engines, but requests still arrive: one replica stays
        cloud.engines[rid] = 0.0
    await until_desired(handle, {"0": 1})
    assert any(m.startswith("0: 2 → 1: target; running 0 over 10s") and m.endswith("requests still arrive (rps 0.50)")
               for m in await events(handle, "scale")), await events(handle, "scale")
    cloud.rps = 0.0  # none arrives any more: it sleeps
    await until_desired(handle, {"0": 0})
    await handle.signal(ServiceRunWorkflow.stop)
    await handle.result()
