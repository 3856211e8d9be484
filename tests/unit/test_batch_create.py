"""Batch creation: ``Sandbox.create_many`` / ``POST /v1/sandboxes/batch`` against the real
apiserver app in front of FakeEdge, and the shared ``create_batch`` helper."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec import AsyncSandbox, Sandbox
from dsec.edge.jobs import create_batch
from dsec.models import CreateSandboxRequest, SandboxInfo
from dsec.testing import FakeEdge, app_transport


def _conn(edge: FakeEdge) -> dict[str, Any]:
    transport, key = app_transport(edge)
    return {"transport": transport, "api_key": key}


async def test_create_many_all_created() -> None:
    edge = FakeEdge()
    batch = await AsyncSandbox.create_many(5, image="busybox", labels={"run": "r1"}, **_conn(edge))
    async with batch:
        assert batch.ok and batch.requested == 5 and len(batch.sandboxes) == 5
        assert len({sb.id for sb in batch.sandboxes}) == 5
        assert all(sb.info.labels == {"run": "r1"} for sb in batch.sandboxes)
        assert (await batch.sandboxes[3].commands.run("echo hi")).stdout == "hi\n"
        assert len(edge.calls_to("create_sandboxes")) == 1  # one API call for the batch
    alive = [s for s in edge.sandboxes.values() if s.state != "stopped"]
    assert alive == []  # `async with` killed them all


async def test_partial_success_is_reported_not_hidden() -> None:
    edge = FakeEdge(max_sandboxes=5)
    conn = _conn(edge)
    first = await AsyncSandbox.create_many(2, **conn)  # the node has room for 3 more
    batch = await AsyncSandbox.create_many(5, **conn)
    try:
        assert not batch.ok
        assert len(batch.sandboxes) == 3 and len(batch.errors) == 2
        assert {e.code for e in batch.errors} == {"quota_exceeded"}
        assert len({e.index for e in batch.errors}) == 2
        assert all(0 <= e.index < 5 for e in batch.errors)
        with pytest.raises(E.QuotaExceeded, match="2 of 5 sandboxes were not created"):
            batch.raise_on_error()
    finally:
        assert await batch.kill_all() == 3
        await first.kill_all()
    # a batch larger than the node can ever hold is refused before anything is made
    with pytest.raises(E.QuotaExceeded, match="can ever hold"):
        await AsyncSandbox.create_many(6, **conn)


async def test_all_or_nothing_creates_nothing_when_it_cannot_fit() -> None:
    edge = FakeEdge(max_sandboxes=3)
    with pytest.raises(E.QuotaExceeded):
        await AsyncSandbox.create_many(5, all_or_nothing=True, **_conn(edge))
    assert [s for s in edge.sandboxes.values() if s.state != "stopped"] == []


async def test_bad_batch_requests_are_typed_errors() -> None:
    edge = FakeEdge()
    conn = _conn(edge)
    with pytest.raises(E.InvalidRequest, match="n"):
        await AsyncSandbox.create_many(0, **conn)
    with pytest.raises(E.InvalidRequest):
        await AsyncSandbox.create_many(5000, **conn)
    with pytest.raises(E.InvalidRequest):
        await AsyncSandbox.create_many(2, cpu=-1, **conn)
    with pytest.raises(E.InvalidRequest, match="not_a_field"):
        await AsyncSandbox.create_many(2, not_a_field=1, **conn)
    async with httpx.AsyncClient(transport=conn["transport"], base_url="http://t") as http:
        h = {"Authorization": f"Bearer {conn['api_key']}"}
        for body in ({"n": 0}, {"n": "x"}, {"n": 2, "sandbox": {"tier": "nope"}}, {}):
            r = await http.post("/v1/sandboxes/batch", json=body, headers=h)
            assert r.status_code in (400, 422), (body, r.status_code)
            assert "error" in r.json()
        r = await http.post("/v1/sandboxes/batch", json={"n": 2}, headers=h)
        assert r.status_code == 200 and len(r.json()["sandboxes"]) == 2
        r = await http.post("/v1/sandboxes/batch", json={"n": 2})
        assert r.status_code == 401
    assert edge.calls_to("create_sandboxes")  # the valid one reached the edge


def test_sync_create_many() -> None:
    edge = FakeEdge()
    with Sandbox.create_many(3, **_conn(edge)) as batch:
        assert len(batch) == 3 and batch.ok
        ids = [sb.id for sb in batch]
        assert all(isinstance(sb, Sandbox) for sb in batch.sandboxes)
        assert batch.sandboxes[0].commands.run("echo x").stdout == "x\n"
    assert all(edge.sandboxes[i].state == "stopped" for i in ids)


async def test_create_batch_helper_all_or_nothing_kills_what_it_made() -> None:
    made: list[str] = []
    killed: list[str] = []
    fake = FakeEdge()

    async def create(i: int) -> SandboxInfo:
        if i == 3:
            await asyncio.sleep(0.01)
            raise E.SandboxError("boom")
        info = await fake.create_sandbox(CreateSandboxRequest(), "owner")
        made.append(info.id)
        return info

    async def kill(sid: str) -> None:
        killed.append(sid)

    with pytest.raises(E.SandboxError, match="already created were killed") as ei:
        await create_batch(6, create, kill, all_or_nothing=True, concurrency=2)
    assert sorted(killed) == sorted(made) and ei.value.details["batch_size"] == 6

    result = await create_batch(6, create, kill, concurrency=3)
    assert [e.index for e in result.errors] == [3] and len(result.sandboxes) == 5
    assert result.errors[0].code == "sandbox_error"
    with pytest.raises(E.InvalidRequest):
        await create_batch(0, create, kill)
