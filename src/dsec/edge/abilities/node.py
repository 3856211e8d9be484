"""The node: its capabilities, info, usage and the live table's views."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dsec.contract.edge import NodeUsage
from dsec.contract.runtime import capabilities_of
from dsec.edge.core import EdgeCore
from dsec.models import (
    NODE_QUERY,
    Capabilities,
    CapabilityList,
    HostTier,
    KeyUsage,
    NodeInfo,
    NodeQuery,
    SandboxInfo,
)
from dsec.tiers import tier_names
from dsec.version import __version__

log = logging.getLogger("dsec.edge")


class NodeVerbs(EdgeCore):
    """The node: its capabilities, info, usage and the live table's views."""

    # ------------------------------------------------------------------ node
    async def capabilities(self, req: NodeQuery = NODE_QUERY) -> CapabilityList:
        out = []
        for tier in tier_names():
            rt = self.runtimes.get(tier)
            if rt is None:
                out.append(
                    Capabilities(
                        tier=tier,
                        available=False,
                        reason=self.unavailable.get(tier, "not enabled on this node"),
                        exec=False,
                        files=False,
                        streaming=False,
                    )
                )
            else:
                out.append(capabilities_of(rt))
        return CapabilityList(tiers=out)

    async def node_info(self, req: NodeQuery = NODE_QUERY) -> NodeInfo:
        tiers = (await self.capabilities()).tiers
        host = None
        if self._host_report is not None:
            try:
                host = await asyncio.to_thread(self._host_report)
            except Exception:  # the node's answer must not fail for its report
                log.exception("host report failed")
        if host is not None:  # the tiers as this edge runs them, not as the host forecasts
            host = host.model_copy(
                update={
                    "tiers": [
                        HostTier(
                            tier=c.tier,
                            available=c.available,
                            reason=c.reason,
                            wanted=c.tier in self.runtimes or c.tier in self.unavailable,
                        )
                        for c in tiers
                    ]
                }
            )
        return NodeInfo(
            node=self.node,
            version=__version__,
            tiers=tiers,
            sandboxes=len(self._live),
            cpus=self._cpus,
            memory_mb=self._mem_mb,
            host=host,
        )

    def metrics_text(self) -> bytes:
        return self.metrics.text()

    def usage(self) -> NodeUsage:
        """:class:`dsec.contract.edge.NodeReports`: what this edge holds and admits against."""
        return NodeUsage(
            node=self.node,
            cpus=self._cpus,
            memory_mb=self._mem_mb,
            sandboxes=len(self._live),
            requested_cpu=self._live.requested_cpu,
            requested_memory_mb=self._live.requested_memory_mb,
            max_sandboxes=self.limits.max_sandboxes,
            cpu_overcommit=self.limits.cpu_overcommit,
            memory_overcommit=self.limits.memory_overcommit,
        )

    async def key_usage(self, owner: str) -> KeyUsage:
        """:class:`dsec.contract.edge.KeyAccounting`: what ``owner`` holds."""
        return self.key_usage_now(owner)

    def owned_sandboxes(self) -> list[tuple[str, SandboxInfo]]:
        """:class:`dsec.contract.edge.NodeReports`: ``(owner, info)`` of every live sandbox."""
        return [(lv.row.owner, self._info(lv.row)) for lv in self._live.values()]

    def live_states(self) -> dict[str, str]:
        """Sandbox id -> state of every live sandbox (cheap: no descriptions are built)."""
        return {lv.row.id: lv.row.state for lv in self._live.values()}

    def owned_sandbox(self, sandbox_id: str) -> tuple[str, SandboxInfo] | None:
        """``(owner, info)`` of the live sandbox ``sandbox_id``, or None."""
        lv = self._live.get(sandbox_id)
        return None if lv is None else (lv.row.owner, self._info(lv.row))

    async def stats(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "live": len(self._live),
            "by_tier_state": {f"{t}/{s}": n for (t, s), n in self.registry.count_by().items()},
        }
