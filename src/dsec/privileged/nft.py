"""nftables through libnftables (ctypes): one in-process context, no ``nft`` subprocess.

libnftables is the library the ``nft`` command itself is built on (Debian package
``libnftables1``, a dependency of ``nftables``). Running a command in-process costs
about 0.1-0.5 ms instead of 2-4 ms for spawning ``nft``, which matters because the
DNS resolver admits every answer into the packet filter before it replies.

Each :meth:`Nftables.run` call is one netlink transaction: a multi-line script either
applies completely or not at all (the kernel's nf_tables commit is atomic), which is
how policies are swapped without a window where the sandbox is unfiltered.

Nothing here parses client input; callers build scripts from validated values only.

File descriptors: a context's netlink socket is opened with the context and waited on with
``select()`` inside the library, so it must be below ``FD_SETSIZE`` (1024): glibc aborts
the whole process ("bit out of range 0 - FD_SETSIZE") otherwise. A busy edge holds
thousands of fds, so this module keeps a few low fds in reserve from its import (early in
every process) and frees one for each socket a context opens; a context that would still
get a high one is refused with :class:`NftError`, never opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import threading
from typing import Any

__all__ = ["NftError", "Nftables"]

_NFT_CTX_DEFAULT = 0
_NFT_CTX_OUTPUT_JSON = 1 << 4
_NFT_CTX_OUTPUT_HANDLE = 1 << 3


class NftError(OSError):
    """libnftables rejected a command; ``message`` holds nft's own error text."""


_FD_SETSIZE = 1024
_RESERVE = 8


def _reserve_low_fds(n: int) -> list[int]:
    """Up to ``n`` fds below FD_SETSIZE held on /dev/null, for sockets contexts open later."""
    out: list[int] = []
    for _ in range(n):
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if fd >= _FD_SETSIZE:
            os.close(fd)
            break
        out.append(fd)
    return out


_LOW_FDS = _reserve_low_fds(_RESERVE)


def _open_fds() -> set[int]:
    return {int(name) for name in os.listdir("/proc/self/fd")}


def _load() -> ctypes.CDLL:
    name = ctypes.util.find_library("nftables") or "libnftables.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as e:  # pragma: no cover - depends on the node's packages
        raise NftError(f"libnftables not found ({name}): install the 'nftables' package") from e
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    return lib


_LIB_LOCK = threading.Lock()
"""Serialises every libnftables call of the process: the library keeps state outside its
contexts (its parser and netlink cache are not safe across threads), so two contexts used
from two threads at once (two edges in one process, e.g. a test process or a cluster node
with an embedded edge) can abort the whole process inside the library."""


class Nftables:
    """One libnftables context. Thread-safe (calls, of every context of the process, are
    serialised by one lock).

    Example::

        nft = Nftables()
        nft.run("add table ip demo")
        tables = nft.json("list tables")
        nft.run("delete table ip demo")
        nft.close()
    """

    def __init__(self) -> None:
        self._lib = _load()
        self._lock = _LIB_LOCK
        self._ctx = self._new_ctx(0)
        self._json_ctx = self._new_ctx(_NFT_CTX_OUTPUT_JSON)

    def _new_ctx(self, flags: int) -> int:
        with _LIB_LOCK:
            # the library opens a few files as it starts (then its socket, kept): each takes
            # the lowest free fd, so free the reserve and take back what it left afterwards
            while _LOW_FDS:
                os.close(_LOW_FDS.pop())
            before = _open_fds()
            try:
                ctx = self._lib.nft_ctx_new(_NFT_CTX_DEFAULT)
                opened = _open_fds() - before
            finally:
                _LOW_FDS.extend(_reserve_low_fds(_RESERVE))
            if not ctx:
                raise NftError("nft_ctx_new failed")
            if any(fd >= _FD_SETSIZE for fd in opened):
                self._lib.nft_ctx_free(ctx)
                raise NftError(
                    "no file descriptor below 1024 is free for an nftables socket "
                    "(libnftables cannot use a higher one)"
                )
            self._lib.nft_ctx_buffer_output(ctx)
            self._lib.nft_ctx_buffer_error(ctx)
            if flags:
                self._lib.nft_ctx_output_set_flags(ctx, flags)
            return int(ctx)

    def _run(self, ctx: int, script: str) -> str:
        with self._lock:
            if not ctx:
                raise NftError("nftables context is closed")
            rc = self._lib.nft_run_cmd_from_buffer(ctx, script.encode())
            out = self._lib.nft_ctx_get_output_buffer(ctx) or b""
            err = self._lib.nft_ctx_get_error_buffer(ctx) or b""
        if rc != 0:
            raise NftError(f"nft failed: {err.decode(errors='replace').strip()}")
        return out.decode(errors="replace")

    def run(self, script: str) -> str:
        """Run an nft script (one or more lines) as one atomic transaction; returns its output."""
        return self._run(self._ctx, script)

    def json(self, command: str) -> list[dict[str, Any]]:
        """Run a ``list ...`` command and return the ``nftables`` array of its JSON output."""
        out = self._run(self._json_ctx, command)
        if not out.strip():
            return []
        data = json.loads(out)
        items: list[dict[str, Any]] = data.get("nftables", [])
        return items

    def close(self) -> None:
        """Free the contexts. Idempotent."""
        with self._lock:
            for attr in ("_ctx", "_json_ctx"):
                ctx = getattr(self, attr)
                if ctx:
                    self._lib.nft_ctx_free(ctx)
                    setattr(self, attr, 0)
            # keep the reserve: the freed socket's fd is most likely the lowest free one
            if len(_LOW_FDS) < _RESERVE:
                with contextlib.suppress(OSError):
                    _LOW_FDS.extend(_reserve_low_fds(_RESERVE - len(_LOW_FDS)))
