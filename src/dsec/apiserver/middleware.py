"""The outermost layer of the apiserver: request ids, auth, body limits, metrics, crash guard.

Written as plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through
untouched. For each HTTP request, in order:

1. assigns a request id (returned in ``X-Request-ID``);
2. authenticates: every ``/v1`` and ``/ui/api`` path needs ``Authorization: Bearer <key>``
   or, from the dashboard, its session cookie (``dsec.ui.session``: a state-changing request
   must then carry the CSRF header); ``/metrics`` needs it unless the client address is
   loopback (a local Prometheus agent may scrape without a key; a remote one must send the
   key, e.g. Prometheus ``authorization``); ``/healthz`` and the docs are open. Failing
   requests get 401 (a cookie request without its CSRF token 403) before any parsing;
3. enforces the body limit (``Content-Length`` checked up front, streamed bodies
   counted): raw file uploads may carry ``max_upload_bytes``, everything else
   ``max_json_bytes``; over it the answer is 413 ``payload_too_large``;
4. turns any exception that escaped the handlers (a bug) into a 500 ``internal``
   response with the request id, logged with its traceback;
5. records ``dsec_api_*`` metrics by route template, and each request in the dashboard's
   activity series (``dsec.ui.series.ActivityRecorder``) when one is given;
6. writes one access-log line (logger ``dsec.access``, level INFO) when the response is
   done: method, route *template* (``/v1/sandboxes/{sandbox_id}/exec``, ``/e2b/...``,
   ``/k/{api_key}/run_code``; never the raw path, so no id or key is logged), status,
   latency in ms (to the end of the response body), the caller's owner id (never the
   key; ``-`` before authentication) and the request id. Formats
   (``DSEC_ACCESS_LOG``, default ``text``)::

       text: method=POST route=/v1/sandboxes status=201 ms=63.20 owner=k1f2e... request_id=9a0b...
       json: {"ts": "2026-12-01T12:00:00.123Z", "type": "access", "method": "POST",
              "route": "/v1/sandboxes", "status": 201, "ms": 63.2, "owner": "k1f2e...",
              "request_id": "9a0b..."}
       off:  nothing

The route template is the one the router matched (``scope["route"]``, with the prefix
of the mounts it went through); a sub-app that routes by itself (envd's Connect-RPC) may
name it in ``scope["dsec.route"]``. Requests no route matched are logged as
``<unmatched>``.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from datetime import UTC, datetime
from typing import IO, Any, Literal

from starlette.routing import Mount, Route, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.apiserver.auth import KeyVerifier
from dsec.apiserver.metrics import ApiMetrics
from dsec.errors import (
    AuthenticationError,
    DsecError,
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
)

__all__ = [
    "ACCESS_LOG_MODES",
    "ROUTE_SCOPE_KEY",
    "AccessLogMode",
    "ApiMiddleware",
    "access_log_mode",
    "configure_access_log",
]

log = logging.getLogger("dsec.apiserver")
access_log = logging.getLogger("dsec.access")

UNMATCHED = "<unmatched>"

AccessLogMode = Literal["text", "json", "off"]
ACCESS_LOG_MODES: tuple[AccessLogMode, ...] = ("text", "json", "off")
ROUTE_SCOPE_KEY = "dsec.route"
"""Scope key where a sub-app that routes by itself names the route template it served."""


def access_log_mode(value: str | None = None) -> AccessLogMode:
    """The access-log format: ``value``, else ``$DSEC_ACCESS_LOG``, else ``text``.
    Anything but ``text``, ``json`` or ``off`` is an :class:`InvalidRequest`."""
    raw = (value if value is not None else os.environ.get("DSEC_ACCESS_LOG", "")).strip()
    mode = raw.lower() or "text"
    for known in ACCESS_LOG_MODES:
        if mode == known:
            return known
    raise InvalidRequest(f"DSEC_ACCESS_LOG must be one of text, json, off (got {raw!r})", value=raw)


def configure_access_log(mode: AccessLogMode, stream: IO[str] | None = None) -> None:
    """Set up the ``dsec.access`` logger for ``dsec serve``: INFO whatever the server's log
    level (``DSEC_ACCESS_LOG`` alone turns it off). ``json``: each line is the JSON object
    alone on ``stream`` (default stderr), not wrapped in the server's log format, so a log
    shipper can parse it; ``text``: through the server's log format."""
    global _json_handler
    if _json_handler is not None:
        access_log.removeHandler(_json_handler)
        _json_handler = None
    access_log.setLevel(logging.INFO)
    access_log.propagate = mode == "text"
    if mode == "json":
        _json_handler = logging.StreamHandler(stream or sys.stderr)
        _json_handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(_json_handler)


_json_handler: logging.Handler | None = None


def _is_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    if not client:
        return False
    try:
        return ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


def _bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class ApiMiddleware:
    """See the module docstring.

    Args:
        app: the FastAPI app (its router is used to find route templates).
        keys: verifies bearer keys.
        metrics: where request metrics go.
        routes: ``(template, methods)`` of every route (metric labels).
        upload_routes: route templates whose body is a raw upload.
        max_upload_bytes: body limit of upload routes, bytes.
        max_json_bytes: body limit of every other route, bytes.
        access_log: ``text``, ``json`` or ``off`` (see the module docstring).
        passthrough: the route template of a request relayed to a sandbox port
            (:meth:`dsec.apiserver.ports.PortProxy.route_of`), None for any other: such a
            request checks its own credentials and has no body limit.
        sessions: dashboard sessions (``dsec.ui.session.SessionAuthority``), or None.
        activity: the dashboard's per-owner request series, or None.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        keys: KeyVerifier,
        metrics: ApiMetrics,
        routes: list[tuple[str, set[str]]],
        upload_routes: frozenset[str],
        max_upload_bytes: int,
        max_json_bytes: int,
        access_log: AccessLogMode = "text",
        passthrough: Callable[[Scope], str | None] | None = None,
        sessions: Any = None,
        activity: Any = None,
    ) -> None:
        self.app = app
        self.passthrough = passthrough
        self.sessions = sessions
        self.activity = activity
        self.access_mode = access_log
        self.keys = keys
        self.metrics = metrics
        self._table = [(compile_path(t)[0], t, m) for t, m in routes]
        self.upload_routes = upload_routes
        self.max_upload_bytes = max_upload_bytes
        self.max_json_bytes = max_json_bytes

    def _template(self, scope: Scope) -> str:
        """The route template of this request, for metrics (``<unmatched>`` if none)."""
        path = scope.get("path", "")
        partial = None
        for regex, template, methods in self._table:
            if regex.match(path):
                if scope.get("method") in methods:
                    return template
                partial = partial or template
        return partial or UNMATCHED

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.perf_counter()
        request_id = secrets.token_hex(8)
        state: MutableMapping[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        relayed = self.passthrough(scope) if self.passthrough is not None else None
        route = relayed or self._template(scope)
        entry_root = str(scope.get("root_path", ""))
        method = scope.get("method", "GET")
        status_box = [0]
        response_started = [False]
        rid_header = (b"x-request-id", request_id.encode())
        limit = self.max_upload_bytes if route in self.upload_routes else self.max_json_bytes
        if relayed is not None:
            limit = 1 << 62  # a sandbox's own server decides what it accepts
        overflow = [False]  # the body went over ``limit`` while the app was reading it
        received = [0]

        def too_large() -> PayloadTooLarge:
            return PayloadTooLarge(
                f"request body exceeds the limit of {limit} bytes", limit_bytes=limit
            )

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                if overflow[0] and not response_started[0]:
                    response_started[0] = True
                    await _send_error(send, too_large(), rid_header)
                    status_box[0] = 413
                    state["error_code"] = PayloadTooLarge.code
                    return
                response_started[0] = True
                status_box[0] = message["status"]
                message = dict(message)
                message["headers"] = [*message.get("headers", []), rid_header]
            elif overflow[0] and status_box[0] == 413:
                return  # the body of the response we replaced
            await send(message)

        async def receive_wrapper() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > limit:
                    overflow[0] = True
                    raise too_large()
            return message

        try:
            early = self._precheck(scope, limit) if relayed is None else None
            if early is not None:
                state["error_code"] = early.code
                status_box[0] = early.http_status
                response_started[0] = True
                await _send_error(send, early, rid_header)
                return
            await self.app(scope, receive_wrapper, send_wrapper)
        except Exception as exc:
            if isinstance(exc, DsecError):  # raised outside the handlers, e.g. by receive
                err: DsecError = exc
            else:
                log.exception("internal error (request %s, %s %s)", request_id, method, route)
                err = InternalError(
                    f"internal error; request id {request_id}", request_id=request_id
                )
            state["error_code"] = err.code
            if not response_started[0]:
                status_box[0] = err.http_status
                await _send_error(send, err, rid_header)
            else:
                status_box[0] = status_box[0] or 500
        finally:
            elapsed = time.perf_counter() - started_at
            status = status_box[0] or 500
            code = state.get("error_code")
            if code:
                self.metrics.error(str(code))
            served = relayed or _served_route(scope, entry_root) or route
            self.metrics.observe(method, served, status, elapsed)
            if self.activity is not None:
                self.activity.record(state.get("owner"), method, served, status, elapsed)
            if self.access_mode != "off" and access_log.isEnabledFor(logging.INFO):
                owner = state.get("owner")
                access_log.info(
                    self._access_line(method, served, status, elapsed, owner, request_id)
                )

    def _access_line(
        self,
        method: str,
        route: str,
        status: int,
        elapsed_s: float,
        owner: object,
        request_id: str,
    ) -> str:
        ms = elapsed_s * 1000.0
        who = str(owner) if owner else None
        if self.access_mode == "json":
            now = datetime.now(UTC)
            return json.dumps(
                {
                    "ts": now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z",
                    "type": "access",
                    "method": method,
                    "route": route,
                    "status": status,
                    "ms": round(ms, 3),
                    "owner": who,
                    "request_id": request_id,
                },
                ensure_ascii=True,
            )
        return (
            f"method={method} route={route} status={status} ms={ms:.2f} "
            f"owner={who or '-'} request_id={request_id}"
        )

    def _authenticate(self, scope: Scope) -> DsecError | None:
        """Set ``state["owner"]`` from the bearer key, else from a dashboard session; the
        error to answer otherwise."""
        key = _bearer(scope)
        if key is None and self.sessions is not None:
            try:
                session = self.sessions.authenticate(scope)
            except DsecError as e:
                return e
            if session is not None:
                scope["state"]["owner"] = session.owner
                scope["state"]["session"] = session
                return None
        if key is None:
            return AuthenticationError(
                "missing API key: send 'Authorization: Bearer <key>' (the server's key is "
                "in $DSEC_HOME/api_key; the SDK reads DSEC_API_KEY or that file)"
            )
        owner = self.keys.verify(key)
        if owner is None:
            return AuthenticationError("invalid or revoked API key")
        scope["state"]["owner"] = owner
        return None

    def _precheck(self, scope: Scope, limit: int) -> DsecError | None:
        path: str = scope.get("path", "")
        needs_key = path == "/v1" or path.startswith(("/v1/", "/ui/api/"))
        if path == "/metrics" and not _is_loopback(scope):
            needs_key = True
        if needs_key:
            denied = self._authenticate(scope)
            if denied is not None:
                return denied
        length = _content_length(scope)
        if length is not None and length > limit:
            return PayloadTooLarge(
                f"request body of {length} bytes exceeds the limit of {limit} bytes",
                limit_bytes=limit,
            )
        return None


def _served_route(scope: Scope, entry_root: str) -> str | None:
    """The template of the route that served this request, or None if no route matched.

    Starlette writes the route it dispatched to in ``scope["route"]`` and, for each mount it
    went through, appends the mount's path to ``scope["root_path"]`` (dsec's mounts have
    fixed paths, so that prefix holds no id). A mounted ASGI app without routes of its own
    is ``<mount>/{path}`` unless it named its route in ``scope["dsec.route"]``."""
    named = scope.get(ROUTE_SCOPE_KEY)
    if isinstance(named, str):
        return named
    route = scope.get("route")
    root = str(scope.get("root_path", ""))
    prefix = root[len(entry_root) :] if root.startswith(entry_root) else root
    if isinstance(route, Mount):
        return f"{prefix}/{{path}}"
    if isinstance(route, Route):
        return prefix + route.path
    return None


async def _send_error(
    send: Callable[[Message], Awaitable[None]], err: DsecError, rid_header: tuple[bytes, bytes]
) -> None:
    body = json.dumps(err.to_wire()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.http_status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                rid_header,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
