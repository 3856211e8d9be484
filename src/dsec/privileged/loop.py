"""Read-only loop devices over layer files, for kernels that cannot mount EROFS from a file.

Linux mounts EROFS straight from a regular file since 6.12 (and then only from files whose
filesystem can read pages for it: not tmpfs, not overlayfs). Elsewhere EROFS needs a block
device: a *loop device* bound to the file. :func:`attach_loop` binds one with ioctls (no
``losetup``):

1. ``LOOP_CTL_GET_FREE`` on ``/dev/loop-control`` names a free device ``/dev/loopN``;
2. ``LOOP_CONFIGURE`` (kernel 5.8+) binds the file in one call, with
   ``LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR`` and ``LO_FLAGS_DIRECT_IO`` (the device reads
   the file with O_DIRECT, so its pages are cached once, by EROFS, not twice). Kernels that
   refuse direct I/O for the file get a second try without it; files on FUSE (lazily served
   layers) never use it: their reads must go through the FUSE page cache the lazy server warms.
   ``EBUSY`` means another process took that device between the two steps: ask again.

AUTOCLEAR makes the kernel unbind the device at its last close: once the file system mounted
on it is unmounted (in every mount namespace) and no descriptor is open, it is free again. A
:class:`LoopDevice` holds one descriptor, which keeps the binding until the caller has mounted
the device; closing it after the mount hands the lifetime to the mount. A process that dies in
between leaks nothing: its descriptor closes with it.

One device per file: before binding a new device, :func:`attach_loop` looks for a device
already bound read-only to the same file (same path in ``/sys/block/loop*/loop/backing_file``,
same device and inode in ``LOOP_GET_STATUS64``) and shares it. Every mount of one loop device
is the same EROFS superblock, so its mounts share one page cache. The search and the binding
run under an exclusive ``flock`` on the file, so two processes attaching the same file at once
end up on one device.

A device of its own: ``attach_loop(file, share=False)`` binds a new device whatever is bound
to the file already, and marks it (its ``lo_file_name`` starts with :data:`OWN_DEVICE_MARK`)
so that no shared attach ever picks it up: a superblock, and so a page cache, that only its
own mounts use (one key's layer mounts, :mod:`dsec.layers.mounts`).

Example::

    with attach_loop("/var/lib/dsec/layers/blobs/sha256/ab....erofs") as dev:
        mount(dev.path, "/mnt/x", "erofs", MS_RDONLY)   # dev.path == "/dev/loop3"
    # the mount now owns the device; umount("/mnt/x") frees it
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "LoopDevice",
    "attach_loop",
    "attached_loops",
    "fs_magic",
    "loop_backing_file",
]

log = logging.getLogger(__name__)

# linux/loop.h
LOOP_CLR_FD = 0x4C01
LOOP_GET_STATUS64 = 0x4C05
LOOP_CONFIGURE = 0x4C0A
LOOP_CTL_GET_FREE = 0x4C82
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
LO_NAME_SIZE = 64

# statfs f_type values (linux/magic.h)
FUSE_SUPER_MAGIC = 0x65735546
TMPFS_MAGIC = 0x01021994
OVERLAYFS_SUPER_MAGIC = 0x794C7630

_ATTEMPTS = 64
OWN_DEVICE_MARK = b"dsec-own:"
"""How ``lo_file_name`` starts on a device bound with ``share=False`` (the rest is the end of
the file's path): such a device is never shared."""


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_char * LO_NAME_SIZE),
        ("lo_crypt_name", ctypes.c_char * LO_NAME_SIZE),
        ("lo_encrypt_key", ctypes.c_char * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


assert ctypes.sizeof(_LoopInfo64) == 232 and ctypes.sizeof(_LoopConfig) == 304

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_attach_lock = threading.Lock()


def fs_magic(fd: int) -> int:
    """``f_type`` of the filesystem holding open file ``fd`` (``fstatfs(2)``; 0 if unknown).
    ``f_type`` is the first field of ``struct statfs`` on every Linux ABI."""
    buf = ctypes.create_string_buffer(256)
    if _libc.fstatfs(fd, buf) != 0:
        return 0
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


@dataclass
class LoopDevice:
    """A loop device bound read-only to ``backing_file``, held open by this object.

    While it is open the binding stays; :meth:`close` (or leaving the ``with`` block) lets
    AUTOCLEAR unbind the device once nothing else (a mount) holds it. ``shared``: the
    device was already bound to the file (another mount's); :meth:`detach` leaves it alone.
    """

    number: int
    backing_file: str
    shared: bool
    direct_io: bool
    fd: int = field(repr=False)

    @property
    def path(self) -> str:
        """``/dev/loopN``: what to pass to mount(2)."""
        return f"/dev/loop{self.number}"

    def close(self) -> None:
        """Close this object's descriptor (idempotent)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def detach(self) -> None:
        """Unbind now (``LOOP_CLR_FD``) and close: after a failed mount. A device that was
        shared, or that something else has open, is only closed (the kernel unbinds it at its
        last close, AUTOCLEAR)."""
        if self.fd >= 0 and not self.shared:
            with contextlib.suppress(OSError):
                fcntl.ioctl(self.fd, LOOP_CLR_FD)
        self.close()

    def __enter__(self) -> LoopDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loop_backing_file(source: str) -> str | None:
    """The file bound to loop device ``source`` (``/dev/loopN``), as the kernel reports it in
    ``/sys/block/loopN/loop/backing_file``; None if ``source`` is no loop device or unbound.
    A backing file deleted since is reported without the kernel's `` (deleted)`` suffix."""
    name = os.path.basename(source)
    if not (source.startswith("/dev/") and name.startswith("loop") and name[4:].isdigit()):
        return None
    try:
        text = Path(f"/sys/block/{name}/loop/backing_file").read_text().rstrip("\n")
    except OSError:
        return None
    return text.removesuffix(" (deleted)")


def attached_loops() -> dict[str, str]:
    """Every bound loop device of the node, ``/dev/loopN`` -> backing file."""
    out: dict[str, str] = {}
    for p in glob.glob("/sys/block/loop*/loop/backing_file"):
        name = p.split("/")[3]
        with contextlib.suppress(OSError):
            out[f"/dev/{name}"] = Path(p).read_text().rstrip("\n").removesuffix(" (deleted)")
    return out


def attach_loop(
    file: str | os.PathLike[str], *, direct_io: bool | None = None, share: bool = True
) -> LoopDevice:
    """Bind ``file`` to a read-only AUTOCLEAR loop device, or share the one already bound to
    it. Returns it open; mount ``.path``, then :meth:`~LoopDevice.close` it (or use ``with``).

    Args:
        file: the image file (any regular file the kernel can read).
        direct_io: read the file with O_DIRECT; default: yes unless it lies on FUSE.
            Falls back to buffered reads if the kernel refuses direct I/O for the file.
        share: share a device already bound to the file (and let later attaches share this
            one); False: always a new device of the caller's own, never shared.

    Takes ~0.1-1 ms (one free-device query, one open, one ioctl).

    Raises:
        OSError: the file cannot be opened, no loop support (``/dev/loop-control`` missing:
            ``modprobe loop``), or no device could be bound after 64 attempts.
    """
    path = os.path.realpath(file)
    ffd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(ffd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file")
        if direct_io is None:
            direct_io = fs_magic(ffd) != FUSE_SUPER_MAGIC
        if not share:  # nothing to search for: no flock needed
            return _bind_new(ffd, path, direct_io, own=True)
        with _attach_lock, _flocked(ffd):
            found = _find_bound(path, st)
            if found is not None:
                return found
            return _bind_new(ffd, path, direct_io, own=False)
    finally:
        os.close(ffd)


@contextlib.contextmanager
def _flocked(fd: int) -> Iterator[None]:
    """Exclusive flock on the file for the search and binding (other processes attaching the
    same file wait); a filesystem without flock is used unlocked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)


def _find_bound(path: str, st: os.stat_result) -> LoopDevice | None:
    """A device already bound read-only, whole-file, to this very file (path, then device and
    inode checked on the device itself while holding it open), else None."""
    for dev, backing in attached_loops().items():
        if backing != path:
            continue
        number = int(dev[len("/dev/loop") :])
        try:
            lfd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # being torn down (ENXIO), or no node
        try:
            info = _status(lfd)
        except OSError:
            os.close(lfd)
            continue
        if (
            info.lo_device == st.st_dev
            and info.lo_inode == st.st_ino
            and info.lo_offset == 0
            and info.lo_sizelimit == 0
            and info.lo_flags & LO_FLAGS_READ_ONLY
            and not bytes(info.lo_file_name).startswith(OWN_DEVICE_MARK)
        ):
            dio = bool(info.lo_flags & LO_FLAGS_DIRECT_IO)
            return LoopDevice(number, path, shared=True, direct_io=dio, fd=lfd)
        os.close(lfd)
    return None


def _status(lfd: int) -> _LoopInfo64:
    buf = bytearray(ctypes.sizeof(_LoopInfo64))
    fcntl.ioctl(lfd, LOOP_GET_STATUS64, buf)
    return _LoopInfo64.from_buffer_copy(buf)


def _bind_new(ffd: int, path: str, direct_io: bool, *, own: bool) -> LoopDevice:
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(_ATTEMPTS):
            number = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            try:
                lfd = _open_loop(number)
            except OSError as e:
                if e.errno in (errno.ENXIO, errno.ENOENT):
                    time.sleep(0.001)  # being removed or its node not made yet: another one
                    continue
                raise
            try:
                dio = _configure(lfd, number, ffd, path, direct_io, own=own)
            except OSError as e:
                os.close(lfd)
                if e.errno == errno.EBUSY:  # another process bound it first
                    continue
                raise
            return LoopDevice(number, path, shared=False, direct_io=dio, fd=lfd)
    finally:
        os.close(ctl)
    raise OSError(errno.EBUSY, f"no free loop device for {path} after {_ATTEMPTS} attempts")


def _open_loop(number: int) -> int:
    dev = f"/dev/loop{number}"
    try:
        return os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        # a /dev that is not devtmpfs (a container's): make the node the kernel announced
        major, minor = Path(f"/sys/block/loop{number}/dev").read_text().strip().split(":")
        with contextlib.suppress(FileExistsError):
            os.mknod(dev, stat.S_IFBLK | 0o600, os.makedev(int(major), int(minor)))
        return os.open(dev, os.O_RDONLY | os.O_CLOEXEC)


def _configure(lfd: int, number: int, ffd: int, path: str, direct_io: bool, *, own: bool) -> bool:
    """LOOP_CONFIGURE; returns whether direct I/O was asked for and accepted."""
    cfg = _LoopConfig()
    cfg.fd = ffd
    mark = OWN_DEVICE_MARK if own else b""
    cfg.info.lo_file_name = mark + os.fsencode(path)[-(LO_NAME_SIZE - 1 - len(mark)) :]
    flags = LO_FLAGS_READ_ONLY | LO_FLAGS_AUTOCLEAR
    if direct_io:
        cfg.info.lo_flags = flags | LO_FLAGS_DIRECT_IO
        try:
            fcntl.ioctl(lfd, LOOP_CONFIGURE, bytes(cfg))
            return True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.debug("loop%d: no direct I/O for %s (%s)", number, path, e.strerror)
    cfg.info.lo_flags = flags
    fcntl.ioctl(lfd, LOOP_CONFIGURE, bytes(cfg))
    return False
