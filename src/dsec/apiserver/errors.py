"""Mapping of every failure to a JSON error body: ``{"error": {code, message, details}}``.

=====================================  ======  =====================================
what happened                          status  code
=====================================  ======  =====================================
a :class:`dsec.errors.DsecError`       its     ``err.code`` (``err.to_wire()``)
request validation (body, query, path) 400     ``invalid_request``, field errors in
                                               ``details.errors``
malformed JSON / unreadable body       400     ``invalid_request``
unknown route                          404     ``not_found``
known route, wrong method              405     ``invalid_request``, with ``Allow``
body over the size limit               413     ``payload_too_large``
anything else (a bug)                  500     ``internal``, with ``details.request_id``
=====================================  ======  =====================================

422 is never used for validation: in dsec it means ``unsupported``.

Messages name the request path as :func:`public_path` shows it: the key of a
``/k/<key>/...`` path (SandboxFusion clients that carry their key in the URL) is never
echoed back.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Route

from dsec.errors import (
    DsecError,
    InternalError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    error_from_wire,
)

__all__ = ["error_response", "install_error_handlers", "public_path", "validation_details"]

_KEYED_PATH = re.compile(r"^/k/[^/]*")


def public_path(path: str) -> str:
    """``path`` fit to echo or log: a ``/k/<key>`` prefix becomes ``/k/{api_key}``."""
    return _KEYED_PATH.sub("/k/{api_key}", path, count=1)


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
    if errors and all(e["loc"][:1] == ["path"] for e in errors):
        # ``GET /v1/sandboxes/batch`` reached ``GET /v1/sandboxes/{sandbox_id}`` only because
        # a parameter matches any segment: the path names the static route, which does not
        # serve this method (405), rather than a malformed sandbox id (400)
        matched = request.scope.get("route")
        params, allowed = _most_specific(request)
        if (
            isinstance(matched, Route)
            and params < len(matched.param_convertors)
            and request.method not in allowed
        ):
            path = public_path(request.url.path)
            err = InvalidRequest(f"method {request.method} not allowed on {path}")
            response = error_response(request, err, status=405)
            response.headers["Allow"] = ", ".join(sorted(allowed))
            return response
    return error_response(request, InvalidRequest(summary, errors=errors))


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = str(exc.detail)
    path = public_path(request.url.path)
    headers = None
    if exc.status_code == 404:
        err: DsecError = NotFound(f"no route {request.method} {path}")
    elif exc.status_code == 405:
        err = InvalidRequest(f"method {request.method} not allowed on {path}")
        allow = _allowed_methods(request) or (exc.headers or {}).get("Allow")
        headers = {"Allow": allow} if allow else None
    elif exc.status_code == 413:
        err = PayloadTooLarge(detail)
    elif 400 <= exc.status_code < 500:
        err = error_from_wire(exc.status_code, {"detail": detail})
        if type(err) is InternalError:
            err = InvalidRequest(detail)
    else:
        err = InternalError(detail)
    response = error_response(request, err, status=exc.status_code)
    if headers:
        response.headers.update(headers)
    return response


def _allowed_methods(request: Request) -> str:
    """Every method the app serves at this path (several routes may share a path, one per
    method; Starlette's own ``Allow`` names only the first). When routes of different
    shapes match (``/v1/sandboxes/batch`` and ``/v1/sandboxes/{sandbox_id}``), only the
    most specific ones count: those with the fewest path parameters."""
    return ", ".join(sorted(_most_specific(request)[1]))


def _most_specific(request: Request) -> tuple[int, set[str]]:
    """(number of path parameters, methods) of the routes with the fewest parameters whose
    path matches this request's; ``(0, set())`` when none does."""
    path = request.scope.get("path", "")
    by_params: dict[int, set[str]] = {}
    for route in _flat_routes(request.app.router.routes):
        if isinstance(route, Route) and route.methods and route.path_regex.match(path):
            by_params.setdefault(len(route.param_convertors), set()).update(route.methods)
    if not by_params:
        return 0, set()
    fewest = min(by_params)
    return fewest, by_params[fewest]


def _flat_routes(routes: list[BaseRoute]) -> list[BaseRoute]:
    """The app's routes with included routers expanded (FastAPI >= 0.16x keeps an included
    router as one entry; older versions copy its routes)."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI: routes are already flat
        return list(routes)
    return [ctx.original_route for ctx in iter_route_contexts(routes)]


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app``."""
    app.add_exception_handler(DsecError, _on_dsec_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
