"""The HTTP layer of the SDK: configuration, one lazily created httpx client, error mapping.

Every failure leaves this module as a :class:`dsec.errors.DsecError`:

* a non-2xx answer -> :func:`dsec.errors.error_from_wire` (the server's own error class);
* connection refused / unreachable -> ``ServiceUnavailable`` with a hint to run ``dsec serve``;
* no answer in time (client side) -> ``SandboxTimeout``.

When the request certainly never left this process (the connection could not be made),
the error's ``details["delivered"]`` is ``False`` (see :func:`not_delivered`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from pydantic import BaseModel

from dsec.config import DEFAULT_HOME, DEFAULT_URL
from dsec.contract.verbs import Envelope, Verb
from dsec.errors import DsecError, SandboxTimeout, ServiceUnavailable, error_from_wire
from dsec.version import __version__
from dsec.wire import ANSWER

__all__ = [
    "IDEMPOTENCY_HEADER",
    "SEQ_HEADER",
    "HttpClient",
    "not_delivered",
    "resolve_api_key",
    "resolve_url",
]

SEQ_HEADER = "X-Dsec-Seq"
"""Request header carrying a call's trajectory sequence number."""

IDEMPOTENCY_HEADER = "Idempotency-Key"
"""Request header carrying a client-chosen idempotency key."""

DEFAULT_TIMEOUT_S = 30.0
"""Default per-request timeout, seconds (exec and create extend it)."""


def resolve_url(url: str | None) -> str:
    """``url``, else ``$DSEC_URL``, else ``http://127.0.0.1:7070``."""
    return (url or os.environ.get("DSEC_URL") or DEFAULT_URL).rstrip("/")


def resolve_api_key(api_key: str | None) -> str | None:
    """``api_key``, else ``$DSEC_API_KEY``, else ``$DSEC_HOME/api_key`` if readable, else None."""
    if api_key:
        return api_key
    env_key = os.environ.get("DSEC_API_KEY")
    if env_key:
        return env_key.strip()
    key_file = os.path.join(os.environ.get("DSEC_HOME", DEFAULT_HOME), "api_key")
    try:
        with open(key_file) as f:
            return f.read().strip() or None
    except OSError:
        return None


def not_delivered(err: DsecError) -> bool:
    """True when ``err`` proves the request never left this process (the connection could
    not be made): ``details["delivered"] is False``."""
    return err.details.get("delivered") is False


_BROKEN_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""Transport errors where the connection broke without an answer (not timeouts: a slow
request may still be running, and repeating it would only wait twice)."""

_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})


def _retry_safe(method: str, headers: Mapping[str, str] | None) -> bool:
    """Whether repeating a request cannot do its work twice: an idempotent method, or a
    request carrying its sandbox sequence number or an idempotency key (the edge records
    those and answers a repeat from its trajectory log without running it again)."""
    if method.upper() in _IDEMPOTENT_METHODS:
        return True
    names = {k.lower() for k in (headers or {})}
    return SEQ_HEADER.lower() in names or IDEMPOTENCY_HEADER.lower() in names


def _error_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return {"detail": response.text[:500] or response.reason_phrase}


class HttpClient:
    """Talks to one dsec server. Safe to share between sandboxes on one event loop.

    The underlying ``httpx.AsyncClient`` is created on first use, and again if used from
    another event loop or after :meth:`aclose`, so objects survive ``asyncio.run`` twice.

    Args:
        url: server URL (see :func:`resolve_url`).
        api_key: API key (see :func:`resolve_api_key`).
        timeout: default per-request timeout, seconds.
        transport: an httpx async transport (tests: ``httpx.ASGITransport(app)``).
    """

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = resolve_url(url)
        self.api_key = resolve_api_key(api_key)
        self.timeout = timeout
        self.transport = transport
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._client.is_closed:
            headers = {"user-agent": f"dsec-python/{__version__}"}
            if self.api_key:
                headers["authorization"] = f"Bearer {self.api_key}"
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                transport=self.transport,
                verify=_ssl_context(),
                timeout=self.timeout,
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
            self._loop = loop
        return self._client

    def _timeout(self, timeout: float | None) -> httpx.Timeout:
        total = self.timeout if timeout is None else timeout
        return httpx.Timeout(total, connect=min(10.0, total))

    def _transport_error(self, exc: httpx.TransportError, what: str, timeout: float) -> DsecError:
        if isinstance(exc, httpx.ConnectTimeout):
            return SandboxTimeout(
                f"{what}: could not connect to {self.url} within {timeout:g} s",
                timeout_s=timeout,
                delivered=False,
            )
        if isinstance(exc, httpx.TimeoutException):
            return SandboxTimeout(
                f"{what}: no answer from {self.url} within {timeout:g} s", timeout_s=timeout
            )
        if isinstance(exc, httpx.ConnectError):
            return ServiceUnavailable(
                f"cannot connect to the dsec server at {self.url} ({exc or 'connection refused'});"
                " is it running? start it with `dsec serve`, or set DSEC_URL",
                url=self.url,
                delivered=False,
            )
        return ServiceUnavailable(f"{what}: connection to {self.url} failed: {exc!r}", url=self.url)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | list[tuple[str, Any]] | None = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one request; return the 2xx response or raise the mapped DsecError.

        A request that is safe to repeat (see :func:`_retry_safe`) is sent once more when the
        connection broke before any answer arrived (typically a pooled keep-alive connection
        the server closed just as it was reused)."""
        t = self.timeout if timeout is None else timeout
        for attempt in range(2):
            try:
                response = await self._http().request(
                    method,
                    path,
                    json=json,
                    params=params,
                    content=content,
                    headers=headers,
                    timeout=self._timeout(t),
                )
                break
            except _BROKEN_CONNECTION as exc:
                if attempt == 0 and _retry_safe(method, headers):
                    continue
                raise self._transport_error(exc, f"{method} {path}", t) from exc
            except httpx.TransportError as exc:
                raise self._transport_error(exc, f"{method} {path}", t) from exc
        if response.is_success:
            return response
        raise error_from_wire(response.status_code, _error_body(response))

    async def call(
        self,
        name: str,
        req: BaseModel,
        *,
        envelope: Envelope | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Send the verb ``name`` of the table (:mod:`dsec.contract.verbs`) and return its
        answer model: the request's path parameters in the URL, its other fields in the
        query (``GET``, and a row's ``query`` fields) or the JSON body, a sequenced verb's
        envelope in its headers. (The table is read on the first call: ``import dsec`` does
        not load the edge contract.)"""
        from dsec.contract.edge import VERBS

        verb: Verb = VERBS[name]
        query = {k: _query_value(v) for k, v in verb.params(req).items() if v is not None}
        body = verb.wire(req)
        headers: dict[str, str] = {}
        if envelope is not None:
            if envelope.seq is not None:
                headers[SEQ_HEADER] = str(envelope.seq)
            if envelope.idem_key is not None:
                headers[IDEMPOTENCY_HEADER] = envelope.idem_key
        response = await self.request(
            verb.method,
            verb.url(req),
            params=query or None,
            json=body or None,
            headers=headers or None,
            timeout=timeout,
        )
        return verb.read_answer(response.json() if verb.answer is not None else None, ANSWER)

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """Open a streamed response (2xx) or raise the mapped DsecError."""
        t = self.timeout if timeout is None else timeout
        try:
            async with self._http().stream(
                method,
                path,
                json=json,
                content=content,
                headers=headers,
                timeout=self._timeout(t),
            ) as response:
                if not response.is_success:
                    await response.aread()
                    raise error_from_wire(response.status_code, _error_body(response))
                yield response
        except httpx.TransportError as exc:
            raise self._transport_error(exc, f"{method} {path}", t) from exc

    async def aclose(self) -> None:
        """Close pooled connections (a later request opens new ones)."""
        client, self._client = self._client, None
        if client is not None and self._loop is asyncio.get_running_loop():
            await client.aclose()


_SSL_CONTEXT: Any = None


def _ssl_context() -> Any:
    """One TLS context per process: building one loads the CA bundle (~0.1-0.3 s here), and
    every sandbox object may open its own client."""
    global _SSL_CONTEXT
    if _SSL_CONTEXT is None:
        import ssl

        _SSL_CONTEXT = ssl.create_default_context()
    return _SSL_CONTEXT


def _query_value(value: Any) -> Any:
    """A JSON value as a query parameter (booleans as ``true``/``false``, as FastAPI reads
    them; lists repeat the parameter)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value
