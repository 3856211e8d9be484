"""Desktop tests: a ``dsec serve`` in this process with the container tier, the port proxy's
host routes on ``desktop.test`` and its TLS listener, sharing the session's layer cache
(the ``desktop`` image is built there once, a few minutes, then reused).

Also the web page the tests and the example drive (:data:`PAGE`): a green button that
turns the page red and counts clicks in the title, a text field, a pad that reports drags,
right and middle clicks counted in the title, and a tall body whose scrolling the title
reports. :func:`find_color` finds the button in
a screenshot as an agent would.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from tests.isolation import worker_subnet
from tests.timing import budget

from dsec.server import BackgroundServer

DOMAIN = "desktop.test"
SUBNET = worker_subnet(236)
EVIDENCE = Path(__file__).with_name("evidence")
"""Screenshots kept as test evidence (committed)."""

BUTTON_RGB = (0, 200, 83)
PAD_RGB = (0x29, 0x62, 0xFF)
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>dsec desktop test</title>
<style>
  html, body { margin: 0; background: #ffffff; height: 3000px; font-family: sans-serif; }
  body.done { background: #d50000; }
  #go { position: absolute; left: 360px; top: 160px; width: 240px; height: 110px;
        background: #00c853; border: none; font-size: 28px; color: #000; }
  #t { position: absolute; left: 360px; top: 300px; width: 300px; height: 36px; }
  #pad { position: absolute; left: 40px; top: 160px; width: 260px; height: 260px;
         background: #2962ff; }
</style></head>
<body>
<button id="go">Click me</button>
<input id="t" autocomplete="off">
<div id="pad"></div>
<script>
  var clicks = 0, down = null;
  document.getElementById("go").addEventListener("click", function () {
    clicks += 1; document.body.className = "done"; document.title = "clicked " + clicks;
  });
  document.getElementById("t").addEventListener("input", function () {
    document.title = "typed [" + this.value + "]";
  });
  var pad = document.getElementById("pad");
  pad.addEventListener("mousedown", function (e) { down = [e.screenX, e.screenY]; });
  document.addEventListener("mouseup", function (e) {
    if (down) { document.title = "dragged " + (e.screenX - down[0]) + " " + (e.screenY - down[1]); }
    down = null;
  });
  window.addEventListener("scroll", function () { document.title = "scrolled " + window.scrollY; });
  var menus = 0, middles = 0;
  document.addEventListener("contextmenu", function (e) {
    e.preventDefault(); menus += 1; document.title = "context " + menus;
  });
  document.addEventListener("auxclick", function (e) {
    if (e.button === 1) { e.preventDefault(); middles += 1; document.title = "middle " + middles; }
  });
</script>
</body></html>
"""

T = TypeVar("T")


def find_color(png: bytes, rgb: tuple[int, int, int], tolerance: int = 24) -> tuple[int, int]:
    """The centre (x, y) of the pixels of ``png`` within ``tolerance`` of ``rgb`` (what an
    agent does with a screenshot, minus the model). Raises AssertionError if none are."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    w, h = img.size
    px = img.load()
    assert px is not None
    xs: list[int] = []
    ys: list[int] = []
    for y in range(0, h, 2):
        for x in range(0, w, 2):
            r, g, b = px[x, y]  # type: ignore[misc]
            if abs(r - rgb[0]) + abs(g - rgb[1]) + abs(b - rgb[2]) <= tolerance:
                xs.append(x)
                ys.append(y)
    assert xs, f"no pixel of colour {rgb} on the {w}x{h} screen"
    return (min(xs) + max(xs)) // 2, (min(ys) + max(ys)) // 2


def wait_for(fn: Callable[[], T | None], what: str, timeout_s: float = 60.0) -> T:
    """Poll ``fn`` every 0.2 s until it returns something truthy (``timeout_s`` stretched
    for this machine: tests/timing.py)."""
    deadline = time.monotonic() + budget(timeout_s)
    last: T | None = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    home = Path(f"/tmp/dsec-desktop-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    # built-in images come from the machine-wide cache (tests/warm_images.py)
    srv = BackgroundServer(
        home,
        tiers=["container"],
        network_options={"subnet": SUBNET},
        ports_domain=DOMAIN,
        tls=True,
    )
    srv.ports.domain = f"{DOMAIN}:{srv.tls_port}"
    with srv:
        assert srv.edge is not None
        if "container" not in srv.edge.runtimes:
            pytest.skip("the container tier is not available on this node")
        srv.call(srv.edge.layers.ensure_image("desktop"), timeout=3600)
        yield srv
    shutil.rmtree(home, ignore_errors=True)
