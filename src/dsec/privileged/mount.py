"""Thin, typed wrappers over mount(2) and umount2(2) (no mount(8): it makes loop devices)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19

MNT_FORCE = 0x1
MNT_DETACH = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def mount(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    fstype: str | None,
    flags: int = 0,
    data: str | None = None,
) -> None:
    """mount(2). Raises OSError with the kernel's errno."""
    d = data.encode() if data is not None else None
    rc = _libc.mount(
        os.fsencode(source),
        os.fsencode(target),
        fstype.encode() if fstype else None,
        flags,
        ctypes.c_char_p(d) if d is not None else None,
    )
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {fstype} {source} -> {target}: {os.strerror(e)}")


def umount(target: str | os.PathLike[str], flags: int = 0) -> None:
    """umount2(2). Raises OSError; EINVAL means 'not a mount point'."""
    rc = _libc.umount2(os.fsencode(target), flags)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def umount_quiet(target: str | os.PathLike[str]) -> bool:
    """Unmount if mounted; fall back to a lazy detach when busy. Returns True if unmounted."""
    try:
        umount(target)
        return True
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.ENOENT):
            return False
        if e.errno == errno.EBUSY:
            umount(target, MNT_DETACH)
            return True
        raise


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _escape(path: str) -> str:
    return (
        path.replace("\\", "\\134")
        .replace(" ", "\\040")
        .replace("\t", "\\011")
        .replace("\n", "\\012")
    )


def mount_points(prefix: str | os.PathLike[str] | None = None) -> list[Path]:
    """Mount points of this mount namespace (from /proc/self/mountinfo), optionally under prefix.

    The prefix is matched on the escaped text before decoding, so scanning thousands of
    mounts for a few of ours stays cheap."""
    pre = _escape(os.fspath(prefix).rstrip("/")) if prefix is not None else None
    out: list[Path] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split(" ", 5)[4]
            if pre is None or raw == pre or raw.startswith(pre + "/"):
                out.append(Path(_unescape(raw)))
    return out


def is_mount_point(path: str | os.PathLike[str]) -> bool:
    return Path(os.path.abspath(path)) in set(mount_points(path))
