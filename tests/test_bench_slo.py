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


def test_the_goal_compares_with_an_rps_run_that_cost_as_much():
    def run(policy: str, met: int, replica_s: float) -> slo.Run:
        req = slo.Req(at=0, isl=4, osl=2)
        good = slo.Result(req, sent=0.0, status=200, tokens=[0.1, 0.12], done=True)
        late = slo.Result(req, sent=0.0, status=200, tokens=[9.0, 9.02], done=True)
        return slo.Run(policy, [good] * met + [late] * (100 - met), 0, 1, {"prefill": replica_s, "decode": 0})

    a = args(peak=8.0, rps_headroom=0.75, ttft=2.0, itl=0.06)
    engine, cheap, dear = run("running", 96, 70), run("rps", 40, 60), run("rps-headroom", 80, 75)
    assert [slo.on_rate(p, a) for p in ("rps", "rps-headroom", "running", "static")] == [True, True, False, False]
    assert slo.goal(engine, [cheap], 100, a).endswith("(rps 40.0% at 60%), 0 failed: not met")  # rps cost less
    line = slo.goal(engine, [cheap, dear], 100, a)
    assert "(rps 40.0% at 60%, rps-headroom 80.0% at 75%)" in line and line.endswith(": met")
    assert slo.goal(run("running", 96, 80), [cheap, dear], 100, a).endswith(": not met")  # dearer than both
