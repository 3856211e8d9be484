"""Map dsec errors to what the ``e2b`` SDK turns into its own exceptions.

Three wire shapes, three mappings:

* control plane (REST): an HTTP status and ``{"code": <status>, "message": ...}``
  (E2B's ``Error`` model). The SDK raises ``SandboxNotFoundException`` for 404 on
  sandbox routes, ``AuthenticationException`` for 401, ``RateLimitException``
  for 429, ``ServiceBusyException`` for 503 and ``SandboxException`` (with
  ``status_code``) otherwise.
* envd Connect-RPC: a :class:`~connectrpc.errors.ConnectError` code. The SDK maps
  ``NOT_FOUND`` to ``NotFoundException`` (``FileNotFoundException`` on file
  calls), ``INVALID_ARGUMENT`` to ``InvalidArgumentException``,
  ``DEADLINE_EXCEEDED`` to ``TimeoutException``, ``UNAUTHENTICATED`` to
  ``AuthenticationException``, ``RESOURCE_EXHAUSTED`` to ``RateLimitException``,
  ``UNAVAILABLE`` whose message contains "was not found" to
  ``SandboxNotRunningException``; anything else to ``SandboxException``.
* envd HTTP (``/files``, ``/health``): statuses as E2B's envd and proxy answer
  them: 400, 401, 404, 507, and 502 "sandbox ... was not found" for a sandbox
  that is gone (or was never this key's).

A sandbox that belongs to another owner is reported exactly like a missing one.
"""

from __future__ import annotations

from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dsec.errors import (
    AuthenticationError,
    CapabilityNotSupported,
    Conflict,
    DsecError,
    FileExists_,
    FileNotFound,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxNotFound,
    SandboxStopped,
    SandboxTimeout,
    ServiceUnavailable,
    Unsupported,
)
from dsec.models import SandboxRef

__all__ = [
    "E2BError",
    "control_status",
    "e2b_http_exception_handlers",
    "envd_http_status",
    "sandbox_gone_message",
    "sandbox_ref",
    "stream_ended_error",
    "to_connect_error",
]


class E2BError(Exception):
    """An E2B-level answer that has no dsec error (bad JSON, unknown route)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def sandbox_ref(sandbox_id: str) -> SandboxRef:
    """The request of a verb about ``sandbox_id`` (a path or header of E2B's), where a
    malformed id is a sandbox that does not exist: ``SandboxNotFound``, answered as E2B
    answers an unknown one (404, 502 "... was not found"), never a 400 as on dsec's API."""
    try:
        return SandboxRef(sandbox_id=sandbox_id)
    except ValidationError:
        raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id) from None


def sandbox_gone_message(sandbox_id: str) -> str:
    """The message E2B's proxy uses for a missing sandbox; the SDK matches "was not found"."""
    return f"The sandbox {sandbox_id} was not found"


def stream_ended_error(sandbox_id: str) -> ConnectError:
    """What envd ends an open stream with when its sandbox goes away mid-stream (killed,
    timed out): an ``UNAVAILABLE`` that does not say why, so the SDK probes ``/health``
    (502 "... was not found") and raises ``SandboxNotRunningException`` "... killed or
    reached its end of life while the request was in flight"."""
    return ConnectError(
        Code.UNAVAILABLE,
        f"the connection to sandbox {sandbox_id} ended before the stream completed",
    )


def control_status(err: DsecError) -> int:
    """HTTP status for a dsec error on the control plane (E2B REST routes)."""
    if isinstance(err, SandboxStopped):
        return 404  # a killed sandbox no longer exists for E2B
    return err.http_status if err.http_status != 500 else 500


def envd_http_status(err: DsecError) -> int:
    """HTTP status for a dsec error on envd's HTTP routes (``/files``)."""
    if isinstance(err, SandboxNotFound | SandboxStopped):
        return 502
    if isinstance(err, FileNotFound | NotFound):
        return 404
    if isinstance(err, InvalidRequest):
        return 400
    if isinstance(err, AuthenticationError):
        return 401
    if isinstance(err, PayloadTooLarge):
        return 413
    if isinstance(err, QuotaExceeded):
        return 429
    if isinstance(err, FileExists_ | Conflict):
        return 409
    if isinstance(err, Unsupported):
        return 501
    if isinstance(err, SandboxTimeout):
        return 504
    if isinstance(err, ServiceUnavailable):
        return 503
    return 500


def to_connect_error(err: DsecError, sandbox_id: str = "") -> ConnectError:
    """The Connect error for a dsec error raised while serving an envd RPC."""
    if isinstance(err, SandboxNotFound | SandboxStopped):
        return ConnectError(Code.UNAVAILABLE, sandbox_gone_message(sandbox_id))
    if isinstance(err, NotFound):
        return ConnectError(Code.NOT_FOUND, err.public_message)
    if isinstance(err, InvalidRequest):
        return ConnectError(Code.INVALID_ARGUMENT, err.public_message)
    if isinstance(err, AuthenticationError):
        return ConnectError(Code.UNAUTHENTICATED, err.public_message)
    if isinstance(err, SandboxTimeout):
        return ConnectError(Code.DEADLINE_EXCEEDED, err.public_message)
    if isinstance(err, FileExists_):
        return ConnectError(Code.ALREADY_EXISTS, err.public_message)
    if isinstance(err, Conflict):
        return ConnectError(Code.FAILED_PRECONDITION, err.public_message)
    if isinstance(err, PayloadTooLarge | QuotaExceeded):
        return ConnectError(Code.RESOURCE_EXHAUSTED, err.public_message)
    if isinstance(err, CapabilityNotSupported | Unsupported):
        return ConnectError(Code.UNIMPLEMENTED, err.public_message)
    if isinstance(err, ServiceUnavailable):
        return ConnectError(Code.UNAVAILABLE, err.public_message)
    return ConnectError(Code.INTERNAL, f"{err.code}: {err.public_message}")


def e2b_http_exception_handlers() -> dict[Any, Any]:
    """Starlette ``exception_handlers`` that answer the router's own refusals (405 method
    not allowed, 404) in E2B's error shape ``{"code", "message"}``, with ``Allow``."""

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        headers = {k: v for k, v in (exc.headers or {}).items() if k.lower() == "allow"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(
            {"code": exc.status_code, "message": message},
            status_code=exc.status_code,
            headers=headers or None,
        )

    return {HTTPException: on_http_error}
