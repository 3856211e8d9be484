"""``sb.display``: the screens of a sandbox, for computer-use agents (vocabulary and
semantics: :mod:`dsec.display`).

A sandbox of a desktop image (``image="desktop"``, on the container or the vm tier) has an X
desktop: the whole API works on it. A vm-tier sandbox also has its VGA console
(``screen="console"``: screenshot, pointer and keys, no windows or applications).

Example (a computer-use loop)::

    from dsec import Sandbox

    with Sandbox.create(image="desktop") as sb:
        sb.display.open("https://example.test/")   # Chromium
        png = sb.display.screenshot()              # PNG bytes, 1024x768
        sb.display.click(512, 300)                 # pixel coordinates of the screenshot
        sb.display.type("hello\\n")                 # "\\n" presses Enter
        sb.display.key("ctrl+l")
        print(sb.display.windows())                # [WindowInfo(id, title, wm_class, ...)]

Errors: a sandbox without the screen asked for raises ``CapabilityNotSupported`` (naming its
image); a point off the screen ``InvalidRequest`` (its ``details`` carry ``width`` and
``height``); a desktop whose X server died ``DisplayNotRunning`` until :meth:`restart`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dsec.display import DisplayState, MouseButton, Screen, WindowInfo
from dsec.models import DisplayActRequest, SandboxRef, ScreenRequest
from dsec.wire import validated

if TYPE_CHECKING:
    from dsec.sdk.sandbox import AsyncSandbox

__all__ = ["AsyncDisplay", "MouseButton"]


class AsyncDisplay:
    """The display of one sandbox: ``sb.display``. Every call resumes a paused sandbox.

    Args:
        sandbox: the sandbox.
        screen: which screen the calls drive: ``auto`` (the desktop if the image has one,
            else the tier's console), ``desktop`` or ``console``.
    """

    def __init__(self, sandbox: AsyncSandbox, screen: Screen = "auto") -> None:
        self._sandbox = sandbox
        self._screen = screen

    def on(self, screen: Screen) -> AsyncDisplay:
        """The same display API on ``screen`` (``sb.display.on("console").screenshot()``)."""
        return AsyncDisplay(self._sandbox, screen)

    def _path(self, action: str) -> str:
        return self._sandbox._path(f"/display/{action}" if action else "/display")

    def _params(self, **extra: Any) -> dict[str, Any]:
        params = {"screen": self._screen} if self._screen != "auto" else {}
        params.update({k: v for k, v in extra.items() if v is not None})
        return params

    async def _act(self, kind: str, **fields: Any) -> None:
        """Send one action of ``kind`` (its row ``display_<kind>``, :mod:`dsec.display`)."""
        sb = self._sandbox
        action = {"action": kind, **fields}
        req = validated(DisplayActRequest, sandbox_id=sb.id, screen=self._screen, action=action)
        await sb._client._http.call(f"display_{kind}", req)

    # --------------------------------------------------------------- queries
    async def screenshot(self, *, pointer: bool = False) -> bytes:
        """The screen as PNG bytes (a desktop: its X screen, 1024x768 by default;
        ``pointer`` draws the mouse pointer. The vm console: as QEMU renders it)."""
        params = self._params(pointer="true" if pointer else None)
        r = await self._sandbox._client._http.request(
            "GET", self._path("screenshot"), params=params
        )
        return r.content

    async def state(self) -> DisplayState:
        """The screen's size and where the pointer is."""
        sb = self._sandbox
        req = validated(ScreenRequest, sandbox_id=sb.id, screen=self._screen)
        state: DisplayState = await sb._client._http.call("display_state", req)
        return state

    async def screen_size(self) -> tuple[int, int]:
        """(width, height) of the screen, pixels."""
        s = await self.state()
        return s.width, s.height

    async def cursor_position(self) -> tuple[int, int] | None:
        """(x, y) of the pointer (None on a console no pointer action was sent to yet)."""
        s = await self.state()
        if s.cursor_x is None or s.cursor_y is None:
            return None
        return s.cursor_x, s.cursor_y

    async def windows(self) -> list[WindowInfo]:
        """The desktop's top-level windows (id, title, WM_CLASS, pid, geometry, focus)."""
        sb = self._sandbox
        req = validated(SandboxRef, sandbox_id=sb.id)
        windows: list[WindowInfo] = await sb._client._http.call("display_windows", req)
        return windows

    async def restart(self) -> DisplayState:
        """Start the desktop again (after its X server died); returns once it is ready."""
        sb = self._sandbox
        req = validated(SandboxRef, sandbox_id=sb.id)
        state: DisplayState = await sb._client._http.call("display_restart", req)
        return state

    # --------------------------------------------------------------- actions
    async def move(self, x: int, y: int) -> None:
        """Move the pointer to pixel (``x``, ``y``) of the screenshot (0, 0 = top left)."""
        await self._act("move", x=x, y=y)

    async def click(
        self,
        x: int | None = None,
        y: int | None = None,
        button: MouseButton = "left",
        *,
        double: bool = False,
    ) -> None:
        """Click ``button`` at (``x``, ``y``), or where the pointer is if both are None;
        ``double`` double-clicks."""
        await self._act("click", x=x, y=y, button=button, double=double)

    async def double_click(self, x: int | None = None, y: int | None = None) -> None:
        """A left double click (see :meth:`click`)."""
        await self.click(x, y, double=True)

    async def drag(
        self, from_x: int, from_y: int, to_x: int, to_y: int, button: MouseButton = "left"
    ) -> None:
        """Press ``button`` at (``from_x``, ``from_y``), move to (``to_x``, ``to_y``), release."""
        await self._act("drag", from_x=from_x, from_y=from_y, to_x=to_x, to_y=to_y, button=button)

    async def scroll(
        self,
        direction: Literal["up", "down", "left", "right"] = "down",
        amount: int = 1,
        x: int | None = None,
        y: int | None = None,
    ) -> None:
        """Turn the wheel ``amount`` notches (at (``x``, ``y``) if given)."""
        await self._act("scroll", direction=direction, amount=amount, x=x, y=y)

    async def button(self, button: MouseButton = "left", *, down: bool = True) -> None:
        """Press (``down``) or release a mouse button where the pointer is."""
        await self._act("button", button=button, down=down)

    async def type(self, text: str, *, delay_ms: int = 0) -> None:
        """Type ``text`` on the keyboard (``\\n`` is Enter, ``\\t`` Tab; at most 10,000
        characters); ``delay_ms`` pauses after each key (desktop)."""
        await self._act("type", text=text, delay_ms=delay_ms)

    async def key(self, name: str) -> None:
        """Press a key or a chord: ``"enter"``, ``"esc"``, ``"f5"``, ``"ctrl+c"``,
        ``"ctrl-alt-delete"`` (on a desktop any X keysym name too: ``"Page_Up"``).
        ``InvalidRequest`` for an unknown name."""
        await self._act("key", name=name)

    async def open(self, target: str) -> None:
        """Open a URL or an absolute path inside the sandbox with its application
        (``xdg-open``; web pages in Chromium). Returns once it is launched."""
        await self._act("open", target=target)

    async def launch(self, app: str, *args: str) -> None:
        """Start an application: a desktop entry id (``chromium``, ``xfce4-terminal``) or a
        command on ``PATH``, with ``args``. Returns once it is started."""
        await self._act("launch", app=app, args=list(args))


def __getattr__(name: str) -> object:
    if name == "Display":  # the sync class lives with the other generated ones
        from dsec.sdk.sync_api import Display

        return Display
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
