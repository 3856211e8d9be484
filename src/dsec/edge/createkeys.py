"""Idempotent creations: a create repeated under the same ``Idempotency-Key`` makes one
sandbox.

A client whose create request broke in transit (a reset connection, a proxy's time-out, a
crash between the server's answer and the client's read) cannot know whether a sandbox was
made. It sends the same request again with the same key (the SDK picks one per create and
retries with it), and gets:

* the sandbox the first request made, if it was made (``replayed``);
* the first request's outcome once it is known, if it is still under way: the retry
  waits for it, here or on another apiserver replica (the claim is in the shared store);
* a new creation, if the first failed (a failure forgets the key: a retry is a new try)
  or if its client left before the answer and no retry took the sandbox (the apiserver
  then kills it and forgets the key, :meth:`IdempotentCreates.abandon`);
* ``SequenceConflict`` (409) if the key was used for a different request.

Keys are per API key (another key's use of the same string is unrelated) and kept for
:data:`KEEP_S` after the creation. A claim whose creator died (a crashed replica) goes
stale after ``stale_after_s`` without its heartbeat, and a retry then takes it over.

The algorithm is here once; each edge gives it a :class:`CreateKeyStore`: the embedded
edge its SQLite registry (:class:`SqliteCreateKeys`), a cluster its PostgreSQL state
(:class:`dsec.cluster.state.PgCreateKeys`). Every store operation is one atomic statement.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel

from dsec.canonical import canonical_digest
from dsec.contract.verbs import IDEMPOTENCY_KEY_PATTERN
from dsec.errors import InvalidRequest, SequenceConflict, ServiceUnavailable
from dsec.models import SandboxInfo, SandboxRef

if TYPE_CHECKING:
    from dsec.contract.verbs import Envelope

__all__ = [
    "KEEP_S",
    "CreateKeyStore",
    "IdempotentCreates",
    "KeyRow",
    "SqliteCreateKeys",
    "fingerprint",
]

KEEP_S = 24 * 3600.0
"""How long a key is remembered after its creation."""
STALE_AFTER_S = 60.0
"""A claim not refreshed for this long belongs to a creator that died."""


@dataclass(frozen=True)
class KeyRow:
    """What the store knows of a key: the request's fingerprint, the sandbox (None while
    the creation runs), when its claim was last refreshed, and whether a retry took it."""

    fingerprint: str
    sandbox_id: str | None
    claimed_at: float
    adopted: bool


class CreateKeyStore(Protocol):
    """Keys of creations, per owner. Each method is atomic."""

    def claim(
        self, owner: str, key: str, fingerprint: str, now: float, stale: float
    ) -> KeyRow | None:
        """Claim the key for a new creation: None when claimed (a new key, or a claim
        refreshed before ``stale`` with no sandbox: taken over), else the row there."""
        ...

    def touch(self, owner: str, key: str, now: float) -> None:
        """Refresh a claim (the creation still runs)."""
        ...

    def settle(self, owner: str, key: str, sandbox_id: str, now: float) -> None:
        """Record the sandbox the claim made."""
        ...

    def adopt(self, owner: str, key: str) -> str | None:
        """Mark a made sandbox as taken by a retry; its id (None: no made sandbox)."""
        ...

    def abandon(self, owner: str, key: str, sandbox_id: str) -> bool:
        """Forget the key if it names ``sandbox_id`` and no retry took it; whether it did."""
        ...

    def forget(self, owner: str, key: str) -> None:
        """Forget the key (its creation failed)."""
        ...

    def expire(self, before: float) -> int:
        """Forget keys whose claim was last refreshed before ``before``; how many."""
        ...


def fingerprint(req: BaseModel) -> str:
    """The request as the server reads it: field order, and defaults sent or left out, do
    not matter."""
    return canonical_digest(req.model_dump(mode="json"))


def check_key(key: str) -> str:
    """``key`` if it is a well-formed ``Idempotency-Key``, else ``InvalidRequest``."""
    if not re.match(IDEMPOTENCY_KEY_PATTERN, key):
        raise InvalidRequest(
            "Idempotency-Key must be 1-256 printable ASCII characters without spaces",
            header="Idempotency-Key",
        )
    return key


class Sandboxes(Protocol):
    """What :class:`IdempotentCreates` asks of the edge it serves."""

    async def get_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo: ...
    async def kill_sandbox(self, req: SandboxRef, owner: str) -> SandboxInfo: ...


class IdempotentCreates:
    """Creations under idempotency keys over one store (see the module's doc).

    Args:
        store: where keys are kept (shared by every replica that serves the same keys).
        stale_after_s: a claim not refreshed for this long is taken over.
        poll_s: how often a retry waiting for another replica's creation looks again.
    """

    def __init__(
        self,
        store: CreateKeyStore,
        *,
        stale_after_s: float = STALE_AFTER_S,
        poll_s: float = 0.05,
        keep_s: float = KEEP_S,
    ) -> None:
        self.store = store
        self.stale_after_s = stale_after_s
        self.poll_s = poll_s
        self.keep_s = keep_s
        self._settled: dict[tuple[str, str], asyncio.Event] = {}
        self._expired_at = 0.0

    async def create(
        self,
        owner: str,
        key: str,
        req: BaseModel,
        make: Callable[[], Awaitable[SandboxInfo]],
        get: Callable[[str], Awaitable[SandboxInfo]],
        *,
        deadline_s: float = 3600.0,
    ) -> tuple[SandboxInfo, bool]:
        """The sandbox of ``key``: made by ``make`` now, or the one an earlier request with
        the key made (``get``); and whether it was the earlier one's (a replay)."""
        check_key(key)
        fp = fingerprint(req)
        await self._expire()
        give_up = time.monotonic() + deadline_s
        while True:
            now = time.time()
            row = await asyncio.to_thread(
                self.store.claim, owner, key, fp, now, now - self.stale_after_s
            )
            if row is None:
                return await self._make(owner, key, make), False
            if row.fingerprint != fp:
                raise SequenceConflict(
                    "this Idempotency-Key was used for a different create request",
                    header="Idempotency-Key",
                )
            if row.sandbox_id is not None:
                sandbox_id = await asyncio.to_thread(self.store.adopt, owner, key)
                if sandbox_id is not None:
                    return await get(sandbox_id), True
                continue  # abandoned meanwhile: claim it again
            if time.monotonic() >= give_up:
                raise ServiceUnavailable(
                    "an earlier create with this Idempotency-Key is still under way",
                    retry_after_s=1,
                )
            await self._wait(owner, key)

    async def _wait(self, owner: str, key: str) -> None:
        """Until the key's creation here settles, or one poll interval (another replica's)."""
        event = self._settled.get((owner, key))
        if event is None:
            await asyncio.sleep(self.poll_s)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), self.stale_after_s / 4)

    async def _make(
        self, owner: str, key: str, make: Callable[[], Awaitable[SandboxInfo]]
    ) -> SandboxInfo:
        event = self._settled.setdefault((owner, key), asyncio.Event())

        async def heartbeat() -> None:
            while True:
                await asyncio.sleep(self.stale_after_s / 4)
                await asyncio.to_thread(self.store.touch, owner, key, time.time())

        beating = asyncio.create_task(heartbeat())
        try:
            info = await make()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.store.forget, owner, key)
            raise
        else:
            await asyncio.to_thread(self.store.settle, owner, key, info.id, time.time())
            return info
        finally:
            beating.cancel()
            event.set()
            self._settled.pop((owner, key), None)

    async def create_once(
        self,
        edge: Sandboxes,
        req: BaseModel,
        owner: str,
        key: str,
        make: Callable[[], Awaitable[SandboxInfo]],
    ) -> SandboxInfo:
        """An edge's creation under ``key``: ``make`` it now, or answer (as ``edge`` sees
        it now) the sandbox an earlier request with the key made."""
        info, _ = await self.create(
            owner,
            key,
            req,
            make,
            lambda sandbox_id: edge.get_sandbox(SandboxRef(sandbox_id=sandbox_id), owner),
        )
        return info

    async def take_back(self, edge: Sandboxes, sandbox_id: str, owner: str, env: Envelope) -> None:
        """``EdgeAPI.abandon_sandbox``: the client of this creation left before its answer;
        the sandbox is killed unless a retry under the same key took it."""
        if env.idem_key is None or await self.abandon(owner, env.idem_key, sandbox_id):
            await edge.kill_sandbox(SandboxRef(sandbox_id=sandbox_id), owner)

    async def abandon(self, owner: str, key: str, sandbox_id: str) -> bool:
        """The client of ``key``'s creation left before its answer: True when the sandbox
        is nobody's now (the caller kills it; a retry will create anew), False when a retry
        under the same key took it."""
        return bool(await asyncio.to_thread(self.store.abandon, owner, key, sandbox_id))

    async def _expire(self) -> None:
        now = time.time()
        if now - self._expired_at < 60:
            return
        self._expired_at = now
        await asyncio.to_thread(self.store.expire, now - self.keep_s)


_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS create_keys (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    sandbox_id TEXT,
    claimed_at REAL NOT NULL,
    adopted INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, key)
);
"""


class SqliteCreateKeys:
    """Keys in the embedded edge's SQLite database (shares the registry's connection)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self._db = db
        self._lock = lock
        with lock:
            db.executescript(_SQLITE_SCHEMA)

    def claim(
        self, owner: str, key: str, fingerprint: str, now: float, stale: float
    ) -> KeyRow | None:
        with self._lock:
            taken = self._db.execute(
                "INSERT INTO create_keys (owner, key, fingerprint, claimed_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (owner, key) DO UPDATE SET fingerprint = excluded.fingerprint,"
                " claimed_at = excluded.claimed_at, adopted = 0"
                " WHERE create_keys.sandbox_id IS NULL AND create_keys.claimed_at < ?"
                " AND create_keys.fingerprint = excluded.fingerprint",
                (owner, key, fingerprint, now, stale),
            ).rowcount
            if taken:
                return None
            r = self._db.execute(
                "SELECT fingerprint, sandbox_id, claimed_at, adopted FROM create_keys"
                " WHERE owner = ? AND key = ?",
                (owner, key),
            ).fetchone()
        if r is None:  # forgotten between the two statements: claim again
            return self.claim(owner, key, fingerprint, now, stale)
        return KeyRow(r[0], r[1], r[2], bool(r[3]))

    def touch(self, owner: str, key: str, now: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE create_keys SET claimed_at = ? WHERE owner = ? AND key = ?"
                " AND sandbox_id IS NULL",
                (now, owner, key),
            )

    def settle(self, owner: str, key: str, sandbox_id: str, now: float) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE create_keys SET sandbox_id = ?, claimed_at = ? WHERE owner = ? AND key = ?",
                (sandbox_id, now, owner, key),
            )

    def adopt(self, owner: str, key: str) -> str | None:
        with self._lock:
            r = self._db.execute(
                "UPDATE create_keys SET adopted = 1 WHERE owner = ? AND key = ?"
                " AND sandbox_id IS NOT NULL RETURNING sandbox_id",
                (owner, key),
            ).fetchone()
        return None if r is None else str(r[0])

    def abandon(self, owner: str, key: str, sandbox_id: str) -> bool:
        with self._lock:
            return bool(
                self._db.execute(
                    "DELETE FROM create_keys WHERE owner = ? AND key = ? AND sandbox_id = ?"
                    " AND adopted = 0",
                    (owner, key, sandbox_id),
                ).rowcount
            )

    def forget(self, owner: str, key: str) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM create_keys WHERE owner = ? AND key = ? AND sandbox_id IS NULL",
                (owner, key),
            )

    def expire(self, before: float) -> int:
        with self._lock:
            return int(
                self._db.execute("DELETE FROM create_keys WHERE claimed_at < ?", (before,)).rowcount
            )
