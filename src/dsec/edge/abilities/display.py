"""A sandbox's desktop: screenshots, input, windows, restart."""

from __future__ import annotations

import contextlib
import logging

from dsec.contract.runtime import Display
from dsec.display import DisplayState, Screen, WindowInfo
from dsec.edge.core import EdgeCore, LiveSandbox
from dsec.edge.desktop import (
    STOP_SCRIPT,
    ConsoleScreen,
    DesktopSpec,
    ExecDesktop,
    ScreenDriver,
    Windowed,
    desktop_spec,
)
from dsec.errors import CapabilityNotSupported, DsecError
from dsec.layers.desktop import DISPLAY_LABEL
from dsec.models import DisplayActRequest, ExecRequest, SandboxRef, ScreenRequest

log = logging.getLogger("dsec.edge")


class DisplayVerbs(EdgeCore):
    """A sandbox's desktop: screenshots, input, windows, restart."""

    # ------------------------------------------------------------------ display
    def _desktop_of(self, lv: LiveSandbox) -> DesktopSpec | None:
        """The desktop the sandbox's image has (None: none). Known from creation; after an
        edge restart looked up again (the image as its owner sees it, if it still has the
        layers the sandbox was made from)."""
        if not lv.desktop_known:
            spec = None
            name = lv.row.request.image
            with contextlib.suppress(DsecError):
                image = self.layers.get_image(name, lv.row.owner)
                if list(image.layers) == lv.row.image_layers[: len(image.layers)]:
                    spec = desktop_spec(image)
            lv.desktop, lv.desktop_known = spec, True
        return lv.desktop

    def _desktop_not_running(self, lv: LiveSandbox) -> str:
        """Why a desktop may not answer, from its start command's fate (for the error)."""
        if lv.start is None or lv.logs is None:
            return "the sandbox's start command is not running (edge restarted?)"
        if lv.logs.end_note is None:
            return "its start command still runs"
        tail = lv.logs.tail(600).strip()
        return f"{lv.logs.end_note}" + (f"; its output ends with: {tail}" if tail else "")

    def _screen(self, lv: LiveSandbox, screen: Screen) -> ScreenDriver:
        """The screen ``screen`` names for this sandbox (see :mod:`dsec.display`)."""
        rt = self.runtimes[lv.row.tier]
        spec = self._desktop_of(lv) if screen != "console" else None
        image = lv.row.request.image
        if spec is not None:
            return ExecDesktop(
                rt, lv.handle, spec.display, spec.image, lambda: self._desktop_not_running(lv)
            )
        if screen == "desktop":
            raise CapabilityNotSupported(
                f"image {image!r} of sandbox {lv.row.id} has no desktop (its config has no "
                f"{DISPLAY_LABEL!r} label): create it with image='desktop'",
                image=image,
                tier=lv.row.tier,
            )
        if isinstance(rt, Display):
            return ConsoleScreen(rt, lv.handle)
        if screen == "console":
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier has no console screen (tier='vm' has one)",
                image=image,
                tier=lv.row.tier,
            )
        raise CapabilityNotSupported(
            f"sandbox {lv.row.id} has no display: its image {image!r} has no desktop "
            f"(create it with image='desktop') and the {lv.row.tier} tier has no console "
            "screen",
            image=image,
            tier=lv.row.tier,
        )

    async def display_screenshot(
        self, sandbox_id: str, owner: str, screen: Screen = "auto", pointer: bool = False
    ) -> bytes:
        """The sandbox's screen as PNG bytes."""

        async def run(lv: LiveSandbox) -> bytes:
            return await self._screen(lv, screen).screenshot(pointer=pointer)

        return await self._use(sandbox_id, owner, run)

    async def display_act(self, req: DisplayActRequest, owner: str) -> None:
        async def run(lv: LiveSandbox) -> None:
            await self._screen(lv, req.screen).act(req.action)

        await self._use(req.sandbox_id, owner, run)

    async def display_state(self, req: ScreenRequest, owner: str) -> DisplayState:
        async def run(lv: LiveSandbox) -> DisplayState:
            return await self._screen(lv, req.screen).state()

        return await self._use(req.sandbox_id, owner, run)

    async def display_windows(self, req: SandboxRef, owner: str) -> list[WindowInfo]:
        async def run(lv: LiveSandbox) -> list[WindowInfo]:
            s = self._screen(lv, "desktop")
            if not isinstance(s, Windowed):  # pragma: no cover - a desktop has windows
                raise CapabilityNotSupported("this screen has no windows")
            return await s.windows()

        return await self._use(req.sandbox_id, owner, run)

    async def display_restart(self, req: SandboxRef, owner: str) -> DisplayState:
        """Stop the sandbox's desktop (whatever is left of it) and run its image's start
        command again; returns once its readiness check passes."""

        async def run(lv: LiveSandbox) -> DisplayState:
            spec = self._desktop_of(lv)
            image = lv.row.request.image
            if spec is None:
                raise CapabilityNotSupported(
                    f"image {image!r} of sandbox {lv.row.id} has no desktop to restart",
                    image=image,
                )
            if spec.start is None:
                raise CapabilityNotSupported(
                    f"image {image!r} has a desktop but no start command that runs it",
                    image=image,
                )
            rt = self.runtimes[lv.row.tier]
            if lv.start is not None:
                await lv.start.stop()
            stop = ExecRequest(
                cmd=["/bin/sh", "-c", STOP_SCRIPT, "dsec-desktop-stop", spec.display],
                timeout_s=30,
            )
            await rt.exec(lv.handle, stop)
            await self._start(lv, rt, spec.start, rt.facts().sink_sees_all_output)
            return await self._screen(lv, "desktop").state()

        return await self._use(req.sandbox_id, owner, run)
