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
"""

from __future__ import annotations

import asyncio
import base64
import inspect
import io
import posixpath
import secrets
import shlex
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import dsec
from dsec.errors import (
    FileExists_,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    SandboxNotFound,
    SandboxStopped,
    TierUnavailable,
)
from dsec.models import (
    TIERS,
    Capabilities,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ImageInfo,
    LayerInfo,
    NodeInfo,
    SandboxInfo,
)

if TYPE_CHECKING:
    import httpx

__all__ = ["ExecHandler", "FakeEdge", "app_transport"]

ExecHandler = Callable[[SandboxInfo, ExecRequest], "ExecResult | Awaitable[ExecResult]"]
"""A function that answers one exec request for a fake sandbox."""

_FAKE_LAYER = "sha256:" + "0" * 64


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


@dataclass
class _FakeSandbox:
    info: SandboxInfo
    owner: str
    fs: dict[str, _FakeNode] = field(default_factory=lambda: {"/": _FakeNode("dir", mode=0o755)})


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
    """

    def __init__(
        self,
        node: str = "fake",
        *,
        exec_handler: ExecHandler | None = None,
        available_tiers: tuple[str, ...] = ("fncall", "container"),
        chunk_delay_s: float = 0.0,
    ) -> None:
        self.node = node
        self.exec_handler = exec_handler
        self.available_tiers = available_tiers
        self.chunk_delay_s = chunk_delay_s
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._sandboxes: dict[str, _FakeSandbox] = {}
        self._programs: dict[str, ExecResult] = {}
        self._errors: dict[str, list[BaseException]] = {}
        created = _now()
        self._layers: dict[str, LayerInfo] = {
            _FAKE_LAYER: LayerInfo(
                digest=_FAKE_LAYER, kind="base", name="busybox", size=2 << 20, created_at=created
            )
        }
        self._images: dict[str, ImageInfo] = {
            "busybox": ImageInfo(
                name="busybox", layers=[_FAKE_LAYER], size=2 << 20, created_at=created
            )
        }

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

    def _get(self, sandbox_id: str, owner: str, *, running: bool = True) -> _FakeSandbox:
        sb = self._sandboxes.get(sandbox_id)
        if sb is None or sb.owner != owner:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox_id=sandbox_id)
        if running and sb.info.state == "stopped":
            raise SandboxStopped(f"sandbox {sandbox_id} is stopped", sandbox_id=sandbox_id)
        return sb

    # --- sandboxes --------------------------------------------------------
    async def create_sandbox(self, req: CreateSandboxRequest, owner: str) -> SandboxInfo:
        self._record("create_sandbox", req=req, owner=owner)
        if req.tier not in self.available_tiers:
            raise TierUnavailable(f"tier {req.tier} is not available on this node", tier=req.tier)
        if req.image not in self._images:
            raise ImageNotFound(f"no image {req.image}", image=req.image)
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
        )
        self._sandboxes[sandbox_id] = _FakeSandbox(info=info, owner=owner)
        return info.model_copy()

    async def get_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self._record("get_sandbox", sandbox_id=sandbox_id, owner=owner)
        return self._get(sandbox_id, owner, running=False).info.model_copy()

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
            out.append(info.model_copy())
        return out

    async def kill_sandbox(self, sandbox_id: str, owner: str) -> SandboxInfo:
        self._record("kill_sandbox", sandbox_id=sandbox_id, owner=owner)
        sb = self._get(sandbox_id, owner, running=False)
        if sb.info.state != "stopped":
            sb.info.state = "stopped"
            sb.info.stopped_reason = "killed"
            sb.info.updated_at = _now()
        return sb.info.model_copy()

    async def set_ttl(self, sandbox_id: str, owner: str, ttl_s: float) -> SandboxInfo:
        self._record("set_ttl", sandbox_id=sandbox_id, owner=owner, ttl_s=ttl_s)
        sb = self._get(sandbox_id, owner)
        sb.info.ttl_s = ttl_s
        sb.info.updated_at = _now()
        sb.info.expires_at = sb.info.updated_at + timedelta(seconds=ttl_s)
        return sb.info.model_copy()

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

    async def exec(self, sandbox_id: str, owner: str, req: ExecRequest) -> ExecResult:
        self._record("exec", sandbox_id=sandbox_id, owner=owner, req=req)
        return await self._answer(self._get(sandbox_id, owner), req)

    async def exec_stream(
        self, sandbox_id: str, owner: str, req: ExecRequest
    ) -> AsyncIterator[ExecEvent]:
        self._record("exec_stream", sandbox_id=sandbox_id, owner=owner, req=req)
        result = await self._answer(self._get(sandbox_id, owner), req)
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

    async def write_file(
        self, sandbox_id: str, owner: str, path: str, data: bytes, mode: int = 0o644
    ) -> FileInfo:
        self._record(
            "write_file", sandbox_id=sandbox_id, owner=owner, path=path, data=data, mode=mode
        )
        return self._put(self._get(sandbox_id, owner), _norm(path), data, mode)

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
        self, sandbox_id: str, owner: str, path: str, recursive: bool = False
    ) -> None:
        self._record(
            "remove_file", sandbox_id=sandbox_id, owner=owner, path=path, recursive=recursive
        )
        sb = self._get(sandbox_id, owner)
        path = _norm(path)
        if path == "/":
            raise InvalidRequest("refusing to remove /", path=path)
        node = self._fs_node(sb, path)
        children = [p for p in sb.fs if p.startswith(path + "/")]
        if node.type == "dir" and children and not recursive:
            raise InvalidRequest(f"{path} is a non-empty directory", path=path)
        for p in [*children, path]:
            del sb.fs[p]

    async def make_dir(self, sandbox_id: str, owner: str, path: str) -> FileInfo:
        self._record("make_dir", sandbox_id=sandbox_id, owner=owner, path=path)
        sb = self._get(sandbox_id, owner)
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

    async def rename_file(self, sandbox_id: str, owner: str, src: str, dst: str) -> FileInfo:
        self._record("rename_file", sandbox_id=sandbox_id, owner=owner, src=src, dst=dst)
        sb = self._get(sandbox_id, owner)
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

    async def upload_tar(self, sandbox_id: str, owner: str, path: str, data: bytes) -> int:
        self._record("upload_tar", sandbox_id=sandbox_id, owner=owner, path=path, size=len(data))
        sb = self._get(sandbox_id, owner)
        root = _norm(path)
        count = 0
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                for member in tar:
                    target = _norm(posixpath.join(root, member.name.lstrip("/")))
                    if target != root and not target.startswith(root.rstrip("/") + "/"):
                        raise InvalidRequest(f"tar member escapes {root}: {member.name}")
                    if member.isdir():
                        await self.make_dir(sandbox_id, owner, target)
                        self.calls.pop()
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

    # --- images and layers --------------------------------------------------
    async def list_images(self) -> list[ImageInfo]:
        self._record("list_images")
        return list(self._images.values())

    async def get_image(self, name: str) -> ImageInfo:
        self._record("get_image", name=name)
        if name not in self._images:
            raise ImageNotFound(f"no image {name}", image=name)
        return self._images[name]

    async def list_layers(self) -> list[LayerInfo]:
        self._record("list_layers")
        return list(self._layers.values())

    async def build_image(
        self, path: str, name: str, kind: str = "workspace", base: str | None = None
    ) -> ImageInfo:
        self._record("build_image", path=path, name=name, kind=kind, base=base)
        base_layers: list[str] = []
        if base is not None:
            base_layers = (await self.get_image(base)).layers
            self.calls.pop()
        digest = "sha256:" + secrets.token_hex(32)
        self._layers[digest] = LayerInfo(
            digest=digest,
            kind=kind,
            name=name,
            size=4096,
            created_at=_now(),
        )
        image = ImageInfo(
            name=name,
            layers=[*base_layers, digest],
            size=4096,
            created_at=_now(),
            meta={"path": path},
        )
        self._images[name] = image
        return image

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
