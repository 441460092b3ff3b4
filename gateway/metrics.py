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

from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.activator import Activator
from gateway.stats import LogEntry

NO_GROUP = "-"
# The text format every Prometheus reads; our names need none of the newer format's escaping.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Inference requests run from milliseconds (a health check) to minutes (a long generation, a cold start).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    """One registry per gateway (tests run several gateways in one process)."""

    def __init__(self, activator: Activator, services: Callable[[], Iterable[str]], since: float):
        # The log is read from its start after a restart: older lines were counted by an earlier process.
        self.since = since
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "durastack_gateway_requests", "Requests of a routed service, by the replica group that served it "
            "('-': none, e.g. rejected or cold start) and status code.", ("service", "group", "code"),
            registry=self.registry)
        self.latency = Histogram(
            "durastack_gateway_request_duration_seconds", "Time of the requests that passed auth, as nginx "
            "logs it (a held request's time includes the hold).", ("service",), buckets=LATENCY_BUCKETS,
            registry=self.registry)
        self.registry.register(_Held(activator, services))
        self.services = services
        self._series: dict[str, set[tuple[str, str, str]]] = {}  # service → its request counters' labels

    def observe(self, entries: Iterable[LogEntry], group_of: Callable[[LogEntry], Optional[str]]) -> None:
        routed = set(self.services())
        for e in entries:
            # "-": no route matched (404s); a deleted service's last lines must not bring its series back.
            if e.service not in routed or e.time < self.since:
                continue
            labels = (e.service, group_of(e) or NO_GROUP, str(e.status))
            self.requests.labels(*labels).inc()
            self._series.setdefault(e.service, set()).add(labels)
            if e.hit or e.activator:
                self.latency.labels(e.service).observe(e.request_time)

    def forget(self, routed: Iterable[str]) -> None:
        """Drop the series of services no longer routed: a deleted service leaves no metric behind."""
        for service in set(self._series) - set(routed):
            for labels in self._series.pop(service):
                self.requests.remove(*labels)
            self.latency.remove(service)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


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
