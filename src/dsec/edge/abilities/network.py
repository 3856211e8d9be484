"""A sandbox's network policy and counters, and its ports."""

from __future__ import annotations

import logging

from dsec.contract.edge import PortStream, PortTicket
from dsec.contract.runtime import Networked, PortConnectable
from dsec.edge.core import EdgeCore, LiveSandbox
from dsec.edge.ports import TrackedStream, check_port
from dsec.errors import CapabilityNotSupported, SandboxNotFound, SandboxStopped, TooManyConnections
from dsec.models import NetworkPolicyRequest, NetworkStats, SandboxInfo, SandboxRef

log = logging.getLogger("dsec.edge")


class NetworkVerbs(EdgeCore):
    """A sandbox's network policy and counters, and its ports."""

    # ------------------------------------------------------------------ network
    async def update_network(self, req: NetworkPolicyRequest, owner: str) -> SandboxInfo:
        """Replace a running sandbox's network policy; new connections see it at once."""
        policy = req.policy

        async def run(lv: LiveSandbox) -> SandboxInfo:
            rt = self.runtimes.get(lv.row.tier)
            if not isinstance(rt, Networked):
                raise CapabilityNotSupported(f"tier {lv.row.tier} has no network policy")
            await rt.network_update(lv.handle, policy)
            lv.row.request = lv.row.request.model_copy(update={"network": policy})
            self.registry.set_request(lv.row.id, lv.row.request)
            return self._info(lv.row)

        return await self._use(req.sandbox_id, owner, run)

    async def network_stats(self, req: SandboxRef, owner: str) -> NetworkStats:
        """Allowed and blocked connection attempts of a sandbox, by destination (only
        ``enabled=False`` set for a sandbox without a network)."""

        async def run(lv: LiveSandbox) -> NetworkStats:
            rt = self.runtimes.get(lv.row.tier)
            if not isinstance(rt, Networked):
                return NetworkStats(enabled=False)
            return NetworkStats.model_validate(await rt.network_stats(lv.handle))

        return await self._use(req.sandbox_id, owner, run)

    # ------------------------------------------------------------------ ports
    async def open_port(self, sandbox_id: str, owner: str, port: int) -> PortStream:
        """:class:`dsec.contract.edge.PortForwarding`: a TCP connection to ``port`` inside
        the sandbox, made from inside it (``PortConnectable`` runtimes). Counted against
        ``limits.max_port_connections`` until closed; traffic counts as TTL activity; the
        connection is closed when the sandbox is killed."""
        port = check_port(port)

        async def run(lv: LiveSandbox) -> PortStream:
            rt = self.runtimes.get(lv.row.tier)
            if not isinstance(rt, PortConnectable):
                raise CapabilityNotSupported(
                    f"tier {lv.row.tier} has no ports to connect to (use container, microvm or vm)",
                    tier=lv.row.tier,
                )
            limit = self.limits.max_port_connections
            if len(lv.ports) + lv.ports_opening >= limit:
                raise TooManyConnections(
                    f"sandbox {sandbox_id} already has {limit} open port connections (the "
                    "node's limit, DSEC_MAX_PORT_CONNECTIONS); close some and retry",
                    sandbox_id=sandbox_id,
                    limit=limit,
                    retry_after_s=1,
                )
            lv.ports_opening += 1
            try:
                inner = await rt.connect_port(lv.handle, port)
            finally:
                lv.ports_opening -= 1
            if lv.row.state == "stopped":  # killed while connecting
                await inner.close()
                raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
            stream = TrackedStream(
                inner, on_activity=lambda: self._touch(lv), on_close=lv.ports.discard
            )
            lv.ports.add(stream)
            self.metrics.port_connections.labels(lv.row.tier).inc()
            return stream

        return await self._use(sandbox_id, owner, run)

    async def port_ticket(self, sandbox_id: str, owner: str, port: int) -> PortTicket:
        """:class:`dsec.contract.edge.PortForwarding`: :meth:`open_port`, parked on this
        node's port gateway for a cluster apiserver to pick up."""
        if self.port_gateway is None:
            raise CapabilityNotSupported(
                "this edge has no port gateway (port tickets are for cluster nodes)"
            )
        return await self.port_gateway.park(self.open_port(sandbox_id, owner, port))

    async def public_port_owner(self, sandbox_id: str) -> str:
        """:class:`dsec.contract.edge.PortForwarding`: the owner of a live sandbox created
        with ``public_ports``; ``SandboxNotFound`` for any other."""
        lv = self._live.get(sandbox_id)
        if lv is None or not lv.row.request.public_ports:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return lv.row.owner
