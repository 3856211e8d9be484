"""Dashboard with many sandboxes: prints a table, writes benchmarks/results/dashboard.json.

The real app (``create_app``, as ``dsec serve`` builds it) over FakeEdge on a loopback port,
``--sandboxes`` sandboxes of one key (default 2,000: what issue 21 asks the page to stay
responsive with), and Debian's chromium driven by Playwright. Measured:

  * server: ``GET /v1/sandboxes`` (what the table polls every 2 s) p50 and its size;
    ``GET /ui/api/overview`` p50;
  * page: sign-in to the table showing every row in its page counter; long tasks (> 50 ms,
    the browser's own PerformanceObserver: what makes a page janky) over 10 s of the table
    polling every 2 s; a header filter typed key by key down to a single row; next page.

Usage: .venv/bin/python benchmarks/dashboard.py [--sandboxes N] [--chromium PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import httpx
import uvicorn

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.models import CreateSandboxRequest
from dsec.testing import FakeEdge

KEY = "dsec_bench_dashboard_key"
RESULTS = Path(__file__).parent / "results" / "dashboard.json"


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=2000)
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()

    edge = FakeEdge(max_sandboxes=args.sandboxes + 100)
    app = create_app(edge, StaticKeys([KEY]), access_log="off")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"

    async def fill() -> None:
        owner = owner_id(KEY)
        for i in range(args.sandboxes):
            await edge.create_sandbox(
                CreateSandboxRequest(job=f"job-{i % 20}", labels={"i": str(i)}), owner
            )

    t0 = time.perf_counter()
    asyncio.run_coroutine_threadsafe(fill(), loop).result(600)
    fill_s = time.perf_counter() - t0

    out: dict[str, Any] = {"sandboxes": args.sandboxes, "fill_s": round(fill_s, 2)}
    h = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=h, timeout=60) as c:
        lat, size = [], 0
        for _ in range(10):
            t = time.perf_counter()
            r = c.get("/v1/sandboxes")
            lat.append((time.perf_counter() - t) * 1000)
            size = len(r.content)
        out["list_p50_ms"] = round(_p50(lat), 1)
        out["list_bytes"] = size
        lat = []
        for _ in range(5):
            t = time.perf_counter()
            c.get("/ui/api/overview")
            lat.append((time.perf_counter() - t) * 1000)
        out["overview_p50_ms"] = round(_p50(lat), 1)

    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = b.new_page(viewport={"width": 1400, "height": 900})
        page.set_default_timeout(60_000)
        page.add_init_script(
            "window.__long = []; new PerformanceObserver(l => l.getEntries().forEach("
            "e => window.__long.push(e.duration))).observe({entryTypes: ['longtask']});"
        )
        t = time.perf_counter()
        page.goto(f"{url}/ui")
        page.fill("#key", KEY)
        page.click("button[type=submit]")
        page.wait_for_selector("[data-testid=overview]")
        page.goto(f"{url}/ui#/sandboxes")
        page.wait_for_selector("[data-testid=sandbox-link]")
        page.wait_for_function(
            "(n) => (document.querySelector('.tabulator-page-counter') || {}).innerText"
            "?.includes(`of ${n} rows`)",
            arg=args.sandboxes,
        )
        out["sign_in_to_table_ms"] = round((time.perf_counter() - t) * 1000, 1)
        page.evaluate("window.__long = []")
        page.wait_for_timeout(10_000)
        long_tasks = page.evaluate("window.__long")
        out["long_tasks_10s"] = len(long_tasks)
        out["long_task_max_ms"] = round(max(long_tasks), 1) if long_tasks else 0.0
        out["long_task_total_ms_10s"] = round(sum(long_tasks), 1)
        # a filter typed down to one row
        target = sorted(edge._live)[7]
        t = time.perf_counter()
        page.locator(".tabulator-col[tabulator-field=id] input").press_sequentially(target)
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=sandbox-link]').length === 1"
        )
        out["filter_to_one_row_ms"] = round((time.perf_counter() - t) * 1000, 1)
        page.locator(".tabulator-col[tabulator-field=id] input").fill("")
        page.locator(".tabulator-col[tabulator-field=id] input").press("Backspace")
        page.wait_for_function(
            "() => document.querySelectorAll('[data-testid=sandbox-link]').length > 1"
        )
        t = time.perf_counter()
        first = page.inner_text("[data-testid=sandbox-link] >> nth=0")
        page.click(".tabulator-page[data-page=next]")
        page.wait_for_function(
            "(f) => document.querySelector('[data-testid=sandbox-link]').innerText !== f", arg=first
        )
        out["next_page_ms"] = round((time.perf_counter() - t) * 1000, 1)
        b.close()
    server.should_exit = True
    thread.join(10)

    print(f"dashboard with {args.sandboxes} sandboxes (FakeEdge, loopback, chromium)")
    print(f"{'measure':<34} {'value':>12}")
    for k, v in out.items():
        print(f"{k:<34} {v!s:>12}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
