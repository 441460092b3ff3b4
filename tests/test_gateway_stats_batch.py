"""The aggregated access-log path (StatsCollector.feed → GatewayMetrics.observe) against the per-line code it
replaced, kept here as a reference: same frames, windows and /metrics exposition. Pure, no nginx."""

import collections
import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.metrics import LATENCY, LATENCY_BUCKETS, NO_GROUP, REQUESTS, GatewayMetrics
from gateway.stats import TTL, LogBatch, StatsCollector, aggregate, parse_line, window_stats

NOW = 1_800_000_000.0
SINCE = NOW - 100.25  # the gateway started a quarter into a second: its lines must be split by their ms


# --- the reference: the per-line code as it was (gateway/stats.py and gateway/metrics.py before the batches)

class OldCollector:
    def __init__(self):
        self.frames, self.group_frames, self.addr_group = {}, {}, {}

    def remember(self, service, address, group):
        self.addr_group[(service, address)] = group

    def group_of(self, e):
        return self.addr_group.get((e.service, e.upstream_addr or ""))

    def feed(self, lines, now):
        entries = [e for e in map(parse_line, lines) if e is not None]
        for e in entries:
            if not e.hit or e.service == "-" or now - e.time > TTL:
                continue
            _bump(self.frames.setdefault(e.service, {}), int(e.time), e.request_time)
            if (group := self.group_of(e)) is not None:
                _bump(self.group_frames.setdefault(e.service, {}).setdefault(group, {}), int(e.time), e.request_time)
        fresh = lambda frames: {s: v for s, v in frames.items() if now - s <= TTL}  # noqa: E731
        self.frames = {k: f for k, f in ((k, fresh(f)) for k, f in self.frames.items()) if f}
        self.group_frames = {svc: g for svc, g in (
            (svc, {k: f for k, f in ((k, fresh(f)) for k, f in groups.items()) if f})
            for svc, groups in self.group_frames.items()) if g}
        return entries


def _bump(frames, second, rt):
    frame = frames.setdefault(second, [0, 0.0])
    frame[0] += 1
    frame[1] += rt


class OldMetrics:
    def __init__(self, services, since):
        self.since, self.services, self.registry, self._series = since, services, CollectorRegistry(), {}
        self.requests = Counter(*REQUESTS, ("service", "group", "code"), registry=self.registry)
        self.latency = Histogram(*LATENCY, ("service",), buckets=LATENCY_BUCKETS, registry=self.registry)

    def observe(self, entries, group_of):
        routed = set(self.services())
        for e in entries:
            if e.service not in routed or e.time < self.since:
                continue
            labels = (e.service, group_of(e) or NO_GROUP, str(e.status))
            self.requests.labels(*labels).inc()
            self._series.setdefault(e.service, set()).add(labels)
            if e.hit or e.activator:
                self.latency.labels(e.service).observe(e.request_time)

    def forget(self, routed):
        for service in set(self._series) - set(routed):
            for labels in self._series.pop(service):
                self.requests.remove(*labels)
            self.latency.remove(service)


class Activator:
    held, held_total = collections.Counter(), collections.Counter()


class Pair:
    """The old and the new code, fed the same lines."""

    def __init__(self, routed=("svc", "other"), since=SINCE):
        self.routed = list(routed)
        self.old, self.new = OldCollector(), StatsCollector()
        self.old_m = OldMetrics(lambda: self.routed, since)
        self.new_m = GatewayMetrics(Activator(), lambda: self.routed, since)
        for args in [("svc", "unix:/r/a.sock", "prefill"), ("svc", "127.0.0.1:8001", "decode"),
                     ("other", "127.0.0.1:8001", "x")]:
            self.old.remember(*args)
            self.new.remember(*args)

    def feed(self, lines, now) -> LogBatch:
        self.old_m.observe(self.old.feed(lines, now), self.old.group_of)
        batch = self.new.feed(lines, now)
        self.new_m.observe(batch, self.new.group_of)
        return batch

    def forget(self, routed):
        self.routed = list(routed)
        self.old_m.forget(routed)
        self.new_m.forget(routed)

    def check(self, now, ordered=True, windows=True):
        assert _frames(self.new._frames) == _frames(self.old.frames)
        # the same times, added in another order
        assert _totals(self.new._frames) == pytest.approx(_totals(self.old.frames), rel=1e-12, nan_ok=True)
        new_groups = {s: _frames(g) for s, g in self.new._group_frames.items()}
        assert new_groups == {s: _frames(g) for s, g in self.old.group_frames.items()}
        for s, g in self.old.group_frames.items():
            assert _totals(self.new._group_frames[s]) == pytest.approx(_totals(g), rel=1e-12, nan_ok=True)
        for service in ["svc", "other", "gone", "-"] if windows else []:
            new = self.new.service_stats(service, now)
            assert new.windows == window_stats(self.old.frames.get(service, {}), now)
            old_groups = self.old.group_frames.get(service, {})
            assert new.per_group == ({g: window_stats(f, now) for g, f in sorted(old_groups.items())} or None)
        old_text = generate_latest(self.old_m.registry).decode()
        new_text = self.new_m.exposition().decode()
        old, new = _exposition(old_text), _exposition(new_text)
        assert new["comments"] == old["comments"]
        if ordered:  # the series appear in the order of their first line, as before
            assert list(new["samples"]) == list(old["samples"])
        assert set(new["samples"]) == set(old["samples"])
        for key, value in old["samples"].items():
            if key.split("{")[0].endswith("_created"):
                continue  # when the series was made: a timestamp
            if key.split("{")[0].endswith("_sum"):  # the same times, added in another order
                assert new["samples"][key] == pytest.approx(value, rel=1e-12, nan_ok=True), key
            else:
                assert new["samples"][key] == value, key
        return old_text, new_text


def _frames(frames):
    return {svc_or_group: {s: n for s, (n, _) in f.items()} for svc_or_group, f in frames.items()}


def _totals(frames):
    return {(k, second): t for k, f in frames.items() for second, (_, t) in f.items()}


def _exposition(text):
    """The request and latency families' HELP/TYPE lines, and their samples (name{labels} → value) in order."""
    comments, samples = [], {}
    for line in text.splitlines():
        if line.startswith("#"):
            if line.split(" ")[2].startswith("durastack_gateway_request"):
                comments.append(line)
        elif line.startswith("durastack_gateway_request"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return {"comments": comments, "samples": samples}


ADDRS = ["-", "unix:/r/a.sock", "127.0.0.1:8001", "127.0.0.1:9999", "127.0.0.1:9999, unix:/r/a.sock",
         "unix:/r/a.sock : 127.0.0.1:8001", "127.0.0.1:8001, 127.0.0.1:9999 : unix:/r/a.sock", "127.0.0.1:9090", ""]
# bucket bounds exactly, repeated times, and beyond the last bucket
RTS = ["0.000", "0.001", "0.005", "0.010", "0.012", "0.250", "1.000", "5.000", "299.999", "300.000", "300.001", "inf"]


def log_lines(rng: random.Random, n: int, now: float = NOW) -> list[str]:
    """Lines as nginx writes them (LOG_FORMAT), over 320 s: hits 0/1/2/3, routed, unrouted and "-" services."""
    out = []
    for _ in range(n):
        age = rng.choice([rng.uniform(0, 320), rng.uniform(0, 5), rng.uniform(99.5, 101.5)])
        rt = rng.choice(RTS) if rng.random() < 0.5 else f"{rng.expovariate(1 / 0.2):.3f}"
        out.append(" ".join([
            f"{now - age:.3f}", rng.choice("1111111023"), rng.choice(["200", "200", "200", "401", "403", "503", "404"]),
            rt, rng.choice(["svc", "svc", "svc", "other", "gone", "-"]), rng.choice(ADDRS)]))
    out += [f"{SINCE - 0.001:.3f} 1 200 0.100 svc -", f"{SINCE:.3f} 1 200 0.200 svc -",
            f"{SINCE + 0.5:.3f} 2 200 0.300 svc -", f"{SINCE + 1:.3f} 1 200 0.400 svc -"]
    rng.shuffle(out)
    return out


# Not as nginx writes them: parse_line decides, one by one (some are valid: a different time, a leading
# space; others not: a bad status, too few fields).
ODD = [
    "garbage", "", "   ", "x 1 200 0.1 svc -", f"{NOW - 3:.1f} 1 200 0.100 svc unix:/r/a.sock",
    f" {NOW - 3:.3f} 1 200 0.100 svc unix:/r/a.sock", f"{NOW - 3:.3f} 1 abc 0.100 svc -", f"{NOW - 3:.3f} 1 200 0.1",
    f"{NOW - 3:.3f}", f"{int(NOW) - 3} 1 200 0.200 svc -", f"+{NOW - 3:.3f} 1 200 0.100 svc -",
    f"{NOW - 3:.3f}  1 200 0.100 svc -", "1.8e9 1 200 0.100 svc -", f"{NOW - 3:.4f} 1 200 0.100 svc -",
    f"{NOW - 3:.3f} 1 200 0.100 svc unix:/r/a.sock\r\n", f"{NOW - 3:.3f} 1 200 x svc -", "999.500 1 200 0.1 svc -",
    f"{NOW - 2:.3f} 1 200 0.100 svc 127.0.0.1:8001 ", f"{NOW - 2:.3f} 2 503 7.000 svc\t-",
    f"{SINCE - 0.1:.2f} 1 200 0.500 svc -", f"{SINCE + 0.1:.2f} 1 200 0.500 svc -",
    f"{NOW - 1.5:.3f} 0 401 -0.500 other 127.0.0.1:8001", f"00{NOW - 4:.3f} 1 0200 0.100 svc -",
    f"{NOW - 3:.3f} 1 200 1e-3 svc -", f"{NOW - 3:.3f} 1 200 0.100 svc unix:/r/a.sock\n",
    f"{NOW - 3:.3f}\t1 200 0.100 svc -", f"{NOW - 3:.3f}.000 1 200 0.100 svc -", f"{NOW - 3:.3f}1 1 200 0.1 svc -",
]


# With since inside a second, that second's lines are counted one by one after the others: their series
# come last in the exposition (a scraper does not mind); otherwise in the order of their first line, as before.
@pytest.mark.parametrize("since,ordered", [(NOW - 100, True), (SINCE, False)])
def test_canonical_lines_give_what_the_per_line_code_gave(since, ordered):
    rng, pair = random.Random(7), Pair(since=since)
    for tick in range(4):  # several reads of the log, the clock moving on
        now = NOW + tick
        lines = log_lines(rng, 3000, now)
        batch = pair.feed(lines, now)
        assert batch.entries == []  # the fast path
        assert sum(n for n, _, _ in batch.groups.values()) == sum(1 for line in lines if parse_line(line))
        pair.check(now, ordered)
    assert pair.new.service_stats("svc", NOW + 3).per_group.keys() == {"prefill", "decode"}


def test_odd_lines_are_skipped_or_kept_as_parse_line_decides():
    rng, pair = random.Random(11), Pair()
    for tick in range(3):
        now = NOW + tick
        lines = log_lines(rng, 1000, now) + ODD + [line + "\n" for line in log_lines(rng, 200, now)]
        rng.shuffle(lines)
        batch = pair.feed(lines, now)
        assert batch.entries  # the line-by-line path
        pair.check(now, ordered=False)


def test_the_fast_and_the_line_by_line_aggregation_agree():
    lines = log_lines(random.Random(3), 2000)
    fast, slow = aggregate(lines), aggregate(lines + ["garbage"])
    assert fast.entries == slow.entries == [] and fast.groups.keys() == slow.groups.keys()
    for key, (n, total, times) in fast.groups.items():
        assert slow.groups[key][0] == n and slow.groups[key][2] == times
        assert slow.groups[key][1] == pytest.approx(total, rel=1e-12)
    # seconds of another length than the first line's are no fast path, and no mistake
    mixed = aggregate(["999.500 1 200 0.100 svc -", "1000.500 1 200 0.100 svc -"])
    assert sorted(k[0] for k in mixed.groups) == [999, 1000]


def test_a_deleted_service_leaves_no_series_and_its_late_lines_bring_none_back():
    rng, pair = random.Random(5), Pair(since=NOW - 100)
    pair.feed(log_lines(rng, 2000), NOW)
    pair.forget(["svc"])
    _, text = pair.check(NOW)
    assert 'service="other"' not in text and 'service="svc"' in text
    pair.feed(log_lines(rng, 2000, NOW + 1), NOW + 1)
    _, text = pair.check(NOW + 1)
    assert 'service="other"' not in text
    pair.forget([])
    pair.feed(log_lines(rng, 100, NOW + 2), NOW + 2)
    _, text = pair.check(NOW + 2)
    assert not _exposition(text)["samples"]


def test_since_splits_its_own_second_by_the_milliseconds():
    pair = Pair(since=1001.25)
    lines = [f"1001.{ms:03d} {hit} 200 0.{ms:03d} svc -" for ms in range(0, 1000, 10) for hit in (1, 2)]
    batch = pair.feed(lines + ["1000.999 1 200 0.1 svc -", "1002.000 1 200 0.1 svc -"], 1002.0)
    assert batch.entries == []  # the fast path, then the second 1001 line by line
    pair.check(1002.0)
    text = pair.new_m.exposition().decode()
    assert 'durastack_gateway_requests_total{code="200",group="-",service="svc"} 151.0' in text  # 75 × 2 + 1


def test_nan_and_infinite_times_as_the_histogram_had_them():
    pair = Pair()
    pair.feed([f"{NOW - 1:.3f} 1 200 nan svc -", f"{NOW - 1:.3f} 1 200 inf svc -", f"{NOW - 1:.3f} 1 200 0.1 svc -",
               f"{NOW - 1:.3f} 2 200 NaN other -"], NOW)
    old, new = pair.check(NOW, windows=False)  # a window's average time cannot be NaN (nor could it before)
    latency = [[line for line in text.splitlines() if line.startswith("durastack_gateway_request_duration_seconds")
                and "_created" not in line] for text in (old, new)]
    assert latency[1] == latency[0] and len(latency[1]) == 2 * (len(LATENCY_BUCKETS) + 3)
    assert 'durastack_gateway_request_duration_seconds_count{service="svc"} 2.0' in new  # NaN is in no bucket
    assert 'durastack_gateway_request_duration_seconds_sum{service="svc"} NaN' in new
    assert math.isnan(pair.new._frames["svc"][int(NOW) - 1][1])


def test_seconds_that_are_not_ascii_digits_send_the_batch_line_by_line():
    pair = Pair()
    weird = [f"{int(NOW) - 3}"[:-2] + "x9.123 1 200 0.100 svc -",  # as long as the others: not a time at all
             "".join(chr(0x660 + int(d)) for d in str(int(NOW) - 2)) + ".123 1 200 0.100 svc -",  # Arabic-Indic digits
             f"+{int(NOW) - 3}"[:-1] + ".123 1 200 0.100 svc -"]
    batch = pair.feed(log_lines(random.Random(2), 500)[:1] + weird + log_lines(random.Random(3), 500), NOW)
    assert [e.time for e in batch.entries] == [NOW - 2 + 0.123, float(weird[2].split()[0])]
    pair.check(NOW, ordered=False)
