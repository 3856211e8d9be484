"""Prometheus metrics of one edge (one node). Scraped through the apiserver's ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from dsec.tiers import tier_names

_STATES = ("creating", "running", "paused", "stopped")
_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)


class _SandboxGauge(Collector):
    def __init__(self, node: str, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._node = node
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            "dsec_sandboxes",
            "Sandboxes on this node by tier and state",
            labels=["node", "tier", "state"],
        )
        counts = self._counts()
        for tier in tier_names():
            for state in _STATES:
                g.add_metric([self._node, tier, state], counts.get((tier, state), 0))
        yield g


class EdgeMetrics:
    """Counters and histograms the edge updates; sandbox gauges computed at scrape time."""

    def __init__(self, node: str, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.node = node
        self.registry.register(_SandboxGauge(node, counts))
        self.creations = Counter(
            "dsec_sandbox_creations",
            "Sandbox creation attempts by tier and outcome",
            ["tier", "outcome"],
            registry=self.registry,
        )
        self.create_seconds = Histogram(
            "dsec_sandbox_create_seconds",
            "Time to create a sandbox (request to running)",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.create_phase_seconds = Histogram(
            "dsec_sandbox_create_phase_seconds",
            "Where a successful creation's time went: admit (checks, image, layers), queue "
            "(waiting for a slot of the node's creation gate), runtime (the tier's create), "
            "start (the image's start command to ready)",
            ["tier", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kills = Counter(
            "dsec_sandbox_kills",
            "Sandboxes stopped, by reason",
            ["tier", "reason"],
            registry=self.registry,
        )
        self.execs = Counter(
            "dsec_exec",
            "Commands executed, by tier and outcome",
            ["tier", "outcome"],
            registry=self.registry,
        )
        self.exec_seconds = Histogram(
            "dsec_exec_seconds",
            "Exec round trip inside the edge (spawn to exit)",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "dsec_edge_errors",
            "Errors raised by the edge, by error code",
            ["code"],
            registry=self.registry,
        )
        self.pauses = Counter(
            "dsec_sandbox_pauses", "Sandboxes paused", ["tier"], registry=self.registry
        )
        self.resumes = Counter(
            "dsec_sandbox_resumes", "Sandboxes resumed", ["tier"], registry=self.registry
        )
        self.file_ops = Counter(
            "dsec_file_ops", "File operations by kind", ["op"], registry=self.registry
        )
        self.port_connections = Counter(
            "dsec_port_connections",
            "Connections opened to ports inside sandboxes (the port proxy)",
            ["tier"],
            registry=self.registry,
        )

    def add_lazy_layers(self, stats: Callable[[], dict[str, Any]]) -> None:
        """Export on-demand layer loading counters (``LayerStore.lazy_stats``)."""
        from dsec.layers.lazy import LazyStatsCollector

        self.registry.register(LazyStatsCollector(self.node, stats))

    def text(self) -> bytes:
        return generate_latest(self.registry)
