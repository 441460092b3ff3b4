"""A stand-in for `python -m sglang.launch_server` that answers what SGLang's model gateway (`smg`) asks of it.

    python3 engine.py --disaggregation-mode prefill|decode|null [--port 8000] [--host 0.0.0.0]
                      [--disaggregation-bootstrap-port 8998] [--served-model-name NAME]

It speaks SGLang's HTTP API as the gateway uses it — `/health`, `/health_generate`, `/server_info` (with
`disaggregation_mode` and `disaggregation_bootstrap_port`, from which a router learns the worker's role),
`/v1/models`, `/version`, `/model_info`, `/generate`, `/v1/completions`, `/v1/chat/completions` and
`/metrics` (SGLang's Prometheus names) — so that the real gateway can route to it and durastack can read it,
unchanged, where a GPU would run the real engine. A prefill worker also serves its KV "bootstrap" port; a decode
worker given a request's `bootstrap_host`/`bootstrap_room` fetches the prefill's KV from there first, as the real
pair does, so a request fails when its prefill worker is gone.

SIGTERM stops taking new requests and exits once those in flight are answered (as an engine asked to stop would
after its router let it go).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGS = argparse.Namespace()
_lock = threading.Lock()
_running = 0  # requests in flight
_served = 0  # requests answered
_stopping = threading.Event()
_kv: dict[str, str] = {}  # bootstrap room → KV digest (prefill side)
_kv_ready = threading.Condition()


def _mode() -> str:
    return ARGS.disaggregation_mode


def server_info() -> dict:
    return {"version": "0.5.6", "model_path": ARGS.served_model_name, "served_model_name": ARGS.served_model_name,
            "disaggregation_mode": _mode(), "disaggregation_bootstrap_port": ARGS.disaggregation_bootstrap_port,
            "tp_size": 1, "dp_size": 1, "is_embedding": False, "host": ARGS.host, "port": ARGS.port,
            "replica": os.environ.get("DURASTACK_REPLICA", "")}


def metrics() -> str:
    with _lock:
        running, served = _running, _served
    name = ARGS.served_model_name
    return "".join([
        "# HELP sglang:num_running_reqs The number of running requests.\n# TYPE sglang:num_running_reqs gauge\n",
        f'sglang:num_running_reqs{{model_name="{name}"}} {running}\n',
        "# HELP sglang:num_queue_reqs The number of requests in the waiting queue.\n",
        "# TYPE sglang:num_queue_reqs gauge\n", f'sglang:num_queue_reqs{{model_name="{name}"}} 0\n',
        "# HELP sglang:token_usage The token usage.\n# TYPE sglang:token_usage gauge\n",
        f'sglang:token_usage{{model_name="{name}"}} {min(1.0, running / 64):.4f}\n',
        "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.\n",
        "# TYPE sglang:prompt_tokens_total counter\n", f'sglang:prompt_tokens_total{{model_name="{name}"}} {served}\n',
    ])


class Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code: int, body: object, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        size = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(size) or b"{}") if size else {}

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/health", "/health_generate"):
            return self._send(503 if _stopping.is_set() else 200, "" if not _stopping.is_set() else "stopping",
                              "text/plain")
        if path in ("/server_info", "/get_server_info"):
            return self._send(200, server_info())
        if path in ("/model_info", "/get_model_info"):
            return self._send(200, {"model_path": ARGS.served_model_name, "is_generation": True})
        if path == "/v1/models":
            return self._send(200, {"object": "list", "data": [{"id": ARGS.served_model_name, "object": "model",
                                                                "owned_by": "sglang"}]})
        if path == "/version":
            return self._send(200, {"version": "0.5.6"})
        if path == "/metrics":
            return self._send(200, metrics(), "text/plain; version=0.0.4")
        self._send(404, {"error": f"no {path}"})

    def do_POST(self) -> None:
        global _running, _served
        path = self.path.split("?", 1)[0]
        body = self._body()
        if path not in ("/generate", "/v1/completions", "/v1/chat/completions"):
            return self._send(404, {"error": f"no {path}"})
        if _stopping.is_set():
            return self._send(503, {"error": "the engine is shutting down"})
        with _lock:
            _running += 1
        try:
            text = self._run(body)
        except OSError as e:
            return self._send(502, {"error": f"KV transfer from the prefill worker failed: {e}"})
        finally:
            with _lock:
                _running -= 1
                _served += 1
        if path == "/generate":
            return self._send(200, {"text": text, "meta_info": {"id": body.get("rid", ""), "finish_reason":
                                                                 {"type": "stop"}}})
        choice = ({"message": {"role": "assistant", "content": text}} if path.endswith("chat/completions")
                  else {"text": text})
        self._send(200, {"id": "cmpl-standin", "object": "text_completion", "model": ARGS.served_model_name,
                         "choices": [{"index": 0, "finish_reason": "stop", **choice}]})

    def _run(self, body: dict) -> str:
        prompt = str(body.get("text") or body.get("prompt") or body.get("messages") or "")
        time.sleep(ARGS.latency)
        room = str(body.get("bootstrap_room", ""))
        if _mode() == "prefill":
            kv = hashlib.sha256(prompt.encode()).hexdigest()[:12]
            with _kv_ready:
                _kv[room] = kv
                _kv_ready.notify_all()
            return f"prefilled {kv}"
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if _mode() == "decode" and host and port:
            with urllib.request.urlopen(f"http://{host}:{port}/kv/{room}", timeout=30) as r:
                kv = json.loads(r.read())["kv"]
            return f"decoded {kv} on {os.environ.get('DURASTACK_REPLICA', '?')}"
        return f"generated on {os.environ.get('DURASTACK_REPLICA', '?')}"

    def log_message(self, fmt: str, *args) -> None:
        pass


class Bootstrap(BaseHTTPRequestHandler):
    """The prefill's KV hand-off: the decode side asks for a room's KV, waiting until the prefill has made it."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        room = self.path.rsplit("/", 1)[-1]
        with _kv_ready:
            found = _kv_ready.wait_for(lambda: room in _kv, timeout=30)
            kv = _kv.pop(room, "")
        data = json.dumps({"kv": kv}).encode()
        self.send_response(200 if found else 504)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt: str, *args) -> None:
        pass


def _drain_and_exit(server: ThreadingHTTPServer) -> None:
    _stopping.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with _lock:
            if _running == 0:
                break
        time.sleep(0.05)
    server.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--disaggregation-mode", choices=["prefill", "decode", "null"], default="null")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--served-model-name", "--model-path", default="standin")
    p.add_argument("--latency", type=float, default=0.02, help="Seconds each request takes.")
    p.parse_args(namespace=ARGS)
    server = ThreadingHTTPServer((ARGS.host, ARGS.port), Engine)
    server.daemon_threads = True
    if _mode() == "prefill":  # port 0: any free one, which /server_info then tells the router
        boot = ThreadingHTTPServer((ARGS.host, ARGS.disaggregation_bootstrap_port), Bootstrap)
        boot.daemon_threads = True
        ARGS.disaggregation_bootstrap_port = boot.server_address[1]
        threading.Thread(target=boot.serve_forever, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=_drain_and_exit, args=(server,)).start())
    print(f"engine ({_mode()}) listening on {ARGS.host}:{ARGS.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
