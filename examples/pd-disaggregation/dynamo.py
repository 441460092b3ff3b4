"""A stand-in for NVIDIA Dynamo's PD-disaggregated serving, in the shape of dstack's Dynamo example, with no GPU.

    python3 dynamo.py frontend [--http-host 0.0.0.0] [--http-port $PORT] [--etcd-host 0.0.0.0] [--etcd-port 2379]
    python3 dynamo.py worker --disaggregation-mode prefill|decode [--host 0.0.0.0] [--port $PORT]
                             [--served-model-name NAME] [--lease-ttl 10]       (needs ETCD_ENDPOINTS)

`frontend` is what the router replica runs, in place of `docker compose up` (etcd, NATS) and
`python3 -m dynamo.frontend --discovery-backend etcd`: an etcd stand-in on port 2379 that speaks etcd v3's JSON
gateway (`/v3/kv/put`, `/v3/kv/range`, `/v3/lease/grant|keepalive|revoke`; int64s as strings, bytes as base64, as
etcd's gateway writes them), and an OpenAI-compatible frontend (`/v1/models`, `/v1/completions`, `/health`) that
finds its workers there, as Dynamo's does, under `v1/instances/`. A completion goes to a prefill worker, then to
a decode worker with the prefill's KV digest, each role in round robin; a role with no worker answers 503.

`worker` is what the prefill and decode replicas run, in place of `python3 -m dynamo.sglang`: it finds etcd at
$ETCD_ENDPOINTS (so, like the real worker, it learns the router's address only from its environment), grants a
lease, registers its URL and role under it and keeps the lease alive. A worker that dies without saying so
vanishes from the frontend once its lease expires; one asked to stop (SIGTERM) revokes its lease first.

Standard library only: the replicas run it with the machine's python3.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "v1/instances/"  # where Dynamo's workers register their endpoints, one key per instance
NAMESPACE = "dynamo"
COMPONENTS = {"prefill": "prefill", "decode": "backend"}  # Dynamo's SGLang workers' component names, by role


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text or "", validate=True)


class Etcd:
    """The part of etcd's key space that service discovery uses: keys, leases and their expiry. Leases expire
    lazily, on the next call: nobody can tell, since every answer comes from a call."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revision = 1
        self.kvs: dict[bytes, dict] = {}  # key → {value, lease, create_revision, mod_revision, version}
        self.leases: dict[int, list] = {}  # lease id → [ttl, deadline (monotonic)]
        self.next_lease = itertools.count(0x694D_0000_0000_0001)  # like etcd's: large, unique, never 0

    def header(self) -> dict:
        return {"cluster_id": "1", "member_id": "1", "revision": str(self.revision), "raft_term": "1"}

    def _expire(self) -> None:
        now = time.monotonic()
        for lease in [lid for lid, (_, deadline) in self.leases.items() if deadline <= now]:
            self._drop_lease(lease)

    def _drop_lease(self, lease: int) -> None:
        del self.leases[lease]
        gone = [k for k, kv in self.kvs.items() if kv["lease"] == lease]
        for key in gone:
            del self.kvs[key]
        if gone:
            self.revision += 1  # one deletion event, as etcd makes for a lease's keys

    def call(self, path: str, body: dict) -> tuple[int, dict]:
        """(HTTP status, JSON answer) of one gateway call."""
        with self.lock:
            self._expire()
            if path == "/v3/kv/put":
                return self._put(unb64(body.get("key", "")), unb64(body.get("value", "")), int(body.get("lease") or 0))
            if path == "/v3/kv/range":
                return self._range(unb64(body.get("key", "")), unb64(body.get("range_end", "")))
            if path == "/v3/lease/grant":
                ttl = max(1, int(body.get("TTL") or 0))
                lease = int(body.get("ID") or 0) or next(self.next_lease)
                self.leases[lease] = [ttl, time.monotonic() + ttl]
                return 200, {"header": self.header(), "ID": str(lease), "TTL": str(ttl)}
            if path == "/v3/lease/keepalive":
                # A streaming call in gRPC: the gateway wraps each answer in "result". An unknown (expired) lease
                # is not an error there: its TTL is 0, which JSON leaves out.
                lease = int(body.get("ID") or 0)
                result = {"header": self.header(), "ID": str(lease)}
                if lease in self.leases:
                    ttl = self.leases[lease][0]
                    self.leases[lease][1] = time.monotonic() + ttl
                    result["TTL"] = str(ttl)
                return 200, {"result": result}
            if path in ("/v3/lease/revoke", "/v3/kv/lease/revoke"):
                lease = int(body.get("ID") or 0)
                if lease not in self.leases:
                    return _lease_not_found()
                self._drop_lease(lease)
                return 200, {"header": self.header()}
        return 404, {"error": f"Not Found: {path}", "code": 5, "message": "Not Found"}

    def _put(self, key: bytes, value: bytes, lease: int) -> tuple[int, dict]:
        if lease and lease not in self.leases:
            return _lease_not_found()
        self.revision += 1
        old = self.kvs.get(key)
        self.kvs[key] = {"value": value, "lease": lease, "mod_revision": self.revision,
                         "create_revision": old["create_revision"] if old else self.revision,
                         "version": old["version"] + 1 if old else 1}
        return 200, {"header": self.header()}

    def _range(self, key: bytes, range_end: bytes) -> tuple[int, dict]:
        # etcd's rule: no range_end is the one key; "\0" is every key from `key` on; else [key, range_end).
        if not range_end:
            keys = [key] if key in self.kvs else []
        else:
            keys = sorted(k for k in self.kvs if k >= key and (range_end == b"\0" or k < range_end))
        kvs = []
        for k in keys:
            kv = self.kvs[k]
            entry = {"key": b64(k), "create_revision": str(kv["create_revision"]),
                     "mod_revision": str(kv["mod_revision"]), "version": str(kv["version"]), "value": b64(kv["value"])}
            if kv["lease"]:
                entry["lease"] = str(kv["lease"])
            kvs.append(entry)
        answer: dict = {"header": self.header()}
        if kvs:  # etcd's gateway leaves out empty and zero fields
            answer.update(kvs=kvs, count=str(len(kvs)))
        return 200, answer


def _lease_not_found() -> tuple[int, dict]:
    message = "etcdserver: requested lease not found"
    return 404, {"error": message, "code": 5, "message": message}


class JSONHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def send_json(self, code: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def body(self) -> dict:
        size = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(size)) if size else {}
        except ValueError:
            body = None
        return body if isinstance(body, dict) else {}

    def log_message(self, fmt: str, *args) -> None:
        pass


def call(url: str, body: dict, timeout: float = 5.0) -> dict:
    """POST ``body`` as JSON, the answer's JSON. Raises OSError (urllib's errors are OSErrors) on failure."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with prefix": the prefix with its last byte increased."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


# ---------------------------------------------------------------------------------------------------- frontend

class Frontend(JSONHandler):
    etcd_url = ""  # where the frontend reads the registry, like any etcd client
    turns = {role: itertools.count() for role in COMPONENTS}  # round robin, one turn per request and role

    def instances(self) -> list[dict]:
        answer = call(f"{self.etcd_url}/v3/kv/range",
                      {"key": b64(PREFIX.encode()), "range_end": b64(prefix_end(PREFIX.encode()))})
        return [json.loads(unb64(kv["value"])) for kv in answer.get("kvs", [])]

    def do_GET(self) -> None:
        try:
            instances = self.instances()
        except OSError as e:
            return self.send_json(503, {"status": "unhealthy", "message": f"etcd at {self.etcd_url}: {e}"})
        path = self.path.split("?", 1)[0]
        if path == "/health":
            return self.send_json(200, {"status": "healthy", "instances": instances})
        if path == "/v1/models":
            names = sorted({i["model"] for i in instances if i["disaggregation_mode"] == "decode"})
            return self.send_json(200, {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "dynamo"}
                                                                   for n in names]})
        self.send_json(404, error(f"no {path}", "not_found", 404))

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            return self.send_json(404, error(f"no {self.path}", "not_found", 404))
        request = self.body()
        try:
            instances = self.instances()
        except OSError as e:
            return self.send_json(503, error(f"etcd at {self.etcd_url}: {e}", "service_unavailable", 503))
        by_role = {role: [i for i in instances if i["disaggregation_mode"] == role] for role in COMPONENTS}
        for role, workers in by_role.items():
            if not workers:
                return self.send_json(503, error(f"no {role} worker is registered", "service_unavailable", 503))
        model = request.get("model") or by_role["decode"][0]["model"]
        if model not in {i["model"] for i in by_role["decode"]}:
            return self.send_json(404, error(f"model {model!r} is not served", "not_found", 404))
        prompt = str(request.get("prompt", ""))
        prefilled = self.on_one(by_role["prefill"], "prefill", {"prompt": prompt})
        if prefilled is None:
            return self.send_json(502, error("no prefill worker answered", "bad_gateway", 502))
        decoded = self.on_one(by_role["decode"], "decode", {"prompt": prompt, "kv": prefilled["kv"],
                                                             "max_tokens": request.get("max_tokens", 16)})
        if decoded is None:
            return self.send_json(502, error("no decode worker answered", "bad_gateway", 502))
        choice = {"index": 0, "text": decoded["text"], "finish_reason": "stop"}
        self.send_json(200, {"id": f"cmpl-{prefilled['kv']}", "object": "text_completion",
                             "created": int(time.time()), "model": model, "choices": [choice]})

    def on_one(self, workers: list[dict], role: str, body: dict):
        """The answer of the role's next worker in turn; one that fails (dead, its lease not yet expired) passes the
        request to the next. None when none answers."""
        workers = sorted(workers, key=lambda i: i["instance_id"])
        start = next(self.turns[role])
        for n in range(len(workers)):
            try:
                return call(f"{workers[(start + n) % len(workers)]['url']}/generate", body, timeout=30)
            except (OSError, ValueError):
                continue
        return None


def error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


class EtcdHandler(JSONHandler):
    store = Etcd()

    def do_POST(self) -> None:
        try:
            self.send_json(*self.store.call(self.path, self.body()))
        except ValueError as e:  # a malformed number or base64 string: gRPC's InvalidArgument
            self.send_json(400, {"error": str(e), "code": 3, "message": str(e)})


def serve(host: str, port: int, handler) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def frontend(args: argparse.Namespace) -> None:
    etcd = serve(args.etcd_host, args.etcd_port, EtcdHandler)
    port = etcd.server_address[1]
    # It reads the registry through etcd's API, not the store in this process: the same client as a frontend
    # beside a real etcd would be.
    Frontend.etcd_url = f"http://127.0.0.1:{port}" if args.etcd_host in ("0.0.0.0", "") else \
        f"http://{args.etcd_host}:{port}"
    http = ThreadingHTTPServer((args.http_host, args.http_port), Frontend)
    http.daemon_threads = True
    print(f"frontend on {args.http_host}:{http.server_address[1]}, etcd on {args.etcd_host}:{port}", flush=True)
    http.serve_forever()


# ------------------------------------------------------------------------------------------------------ worker

class Worker(JSONHandler):
    mode = ""
    name = ""

    def do_GET(self) -> None:
        self.send_json(200 if self.path == "/health" else 404, {"status": "ok", "mode": self.mode})

    def do_POST(self) -> None:
        if self.path != "/generate":
            return self.send_json(404, {"error": f"no {self.path}"})
        body = self.body()
        if self.mode == "prefill":  # the KV cache a decode worker would pull, as a digest of the prompt
            return self.send_json(200, {"kv": hashlib.sha256(str(body.get("prompt")).encode()).hexdigest()[:12]})
        if not body.get("kv"):
            return self.send_json(400, {"error": "a decode worker needs the prefill's KV"})
        self.send_json(200, {"text": f"decoded {body['kv']} on {self.name}"})


class Registration:
    """This worker's key in etcd, under a lease it keeps alive, registered again if the lease is lost (etcd
    restarted, or could not be reached for longer than the TTL)."""

    def __init__(self, etcd: str, ttl: int, info: dict) -> None:
        self.etcd, self.ttl, self.info = etcd, ttl, info
        self.lease = 0

    def register(self) -> None:
        self.lease = int(call(f"{self.etcd}/v3/lease/grant", {"TTL": self.ttl})["ID"])
        info = {**self.info, "instance_id": self.lease}
        key = f"{PREFIX}{NAMESPACE}/{COMPONENTS[info['disaggregation_mode']]}/generate/{self.lease:x}"
        call(f"{self.etcd}/v3/kv/put", {"key": b64(key.encode()), "value": b64(json.dumps(info).encode()),
                                        "lease": str(self.lease)})
        print(f"registered {key} at {self.etcd} (lease TTL {self.ttl}s)", flush=True)

    def register_within(self, seconds: float) -> None:
        """Tries until etcd answers: the router replica may start after this one."""
        deadline, tries = time.monotonic() + seconds, 0
        while True:
            try:
                return self.register()
            except OSError as e:
                tries += 1
                if time.monotonic() >= deadline:
                    sys.exit(f"worker: etcd at {self.etcd} did not answer within {seconds:.0f}s: {e}")
                if tries % 10 == 1:
                    print(f"waiting for etcd at {self.etcd}: {e}", flush=True)
                time.sleep(1)

    def keep_alive(self, stopping: threading.Event) -> None:
        while not stopping.wait(self.ttl / 3):
            try:
                answer = call(f"{self.etcd}/v3/lease/keepalive", {"ID": str(self.lease)})
                if not int(answer.get("result", {}).get("TTL") or 0):
                    print("lease lost: registering again", flush=True)
                    self.register()
            except (OSError, ValueError) as e:
                print(f"keepalive failed, trying again: {e}", flush=True)

    def revoke(self) -> None:
        try:
            call(f"{self.etcd}/v3/lease/revoke", {"ID": str(self.lease)}, timeout=2)
        except OSError:
            pass  # then it expires


def worker(args: argparse.Namespace) -> None:
    endpoints = os.environ.get("ETCD_ENDPOINTS", "").strip()
    if not endpoints:
        sys.exit("worker: ETCD_ENDPOINTS is not set; it says where etcd is, e.g. "
                 "`export ETCD_ENDPOINTS=http://$DSTACK_ROUTER_INTERNAL_IP:2379`")
    etcd = endpoints.split(",")[0].rstrip("/")
    # Listening before it registers (a caller waits in the backlog), serving only after: a worker the frontend can
    # find always answers, and one that answers HTTP (the replica's readiness) has registered.
    server = ThreadingHTTPServer((args.host, args.port), Worker)
    server.block_on_close = True  # server_close() waits for the requests in flight
    host = args.advertise_host or os.environ.get("DURASTACK_REPLICA_IP") or "127.0.0.1"
    Worker.mode = args.disaggregation_mode
    Worker.name = f"{args.disaggregation_mode} replica {os.environ.get('DURASTACK_REPLICA', '?')}"
    registration = Registration(etcd, args.lease_ttl, {
        "namespace": NAMESPACE, "component": COMPONENTS[args.disaggregation_mode], "endpoint": "generate",
        "model": args.served_model_name, "disaggregation_mode": args.disaggregation_mode,
        "url": f"http://{host}:{server.server_address[1]}", "replica": os.environ.get("DURASTACK_REPLICA", "")})
    registration.register_within(args.etcd_wait)
    stopping = threading.Event()
    threading.Thread(target=registration.keep_alive, args=(stopping,), daemon=True).start()

    def stop(*_) -> None:  # leave the registry first, so that the frontend sends nothing more here
        stopping.set()
        registration.revoke()
        threading.Thread(target=server.shutdown).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"{Worker.name} serving on {args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever()
    server.server_close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    modes = p.add_subparsers(dest="mode", required=True)
    port = int(os.environ.get("PORT", "8000"))
    f = modes.add_parser("frontend", help="etcd stand-in and OpenAI frontend (the router replica)")
    f.add_argument("--http-host", default="0.0.0.0")
    f.add_argument("--http-port", type=int, default=port)
    f.add_argument("--etcd-host", default="0.0.0.0")
    f.add_argument("--etcd-port", type=int, default=2379)
    f.add_argument("--discovery-backend", choices=["etcd"], default="etcd")
    f.add_argument("--router-mode", choices=["round-robin"], default="round-robin")
    w = modes.add_parser("worker", help="a prefill or decode worker")
    w.add_argument("--disaggregation-mode", choices=list(COMPONENTS), required=True)
    w.add_argument("--host", default="0.0.0.0")
    w.add_argument("--port", type=int, default=port)
    w.add_argument("--advertise-host", default="", help="the host in the URL it registers "
                                                        "(default: $DURASTACK_REPLICA_IP, else 127.0.0.1)")
    w.add_argument("--served-model-name", "--model-path", default="standin")
    w.add_argument("--discovery-backend", choices=["etcd"], default="etcd")
    w.add_argument("--lease-ttl", type=int, default=10, help="seconds a dead worker stays registered")
    w.add_argument("--etcd-wait", type=float, default=300, help="seconds to wait for etcd at start")
    args = p.parse_args()
    if args.mode == "frontend":
        frontend(args)
    else:
        worker(args)


if __name__ == "__main__":
    main()
