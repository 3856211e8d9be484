"""Thin, typed wrappers over mount(2) and umount2(2) (no mount(8)), and the one place that
mounts an EROFS image file: :func:`mount_erofs`.

EROFS mounts: from the file itself (kernel 6.12+, file on a filesystem that can back it) or
through a read-only loop device bound to it (:mod:`dsec.privileged.loop`; kernels from 6.1,
files on tmpfs or overlayfs). ``DSEC_EROFS_MOUNT`` chooses (read at each mount):

* ``auto`` (default): kernels before 6.12 use loop devices; newer ones mount the file and fall
  back to a loop device when the kernel answers ``ENOTBLK`` (the file's filesystem cannot back
  EROFS), remembered per filesystem for the life of the process;
* ``loop``: always a loop device (tests, operators who want one page cache per layer across
  mount namespaces and tiers);
* ``file``: always the file (errors are not retried).

Each mount of a file is an EROFS superblock of its own, with its own page cache; every mount
of one loop device is the same superblock. ``own_device=True`` gives a mount made through a
loop device a device of its own (:func:`dsec.privileged.loop.attach_loop` with
``share=False``), so that it too has a page cache no other mount shares.

Direct I/O: a mount from the file asks for EROFS's ``directio`` option (Linux 6.13+): EROFS
reads the file with O_DIRECT, so its blocks are cached once, in the mount's own page cache,
and not a second time in the file's, which every mount of the file shares (loop devices read
their files with O_DIRECT too, see ``loop.py``). A kernel that does not know the option
(``EINVAL``, and the mount works without it) gets mounts without it from then on, for the
life of the process, for files on that filesystem; files on FUSE (lazily served layers) never use it: their reads must go
through the FUSE page cache the lazy server warms. :func:`erofs_directio_supported` says
what this kernel did.

:func:`erofs_mount_mode` and :func:`erofs_mount_reason` say which this process uses and why
(``dsec doctor``); :func:`erofs_file_mount_supported` is the kernel probe behind them.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import re
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from dsec.config import env_choice
from dsec.privileged.loop import (
    FUSE_SUPER_MAGIC,
    OVERLAYFS_SUPER_MAGIC,
    TMPFS_MAGIC,
    attach_loop,
    fs_magic,
)

log = logging.getLogger(__name__)

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


SYS_FSCONFIG = 431
SYS_FSPICK = 433
FSPICK_CLOEXEC = 0x1
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_RECONFIGURE = 7
_libc.syscall.restype = ctypes.c_long


def reconfigure(target: str | os.PathLike[str], options: dict[str, str]) -> None:
    """Change the options of the filesystem mounted at ``target`` (``mount -o remount``
    without touching the mount's own flags), through fspick(2) and fsconfig(2) (Linux 5.2+).

    Unlike ``mount(MS_REMOUNT)``, it reaches a mount of another mount namespace by a path
    through ``/proc/<pid>/root``: no helper has to join that namespace (a threaded process
    cannot). Raises OSError with the kernel's errno (the first option it refused)."""
    path = os.fsencode(target)
    fd = int(_libc.syscall(SYS_FSPICK, -100, path, FSPICK_CLOEXEC))  # AT_FDCWD
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"fspick {os.fsdecode(path)}: {os.strerror(e)}")
    try:
        for key, value in options.items():
            k, v = key.encode(), value.encode()
            if _libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_SET_STRING, k, v, 0) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"{os.fsdecode(path)}: {key}={value}: {os.strerror(e)}")
        if _libc.syscall(SYS_FSCONFIG, fd, FSCONFIG_CMD_RECONFIGURE, None, None, 0) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"reconfigure {os.fsdecode(path)}: {os.strerror(e)}")
    finally:
        os.close(fd)


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


_SYS_OPEN_TREE = 428
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100
_libc.syscall.restype = ctypes.c_long


def open_tree_clone(path: str | os.PathLike[str]) -> int:
    """A detached copy of the mount at ``path`` (``open_tree(OPEN_TREE_CLONE)``, Linux 5.2+;
    not its submounts): a close-on-exec fd to attach elsewhere, e.g. in another mount
    namespace with ``move_mount``. Raises OSError."""
    fd = int(
        _libc.syscall(
            ctypes.c_long(_SYS_OPEN_TREE),
            ctypes.c_int(_AT_FDCWD),
            ctypes.c_char_p(os.fsencode(path)),
            ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC),
        )
    )
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"open_tree({path}): {os.strerror(e)}")
    return fd


def mounts_below_root(pid: int) -> list[tuple[str, bool]]:
    """The mounts right below process ``pid``'s root mount, as seen in its mount namespace
    (``/proc/PID/mountinfo``): (mount point, whether it is a directory), in mount order
    (those stacked on another mount come with it and are not listed)."""
    rows: list[tuple[int, int, str]] = []
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split(" ", 5)
            rows.append((int(fields[0]), int(fields[1]), _unescape(fields[4])))
    roots = [mid for mid, _, mp in rows if mp == "/"]
    if not roots:
        raise OSError(errno.ENOENT, f"process {pid} has no root mount in its mountinfo")
    root = roots[-1]  # the topmost of a stack on /
    out: list[tuple[str, bool]] = []
    for _, parent, mp in rows:
        if parent == root and mp != "/":
            out.append((mp, stat.S_ISDIR(os.stat(f"/proc/{pid}/root{mp}").st_mode)))
    return out


# --- EROFS -----------------------------------------------------------------------------------

EROFS_MOUNT_ENV = "DSEC_EROFS_MOUNT"
"""Environment variable: ``auto`` (default), ``loop`` or ``file`` (see the module doc)."""

EROFS_FILE_MOUNT_SINCE = (6, 12)
"""First kernel release that mounts EROFS from a regular file."""

ErofsMountMode = Literal["file", "loop"]

_file_mount_ok: dict[int, bool] = {}  # st_dev -> can the kernel mount EROFS from files there
_file_mount_lock = threading.Lock()
_directio_ok: dict[int, bool] = {}  # st_dev -> did the kernel take EROFS's directio


def erofs_mount_setting() -> Literal["file", "loop", "auto"]:
    """``DSEC_EROFS_MOUNT`` as set (``auto`` if unset or unknown, with a warning)."""
    value = env_choice(EROFS_MOUNT_ENV, ("auto", "file", "loop"))
    return "file" if value == "file" else "loop" if value == "loop" else "auto"


@functools.cache
def _release_can_file_mount() -> bool:
    """False on kernels older than 6.12 (from ``uname -r``; True if it does not parse)."""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return m is None or (int(m.group(1)), int(m.group(2))) >= EROFS_FILE_MOUNT_SINCE


@functools.cache
def _kernel_probe() -> tuple[bool, str]:
    """Can this kernel mount EROFS from a regular file, and why we think so. Mounts a file
    that is no EROFS image (a file of dsec's own, on disk) read-only: a kernel that can answers
    EINVAL (no superblock), one that cannot ENOTBLK. Once per process, ~0.1 ms."""
    release = os.uname().release
    if not _release_can_file_mount():
        since = ".".join(map(str, EROFS_FILE_MOUNT_SINCE))
        return (
            False,
            f"this kernel cannot mount EROFS from a file: needs {since}, this is {release}",
        )
    not_probed = "files on tmpfs or overlayfs only"
    for candidate in (os.path.abspath(__file__), os.path.realpath(sys.executable)):
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if fs_magic(fd) in (TMPFS_MAGIC, OVERLAYFS_SUPER_MAGIC):
                continue  # these answer ENOTBLK on any kernel
        finally:
            os.close(fd)
        target = tempfile.mkdtemp(prefix="dsec-erofs-probe-")
        try:
            mount(candidate, target, "erofs", MS_RDONLY)
            umount(target, MNT_DETACH)
            return True, f"kernel {release} mounts EROFS straight from a file"
        except OSError as e:
            if e.errno == errno.EINVAL:
                return True, f"kernel {release} mounts EROFS straight from a file"
            if e.errno == errno.ENOTBLK:
                return False, (
                    f"kernel {release} cannot mount EROFS from a file "
                    "(built without CONFIG_EROFS_FS_BACKED_BY_FILE)"
                )
            if e.errno == errno.ENODEV:
                return False, f"kernel {release} has no EROFS at all (CONFIG_EROFS_FS)"
            not_probed = e.strerror or str(e)
            break
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(target)
    return True, f"kernel {release} should mount EROFS from a file (not probed: {not_probed})"


def erofs_file_mount_supported() -> bool:
    """Whether this kernel mounts EROFS from a regular file (6.12+ with
    ``CONFIG_EROFS_FS_BACKED_BY_FILE``), whatever ``DSEC_EROFS_MOUNT`` says. Probed once."""
    return _kernel_probe()[0]


def erofs_mount_mode() -> ErofsMountMode:
    """How this process mounts EROFS layer files: ``"file"`` (straight from the file) or
    ``"loop"`` (through loop devices), from ``DSEC_EROFS_MOUNT`` and the kernel. In ``file``
    mode, files whose filesystem cannot back EROFS (tmpfs, overlayfs) still use loop devices."""
    setting = erofs_mount_setting()
    if setting != "auto":
        return setting
    return "file" if _kernel_probe()[0] else "loop"


def erofs_mount_reason() -> str:
    """Why :func:`erofs_mount_mode` says what it says, for people, e.g. ``"this kernel cannot
    mount EROFS from a file: needs 6.12, this is 6.1.0-18-amd64"``."""
    setting = erofs_mount_setting()
    if setting != "auto":
        return f"{EROFS_MOUNT_ENV}={setting}"
    ok, why = _kernel_probe()
    return f"{why}; files on tmpfs or overlayfs use loop devices" if ok else why


def _plan(file: str) -> Literal["file", "loop", "try"]:
    """``file``: mount the file, no fallback; ``loop``: a loop device; ``try``: the file,
    then a loop device on ENOTBLK."""
    setting = erofs_mount_setting()
    if setting != "auto":
        return setting
    if not _release_can_file_mount():
        return "loop"
    try:
        dev = os.stat(file).st_dev
    except OSError:
        return "try"  # the mount reports the real error
    return "loop" if _file_mount_ok.get(dev) is False else "try"


def _learn(file: str, ok: bool) -> None:
    try:
        dev = os.stat(file).st_dev
    except OSError:
        return
    with _file_mount_lock:
        if dev in _file_mount_ok:
            return
        _file_mount_ok[dev] = ok
    if not ok:
        log.info(
            "EROFS: %s cannot be mounted from the file (ENOTBLK: its filesystem cannot back "
            "EROFS); files there are mounted through loop devices",
            file,
        )


def erofs_directio_supported() -> bool | None:
    """Whether this kernel took EROFS's ``directio`` option for a mount from a file (Linux
    6.13+); None until this process has mounted a file (not on FUSE) with it asked for."""
    with _file_mount_lock:
        known = set(_directio_ok.values())
    return (True in known) if known else None


def _mount_file(src: str, target: str | os.PathLike[str], flags: int) -> None:
    """mount(2) of an EROFS file, with ``directio`` unless the kernel refused it for a file
    on the same filesystem before or the file lies on FUSE (see the module doc)."""
    try:
        st_dev = os.stat(src).st_dev
    except OSError:
        st_dev = -1  # the mount reports the real error
    if _directio_ok.get(st_dev) is False or _on_fuse(src):
        mount(src, target, "erofs", flags)
        return
    try:
        mount(src, target, "erofs", flags, "directio")
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise  # ENOTBLK (the file's filesystem cannot back EROFS), ...
        mount(src, target, "erofs", flags)  # EINVAL again: no EROFS image at all
        ok = False
    else:
        ok = True
    with _file_mount_lock:
        if st_dev != -1 and st_dev not in _directio_ok:
            _directio_ok[st_dev] = ok
            if not ok:
                log.info("EROFS: no directio option for %s: its blocks are cached twice", src)


def _on_fuse(file: str) -> bool:
    try:
        fd = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False  # the mount reports the real error
    try:
        return fs_magic(fd) == FUSE_SUPER_MAGIC
    finally:
        os.close(fd)


def mount_erofs(
    file: str | os.PathLike[str],
    target: str | os.PathLike[str],
    flags: int = MS_RDONLY,
    *,
    own_device: bool = False,
) -> str:
    """Mount the EROFS image ``file`` read-only at ``target``, from the file or through a loop
    device (see the module doc). ``flags`` should include ``MS_RDONLY``.

    A loop device is AUTOCLEAR: unmounting the last mount of it (in any mount namespace) frees
    it. One device per file: a device already bound to the file is shared, unless
    ``own_device``: then the mount gets a device of its own, which nothing else shares (a
    mount from the file is a superblock of its own anyway). ``file`` may also be a block
    device (a loop device bound by the caller), mounted as it is.

    Returns:
        The mount's source: ``file`` or ``/dev/loopN``.

    Raises:
        OSError: the kernel's errno (EINVAL: not an EROFS image; ENOTBLK with
            ``DSEC_EROFS_MOUNT=file``: this kernel or filesystem cannot mount from a file).
    """
    src = os.fspath(file)
    try:
        is_block = stat.S_ISBLK(os.stat(src).st_mode)
    except OSError:
        is_block = False
    if is_block:
        mount(src, target, "erofs", flags)
        return src
    plan = _plan(src)
    if plan != "loop":
        try:
            _mount_file(src, target, flags)
        except OSError as e:
            if plan == "file" or e.errno != errno.ENOTBLK:
                raise
            _learn(src, False)
        else:
            if plan == "try":
                _learn(src, True)
            return src
    with attach_loop(src, share=not own_device) as dev:
        try:
            mount(dev.path, target, "erofs", flags)
        except OSError as e:
            dev.detach()
            why = os.strerror(e.errno) if e.errno else str(e)
            raise OSError(e.errno, f"mount erofs {src} (on {dev.path}) -> {target}: {why}") from e
    return dev.path


def _file_mountable(file: str) -> bool:
    """Can the kernel mount ``file`` itself (auto mode, kernel 6.12+)? Known per filesystem
    after the first mount there; else found out by mounting it on a scratch directory."""
    try:
        dev = os.stat(file).st_dev
    except OSError:
        return True  # the mount reports the real error
    known = _file_mount_ok.get(dev)
    if known is not None:
        return known
    target = tempfile.mkdtemp(prefix="dsec-erofs-probe-")
    try:
        mount(file, target, "erofs", MS_RDONLY)
    except OSError as e:
        if e.errno != errno.ENOTBLK:
            return True  # not a filesystem question: the real mount reports it
        _learn(file, False)
        return False
    else:
        umount(target, MNT_DETACH)
        _learn(file, True)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(target)


@contextlib.contextmanager
def erofs_mount_sources(files: Sequence[str | os.PathLike[str]]) -> Iterator[list[str]]:
    """For a mount made by another process (the fncall launcher, in its own mount namespace):
    what to pass to mount(2) for each EROFS file, the file itself or a loop device bound to
    it, held (open here) until the block exits. The other process must have mounted them by
    then; an unmounted device is freed at the exit (AUTOCLEAR).

    Example::

        with erofs_mount_sources(layer_files) as sources:
            subprocess.run([launcher, *sources])   # mounts each with fstype erofs
    """
    with contextlib.ExitStack() as stack:
        out: list[str] = []
        for f in files:
            src = os.fspath(f)
            plan = _plan(src)
            if plan == "loop" or (plan == "try" and not _file_mountable(src)):
                src = stack.enter_context(attach_loop(src)).path
            out.append(src)
        yield out
