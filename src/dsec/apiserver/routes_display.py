"""``/v1/sandboxes/{sandbox_id}/display``: the screen and input devices of a sandbox that has
a display (the ``vm`` tier; ``capabilities.display``), for computer-use agents.

* ``GET  .../display/screenshot`` -> ``image/png`` (the guest screen as QEMU renders it);
* ``POST .../display/click`` ``{"x", "y", "button"}`` -> 204 (pixel coordinates of the
  screenshot; the absolute pointer moves there and clicks);
* ``POST .../display/type`` ``{"text"}`` -> 204 (US keyboard layout, ``\\n`` is Enter);
* ``POST .../display/key`` ``{"name"}`` -> 204 (``enter``, ``esc``, ``ctrl-c``, ``alt-f4``...).

Routes only parse; the edge acts through :class:`DisplayEdge`. A sandbox of a tier without a
display answers 422 ``capability_not_supported``; a bad coordinate or key name 400.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from dsec.apiserver.deps import ERROR_RESPONSES, Owner, current_owner
from dsec.apiserver.schemas import SANDBOX_ID_PATTERN
from dsec.edge.interface import DisplayEdge
from dsec.errors import CapabilityNotSupported

__all__ = ["ClickRequest", "DisplayEdge", "KeyRequest", "TypeRequest", "router"]

MAX_TYPE_CHARS = 10_000
"""Longest text one ``type`` call sends (characters)."""


class ClickRequest(BaseModel):
    """A click at pixel (x, y) of the screenshot; (0, 0) is the top left corner."""

    model_config = ConfigDict(extra="forbid")

    x: int = Field(ge=0, le=16384, description="pixels from the left edge")
    y: int = Field(ge=0, le=16384, description="pixels from the top edge")
    button: Literal["left", "right", "middle"] = "left"


class TypeRequest(BaseModel):
    """Text to type on a US keyboard layout (``\\n`` presses Enter, ``\\t`` Tab)."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, max_length=MAX_TYPE_CHARS)


class KeyRequest(BaseModel):
    """A key or a chord joined by ``-``: ``enter``, ``esc``, ``f1``, ``ctrl-c``, ``ctrl-alt-delete``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_]+(-[A-Za-z0-9_]+)*$", max_length=64)


router = APIRouter(
    prefix="/v1/sandboxes/{sandbox_id}/display",
    tags=["display"],
    dependencies=[Depends(current_owner)],
    responses=ERROR_RESPONSES,
)

SandboxIdParam = Annotated[str, Path(pattern=SANDBOX_ID_PATTERN, description="sb-<node>-<random>")]


async def display_edge(request: Request) -> DisplayEdge:
    """The app's edge, if it implements :class:`DisplayEdge`."""
    edge = request.app.state.edge
    if not isinstance(edge, DisplayEdge):
        raise CapabilityNotSupported("this server's edge has no display support")
    return edge


DisplayEdgeDep = Annotated[DisplayEdge, Depends(display_edge)]


@router.get(
    "/screenshot",
    response_class=Response,
    summary="The sandbox's screen as a PNG image",
    responses={200: {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}}},
)
async def screenshot(sandbox_id: SandboxIdParam, edge: DisplayEdgeDep, owner: Owner) -> Response:
    data = await edge.display_screenshot(sandbox_id, owner)
    return Response(content=data, media_type="image/png", headers={"cache-control": "no-store"})


@router.post("/click", status_code=204, summary="Click at a pixel of the screen")
async def click(
    sandbox_id: SandboxIdParam, req: ClickRequest, edge: DisplayEdgeDep, owner: Owner
) -> Response:
    await edge.display_click(sandbox_id, owner, req.x, req.y, req.button)
    return Response(status_code=204)


@router.post("/type", status_code=204, summary="Type text on the keyboard")
async def type_text(
    sandbox_id: SandboxIdParam, req: TypeRequest, edge: DisplayEdgeDep, owner: Owner
) -> Response:
    await edge.display_type(sandbox_id, owner, req.text)
    return Response(status_code=204)


@router.post("/key", status_code=204, summary="Press a key or a chord (ctrl-c)")
async def key(
    sandbox_id: SandboxIdParam, req: KeyRequest, edge: DisplayEdgeDep, owner: Owner
) -> Response:
    await edge.display_key(sandbox_id, owner, req.name)
    return Response(status_code=204)
