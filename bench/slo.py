"""SLO attainment against cost, per autoscaling policy, for a PD service of stand-in engines under a burst trace.

    .venv/bin/python -m bench.slo [--policies static,rps,running,ttft] [--period 200] [--duration 200] \
                                  [--low 1] [--peak 8] [--seed 7] [--ttft 2.0] [--itl 0.06] [--cold-start 20] \
                                  [--static-prefill 4] [--static-decode 3] [--engine-window 10] [--rps-headroom 0.75] \
                                  [--timeline] [--dump FILE] [--keep]

One `durastack server` (bench/stack.py) serves every run. Each policy gets its own service (`slo-<policy>`), applied
with `durastack apply -f FILE -y` from one template (SERVICE below, the shape of
examples/pd-disaggregation/standin.yml: the real router `smg` as the router group, prefill and decode groups of the
stand-in engine examples/pd-disaggregation/engine.py with vLLM's metric names and its performance model, ENGINE_*
below), waited for until every group is ready and the router lists every worker healthy, driven by the trace, then
stopped with `durastack stop NAME -y`. Only the groups' `replicas` and `scaling` differ between policies (POLICIES):

* `static`: prefill and decode fixed at the peak's size (`--static-prefill`, `--static-decode`);
* `rps`: the gateway's request rate, each group's target the peak rate over its static size (the rate a replica
  is sized for); `rps-headroom` (not in the default set) the same with targets × `--rps-headroom`, rps given about
  an engine signal's cost;
* engine signals, read by durastack from each replica's /metrics (targets in POLICIES): `running` (prefill and
  decode on running + waiting), `queue` (prefill on waiting, decode on running + waiting), `ttft` (prefill on p90
  time to first token, decode on running + waiting), `itl` (prefill on TTFT, decode on p90 inter-token latency).

Every policy but `static` ranges from `--min-prefill` (1) / `--min-decode` (2) replicas to `--max-prefill` /
`--max-decode` (static's sizes, 4 and 3: the same peak pool), scale-up delay 0 s, scale-down delay
`--scale-down-delay` (30 s: durastack scales down only after the group wanted fewer for that long without a break,
so a short window's noise does not take a replica away); the window is the gateway's shortest, 30 s, for `rps` and
`--engine-window` (10 s) for the engine signals, which a gauge's mean follows about half a window late. `running`'s
targets (prefill 1.25, decode 2: half a decode batch, room for the rise while a replica loads) and the delay were
chosen with bench/slo_model.py over several seeds of the 600 s trace. One decode replica
(4 requests at once) saturates at about 2.4 req/s of the burst's output-heavy rise, 25 s into it: sooner than any
reactive policy can add one (its 20 s cold start after the window has seen the rise), so decode keeps two.
The `itl` policy is not in the default set: vLLM's ITL buckets are 25 ms and 50 ms around the stand-in's 30–35 ms steps, so the p90 read from them is 47.5 ms whatever the batch (Prometheus's interpolation
within a bucket), and a target between two bounds cannot tell a full batch from an empty one.

**The trace** (the same for every policy: seeded) is Dynamo's sinusoidal load generator
(benchmarks/sin_load_generator/sin_synth.py, which the planner's burst tests use) with a compressed period: in
each second t, Poisson(rate(t)) requests spread evenly over the second, rate(t) = (low + peak)/2 − (peak − low)/2 ×
cos(2π t / period), from `--low` at t = 0 to `--peak` at period/2 (the default trace is one period: one burst).
Each request is one of sin_synth's two classes: output-heavy (ISL 100, OSL 2,000 tokens) or prompt-heavy (ISL 5,000,
OSL 100), the share of the first going from 0.8 at t = 0 through 0.5 at the peak to 0.2 a period later
(0.5 + 0.3 cos(π t / period)), so that a burst's rise loads decode and its fall prefill: a mix a request rate cannot
see. Lengths are scaled down (prompt ÷ 16, output ÷ 32) and jittered ±20 % (uniform), so that a 2-CPU machine can
stream them: the prompt-heavy class's prefills then take about 0.6 s and the output-heavy class's decodes about 2 s. (ai-dynamo/dynamo#10528, the burst issue this bench follows, gives
no length distribution beyond its 32,032-token prompt; its traces are sin_synth's.)

**Requests** are `/v1/completions` with `"stream": true` through the gateway (auth on), the prompt as ISL
whitespace-separated words (the stand-in counts words as tokens) and `max_tokens` = OSL; smg in PD mode passes the
decode worker's event stream through, one chunk per token at the decode pace. Per request the client measures TTFT
(send → first token chunk) and ITL (its mean gap between token chunks, (last − first) / (tokens − 1)). A request is
**within the SLO** when it answered 200 with every token and `[DONE]`, TTFT ≤ `--ttft` and ITL ≤ `--itl`;
**failed** is any other status, a transport error or a stream cut short. Attainment counts failed requests as
missed. The client runs on the same 2 CPUs as everything else: its own delays count in its figures.

**Replica-seconds**: the bench counts the live stand-in engine processes of each worker group (prefill, decode) every
second from /proc (by their `DURASTACK_SERVICE` / `DURASTACK_GROUP` environment) and integrates them over the trace,
from its first request's send time to its last; a replica counts from its spawn (its 20 s "model load" included, as
a cloud bills it) until its process exits. The router (one replica in every policy) is not counted. Beside the
policies the summary prints **foresight**, what the cost goal is measured against: the replica-seconds of a policy
that knew the trace (foresight() below), each second at the fewest replicas that keep each group as busy as static's
busiest moment keeps it, within the same min and max, paying each added replica's cold start. No reactive policy
can be cheaper at static's attainment; on the default trace it is 80 % of static, the pools being small (4 + 3 at
the peak), so a count rounded up costs a quarter to a third of a replica's work.

**Decision lag**, per scale-up of a group during the trace (from `durastack events NAME --json`: `a → b` scale
events): the event's time minus the moment the group's signal crossed its target — the first of the bench's own
readings, after the last one that wanted no more than a, to want more (up to 3 s after the event: the bench's
reading is not in step with the autoscaler's, so a lag may be negative, the autoscaler's reading having crossed
first; min/median/max are printed, so the bench's resolution shows). The bench reads the
signal itself once a second, as the autoscaler does, from the same sources: each engine's /metrics through its
replica's socket (gauges averaged over the window, histograms' p90 of their increase over it; a group's total is
the sum over the replicas that answered: `queue` and `running` need ceil(total / target), `ttft`/`itl`/`kv_cache`
ceil(replicas × mean / target)), the gateway's request count over the window for `rps`. A scale-up whose crossing
the bench never read is counted as unseen, not given a lag. `static` has no decisions: n/a.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from backends import engine_metrics  # noqa: E402
from bench.stack import BenchStack, code_note, load_note, percentile, step, until  # noqa: E402

EXAMPLE = ROOT / "examples" / "pd-disaggregation"

# The stand-in engines' performance model (examples/pd-disaggregation/engine.py): vLLM's names, a 20 s cold start,
# prefill 2 ms per prompt token one request at a time, decode 30 ms per step for one request, 5 % slower per further
# request in a batch of at most 4, KV hand-offs waiting as long as a prefill queue may take.
PREFILL_SECONDS_PER_TOKEN, DECODE_SECONDS_PER_TOKEN, DECODE_BATCH, DECODE_SLOWDOWN = 0.002, 0.03, 4, 0.05
FULL_STEP = DECODE_SECONDS_PER_TOKEN * (1 + DECODE_SLOWDOWN * (DECODE_BATCH - 1))  # a full batch's decode step
ENGINE_COMMON = "--metric-names vllm --latency 0 --kv-timeout 300 --cold-start {cold_start:g}"
ENGINE_PREFILL = f"--max-running 1 --prefill-seconds-per-token {PREFILL_SECONDS_PER_TOKEN} --kv-cache-tokens 8192"
ENGINE_DECODE = (f"--max-running {DECODE_BATCH} --decode-seconds-per-token {DECODE_SECONDS_PER_TOKEN} "
                 f"--decode-batch-slowdown {DECODE_SLOWDOWN} --kv-cache-tokens 8192")

SERVICE = """\
type: service
name: {name}
port: 8000
env:
  - PD_EXAMPLE
  - SMG
groups:
  - name: router
    replicas: 1
    router:
      type: sglang
    commands:
      - >-
        "${{SMG:-smg}}" launch --pd-disaggregation --policy round_robin
        --host 0.0.0.0 --port "$PORT"
        --prometheus-host 127.0.0.1 --prometheus-port "$((PORT + 1))"
    resources: {{cpu: 1, memory: 1GB..}}
  - name: prefill
{prefill}
    commands:
      - >-
        python3 "$PD_EXAMPLE/engine.py" --disaggregation-mode prefill
        --host 0.0.0.0 --port "$PORT" --disaggregation-bootstrap-port 0 {common} {prefill_flags}
    resources: {{cpu: 1, memory: 1GB..}}
  - name: decode
{decode}
    commands:
      - >-
        python3 "$PD_EXAMPLE/engine.py" --disaggregation-mode decode
        --host 0.0.0.0 --port "$PORT" {common} {decode_flags}
    resources: {{cpu: 1, memory: 1GB..}}
"""

# policy → group → (metric, target); None: static. The rps targets come from the peak (policy_targets).
POLICIES: dict[str, Optional[dict[str, tuple[str, float]]]] = {
    "static": None,
    "rps": {"prefill": ("rps", 0.0), "decode": ("rps", 0.0)},
    "rps-headroom": {"prefill": ("rps", 0.0), "decode": ("rps", 0.0)},
    "running": {"prefill": ("running", 1.25), "decode": ("running", 2.0)},
    "queue": {"prefill": ("queue", 0.5), "decode": ("running", 3.0)},
    "ttft": {"prefill": ("ttft", 1.2), "decode": ("running", 3.0)},
    "itl": {"prefill": ("ttft", 1.2), "decode": ("itl", 0.034)},
}
WORKERS = ("prefill", "decode")
RPS_WINDOW = 30  # the gateway's shortest stats window, which `rps` is read over


# ---- the trace ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Req:
    at: float  # seconds after the trace's start
    isl: int
    osl: int


def make_trace(seed: int, duration: float, period: float, low: float, peak: float) -> list[Req]:
    """sin_synth's trace, scaled down (see the module's docstring)."""
    rng = random.Random(seed)
    out: list[Req] = []
    for t in range(int(duration)):
        rate = (low + peak) / 2 - (peak - low) / 2 * math.cos(2 * math.pi * t / period)
        n = _poisson(rng, rate)
        # the output-heavy share: 0.8 at t = 0, 0.5 at the peak, 0.2 a period later (a burst's rise loads decode,
        # its fall prefill)
        share = 0.5 + 0.3 * math.cos(math.pi * t / period)
        for i in range(n):
            isl, osl = (100, 2000) if rng.random() < share else (5000, 100)
            jitter = lambda: rng.uniform(0.8, 1.2)  # noqa: E731
            out.append(Req(at=t + i / n, isl=max(4, round(isl / 16 * jitter())), osl=max(2, round(osl / 32 * jitter()))))
    return out


def _poisson(rng: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p < limit:
            return k
        k += 1


@dataclass(frozen=True)
class Sizes:
    static: int  # the static policy's count: the peak's pool
    lo: int  # every scaled policy's range
    hi: int


def sizes(args: argparse.Namespace) -> dict[str, Sizes]:
    """Each worker group's sizes, from the command line."""
    return {"prefill": Sizes(args.static_prefill, args.min_prefill, args.max_prefill),
            "decode": Sizes(args.static_decode, args.min_decode, args.max_decode)}


def foresight(trace: list[Req], args: argparse.Namespace, smooth: int = 20) -> dict[str, float]:
    """Replica-seconds per worker group of a policy that knew the trace: each second, the fewest replicas that keep
    the group's work (prefill seconds; decode slots busy at a full batch's pace; a centred mean over ``smooth`` s)
    at or below the share of its static pool the busiest moment takes, within the policies' min and max, each
    replica added started a cold start ahead and paid for. What the cost goal is measured against."""
    seconds = int(args.duration)
    work = {g: [0.0] * seconds for g in WORKERS}
    for r in trace:
        work["prefill"][int(r.at)] += r.isl * PREFILL_SECONDS_PER_TOKEN
        work["decode"][int(r.at)] += r.osl * FULL_STEP / DECODE_BATCH
    out = {}
    for g, size in sizes(args).items():
        spans = [work[g][max(0, t - smooth // 2):t + smooth // 2] for t in range(seconds)]
        mean = [sum(span) / len(span) for span in spans]
        busiest = max(mean) / size.static
        counts = [min(size.hi, max(size.lo, math.ceil(m / busiest - 1e-9))) for m in mean]
        out[g] = sum(counts) + args.cold_start * sum(max(0, b - a) for a, b in zip(counts, counts[1:]))
    return out


# ---- the load -------------------------------------------------------------------------------------------------------

@dataclass
class Result:
    req: Req
    sent: float = 0.0
    status: object = None  # HTTP status, or the transport error's name
    tokens: list[float] = field(default_factory=list)  # arrival of each token chunk
    done: bool = False

    @property
    def failed(self) -> bool:
        return self.status != 200 or not self.done or len(self.tokens) != self.req.osl

    @property
    def ttft(self) -> Optional[float]:
        return self.tokens[0] - self.sent if self.tokens else None

    @property
    def itl(self) -> Optional[float]:
        return (self.tokens[-1] - self.tokens[0]) / (len(self.tokens) - 1) if len(self.tokens) > 1 else 0.0

    def within(self, ttft: float, itl: float) -> bool:
        return not self.failed and self.ttft <= ttft and self.itl <= itl


async def drive(url: str, token: str, trace: list[Req], timeout: float) -> tuple[list[Result], float, float]:
    """Send the trace (each request at its time), stream every answer; (results, start, end) in monotonic time."""
    results = [Result(r) for r in trace]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30), limits=limits, trust_env=False,
                                 headers={"Authorization": f"Bearer {token}"}) as client:
        start = time.monotonic()

        async def one(i: int, res: Result) -> None:
            await asyncio.sleep(max(0.0, start + res.req.at - time.monotonic()))
            words = " ".join(f"w{(i + k) % 997}" for k in range(res.req.isl))
            body = {"model": "standin", "prompt": words, "max_tokens": res.req.osl, "stream": True}
            res.sent = time.monotonic()
            try:
                async with client.stream("POST", url, json=body) as r:
                    res.status = r.status_code
                    if r.status_code != 200:
                        await r.aread()
                        return
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[len("data: "):]
                        if data == "[DONE]":
                            res.done = True
                            break
                        choices = json.loads(data).get("choices") or []
                        if choices and choices[0].get("text"):
                            res.tokens.append(time.monotonic())
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                res.status = type(e).__name__

        await asyncio.wait_for(asyncio.gather(*(one(i, r) for i, r in enumerate(results))),
                               timeout=(trace[-1].at if trace else 0) + timeout + 30)
        end = start + (trace[-1].at if trace else 0.0)
    return results, start, end


# ---- what the bench watches while the trace runs -----------------------------------------------------------------

def engine_groups(service: str) -> dict[int, str]:
    """PID → worker group of the service's live stand-in engines (python …/engine.py with the replica's env)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if not any(a.endswith(b"engine.py") for a in argv) or b"python" not in Path(argv[0].decode()).name.encode():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            env = dict(e.split(b"=", 1) for e in (entry / "environ").read_bytes().split(b"\0") if b"=" in e)
        except (OSError, IndexError, ValueError):
            continue
        if state not in "ZX" and env.get(b"DURASTACK_SERVICE") == service.encode():
            found[int(entry.name)] = env.get(b"DURASTACK_GROUP", b"").decode()
    return found


class Watch:
    """A thread that, every second: counts the engines per worker group, and reads each group's signal the way its
    policy's autoscaler does (for the decision lag)."""

    def __init__(self, stack: BenchStack, service: str, policy: Optional[dict[str, tuple[str, float]]],
                 window: float):
        self.stack, self.service, self.policy, self.window = stack, service, policy, window
        self.counts: list[tuple[float, dict[str, int]]] = []  # (epoch, group → live engines)
        self.wanted: dict[str, list[tuple[float, Optional[int]]]] = {g: [] for g in WORKERS}  # (epoch, wanted count)
        self.readings: dict[str, deque] = {}  # replica dir → its engine_metrics.Reading, oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._clients: dict[str, httpx.Client] = {}

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join(30)
        for c in self._clients.values():
            c.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            tick = time.monotonic()
            now = time.time()
            try:
                per = {g: 0 for g in WORKERS}
                for group in engine_groups(self.service).values():
                    if group in per:
                        per[group] += 1
                self.counts.append((now, per))
                if self.policy:
                    self._signals(now)
            except Exception as e:  # a reading lost is a second without one, not a failed run
                print(f"  (watch: {type(e).__name__}: {e})", file=sys.stderr)
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - tick)))

    def _signals(self, now: float) -> None:
        engine = [g for g, (metric, _) in self.policy.items() if metric != "rps"]
        rate = None
        if any(metric == "rps" for metric, _ in self.policy.values()):
            rate = self._rate()
        values: dict[str, list[float]] = {g: [] for g in engine}
        for group in engine:
            metric = self.policy[group][0]
            for replica_dir in sorted((self.stack.home / "replicas" / self.service / group).glob("r*-s*")):
                value = self._engine_value(replica_dir, metric)
                if value is not None:
                    values[group].append(value)
        for group, (metric, target) in self.policy.items():
            if metric == "rps":
                total = rate
            else:
                read = values[group]
                total = sum(read) if read else None  # additive: the sum; averages: replicas × mean = the sum too
            self.wanted[group].append((now, None if total is None else max(1, math.ceil(total / target - 1e-9))))

    def _rate(self) -> Optional[float]:
        try:
            stats = httpx.get(f"{self.stack.control}/api/stats", timeout=2, trust_env=False, headers={
                "Authorization": f"Bearer {self.stack.settings.control_token}"}).json()["services"].get(self.service)
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return stats["windows"][str(RPS_WINDOW)]["requests"] / RPS_WINDOW if stats else 0.0

    def _engine_value(self, replica_dir: Path, metric: str) -> Optional[float]:
        try:
            inst = json.loads((replica_dir / ".durastack" / "instance.json").read_text())
        except (OSError, ValueError):
            return None
        address, key = inst.get("address", ""), str(replica_dir)
        if not address.startswith("unix:") or not os.path.exists(address[len("unix:"):]):
            self.readings.pop(key, None)
            return None
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = httpx.Client(transport=httpx.HTTPTransport(uds=address[len("unix:"):]),
                                                       timeout=1, trust_env=False)
        try:
            r = client.get("http://replica/metrics")
            if r.status_code != 200:
                return None
            reading = engine_metrics.read(metric, r.text, time.monotonic())
        except (httpx.HTTPError, ValueError):  # UnknownNames is a ValueError
            return None
        history = self.readings.setdefault(key, deque())
        history.append(reading)
        while len(history) > 1 and history[1].at <= reading.at - self.window:
            history.popleft()
        return engine_metrics.over_window(metric, list(history), self.window)


# ---- one run --------------------------------------------------------------------------------------------------------

@dataclass
class Run:
    policy: str
    results: list[Result]
    start: float  # epoch
    end: float
    replica_seconds: dict[str, float]
    scale_ups: int = 0
    lags: list[float] = field(default_factory=list)
    unseen: int = 0  # scale-ups decided before the bench's own reading crossed
    events: list[dict] = field(default_factory=list)
    counts: list = field(default_factory=list)  # the watch's (epoch, group → live engines)
    wanted: dict = field(default_factory=dict)  # the watch's group → [(epoch, wanted count)]


def policy_targets(policy: str, args: argparse.Namespace) -> Optional[dict[str, tuple[str, float]]]:
    """Each worker group's (metric, target) under ``policy``; None for static. An rps target is the peak's rate
    over the group's static size: the rate one replica of the peak's pool serves (× `--rps-headroom` for
    `rps-headroom`: more replicas, at about an engine signal's cost)."""
    spec = POLICIES[policy]
    if spec is None:
        return None
    scale = args.rps_headroom if policy == "rps-headroom" else 1.0
    return {group: (metric, round(args.peak / sizes(args)[group].static * scale, 3) if metric == "rps" else target)
            for group, (metric, target) in spec.items()}


def group_spec(policy: str, group: str, args: argparse.Namespace) -> str:
    targets, size = policy_targets(policy, args), sizes(args)[group]
    if targets is None:
        return f"    replicas: {size.static}"
    metric, target = targets[group]
    window = RPS_WINDOW if metric == "rps" else args.engine_window
    return (f"    replicas: {size.lo}..{size.hi}\n"
            f"    scaling: {{metric: {metric}, target: {target:g}, window: {window}s, scale_up_delay: 0s, "
            f"scale_down_delay: {args.scale_down_delay:g}s}}")


def service_file(policy: str, args: argparse.Namespace) -> str:
    return SERVICE.format(name=f"slo-{policy}", prefill=group_spec(policy, "prefill", args),
                          decode=group_spec(policy, "decode", args),
                          common=ENGINE_COMMON.format(cold_start=args.cold_start), prefill_flags=ENGINE_PREFILL,
                          decode_flags=ENGINE_DECODE)


def settled(stack: BenchStack, name: str) -> bool:
    """Every group at its desired count, ready and running, and the router listing every worker healthy."""
    status = stack.ps(name)
    workers = 0
    for g in status["groups"]:
        live = [r for r in g["replicas"] if r["status"] not in ("terminated", "failed")]
        if len(live) != g["desired"] or not all(r["ready"] and r["status"] == "running" for r in live):
            return False
        workers += g["desired"] if g["role"] == "worker" else 0
    view = status.get("router") or []
    return len(view) == 1 and sum(w["healthy"] for w in view[0]["workers"]) == workers


def run_policy(stack: BenchStack, policy: str, trace: list[Req], args: argparse.Namespace) -> Run:
    name = f"slo-{policy}"
    step(f"{policy}: {name}")
    path = stack.write(f"{name}.yml", service_file(policy, args))
    if args.print_files:
        print(path.read_text())
    stack.check("apply", "-f", str(path), "-y", timeout=600)
    until(lambda: settled(stack, name), 300, 1.0, f"{name} ready, every worker listed by the router")
    token = stack.token()
    url = f"{stack.gateway}/services/{name}/v1/completions"
    with Watch(stack, name, policy_targets(policy, args), args.engine_window) as watch:
        epoch0, mono0 = time.time(), time.monotonic()
        results, start, end = asyncio.run(drive(url, token, trace, args.request_timeout))
    start_epoch, end_epoch = epoch0 + (start - mono0), epoch0 + (end - mono0)
    events = json.loads(stack.check("events", name, "--json"))
    stack.check("stop", name, "-y", timeout=600)
    run = Run(policy, results, start_epoch, end_epoch, integrate(watch.counts, start_epoch, end_epoch),
              events=events, counts=watch.counts, wanted=watch.wanted)
    for res in results:  # epoch times from here on, as the watch's and the events'
        res.sent = epoch0 + (res.sent - mono0) if res.sent else 0.0
        res.tokens = [epoch0 + (t - mono0) for t in res.tokens]
    decision_lags(run, watch)
    return run


def integrate(counts: list[tuple[float, dict[str, int]]], start: float, end: float) -> dict[str, float]:
    """Replica-seconds per group over [start, end]: each sample holds until the next."""
    out = {g: 0.0 for g in WORKERS}
    for (t, per), (t_next, _) in zip(counts, counts[1:] + [(end, {})]):
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            for g in WORKERS:
                out[g] += per.get(g, 0) * (hi - lo)
    return out


SCALE = re.compile(r"^(\d+) → (\d+)")


def decision_lags(run: Run, watch: Watch, grace: float = 3.0) -> None:
    """Each scale-up's lag: its event's time minus the first of the bench's readings, after the last one that wanted
    no more than the old count, to want more. The bench reads once a second, like the autoscaler but not in step with
    it: a reading up to ``grace`` s after the event still counts (a negative lag: the autoscaler's reading crossed
    first); none by then is counted as unseen."""
    for e in run.events:
        m = SCALE.match(e.get("message", ""))
        group = e.get("group")
        if e.get("kind") != "scale" or not m or group not in watch.wanted or "manual" in e["message"]:
            continue
        at = datetime.fromisoformat(e["at"]).timestamp()
        old, new = int(m.group(1)), int(m.group(2))
        if new <= old or not run.start <= at <= run.end:
            continue
        run.scale_ups += 1
        samples = watch.wanted[group]
        below = [t for t, w in samples if t <= at and (w is None or w <= old)]
        since = below[-1] if below else float("-inf")
        crossed = next((t for t, w in samples if since < t <= at + grace and w is not None and w > old), None)
        if crossed is None:
            run.unseen += 1
        else:
            run.lags.append(at - crossed)


# ---- report ---------------------------------------------------------------------------------------------------------

def on_rate(policy: str, args: argparse.Namespace) -> bool:
    """Whether every group of the policy scales on the gateway's request rate (rps, rps-headroom)."""
    targets = policy_targets(policy, args)
    return bool(targets) and all(metric == "rps" for metric, _ in targets.values())


def figures(run: Run, base: float, args: argparse.Namespace) -> tuple[float, float]:
    """(SLO attainment, replica-seconds as a share of ``base``, static's)."""
    n = len(run.results)
    return (sum(x.within(args.ttft, args.itl) for x in run.results) / n if n else 0.0,
            sum(run.replica_seconds.values()) / base)


def goal(run: Run, on_rps: list[Run], base: float, args: argparse.Namespace) -> str:
    """The goal's line for an engine-signal policy: ≥ 95 % attainment, ≤ 75 % of static's cost, 0 failed, and a
    better attainment than an rps run that cost as much or more."""
    att, cost = figures(run, base, args)
    ok = [att >= 0.95, cost <= 0.75, all(not x.failed for x in run.results)]
    versus = ""
    if on_rps:
        rates = [(r.policy, *figures(r, base, args)) for r in on_rps]
        ok.append(any(att > a and cost <= c for _, a, c in rates))
        versus = ", better than rps at equal or lower cost (" + \
            ", ".join(f"{p} {a:.1%} at {c:.0%}" for p, a, c in rates) + ")"
    return (f"goal for {run.policy}: ≥ 95 % attainment ({att:.1%}), ≤ 75 % of static's replica-seconds ({cost:.0%})"
            f"{versus}, 0 failed: {'met' if all(ok) else 'not met'}")


def report(runs: list[Run], args: argparse.Namespace, trace: list[Req]) -> None:
    step(f"summary: TTFT ≤ {args.ttft:g} s and ITL ≤ {args.itl:g} s; {len(trace)} requests over {args.duration:g} s "
         f"(rate {args.low:g} → {args.peak:g} req/s, period {args.period:g} s, seed {args.seed})")
    static = next((r for r in runs if r.policy == "static"), None)
    base = sum(static.replica_seconds.values()) if static else None
    head = (f"{'policy':8} {'requests':>8} {'failed':>6} {'SLO met':>8} {'TTFT p50/p90/p99 s':>19} {'ITL p90 s':>9} "
            f"{'replica-s P+D':>15} {'vs static':>9} {'scale-ups':>9} {'lag min/med/max s':>18}")
    print(head)
    for r in runs:
        n = len(r.results)
        met = sum(x.within(args.ttft, args.itl) for x in r.results)
        failed = sum(x.failed for x in r.results)
        ttfts = sorted(x.ttft for x in r.results if x.ttft is not None)
        itls = sorted(x.itl for x in r.results if x.itl is not None and not x.failed)
        rs = r.replica_seconds
        total = sum(rs.values())
        vs = f"{total / base:.0%}" if base else "n/a"
        if r.policy == "static":
            lag = "n/a (no decisions)"
        elif r.lags:
            lag = f"{min(r.lags):.1f}/{percentile(sorted(r.lags), 50):.1f}/{max(r.lags):.1f}"
        else:
            lag = "n/a (none seen)"
        if r.unseen:
            lag += f" +{r.unseen} unseen"
        ttft = "/".join(f"{percentile(ttfts, q):.2f}" for q in (50, 90, 99)) if ttfts else "n/a"
        itl = f"{percentile(itls, 90):.3f}" if itls else "n/a"
        print(f"{r.policy:8} {n:>8} {failed:>6} {met / n if n else 0:>8.1%} {ttft:>19} {itl:>9} "
              f"{rs['prefill']:>6.0f}+{rs['decode']:<6.0f}={total:<5.0f} {vs:>6} {r.scale_ups:>9} {lag:>18}")
    seen = foresight(trace, args)
    vs = f"{sum(seen.values()) / base:.0%}" if base else "n/a"
    print(f"{'foresight':9} {'':>53} {seen['prefill']:>6.0f}+{seen['decode']:<6.0f}={sum(seen.values()):<5.0f} {vs:>6}")
    print("replica-s: live engine processes (cold start included) integrated over the trace; foresight: a policy "
          "that knew the trace, at static's busiest share (bench/slo.py foresight()); lag: scale-up event "
          "minus the bench's own reading of the signal crossing its target, read once a second (negative: the "
          "autoscaler's reading crossed first; 'unseen': the bench's had not crossed 3 s after)")
    if base:
        on_rps = [r for r in runs if r.results and on_rate(r.policy, args)]
        for r in runs:
            if r.policy != "static" and r not in on_rps:
                print(goal(r, on_rps, base, args))
    for r in runs:
        fails = {}
        for x in r.results:
            if x.failed:
                why = x.status if x.status != 200 else ("cut short" if not x.done else "missing tokens")
                fails[why] = fails.get(why, 0) + 1
        if fails:
            print(f"{r.policy}: failed requests by cause: {fails}")


def timeline(run: Run, args: argparse.Namespace, step_s: float = 10.0) -> None:
    """Per `step_s` of the trace: the rate sent, the live engines, what the requests sent then met, and the bench's
    reading of each group's wanted count."""
    print(f"\n{run.policy}: every {step_s:g} s of the trace (requests by send time; engines: mean live; wanted: the "
          "bench's reading of the policy's signal, last in the step)")
    print(f"{'t s':>5} {'req/s':>5} {'prefill':>7} {'decode':>6} {'SLO met':>7} {'TTFT p90':>8} {'wanted P/D':>10}")
    t = 0.0
    while t < args.duration:
        lo, hi = run.start + t, run.start + t + step_s
        sent = [x for x in run.results if lo <= x.sent < hi]
        counts = [per for at, per in run.counts if lo <= at < hi]
        live = {g: sum(c.get(g, 0) for c in counts) / len(counts) if counts else float("nan") for g in WORKERS}
        met = sum(x.within(args.ttft, args.itl) for x in sent)
        ttfts = sorted(x.ttft for x in sent if x.ttft is not None)
        wanted = []
        for g in WORKERS:
            w = [v for at, v in run.wanted.get(g, []) if lo <= at < hi]
            wanted.append("-" if not w or w[-1] is None else str(w[-1]))
        print(f"{t:>5.0f} {len(sent) / step_s:>5.1f} {live['prefill']:>7.1f} {live['decode']:>6.1f} "
              f"{met / len(sent) if sent else 1:>7.0%} {percentile(ttfts, 90) if ttfts else 0:>8.2f} "
              f"{'/'.join(wanted):>10}")
        t += step_s


def dump(runs: list[Run], path: str) -> None:
    data = [{"policy": r.policy, "start": r.start, "end": r.end, "replica_seconds": r.replica_seconds,
             "events": r.events, "counts": r.counts, "wanted": r.wanted, "lags": r.lags, "unseen": r.unseen,
             "results": [{"at": x.req.at, "isl": x.req.isl, "osl": x.req.osl, "sent": x.sent, "status": x.status,
                          "done": x.done, "ttft": x.ttft, "itl": x.itl, "tokens": len(x.tokens)} for x in r.results]}
            for r in runs]
    Path(path).write_text(json.dumps(data))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--policies", default="static,rps,running,ttft",
                   help=f"Comma-separated, run in this order, from: {', '.join(POLICIES)}.")
    p.add_argument("--period", type=float, default=200.0, help="Period of the request rate (s).")
    p.add_argument("--duration", type=float, default=None, help="Trace length (s); default one period.")
    p.add_argument("--low", type=float, default=1.0, help="Lowest request rate (req/s).")
    p.add_argument("--peak", type=float, default=8.0, help="Peak request rate (req/s).")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--ttft", type=float, default=2.0, help="TTFT target of the SLO (s).")
    p.add_argument("--itl", type=float, default=0.06, help="ITL target of the SLO: a request's mean gap (s).")
    p.add_argument("--static-prefill", type=int, default=4, help="Prefill replicas of `static` (the peak's size).")
    p.add_argument("--static-decode", type=int, default=3, help="Decode replicas of `static` (the peak's size).")
    p.add_argument("--min-prefill", type=int, default=1, help="Fewest prefill replicas of every scaled policy.")
    p.add_argument("--min-decode", type=int, default=2, help="Fewest decode replicas of every scaled policy.")
    p.add_argument("--max-prefill", type=int, default=4, help="Most prefill replicas of every scaled policy.")
    p.add_argument("--max-decode", type=int, default=3, help="Most decode replicas of every scaled policy.")
    p.add_argument("--rps-headroom", type=float, default=0.75,
                   help="`rps-headroom`'s targets as a share of `rps`'s: rps at about an engine signal's cost.")
    p.add_argument("--engine-window", type=int, default=10,
                   help="`window` of the engine-signal policies (s); `rps` is read over the gateway's 30 s.")
    p.add_argument("--scale-down-delay", type=float, default=30.0)
    p.add_argument("--cold-start", type=float, default=20.0, help="The engines' model-load time (s).")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--print-files", action="store_true", help="Print each policy's service file.")
    p.add_argument("--timeline", action="store_true", help="Also print each run, 10 s at a time.")
    p.add_argument("--dump", metavar="FILE", help="Write every run's raw figures (requests, events, readings) as JSON.")
    p.add_argument("--keep", action="store_true", help="Keep the temp dir (logs, files).")
    args = p.parse_args()
    args.duration = args.duration or args.period
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    os.environ["PD_EXAMPLE"] = str(EXAMPLE)
    os.environ["SMG"] = str(Path(sys.executable).parent / "smg")
    trace = make_trace(args.seed, args.duration, args.period, args.low, args.peak)
    print(f"{datetime.now():%Y-%m-%d %H:%M} local, {code_note()}; {load_note()} at the start", flush=True)
    runs = []
    with BenchStack(keep=args.keep) as stack:
        for policy in policies:
            runs.append(run_policy(stack, policy, trace, args))
    print(f"load at the end: {load_note()}")
    report(runs, args, trace)
    if args.timeline:
        for run in runs:
            timeline(run, args)
    if args.dump:
        dump(runs, args.dump)


if __name__ == "__main__":
    main()
