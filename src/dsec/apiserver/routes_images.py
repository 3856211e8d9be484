"""``/v1/images``, ``/v1/layers`` (``/v1/node`` and ``/v1/capabilities``: the verb table)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

from dsec.apiserver.auth import KeyVerifier
from dsec.apiserver.deps import ERROR_RESPONSES, Edge, Owner, current_owner
from dsec.apiserver.schemas import (
    IMAGE_NAME_PATTERN,
    IMAGE_REF_PATTERN,
    ImageList,
    LayerList,
)
from dsec.builds.records import BuildList, BuildRecord
from dsec.contract.edge import ImageBuilds, ImagePublisher
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InternalError,
    InvalidRequest,
    PermissionDenied,
    Unsupported,
)
from dsec.models import (
    SYSTEM_OWNER,
    BuildImageRequest,
    ImageInfo,
    LayerKind,
    PullImageRequest,
    PushImageRequest,
    PushImageResult,
    UpdateImageRequest,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(current_owner)], responses=ERROR_RESPONSES)

ImageName = Annotated[
    str,
    Path(
        pattern=IMAGE_REF_PATTERN,
        description="name[:tag], sha256:<hex>, or a pulled reference (host:port/repo:tag)",
    ),
]
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TAR_TYPES = (
    "application/x-tar",
    "application/gzip",
    "application/x-gzip",
    "application/octet-stream",
)


def _as(request: Request, owner: str, system: bool, what: str) -> str:
    """The owner an image operation acts as: the caller, or the system for ``system=true``,
    which only the operator's key may ask for (``PermissionDenied`` for any other key)."""
    if not system:
        return owner
    keys: KeyVerifier = request.app.state.keys
    if not keys.is_operator(owner):
        raise PermissionDenied(
            f"only the operator's key may {what} system images (they are read-only to keys)"
        )
    return SYSTEM_OWNER


@router.get("/images", response_model=ImageList, tags=["images"], summary="List images")
async def list_images(edge: Edge, owner: Owner) -> ImageList:
    """This key's images and the system's (built-in images not built yet show their build
    status); other keys' images are never listed."""
    return ImageList(images=await edge.list_images(owner))


@router.get(
    "/images/{name:path}", response_model=ImageInfo, tags=["images"], summary="Describe an image"
)
async def get_image(name: ImageName, edge: Edge, owner: Owner) -> ImageInfo:
    return await edge.get_image(name, owner)


@router.delete(
    "/images/{name:path}",
    status_code=204,
    response_class=Response,
    tags=["images"],
    summary="Forget one of this key's images (its layers stay while sandboxes use them)",
)
async def delete_image(
    request: Request,
    name: ImageName,
    edge: Edge,
    owner: Owner,
    system: Annotated[bool, Query(description="a system image (operator only)")] = False,
) -> Response:
    await edge.delete_image(name, _as(request, owner, system, "remove"))
    return Response(status_code=204)


@router.patch(
    "/images/{name:path}",
    response_model=ImageInfo,
    tags=["images"],
    summary="Share one of this key's images with every key (as <owner>/<name>), or stop",
)
async def update_image(
    name: ImageName, req: UpdateImageRequest, edge: Edge, owner: Owner
) -> ImageInfo:
    return await edge.share_image(name, owner, req.shared)


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
    as_owner = _as(request, owner, system, "publish")
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


BuildIdParam = Annotated[
    str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
]


@router.get(
    "/builds",
    response_model=BuildList,
    tags=["images"],
    summary="This key's image builds, newest first (running ones included)",
)
async def list_builds(edge: Edge, owner: Owner) -> BuildList:
    """State, step, cache hits and the image made or the error, of this key's recent
    builds (``dsec.builds.records``: bounded per key, kept by the server process)."""
    if not isinstance(edge, ImageBuilds):
        raise CapabilityNotSupported("this server does not build images")
    return edge.list_builds(owner)


@router.get(
    "/builds/{build_id}",
    response_model=BuildRecord,
    tags=["images"],
    summary="One build of this key, with its log",
)
async def get_build(build_id: BuildIdParam, edge: Edge, owner: Owner) -> BuildRecord:
    if not isinstance(edge, ImageBuilds):
        raise CapabilityNotSupported("this server does not build images")
    return edge.get_build(build_id, owner)


@router.post(
    "/images/pull",
    response_model=ImageInfo,
    status_code=201,
    tags=["images"],
    summary="Pull an image from an OCI / Docker v2 registry",
)
async def pull_image(
    request: Request, req: PullImageRequest, edge: Edge, owner: Owner
) -> ImageInfo:
    as_owner = _as(request, owner, req.system, "publish")
    if req.lazy:
        if not isinstance(edge, ImagePublisher):
            raise Unsupported("this server's edge cannot attach images lazily")
        return await edge.attach_image(req.ref, req.name, True, as_owner)
    return await edge.pull_image(req.ref, as_owner, req.name)


@router.post(
    "/images/{name:path}/push",
    response_model=PushImageResult,
    tags=["images"],
    summary="Publish an image's EROFS layers to an OCI registry",
)
async def push_image(
    name: ImageName, req: PushImageRequest, edge: Edge, owner: Owner
) -> PushImageResult:
    if not isinstance(edge, ImagePublisher):
        raise Unsupported("this server's edge cannot push images")
    return await edge.push_image(name, req.target, owner)


@router.get("/layers", response_model=LayerList, tags=["images"], summary="List layers")
async def list_layers(edge: Edge, owner: Owner) -> LayerList:
    """The layers this key may name by digest: those of its images, snapshots and builds,
    and the system's."""
    return LayerList(layers=await edge.list_layers(owner))
