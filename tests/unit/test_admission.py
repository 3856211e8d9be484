"""Admission of creations (dsec.edge.admission): bounded slots, a fair per-key FIFO queue,
a typed retryable refusal when full, and nothing lost or leaked when clients give up."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from dsec import AsyncSandbox, NodeBusy
from dsec.contract.runtime import Handle, SandboxSpec
from dsec.edge.admission import CreationGate
from dsec.models import CreateSandboxRequest
from dsec.testing import FakeEdge, MemoryLayers, MemoryRuntime, app_transport


async def _run(gate: CreationGate, owner: str, log: list[str], hold: asyncio.Event) -> None:
    async with gate.slot(owner):
        log.append(owner)
        await hold.wait()


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0)


async def test_at_most_slots_run_and_every_waiter_runs() -> None:
    gate = CreationGate(2)
    running = peak = done = 0

    async def one() -> None:
        nonlocal running, peak, done
        async with gate.slot("k"):
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.001)
            running -= 1
            done += 1

    await asyncio.gather(*(one() for _ in range(50)))
    assert (peak, done) == (2, 50)
    assert gate.stats().running == 0 and gate.stats().waiting == 0


async def test_keys_are_served_in_turn_and_fifo_within_a_key() -> None:
    """Key a queues 10 behind the one running; b's one, arriving after, runs second."""
    gate = CreationGate(1)
    log: list[str] = []
    holds = [asyncio.Event() for _ in range(12)]
    tasks = [asyncio.create_task(_run(gate, "a", log, holds[0]))]
    await _until(lambda: log == ["a"])
    order: list[int] = []

    async def a(i: int) -> None:
        async with gate.slot("a"):
            order.append(i)
            log.append("a")

    tasks += [asyncio.create_task(a(i)) for i in range(10)]
    await _until(lambda: gate.stats().waiting == 10)
    tasks.append(asyncio.create_task(_run(gate, "b", log, holds[1])))
    await _until(lambda: gate.stats().waiting == 11)
    holds[0].set()
    await _until(lambda: len(log) >= 3)
    assert log[:3] == ["a", "a", "b"]  # a's first waiter had its turn, then b's
    holds[1].set()
    await asyncio.gather(*tasks)
    assert order == list(range(10))


async def test_a_full_queue_refuses_with_a_retryable_error() -> None:
    gate = CreationGate(1, max_waiting=2)
    log: list[str] = []
    hold = asyncio.Event()
    tasks = [asyncio.create_task(_run(gate, "k", log, hold)) for _ in range(3)]
    await _until(lambda: gate.stats().waiting == 2)
    with pytest.raises(NodeBusy) as e:
        async with gate.slot("other"):
            pass
    assert e.value.http_status == 503 and e.value.details["retry_after_s"] >= 1
    hold.set()
    await asyncio.gather(*tasks)
    assert len(log) == 3  # the refusal took nothing from the ones waiting


async def test_a_wait_past_max_wait_is_refused_and_forgotten() -> None:
    gate = CreationGate(1, max_wait_s=0.05)
    hold = asyncio.Event()
    first = asyncio.create_task(_run(gate, "k", [], hold))
    await _until(lambda: gate.stats().running == 1)
    with pytest.raises(NodeBusy, match="waited"):
        async with gate.slot("k"):
            pass
    assert gate.stats().waiting == 0
    hold.set()
    await first
    async with gate.slot("k"):  # the slot came back
        assert gate.stats().running == 1


async def test_a_client_that_goes_away_leaves_the_queue_and_passes_its_turn() -> None:
    gate = CreationGate(1)
    log: list[str] = []
    hold, later = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(_run(gate, "a", log, hold))
    await _until(lambda: log == ["a"])
    gone = asyncio.create_task(_run(gate, "b", log, later))
    waiting = asyncio.create_task(_run(gate, "c", log, later))
    await _until(lambda: gate.stats().waiting == 2)
    gone.cancel()
    await _until(lambda: gate.stats().waiting == 1)
    hold.set()
    await _until(lambda: log == ["a", "c"])
    later.set()
    await asyncio.gather(first, waiting)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert gate.stats() == gate.stats().__class__(1, 0, 0, 0)


class _SlowRuntime(MemoryRuntime):
    """Creations wait for ``release`` (a node whose kernel is slow)."""

    release: asyncio.Event

    async def create(self, spec: SandboxSpec) -> Handle:
        await self.release.wait()
        return await super().create(spec)


def _slow_edge() -> tuple[FakeEdge, asyncio.Event]:
    release = asyncio.Event()
    layers = MemoryLayers()
    holder: list[FakeEdge] = []

    async def answer(sandbox_id: str, req: Any) -> Any:
        return await holder[0]._answer(sandbox_id, req)

    def factory(tier: str) -> Any:
        rt = _SlowRuntime(tier, layers, answer)
        rt.release = release
        return rt

    edge = FakeEdge(runtime_factory=factory, layers=layers)
    holder.append(edge)
    edge.creations = CreationGate(1, max_waiting=1)
    return edge, release


async def test_the_api_answers_503_node_busy_with_retry_after_and_creates_nothing() -> None:
    edge, release = _slow_edge()
    transport, key = app_transport(edge)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        auth = {"Authorization": f"Bearer {key}"}
        body = {"image": "busybox", "tier": "container"}
        running = asyncio.create_task(http.post("/v1/sandboxes", json=body, headers=auth))
        waiting = asyncio.create_task(http.post("/v1/sandboxes", json=body, headers=auth))
        await _until(lambda: edge.creations.stats().waiting == 1)
        r = await http.post("/v1/sandboxes", json=body, headers=auth)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "node_busy"
        assert int(r.headers["Retry-After"]) >= 1
        release.set()
        assert [(await t).status_code for t in (running, waiting)] == [201, 201]
        listed = (await http.get("/v1/sandboxes", headers=auth)).json()["sandboxes"]
        assert len(listed) == 2  # the refused one left nothing


async def test_the_sdk_retries_node_busy_until_the_node_has_room() -> None:
    edge, release = _slow_edge()
    transport, key = app_transport(edge)
    kw: dict[str, Any] = {"transport": transport, "api_key": key, "url": "http://t"}
    first = asyncio.create_task(AsyncSandbox.create(image="busybox", **kw))
    second = asyncio.create_task(AsyncSandbox.create(image="busybox", **kw))
    await _until(lambda: edge.creations.stats().waiting == 1)
    third = asyncio.create_task(AsyncSandbox.create(image="busybox", timeout=30, **kw))
    await asyncio.sleep(0.2)  # refused at least once meanwhile, and waiting to retry
    assert not third.done()
    release.set()
    boxes = await asyncio.gather(first, second, third)
    assert len({b.id for b in boxes}) == 3


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.edge.agent import EdgeLimits

    monkeypatch.setenv("DSEC_CREATE_SLOTS", "3")
    monkeypatch.setenv("DSEC_CREATE_QUEUE", "7")
    monkeypatch.setenv("DSEC_CREATE_WAIT_S", "12.5")
    lim = EdgeLimits.from_env()
    assert (lim.create_slots, lim.create_queue, lim.create_wait_s) == (3, 7, 12.5)
    with pytest.raises(ValueError):
        CreationGate(0)
    assert CreateSandboxRequest(image="busybox").tier  # the request model is untouched
