"""The node side of cluster port connections (dsec.edge.ports.PortGateway): the edge opens
a connection, parks it under a one-use ticket, and a client on the node network picks it
up; the ticket works once, expires, and a wrong one gets a typed error."""

from __future__ import annotations

import asyncio

import pytest
from tests.timing import budget

from dsec.edge.ports import PortGateway, redeem_ticket
from dsec.errors import InvalidRequest, PortNotListening, SandboxNotFound
from dsec.models import CreateSandboxRequest
from dsec.testing import FakeEdge

OWNER = "k0123456789abcdef"


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data.upper())
        await writer.drain()
    writer.close()


async def test_ticket_carries_the_connection_once() -> None:
    edge = FakeEdge()
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    gateway = PortGateway("127.0.0.1", ticket_ttl_s=0.5)
    await gateway.start()
    edge.port_gateway = gateway
    try:
        sid = (await edge.create_sandbox(CreateSandboxRequest(), OWNER)).id
        edge.serve_port(sid, 8000, server.sockets[0].getsockname()[:2])
        ticket = await edge.port_ticket(sid, OWNER, 8000)
        assert ticket.port == gateway.port and len(ticket.ticket) >= 40
        stream = await redeem_ticket(ticket)
        await stream.write(b"hello")
        assert await stream.read() == b"HELLO"
        await stream.close()
        with pytest.raises(InvalidRequest, match="ticket"):
            await redeem_ticket(ticket)  # used
        # errors of the node arrive typed, before any ticket exists
        with pytest.raises(PortNotListening):
            await edge.port_ticket(sid, OWNER, 9)
        with pytest.raises(SandboxNotFound):
            await edge.port_ticket(sid, "k" + "f" * 16, 8000)
        # a ticket nobody picks up expires and its connection is closed
        await edge.port_ticket(sid, OWNER, 8000)
        assert gateway.parked == 1
        async with asyncio.timeout(budget(4)):  # its 0.5 s are over
            while gateway.parked:
                await asyncio.sleep(0.05)
        async with asyncio.timeout(budget(1)):
            while edge._live[sid].ports:
                await asyncio.sleep(0.05)
    finally:
        await gateway.close()
        server.close()
