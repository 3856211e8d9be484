"""The ``desktop`` image on the vm tier (QEMU; TCG here, so one sandbox for the whole
test): the desktop runs in the guest and the same display API drives it as on the
container tier — screenshot, state, move, click, type, key, windows, launch — while the
guest's VGA console stays available as the ``console`` screen.

The application typed into is ``xterm`` (a light X client: GTK terminals and browsers take
minutes to start in a TCG guest) running a shell that reads one line and writes it to a
file: the file holds the text only if the typed keys reached the application, and only
after the ``Return`` sent by ``key()``. About 1.5 minutes here (a TCG guest on a busy
2-core machine): the desktop is ready ~20 s after the VM starts, the rest of the Xfce
session ~30 s later, xterm's window ~5 s after its launch."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from tests.timing import budget

from dsec import CapabilityNotSupported, InvalidRequest, Sandbox
from dsec.server import BackgroundServer

pytestmark = [pytest.mark.root, pytest.mark.vm, pytest.mark.slow, pytest.mark.timeout(600)]

T = TypeVar("T")
TYPED = "typed-into-xterm 42"
READER = 'read -r line; printf "%s\\n" "$line" > /tmp/typed.part && mv /tmp/typed.part /tmp/typed'


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def _wait(cond: Callable[[], T | None], what: str, timeout_s: float) -> T:
    deadline = time.monotonic() + budget(timeout_s)
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_desktop_on_the_vm_tier(short_home: Path, shared_layers: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = short_home
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    with BackgroundServer(home, tiers=["vm"]) as srv:
        kw = {"url": srv.url, "api_key": srv.api_key}
        assert srv.edge is not None
        srv.call(srv.edge.layers.ensure_image("desktop"), timeout=3600)
        t0 = time.monotonic()
        with Sandbox.create(
            image="desktop", tier="vm", memory_mb=1024, timeout=600, ttl_s=1800, **kw
        ) as sb:
            print(f"vm desktop ready in {time.monotonic() - t0:.1f} s")
            state = sb.display.state()
            assert (state.screen, state.width, state.height) == ("desktop", 1024, 768)
            assert _png_size(sb.display.screenshot()) == (1024, 768)
            sb.display.move(30, 40)
            assert sb.display.cursor_position() == (30, 40)
            with pytest.raises(InvalidRequest) as off:
                sb.display.click(1024, 0)
            assert off.value.details == {"width": 1024, "height": 768}

            # the VGA console is still there, a screen of its own
            console = sb.display.on("console")
            cstate = console.state()
            assert cstate.screen == "console" and cstate.width > 0
            assert _png_size(console.screenshot()) == (cstate.width, cstate.height)
            with pytest.raises(CapabilityNotSupported):
                console.open("/etc/hostname")

            # typing reaches an application in the guest, once the rest of the session
            # (started after the window manager, tens of seconds under TCG) has mapped its
            # windows: a panel or desktop appearing later may take the keyboard focus
            _wait(
                lambda: {"Xfce4-panel", "Xfdesktop"} <= {w.wm_class for w in sb.display.windows()},
                "the panel and the desktop in the guest",
                120,
            )
            sb.display.launch("xterm", "-geometry", "80x10+100+100", "-e", "sh", "-c", READER)
            term = _wait(
                lambda: next((w for w in sb.display.windows() if w.wm_class == "XTerm"), None),
                "xterm's window in the guest",
                90,
            )
            sb.display.click(term.x + term.width // 2, term.y + term.height // 2)  # focus it
            _wait(
                lambda: any(w.active for w in sb.display.windows() if w.id == term.id),
                "xterm to be the active window",
                30,
            )
            sb.display.type(TYPED)
            time.sleep(1)
            typed = sb.commands.run("cat /tmp/typed 2>/dev/null")
            assert typed.stdout == "", "the line was complete before Return was pressed"
            sb.display.key("Return")
            _wait(
                lambda: sb.commands.run("cat /tmp/typed 2>/dev/null").stdout.strip() == TYPED,
                "the line typed into xterm",
                60,
            )
            print(f"vm desktop test done in {time.monotonic() - t0:.1f} s")
