"""Engine signals: vLLM's and SGLang's Prometheus exposition read as the engines write it (counters, gauges,
histograms with labels, several series), the window's mean and p90, the scaling formulas, and the engine watcher
reading real HTTP endpoints the way the probes reach a replica."""

from __future__ import annotations

import asyncio
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from activities.engines import EngineActivities, changed
from backends.engine_metrics import Reading, UnknownNames, over_window, quantile, read, requests_in_flight
from models.replica import LocalInstance
from models.messages import EngineGroupWatch, EngineWatch, Watched
from models.state import NOT_READ_YET, ReplicaSignal
from rules.autoscaler import engine_total, wanted

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]


def vllm(running=3, waiting=5, kv=0.42, ttft: dict[float, int] | None = None, engines=("0",)) -> str:
    """vLLM v1's /metrics, written as vLLM writes it: by prometheus_client, with its bucket bounds, an `engine`
    label per data-parallel rank, `_created` samples and counters' `_total`. ``ttft``: observations per bound."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    model = "meta-llama/Llama-3.1-8B-Instruct"
    gauges = {name: Gauge(name, name, labels, registry=registry) for name in
              ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}
    tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry)
    hist = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                     buckets=TTFT_BUCKETS, registry=registry)
    for e in engines:
        for name, value in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
                            ("vllm:kv_cache_usage_perc", kv)):
            gauges[name].labels(e, model).set(value)
        tokens.labels(e, model).inc(12345)
        for bound, count in (ttft or {}).items():
            for _ in range(count):
                hist.labels(e, model).observe(bound)
    return generate_latest(registry).decode()


SGLANG = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",tp_rank="0"} 7.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",tp_rank="0"} 0.8
# HELP sglang:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE sglang:inter_token_latency_seconds histogram
sglang:inter_token_latency_seconds_bucket{le="0.01",model_name="qwen",tp_rank="0"} 10.0
sglang:inter_token_latency_seconds_bucket{le="0.05",model_name="qwen",tp_rank="0"} 90.0
sglang:inter_token_latency_seconds_bucket{le="0.1",model_name="qwen",tp_rank="0"} 100.0
sglang:inter_token_latency_seconds_bucket{le="+Inf",model_name="qwen",tp_rank="0"} 100.0
sglang:inter_token_latency_seconds_sum{model_name="qwen",tp_rank="0"} 3.1
sglang:inter_token_latency_seconds_count{model_name="qwen",tp_rank="0"} 100.0
"""


def test_vllm_gauges_sum_over_ranks_and_the_kv_cache_is_their_mean():
    text = vllm(running=3, waiting=5, kv=0.5, engines=("0", "1"))
    assert read("queue", text, 0).value == 10  # two ranks, 5 waiting each
    assert read("running", text, 0).value == 16  # running + waiting
    assert read("kv_cache", text, 0).value == 0.5


def test_vllm_histogram_buckets_sum_over_ranks():
    reading = read("ttft", vllm(ttft={0.1: 2, 0.5: 1}, engines=("0", "1")), 0)
    buckets = dict(reading.buckets)
    assert buckets[0.08] == 0 and buckets[0.1] == 4 and buckets[0.5] == 6 and buckets[math.inf] == 6


def test_sglang_names_are_recognised():
    assert read("queue", SGLANG, 0).value == 2
    assert read("running", SGLANG, 0).value == 9
    assert read("kv_cache", SGLANG, 0).value == 0.8
    # p90 of 100 observations: the 90th is the last of the (0.01, 0.05] bucket.
    assert over_window("itl", [Reading(at=0, buckets=((0.01, 0), (0.05, 0), (0.1, 0), (math.inf, 0))),
                               read("itl", SGLANG, 10)], 30) == pytest.approx(0.05)


def test_a_drain_counts_sglangs_pd_hand_offs_and_no_scaling_metric_does():
    handoff = "".join(f"# TYPE sglang:{n} gauge\nsglang:{n}{{model_name=\"qwen\",tp_rank=\"0\"}} {v}\n" for n, v in (
        ("num_decode_prealloc_queue_reqs", 1.0), ("num_decode_transfer_queue_reqs", 3.0),
        ("num_prefill_bootstrap_queue_reqs", 0.0), ("num_prefill_inflight_queue_reqs", 0.0)))
    assert requests_in_flight(SGLANG) == 9
    assert requests_in_flight(SGLANG + handoff) == 13
    assert read("running", SGLANG + handoff, 0).value == read("running", SGLANG, 0).value == 9
    assert requests_in_flight(handoff) is None  # an engine that says nothing of its batch


def test_the_older_vllm_kv_cache_name_is_read_and_the_newer_wins():
    old = "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0.3\n"
    assert read("kv_cache", old, 0).value == 0.3
    both = old + "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.6\n"
    assert read("kv_cache", both, 0).value == 0.6


def test_an_engine_without_the_names_says_which_it_lacks():
    with pytest.raises(UnknownNames, match="none of vllm:num_requests_waiting, sglang:num_queue_reqs"):
        read("queue", "# TYPE other gauge\nother 1\n", 0)
    with pytest.raises(UnknownNames, match="a histogram"):  # a gauge of that name is not the histogram
        read("ttft", "# TYPE vllm:time_to_first_token_seconds gauge\nvllm:time_to_first_token_seconds 1\n", 0)


def test_a_gauge_is_the_mean_of_the_window_and_a_latency_the_p90_of_its_increase():
    gauges = [Reading(at=t, value=v) for t, v in ((0, 100), (40, 2), (50, 4), (60, 6))]
    assert over_window("queue", gauges, 30) == 4  # the one at 0 s is outside the window
    first = read("ttft", vllm(ttft={5.0: 50}), 0)  # slow requests before the window
    later = read("ttft", vllm(ttft={5.0: 50, 0.1: 9, 0.25: 1}), 40)
    assert over_window("ttft", [first, later], 30) == pytest.approx(0.1)  # only the 10 within: 9 fast, 1 at 0.25
    assert over_window("ttft", [first, read("ttft", vllm(ttft={5.0: 50}), 40)], 30) == 0  # idle: fast
    assert over_window("ttft", [first], 30) is None  # one reading tells nothing of a window
    restarted = read("ttft", vllm(ttft={0.5: 2}), 40)  # the counters went back: counted since
    assert over_window("ttft", [first, restarted], 30) == pytest.approx(0.475)


def test_quantile_is_prometheus_histogram_quantile():
    buckets = [(0.1, 0.0), (0.2, 10.0), (math.inf, 10.0)]
    assert quantile(0.9, buckets) == pytest.approx(0.19)  # linear within (0.1, 0.2]
    assert quantile(0.9, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1  # in +Inf: the highest finite bound
    assert quantile(0.9, [(0.1, 0.0), (math.inf, 0.0)]) == 0.0


def test_the_formulas():
    # Additive (queue, running): ceil(sum / target). Averages and latencies: ceil(replicas × mean / target),
    # which is the same sum of each replica's value.
    assert wanted(engine_total(7, 1, 1), 2, 1, 10)[0] == 4
    assert wanted(engine_total(3 * 0.1, 3, 3), 0.1, 1, 10)[0] == 3  # 3 × 0.1 / 0.1, not 4 by float error
    assert wanted(engine_total(0.9 + 0.9, 2, 2), 0.6, 1, 10)[0] == 3  # kv_cache 0.9 on 2 → ceil(2 × 0.9 / 0.6)
    # An unreadable replica counts as the average of the read; one never read is not counted.
    assert engine_total(6, 2, 3) == 9 and engine_total(6, 2, 2) == 6
    assert engine_total(0, 0, 3) is None


# --- the watcher, against real endpoints ----------------------------------------------------------------------

class Engine:
    """An HTTP server on 127.0.0.1 answering /metrics with whatever ``text`` holds (or ``status``)."""

    def __init__(self):
        self.text, self.status = vllm(), 200
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = owner.text.encode() if self.path == "/metrics" else b"no"
                self.send_response(owner.status if self.path == "/metrics" else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def engines():
    made = [Engine(), Engine()]
    yield made
    for e in made:
        e.close()


def _watched(num: int, address: str) -> Watched:
    instance = LocalInstance(replica_id=f"s/g/r{num}-s0", pid=1, start_time=1, work_dir="/nonexistent",
                             address=address, isolated=False, log_path="/nonexistent/log")
    return Watched(replica_num=num, submission_num=0, group="g", workflow_id=f"w{num}", replica_id=f"s/g/r{num}-s0",
                   instance=instance)


def _watch(metric: str, engines, wanted_now: int, known=()) -> EngineWatch:
    group = EngineGroupWatch(name="g", metric=metric, target=2, window=30, lo=1, hi=10, wanted=wanted_now)
    return EngineWatch(service="s", backend="local", groups=[group], known=list(known), poll_seconds=0.05,
                       replicas=[_watched(i, e.address) for i, e in enumerate(engines)])


async def _run(acts: EngineActivities, watch: EngineWatch):
    from temporalio.testing import ActivityEnvironment

    return await asyncio.wait_for(ActivityEnvironment().run(acts.watch, watch), 10)


@pytest.mark.asyncio
async def test_the_watcher_reads_each_engine_and_returns_when_the_wanted_count_moves(engines):
    acts = EngineActivities(lambda backend: (lambda instance: (instance.address, None)))
    engines[0].text, engines[1].text = vllm(waiting=1), vllm(waiting=2)
    known = [ReplicaSignal(replica_num=i, submission_num=0, group="g", value=v) for i, v in ((0, 1.0), (1, 2.0))]
    snap = await _run(acts, _watch("queue", engines, wanted_now=1, known=known))  # ceil(3 / 2) = 2 ≠ 1
    assert [(s.replica_num, s.value) for s in snap.replicas] == [(0, 1.0), (1, 2.0)]
    # An engine that stops answering is said, with why; the other goes on being read.
    engines[1].status = 503
    snap = await _run(acts, _watch("queue", engines, wanted_now=2, known=snap.replicas))
    assert snap.replicas[1].value is None and snap.replicas[1].error == "/metrics answered HTTP 503"
    assert snap.replicas[0].value is not None


@pytest.mark.asyncio
async def test_a_latency_needs_two_readings_and_the_readings_outlive_the_watcher(engines):
    acts = EngineActivities(lambda backend: (lambda instance: (instance.address, None)))
    engines = engines[:1]
    engines[0].text = vllm(ttft={0.1: 5})
    first = _watch("ttft", engines, wanted_now=-1)
    snap = await _run(acts, first)  # a second reading came, then the value: p90 of no new request is 0
    assert snap.replicas[0].value == 0
    # A restarted watcher goes on with the readings kept: 40 slow requests since → p90 in (2.5, 5].
    engines[0].text = vllm(ttft={0.1: 5, 5.0: 40})
    snap = await _run(acts, _watch("ttft", engines, wanted_now=-1, known=snap.replicas))
    assert 2.5 < snap.replicas[0].value <= 5.0


def test_a_replica_read_once_is_not_news_but_one_read_for_the_first_time_is():
    group = EngineGroupWatch(name="g", metric="ttft", target=1, window=30, lo=1, hi=4, wanted=1)
    fresh = ReplicaSignal(replica_num=0, submission_num=0, group="g", error=NOT_READ_YET)
    assert not changed([group], [fresh], {})
    read_now = ReplicaSignal(replica_num=0, submission_num=0, group="g", value=0.5)
    assert changed([group], [read_now], {(0, 0): fresh})
    assert not changed([group], [read_now], {(0, 0): read_now})
