"""The trajectory log: a durable, per-sandbox, globally ordered record of state-changing calls.

Every state-changing request to a sandbox (exec, file write, upload, snapshot...) carries a
per-sandbox **sequence number** ``seq`` (1, 2, 3, ... set by the SDK) and/or an
**idempotency key**. The edge asks the log before running anything::

    b = log.begin(sandbox_id, seq=7, idem_key=None, op="exec", request=req_dict)
    if b.kind == "replay":            # already ran: answer with the recorded result
        return b.result               # (or re-raise b.error for a recorded failure)
    if b.kind == "unknown":           # begun before a crash, never committed
        raise OutcomeUnknown(...)     # b.unknown_error() builds it; never re-run silently
    t0 = time.monotonic()
    result = await run(...)
    log.commit(sandbox_id, b.seq, result, {"run_ms": ...})   # durable before the reply

Rules ``begin`` enforces (``last`` is the sandbox's highest recorded ``seq``, 0 at first):

* ``seq == last + 1``: new entry, status ``pending``; the caller runs it and commits.
* ``seq <= last`` with the *same request digest*: ``replay`` (committed) or ``unknown``
  (still pending: the edge died while running it, or it is running right now).
* ``seq <= last`` with a different request: :class:`SequenceConflict`.
* ``seq > last + 1``: :class:`SequenceGap` (details carry ``expected_seq``).
* an idempotency key seen before: same as a repeat of that entry's ``seq``.
* neither ``seq`` nor key: the entry takes ``last + 1`` (so a client that numbers its calls
  must number all of them).

Every entry also gets ``gidx``, a node-wide, strictly increasing index (SQLite
``AUTOINCREMENT``: never reused, even after deletes), which orders entries across sandboxes.

Durability: one SQLite database in WAL mode. Each ``begin``/``commit`` is one transaction,
committed before the call returns. With ``synchronous=NORMAL`` (default) a committed entry
survives the edge process being killed (``kill -9``) at any point; ``synchronous=FULL``
also survives power loss at ~the cost of an fsync per call. A crash mid-transaction rolls
back that transaction and nothing else: the log is never torn.

Digests: the request digest is the sha256 of its canonical JSON (sorted keys, no spaces),
where ``bytes`` values are hashed in full. Stored requests keep ``bytes`` values up to
``inline_bytes`` (base64); larger ones are stored as their digest only (replay reports them as
not reproducible). Exports replace any string or bytes value longer than
``export_inline_bytes`` by ``{"$sha256": hex, "size": n}``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dsec.canonical import canonical_digest, json_default
from dsec.errors import (
    DsecError,
    InvalidRequest,
    OutcomeUnknown,
    SequenceConflict,
    SequenceGap,
    error_from_wire,
)

__all__ = [
    "FORMAT",
    "Begin",
    "OutcomeUnknown",
    "SequenceConflict",
    "SequenceGap",
    "TrajectoryLog",
    "canonical_digest",
    "digest_value",
    "jsonable",
]

FORMAT = "dsec-trajectory/1"
"""The ``format`` field of an exported log's header line."""

DEFAULT_INLINE_BYTES = 64 * 1024
"""Largest ``bytes`` request value stored in full (bytes); larger ones keep only a digest."""

DEFAULT_EXPORT_INLINE_BYTES = 4 * 1024
"""Longest string/bytes value written as-is to a JSONL export (bytes); longer: a digest."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectory (
    gidx INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    idem_key TEXT,
    op TEXT NOT NULL,
    request TEXT NOT NULL,
    request_digest TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'ok', 'error')),
    result TEXT,
    timings TEXT,
    begun_at REAL NOT NULL,
    committed_at REAL,
    UNIQUE (sandbox_id, seq)
);
CREATE UNIQUE INDEX IF NOT EXISTS trajectory_idem
    ON trajectory (sandbox_id, idem_key) WHERE idem_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS trajectory_head (
    sandbox_id TEXT PRIMARY KEY,
    last_seq INTEGER NOT NULL
);
"""


def digest_value(value: str | bytes) -> str:
    """sha256 hex of a string (UTF-8) or bytes: the digest exports use for large values."""
    data = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(data).hexdigest()


def jsonable(value: Any, inline_bytes: int = DEFAULT_INLINE_BYTES) -> Any:
    """``value`` made JSON-safe for storage: ``bytes`` up to ``inline_bytes`` become
    ``{"$b64": ...}``, larger ones ``{"$sha256": hex, "size": n}``; pydantic models dump."""
    if isinstance(value, dict):
        return {str(k): jsonable(v, inline_bytes) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v, inline_bytes) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        b = bytes(value)
        if len(b) <= inline_bytes:
            return {"$b64": base64.b64encode(b).decode()}
        return {"$sha256": hashlib.sha256(b).hexdigest(), "size": len(b)}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json_default(value)


def _shrink(value: Any, limit: int) -> Any:
    """Replace strings/base64 blobs longer than ``limit`` bytes by their digest (for export)."""
    if isinstance(value, str):
        raw = value.encode()
        if len(raw) > limit:
            return {"$sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
        return value
    if isinstance(value, dict):
        if set(value) == {"$b64"} and isinstance(value["$b64"], str):
            raw = base64.b64decode(value["$b64"])
            if len(raw) > limit:
                return {"$sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
            return value
        return {k: _shrink(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_shrink(v, limit) for v in value]
    return value


@dataclass(frozen=True)
class Begin:
    """What :meth:`TrajectoryLog.begin` decided.

    Attributes:
        kind: ``"new"`` (run it, then :meth:`TrajectoryLog.commit`), ``"replay"`` (already
            ran: answer with ``result`` or re-raise ``error``), ``"unknown"`` (begun, never
            committed: do not run; answer with :meth:`unknown_error`).
        sandbox_id: the sandbox.
        seq: the entry's sequence number (assigned when the caller gave none).
        gidx: the entry's node-wide global index.
        op: the recorded operation name.
        status: ``"pending"``, ``"ok"`` or ``"error"``.
        result: the recorded result (``replay`` with status ``ok``), else None.
        error: the recorded error (``replay`` with status ``error``), rebuilt as a
            :class:`~dsec.errors.DsecError`, else None.
        begun_at: when the entry was first begun (Unix seconds).
    """

    kind: Literal["new", "replay", "unknown"]
    sandbox_id: str
    seq: int
    gidx: int
    op: str
    status: str
    result: dict[str, Any] | None = None
    error: DsecError | None = None
    begun_at: float = 0.0
    timings: dict[str, Any] = field(default_factory=dict)

    def unknown_error(self) -> OutcomeUnknown:
        """The error to answer a repeat of an entry whose outcome was never recorded."""
        return OutcomeUnknown(
            f"request seq={self.seq} ({self.op}) on sandbox {self.sandbox_id} was started at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(self.begun_at))} but its result "
            "was never recorded (the edge stopped while it ran, or it is still running); "
            "it will not be run again: inspect the sandbox and continue with the next seq",
            sandbox_id=self.sandbox_id,
            seq=self.seq,
            op=self.op,
            status="unknown",
            expected_seq=self.seq + 1,
        )


class TrajectoryLog:
    """The node's trajectory log (SQLite, WAL). Thread-safe; every method is synchronous and
    returns after its transaction committed.

    Args:
        path: the database file (created with its directory).
        synchronous: SQLite ``synchronous`` level: ``"NORMAL"`` survives process crashes,
            ``"FULL"`` also power loss.
        inline_bytes: largest ``bytes`` request value stored in full, bytes.
    """

    def __init__(
        self,
        path: Path,
        *,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise InvalidRequest(f"synchronous must be NORMAL or FULL, not {synchronous!r}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.inline_bytes = inline_bytes
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(_SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(trajectory)")}
        if "replays" not in columns:  # a log written before replays were counted
            self._db.execute("ALTER TABLE trajectory ADD COLUMN replays INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ writes
    def begin(
        self,
        sandbox_id: str,
        seq: int | None,
        idem_key: str | None,
        op: str,
        request: Mapping[str, Any],
    ) -> Begin:
        """Record that ``op`` is about to run, or find it already recorded. See the module doc.

        Raises:
            InvalidRequest: ``seq`` < 1, an empty ``op`` or an over-long key.
            SequenceGap: ``seq`` > next expected (``details["expected_seq"]``).
            SequenceConflict: ``seq`` or ``idem_key`` reused for a different request.
        """
        if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 1):
            raise InvalidRequest(f"seq must be an integer >= 1, not {seq!r}", seq=seq)
        if not op:
            raise InvalidRequest("op must be a non-empty string")
        if idem_key is not None and not 1 <= len(idem_key) <= 256:
            raise InvalidRequest("idempotency key must be 1..256 characters")
        digest = canonical_digest(request)
        with self._lock:
            existing = None
            if idem_key is not None:
                existing = self._db.execute(
                    "SELECT gidx, seq, op, request_digest, status, result, timings, begun_at "
                    "FROM trajectory WHERE sandbox_id=? AND idem_key=?",
                    (sandbox_id, idem_key),
                ).fetchone()
                if existing is not None and seq is not None and existing[1] != seq:
                    raise SequenceConflict(
                        f"idempotency key {idem_key!r} was used for seq={existing[1]}, not "
                        f"seq={seq}, on sandbox {sandbox_id}",
                        sandbox_id=sandbox_id,
                        seq=seq,
                        idem_key=idem_key,
                        recorded_seq=existing[1],
                    )
            if existing is None and seq is not None:
                existing = self._db.execute(
                    "SELECT gidx, seq, op, request_digest, status, result, timings, begun_at "
                    "FROM trajectory WHERE sandbox_id=? AND seq=?",
                    (sandbox_id, seq),
                ).fetchone()
            if existing is not None:
                return self._repeat(sandbox_id, seq, idem_key, op, digest, existing)
            last = self._last_seq(sandbox_id)
            if seq is None:
                seq = last + 1
            elif seq > last + 1:
                raise SequenceGap(
                    f"sandbox {sandbox_id} expected seq={last + 1} but got seq={seq}: "
                    f"{seq - last - 1} request(s) in between never reached the edge",
                    sandbox_id=sandbox_id,
                    seq=seq,
                    expected_seq=last + 1,
                )
            elif seq <= last:  # only after purge(): the entry is gone
                raise SequenceConflict(
                    f"sandbox {sandbox_id} has no record of seq={seq} (purged); next is {last + 1}",
                    sandbox_id=sandbox_id,
                    seq=seq,
                    expected_seq=last + 1,
                )
            stored = json.dumps(jsonable(dict(request), self.inline_bytes), separators=(",", ":"))
            now = time.time()
            cur = self._db.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                cur.execute(
                    "INSERT INTO trajectory (sandbox_id, seq, idem_key, op, request, "
                    "request_digest, status, begun_at) VALUES (?,?,?,?,?,?,'pending',?)",
                    (sandbox_id, seq, idem_key, op, stored, digest, now),
                )
                gidx = int(cur.lastrowid or 0)
                cur.execute(
                    "INSERT INTO trajectory_head (sandbox_id, last_seq) VALUES (?, ?) "
                    "ON CONFLICT(sandbox_id) DO UPDATE SET last_seq=excluded.last_seq",
                    (sandbox_id, seq),
                )
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        return Begin("new", sandbox_id, seq, gidx, op, "pending", begun_at=now)

    def _repeat(
        self,
        sandbox_id: str,
        seq: int | None,
        idem_key: str | None,
        op: str,
        digest: str,
        row: tuple[Any, ...],
    ) -> Begin:
        gidx, rseq, rop, rdigest, status, result, timings, begun_at = row
        if rdigest != digest or rop != op:
            what = f"idempotency key {idem_key!r}" if idem_key is not None else f"seq={seq}"
            raise SequenceConflict(
                f"{what} on sandbox {sandbox_id} was already used for a different request "
                f"(recorded {rop} with digest {rdigest[:12]}, got {op} with digest {digest[:12]})",
                sandbox_id=sandbox_id,
                seq=rseq,
                idem_key=idem_key,
                expected_seq=self._last_seq(sandbox_id) + 1,
                recorded_op=rop,
                recorded_digest=rdigest,
                request_digest=digest,
            )
        tim = json.loads(timings) if timings else {}
        if status == "pending":
            return Begin("unknown", sandbox_id, rseq, gidx, rop, status, begun_at=begun_at)
        payload = json.loads(result) if result else {}
        self._db.execute("UPDATE trajectory SET replays = replays + 1 WHERE gidx=?", (gidx,))
        if status == "error":
            err = error_from_wire(409, payload)
            return Begin("replay", sandbox_id, rseq, gidx, rop, status, None, err, begun_at, tim)
        return Begin("replay", sandbox_id, rseq, gidx, rop, status, payload, None, begun_at, tim)

    def commit(
        self,
        sandbox_id: str,
        seq: int,
        result: Mapping[str, Any],
        timings: Mapping[str, Any] | None = None,
        *,
        status: Literal["ok", "error"] = "ok",
    ) -> None:
        """Record the result of a begun entry, durably.

        Args:
            result: the answer (for ``status="error"``: ``DsecError.to_wire()``).
            timings: e.g. ``{"run_ms": 12.5}`` (any JSON).
            status: ``"ok"`` or ``"error"`` (a recorded error is replayed as the same error).

        Raises:
            InvalidRequest: no pending entry ``(sandbox_id, seq)`` (never begun, or already
                committed).
        """
        if status not in ("ok", "error"):
            raise InvalidRequest(f"status must be ok or error, not {status!r}")
        res = json.dumps(jsonable(dict(result), self.inline_bytes), separators=(",", ":"))
        tim = json.dumps(jsonable(dict(timings or {})), separators=(",", ":"))
        with self._lock:
            cur = self._db.execute(
                "UPDATE trajectory SET status=?, result=?, timings=?, committed_at=? "
                "WHERE sandbox_id=? AND seq=? AND status='pending'",
                (status, res, tim, time.time(), sandbox_id, seq),
            )
            if cur.rowcount != 1:
                raise InvalidRequest(
                    f"no pending trajectory entry seq={seq} for sandbox {sandbox_id}",
                    sandbox_id=sandbox_id,
                    seq=seq,
                )

    def commit_error(self, sandbox_id: str, seq: int, error: DsecError) -> None:
        """Record that a begun entry failed with ``error`` (a repeat re-raises it)."""
        self.commit(sandbox_id, seq, error.to_wire(), status="error")

    def abort(self, sandbox_id: str, seq: int, error: DsecError) -> bool:
        """Undo a begun entry whose command certainly did not start (e.g. the sandbox was
        stopped), so the client may retry the same ``seq``. Only the sandbox's last entry
        can be removed; an earlier one is committed as ``error`` instead. Returns True if
        the entry was removed."""
        with self._lock:
            last = self._last_seq(sandbox_id)
            if seq == last:
                cur = self._db.cursor()
                cur.execute("BEGIN IMMEDIATE")
                try:
                    n = cur.execute(
                        "DELETE FROM trajectory WHERE sandbox_id=? AND seq=? AND status='pending'",
                        (sandbox_id, seq),
                    ).rowcount
                    if n:
                        cur.execute(
                            "UPDATE trajectory_head SET last_seq=? WHERE sandbox_id=?",
                            (seq - 1, sandbox_id),
                        )
                    cur.execute("COMMIT")
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                if n:
                    return True
        self.commit(sandbox_id, seq, error.to_wire(), status="error")
        return False

    def purge(self, sandbox_id: str) -> int:
        """Delete a sandbox's entries (retention). Its ``next_seq`` stays where it was, so an
        old seq is a conflict, never a silent re-run. Returns the number deleted."""
        with self._lock:
            return self._db.execute(
                "DELETE FROM trajectory WHERE sandbox_id=?", (sandbox_id,)
            ).rowcount

    # ------------------------------------------------------------------ reads
    def _last_seq(self, sandbox_id: str) -> int:
        row = self._db.execute(
            "SELECT last_seq FROM trajectory_head WHERE sandbox_id=?", (sandbox_id,)
        ).fetchone()
        return int(row[0]) if row else 0

    def next_seq(self, sandbox_id: str) -> int:
        """The sequence number the sandbox's next new request must carry (1 at first)."""
        with self._lock:
            return self._last_seq(sandbox_id) + 1

    def next_seqs(self, sandbox_ids: list[str]) -> dict[str, int]:
        """:meth:`next_seq` of many sandboxes in one query per 500 ids (list calls)."""
        out = dict.fromkeys(sandbox_ids, 1)
        with self._lock:
            for i in range(0, len(sandbox_ids), 500):
                chunk = sandbox_ids[i : i + 500]
                marks = ",".join("?" * len(chunk))
                for sid, last in self._db.execute(
                    f"SELECT sandbox_id, last_seq FROM trajectory_head WHERE sandbox_id IN ({marks})",
                    chunk,
                ):
                    out[sid] = int(last) + 1
        return out

    def starts(
        self, sandbox_id: str, last: int | None = None
    ) -> list[tuple[int, float, float | None]]:
        """``(seq, begun_at, committed_at)`` of the sandbox's entries (the ``last`` ones
        only, if given), in ``seq`` order (no payloads read; ``committed_at`` None while one
        runs)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, begun_at, committed_at FROM trajectory WHERE sandbox_id=? "
                "ORDER BY seq DESC LIMIT ?",
                (sandbox_id, -1 if last is None else last),
            ).fetchall()
        return [(int(r[0]), float(r[1] or 0), r[2]) for r in reversed(rows)]

    def entries(self, sandbox_id: str) -> Iterator[dict[str, Any]]:
        """The sandbox's entries in ``seq`` order, as stored (full results)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT gidx, seq, idem_key, op, request, request_digest, status, result, "
                "timings, begun_at, committed_at, replays FROM trajectory WHERE sandbox_id=? "
                "ORDER BY seq",
                (sandbox_id,),
            ).fetchall()
        for r in rows:
            yield {
                "gidx": r[0],
                "seq": r[1],
                "idem_key": r[2],
                "op": r[3],
                "request": json.loads(r[4]),
                "request_digest": r[5],
                "status": "unknown" if r[6] == "pending" else r[6],
                "result": json.loads(r[7]) if r[7] else None,
                "timings": json.loads(r[8]) if r[8] else {},
                "begun_at": r[9],
                "committed_at": r[10],
                "replays": r[11],
            }

    def export_jsonl(
        self,
        sandbox_id: str,
        *,
        header: Mapping[str, Any] | None = None,
        inline_bytes: int = DEFAULT_EXPORT_INLINE_BYTES,
    ) -> Iterator[str]:
        """The sandbox's log as JSONL lines (each ending in a newline).

        The first line is a header ``{"type": "header", "format": FORMAT, "sandbox_id",
        ...header}`` (the edge passes the sandbox's create request there, so ``dsec replay``
        can make a fresh one). Then one ``{"type": "entry", ...}`` line per entry in ``seq``
        order with ``gidx``, ``seq``, ``idem_key``, ``op``, ``request``, ``request_digest``,
        ``status`` (``ok`` | ``error`` | ``unknown``), ``result``, ``timings``,
        ``exit_code`` (exec only), ``begun_at``, ``committed_at``, ``replays`` (how many
        repeats were answered from the log instead of running); values longer than
        ``inline_bytes`` are replaced by ``{"$sha256", "size"}``; exec results also carry
        ``stdout_sha256``/``stderr_sha256`` so digests can always be compared.
        """
        head = {"type": "header", "format": FORMAT, "sandbox_id": sandbox_id}
        head.update(jsonable(dict(header or {})))
        yield json.dumps(head, separators=(",", ":")) + "\n"
        for e in self.entries(sandbox_id):
            res = e["result"]
            line: dict[str, Any] = {"type": "entry", **e}
            if isinstance(res, dict) and "exit_code" in res:
                line["exit_code"] = res.get("exit_code")
                for stream in ("stdout", "stderr"):
                    if isinstance(res.get(stream), str):
                        line[f"{stream}_sha256"] = digest_value(res[stream])
            line["request"] = _shrink(e["request"], inline_bytes)
            line["result"] = _shrink(res, inline_bytes)
            yield json.dumps(line, separators=(",", ":")) + "\n"

    def stats(self) -> dict[str, int]:
        """Counts for metrics: entries by status and the highest ``gidx``."""
        with self._lock:
            rows = self._db.execute(
                "SELECT status, COUNT(*) FROM trajectory GROUP BY status"
            ).fetchall()
            top = self._db.execute("SELECT MAX(gidx) FROM trajectory").fetchone()[0]
        out = {str(s): int(n) for s, n in rows}
        out["max_gidx"] = int(top or 0)
        return out
