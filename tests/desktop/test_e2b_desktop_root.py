"""The unmodified ``e2b-desktop`` SDK (2.x, pinned in the dev extras) against a real
``dsec serve`` on the container tier, configured as a user would (``E2B_API_URL``,
``E2B_SANDBOX_URL``, ``E2B_API_KEY``; the template is e2b-desktop's default, ``desktop``):
``Sandbox.create()`` (its own ``Xvfb`` and ``startxfce4`` calls adopt the image's running
desktop), screenshots, clicks, ``write``, ``press``, ``open``, ``launch``, window queries, and
``stream.start()`` whose ``get_url()`` is loaded in headless Chromium (Debian's, driven by
Playwright) through dsec's port proxy over TLS: the noVNC page connects and shows the
desktop; its screenshot is kept in ``tests/desktop/evidence/``. The stream is opened twice:
from a private sandbox on a server with a ports domain, with the traffic token header, and
from a ``dsec serve`` nobody configured, as it is (no header, no resolver rule: E2B's public
default on ``*.dsec.localhost``)."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from tests.browser_net import BrowserNet
from tests.timing import budget

from dsec.server import BackgroundServer, ServeProcess

from .conftest import BUTTON_RGB, DOMAIN, EVIDENCE, PAD_RGB, PAGE, find_color, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]

e2b_desktop = pytest.importorskip("e2b_desktop")
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture
def e2b_env(server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> BackgroundServer:
    monkeypatch.setenv("E2B_API_URL", f"{server.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{server.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", server.api_key)
    return server


@pytest.fixture
def desktop(e2b_env: BackgroundServer) -> Iterator[object]:
    # private ports (E2B's are public by default): the stream needs the traffic token
    sbx = e2b_desktop.Sandbox.create(timeout=600, network={"allow_public_traffic": False})
    try:
        yield sbx
    finally:
        sbx.kill()


def _titles(sbx: object, prefix: str) -> str | None:
    try:  # xdotool search exits 1 while no window matches (as on E2B)
        wids = sbx.get_application_windows("chromium")  # type: ignore[attr-defined]
    except Exception:
        return None
    for wid in wids:
        if not wid:
            continue
        try:
            title = sbx.get_window_title(wid)  # type: ignore[attr-defined]
        except Exception:  # a window that went away between the calls
            continue
        if title.startswith(prefix):
            return str(title)
    return None


def test_e2b_desktop_calls(desktop: object) -> None:
    from PIL import Image

    sbx = desktop
    assert sbx.get_screen_size() == (1024, 768)  # type: ignore[attr-defined]
    png = sbx.screenshot()  # type: ignore[attr-defined]
    assert Image.open(io.BytesIO(png)).size == (1024, 768)
    sbx.move_mouse(100, 120)  # type: ignore[attr-defined]
    assert sbx.get_cursor_position() == (100, 120)  # type: ignore[attr-defined]

    sbx.files.write("/home/user/page.html", PAGE)  # type: ignore[attr-defined]
    sbx.open("/home/user/page.html")  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "dsec desktop test"), "Chromium with the page")
    shot = wait_for(
        lambda: (lambda p: p if _has(p) else None)(sbx.screenshot()),  # type: ignore[attr-defined]
        "the button on the screen",
    )
    x, y = find_color(shot, BUTTON_RGB)
    sbx.left_click(x, y)  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "clicked 1"), "the click")
    sbx.double_click(x, y)  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "clicked 3"), "the double click")
    sbx.press("tab")  # type: ignore[attr-defined]
    sbx.write("hi e2b")  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "typed [hi e2b]"), "write()")
    sbx.press(["ctrl", "a"])  # type: ignore[attr-defined]
    sbx.press("backspace")  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "typed []"), "press(['ctrl', 'a']), press('backspace')")
    current = sbx.get_current_window_id()  # type: ignore[attr-defined]
    assert sbx.get_window_title(current).startswith("typed []")  # type: ignore[attr-defined]

    sbx.right_click(x, y)  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "context 1"), "right_click()")
    sbx.middle_click(x, y)  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "middle 1"), "middle_click()")
    px, py = find_color(sbx.screenshot(), PAD_RGB)  # type: ignore[attr-defined]
    sbx.drag((px, py), (px + 70, py + 50))  # type: ignore[attr-defined]  # mouse_press/release
    wait_for(lambda: _titles(sbx, "dragged 70 50"), "drag()")
    sbx.move_mouse(x, y)  # type: ignore[attr-defined]
    sbx.scroll("down", 3)  # type: ignore[attr-defined]
    scrolled = wait_for(lambda: _titles(sbx, "scrolled "), "scroll('down', 3)")
    assert int(scrolled.split()[1]) > 0
    sbx.scroll("up", 10)  # type: ignore[attr-defined]
    wait_for(lambda: _titles(sbx, "scrolled 0"), "scroll('up', 10)")
    chunks = b"".join(sbx.screenshot(format="stream"))  # type: ignore[attr-defined]
    assert Image.open(io.BytesIO(chunks)).size == (1024, 768)

    sbx.launch("xfce4-terminal")  # type: ignore[attr-defined]
    wait_for(lambda: _windows(sbx, "xfce4-terminal"), "the launched terminal")


def _windows(sbx: object, app: str) -> list[str]:
    try:
        return [w for w in sbx.get_application_windows(app) if w]  # type: ignore[attr-defined]
    except Exception:
        return []


def _has(png: bytes) -> bool:
    try:
        find_color(png, BUTTON_RGB)
    except AssertionError:
        return False
    return True


def _page_on_screen(sbx: Any) -> None:
    """Skip without Chromium or Playwright on the host; else show the test page in the
    sandbox's browser (something of the sandbox's own to look for in the stream: the
    page's green button)."""
    pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing (scripts/bootstrap.sh installs chromium)")
    sbx.files.write("/home/user/page.html", PAGE)
    sbx.open("/home/user/page.html")
    wait_for(lambda: _titles(sbx, "dsec desktop test"), "Chromium with the page")


def test_e2b_desktop_stream_in_chromium(desktop: object, e2b_env: BackgroundServer) -> None:
    sbx = desktop
    _page_on_screen(sbx)
    sbx.stream.start()  # type: ignore[attr-defined]
    url = sbx.stream.get_url()  # type: ignore[attr-defined]
    parts = urlsplit(url)
    assert parts.scheme == "https" and parts.path == "/vnc.html"
    assert parts.netloc == f"6080-{sbx.sandbox_id}.{DOMAIN}:{e2b_env.tls_port}"  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError):
        sbx.stream.start()  # type: ignore[attr-defined]  # already running

    token = sbx.traffic_access_token  # type: ignore[attr-defined]
    assert token
    with _browser(token, url) as page, _explained(sbx, page):
        shot = _connected(page, url)
        EVIDENCE.mkdir(exist_ok=True)
        (EVIDENCE / "e2b-desktop-novnc-stream.png").write_bytes(shot)
    sbx.stream.stop()  # type: ignore[attr-defined]
    wait_for(
        lambda: sbx.commands.run("pgrep -x x11vnc || true").stdout.strip() == "",  # type: ignore[attr-defined]
        "x11vnc to stop",
        20,
    )


def test_e2b_desktop_stream_with_an_auth_key(desktop: object) -> None:
    """``stream.start(require_auth=True)``: x11vnc asks for the generated password, so the
    noVNC page draws the desktop with ``get_url(auth_key=...)`` and asks for credentials
    without it."""
    sbx = desktop
    _page_on_screen(sbx)
    sbx.stream.start(require_auth=True)  # type: ignore[attr-defined]
    key = sbx.stream.get_auth_key()  # type: ignore[attr-defined]
    assert len(key) == 16
    token = sbx.traffic_access_token  # type: ignore[attr-defined]
    url = sbx.stream.get_url(auth_key=key)  # type: ignore[attr-defined]
    with _browser(token, url) as page, _explained(sbx, page):
        _connected(page, url)
    with _browser(token, url) as page, _explained(sbx, page):
        answer = page.goto(sbx.stream.get_url(), timeout=budget(60) * 1000)  # type: ignore[attr-defined]
        assert answer is not None and answer.status == 200
        page.wait_for_selector("#noVNC_credentials_dlg.noVNC_open", timeout=budget(60) * 1000)
    sbx.stream.stop()  # type: ignore[attr-defined]


@contextmanager
def _browser(token: str | None, url: str) -> Iterator[Any]:
    """A page of Debian's headless Chromium that resolves the proxy's host routes to this
    node and sends the sandbox's traffic token (None: no header at all, and no resolver
    rule: Chromium resolves ``*.localhost`` itself), as a viewer of the stream would; in a
    network namespace of its own (tests/browser_net.py), off the node whose sandboxes'
    addresses come and go, with the port of ``url`` relayed to the node."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, BrowserNet() as net:
        port = urlsplit(url).port
        assert port is not None, url
        net.forward(port)
        rules = [f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1"] if token else []
        browser = p.chromium.launch(
            executable_path=net.executable(CHROMIUM),
            headless=True,
            args=[*rules, "--no-sandbox"],
        )
        try:
            # the node's own authority is not in the browser's store (httpx tests check it)
            ctx = browser.new_context(
                ignore_https_errors=True,
                extra_http_headers={"E2B-Traffic-Access-Token": token} if token else None,
                viewport={"width": 1100, "height": 850},
            )
            yield ctx.new_page()
        finally:
            browser.close()


@contextmanager
def _explained(sbx: Any, page: Any) -> Iterator[None]:
    """On a failure inside, add what the page and the sandbox's VNC servers said to it: the
    page's console and WebSocket events, x11vnc's and noVNC's logs."""
    events: list[str] = []
    page.on("console", lambda m: events.append(f"console {m.type}: {m.text}"))
    page.on(
        "websocket",
        lambda ws: (
            events.append(f"websocket open {ws.url}"),
            ws.on("close", lambda _ws: events.append("websocket closed")),
            ws.on("socketerror", lambda err: events.append(f"websocket error {err}")),
        ),
    )
    try:
        yield
    except BaseException as e:
        logs = sbx.commands.run(
            "pgrep -a x11vnc; pgrep -af novnc; tail -n 30 /tmp/x11vnc_stderr.log /tmp/novnc.log; true",
            timeout=60,
        )
        note = "\n".join(events[-40:]) + "\n" + logs.stdout + logs.stderr
        raise AssertionError(f"{e}\n--- what the page and the sandbox said:\n{note}") from e


def _connected(page: Any, url: str) -> bytes:
    """Load the noVNC page at ``url`` and return a screenshot once it shows the desktop."""
    answer = page.goto(url, timeout=budget(60) * 1000)
    assert answer is not None and answer.status == 200
    assert "noVNC" in page.title()
    # connected: noVNC hides its status bar and draws the remote screen on a canvas
    page.wait_for_function(
        "() => { const c = document.querySelector('#noVNC_container canvas')"
        " || document.querySelector('canvas'); return c && c.width >= 1024; }",
        timeout=budget(60) * 1000,
    )
    return _wait_drawn(page)


def _wait_drawn(page: object) -> bytes:
    """A screenshot of the page once the canvas shows the desktop: many colours, and the
    green button of the page open in the sandbox's Chromium."""
    from PIL import Image

    def drawn() -> bytes | None:
        png = page.screenshot()  # type: ignore[attr-defined]
        colours = Image.open(io.BytesIO(png)).convert("RGB").getcolors(maxcolors=1 << 16)
        many = colours is None or len(colours) > 16
        return png if many and _has(png) else None

    return wait_for(drawn, "the desktop drawn in the noVNC canvas", 60)


@pytest.fixture(scope="module")
def plain_serve() -> Iterator[ServeProcess]:
    """A ``dsec serve`` child with no port settings at all (its defaults: host routes on
    ``*.dsec.localhost`` behind its own TLS listener), its E2B_* pointing the SDK at it."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if any(k.startswith("DSEC_PORTS_") for k in os.environ):
        pytest.skip("this test is about a server without port settings")
    home = Path(tempfile.mkdtemp(prefix="dsec-desktop-plain-", dir="/tmp")) / "home"
    with ServeProcess(home) as srv:
        yield srv
    shutil.rmtree(home.parent, ignore_errors=True)


def test_e2b_desktop_stream_url_opens_with_no_settings_and_no_header(
    plain_serve: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """e2b-desktop's ``stream.get_url()`` from a server nobody configured opens in Chromium
    as it is: no resolver rule, no header (E2B's sandboxes are public by default, so is
    this one), the noVNC page connects and draws the desktop. Another key's credential
    opens nothing of it."""
    import httpx

    from dsec.apiserver.auth import KeyStore
    from dsec.server import DEFAULT_PORTS_DOMAIN

    monkeypatch.setenv("E2B_API_URL", f"{plain_serve.url}/e2b")
    monkeypatch.setenv("E2B_SANDBOX_URL", f"{plain_serve.url}/e2b/envd")
    monkeypatch.setenv("E2B_API_KEY", plain_serve.api_key)
    sbx = e2b_desktop.Sandbox.create(timeout=600)
    try:
        _page_on_screen(sbx)
        sbx.stream.start()
        url = sbx.stream.get_url()
        parts = urlsplit(url)
        assert parts.scheme == "https" and parts.path == "/vnc.html"
        assert parts.hostname == f"6080-{sbx.sandbox_id}.{DEFAULT_PORTS_DOMAIN}"
        assert sbx.traffic_access_token is None
        with _browser(None, url) as page, _explained(sbx, page):
            shot = _connected(page, url)
            EVIDENCE.mkdir(exist_ok=True)
            (EVIDENCE / "e2b-desktop-novnc-stream-no-settings.png").write_bytes(shot)
        other = KeyStore(plain_serve.home).create_key("desktop-other")
        r = httpx.get(
            url, headers={"authorization": f"Bearer {other}"}, verify=False, timeout=budget(30)
        )
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
        sbx.stream.stop()
    finally:
        sbx.kill()


def test_e2b_desktop_resolution_restarts_the_desktop(e2b_env: BackgroundServer) -> None:
    """``create(resolution=...)``: e2b-desktop's own ``Xvfb`` call asks for another screen;
    the image restarts its desktop at that size, which dsec's display API then reports."""
    from dsec import InvalidRequest, Sandbox

    sbx = e2b_desktop.Sandbox.create(resolution=(1280, 720), timeout=600)
    try:
        assert sbx.get_screen_size() == (1280, 720)
        sb = Sandbox.connect(sbx.sandbox_id, url=e2b_env.url, api_key=e2b_env.api_key)
        assert sb.display.screen_size() == (1280, 720)
        with pytest.raises(InvalidRequest) as off:
            sb.display.click(1280, 0)
        assert off.value.details == {"width": 1280, "height": 720}
    finally:
        sbx.kill()
