"""A computer-use episode on dsec's ``desktop`` image: screenshot, find, click, check.

The task: a local web page (written into the sandbox, opened in its Chromium with
``sb.display.open``) shows a green button that jumps to a new place each time it is
clicked and counts the clicks in the page title. Each step the "agent" takes a screenshot,
finds the button in it (the pixels of its colour: what a vision model would do, minus the
model), and clicks its centre. After the first click the page must have changed (the
counter in the window title, read with ``sb.display.windows()``), and at the end the
count must equal the clicks the agent made. Every step prints its timing: screenshot,
finding the button, the click.

Run against a server (``dsec serve``; ``$DSEC_URL`` and ``$DSEC_API_KEY`` select it)::

    python examples/computer_use_episode.py                 # 50 steps, container tier
    python examples/computer_use_episode.py --tier vm --steps 10
    python examples/computer_use_episode.py --save-last /tmp/last.png

Needs Pillow on the client (``pip install pillow``) to read the screenshots.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from dataclasses import dataclass, field

from dsec import Sandbox

PAGE_PATH = "/home/user/episode.html"
BUTTON_RGB = (0, 200, 83)
PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>clicks 0</title>
<style>
  html, body { margin: 0; height: 100%; background: #fafafa; overflow: hidden; }
  #go { position: absolute; width: 120px; height: 64px; border: none; font-size: 18px;
        background: #00c853; color: #000; }
</style></head>
<body>
<button id="go">Click me</button>
<script>
  // a fixed pseudo-random walk, so an episode is reproducible
  var n = 0, seed = 7;
  function next() { seed = (seed * 1103515245 + 12345) % 2147483648; return seed / 2147483648; }
  var go = document.getElementById("go");
  function place() {
    go.style.left = Math.floor(next() * (window.innerWidth - 140)) + "px";
    go.style.top = Math.floor(next() * (window.innerHeight - 80)) + "px";
  }
  go.addEventListener("click", function () {
    n += 1; document.title = "clicks " + n;
    document.body.style.background = n % 2 ? "#fff3e0" : "#e3f2fd";
    place();
  });
  place();
</script>
</body></html>
"""


@dataclass
class Step:
    """One step's timings, milliseconds, and where it clicked."""

    n: int
    screenshot_ms: float
    find_ms: float
    act_ms: float
    x: int
    y: int


@dataclass
class Episode:
    steps: list[Step] = field(default_factory=list)
    clicks: int = 0
    counted: int = 0
    first_change_seen: bool = False
    last_png: bytes = b""


def find_color(
    png: bytes, rgb: tuple[int, int, int], tolerance: int = 24
) -> tuple[int, int] | None:
    """The centre of the pixels of ``png`` near ``rgb`` (None if there are none)."""
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    w, h = img.size
    px = img.load()
    assert px is not None
    xs, ys = [], []
    for y in range(0, h, 3):
        for x in range(0, w, 3):
            r, g, b = px[x, y]  # type: ignore[misc]
            if abs(r - rgb[0]) + abs(g - rgb[1]) + abs(b - rgb[2]) <= tolerance:
                xs.append(x)
                ys.append(y)
    if not xs:
        return None
    return (min(xs) + max(xs)) // 2, (min(ys) + max(ys)) // 2


def page_count(sb: Sandbox) -> int | None:
    """The click counter in the page's window title (None while the page is not shown)."""
    for w in sb.display.windows():
        if w.title.startswith("clicks "):
            return int(w.title.split()[1])
    return None


def wait(cond: object, what: str, timeout_s: float = 60.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()  # type: ignore[operator]
        if value is not None and value is not False:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def run_episode(sb: Sandbox, steps: int, *, quiet: bool = False) -> Episode:
    """Open the page, then ``steps`` steps of screenshot + find + click."""
    ep = Episode()
    sb.files.write(PAGE_PATH, PAGE)
    sb.display.open(PAGE_PATH)
    wait(lambda: page_count(sb) == 0, "the page in Chromium")
    last = b""
    for n in range(1, steps + 1):
        t0 = time.perf_counter()
        png = sb.display.screenshot()
        t1 = time.perf_counter()
        where = find_color(png, BUTTON_RGB)
        t2 = time.perf_counter()
        if where is None:  # the page is redrawing after the last click: look again
            time.sleep(0.05)
            png = sb.display.screenshot()
            where = find_color(png, BUTTON_RGB)
            if where is None:
                raise SystemExit(f"step {n}: no button on the screen")
        x, y = where
        sb.display.click(x, y)
        t3 = time.perf_counter()
        ep.clicks += 1
        last = png
        if n == 1:  # the page must change after the first click
            wait(lambda: page_count(sb) == 1, "the page to count the first click")
            ep.first_change_seen = True
        else:
            # wait until the page has taken this click (the button moved) before looking; on
            # a busy node the browser renders at the sandbox's idle weight once xdotool ends
            wait(lambda c=ep.clicks: (page_count(sb) or 0) >= c, f"click {n}")
        step = Step(n, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, x, y)
        ep.steps.append(step)
        if not quiet:
            print(
                f"step {n:3d}: screenshot {step.screenshot_ms:6.1f} ms  find "
                f"{step.find_ms:6.1f} ms  click ({x:4d},{y:4d}) {step.act_ms:6.1f} ms"
            )
    ep.counted = page_count(sb) or 0
    ep.last_png = last
    return ep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tier", default="container")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--url", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--save-last", default=None, help="write the last screenshot here")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    with Sandbox.create(
        image="desktop", tier=args.tier, memory_mb=2048, url=args.url, api_key=args.api_key
    ) as sb:
        print(f"sandbox {sb.id} ({args.tier}) ready in {time.perf_counter() - t:.2f} s")
        ep = run_episode(sb, args.steps)
        if args.save_last:
            with open(args.save_last, "wb") as f:
                f.write(ep.last_png)
    shots = [s.screenshot_ms for s in ep.steps]
    acts = [s.act_ms for s in ep.steps]
    print(
        f"{len(ep.steps)} steps: screenshot p50 {statistics.median(shots):.1f} ms, click p50 "
        f"{statistics.median(acts):.1f} ms; the page counted {ep.counted} of {ep.clicks} clicks"
    )
    ok = ep.first_change_seen and ep.counted == ep.clicks
    print("episode", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
