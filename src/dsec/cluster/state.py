"""Cluster state in PostgreSQL: nodes, the sandbox registry, jobs, API keys, migrations.

Embedded mode keeps this in SQLite on the one node; in cluster mode every apiserver
replica reads and writes the same PostgreSQL database, so replicas stay stateless. The
edges stay the authority on what runs on their node: the registry here is what the
apiserver replicas learned (creations, kills, migrations, node reports), used to list
sandboxes of lost nodes, to answer job queries, and to report lost sandboxes.

Tables (created on first connect, idempotent)::

    dsec_nodes       name, ray_node_id, state ('alive' | 'lost'), last_seen (unix s), info
    dsec_sandboxes   id, node, owner, tier, state, job, labels, info (last SandboxInfo JSON),
                     stopped_reason, created_at, updated_at (unix s)
    dsec_jobs        owner, job, created_at
    dsec_api_keys    sha256, owner, name, created_at, quota (JSONB: a KeyQuota)
    dsec_migrations  id, owner, from_id, to_id, from_node, to_node, method, state,
                     started_at, finished_at, error
    dsec_create_keys owner, key, fingerprint, sandbox_id, claimed_at, adopted
                     (idempotent creations: :class:`PgCreateKeys`)

One connection per :class:`ClusterState`, guarded by a lock (calls are short; the async
callers run them in a thread with :func:`asyncio.to_thread`). Writes are batched
(:meth:`ClusterState.record_sandboxes`: one statement for many sandboxes). A row's
``info`` is the description of its last state change: the registry follows states
(creations, pauses, stops), not every field of a live sandbox (docs/design/cluster.md).
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.edge.createkeys import KeyRow
from dsec.edge.quotas import UNLIMITED
from dsec.errors import ServiceUnavailable
from dsec.models import KeyQuota, SandboxInfo

if TYPE_CHECKING:
    from dsec.apiserver.auth import KeyRecord

__all__ = ["ClusterState", "PgCreateKeys", "PgKeyStore", "connect_database"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS dsec_nodes (
    name TEXT PRIMARY KEY,
    ray_node_id TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL,
    info JSONB NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS dsec_sandboxes (
    id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    owner TEXT NOT NULL,
    tier TEXT NOT NULL,
    state TEXT NOT NULL,
    job TEXT,
    labels JSONB NOT NULL DEFAULT '{}',
    info JSONB NOT NULL,
    stopped_reason TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS dsec_sandboxes_owner ON dsec_sandboxes (owner, state);
CREATE INDEX IF NOT EXISTS dsec_sandboxes_node ON dsec_sandboxes (node, state);
CREATE INDEX IF NOT EXISTS dsec_sandboxes_job ON dsec_sandboxes (owner, job);
CREATE TABLE IF NOT EXISTS dsec_jobs (
    owner TEXT NOT NULL,
    job TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (owner, job)
);
CREATE TABLE IF NOT EXISTS dsec_api_keys (
    sha256 TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL DEFAULT '',
    created_at DOUBLE PRECISION NOT NULL
);
ALTER TABLE dsec_api_keys ADD COLUMN IF NOT EXISTS quota JSONB NOT NULL DEFAULT '{}';
CREATE TABLE IF NOT EXISTS dsec_migrations (
    id BIGSERIAL PRIMARY KEY,
    owner TEXT NOT NULL,
    from_id TEXT NOT NULL,
    to_id TEXT,
    from_node TEXT NOT NULL,
    to_node TEXT,
    method TEXT NOT NULL,
    state TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    finished_at DOUBLE PRECISION,
    error TEXT
);
CREATE TABLE IF NOT EXISTS dsec_create_keys (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    sandbox_id TEXT,
    claimed_at DOUBLE PRECISION NOT NULL,
    adopted BOOLEAN NOT NULL DEFAULT false,
    PRIMARY KEY (owner, key)
);
"""

_LIVE_STATES = ("creating", "running", "paused")


def connect_database(dsn: str, *, timeout_s: float = 10.0) -> Any:
    """Open a PostgreSQL connection (autocommit) or raise ``ServiceUnavailable`` within
    about ``timeout_s`` seconds with the reason (bad DSN, refused, auth)."""
    try:
        import psycopg
    except ImportError as e:  # pragma: no cover - the cluster extra installs it
        raise ServiceUnavailable(
            "cluster mode needs psycopg: pip install 'dsec[cluster]'", missing="psycopg"
        ) from e
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=max(1, int(timeout_s)))
    except psycopg.Error as e:
        raise ServiceUnavailable(
            f"cannot connect to the cluster database: {str(e).strip()}", database=_redact(dsn)
        ) from None


def _redact(dsn: str) -> str:
    """The DSN without its password (for error messages and logs)."""
    import re

    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", re.sub(r"password=\S+", "password=***", dsn))


class ClusterState:
    """The cluster registry in PostgreSQL. Thread-safe (one locked connection).

    Args:
        dsn: a libpq connection string or ``postgresql://`` URL.
        connect_timeout_s: how long connecting may take, seconds.
    """

    def __init__(self, dsn: str, *, connect_timeout_s: float = 10.0) -> None:
        self.dsn = dsn
        self._connect_timeout_s = connect_timeout_s
        self._lock = threading.Lock()
        self._jobs_seen: set[tuple[str, str]] = set()  # (owner, job) rows known to exist
        self._conn = connect_database(dsn, timeout_s=connect_timeout_s)
        with self._cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(74210917)")  # replicas create the schema once
            try:
                cur.execute(_SCHEMA)
            finally:
                cur.execute("SELECT pg_advisory_unlock(74210917)")

    def close(self) -> None:
        with self._lock, contextlib.suppress(Exception):
            self._conn.close()

    @contextlib.contextmanager
    def _cursor(self, *, wait_s: float | None = None, reconnect: bool = True) -> Iterator[Any]:
        """The connection's cursor, under its lock. ``wait_s``: how long to wait for the
        lock (None: as long as it takes), ``reconnect=False``: a dropped connection is not
        reconnected here; both raise ``ServiceUnavailable`` instead of waiting (for callers
        on an event loop)."""
        import psycopg

        if not self._lock.acquire(timeout=-1 if wait_s is None else wait_s):
            raise ServiceUnavailable("the cluster database connection is busy")
        try:
            if self._conn.closed:  # reconnect once after a dropped connection
                if not reconnect:
                    raise ServiceUnavailable("the cluster database connection is down")
                self._conn = connect_database(self.dsn, timeout_s=self._connect_timeout_s)
            try:
                with self._conn.cursor() as cur:
                    yield cur
            except psycopg.OperationalError as e:
                with contextlib.suppress(Exception):
                    self._conn.close()
                raise ServiceUnavailable(f"cluster database error: {str(e).strip()}") from None
        finally:
            self._lock.release()

    # --- nodes -------------------------------------------------------------------------
    def upsert_node(self, name: str, ray_node_id: str, state: str, info: dict[str, Any]) -> None:
        """Record a node's membership state (``alive`` or ``lost``) and its last report."""
        with self._cursor() as cur:
            cur.execute(
                "INSERT INTO dsec_nodes (name, ray_node_id, state, last_seen, info) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (name) DO UPDATE SET "
                "ray_node_id = EXCLUDED.ray_node_id, state = EXCLUDED.state, "
                "last_seen = EXCLUDED.last_seen, info = EXCLUDED.info",
                (name, ray_node_id, state, time.time(), json.dumps(info)),
            )

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Every known node: name -> {ray_node_id, state, last_seen, info}."""
        with self._cursor() as cur:
            cur.execute("SELECT name, ray_node_id, state, last_seen, info FROM dsec_nodes")
            return {
                r[0]: {"ray_node_id": r[1], "state": r[2], "last_seen": r[3], "info": r[4]}
                for r in cur.fetchall()
            }

    def mark_node_lost(self, name: str, reason: str) -> int:
        """Mark a node lost and every live sandbox on it stopped with ``reason``.
        Returns how many sandboxes were marked."""
        now = time.time()
        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_nodes SET state = 'lost', last_seen = %s WHERE name = %s",
                (now, name),
            )
            cur.execute(
                "UPDATE dsec_sandboxes SET state = 'stopped', stopped_reason = %s, "
                "updated_at = %s WHERE node = %s AND state = ANY(%s)",
                (reason, now, name, list(_LIVE_STATES)),
            )
            return int(cur.rowcount or 0)

    # --- sandboxes ---------------------------------------------------------------------
    def record_sandbox(self, owner: str, info: SandboxInfo) -> None:
        """Insert or update one sandbox as an edge last described it."""
        self.record_sandboxes([(owner, info)])

    def record_sandboxes(self, items: list[tuple[str, SandboxInfo]]) -> None:
        """Insert or update sandboxes as their edges last described them: one statement
        for all of them (the last description of an id wins), and one more for jobs this
        connection has not recorded yet. A row whose state, stop reason and labels are
        already these is left as it is (the registry follows states, see the module doc)."""
        if not items:
            return
        now = time.time()
        rows = {info.id: (owner, info) for owner, info in items}
        cols: list[list[Any]] = [[] for _ in range(11)]
        for owner, info in rows.values():
            for col, value in zip(
                cols,
                (
                    info.id,
                    info.node,
                    owner,
                    info.tier,
                    info.state,
                    info.job,
                    json.dumps(info.labels),
                    info.model_dump_json(),
                    info.stopped_reason,
                    info.created_at.timestamp(),
                    now,
                ),
                strict=True,
            ):
                col.append(value)
        jobs = {(owner, info.job) for owner, info in rows.values() if info.job}
        with self._cursor() as cur:  # under the connection's lock: _jobs_seen too
            cur.execute(
                "INSERT INTO dsec_sandboxes (id, node, owner, tier, state, job, labels, info, "
                "stopped_reason, created_at, updated_at) "
                "SELECT i, n, o, t, s, j, l::jsonb, f::jsonb, r, c, u FROM unnest("
                "%s::text[], %s::text[], %s::text[], %s::text[], %s::text[], %s::text[], "
                "%s::text[], %s::text[], %s::text[], %s::float8[], %s::float8[]) "
                "AS x(i, n, o, t, s, j, l, f, r, c, u) "
                "ON CONFLICT (id) DO UPDATE SET state = EXCLUDED.state, info = EXCLUDED.info, "
                "labels = EXCLUDED.labels, stopped_reason = EXCLUDED.stopped_reason, "
                "updated_at = EXCLUDED.updated_at "
                # a description the registry already has (the report of a creation this or
                # another replica recorded) writes no row version
                "WHERE (dsec_sandboxes.state, dsec_sandboxes.stopped_reason, "
                "dsec_sandboxes.labels) IS DISTINCT FROM "
                "(EXCLUDED.state, EXCLUDED.stopped_reason, EXCLUDED.labels)",
                cols,
            )
            jobs -= self._jobs_seen
            if jobs:
                owners, names = zip(*sorted(jobs), strict=True)
                cur.execute(
                    "INSERT INTO dsec_jobs (owner, job, created_at) "
                    "SELECT o, j, %s FROM unnest(%s::text[], %s::text[]) AS x(o, j) "
                    "ON CONFLICT DO NOTHING",
                    (now, list(owners), list(names)),
                )
                if len(self._jobs_seen) > 100_000:
                    self._jobs_seen.clear()
                self._jobs_seen |= jobs

    def sync_node(
        self,
        node: str,
        live: dict[str, tuple[str, SandboxInfo]],
        asked_at: float | None = None,
    ) -> int:
        """Reconcile the registry with a node's report: ``live`` maps sandbox id ->
        (owner, info) of what runs there now. Registry rows of that node that are live here
        but absent from the report (and not written since ``asked_at``, see
        :meth:`stop_absent`) are marked stopped. Returns rows changed."""
        self.record_sandboxes(list(live.values()))
        return self.stop_absent(node, list(live), asked_at) + len(live)

    def apply_changes(
        self, node: str, changed: list[tuple[str, SandboxInfo]], gone: list[str]
    ) -> int:
        """What changed on ``node`` since the last sync: ``changed`` (owner, info) of
        sandboxes new or in another state there, ``gone`` ids no longer live there (marked
        stopped unless already). Returns rows written."""
        self.record_sandboxes(changed)
        if not gone:
            return len(changed)
        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_sandboxes SET state = 'stopped', "
                "stopped_reason = COALESCE(stopped_reason, 'gone from its node'), updated_at = %s "
                "WHERE node = %s AND id = ANY(%s) AND state = ANY(%s)",
                (time.time(), node, gone, list(_LIVE_STATES)),
            )
            return int(cur.rowcount or 0) + len(changed)

    def stop_absent(self, node: str, live_ids: list[str], asked_at: float | None = None) -> int:
        """Mark stopped the registry rows of ``node`` that are live here but not in
        ``live_ids`` (what runs there now): the reconcile that catches stops no replica
        recorded (a TTL, a stop between two reports). ``asked_at`` (unix s): when the
        node was asked; rows written since (a creation that answered meanwhile) are left
        alone. Returns rows changed."""
        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_sandboxes SET state = 'stopped', "
                "stopped_reason = COALESCE(stopped_reason, 'gone from its node'), updated_at = %s "
                "WHERE node = %s AND state = ANY(%s) AND updated_at < %s "
                "AND id NOT IN (SELECT unnest(%s::text[]))",  # a hashed anti-join
                (time.time(), node, list(_LIVE_STATES), asked_at or time.time(), live_ids),
            )
            return int(cur.rowcount or 0)

    def mark_stopped_many(self, sandbox_ids: list[str], reason: str) -> int:
        """Mark these sandboxes stopped (one statement). Returns rows changed."""
        if not sandbox_ids:
            return 0
        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_sandboxes SET state = 'stopped', "
                "stopped_reason = COALESCE(stopped_reason, %s), updated_at = %s "
                "WHERE id = ANY(%s) AND state <> 'stopped'",
                (reason, time.time(), sandbox_ids),
            )
            return int(cur.rowcount or 0)

    def mark_stopped(self, sandbox_id: str, reason: str) -> None:
        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_sandboxes SET state = 'stopped', stopped_reason = %s, updated_at = %s "
                "WHERE id = %s",
                (reason, time.time(), sandbox_id),
            )

    def sandbox(self, sandbox_id: str) -> tuple[str, SandboxInfo] | None:
        """(owner, info) of a sandbox as last recorded, or None."""
        with self._cursor() as cur:
            cur.execute(
                "SELECT owner, info, state, stopped_reason FROM dsec_sandboxes WHERE id = %s",
                (sandbox_id,),
            )
            row = cur.fetchone()
        return None if row is None else (row[0], _info(row[1], row[2], row[3]))

    def sandboxes(
        self,
        owner: str,
        *,
        nodes: list[str] | None = None,
        states: tuple[str, ...] | None = None,
        job: str | None = None,
    ) -> list[SandboxInfo]:
        """Recorded sandboxes of ``owner``, optionally only on ``nodes``/in ``states``/of ``job``."""
        sql = "SELECT info, state, stopped_reason FROM dsec_sandboxes WHERE owner = %s"
        args: list[Any] = [owner]
        if nodes is not None:
            sql += " AND node = ANY(%s)"
            args.append(nodes)
        if states is not None:
            sql += " AND state = ANY(%s)"
            args.append(list(states))
        if job is not None:
            sql += " AND job = %s"
            args.append(job)
        with self._cursor() as cur:
            cur.execute(sql + " ORDER BY created_at", args)
            return [_info(r[0], r[1], r[2]) for r in cur.fetchall()]

    def jobs(self, owner: str) -> list[str]:
        with self._cursor() as cur:
            cur.execute("SELECT job FROM dsec_jobs WHERE owner = %s ORDER BY job", (owner,))
            return [r[0] for r in cur.fetchall()]

    # --- migrations --------------------------------------------------------------------
    def begin_migration(self, owner: str, from_id: str, from_node: str, method: str) -> int:
        with self._cursor() as cur:
            cur.execute(
                "INSERT INTO dsec_migrations (owner, from_id, from_node, method, state, started_at)"
                " VALUES (%s, %s, %s, %s, 'running', %s) RETURNING id",
                (owner, from_id, from_node, method, time.time()),
            )
            row = cur.fetchone()
            return int(row[0])

    def end_migration(
        self,
        migration_id: int,
        *,
        to_id: str | None,
        to_node: str | None,
        error: str | None = None,
    ) -> None:
        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_migrations SET to_id = %s, to_node = %s, state = %s, "
                "finished_at = %s, error = %s WHERE id = %s",
                (
                    to_id,
                    to_node,
                    "failed" if error else "done",
                    time.time(),
                    error,
                    migration_id,
                ),
            )

    def migrations(self, owner: str) -> list[dict[str, Any]]:
        with self._cursor() as cur:
            cur.execute(
                "SELECT from_id, to_id, from_node, to_node, method, state, error "
                "FROM dsec_migrations WHERE owner = %s ORDER BY id",
                (owner,),
            )
            keys = ("from_id", "to_id", "from_node", "to_node", "method", "state", "error")
            return [dict(zip(keys, r, strict=True)) for r in cur.fetchall()]

    # --- API keys ----------------------------------------------------------------------
    def key_records(self) -> list[tuple[str, str]]:
        """(sha256, owner) of every key."""
        with self._cursor() as cur:
            cur.execute("SELECT sha256, owner FROM dsec_api_keys")
            return [(r[0], r[1]) for r in cur.fetchall()]

    def key_rows(self) -> list[tuple[str, str, str, float, dict[str, Any]]]:
        """(sha256, owner, name, created_at, quota) of every key, oldest first."""
        with self._cursor() as cur:
            cur.execute(
                "SELECT sha256, owner, name, created_at, quota FROM dsec_api_keys "
                "ORDER BY created_at"
            )
            return [
                (
                    r[0],
                    r[1],
                    r[2],
                    float(r[3]),
                    r[4] if isinstance(r[4], dict) else json.loads(r[4]),
                )
                for r in cur.fetchall()
            ]

    def key_quotas(self) -> dict[str, dict[str, Any]]:
        """owner -> stored quota of every key that has one."""
        with self._cursor() as cur:
            cur.execute("SELECT owner, quota FROM dsec_api_keys WHERE quota <> '{}'::jsonb")
            return {
                r[0]: (r[1] if isinstance(r[1], dict) else json.loads(r[1])) for r in cur.fetchall()
            }

    def set_key_quota(self, key_or_owner: str, quota: dict[str, Any]) -> bool:
        """Store a key's quota (given the key or its owner id); False if no such key."""
        from dsec.apiserver.auth import key_digest

        with self._cursor() as cur:
            cur.execute(
                "UPDATE dsec_api_keys SET quota = %s::jsonb WHERE owner = %s OR sha256 = %s",
                (json.dumps(quota), key_or_owner, key_digest(key_or_owner)),
            )
            return bool(cur.rowcount)

    def owner_usage(self, owner: str) -> tuple[int, float, int]:
        """``(sandboxes, cores, MiB)`` requested by ``owner``'s live sandboxes (one indexed
        query on ``(owner, state)``)."""
        with self._cursor() as cur:
            cur.execute(
                "SELECT count(*), COALESCE(sum((info->>'cpu')::float8), 0), "
                "COALESCE(sum((info->>'memory_mb')::bigint), 0) FROM dsec_sandboxes "
                "WHERE owner = %s AND state = ANY(%s)",
                (owner, list(_LIVE_STATES)),
            )
            row = cur.fetchone()
        return (int(row[0]), float(row[1]), int(row[2])) if row else (0, 0.0, 0)

    def key_owner(
        self, sha256: str, *, wait_s: float | None = None
    ) -> tuple[str, dict[str, Any]] | None:
        """The owner and stored quota of the key with this sha256, or None (one indexed
        lookup). With ``wait_s``: ``ServiceUnavailable`` rather than wait longer for the
        connection, or reconnect it."""
        with self._cursor(wait_s=wait_s, reconnect=wait_s is None) as cur:
            cur.execute("SELECT owner, quota FROM dsec_api_keys WHERE sha256 = %s", (sha256,))
            row = cur.fetchone()
            if row is None:
                return None
            return str(row[0]), (row[1] if isinstance(row[1], dict) else json.loads(row[1]))

    def add_key(
        self, sha256: str, owner: str, name: str, quota: dict[str, Any] | None = None
    ) -> None:
        with self._cursor() as cur:
            cur.execute(
                "INSERT INTO dsec_api_keys (sha256, owner, name, created_at, quota) VALUES "
                "(%s, %s, %s, %s, %s::jsonb) ON CONFLICT DO NOTHING",
                (sha256, owner, name, time.time(), json.dumps(quota or {})),
            )

    def remove_key(self, key_or_owner: str) -> bool:
        from dsec.apiserver.auth import key_digest

        digest = key_digest(key_or_owner)
        with self._cursor() as cur:
            cur.execute(
                "DELETE FROM dsec_api_keys WHERE owner = %s OR sha256 = %s", (key_or_owner, digest)
            )
            return bool(cur.rowcount)


def _parse_quotas(stored: dict[str, dict[str, Any]]) -> dict[str, KeyQuota]:
    out: dict[str, KeyQuota] = {}
    for owner, raw in stored.items():
        try:
            out[owner] = KeyQuota.model_validate(raw)
        except ValueError as e:
            log.error("dsec_api_keys: key %s has an invalid quota (%s)", owner, e)
    return out


def _info(raw: Any, state: str, stopped_reason: str | None) -> SandboxInfo:
    data = raw if isinstance(raw, dict) else json.loads(raw)
    data["state"] = state
    data["stopped_reason"] = stopped_reason
    if state == "stopped":
        data["expires_at"] = None
    return SandboxInfo.model_validate(data)


class PgCreateKeys:
    """The idempotency keys of creations, shared by every apiserver replica (a
    :class:`dsec.edge.createkeys.CreateKeyStore`; one statement per operation)."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    def claim(
        self, owner: str, key: str, fingerprint: str, now: float, stale: float
    ) -> KeyRow | None:
        with self.state._cursor() as cur:
            cur.execute(
                "INSERT INTO dsec_create_keys (owner, key, fingerprint, claimed_at) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (owner, key) DO UPDATE SET "
                "claimed_at = EXCLUDED.claimed_at, adopted = false "
                "WHERE dsec_create_keys.sandbox_id IS NULL "
                "AND dsec_create_keys.claimed_at < %s "
                "AND dsec_create_keys.fingerprint = EXCLUDED.fingerprint",
                (owner, key, fingerprint, now, stale),
            )
            if cur.rowcount:
                return None
            cur.execute(
                "SELECT fingerprint, sandbox_id, claimed_at, adopted FROM dsec_create_keys "
                "WHERE owner = %s AND key = %s",
                (owner, key),
            )
            r = cur.fetchone()
        if r is None:  # forgotten between the two statements: claim again
            return self.claim(owner, key, fingerprint, now, stale)
        return KeyRow(r[0], r[1], r[2], bool(r[3]))

    def touch(self, owner: str, key: str, now: float) -> None:
        with self.state._cursor() as cur:
            cur.execute(
                "UPDATE dsec_create_keys SET claimed_at = %s WHERE owner = %s AND key = %s "
                "AND sandbox_id IS NULL",
                (now, owner, key),
            )

    def settle(self, owner: str, key: str, sandbox_id: str, now: float) -> None:
        with self.state._cursor() as cur:
            cur.execute(
                "UPDATE dsec_create_keys SET sandbox_id = %s, claimed_at = %s "
                "WHERE owner = %s AND key = %s",
                (sandbox_id, now, owner, key),
            )

    def adopt(self, owner: str, key: str) -> str | None:
        with self.state._cursor() as cur:
            cur.execute(
                "UPDATE dsec_create_keys SET adopted = true WHERE owner = %s AND key = %s "
                "AND sandbox_id IS NOT NULL RETURNING sandbox_id",
                (owner, key),
            )
            r = cur.fetchone()
        return None if r is None else str(r[0])

    def abandon(self, owner: str, key: str, sandbox_id: str) -> bool:
        with self.state._cursor() as cur:
            cur.execute(
                "DELETE FROM dsec_create_keys WHERE owner = %s AND key = %s "
                "AND sandbox_id = %s AND NOT adopted",
                (owner, key, sandbox_id),
            )
            return bool(cur.rowcount)

    def forget(self, owner: str, key: str) -> None:
        with self.state._cursor() as cur:
            cur.execute(
                "DELETE FROM dsec_create_keys WHERE owner = %s AND key = %s AND sandbox_id IS NULL",
                (owner, key),
            )

    def expire(self, before: float) -> int:
        with self.state._cursor() as cur:
            cur.execute("DELETE FROM dsec_create_keys WHERE claimed_at < %s", (before,))
            return int(cur.rowcount or 0)


class PgKeyStore:
    """API keys shared by every apiserver replica (PostgreSQL), with the local
    :class:`~dsec.apiserver.auth.KeyStore` interface the apiserver and tests use.

    ``verify`` runs on the apiserver's event loop, so it never waits on the database for
    long. It answers from a copy of the keys that a background thread reloads every
    ``refresh_s`` seconds (a key revoked by another replica stops working within that time;
    while the database is down the last good copy stands). A key the copy does not know is
    looked up at once, so a key another replica just created works on its first request:
    one indexed query, which gives up after ``lookup_wait_s`` if the connection is busy and
    never reconnects a dropped one (that is the thread's job; meanwhile unknown keys are
    refused). A digest just found missing is not looked up again for ``miss_s`` seconds, and
    at most ``lookups_per_s`` lookups of unknown keys are made a second in all: a flood of
    made-up keys costs the database and the loop that much and no more.

    ``state`` should be this store's own :class:`ClusterState` (connection): the lookup
    then never waits behind the cluster edge's queries. On first start against an empty
    table a key is generated and written to ``home/api_key`` (mode 0600), like the embedded
    server does. :meth:`close` stops the reload thread.
    """

    _MAX_MISSES = 4096  # digests remembered as missing (oldest forgotten first)

    def __init__(
        self,
        state: ClusterState,
        home: Path,
        *,
        refresh_s: float = 2.0,
        miss_s: float = 1.0,
        lookups_per_s: float = 20.0,
        lookup_wait_s: float = 0.05,
    ) -> None:
        self.state = state
        self.home = home
        self.refresh_s = refresh_s
        self.miss_s = miss_s
        self.lookups_per_s = lookups_per_s
        self.lookup_wait_s = lookup_wait_s
        self._cache: list[tuple[str, str]] = []
        self._quotas: dict[str, KeyQuota] = {}
        self._db_ok = False
        self._budget = lookups_per_s
        self._budget_at = time.monotonic()
        self._refused_logged_at = 0.0
        self._misses: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._bootstrap()
        from dsec.apiserver.auth import owner_id

        key_file = self.home / "api_key"
        self._operator = owner_id(key_file.read_text().strip()) if key_file.exists() else None
        self._stop = threading.Event()
        self._reload()
        self._thread = threading.Thread(
            target=self._reload_loop, name="dsec-key-reload", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop reloading (idempotent); ``verify`` answers from the last copy after this."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.refresh_s + 15)

    def is_operator(self, owner: str) -> bool:
        """The operator is the key in this replica's ``$DSEC_HOME/api_key`` (the cluster's
        bootstrap key)."""
        return owner == self._operator

    def _bootstrap(self) -> None:
        from dsec.apiserver.auth import KeyStore

        if self.state.key_records():
            return
        local = KeyStore(self.home)  # reuses (and imports) the local first key if there is one
        key_file = self.home / "api_key"
        key = key_file.read_text().strip() if key_file.exists() else local.create_key("cluster")
        self._add(key, "cluster bootstrap")

    def _reload_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._reload()

    def _reload(self) -> None:
        try:
            records = self.state.key_records()
            quotas = _parse_quotas(self.state.key_quotas())
        except ServiceUnavailable as e:
            with self._lock:
                if self._db_ok:
                    log.warning("API keys: %s; answering from the last copy", e.message)
                self._db_ok = False
            return
        with self._lock:
            self._cache = records
            self._quotas = quotas
            self._db_ok = True

    def _add(self, key: str, name: str, quota: KeyQuota | None = None) -> None:
        from dsec.apiserver.auth import key_digest, owner_id

        digest = key_digest(key)
        owner = owner_id(key)
        stored = quota.model_dump(mode="json", exclude_defaults=True) if quota else {}
        self.state.add_key(digest, owner, name, stored)
        with self._lock:
            self._misses.pop(digest, None)
            self._cache = [*self._cache, (digest, owner)]
            if stored and quota is not None:
                self._quotas = {**self._quotas, owner: quota}

    def quota_of(self, owner: str) -> KeyQuota:
        """:class:`~dsec.edge.quotas.KeyQuotas`: ``owner``'s quota, from the copy (a quota
        set on another replica applies here within ``refresh_s``)."""
        with self._lock:
            return self._quotas.get(owner, UNLIMITED)

    def list(self) -> builtins.list[KeyRecord]:
        """Every key's record (owner ids and hashes, never keys); the operator's is the
        key in ``home/api_key``."""
        from dsec.apiserver.auth import KeyRecord

        return [
            KeyRecord(
                owner, sha, created, name, "operator" if owner == self._operator else "user", quota
            )
            for sha, owner, name, created, quota in self.state.key_rows()
        ]

    def set_quota(self, key_or_owner: str, quota: KeyQuota) -> None:
        """Replace a key's quota (the key or its owner id); ``KeyError`` if no such key."""
        if not self.state.set_key_quota(
            key_or_owner, quota.model_dump(mode="json", exclude_defaults=True)
        ):
            raise KeyError(key_or_owner)
        self._reload()

    def verify(self, key: str) -> str | None:
        from dsec.apiserver.auth import key_digest

        digest = key_digest(key)
        found = self._find(digest)
        if found is None:  # a key another replica just created, or a bad key
            found = self._look_up(digest)
        return found

    def _take_budget(self, now: float) -> bool:
        """One lookup of the ``lookups_per_s`` budget (a token bucket of one second's worth);
        False when it is spent. Under the lock."""
        self._budget = min(
            self.lookups_per_s, self._budget + (now - self._budget_at) * self.lookups_per_s
        )
        self._budget_at = now
        if self._budget < 1.0:
            if now - self._refused_logged_at > 10.0:
                self._refused_logged_at = now
                log.warning(
                    "API keys: over %.0f lookups of unknown keys a second; refusing unknown "
                    "keys without a lookup (a flood of bad keys?)",
                    self.lookups_per_s,
                )
            return False
        self._budget -= 1.0
        return True

    def _look_up(self, digest: str) -> str | None:
        now = time.monotonic()
        with self._lock:
            missed = self._misses.get(digest)
            if missed is not None and now - missed < self.miss_s:
                return None
            if not self._db_ok or not self._take_budget(now):
                return None
        try:
            found = self.state.key_owner(digest, wait_s=self.lookup_wait_s)
        except ServiceUnavailable:
            return None  # busy or down: the copy's answer stands (the thread reconnects)
        owner = found[0] if found is not None else None
        # its quota with it: a key created with limits is limited from its first request
        quota = _parse_quotas({found[0]: found[1]}) if found is not None and found[1] else {}
        with self._lock:
            if quota:
                self._quotas = {**self._quotas, **quota}
            if owner is None:
                self._misses[digest] = now
                self._misses.move_to_end(digest)
                while len(self._misses) > self._MAX_MISSES:
                    self._misses.popitem(last=False)
            else:
                self._misses.pop(digest, None)
                self._cache = [*self._cache, (digest, owner)]
        return owner

    def has_owner(self, owner: str) -> bool:
        """:class:`~dsec.apiserver.auth.KeyDirectory`: whether ``owner`` has a key (in the
        copy)."""
        with self._lock:
            return any(o == owner for _, o in self._cache)

    def _find(self, digest: str) -> str | None:
        import hmac

        with self._lock:
            records = self._cache
        found: str | None = None
        for sha, owner in records:  # constant time over all records
            if hmac.compare_digest(sha, digest):
                found = owner
        return found

    def create_key(self, name: str = "", *, quota: KeyQuota | None = None) -> str:
        """A new key (``quota``: its limits), stored (hashed) in the database; returned once
        in plaintext."""
        from dsec.apiserver.auth import generate_key

        key = generate_key()
        self._add(key, name, quota)
        return key

    def revoke(self, key_or_owner: str) -> bool:
        from dsec.apiserver.auth import key_digest

        ok = self.state.remove_key(key_or_owner)
        digest = key_digest(key_or_owner)
        with self._lock:  # at once on this replica; the others within refresh_s
            self._cache = [(d, o) for d, o in self._cache if d != digest and o != key_or_owner]
        return ok
