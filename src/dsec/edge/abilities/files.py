"""The files API: read, write, list, stat, remove, rename, xattrs, watch, tar."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dsec.contract.edge import DirectoryWatcher
from dsec.contract.runtime import SandboxFiles, WatchableFiles, XattrFiles
from dsec.contract.verbs import NO_ENVELOPE, Envelope
from dsec.edge.core import EdgeCore, LiveSandbox, json_dump
from dsec.errors import (
    CapabilityNotSupported,
    DsecError,
    InvalidRequest,
    PathOutsideSandbox,
    PayloadTooLarge,
)
from dsec.models import (
    FileInfo,
    FileList,
    ListFilesRequest,
    RemoveFileRequest,
    RenameRequest,
    SandboxPathRequest,
)

log = logging.getLogger("dsec.edge")

T = TypeVar("T")


class FileVerbs(EdgeCore):
    """The files API: read, write, list, stat, remove, rename, xattrs, watch, tar."""

    # ------------------------------------------------------------------ files
    async def read_file(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("read").inc()
        return await self._use(
            sandbox_id, owner, lambda lv: self._files(lv).read(path, self.limits.max_read_bytes)
        )

    async def _logged_file_op(
        self,
        sandbox_id: str,
        owner: str,
        op: str,
        request: dict[str, Any],
        env: Envelope,
        fn: Callable[[SandboxFiles], Awaitable[T]],
        encode: Callable[[T], dict[str, Any]],
        decode: Callable[[dict[str, Any]], T],
    ) -> T:
        self.metrics.file_ops.labels(op).inc()

        async def run(lv: LiveSandbox) -> T:
            files = self._files(lv)
            return await self._logged(lv, op, request, env, lambda: fn(files), encode, decode)

        return await self._use(sandbox_id, owner, run)

    async def write_file(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        mode: int = 0o644,
        *,
        env: Envelope = NO_ENVELOPE,
    ) -> FileInfo:
        self._check_path(sandbox_id, owner, path)
        if not 0 <= mode <= 0o7777:
            raise InvalidRequest(f"mode {mode:o} is not a permission mode")
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "write_file",
            {"path": path, "mode": mode, "data": data},
            env,
            lambda f: f.write(path, data, mode),
            json_dump,
            FileInfo.model_validate,
        )

    def _xattr_files(self, lv: LiveSandbox) -> XattrFiles:
        files = self._files(lv)
        if not isinstance(files, XattrFiles):
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier cannot keep extended attributes on files",
                tier=lv.row.tier,
            )
        return files

    async def get_xattrs(
        self, sandbox_id: str, owner: str, paths: list[str], prefix: str = "user."
    ) -> list[dict[str, str]]:
        """See :class:`dsec.contract.edge.FileXattrs`."""
        if not prefix.startswith("user."):
            raise InvalidRequest("only user.* extended attributes are readable")
        if len(paths) > MAX_XATTR_PATHS:
            raise InvalidRequest(f"at most {MAX_XATTR_PATHS} paths per call")
        for path in paths:
            self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("get_xattrs").inc()
        return await self._use(
            sandbox_id, owner, lambda lv: self._xattr_files(lv).get_xattrs(paths, prefix)
        )

    async def set_xattrs(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        values: dict[str, str],
        *,
        clear_prefix: str | None = None,
        env: Envelope = NO_ENVELOPE,
    ) -> None:
        """See :class:`dsec.contract.edge.FileXattrs`."""
        self._check_path(sandbox_id, owner, path)
        _check_xattrs(values, clear_prefix)

        async def run(lv: LiveSandbox) -> None:
            files = self._xattr_files(lv)
            await self._logged(
                lv,
                "set_xattrs",
                {"path": path, "values": values, "clear_prefix": clear_prefix},
                env,
                lambda: files.set_xattrs(path, values, clear_prefix),
                lambda _r: {},
                lambda _d: None,
            )

        self.metrics.file_ops.labels("set_xattrs").inc()
        await self._use(sandbox_id, owner, run)

    async def watch_directory(
        self, sandbox_id: str, owner: str, path: str, *, recursive: bool = False
    ) -> DirectoryWatcher:
        """See :class:`dsec.contract.edge.DirectoryWatch`: the tier's kernel watch, opened
        without resuming the sandbox or counting as its activity."""
        self._check_path(sandbox_id, owner, path)
        lv = self._live_for(sandbox_id, owner)
        files = self._files(lv)
        if not isinstance(files, WatchableFiles):
            raise CapabilityNotSupported(
                f"the {lv.row.tier} tier cannot watch directories", tier=lv.row.tier
            )
        self.metrics.file_ops.labels("watch").inc()
        return await files.watch(path, recursive)

    async def list_files(self, req: ListFilesRequest, owner: str) -> FileList:
        sandbox_id, path, depth = req.sandbox_id, req.path, req.depth
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("list").inc()
        entries = await self._use(sandbox_id, owner, lambda lv: self._files(lv).list(path, depth))
        return FileList(entries=entries)

    async def stat_file(self, req: SandboxPathRequest, owner: str) -> FileInfo:
        sandbox_id, path = req.sandbox_id, req.path
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("stat").inc()
        return await self._use(sandbox_id, owner, lambda lv: self._files(lv).stat(path))

    async def remove_file(
        self, req: RemoveFileRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> None:
        sandbox_id, path, recursive = req.sandbox_id, req.path, req.recursive
        self._check_path(sandbox_id, owner, path)
        await self._logged_file_op(
            sandbox_id,
            owner,
            "remove_file",
            {"path": path, "recursive": recursive},
            env,
            lambda f: f.remove(path, recursive),
            lambda _r: {},
            lambda _d: None,
        )

    async def make_dir(
        self, req: SandboxPathRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> FileInfo:
        sandbox_id, path = req.sandbox_id, req.path
        self._check_path(sandbox_id, owner, path)
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "make_dir",
            {"path": path},
            env,
            lambda f: f.mkdir(path),
            json_dump,
            FileInfo.model_validate,
        )

    async def rename_file(
        self, req: RenameRequest, owner: str, env: Envelope = NO_ENVELOPE
    ) -> FileInfo:
        sandbox_id, src, dst = req.sandbox_id, req.src, req.dst
        self._check_path(sandbox_id, owner, src)
        self._check_path(sandbox_id, owner, dst)
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "rename_file",
            {"src": src, "dst": dst},
            env,
            lambda f: f.rename(src, dst),
            json_dump,
            FileInfo.model_validate,
        )

    async def upload_tar(
        self,
        sandbox_id: str,
        owner: str,
        path: str,
        data: bytes,
        *,
        env: Envelope = NO_ENVELOPE,
    ) -> int:
        if len(data) > self.limits.max_tar_bytes:
            raise PayloadTooLarge(f"tar upload is larger than {self.limits.max_tar_bytes} bytes")
        self._check_path(sandbox_id, owner, path)
        try:
            await asyncio.to_thread(check_tar, data)
        except DsecError as e:
            self.audit.refusal(sandbox_id, owner, e)
            raise
        return await self._logged_file_op(
            sandbox_id,
            owner,
            "upload_tar",
            {"path": path, "data": data},
            env,
            lambda f: f.upload_tar(path, data),
            lambda n: {"files": n},
            lambda d: int(d.get("files", 0)),
        )

    async def download_tar(self, sandbox_id: str, owner: str, path: str) -> bytes:
        self._check_path(sandbox_id, owner, path)
        self.metrics.file_ops.labels("download_tar").inc()
        return await self._use(
            sandbox_id,
            owner,
            lambda lv: self._files(lv).download_tar(path, self.limits.max_tar_bytes),
        )

    def _check_path(self, sandbox_id: str, owner: str, path: str) -> str:
        """:func:`check_path`, its refusals recorded as the sandbox's (:mod:`dsec.edge.audit`)."""
        try:
            return check_path(path)
        except DsecError as e:
            self.audit.refusal(sandbox_id, owner, e)
            raise


MAX_XATTR_PATHS = 100_000
MAX_XATTRS = 64
MAX_XATTR_NAME_BYTES = 255
MAX_XATTR_VALUE_BYTES = 4096


def _check_xattrs(values: dict[str, str], clear_prefix: str | None) -> None:
    """Refuse anything but a few small ``user.*`` attributes (InvalidRequest)."""
    if len(values) > MAX_XATTRS:
        raise InvalidRequest(f"at most {MAX_XATTRS} extended attributes per file")
    if clear_prefix is not None and not clear_prefix.startswith("user."):
        raise InvalidRequest("only user.* extended attributes can be cleared")
    for name, value in values.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise InvalidRequest("extended attribute names and values are strings")
        if not name.startswith("user.") or len(name) <= 5 or "\0" in name:
            raise InvalidRequest(f"invalid extended attribute name {name!r} (user.<name>)")
        if len(name.encode()) > MAX_XATTR_NAME_BYTES:
            raise InvalidRequest(f"extended attribute name {name[:40]!r}... is too long")
        if len(value.encode()) > MAX_XATTR_VALUE_BYTES:
            raise InvalidRequest(
                f"extended attribute {name!r} is over {MAX_XATTR_VALUE_BYTES} bytes"
            )


def check_path(path: str) -> str:
    """Refuse sandbox paths that are not absolute or that climb with ``..`` (every tier gets
    the same answer, whatever its file backend would make of them)."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidRequest(f"path {path!r} must be absolute", path=path)
    if "\0" in path or len(path) > 4096:
        raise InvalidRequest("path contains a NUL byte or is longer than 4096 bytes")
    if ".." in path.split("/"):
        raise PathOutsideSandbox(f"path {path!r} contains '..'", path=path)
    return path


def check_tar(data: bytes, max_members: int = 1_000_000) -> int:
    """Validate an uploaded tar before any tier sees it: no absolute names, no ``..``, no
    device nodes or FIFOs, no links that point outside the upload. Returns the member count."""
    import io
    import tarfile

    def bad(name: str) -> bool:
        return name.startswith("/") or ".." in name.split("/")

    n = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
            for m in tf:
                n += 1
                if n > max_members:
                    raise PayloadTooLarge(f"tar has more than {max_members} members")
                if bad(m.name):
                    raise PathOutsideSandbox(
                        f"tar member {m.name!r} escapes the target", member=m.name
                    )
                if m.ischr() or m.isblk() or m.isfifo():
                    raise PathOutsideSandbox(
                        f"tar member {m.name!r} is a device or FIFO", member=m.name
                    )
                if m.islnk() and bad(m.linkname):
                    raise PathOutsideSandbox(
                        f"tar hard link {m.name!r} points outside the upload", member=m.name
                    )
    except tarfile.TarError as e:
        raise InvalidRequest(f"not a valid tar archive: {e}") from e
    return n
