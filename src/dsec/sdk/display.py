"""``sb.display``: the screen, keyboard and pointer of a sandbox with a display (``vm`` tier).

Example (a computer-use loop)::

    from dsec import Sandbox

    with Sandbox.create(tier="vm", image="debian") as sb:
        png = sb.display.screenshot()          # PNG bytes of the guest screen
        sb.display.type("echo hello\\n")        # US layout; "\\n" presses Enter
        sb.display.key("ctrl-c")
        sb.display.click(100, 200)              # pixel coordinates of the screenshot

A sandbox whose tier has no display raises ``CapabilityNotSupported``
(``sb.info`` / ``capabilities().display`` says which tiers have one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from dsec.sdk.sandbox import AsyncSandbox

__all__ = ["AsyncDisplay", "MouseButton"]

MouseButton = Literal["left", "right", "middle"]


class AsyncDisplay:
    """The display of one sandbox: ``sb.display``. Every call resumes a paused sandbox."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self._sandbox = sandbox

    def _path(self, action: str) -> str:
        return self._sandbox._path(f"/display/{action}")

    async def screenshot(self) -> bytes:
        """The screen as PNG bytes (QEMU renders the guest's display; 720x400 for the text
        console, the guest's resolution for a graphical one)."""
        r = await self._sandbox._client._http.request("GET", self._path("screenshot"))
        return r.content

    async def click(self, x: int, y: int, button: MouseButton = "left") -> None:
        """Move the pointer to pixel (``x``, ``y``) of the screenshot (0, 0 = top left) and
        click ``button``. ``InvalidRequest`` if the point is off the screen."""
        await self._sandbox._client._http.request(
            "POST", self._path("click"), json={"x": x, "y": y, "button": button}
        )

    async def type(self, text: str) -> None:
        """Type ``text`` on the keyboard (US layout; ``\\n`` is Enter, ``\\t`` Tab; at most
        10,000 characters). ``InvalidRequest`` for a character the layout cannot type."""
        await self._sandbox._client._http.request("POST", self._path("type"), json={"text": text})

    async def key(self, name: str) -> None:
        """Press a key or a chord: ``"enter"``, ``"esc"``, ``"f1"``, ``"ctrl-c"``,
        ``"ctrl-alt-delete"`` (QEMU key names, plus common aliases). ``InvalidRequest`` for an
        unknown name."""
        await self._sandbox._client._http.request("POST", self._path("key"), json={"name": name})


def __getattr__(name: str) -> object:
    if name == "Display":  # the sync class lives with the other generated ones
        from dsec.sdk.sync_api import Display

        return Display
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
