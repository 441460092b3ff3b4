"""Access-log statistics: an incremental tailer, 1-second frames, 30/60/300 s windows.

Everything except :class:`LogTailer` is pure and takes ``now`` as an argument. Log lines follow
``gateway.render.LOG_FORMAT``: ``msec hit status request_time service upstream_addr``. Only lines
with hit ``1`` count: requests handed to the activator (hit ``2``) are counted by the activator
itself when they arrive (:meth:`StatsCollector.count`), since their log line comes after the hold.

The control app reads every request's line on the same CPUs as nginx, so the lines are aggregated before
anything is made of them (:func:`aggregate`): lines that differ only in their milliseconds are counted
together (in C), then each distinct (second, rest of the line) is parsed once.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Mapping, Optional, Sequence

from models.gateway import WINDOWS, ServiceStats, StatsWindow

TTL = max(WINDOWS)  # frames older than the largest window are useless


@dataclass(frozen=True)
class LogEntry:
    time: float
    hit: bool
    status: int
    request_time: float
    service: str
    upstream_addr: Optional[str]  # the address that served the request, if any
    activator: bool = False  # hit "2": handed to the activator (a cold start)


def parse_line(line: str) -> Optional[LogEntry]:
    parts = line.strip().split(" ", 5)
    fields = _fields(parts)
    if fields is None:
        return None
    try:
        t = float(parts[0])
    except ValueError:
        return None
    (hit, status, service, addr), rt = fields
    return LogEntry(t, hit == HIT, status, rt, service, addr, hit == ACTIVATOR)


HIT, ACTIVATOR, OTHER = 1, 2, 0  # the hit field as parse_line reads it: "1", "2", anything else


def _fields(parts: list[str]) -> Optional[tuple[tuple[int, int, str, Optional[str]], float]]:
    """((hit, status, service, upstream address), request time) of a split line, or None: parse_line's rules."""
    if len(parts) < 5:
        return None
    try:
        status, rt = int(parts[2]), float(parts[3])
    except ValueError:
        return None
    addr = parts[5].strip() if len(parts) > 5 else "-"
    # After retries $upstream_addr is "a, b" (and "a : b" across internal redirects): the last served.
    last = addr.replace(" : ", ", ").split(", ")[-1].strip()
    hit = HIT if parts[1] == "1" else ACTIVATOR if parts[1] == "2" else OTHER
    return (hit, status, parts[4], None if last in ("", "-") else last), rt


# A line as nginx writes $msec: whole seconds (at most 12 digits, so that the float of "S.mmm" stays
# below S + 1), a dot and 3 digits, a space. The rest of such a line parses alone: line.strip().split(" ", 5)
# is [the time] + the same fields as rest.rstrip().split(" ", 5) gives after its leading "".
_CANONICAL = re.compile(r"([0-9]{1,12})\.[0-9]{3}( .*)", re.DOTALL)
_MILLIS = re.compile(r"\.[0-9]{3} ")

GroupKey = tuple[int, int, int, str, Optional[str]]  # (second, hit, status, service, upstream address)


@dataclass
class LogBatch:
    """The lines of one read of the log, aggregated.

    ``groups``: (second, hit, status, service, upstream address) → [requests, total request time,
    {request time: requests}]. ``entries``: the valid lines not in nginx's own form (none in practice),
    parsed one by one. ``lines``: the lines themselves, for :meth:`exact`.
    """

    groups: dict[GroupKey, list] = field(default_factory=dict)
    entries: list[LogEntry] = field(default_factory=list)
    lines: Sequence[str] = ()

    def exact(self, second: int) -> list[LogEntry]:
        """The lines of ``second`` counted in ``groups``, parsed one by one (their milliseconds matter)."""
        out = []
        for line in self.lines:
            m = _CANONICAL.fullmatch(line)
            if m and int(m[1]) == second and (e := parse_line(line)) is not None:
                out.append(e)
        return out


def aggregate(lines: Sequence[str]) -> LogBatch:
    """Group the lines by (second, hit, status, service, upstream address), skipping what parse_line skips."""
    if not isinstance(lines, (list, tuple)):
        lines = list(lines)
    batch = LogBatch(lines=lines)
    if not lines:
        return batch
    counts = _count_canonical(lines)
    if counts is None:  # some line is not as nginx writes it: sort them one by one
        counts = {}
        for line in lines:
            m = _CANONICAL.fullmatch(line)
            if m:
                key = (m[1], m[2])
                counts[key] = counts.get(key, 0) + 1
            elif (e := parse_line(line)) is not None:
                batch.entries.append(e)
    groups = batch.groups
    for (head, rest), n in counts.items():
        fields = _fields(rest.rstrip().split(" ", 5))
        if fields is None:
            continue
        (hit, status, service, addr), rt = fields
        key = (int(head), hit, status, service, addr)
        group = groups.get(key)
        if group is None:
            groups[key] = [n, rt * n, {rt: n}]
        else:
            group[0] += n
            group[1] += rt * n
            times = group[2]
            times[rt] = times.get(rt, 0) + n
    return batch


def _count_canonical(lines: Sequence[str]) -> Optional[Counter]:
    """(seconds, rest) → lines, if every line is in nginx's form with seconds as long as the first's; else None.

    Slicing at a fixed offset lets the counting run in C: a few hundred nanoseconds a line.
    """
    n = lines[0].find(" ") - 4
    if not 1 <= n <= 12:
        return None
    if not all(_MILLIS.fullmatch(m) for m in set(map(itemgetter(slice(n, n + 5)), lines))):
        return None
    counts = Counter(zip(map(itemgetter(slice(0, n)), lines), map(itemgetter(slice(n + 4, None)), lines)))
    if not all(head.isascii() and head.isdigit() for head, _ in counts):
        return None
    return counts


Frames = dict[int, list]  # second -> [requests, total request time]


def window_stats(frames: Mapping[int, list], now: float) -> dict[int, StatsWindow]:
    """Sum frames with ``now - second <= W`` for each window W; the time is an average, 3 decimals."""
    out = {}
    for w in WINDOWS:
        n, total = 0, 0.0
        for second, (count, rt) in frames.items():
            if now - second <= w:
                n, total = n + count, total + rt
        out[w] = StatsWindow(requests=n, request_time=round(total / n, 3) if n else 0.0)
    return out


class StatsCollector:
    """Per-service (and per-group, where the upstream address is known) 1-second frames."""

    def __init__(self) -> None:
        self._frames: dict[str, Frames] = {}
        self._group_frames: dict[str, dict[str, Frames]] = {}
        self._addr_group: dict[tuple[str, str], str] = {}

    def remember(self, service: str, address: str, group: str) -> None:
        """Map an upstream address to its group. Kept after unregistering: its log lines come later."""
        self._addr_group[(service, address)] = group

    def group_of(self, service: str, upstream_addr: Optional[str]) -> Optional[str]:
        """The replica group that served a logged request: its upstream address, as registered."""
        return self._addr_group.get((service, upstream_addr or ""))

    def add(self, entry: LogEntry, now: float) -> None:
        if not entry.hit or entry.service == "-" or now - entry.time > TTL:
            return
        second = int(entry.time)
        _bump(self._frames.setdefault(entry.service, {}), second, entry.request_time)
        group = self.group_of(entry.service, entry.upstream_addr)
        if group is not None:
            _bump(self._group_frames.setdefault(entry.service, {}).setdefault(group, {}), second, entry.request_time)

    def count(self, service: str, at: float) -> None:
        """Count one replica hit that arrived at ``at`` (the activator's requests, not in the log)."""
        _bump(self._frames.setdefault(service, {}), int(at), 0.0)

    def add_request_time(self, service: str, at: float, request_time: float) -> None:
        """Add the time of a request counted by :meth:`count` once it completed, if its frame is kept."""
        frame = self._frames.get(service, {}).get(int(at))
        if frame is not None:
            frame[1] += request_time

    def feed(self, lines: Sequence[str], now: float) -> LogBatch:
        """Count the lines; return them aggregated, for the other readers of the same log (metrics)."""
        batch = aggregate(lines)
        frames, group_frames = self._frames, self._group_frames
        for (second, hit, _, service, addr), (n, total, _) in batch.groups.items():
            # A frame's second is at most its lines' times: if it is within TTL, so are they all (and
            # if it is not, prune drops it below: only hit lines within TTL ever reach a frame).
            if hit != HIT or service == "-" or now - second > TTL:
                continue
            _bump_n(frames.setdefault(service, {}), second, n, total)
            group = self._addr_group.get((service, addr or ""))
            if group is not None:
                _bump_n(group_frames.setdefault(service, {}).setdefault(group, {}), second, n, total)
        for entry in batch.entries:
            self.add(entry, now)
        self.prune(now)
        return batch

    def prune(self, now: float) -> None:
        """Drop frames older than TTL, and services/groups left without frames."""
        def fresh(frames: Frames) -> Frames:
            return {s: v for s, v in frames.items() if now - s <= TTL}

        self._frames = {k: f for k, f in ((k, fresh(f)) for k, f in self._frames.items()) if f}
        self._group_frames = {
            svc: g for svc, g in (
                (svc, {k: f for k, f in ((k, fresh(f)) for k, f in groups.items()) if f})
                for svc, groups in self._group_frames.items()) if g}

    def service_stats(self, service: str, now: float) -> ServiceStats:
        groups = self._group_frames.get(service, {})
        return ServiceStats(
            service=service,
            windows=window_stats(self._frames.get(service, {}), now),
            per_group={g: window_stats(f, now) for g, f in sorted(groups.items())} or None,
        )


def _bump(frames: Frames, second: int, request_time: float) -> None:
    _bump_n(frames, second, 1, request_time)


def _bump_n(frames: Frames, second: int, requests: int, request_time: float) -> None:
    frame = frames.setdefault(second, [0, 0.0])
    frame[0] += requests
    frame[1] += request_time


class LogTailer:
    """Reads whole lines appended to ``path`` since the last call.

    Notices rotation (a new inode at ``path``: the old file is drained, then the new one read from
    its start) and truncation (size below the offset: read again from the start).
    """

    def __init__(self, path: str | os.PathLike, chunk: int = 1 << 20):
        self.path = os.fspath(path)
        self.chunk = chunk
        self._f = None
        self._ino: Optional[tuple[int, int]] = None
        self._partial = b""

    def read_lines(self) -> list[str]:
        out: list[bytes] = []
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if self._f is not None and (st is None or (st.st_dev, st.st_ino) != self._ino):
            out += self._drain()  # rotated away: finish the old file first
            self._close()
        if self._f is None and st is not None:
            self._f = open(self.path, "rb")
            st = os.fstat(self._f.fileno())
            self._ino = (st.st_dev, st.st_ino)
        if self._f is not None:
            if os.fstat(self._f.fileno()).st_size < self._f.tell():
                self._f.seek(0)  # truncated in place
                self._partial = b""
            out += self._drain()
        return [line.decode(errors="replace") for line in out]

    def _drain(self) -> list[bytes]:
        lines: list[bytes] = []
        while block := self._f.read(self.chunk):
            parts = (self._partial + block).split(b"\n")
            self._partial = parts.pop()  # an unfinished last line waits for its newline
            lines += (p for p in parts if p)
        return lines

    def _close(self) -> None:
        if self._f is not None:
            self._f.close()
        self._f, self._ino, self._partial = None, None, b""

    def close(self) -> None:
        self._close()
