"""The logs pane of a sandbox page, shown only where the server keeps sandbox logs
(``features.logs``: ``GET /v1/sandboxes/{id}/logs``, NDJSON ``ts``/``stream``/``data``,
``?follow=true``), in chromium. The edge here prints known lines for every sandbox; where
this tree's apiserver has no logs route yet, a stub of the route's documented shape serves
the edge's ``sandbox_logs`` (the real route takes precedence once it exists)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from tests.ui.conftest import ALICE, Evidence, UiServer, serve_ui, sign_in

from dsec import Sandbox
from dsec.models import SandboxRef
from dsec.testing import FakeEdge


@dataclass
class _Line:
    ts: float
    stream: str
    data: str

    def model_dump_json(self) -> str:
        return json.dumps({"ts": self.ts, "stream": self.stream, "data": self.data})


class LoggingEdge(FakeEdge):
    async def sandbox_logs(  # type: ignore[override]
        self, sandbox_id: str, owner: str, *, follow: bool = False
    ) -> AsyncGenerator[Any, None]:
        await self.get_sandbox(SandboxRef(sandbox_id=sandbox_id), owner)
        yield _Line(1.0, "stdout", "web server starting\n")
        yield _Line(2.0, "stderr", "warning: debug mode\n")
        yield _Line(3.0, "stdout", "listening on :8000\n")


def _stub_route() -> APIRouter:
    router = APIRouter()

    @router.get("/v1/sandboxes/{sandbox_id}/logs")
    async def logs(request: Request, sandbox_id: str, follow: bool = False) -> StreamingResponse:
        edge = request.app.state.edge
        owner = request.scope["state"]["owner"]
        lines = edge.sandbox_logs(sandbox_id, owner, follow=follow)

        async def body() -> AsyncIterator[bytes]:
            async for line in lines:
                yield line.model_dump_json().encode() + b"\n"

        return StreamingResponse(body(), media_type="application/x-ndjson")

    return router


@pytest.fixture(scope="module")
def logs_server() -> Iterator[UiServer]:
    with serve_ui(LoggingEdge(), routes=_stub_route()) as s:
        yield s


def test_the_logs_pane(logs_server: UiServer, new_page: Any, evidence: Evidence) -> None:
    sb = Sandbox.create(url=logs_server.url, api_key=ALICE)
    page = new_page()
    sign_in(page, logs_server.url, ALICE)
    page.goto(f"{logs_server.url}/ui#/sandboxes/{sb.id}")
    page.click("[data-testid=tab-logs]")
    page.locator("[data-testid=logs]", has_text="listening on :8000").wait_for()
    text = page.inner_text("[data-testid=logs]")
    assert text.index("web server starting") < text.index("listening on :8000")
    assert page.locator("[data-testid=logs] .stderr", has_text="debug mode").count() == 1
    evidence.shot(page, "logs")
    sb.kill()


def test_no_logs_pane_without_the_route(ui_server: UiServer, new_page: Any) -> None:
    from dsec.contract.edge import EdgeAPI

    if "sandbox_logs" in vars(EdgeAPI):
        pytest.skip("this tree's apiserver serves logs for every sandbox")
    sb = Sandbox.create(url=ui_server.url, api_key=ALICE)
    page = new_page()
    sign_in(page, ui_server.url, ALICE)
    page.goto(f"{ui_server.url}/ui#/sandboxes/{sb.id}")
    page.wait_for_selector("[data-testid=tab-trajectory]")
    assert page.locator("[data-testid=tab-logs]").count() == 0
    sb.kill()
