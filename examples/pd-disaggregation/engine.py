"""A stand-in for `python -m sglang.launch_server` that answers what SGLang's model gateway (`smg`) asks of it.

    python3 engine.py --disaggregation-mode prefill|decode|null [--port 8000] [--host 0.0.0.0]
                      [--disaggregation-bootstrap-port 8998] [--served-model-name NAME] [--latency 0.02]
                      [--metric-names sglang|vllm] [--max-running N] [--kv-cache-tokens N]
                      [--prefill-seconds-per-token S] [--decode-seconds-per-token S] [--decode-batch-slowdown F]
                      [--cold-start SECONDS] [--kv-timeout SECONDS]

It speaks SGLang's HTTP API as the gateway uses it — `/health`, `/health_generate`, `/server_info` (with
`disaggregation_mode` and `disaggregation_bootstrap_port`, from which a router learns the worker's role),
`/v1/models`, `/version`, `/model_info`, `/generate`, `/v1/completions`, `/v1/chat/completions` and
`/metrics` — so that the real gateway can route to it and durastack can read it, unchanged, where a GPU would run
the real engine. A prefill worker also serves its KV "bootstrap" port; a decode worker given a request's
`bootstrap_host`/`bootstrap_room` fetches the prefill's KV from there first, as the real pair does, so a request
fails when its prefill worker is gone.

**Metrics.** `--metric-names sglang` (the default) exposes SGLang's names (`sglang:num_running_reqs`,
`sglang:num_queue_reqs`, `sglang:token_usage`, the `sglang:time_to_first_token_seconds` and
`sglang:inter_token_latency_seconds` histograms with SGLang's buckets); `--metric-names vllm` exposes vLLM's
(`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, token and success counters), labelled and bucketed as vLLM's
PrometheusStatLogger does, with HELP and TYPE lines.

**Performance model** (every flag off by default: then each request takes `--latency` seconds, as before). Time is
slept, not computed: the stand-in uses no CPU for "GPU" work, so a 2-CPU machine can run many of them.

* A batch of at most `--max-running` requests is processed at once (0: no limit); the others wait, first come first
  served, and are counted as waiting. With `--kv-cache-tokens`, a request is admitted only while the tokens it
  reserves (prompt + max_tokens) fit besides those of the running batch (or when nothing runs).
* Prefill (a prefill or a non-disaggregated engine) takes prompt tokens × `--prefill-seconds-per-token`, once the
  request is in the batch; prompt tokens are counted as whitespace-separated words (there is no tokenizer).
* Decode (a decode or a non-disaggregated engine) gives the first output token when the request joins the batch
  (after its prefill), then one token per step; a step takes `--decode-seconds-per-token` × (1 +
  `--decode-batch-slowdown` × (running − 1)), read at each step: a larger batch decodes each request more slowly,
  as real batching does. A request generates its `max_tokens` (default 16; `max_new_tokens` for /generate), as a
  benchmark's `ignore_eos` requests do. A prefill worker gives one token (its answer to the router).
* A decode worker fetches a request's KV from its prefill worker (waiting up to `--kv-timeout` s for the prefill
  to finish) before the request may join its batch. That wait is not this engine's load: with SGLang's names it
  counts in `sglang:num_decode_transfer_queue_reqs`, apart from the batch and the queue, as SGLang counts it; with
  vLLM's it counts nowhere (vLLM's own PD proxy sends a request to the decode only once its prefill is done).
* KV-cache use is the tokens held by the batch (prompt + generated so far) / `--kv-cache-tokens`; without that flag
  it is the stand-in's old figure, running / 64.
* `--cold-start S`: the engine loads its "model" for S seconds before it listens at all, as vLLM and SGLang do
  (neither serves HTTP before the model is loaded): until then a connection is refused.

**Latency histograms**, recorded where the engines record them: time to first token from the request's arrival
(queue wait included) to its first token — on a prefill worker, the end of its prefill; on a decode worker, its
first token after the KV arrived and it joined the batch — and the inter-token latency of every later token of a
decoding engine.

**Streaming.** `"stream": true` answers as the engines do: Server-Sent Events, one `data: {...}` chunk per output
token at the decode pace (`text_completion` chunks for /v1/completions, `chat.completion.chunk` deltas for
/v1/chat/completions, SGLang's cumulative `text` + `meta_info` for /generate), then `data: [DONE]`.

SIGTERM stops taking new requests and exits once those in flight are answered and the KV a decode worker is
fetching has been handed over (as an engine asked to stop would after its router let it go).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import hashlib
import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

ARGS = argparse.Namespace()
_lock = threading.Lock()
_running = 0  # requests in flight (in the engine at all)
_served = 0  # requests answered
_fetching = 0  # KV hand-offs in progress on this prefill's bootstrap port
_awaiting_kv = 0  # this decode's requests (in _running too) waiting for their prefill's KV
_stopping = threading.Event()
_kv: dict[str, str] = {}  # bootstrap room → KV digest (prefill side)
_kv_ready = threading.Condition()

# vLLM's bucket layouts (vllm/v1/metrics/loggers.py) and SGLang's (sglang/srt/metrics/collector.py).
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
                      0.100, 0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
SGLANG_E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 800)


def _mode() -> str:
    return ARGS.disaggregation_mode


def _num(value: float) -> str:
    """A sample value or bound as prometheus_client writes it."""
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket, the last one +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{_num(bound)}"}} {_num(total)}\n')
        out.append(f"{name}_count{{{labels}}} {_num(total)}\n")
        out.append(f"{name}_sum{{{labels}}} {_num(self.sum)}\n")
        return out


class Scheduler:
    """The batch: at most ``max_running`` requests (0: any number) run at once, the rest wait in arrival order;
    with a KV capacity, a request joins only while its reservation fits besides the batch's."""

    def __init__(self, max_running: int, kv_tokens: int):
        self.max_running, self.kv_tokens = max_running, kv_tokens
        self.cond = threading.Condition(_lock)
        self.queue: collections.deque = collections.deque()
        self.running = 0
        self.reserved = 0  # tokens reserved by the batch (prompt + max_tokens each)
        self.used = 0  # tokens held by the batch (prompt + generated so far)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = 0
        vllm = ARGS.metric_names == "vllm"
        self.ttft = Histogram(VLLM_TTFT_BUCKETS if vllm else SGLANG_TTFT_BUCKETS)
        self.itl = Histogram(VLLM_ITL_BUCKETS if vllm else SGLANG_ITL_BUCKETS)
        self.e2e = Histogram(VLLM_REQUEST_BUCKETS if vllm else SGLANG_E2E_BUCKETS)
        self.queue_time = Histogram(VLLM_REQUEST_BUCKETS if vllm else SGLANG_E2E_BUCKETS)  # vLLM's only

    def _fits(self, reserve: int) -> bool:
        if self.max_running and self.running >= self.max_running:
            return False
        return not self.kv_tokens or self.running == 0 or self.reserved + reserve <= self.kv_tokens

    def admit(self, reserve: int, held: int) -> None:
        """Wait for a place in the batch (first come, first served)."""
        ticket = object()
        with self.cond:
            self.queue.append(ticket)
            self.cond.wait_for(lambda: self.queue[0] is ticket and self._fits(reserve))
            self.queue.popleft()
            self.running += 1
            self.reserved += reserve
            self.used += held
            self.cond.notify_all()

    def release(self, reserve: int, held: int) -> None:
        with self.cond:
            self.running -= 1
            self.reserved -= reserve
            self.used -= held
            self.cond.notify_all()

    def step_seconds(self) -> float:
        with _lock:
            running = max(1, self.running)
        return ARGS.decode_seconds_per_token * (1.0 + ARGS.decode_batch_slowdown * (running - 1))

    def kv_usage(self, in_flight: int) -> float:
        if not self.kv_tokens:
            return min(1.0, in_flight / 64)  # the stand-in's figure without a KV model
        return min(1.0, self.used / self.kv_tokens)


SCHED: Scheduler


def server_info() -> dict:
    return {"version": "0.5.6", "model_path": ARGS.served_model_name, "served_model_name": ARGS.served_model_name,
            "disaggregation_mode": _mode(), "disaggregation_bootstrap_port": ARGS.disaggregation_bootstrap_port,
            "tp_size": 1, "dp_size": 1, "is_embedding": False, "host": ARGS.host, "port": ARGS.port,
            "replica": os.environ.get("DURASTACK_REPLICA", "")}


# Each engine's families as its exporter writes them: (name, type, help, what it reports, further labels).
VLLM_FAMILIES = (
    ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", "running", ""),
    ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", "waiting", ""),
    ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", "usage", ""),
    ("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "prompt", ""),
    ("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.", "generated", ""),
    ("vllm:request_success_total", "counter", "Count of successfully processed requests.", "finished",
     ',finished_reason="length"'),
    ("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", "ttft", ""),
    ("vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.", "itl", ""),
    ("vllm:e2e_request_latency_seconds", "histogram", "Histogram of e2e request latency in seconds.", "e2e", ""),
    ("vllm:request_queue_time_seconds", "histogram", "Histogram of time spent in WAITING phase for request.",
     "queue", ""),
)
SGLANG_FAMILIES = (
    ("sglang:num_running_reqs", "gauge", "The number of running requests.", "running", ""),
    ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", "waiting", ""),
    ("sglang:token_usage", "gauge", "The token usage.", "usage", ""),
    ("sglang:num_decode_transfer_queue_reqs", "gauge", "The number of requests in the decode transfer queue.",
     "transfer", ""),
    ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", "prompt", ""),
    ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", "generated", ""),
    ("sglang:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.", "ttft", ""),
    ("sglang:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.", "itl", ""),
    ("sglang:e2e_request_latency_seconds", "histogram", "Histogram of End-to-end request latency in seconds", "e2e",
     ""),
)


def metrics() -> str:
    vllm = ARGS.metric_names == "vllm"
    labels = f'model_name="{ARGS.served_model_name}"' + (',engine="0"' if vllm else "")
    out = []
    with _lock:  # one consistent reading; rendering it takes microseconds
        # the wait for a KV is not this engine's load (the module's docstring says why)
        in_flight, queued = _running - _awaiting_kv, len(SCHED.queue)
        if vllm:
            # What is neither waiting nor in the batch (the fixed --latency before it queues) is not counted by
            # vLLM either, but drains count running + waiting: so it is counted as waiting.
            running, waiting = SCHED.running, in_flight - SCHED.running
        else:
            # Everything else not waiting for a place in the batch counts as running (the fixed --latency too), as
            # this stand-in always counted what it had in flight.
            running, waiting = in_flight - queued, queued
        values = {"running": running, "waiting": waiting, "transfer": _awaiting_kv,
                  "usage": SCHED.kv_usage(in_flight),
                  # SGLang's count before the performance model was of requests served; with one, prompt tokens
                  "prompt": SCHED.prompt_tokens if vllm or _modelled() else _served,
                  "generated": SCHED.generation_tokens, "finished": SCHED.finished}
        hists = {"ttft": SCHED.ttft, "itl": SCHED.itl, "e2e": SCHED.e2e, "queue": SCHED.queue_time}
        for name, kind, help_text, what, extra in VLLM_FAMILIES if vllm else SGLANG_FAMILIES:
            out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
            if kind == "histogram":
                out += hists[what].lines(name, labels)
            else:
                out.append(f"{name}{{{labels}{extra}}} {_num(values[what])}\n")
    return "".join(out)


def _modelled() -> bool:
    return bool(ARGS.max_running or ARGS.kv_cache_tokens or ARGS.prefill_seconds_per_token
                or ARGS.decode_seconds_per_token)


class KVError(Exception):
    """The decode worker could not get the request's KV from its prefill worker."""


class ClientGone(Exception):
    pass


class Request:
    def __init__(self, path: str, body: dict):
        self.path, self.body = path, body
        self.arrival = time.monotonic()
        self.id = str(body.get("rid") or f"{'chatcmpl' if path.endswith('chat/completions') else 'cmpl'}-"
                      f"{uuid.uuid4().hex}")
        self.created = int(time.time())
        prompt = body.get("text") or body.get("prompt") or body.get("messages") or ""
        self.prompt = str(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            self.prompt_tokens = len(prompt)  # token ids
        elif isinstance(body.get("input_ids"), list):
            self.prompt_tokens = len(body["input_ids"])
        elif isinstance(prompt, list):  # chat messages
            self.prompt_tokens = sum(len(str(m.get("content", "") if isinstance(m, dict) else m).split())
                                     for m in prompt)
        else:
            self.prompt_tokens = len(self.prompt.split())
        params = body.get("sampling_params") or {}
        asked = body.get("max_tokens", body.get("max_completion_tokens", params.get("max_new_tokens")))
        self.max_tokens = max(1, int(asked)) if isinstance(asked, (int, float)) else 16
        self.stream = bool(body.get("stream"))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage"))


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
            return self._send(200, metrics(), "text/plain; version=0.0.4; charset=utf-8")
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
            self._serve(Request(path, body))
        except KVError as e:
            self._send(502, {"error": f"KV transfer from the prefill worker failed: {e}"})
        except ClientGone:
            self.close_connection = True
        finally:
            with _lock:
                _running -= 1
                _served += 1

    # ---- one request --------------------------------------------------------------------------------------------

    def _serve(self, req: Request) -> None:
        time.sleep(ARGS.latency)
        room = str(req.body.get("bootstrap_room", ""))
        mode = _mode()
        kv = ""
        if mode == "decode" and req.body.get("bootstrap_host") and req.body.get("bootstrap_port"):
            kv = self._fetch_kv(req, room)
        reserve = req.prompt_tokens + (1 if mode == "prefill" else req.max_tokens)
        SCHED.admit(reserve, req.prompt_tokens)
        admitted = time.monotonic()
        held = req.prompt_tokens
        try:
            with _lock:
                SCHED.queue_time.observe(admitted - req.arrival)
            if mode in ("prefill", "null"):
                time.sleep(req.prompt_tokens * ARGS.prefill_seconds_per_token)
                with _lock:
                    SCHED.prompt_tokens += req.prompt_tokens
            if mode == "prefill":
                kv = hashlib.sha256(req.prompt.encode()).hexdigest()[:12]
                with _kv_ready:
                    _kv[room] = kv
                    _kv_ready.notify_all()
                self._first_token(req)
                with _lock:
                    SCHED.generation_tokens += 1
                    SCHED.finished += 1
                    SCHED.e2e.observe(time.monotonic() - req.arrival)
                return self._answer(req, [f"prefilled {kv}"])
            text = (f"decoded {kv} on {os.environ.get('DURASTACK_REPLICA', '?')}" if mode == "decode" and kv
                    else f"generated on {os.environ.get('DURASTACK_REPLICA', '?')}")
            if not _modelled():
                with _lock:
                    SCHED.ttft.observe(time.monotonic() - req.arrival)
                    SCHED.generation_tokens += req.max_tokens
                    SCHED.finished += 1
                    SCHED.e2e.observe(time.monotonic() - req.arrival)
                return self._answer(req, [text] + [" ."] * (req.max_tokens - 1) if req.stream else [text])
            # decode: the first token as the request joins the batch, then one per step
            tokens = []
            if req.stream:
                self._start_stream()
            last = self._first_token(req)
            for i in range(req.max_tokens):
                if i:
                    time.sleep(SCHED.step_seconds())
                    now = time.monotonic()
                    with _lock:
                        SCHED.itl.observe(now - last)
                    last = now
                token = text if i == 0 else f" t{i}"
                tokens.append(token)
                with _lock:
                    SCHED.generation_tokens += 1
                    SCHED.used += 1
                held += 1
                if req.stream:
                    self._chunk(req, token, i + 1, final=i + 1 == req.max_tokens, sent="".join(tokens))
            with _lock:
                SCHED.finished += 1
                SCHED.e2e.observe(time.monotonic() - req.arrival)
            if req.stream:
                self._end_stream(req, len(tokens))
            else:
                self._answer(req, ["".join(tokens)], completion=len(tokens))
        finally:
            SCHED.release(reserve, held)

    def _first_token(self, req: Request) -> float:
        now = time.monotonic()
        with _lock:
            SCHED.ttft.observe(now - req.arrival)
        return now

    def _fetch_kv(self, req: Request, room: str) -> str:
        global _awaiting_kv
        host, port = req.body["bootstrap_host"], req.body["bootstrap_port"]
        with _lock:
            _awaiting_kv += 1
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/kv/{room}", timeout=ARGS.kv_timeout + 5) as r:
                return json.loads(r.read())["kv"]
        except OSError as e:
            raise KVError(str(e)) from None
        finally:
            with _lock:
                _awaiting_kv -= 1

    # ---- answers ------------------------------------------------------------------------------------------------

    def _answer(self, req: Request, tokens: list[str], completion: Optional[int] = None) -> None:
        """The whole answer: one JSON body, or (a streaming request not yet streaming) its chunks at once."""
        if req.stream and completion is None:
            self._start_stream()
            sent = ""
            for i, token in enumerate(tokens):
                sent += token
                self._chunk(req, token, i + 1, final=i + 1 == len(tokens), sent=sent)
            return self._end_stream(req, len(tokens))
        text = "".join(tokens)
        usage = self._usage(req, completion or (1 if _mode() == "prefill" else req.max_tokens))
        if req.path == "/generate":
            return self._send(200, {"text": text, "meta_info": {"id": req.body.get("rid", ""), "finish_reason":
                                                                {"type": "stop"}, **usage}})
        choice = ({"message": {"role": "assistant", "content": text}} if req.path.endswith("chat/completions")
                  else {"text": text})
        self._send(200, {"id": "cmpl-standin", "object": "text_completion", "model": ARGS.served_model_name,
                         "choices": [{"index": 0, "finish_reason": "stop", **choice}], "usage": usage})

    @staticmethod
    def _usage(req: Request, completion: int) -> dict:
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": completion,
                "total_tokens": req.prompt_tokens + completion}

    def _write(self, data: bytes) -> None:
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ClientGone() from e

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chat_role_sent = False

    def _event(self, payload: object) -> None:
        self._write(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode()) + b"\n\n")

    def _chunk(self, req: Request, token: str, n: int, final: bool, sent: str) -> None:
        finish = "length" if final else None
        if req.path == "/generate":  # SGLang's native stream: the text so far
            return self._event({"text": sent, "meta_info": {"id": req.id, "prompt_tokens": req.prompt_tokens,
                                                           "completion_tokens": n,
                                                           "finish_reason": {"type": finish} if finish else None}})
        chat = req.path.endswith("chat/completions")
        head = {"id": req.id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": req.created, "model": ARGS.served_model_name}
        if chat:
            if not self._chat_role_sent:
                self._chat_role_sent = True
                self._event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            return self._event({**head, "choices": [
                {"index": 0, "delta": {"content": token}, "logprobs": None, "finish_reason": finish}]})
        self._event({**head, "choices": [
            {"index": 0, "text": token, "logprobs": None, "finish_reason": finish, "stop_reason": None}]})

    def _end_stream(self, req: Request, completion: int) -> None:
        if req.include_usage and req.path != "/generate":
            obj = "chat.completion.chunk" if req.path.endswith("chat/completions") else "text_completion"
            self._event({"id": req.id, "object": obj, "created": req.created, "model": ARGS.served_model_name,
                         "choices": [], "usage": self._usage(req, completion)})
        self._event(b"[DONE]")
        try:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError) as e:
            raise ClientGone() from e

    def log_message(self, fmt: str, *args) -> None:
        pass


class Bootstrap(BaseHTTPRequestHandler):
    """The prefill's KV hand-off: the decode side asks for a room's KV, waiting until the prefill has made it."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        global _fetching
        room = self.path.rsplit("/", 1)[-1]
        with _lock:
            _fetching += 1
        try:
            with _kv_ready:
                found = _kv_ready.wait_for(lambda: room in _kv, timeout=ARGS.kv_timeout)
                kv = _kv.pop(room, "")
            data = json.dumps({"kv": kv}).encode()
            self.send_response(200 if found else 504)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        finally:
            with _lock:
                _fetching -= 1

    def log_message(self, fmt: str, *args) -> None:
        pass


def _drain_and_exit(server: ThreadingHTTPServer) -> None:
    _stopping.set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with _lock:
            if _running == 0 and _fetching == 0:
                break
        time.sleep(0.05)
    server.shutdown()


def parse(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--disaggregation-mode", choices=["prefill", "decode", "null"], default="null")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "8000")))
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--served-model-name", "--model-path", default="standin")
    p.add_argument("--latency", type=float, default=0.02, help="Seconds each request takes before anything else.")
    p.add_argument("--metric-names", choices=["sglang", "vllm"], default="sglang",
                   help="Whose Prometheus names /metrics uses.")
    p.add_argument("--max-running", type=int, default=0,
                   help="Requests processed at once; the others wait (0: no limit).")
    p.add_argument("--kv-cache-tokens", type=int, default=0,
                   help="KV-cache capacity in tokens (0: no KV model; usage is running / 64).")
    p.add_argument("--prefill-seconds-per-token", type=float, default=0.0, help="Prefill time per prompt token.")
    p.add_argument("--decode-seconds-per-token", type=float, default=0.0, help="Decode step time, one request.")
    p.add_argument("--decode-batch-slowdown", type=float, default=0.0,
                   help="Each further request in the batch lengthens a decode step by this share.")
    p.add_argument("--cold-start", type=float, default=0.0,
                   help="Seconds of 'model loading' before the engine listens.")
    p.add_argument("--kv-timeout", type=float, default=30.0,
                   help="Seconds a KV hand-off waits for its prefill to finish.")
    p.parse_args(argv, namespace=ARGS)


def main() -> None:
    global SCHED
    parse()
    SCHED = Scheduler(ARGS.max_running, ARGS.kv_cache_tokens)
    if ARGS.cold_start > 0:  # the real engines load the model before they listen: connections are refused
        print(f"engine ({_mode()}) loading for {ARGS.cold_start:g} s", flush=True)
        time.sleep(ARGS.cold_start)
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
