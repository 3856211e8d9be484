"""``/v1/images``, ``/v1/layers`` (``/v1/node`` and ``/v1/capabilities``: the verb table)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, acting_owner, current_owner
from dsec.apiserver.schemas import (
    IMAGE_NAME_PATTERN,
    IMAGE_REF_PATTERN,
)
from dsec.contract.edge import ImageBuilds
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InternalError,
    InvalidRequest,
)
from dsec.models import (
    BuildImageRequest,
    ImageInfo,
    LayerKind,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(current_owner)], responses=ERROR_RESPONSES)

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TAR_TYPES = (
    "application/x-tar",
    "application/gzip",
    "application/x-gzip",
    "application/octet-stream",
)


async def _context_is_a_tar(request: Request) -> None:
    """Refuse a build request whose body is not an archive, before its parameters are read
    (an old client sending ``{"path": ...}`` learns why)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "application/json":
        raise InvalidRequest(
            "builds take an uploaded build context, not a server path: send the context as "
            "a tar archive (Content-Type: application/x-tar) with name, kind and base as "
            "query parameters (`dsec image build PATH` does this)"
        )
    if content_type and content_type not in _TAR_TYPES:
        raise InvalidRequest(f"the build context must be a tar archive, not {content_type}")


@router.post(
    "/images/build",
    status_code=201,
    response_model=ImageInfo,
    tags=["images"],
    summary="Build an image from an uploaded build context (a tar archive)",
    dependencies=[Depends(_context_is_a_tar)],
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {t: _BINARY for t in ("application/x-tar", "application/gzip")},
        }
    },
)
async def build_image(
    request: Request,
    edge: Edge,
    owner: Owner,
    name: Annotated[str, Query(pattern=IMAGE_NAME_PATTERN, description="image name[:tag]")],
    kind: Annotated[LayerKind, Query(description="kind of the new layer")] = "workspace",
    base: Annotated[
        str | None, Query(pattern=IMAGE_REF_PATTERN, description="image to stack on")
    ] = None,
    system: Annotated[
        bool, Query(description="publish as a system image (the operator's key only)")
    ] = False,
) -> ImageInfo:
    """The body is the build context: a tar archive (plain, gzip, bzip2 or xz), whose files
    become the new layer. The server never reads a path of its own: ``dsec image build
    PATH`` packs PATH on the client and uploads it. The image belongs to this key."""
    req = BuildImageRequest(name=name, kind=kind, base=base, system=system)
    as_owner = acting_owner(request, owner, system, "publish")
    context = await request.body()
    if not context:
        raise InvalidRequest("the build context (request body) is empty")
    return await edge.build_image(as_owner, req, context)


@router.post(
    "/builds",
    tags=["images"],
    summary="Build an image from steps or a Dockerfile, streaming its progress",
    response_class=StreamingResponse,
    dependencies=[Depends(_context_is_a_tar)],
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "a tar archive: first member `request.json` (the build request: "
            "a name and steps or a Dockerfile), then the build context's files",
            "content": {"application/x-tar": _BINARY},
        }
    },
    responses={
        200: {
            "description": "NDJSON: build events (start, step, cached, output, step_done, "
            "then one done or error)",
            "content": {"application/x-ndjson": {}},
        }
    },
)
async def build(request: Request, edge: Edge, owner: Owner) -> StreamingResponse:
    """Refusals known before anything runs (a malformed Dockerfile line, a missing copy
    source, an unknown base, a system image's name, a context over the limit) are plain
    HTTP errors; after that, a failing step is the stream's ``error`` event (its step and
    output tail) and no image is made. The image belongs to this key. Closing the
    connection stops the build (its sandboxes are killed)."""
    if not isinstance(edge, ImageBuilds):
        raise CapabilityNotSupported("this server does not build images")
    from dsec.builds.wire import BuildError, decode_build_upload

    req, context = decode_build_upload(await request.body())
    events = edge.build(owner, req, context)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise InternalError("the build ended before it started") from None

    async def body() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            yield first.model_dump_json().encode() + b"\n"
            try:
                async for event in events:
                    yield event.model_dump_json().encode() + b"\n"
            except DsecError as e:  # e.g. the building node was lost
                wire = e.to_wire()["error"]
                err = BuildError(code=e.code, message=wire["message"], details=wire["details"])
                yield err.model_dump_json().encode() + b"\n"

    return StreamingResponse(
        body(), media_type="application/x-ndjson", headers={"cache-control": "no-store"}
    )
