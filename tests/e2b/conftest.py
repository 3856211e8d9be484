"""E2B tests: the E2B app over the fake edge, served by uvicorn on a loopback port.

The unmodified ``e2b`` SDK is configured exactly as a user would: through
``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fake_edge import make_fake_edge
from starlette.applications import Starlette
from starlette.routing import Mount
from tests.conftest import free_port

from dsec.e2b import make_e2b_app
from dsec.testing import FakeEdge

KEYS = {"key-alice": "alice", "key-bob": "bob"}


@dataclass
class E2BServer:
    """A running E2B app: its URLs, the fake edge behind it and the server's loop."""

    api_url: str
    sandbox_url: str
    edge: FakeEdge
    loop: asyncio.AbstractEventLoop
    app: Any

    def call(self, coro: Any, timeout: float = 30) -> Any:
        """Run a coroutine on the server's loop (to inspect the edge)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


class StreamOnlyEdge:
    """The fake edge seen through ``EdgeAPI`` alone (no ``InteractiveExec``), like an edge
    that has not implemented interactive processes: the E2B layer falls back to exec_stream."""

    def __init__(self, inner: FakeEdge) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "start_process":
            raise AttributeError(name)
        return getattr(self._inner, name)


@contextlib.contextmanager
def serve_e2b(edge: Any) -> Iterator[tuple[str, Any, asyncio.AbstractEventLoop]]:
    """Serve ``make_e2b_app(edge)`` mounted at ``/e2b`` (as ``dsec serve`` does) on a loopback port."""
    app = make_e2b_app(edge, KEYS.get, watch_poll_interval_s=0.05, max_upload_bytes=1 << 20)
    # root /files: where the SDK's download_url()/upload_url() point (it drops the
    # E2B_SANDBOX_URL path); dsec.server.build_app serves them there the same way
    outer = Starlette(routes=[*app.state.e2b.envd.files_routes(), Mount("/e2b", app=app)])
    port = free_port()
    config = uvicorn.Config(outer, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/e2b", app, loop
    finally:
        asyncio.run_coroutine_threadsafe(app.state.e2b.aclose(), loop).result(30)
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def _bwrap_edge() -> Iterator[FakeEdge]:
    if shutil.which("bwrap") is None:
        pytest.skip("the fake edge needs bwrap (apt-get install bubblewrap)")
    base = Path(tempfile.mkdtemp(prefix="dsec-e2b-test-"))
    edge = make_fake_edge(base)
    try:
        yield edge
    finally:
        asyncio.run(edge.close(kill_sandboxes=True))
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_edge() -> Iterator[FakeEdge]:
    """The real edge over bubblewrap sandboxes (started on the E2B server's loop)."""
    with _bwrap_edge() as edge:
        yield edge


@pytest.fixture(scope="session")
def e2b_server(fake_edge: FakeEdge) -> Iterator[E2BServer]:
    """The E2B app over the fake edge; the E2B_* environment points the SDK at it."""
    with serve_e2b(fake_edge) as (root, app, loop):
        asyncio.run_coroutine_threadsafe(fake_edge.start(), loop).result(30)  # TTLs run
        env = {"E2B_API_URL": root, "E2B_SANDBOX_URL": f"{root}/envd", "E2B_API_KEY": "key-alice"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield E2BServer(
                api_url=root, sandbox_url=f"{root}/envd", edge=fake_edge, loop=loop, app=app
            )
        finally:
            asyncio.run_coroutine_threadsafe(fake_edge.close(kill_sandboxes=True), loop).result(60)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="session")
def stream_only_server() -> Iterator[E2BServer]:
    """The E2B app over an edge without InteractiveExec (URLs passed explicitly); an edge
    of its own (an edge serves one event loop)."""
    with _bwrap_edge() as edge, serve_e2b(StreamOnlyEdge(edge)) as (root, app, loop):
        yield E2BServer(api_url=root, sandbox_url=f"{root}/envd", edge=edge, loop=loop, app=app)


def pause_during_stream(sandbox: Any, join_s: float) -> tuple[bool, dict[str, Any]]:
    """Run a command that prints once a second for 8 s on ``sandbox`` (an e2b ``Sandbox``),
    pause the sandbox 1.5 s in, and wait up to ``join_s`` for the command's call to return.
    Returns (the call is still blocked, {"result" or "error": what it returned or raised})."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = sandbox.commands.run(
                "for i in 1 2 3 4 5 6 7 8; do echo f$i; sleep 1; done"
            )
        except Exception as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(1.5)
    type(sandbox).pause(sandbox.sandbox_id)
    thread.join(join_s)
    return thread.is_alive(), outcome
