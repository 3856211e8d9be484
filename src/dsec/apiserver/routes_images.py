"""``/v1/images``, ``/v1/layers``, ``/v1/node``, ``/v1/capabilities``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path

from dsec.apiserver.deps import ERROR_RESPONSES, Edge, current_owner
from dsec.apiserver.schemas import IMAGE_REF_PATTERN, CapabilityList, ImageList, LayerList
from dsec.edge.interface import ImagePublisher
from dsec.errors import Unsupported
from dsec.models import (
    BuildImageRequest,
    ImageInfo,
    NodeInfo,
    PullImageRequest,
    PushImageRequest,
    PushImageResult,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1", dependencies=[Depends(current_owner)], responses=ERROR_RESPONSES)


@router.get("/images", response_model=ImageList, tags=["images"], summary="List images")
async def list_images(edge: Edge) -> ImageList:
    return ImageList(images=await edge.list_images())


@router.get(
    "/images/{name}", response_model=ImageInfo, tags=["images"], summary="Describe an image"
)
async def get_image(
    name: Annotated[str, Path(pattern=IMAGE_REF_PATTERN, description="name[:tag] or sha256:<hex>")],
    edge: Edge,
) -> ImageInfo:
    return await edge.get_image(name)


@router.post(
    "/images/build",
    status_code=201,
    response_model=ImageInfo,
    tags=["images"],
    summary="Build an image from a directory or tarball on the server",
)
async def build_image(req: BuildImageRequest, edge: Edge) -> ImageInfo:
    return await edge.build_image(req.path, req.name, req.kind, req.base)


@router.post(
    "/images/pull",
    response_model=ImageInfo,
    status_code=201,
    tags=["images"],
    summary="Pull an image from an OCI / Docker v2 registry",
)
async def pull_image(req: PullImageRequest, edge: Edge) -> ImageInfo:
    if req.lazy:
        if not isinstance(edge, ImagePublisher):
            raise Unsupported("this server's edge cannot attach images lazily")
        return await edge.attach_image(req.ref, req.name, lazy=True)
    return await edge.pull_image(req.ref, req.name)


@router.post(
    "/images/{name}/push",
    response_model=PushImageResult,
    tags=["images"],
    summary="Publish an image's EROFS layers to an OCI registry",
)
async def push_image(
    name: Annotated[str, Path(pattern=IMAGE_REF_PATTERN, description="name[:tag] or sha256:<hex>")],
    req: PushImageRequest,
    edge: Edge,
) -> PushImageResult:
    if not isinstance(edge, ImagePublisher):
        raise Unsupported("this server's edge cannot push images")
    return await edge.push_image(name, req.target)


@router.get("/layers", response_model=LayerList, tags=["images"], summary="List layers")
async def list_layers(edge: Edge) -> LayerList:
    return LayerList(layers=await edge.list_layers())


@router.get("/node", response_model=NodeInfo, tags=["node"], summary="Describe this node")
async def node_info(edge: Edge) -> NodeInfo:
    return await edge.node_info()


@router.get(
    "/capabilities", response_model=CapabilityList, tags=["node"], summary="What each tier can do"
)
async def capabilities(edge: Edge) -> CapabilityList:
    return CapabilityList(tiers=await edge.capabilities())
