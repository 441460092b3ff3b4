"""An inference engine's own signals, from its Prometheus endpoint, in vLLM's and SGLang's names.

The exposition text is parsed by prometheus_client's parser (the format has escapes, labels and histograms a
regex gets wrong). Each signal is the sum over the engine's series (one per model or data-parallel rank), but
the KV-cache use, a share, which is their mean. A latency is the p90 of what its histogram counted within the
scaling window: the increase of each bucket between a reading a window ago and the latest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from backends.http import Connect, client_for
from models.state import UNKNOWN_NAMES
from models.service import SUMMED_METRICS

# Requests the engine is working on, and requests waiting for a slot: running + waiting is what is in flight.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
# Requests an SGLang engine holds for a PD hand-off, outside its batch and its queue: a prefill's waiting for the
# decode's handshake or sending its KV, a decode's waiting for KV space or for the KV itself (its prefill may not have
# run yet). Not this engine's load, so no scaling metric reads them; a drain waits for them. (vLLM has none: its own
# PD proxy sends a request to the decode only once the prefill is done.)
HANDOFF = ("sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_prealloc_queue_reqs",
           "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
           "sglang:num_decode_transfer_queue_reqs")
# Each engine scaling metric and the names it is read from, newest first: of a share or a histogram, the first an
# engine exposes is used (vLLM exposed the older and newer names side by side for a while).
NAMES = {
    "queue": WAITING,
    "running": RUNNING + WAITING,
    "kv_cache": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "ttft": ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "sglang:inter_token_latency_seconds"),
}
HISTOGRAMS = ("ttft", "itl")
QUANTILE = 0.9


class UnknownNames(ValueError):
    """The endpoint answers, but in none of the names a metric is read from."""


def gauges(text: str) -> dict[str, float]:
    """Every gauge and counter sample in ``text``, summed per metric name (labels dropped)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


@dataclass(frozen=True)
class Reading:
    """What one scrape of an engine said of one metric: a gauge's value, or a histogram's cumulative buckets."""

    at: float
    value: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()  # (upper bound, cumulative count), ascending, +Inf last


def read(metric: str, text: str, at: float) -> Reading:
    """The metric's reading in one exposition text; UnknownNames when the engine exposes none of its names."""
    families = {f.name: f for f in text_string_to_metric_families(text)}
    if metric in HISTOGRAMS:
        name = next((n for n in NAMES[metric] if n in families and families[n].type == "histogram"), None)
        if name is None:
            raise UnknownNames(f"{UNKNOWN_NAMES}{', '.join(NAMES[metric])} (a histogram) in the engine's metrics")
        counts: dict[float, float] = {}
        for sample in families[name].samples:
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                counts[le] = counts.get(le, 0.0) + float(sample.value)
        return Reading(at=at, buckets=tuple(sorted(counts.items())))
    found = [n for n in NAMES[metric] if n in families]
    if not found:
        raise UnknownNames(f"{UNKNOWN_NAMES}{', '.join(NAMES[metric])} in the engine's metrics")
    if metric in SUMMED_METRICS:  # running + waiting: each name once, summed over its series
        return Reading(at=at, value=sum(float(s.value) for n in found for s in families[n].samples if s.name == n))
    values = [float(s.value) for s in families[found[0]].samples if s.name == found[0]]
    return Reading(at=at, value=sum(values) / len(values) if values else 0.0)


def over_window(metric: str, readings: list[Reading], window: float) -> Optional[float]:
    """The metric over the last ``window`` seconds of ``readings`` (oldest first): a gauge's mean, a latency's p90
    (0 when no request was counted: an idle engine is fast). None without a reading (a latency: two)."""
    if not readings:
        return None
    newest = readings[-1]
    since = newest.at - window
    if metric not in HISTOGRAMS:
        inside = [r.value for r in readings if r.at >= since]
        return sum(inside) / len(inside)
    before = [r for r in readings if r.at <= since]
    base = before[-1] if before else readings[0]
    if base is newest:  # one reading: nothing yet of what happened within a window
        return None
    old = dict(base.buckets)
    increase = [(le, count - old.get(le, 0.0)) for le, count in newest.buckets]
    if any(d < 0 for _, d in increase):  # the counters went back: the engine restarted; what it counted since
        increase = list(newest.buckets)
    return quantile(QUANTILE, increase)


def quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile: the bucket holding the q-th observation, linearly within it; in the +Inf
    bucket, the highest finite bound. 0 with no observation."""
    if not buckets or buckets[-1][1] <= 0:
        return 0.0
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def requests_in_flight(text: str) -> Optional[float]:
    """Every request the engine holds (running, waiting, in a PD hand-off), or None when it exposes neither running
    nor waiting requests in a known name."""
    values = gauges(text)
    if not any(n in values for n in RUNNING + WAITING):
        return None
    return sum(values.get(n, 0.0) for n in RUNNING + WAITING + HANDOFF)


async def in_flight(address: str, connect: Optional[Connect] = None, path: str = "/metrics") -> Optional[float]:
    """What the engine at ``address`` has in flight now; None when it cannot tell (no endpoint, unknown names)."""
    client, base = client_for(address, 2.0, connect)
    async with client:
        try:
            r = await client.get(base + path)
        except httpx.HTTPError:
            return None
    if r.status_code != 200:
        return None
    try:
        return requests_in_flight(r.text)
    except ValueError:  # not the exposition format
        return None
