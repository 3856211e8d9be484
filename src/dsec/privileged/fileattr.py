"""Inode flags (``chattr``): ``FS_IOC_GETFLAGS``/``FS_IOC_SETFLAGS`` on a file the node owns.

An immutable file (``FS_IMMUTABLE_FL``) can be neither written, truncated, renamed nor
removed, through any mount and whatever its mode, by a process without
``CAP_LINUX_IMMUTABLE``. tmpfs has the flag since Linux 6.0, ext4 and xfs always.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct
from pathlib import Path

__all__ = ["is_immutable", "set_immutable"]

log = logging.getLogger(__name__)

FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_IMMUTABLE_FL = 0x00000010

_UNSUPPORTED = (errno.ENOTTY, errno.EOPNOTSUPP, errno.EINVAL)
_warned: set[int] = set()


def _flags(fd: int) -> int:
    buf = fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("l", 0))
    return int(struct.unpack("l", buf)[0])


def is_immutable(path: Path) -> bool:
    """Whether ``path`` carries the immutable flag (False if missing or unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return bool(_flags(fd) & FS_IMMUTABLE_FL)
    except OSError:
        return False
    finally:
        os.close(fd)


def set_immutable(path: Path, on: bool) -> bool:
    """Set or clear ``path``'s immutable flag. A missing file is fine when clearing; a
    filesystem without the flag is logged once per device and reported False (the file then
    keeps only its mode and mount flags). Other errors raise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        if on:
            raise
        return False
    try:
        try:
            flags = _flags(fd)
            want = flags | FS_IMMUTABLE_FL if on else flags & ~FS_IMMUTABLE_FL
            if want != flags:
                fcntl.ioctl(fd, FS_IOC_SETFLAGS, struct.pack("l", want))
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            dev = os.fstat(fd).st_dev
            if dev not in _warned:
                _warned.add(dev)
                log.warning("%s: its filesystem has no immutable flag (%s)", path, e.strerror)
            return False
        return True
    finally:
        os.close(fd)
