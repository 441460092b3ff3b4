"""Prometheus metrics of the gateway, served as text at ``GET /metrics`` on the control port.

Requests and their latency are read from the access log, from the very lines the stats windows
parse (:meth:`gateway.stats.StatsCollector.feed`):

* ``durastack_gateway_requests_total{service, group, code}``: every logged request of a routed
  service. ``group`` is the replica group whose upstream address served it (upstream → registered
  replica → group), ``-`` when no replica did as far as nginx knows: auth rejections (401/403), and
  cold-start requests, which nginx hands to the activator in the control app.
* ``durastack_gateway_request_duration_seconds{service}``: nginx's ``$request_time`` of the requests
  that passed auth (a held request's time includes its hold).
* ``durastack_gateway_held_requests{service}`` (gauge) and ``durastack_gateway_activator_requests_total``:
  the scale-from-zero activator's requests waiting now, and held since the gateway started; read
  from the activator at scrape time.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_left
from typing import Callable, Iterable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as _client_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.activator import Activator
from gateway.stats import OTHER, LogBatch

NO_GROUP = "-"
# The text format every Prometheus reads; our names need none of the newer format's escaping.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Inference requests run from milliseconds (a health check) to minutes (a long generation, a cold start).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# (name, help) of the request counter and the latency histogram.
REQUESTS = ("durastack_gateway_requests", "Requests of a routed service, by the replica group that served it "
            "('-': none, e.g. rejected or cold start) and status code.")
LATENCY = ("durastack_gateway_request_duration_seconds", "Time of the requests that passed auth, as nginx logs it "
           "(a held request's time includes the hold).")


class GatewayMetrics:
    """One registry per gateway (tests run several gateways in one process)."""

    def __init__(self, activator: Activator, services: Callable[[], Iterable[str]], since: float):
        # The log is read from its start after a restart: older lines were counted by an earlier process.
        self.since = since
        self.registry = CollectorRegistry()
        self.requests = Counter(*REQUESTS, ("service", "group", "code"), registry=self.registry)
        self.latency = _Latency(*LATENCY, "service", LATENCY_BUCKETS)
        self.registry.register(self.latency)
        self.registry.register(_Held(activator, services))
        self.services = services
        self._series: dict[str, set[tuple[str, str, str]]] = {}  # service → its request counters' labels

    def observe(self, batch: LogBatch, group_of: Callable[[str, Optional[str]], Optional[str]]) -> None:
        """Count a batch of log lines (:meth:`gateway.stats.StatsCollector.feed`), one update per series."""
        routed = set(self.services())
        since = self.since
        split = math.floor(since) if since != math.floor(since) else None  # a second partly before since
        requests: dict[tuple[str, str, str], int] = {}
        latency: dict[str, dict[float, int]] = {}
        exact = False
        for (second, hit, status, service, addr), (n, _, times) in batch.groups.items():
            # "-": no route matched (404s); a deleted service's last lines must not bring its series back.
            if service not in routed:
                continue
            if second < since:  # a line's time is in [second, second + 1)
                exact = exact or second == split
                continue
            labels = (service, group_of(service, addr) or NO_GROUP, str(status))
            requests[labels] = requests.get(labels, 0) + n
            if hit != OTHER:
                mine = latency.setdefault(service, {})
                for rt, k in times.items():
                    mine[rt] = mine.get(rt, 0) + k
        # One by one: the lines not in nginx's form, and those of the second since falls in.
        for e in batch.entries + batch.exact(split) if exact else batch.entries:
            if e.service not in routed or e.time < since:
                continue
            labels = (e.service, group_of(e.service, e.upstream_addr) or NO_GROUP, str(e.status))
            requests[labels] = requests.get(labels, 0) + 1
            if e.hit or e.activator:
                mine = latency.setdefault(e.service, {})
                mine[e.request_time] = mine.get(e.request_time, 0) + 1
        for labels, n in requests.items():
            self.requests.labels(*labels).inc(n)
            self._series.setdefault(labels[0], set()).add(labels)
        for service, times in latency.items():
            self.latency.observe(service, times)

    def forget(self, routed: Iterable[str]) -> None:
        """Drop the series of services no longer routed: a deleted service leaves no metric behind."""
        for service in set(self._series) - set(routed):
            for labels in self._series.pop(service):
                self.requests.remove(*labels)
            self.latency.remove(service)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Latency(Collector):
    """A histogram with one label, observed many values at a time (prometheus_client's Histogram takes one
    per call). Its exposition is the Histogram's: cumulative ``_bucket`` (``le`` up to ``+Inf``), ``_count``,
    ``_sum`` and, unless created series are disabled, ``_created``."""

    def __init__(self, name: str, documentation: str, label: str, buckets: Iterable[float]):
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = tuple(float(b) for b in buckets) + (math.inf,)
        self._le = [floatToGoString(b) for b in self.bounds]
        self._series: dict[str, list] = {}  # label value → [counts per bucket (not cumulative), sum, created]

    def observe(self, value: str, times: Mapping[float, int]) -> None:
        """Observe each ``time`` ``count`` times (``times``: time → count)."""
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = [[0] * len(self.bounds), 0.0, time.time()]
        counts, total, bounds = series[0], series[1], self.bounds
        for t, n in times.items():
            total += t * n
            if t == t:  # NaN is in the sum and in no bucket, as Histogram.observe has it
                counts[bisect_left(bounds, t)] += n  # the first bucket with t <= le
        series[1] = total

    def remove(self, value: str) -> None:
        self._series.pop(value, None)

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label])]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, (counts, total, created) in list(self._series.items()):
            acc, buckets = 0.0, []
            for le, n in zip(self._le, counts):
                acc += n
                buckets.append((le, acc))
            family.add_metric([value], buckets, total)
            if _client_metrics._use_created:  # prometheus_client's switch (disable_created_metrics)
                family.add_sample(self.name + "_created", {self.label: value}, created)
        return [family]


class _Held(Collector):
    """The activator's counts at scrape time; every routed service shows, 0 when nothing is held."""

    def __init__(self, activator: Activator, services: Callable[[], Iterable[str]]):
        self.activator, self.services = activator, services

    def collect(self):
        held = GaugeMetricFamily("durastack_gateway_held_requests", "Requests the activator holds now, "
                                 "waiting for the service's first ready replica.", labels=["service"])
        total = CounterMetricFamily("durastack_gateway_activator_requests", "Requests the activator has held "
                                    "since the gateway started.", labels=["service"])
        names = set(self.services()) | set(self.activator.held) | set(self.activator.held_total)
        for name in sorted(names):
            held.add_metric([name], self.activator.held[name])
            total.add_metric([name], self.activator.held_total[name])
        return [held, total]
