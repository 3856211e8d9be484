"""E2B's sandbox logs (``GET /sandboxes/{id}/logs``, ``GET /v2/sandboxes/{id}/logs``) mapped
onto the edge's ``sandbox_logs`` (what ``GET /v1/sandboxes/{id}/logs`` serves), read with
the unmodified ``e2b`` package's generated client and models."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from e2b.api.client.api.sandboxes import (
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.client import AuthenticatedClient
from e2b.api.client.models import LogLevel, LogsDirection, SandboxLogs, SandboxLogsV2Response

from conftest import serve_e2b
from dsec.models import SandboxRef
from dsec.testing import FakeEdge, MemoryLayers
from e2b import Sandbox


@dataclass
class _Line:
    ts: float
    stream: str
    data: str


LINES = [
    _Line(1000.0, "stdout", "booting\nready on :8000\n"),
    _Line(1001.0, "stderr", "warning: slow disk\n"),
    _Line(1002.5, "stdout", "GET / 200\n"),
    _Line(1003.0, "dsec", "start command exited with code 0\n"),
]


class LoggingEdge(FakeEdge):
    """FakeEdge whose sandboxes' start commands printed ``LINES`` (the lead's edge keeps
    real ones: dsec.edge.logs)."""

    async def sandbox_logs(  # type: ignore[override]
        self, sandbox_id: str, owner: str, *, follow: bool = False
    ) -> AsyncGenerator[_Line, None]:
        # ownership, as the real verb checks
        await self.get_sandbox(SandboxRef(sandbox_id=sandbox_id), owner)
        for line in LINES:
            yield line


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, Any]]:
    edge = LoggingEdge(layers=MemoryLayers(system_images=("busybox", "debian", "e2b-base")))
    with serve_e2b(edge) as (root, _app, _loop):
        yield {"api_url": root, "sandbox_url": f"{root}/envd"}


def _client(server: dict[str, Any], key: str) -> AuthenticatedClient:
    return AuthenticatedClient(
        base_url=server["api_url"], token=key, prefix="", auth_header_name="X-API-Key"
    )


def test_logs_v1_and_v2(server: dict[str, Any]) -> None:
    sbx = Sandbox.create(
        "base", api_key="key-alice", **{k: server[k] for k in ("api_url", "sandbox_url")}
    )
    try:
        alice = _client(server, "key-alice")
        v1 = get_sandboxes_sandbox_id_logs.sync(sbx.sandbox_id, client=alice)
        assert isinstance(v1, SandboxLogs)
        assert [x.line for x in v1.logs] == [
            "booting",
            "ready on :8000",
            "warning: slow disk",
            "GET / 200",
            "start command exited with code 0",
        ]
        assert [e.level for e in v1.log_entries][:3] == [
            LogLevel.INFO,
            LogLevel.INFO,
            LogLevel.ERROR,
        ]
        assert v1.log_entries[-1].level == LogLevel.WARN
        assert v1.log_entries[2].fields.additional_properties == {"stream": "stderr"}
        later = get_sandboxes_sandbox_id_logs.sync(
            sbx.sandbox_id, client=alice, start=1_001_500, limit=1
        )
        assert isinstance(later, SandboxLogs) and [x.line for x in later.logs] == ["GET / 200"]

        v2 = get_v_2_sandboxes_sandbox_id_logs.sync(
            sbx.sandbox_id, client=alice, level=LogLevel.WARN
        )
        assert isinstance(v2, SandboxLogsV2Response)
        assert [e.message for e in v2.logs] == [
            "warning: slow disk",
            "start command exited with code 0",
        ]
        back = get_v_2_sandboxes_sandbox_id_logs.sync(
            sbx.sandbox_id,
            client=alice,
            direction=LogsDirection.BACKWARD,
            cursor=1_002_000,
            limit=2,
        )
        assert isinstance(back, SandboxLogsV2Response)
        assert [e.message for e in back.logs] == ["warning: slow disk", "ready on :8000"]
        found = get_v_2_sandboxes_sandbox_id_logs.sync(sbx.sandbox_id, client=alice, search="200")
        assert isinstance(found, SandboxLogsV2Response) and len(found.logs) == 1

        # another key: not found; bad input: 400, never a 500
        r = httpx.get(
            f"{server['api_url']}/sandboxes/{sbx.sandbox_id}/logs", headers={"X-API-Key": "key-bob"}
        )
        assert r.status_code == 404
        for params in ({"start": "x"}, {"limit": "-1"}, {"limit": "99999999"}):
            r = httpx.get(
                f"{server['api_url']}/sandboxes/{sbx.sandbox_id}/logs",
                params=params,
                headers={"X-API-Key": "key-alice"},
            )
            assert r.status_code == 400, (params, r.text)
        for params in ({"direction": "sideways"}, {"level": "loud"}, {"cursor": "soon"}):
            r = httpx.get(
                f"{server['api_url']}/v2/sandboxes/{sbx.sandbox_id}/logs",
                params=params,
                headers={"X-API-Key": "key-alice"},
            )
            assert r.status_code == 400, (params, r.text)
    finally:
        sbx.kill()
