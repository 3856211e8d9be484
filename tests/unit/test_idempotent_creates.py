"""Idempotent creations: a create repeated under one ``Idempotency-Key`` makes one sandbox
(the store's algorithm, the HTTP route as two API keys, and the SDK retrying a create whose
answer was lost)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

import dsec.errors as E
from dsec.apiserver.app import create_app
from dsec.apiserver.auth import StaticKeys
from dsec.edge.createkeys import IdempotentCreates, SqliteCreateKeys, fingerprint
from dsec.models import CreateSandboxRequest, SandboxInfo
from dsec.sdk import AsyncSandbox
from dsec.testing import FakeEdge, keyed_client

KEY, OTHER = "dsec_idem_key_a", "dsec_idem_key_b"


def _store() -> SqliteCreateKeys:
    return SqliteCreateKeys(sqlite3.connect(":memory:", check_same_thread=False), threading.Lock())


def _info(sandbox_id: str) -> SandboxInfo:
    return SandboxInfo.model_validate(
        {
            "id": sandbox_id,
            "tier": "container",
            "image": "busybox",
            "state": "running",
            "cpu": 1,
            "memory_mb": 512,
            "disk_mb": 0,
            "node": "n",
            "created_at": "2026-12-07T00:00:00Z",
            "updated_at": "2026-12-07T00:00:00Z",
        }
    )


class Maker:
    """Counts creations; each waits for ``gate`` (set at once unless a test holds it)."""

    def __init__(self) -> None:
        self.made: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: Exception | None = None

    async def make(self) -> SandboxInfo:
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.made.append(f"sb-n-{len(self.made)}")
        return _info(self.made[-1])

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return _info(sandbox_id)


REQ = CreateSandboxRequest(image="busybox")


async def test_a_repeat_answers_the_first_sandbox() -> None:
    creates, m = IdempotentCreates(_store()), Maker()
    first, replayed = await creates.create("o", "k1", REQ, m.make, m.get)
    assert not replayed
    again, replayed = await creates.create("o", "k1", REQ, m.make, m.get)
    assert replayed and again.id == first.id and m.made == [first.id]
    # another owner's same key is another creation; another key too
    assert (await creates.create("p", "k1", REQ, m.make, m.get))[0].id != first.id
    assert (await creates.create("o", "k2", REQ, m.make, m.get))[0].id != first.id
    assert len(m.made) == 3


async def test_the_same_key_for_another_request_is_a_conflict() -> None:
    creates, m = IdempotentCreates(_store()), Maker()
    await creates.create("o", "k", REQ, m.make, m.get)
    with pytest.raises(E.SequenceConflict):
        await creates.create("o", "k", CreateSandboxRequest(image="debian"), m.make, m.get)
    # the same request written differently (a default sent or not) is the same request
    explicit = CreateSandboxRequest(image="busybox", cpu=REQ.cpu, memory_mb=REQ.memory_mb)
    assert (await creates.create("o", "k", explicit, m.make, m.get))[1]


async def test_a_repeat_during_the_creation_waits_for_it() -> None:
    creates, m = IdempotentCreates(_store()), Maker()
    m.gate.clear()
    first = asyncio.ensure_future(creates.create("o", "k", REQ, m.make, m.get))
    second = asyncio.ensure_future(creates.create("o", "k", REQ, m.make, m.get))
    await asyncio.sleep(0.1)
    assert not first.done() and not second.done()
    m.gate.set()
    (a, a_replayed), (b, b_replayed) = await first, await second
    assert a.id == b.id and m.made == [a.id] and {a_replayed, b_replayed} == {False, True}


async def test_a_repeat_on_another_replica_waits_by_polling() -> None:
    """Two IdempotentCreates over one store stand for two apiserver replicas."""
    store = _store()
    here, there = IdempotentCreates(store), IdempotentCreates(store, poll_s=0.01)
    m = Maker()
    m.gate.clear()
    first = asyncio.ensure_future(here.create("o", "k", REQ, m.make, m.get))
    await asyncio.sleep(0.05)
    second = asyncio.ensure_future(there.create("o", "k", REQ, m.make, m.get))
    await asyncio.sleep(0.05)
    assert not second.done()
    m.gate.set()
    assert (await first)[0].id == (await second)[0].id and len(m.made) == 1


async def test_a_failed_creation_forgets_its_key() -> None:
    creates, m = IdempotentCreates(_store()), Maker()
    m.fail = E.NodeBusy("the node is busy", retry_after_s=1)
    with pytest.raises(E.NodeBusy):
        await creates.create("o", "k", REQ, m.make, m.get)
    m.fail = None
    info, replayed = await creates.create("o", "k", REQ, m.make, m.get)
    assert not replayed and m.made == [info.id]


async def test_a_departed_clients_sandbox_goes_unless_a_retry_took_it() -> None:
    creates, m = IdempotentCreates(_store()), Maker()
    info, _ = await creates.create("o", "k", REQ, m.make, m.get)
    assert await creates.abandon("o", "k", info.id)  # nobody took it: kill it
    again, replayed = await creates.create("o", "k", REQ, m.make, m.get)
    assert not replayed and again.id != info.id  # the retry after that makes a new one
    # a retry took the sandbox before the departed request's undo: it stays
    assert (await creates.create("o", "k", REQ, m.make, m.get))[1]
    assert not await creates.abandon("o", "k", again.id)


async def test_a_dead_creators_claim_is_taken_over() -> None:
    store = _store()
    assert store.claim("o", "k", fingerprint(REQ), time.time() - 120, 0) is None  # then it died
    creates, m = IdempotentCreates(store, stale_after_s=60), Maker()
    info, replayed = await creates.create("o", "k", REQ, m.make, m.get, deadline_s=5)
    assert not replayed and m.made == [info.id]


async def test_old_keys_expire() -> None:
    store = _store()
    creates, m = IdempotentCreates(store, keep_s=0.0), Maker()
    await creates.create("o", "k", REQ, m.make, m.get)
    creates._expired_at = 0.0
    assert store.expire(time.time() + 1) == 1


# ---------------------------------------------------------------- over HTTP


@pytest.fixture
async def clients() -> AsyncIterator[tuple[FakeEdge, httpx.AsyncClient, httpx.AsyncClient]]:
    edge = FakeEdge()
    keys = [KEY, OTHER]
    async with keyed_client(edge, keys, KEY) as a, keyed_client(edge, keys, OTHER) as b:
        yield edge, a, b


async def _ids(client: httpx.AsyncClient) -> list[str]:
    r = await client.get("/v1/sandboxes")
    return [s["id"] for s in r.json()["sandboxes"]]


async def test_the_route_makes_one_sandbox_per_key_and_api_key(clients: Any) -> None:
    _, a, b = clients
    body, headers = {"image": "busybox"}, {"idempotency-key": "trainer-7-rollout-3"}
    r1 = await a.post("/v1/sandboxes", json=body, headers=headers)
    r2 = await a.post("/v1/sandboxes", json=body, headers=headers)
    assert r1.status_code == r2.status_code == 201
    assert r1.json()["id"] == r2.json()["id"]
    assert await _ids(a) == [r1.json()["id"]]
    # the other API key's same string is its own
    r3 = await b.post("/v1/sandboxes", json=body, headers=headers)
    assert r3.status_code == 201 and r3.json()["id"] != r1.json()["id"]
    assert await _ids(a) == [r1.json()["id"]] and await _ids(b) == [r3.json()["id"]]
    # the same key with another body: 409, nothing made
    r4 = await a.post("/v1/sandboxes", json={"image": "busybox", "cpu": 2}, headers=headers)
    assert r4.status_code == 409 and r4.json()["error"]["code"] == "sequence_conflict"
    # a malformed key: 400 before the edge
    r5 = await a.post("/v1/sandboxes", json=body, headers={"idempotency-key": "a b"})
    assert r5.status_code == 400, r5.text
    assert len(await _ids(a)) == 1


class LoseFirstCreateAnswer(httpx.AsyncBaseTransport):
    """Delivers the first create to the server, then breaks the connection before its
    answer reaches the client (what a proxy's reset or a dropped link does)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.lost = 0
        self.keys: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and request.url.path == "/v1/sandboxes":
            self.keys.append(request.headers.get("idempotency-key"))
            if not self.lost:
                self.lost += 1
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return response


async def test_the_sdk_retries_a_create_whose_answer_was_lost() -> None:
    edge = FakeEdge()
    transport = LoseFirstCreateAnswer(httpx.ASGITransport(app=create_app(edge, StaticKeys([KEY]))))
    sb = await AsyncSandbox.create(url="http://dsec", api_key=KEY, transport=transport)
    async with sb:
        assert transport.lost == 1 and len(transport.keys) == 2
        assert transport.keys[0] is not None and transport.keys[0] == transport.keys[1]
        live = [
            s.id
            for s in await AsyncSandbox.list(url="http://dsec", api_key=KEY, transport=transport)
        ]
        assert live == [sb.id]  # one sandbox, the one the lost answer described


async def test_the_sdk_sends_a_callers_key_and_a_conflict_is_typed() -> None:
    edge = FakeEdge()
    transport = httpx.ASGITransport(app=create_app(edge, StaticKeys([KEY])))
    kw: dict[str, Any] = {"url": "http://dsec", "api_key": KEY, "transport": transport}
    a = await AsyncSandbox.create(idempotency_key="ckpt-41", **kw)
    b = await AsyncSandbox.create(idempotency_key="ckpt-41", **kw)  # a restarted trainer
    assert a.id == b.id
    with pytest.raises(E.SequenceConflict):
        await AsyncSandbox.create(idempotency_key="ckpt-41", cpu=2, **kw)
    await a.kill()
