"""Access-log statistics (spec 4.2): an incremental tailer, 1-second frames, 30/60/300 s windows.

Everything except :class:`LogTailer` is pure and takes ``now`` as an argument. Log lines follow
``gateway.render.LOG_FORMAT``: ``msec hit status request_time service upstream_addr``. Only lines
with hit ``1`` count: requests handed to the activator (hit ``2``) are counted by the activator
itself when they arrive (:meth:`StatsCollector.count`), since their log line comes after the hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

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
    if len(parts) < 5:
        return None
    try:
        t, hit, status, rt = float(parts[0]), parts[1] == "1", int(parts[2]), float(parts[3])
    except ValueError:
        return None
    addr = parts[5].strip() if len(parts) > 5 else "-"
    # After retries $upstream_addr is "a, b" (and "a : b" across internal redirects): the last served.
    last = addr.replace(" : ", ", ").split(", ")[-1].strip()
    return LogEntry(t, hit, status, rt, parts[4], None if last in ("", "-") else last, parts[1] == "2")


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

    def group_of(self, entry: LogEntry) -> Optional[str]:
        """The replica group that served a logged request: its upstream address, as registered."""
        return self._addr_group.get((entry.service, entry.upstream_addr or ""))

    def add(self, entry: LogEntry, now: float) -> None:
        if not entry.hit or entry.service == "-" or now - entry.time > TTL:
            return
        second = int(entry.time)
        _bump(self._frames.setdefault(entry.service, {}), second, entry.request_time)
        group = self.group_of(entry)
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

    def feed(self, lines: Iterable[str], now: float) -> list[LogEntry]:
        """Count the lines; return them parsed, for the other readers of the same log (metrics)."""
        entries = [e for e in map(parse_line, lines) if e is not None]
        for entry in entries:
            self.add(entry, now)
        self.prune(now)
        return entries

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
    frame = frames.setdefault(second, [0, 0.0])
    frame[0] += 1
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
