"""An inference engine's own signals, from its Prometheus endpoint, in vLLM's and SGLang's names.

The exposition text is parsed by prometheus_client's parser (the format has escapes, labels and histograms a
regex gets wrong). Each signal is the sum over the engine's series (one per model or data-parallel rank).
"""

from __future__ import annotations

from typing import Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

from activities.probes import Connect, client_for

# Requests the engine is working on, and requests waiting for a slot: running + waiting is what is in flight.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")


def gauges(text: str) -> dict[str, float]:
    """Every gauge and counter sample in ``text``, summed per metric name (labels dropped)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def requests_in_flight(text: str) -> Optional[float]:
    """Running plus waiting requests, or None when the engine exposes neither in a known name."""
    values = gauges(text)
    found = [values[n] for n in RUNNING + WAITING if n in values]
    return sum(found) if found else None


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
