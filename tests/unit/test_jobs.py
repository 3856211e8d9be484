"""Job groups: parallel, bounded, per-sandbox outcomes that never sink each other."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tests.timing import budget

from dsec.edge.jobs import for_each_sandbox, summarize
from dsec.errors import InvalidRequest, SandboxStopped
from dsec.models import SandboxInfo


async def test_outcomes_per_sandbox_with_mixed_failures() -> None:
    async def action(sid: str) -> Any:
        if sid == "sb-dead":
            raise SandboxStopped(f"sandbox {sid} is stopped", sandbox_id=sid)
        if sid == "sb-bug":
            raise RuntimeError("boom")
        if sid == "sb-dict":
            return {"state": "paused"}
        return type("Info", (), {"state": "paused"})()

    out = await for_each_sandbox(["sb-1", "sb-dead", "sb-bug", "sb-dict", "sb-1"], action)
    assert list(out) == ["sb-1", "sb-dead", "sb-bug", "sb-dict"]
    assert out["sb-1"] == {"ok": True, "state": "paused", "error": None}
    assert out["sb-dict"]["state"] == "paused"
    dead = out["sb-dead"]
    assert dead["ok"] is False and dead["error"] is not None
    assert dead["error"]["code"] == "sandbox_stopped"
    assert dead["error"]["details"] == {"sandbox_id": "sb-dead"}
    assert out["sb-bug"]["error"] is not None and out["sb-bug"]["error"]["code"] == "internal"
    assert summarize(out) == {
        "total": 4,
        "ok": 2,
        "failed": 2,
        "error:sandbox_stopped": 1,
        "error:internal": 1,
    }


async def test_runs_in_parallel_but_bounded() -> None:
    running = peak = 0

    async def action(sid: str) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1

    out = await for_each_sandbox([f"sb-{i}" for i in range(40)], action, concurrency=8)
    assert all(o["ok"] and o["state"] is None for o in out.values())
    assert peak == 8  # in flight at once: 8 at most (bounded), and 8 (not 1: serial)


async def test_per_sandbox_timeout() -> None:
    async def action(sid: str) -> None:
        await asyncio.sleep(5 if sid == "sb-slow" else 0)

    out = await for_each_sandbox(["sb-fast", "sb-slow"], action, timeout_s=0.05)
    assert out["sb-fast"]["ok"]
    err = out["sb-slow"]["error"]
    assert err is not None and err["code"] == "timeout" and err["details"]["timeout_s"] == 0.05


async def test_accepts_real_sandbox_info() -> None:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    info = SandboxInfo(
        id="sb-x-1",
        tier="container",
        image="busybox",
        state="paused",
        cpu=1,
        memory_mb=64,
        disk_mb=64,
        node="x",
        created_at=now,
        updated_at=now,
    )

    async def action(sid: str) -> SandboxInfo:
        return info

    assert (await for_each_sandbox(["sb-x-1"], action))["sb-x-1"]["state"] == "paused"


async def test_empty_job_and_bad_arguments() -> None:
    async def action(sid: str) -> None:
        raise AssertionError("not called")

    assert await for_each_sandbox([], action) == {}
    with pytest.raises(InvalidRequest):
        await for_each_sandbox(["a"], action, concurrency=0)
    with pytest.raises(InvalidRequest):
        await for_each_sandbox(["a"], action, timeout_s=0)


async def test_cancelling_the_call_cancels_the_actions() -> None:
    started = cancelled = 0

    async def action(sid: str) -> None:
        nonlocal started, cancelled
        started += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled += 1
            raise

    task = asyncio.create_task(for_each_sandbox(["a", "b", "c"], action))
    async with asyncio.timeout(budget(5)):  # all three actions are running
        while started < 3:
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled == 3
