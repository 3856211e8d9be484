"""Prometheus metrics of the apiserver itself (the edge exports its own).

Each app has its own :class:`prometheus_client.CollectorRegistry`, so several apps in one
process (tests) never share counters. Exported series::

    dsec_api_requests_total{method, route, status}     counter
    dsec_api_request_duration_seconds{method, route}   histogram, seconds
    dsec_api_errors_total{code}                        counter, by dsec error code

``route`` is the route *template* (``/v1/sandboxes/{sandbox_id}/exec``), never the raw
path, so cardinality stays bounded; unmatched paths are reported as ``<unmatched>``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

__all__ = ["ApiMetrics"]

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class ApiMetrics:
    """Request counters and latency histograms for one app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "dsec_api_requests",
            "HTTP requests answered, by route template and status.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dsec_api_request_duration_seconds",
            "Time from request start to the end of the response body, seconds.",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.errors = Counter(
            "dsec_api_errors",
            "Error responses and mid-stream error events, by dsec error code.",
            ["code"],
            registry=self.registry,
        )

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Record one finished request."""
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def error(self, code: str) -> None:
        """Record one error of a dsec error ``code``."""
        self.errors.labels(code).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of these metrics."""
        return generate_latest(self.registry)
