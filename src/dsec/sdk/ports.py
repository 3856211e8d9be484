"""Ports of a sandbox from the SDK: URLs of the port proxy and local port forwarding.

:meth:`dsec.AsyncSandbox.get_url` / :meth:`~dsec.AsyncSandbox.get_host` build addresses of
the server's port proxy (``docs/network.md``, "Ports"), :meth:`~dsec.AsyncSandbox.port_forward`
opens a local TCP port whose connections are carried to a port inside the sandbox (like
``kubectl port-forward``; ``dsec port-forward ID [LOCAL:]PORT`` on the command line).

Forwarding rides on WebSockets (``/v1/sandboxes/{id}/tcp/{port}``, binary messages are the
bytes) and needs the ``websockets`` package.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from types import TracebackType
from typing import Any
from urllib.parse import quote

from dsec.errors import DsecError, ServiceUnavailable, error_from_wire
from dsec.models import PortAccess

__all__ = ["AsyncPortForward", "port_url"]

TOKEN_PATH_PREFIX = "/_dsec_token/"
TOKEN_QUERY = "dsec_token"


def port_url(
    api_url: str,
    access: PortAccess,
    port: int,
    path: str = "/",
    *,
    signed: bool = True,
    host: bool = False,
) -> str:
    """The URL of ``path`` on ``port`` of the sandbox ``access`` describes.

    ``host=False`` (default): the path route on the API's own address
    (``{api}/v1/sandboxes/{id}/ports/{port}{path}``), which needs nothing but the API;
    ``host=True``: the host route ``{scheme}://{port}-{id}.{domain}{path}`` (relative and
    absolute links of web apps work; needs DNS for the domain). ``signed`` puts the
    sandbox's access token in the URL (a ``/_dsec_token/<token>`` path prefix on path routes,
    which survives a client appending paths; ``?dsec_token=`` on host routes, which a browser
    trades for a cookie), so the URL works with no header; a public sandbox needs none."""
    if not 1 <= int(port) <= 65535:
        from dsec.errors import InvalidRequest

        raise InvalidRequest(f"port must be between 1 and 65535, not {port}", port=port)
    if not path.startswith("/"):
        path = "/" + path
    token = access.token if signed and not access.public else None
    if host:
        if not access.domain:
            from dsec.errors import CapabilityNotSupported

            raise CapabilityNotSupported(
                "this server has no ports domain for host routes (DSEC_PORTS_DOMAIN): use "
                "path routes (host=False)"
            )
        url = f"{access.scheme}://{port}-{access.sandbox_id}.{access.domain}{path}"
        if token:
            url += ("&" if "?" in path else "?") + f"{TOKEN_QUERY}={quote(token, safe='')}"
        return url
    base = f"{api_url.rstrip('/')}/v1/sandboxes/{access.sandbox_id}/ports/{port}"
    if token:
        base += TOKEN_PATH_PREFIX + token
    return base + path


class AsyncPortForward:
    """A local TCP listener whose connections go to a port inside a sandbox. Made by
    :meth:`dsec.AsyncSandbox.port_forward`; ``close()`` (or leaving ``async with``) stops
    it and ends its connections.

    Properties: ``local_host``, ``local_port`` (where it listens), ``remote_port`` (the
    port in the sandbox), ``connections`` (relayed so far).
    """

    def __init__(
        self,
        ws_url: str,
        headers: dict[str, str],
        remote_port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._ws_url = ws_url
        self._headers = headers
        self._ssl = ssl_context
        self._remote_port = remote_port
        self._local_host = "127.0.0.1"
        self._local_port = 0
        self._connections = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def local_host(self) -> str:
        """The local address it listens on."""
        return self._local_host

    @property
    def local_port(self) -> int:
        """The local TCP port it listens on."""
        return self._local_port

    @property
    def remote_port(self) -> int:
        """The TCP port inside the sandbox."""
        return self._remote_port

    @property
    def connections(self) -> int:
        """Connections relayed so far."""
        return self._connections

    def __repr__(self) -> str:
        return f"AsyncPortForward({self.local_host}:{self.local_port} -> {self.remote_port})"

    async def start(self, local_port: int = 0, local_host: str = "127.0.0.1") -> None:
        """Listen on ``local_host:local_port`` (0: a free port; see :attr:`local_port`).
        One connection is opened first, so a sandbox or port that cannot be reached fails
        here (``PortNotListening``, ``SandboxNotFound``...) rather than on first use."""
        try:
            import websockets  # noqa: F401
        except ImportError:
            raise ServiceUnavailable(
                "port forwarding needs the websockets package: pip install websockets"
            ) from None
        ws = await self._connect()
        await ws.close()
        self._server = await asyncio.start_server(self._serve, local_host, local_port)
        self._local_host = local_host
        self._local_port = int(self._server.sockets[0].getsockname()[1])

    async def _connect(self) -> Any:
        import websockets

        try:
            return await websockets.connect(
                self._ws_url,
                additional_headers=self._headers,
                ssl=self._ssl,
                max_size=None,
                compression=None,
                open_timeout=30,
            )
        except websockets.exceptions.InvalidStatus as e:
            body: Any
            try:
                import json

                body = json.loads(bytes(e.response.body or b"{}"))
            except ValueError:
                body = None
            raise error_from_wire(e.response.status_code, body) from None
        except (OSError, TimeoutError) as e:
            raise ServiceUnavailable(f"cannot reach the server for port forwarding: {e}") from None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._connections += 1
        try:
            try:
                ws = await self._connect()
            except DsecError:
                return
            await _relay(reader, writer, ws)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        """Stop listening and end every relayed connection (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_closed(self) -> None:
        """Block until :meth:`close` (serve forever, as ``dsec port-forward`` does)."""
        while self._server is not None:
            await asyncio.sleep(0.5)

    async def __aenter__(self) -> AsyncPortForward:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ws: Any) -> None:
    import websockets

    async def up() -> None:
        while True:
            data = await reader.read(256 * 1024)
            if not data:
                return
            await ws.send(data)

    async def down() -> None:
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            async for message in ws:
                writer.write(message if isinstance(message, bytes) else message.encode())
                await writer.drain()

    tasks = [asyncio.create_task(up()), asyncio.create_task(down())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if tasks[0] in done:  # the local side finished sending: let the answer drain
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(tasks[1]), 30)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(Exception):
            await ws.close()
