"""Browser tests of the dashboard: Debian's ``chromium`` driven by Playwright (from PyPI,
pointed at the system browser with ``executable_path``: Playwright never downloads one).

A real apiserver (``create_app``, the same app ``dsec serve`` builds) over FakeEdge, served
by uvicorn on a loopback port; sandboxes are made through the SDK over HTTP, as a trainer
would. Every test keeps screenshots of the pages it saw in ``tests/ui/evidence/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from tests.conftest import free_port

from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys, owner_id
from dsec.testing import FakeEdge
from dsec.ui.routes import STATIC_DIR

OPERATOR = "dsec_browser_operator_key"
ALICE = "dsec_browser_alice_key"
BOB = "dsec_browser_bob_key"
EVIDENCE = Path(__file__).parent / "evidence"
CHROMIUM = os.environ.get("DSEC_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


@dataclass
class UiServer:
    url: str
    edge: FakeEdge
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def owner(self, key: str) -> str:
        return owner_id(key)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (scripts/bootstrap.sh installs it)")
    if not (STATIC_DIR / "app.js").exists():
        pytest.fail("the dashboard is not built: run scripts/bootstrap.sh (npm ci + ui/build.mjs)")
    return CHROMIUM


@contextlib.contextmanager
def serve_ui(edge: FakeEdge, routes: Any = None) -> Iterator[UiServer]:
    """The app over ``edge`` on a loopback port (``routes``: an extra router, included
    after the app's own)."""
    app = create_app(
        edge, StaticKeys([OPERATOR, ALICE, BOB], operators=[OPERATOR]), access_log="off"
    )
    if routes is not None:
        app.include_router(routes)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield UiServer(f"http://127.0.0.1:{port}", edge, loop)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def ui_server() -> Iterator[UiServer]:
    with serve_ui(FakeEdge(available_tiers=("fncall", "container", "vm"), max_sandboxes=5000)) as s:
        yield s


@pytest.fixture(scope="module")
def browser(chromium_path: str) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Evidence:
    """Screenshots of one test, named after it."""

    def __init__(self, name: str) -> None:
        self.name = name
        EVIDENCE.mkdir(parents=True, exist_ok=True)

    def shot(self, page: Any, what: str) -> Path:
        path = EVIDENCE / f"{self.name}-{what}.png"
        page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture
def evidence(request: pytest.FixtureRequest) -> Evidence:
    return Evidence(request.node.name)


@pytest.fixture
def new_page(browser: Any) -> Iterator[Any]:
    """``new_page()``: a page in a fresh browser context (its own cookies); errors the page
    raises fail the test."""
    contexts: list[Any] = []
    errors: list[str] = []

    def make() -> Any:
        ctx = browser.new_context(viewport={"width": 1400, "height": 900})
        contexts.append(ctx)
        page = ctx.new_page()
        page.set_default_timeout(15_000)
        page.on("pageerror", lambda e: errors.append(str(e)))
        return page

    yield make
    for ctx in contexts:
        ctx.close()
    assert not errors, f"the page raised: {errors}"


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(f"{url}/ui")
    page.fill("#key", key)
    page.click("button[type=submit]")
    page.wait_for_selector("[data-testid=overview]")
