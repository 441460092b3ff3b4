"""Access-log statistics: parsing, frames and windows, and the tailer. Pure, no nginx."""

import os

import pytest

from gateway.stats import LogTailer, StatsCollector, parse_line, window_stats

NOW = 1_800_000_000.0


def line(t: float, hit: int = 1, status: int = 200, rt: float = 0.1, svc: str = "svc", addr: str = "-") -> str:
    return f"{t:.3f} {hit} {status} {rt:.3f} {svc} {addr}"


def test_parse_line_fields_and_last_upstream():
    e = parse_line(line(NOW, rt=0.25, addr="127.0.0.1:8001, unix:/r.sock"))
    assert (e.time, e.hit, e.status, e.request_time, e.service, e.upstream_addr) == (
        NOW, True, 200, 0.25, "svc", "unix:/r.sock")
    assert parse_line(line(NOW, hit=0, addr="-")).upstream_addr is None
    assert parse_line("garbage") is None and parse_line("x 1 200 0.1 svc -") is None


def test_windows_sum_frames_by_age():
    c = StatsCollector()
    # 10 requests 5 s ago, 20 at 45 s ago, 30 at 200 s ago; one at exactly 30 s ago counts in 30
    c.feed([line(NOW - 5, rt=0.1)] * 10 + [line(NOW - 45, rt=0.3)] * 20 + [line(NOW - 200, rt=0.5)] * 30
           + [line(NOW - 30, rt=0.2)], NOW)
    w = c.service_stats("svc", NOW).windows
    assert {k: v.requests for k, v in w.items()} == {30: 11, 60: 31, 300: 61}
    assert w[30].request_time == round((10 * 0.1 + 0.2) / 11, 3)
    assert w[300].request_time == round((1 + 6 + 15 + 0.2) / 61, 3)


def test_no_traffic_gives_zeros_and_rounding():
    c = StatsCollector()
    assert all(v.requests == 0 and v.request_time == 0.0 for v in c.service_stats("svc", NOW).windows.values())
    c.feed([line(NOW - 1, rt=0.0011), line(NOW - 1, rt=0.0012)], NOW)
    assert c.service_stats("svc", NOW).windows[30].request_time == 0.001


def test_misses_and_stale_lines_are_skipped():
    c = StatsCollector()
    c.feed([line(NOW - 1, hit=0, status=401), line(NOW - 1, hit=0, status=403), line(NOW - 301),
            line(NOW - 1, svc="-"), line(NOW - 1, status=503)], NOW)
    assert c.service_stats("svc", NOW).windows[300].requests == 1  # only the 503 hit (activator)


def test_activator_lines_are_skipped_and_arrivals_counted_directly():
    c = StatsCollector()
    # nginx logs a request handed to the activator with hit 2, when it completes: not counted from the log
    c.feed([line(NOW - 1, hit=2, rt=40.0, addr="127.0.0.1:9090")] * 3, NOW)
    assert c.service_stats("svc", NOW).windows[300].requests == 0
    # the activator counts each one when it arrives, then adds its time once it completed
    for _ in range(3):
        c.count("svc", NOW - 40)
    assert c.service_stats("svc", NOW).windows[60].requests == 3
    assert c.service_stats("svc", NOW).windows[60].request_time == 0.0
    c.add_request_time("svc", NOW - 40, 30.0)
    assert c.service_stats("svc", NOW).windows[60].request_time == 10.0
    assert c.service_stats("svc", NOW).windows[30].requests == 0 and c.service_stats("svc", NOW).per_group is None
    c.add_request_time("svc", NOW - 1000, 1.0)  # frame long gone: ignored
    c.add_request_time("other", NOW, 1.0)
    assert "other" not in c._frames


def test_frames_expire_after_ttl():
    c = StatsCollector()
    c.feed([line(NOW - 10)], NOW)
    assert c.service_stats("svc", NOW + 250).windows[300].requests == 1
    c.prune(NOW + 400)
    assert c.service_stats("svc", NOW + 400).windows[300].requests == 0
    assert c._frames == {}


def test_per_group_from_upstream_address():
    c = StatsCollector()
    c.remember("svc", "unix:/a.sock", "prefill")
    c.remember("svc", "127.0.0.1:8001", "decode")
    c.feed([line(NOW - 1, addr="unix:/a.sock")] * 3 + [line(NOW - 1, addr="127.0.0.1:8001")] * 2
           + [line(NOW - 1, status=503, addr="127.0.0.1:9999")], NOW)
    s = c.service_stats("svc", NOW)
    assert s.windows[30].requests == 6
    assert {g: w[30].requests for g, w in s.per_group.items()} == {"prefill": 3, "decode": 2}


def test_window_stats_pure_function():
    frames = {int(NOW) - 100: [4, 2.0], int(NOW): [1, 1.0]}
    w = window_stats(frames, NOW)
    assert (w[30].requests, w[60].requests, w[300].requests) == (1, 1, 5)
    assert w[300].request_time == 0.6


def test_tailer_reads_increments_and_holds_partial_lines(tmp_path):
    path = tmp_path / "access.log"
    t = LogTailer(path)
    assert t.read_lines() == []  # no file yet
    with open(path, "a") as f:
        f.write("one\ntwo\nthr")
    assert t.read_lines() == ["one", "two"]
    with open(path, "a") as f:
        f.write("ee\n")
    assert t.read_lines() == ["three"]
    assert t.read_lines() == []


def test_tailer_follows_rotation_by_inode(tmp_path):
    path = tmp_path / "access.log"
    path.write_text("a\n")
    t = LogTailer(path)
    assert t.read_lines() == ["a"]
    with open(path, "a") as f:
        f.write("b\n")  # written before the rename, not yet read
    os.replace(path, tmp_path / "access.log.1")
    path.write_text("c\n")
    assert t.read_lines() == ["b", "c"]
    with open(path, "a") as f:
        f.write("d\n")
    assert t.read_lines() == ["d"]


def test_tailer_notices_truncation(tmp_path):
    path = tmp_path / "access.log"
    path.write_text("a\nb\n")
    t = LogTailer(path)
    assert t.read_lines() == ["a", "b"]
    with open(path, "r+") as f:
        f.truncate(0)
    with open(path, "a") as f:
        f.write("c\n")
    assert t.read_lines() == ["c"]


def test_tailer_feeds_collector(tmp_path):
    path = tmp_path / "access.log"
    path.write_text("\n".join([line(NOW - 2)] * 4 + [line(NOW - 2, hit=0, status=401)]) + "\n")
    c = StatsCollector()
    c.feed(LogTailer(path).read_lines(), NOW)
    assert c.service_stats("svc", NOW).windows[60].requests == 4


@pytest.mark.parametrize("age,expected", [(0, (1, 1, 1)), (30, (1, 1, 1)), (31, (0, 1, 1)), (60, (0, 1, 1)),
                                          (61, (0, 0, 1)), (300, (0, 0, 1))])
def test_window_boundaries(age, expected):
    c = StatsCollector()
    c.feed([line(NOW - age)], NOW)
    w = c.service_stats("svc", NOW).windows
    assert (w[30].requests, w[60].requests, w[300].requests) == expected
