"""``dsec replay LOG.jsonl``: re-run a sandbox's trajectory on a fresh sandbox, report divergences.

The input is what ``sb.trajectory()`` / :meth:`dsec.edge.trajectory.TrajectoryLog.export_jsonl`
writes: a header line (``{"type": "header", "format": "dsec-trajectory/1", "create": {...}}``)
then one entry per state-changing call, in ``seq`` order. Each entry is applied to the target
sandbox through the SDK and its outcome compared with the recorded one:

* ``exec``: ``exit_code``, ``timed_out`` and the sha256 of ``stdout`` (``stderr`` too when
  asked: ``fields=(..., "stderr")``; it often carries timings);
* file operations (``write_file``, ``remove_file``, ``make_dir``, ``rename_file``,
  ``upload_tar``): success or failure, the error code, and the written size;
* a recorded error must fail again with the same error code;
* ``snapshot``: run when the target has ``snapshot()``; its digest is not compared (file
  times differ), only success;
* entries whose outcome was never recorded (``status: unknown``) are applied but not compared;
  entries whose request content was too large to record (``{"$sha256": ...}`` in place of
  bytes) cannot be reproduced: reported, skipped.

Usage::

    report = await replay_lines(open("run.jsonl"), sandbox)      # an AsyncSandbox
    print(report.format_text()); sys.exit(0 if report.ok else 1)

    # or from scratch: a sandbox like the logged one
    header = read_header(lines)
    async with await AsyncSandbox.create(**create_kwargs(header)) as sb:
        report = await replay_lines(lines, sb)

The target is anything shaped like :class:`dsec.sdk.AsyncSandbox` (``commands.run``,
``files.write/remove/make_dir/rename/upload_dir``), so tests can pass a fake.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dsec.errors import DsecError, InvalidRequest

__all__ = [
    "DEFAULT_FIELDS",
    "Divergence",
    "ReplayReport",
    "ReplayTarget",
    "create_kwargs",
    "read_header",
    "replay_lines",
]

DEFAULT_FIELDS: tuple[str, ...] = ("exit_code", "timed_out", "stdout")
"""Exec result fields compared by default."""

_CREATE_KEYS = (
    "tier", "image", "layers", "cpu", "memory_mb", "disk_mb", "pids", "env", "user", "workdir",
)  # fmt: skip


class ReplayTarget(Protocol):
    """The part of :class:`dsec.sdk.AsyncSandbox` replay uses."""

    @property
    def commands(self) -> Any: ...
    @property
    def files(self) -> Any: ...


@dataclass
class Divergence:
    """One difference between the log and the replay.

    Attributes:
        seq: the entry's sequence number. op: its operation.
        field: what differs (``exit_code``, ``stdout``, ``error``, ``not_reproducible``...).
        expected: the recorded value (digests for output). actual: the replayed value.
    """

    seq: int
    op: str
    field: str
    expected: Any
    actual: Any


@dataclass
class ReplayReport:
    """The outcome of a replay: counts and every divergence, in ``seq`` order."""

    entries: int = 0
    applied: int = 0
    compared: int = 0
    matched: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every compared entry matched and nothing had to be skipped."""
        return not self.divergences

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def format_text(self) -> str:
        """A short human report (what ``dsec replay`` prints)."""
        lines = [
            f"{self.entries} entries, {self.applied} applied, {self.compared} compared, "
            f"{self.matched} matched, {len(self.divergences)} divergence(s)"
        ]
        for s in self.skipped:
            lines.append(f"  seq {s['seq']} {s['op']}: not compared ({s['reason']})")
        for d in self.divergences:
            lines.append(
                f"  seq {d.seq} {d.op}: {d.field} expected {d.expected!r}, got {d.actual!r}"
            )
        return "\n".join(lines)


def _sha(value: str | bytes) -> str:
    data = value.encode() if isinstance(value, str) else value
    return hashlib.sha256(data).hexdigest()


def _parse(lines: Iterable[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    header: dict[str, Any] = {}
    entries: list[dict[str, Any]] = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"line {n} of the log is not JSON: {e}", line=n) from e
        if not isinstance(obj, dict):
            raise InvalidRequest(f"line {n} of the log is not an object", line=n)
        if obj.get("type") == "header":
            header = obj
        elif obj.get("type") == "entry":
            entries.append(obj)
        elif obj.get("type") == "audit":
            continue  # a refusal recorded between calls (dsec.edge.audit): nothing to replay
        else:
            raise InvalidRequest(f"line {n}: unknown record type {obj.get('type')!r}", line=n)
    if header and not str(header.get("format", "")).startswith("dsec-trajectory/"):
        raise InvalidRequest(f"not a dsec trajectory log (format {header.get('format')!r})")
    entries.sort(key=lambda e: int(e.get("seq", 0)))
    return header, entries


def read_header(lines: Sequence[str]) -> dict[str, Any]:
    """The header record of an exported log ({} if it has none)."""
    return _parse(lines)[0]


def create_kwargs(header: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments for ``AsyncSandbox.create`` that rebuild the logged sandbox
    (from ``header["create"]``: tier, image, layers, cpu, memory, disk, pids, env, user,
    workdir; never its job, labels or TTL)."""
    create = header.get("create") or {}
    return {k: create[k] for k in _CREATE_KEYS if k in create}


def _bytes_of(value: Any) -> bytes | None:
    """Recorded bytes (``{"$b64"}``) or text; None when only a digest was kept."""
    if isinstance(value, dict):
        if "$b64" in value:
            return base64.b64decode(value["$b64"])
        return None
    if isinstance(value, str):
        return value.encode()
    if value is None:
        return b""
    return None


def _expected_stream(entry: dict[str, Any], result: dict[str, Any], name: str) -> str | None:
    if isinstance(entry.get(f"{name}_sha256"), str):
        return str(entry[f"{name}_sha256"])
    v = result.get(name)
    if isinstance(v, dict) and "$sha256" in v:
        return str(v["$sha256"])
    if isinstance(v, str):
        return _sha(v)
    return None


_OLD_OP_NAMES = {
    "write": "write_file",
    "remove": "remove_file",
    "mkdir": "make_dir",
    "rename": "rename_file",
}
"""Operation names an edge of an earlier version logged (now the edge's method names)."""


async def _apply(target: ReplayTarget, op: str, req: dict[str, Any]) -> dict[str, Any]:
    """Run one logged request; return a result dict comparable with the recorded one."""
    op = _OLD_OP_NAMES.get(op, op)
    if op == "exec":
        stdin: str | bytes | None = req.get("stdin")
        if req.get("stdin_b64") is not None:
            stdin = base64.b64decode(req["stdin_b64"])
        res = await target.commands.run(
            req["cmd"],
            cwd=req.get("cwd"),
            env=req.get("env") or None,
            timeout=req.get("timeout_s", 60.0),
            stdin=stdin,
            user=req.get("user"),
            max_output_bytes=req.get("max_output_bytes", 1 << 20),
        )
        return {
            "exit_code": res.exit_code,
            "timed_out": bool(res.timed_out),
            "stdout": res.stdout,
            "stderr": res.stderr,
        }
    if op == "write_file":
        data = _bytes_of(req.get("data"))
        if data is None:
            raise _NotReproducible("the written content was too large to record")
        info = await target.files.write(req["path"], data, mode=int(req.get("mode", 0o644)))
        return {"size": getattr(info, "size", len(data))}
    if op == "remove_file":
        await target.files.remove(req["path"], recursive=bool(req.get("recursive", False)))
        return {}
    if op == "make_dir":
        await target.files.make_dir(req["path"])
        return {}
    if op == "rename_file":
        await target.files.rename(req["src"], req["dst"])
        return {}
    if op == "upload_tar":
        data = _bytes_of(req.get("data"))
        if data is None:
            raise _NotReproducible("the uploaded tar was too large to record")
        with tempfile.TemporaryDirectory(prefix="dsec-replay-") as tmp:
            with tarfile.open(fileobj=io.BytesIO(data)) as tf:
                tf.extractall(tmp, filter="data")
            n = await target.files.upload_dir(tmp, req["path"])
        return {"files": n}
    if op == "snapshot":
        snap = getattr(target, "snapshot", None)
        if snap is None:
            raise _NotReproducible("the target cannot snapshot")
        await snap(**{k: v for k, v in req.items() if k in ("name", "scrub")})
        return {}
    raise _NotReproducible(f"unknown operation {op!r}")


class _NotReproducible(Exception):
    pass


def _compare(
    entry: dict[str, Any],
    live: dict[str, Any] | None,
    live_error: str | None,
    fields: Sequence[str],
) -> list[Divergence]:
    seq, op = int(entry["seq"]), str(entry["op"])
    recorded = entry.get("result") or {}
    out: list[Divergence] = []
    if entry.get("status") == "error":
        want = (recorded.get("error") or {}).get("code", "error")
        if live_error != want:
            out.append(Divergence(seq, op, "error", want, live_error or "no error"))
        return out
    if live_error is not None:
        return [Divergence(seq, op, "error", "no error", live_error)]
    assert live is not None
    if op == "exec":
        for f in fields:
            if f in ("stdout", "stderr"):
                want_digest = _expected_stream(entry, recorded, f)
                got_digest = _sha(live.get(f) or "")
                if want_digest is not None and want_digest != got_digest:
                    out.append(Divergence(seq, op, f"{f}_sha256", want_digest, got_digest))
            elif f in recorded and recorded.get(f) != live.get(f):
                out.append(Divergence(seq, op, f, recorded.get(f), live.get(f)))
    elif (
        _OLD_OP_NAMES.get(op, op) == "write_file"
        and "size" in recorded
        and recorded["size"] != live.get("size")
    ):
        out.append(Divergence(seq, op, "size", recorded["size"], live.get("size")))
    return out


async def replay_lines(
    lines: Iterable[str], target: ReplayTarget, *, fields: Sequence[str] = DEFAULT_FIELDS
) -> ReplayReport:
    """Apply every logged entry to ``target`` in ``seq`` order and compare outcomes.

    Args:
        lines: the JSONL export (a file object works).
        target: a fresh sandbox (an ``AsyncSandbox`` or anything shaped like it).
        fields: exec result fields to compare (``exit_code``, ``timed_out``, ``stdout``,
            ``stderr``).

    Returns:
        A :class:`ReplayReport`; ``report.ok`` is False if anything diverged.

    Raises:
        InvalidRequest: the input is not a dsec trajectory log.
    """
    _, entries = _parse(lines)
    report = ReplayReport(entries=len(entries))
    for entry in entries:
        seq, op = int(entry["seq"]), str(entry["op"])
        live: dict[str, Any] | None = None
        live_error: str | None = None
        try:
            live = await _apply(target, op, entry.get("request") or {})
        except _NotReproducible as e:
            report.skipped.append({"seq": seq, "op": op, "reason": str(e)})
            report.divergences.append(Divergence(seq, op, "not_reproducible", str(e), None))
            continue
        except DsecError as e:
            live_error = e.code
        report.applied += 1
        if entry.get("status") == "unknown":
            report.skipped.append({"seq": seq, "op": op, "reason": "outcome never recorded"})
            continue
        report.compared += 1
        diffs = _compare(entry, live, live_error, fields)
        if diffs:
            report.divergences.extend(diffs)
        else:
            report.matched += 1
    return report
