"""The Dynamo stand-in (examples/pd-disaggregation/dynamo.py) without a stack: its etcd speaks etcd v3's JSON
gateway (put, prefix range, leases that expire), and its workers register there, are found by the frontend and
leave it. The script runs as a subprocess on 127.0.0.1, with the standard library alone (`-S`), as replicas run
it with the machine's python3."""

from __future__ import annotations

import base64
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.app import free_port
from tests.e2e import until

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "pd-disaggregation" / "dynamo.py"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def run(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-S", str(SCRIPT), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PORT": "0", **(env or {})})


def end(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.stdout.read() if proc.stdout else ""


class Frontend:
    def __init__(self, etcd_port: int | None = None):
        self.etcd_port, self.http_port = etcd_port or free_port(), free_port()
        self.etcd = f"http://127.0.0.1:{self.etcd_port}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.proc = run("frontend", "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                        "--etcd-host", "127.0.0.1", "--etcd-port", str(self.etcd_port))
        until(lambda: self.answers() or self.proc.poll() is not None, 20, 0.05, "the frontend up")
        assert self.proc.poll() is None, end(self.proc)

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def call(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.etcd}{path}", json=body, timeout=5)

    def keys(self, prefix: str) -> list[str]:
        end_ = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        found = self.call("/v3/kv/range", {"key": b64(prefix), "range_end": b64(end_)}).json()
        return [base64.b64decode(kv["key"]).decode() for kv in found.get("kvs", [])]

    def instances(self) -> list[dict]:
        return httpx.get(f"{self.url}/health", timeout=5).json()["instances"]

    def complete(self) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", json={"model": "standin", "prompt": "hi"}, timeout=30)


@pytest.fixture
def frontend():
    f = Frontend()
    yield f
    end(f.proc)


def test_put_and_range_by_prefix_as_etcds_gateway_answers(frontend):
    for key, value in [("v1/instances/a", "1"), ("v1/instances/b", "2"), ("v1/other", "3"), ("v1/instances/a", "4")]:
        put = frontend.call("/v3/kv/put", {"key": b64(key), "value": b64(value)})
        assert put.status_code == 200 and int(put.json()["header"]["revision"]) > 1
    found = frontend.call("/v3/kv/range", {"key": b64("v1/instances/"), "range_end": b64("v1/instances0")}).json()
    assert found["count"] == "2"  # int64s are strings in etcd's JSON
    assert [(base64.b64decode(kv["key"]), base64.b64decode(kv["value"]), kv["version"]) for kv in found["kvs"]] == \
        [(b"v1/instances/a", b"4", "2"), (b"v1/instances/b", b"2", "1")]
    one = frontend.call("/v3/kv/range", {"key": b64("v1/other")}).json()
    assert [base64.b64decode(kv["value"]) for kv in one["kvs"]] == [b"3"]
    assert "kvs" not in frontend.call("/v3/kv/range", {"key": b64("v1/none")}).json()  # left out, as etcd does
    everything = frontend.call("/v3/kv/range", {"key": b64("\0"), "range_end": b64("\0")}).json()
    assert everything["count"] == "3"
    assert frontend.call("/v3/kv/put", {"key": "!!", "value": ""}).status_code == 400


def test_a_leases_keys_vanish_when_it_expires_unless_kept_alive(frontend):
    lease = frontend.call("/v3/lease/grant", {"TTL": 1}).json()
    assert lease["TTL"] == "1"
    assert frontend.call("/v3/kv/put", {"key": b64("v1/instances/x"), "value": b64("x"),
                                        "lease": lease["ID"]}).status_code == 200
    kv = frontend.call("/v3/kv/range", {"key": b64("v1/instances/x")}).json()["kvs"][0]
    assert kv["lease"] == lease["ID"]
    alive = frontend.call("/v3/lease/keepalive", {"ID": lease["ID"]}).json()
    assert alive["result"]["ID"] == lease["ID"] and alive["result"]["TTL"] == "1"
    until(lambda: frontend.keys("v1/instances/") == [], 5, 0.05, "the lease's key gone")
    # Expired: keepalive says TTL 0 (left out), and the lease can neither hold a key nor be revoked.
    assert "TTL" not in frontend.call("/v3/lease/keepalive", {"ID": lease["ID"]}).json()["result"]
    refused = frontend.call("/v3/kv/put", {"key": b64("y"), "value": "", "lease": lease["ID"]})
    assert refused.status_code == 404 and refused.json()["code"] == 5
    assert frontend.call("/v3/lease/revoke", {"ID": lease["ID"]}).status_code == 404


def test_revoking_a_lease_deletes_its_keys_at_once(frontend):
    lease = frontend.call("/v3/lease/grant", {"TTL": 60}).json()["ID"]
    frontend.call("/v3/kv/put", {"key": b64("v1/instances/z"), "value": b64("z"), "lease": lease})
    frontend.call("/v3/kv/put", {"key": b64("v1/instances/kept"), "value": b64("k")})
    assert frontend.call("/v3/lease/revoke", {"ID": lease}).status_code == 200
    assert frontend.keys("v1/instances/") == ["v1/instances/kept"]


def test_a_worker_without_etcd_endpoints_exits_saying_so():
    env = {k: v for k, v in os.environ.items() if k != "ETCD_ENDPOINTS"}
    done = subprocess.run([sys.executable, "-S", str(SCRIPT), "worker", "--disaggregation-mode", "decode"],
                          capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode != 0 and "ETCD_ENDPOINTS is not set" in done.stderr


def test_workers_wait_for_etcd_register_serve_and_leave():
    etcd_port = free_port()
    env = {"ETCD_ENDPOINTS": f"http://127.0.0.1:{etcd_port}"}
    # A 2 s lease (renewed every 0.7 s): with 1 s, one stall of a loaded CI machine let a live worker's lease lapse.
    workers = {mode: run("worker", "--disaggregation-mode", mode, "--host", "127.0.0.1", "--lease-ttl", "2",
                         env={**env, "DURASTACK_REPLICA": "7"}) for mode in ("prefill", "decode")}
    # Each worker tries until etcd answers: the frontend (its etcd) starts once both said they wait for it, not
    # merely after they were started (a loaded machine can start a Python process in longer than the frontend).
    for mode, worker in workers.items():
        ready, _, _ = select.select([worker.stdout], [], [], 20)
        assert ready, f"{mode}: nothing said in 20 s"
        said = worker.stdout.readline()
        assert said.startswith("waiting for etcd"), f"{mode}: {said}{end(worker)}"
    f = Frontend(etcd_port)
    try:
        until(lambda: sorted(i["disaggregation_mode"] for i in f.instances()) == ["decode", "prefill"], 20, 0.05,
              "both workers registered")
        assert all(i["url"].startswith("http://127.0.0.1:") for i in f.instances())
        # Dynamo's layout: v1/instances/<namespace>/<component>/<endpoint>/<lease id, hex>
        assert sorted(k.split("/")[3] for k in f.keys("v1/instances/dynamo/")) == ["backend", "prefill"]
        assert httpx.get(f"{f.url}/v1/models", timeout=5).json()["data"][0]["id"] == "standin"
        answer = f.complete()
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"].startswith("decoded ")
        assert answer.json()["choices"][0]["text"].endswith(" on decode replica 7")

        # kept alive: still registered after 2.5 TTLs, looked at all along (nothing to wait for but time)
        since = time.monotonic()
        while time.monotonic() - since < 5:
            assert len(f.instances()) == 2
            time.sleep(0.1)
        # SIGTERM: the decode worker revokes its lease and exits 0; the frontend has no decode worker then
        workers["decode"].send_signal(signal.SIGTERM)
        assert workers["decode"].wait(10) == 0
        assert [i["disaggregation_mode"] for i in f.instances()] == ["prefill"]
        refused = f.complete()
        assert refused.status_code == 503 and "no decode worker" in refused.json()["error"]["message"]

        # kill -9: the prefill worker stays registered until its lease expires
        workers["prefill"].kill()
        workers["prefill"].wait(10)
        until(lambda: f.instances() == [], 10, 0.05, "the dead worker's lease expired")
    finally:
        for w in workers.values():
            end(w)
        end(f.proc)
