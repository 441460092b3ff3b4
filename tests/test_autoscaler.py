"""The RPS autoscaler and the stats watcher's snapshot logic, without Temporal."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from activities.stats import changed, snapshot_of
from models.gateway import ServiceStats, StatsReport, StatsWindow
from models.messages import GroupWatch, StatsWatch
from models.service import ReplicaGroup, ScalingSpec
from models.state import StatsSnapshot
from rules.autoscaler import Below, GroupScaler, bounds, wanted

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)
SPEC = ScalingSpec(metric="rps", target=10, window=60, scale_up_delay=300, scale_down_delay=600)
SCALER = GroupScaler(SPEC, 0, 5)


def ago(seconds):
    return NOW - timedelta(seconds=seconds) if seconds is not None else None


@pytest.mark.parametrize("current, requests, last, expected", [
    (1, 600, 3600, 1),
    (1, 1200, 3600, 2),
    (2, 3000, 3600, 5),
    (2, 60000, 3600, 5),      # clamped to max
    (2, 300, 3600, 1),
    (1, 1200, 60, 1),         # up-delay holds
    (2, 300, 300, 2),         # down-delay holds
    (0, 300, None, 1),        # from zero, never scaled
    (0, 300, 1, 1),           # from zero ignores the up-delay
    (2, 0, 3600, 0),          # to zero
])
def test_worked_examples_of_spec_3_6(current, requests, last, expected):
    d = SCALER.decide(current, requests / 60, ago(last), NOW)
    assert d.new == expected


@pytest.mark.parametrize("window, expected", [(30, 3), (60, 2), (300, 1)])
def test_window_choice(window, expected):
    snap = StatsSnapshot(rps={30: 900 / 30, 60: 1200 / 60, 300: 1500 / 300})
    spec = SPEC.model_copy(update={"window": window})
    assert GroupScaler(spec, 0, 5).decide(1, snap.rate(window), ago(3600), NOW).new == expected


def test_reasons_name_the_rule():
    assert SCALER.decide(2, 1000, ago(3600), NOW).reason == "clamped to max 5"
    assert SCALER.decide(0, 5, ago(1), NOW).reason == "from zero"
    assert "up-delay" in SCALER.decide(1, 20, ago(60), NOW).reason
    assert "down-delay" in SCALER.decide(2, 5, ago(60), NOW).reason
    assert GroupScaler(SPEC, 2, 5).decide(3, 0, ago(3600), NOW) .reason == "clamped to min 2"


def test_no_stats_means_no_change():
    d = SCALER.decide(3, None, ago(3600), NOW)
    assert d.new == 3 and d.reason == "no stats"


def test_constant_load_never_oscillates():
    # At 25 rps and target 10 the group wants 3; once there, the same load keeps it there.
    assert SCALER.decide(2, 25, ago(3600), NOW).new == 3
    assert all(SCALER.decide(3, 25, ago(s), NOW).new == 3 for s in (0, 1, 599, 601, 3600))


def test_last_scaled_none_disables_delays():
    assert SCALER.decide(1, 50, None, NOW).new == 5
    assert SCALER.decide(5, 0, None, NOW).new == 0


def test_raising_min_waits_for_the_up_delay_unless_from_zero():
    assert GroupScaler(SPEC, 2, 5).decide(1, 0, ago(60), NOW).new == 1
    assert GroupScaler(SPEC, 2, 5).decide(1, 0, ago(301), NOW).new == 2
    assert GroupScaler(SPEC, 2, 5).decide(0, 0, ago(60), NOW).new == 2


def test_a_groups_scaler_reads_its_bounds_once():
    group = ReplicaGroup.model_validate({"name": "g", "count": {"min": 1, "max": 3}, "commands": ["true"],
                                         "scaling": {"metric": "rps", "target": 10}})
    scaler = GroupScaler.of(group)
    assert (scaler.lo, scaler.hi, scaler.scaling) == (1, 3, group.scaling) and bounds(group) == (1, 3)
    assert scaler.decide(1, 1000, None, NOW).reason == "clamped to max 3"


def test_next_check_tells_when_a_held_decision_is_due():
    assert SCALER.next_check(1, 20, ago(60)) == 300
    assert SCALER.next_check(2, 5, ago(60)) == 600
    assert SCALER.next_check(2, 20, ago(60)) is None
    assert SCALER.next_check(0, 20, ago(60)) is None  # from zero is never held


def steady_walk(current: int, readings: list[tuple[int, float]], last: int = 3600) -> list[tuple[int, int, str]]:
    """Feed readings (seconds after NOW, total) to below/decide as the workflow does: the counts it moves to."""
    span, last_at, out = None, NOW - timedelta(seconds=last), []
    for at, total in readings:
        now = NOW + timedelta(seconds=at)
        span = SCALER.below(span, current, total, now)
        d = SCALER.decide(current, total, last_at, now, span, steady=True)
        if d.new != current:
            out.append((at, d.new, d.reason))
            current, last_at, span = d.new, now, SCALER.below(None, d.new, total, now)
    return out


def test_a_steady_scale_down_waits_for_the_whole_delay_below_the_target():
    # Long after the last scaling, a dip below the target is not enough: the group must want fewer for 600 s.
    assert steady_walk(3, [(0, 15), (599, 15)]) == []
    assert steady_walk(3, [(0, 15), (600, 15)]) == [(600, 2, "target")]
    # A reading back at the target in between starts the wait again.
    assert steady_walk(3, [(0, 15), (300, 30), (400, 15), (900, 15)]) == []
    assert steady_walk(3, [(0, 15), (300, 30), (400, 15), (1000, 15)]) == [(1000, 2, "target")]


def test_a_steady_scale_down_goes_to_the_most_wanted_meanwhile():
    moves = steady_walk(5, [(0, 5), (100, 35), (200, 5), (600, 5)])
    assert moves == [(600, 4, "the most wanted over the last 600s")]
    # Then it waits a whole delay again before the next step.
    assert steady_walk(5, [(0, 5), (100, 35), (200, 5), (600, 5), (1199, 5), (1200, 5)])[1:] == \
        [(1200, 1, "target")]


def test_a_steady_scale_down_still_waits_for_the_delay_since_the_last_scaling():
    assert steady_walk(3, [(0, 15), (700, 15)], last=0) == [(700, 2, "target")]
    assert steady_walk(3, [(0, 15), (599, 15)], last=0) == []


def test_below_ends_when_the_group_wants_as_many():
    span = SCALER.below(None, 3, 15, NOW)
    assert span == Below(NOW, 2)
    assert SCALER.below(span, 3, 5, NOW + timedelta(seconds=9)) == Below(NOW, 2)
    assert SCALER.below(span, 3, 25, NOW) is None
    assert SCALER.below(span, 3, None, NOW) is None


def test_next_check_of_a_steady_scale_down_counts_from_the_span():
    span = Below(NOW - timedelta(seconds=100), 2)  # below for 100 s, last scaled 3600 s ago
    assert SCALER.next_check(3, 15, ago(3600), span) == 3600 - 100 + 600
    assert SCALER.next_check(3, 15, ago(60), Below(NOW - timedelta(seconds=60), 2)) == 600


def test_wanted_clamps():
    assert wanted(0.0001, 10, 0, 5) == (1, "target")
    assert wanted(0, 10, 1, 5) == (1, "clamped to min 1")


def test_held_requests_count_as_traffic():
    snap = StatsSnapshot(rps={60: 0.0}, held=1)
    assert snap.rate(60) > 0 and SCALER.decide(0, snap.rate(60), None, NOW).new == 1


def test_watcher_returns_only_when_a_groups_wanted_count_changes():
    report = StatsReport(collected_at=0, services={"svc": ServiceStats(
        service="svc", windows={30: StatsWindow(requests=240), 60: StatsWindow(requests=480),
                                300: StatsWindow(requests=480)})})
    snap = snapshot_of(report, "svc")
    assert snap.rate(60) == 8
    watch = StatsWatch(service="svc", groups=[GroupWatch(name="0", target=2, window=60, lo=0, hi=2, wanted=2),
                                              GroupWatch(name="1", target=2, window=60, lo=0, hi=3, wanted=3)])
    assert not changed(watch, snap)  # 8 rps / 2 = 4, clamped to 2 and 3: what they already want
    watch.groups[1].wanted = 1
    assert changed(watch, snap)
    assert snapshot_of(report, "other") is None
