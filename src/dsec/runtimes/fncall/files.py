"""Host-side file access to one fncall worker's filesystem view, confined to it.

The worker's root is reached through ``/proc/<pid>/root`` (its mount namespace: the
read-only image plus its private scratch tmpfs at ``/work``, ``/tmp`` and ``/dev/shm``). The root is
opened ``O_PATH`` once and the worker's pidfd is checked *after* the open, so a recycled pid
can never hand us another process's root. Every path is then resolved by the kernel with
``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)``: ``..`` and absolute symlinks stay inside
the worker's root, ``/proc/*/fd`` jumps are refused. Operations on the last component use the
parent's descriptor and one name (``unlinkat``, ``mkdirat``, ``renameat``), and only regular
files are read or written. Everything outside the writable directories is read-only
(``EROFS`` is reported as :class:`~dsec.errors.InvalidRequest`).

Files written here are charged to the server's memory cgroup (tmpfs pages belong to whoever
first touches them), not to the worker's; ``run_code`` therefore ships its files inside the
request and the worker writes them itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import io
import os
import posixpath
import signal
import stat
import tarfile
from collections.abc import Callable, Iterator
from typing import TypeVar

from dsec.errors import (
    DsecError,
    FileExists_,
    FileNotFound,
    InvalidRequest,
    PathOutsideSandbox,
    PayloadTooLarge,
    SandboxError,
    SandboxStopped,
)
from dsec.models import FileInfo, FileType

__all__ = ["WorkerFiles", "normalize_sandbox_path"]

_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
T = TypeVar("T")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dirfd: int, path: str, flags: int, mode: int = 0) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = int(
        _libc.syscall(
            _SYS_OPENAT2, dirfd, os.fsencode(path or "."), ctypes.byref(how), ctypes.sizeof(how)
        )
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return fd


def normalize_sandbox_path(path: str) -> list[str]:
    """Components of an absolute sandbox path; ``..`` above ``/`` raises PathOutsideSandbox."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise InvalidRequest(f"path must be absolute (got {path!r})", path=str(path))
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if not parts:
                raise PathOutsideSandbox(f"{path} leaves the sandbox root", path=path)
            parts.pop()
        else:
            parts.append(part)
    return parts


def _map_error(e: OSError, path: str) -> DsecError:
    if e.errno == errno.ENOENT:
        return FileNotFound(f"{path}: no such file or directory", path=path)
    if e.errno == errno.EEXIST:
        return FileExists_(f"{path} already exists", path=path)
    if e.errno == errno.EXDEV:
        return PathOutsideSandbox(f"{path} resolves outside the sandbox", path=path)
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return InvalidRequest(
            f"{path}: {os.strerror(e.errno)} (only /work, /tmp and /dev/shm are writable)",
            path=path,
        )
    if e.errno in (
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENOTEMPTY,
        errno.ELOOP,
        errno.ENAMETOOLONG,
        errno.EINVAL,
    ):
        return InvalidRequest(f"{path}: {os.strerror(e.errno)}", path=path)
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return PayloadTooLarge(f"{path}: {os.strerror(e.errno)}", path=path)
    return SandboxError(f"{path}: {e}", path=path)


def _ftype(mode: int) -> FileType:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


class WorkerFiles:
    """:class:`~dsec.contract.runtime.SandboxFiles` of one worker (see the module docstring).

    Args:
        pid: the worker's pid (host pid namespace).
        pidfd: its pidfd, checked after opening its root.
        owner: ``(uid, gid)`` given to what this class creates (the sandbox user).
    """

    def __init__(self, pid: int, pidfd: int, owner: tuple[int, int]) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.owner = owner

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.to_thread(self._guard, fn, *args)

    def _guard(self, fn: Callable[..., T], *args: object) -> T:
        path = str(args[0]) if args else "/"
        try:
            return fn(*args)
        except DsecError:
            raise
        except OSError as e:
            raise _map_error(e, path) from e

    @contextlib.contextmanager
    def _root(self) -> Iterator[int]:
        try:
            fd = os.open(f"/proc/{self.pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise SandboxStopped("the fncall worker is gone") from e
        try:
            try:
                signal.pidfd_send_signal(
                    self.pidfd, 0
                )  # still the same process: the root is its root
            except OSError as e:
                raise SandboxStopped("the fncall worker is gone") from e
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _open(self, path: str, flags: int, mode: int = 0) -> Iterator[int]:
        parts = normalize_sandbox_path(path)
        with self._root() as root:
            fd = _openat2(root, "/".join(parts), flags, mode)
            try:
                yield fd
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _parent(self, path: str) -> Iterator[tuple[int, str]]:
        parts = normalize_sandbox_path(path)
        if not parts:
            raise InvalidRequest("the sandbox root itself cannot be changed", path=path)
        with self._root() as root:
            fd = _openat2(root, "/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY)
            try:
                yield fd, parts[-1]
            finally:
                os.close(fd)

    def _info(self, path: str, st: os.stat_result, target: str | None = None) -> FileInfo:
        clean = "/" + "/".join(normalize_sandbox_path(path))
        return FileInfo(
            path=clean,
            name=posixpath.basename(clean) or "/",
            type=_ftype(st.st_mode),
            size=st.st_size,
            mode=stat.S_IMODE(st.st_mode),
            mtime=st.st_mtime,
            uid=st.st_uid,
            gid=st.st_gid,
            target=target,
        )

    def _stat_sync(self, path: str) -> FileInfo:
        with self._parent(path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
            return self._info(path, st, target)

    def _read_sync(self, path: str, max_bytes: int) -> bytes:
        with self._open(path, os.O_RDONLY | os.O_NONBLOCK) as fd:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"{path} is not a regular file", path=path)
            if st.st_size > max_bytes:
                raise PayloadTooLarge(
                    f"{path} is {st.st_size} bytes; at most {max_bytes}", path=path
                )
            data = bytearray()
            while len(data) <= max_bytes:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return bytes(data)
                data += chunk
            raise PayloadTooLarge(f"{path} is larger than {max_bytes} bytes", path=path)

    def _mkdirs_sync(self, parts: list[str]) -> None:
        with self._root() as root:
            for i in range(1, len(parts) + 1):
                parent = _openat2(root, "/".join(parts[: i - 1]), os.O_PATH | os.O_DIRECTORY)
                try:
                    os.mkdir(parts[i - 1], 0o755, dir_fd=parent)
                    os.chown(parts[i - 1], *self.owner, dir_fd=parent, follow_symlinks=False)
                except FileExistsError:
                    pass
                finally:
                    os.close(parent)

    def _write_sync(self, path: str, data: bytes, mode: int, make_parents: bool) -> FileInfo:
        parts = normalize_sandbox_path(path)
        if make_parents and len(parts) > 1:
            self._mkdirs_sync(parts[:-1])
        with self._parent(path) as (dfd, name):
            fd = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                mode & 0o7777,
                dir_fd=dfd,
            )
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise InvalidRequest(f"{path} is not a regular file", path=path)
                os.ftruncate(fd, 0)
                view = memoryview(data)
                while view.nbytes:
                    view = view[os.write(fd, view) :]
                os.fchown(fd, *self.owner)
                os.fchmod(fd, mode & 0o7777)
                return self._info(path, os.fstat(fd))
            finally:
                os.close(fd)

    def _list_sync(self, path: str, depth: int) -> list[FileInfo]:
        out: list[FileInfo] = []
        base = "/" + "/".join(normalize_sandbox_path(path))
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as dfd:
            self._list_dir(dfd, base, max(1, depth), out)
        return out

    def _list_dir(self, dfd: int, base: str, depth: int, out: list[FileInfo]) -> None:
        for name in sorted(os.listdir(dfd)):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            full = posixpath.join(base, name)
            target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
            out.append(self._info(full, st, target))
            if len(out) > 100_000:
                raise PayloadTooLarge("more than 100000 entries")
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                sub = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd
                )
                try:
                    self._list_dir(sub, full, depth - 1, out)
                finally:
                    os.close(sub)

    def _remove_tree(self, dfd: int, name: str) -> None:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dfd)
            return
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            for child in os.listdir(sub):
                self._remove_tree(sub, child)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=dfd)

    def _remove_sync(self, path: str, recursive: bool) -> None:
        with self._parent(path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                if recursive:
                    self._remove_tree(dfd, name)
                else:
                    os.rmdir(name, dir_fd=dfd)
            else:
                os.unlink(name, dir_fd=dfd)

    def _mkdir_sync(self, path: str, parents: bool) -> FileInfo:
        parts = normalize_sandbox_path(path)
        if parents:
            self._mkdirs_sync(parts)
        else:
            with self._parent(path) as (dfd, name):
                os.mkdir(name, 0o755, dir_fd=dfd)
                os.chown(name, *self.owner, dir_fd=dfd, follow_symlinks=False)
        return self._stat_sync(path)

    def _rename_sync(self, src: str, dst: str) -> FileInfo:
        with self._parent(src) as (sfd, sname), self._parent(dst) as (dfd, dname):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
        return self._stat_sync(dst)

    def _upload_tar_sync(self, path: str, data: bytes) -> int:
        base = normalize_sandbox_path(path)
        self._mkdirs_sync(base)
        count = 0
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for m in tar:
                rel = [p for p in m.name.split("/") if p not in ("", ".")]
                if not rel or ".." in rel:
                    raise PathOutsideSandbox(
                        f"tar member {m.name!r} leaves the target directory", path=m.name
                    )
                target = "/" + "/".join(base + rel)
                if m.isdir():
                    self._mkdirs_sync(base + rel)
                elif m.isfile():
                    f = tar.extractfile(m)
                    self._write_sync(target, f.read() if f else b"", m.mode or 0o644, True)
                elif m.issym():
                    self._mkdirs_sync(base + rel[:-1])
                    with self._parent(target) as (dfd, name):
                        os.symlink(m.linkname, name, dir_fd=dfd)
                else:
                    continue
                count += 1
        return count

    def _download_tar_sync(self, path: str, max_bytes: int) -> bytes:
        buf = io.BytesIO()
        base = "/" + "/".join(normalize_sandbox_path(path))
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = self._stat_sync(path)
            # a directory's entries relative to it (what upload_tar takes back); a file
            # under its own name
            is_dir = info.type == "dir"
            entries = self._list_sync(path, 64) if is_dir else [info]
            for e in entries:
                arc = posixpath.relpath(e.path, base) if is_dir else posixpath.basename(base)
                ti = tarfile.TarInfo(arc)
                ti.mode, ti.mtime, ti.uid, ti.gid = e.mode, int(e.mtime), e.uid, e.gid
                if e.type == "dir":
                    ti.type = tarfile.DIRTYPE
                    tar.addfile(ti)
                elif e.type == "symlink":
                    ti.type, ti.linkname = tarfile.SYMTYPE, e.target or ""
                    tar.addfile(ti)
                elif e.type == "file":
                    content = self._read_sync(e.path, max_bytes)
                    ti.size = len(content)
                    tar.addfile(ti, io.BytesIO(content))
                if buf.tell() > max_bytes:
                    raise PayloadTooLarge(
                        f"{path} is larger than {max_bytes} bytes as a tar", path=path
                    )
        return buf.getvalue()

    async def read(self, path: str, max_bytes: int) -> bytes:
        return await self._run(self._read_sync, path, max_bytes)

    async def write(
        self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True
    ) -> FileInfo:
        return await self._run(self._write_sync, path, data, mode, make_parents)

    async def list(self, path: str, depth: int = 1) -> list[FileInfo]:
        return await self._run(self._list_sync, path, depth)

    async def stat(self, path: str) -> FileInfo:
        return await self._run(self._stat_sync, path)

    async def remove(self, path: str, recursive: bool = False) -> None:
        await self._run(self._remove_sync, path, recursive)

    async def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        return await self._run(self._mkdir_sync, path, parents)

    async def rename(self, src: str, dst: str) -> FileInfo:
        return await self._run(self._rename_sync, src, dst)

    async def upload_tar(self, path: str, data: bytes) -> int:
        return await self._run(self._upload_tar_sync, path, data)

    async def download_tar(self, path: str, max_bytes: int) -> bytes:
        return await self._run(self._download_tar_sync, path, max_bytes)
