"""bench/slo.py's foresight floor, the figure its cost goal is read against: a pure function of the trace."""

from __future__ import annotations

import argparse

from bench import slo


def args(**kw) -> argparse.Namespace:
    base = dict(duration=200, static_prefill=4, static_decode=3, min_prefill=1, min_decode=2, max_prefill=4,
                max_decode=3, cold_start=20)
    return argparse.Namespace(**{**base, **kw})


def test_a_flat_load_needs_the_static_pool_all_along():
    flat = [slo.Req(at=t + 0.5, isl=300, osl=60) for t in range(200)]  # the same work every second
    assert slo.foresight(flat, args()) == {"prefill": 4 * 200, "decode": 3 * 200}


def test_a_burst_costs_less_than_static_and_each_replica_added_pays_its_cold_start():
    trace = slo.make_trace(7, 200, 200, 1, 8)
    seen = slo.foresight(trace, args())
    assert sum(seen.values()) < 7 * 200
    assert seen["decode"] >= 2 * 200  # never below its minimum
    slower = slo.foresight(trace, args(cold_start=40))
    extra = slower["prefill"] - seen["prefill"]  # 20 s more for each replica added: at least the three of 1 → 4
    assert extra % 20 == 0 and extra >= 20 * 3
