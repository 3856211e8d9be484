"""``run_code`` routes: SandboxFusion-compatible and dsec-native.

=================================  ===========================================================
route                              body -> answer
=================================  ===========================================================
``POST /run_code``                 SandboxFusion ``RunCodeRequest`` -> ``RunCodeResponse``
``POST /k/{api_key}/run_code``     same, with the API key in the path (for unmodified clients)
``POST /v1/run_code``              dsec ``CodeRunRequest`` -> ``CodeRunResult``
``POST /run_jupyter``              SandboxFusion ``RunJupyterRequest`` -> ``RunJupyterResponse``
                                   (when the server has a :class:`RunJupyterService`)
``POST /k/{api_key}/run_jupyter``  same, with the API key in the path
=================================  ===========================================================

Authentication: ``authorize(request)`` returns the caller's owner id or None. It sees the
``Authorization`` header and, on ``/k/{api_key}/...``, ``request.path_params["api_key"]``
(:func:`request_api_key` returns whichever is present). SandboxFusion clients send no key, so
an operator may list client networks in ``keyless_networks`` (CIDRs, e.g. ``10.0.0.0/8``):
calls from those addresses without a key run as the owner ``keyless``. Everything else
without a valid key gets 401.

Who runs the code: ``get_service()`` returns the server's edge, whose
:class:`~dsec.contract.edge.CodeRuns` verbs run each call as the caller's (admitted like a
sandbox creation of its key: the key's quota, the node's creation gate; in a cluster on a
node with the fncall tier), or a bare :class:`RunCodeService` (a private server, tests),
which runs every call as nobody's.

Errors: on the SandboxFusion routes every problem with the request's content (unknown
language, bad base64, a path outside ``/work``, too large) is answered 200 with
``status: "SandboxError"`` and a message, as SandboxFusion does; an unparseable body is a
400; a call the key's quota or the node refuses (``QuotaExceeded``, ``CreationRateExceeded``:
429; ``NodeBusy``: 503; no fncall tier: 422) is answered with dsec's error shape and status,
as a missing key is (SandboxFusion's client retries what is not a 200). The dsec route
answers dsec's error shape (``{"error": {code, message, details}}``) with the error's
status. No route answers 500 for bad input.

Not on the verb table (:mod:`dsec.contract.verbs`), ``/v1/run_code`` included: these routes
also serve without an edge (a bare :class:`RunCodeService`), find their caller themselves
(``authorize``, ``keyless_networks``) and read their own bodies on a :class:`LeanRoute`; see
``docs/design/overview.md``, "The verb table".
"""

from __future__ import annotations

import inspect
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from dsec.apiserver.deps import ERROR_RESPONSES
from dsec.apiserver.jupyter import RunJupyterService
from dsec.contract.edge import CodeRuns
from dsec.errors import (
    AuthenticationError,
    DsecError,
    InternalError,
    InvalidRequest,
    PayloadTooLarge,
)
from dsec.models import RunJupyterRequest, RunJupyterResponse
from dsec.runtimes.fncall.service import (
    CodeRunRequest,
    CodeRunResult,
    RunCodeRequest,
    RunCodeResponse,
    RunCodeService,
    RunStatus,
)

log = logging.getLogger("dsec.apiserver.runcode")

__all__ = ["KEYLESS_OWNER", "make_runcode_router", "request_api_key"]

KEYLESS_OWNER = "keyless"
MAX_BODY_BYTES = 200 << 20

SANDBOXFUSION_ERRORS: dict[int | str, dict[str, Any]] = {
    status: ERROR_RESPONSES[status] for status in (400, 401, 413, 500)
}
"""What the SandboxFusion routes answer besides 200: a body that is not JSON, no valid key,
a body over the limit (everything else is a 200 with ``status: "SandboxError"``)."""
RUN_CODE_ERRORS: dict[int | str, dict[str, Any]] = {
    **SANDBOXFUSION_ERRORS,
    **{status: ERROR_RESPONSES[status] for status in (422, 429, 503)},
}
"""What SandboxFusion's ``/run_code`` answers besides those: no fncall tier (422), the key's
quota (429) or the node (503) refusing the call."""

Authorize = Callable[[Request], "Awaitable[str | None] | str | None"]


def request_api_key(request: Request) -> str | None:
    """The API key of a request: ``/k/{api_key}/`` in the path, else ``Authorization: Bearer``
    (or ``X-API-Key``)."""
    key = request.path_params.get("api_key")
    if key:
        return str(key)
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.headers.get("x-api-key") or None


def _error(err: DsecError) -> JSONResponse:
    return JSONResponse(err.to_wire(), status_code=err.http_status)


def _json(model: Any) -> Response:
    """A pydantic model as a JSON response, serialised by pydantic-core (no dict round trip)."""
    return Response(model.model_dump_json(), media_type="application/json")


class LeanRoute(APIRoute):
    """An APIRoute that calls its endpoint with the bare ``Request``.

    The run_code endpoints read and validate their own bodies and always return a
    ``Response``, so FastAPI's per-request dependency solving and response-model handling are
    pure overhead (measured: 0.32 -> 0.17 ms of CPU per request, server + client, on this VM).
    The route keeps its OpenAPI description (``response_model``, ``openapi_extra``).
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
        return handler


def make_runcode_router(
    get_service: Callable[[], CodeRuns | RunCodeService],
    authorize: Authorize | None = None,
    *,
    keyless_networks: Sequence[str] = (),
    max_body_bytes: int = MAX_BODY_BYTES,
    get_jupyter: Callable[[], RunJupyterService] | None = None,
) -> APIRouter:
    """The run_code routes (and ``/run_jupyter`` when ``get_jupyter`` is given).

    Args:
        get_service: returns the edge (:class:`~dsec.contract.edge.CodeRuns`: each call
            runs as its caller's) or a bare :class:`RunCodeService` (called per request).
        authorize: ``authorize(request) -> owner | None`` (sync or async). None accepts every
            caller as ``keyless`` (for a private, loopback-only server).
        keyless_networks: client CIDRs allowed to call without a key.
        max_body_bytes: larger bodies get 413.
        get_jupyter: returns the :class:`RunJupyterService` (called per request).
    """
    networks = [ipaddress.ip_network(n, strict=False) for n in keyless_networks]
    router = APIRouter(tags=["run_code"])

    async def owner_of(request: Request) -> str:
        owner = await _owner(request)
        request.scope.setdefault("state", {})["owner"] = owner  # for the access log
        return owner

    async def _owner(request: Request) -> str:
        if authorize is None:
            return KEYLESS_OWNER
        result = authorize(request)
        owner = await result if inspect.isawaitable(result) else result
        if owner:
            return str(owner)
        if request_api_key(request) is None and request.client is not None and networks:
            try:
                addr = ipaddress.ip_address(request.client.host)
            except ValueError:
                addr = None
            if addr is not None and any(addr in n for n in networks):
                return KEYLESS_OWNER
        raise AuthenticationError(
            "missing or invalid API key (send Authorization: Bearer, or use /k/{key}/run_code)"
        )

    async def body_json(request: Request) -> Any:
        try:
            size = int(request.headers.get("content-length") or 0)
        except ValueError:
            raise InvalidRequest("the Content-Length header is not a number") from None
        if size > max_body_bytes:
            raise PayloadTooLarge(f"request body is {size} bytes; at most {max_body_bytes}")
        raw = await request.body()
        if len(raw) > max_body_bytes:
            raise PayloadTooLarge(f"request body is larger than {max_body_bytes} bytes")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise InvalidRequest(f"request body is not JSON: {e}") from None
        except RecursionError:
            raise InvalidRequest(
                "request body is not acceptable JSON: it is nested too deeply"
            ) from None

    async def sandboxfusion(request: Request) -> Response:
        try:
            owner = await owner_of(request)
            data = await body_json(request)
        except DsecError as e:
            return _error(e)
        try:
            req = RunCodeRequest.model_validate(data)
        except ValidationError as e:
            msg = "; ".join(
                f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors()[:8]
            )
            return _json(
                RunCodeResponse(status=RunStatus.SandboxError, message=f"invalid request: {msg}")
            )
        runner = get_service()
        try:
            if isinstance(runner, CodeRuns):
                resp = await runner.run_code_sandboxfusion(req, owner)
            else:
                resp = await runner.run_code(req)
        except DsecError as e:  # refused by the key's quota or the node: not an answer
            return _error(e)
        return _json(resp)

    router.add_api_route(
        "/run_code",
        sandboxfusion,
        methods=["POST"],
        response_model=RunCodeResponse,
        summary="Run code (SandboxFusion-compatible)",
        openapi_extra={"requestBody": _body_schema(RunCodeRequest)},
        responses=RUN_CODE_ERRORS,
        route_class_override=LeanRoute,
    )
    router.add_api_route(
        "/k/{api_key}/run_code",
        sandboxfusion,
        methods=["POST"],
        response_model=RunCodeResponse,
        summary="Run code (SandboxFusion-compatible, API key in the path)",
        openapi_extra={
            "requestBody": _body_schema(RunCodeRequest),
            "parameters": [
                {
                    "name": "api_key",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                    "description": "a dsec API key (never logged nor echoed)",
                }
            ],
        },
        responses=RUN_CODE_ERRORS,
        route_class_override=LeanRoute,
    )

    async def native(request: Request) -> Response:
        try:
            owner = await owner_of(request)
            data = await body_json(request)
            try:
                req = CodeRunRequest.model_validate(data)
            except ValidationError as e:
                # without the inputs: they may be megabytes (a file's base64) or deeply nested
                errors = json.loads(e.json(include_url=False, include_input=False))[:16]
                raise InvalidRequest("invalid run_code request", errors=errors) from None
            runner = get_service()
            if isinstance(runner, CodeRuns):
                result = await runner.run_code(req, owner)
            else:
                result = await runner.run(req)
        except DsecError as e:
            return _error(e)
        except Exception as e:
            log.exception("run_code failed")
            return _error(InternalError(f"{type(e).__name__}"))
        return _json(result)

    router.add_api_route(
        "/v1/run_code",
        native,
        methods=["POST"],
        response_model=CodeRunResult,
        summary="Run code in a fresh fncall worker",
        openapi_extra={"requestBody": _body_schema(CodeRunRequest)},
        responses=ERROR_RESPONSES,
        route_class_override=LeanRoute,
    )
    if get_jupyter is None:
        return router

    async def jupyter(request: Request) -> Response:
        try:
            owner = await owner_of(request)
            data = await body_json(request)
        except DsecError as e:
            return _error(e)
        try:
            req = RunJupyterRequest.model_validate(data)
        except ValidationError as e:
            msg = "; ".join(
                f"{'.'.join(map(str, er['loc']))}: {er['msg']}" for er in e.errors()[:8]
            )
            return _json(
                RunJupyterResponse(status=RunStatus.SandboxError, message=f"invalid request: {msg}")
            )
        return _json(await get_jupyter().run_jupyter(req, owner))

    for path, summary in (
        ("/run_jupyter", "Run cells on a Jupyter kernel (SandboxFusion-compatible)"),
        ("/k/{api_key}/run_jupyter", "Run cells on a Jupyter kernel (API key in the path)"),
    ):
        extra: dict[str, Any] = {"requestBody": _body_schema(RunJupyterRequest)}
        if "{api_key}" in path:
            extra["parameters"] = [
                {
                    "name": "api_key",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string"},
                    "description": "a dsec API key (never logged nor echoed)",
                }
            ]
        router.add_api_route(
            path,
            jupyter,
            methods=["POST"],
            response_model=RunJupyterResponse,
            summary=summary,
            openapi_extra=extra,
            responses=SANDBOXFUSION_ERRORS,
            route_class_override=LeanRoute,
        )
    return router


def _body_schema(model: type[Any]) -> dict[str, Any]:
    return {
        "required": True,
        "content": {"application/json": {"schema": model.model_json_schema()}},
    }
