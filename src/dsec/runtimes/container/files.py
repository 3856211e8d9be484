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
import shutil
import stat
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from dsec.errors import (
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

__all__ = ["RootedFiles", "openat2"]

_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_MAX_LIST_ENTRIES = 100_000

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


class RootedFiles:
    """:class:`~dsec.runtimes.base.SandboxFiles` over a root directory on the host.

    Args:
        root: the sandbox's rootfs on the host (the overlay mount point).
        owner: ``(uid, gid)`` given to files and directories this class creates.
    """

    def __init__(self, root: Path, owner: tuple[int, int] = (0, 0)) -> None:
        self.root = root
        self.owner = owner

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
            yield fd
        finally:
            os.close(fd)

    @staticmethod
    def _rel(parts: list[str]) -> str:
        return "/".join(parts) if parts else "."

    @contextlib.contextmanager
    def _open(self, path: str, flags: int, mode: int = 0) -> Iterator[int]:
        parts = _components(path)
        with self._root_fd() as root:
            fd = openat2(root, self._rel(parts), flags, mode)
        try:
            yield fd
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
        if self.owner != (0, 0):
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
        with self._root_fd() as root:
            for i in range(1, len(parts) + 1):
                try:
                    fd = openat2(root, self._rel(parts[:i]), os.O_PATH | os.O_DIRECTORY)
                    os.close(fd)
                    continue
                except FileNotFoundError:
                    pass
                pfd = openat2(root, self._rel(parts[: i - 1]), os.O_PATH | os.O_DIRECTORY)
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
        with self._root_fd() as root:
            try:
                pfd = openat2(root, self._rel(parts), os.O_PATH | os.O_NOFOLLOW)
            except FileNotFoundError:
                pfd = -1
            if pfd >= 0:
                try:
                    mode_now = os.fstat(pfd).st_mode
                    if stat.S_ISLNK(mode_now):
                        raise InvalidRequest(f"{path} is a symlink; write to its target", path=path)
                    if not stat.S_ISREG(mode_now):
                        raise InvalidRequest(f"not a regular file: {path}", path=path)
                finally:
                    os.close(pfd)
            # O_NOFOLLOW: a symlink planted at the target is refused, not written through
            fd = openat2(
                root,
                self._rel(parts),
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_NOCTTY | os.O_NOFOLLOW,
                mode & 0o7777,
            )
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"not a regular file: {path}", path=path)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode & 0o7777)
            self._chown(fd)
            return self._info(path, os.fstat(fd))
        finally:
            os.close(fd)

    def _list_sync(self, path: str, depth: int) -> list[FileInfo]:
        if depth < 1:
            raise InvalidRequest("depth must be >= 1", depth=depth)
        out: list[FileInfo] = []
        base = "/" + "/".join(_components(path))
        with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as dfd:
            self._list_dir(dfd, base, depth, out)
        return out

    def _list_dir(self, dfd: int, base: str, depth: int, out: list[FileInfo]) -> None:
        for name in sorted(os.listdir(dfd)):
            if len(out) >= _MAX_LIST_ENTRIES:
                raise PayloadTooLarge(
                    f"more than {_MAX_LIST_ENTRIES} entries", limit=_MAX_LIST_ENTRIES
                )
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we listed
            target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
            child = posixpath.join(base, name)
            out.append(self._info(child, st, target))
            if depth > 1 and stat.S_ISDIR(st.st_mode):
                try:
                    cfd = os.open(
                        name,
                        os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=dfd,
                    )
                except OSError:
                    continue
                try:
                    if os.fstat(cfd).st_dev == st.st_dev:  # never cross a mount
                        self._list_dir(cfd, child, depth - 1, out)
                finally:
                    os.close(cfd)

    def _remove_sync(self, path: str, recursive: bool) -> None:
        with self._parent(path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(name, dir_fd=dfd)
            elif recursive:
                # shutil.rmtree with dir_fd walks by descriptors and never follows symlinks
                rfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dfd)
                try:
                    shutil.rmtree(name, dir_fd=rfd)
                finally:
                    os.close(rfd)
            else:
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
                    src = tar.extractfile(member)
                    if src is None:
                        continue
                    self._write_sync(target, src.read(), member.mode & 0o777 or 0o644, True)
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
        info = self._stat_sync(path)
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            if info.type == "dir":
                # members are relative to the directory, so that upload_tar(path, ...) of
                # the archive restores it in place
                with self._open(path, os.O_RDONLY | os.O_DIRECTORY) as dfd:
                    self._tar_dir(tar, dfd, "", os.fstat(dfd).st_dev, budget)
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
        budget[0] -= 512 + ti.size
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

    def _tar_dir(
        self, tar: tarfile.TarFile, dfd: int, arcbase: str, dev: int, budget: list[int]
    ) -> None:
        for name in sorted(os.listdir(dfd)):
            arcname = f"{arcbase}/{name}" if arcbase else name
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if st.st_dev != dev:
                    continue
                cfd = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd
                )
                try:
                    self._tar_add(tar, arcname, os.fstat(cfd), None, None, budget)
                    self._tar_dir(tar, cfd, arcname, dev, budget)
                finally:
                    os.close(cfd)
            else:
                self._tar_entry(tar, dfd, name, arcname, budget)

    # -- SandboxFiles ---------------------------------------------------------

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
        await self._run(self._remove_sync, path, recursive)

    async def mkdir(self, path: str, parents: bool = True) -> FileInfo:
        return await self._run(self._mkdir_sync, path, parents)

    async def rename(self, src: str, dst: str) -> FileInfo:
        return await self._run(self._rename_sync, src, dst)

    async def upload_tar(self, path: str, data: bytes) -> int:
        """Extract a tar (optionally compressed) under directory ``path``; returns members written."""
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
