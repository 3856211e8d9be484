"""The unmodified ``e2b`` SDK's ``get_metrics`` against dsec's E2B API (``sandbox_metrics``),
over the in-memory FakeEdge: one sample now, in E2B's units; another key's sandbox is not
found; ``GET /sandboxes/metrics`` lists only the caller's."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from conftest import serve_e2b
from dsec.testing import FAKE_BASE_MEMORY, FakeEdge, MemoryLayers
from e2b import AsyncSandbox, Sandbox, SandboxException, SandboxNotFoundException


@pytest.fixture(scope="module")
def server() -> Iterator[dict[str, Any]]:
    edge = FakeEdge(layers=MemoryLayers(system_images=("busybox", "debian")))
    with serve_e2b(edge) as (root, _app, loop):
        yield {"api_url": root, "sandbox_url": f"{root}/envd", "edge": edge, "loop": loop}


def _opts(server: dict[str, Any], key: str = "key-alice") -> dict[str, str]:
    return {"api_key": key, "api_url": server["api_url"], "sandbox_url": server["sandbox_url"]}


def test_get_metrics_of_a_sandbox(server: dict[str, Any]) -> None:
    sbx = Sandbox.create("base", **_opts(server))
    try:
        metrics = sbx.get_metrics()
        assert len(metrics) == 1
        m = metrics[0]
        assert m.cpu_count == 1 and 0 <= m.cpu_used_pct
        assert m.mem_used == FAKE_BASE_MEMORY and m.mem_total > 0
        assert m.disk_total > 0 and m.disk_used == 0
        now = datetime.datetime.now(datetime.UTC)
        assert abs((m.timestamp - now).total_seconds()) < 30
        # a window that ended an hour ago holds no sample taken now
        past = now - datetime.timedelta(hours=1)
        assert sbx.get_metrics(start=past - datetime.timedelta(hours=1), end=past) == []
        # the class-method form, and another key
        assert len(Sandbox.get_metrics(sbx.sandbox_id, **_opts(server))) == 1
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_metrics(sbx.sandbox_id, **_opts(server, "key-bob"))
    finally:
        sbx.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics(sbx.sandbox_id, **_opts(server))


def test_async_get_metrics(server: dict[str, Any]) -> None:
    async def go() -> None:
        sbx = await AsyncSandbox.create("base", **_opts(server))
        try:
            [m] = await sbx.get_metrics()
            assert m.mem_used == FAKE_BASE_MEMORY
        finally:
            await sbx.kill()

    asyncio.run(go())


def test_metrics_of_many_sandboxes_lists_only_the_callers(server: dict[str, Any]) -> None:
    mine = Sandbox.create("base", **_opts(server))
    theirs = Sandbox.create("base", **_opts(server, "key-bob"))
    try:
        r = httpx.get(
            f"{server['api_url']}/sandboxes/metrics",
            params={"sandbox_ids": f"{mine.sandbox_id},{theirs.sandbox_id},sb-x-000000000000"},
            headers={"X-API-Key": "key-alice"},
        )
        assert r.status_code == 200
        assert set(r.json()["sandboxes"]) == {mine.sandbox_id}
        assert r.json()["sandboxes"][mine.sandbox_id]["memUsed"] == FAKE_BASE_MEMORY
        r = httpx.get(
            f"{server['api_url']}/sandboxes/{mine.sandbox_id}/metrics",
            params={"start": "yesterday"},
            headers={"X-API-Key": "key-alice"},
        )
        assert r.status_code == 400
    finally:
        mine.kill()
        theirs.kill()


def test_a_tier_that_cannot_measure_is_a_clear_error(server: dict[str, Any]) -> None:
    from dsec.testing import MemoryRuntime

    class Blind(MemoryRuntime):
        usage = None  # type: ignore[assignment]

    sbx = Sandbox.create("base", **_opts(server))
    rt = server["edge"].runtimes["container"]
    rt.__class__ = Blind
    try:
        with pytest.raises(SandboxException, match="cannot measure"):
            sbx.get_metrics()
    finally:
        rt.__class__ = MemoryRuntime
        sbx.kill()
