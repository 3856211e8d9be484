"""Host-side file access to a container's root filesystem, confined to it.

Every path is resolved by the kernel with ``openat2(2)`` relative to an ``O_PATH``
descriptor of the sandbox's root, with ``RESOLVE_IN_ROOT`` (``..`` and absolute
symlinks stay inside the root, as they would inside the container),
``RESOLVE_NO_MAGICLINKS`` (no ``/proc/*/fd`` jumps) and ``RESOLVE_NO_XDEV`` (no
crossing into another mount). Operations on the last component use the parent's
descriptor and a single name (``unlinkat``, ``mkdirat``, ``renameat``...), so no
path string is ever resolved by the host outside that discipline. A path whose
``..`` would climb above ``/`` is refused with :class:`PathOutsideSandbox`
before it reaches the kernel.

Only regular files are read or written (a FIFO or a device node planted by the
sandbox can neither block nor reach the host). Blocking work runs in a thread.

Kernel mounts: inside the container ``/proc``, ``/sys`` and ``/dev`` (with ``/dev/pts``,
``/dev/shm``, ``/dev/mqueue`` and dsec's init binary) are separate mounts (see
``bundle.py``); the host sees only the empty directories of the overlay beneath them.
Every operation on a path at or beneath them, named directly or reached through a
symlink, is refused with :class:`InvalidRequest` (reading them means running a command
in the sandbox). Listing ``/`` still shows the three directories.

Depth: directory walks (recursive remove, list, ``download_tar``) keep at most two
descriptors open and no recursion, whatever the depth; they climb back with ``..`` and
check that they are where they came from (:class:`Conflict` if the sandbox moved the
tree meanwhile). ``upload_tar`` streams each member to disk in 1 MiB chunks, refuses a
member that would take the unpacked total past the sandbox's free disk space
(:class:`QuotaExceeded`), and writes each file under a temporary name renamed into place
only when complete, so a refused or failed member leaves no partial file.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import io
import os
import posixpath
import secrets
import stat
import tarfile
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NamedTuple, TypeVar

from dsec.errors import (
    CapabilityNotSupported,
    Conflict,
    DsecError,
    FileExists_,
    FileNotFound,
    InvalidRequest,
    PathOutsideSandbox,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxError,
)
from dsec.models import FileInfo, FileType
from dsec.runtimes.container.watch import DirWatcher, WatchHub

__all__ = ["RootedFiles", "openat2"]

_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_MAX_LIST_ENTRIES = 100_000
_COPY_CHUNK_BYTES = 1 << 20
"""``upload_tar`` copies a member to disk in chunks of this many bytes (bounded memory)."""
KERNEL_MOUNT_DIRS: frozenset[str] = frozenset({"proc", "sys", "dev"})
"""Top-level directories that are separate mounts inside the container (``bundle.py``'s
mount list: proc, sysfs, the /dev tmpfs and everything mounted under it). The files API
refuses paths at or beneath them."""

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    """openat2(2): open ``path`` relative to ``dirfd`` under ``resolve`` rules. Raises OSError."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = _libc.syscall(
        _SYS_OPENAT2,
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{os.strerror(e)}: {path}")
    return int(fd)


T = TypeVar("T")


def _components(path: str) -> list[str]:
    """The components of an absolute sandbox path; refuses ``..`` above the root."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path must be absolute: {path!r}", path=path)
    depth = 0
    out: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if depth == 0:
                raise PathOutsideSandbox(f"path {path!r} leaves the sandbox root", path=path)
            depth -= 1
        else:
            depth += 1
        out.append(part)
    return out


def _map_oserror(e: OSError, path: str) -> DsecError:
    code = e.errno
    if code == errno.ENOENT:
        return FileNotFound(f"no such file or directory: {path}", path=path)
    if code == errno.EEXIST:
        return FileExists_(f"already exists: {path}", path=path)
    if code == errno.ENOTEMPTY:
        return InvalidRequest(f"directory not empty: {path}", path=path)
    if code in (errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.EINVAL, errno.ENAMETOOLONG):
        return InvalidRequest(f"{os.strerror(code or 0)}: {path}", path=path)
    if code == errno.EXDEV:
        return PathOutsideSandbox(f"path {path!r} crosses a mount boundary", path=path)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return QuotaExceeded(f"the sandbox's disk is full writing {path}", path=path)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return InvalidRequest(f"permission denied: {path}", path=path)
    return SandboxError(f"file operation on {path} failed: {e}", path=path)


def _file_type(mode: int) -> FileType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _kernel_mount_error(path: str, top: str) -> InvalidRequest:
    return InvalidRequest(
        f"{path} is a kernel/device mount inside the sandbox (/{top}): the files API does "
        "not reach it; use a command (e.g. `cat`, `ls`) instead",
        path=path,
    )


def _refuse_kernel_mount(parts: list[str], path: str) -> None:
    """Refuse a path that names, lexically, something at or beneath a kernel mount."""
    norm: list[str] = []
    for part in parts:
        if part == "..":
            if norm:
                norm.pop()
        else:
            norm.append(part)
    if norm and norm[0] in KERNEL_MOUNT_DIRS:
        raise _kernel_mount_error(path, norm[0])


class _WalkStep(NamedTuple):
    """One step of :func:`_walk_tree`.

    ``kind``: ``"entry"`` (a non-directory, or a directory on another device, not
    descended), ``"dir"`` (a directory, before its contents) or ``"post"`` (a directory
    after its contents). ``dir_fd`` is the open directory holding ``name``, valid only
    until the next step; ``rel`` is the path relative to the walk's top.
    """

    kind: str
    dir_fd: int
    name: str
    rel: str
    st: os.stat_result


@dataclass
class _Frame:
    names: list[str]
    rel: str
    st: os.stat_result
    pos: int = 0


def _walk_tree(
    top_fd: int, descend: Callable[[str, int], bool]
) -> Generator[_WalkStep, None, None]:
    """Depth-first walk below the directory open as ``top_fd`` (which is neither yielded
    nor closed), in sorted name order, never following symlinks nor crossing devices.

    Iterative and holding at most two descriptors whatever the depth: it enters a child
    with ``openat(O_NOFOLLOW)`` and leaves it through ``..``, checking that ``..`` is the
    very directory (device and inode) it came from. ``descend(rel, level)`` decides
    whether to enter the directory ``rel`` found at ``level`` (1 = a child of the top).

    Raises:
        Conflict: the tree was moved while it was walked (``..`` led elsewhere).
        OSError: as the underlying calls.
    """
    top_st = os.fstat(top_fd)
    dev = top_st.st_dev
    cur = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=top_fd)
    try:
        frames = [_Frame(sorted(os.listdir(cur)), "", top_st)]
        while frames:
            frame = frames[-1]
            if frame.pos < len(frame.names):
                name = frame.names[frame.pos]
                frame.pos += 1
                try:
                    st = os.stat(name, dir_fd=cur, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while we walked
                rel = f"{frame.rel}/{name}" if frame.rel else name
                if not stat.S_ISDIR(st.st_mode) or st.st_dev != dev:
                    yield _WalkStep("entry", cur, name, rel, st)
                    continue
                yield _WalkStep("dir", cur, name, rel, st)
                if not descend(rel, len(frames)):
                    continue
                try:
                    child = os.open(
                        name,
                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=cur,
                    )
                except (FileNotFoundError, NotADirectoryError):
                    continue  # replaced while we walked
                try:
                    child_st = os.fstat(child)
                    if (child_st.st_dev, child_st.st_ino) != (dev, st.st_ino):
                        os.close(child)
                        continue  # replaced between stat and open
                    names = sorted(os.listdir(child))
                except BaseException:
                    os.close(child)
                    raise
                os.close(cur)
                cur = child
                frames.append(_Frame(names, rel, child_st))
            else:
                done = frames.pop()
                if not frames:
                    break
                parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
                parent_st = os.fstat(parent)
                expected = frames[-1].st
                if (parent_st.st_dev, parent_st.st_ino) != (expected.st_dev, expected.st_ino):
                    os.close(parent)
                    raise Conflict(
                        f"the directory tree was moved while it was walked (at {done.rel!r})",
                        path=done.rel,
                    )
                os.close(cur)
                cur = parent
                yield _WalkStep("post", cur, posixpath.basename(done.rel), done.rel, done.st)
    finally:
        os.close(cur)


class RootedFiles:
    """:class:`~dsec.contract.runtime.SandboxFiles` over a root directory on the host.

    Args:
        root: the sandbox's rootfs on the host (the overlay mount point).
        owner: ``(uid, gid)`` given to files and directories this class creates.
        watch_hub: the node's inotify instance, for :meth:`watch` (None: no watches).
        max_upload_bytes: a cap on one ``upload_tar``'s unpacked size, bytes, on top of
            the sandbox's free disk space (``statvfs`` of the root: the tmpfs upper);
            None: the free space only.
    """

    def __init__(
        self,
        root: Path,
        owner: tuple[int, int] = (0, 0),
        max_upload_bytes: int | None = None,
        watch_hub: WatchHub | None = None,
    ) -> None:
        self.root = root
        self.owner = owner
        self.max_upload_bytes = max_upload_bytes
        self.watch_hub = watch_hub
        self._root_real: str | None = None

    # -- plumbing ------------------------------------------------------------

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(self._guard, fn, *args)

    def _guard(self, fn: Callable[..., T], *args: object) -> T:
        try:
            return fn(*args)
        except DsecError:
            raise
        except OSError as e:
            raise _map_oserror(e, str(args[0]) if args else "") from e

    @contextlib.contextmanager
    def _root_fd(self) -> Iterator[int]:
        try:
            fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise SandboxError("the sandbox's root filesystem is gone") from e
        try:
            if self._root_real is None:
                self._root_real = os.readlink(f"/proc/self/fd/{fd}")
            yield fd
        finally:
            os.close(fd)

    def _check_resolved(self, fd: int, path: str) -> None:
        """Refuse ``fd`` if the kernel resolved it (e.g. through a symlink) to somewhere at
        or beneath a kernel mount's directory in the root."""
        if self._root_real is None:
            return
        where = os.readlink(f"/proc/self/fd/{fd}")
        prefix = self._root_real.rstrip("/") + "/"
        if where.startswith(prefix):
            top = where[len(prefix) :].split("/", 1)[0]
            if top in KERNEL_MOUNT_DIRS:
                raise _kernel_mount_error(path, top)

    def _is_root(self, fd: int) -> bool:
        """Whether ``fd`` is the sandbox's root directory itself (however it was named)."""
        return os.readlink(f"/proc/self/fd/{fd}") == self._root_real

    def _openat2_checked(self, dirfd: int, rel: str, flags: int, path: str, mode: int = 0) -> int:
        fd = openat2(dirfd, rel, flags, mode)
        try:
            self._check_resolved(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    @staticmethod
    def _rel(parts: list[str]) -> str:
        return "/".join(parts) if parts else "."

    @contextlib.contextmanager
    def _open(self, path: str, flags: int, mode: int = 0) -> Iterator[int]:
        """``path`` opened in the root; refused at or beneath a kernel mount (by name, or
        as resolved through symlinks)."""
        parts = _components(path)
        _refuse_kernel_mount(parts, path)
        with self._root_fd() as root:
            try:
                fd = self._openat2_checked(root, self._rel(parts), flags, path, mode)
            except FileNotFoundError:
                # e.g. /link/version with /link -> /proc: say why rather than "not found"
                self._check_existing_prefix(root, parts, path)
                raise
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def open_dir(self, path: str) -> Iterator[int]:
        """An ``O_PATH`` descriptor of the directory ``path``, resolved in the root as every
        call is (errors mapped as they are: ``FileNotFound``, ``InvalidRequest``...)."""
        opened = self._open(path, os.O_PATH | os.O_DIRECTORY)
        try:
            fd = opened.__enter__()
        except DsecError:
            raise
        except OSError as e:
            raise _map_oserror(e, path) from e
        try:
            yield fd
        finally:
            opened.__exit__(None, None, None)

    def _check_existing_prefix(self, root: int, parts: list[str], path: str) -> None:
        """Apply :meth:`_check_resolved` to the longest prefix of ``parts`` that resolves
        (found by bisection: if a prefix resolves, every shorter one does)."""
        lo, hi = 0, len(parts) - 1  # parts[:lo] resolves (the root); parts[:hi + 1] does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                fd = openat2(root, self._rel(parts[:mid]), os.O_PATH)
            except OSError:
                hi = mid - 1
                continue
            os.close(fd)
            lo = mid
        if lo > 0:
            fd = openat2(root, self._rel(parts[:lo]), os.O_PATH)
            try:
                self._check_resolved(fd, path)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str]]:
        """An O_PATH fd of the parent directory and the last component's name."""
        parts = _components(path)
        if not parts or parts[-1] == "..":
            raise InvalidRequest(
                f"path {path!r} names the root or a parent, not an entry", path=path
            )
        _refuse_kernel_mount(parts, path)
        with self._open("/" + "/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY) as dfd:
            yield dfd, parts[-1]

    def _info(self, path: str, st: os.stat_result, target: str | None = None) -> FileInfo:
        norm = posixpath.normpath(path) if path != "/" else "/"
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        return FileInfo(
            path=norm,
            name=posixpath.basename(norm) or "/",
            type=_file_type(st.st_mode),
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
            uid=st.st_uid,
            gid=st.st_gid,
            target=target,
        )

    def _chown(self, fd: int) -> None:
        """Give the file at ``fd`` to :attr:`owner` (only if it is not already theirs: each
        change is an attribute event a directory watcher sees)."""
        if self.owner != (0, 0):
            st = os.fstat(fd)
            if (st.st_uid, st.st_gid) != self.owner:
                os.fchown(fd, *self.owner)

    # -- sync implementations -----------------------------------------------

    def _stat_sync(self, path: str) -> FileInfo:
        parts = _components(path)
        if not parts:
            with self._root_fd() as root:
                return self._info("/", os.fstat(root))
        with self._parent(path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
            return self._info(path, st, target)

    def _read_sync(self, path: str, max_bytes: int) -> bytes:
        with self._open(path, os.O_PATH) as pfd:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"not a regular file: {path}", path=path)
            if st.st_size > max_bytes:
                raise PayloadTooLarge(
                    f"{path} is {st.st_size} bytes; the limit is {max_bytes}",
                    size=st.st_size,
                    limit=max_bytes,
                )
            # reopen the very inode we checked (host /proc, not the sandbox's)
            fd = os.open(
                f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
            )
        try:
            chunks, total = [], 0
            while True:
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
                if not chunk:
                    break
                total += len(chunk)
                if total > max_bytes:
                    raise PayloadTooLarge(
                        f"{path} is larger than {max_bytes} bytes", limit=max_bytes
                    )
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def _mkdirs_sync(self, parts: list[str], mode: int = 0o755) -> None:
        """mkdir -p of the directory named by ``parts`` (each step resolved in root)."""
        path = "/" + "/".join(parts)
        _refuse_kernel_mount(parts, path)
        with self._root_fd() as root:
            for i in range(1, len(parts) + 1):
                try:
                    fd = self._openat2_checked(
                        root, self._rel(parts[:i]), os.O_PATH | os.O_DIRECTORY, path
                    )
                    os.close(fd)
                    continue
                except FileNotFoundError:
                    pass
                pfd = self._openat2_checked(
                    root, self._rel(parts[: i - 1]), os.O_PATH | os.O_DIRECTORY, path
                )
                try:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(parts[i - 1], mode, dir_fd=pfd)
                        if self.owner != (0, 0):
                            os.chown(parts[i - 1], *self.owner, dir_fd=pfd, follow_symlinks=False)
                finally:
                    os.close(pfd)

    def _write_sync(self, path: str, data: bytes, mode: int, make_parents: bool) -> FileInfo:
        parts = _components(path)
        if not parts:
            raise InvalidRequest("cannot write to the root directory", path=path)
        if make_parents and len(parts) > 1:
            self._mkdirs_sync(parts[:-1])
        with self._parent(path) as (dfd, name):
            self._check_writable_target(dfd, name, path)
            # O_NOFOLLOW: a symlink planted at the target is refused, not written through
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW
                | os.O_CLOEXEC,
                mode & 0o7777,
                dir_fd=dfd,
            )  # fmt: skip
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"not a regular file: {path}", path=path)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            # owner first (a chown clears set-id bits), then the mode if it is not yet
            # right: a new file shows a watcher create, write, chmod, as envd's does
            self._chown(fd)
            if stat.S_IMODE(os.fstat(fd).st_mode) != mode & 0o7777:
                os.fchmod(fd, mode & 0o7777)
            return self._info(path, os.fstat(fd))
        finally:
            os.close(fd)

    @staticmethod
    def _check_writable_target(dfd: int, name: str, path: str) -> None:
        """Refuse an existing ``name`` in ``dfd`` that is not a regular file."""
        try:
            mode_now = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISLNK(mode_now):
            raise InvalidRequest(f"{path} is a symlink; write to its target", path=path)
        if not stat.S_ISREG(mode_now):
            raise InvalidRequest(f"not a regular file: {path}", path=path)

    def _write_stream_sync(
        self, path: str, src: IO[bytes], size: int, mode: int, limit: int
    ) -> None:
        """Write ``size`` bytes read from ``src`` to the file ``path`` (parents exist), in
        bounded chunks, under a temporary name renamed over ``path`` once complete; on any
        failure the temporary file is removed. Refuses more than ``limit`` bytes."""
        with self._parent(path) as (dfd, name):
            self._check_writable_target(dfd, name, path)
            tmp_name = f".dsec-upload-{secrets.token_hex(6)}"
            fd = os.open(
                tmp_name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dfd,
            )
            try:
                written = 0
                while chunk := src.read(min(_COPY_CHUNK_BYTES, size - written + 1)):
                    written += len(chunk)
                    if written > limit:
                        raise QuotaExceeded(
                            f"unpacking {path} would pass the upload limit of {limit} bytes",
                            path=path,
                            limit=limit,
                        )
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, mode & 0o7777)
                self._chown(fd)
                os.close(fd)
                fd = -1
                os.rename(tmp_name, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name, dir_fd=dfd)
                raise

    def _upload_budget(self) -> int:
        """Bytes an upload may unpack: the root filesystem's free space (for the overlay,
        its tmpfs upper's: what is left of ``disk_mb``), capped by ``max_upload_bytes``."""
        with self._root_fd() as root:
            vfs = os.statvfs(f"/proc/self/fd/{root}")
        free = vfs.f_bavail * vfs.f_frsize
        return free if self.max_upload_bytes is None else min(free, self.max_upload_bytes)

    def _list_sync(self, path: str, depth: int) -> list[FileInfo]:
        if depth < 1:
            raise InvalidRequest("depth must be >= 1", depth=depth)
        out: list[FileInfo] = []
        parts = _components(path)
        base = "/" + "/".join(parts)
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as dfd:
            at_root = self._is_root(dfd)

            def descend(rel: str, level: int) -> bool:
                # the kernel mounts are listed at "/" but never entered (empty dirs here)
                return level < depth and not (at_root and rel in KERNEL_MOUNT_DIRS)

            self._list_walk(dfd, base, descend, out)
        return out

    def _list_walk(
        self, dfd: int, base: str, descend: Callable[[str, int], bool], out: list[FileInfo]
    ) -> None:
        with contextlib.closing(_walk_tree(dfd, descend)) as steps:
            for step in steps:
                if step.kind == "post":
                    continue
                if len(out) >= _MAX_LIST_ENTRIES:
                    raise PayloadTooLarge(
                        f"more than {_MAX_LIST_ENTRIES} entries", limit=_MAX_LIST_ENTRIES
                    )
                st = step.st
                target = (
                    os.readlink(step.name, dir_fd=step.dir_fd) if stat.S_ISLNK(st.st_mode) else None
                )
                out.append(self._info(posixpath.join(base, step.rel), st, target))

    def _remove_sync(self, path: str, recursive: bool) -> None:
        with self._parent(path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dfd)
            elif recursive:
                self._rmtree(dfd, name)
            else:
                os.rmdir(name, dir_fd=dfd)

    @staticmethod
    def _rmtree(dfd: int, name: str) -> None:
        """``rm -r`` of the directory ``name`` in ``dfd``: by descriptors, never following
        symlinks, iterative (any depth, two descriptors)."""
        top = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            with contextlib.closing(_walk_tree(top, lambda rel, level: True)) as steps:
                for step in steps:
                    if step.kind == "entry":
                        os.unlink(step.name, dir_fd=step.dir_fd)
                    elif step.kind == "post":
                        os.rmdir(step.name, dir_fd=step.dir_fd)
        finally:
            os.close(top)
        os.rmdir(name, dir_fd=dfd)

    def _mkdir_sync(self, path: str, parents: bool) -> FileInfo:
        parts = _components(path)
        if parents:
            self._mkdirs_sync(parts)
        else:
            with self._parent(path) as (dfd, name):
                os.mkdir(name, 0o755, dir_fd=dfd)
                if self.owner != (0, 0):
                    os.chown(name, *self.owner, dir_fd=dfd, follow_symlinks=False)
        return self._stat_sync(path)

    def _rename_sync(self, src: str, dst: str) -> FileInfo:
        with self._parent(src) as (sfd, sname), self._parent(dst) as (dfd, dname):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        return self._stat_sync(dst)

    def _upload_tar_sync(self, path: str, data: bytes) -> int:
        base = _components(path)
        self._mkdirs_sync(base)
        budget = self._upload_budget()
        count = 0
        try:
            tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
        except tarfile.TarError as e:
            raise InvalidRequest(f"not a tar archive: {e}") from e
        with tar:
            for member in tar:
                rel = _tar_member_parts(member.name)
                if rel is None:
                    continue  # the archive's own root entry
                target = "/" + "/".join(base + rel)
                if member.isdir():
                    self._mkdirs_sync(base + rel)
                elif member.isfile():
                    if member.size > budget:
                        raise QuotaExceeded(
                            f"tar member {member.name!r} ({member.size} bytes) would take the "
                            f"upload past the sandbox's free disk space ({budget} bytes left)",
                            path=target,
                            size=member.size,
                            limit=budget,
                        )
                    src = tar.extractfile(member)
                    if src is None:
                        continue
                    self._mkdirs_sync(base + rel[:-1])
                    self._write_stream_sync(
                        target, src, member.size, member.mode & 0o777 or 0o644, budget
                    )
                    budget -= member.size
                elif member.issym():
                    if "\0" in member.linkname:
                        raise InvalidRequest(f"tar member {member.name!r}: bad link target")
                    self._mkdirs_sync(base + rel[:-1])
                    with self._parent(target) as (dfd, name):
                        # the target string is stored verbatim; every later access resolves
                        # it inside the root, so it cannot point out of the sandbox
                        os.symlink(member.linkname, name, dir_fd=dfd)
                elif member.islnk():
                    link_rel = _tar_member_parts(member.linkname)
                    if link_rel is None:
                        raise PathOutsideSandbox(
                            f"tar member {member.name!r} links outside the archive"
                        )
                    self._mkdirs_sync(base + rel[:-1])
                    src_path = "/" + "/".join(base + link_rel)
                    with (
                        self._parent(src_path) as (sfd, sname),
                        self._parent(target) as (dfd, dname),
                    ):
                        os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
                else:
                    raise InvalidRequest(
                        f"tar member {member.name!r}: devices and FIFOs are not allowed"
                    )
                count += 1
        return count

    def _download_tar_sync(self, path: str, max_bytes: int) -> bytes:
        buf = io.BytesIO()
        budget = [max_bytes]
        info = self._stat_sync(path) if _components(path) else None
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            if info is None or info.type == "dir":
                # members are relative to the directory, so that upload_tar(path, ...) of
                # the archive restores it in place
                with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as dfd:
                    self._tar_dir(tar, dfd, self._is_root(dfd), budget)
            else:
                with self._parent(path) as (pfd, name):
                    self._tar_entry(tar, pfd, name, info.name, budget)
        if buf.tell() > max_bytes:
            raise PayloadTooLarge(
                f"the archive of {path} exceeds {max_bytes} bytes", limit=max_bytes
            )
        return buf.getvalue()

    def _tar_add(
        self,
        tar: tarfile.TarFile,
        arcname: str,
        st: os.stat_result,
        fileobj: io.BufferedIOBase | None,
        linkname: str | None,
        budget: list[int],
    ) -> None:
        ti = tarfile.TarInfo(arcname)
        ti.mode = stat.S_IMODE(st.st_mode)
        ti.mtime = int(st.st_mtime)
        ti.uid, ti.gid = st.st_uid, st.st_gid
        if stat.S_ISDIR(st.st_mode):
            ti.type = tarfile.DIRTYPE
        elif linkname is not None:
            ti.type = tarfile.SYMTYPE
            ti.linkname = linkname
        else:
            ti.size = st.st_size
        budget[0] -= 512 + ti.size + len(arcname) + len(linkname or "")
        if budget[0] < 0:
            raise PayloadTooLarge("the archive exceeds the size limit")
        tar.addfile(ti, fileobj)

    def _tar_entry(
        self, tar: tarfile.TarFile, dfd: int, name: str, arcname: str, budget: list[int]
    ) -> None:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            self._tar_add(tar, arcname, st, None, os.readlink(name, dir_fd=dfd), budget)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(f.fileno())
                if stat.S_ISREG(st.st_mode):
                    self._tar_add(tar, arcname, st, f, None, budget)
        # devices, FIFOs and sockets are skipped

    def _tar_dir(self, tar: tarfile.TarFile, dfd: int, at_root: bool, budget: list[int]) -> None:
        """Add everything below the directory ``dfd`` (iteratively, any depth); at the
        sandbox's root the kernel mount directories are left out."""

        def descend(rel: str, level: int) -> bool:
            return not (at_root and rel in KERNEL_MOUNT_DIRS)

        with contextlib.closing(_walk_tree(dfd, descend)) as steps:
            for step in steps:
                if at_root and step.rel in KERNEL_MOUNT_DIRS:
                    continue
                if step.kind == "dir":
                    self._tar_add(tar, step.rel, step.st, None, None, budget)
                elif step.kind == "entry":
                    self._tar_entry(tar, step.dir_fd, step.name, step.rel, budget)

    def _get_xattrs_sync(self, paths: list[str], prefix: str) -> list[dict[str, str]]:
        out: list[dict[str, str]] = []
        for path in paths:
            try:
                with self._open(path, os.O_PATH | os.O_NOFOLLOW) as fd:
                    if stat.S_ISLNK(os.fstat(fd).st_mode):
                        out.append({})
                        continue
                    where = f"/proc/self/fd/{fd}"  # the very inode (O_PATH has no fgetxattr)
                    found: dict[str, str] = {}
                    for name in os.listxattr(where):
                        if name.startswith(prefix):
                            with contextlib.suppress(OSError):
                                found[name] = os.getxattr(where, name).decode(errors="replace")
                    out.append(found)
            except (FileNotFoundError, NotADirectoryError, FileNotFound):
                out.append({})
            except OSError as e:
                if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    out.append({})
                    continue
                raise
        return out

    def _set_xattrs_sync(self, path: str, values: dict[str, str], clear_prefix: str | None) -> None:
        with self._open(path, os.O_PATH | os.O_NOFOLLOW) as fd:
            mode = os.fstat(fd).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise InvalidRequest(
                    f"extended attributes are kept on files and directories only: {path}",
                    path=path,
                )
            where = f"/proc/self/fd/{fd}"
            try:
                if clear_prefix is not None:
                    for name in os.listxattr(where):
                        if name.startswith(clear_prefix) and name not in values:
                            os.removexattr(where, name)
                for name, value in values.items():
                    os.setxattr(where, name, value.encode())
            except OSError as e:
                if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise CapabilityNotSupported(
                        "this sandbox's filesystem keeps no extended attributes"
                    ) from None
                if e.errno == errno.ENOSPC:
                    raise QuotaExceeded(f"no room for the extended attributes of {path}") from None
                raise

    # -- on the caller's thread (a few bytes, where a thread hop costs more) ---

    def read_now(self, path: str, max_bytes: int) -> bytes:
        """:meth:`read` without leaving the calling thread."""
        return self._guard(self._read_sync, path, max_bytes)

    def replace_now(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` as the regular file ``path`` (its parents made), without leaving
        the calling thread. A symlink or an empty directory there is removed first (never
        followed); on any other error (a full disk) what is there stays."""
        try:
            self._guard(self._write_sync, path, data, mode, True)
        except InvalidRequest:  # not a regular file
            self._guard(self._remove_sync, path, False)
            self._guard(self._write_sync, path, data, mode, True)

    # -- SandboxFiles ---------------------------------------------------------

    async def watch(self, path: str, recursive: bool) -> DirWatcher:
        """An inotify watcher of the directory ``path`` (see ``watch.py``)."""
        if self.watch_hub is None:
            raise CapabilityNotSupported("no directory watches on these files")
        return await DirWatcher(self.watch_hub, self, path, recursive).start()

    async def get_xattrs(self, paths: list[str], prefix: str) -> list[dict[str, str]]:
        """The ``prefix`` attributes of each path (``{}``: missing, a symlink, or a
        filesystem without extended attributes)."""
        return await self._run(self._get_xattrs_sync, list(paths), prefix)

    async def set_xattrs(self, path: str, values: dict[str, str], clear_prefix: str | None) -> None:
        """Set attributes on a file or directory (after clearing ``clear_prefix`` ones)."""
        await self._run(self._set_xattrs_sync, path, dict(values), clear_prefix)

    async def read(self, path: str, max_bytes: int) -> bytes:
        """The whole file; ``PayloadTooLarge`` if it is larger than ``max_bytes`` bytes."""
        return await self._run(self._read_sync, path, max_bytes)

    async def write(
        self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True
    ) -> FileInfo:
        """Create or replace a regular file (mode: permission bits)."""
        return await self._run(self._write_sync, path, data, mode, make_parents)

    async def list(self, path: str, depth: int = 1) -> list[FileInfo]:
        """Entries of a directory, recursing ``depth - 1`` levels (symlinks not followed)."""
        return await self._run(self._list_sync, path, depth)

    async def stat(self, path: str) -> FileInfo:
        """Like lstat(2): a symlink is reported as itself, with its target."""
        return await self._run(self._stat_sync, path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file, symlink or empty directory; ``recursive``: a whole tree, of any
        depth (by descriptors, never following symlinks)."""
        await self._run(self._remove_sync, path, recursive)

    async def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        return await self._run(self._mkdir_sync, path, parents)

    async def rename(self, src: str, dst: str) -> FileInfo:
        return await self._run(self._rename_sync, src, dst)

    async def upload_tar(self, path: str, data: bytes) -> int:
        """Extract a tar (optionally compressed) under directory ``path``; returns members written.

        Members are streamed to disk in 1 MiB chunks. A member whose size would take the
        unpacked total past the sandbox's free disk space (or ``max_upload_bytes``) raises
        :class:`QuotaExceeded` before any of it is written; members extracted before it
        stay, and no partially written file is ever left behind."""
        return await self._run(self._upload_tar_sync, path, data)

    async def download_tar(self, path: str, max_bytes: int) -> bytes:
        """A tar of ``path``, at most ``max_bytes``: a directory's entries relative to it (the
        format :meth:`upload_tar` takes back), or a single file under its own name. Symlinks
        are stored as symlinks; devices, FIFOs and sockets are skipped."""
        return await self._run(self._download_tar_sync, path, max_bytes)


def _tar_member_parts(name: str) -> list[str] | None:
    """Sanitised relative components of a tar member name; None for the archive root.

    Absolute names and any ``..`` are refused (``PathOutsideSandbox``)."""
    if name.startswith("/") or "\0" in name:
        raise PathOutsideSandbox(f"tar member {name!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise PathOutsideSandbox(f"tar member {name!r} contains '..'")
    return parts or None
