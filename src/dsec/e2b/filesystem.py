"""envd's ``filesystem.Filesystem`` Connect service over ``EdgeAPI`` file calls.

Paths: absolute sandbox paths; a relative path is taken relative to the home of the
user the request runs as (the ``Authorization: Basic`` user, else the sandbox's default
user), as envd does (:mod:`dsec.e2b.users`). Entries are owned by user and group names
from the sandbox's own passwd and group files, and carry the file's metadata: its
``user.e2b.<key>`` extended attributes (:class:`~dsec.contract.edge.FileXattrs`; a tier
without them shows none). Removing a path that does not exist succeeds (envd's
``os.RemoveAll``).

Watching (``watch_dir`` in both SDK flavours) uses the edge's kernel watch when it has one
(:class:`~dsec.contract.edge.DirectoryWatch`: inotify on the container tier): every
change arrives as it happens, as its own event (envd's kinds, renames included), and
nothing polls the sandbox. Other tiers (and a cluster's apiserver) fall back to polling:
each poll
lists the watched tree (``depth`` 1, or up to :data:`RECURSIVE_WATCH_DEPTH`
levels when recursive) and diffs it with the previous listing. A new path is
``CREATE``, a vanished one ``REMOVE``, a changed size or mtime ``WRITE``, a
changed mode only ``CHMOD``; a rename shows as ``REMOVE`` + ``CREATE``. Events
arrive up to one poll interval late and writes within one interval coalesce.

A ``CreateWatcher`` watcher (the sync SDK's ``watch_dir``) records from its
creation on: a background task polls every interval into a bounded queue
(:data:`MAX_WATCHER_EVENTS`, oldest dropped beyond it) that ``GetWatcherEvents``
drains; ``RemoveWatcher`` (or :data:`WATCHER_IDLE_EXPIRY_S` without a
``GetWatcherEvents``) stops it. Polls are skipped while the sandbox is paused
(a poll would resume it); like any file call they count as sandbox activity.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import stat as stat_mod
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_connect
from e2b.envd.filesystem import filesystem_pb as fs_pb
from protobuf import Oneof
from protobuf.wkt import Timestamp

from dsec.contract.edge import (
    DirectoryWatch,
    DirectoryWatcher,
    EdgeAPI,
    FileEventKind,
    FileXattrs,
)
from dsec.e2b.errors import sandbox_ref, to_connect_error
from dsec.e2b.users import SandboxUsers, user_from_headers
from dsec.errors import CapabilityNotSupported, DsecError, FileNotFound, InvalidRequest
from dsec.models import (
    FileInfo,
    FileList,
    ListFilesRequest,
    RemoveFileRequest,
    RenameRequest,
    SandboxPathRequest,
)

__all__ = ["METADATA_XATTR_PREFIX", "RECURSIVE_WATCH_DEPTH", "FilesystemService", "entry_info"]

METADATA_XATTR_PREFIX = "user.e2b."
"""envd keeps a file's metadata as extended attributes ``user.e2b.<key>`` (keys lowercased)."""

RECURSIVE_WATCH_DEPTH = 16
"""Levels below the watched directory a recursive watch sees."""
WATCH_POLL_INTERVAL_S = 0.25
"""How often a watch re-lists its tree, seconds."""
MAX_SYMLINK_HOPS = 40
"""Symlinks followed to find what a symlink leads to (Linux's own limit)."""
MAX_LIST_DEPTH = 32
"""Deepest ``list(depth=)`` (the edge's limit)."""
MAX_WATCHERS_PER_SANDBOX = 64
WATCHER_IDLE_EXPIRY_S = 600.0
"""A ``CreateWatcher`` watcher nobody polled for this long is dropped, seconds."""
MAX_WATCHER_EVENTS = 10_000
"""Events a ``CreateWatcher`` watcher keeps until ``GetWatcherEvents`` drains them."""

_TYPES = {
    "file": fs_pb.FileType.FILE,
    "dir": fs_pb.FileType.DIRECTORY,
    "symlink": fs_pb.FileType.SYMLINK,
}
_MODE_BITS = {"file": stat_mod.S_IFREG, "dir": stat_mod.S_IFDIR, "symlink": stat_mod.S_IFLNK}
_EVENT_TYPES: dict[FileEventKind, fs_pb.EventType] = {
    "create": fs_pb.EventType.CREATE,
    "write": fs_pb.EventType.WRITE,
    "remove": fs_pb.EventType.REMOVE,
    "rename": fs_pb.EventType.RENAME,
    "chmod": fs_pb.EventType.CHMOD,
}


def _watch_start() -> fs_pb.WatchDirResponse:
    payload: Oneof[Literal["start"], fs_pb.WatchDirResponse.StartEvent] = Oneof(
        "start", fs_pb.WatchDirResponse.StartEvent()
    )
    return fs_pb.WatchDirResponse(event=payload)


def _watch_event(ev: fs_pb.FilesystemEvent) -> fs_pb.WatchDirResponse:
    payload: Oneof[Literal["filesystem"], fs_pb.FilesystemEvent] = Oneof("filesystem", ev)
    return fs_pb.WatchDirResponse(event=payload)


def _watch_keepalive() -> fs_pb.WatchDirResponse:
    payload: Oneof[Literal["keepalive"], fs_pb.WatchDirResponse.KeepAlive] = Oneof(
        "keepalive", fs_pb.WatchDirResponse.KeepAlive()
    )
    return fs_pb.WatchDirResponse(event=payload)


def _user_name(uid: int) -> str:
    return "root" if uid == 0 else str(uid)


def entry_info(
    info: FileInfo,
    names: tuple[str, str] | None = None,
    metadata: dict[str, str] | None = None,
) -> fs_pb.EntryInfo:
    """envd's ``EntryInfo`` for a dsec :class:`FileInfo`: ``names`` are the owner and group
    names (default: ``root`` or the numeric id), ``metadata`` the file's metadata."""
    mode = info.mode & 0o7777
    owner, group = names if names is not None else (_user_name(info.uid), _user_name(info.gid))
    return fs_pb.EntryInfo(
        name=info.name,
        type=_TYPES.get(info.type, fs_pb.FileType.UNSPECIFIED),
        path=info.path,
        size=info.size,
        mode=mode,
        permissions=stat_mod.filemode(_MODE_BITS.get(info.type, 0) | mode),
        owner=owner,
        group=group,
        modified_time=Timestamp.from_nanos(int(info.mtime * 1e9)),
        symlink_target=info.target,
        is_symlink=info.target is not None,
        metadata=metadata or {},
    )


Fingerprint = tuple[str, int, float, int]


@dataclass
class _Watcher:
    sandbox_id: str
    owner: str
    path: str
    recursive: bool
    include_entry: bool
    snapshot: dict[str, tuple[Fingerprint, FileInfo]]
    last_used: float = field(default_factory=time.monotonic)
    recorded: deque[fs_pb.FilesystemEvent] = field(
        default_factory=lambda: deque(maxlen=MAX_WATCHER_EVENTS)
    )
    """Events seen by the background poll, not yet returned by ``GetWatcherEvents``."""
    failure: ConnectError | None = None
    """Why the background poll stopped (the directory was removed, the sandbox is gone)."""
    recorder: asyncio.Task[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises polls (background and ``GetWatcherEvents``) so the diff base stays consistent."""
    kernel: DirectoryWatcher | None = None
    """The edge's kernel watch (inotify), when it has one; else the tree is polled."""

    def stop(self) -> None:
        if self.recorder is not None:
            self.recorder.cancel()
        if self.kernel is not None:
            asyncio.ensure_future(self.kernel.close())
            self.kernel = None


Authorize = Callable[[RequestContext], Awaitable[tuple[str, str]]]


class FilesystemService(filesystem_connect.Filesystem):
    """The ``filesystem.Filesystem`` Connect service."""

    def __init__(
        self,
        edge: EdgeAPI,
        authorize: Authorize,
        *,
        users: SandboxUsers | None = None,
        poll_interval_s: float = WATCH_POLL_INTERVAL_S,
    ) -> None:
        self._edge = edge
        self._authorize = authorize
        self.users = users if users is not None else SandboxUsers(edge)
        self._poll_interval_s = poll_interval_s
        self._watchers: dict[str, _Watcher] = {}

    # --- helpers ------------------------------------------------------------
    async def _abs(
        self, sandbox_id: str, owner: str, path: str, ctx: RequestContext | None = None
    ) -> str:
        """``path`` made absolute (a relative one against the request's user's home)."""
        if not path:
            raise ConnectError(Code.INVALID_ARGUMENT, "path is empty")
        user = user_from_headers(ctx.request_headers) if ctx is not None else None
        try:
            return await self.users.resolve(sandbox_id, owner, path, user)
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None

    async def entries(
        self, sandbox_id: str, owner: str, infos: list[FileInfo]
    ) -> list[fs_pb.EntryInfo]:
        """envd entries of ``infos``: owner and group names, each file's metadata, and for a
        symlink (as envd) the type and size of what it leads to and that path, absolute."""
        try:
            infos = [
                await self._through_link(sandbox_id, owner, i) if i.type == "symlink" else i
                for i in infos
            ]
            names = [await self.users.names(sandbox_id, owner, i.uid, i.gid) for i in infos]
            metadata = await self.metadata(sandbox_id, owner, [i.path for i in infos])
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        return [entry_info(i, n, m) for i, n, m in zip(infos, names, metadata, strict=True)]

    async def _through_link(self, sandbox_id: str, owner: str, link: FileInfo) -> FileInfo:
        """``link`` as envd shows a symlink: the final target's type and size, and the
        target's absolute path (a dangling link stays a symlink, its target made absolute)."""
        target = link.target or ""
        seen = 0
        current = link
        while current.type == "symlink" and seen < MAX_SYMLINK_HOPS:
            seen += 1
            base = posixpath.dirname(current.path) or "/"
            target = posixpath.normpath(posixpath.join(base, current.target or ""))
            try:
                current = await self._edge.stat_file(
                    SandboxPathRequest(sandbox_id=sandbox_id, path=target), owner
                )
            except (FileNotFound, InvalidRequest):
                return link.model_copy(update={"target": target})
        if current.type == "symlink":  # a loop
            return link.model_copy(update={"target": target})
        return link.model_copy(
            update={"type": current.type, "size": current.size, "target": target}
        )

    async def metadata(
        self, sandbox_id: str, owner: str, paths: list[str]
    ) -> list[dict[str, str] | None]:
        """The metadata (``user.e2b.*`` attributes, prefix stripped) of each path; ``None``
        where there is none, or on an edge or tier that keeps no extended attributes."""
        if not paths or not isinstance(self._edge, FileXattrs):
            return [None] * len(paths)
        try:
            found = await self._edge.get_xattrs(sandbox_id, owner, paths, METADATA_XATTR_PREFIX)
        except CapabilityNotSupported:
            return [None] * len(paths)
        n = len(METADATA_XATTR_PREFIX)
        return [{k[n:]: v for k, v in attrs.items()} or None for attrs in found]

    async def _call(self, sandbox_id: str, coro: Awaitable[object]) -> object:
        try:
            return await coro
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None

    async def _listing(self, w: _Watcher) -> dict[str, tuple[Fingerprint, FileInfo]]:
        depth = RECURSIVE_WATCH_DEPTH if w.recursive else 1
        req = ListFilesRequest(sandbox_id=w.sandbox_id, path=w.path, depth=depth)
        infos = (await self._edge.list_files(req, w.owner)).entries
        return {i.path: ((i.type, i.size, i.mtime, i.mode), i) for i in infos if i.path != w.path}

    def _diff(
        self, w: _Watcher, new: dict[str, tuple[Fingerprint, FileInfo]]
    ) -> list[fs_pb.FilesystemEvent]:
        events: list[fs_pb.FilesystemEvent] = []

        def event(path: str, kind: fs_pb.EventType, info: FileInfo | None) -> None:
            name = posixpath.relpath(path, w.path)
            entry = entry_info(info) if (w.include_entry and info is not None) else None
            events.append(fs_pb.FilesystemEvent(name=name, type=kind, entry=entry))

        for path, (fp, info) in sorted(new.items()):
            old = w.snapshot.get(path)
            if old is None:
                event(path, fs_pb.EventType.CREATE, info)
            elif old[0] != fp:
                ofp = old[0]
                only_mode = ofp[0] == fp[0] and ofp[1] == fp[1] and ofp[2] == fp[2]
                event(path, fs_pb.EventType.CHMOD if only_mode else fs_pb.EventType.WRITE, info)
        for path in sorted(set(w.snapshot) - set(new)):
            event(path, fs_pb.EventType.REMOVE, None)
        w.snapshot = new
        return events

    async def _new_watcher(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        recursive: bool,
        include_entry: bool,
        ctx: RequestContext | None = None,
    ) -> _Watcher:
        path = await self._abs(sandbox_id, owner, path, ctx)
        try:
            info = await self._edge.stat_file(
                SandboxPathRequest(sandbox_id=sandbox_id, path=path), owner
            )
            if info.type != "dir":
                raise InvalidRequest(f"path {path} is not a directory")
            w = _Watcher(sandbox_id, owner, path, recursive, include_entry, {})
            if isinstance(self._edge, DirectoryWatch):
                with contextlib.suppress(CapabilityNotSupported):  # then: polling
                    w.kernel = await self._edge.watch_directory(
                        sandbox_id, owner, path, recursive=recursive
                    )
            if w.kernel is None:
                w.snapshot = await self._listing(w)
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        return w

    async def _kernel_events(self, w: _Watcher, timeout_s: float) -> list[fs_pb.FilesystemEvent]:
        """The kernel watch's events (waiting up to ``timeout_s``) as envd's events; the
        watch's end (directory removed, sandbox gone) as the Connect error."""
        assert w.kernel is not None
        try:
            found = await w.kernel.events(timeout_s)
        except FileNotFound:
            raise ConnectError(Code.NOT_FOUND, f"watched directory {w.path} was removed") from None
        except DsecError as e:
            raise to_connect_error(e, w.sandbox_id) from None
        out: list[fs_pb.FilesystemEvent] = []
        for ev in found:
            entry = None
            if w.include_entry and ev.kind != "remove":
                try:  # best effort, as envd: the entry of a path that still exists
                    info = await self._edge.stat_file(
                        SandboxPathRequest(sandbox_id=w.sandbox_id, path=ev.path), w.owner
                    )
                    entry = (await self.entries(w.sandbox_id, w.owner, [info]))[0]
                except (DsecError, ConnectError):
                    entry = None
            out.append(
                fs_pb.FilesystemEvent(
                    name=posixpath.relpath(ev.path, w.path), type=_EVENT_TYPES[ev.kind], entry=entry
                )
            )
        return out

    def _expire_watchers(self) -> None:
        now = time.monotonic()
        for wid, w in list(self._watchers.items()):
            if now - w.last_used > WATCHER_IDLE_EXPIRY_S:
                self._watchers.pop(wid).stop()

    def drop_sandbox(self, sandbox_id: str) -> None:
        """Forget (and stop) the watchers of a sandbox that was killed."""
        for wid, w in list(self._watchers.items()):
            if w.sandbox_id == sandbox_id:
                self._watchers.pop(wid).stop()

    def aclose(self) -> None:
        """Stop every watcher's background poll (server shutdown)."""
        for w in self._watchers.values():
            w.stop()
        self._watchers.clear()

    async def _poll_into(self, w: _Watcher) -> None:
        """One poll of ``w``: new events go to ``w.recorded``; errors to ``w.failure``."""
        async with w.lock:
            if w.failure is not None:
                return
            if w.kernel is not None:
                try:
                    w.recorded.extend(await self._kernel_events(w, 0.0))
                except ConnectError as e:
                    w.failure = e
                return
            try:
                w.recorded.extend(self._diff(w, await self._listing(w)))
            except FileNotFound:
                w.failure = ConnectError(Code.NOT_FOUND, f"watched directory {w.path} was removed")
            except DsecError as e:
                w.failure = to_connect_error(e, w.sandbox_id)

    async def _record(self, watcher_id: str, w: _Watcher) -> None:
        """Background poll of a ``CreateWatcher`` watcher until removed, expired or failed."""
        while w.failure is None:
            await asyncio.sleep(self._poll_interval_s)
            if time.monotonic() - w.last_used > WATCHER_IDLE_EXPIRY_S:
                self._watchers.pop(watcher_id, None)
                return
            try:
                info = await self._edge.get_sandbox(sandbox_ref(w.sandbox_id), w.owner)
            except DsecError as e:
                w.failure = to_connect_error(e, w.sandbox_id)
                return
            if info.state == "paused":
                continue
            if info.state == "stopped":
                w.failure = ConnectError(Code.UNAVAILABLE, f"sandbox {w.sandbox_id} is stopped")
                return
            await self._poll_into(w)

    # --- RPCs -------------------------------------------------------------
    async def stat(self, request: fs_pb.StatRequest, ctx: RequestContext) -> fs_pb.StatResponse:
        sandbox_id, owner = await self._authorize(ctx)
        path = await self._abs(sandbox_id, owner, request.path, ctx)
        info = await self._call(
            sandbox_id,
            self._edge.stat_file(SandboxPathRequest(sandbox_id=sandbox_id, path=path), owner),
        )
        assert isinstance(info, FileInfo)
        return fs_pb.StatResponse(entry=(await self.entries(sandbox_id, owner, [info]))[0])

    async def make_dir(
        self, request: fs_pb.MakeDirRequest, ctx: RequestContext
    ) -> fs_pb.MakeDirResponse:
        sandbox_id, owner = await self._authorize(ctx)
        path = await self._abs(sandbox_id, owner, request.path, ctx)
        try:
            existing = await self._edge.stat_file(
                SandboxPathRequest(sandbox_id=sandbox_id, path=path), owner
            )
        except FileNotFound:
            pass
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        else:
            if existing.type != "dir":  # as envd: the SDK raises InvalidArgumentException
                raise ConnectError(
                    Code.INVALID_ARGUMENT, f"path {path} already exists but it is not a directory"
                )
            raise ConnectError(Code.ALREADY_EXISTS, f"directory {path} already exists")
        info = await self._call(
            sandbox_id,
            self._edge.make_dir(SandboxPathRequest(sandbox_id=sandbox_id, path=path), owner),
        )
        assert isinstance(info, FileInfo)
        return fs_pb.MakeDirResponse(entry=(await self.entries(sandbox_id, owner, [info]))[0])

    async def move(self, request: fs_pb.MoveRequest, ctx: RequestContext) -> fs_pb.MoveResponse:
        sandbox_id, owner = await self._authorize(ctx)
        src = await self._abs(sandbox_id, owner, request.source, ctx)
        dst = await self._abs(sandbox_id, owner, request.destination, ctx)
        info = await self._call(
            sandbox_id,
            self._edge.rename_file(RenameRequest(sandbox_id=sandbox_id, src=src, dst=dst), owner),
        )
        assert isinstance(info, FileInfo)
        return fs_pb.MoveResponse(entry=(await self.entries(sandbox_id, owner, [info]))[0])

    async def list_dir(
        self, request: fs_pb.ListDirRequest, ctx: RequestContext
    ) -> fs_pb.ListDirResponse:
        sandbox_id, owner = await self._authorize(ctx)
        path = await self._abs(sandbox_id, owner, request.path, ctx)
        depth = request.depth or 1
        if depth > MAX_LIST_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth is at most {MAX_LIST_DEPTH}")
        req = ListFilesRequest(sandbox_id=sandbox_id, path=path, depth=depth)
        listed = await self._call(sandbox_id, self._edge.list_files(req, owner))
        assert isinstance(listed, FileList)
        return fs_pb.ListDirResponse(
            entries=await self.entries(
                sandbox_id, owner, [i for i in listed.entries if i.path != path]
            )
        )

    async def remove(
        self, request: fs_pb.RemoveRequest, ctx: RequestContext
    ) -> fs_pb.RemoveResponse:
        sandbox_id, owner = await self._authorize(ctx)
        path = await self._abs(sandbox_id, owner, request.path, ctx)
        if path == "/":
            raise ConnectError(Code.INVALID_ARGUMENT, "refusing to remove /")
        try:
            await self._edge.remove_file(
                RemoveFileRequest(sandbox_id=sandbox_id, path=path, recursive=True), owner
            )
        except FileNotFound:
            pass  # as envd (os.RemoveAll): removing what is not there succeeds
        except DsecError as e:
            raise to_connect_error(e, sandbox_id) from None
        return fs_pb.RemoveResponse()

    async def watch_dir(
        self, request: fs_pb.WatchDirRequest, ctx: RequestContext
    ) -> AsyncIterator[fs_pb.WatchDirResponse]:
        sandbox_id, owner = await self._authorize(ctx)
        w = await self._new_watcher(
            sandbox_id, owner, request.path, request.recursive, request.include_entry, ctx
        )
        yield _watch_start()
        raw = ctx.request_headers.get("keepalive-ping-interval")
        keepalive = 50.0
        with contextlib.suppress(ValueError):
            keepalive = min(max(float(raw or 50), 1.0), 300.0)
        loop = asyncio.get_running_loop()
        last_sent = loop.time()
        try:
            while True:
                remaining = ctx.timeout_ms
                if remaining is not None and remaining <= 0:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "watch timeout reached")
                if w.kernel is not None:  # pushed by the kernel: wait for them
                    wait = keepalive - (loop.time() - last_sent)
                    if remaining is not None:
                        wait = min(wait, remaining / 1000.0)
                    events = await self._kernel_events(w, max(wait, 0.01))
                else:
                    await asyncio.sleep(self._poll_interval_s)
                    try:
                        events = self._diff(w, await self._listing(w))
                    except FileNotFound:
                        raise ConnectError(
                            Code.NOT_FOUND, f"watched directory {w.path} was removed"
                        ) from None
                    except DsecError as e:
                        raise to_connect_error(e, sandbox_id) from None
                for ev in events:
                    yield _watch_event(ev)
                    last_sent = loop.time()
                if loop.time() - last_sent >= keepalive:
                    yield _watch_keepalive()
                    last_sent = loop.time()
        finally:
            w.stop()

    async def create_watcher(
        self, request: fs_pb.CreateWatcherRequest, ctx: RequestContext
    ) -> fs_pb.CreateWatcherResponse:
        sandbox_id, owner = await self._authorize(ctx)
        self._expire_watchers()
        if (
            sum(1 for w in self._watchers.values() if w.sandbox_id == sandbox_id)
            >= MAX_WATCHERS_PER_SANDBOX
        ):
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"at most {MAX_WATCHERS_PER_SANDBOX} watchers per sandbox"
            )
        w = await self._new_watcher(
            sandbox_id, owner, request.path, request.recursive, request.include_entry, ctx
        )
        watcher_id = "w-" + secrets.token_hex(8)
        self._watchers[watcher_id] = w
        if w.kernel is None:  # a kernel watch records by itself
            w.recorder = asyncio.create_task(self._record(watcher_id, w))
        return fs_pb.CreateWatcherResponse(watcher_id=watcher_id)

    def _get_watcher(self, watcher_id: str, sandbox_id: str, owner: str) -> _Watcher:
        w = self._watchers.get(watcher_id)
        if w is None or w.sandbox_id != sandbox_id or w.owner != owner:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id} not found")
        w.last_used = time.monotonic()
        return w

    async def get_watcher_events(
        self, request: fs_pb.GetWatcherEventsRequest, ctx: RequestContext
    ) -> fs_pb.GetWatcherEventsResponse:
        sandbox_id, owner = await self._authorize(ctx)
        w = self._get_watcher(request.watcher_id, sandbox_id, owner)
        await self._poll_into(w)  # and what changed since the last background poll
        events = list(w.recorded)
        w.recorded.clear()
        if not events and w.failure is not None:
            raise w.failure
        return fs_pb.GetWatcherEventsResponse(events=events)

    async def remove_watcher(
        self, request: fs_pb.RemoveWatcherRequest, ctx: RequestContext
    ) -> fs_pb.RemoveWatcherResponse:
        sandbox_id, owner = await self._authorize(ctx)
        self._get_watcher(request.watcher_id, sandbox_id, owner)
        w = self._watchers.pop(request.watcher_id, None)
        if w is not None:
            w.stop()
        return fs_pb.RemoveWatcherResponse()
