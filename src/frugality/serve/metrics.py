"""The server's Prometheus metrics (`GET /metrics`), in a registry of its own: requests by
endpoint and status, latency and time queued, rows per model call, tokens, the queue's
depth, and the energy the machine's meter counted since the start (the meter `train`
uses; its label says measured or estimated)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

if TYPE_CHECKING:
    from frugality.metrics.energy import Meter

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    def __init__(self, meter: Meter | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "frugality_requests", "Requests answered, by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "frugality_request_seconds",
            "Time from arrival to the last byte",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.queued = Histogram(
            "frugality_queue_seconds",
            "Time a request waited before the model took it",
            ["endpoint"],
            buckets=_SECONDS,
            registry=r,
        )
        self.batch = Histogram(
            "frugality_batch_rows", "Rows in one model call", ["endpoint"], buckets=_ROWS, registry=r
        )
        self.tokens = Counter(
            "frugality_tokens", "Tokens processed, by endpoint and kind", ["endpoint", "kind"], registry=r
        )
        self.truncated = Counter(
            "frugality_truncated_inputs",
            "Texts cut to the model's length, as embed cuts them",
            ["endpoint"],
            registry=r,
        )
        self.depth = Gauge("frugality_queue_depth", "Requests waiting for the model", ["endpoint"], registry=r)
        self._meter, self._lock = meter, threading.Lock()
        if meter is not None:
            r.register(_EnergyCollector(self))

    def joules(self) -> float:
        assert self._meter is not None  # read by the energy collector, registered with a meter only
        with self._lock:  # a meter's counters are read as deltas: one reader at a time
            self._meter.sample()
            return self._meter.joules()

    def answered(self, endpoint: str, status: str, seconds: float) -> None:
        """A request answered (`Edge`, or a front end of `serve --workers` through its pipe)."""
        self.requests.labels(endpoint, status).inc()
        self.latency.labels(endpoint).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """`GET /metrics`' body (a front end of `serve --workers` asks the model's process)."""
        return self.exposition()


class _EnergyCollector:
    def __init__(self, metrics: ServeMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        meter = self.metrics._meter
        assert meter is not None  # (see ServeMetrics.joules)
        family = CounterMetricFamily(
            "frugality_energy_joules",
            "Energy since the server started, by the meter train uses",
            labels=["kind", "how"],
        )
        family.add_metric([meter.kind, meter.how], self.metrics.joules())  # kind: measured, declared or estimated
        yield family
