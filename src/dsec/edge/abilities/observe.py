"""What a sandbox did: metrics, trajectory export, audit, logs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

from dsec.contract.runtime import Measurable
from dsec.edge.audit import interleave_audit, place_entries
from dsec.edge.core import EdgeCore, LiveSandbox, utc_datetime
from dsec.errors import CapabilityNotSupported, DsecError, InvalidRequest, SandboxStopped
from dsec.models import (
    AuditEntry,
    AuditReport,
    AuditSummary,
    CpuMetrics,
    DiskMetrics,
    JobAudit,
    JobRef,
    LogLine,
    MemoryMetrics,
    NetworkMetrics,
    SandboxMetrics,
    SandboxRef,
    SandboxUptime,
)

log = logging.getLogger("dsec.edge")


class ObserveVerbs(EdgeCore):
    """What a sandbox did: metrics, trajectory export, audit, logs."""

    # ------------------------------------------------------------------ uptime
    async def sandbox_uptime(self, req: SandboxRef, owner: str) -> SandboxUptime:
        """Ages from the registry's times: nothing is resumed, no activity is counted."""
        row = self._lookup_row(req.sandbox_id, owner)
        now = time.time()
        end = row.updated_at if row.state == "stopped" else now
        expires = row.expires_at if row.state in ("running", "creating") else None
        return SandboxUptime(
            sandbox_id=row.id,
            state=row.state,
            created_at=utc_datetime(row.created_at),
            uptime_s=round(max(0.0, end - row.created_at), 3),
            idle_s=round(max(0.0, end - row.last_active), 3),
            expires_in_s=round(max(0.0, expires - now), 3) if expires is not None else None,
        )

    # ------------------------------------------------------------------ metrics
    async def sandbox_metrics(self, req: SandboxRef, owner: str) -> SandboxMetrics:
        """:class:`dsec.contract.edge.MetricsEdge`: one usage sample of a live sandbox, read
        without resuming it or touching its TTL (see :class:`dsec.contract.runtime.Measurable`)."""
        sandbox_id = req.sandbox_id
        row = self._lookup_row(sandbox_id, owner)
        lv = self._live.get(sandbox_id)
        if lv is None or lv.row.state not in ("running", "paused"):
            state = lv.row.state if lv is not None else row.state
            raise SandboxStopped(
                f"sandbox {sandbox_id} is {state}"
                + (f" ({row.stopped_reason})" if state == "stopped" and row.stopped_reason else ""),
                sandbox_id=sandbox_id,
            )
        rt = self.runtimes.get(lv.row.tier)
        if not isinstance(rt, Measurable):
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier cannot measure its sandboxes", tier=lv.row.tier
            )
        try:
            u = await rt.usage(lv.handle)
        except DsecError as e:
            self.metrics.errors.labels(e.code).inc()
            raise
        now_mono, now = time.monotonic(), time.time()
        if (
            lv.last_usage is not None
            and now_mono > lv.last_usage[0]
            and u.cpu_usage_ns >= lv.last_usage[1]
        ):
            interval = now_mono - lv.last_usage[0]
            busy_ns = u.cpu_usage_ns - lv.last_usage[1]
        else:  # the first sample: the average since the sandbox was created
            interval = max(1e-3, now - lv.row.created_at)
            busy_ns = u.cpu_usage_ns
        lv.last_usage = (now_mono, u.cpu_usage_ns)
        # the CFS quota is at least 0.01 cores (1 ms per 100 ms), whatever was asked
        limit = max(0.01, lv.row.request.cpu)
        cores = busy_ns / 1e9 / interval
        net = u.net
        return SandboxMetrics(
            sandbox_id=sandbox_id,
            tier=lv.row.tier,
            state=lv.row.state,
            timestamp=utc_datetime(now),
            interval_s=round(interval, 6),
            cpu=CpuMetrics(
                usage_s=u.cpu_usage_ns / 1e9,
                used_cores=round(cores, 4),
                used_pct=round(100.0 * cores / limit, 2),
                limit_cores=limit,
            ),
            memory=MemoryMetrics(
                used_bytes=u.memory_used_bytes,
                cache_bytes=u.memory_cache_bytes,
                limit_bytes=u.memory_limit_bytes,
                peak_bytes=u.memory_peak_bytes,
                host_bytes=u.host_memory_bytes,
            ),
            disk=DiskMetrics(used_bytes=u.disk_used_bytes, total_bytes=u.disk_total_bytes),
            network=(
                NetworkMetrics(
                    rx_bytes=net.rx_bytes,
                    tx_bytes=net.tx_bytes,
                    rx_packets=net.rx_packets,
                    tx_packets=net.tx_packets,
                )
                if net is not None
                else None
            ),
            pids=u.pids,
            source=u.source,
            # the cgroup's counters only: a dashboard polls metrics every second
            audit=await self._audit_summary(lv, network=False) if self.audit.enabled else None,
        )

    async def export_trajectory(self, sandbox_id: str, owner: str) -> str:
        row = self._lookup_row(sandbox_id, owner)
        header = {
            "node": self.node,
            "create": row.request.model_dump(mode="json"),
            "image_layers": row.image_layers,
        }
        lines = self.trajectory.export_jsonl(sandbox_id, header=header)
        if not self.audit.enabled:
            return "".join(lines)
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self.audit.sample(sandbox_id, self.runtimes.get(row.tier), lv.handle)
        entries = self.audit.recorder.report(sandbox_id, row.tier, row.job).entries
        return "".join(interleave_audit(lines, entries))

    # ------------------------------------------------------------------ audit

    async def _audit_summary(self, lv: LiveSandbox, *, network: bool = True) -> AuditSummary:
        rt = self.runtimes.get(lv.row.tier)
        await self.audit.sample(lv.row.id, rt, lv.handle, network=network)
        return self.audit.recorder.summary(lv.row.id, lv.row.tier, lv.row.job)

    async def sandbox_audit(self, sandbox_id: str, owner: str, after: int = 0) -> AuditReport:
        """:class:`dsec.contract.edge.SandboxAudits`: the sandbox's refusals (live or
        stopped while the node remembers it); never resumes it nor extends its TTL."""
        row = self._lookup_row(sandbox_id, owner)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise InvalidRequest(f"after={after!r} must be an entry number >= 0")
        lv = self._live.get(sandbox_id)
        if lv is not None:
            await self.audit.sample(sandbox_id, self.runtimes.get(row.tier), lv.handle)
        report = self.audit.recorder.report(sandbox_id, row.tier, row.job, after=after)
        report.sources = self.audit.sources(self.runtimes.get(row.tier))
        place_entries(report.entries, self.trajectory.starts(sandbox_id))
        return report

    async def follow_audit(
        self, sandbox_id: str, owner: str, after: int = 0
    ) -> AsyncGenerator[AuditEntry, None]:
        """:class:`dsec.contract.edge.SandboxAudits`: entries numbered above ``after`` as
        they are recorded, until the sandbox stops (sampled sources are read every 2 s)."""
        row = self._lookup_row(sandbox_id, owner)
        if not isinstance(after, int) or isinstance(after, bool) or after < 0:
            raise InvalidRequest(f"after={after!r} must be an entry number >= 0")
        rt = self.runtimes.get(row.tier)

        async def poll() -> None:
            while (lv := self._live.get(sandbox_id)) is not None:
                await self.audit.sample(sandbox_id, rt, lv.handle)
                await asyncio.sleep(2.0)

        poller = asyncio.create_task(poll())
        try:
            async for entry in self.audit.recorder.follow(sandbox_id, after):
                yield entry
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller

    async def job_audit(self, req: JobRef, owner: str) -> JobAudit:
        """:class:`dsec.contract.edge.SandboxAudits`: the summary of every sandbox of
        ``owner``'s ``job`` this node has (live, and stopped ones it remembers)."""
        job = req.job
        out: dict[str, AuditSummary] = {}
        for row in self.registry.select(owner=owner, job=job):
            lv = self._live.get(row.id)
            if lv is not None:
                out[row.id] = await self._audit_summary(lv)
            else:
                out[row.id] = self.audit.recorder.summary(row.id, row.tier, row.job)
        return JobAudit(job=job, sandboxes=out)

    async def sandbox_logs(
        self, sandbox_id: str, owner: str, *, follow: bool = False
    ) -> AsyncGenerator[LogLine, None]:
        """The output of the sandbox's start command (:mod:`dsec.edge.logs`): what is kept,
        then with ``follow`` what comes until the command ends. Empty for a sandbox whose
        image has none. The sandbox must be live (``SandboxStopped`` otherwise)."""
        lv = self._live_for(sandbox_id, owner)
        if lv.logs is None:
            return
        async for line in lv.logs.read(follow=follow):
            yield line
