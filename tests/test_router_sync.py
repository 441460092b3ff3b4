"""The router sync against the real router: SGLang's model gateway (`smg`, from PyPI) started with no workers, and
stand-in SGLang engines (examples/pd-disaggregation/engine.py) that answer what it asks. Only the engines are
stand-ins: every worker-API call, health check and PD request goes through the real gateway."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from activities.router import RouterActivities
from backends.engine_metrics import requests_in_flight
from models.replica import LocalInstance
from models.router import RouterLeave, RouterSyncInput, RouterTarget, RouterView, RouterWorker
from tests.conftest import eventually, tool
from tests.standins import Processes, free_port


def _instance(port: int) -> LocalInstance:
    return LocalInstance(replica_id=f"svc/g/r{port}-s0", pid=0, start_time=0, work_dir="/nonexistent",
                         address=f"127.0.0.1:{port}", isolated=False, log_path="/nonexistent")


class Procs(Processes):
    def router(self) -> int:
        port = free_port()
        # round robin: the default cache-aware policy sends a test's alike prompts to one worker
        self.spawn([tool("smg"), "launch", "--pd-disaggregation", "--policy", "round_robin", "--host", "127.0.0.1",
                    "--port", str(port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())])
        return port

    def old_router(self) -> int:
        """SGLang's router before the model gateway (sglang-router 0.1.9): only /add_worker, /list_workers and
        /remove_worker; it answers 404 to /workers."""
        pytest.importorskip("sglang_router", reason="pip install -e '.[test]'")
        port = free_port()
        self.spawn([sys.executable, "-m", "sglang_router.launch_router", "--policy", "round_robin", "--host",
                    "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
                    str(free_port())])
        return port

    def engine(self, mode: str, latency: float = 0.02) -> int:
        return self.start_engine(mode, latency=latency)[0]


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.stop_all()


async def _answers(port: int, path: str) -> bool:
    async with httpx.AsyncClient(timeout=1) as c:
        try:
            return (await c.get(f"http://127.0.0.1:{port}{path}")).status_code < 500
        except httpx.HTTPError:
            return False


async def _up(*ports: int) -> None:
    for port in ports:
        await eventually(lambda: _answers(port, "/health"))


def _worker(port: int, group: str, num: int) -> RouterWorker:
    return RouterWorker(replica_num=num, submission_num=0, group=group, url=f"http://127.0.0.1:{port}",
                        instance=_instance(port))


def _target(port: int, num: int = 0) -> RouterTarget:
    return RouterTarget(replica_num=num, submission_num=0, instance=_instance(port))


def _sync_input(routers: list[RouterTarget], workers: list[RouterWorker], known=None) -> RouterSyncInput:
    return RouterSyncInput(service="svc", backend="local", routers=routers, workers=workers,
                           known=known or RouterView(), poll_seconds=0.2)


def _activities() -> RouterActivities:
    return RouterActivities(lambda backend: (lambda instance: (instance.address, None)))


async def _in_sync(acts: RouterActivities, inp: RouterSyncInput) -> RouterView:
    """Sync until what the routers list is healthy and stable (the gateway checks a worker's health before it
    marks it healthy)."""
    env = ActivityEnvironment()
    view = await env.run(acts.sync, inp)
    while not all(r.reachable and len(r.healthy()) == len(inp.workers) for r in view.routers):
        view = await env.run(acts.sync, inp.model_copy(update={"known": view.without_changes()}))
    return view


async def _complete(router: int) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as c:
        return await c.post(f"http://127.0.0.1:{router}/v1/completions",
                            json={"model": "standin", "prompt": "hi", "max_tokens": 4})


async def test_an_empty_router_learns_its_workers_and_their_roles_then_routes_through_them(procs):
    router, prefill, decode = procs.router(), procs.engine("prefill"), procs.engine("decode")
    await _up(router, prefill, decode)
    async with httpx.AsyncClient() as c:  # started with no workers: it cannot serve
        assert (await c.get(f"http://127.0.0.1:{router}/readiness")).status_code == 503
    acts = _activities()
    view = await _in_sync(acts, _sync_input([_target(router)], [_worker(prefill, "prefill", 1),
                                                                  _worker(decode, "decode", 2)]))
    roles = {w.url: w.worker_type for w in view.routers[0].workers}
    assert roles == {f"http://127.0.0.1:{prefill}": "prefill", f"http://127.0.0.1:{decode}": "decode"}
    r = await _complete(router)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("decoded ")
    async with httpx.AsyncClient() as c:
        assert (await c.get(f"http://127.0.0.1:{router}/readiness")).status_code == 200


async def test_a_scale_step_and_a_replacement_change_the_list_without_restarting_the_router(procs):
    router, prefill = procs.router(), procs.engine("prefill")
    decodes = [procs.engine("decode") for _ in range(3)]
    await _up(router, prefill, *decodes)
    acts = _activities()
    workers = [_worker(prefill, "prefill", 1), _worker(decodes[0], "decode", 2)]
    view = await _in_sync(acts, _sync_input([_target(router)], workers))
    # decode 1 → 3: both new ones are listed and take requests
    workers += [_worker(decodes[1], "decode", 3), _worker(decodes[2], "decode", 4)]
    view = await _in_sync(acts, _sync_input([_target(router)], workers, view))
    assert sorted(w.url for w in view.routers[0].workers) == sorted(w.url for w in workers)
    served = set()
    for _ in range(24):
        r = await _complete(router)
        assert r.status_code == 200
        served.add(r.headers.get("x-smg-routed-worker-id"))
    assert {f"http://127.0.0.1:{p}" for p in decodes} <= served  # all three decode workers take requests
    # decode 2 replaced by another: the old one is removed, the new one added, the router never restarted
    replacement = procs.engine("decode")
    await _up(replacement)
    workers = [w for w in workers if w.replica_num != 2] + [_worker(replacement, "decode", 5)]
    env = ActivityEnvironment()
    view = await env.run(acts.sync, _sync_input([_target(router)], workers, view))
    assert f"router r0: removed http://127.0.0.1:{decodes[0]}" in view.changes
    assert any(c.startswith("router r0: added decode replica 5") for c in view.changes)
    assert procs.started[0].poll() is None


async def test_a_router_that_is_down_is_said_and_retried_and_a_new_router_starts_from_the_full_list(procs):
    prefill, decode = procs.engine("prefill"), procs.engine("decode")
    dead = free_port()  # nothing listens there
    await _up(prefill, decode)
    acts, workers = _activities(), [_worker(prefill, "prefill", 1), _worker(decode, "decode", 2)]
    view = await ActivityEnvironment().run(acts.sync, _sync_input([_target(dead)], workers))
    assert not view.routers[0].reachable and "GET /workers" in view.routers[0].error and not view.changes
    # Nothing changed since: the sync keeps trying and does not return (no history while a router is down).
    task = asyncio.ensure_future(ActivityEnvironment().run(acts.sync, _sync_input([_target(dead)], workers, view)))
    await asyncio.sleep(1.0)
    assert not task.done()
    task.cancel()
    # The replacement router (new address, starts empty) is given every worker.
    router = procs.router()
    await _up(router)
    view = await _in_sync(acts, _sync_input([_target(router, 3)], workers, view))
    assert len(view.routers[0].healthy()) == 2
    assert (await _complete(router)).status_code == 200


async def test_a_worker_leaves_the_router_before_it_stops_and_its_requests_in_flight_finish(procs):
    router, prefill = procs.router(), procs.engine("prefill")
    slow, other = procs.engine("decode", latency=1.5), procs.engine("decode", latency=1.5)
    await _up(router, prefill, slow, other)
    acts = _activities()
    workers = [_worker(prefill, "prefill", 1), _worker(slow, "decode", 2), _worker(other, "decode", 3)]
    await _in_sync(acts, _sync_input([_target(router)], workers))
    flights = [asyncio.ensure_future(_complete(router)) for _ in range(6)]

    async def busy() -> bool:
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{slow}/metrics")).text
        return (requests_in_flight(text) or 0) > 0
    await eventually(busy)
    started = time.monotonic()
    await ActivityEnvironment().run(acts.leave, "local", RouterLeave(routers=[_target(router)],
                                                                     url=f"http://127.0.0.1:{slow}"),
                                    30.0, _instance(slow))
    async with httpx.AsyncClient() as c:
        listed = [w["url"] for w in (await c.get(f"http://127.0.0.1:{router}/workers")).json()["workers"]]
        text = (await c.get(f"http://127.0.0.1:{slow}/metrics")).text
    assert f"http://127.0.0.1:{slow}" not in listed and requests_in_flight(text) == 0
    assert time.monotonic() - started < 10
    assert [f.status_code for f in await asyncio.gather(*flights)] == [200] * 6


async def test_an_older_router_is_synced_through_its_older_worker_api(procs):
    router, first, second = procs.old_router(), procs.engine("null"), procs.engine("null")
    await _up(router, first, second)
    acts = _activities()
    workers = [_worker(first, "workers", 1), _worker(second, "workers", 2)]
    view = await _in_sync(acts, _sync_input([_target(router)], workers))
    assert sorted(w.url for w in view.routers[0].workers) == sorted(w.url for w in workers)
    assert {w.worker_type for w in view.routers[0].workers} == {"regular"}  # no disaggregation: regular
    assert (await _complete(router)).status_code == 200
    view = await _in_sync(acts, _sync_input([_target(router)], workers[1:], view))
    assert f"router r0: removed http://127.0.0.1:{first}" in view.changes
    async with httpx.AsyncClient() as c:
        assert (await c.get(f"http://127.0.0.1:{router}/list_workers")).json()["urls"] == [f"http://127.0.0.1:{second}"]


def test_the_engines_in_flight_requests_are_read_in_vllm_and_sglang_names():
    vllm = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.25
"""
    sglang = ('# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m",tp_rank="0"} 4\n'
              '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m",tp_rank="0"} 0\n')
    assert requests_in_flight(vllm) == 6.0
    assert requests_in_flight(sglang) == 4.0
    assert requests_in_flight("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n") is None
    assert json.dumps(requests_in_flight(sglang))  # a plain number
