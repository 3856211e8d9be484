"""Test helpers shipped with dsec: an in-memory edge that speaks the real protocol.

:class:`FakeEdge` implements :class:`~dsec.edge.interface.EdgeAPI` without touching the
kernel: sandboxes are records in a dict, files live in memory, and ``exec`` runs nothing.
Put the real apiserver in front of it and point the SDK at the app through an httpx
transport, and your tests exercise the whole wire protocol hermetically (like
``httpx.MockTransport``)::

    from dsec import AsyncSandbox
    from dsec.testing import FakeEdge, app_transport

    async def test_my_agent() -> None:
        edge = FakeEdge()
        edge.program("pytest -q", stdout="1 passed\\n", exit_code=0)
        transport, key = app_transport(edge)
        async with await AsyncSandbox.create(api_key=key, transport=transport) as sb:
            result = await sb.commands.run("pytest -q")
        assert result.ok
        assert edge.calls_to("exec")[0]["req"].cmd == "pytest -q"

Exec behaviour, in order of precedence:

1. an error queued with :meth:`FakeEdge.inject_error` for the method is raised;
2. a command registered with :meth:`FakeEdge.program` returns its programmed result;
3. ``exec_handler`` (constructor argument) is called, if given;
4. a tiny built-in interpreter answers ``echo ARGS`` (prints ARGS), ``cat`` (prints
   stdin), ``true``, ``false`` and ``exit N``; anything else exits 127 with
   ``fake: <cmd>: command not programmed`` on stderr.

Every call is recorded in :attr:`FakeEdge.calls` as ``(method, {arg: value})``.

RL lifecycle, in memory but with the real rules:

* **Trajectory log**: state-changing calls (exec, file writes, mkdir, rename, remove, tar
  upload, snapshot) go through a real :class:`~dsec.edge.trajectory.TrajectoryLog` (an
  in-memory SQLite database unless ``trajectory_path`` is given), so sequence numbers,
  idempotency keys, fast-forward replays (``ExecResult.replayed``), gaps (after waiting
  ``gap_wait_s`` for late arrivals), conflicts and ``OutcomeUnknown`` behave as on a real
  edge. :attr:`FakeEdge.executed` counts what really ran (a replay does not).
* **Pause/resume**: states and ``paused_at``/``last_pause`` change (nothing is frozen; the
  report says ``method="fake"``); any request to a paused sandbox resumes it.
* **Snapshots and fork**: a snapshot copies the sandbox's files (minus ``scrub`` globs)
  into a new layer with a content digest; creating a sandbox with that layer restores the
  files. A file containing one of ``secret_values`` raises ``SecretInSnapshot``.
* **Jobs**: :func:`dsec.edge.jobs.for_each_sandbox` over the job's sandboxes.
"""

from __future__ import annotations

import asyncio
import base64
import fnmatch
import hashlib
import inspect
import io
import posixpath
import secrets
import shlex
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import dsec
from dsec.edge.jobs import create_batch, for_each_sandbox
from dsec.edge.trajectory import TrajectoryLog
from dsec.errors import (
    CapabilityNotSupported,
    Conflict,
    DsecError,
    FileExists_,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    LayerNotFound,
    QuotaExceeded,
    SandboxNotFound,
    SandboxStopped,
    SecretInSnapshot,
    SequenceGap,
    ServiceUnavailable,
    TierUnavailable,
)
from dsec.models import (
    SYSTEM_OWNER,
    TIERS,
    BatchCreateResult,
    BuildImageRequest,
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ForkRequest,
    ForkResult,
    ImageInfo,
    JobAction,
    JobActionResult,
    JobOutcome,
    LayerInfo,
    MigrateResult,
    NodeInfo,
    PauseReport,
    SandboxInfo,
    SnapshotRequest,
)

if TYPE_CHECKING:
    import httpx

__all__ = ["ExecHandler", "FakeEdge", "app_transport"]

ExecHandler = Callable[[SandboxInfo, ExecRequest], "ExecResult | Awaitable[ExecResult]"]
"""A function that answers one exec request for a fake sandbox."""

_FAKE_LAYER = "sha256:" + "0" * 64

T = TypeVar("T")

_NOT_STARTED = (SandboxStopped, ServiceUnavailable, QuotaExceeded)
"""Errors that prove a logged call never started: its log entry is undone (abort)."""


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class _FakeNode:
    """One in-memory file system entry."""

    type: str  # "file" | "dir" | "symlink"
    data: bytes = b""
    mode: int = 0o644
    mtime: float = field(default_factory=time.time)
    target: str | None = None


def _root_fs() -> dict[str, _FakeNode]:
    return {"/": _FakeNode("dir", mode=0o755)}


@dataclass
class _FakeSandbox:
    info: SandboxInfo
    owner: str
    request: CreateSandboxRequest
    fs: dict[str, _FakeNode] = field(default_factory=_root_fs)


def _norm(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute: {path!r}", path=path)
    norm = posixpath.normpath(path)
    return "/" if norm in ("/", "//") else norm


class FakeEdge:
    """An in-memory :class:`~dsec.edge.interface.EdgeAPI` for tests. See the module docstring.

    Args:
        node: node name used in sandbox ids (``sb-<node>-<hex>``).
        exec_handler: optional function answering exec requests not programmed with
            :meth:`program`.
        available_tiers: tiers reported as available; creating any other raises
            ``TierUnavailable``.
        chunk_delay_s: seconds to sleep between streamed output chunks.
        trajectory_path: SQLite file of the trajectory log (default: in memory).
        gap_wait_s: how long a sequence number that skips ahead waits for the missing
            ones before ``SequenceGap``, seconds.
        max_sandboxes: live sandboxes allowed per owner (``QuotaExceeded`` beyond;
            None: no limit).
    """

    def __init__(
        self,
        node: str = "fake",
        *,
        exec_handler: ExecHandler | None = None,
        available_tiers: tuple[str, ...] = ("fncall", "container"),
        chunk_delay_s: float = 0.0,
        trajectory_path: Path | None = None,
        gap_wait_s: float = 0.5,
        max_sandboxes: int | None = None,
    ) -> None:
        self.node = node
        self.exec_handler = exec_handler
        self.available_tiers = available_tiers
        self.chunk_delay_s = chunk_delay_s
        self.gap_wait_s = gap_wait_s
        self.max_sandboxes = max_sandboxes
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.trajectory = TrajectoryLog(trajectory_path or Path(":memory:"))
        self.executed: dict[str, int] = {}
        """Per operation, how many logged calls really ran (replays are not counted)."""
        self._running: dict[tuple[str, int], asyncio.Future[tuple[str, Any]]] = {}
        self._sandboxes: dict[str, _FakeSandbox] = {}
        self._snapshots: dict[str, dict[str, _FakeNode]] = {}
        self._programs: dict[str, ExecResult] = {}
        self._errors: dict[str, list[BaseException]] = {}
        created = _now()
        self._layers: dict[str, LayerInfo] = {
            _FAKE_LAYER: LayerInfo(
                digest=_FAKE_LAYER, kind="base", name="busybox", size=2 << 20, created_at=created
            )
        }
        # (owner, name) -> image; SYSTEM_OWNER's are the built-in ones, visible to every key
        self._images: dict[tuple[str, str], ImageInfo] = {
            (SYSTEM_OWNER, "busybox"): ImageInfo(
                name="busybox", layers=[_FAKE_LAYER], size=2 << 20, created_at=created
            )
        }
        self._grants: set[tuple[str, str]] = {(SYSTEM_OWNER, _FAKE_LAYER)}  # (owner, digest)

    # --- programming the fake ---------------------------------------------
    def program(
        self,
        cmd: str | list[str],
        *,
        stdout: str = "",
        stderr: str = "",
        exit_code: int | None = 0,
        **fields: Any,
    ) -> None:
        """Make ``exec`` of exactly ``cmd`` return this result (other ExecResult fields via kwargs)."""
        key = cmd if isinstance(cmd, str) else shlex.join(cmd)
        self._programs[key] = ExecResult(
            stdout=stdout, stderr=stderr, exit_code=exit_code, **fields
        )

    def inject_error(self, method: str, error: BaseException) -> None:
        """Raise ``error`` on the next call of ``method`` (e.g. ``"exec"``, ``"read_file"``)."""
        self._errors.setdefault(method, []).append(error)

    def calls_to(self, method: str) -> list[dict[str, Any]]:
        """The recorded arguments of every call to ``method``, oldest first."""
        return [args for name, args in self.calls if name == method]

    def _record(self, method: str, **args: Any) -> None:
        self.calls.append((method, args))
        queued = self._errors.get(method)
        if queued:
            raise queued.pop(0)

    def close(self) -> None:
        """Close the trajectory log (the fake is unusable afterwards)."""
        self.trajectory.close()

    def _get(self, sandbox_id: str, owner: str, *, running: bool = True) -> _FakeSandbox:
        """The sandbox; with ``running`` it must not be stopped, and a paused one resumes."""
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.owner != owner:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        if running and sb.info.state == "stopped":
            raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
        if running and sb.info.state == "paused":
            self._set_running(sb)  # any request resumes a paused sandbox
        return sb

    def _set_running(self, sb: _FakeSandbox) -> None:
        sb.info.state = "running"
        sb.info.paused_at = None
        sb.info.updated_at = _now()
        if sb.info.ttl_s:
            sb.info.expires_at = sb.info.updated_at + timedelta(seconds=sb.info.ttl_s)

    def _public(self, sb: _FakeSandbox) -> SandboxInfo:
        info = sb.info.model_copy(deep=True)
        info.next_seq = self.trajectory.next_seq(info.id)
        return info

    async def _logged(
        self,
        sb: _FakeSandbox,
        seq: int | None,
        idem_key: str | None,
        op: str,
        request: Mapping[str, Any],
        run: Callable[[], Awaitable[T]],
        encode: Callable[[T], dict[str, Any]],
        decode: Callable[[dict[str, Any]], T],
    ) -> T:
        """Run ``run`` under the trajectory log, exactly as the real edge does: a recorded
        repeat is decoded from the log (nothing runs), a repeat of a call still running
        waits for it, a gap waits ``gap_wait_s`` for the missing numbers."""
        sid = sb.info.id
        deadline = time.monotonic() + self.gap_wait_s
        while True:
            try:
                begin = self.trajectory.begin(sid, seq, idem_key, op, request)
                break
            except SequenceGap:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.005)
        if begin.kind == "replay":
            if begin.error is not None:
                raise begin.error
            return decode(begin.result or {})
        if begin.kind == "unknown":
            running = self._running.get((sid, begin.seq))
            if running is None:
                raise begin.unknown_error()
            status, payload = await asyncio.shield(running)
            if status == "error":
                raise payload
            return decode(payload)
        future: asyncio.Future[tuple[str, Any]] = asyncio.get_running_loop().create_future()
        self._running[(sid, begin.seq)] = future
        t0 = time.monotonic()
        try:
            result = await run()
        except _NOT_STARTED as e:
            self.trajectory.abort(sid, begin.seq, e)
            future.set_result(("error", e))
            raise
        except DsecError as e:
            self.trajectory.commit_error(sid, begin.seq, e)
            future.set_result(("error", e))
            raise
        except BaseException:
            future.set_result(("error", begin.unknown_error()))  # stays pending: unknown
            raise
        finally:
            self._running.pop((sid, begin.seq), None)
        payload = encode(result)
        self.trajectory.commit(sid, begin.seq, payload, {"run_ms": (time.monotonic() - t0) * 1e3})
        self.executed[op] = self.executed.get(op, 0) + 1
        future.set_result(("ok", payload))
        return result

    # --- sandboxes --------------------------------------------------------
    async def create_sandbox(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        self._record("create_sandbox", req=req, owner=owner)
        self._check_tier(req.tier)
        if req.tier not in self.available_tiers:
            raise TierUnavailable(f"tier {req.tier} is not available on this node", tier=req.tier)
        self._image(req.image, owner)
        fs = _root_fs()
        for ref in req.layers:
            digest = self._layer_digest(ref, owner)
            for path, node in self._snapshots.get(digest, {}).items():
                fs[path] = replace(node)
        self._admit(owner, 1)
        now = _now()
        sandbox_id = f"sb-{self.node}-{secrets.token_hex(4)}"
        info = SandboxInfo(
            id=sandbox_id,
            tier=req.tier,
            image=req.image,
            layers=list(req.layers),
            state="running",
            cpu=req.cpu,
            memory_mb=req.memory_mb,
            disk_mb=req.disk_mb,
            pids=req.pids,
            labels=dict(req.labels),
            job=req.job,
            user=req.user,
            workdir=req.workdir,
            node=self.node,
            created_at=now,
            updated_at=now,
            ttl_s=req.ttl_s,
            expires_at=now + timedelta(seconds=req.ttl_s) if req.ttl_s else None,
            on_timeout=req.on_timeout,
            paused_ttl_s=req.paused_ttl_s,
            network=req.network,
        )
        sb = _FakeSandbox(info=info, owner=owner, request=req.model_copy(deep=True), fs=fs)
        self._sandboxes[sandbox_id] = sb
        return self._public(sb)

    async def create_sandboxes(
        self, req: CreateSandboxRequest, n: int, owner: str, *, all_or_nothing: bool = False
    ) -> BatchCreateResult:
        self._record("create_sandboxes", req=req, n=n, owner=owner)
        self._check_tier(req.tier)
        if all_or_nothing:
            self._admit(owner, n)
        return await create_batch(
            n,
            lambda _i: self.create_sandbox(req, owner),
            lambda sid: self.kill_sandbox(sid, owner),
            all_or_nothing=all_or_nothing,
        )

    @staticmethod
    def _check_tier(tier: str) -> None:
        if tier not in TIERS:  # as the real edge: a tier this server does not know
            raise InvalidRequest(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")

    def _visible(self, digest: str, owner: str) -> bool:
        return (owner, digest) in self._grants or (SYSTEM_OWNER, digest) in self._grants

    def _image(self, name: str, owner: str) -> ImageInfo:
        """``owner``'s image ``name``, else the system's (as the real layer store)."""
        for who in (owner, SYSTEM_OWNER):
            if (who, name) in self._images:
                return self._images[(who, name)]
        raise ImageNotFound(f"no image {name}", image=name)

    def _layer_digest(self, ref: str, owner: str) -> str:
        if ref in self._layers and self._visible(ref, owner):
            return ref
        for layer in self._layers.values():
            if layer.name == ref and self._visible(layer.digest, owner):
                return layer.digest
        raise LayerNotFound(f"no layer {ref}", layer=ref)

    def _put_image(self, owner: str, image: ImageInfo) -> ImageInfo:
        if owner != SYSTEM_OWNER and (SYSTEM_OWNER, image.name) in self._images:
            raise Conflict(f"{image.name!r} is a system image", name=image.name)
        image = image.model_copy(update={"owner": owner or "system"})
        self._images[(owner, image.name)] = image
        self._grants.update((owner, d) for d in image.layers)
        return image

    def _admit(self, owner: str, n: int) -> None:
        if self.max_sandboxes is None:
            return
        alive = sum(
            1 for s in self._sandboxes.values() if s.owner == owner and s.info.state != "stopped"
        )
        if alive + n > self.max_sandboxes:
            raise QuotaExceeded(
                f"{alive} sandboxes alive, {n} more would exceed the limit of {self.max_sandboxes}",
                limit=self.max_sandboxes,
                alive=alive,
                requested=n,
            )

    async def get_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self._record("get_sandbox", sandbox_id=sandbox_id, owner=owner)
        return self._public(self._get(sandbox_id, owner, running=False))

    async def list_sandboxes(
        self,
        owner: str,
        *,
        state: str | None = None,
        labels: dict[str, str] | None = None,
        job: str | None = None,
        include_stopped: bool = False,
    ) -> list[SandboxInfo]:
        self._record(
            "list_sandboxes",
            owner=owner,
            state=state,
            labels=labels,
            job=job,
            include_stopped=include_stopped,
        )
        out = []
        for sb in self._sandboxes.values():
            info = sb.info
            if sb.owner != owner:
                continue
            if state is not None and info.state != state:
                continue
            if state is None and not include_stopped and info.state == "stopped":
                continue
            if job is not None and info.job != job:
                continue
            if labels and any(info.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(self._public(sb))
        return out

    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self._record("kill_sandbox", sandbox_id=sandbox_id, owner=owner)
        sb = self._get(sandbox_id, owner, running=False)
        if sb.info.state != "stopped":
            sb.info.state = "stopped"
            sb.info.stopped_reason = "killed"
            sb.info.paused_at = None
            sb.info.expires_at = None
            sb.info.updated_at = _now()
        return self._public(sb)

    async def set_ttl(self, sandbox_id: str, owner: str, ttl_s: float) -> SandboxInfo:
        self._record("set_ttl", sandbox_id=sandbox_id, owner=owner, ttl_s=ttl_s)
        sb = self._get(sandbox_id, owner)
        sb.info.ttl_s = ttl_s
        sb.info.updated_at = _now()
        sb.info.expires_at = sb.info.updated_at + timedelta(seconds=ttl_s)
        return self._public(sb)

    # --- exec -------------------------------------------------------------
    async def _answer(self, sb: _FakeSandbox, req: ExecRequest) -> ExecResult:
        key = req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)
        if key in self._programs:
            result = self._programs[key].model_copy()
        elif self.exec_handler is not None:
            answer = self.exec_handler(sb.info.model_copy(), req)
            result = await answer if inspect.isawaitable(answer) else answer
        else:
            result = _interpret(req)
        return _truncate(result, req.max_output_bytes)

    async def _exec_logged(
        self, sb: _FakeSandbox, req: ExecRequest, seq: int | None, idem_key: str | None
    ) -> ExecResult:
        return await self._logged(
            sb,
            seq,
            idem_key,
            "exec",
            req.model_dump(mode="json", exclude_defaults=True),  # as the real edge records it
            lambda: self._answer(sb, req),
            lambda r: r.model_dump(mode="json", exclude={"replayed"}),
            lambda d: ExecResult.model_validate({**d, "replayed": True}),
        )

    async def exec(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> ExecResult:
        self._record(
            "exec", sandbox_id=sandbox_id, owner=owner, req=req, seq=seq, idem_key=idem_key
        )
        return await self._exec_logged(self._get(sandbox_id, owner), req, seq, idem_key)

    async def exec_stream(
        self,
        sandbox_id: str,
        owner: str,
        req: ExecRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> AsyncIterator[ExecEvent]:
        self._record(
            "exec_stream", sandbox_id=sandbox_id, owner=owner, req=req, seq=seq, idem_key=idem_key
        )
        result = await self._exec_logged(self._get(sandbox_id, owner), req, seq, idem_key)
        for kind, text in (("stdout", result.stdout), ("stderr", result.stderr)):
            for line in text.splitlines(keepends=True):
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
                yield ExecEvent(type=kind, data=line)
        yield ExecEvent(type="exit", result=result)

    # --- files ------------------------------------------------------------
    def _fs_node(self, sb: _FakeSandbox, path: str) -> _FakeNode:
        node = sb.fs.get(path)
        if node is None:
            raise FileNotFound(f"no such file: {path}", path=path)
        return node

    def _info(self, path: str, node: _FakeNode) -> FileInfo:
        return FileInfo(
            path=path,
            name=posixpath.basename(path) or "/",
            type=node.type,
            size=len(node.data),
            mode=node.mode,
            mtime=node.mtime,
            target=node.target,
        )

    def _put(self, sb: _FakeSandbox, path: str, data: bytes, mode: int) -> FileInfo:
        parent = posixpath.dirname(path)
        parts = [p for p in parent.split("/") if p]
        cur = ""
        for p in parts:
            cur += "/" + p
            existing = sb.fs.get(cur)
            if existing is None:
                sb.fs[cur] = _FakeNode("dir", mode=0o755)
            elif existing.type != "dir":
                raise FileExists_(f"{cur} exists and is not a directory", path=cur)
        if sb.fs.get(path) is not None and sb.fs[path].type == "dir":
            raise FileExists_(f"{path} is a directory", path=path)
        sb.fs[path] = _FakeNode("file", data=bytes(data), mode=mode & 0o7777)
        return self._info(path, sb.fs[path])

    async def read_file(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self._record("read_file", sandbox_id=sandbox_id, owner=owner, path=path)
        sb = self._get(sandbox_id, owner)
        path = _norm(path)
        node = self._fs_node(sb, path)
        if node.type == "dir":
            raise InvalidRequest(f"{path} is a directory", path=path)
        return node.data

    async def _file_logged(
        self,
        sb: _FakeSandbox,
        seq: int | None,
        idem_key: str | None,
        op: str,
        request: Mapping[str, Any],
        run: Callable[[], FileInfo],
    ) -> FileInfo:
        async def run_async() -> FileInfo:
            return run()

        return await self._logged(
            sb,
            seq,
            idem_key,
            op,
            request,
            run_async,
            lambda r: r.model_dump(mode="json"),
            FileInfo.model_validate,
        )

    async def write_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        self._record(
            "write_file",
            sandbox_id=sandbox_id,
            owner=owner,
            path=path,
            data=data,
            mode=mode,
            seq=seq,
            idem_key=idem_key,
        )
        sb = self._get(sandbox_id, owner)
        request = {"path": path, "data": bytes(data), "mode": mode}
        return await self._file_logged(
            sb, seq, idem_key, "write_file", request, lambda: self._put(sb, _norm(path), data, mode)
        )

    async def list_files(
        self, sandbox_id: str, owner: str, path: str, depth: int = 1
    ) -> list[FileInfo]:
        self._record("list_files", sandbox_id=sandbox_id, owner=owner, path=path, depth=depth)
        sb = self._get(sandbox_id, owner)
        path = _norm(path)
        if self._fs_node(sb, path).type != "dir":
            raise InvalidRequest(f"{path} is not a directory", path=path)
        prefix = path.rstrip("/") + "/"
        out = []
        for p, node in sorted(sb.fs.items()):
            if p.startswith(prefix) and p != path:
                level = p[len(prefix) :].count("/") + 1
                if level <= depth:
                    out.append(self._info(p, node))
        return out

    async def stat_file(self, sandbox_id: str, owner: str, path: str) -> FileInfo:
        self._record("stat_file", sandbox_id=sandbox_id, owner=owner, path=path)
        sb = self._get(sandbox_id, owner)
        path = _norm(path)
        return self._info(path, self._fs_node(sb, path))

    async def remove_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        recursive: bool = False,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> None:
        self._record(
            "remove_file",
            sandbox_id=sandbox_id,
            owner=owner,
            path=path,
            recursive=recursive,
            seq=seq,
            idem_key=idem_key,
        )
        sb = self._get(sandbox_id, owner)

        async def run() -> None:
            self._remove(sb, path, recursive)

        await self._logged(
            sb,
            seq,
            idem_key,
            "remove_file",
            {"path": path, "recursive": recursive},
            run,
            lambda _: {},
            lambda _: None,
        )

    def _remove(self, sb: _FakeSandbox, path: str, recursive: bool) -> None:
        path = _norm(path)
        if path == "/":
            raise InvalidRequest("refusing to remove /", path=path)
        node = self._fs_node(sb, path)
        children = [p for p in sb.fs if p.startswith(path + "/")]
        if node.type == "dir" and children and not recursive:
            raise InvalidRequest(f"{path} is a non-empty directory", path=path)
        for p in [*children, path]:
            del sb.fs[p]

    async def make_dir(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        self._record(
            "make_dir", sandbox_id=sandbox_id, owner=owner, path=path, seq=seq, idem_key=idem_key
        )
        sb = self._get(sandbox_id, owner)
        return await self._file_logged(
            sb, seq, idem_key, "make_dir", {"path": path}, lambda: self._mkdir(sb, path)
        )

    def _mkdir(self, sb: _FakeSandbox, path: str) -> FileInfo:
        path = _norm(path)
        cur = ""
        for p in [p for p in path.split("/") if p]:
            cur += "/" + p
            existing = sb.fs.get(cur)
            if existing is None:
                sb.fs[cur] = _FakeNode("dir", mode=0o755)
            elif existing.type != "dir":
                raise FileExists_(f"{cur} exists and is not a directory", path=cur)
        return self._info(path, sb.fs[path])

    async def rename_file(
        self,
        sandbox_id: str,
        owner: str,
        src: str,
        dst: str,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> FileInfo:
        self._record(
            "rename_file",
            sandbox_id=sandbox_id,
            owner=owner,
            src=src,
            dst=dst,
            seq=seq,
            idem_key=idem_key,
        )
        sb = self._get(sandbox_id, owner)
        request = {"src": src, "dst": dst}
        return await self._file_logged(
            sb, seq, idem_key, "rename_file", request, lambda: self._rename(sb, src, dst)
        )

    def _rename(self, sb: _FakeSandbox, src: str, dst: str) -> FileInfo:
        src, dst = _norm(src), _norm(dst)
        self._fs_node(sb, src)
        if posixpath.dirname(dst) not in sb.fs:
            raise FileNotFound(f"no such directory: {posixpath.dirname(dst)}", path=dst)
        moved = {p: n for p, n in sb.fs.items() if p == src or p.startswith(src + "/")}
        for p in moved:
            del sb.fs[p]
        for p, n in moved.items():
            sb.fs[dst + p[len(src) :]] = n
        return self._info(dst, sb.fs[dst])

    async def upload_tar(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> int:
        self._record(
            "upload_tar",
            sandbox_id=sandbox_id,
            owner=owner,
            path=path,
            size=len(data),
            seq=seq,
            idem_key=idem_key,
        )
        sb = self._get(sandbox_id, owner)

        async def run() -> int:
            return self._untar(sb, path, data)

        return await self._logged(
            sb,
            seq,
            idem_key,
            "upload_tar",
            {"path": path, "data": bytes(data)},
            run,
            lambda n: {"files": n},
            lambda d: int(d["files"]),
        )

    def _untar(self, sb: _FakeSandbox, path: str, data: bytes) -> int:
        root = _norm(path)
        count = 0
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                for member in tar:
                    target = _norm(posixpath.join(root, member.name.lstrip("/")))
                    if target != root and not target.startswith(root.rstrip("/") + "/"):
                        raise InvalidRequest(f"tar member escapes {root}: {member.name}")
                    if member.isdir():
                        self._mkdir(sb, target)
                    elif member.isfile():
                        fobj = tar.extractfile(member)
                        body = fobj.read() if fobj else b""
                        self._put(sb, target, body, member.mode)
                    count += 1
        except tarfile.TarError as exc:
            raise InvalidRequest(f"not a tar archive: {exc}") from exc
        return count

    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self._record("download_tar", sandbox_id=sandbox_id, owner=owner, path=path)
        sb = self._get(sandbox_id, owner)
        root = _norm(path)
        self._fs_node(sb, root)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p, node in sorted(sb.fs.items()):
                if p != root and not p.startswith(root.rstrip("/") + "/"):
                    continue
                rel = posixpath.relpath(p, root) if p != root else "."
                member = tarfile.TarInfo(rel)
                member.mode = node.mode
                member.mtime = int(node.mtime)
                if node.type == "dir":
                    member.type = tarfile.DIRTYPE
                    tar.addfile(member)
                else:
                    member.size = len(node.data)
                    tar.addfile(member, io.BytesIO(node.data))
        return buf.getvalue()

    # --- RL lifecycle -----------------------------------------------------------
    async def pause_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self._record("pause_sandbox", sandbox_id=sandbox_id, owner=owner)
        sb = self._get(sandbox_id, owner, running=False)
        if sb.info.state == "stopped":
            raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
        if sb.info.state != "paused":
            held = sum(len(n.data) for n in sb.fs.values())  # the "tmpfs upper" stays
            sb.info.state = "paused"
            sb.info.paused_at = sb.info.updated_at = _now()
            sb.info.expires_at = (
                sb.info.paused_at + timedelta(seconds=sb.info.paused_ttl_s)
                if sb.info.paused_ttl_s
                else None
            )
            sb.info.last_pause = PauseReport(
                memory_before_bytes=held + (8 << 20),
                memory_after_bytes=held,
                duration_ms=0.0,
                method="fake",
                notes=["fake edge: nothing was frozen"],
            )
        return self._public(sb)

    async def resume_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self._record("resume_sandbox", sandbox_id=sandbox_id, owner=owner)
        return self._public(self._get(sandbox_id, owner))  # resumes a paused one

    def _snapshot(self, sb: _FakeSandbox, req: SnapshotRequest) -> LayerInfo:
        scrub = [p.rstrip("/") or "/" for p in req.scrub]
        files: dict[str, _FakeNode] = {}
        for path, node in sorted(sb.fs.items()):
            scrubbed = any(
                fnmatch.fnmatchcase(path, g) or path.startswith(g.rstrip("/") + "/") for g in scrub
            )
            if path != "/" and not scrubbed:
                files[path] = replace(node)
        leaks = sorted(
            path
            for path, node in files.items()
            if any(v and v.encode() in node.data for v in req.secret_values)
        )
        if leaks:
            raise SecretInSnapshot(
                f"{len(leaks)} file(s) contain a builder secret; nothing was stored",
                paths=leaks[:20],
            )
        h = hashlib.sha256()
        for path, node in files.items():
            h.update(f"{path}\0{node.type}\0{node.mode:o}\0{len(node.data)}\0".encode())
            h.update(node.data)
        digest = "sha256:" + h.hexdigest()
        parents = [*self._image(sb.info.image, sb.owner).layers, *sb.info.layers]
        layer = LayerInfo(
            digest=digest,
            kind="workspace",
            name=req.name,
            size=sum(len(n.data) for n in files.values()) + 4096,
            created_at=_now(),
            meta={"parents": parents, "sandbox_id": sb.info.id, "scrub": list(req.scrub)},
        )
        if req.name is not None and (SYSTEM_OWNER, req.name) in self._images:
            raise Conflict(f"{req.name!r} is a system image", name=req.name)
        self._layers.setdefault(digest, layer)
        self._snapshots[digest] = files
        self._grants.add((sb.owner, digest))
        if req.name is not None:
            self._put_image(
                sb.owner,
                ImageInfo(
                    name=req.name,
                    layers=[*parents, digest],
                    size=layer.size,
                    created_at=layer.created_at,
                    meta={"snapshot_of": sb.info.id},
                ),
            )
        return layer

    async def snapshot_sandbox(
        self,
        sandbox_id: str,
        owner: str,
        req: SnapshotRequest,
        *,
        seq: int | None = None,
        idem_key: str | None = None,
    ) -> LayerInfo:
        self._record(
            "snapshot_sandbox",
            sandbox_id=sandbox_id,
            owner=owner,
            req=req,
            seq=seq,
            idem_key=idem_key,
        )
        sb = self._get(sandbox_id, owner)

        async def run() -> LayerInfo:
            return self._snapshot(sb, req)

        return await self._logged(
            sb,
            seq,
            idem_key,
            "snapshot",
            {"name": req.name, "scrub": list(req.scrub)},
            run,
            lambda r: r.model_dump(mode="json"),
            LayerInfo.model_validate,
        )

    async def fork_sandbox(self, sandbox_id: str, owner: str, req: ForkRequest) -> ForkResult:
        self._record("fork_sandbox", sandbox_id=sandbox_id, owner=owner, req=req)
        sb = self._get(sandbox_id, owner)
        if req.n < 1:
            raise InvalidRequest(f"n must be >= 1, not {req.n}", n=req.n)
        self._admit(owner, req.n)  # all or nothing
        layer = self._snapshot(sb, SnapshotRequest(scrub=req.scrub))
        create = sb.request.model_copy(
            update={
                "layers": [*sb.request.layers, layer.digest],
                "labels": {**sb.request.labels, **req.labels},
            }
        )
        children = []
        for _ in range(req.n):
            children.append(await self.create_sandbox(create, owner))
            self.calls.pop()
        return ForkResult(layer=layer, sandboxes=children)

    async def migrate_sandbox(
        self, sandbox_id: str, owner: str, node: str | None = None
    ) -> MigrateResult:
        """One node, like an embedded server: ``CapabilityNotSupported``."""
        self._record("migrate_sandbox", sandbox_id=sandbox_id, owner=owner, node=node)
        self._get(sandbox_id, owner)
        raise CapabilityNotSupported(
            "migration needs cluster mode (dsec serve --cluster): this server has one node",
            node=self.node,
        )

    async def job_action(self, owner: str, job: str, action: JobAction) -> JobActionResult:
        self._record("job_action", owner=owner, job=job, action=action)
        ids = [
            s.info.id
            for s in self._sandboxes.values()
            if s.owner == owner and s.info.job == job and s.info.state != "stopped"
        ]
        verbs = {
            "pause": self.pause_sandbox,
            "resume": self.resume_sandbox,
            "kill": self.kill_sandbox,
        }
        if action not in verbs:
            raise InvalidRequest(f"unknown job action {action!r}", action=action)
        verb = verbs[action]
        before = len(self.calls)
        outcomes = await for_each_sandbox(ids, lambda sid: verb(sid, owner))
        del self.calls[before:]  # one recorded call: job_action
        return JobActionResult(
            job=job,
            action=action,
            outcomes={sid: JobOutcome(**o) for sid, o in outcomes.items()},
        )

    async def export_trajectory(self, sandbox_id: str, owner: str) -> str:
        self._record("export_trajectory", sandbox_id=sandbox_id, owner=owner)
        sb = self._get(sandbox_id, owner, running=False)
        header = {"create": sb.request.model_dump(mode="json")}
        return "".join(self.trajectory.export_jsonl(sandbox_id, header=header))

    # --- network --------------------------------------------------------------
    async def update_network(self, sandbox_id: str, owner: str, policy: Any) -> SandboxInfo:
        """Record the new policy (nothing is enforced: fake sandboxes send no traffic).

        As on a real node, a sandbox created without a network cannot get one
        (``CapabilityNotSupported``) and a stopped one answers ``SandboxStopped``."""
        self._record("update_network", sandbox_id=sandbox_id, owner=owner, policy=policy)
        sb = self._get(sandbox_id, owner)
        if sb.info.network is None:
            raise CapabilityNotSupported(
                f"sandbox {sandbox_id} was created without networking (network=None); "
                "networking cannot be added to a running sandbox",
                sandbox_id=sandbox_id,
            )
        sb.info.network = policy
        sb.request = sb.request.model_copy(update={"network": policy})
        return self._public(sb)

    async def network_stats(self, sandbox_id: str, owner: str) -> dict[str, Any]:
        """The real stats shape with zero counters (the fake sends no traffic);
        ``{"enabled": False}`` for a sandbox without a network."""
        self._record("network_stats", sandbox_id=sandbox_id, owner=owner)
        sb = self._get(sandbox_id, owner)
        if sb.info.network is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "sandbox_id": sandbox_id,
            "ip": "10.203.0.2",
            "policy": sb.info.network.model_dump(),
            "allowed": [],
            "blocked": [],
            "allowed_total": 0,
            "blocked_total": 0,
            "admitted": {},
            "dns": {"queries": 0, "answered": 0, "refused": 0, "rate_limited": 0},
        }

    # --- images and layers --------------------------------------------------
    async def list_images(self, owner: str) -> list[ImageInfo]:
        self._record("list_images", owner=owner)
        mine = {name: im for (who, name), im in self._images.items() if who == owner}
        system = {n: im for (who, n), im in self._images.items() if who == SYSTEM_OWNER}
        return [im for _, im in sorted({**system, **mine}.items())]

    async def get_image(self, name: str, owner: str) -> ImageInfo:
        self._record("get_image", name=name, owner=owner)
        return self._image(name, owner)

    async def delete_image(self, name: str, owner: str) -> None:
        self._record("delete_image", name=name, owner=owner)
        if self._images.pop((owner, name), None) is None:
            raise ImageNotFound(f"no image {name}", image=name)

    async def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        self._record("share_image", name=name, owner=owner, shared=shared)
        if (owner, name) not in self._images:
            raise ImageNotFound(f"no image {name}", image=name)
        image = self._images[(owner, name)].model_copy(update={"shared": shared})
        self._images[(owner, name)] = image
        return image

    async def list_layers(self, owner: str) -> list[LayerInfo]:
        self._record("list_layers", owner=owner)
        return [x for d, x in self._layers.items() if self._visible(d, owner)]

    async def build_image(self, owner: str, req: BuildImageRequest, context: bytes) -> ImageInfo:
        self._record("build_image", owner=owner, req=req, context=context)
        base_layers: list[str] = []
        if req.base is not None:
            base_layers = self._image(req.base, owner).layers
        digest = "sha256:" + hashlib.sha256(context).hexdigest()
        self._layers[digest] = LayerInfo(
            digest=digest, kind=req.kind, name=req.name, size=len(context), created_at=_now()
        )
        image = ImageInfo(
            name=req.name,
            layers=[*base_layers, digest],
            size=len(context),
            created_at=_now(),
            meta={"source": "upload"},
        )
        return self._put_image(owner, image)

    async def pull_image(self, ref: str, owner: str, name: str | None = None) -> ImageInfo:
        self._record("pull_image", ref=ref, owner=owner, name=name)
        image_name = name or ref.rsplit("/", 1)[-1].split("@")[0]
        digest = "sha256:" + hashlib.sha256(ref.encode()).hexdigest()
        self._layers[digest] = LayerInfo(
            digest=digest, kind="base", name=image_name, size=4096, created_at=_now()
        )
        image = ImageInfo(
            name=image_name, layers=[digest], size=4096, created_at=_now(), meta={"ref": ref}
        )
        return self._put_image(owner, image)

    # --- node ---------------------------------------------------------------
    async def node_info(self) -> NodeInfo:
        self._record("node_info")
        return NodeInfo(
            node=self.node,
            version=dsec.__version__,
            tiers=await self.capabilities(),
            sandboxes=sum(1 for s in self._sandboxes.values() if s.info.state != "stopped"),
            cpus=2,
            memory_mb=4096,
        )

    async def capabilities(self) -> list[Capabilities]:
        return [
            Capabilities(
                tier=tier,
                available=tier in self.available_tiers,
                reason=None if tier in self.available_tiers else "not enabled on the fake edge",
                pause=tier in self.available_tiers,
                snapshot=tier in self.available_tiers,
                fork=tier in self.available_tiers,
            )
            for tier in TIERS
        ]

    def metrics_text(self) -> bytes:
        alive = sum(1 for s in self._sandboxes.values() if s.info.state != "stopped")
        return (
            b"# HELP dsec_fake_sandboxes Sandboxes alive on the fake edge.\n"
            b"# TYPE dsec_fake_sandboxes gauge\n" + f"dsec_fake_sandboxes {alive}\n".encode()
        )

    async def stats(self) -> dict[str, Any]:
        return {"sandboxes": len(self._sandboxes), "calls": len(self.calls)}


def _stdin_text(req: ExecRequest) -> str:
    if req.stdin_b64 is not None:
        return base64.b64decode(req.stdin_b64).decode("utf-8", "replace")
    return req.stdin or ""


def _interpret(req: ExecRequest) -> ExecResult:
    """The built-in answers: echo, cat, true, false, exit N."""
    try:
        argv = shlex.split(req.cmd) if isinstance(req.cmd, str) else list(req.cmd)
    except ValueError:
        argv = [str(req.cmd)]
    if argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3:
        argv = shlex.split(argv[2])
    name, args = (argv[0], argv[1:]) if argv else ("", [])
    if name == "echo":
        return ExecResult(stdout=" ".join(args) + "\n", exit_code=0)
    if name == "cat" and not args:
        return ExecResult(stdout=_stdin_text(req), exit_code=0)
    if name == "true":
        return ExecResult(exit_code=0)
    if name == "false":
        return ExecResult(exit_code=1)
    if name == "exit" and len(args) == 1 and args[0].isdigit():
        return ExecResult(exit_code=int(args[0]) % 256)
    shown = req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)
    return ExecResult(stderr=f"fake: {shown}: command not programmed\n", exit_code=127)


def _truncate(result: ExecResult, limit: int) -> ExecResult:
    out = result.model_copy()
    if len(out.stdout.encode()) > limit:
        out.stdout = out.stdout.encode()[:limit].decode("utf-8", "replace")
        out.stdout_truncated = True
    if len(out.stderr.encode()) > limit:
        out.stderr = out.stderr.encode()[:limit].decode("utf-8", "replace")
        out.stderr_truncated = True
    return out


def app_transport(
    edge: Any | None = None, *, max_upload_bytes: int | None = None
) -> tuple[httpx.AsyncBaseTransport, str]:
    """An httpx transport into a real apiserver app in front of ``edge`` (default: a new FakeEdge).

    Returns ``(transport, api_key)``; pass both to the SDK (``transport=``, ``api_key=``).
    The app's key store accepts exactly that one key. Requests go through the real auth,
    validation, error mapping and metrics code; nothing touches the network.
    """
    import httpx

    from dsec.apiserver.app import create_app
    from dsec.apiserver.auth import StaticKeys

    key = "dsec_test_" + secrets.token_urlsafe(16)
    kwargs: dict[str, Any] = {}
    if max_upload_bytes is not None:
        kwargs["max_upload_bytes"] = max_upload_bytes
    app = create_app(edge if edge is not None else FakeEdge(), StaticKeys([key]), **kwargs)
    return httpx.ASGITransport(app=app), key


if TYPE_CHECKING:  # mypy checks that FakeEdge satisfies the contract it fakes
    from dsec.edge.interface import EdgeAPI

    _conforms: EdgeAPI = FakeEdge()
