"""``/v1/sandboxes``: lifecycle, exec, files, pause/resume, snapshots, fork, trajectory,
network policy.

Routes only parse; the edge acts. Every state-changing route (exec, exec/stream, file
PUT/DELETE, mkdir, rename, tar PUT, snapshot) reads two optional headers and hands them
to the edge's ``seq``/``idem_key`` keywords:

* ``X-Dsec-Seq``: the per-sandbox trajectory sequence number (integer >= 1; anything
  else is a 400 ``invalid_request`` and nothing reaches the edge);
* ``Idempotency-Key``: 1..256 printable ASCII characters.

A repeat of a recorded call is answered from the trajectory log without running anything;
an exec's answer then carries ``X-Dsec-Replayed: 1`` (and ``replayed: true`` in the body;
``POST .../exec`` is a route of the verb table, :mod:`dsec.apiserver.verbs`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, Seq, current_owner
from dsec.apiserver.schemas import (
    SANDBOX_ID_PATTERN,
    SANDBOX_PATH_PATTERN,
    TarUploadResult,
)
from dsec.errors import (
    DsecError,
    InternalError,
    SandboxStopped,
)
from dsec.models import (
    ExecEvent,
    ExecRequest,
    FileInfo,
    LogLine,
    SandboxExecRequest,
    SandboxRef,
)

__all__ = ["UPLOAD_ROUTES", "ndjson_response", "router"]

log = logging.getLogger("dsec.apiserver")

router = APIRouter(
    prefix="/v1/sandboxes",
    tags=["sandboxes"],
    dependencies=[Depends(current_owner)],
    responses=ERROR_RESPONSES,
)

SandboxIdParam = Annotated[str, Path(pattern=SANDBOX_ID_PATTERN, description="sb-<node>-<random>")]
PathQuery = Annotated[
    str,
    Query(pattern=SANDBOX_PATH_PATTERN, description="absolute path inside the sandbox"),
]
ModeQuery = Annotated[
    str,
    Query(pattern=r"^(0o)?[0-7]{1,4}$", description="permission bits in octal, e.g. 644"),
]

_BINARY = {"schema": {"type": "string", "format": "binary"}}

UPLOAD_ROUTES = frozenset(
    {"/v1/sandboxes/{sandbox_id}/files", "/v1/sandboxes/{sandbox_id}/files/tar"}
)
"""Route templates whose body is a raw upload (the larger body limit applies)."""


def ndjson_of(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI media entry of an NDJSON body: no ``schema`` (the whole body, possibly
    empty or many lines, is not one JSON value); each line is one ``model``, whose schema is
    under ``x-line-schema``."""
    return {
        "x-line-schema": model.model_json_schema(ref_template="#/components/schemas/{model}"),
    }


def _event_line(event: ExecEvent) -> bytes:
    return event.model_dump_json(exclude_none=True).encode() + b"\n"


@router.post(
    "/{sandbox_id}/exec/stream",
    summary="Run a command, streaming its output",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "NDJSON: ExecEvent lines (stdout/stderr chunks, then one exit or error)",
            "content": {
                "application/x-ndjson": ndjson_of(ExecEvent),
            },
        }
    },
)
async def exec_stream(
    request: Request,
    sandbox_id: SandboxIdParam,
    req: ExecRequest,
    edge: Edge,
    owner: Owner,
    s: Seq,
) -> StreamingResponse:
    run = SandboxExecRequest.of(sandbox_id, req)
    # Errors knowable before the first byte get a proper HTTP status.
    info = await edge.get_sandbox(SandboxRef(sandbox_id=sandbox_id), owner)
    if info.state == "stopped":
        raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
    metrics = request.app.state.metrics
    request_id = request.scope.get("state", {}).get("request_id", "")

    async def body() -> AsyncIterator[bytes]:
        ended = False
        try:
            events = edge.exec_stream(run, owner, s)
            async for event in events:
                yield _event_line(event)
                if event.type in ("exit", "error"):
                    ended = True
                    break
            if not ended:
                raise InternalError("the edge ended the stream without an exit event")
        except DsecError as err:
            metrics.error(err.code)
            yield _event_line(ExecEvent(type="error", error=err.to_wire()["error"]))
        except Exception:
            log.exception("exec stream failed (request %s)", request_id)
            bug = InternalError(f"internal error; request id {request_id}", request_id=request_id)
            metrics.error(bug.code)
            yield _event_line(ExecEvent(type="error", error=bug.to_wire()["error"]))

    return StreamingResponse(
        body(), media_type="application/x-ndjson", headers={"cache-control": "no-store"}
    )


# --- files -------------------------------------------------------------------
@router.get(
    "/{sandbox_id}/files",
    response_class=Response,
    summary="Read a file",
    responses={200: {"content": {"application/octet-stream": _BINARY}}},
)
async def read_file(
    sandbox_id: SandboxIdParam, path: PathQuery, edge: Edge, owner: Owner
) -> Response:
    data = await edge.read_file(sandbox_id, owner, path)
    return Response(content=data, media_type="application/octet-stream")


@router.put(
    "/{sandbox_id}/files",
    response_model=FileInfo,
    summary="Write a file (raw body)",
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/octet-stream": _BINARY}}
    },
)
async def write_file(
    request: Request,
    sandbox_id: SandboxIdParam,
    path: PathQuery,
    edge: Edge,
    owner: Owner,
    s: Seq,
    mode: ModeQuery = "644",
) -> FileInfo:
    mode_bits = int(mode.removeprefix("0o"), 8)
    data = await request.body()
    return await edge.write_file(sandbox_id, owner, path, data, mode_bits, env=s)


@router.put(
    "/{sandbox_id}/files/tar",
    response_model=TarUploadResult,
    summary="Unpack a tar archive under a directory",
    openapi_extra={"requestBody": {"required": True, "content": {"application/x-tar": _BINARY}}},
)
async def upload_tar(
    request: Request,
    sandbox_id: SandboxIdParam,
    path: PathQuery,
    edge: Edge,
    owner: Owner,
    s: Seq,
) -> TarUploadResult:
    data = await request.body()
    files = await edge.upload_tar(sandbox_id, owner, path, data, env=s)
    return TarUploadResult(files=files)


@router.get(
    "/{sandbox_id}/files/tar",
    response_class=Response,
    summary="Download a path as a tar archive",
    responses={200: {"content": {"application/x-tar": _BINARY}}},
)
async def download_tar(
    sandbox_id: SandboxIdParam, path: PathQuery, edge: Edge, owner: Owner
) -> Response:
    data = await edge.download_tar(sandbox_id, owner, path)
    return Response(content=data, media_type="application/x-tar")


# --- RL lifecycle: pause, resume, snapshot, fork, trajectory ---------------------
@router.get(
    "/{sandbox_id}/logs",
    response_class=StreamingResponse,
    summary="The output of the sandbox's start command",
    responses={
        200: {
            "description": "NDJSON: LogLine objects (ts, stream, data) in order; with "
            "follow=true the response stays open until the start command ends",
            "content": {
                "application/x-ndjson": ndjson_of(LogLine),
            },
        }
    },
)
async def sandbox_logs(
    sandbox_id: SandboxIdParam,
    edge: Edge,
    owner: Owner,
    follow: Annotated[bool, Query(description="keep streaming new output")] = False,
) -> StreamingResponse:
    """What the image's start command wrote (stdout and stderr as they came, the oldest
    dropped past the node's limit), and one ``dsec`` line once it ended. Empty for a
    sandbox whose image has no start command. A stopped sandbox: 409 ``sandbox_stopped``."""
    info = await edge.get_sandbox(SandboxRef(sandbox_id=sandbox_id), owner)
    if info.state == "stopped":
        raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
    return ndjson_response(edge.sandbox_logs(sandbox_id, owner, follow=follow))


def ndjson_response(items: AsyncGenerator[BaseModel, None]) -> StreamingResponse:
    """An NDJSON response of ``items`` (one model per line), ended quietly when the sandbox
    goes away while they are followed; the generator is closed with the response."""

    async def body() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(items):
            try:
                async for item in items:
                    yield item.model_dump_json().encode() + b"\n"
            except DsecError:  # the sandbox went away while followed
                return

    return StreamingResponse(
        body(), media_type="application/x-ndjson", headers={"cache-control": "no-store"}
    )


@router.get(
    "/{sandbox_id}/trajectory",
    response_class=Response,
    summary="Export the trajectory log (JSONL)",
    responses={
        200: {
            "description": "NDJSON: one header line, then one entry per state-changing call "
            "in seq order (request, result, timings, exit codes, digests of large values)",
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
        }
    },
)
async def export_trajectory(sandbox_id: SandboxIdParam, edge: Edge, owner: Owner) -> Response:
    text = await edge.export_trajectory(sandbox_id, owner)
    return Response(
        content=text.encode(),
        media_type="application/x-ndjson",
        headers={"cache-control": "no-store"},
    )
