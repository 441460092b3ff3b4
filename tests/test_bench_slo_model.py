"""bench/slo_model.py: the stand-in engines' performance model stepped with durastack's own autoscaler."""

from __future__ import annotations

import argparse

from bench import slo_model


def args(**kw) -> argparse.Namespace:
    base = dict(period=200.0, duration=200.0, low=1.0, peak=8.0, ttft=2.0, cold_start=20.0, min_prefill=1,
                min_decode=1, max_prefill=4, max_decode=3, static_prefill=4, static_decode=3, window=10)
    return argparse.Namespace(**{**base, **kw})


def test_static_pays_its_whole_pool_and_a_scaled_policy_less():
    att, cost = slo_model.run(args(), 7)
    assert cost == 7 * 200 and 0.9 < att <= 1.0
    scaled_att, scaled_cost = slo_model.run(args(), 7, {"prefill": 1.0, "decode": 2.0}, delay=30)
    assert scaled_cost < cost and scaled_att <= att + 0.01


def test_a_pool_too_small_for_the_peak_misses_and_one_at_its_max_does_not_pay_more():
    att, _ = slo_model.run(args(static_prefill=1, static_decode=1), 7)
    assert att < 0.5
    pinned = args(min_prefill=4, min_decode=3)  # a scaled policy that can never leave static's size
    assert slo_model.run(pinned, 7, {"prefill": 1.0, "decode": 2.0}) == slo_model.run(args(), 7)


def test_a_longer_scale_down_delay_keeps_replicas_longer():
    targets = {"prefill": 1.0, "decode": 2.0}
    _, short = slo_model.run(args(), 7, targets, delay=30)
    _, long = slo_model.run(args(), 7, targets, delay=90)
    assert long > short


def test_a_replica_added_serves_only_after_its_cold_start():
    group = slo_model.Group(slots=1, scaler=None)
    slo_model.add(group, 10.0, 1, 20.0)
    engine = group.engines[0]
    assert not engine.serving(29.9) and engine.serving(30.0)
    assert slo_model.serve(group, 30.0, 0.5) == (30.0, 30.5)
    assert slo_model.serve(group, 30.1, 0.5) == (30.5, 31.0)  # one slot: the second waits for the first
