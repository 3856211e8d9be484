"""``GET /v1/sandboxes/{sandbox_id}/display/screenshot``: a sandbox's screen as a PNG
image (``?pointer=true`` draws the pointer; vocabulary and semantics: :mod:`dsec.display`).

The display's other routes come from the verb table (:data:`dsec.contract.edge.VERBS`):

* ``GET  .../display`` -> :class:`~dsec.display.DisplayState` (screen size, pointer);
* ``GET  .../display/windows`` -> ``[WindowInfo]`` (the desktop's windows);
* ``POST .../display/restart`` starts a dead desktop again (answers its new state);
* the actions (``display_act``, a row per kind; ``POST``, a JSON body of the action's
  fields, 204): ``move`` ``{x, y}``, ``click`` ``{x?, y?, button, double}``, ``drag``
  ``{from_x, from_y, to_x, to_y, button}``, ``scroll`` ``{direction, amount, x?, y?}``,
  ``button`` ``{button, down}``, ``type`` ``{text, delay_ms}``, ``key`` ``{name}``
  (``enter``, ``ctrl+c``, ``alt-f4``), ``open`` ``{target}``, ``launch`` ``{app, args}``.

Every route but ``windows`` and ``restart`` takes ``?screen=auto|desktop|console``. Routes only
parse; the edge acts through :class:`DisplayEdge`. A sandbox without the screen asked for
answers 422 ``capability_not_supported`` (naming its image and tier); a point off the screen
400 with ``width``/``height`` in the details; a desktop whose X server is gone 409
``display_not_running``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from dsec.apiserver.deps import ERROR_RESPONSES, Owner, current_owner
from dsec.apiserver.schemas import SANDBOX_ID_PATTERN
from dsec.contract.edge import DisplayEdge
from dsec.display import Screen
from dsec.errors import CapabilityNotSupported

__all__ = ["DisplayEdge", "router"]

router = APIRouter(
    prefix="/v1/sandboxes/{sandbox_id}/display",
    tags=["display"],
    dependencies=[Depends(current_owner)],
    responses=ERROR_RESPONSES,
)

SandboxIdParam = Annotated[str, Path(pattern=SANDBOX_ID_PATTERN, description="sb-<node>-<random>")]
ScreenParam = Annotated[
    Screen,
    Query(description="desktop (a desktop image's), console (the tier's), auto: desktop first"),
]


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
async def screenshot(
    sandbox_id: SandboxIdParam,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
    pointer: Annotated[bool, Query(description="draw the mouse pointer (desktop)")] = False,
) -> Response:
    data = await edge.display_screenshot(sandbox_id, owner, screen, pointer)
    return Response(content=data, media_type="image/png", headers={"cache-control": "no-store"})
