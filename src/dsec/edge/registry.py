"""The edge's durable record of sandboxes on this node (SQLite, WAL).

One row per sandbox: its request (a :class:`ResolvedRequest`, stored as it is), its runtime
handle (what ``recover()`` needs after a restart), its state and timestamps. Rows of stopped
sandboxes are kept for a while so a client that uses a killed sandbox gets
``SandboxStopped``, not ``NotFound``.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from dsec.edge.createkeys import SqliteCreateKeys
from dsec.models import CreateSandboxRequest
from dsec.wire import ANSWER

log = logging.getLogger("dsec.edge")


class ResolvedRequest(CreateSandboxRequest):
    """A create request as the edge made the sandbox: the image's defaults applied
    (:func:`dsec.edge.start.with_image_defaults`), so its ``workdir`` is known. The registry
    stores it as it is; the sandbox's info, its runtime spec, forks and migrations read it."""

    workdir: str = Field(  # resolved: never None
        "/", max_length=4096, description="default cwd of commands (the image's, else /)"
    )

    @classmethod
    def stored(cls, data: dict[str, Any]) -> ResolvedRequest:
        """A request as any dsec stored it: a field this one does not know is dropped, one
        it lacks (or no longer accepts the stored value of) gets its default."""
        try:
            return cls.model_validate(data, context=ANSWER)
        except ValidationError as e:
            bad = {err["loc"][0] for err in e.errors() if err["loc"]}
            if not bad:
                raise
            log.warning("stored request: %s replaced by defaults: %s", sorted(bad), e)
            kept = {k: v for k, v in data.items() if k not in bad}
            return cls.model_validate(kept, context=ANSWER)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    tier TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    image_layers TEXT NOT NULL,
    handle TEXT NOT NULL DEFAULT '{}',
    job TEXT,
    labels TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    last_active REAL NOT NULL,
    ttl_s REAL,
    stopped_reason TEXT,
    paused_at REAL,
    forked_from TEXT
);
CREATE INDEX IF NOT EXISTS sandboxes_owner_state ON sandboxes(owner, state);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
CREATE INDEX IF NOT EXISTS sandboxes_job ON sandboxes(job);
"""


@dataclass
class SandboxRow:
    id: str
    owner: str
    tier: str
    state: str
    request: ResolvedRequest
    image_layers: list[str]
    handle: dict[str, Any] = field(default_factory=dict)
    job: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0
    last_active: float = 0.0
    ttl_s: float | None = None
    stopped_reason: str | None = None
    paused_at: float | None = None
    forked_from: str | None = None  # the sandbox this one was forked from

    @property
    def expires_at(self) -> float | None:
        return None if self.ttl_s is None else self.last_active + self.ttl_s


class Registry:
    """Thread-safe SQLite store of :class:`SandboxRow`. Every write is committed before
    it returns, so a crash never loses a sandbox the client was told about."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
        if "forked_from" not in columns:  # a registry of an older dsec
            self._db.execute("ALTER TABLE sandboxes ADD COLUMN forked_from TEXT")

    def create_keys(self) -> SqliteCreateKeys:
        """The idempotency keys of creations, in this database (one lock, one connection)."""
        return SqliteCreateKeys(self._db, self._lock)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _row(r: tuple[Any, ...]) -> SandboxRow:
        return SandboxRow(
            id=r[0],
            owner=r[1],
            tier=r[2],
            state=r[3],
            request=ResolvedRequest.stored(json.loads(r[4])),
            image_layers=json.loads(r[5]),
            handle=json.loads(r[6]),
            job=r[7],
            labels=json.loads(r[8]),
            created_at=r[9],
            updated_at=r[10],
            last_active=r[11],
            ttl_s=r[12],
            stopped_reason=r[13],
            paused_at=r[14],
            forked_from=r[15],
        )

    _COLS = (
        "id, owner, tier, state, request, image_layers, handle, job, labels, "
        "created_at, updated_at, last_active, ttl_s, stopped_reason, paused_at, forked_from"
    )

    def insert(self, row: SandboxRow) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT INTO sandboxes ({self._COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    row.id,
                    row.owner,
                    row.tier,
                    row.state,
                    row.request.model_dump_json(),
                    json.dumps(row.image_layers),
                    json.dumps(row.handle),
                    row.job,
                    json.dumps(row.labels),
                    row.created_at,
                    row.updated_at,
                    row.last_active,
                    row.ttl_s,
                    row.stopped_reason,
                    row.paused_at,
                    row.forked_from,
                ),
            )

    def get(self, sandbox_id: str) -> SandboxRow | None:
        with self._lock:
            cur = self._db.execute(f"SELECT {self._COLS} FROM sandboxes WHERE id=?", (sandbox_id,))
            r = cur.fetchone()
        return self._row(r) if r else None

    def select(
        self,
        *,
        owner: str | None = None,
        states: tuple[str, ...] | None = None,
        job: str | None = None,
    ) -> list[SandboxRow]:
        q = f"SELECT {self._COLS} FROM sandboxes WHERE 1=1"
        args: list[Any] = []
        if owner is not None:
            q += " AND owner=?"
            args.append(owner)
        if states:
            q += f" AND state IN ({','.join('?' * len(states))})"
            args.extend(states)
        if job is not None:
            q += " AND job=?"
            args.append(job)
        q += " ORDER BY created_at"
        with self._lock:
            rows = self._db.execute(q, args).fetchall()
        return [self._row(r) for r in rows]

    def set_state(
        self,
        sandbox_id: str,
        state: str,
        *,
        handle: dict[str, Any] | None = None,
        reason: str | None = None,
        last_active: float | None = None,
    ) -> None:
        """Set ``state`` (and the handle, the stop reason, ``last_active`` when given) in
        one commit."""
        now = time.time()
        with self._lock:
            if last_active is not None:
                self._db.execute(
                    "UPDATE sandboxes SET state=?, handle=COALESCE(?, handle), updated_at=?, "
                    "last_active=?, stopped_reason=COALESCE(?, stopped_reason) WHERE id=?",
                    (
                        state,
                        json.dumps(handle) if handle is not None else None,
                        now,
                        last_active,
                        reason,
                        sandbox_id,
                    ),
                )
            elif handle is not None:
                self._db.execute(
                    "UPDATE sandboxes SET state=?, handle=?, updated_at=?, stopped_reason=COALESCE(?, stopped_reason) WHERE id=?",
                    (state, json.dumps(handle), now, reason, sandbox_id),
                )
            else:
                self._db.execute(
                    "UPDATE sandboxes SET state=?, updated_at=?, stopped_reason=COALESCE(?, stopped_reason) WHERE id=?",
                    (state, now, reason, sandbox_id),
                )

    def set_paused(self, sandbox_id: str, paused_at: float | None) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "UPDATE sandboxes SET state=?, paused_at=?, updated_at=?, last_active=? WHERE id=?",
                ("paused" if paused_at else "running", paused_at, now, now, sandbox_id),
            )

    def touch(self, sandbox_id: str, when: float | None = None) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE sandboxes SET last_active=? WHERE id=?", (when or time.time(), sandbox_id)
            )

    def set_request(self, sandbox_id: str, request: ResolvedRequest) -> None:
        """Replace the sandbox's stored request (what changed while it ran: its network
        policy), so a restarted edge, a fork and an export see the request in force."""
        with self._lock:
            self._db.execute(
                "UPDATE sandboxes SET request=?, updated_at=? WHERE id=?",
                (request.model_dump_json(), time.time(), sandbox_id),
            )

    def set_ttl(self, sandbox_id: str, ttl_s: float | None) -> None:
        now = time.time()
        with self._lock:
            self._db.execute(
                "UPDATE sandboxes SET ttl_s=?, last_active=?, updated_at=? WHERE id=?",
                (ttl_s, now, now, sandbox_id),
            )

    def expired(self, now: float) -> list[SandboxRow]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {self._COLS} FROM sandboxes WHERE state IN ('running','paused') "
                "AND ttl_s IS NOT NULL AND last_active + ttl_s < ?",
                (now,),
            ).fetchall()
        return [self._row(r) for r in rows]

    def remove(self, sandbox_id: str) -> None:
        """Forget one sandbox's row (whatever its state)."""
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))

    def purge_stopped(self, older_than: float) -> list[str]:
        """Forget stopped sandboxes last updated before ``older_than``; returns their ids."""
        with self._lock:
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT id FROM sandboxes WHERE state='stopped' AND updated_at < ?",
                    (older_than,),
                ).fetchall()
            ]
            self._db.execute(
                "DELETE FROM sandboxes WHERE state='stopped' AND updated_at < ?", (older_than,)
            )
        return ids

    def count_by(self) -> dict[tuple[str, str], int]:
        with self._lock:
            rows = self._db.execute(
                "SELECT tier, state, COUNT(*) FROM sandboxes GROUP BY tier, state"
            ).fetchall()
        return {(t, s): n for t, s, n in rows}
