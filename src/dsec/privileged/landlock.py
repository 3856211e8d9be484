"""Landlock (Linux LSM, syscalls 444-446) through ctypes: confine a process's filesystem access.

A Landlock *ruleset* lists the access rights it handles; every handled right is denied
unless a rule grants it beneath a directory (or on a file). ``restrict_self`` applies the
ruleset to the calling thread and, inherited, to every process it creates afterwards. It
needs ``PR_SET_NO_NEW_PRIVS`` (set here) or CAP_SYS_ADMIN, and cannot be undone.

This module imports only the standard library: the fncall zygote runs it inside the
sandbox's own Python interpreter (see ``dsec.runtimes.fncall.zygote``).

Example::

    abi = landlock_abi()                     # 0 when Landlock is unavailable
    confine(read_only=["/"], writable=["/work", "/tmp"], abi=abi)

ABI levels used: 1 (base fs rights), 2 (REFER), 3 (TRUNCATE), 5 (IOCTL_DEV),
6 (scopes: abstract unix sockets, signals), 7 (audit: ``log_new_exec``, Linux 6.15).
"""

from __future__ import annotations

import ctypes
import os
import struct

__all__ = [
    "FS_READ",
    "FS_WRITE",
    "LandlockError",
    "build_ruleset",
    "confine",
    "handled_fs_rights",
    "landlock_abi",
    "new_domain_ruleset",
    "restrict_self",
]

SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38

ACCESS_FS_EXECUTE = 1 << 0
ACCESS_FS_WRITE_FILE = 1 << 1
ACCESS_FS_READ_FILE = 1 << 2
ACCESS_FS_READ_DIR = 1 << 3
ACCESS_FS_REMOVE_DIR = 1 << 4
ACCESS_FS_REMOVE_FILE = 1 << 5
ACCESS_FS_MAKE_CHAR = 1 << 6
ACCESS_FS_MAKE_DIR = 1 << 7
ACCESS_FS_MAKE_REG = 1 << 8
ACCESS_FS_MAKE_SOCK = 1 << 9
ACCESS_FS_MAKE_FIFO = 1 << 10
ACCESS_FS_MAKE_BLOCK = 1 << 11
ACCESS_FS_MAKE_SYM = 1 << 12
ACCESS_FS_REFER = 1 << 13  # ABI 2
ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
ACCESS_FS_IOCTL_DEV = 1 << 15  # ABI 5
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6
RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1  # ABI 7

FS_READ = ACCESS_FS_EXECUTE | ACCESS_FS_READ_FILE | ACCESS_FS_READ_DIR
"""Rights granted on read-only paths: execute, read files, list directories."""

_FS_WRITE_V1 = (
    ACCESS_FS_WRITE_FILE
    | ACCESS_FS_REMOVE_DIR
    | ACCESS_FS_REMOVE_FILE
    | ACCESS_FS_MAKE_DIR
    | ACCESS_FS_MAKE_REG
    | ACCESS_FS_MAKE_SOCK
    | ACCESS_FS_MAKE_FIFO
    | ACCESS_FS_MAKE_SYM
)
FS_WRITE = _FS_WRITE_V1 | ACCESS_FS_REFER | ACCESS_FS_TRUNCATE
"""Rights granted on writable paths (never device nodes: MAKE_CHAR/MAKE_BLOCK stay denied)."""

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class LandlockError(OSError):
    """A Landlock syscall failed (errno set)."""


def _check(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise LandlockError(err, f"landlock {what}: {os.strerror(err)}")
    return rc


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is not supported or disabled."""
    rc = _libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION
    )
    return int(rc) if rc > 0 else 0


def handled_fs_rights(abi: int) -> int:
    """Every filesystem right the given ABI knows (so that all of them are denied by default)."""
    rights = FS_READ | _FS_WRITE_V1 | ACCESS_FS_MAKE_CHAR | ACCESS_FS_MAKE_BLOCK
    if abi >= 2:
        rights |= ACCESS_FS_REFER
    if abi >= 3:
        rights |= ACCESS_FS_TRUNCATE
    if abi >= 5:
        rights |= ACCESS_FS_IOCTL_DEV
    return rights


def _add_path_rule(ruleset_fd: int, path: str | int, access: int) -> None:
    """A rule granting ``access`` beneath ``path``: a path, or a descriptor of a directory
    (one the process cannot name by path, e.g. outside its root; not closed here)."""
    fd = path if isinstance(path, int) else os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        # struct landlock_path_beneath_attr { __u64 allowed_access; __s32 parent_fd; } __attribute__((packed))
        attr = ctypes.create_string_buffer(struct.pack("=Qi", access, fd))
        _check(
            int(
                _libc.syscall(
                    SYS_LANDLOCK_ADD_RULE, ruleset_fd, LANDLOCK_RULE_PATH_BENEATH, attr, 0
                )
            ),
            f"add_rule {path}",
        )
    finally:
        if not isinstance(path, int):
            os.close(fd)


def build_ruleset(
    read_only: list[str],
    writable: list[str | int],
    devices: list[str] | None = None,
    abi: int | None = None,
    scope_ipc: bool = True,
) -> int:
    """Create a ruleset and return its file descriptor (apply it with :func:`restrict_self`).

    Rules attach to the inodes of the given paths, so a file system mounted later on one of
    those directories is covered by that directory's rule: a zygote can build the ruleset
    once and each worker only calls :func:`restrict_self` after its own mounts.

    Args:
        read_only: directories (and everything beneath) that may be read and executed.
        writable: directories where files may also be created, written, removed (paths,
            or descriptors of directories).
        devices: device files that may be read and written (e.g. ``/dev/null``).
        abi: the kernel's ABI (``landlock_abi()`` if None).
        scope_ipc: with ABI >= 6, also forbid connecting to abstract unix sockets and
            sending signals outside the Landlock domain.

    Raises :class:`LandlockError` if Landlock is unavailable or a syscall fails.
    """
    abi = landlock_abi() if abi is None else abi
    if abi < 1:
        raise LandlockError(95, "landlock is not supported by this kernel")
    handled = handled_fs_rights(abi)
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if (scope_ipc and abi >= 6) else 0
    # struct landlock_ruleset_attr { __u64 handled_access_fs; __u64 handled_access_net; __u64 scoped; }
    if abi >= 6:
        attr = struct.pack("=QQQ", handled, 0, scoped)
    elif abi >= 4:
        attr = struct.pack("=QQ", handled, 0)
    else:
        attr = struct.pack("=Q", handled)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset_fd = _check(
        int(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), 0)),
        "create_ruleset",
    )
    try:
        for path in read_only:
            _add_path_rule(ruleset_fd, path, FS_READ & handled)
        for where in writable:
            _add_path_rule(ruleset_fd, where, (FS_READ | FS_WRITE) & handled)
        dev_rights = (
            ACCESS_FS_READ_FILE | ACCESS_FS_WRITE_FILE | ACCESS_FS_TRUNCATE | ACCESS_FS_IOCTL_DEV
        ) & handled
        for path in devices or []:
            _add_path_rule(ruleset_fd, path, dev_rights)
    except BaseException:
        os.close(ruleset_fd)
        raise
    return ruleset_fd


def new_domain_ruleset(abi: int | None = None) -> int:
    """A ruleset whose only effect, applied, is a Landlock domain of its own: it handles the
    making of block devices alone (never allowed in a sandbox anyway) and no scope.

    The kernel lets a process open another's ``/proc/<pid>/mem`` (or ptrace it) only if that
    process is in the same domain or one nested in it, whatever the users and capabilities:
    each command a sandbox runs enters a fresh one, so what one command leaves running cannot
    rewrite the memory of a command started later (docs/design/tenancy.md). Signals and
    everything else keep working. Raises :class:`LandlockError` without Landlock."""
    abi = landlock_abi() if abi is None else abi
    if abi < 1:
        raise LandlockError(95, "landlock is not supported by this kernel")
    # from ABI 2 every domain refuses linking or renaming across directories (EXDEV: apt,
    # pip, mv) unless the ruleset handles REFER and grants it: granted beneath "/" (this
    # process's root: call it in the mount namespace the commands run in)
    handled = ACCESS_FS_MAKE_BLOCK | (ACCESS_FS_REFER if abi >= 2 else 0)
    attr = ctypes.create_string_buffer(struct.pack("=Q", handled), 8)
    fd = _check(
        int(_libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(8), 0)),
        "create_ruleset",
    )
    if abi >= 2:
        try:
            _add_path_rule(fd, "/", ACCESS_FS_REFER)
        except BaseException:
            os.close(fd)
            raise
    return fd


def restrict_self(ruleset_fd: int, flags: int = 0) -> None:
    """Apply a ruleset to the calling thread (sets ``PR_SET_NO_NEW_PRIVS`` first)."""
    _check(int(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)), "no_new_privs")
    _check(int(_libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, flags)), "restrict_self")


def confine(
    read_only: list[str],
    writable: list[str | int],
    devices: list[str] | None = None,
    abi: int | None = None,
    scope_ipc: bool = True,
    log: bool = False,
) -> int:
    """Restrict the calling process (and its future children) to the given paths.

    Same arguments as :func:`build_ruleset`; with ``log`` (and ABI 7, Linux 6.15+) the
    kernel's audit records every refusal, also of the programs executed later (by default
    only those of the process that restricted itself are: ``LOG_NEW_EXEC_ON``), when the
    kernel's audit is enabled. Returns the ABI used; raises :class:`LandlockError` when
    Landlock is unavailable or a syscall fails.
    """
    abi = landlock_abi() if abi is None else abi
    fd = build_ruleset(read_only, writable, devices, abi, scope_ipc)
    try:
        restrict_self(fd, RESTRICT_SELF_LOG_NEW_EXEC_ON if log and abi >= 7 else 0)
    finally:
        os.close(fd)
    return abi
