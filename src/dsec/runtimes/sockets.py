"""A :class:`~dsec.contract.streams.PortStream` over a connected socket: what a runtime
hands up when the edge opens a port of a sandbox (the container tier makes the socket inside
the sandbox's network namespace, :class:`dsec.privileged.netns.NetnsSockets`), and
:func:`connect_socket`, which connects such a socket with a timeout, a refusal being
``PortNotListening``."""

from __future__ import annotations

import asyncio
import contextlib
import socket

from dsec.errors import PortNotListening, SandboxTimeout

__all__ = ["CONNECT_TIMEOUT_S", "READ_CHUNK", "SocketStream", "connect_socket"]

CONNECT_TIMEOUT_S = 5.0
"""How long a connection to a sandbox port may take to be accepted, seconds (a listener
whose accept queue is full drops SYNs: the client would otherwise wait for minutes)."""
READ_CHUNK = 1024 * 1024
"""Largest read from a connection, bytes."""


class SocketStream:
    """:class:`~dsec.contract.streams.PortStream` over a connected socket (asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._closed = False

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> SocketStream:
        reader, writer = await asyncio.open_connection(sock=sock, limit=READ_CHUNK)
        return cls(reader, writer)

    async def read(self, max_bytes: int = 65536) -> bytes:
        if self._closed:
            return b""
        try:
            return await self._reader.read(max_bytes)
        except (ConnectionError, OSError):
            return b""

    async def write(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionResetError("the connection to the sandbox is closed")
        self._writer.write(data)
        if self._writer.transport.get_write_buffer_size() > READ_CHUNK:
            await self._writer.drain()

    async def write_eof(self) -> None:
        if not self._closed and self._writer.can_write_eof():
            with contextlib.suppress(OSError, RuntimeError):
                self._writer.write_eof()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


async def connect_socket(
    sock: socket.socket, port: int, *, host: str = "127.0.0.1", timeout_s: float = CONNECT_TIMEOUT_S
) -> SocketStream:
    """Connect the non-blocking ``sock`` to ``host:port`` (inside whatever network
    namespace it was made in) and wrap it. ``PortNotListening`` when refused or reset,
    ``SandboxTimeout`` when not accepted within ``timeout_s`` seconds. ``sock`` is closed
    on failure."""
    loop = asyncio.get_running_loop()
    try:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout(timeout_s):
                await loop.sock_connect(sock, (host, port))
        except (ConnectionRefusedError, ConnectionResetError):
            raise PortNotListening(
                f"nothing in the sandbox accepts connections on port {port}", port=port
            ) from None
        except TimeoutError:
            raise SandboxTimeout(
                f"the sandbox did not accept a connection on port {port} within "
                f"{timeout_s:.0f} s (is its listener overloaded?)",
                port=port,
            ) from None
        except OSError as e:
            raise PortNotListening(
                f"port {port} of the sandbox cannot be reached: {e.strerror}", port=port
            ) from None
        return await SocketStream.from_socket(sock)
    except BaseException:
        sock.close()
        raise
