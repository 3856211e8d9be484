"""The display API's pure parts: the action vocabulary (validation), key chords, the
``wmctrl`` parser, the image's desktop label, and :class:`ExecDesktop` running its real
in-sandbox helper script under ``/bin/sh`` against stand-in X tools (a fake ``xdotool``,
``scrot`` and ``wmctrl`` on ``PATH``), so the error mapping (dead display, off-screen
points, missing tools) and the parsing are checked without an X server. Then the HTTP
routes over a recording edge: 400s from the schema, the edge's errors as JSON."""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError
from tests.timing import budget

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.contract.runtime import Handle
from dsec.display import (
    Click,
    DisplayAction,
    DisplayState,
    Key,
    Launch,
    Move,
    Open,
    Screen,
    Scroll,
    Type,
    WindowInfo,
    key_tokens,
)
from dsec.edge.desktop import ExecDesktop, desktop_spec, parse_wmctrl, x_key_chord
from dsec.errors import (
    CapabilityNotSupported,
    DisplayNotRunning,
    InvalidRequest,
    SandboxNotFound,
)
from dsec.layers import desktop as desktop_layer
from dsec.models import (
    DisplayActRequest,
    ExecRequest,
    ExecResult,
    ImageInfo,
    SandboxInfo,
    SandboxRef,
    ScreenRequest,
)

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + (1024).to_bytes(4, "big") + bytes(12)

FAKE_XDOTOOL = r"""#!/bin/sh
[ -n "${FAKE_DEAD:-}" ] && { echo "Error: Can't open display: $DISPLAY" >&2; exit 1; }
echo "$*" >> "$FAKE_LOG"
case "$1" in
getdisplaygeometry) echo "1024 768" ;;
getmouselocation) printf 'X=17\nY=23\nSCREEN=0\nWINDOW=42\n' ;;
getactivewindow) echo 23068676 ;;
key) case "$*" in *NoSuch*) echo "(symbol) No such key name 'NoSuch'." >&2 ;; esac ;;
esac
exit 0
"""
FAKE_SCROT = r"""#!/bin/sh
[ -n "${FAKE_DEAD:-}" ] && { echo "scrot: Can't open X display. It *is* running, yeah?" >&2; exit 1; }
for a in "$@"; do f=$a; done
printf '%s' "$FAKE_PNG_B64" | base64 -d > "$f"
"""
FAKE_WMCTRL = r"""#!/bin/sh
echo "0x01600004  0 151  10 37 1004 721  chromium.Chromium  host  A page - Chromium"
echo "0x00c00003 -1 88   0 0 1024 30  xfce4-panel.Xfce4-panel  host  xfce4-panel"
"""


class ShellRuntime:
    """Just ``exec``: runs the request's command here under ``/bin/sh`` with fake X tools
    first on ``PATH`` (what the sandbox's exec would do with the real ones)."""

    def __init__(self, bin_dir: Path, env: dict[str, str]) -> None:
        self.bin_dir = bin_dir
        self.env = env
        self.requests: list[ExecRequest] = []

    async def exec(self, handle: Handle, req: ExecRequest, on_output: Any = None) -> ExecResult:
        self.requests.append(req)
        assert isinstance(req.cmd, list)
        env = {"PATH": f"{self.bin_dir}:/usr/bin:/bin", **self.env, **req.env}
        proc = await asyncio.to_thread(
            subprocess.run, req.cmd, env=env, capture_output=True, text=True, check=False
        )
        return ExecResult(stdout=proc.stdout, stderr=proc.stderr, exit_code=proc.returncode)


@pytest.fixture
def fake_x(tmp_path: Path) -> tuple[ShellRuntime, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("xdotool", FAKE_XDOTOOL), ("scrot", FAKE_SCROT), ("wmctrl", FAKE_WMCTRL)):
        (bin_dir / name).write_text(text)
        os.chmod(bin_dir / name, 0o755)
    for name in ("xdg-open", "gtk-launch", "thunar"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> "$FAKE_LOG"\n')
        os.chmod(bin_dir / name, 0o755)
    log = tmp_path / "calls.log"
    env = {"FAKE_LOG": str(log), "FAKE_PNG_B64": base64.b64encode(PNG).decode(), "HOME": "/"}
    return ShellRuntime(bin_dir, env), log


def _desktop(rt: ShellRuntime, why: str = "") -> ExecDesktop:
    return ExecDesktop(rt, Handle("sb-test"), ":0", "desktop", (lambda: why) if why else None)  # type: ignore[arg-type]


def test_actions_validate() -> None:
    adapter: TypeAdapter[Any] = TypeAdapter(DisplayAction)
    assert adapter.validate_python({"action": "click", "x": 1, "y": 2}) == Click(x=1, y=2)
    for bad in (
        {"action": "click", "x": 1},  # x without y
        {"action": "move", "x": -1, "y": 0},
        {"action": "type", "text": ""},
        {"action": "key", "name": "ctrl++c"},
        {"action": "open", "target": "relative/path.html"},
        {"action": "open", "target": "/a\nb"},
        {"action": "launch", "app": "../x"},
        {"action": "scroll", "amount": 0},
        {"action": "fly"},
    ):
        with pytest.raises(ValidationError):
            adapter.validate_python(bad)
    assert Open(target="file:///home/user/a.html").target.startswith("file:")
    assert key_tokens("ctrl+shift-t") == ["ctrl", "shift", "t"]
    with pytest.raises(ValueError):
        key_tokens("ctrl+")


def test_key_chords_map_to_xdotool() -> None:
    assert x_key_chord("ctrl-c") == "ctrl+c"
    assert x_key_chord("enter") == "Return"
    assert x_key_chord("ctrl+alt+del") == "ctrl+alt+Delete"
    assert x_key_chord("Page_Up") == "Page_Up"  # any keysym name passes through
    assert x_key_chord("f5") == "F5"


def test_parse_wmctrl() -> None:
    text = "active 23068676\n" + FAKE_WMCTRL.split("\n", 1)[1].replace('echo "', "").replace(
        '"', ""
    )
    windows = parse_wmctrl(text)
    assert [w.wm_class for w in windows] == ["Chromium", "Xfce4-panel"]
    chromium = windows[0]
    assert chromium == WindowInfo(
        id=0x01600004,
        title="A page - Chromium",
        wm_class="Chromium",
        wm_instance="chromium",
        pid=151,
        x=10,
        y=37,
        width=1004,
        height=721,
        active=True,
    )
    assert not windows[1].active
    assert parse_wmctrl("garbage\n0xzz 0 1 2 3 4 5 a.b h t\n") == []


def _image(name: str, meta: dict[str, Any]) -> ImageInfo:
    return ImageInfo(
        name=name, layers=["sha256:" + "0" * 64], size=1, meta=meta, created_at=datetime.now(UTC)
    )


def test_desktop_spec_from_the_image_label() -> None:
    meta = desktop_layer.image_meta()
    image = _image("desktop", meta)
    spec = desktop_spec(image)
    assert spec is not None and spec.display == ":0" and spec.start is not None
    assert spec.start.cmd == list(desktop_layer.START_CMD)
    plain = _image("debian", {})
    assert desktop_spec(plain) is None
    bad = dict(meta, config={**meta["config"], "Labels": {"dsec.display": "0; rm -rf /"}})  # type: ignore[dict-item]
    assert desktop_spec(_image("x", bad)) is None


def test_recipe_fingerprint_covers_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    before = desktop_layer.recipe_fingerprint()
    monkeypatch.setattr(desktop_layer, "APT_PACKAGES", (*desktop_layer.APT_PACKAGES, "gimp"))
    with_gimp = desktop_layer.recipe_fingerprint()
    assert with_gimp != before
    monkeypatch.setattr(desktop_layer, "CHROOT_COMMANDS", (("fc-cache", "--really-force"),))
    assert desktop_layer.recipe_fingerprint() != with_gimp


async def test_exec_desktop_acts_and_reports(fake_x: tuple[ShellRuntime, Path]) -> None:
    rt, log = fake_x
    d = _desktop(rt)
    assert await d.screenshot() == PNG
    assert await d.state() == DisplayState(
        screen="desktop", width=1024, height=768, cursor_x=17, cursor_y=23, display=":0"
    )
    await d.act(Move(x=5, y=6))
    await d.act(Click(x=100, y=200, button="right", double=True))
    await d.act(Click())
    await d.act(Scroll(direction="up", amount=3))
    await d.act(Type(text="it's $HOME `x`"))
    await d.act(Key(name="ctrl-alt-t"))
    await d.act(Open(target="/etc/hostname"))
    await d.act(Launch(app="thunar", args=["/tmp"]))
    windows = await d.windows()
    assert windows[0].title == "A page - Chromium"
    calls = log.read_text().splitlines()
    assert "mousemove 5 6" in calls
    assert "mousemove 100 200 click --repeat 2 --delay 40 3" in calls
    assert "click --delay 0 1" in calls
    assert "click --repeat 3 --delay 8 4" in calls
    assert "type --delay 0 -- it's $HOME `x`" in calls  # passed as an argument, never parsed
    assert "key --delay 0 ctrl+alt+t" in calls
    async with asyncio.timeout(budget(5)):  # open and launch are detached
        while not {"xdg-open /etc/hostname", "thunar /tmp"} <= set(log.read_text().splitlines()):
            await asyncio.sleep(0.02)
    assert all(r.env == {"DISPLAY": ":0"} for r in rt.requests)


async def test_exec_desktop_errors(fake_x: tuple[ShellRuntime, Path]) -> None:
    rt, _ = fake_x
    d = _desktop(rt)
    with pytest.raises(InvalidRequest) as off:
        await d.act(Click(x=1024, y=0))
    assert off.value.details == {"width": 1024, "height": 768}
    with pytest.raises(InvalidRequest) as off:
        await d.act(Move(x=0, y=5000))
    assert off.value.details["height"] == 768
    with pytest.raises(InvalidRequest, match="No such key name"):
        await d.act(Key(name="ctrl+NoSuch"))
    with pytest.raises(InvalidRequest, match="no application"):
        await d.act(Launch(app="no-such-app"))
    with pytest.raises(InvalidRequest, match="no such file"):
        await d.act(Open(target="/no/such/file"))

    rt.env["FAKE_DEAD"] = "1"
    dead = _desktop(rt, "its start command ended (exit 1)")
    for call in (dead.screenshot, dead.state, lambda: dead.act(Click(x=1, y=1))):
        with pytest.raises(DisplayNotRunning) as e:
            await call()
        assert "start command ended" in str(e.value) and "restart()" in str(e.value)
    del rt.env["FAKE_DEAD"]

    (rt.bin_dir / "scrot").unlink()
    with pytest.raises(CapabilityNotSupported) as missing:
        await d.screenshot()
    assert "scrot" in str(missing.value) and missing.value.details["image"] == "desktop"


class RecordingEdge:
    """A :class:`DisplayEdge` that records actions for one sandbox of one owner."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.actions: list[tuple[Any, Screen]] = []

    def _check(self, sandbox_id: str, owner: str) -> None:
        if owner != self.owner or sandbox_id != "sb-n-abc":
            raise SandboxNotFound(f"no sandbox {sandbox_id}")

    async def display_screenshot(
        self, sandbox_id: str, owner: str, screen: Screen = "auto", pointer: bool = False
    ) -> bytes:
        self._check(sandbox_id, owner)
        return PNG

    async def display_act(self, req: DisplayActRequest, owner: str) -> None:
        self._check(req.sandbox_id, owner)
        action = req.action
        if isinstance(action, Click) and action.x is not None and action.x >= 1024:
            raise InvalidRequest("off the screen", width=1024, height=768)
        self.actions.append((action, req.screen))

    async def display_state(self, req: ScreenRequest, owner: str) -> DisplayState:
        self._check(req.sandbox_id, owner)
        return DisplayState(screen="desktop", width=1024, height=768, cursor_x=1, cursor_y=2)

    async def display_windows(self, req: SandboxRef, owner: str) -> list[WindowInfo]:
        self._check(req.sandbox_id, owner)
        raise DisplayNotRunning("the X server died", sandbox_id=req.sandbox_id, display=":0")

    async def display_restart(self, req: SandboxRef, owner: str) -> DisplayState:
        self._check(req.sandbox_id, owner)
        raise CapabilityNotSupported("image 'busybox' has no desktop", image="busybox")


async def test_routes() -> None:
    key = "dsec_display_unit_key"
    edge = RecordingEdge(owner_id(key))
    app = create_app(edge, StaticKeys([key]))  # type: ignore[arg-type]
    base = "http://dsec.test/v1/sandboxes/sb-n-abc/display"
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), headers={"authorization": f"Bearer {key}"}
    ) as c:
        r = await c.get(f"{base}/screenshot")
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        r = await c.get(base)
        assert r.json()["cursor_x"] == 1
        r = await c.post(f"{base}/click?screen=console", json={"x": 3, "y": 4, "double": True})
        assert r.status_code == 204
        assert edge.actions[-1] == (Click(x=3, y=4, double=True), "console")
        r = await c.post(f"{base}/launch", json={"app": "chromium", "args": ["about:blank"]})
        assert r.status_code == 204 and edge.actions[-1][0] == Launch(
            app="chromium", args=["about:blank"]
        )
        for path, body in (
            ("click", {"x": -1, "y": 0}),
            ("click", {"x": 1}),
            ("type", {"text": "x" * 10_001}),
            ("key", {"name": "a b"}),
            ("move", {"x": 1, "y": 2, "extra": 1}),
        ):
            r = await c.post(f"{base}/{path}", json=body)
            assert r.status_code == 400, (path, r.text)
        r = await c.post(f"{base}/click", json={"x": 5000, "y": 1})
        assert r.status_code == 400
        assert r.json()["error"]["details"] == {"width": 1024, "height": 768}
        r = await c.get(f"{base}/windows")
        assert r.status_code == 409 and r.json()["error"]["code"] == "display_not_running"
        r = await c.post(f"{base}/restart")
        assert r.status_code == 422 and r.json()["error"]["details"]["image"] == "busybox"
        r = await c.get(f"{base}/screenshot?screen=tv")
        assert r.status_code == 400
        r = await c.get("http://dsec.test/v1/sandboxes/sb-n-zzz/display/screenshot")
        assert r.status_code == 404
        # the screen travels in the query of every action; a bad one is refused before the edge
        before = len(edge.actions)
        r = await c.post(f"{base}/move?screen=tv", json={"x": 1, "y": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await c.post(f"{base}/move", json={"action": "click"})  # each route its own kind
        assert r.status_code == 400
        assert len(edge.actions) == before
        r = await c.post("http://dsec.test/v1/sandboxes/sb-n-zzz/display/click", json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"


async def test_the_sdk_sends_each_action_to_its_route() -> None:
    """``sb.display``'s actions go through the verb table (``display_<kind>`` rows, all
    calling ``display_act``): the kind's route, the action's fields as the body, the screen
    in the query; a bad action is refused before anything is sent."""
    from dsec.sdk import AsyncClient, AsyncSandbox
    from dsec.sdk.display import AsyncDisplay

    key = "dsec_display_unit_key"
    edge = RecordingEdge(owner_id(key))
    paths: list[str] = []

    class Recording(httpx.ASGITransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            paths.append(f"{request.url.path}?{request.url.query.decode()}")
            return await super().handle_async_request(request)

    app = create_app(edge, StaticKeys([key]))  # type: ignore[arg-type]
    client = AsyncClient("http://dsec.test", key, transport=Recording(app=app))
    now = datetime.now(UTC)
    info = SandboxInfo(
        id="sb-n-abc", tier="vm", image="desktop", state="running", cpu=1.0, memory_mb=256,
        disk_mb=96, node="test", created_at=now, updated_at=now,
    )  # fmt: skip
    display = AsyncDisplay(AsyncSandbox(info, client, owns_client=False))
    try:
        await display.move(5, 6)
        await display.on("console").click(7, 8, double=True)
        await display.scroll("up", 2)
        await display.type("hi\n")
        await display.key("ctrl+c")
        await display.launch("chromium", "about:blank")
        with pytest.raises(InvalidRequest):
            await display.click(1)  # x without y
        with pytest.raises(InvalidRequest) as off:
            await display.click(5000, 1)  # the edge's refusal, with the screen's size
        assert off.value.details == {"width": 1024, "height": 768}
    finally:
        await client.close()
    assert edge.actions == [
        (Move(x=5, y=6), "auto"),
        (Click(x=7, y=8, double=True), "console"),
        (Scroll(direction="up", amount=2), "auto"),
        (Type(text="hi\n"), "auto"),
        (Key(name="ctrl+c"), "auto"),
        (Launch(app="chromium", args=["about:blank"]), "auto"),
    ]
    base = "/v1/sandboxes/sb-n-abc/display"
    assert paths[:2] == [f"{base}/move?screen=auto", f"{base}/click?screen=console"]
    assert len(paths) == 7  # the click without y was never sent
