"""Directory watches on container sandboxes, from the kernel's inotify.

A container's root filesystem is an overlay mounted on the host; the sandbox writes through
that very mount, so an inotify watch the host puts on a directory of it sees every change
the sandbox makes (and the files API's own), as they happen: nothing is polled, events are
not merged into snapshots of a listing, a rename is a rename.

One :class:`WatchHub` (one inotify instance, read on the event loop) serves every
:class:`DirWatcher` of a node: ``fs.inotify.max_user_instances`` is per user (128 by
default, and the edge runs as root), watches are not. A watcher resolves each directory it
watches inside the sandbox's root as the files API does (``openat2`` with
``RESOLVE_IN_ROOT``: symlinks cannot lead it out, kernel mounts are refused), then hands
the kernel the directory's descriptor (``/proc/self/fd/N``), never a path string.

Events (the kinds envd reports, from Go's fsnotify):

=========================================  =============
inotify                                    event
=========================================  =============
``IN_CREATE``, ``IN_MOVED_TO``             ``create``
``IN_MODIFY``                              ``write``
``IN_ATTRIB``                              ``chmod``
``IN_DELETE``                              ``remove``
``IN_MOVED_FROM``                          ``rename``
=========================================  =============

The kernel merges an event with the previous one only when they are identical and the
first is still unread. A recursive watcher watches every directory below its own (up to
:data:`MAX_WATCHED_DIRS`, at most :data:`RECURSIVE_DEPTH` levels) and adds the ones created
later as their ``create`` arrives (a file written into a new directory before its watch is
added is missed, as with fsnotify). Removing or moving the watched directory itself, or
the sandbox going away (its root unmounted), ends the watcher: :meth:`DirWatcher.events`
raises ``FileNotFound`` or ``SandboxStopped``. At most :data:`MAX_QUEUED_EVENTS` wait per
watcher; beyond, the oldest are dropped (as when the kernel's own queue overflows).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import posixpath
import struct
from collections import deque
from typing import TYPE_CHECKING

from dsec.contract.streams import FileEvent, FileEventKind
from dsec.errors import (
    DsecError,
    FileNotFound,
    InvalidRequest,
    QuotaExceeded,
    SandboxError,
    SandboxStopped,
)

if TYPE_CHECKING:
    from dsec.runtimes.container.files import RootedFiles

__all__ = ["MAX_QUEUED_EVENTS", "MAX_WATCHED_DIRS", "RECURSIVE_DEPTH", "DirWatcher", "WatchHub"]

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000

WATCH_MASK = (
    IN_MODIFY
    | IN_ATTRIB
    | IN_MOVED_FROM
    | IN_MOVED_TO
    | IN_CREATE
    | IN_DELETE
    | IN_DELETE_SELF
    | IN_MOVE_SELF
    | IN_ONLYDIR
)
MAX_QUEUED_EVENTS = 10_000
MAX_WATCHED_DIRS = 4096
"""Directories one recursive watcher may watch (beyond: ``QuotaExceeded``)."""
RECURSIVE_DEPTH = 16
_EVENT = struct.Struct("iIII")
_KINDS: tuple[tuple[int, FileEventKind], ...] = (
    (IN_CREATE | IN_MOVED_TO, "create"),
    (IN_MODIFY, "write"),
    (IN_ATTRIB, "chmod"),
    (IN_DELETE, "remove"),
    (IN_MOVED_FROM, "rename"),
)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> int:
    if result < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return result


class WatchHub:
    """The node's inotify instance and the watches of every :class:`DirWatcher` on it.
    Lives on one event loop (the edge's); created lazily, closed with the runtime."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # wd -> {watcher: directory of that watcher, relative to its root ("" = the root)}
        self._wds: dict[int, dict[DirWatcher, str]] = {}

    def _ensure(self) -> int:
        if self._fd is None:
            self._fd = _check(_libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC), "inotify_init1")
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._fd, self.read_pending)
        return self._fd

    @property
    def watch_count(self) -> int:
        """Kernel watches held (for tests and metrics)."""
        return len(self._wds)

    def add(self, watcher: DirWatcher, dir_fd: int, rel: str) -> int:
        """Watch the directory open as ``dir_fd`` for ``watcher`` (``rel``: its path below the
        watcher's root). Returns the watch descriptor."""
        fd = self._ensure()
        path = f"/proc/self/fd/{dir_fd}".encode()
        wd = _check(_libc.inotify_add_watch(fd, path, WATCH_MASK), "inotify_add_watch")
        self._wds.setdefault(wd, {})[watcher] = rel
        return wd

    def discard(self, watcher: DirWatcher, wds: set[int]) -> None:
        """Forget ``watcher``'s watches; a watch nobody else uses is removed from the kernel."""
        for wd in wds:
            users = self._wds.get(wd)
            if users is None:
                continue
            users.pop(watcher, None)
            if not users:
                del self._wds[wd]
                if self._fd is not None:
                    _libc.inotify_rm_watch(self._fd, wd)  # EINVAL if already gone: fine

    def read_pending(self) -> None:
        """Dispatch every event the kernel has queued (the loop's reader may not have run
        yet: a caller about to read its watcher wants what already happened)."""
        while self._fd is not None and self._on_readable():
            pass

    def _on_readable(self) -> bool:
        """Read and dispatch one buffer of events; False when there was none."""
        assert self._fd is not None
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return False
        off = 0
        while off + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
            raw = data[off + _EVENT.size : off + _EVENT.size + length]
            off += _EVENT.size + length
            name = raw.split(b"\0", 1)[0].decode(errors="surrogateescape")
            if mask & IN_Q_OVERFLOW:
                for users in list(self._wds.values()):
                    for w in users:
                        w.overflowed = True
                continue
            for watcher, rel in list(self._wds.get(wd, {}).items()):
                watcher.deliver(wd, rel, mask, name)
            if mask & IN_IGNORED:  # the watched directory is gone (removed, unmounted)
                self._wds.pop(wd, None)
        return bool(data)

    def close(self) -> None:
        if self._fd is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        self._wds.clear()


class DirWatcher:
    """The changes below one directory of one sandbox (see the module docstring). Make it
    with :meth:`start`; read it with :meth:`events`; :meth:`close` it."""

    def __init__(self, hub: WatchHub, files: RootedFiles, path: str, recursive: bool) -> None:
        self._hub = hub
        self._files = files
        self.path = path
        self.recursive = recursive
        self._wds: set[int] = set()
        self._root_wd: int | None = None
        self._queue: deque[FileEvent] = deque(maxlen=MAX_QUEUED_EVENTS)
        self._ready = asyncio.Event()
        self._failure: DsecError | None = None
        self._closed = False
        self.overflowed = False
        """True once events were lost (the kernel's or this queue's limit)."""

    async def start(self) -> DirWatcher:
        """Watch the directory (and, recursively, those below it). Raises ``FileNotFound``,
        ``InvalidRequest`` (not a directory, a kernel mount), ``QuotaExceeded``."""
        info = await self._files.stat(self.path)
        if info.type != "dir":
            raise InvalidRequest(f"path {self.path} is not a directory", path=self.path)
        self._root_wd = self._watch("")
        if self.recursive:
            below = await self._files.list(self.path, RECURSIVE_DEPTH)
            for entry in below:
                if entry.type == "dir":
                    self._watch(posixpath.relpath(entry.path, self.path))
        return self

    def _watch(self, rel: str) -> int:
        if len(self._wds) >= MAX_WATCHED_DIRS:
            raise QuotaExceeded(
                f"more than {MAX_WATCHED_DIRS} directories under {self.path} to watch",
                path=self.path,
            )
        full = self.path if not rel else posixpath.join(self.path, rel)
        try:
            with self._files.open_dir(full) as fd:
                wd = self._hub.add(self, fd, rel)
        except OSError as e:
            raise SandboxError(f"cannot watch {full}: {e.strerror}", path=full) from None
        self._wds.add(wd)
        return wd

    def deliver(self, wd: int, rel: str, mask: int, name: str) -> None:
        """One inotify event of a directory this watcher watches (called by the hub)."""
        if self._closed or self._failure is not None:
            return
        if wd == self._root_wd and mask & (IN_DELETE_SELF | IN_MOVE_SELF):
            self._fail(FileNotFound(f"watched directory {self.path} was removed", path=self.path))
            return
        if mask & IN_UNMOUNT:
            self._fail(SandboxStopped("the sandbox's filesystem went away"))
            return
        if mask & IN_IGNORED:
            self._wds.discard(wd)
            if wd == self._root_wd:
                self._fail(
                    FileNotFound(f"watched directory {self.path} was removed", path=self.path)
                )
            return
        if not name:
            return
        child = posixpath.join(rel, name) if rel else name
        for bits, kind in _KINDS:
            if mask & bits:
                if len(self._queue) == self._queue.maxlen:
                    self.overflowed = True
                self._queue.append(FileEvent(path=posixpath.join(self.path, child), kind=kind))
                break
        if self.recursive and mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
            if child.count("/") < RECURSIVE_DEPTH:
                with contextlib.suppress(DsecError):  # gone again already, or too many
                    self._watch(child)
        self._ready.set()

    def _fail(self, error: DsecError) -> None:
        self._failure = error
        self._ready.set()

    async def events(self, timeout_s: float) -> list[FileEvent]:
        """The events since the last call, waiting up to ``timeout_s`` seconds for one
        (``[]`` when none came). Raises the reason once the watch has ended and its events
        were read."""
        self._hub.read_pending()
        if not self._queue and self._failure is None and timeout_s > 0:
            self._ready.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        out = list(self._queue)
        self._queue.clear()
        if not out and self._failure is not None:
            raise self._failure
        return out

    async def close(self) -> None:
        """Stop watching (idempotent)."""
        if not self._closed:
            self._closed = True
            self._hub.discard(self, self._wds)
            self._wds.clear()
