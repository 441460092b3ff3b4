"""The Dynamo-shaped stand-in (examples/pd-disaggregation/dynamo-standin.yml) end to end, from the CLI: a router
group (`router: {type: dynamo}`) running an etcd stand-in and an OpenAI frontend, and prefill and decode groups
whose workers find etcd at $DSTACK_ROUTER_INTERNAL_IP, as dstack's Dynamo example has them do. durastack does not
touch the router's worker list here: the workers register themselves, so the frontend listing them proves they
were given the router's address. A decode scale step reaches the frontend through etcd alone.

The replicas run isolated on their service's network (the default as root), so etcd, the frontend and the workers
listen inside their own namespaces, never on the host.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e import Stack, isolated_stack, python_scripts, ready, until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "pd-disaggregation"
STANDIN = EXAMPLE / "dynamo-standin.yml"
NAME = "dynamo-standin"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    gen = isolated_stack(tmp_path_factory, {"PD_EXAMPLE": str(EXAMPLE)}, "the stand-in's etcd, frontend and workers")
    s = next(gen)
    yield s
    next(gen, None)
    assert processes(s.home) == {}


def processes(home: Path) -> dict[int, dict[str, str]]:
    """PID → env of this home's dynamo.py processes."""
    return python_scripts(home, "dynamo.py")


def client(stack: Stack) -> httpx.Client:
    return httpx.Client(base_url=f"{stack.gateway}/services/{NAME}", timeout=30,
                        headers={"Authorization": f"Bearer {stack.token()}"})


def instances(stack: Stack) -> list[dict]:
    """The workers the frontend finds in its etcd (its /health), asked through the gateway."""
    with client(stack) as c:
        answer = c.get("/health")
    return answer.json()["instances"] if answer.status_code == 200 else []


def roles(stack: Stack) -> list[str]:
    return sorted(i["disaggregation_mode"] for i in instances(stack))


def complete(stack: Stack, n: int) -> list[httpx.Response]:
    with client(stack) as c:
        return [c.post("/v1/completions", json={"model": "standin", "prompt": f"hi {i}", "max_tokens": 4})
                for i in range(n)]


def test_workers_find_the_dynamo_router_register_scale_and_serve(stack):
    applied = stack.cli("apply", "-f", str(STANDIN), "-y")
    assert applied.returncode == 0, applied.stderr
    until(lambda: [len(r) for r in ready(stack.ps(NAME)).values()] == [1, 1, 1], 120, 0.5, "all groups ready")
    status = stack.ps(NAME)
    assert [(g["name"], g["role"]) for g in status["groups"]] == \
        [("router", "router"), ("prefill", "worker"), ("decode", "worker")]
    assert [u["replica_id"] for u in stack.routes()[NAME]["upstreams"]] == [f"{NAME}/router/r0-s0"]

    # The workers were given the router replica's address, and registered in the etcd it runs.
    procs = processes(stack.home).values()
    router_ip = next(p["DURASTACK_REPLICA_IP"] for p in procs if p["DURASTACK_GROUP"] == "router")
    workers = [p for p in procs if p["DURASTACK_GROUP"] != "router"]
    assert router_ip and len(workers) == 2
    for env in workers:
        assert env["DSTACK_ROUTER_INTERNAL_IP"] == env["DURASTACK_ROUTER_INTERNAL_IP"] == router_ip
        assert env["ETCD_ENDPOINTS"] == f"http://{router_ip}:2379"
    until(lambda: roles(stack) == ["decode", "prefill"], 30, 0.5, "the frontend lists 1 prefill + 1 decode")
    assert sorted(i["url"] for i in instances(stack)) == \
        sorted(f"http://{w['DURASTACK_REPLICA_IP']}:8000" for w in workers)
    with client(stack) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["standin"]
    answers = complete(stack, 4)
    assert [r.status_code for r in answers] == [200] * 4, answers[-1].text
    assert all(r.json()["choices"][0]["text"].startswith("decoded ") for r in answers)  # prefill's KV, then decode

    # decode 1 → 2: the new worker registers itself and the frontend sends requests to both
    assert stack.cli("scale", NAME, "decode", "2").returncode == 0
    until(lambda: roles(stack) == ["decode", "decode", "prefill"], 90, 0.5, "the frontend lists 2 decode workers")
    answers = complete(stack, 6)
    assert [r.status_code for r in answers] == [200] * 6, answers[-1].text
    decoders = {r.json()["choices"][0]["text"].rsplit(" on ", 1)[1] for r in answers}
    assert len(decoders) == 2, decoders
    assert all(r["submission"] == 0 for g in stack.ps(NAME)["groups"] for r in g["replicas"])  # nothing rolled

    assert stack.cli("stop", NAME, "-y").returncode == 0
    until(lambda: not processes(stack.home), 60, 0.5, "the stand-in's processes gone")
