"""Test helpers shipped with dsec: the real edge over in-memory parts.

:class:`FakeEdge` *is* an :class:`~dsec.edge.agent.EdgeAgent`: every rule of the real edge
(admission, ownership, the trajectory log and fast-forward, pause and resume, snapshots and
forks, jobs, TTL bookkeeping, error mapping) runs as it runs on a node. Only the two parts
below the edge are in memory: the sandboxes (:class:`MemoryRuntime`: a file tree per sandbox,
commands answered by programs you set) and the layer store (:class:`MemoryLayers`: images
and layers with the same ownership rules as :class:`~dsec.layers.store.LayerStore`). Nothing
needs root, a kernel feature or a built image; a temporary directory holds the edge's SQLite
registry and trajectory log. Put the real apiserver in front of it and point the SDK at the
app through an httpx transport, and your tests exercise the whole wire protocol hermetically
(like ``httpx.MockTransport``)::

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

Every call from outside is recorded in :attr:`FakeEdge.calls` as ``(method, {arg: value})``
(the arguments it was called with); :attr:`FakeEdge.executed` counts, per method, the calls
that really ran in a sandbox (a fast-forwarded repeat does not). Pauses report
``method="fake"`` (nothing is frozen); a snapshot copies the sandbox's files (minus the
``scrub`` globs) into a layer whose content a new sandbox starts from; a file holding one of
``secret_values`` refuses it (``SecretInSnapshot``). Network policies are recorded, not
enforced (fake sandboxes send no traffic). Ports (every tier whose traits say ``ports``,
:mod:`dsec.tiers`: all but ``fncall``): a fake sandbox's port is whatever TCP address
:meth:`FakeEdge.serve_port` maps it to (a server the test runs on loopback); unmapped ports
are refused (``PortNotListening``).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import fnmatch
import functools
import hashlib
import inspect
import io
import json
import os
import posixpath
import re
import shlex
import tarfile
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.config import Paths
from dsec.contract.edge import edge_verbs
from dsec.contract.runtime import (
    Handle,
    OutputSink,
    Runtime,
    RuntimeFacts,
    SandboxFiles,
    SandboxSpec,
    TierState,
)
from dsec.edge.agent import EdgeAgent, EdgeLimits
from dsec.errors import (
    CapabilityNotSupported,
    Conflict,
    FileExists_,
    FileNotFound,
    ImageNotFound,
    InvalidRequest,
    LayerNotFound,
    PayloadTooLarge,
    PortNotListening,
    SandboxStopped,
    SecretInSnapshot,
)
from dsec.images.reference import familiar_name, is_reference_name, parse_ref
from dsec.models import (
    SYSTEM_OWNER,
    ExecRequest,
    ExecResult,
    FileInfo,
    ImageInfo,
    LayerInfo,
    LayerKind,
    SandboxInfo,
    SnapshotRequest,
)
from dsec.runtimes.usage import NetCounters, SandboxUsage
from dsec.tiers import get_tier, tier_has

if TYPE_CHECKING:
    import httpx

    from dsec.models import HostReport

__all__ = [
    "ExecHandler",
    "FakeEdge",
    "MemoryLayers",
    "MemoryPortRuntime",
    "MemoryRuntime",
    "app_transport",
    "http_scope",
    "keyed_client",
    "memory_node_edge",
]

ExecHandler = Callable[[SandboxInfo, ExecRequest], "ExecResult | Awaitable[ExecResult]"]
"""A function that answers one exec request for a fake sandbox."""

FAKE_CPU_NS_PER_EXEC = 5_000_000
"""CPU time a fake sandbox is charged per command, nanoseconds (see :meth:`MemoryRuntime.usage`)."""

FAKE_BASE_MEMORY = 8 << 20
"""Memory a fake sandbox holds besides its files, bytes."""

FAKE_BUSYBOX = "sha256:" + "0" * 64
"""The digest of the one-layer ``busybox`` system image every :class:`MemoryLayers` has."""

_OWNER_ID = re.compile(r"^k[0-9a-f]{16}$")
"""A key's owner id: ``<owner>/<name>`` names another key's shared image."""


def _now() -> datetime:
    return datetime.now(UTC)


# --- an in-memory file tree ------------------------------------------------------------------


@dataclass
class _Node:
    """One in-memory file system entry."""

    type: str  # "file" | "dir" | "symlink"
    data: bytes = b""
    mode: int = 0o644
    mtime: float = field(default_factory=time.time)
    target: str | None = None


def _root() -> dict[str, _Node]:
    return {"/": _Node("dir", mode=0o755)}


def _norm(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute: {path!r}", path=path)
    norm = posixpath.normpath(path)
    return "/" if norm in ("/", "//") else norm


class MemoryFiles:
    """:class:`~dsec.contract.runtime.SandboxFiles` over one fake sandbox's file tree. Changes
    are counted in ``executed`` under the edge method that made them."""

    def __init__(self, fs: dict[str, _Node], executed: dict[str, int]) -> None:
        self.fs = fs
        self._executed = executed

    def _ran(self, method: str) -> None:
        self._executed[method] = self._executed.get(method, 0) + 1

    def _node(self, path: str) -> _Node:
        node = self.fs.get(path)
        if node is None:
            raise FileNotFound(f"no such file: {path}", path=path)
        return node

    @staticmethod
    def _info(path: str, node: _Node) -> FileInfo:
        return FileInfo(
            path=path,
            name=posixpath.basename(path) or "/",
            type=node.type,
            size=len(node.data),
            mode=node.mode,
            mtime=node.mtime,
            target=node.target,
        )

    def _dirs(self, path: str) -> None:
        cur = ""
        for part in [p for p in path.split("/") if p]:
            cur += "/" + part
            existing = self.fs.get(cur)
            if existing is None:
                self.fs[cur] = _Node("dir", mode=0o755)
            elif existing.type != "dir":
                raise FileExists_(f"{cur} exists and is not a directory", path=cur)

    def put(self, path: str, data: bytes, mode: int = 0o644) -> FileInfo:
        path = _norm(path)
        self._dirs(posixpath.dirname(path))
        if self.fs.get(path) is not None and self.fs[path].type == "dir":
            raise FileExists_(f"{path} is a directory", path=path)
        self.fs[path] = _Node("file", data=bytes(data), mode=mode & 0o7777)
        return self._info(path, self.fs[path])

    async def read(self, path: str, max_bytes: int) -> bytes:
        path = _norm(path)
        node = self._node(path)
        if node.type == "dir":
            raise InvalidRequest(f"{path} is a directory", path=path)
        if len(node.data) > max_bytes:
            raise PayloadTooLarge(f"{path} is larger than {max_bytes} bytes", limit=max_bytes)
        return node.data

    async def write(
        self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True
    ) -> FileInfo:
        info = self.put(path, data, mode)
        self._ran("write_file")
        return info

    async def list(self, path: str, depth: int = 1) -> list[FileInfo]:
        path = _norm(path)
        if self._node(path).type != "dir":
            raise InvalidRequest(f"{path} is not a directory", path=path)
        prefix = path.rstrip("/") + "/"
        out = []
        for p, node in sorted(self.fs.items()):
            if p.startswith(prefix) and p != path and p[len(prefix) :].count("/") < depth:
                out.append(self._info(p, node))
        return out

    async def stat(self, path: str) -> FileInfo:
        path = _norm(path)
        return self._info(path, self._node(path))

    async def remove(self, path: str, recursive: bool = False) -> None:
        path = _norm(path)
        if path == "/":
            raise InvalidRequest("refusing to remove /", path=path)
        node = self._node(path)
        children = [p for p in self.fs if p.startswith(path + "/")]
        if node.type == "dir" and children and not recursive:
            raise InvalidRequest(f"{path} is a non-empty directory", path=path)
        for p in [*children, path]:
            del self.fs[p]
        self._ran("remove_file")

    async def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        path = _norm(path)
        self._dirs(path)
        self._ran("make_dir")
        return self._info(path, self.fs[path])

    async def rename(self, src: str, dst: str) -> FileInfo:
        src, dst = _norm(src), _norm(dst)
        self._node(src)
        if posixpath.dirname(dst) not in self.fs:
            raise FileNotFound(f"no such directory: {posixpath.dirname(dst)}", path=dst)
        moved = {p: n for p, n in self.fs.items() if p == src or p.startswith(src + "/")}
        for p in moved:
            del self.fs[p]
        for p, n in moved.items():
            self.fs[dst + p[len(src) :]] = n
        self._ran("rename_file")
        return self._info(dst, self.fs[dst])

    async def upload_tar(self, path: str, data: bytes) -> int:
        root = _norm(path)
        count = 0
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                for member in tar:
                    target = _norm(posixpath.join(root, member.name.lstrip("/")))
                    if target != root and not target.startswith(root.rstrip("/") + "/"):
                        raise InvalidRequest(f"tar member escapes {root}: {member.name}")
                    if member.isdir():
                        self._dirs(target)
                    elif member.isfile():
                        fobj = tar.extractfile(member)
                        self.put(target, fobj.read() if fobj else b"", member.mode)
                    count += 1
        except tarfile.TarError as exc:
            raise InvalidRequest(f"not a tar archive: {exc}") from exc
        self._ran("upload_tar")
        return count

    async def download_tar(self, path: str, max_bytes: int) -> bytes:
        root = _norm(path)
        self._node(root)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for p, node in sorted(self.fs.items()):
                if p != root and not p.startswith(root.rstrip("/") + "/"):
                    continue
                member = tarfile.TarInfo(posixpath.relpath(p, root) if p != root else ".")
                member.mode = node.mode
                member.mtime = int(node.mtime)
                if node.type == "dir":
                    member.type = tarfile.DIRTYPE
                    tar.addfile(member)
                else:
                    member.size = len(node.data)
                    tar.addfile(member, io.BytesIO(node.data))
        if buf.tell() > max_bytes:
            raise PayloadTooLarge(f"{path} packs to more than {max_bytes} bytes")
        return buf.getvalue()


# --- the layer source ------------------------------------------------------------------------


class MemoryLayers:
    """The node's layer store, in memory, with :class:`~dsec.layers.store.LayerStore`'s
    ownership rules (see docs/design/tenancy.md): system images (``busybox`` is always there)
    seen by every key and read-only to them, a key's own images first, sharing as
    ``<owner>/<name>``, and layers usable by digest only where granted. A layer's content is
    the bytes it was imported with (for :class:`MemoryRuntime`: a snapshot's files)."""

    def __init__(
        self,
        system_images: Iterable[str] = ("busybox",),
        *,
        registry: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self._lock = threading.RLock()
        self._layers: dict[str, LayerInfo] = {}
        self._content: dict[str, bytes] = {}
        self._images: dict[tuple[str, str], ImageInfo] = {}  # (owner, name) -> image
        self._grants: set[tuple[str, str]] = set()  # (owner, digest)
        self.registry: dict[str, dict[str, Any]] = {}
        """The registry in memory: reference (as :func:`~dsec.images.reference.parse_ref`
        spells it, ``registry-1.docker.io/library/python:3.12``) -> image meta (``config``,
        ``start``). ``pulls`` counts the pulls each one got."""
        self.pulls: dict[str, int] = {}
        for ref, meta in (registry or {}).items():
            self.registry[str(parse_ref(ref))] = dict(meta)
        self._tmp = tempfile.TemporaryDirectory(prefix="dsec-fake-layers-")
        self.scratch = Path(self._tmp.name)
        busybox = LayerInfo(
            digest=FAKE_BUSYBOX,
            kind="base",
            name="busybox",
            size=2 << 20,
            created_at=_now(),
            meta={"builtin": "busybox", "provides": ["busybox"]},
        )
        self._layers[FAKE_BUSYBOX] = busybox
        for name in system_images:  # empty base layers: a fake sandbox starts with no files
            digest = FAKE_BUSYBOX
            if name != "busybox":
                digest = "sha256:" + hashlib.sha256(f"fake {name}".encode()).hexdigest()
                self._layers[digest] = busybox.model_copy(
                    update={"digest": digest, "name": name, "meta": {"builtin": name}}
                )
            self.put_image(name, [digest], meta={"builtin": name})

    # layers
    def get_layer(self, digest: str) -> LayerInfo:
        with self._lock:
            if digest not in self._layers:
                raise LayerNotFound(f"no layer {digest}", digest=digest)
            return self._layers[digest]

    def layer_visible(self, digest: str, owner: str) -> bool:
        with self._lock:
            if digest not in self._layers:
                return False
            return owner == SYSTEM_OWNER or bool(
                {(owner, digest), (SYSTEM_OWNER, digest)} & self._grants
            )

    def get_owned_layer(self, digest: str, owner: str) -> LayerInfo:
        if not self.layer_visible(digest, owner):
            raise LayerNotFound(f"no layer {digest}", digest=digest)
        return self.get_layer(digest)

    def list_layers(self) -> list[LayerInfo]:
        with self._lock:
            return list(self._layers.values())

    def list_owned_layers(self, owner: str) -> list[LayerInfo]:
        return [x for x in self.list_layers() if self.layer_visible(x.digest, owner)]

    def grant_layers(self, owner: str, digests: list[str]) -> None:
        with self._lock:
            self._grants.update((owner, d) for d in digests)

    def layer_path(self, digest: str) -> Path:
        self.get_layer(digest)
        return self.scratch / "layers" / digest.split(":", 1)[1]

    def is_local(self, digest: str) -> bool:
        return True

    def cached_fraction(self, digest: str) -> float:
        return 1.0

    def remote_source(self, digest: str) -> str | None:
        return None

    def content(self, digest: str) -> bytes:
        """The bytes the layer was imported with (empty for the fake busybox)."""
        with self._lock:
            return self._content.get(digest, b"")

    def import_layer_file(
        self,
        erofs_file: Path,
        kind: LayerKind,
        *,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> LayerInfo:
        """Adopt ``erofs_file``'s bytes as a layer (any bytes: nothing is mounted here)."""
        data = Path(erofs_file).read_bytes()
        Path(erofs_file).unlink()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        with self._lock:
            info = self._layers.setdefault(
                digest,
                LayerInfo(
                    digest=digest,
                    kind=kind,
                    name=name,
                    size=len(data),
                    created_at=_now(),
                    meta=dict(meta or {}),
                ),
            )
            self._content[digest] = data
        return info

    def build_layer(
        self,
        source: Path,
        kind: LayerKind,
        *,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> LayerInfo:
        """A layer of a directory's regular files (their paths, bytes and modes), in the
        form :class:`MemoryRuntime` starts sandboxes from."""
        files: dict[str, _Node] = {}
        for dirpath, _dirs, names in os.walk(source):
            for n in names:
                full = Path(dirpath) / n
                if full.is_file() and not full.is_symlink():
                    rel = "/" + full.relative_to(source).as_posix()
                    files[rel] = _Node("file", full.read_bytes(), full.stat().st_mode & 0o7777)
        return self.import_layer_file(self._layer_file(files), kind, name=name, meta=meta)

    def _layer_file(self, files: dict[str, _Node]) -> Path:
        doc = {
            p: {"data": base64.b64encode(n.data).decode(), "mode": n.mode}
            for p, n in sorted(files.items())
        }
        tmp = self.scratch / f"layer-{time.monotonic_ns()}-{threading.get_ident()}"
        tmp.write_text(json.dumps({"files": doc}, sort_keys=True))
        return tmp

    def files_of(self, digest: str) -> dict[str, _Node]:
        """The files a layer made by :meth:`build_layer` or a snapshot holds."""
        raw = self.content(digest)
        if not raw:
            return {}
        return {
            p: _Node("file", base64.b64decode(d["data"]), int(d["mode"]))
            for p, d in json.loads(raw)["files"].items()
        }

    # images
    def _system_name(self, name: str) -> bool:
        return (SYSTEM_OWNER, name) in self._images

    def check_name_free(self, name: str, owner: str) -> None:
        local = isinstance(name, str) and bool(name) and "/" not in name
        if (
            not isinstance(name, str)
            or name.startswith("sha256:")
            or not (local or is_reference_name(name))
        ):
            raise InvalidRequest(f"invalid image name {name!r}", name=name)
        if owner != SYSTEM_OWNER and self._system_name(name):
            raise Conflict(f"{name!r} is a system image: keys cannot replace it", name=name)

    def put_image(
        self,
        name: str,
        layers: list[str],
        *,
        meta: dict[str, Any] | None = None,
        owner: str = SYSTEM_OWNER,
    ) -> ImageInfo:
        self.check_name_free(name, owner)
        if not layers:
            raise InvalidRequest("an image needs at least one layer", name=name)
        infos = [self.get_layer(d) for d in layers]
        with self._lock:
            old = self._images.get((owner, name))
            image = ImageInfo(
                name=name,
                layers=list(layers),
                size=sum({i.digest: i.size for i in infos}.values()),
                created_at=_now(),
                meta=dict(meta or {}),
                owner="system" if owner == SYSTEM_OWNER else owner,
                shared=old.shared if old is not None else False,
            )
            self._images[(owner, name)] = image
            self._grants.update((owner, d) for d in layers)
        return image

    def attach(self, ref: str, name: str | None, lazy: bool, owner: str) -> ImageInfo:
        """Pull ``ref`` from :attr:`registry` (an image of one empty layer with the meta it
        was given); a reference it lacks is ``ImageNotFound``, as a real registry's 404.
        Named ``name``, else by the reference (``127.0.0.1:5000/team/app:1``)."""
        parsed = parse_ref(ref)
        key = str(parsed)
        with self._lock:
            if key not in self.registry:
                raise ImageNotFound(f"manifest unknown: {key}", image=ref)
            self.pulls[key] = self.pulls.get(key, 0) + 1
            digest = "sha256:" + hashlib.sha256(key.encode()).hexdigest()
            self._layers.setdefault(
                digest,
                LayerInfo(digest=digest, kind="base", name=key, size=4096, created_at=_now()),
            )
            meta = {**self.registry[key], "source": "registry", "ref": key, "lazy": lazy}
        return self.put_image(name or familiar_name(parsed), [digest], meta=meta, owner=owner)

    def get_image(self, ref: str, owner: str = SYSTEM_OWNER) -> ImageInfo:
        if ref.startswith("sha256:"):
            try:
                layer = self.get_owned_layer(ref, owner)
            except LayerNotFound as e:
                raise ImageNotFound(f"no image or layer {ref}", image=ref) from e
            return ImageInfo(name=ref, layers=[ref], size=layer.size, created_at=layer.created_at)
        with self._lock:
            for who in (owner, SYSTEM_OWNER):
                if (who, ref) in self._images:
                    return self._images[(who, ref)]
            other, sep, name = ref.partition("/")
            shared = self._images.get((other, name))
            if sep and _OWNER_ID.match(other) and shared is not None and shared.shared:
                return shared
        raise ImageNotFound(f"no image {ref!r}", image=ref)

    async def ensure_image(
        self, name: str, owner: str = SYSTEM_OWNER, *, wait_s: float | None = None
    ) -> ImageInfo:
        return self.get_image(name, owner)

    def list_images(self, owner: str | None = None) -> list[ImageInfo]:
        with self._lock:
            if owner is None:
                return [im for _, im in sorted(self._images.items())]
            mine = {n: im for (who, n), im in self._images.items() if who == owner}
            system = {n: im for (who, n), im in self._images.items() if who == SYSTEM_OWNER}
        return [im for _, im in sorted({**system, **mine}.items())]

    def remove_image(self, name: str, owner: str = SYSTEM_OWNER) -> None:
        with self._lock:
            if self._images.pop((owner, name), None) is None:
                if owner != SYSTEM_OWNER and self._system_name(name):
                    raise Conflict(f"{name!r} is a system image: keys cannot remove it")
                raise ImageNotFound(f"no image {name!r}", image=name)

    def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        with self._lock:
            if (owner, name) not in self._images:
                raise ImageNotFound(f"no image {name!r}", image=name)
            image = self._images[(owner, name)].model_copy(update={"shared": shared})
            self._images[(owner, name)] = image
        return image

    def resolve_layers(self, refs: list[str], owner: str = SYSTEM_OWNER) -> list[LayerInfo]:
        digests: list[str] = []
        for ref in refs:
            if ref.startswith("sha256:"):
                self.get_owned_layer(ref, owner)
                digests.append(ref)
            else:
                digests.extend(self.get_image(ref, owner).layers)
        last = {d: i for i, d in enumerate(digests)}
        return [self.get_layer(d) for i, d in enumerate(digests) if last[d] == i]

    def builtin_status(self, name: str) -> tuple[str, str, float] | None:
        return None  # the one built-in image is always there

    def build_image(
        self,
        source: Path,
        name: str,
        kind: LayerKind = "workspace",
        base: str | None = None,
        *,
        owner: str = SYSTEM_OWNER,
        meta: dict[str, Any] | None = None,
    ) -> ImageInfo:
        self.check_name_free(name, owner)
        base_layers = self.get_image(base, owner).layers if base is not None else []
        layer = self.build_layer(Path(source), kind, name=name, meta=meta)
        layers = [d for d in base_layers if d != layer.digest] + [layer.digest]
        return self.put_image(name, layers, meta={"base": base} if base else {}, owner=owner)


# --- the runtime -----------------------------------------------------------------------------


class MemoryState(TierState):
    """What a :class:`MemoryRuntime` handle keeps: that it is one (the sandbox itself lives
    in the runtime's memory and dies with it)."""

    fake: bool = True


@dataclass
class _Sandbox:
    spec: SandboxSpec
    files: MemoryFiles
    network: Any = None
    execs: int = 0


class MemoryRuntime:
    """A tier whose sandboxes are file trees in memory and whose commands are answered by
    programs (see the module docstring). Pausable, snapshottable, networked (policies are
    recorded, nothing is enforced) and measurable: :meth:`usage` counts
    :data:`FAKE_CPU_NS_PER_EXEC` of CPU per command, its files' bytes as disk and cache, and
    :data:`FAKE_BASE_MEMORY` more as memory.

    Args:
        tier: the tier it stands in for.
        layers: the layer source snapshots go to and sandboxes start from.
        answer: answers one command of a sandbox (``FakeEdge`` passes its programs).
        chunk_delay_s: seconds between streamed output lines.
        executed: the counter of calls that really ran, shared with the edge's fake.
    """

    def __init__(
        self,
        tier: str,
        layers: MemoryLayers,
        answer: Callable[[str, ExecRequest], Awaitable[ExecResult]],
        *,
        chunk_delay_s: float = 0.0,
        executed: dict[str, int] | None = None,
    ) -> None:
        self.tier = tier
        self.layers = layers
        self._answer = answer
        self.chunk_delay_s = chunk_delay_s
        self.executed = executed if executed is not None else {}
        self.sandboxes: dict[str, _Sandbox] = {}

    def facts(self) -> RuntimeFacts:
        return RuntimeFacts(available=True, network_ready=True, sink_sees_all_output=True)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def create(self, spec: SandboxSpec) -> Handle:
        fs = _root()
        files = MemoryFiles(fs, self.executed)
        for digest in spec.layer_digests:  # snapshots: their files, bottom first
            for path, node in self.layers.files_of(digest).items():
                files.put(path, node.data, node.mode)
        self.sandboxes[spec.id] = _Sandbox(spec, files, spec.network)
        return Handle.of(spec.id, MemoryState())

    def _get(self, handle: Handle) -> _Sandbox:
        sb = self.sandboxes.get(handle.id)
        if sb is None:
            raise SandboxStopped(f"sandbox {handle.id} is gone", sandbox_id=handle.id)
        return sb

    async def exec(
        self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
    ) -> ExecResult:
        self._get(handle).execs += 1
        full = await self._answer(handle.id, req)
        self.executed["exec"] = self.executed.get("exec", 0) + 1
        if sink is not None:  # a sink sees all of it (the result keeps the cap)
            for stream, text in (("stdout", full.stdout), ("stderr", full.stderr)):
                for line in text.splitlines(keepends=True):
                    if self.chunk_delay_s:
                        await asyncio.sleep(self.chunk_delay_s)
                    await sink(stream, line.encode())
        return _truncate(full, req.max_output_bytes)

    def files(self, handle: Handle) -> SandboxFiles:
        return self._get(handle).files

    async def destroy(self, handle: Handle) -> None:
        self.sandboxes.pop(handle.id, None)

    async def recover(self, handle: Handle) -> bool:
        return handle.typed(MemoryState).fake and handle.id in self.sandboxes

    async def alive(self, handle: Handle) -> bool:
        return handle.id in self.sandboxes

    async def list_orphans(self, known: set[str]) -> list[str]:
        return [sid for sid in self.sandboxes if sid not in known]

    async def destroy_orphan(self, sandbox_id: str) -> None:
        self.sandboxes.pop(sandbox_id, None)

    # Measurable
    async def usage(self, handle: Handle) -> SandboxUsage:
        sb = self._get(handle)
        held = sum(len(n.data) for n in sb.files.fs.values())
        return SandboxUsage(
            cpu_usage_ns=sb.execs * FAKE_CPU_NS_PER_EXEC,
            memory_used_bytes=FAKE_BASE_MEMORY + held,
            memory_cache_bytes=held,
            memory_limit_bytes=sb.spec.memory_mb << 20,
            disk_used_bytes=held,
            disk_total_bytes=sb.spec.disk_mb << 20,
            net=NetCounters() if sb.network is not None else None,
            pids=1,
            source="fake",
        )

    # Pausable
    async def pause(self, handle: Handle) -> dict[str, Any]:
        held = sum(len(n.data) for n in self._get(handle).files.fs.values())
        return {
            "memory_before_bytes": held + (8 << 20),
            "memory_after_bytes": held,
            "duration_ms": 0.0,
            "method": "fake",
            "notes": ["fake edge: nothing was frozen"],
        }

    async def resume(self, handle: Handle) -> None:
        self._get(handle)

    # Snapshottable
    async def snapshot(
        self, handle: Handle, store: Any, req: SnapshotRequest, meta: dict[str, Any]
    ) -> LayerInfo:
        fs = self._get(handle).files.fs
        scrub = [p.rstrip("/") or "/" for p in req.scrub]
        kept = {
            path: node
            for path, node in sorted(fs.items())
            if path != "/"
            and node.type == "file"
            and not any(fnmatch.fnmatchcase(path, g) or path.startswith(g + "/") for g in scrub)
        }
        leaks = sorted(
            p for p, n in kept.items() if any(v and v.encode() in n.data for v in req.secret_values)
        )
        if leaks:
            raise SecretInSnapshot(
                f"{len(leaks)} file(s) contain a builder secret; nothing was stored",
                paths=leaks[:20],
            )
        self.executed["snapshot_sandbox"] = self.executed.get("snapshot_sandbox", 0) + 1
        return self.layers.import_layer_file(
            self.layers._layer_file(kept),
            "workspace",
            name=req.name,
            meta={**meta, "scrub": list(req.scrub)},
        )

    # Networked
    async def network_update(self, handle: Handle, policy: Any) -> None:
        sb = self._get(handle)
        if sb.network is None:  # as on a node: no namespace to give rules to
            raise CapabilityNotSupported(
                f"sandbox {handle.id} was created without networking (network=None); "
                "networking cannot be added to a running sandbox",
                sandbox_id=handle.id,
            )
        sb.network = policy

    async def network_stats(self, handle: Handle) -> dict[str, Any]:
        policy = self._get(handle).network
        if policy is None:
            return {"enabled": False}
        return {
            "enabled": True,
            "sandbox_id": handle.id,
            "ip": "10.203.0.2",
            "policy": policy.model_dump() if hasattr(policy, "model_dump") else policy,
            "allowed": [],
            "blocked": [],
            "allowed_total": 0,
            "blocked_total": 0,
            "admitted": {},
            "dns": {"queries": 0, "answered": 0, "refused": 0, "rate_limited": 0},
        }


class MemoryPortRuntime(MemoryRuntime):
    """:class:`MemoryRuntime` with ports (``PortConnectable``): port ``p`` of sandbox ``s``
    is the TCP address ``ports[(s, p)]`` (a test server on loopback)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ports: dict[tuple[str, int], tuple[str, int]] = {}

    async def connect_port(self, handle: Handle, port: int) -> Any:
        import socket

        from dsec.runtimes.sockets import connect_socket

        self._get(handle)
        host, real = self.ports.get((handle.id, port), ("127.0.0.1", 0))
        if real == 0:
            raise PortNotListening(
                f"nothing in the sandbox accepts connections on port {port}", port=port
            )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        return await connect_socket(sock, real, host=host)


def memory_node_edge(home: Path, node: str, config: Any) -> EdgeAgent:
    """A real :class:`~dsec.edge.agent.EdgeAgent` whose tiers are :class:`MemoryRuntime`
    and whose layer store is a :class:`MemoryLayers`: a simulated node for cluster
    benchmarks, where sandboxes cost nothing and the control plane is all that is measured.
    The cluster's edge actor builds it when its ``NodeConfig.edge_factory`` is
    ``"dsec.testing:memory_node_edge"`` (``DSEC_CLUSTER_EDGE_FACTORY`` of ``dsec serve
    --cluster``).

    The edge's registry and trajectory log are real (SQLite under ``home``); commands are
    answered by the built-in interpreter (``echo``, ``true``, ...). Its size for admission:
    ``DSEC_MEMORY_NODE_CPUS`` cores (default 256) and ``DSEC_MEMORY_NODE_MEMORY_MB`` MiB
    (default 4 TiB); other limits from the node's environment (``DSEC_MAX_SANDBOXES``...).

    Args:
        home: the node's data dir.
        node: the node name (sandbox ids ``sb-<node>-<random>``).
        config: the cluster's ``NodeConfig`` (its ``tiers``; default ``container``).
    """
    layers = MemoryLayers()

    async def answer(sandbox_id: str, req: ExecRequest) -> ExecResult:
        return _interpret(req)

    tiers = tuple(getattr(config, "tiers", None) or ("container",))
    runtimes: dict[str, Runtime] = {t: MemoryRuntime(t, layers, answer) for t in tiers}
    return EdgeAgent(
        Paths(home),
        runtimes,
        layers,
        limits=EdgeLimits.from_env(),
        node=node,
        cpus=int(os.environ.get("DSEC_MEMORY_NODE_CPUS", "256")),
        memory_mb=int(os.environ.get("DSEC_MEMORY_NODE_MEMORY_MB", str(1 << 22))),
    )


# --- the edge --------------------------------------------------------------------------------

_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("dsec_fake_edge_depth", default=0)


class FakeEdge(EdgeAgent):
    """The real :class:`~dsec.edge.agent.EdgeAgent` over :class:`MemoryRuntime` tiers and
    :class:`MemoryLayers` (see the module docstring). Usable without ``await start()``.

    Args:
        node: node name used in sandbox ids (``sb-<node>-<hex>``).
        exec_handler: optional function answering exec requests not programmed with
            :meth:`program`.
        available_tiers: tiers the node offers; creating any other raises
            ``TierUnavailable``.
        chunk_delay_s: seconds to sleep between streamed output chunks.
        trajectory_path: SQLite file of the trajectory log (default: in the edge's
            temporary directory).
        gap_wait_s: how long a sequence number that skips ahead waits for the missing
            ones before ``SequenceGap``, seconds.
        max_sandboxes: live sandboxes the node admits (``QuotaExceeded`` beyond; None: the
            edge's default).
        layers: the layer source (default: a new :class:`MemoryLayers`).
        runtime_factory: makes each tier's runtime (default: :class:`MemoryRuntime`, whose
            commands are answered by :meth:`program`, ``exec_handler`` and the interpreter);
            e.g. a runtime that really runs commands, under the same edge.
        unavailable: tiers the node's host rules out, with why (as
            :func:`dsec.node.prepare_host` finds them).
        host_report: makes the node's host report (``GET /v1/node``'s ``host``; default
            none).
    """

    def __init__(
        self,
        node: str = "fake",
        *,
        exec_handler: ExecHandler | None = None,
        available_tiers: Iterable[str] = ("fncall", "container"),
        chunk_delay_s: float = 0.0,
        trajectory_path: Path | None = None,
        gap_wait_s: float = 0.5,
        max_sandboxes: int | None = None,
        layers: MemoryLayers | None = None,
        runtime_factory: Callable[[str], Runtime] | None = None,
        unavailable: dict[str, str] | None = None,
        host_report: Callable[[], HostReport] | None = None,
    ) -> None:
        self._home = tempfile.TemporaryDirectory(prefix="dsec-fake-edge-")
        self.exec_handler = exec_handler
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.executed: dict[str, int] = {}
        """Per edge method, how many calls really ran in a sandbox (replays are not counted)."""
        self._programs: dict[str, ExecResult] = {}
        self._errors: dict[str, list[BaseException]] = {}
        self.memory_layers = layers if layers is not None else MemoryLayers()

        def memory_runtime(tier: str) -> Runtime:
            ports = tier_has(tier, lambda t: t.ports) or get_tier(tier) is None
            return (MemoryPortRuntime if ports else MemoryRuntime)(
                tier,
                self.memory_layers,
                self._answer,
                chunk_delay_s=chunk_delay_s,
                executed=self.executed,
            )

        make = runtime_factory or memory_runtime
        runtimes = {tier: make(tier) for tier in available_tiers}
        limits = EdgeLimits(gap_wait_s=gap_wait_s, reap_interval_s=0.05)
        if max_sandboxes is not None:
            limits.max_sandboxes = max_sandboxes
        super().__init__(
            Paths(Path(self._home.name)),
            runtimes,
            self.memory_layers,
            limits=limits,
            node=node,
            trajectory_path=trajectory_path,
            cpus=256,  # admission as on a large node: tests ask for resources freely
            memory_mb=1 << 22,
            unavailable=unavailable,
            host_report=host_report,
        )
        self.paths.ensure()
        for name in edge_verbs():
            fn = getattr(self, name, None)
            if fn is not None:
                setattr(self, name, self._recording(name, fn))

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

    @property
    def sandboxes(self) -> dict[str, SandboxInfo]:
        """Every sandbox the edge knows (stopped ones included), by id."""
        return {
            row.id: self._info(self._live[row.id].row if row.id in self._live else row)
            for row in self.registry.select()
        }

    def serve_port(self, sandbox_id: str, port: int, address: tuple[str, int]) -> None:
        """Make ``port`` of a fake sandbox the TCP server at ``address`` (e.g. a test's
        loopback server): what the port proxy reaches for that sandbox and port."""
        lv = self._live[sandbox_id]
        rt = self.runtimes[lv.row.tier]
        if not isinstance(rt, MemoryPortRuntime):
            raise CapabilityNotSupported(f"tier {lv.row.tier} has no ports")
        rt.ports[(sandbox_id, port)] = address

    def forget(self, sandbox_id: str) -> None:
        """Make the node forget a sandbox altogether, as once a stopped sandbox's record is
        purged (its id then answers ``SandboxNotFound``)."""
        lv = self._live.pop(sandbox_id)
        if lv is not None:
            for rt in self.runtimes.values():
                if isinstance(rt, MemoryRuntime):
                    rt.sandboxes.pop(sandbox_id, None)
        self.registry.remove(sandbox_id)
        self.trajectory.purge(sandbox_id)

    # --- plumbing -----------------------------------------------------------
    def _take_error(self, method: str) -> None:
        queued = self._errors.get(method)
        if queued:
            raise queued.pop(0)

    def _recording(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` that records its outermost calls and raises injected errors."""
        sig = inspect.signature(fn)

        def enter(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
            depth = _DEPTH.get()
            if depth == 0:
                self.calls.append((name, dict(sig.bind(*args, **kwargs).arguments)))
            self._take_error(name)
            _DEPTH.set(depth + 1)
            return depth

        if inspect.isasyncgenfunction(fn):

            @functools.wraps(fn)
            async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                depth = enter(args, kwargs)
                try:
                    async for item in fn(*args, **kwargs):
                        yield item
                finally:
                    _DEPTH.set(depth)

            return stream
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def call(*args: Any, **kwargs: Any) -> Any:
                depth = enter(args, kwargs)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    _DEPTH.set(depth)

            return call

        @functools.wraps(fn)
        def plain(*args: Any, **kwargs: Any) -> Any:
            depth = enter(args, kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                _DEPTH.set(depth)

        return plain

    async def _answer(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        key = req.cmd if isinstance(req.cmd, str) else shlex.join(req.cmd)
        if key in self._programs:
            return self._programs[key].model_copy()
        if self.exec_handler is not None:
            lv = self._live.get(sandbox_id)
            row = lv.row if lv is not None else self.registry.get(sandbox_id)
            assert row is not None
            answer = self.exec_handler(self._info(row), req)
            return await answer if inspect.isawaitable(answer) else answer
        return _interpret(req)


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


def keyed_client(edge: Any, keys: list[str], key: str) -> httpx.AsyncClient:
    """An httpx client into a real apiserver app in front of ``edge`` that accepts ``keys``,
    sending ``key``: one per tenant, to check what another key sees."""
    import httpx

    from dsec.apiserver.app import create_app
    from dsec.apiserver.auth import StaticKeys

    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(edge, StaticKeys(keys))),
        base_url="http://dsec",
        headers={"authorization": f"Bearer {key}"},
    )


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

    key = "dsec_test_" + base64.urlsafe_b64encode(os.urandom(12)).decode()
    kwargs: dict[str, Any] = {}
    if max_upload_bytes is not None:
        kwargs["max_upload_bytes"] = max_upload_bytes
    app = create_app(edge if edge is not None else FakeEdge(), StaticKeys([key]), **kwargs)
    return httpx.ASGITransport(app=app), key


def http_scope(
    method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None
) -> dict[str, Any]:
    """The ASGI scope of one HTTP request (``path`` without a query), for driving an app
    directly: ``await app(http_scope("GET", "/healthz"), receive, send)``."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"dsec"), *(headers or [])],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 7070),
    }


if TYPE_CHECKING:  # mypy checks that the fakes satisfy the contracts they stand below
    from dsec.contract.runtime import Measurable, Networked, Pausable, Snapshottable
    from dsec.layers.source import LayerSource

    async def _no_answer(sandbox_id: str, req: ExecRequest) -> ExecResult: ...

    _layers: LayerSource = MemoryLayers()
    _runtime: Runtime = MemoryRuntime("container", MemoryLayers(), _no_answer)
    _pausable: Pausable = MemoryRuntime("container", MemoryLayers(), _no_answer)
    _snapshots: Snapshottable = MemoryRuntime("container", MemoryLayers(), _no_answer)
    _networked: Networked = MemoryRuntime("container", MemoryLayers(), _no_answer)
    from dsec.contract.runtime import PortConnectable

    _ports: PortConnectable = MemoryPortRuntime("container", MemoryLayers(), _no_answer)
    _measurable: Measurable = MemoryRuntime("container", MemoryLayers(), _no_answer)
