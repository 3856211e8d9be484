"""dsec's display API on the ``desktop`` image, container tier, through the SDK and the HTTP
API of a real server: a web page in Chromium driven by screenshots, clicks, drags, the
wheel, typing and keys; windows; applications; the errors (a point off the screen, a
sandbox without a desktop, a desktop whose X server died) and ``restart``."""

from __future__ import annotations

import io
from collections.abc import Callable

import httpx
import pytest

from dsec import CapabilityNotSupported, DisplayNotRunning, InvalidRequest, Sandbox
from dsec.server import BackgroundServer

from .conftest import BUTTON_RGB, EVIDENCE, PAD_RGB, PAGE, find_color, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def _title(sb: Sandbox, prefix: str) -> str | None:
    for w in sb.display.windows():
        if w.title.startswith(prefix):
            return str(w.title)
    return None


def test_display_api_drives_chromium(server: BackgroundServer) -> None:
    kw = {"url": server.url, "api_key": server.api_key}
    with Sandbox.create(image="desktop", tier="container", memory_mb=2048, **kw) as sb:
        state = sb.display.state()
        assert (state.screen, state.width, state.height, state.display) == (
            "desktop",
            1024,
            768,
            ":0",
        )
        assert sb.display.screen_size() == (1024, 768)
        assert _size(sb.display.screenshot()) == (1024, 768)
        assert _size(sb.display.screenshot(pointer=True)) == (1024, 768)
        sb.display.move(10, 20)
        assert sb.display.cursor_position() == (10, 20)

        sb.files.write("/home/user/page.html", PAGE)
        sb.display.open("/home/user/page.html")
        wait_for(lambda: _title(sb, "dsec desktop test"), "Chromium to show the page")
        chromium = next(w for w in sb.display.windows() if w.title.startswith("dsec desktop"))
        assert chromium.wm_class.lower() == "chromium" and chromium.pid
        # the page is drawn some time after its title is set
        png = wait_for(
            lambda: (lambda p: p if _has(p, BUTTON_RGB) else None)(sb.display.screenshot()),
            "the button on the screen",
        )
        x, y = find_color(png, BUTTON_RGB)
        sb.display.click(x, y)
        wait_for(lambda: _title(sb, "clicked 1"), "the click to reach the page")
        after = sb.display.screenshot()
        assert _has(after, (0xD5, 0, 0)), "the page did not turn red"
        (EVIDENCE / "display-api-clicked.png").parent.mkdir(exist_ok=True)
        (EVIDENCE / "display-api-clicked.png").write_bytes(after)
        sb.display.double_click(x, y)
        wait_for(lambda: _title(sb, "clicked 3"), "the double click")

        sb.display.key("Tab")  # the button has the focus: Tab moves it to the text field
        sb.display.type("hello desk")
        wait_for(lambda: _title(sb, "typed [hello desk]"), "the typed text")
        sb.display.key("ctrl+a")
        sb.display.key("BackSpace")
        wait_for(lambda: _title(sb, "typed []"), "ctrl+a, backspace")

        px, py = find_color(sb.display.screenshot(), PAD_RGB)
        sb.display.drag(px, py, px + 80, py + 60)
        wait_for(lambda: _title(sb, "dragged 80 60"), "the drag")

        sb.display.scroll("down", 3, x, y)
        title = wait_for(lambda: _title(sb, "scrolled "), "the wheel")
        assert int(title.split()[1]) > 0
        sb.display.key("ctrl+Home")
        wait_for(lambda: _title(sb, "scrolled 0"), "ctrl+Home")

        sb.display.button("left", down=True)
        sb.display.button("left", down=False)

        sb.display.launch("xfce4-terminal")
        term = wait_for(
            lambda: next((w for w in sb.display.windows() if w.wm_class == "Xfce4-terminal"), None),
            "the terminal window",
        )
        wait_for(  # its shell starts (a child of the terminal)
            lambda: sb.commands.run('pgrep -P "$(pgrep -n -x xfce4-terminal)"').exit_code == 0,
            "the terminal's shell",
        )
        sb.display.click(term.x + term.width // 2, term.y + term.height // 2)  # focus it
        sb.display.type("echo typed-in-the-terminal > /tmp/typed\n")
        wait_for(
            lambda: (
                sb.commands.run("cat /tmp/typed 2>/dev/null").stdout.strip()
                == "typed-in-the-terminal"
            ),
            "the command typed into the terminal",
            30,
        )
        assert sum(w.active for w in sb.display.windows()) <= 1

        # bad input: 400 with the screen size, unknown keys and applications
        with pytest.raises(InvalidRequest) as off:
            sb.display.click(1024, 10)
        assert (off.value.details["width"], off.value.details["height"]) == (1024, 768)
        with pytest.raises(InvalidRequest) as off:
            sb.display.drag(10, 10, 2000, 10)
        assert off.value.details["width"] == 1024
        with pytest.raises(InvalidRequest):
            sb.display.key("ctrl+NoSuchKeyName")
        with pytest.raises(InvalidRequest):
            sb.display.launch("no-such-app")
        with pytest.raises(InvalidRequest):
            sb.display.open("/no/such/file.html")
        with pytest.raises(CapabilityNotSupported):
            sb.display.on("console").screenshot()  # the container tier has no console
        r = httpx.post(
            f"{server.url}/v1/sandboxes/{sb.id}/display/click",
            json={"x": 5000, "y": 1},
            headers={"authorization": f"Bearer {server.api_key}"},
        )
        assert r.status_code == 400
        assert r.json()["error"]["details"] == {"width": 1024, "height": 768}

        # another key sees no such sandbox
        other = server.keys.create_key("desktop-other")
        r = httpx.get(
            f"{server.url}/v1/sandboxes/{sb.id}/display/screenshot",
            headers={"authorization": f"Bearer {other}"},
        )
        assert r.status_code == 404


def _has(png: bytes, rgb: tuple[int, int, int]) -> bool:
    try:
        find_color(png, rgb)
    except AssertionError:
        return False
    return True


def test_dead_x_server_and_restart(server: BackgroundServer) -> None:
    kw = {"url": server.url, "api_key": server.api_key}
    with Sandbox.create(image="desktop", tier="container", memory_mb=1024, **kw) as sb:
        assert sb.display.screen_size() == (1024, 768)
        sb.commands.run("kill -KILL $(cat /tmp/.dsec-desktop/0/xvfb.pid)", user="root")
        wait_for(lambda: _raises(sb.display.screenshot), "the display to be gone", 10)
        for call in (
            sb.display.screenshot,
            sb.display.state,
            sb.display.windows,
            lambda: sb.display.click(1, 1),
            lambda: sb.display.type("x"),
        ):
            with pytest.raises(DisplayNotRunning) as dead:
                call()
            assert "restart()" in str(dead.value)
        # the start command ends and says why; the errors then carry it
        wait_for(
            lambda: "X server on :0 exited" in "".join(line.data for line in sb.logs()),
            "the start command to report the X server's death",
            10,
        )
        with pytest.raises(DisplayNotRunning) as dead:
            sb.display.screenshot()
        assert "X server on :0 exited" in str(dead.value)
        state = sb.display.restart()
        assert (state.width, state.height) == (1024, 768)
        assert _size(sb.display.screenshot()) == (1024, 768)
        wait_for(lambda: any(w.wm_class for w in sb.display.windows()) or None, "Xfce", 60)


def _raises(call: Callable[[], object]) -> bool:
    try:
        call()
    except DisplayNotRunning:
        return True
    return False


def test_no_desktop_names_the_image(server: BackgroundServer) -> None:
    kw = {"url": server.url, "api_key": server.api_key}
    with Sandbox.create(image="busybox", tier="container", **kw) as sb:
        for call in (sb.display.screenshot, sb.display.windows, lambda: sb.display.click(1, 1)):
            with pytest.raises(CapabilityNotSupported) as no:
                call()
            assert "busybox" in str(no.value) and no.value.details["image"] == "busybox"
        with pytest.raises(CapabilityNotSupported):
            sb.display.restart()


def test_screenshot_is_a_png_of_the_screen(server: BackgroundServer) -> None:
    """The PNG decodes, at the size the state reports, and is not blank (Xfce draws)."""
    from PIL import Image

    kw = {"url": server.url, "api_key": server.api_key}
    with Sandbox.create(image="desktop", tier="container", memory_mb=1024, **kw) as sb:

        def drawn() -> bool:
            img = Image.open(io.BytesIO(sb.display.screenshot())).convert("RGB")
            return len(img.getcolors(maxcolors=1 << 16) or ()) > 8

        wait_for(drawn, "Xfce to draw the desktop", 60)
