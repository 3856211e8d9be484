"""Mapping of every failure to a JSON error body: ``{"error": {code, message, details}}``.

=====================================  ======  =====================================
what happened                          status  code
=====================================  ======  =====================================
a :class:`dsec.errors.DsecError`       its     ``err.code`` (``err.to_wire()``)
request validation (body, query, path) 400     ``invalid_request``, field errors in
                                               ``details.errors``
malformed JSON / unreadable body       400     ``invalid_request``
unknown route                          404     ``not_found``
known route, wrong method              405     ``invalid_request``
body over the size limit               413     ``payload_too_large``
anything else (a bug)                  500     ``internal``, with ``details.request_id``
=====================================  ======  =====================================

422 is never used for validation: in dsec it means ``unsupported``.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec.errors import (
    DsecError,
    InternalError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    error_from_wire,
)

__all__ = ["error_response", "install_error_handlers", "validation_details"]


def error_response(request: Request, err: DsecError, status: int | None = None) -> JSONResponse:
    """The JSON response for ``err``; also tells the metrics middleware the error code. An
    error that says when to retry (``details["retry_after_s"]``) sends ``Retry-After``."""
    request.state.error_code = err.code
    headers = None
    retry_after = err.details.get("retry_after_s")
    if isinstance(retry_after, int | float) and not isinstance(retry_after, bool):
        headers = {"Retry-After": str(max(1, round(retry_after)))}
    return JSONResponse(err.to_wire(), status_code=status or err.http_status, headers=headers)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def validation_details(errors: Any) -> tuple[str, list[dict[str, Any]]]:
    """A one-line summary and a JSON-safe list of ``{loc, msg, type}`` field errors.

    Input values are left out on purpose: they can be large (file bodies, stdin).
    """
    out: list[dict[str, Any]] = []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ())]
        out.append({"loc": loc, "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))})
    if not out:
        return "invalid request", out
    first = out[0]
    summary = f"{'.'.join(first['loc'])}: {first['msg']}"
    if len(out) > 1:
        summary += f" (and {len(out) - 1} more)"
    return summary, _jsonable(out)


async def _on_dsec_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DsecError)
    return error_response(request, exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    summary, errors = validation_details(exc.errors())
    return error_response(request, InvalidRequest(summary, errors=errors))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = str(exc.detail)
    if exc.status_code == 404:
        err: DsecError = NotFound(f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        err = InvalidRequest(f"method {request.method} not allowed on {request.url.path}")
    elif exc.status_code == 413:
        err = PayloadTooLarge(detail)
    elif 400 <= exc.status_code < 500:
        err = error_from_wire(exc.status_code, {"detail": detail})
        if type(err) is InternalError:
            err = InvalidRequest(detail)
    else:
        err = InternalError(detail)
    return error_response(request, err, status=exc.status_code)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(DsecError, _on_dsec_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
