"""The stand-in engine's performance model (examples/pd-disaggregation/engine.py), as bench/slo.py runs it: vLLM's
metric names, a batch capacity with a waiting queue, prefill and decode times, latency histograms, streaming and a
cold start. Each test starts the engine as a subprocess on 127.0.0.1 (free ports) and ends only what it started."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.engine_metrics import gauges, read, requests_in_flight
from tests.conftest import eventually
from tests.standins import Processes, free_port

VLLM_TTFT_BOUNDS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL_BOUNDS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0]


class Engines(Processes):
    def start(self, mode: str, *flags: str, bootstrap: int = 0) -> tuple[int, subprocess.Popen]:
        """The engine as bench/slo.py runs it: no fixed latency, its stdout readable."""
        return self.start_engine(mode, *flags, latency=0, bootstrap=bootstrap, capture=True)


@pytest.fixture
def engines():
    e = Engines()
    yield e
    e.stop_all()


async def _get(port: int, path: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as c:
        return await c.get(f"http://127.0.0.1:{port}{path}")


async def _up(port: int) -> None:
    async def answers() -> bool:
        try:
            return (await _get(port, "/health")).status_code == 200
        except httpx.HTTPError:
            return False
    await eventually(answers, 30)


async def _metrics(port: int) -> dict:
    """Family name → family, parsed by prometheus_client's parser."""
    text = (await _get(port, "/metrics")).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict, name: str, sample: str = "") -> float:
    return sum(s.value for s in families[name].samples if s.name == (sample or name))


def _bounds(family) -> list[float]:
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


async def _complete(port: int, prompt_words: int, max_tokens: int, **extra) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
        return await c.post(f"http://127.0.0.1:{port}/v1/completions", json={
            "model": "standin", "prompt": " ".join(["w"] * prompt_words), "max_tokens": max_tokens, **extra})


async def test_vllm_names_parse_as_gauges_and_histograms_with_vllms_buckets(engines):
    port, _ = engines.start("null", "--metric-names", "vllm")
    await _up(port)
    families = await _metrics(port)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge", name
        assert [s.labels for s in families[name].samples] == [{"model_name": "standin", "engine": "0"}]
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds"):
        assert families[name].type == "histogram", name
    assert families["vllm:prompt_tokens"].type == "counter"
    assert _bounds(families["vllm:time_to_first_token_seconds"]) == VLLM_TTFT_BOUNDS + [float("inf")]
    assert _bounds(families["vllm:inter_token_latency_seconds"]) == VLLM_ITL_BOUNDS + [float("inf")]
    assert not any(name.startswith("sglang:") for name in families)


async def test_a_request_beyond_the_batch_waits_and_the_histograms_count_every_request(engines):
    # one request at a time, each 10 tokens of 0.05 s: the second waits about half a second
    port, _ = engines.start("null", "--metric-names", "vllm", "--max-running", "1",
                            "--prefill-seconds-per-token", "0.001", "--decode-seconds-per-token", "0.05",
                            "--kv-cache-tokens", "1000")
    await _up(port)
    first = asyncio.ensure_future(_complete(port, 100, 10))
    second = None

    async def one_running() -> bool:
        return _value(await _metrics(port), "vllm:num_requests_running") == 1
    await eventually(one_running, 10, 0.01)
    second = asyncio.ensure_future(_complete(port, 100, 10))

    async def one_waiting() -> dict:
        families = await _metrics(port)
        return families if _value(families, "vllm:num_requests_waiting") == 1 else {}
    families = await eventually(one_waiting, 10, 0.01)
    assert _value(families, "vllm:num_requests_running") == 1
    assert 0 < _value(families, "vllm:kv_cache_usage_perc") <= 1  # the running request's tokens of 1000
    answers = await asyncio.gather(first, second)
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [10, 10]

    families = await _metrics(port)
    assert _value(families, "vllm:num_requests_running") == 0 and _value(families, "vllm:num_requests_waiting") == 0
    ttft = "vllm:time_to_first_token_seconds"
    itl = "vllm:inter_token_latency_seconds"
    assert _value(families, ttft, ttft + "_count") == 2
    assert _value(families, itl, itl + "_count") == 2 * 9  # every token after the first
    assert _value(families, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == 2
    # the second request's time to first token includes its wait behind the first (9 steps of 0.05 s at least)
    assert _value(families, ttft, ttft + "_sum") >= 0.45
    assert _value(families, itl, itl + "_sum") >= 18 * 0.05 * 0.9
    assert _value(families, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 200
    assert _value(families, "vllm:generation_tokens", "vllm:generation_tokens_total") == 20


async def test_a_stream_gives_one_chunk_per_token_at_the_decode_pace_then_done(engines):
    port, _ = engines.start("null", "--metric-names", "vllm", "--decode-seconds-per-token", "0.05")
    await _up(port)
    arrivals, events = [], []
    async with httpx.AsyncClient(timeout=30, trust_env=False) as c:
        async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={
                "model": "standin", "prompt": "a b c", "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["choices"][0] for c in chunks if c["choices"]]
    assert len(texts) == 5 and texts[-1]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    gaps = [b - a for a, b in zip(arrivals[:4], arrivals[1:5])]
    assert min(gaps) >= 0.04  # one decode step between tokens


async def test_prefill_records_ttft_and_decode_records_itl_across_the_kv_hand_off(engines):
    boot = free_port()
    prefill, _ = engines.start("prefill", "--metric-names", "vllm", "--prefill-seconds-per-token", "0.002",
                               bootstrap=boot)
    decode, _ = engines.start("decode", "--metric-names", "vllm", "--decode-seconds-per-token", "0.01")
    await _up(prefill)
    await _up(decode)
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 7}
    p, d = await asyncio.gather(_complete(prefill, 50, 4, **pd), _complete(decode, 50, 4, **pd))
    assert p.status_code == d.status_code == 200
    assert d.json()["choices"][0]["text"].startswith("decoded ")
    pre, dec = await _metrics(prefill), await _metrics(decode)
    ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
    assert _value(pre, ttft, ttft + "_count") == 1 and _value(pre, ttft, ttft + "_sum") >= 0.1  # 50 × 0.002 s
    assert _value(pre, itl, itl + "_count") == 0
    assert _value(dec, itl, itl + "_count") == 3
    assert _value(dec, ttft, ttft + "_sum") >= 0.1  # the decode's first token waited for the prefill's KV


@pytest.mark.parametrize("names", ["vllm", "sglang"])
async def test_a_decode_waiting_for_its_prefill_is_not_its_load_but_a_drain_sees_it(engines, names):
    """vLLM's decode never holds a request whose prefill runs (its own PD proxy sends it after); SGLang's holds it in
    its transfer queue, apart from the batch and the queue. Neither is load a `running` target should scale on."""
    boot = free_port()
    prefill, _ = engines.start("prefill", "--metric-names", names, "--prefill-seconds-per-token", "0.02",
                               bootstrap=boot)
    decode, _ = engines.start("decode", "--metric-names", names, "--decode-seconds-per-token", "0.01")
    await _up(prefill)
    await _up(decode)
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": boot, "bootstrap_room": 9}
    flight = asyncio.gather(_complete(prefill, 100, 4, **pd), _complete(decode, 100, 4, **pd))  # a 2 s prefill
    waiting_for_kv = []  # the decode's readings before the prefill had made the KV (it counts its tokens first)
    for _ in range(1000):
        text = (await _get(decode, "/metrics")).text
        if gauges((await _get(prefill, "/metrics")).text)[f"{names}:prompt_tokens_total"] > 0:
            break
        waiting_for_kv.append(text)
        await asyncio.sleep(0.02)
    assert [r.status_code for r in await flight] == [200, 200]
    assert waiting_for_kv and all(read("running", t, 0).value == 0 for t in waiting_for_kv)
    if names == "sglang":  # the drain waits for it
        assert max(requests_in_flight(t) for t in waiting_for_kv) == 1
    if names == "vllm":  # it was in the decode while the prefill ran, yet counted nowhere
        ttft = "vllm:time_to_first_token_seconds"
        assert _value(await _metrics(decode), ttft, ttft + "_sum") >= 1.5
    assert requests_in_flight((await _get(decode, "/metrics")).text) == 0


async def test_a_cold_engine_refuses_connections_until_it_has_loaded(engines):
    port, proc = engines.start("null", "--metric-names", "vllm", "--cold-start", "1.5")
    assert proc.stdout is not None
    assert "loading" in await asyncio.to_thread(proc.stdout.readline)
    started = time.monotonic()
    with pytest.raises(httpx.ConnectError):
        await _get(port, "/health")
    await _up(port)
    assert time.monotonic() - started > 0.5


async def test_without_the_flags_it_answers_and_counts_as_before(engines):
    port, _ = engines.start("null")
    await _up(port)
    r = await _complete(port, 2, 4)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("generated on ")
    families = await _metrics(port)
    assert _value(families, "sglang:num_running_reqs") == 0 and _value(families, "sglang:num_queue_reqs") == 0
    assert _value(families, "sglang:prompt_tokens", "sglang:prompt_tokens_total") == 1  # requests served, as the stand-in always counted
    name = "sglang:time_to_first_token_seconds"
    assert families[name].type == "histogram" and _value(families, name, name + "_count") == 1
