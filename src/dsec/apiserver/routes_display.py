"""``/v1/sandboxes/{sandbox_id}/display``: the screens of a sandbox, for computer-use agents
(vocabulary and semantics: :mod:`dsec.display`).

Queries:

* ``GET  .../display`` -> :class:`~dsec.display.DisplayState` (screen size, pointer);
* ``GET  .../display/screenshot`` -> ``image/png`` (``?pointer=true`` draws the pointer);
* ``GET  .../display/windows`` -> ``[WindowInfo]`` (the desktop's windows).

Actions (``POST``, a JSON body of the action's fields, 204): ``move`` ``{x, y}``, ``click``
``{x?, y?, button, double}``, ``drag`` ``{from_x, from_y, to_x, to_y, button}``, ``scroll``
``{direction, amount, x?, y?}``, ``button`` ``{button, down}``, ``type`` ``{text,
delay_ms}``, ``key`` ``{name}`` (``enter``, ``ctrl+c``, ``alt-f4``), ``open`` ``{target}``,
``launch`` ``{app, args}``.

``POST .../display/restart`` starts a dead desktop again (answers its new state).

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
from dsec.display import (
    Button,
    Click,
    DisplayAction,
    Drag,
    Key,
    Launch,
    Move,
    Open,
    Screen,
    Scroll,
    Type,
)
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


async def _act(
    edge: DisplayEdge, sandbox_id: str, owner: str, action: DisplayAction, screen: Screen
) -> Response:
    await edge.display_act(sandbox_id, owner, action, screen)
    return Response(status_code=204)


@router.post("/move", status_code=204, summary="Move the pointer")
async def move(
    sandbox_id: SandboxIdParam,
    req: Move,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/click", status_code=204, summary="Click (at a pixel, or where the pointer is)")
async def click(
    sandbox_id: SandboxIdParam,
    req: Click,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/drag", status_code=204, summary="Drag with a button held")
async def drag(
    sandbox_id: SandboxIdParam,
    req: Drag,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/scroll", status_code=204, summary="Turn the mouse wheel")
async def scroll(
    sandbox_id: SandboxIdParam,
    req: Scroll,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/button", status_code=204, summary="Press or release a mouse button")
async def button(
    sandbox_id: SandboxIdParam,
    req: Button,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/type", status_code=204, summary="Type text on the keyboard")
async def type_text(
    sandbox_id: SandboxIdParam,
    req: Type,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/key", status_code=204, summary="Press a key or a chord (ctrl+c)")
async def key(
    sandbox_id: SandboxIdParam,
    req: Key,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/open", status_code=204, summary="Open a URL or a file with its application")
async def open_target(
    sandbox_id: SandboxIdParam,
    req: Open,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)


@router.post("/launch", status_code=204, summary="Start an application")
async def launch(
    sandbox_id: SandboxIdParam,
    req: Launch,
    edge: DisplayEdgeDep,
    owner: Owner,
    screen: ScreenParam = "auto",
) -> Response:
    return await _act(edge, sandbox_id, owner, req, screen)
