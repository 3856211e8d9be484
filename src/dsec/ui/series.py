"""The dashboard's time series: small, in-process, over the last hour.

Two sources, both bounded (one point per ``step_s``, ``window_s`` of them):

* :class:`ActivityRecorder`: what each key did through *this* apiserver, fed by the API
  middleware with every finished request (owner, route template, status, latency): requests,
  errors, execs and a latency histogram of execs, per owner and for everyone. A key's own
  dashboard shows its own; the operator's the total. Owners idle for the whole window are
  forgotten.
* :class:`NodeSampler`: the node's own counters, sampled every ``step_s`` by a background
  task: the edge's Prometheus series (creations, execs by outcome, the exec-latency
  histogram, sandboxes by state), the host's CPU and memory (``/proc``, where the edge runs
  in this process) and what the edge admitted (requested cores and memory). Rates are the
  differences between consecutive samples; latency percentiles are interpolated in the
  histogram of the interval (the edge's own buckets).

Percentiles from a histogram: linear inside the bucket that holds the rank, the bucket's
lower bound at its bottom (0 for the first). Series are lists aligned on ``t`` (unix
seconds, the start of each step); a step without data is ``None`` (a gap in the chart).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from dsec.contract.edge import EdgeAPI, NodeReports
from dsec.runtimes.usage import parse_meminfo

__all__ = [
    "EXEC_ROUTES",
    "LATENCY_BOUNDS_MS",
    "ActivityRecorder",
    "NodeSampler",
    "percentile",
]

log = logging.getLogger("dsec.ui")

LATENCY_BOUNDS_MS: tuple[float, ...] = (
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 30_000, 60_000, math.inf,
)  # fmt: skip
"""Upper bounds of the exec latency buckets of :class:`ActivityRecorder`, milliseconds."""

EXEC_ROUTES = frozenset(
    {
        "/v1/sandboxes/{sandbox_id}/exec",
        "/v1/sandboxes/{sandbox_id}/exec/stream",
        "/e2b/envd/process.Process/Start",
        "/run_code",
        "/k/{api_key}/run_code",
    }
)
"""Route templates whose requests run a command: their latency is an exec's round trip as
the client saw it (a streamed one: until its last byte)."""

CREATE_ROUTES = frozenset(
    {("POST", "/v1/sandboxes"), ("POST", "/e2b/sandboxes"), ("POST", "/e2b/v2/sandboxes")}
)

ALL = "*"
"""The owner key of everyone's totals."""


def percentile(bounds: Sequence[float], counts: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram: ``counts[i]`` observations at most
    ``bounds[i]`` and above ``bounds[i-1]``; None when empty. An infinite last bound
    answers the last finite one."""
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for i, c in enumerate(counts):
        if c <= 0:
            continue
        if seen + c >= rank:
            lo = bounds[i - 1] if i > 0 else 0.0
            hi = bounds[i]
            if math.isinf(hi):
                return lo
            return lo + (hi - lo) * max(0.0, min(1.0, (rank - seen) / c))
        seen += c
    finite = [b for b in bounds if not math.isinf(b)]
    return finite[-1] if finite else None


@dataclass
class _Bucket:
    t: int
    requests: int = 0
    errors: int = 0
    server_errors: int = 0
    creations: int = 0
    execs: int = 0
    exec_errors: int = 0
    hist: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BOUNDS_MS))


class ActivityRecorder:
    """Requests per owner in ``step_s`` buckets over ``window_s`` (see the module docstring).

    :meth:`record` is what the middleware calls (cheap: one dict lookup and a few adds);
    :meth:`series` renders an owner's (or everyone's, ``owner=None``) window.
    """

    def __init__(self, *, step_s: int = 10, window_s: int = 3600, max_owners: int = 10_000):
        self.step_s = step_s
        self.window_s = window_s
        self.max_owners = max_owners
        self._owners: dict[str, deque[_Bucket]] = {}
        self._lock = threading.Lock()

    def _bucket(self, owner: str, t: int) -> _Bucket:
        q = self._owners.get(owner)
        if q is None:
            if len(self._owners) >= self.max_owners:
                self._evict(t)
            q = self._owners[owner] = deque(maxlen=self.window_s // self.step_s + 1)
        if not q or q[-1].t < t:
            q.append(_Bucket(t))
            return q[-1]
        if q.maxlen is not None and len(q) >= q.maxlen:
            if t < q[0].t:
                return _Bucket(t)  # older than the window: counted nowhere
            q.popleft()
        for i in range(len(q) - 1, -1, -1):  # a request that ended a step late: its step
            if q[i].t == t:
                return q[i]
            if q[i].t < t:
                q.insert(i + 1, _Bucket(t))
                return q[i + 1]
        q.appendleft(_Bucket(t))
        return q[0]

    def _evict(self, now: int) -> None:
        """Forget the owners idle for the whole window, or else the longest idle one."""
        others = [o for o in self._owners if o != ALL]
        idle = [o for o in others if self._owners[o][-1].t < now - self.window_s]
        if not idle and others:
            idle = [min(others, key=lambda o: self._owners[o][-1].t)]
        for o in idle:
            del self._owners[o]

    def record(
        self,
        owner: str | None,
        method: str,
        route: str,
        status: int,
        seconds: float,
        *,
        now: float | None = None,
    ) -> None:
        """One finished request (``owner`` None: not authenticated; counted in the total)."""
        t = int(time.time() if now is None else now) // self.step_s * self.step_s
        is_exec = route in EXEC_ROUTES
        created = (method, route) in CREATE_ROUTES and status == 201
        ms = seconds * 1000.0
        slot = next(i for i, b in enumerate(LATENCY_BOUNDS_MS) if ms <= b)
        with self._lock:
            for who in (ALL, owner) if owner else (ALL,):
                b = self._bucket(who, t)
                b.requests += 1
                if status >= 400:
                    b.errors += 1
                if status >= 500:
                    b.server_errors += 1
                if created:
                    b.creations += 1
                if is_exec:
                    b.execs += 1
                    if status >= 400:
                        b.exec_errors += 1
                    else:
                        b.hist[slot] += 1

    def series(self, owner: str | None, *, now: float | None = None) -> dict[str, list[Any]]:
        """The window of ``owner`` (None: everyone): per step ``t``, ``requests``,
        ``errors``, ``server_errors``, ``creations``, ``execs``, ``exec_errors`` (counts per
        step) and ``exec_p50_ms`` / ``exec_p95_ms`` (None without execs)."""
        step = self.step_s
        end = int(time.time() if now is None else now) // step * step
        ts = list(range(end - self.window_s + step, end + step, step))
        with self._lock:
            by_t = {b.t: b for b in self._owners.get(owner or ALL, ())}
            rows = [by_t.get(t) for t in ts]
            out: dict[str, list[Any]] = {"t": ts}
            for name in (
                "requests",
                "errors",
                "server_errors",
                "creations",
                "execs",
                "exec_errors",
            ):
                out[name] = [getattr(b, name) if b else 0 for b in rows]
            out["exec_p50_ms"] = [
                percentile(LATENCY_BOUNDS_MS, b.hist, 0.5) if b else None for b in rows
            ]
            out["exec_p95_ms"] = [
                percentile(LATENCY_BOUNDS_MS, b.hist, 0.95) if b else None for b in rows
            ]
        return out


@dataclass
class _Sample:
    t: float
    creations: float | None = None
    execs: float | None = None
    exec_errors: float | None = None
    exec_hist: dict[float, float] | None = None  # le (s) -> cumulative count
    sandboxes: dict[str, float] = field(default_factory=dict)  # state -> count
    cpu_busy: float | None = None  # jiffies
    cpu_total: float | None = None
    mem_used: float | None = None  # bytes
    mem_total: float | None = None
    requested_cpu: float | None = None
    requested_memory_mb: float | None = None


def _host_cpu() -> tuple[float, float] | None:
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    values = [float(x) for x in first[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    total = sum(values[:8])  # guest time is already in user
    return total - idle, total


def _host_memory() -> tuple[float, float] | None:
    try:
        mi = parse_meminfo(Path("/proc/meminfo").read_text())
    except OSError:
        return None
    if "MemTotal" not in mi or "MemAvailable" not in mi:
        return None
    return float(mi["MemTotal"] - mi["MemAvailable"]), float(mi["MemTotal"])


def parse_edge_counters(text: str) -> dict[str, Any]:
    """The edge counters the sampler keeps, from Prometheus text: ``creations`` (ok),
    ``execs``, ``exec_errors`` (error or timeout), ``exec_hist`` (le seconds -> cumulative
    count, summed over tiers), ``sandboxes`` (state -> count). Missing series are absent."""
    out: dict[str, Any] = {}
    hist: dict[float, float] = {}
    seen_hist = False
    for fam in text_string_to_metric_families(text):
        # a family the edge exports without samples yet counts 0 (nothing happened so far)
        if fam.name == "dsec_sandbox_creations":
            out.setdefault("creations", 0.0)
        elif fam.name == "dsec_exec":
            out.setdefault("execs", 0.0)
            out.setdefault("exec_errors", 0.0)
        elif fam.name == "dsec_exec_seconds":
            seen_hist = True
        for s in fam.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            if name == "dsec_sandbox_creations_total" and labels.get("outcome") == "ok":
                out["creations"] = out.get("creations", 0.0) + value
            elif name == "dsec_exec_total":
                out["execs"] = out.get("execs", 0.0) + value
                if labels.get("outcome") in ("error", "timeout"):
                    out["exec_errors"] = out.get("exec_errors", 0.0) + value
                else:
                    out.setdefault("exec_errors", 0.0)
            elif name == "dsec_exec_seconds_bucket":
                le = float(labels.get("le", "inf"))
                hist[le] = hist.get(le, 0.0) + value
            elif name == "dsec_sandboxes":
                state = labels.get("state", "")
                out.setdefault("sandboxes", {})
                out["sandboxes"][state] = out["sandboxes"].get(state, 0.0) + value
    if hist or seen_hist:
        out["exec_hist"] = hist
    return out


class NodeSampler:
    """The node's own counters every ``step_s`` over ``window_s`` (see the module docstring).

    Args:
        edge: the app's edge (its ``metrics_text``; ``NodeReports`` where it has them).
        step_s: seconds between samples.
        window_s: how much is kept, seconds.
        host: read this host's ``/proc`` (True where the edge runs in this process).
    """

    def __init__(
        self,
        edge: EdgeAPI,
        *,
        step_s: float = 10.0,
        window_s: float = 3600.0,
        host: bool | None = None,
    ) -> None:
        self.edge = edge
        self.step_s = step_s
        self.window_s = window_s
        self.host = isinstance(edge, NodeReports) if host is None else host
        self._samples: deque[_Sample] = deque(maxlen=int(window_s // step_s) + 2)
        self._task: asyncio.Task[None] | None = None

    def sample(self, *, now: float | None = None) -> None:
        """Take one sample now (the background task calls this every ``step_s``)."""
        s = _Sample(t=time.time() if now is None else now)
        try:
            counters = parse_edge_counters(self.edge.metrics_text().decode("utf-8", "replace"))
        except Exception as e:  # a bad exposition must not stop the sampler
            log.debug("edge metrics unreadable: %s", e)
            counters = {}
        s.creations = counters.get("creations")
        s.execs = counters.get("execs")
        s.exec_errors = counters.get("exec_errors")
        s.exec_hist = counters.get("exec_hist")
        s.sandboxes = counters.get("sandboxes", {})
        if self.host:
            cpu, mem = _host_cpu(), _host_memory()
            if cpu is not None:
                s.cpu_busy, s.cpu_total = cpu
            if mem is not None:
                s.mem_used, s.mem_total = mem
        if isinstance(self.edge, NodeReports):
            with contextlib.suppress(Exception):
                u = self.edge.usage()
                s.requested_cpu, s.requested_memory_mb = u.requested_cpu, u.requested_memory_mb
        self._samples.append(s)

    async def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:
                log.exception("node sample failed")
            await asyncio.sleep(self.step_s)

    def start(self) -> None:
        """Start sampling in the background on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="dsec-ui-sampler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def latest(self) -> _Sample | None:
        return self._samples[-1] if self._samples else None

    def series(self) -> dict[str, list[Any]]:
        """Per interval between consecutive samples: ``t`` (its end), ``creations_per_min``,
        ``execs_per_min``, ``exec_errors_per_min``, ``exec_p50_ms``, ``exec_p95_ms``,
        ``host_cpu_pct``, ``host_mem_used``, ``running``, ``paused``, ``requested_cpu``."""
        keys = (
            "t", "creations_per_min", "execs_per_min", "exec_errors_per_min", "exec_p50_ms",
            "exec_p95_ms", "host_cpu_pct", "host_mem_used", "running", "paused", "requested_cpu",
        )  # fmt: skip
        out: dict[str, list[Any]] = {k: [] for k in keys}
        samples = list(self._samples)
        for prev, cur in itertools.pairwise(samples):
            dt = cur.t - prev.t
            if dt <= 0:
                continue

            def rate(a: float | None, b: float | None, dt: float = dt) -> float | None:
                if a is None or b is None or b < a:
                    return None
                return round((b - a) * 60.0 / dt, 3)

            out["t"].append(int(cur.t))
            out["creations_per_min"].append(rate(prev.creations, cur.creations))
            out["execs_per_min"].append(rate(prev.execs, cur.execs))
            out["exec_errors_per_min"].append(rate(prev.exec_errors, cur.exec_errors))
            p50 = p95 = None
            if prev.exec_hist is not None and cur.exec_hist is not None:
                bounds = sorted(cur.exec_hist)
                cum = [cur.exec_hist[b] - prev.exec_hist.get(b, 0.0) for b in bounds]
                counts = [max(0.0, c - (cum[i - 1] if i else 0.0)) for i, c in enumerate(cum)]
                ms = [b * 1000.0 for b in bounds]
                p50, p95 = percentile(ms, counts, 0.5), percentile(ms, counts, 0.95)
            out["exec_p50_ms"].append(None if p50 is None else round(p50, 3))
            out["exec_p95_ms"].append(None if p95 is None else round(p95, 3))
            cpu = None
            if None not in (prev.cpu_busy, cur.cpu_busy, prev.cpu_total, cur.cpu_total):
                total = float(cur.cpu_total) - float(prev.cpu_total)  # type: ignore[arg-type]
                busy = float(cur.cpu_busy) - float(prev.cpu_busy)  # type: ignore[arg-type]
                cpu = round(100.0 * busy / total, 2) if total > 0 else None
            out["host_cpu_pct"].append(cpu)
            out["host_mem_used"].append(cur.mem_used)
            out["running"].append(cur.sandboxes.get("running"))
            out["paused"].append(cur.sandboxes.get("paused"))
            out["requested_cpu"].append(cur.requested_cpu)
        return out
