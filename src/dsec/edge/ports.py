"""The edge side of port forwarding: connections to TCP ports inside sandboxes.

The apiserver's port proxy (:mod:`dsec.apiserver.ports`) relays HTTP, WebSocket and raw
TCP over :class:`~dsec.contract.edge.PortStream` objects that an edge opens with
:meth:`~dsec.contract.edge.PortForwarding.open_port`. What is here:

* :func:`check_port`: the one check of a port number (1..65535, else ``InvalidRequest``);
* (:class:`~dsec.runtimes.sockets.SocketStream` and
  :func:`~dsec.runtimes.sockets.connect_socket`, the ``PortStream`` the container tier
  makes, live with the runtimes;)
* :class:`TrackedStream`: the edge's wrapper that counts a sandbox's open connections,
  turns traffic into TTL activity and is closed when the sandbox goes;
* :class:`PortGateway` and :func:`redeem_ticket`: cluster mode. A live connection cannot
  cross Ray, so the node's edge opens it (every check and error as in embedded mode,
  returned through Ray as a typed error) and parks it under a one-use random ticket; the
  apiserver replica connects to the gateway's TCP port on the node network, presents the
  ticket and gets the bytes. The ticket (32 random bytes) travels only over Ray's
  authenticated channel, expires after ``ticket_ttl_s`` and works once, so the gateway
  port needs no other credential (docs/design/ports.md).

Gateway wire protocol: the client sends ``DSEC-PORT1 <ticket>\\n``; the gateway answers
``OK\\n`` and from then on relays bytes both ways, or one line of JSON (a dsec wire error)
and closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dsec.contract.edge import PortStream, PortTicket
from dsec.errors import (
    DsecError,
    InvalidRequest,
    ServiceUnavailable,
    error_from_wire,
)
from dsec.runtimes.sockets import CONNECT_TIMEOUT_S, READ_CHUNK, SocketStream

__all__ = [
    "CONNECT_TIMEOUT_S",
    "PortGateway",
    "TrackedStream",
    "check_port",
    "redeem_ticket",
    "relay",
]

log = logging.getLogger("dsec.ports")

GATEWAY_MAGIC = b"DSEC-PORT1 "


def check_port(port: object) -> int:
    """``port`` as an int in 1..65535, else ``InvalidRequest`` (HTTP 400)."""
    if isinstance(port, bool) or not isinstance(port, int):
        try:
            port = int(str(port), 10)
        except ValueError:
            raise InvalidRequest(f"port must be a number, not {str(port)[:20]!r}") from None
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"port must be between 1 and 65535, not {port}", port=port)
    return port


class TrackedStream:
    """A sandbox connection as the edge hands it out: ``on_activity`` on traffic (at most
    once a second: TTL activity), ``on_close`` exactly once when closed by either side,
    and :meth:`close` when the edge destroys the sandbox."""

    def __init__(
        self,
        inner: PortStream,
        *,
        on_activity: Callable[[], None],
        on_close: Callable[[TrackedStream], None],
    ) -> None:
        self._inner = inner
        self._on_activity = on_activity
        self._on_close: Callable[[TrackedStream], None] | None = on_close
        self._last = 0.0

    def _active(self) -> None:
        now = time.monotonic()
        if now - self._last > 1.0:
            self._last = now
            self._on_activity()

    async def read(self, max_bytes: int = 65536) -> bytes:
        data = await self._inner.read(max_bytes)
        if data:
            self._active()
        return data

    async def write(self, data: bytes) -> None:
        self._active()
        await self._inner.write(data)

    async def write_eof(self) -> None:
        await self._inner.write_eof()

    async def close(self) -> None:
        done, self._on_close = self._on_close, None
        try:
            await self._inner.close()
        finally:
            if done is not None:
                done(self)


async def relay(a: PortStream, b: PortStream, *, chunk: int = READ_CHUNK) -> None:
    """Copy bytes both ways between two streams until both directions ended (each EOF
    is passed on as ``write_eof``), then close both. Returns when done or cancelled."""

    async def pump(src: PortStream, dst: PortStream) -> None:
        try:
            while True:
                data = await src.read(chunk)
                if not data:
                    break
                await dst.write(data)
        except (ConnectionError, OSError):
            pass
        with contextlib.suppress(Exception):
            await dst.write_eof()

    try:
        await asyncio.gather(pump(a, b), pump(b, a))
    finally:
        with contextlib.suppress(Exception):
            await a.close()
        with contextlib.suppress(Exception):
            await b.close()


@dataclass
class _Parked:
    stream: PortStream
    expires: float


class PortGateway:
    """A node's TCP endpoint where parked sandbox connections are picked up (cluster mode,
    see the module docstring). Start with :meth:`start`, stop with :meth:`close`.

    Args:
        host: the address to listen on (the node's address on the node network).
        port: the TCP port (0: any free one; :attr:`port` says which after start).
        advertise: the address put in tickets (default ``host``).
        ticket_ttl_s: how long a parked connection waits to be picked up, seconds.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        advertise: str | None = None,
        ticket_ttl_s: float = 10.0,
    ) -> None:
        self.host = host
        self.port = port
        self.advertise = advertise or host
        self.ticket_ttl_s = ticket_ttl_s
        self._parked: dict[str, _Parked] = {}
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._relays: set[asyncio.Task[None]] = set()

    @property
    def parked(self) -> int:
        """Connections waiting to be picked up."""
        return len(self._parked)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=65536)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._sweeper = asyncio.create_task(self._sweep(), name="dsec-port-gateway-sweeper")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for task in list(self._relays):
            task.cancel()
        for parked in list(self._parked.values()):
            with contextlib.suppress(Exception):
                await parked.stream.close()
        self._parked.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def park(self, opener: Awaitable[PortStream]) -> PortTicket:
        """Open a connection (``opener``: the edge's ``open_port``) and park it under a
        new ticket. Errors of the opener propagate (typed)."""
        if self._server is None:
            raise ServiceUnavailable("the node's port gateway is not running")
        stream = await opener
        ticket = secrets.token_urlsafe(32)
        self._parked[ticket] = _Parked(stream, time.monotonic() + self.ticket_ttl_s)
        return PortTicket(self.advertise, self.port, ticket, self.ticket_ttl_s)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.ticket_ttl_s / 4))
            now = time.monotonic()
            for ticket, parked in list(self._parked.items()):
                if parked.expires < now and self._parked.pop(ticket, None) is not None:
                    with contextlib.suppress(Exception):
                        await parked.stream.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer: PortStream = SocketStream(reader, writer)
        try:
            async with asyncio.timeout(5.0):
                line = await reader.readline()
        except (TimeoutError, ConnectionError, OSError, ValueError):
            await peer.close()
            return
        parked = None
        if line.startswith(GATEWAY_MAGIC):
            parked = self._parked.pop(line[len(GATEWAY_MAGIC) :].strip().decode("latin-1"), None)
        if parked is None or parked.expires < time.monotonic():
            err = InvalidRequest("unknown or expired port ticket")
            with contextlib.suppress(Exception):
                writer.write(json.dumps(err.to_wire()).encode() + b"\n")
                await writer.drain()
            await peer.close()
            if parked is not None:
                await parked.stream.close()
            return
        writer.write(b"OK\n")
        task = asyncio.current_task()
        if task is not None:
            self._relays.add(task)
        try:
            await relay(peer, parked.stream)
        finally:
            if task is not None:
                self._relays.discard(task)


async def redeem_ticket(ticket: PortTicket, *, timeout_s: float = CONNECT_TIMEOUT_S) -> PortStream:
    """The sandbox connection parked under ``ticket`` on its node's gateway (the cluster
    apiserver's side of :class:`PortGateway`)."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                ticket.host, ticket.port, limit=READ_CHUNK
            )
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            writer.write(GATEWAY_MAGIC + ticket.ticket.encode() + b"\n")
            line = await reader.readline()
    except (TimeoutError, OSError) as e:
        raise ServiceUnavailable(
            f"the port gateway of the sandbox's node ({ticket.host}:{ticket.port}) cannot be "
            f"reached: {e!r}"[:300]
        ) from None
    if line == b"OK\n":
        return SocketStream(reader, writer)
    writer.close()
    try:
        body: Any = json.loads(line)
    except ValueError:
        body = None
    raise (
        error_from_wire(502, body)
        if isinstance(body, dict)
        else DsecError("the port gateway answered garbage")
    )
