"""The seccomp-BPF deny list of fncall workers, compiled by hand (no libseccomp).

Standard library only: the zygote runs this module inside the sandbox's own Python.

Policy (x86-64): a foreign architecture or an x32 syscall kills the process; the syscalls
below fail with ``EPERM``; ``clone`` with any namespace flag fails with ``EPERM``; ``clone3``
fails with ``ENOSYS`` (its flags sit behind a pointer seccomp cannot read, and libc then
falls back to ``clone``); ``ioctl`` with ``TIOCSTI``/``TIOCLINUX``/``XFS_IOC_SWAPEXT``/
``FICLONE``/``FICLONERANGE``/``FIDEDUPERANGE`` fails with ``EPERM``; ``socket`` is limited
to ``AF_UNIX``, ``AF_INET``, ``AF_INET6`` and ``AF_NETLINK`` (the worker's network namespace
has only loopback). Everything else is allowed.

Refusals can be reported (evidence of cheating, :mod:`dsec.edge.audit`): installed with
``log=True`` the filter carries ``SECCOMP_FILTER_FLAG_LOG`` and the kernel emits an audit
record (type 1326) for every call it refuses, at no cost to the calls it allows. A worker is
forked before its sandbox is known, so it cannot carry the sandbox's audit id: it carries
one of its own, :func:`worker_audit_id` (its agent sets its loginuid while still root), and
the edge maps that id to the sandbox that claims the worker.

Example::

    prog = build_filter()          # bytes of struct sock_filter[]
    install_filter(prog, log=True) # PR_SET_NO_NEW_PRIVS + seccomp(SECCOMP_FILTER_FLAG_LOG)
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

__all__ = [
    "DENIED_IOCTLS",
    "DENIED_SYSCALLS",
    "build_filter",
    "install_filter",
    "worker_audit_id",
]

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# x86-64 syscall numbers
DENIED_SYSCALLS: dict[str, int] = {
    "ptrace": 101,
    "syslog": 103,
    "uselib": 134,
    "vhangup": 153,
    "pivot_root": 155,
    "_sysctl": 156,
    "adjtimex": 159,
    "chroot": 161,
    "acct": 163,
    "settimeofday": 164,
    "mount": 165,
    "umount2": 166,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "sethostname": 170,
    "setdomainname": 171,
    "iopl": 172,
    "ioperm": 173,
    "create_module": 174,
    "init_module": 175,
    "delete_module": 176,
    "get_kernel_syms": 177,
    "query_module": 178,
    "quotactl": 179,
    "nfsservctl": 180,
    "lookup_dcookie": 212,
    "clock_settime": 227,
    "kexec_load": 246,
    "add_key": 248,
    "request_key": 249,
    "keyctl": 250,
    "migrate_pages": 256,
    "unshare": 272,
    "move_pages": 279,
    "perf_event_open": 298,
    "fanotify_init": 300,
    "name_to_handle_at": 303,
    "open_by_handle_at": 304,
    "clock_adjtime": 305,
    "setns": 308,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "kcmp": 312,
    "finit_module": 313,
    "kexec_file_load": 320,
    "bpf": 321,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
    "quotactl_fd": 443,
}

NR_IOCTL = 16
NR_SOCKET = 41
NR_CLONE = 56
NR_CLONE3 = 435

DENIED_IOCTLS: dict[str, int] = {
    "TIOCSTI": 0x5412,
    "TIOCLINUX": 0x541C,
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "FICLONE": 0x40049409,
    "FICLONERANGE": 0x4020940D,
    "FIDEDUPERANGE": 0xC0189436,
}
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
CLONE_NS_FLAGS = 0x7E020000  # NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET

# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000

_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0_LO = 16
_OFF_ARG1_LO = 24


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def build_filter() -> bytes:
    """The filter program as the bytes of a ``struct sock_filter`` array."""
    eperm = _RET_ERRNO | errno.EPERM
    prog: list[bytes] = [
        _insn(_LD_W_ABS, 0, 0, _OFF_ARCH),
        _insn(_JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        _insn(_RET_K, 0, 0, RET_KILL_PROCESS),
        _insn(_LD_W_ABS, 0, 0, _OFF_NR),
        _insn(_JGE_K, 0, 1, X32_SYSCALL_BIT),
        _insn(_RET_K, 0, 0, RET_KILL_PROCESS),
    ]
    for nr in sorted(DENIED_SYSCALLS.values()):
        prog += [_insn(_JEQ_K, 0, 1, nr), _insn(_RET_K, 0, 0, eperm)]
    prog += [_insn(_JEQ_K, 0, 1, NR_CLONE3), _insn(_RET_K, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    # clone: deny namespace flags (flags are argument 0 on x86-64)
    prog += [
        _insn(_JEQ_K, 0, 4, NR_CLONE),
        _insn(_LD_W_ABS, 0, 0, _OFF_ARG0_LO),
        _insn(_JSET_K, 0, 1, CLONE_NS_FLAGS),
        _insn(_RET_K, 0, 0, eperm),
        _insn(_RET_K, 0, 0, RET_ALLOW),
    ]
    # ioctl: deny the listed request numbers (argument 1, an unsigned int)
    cmds = sorted(DENIED_IOCTLS.values())
    block = [_insn(_LD_W_ABS, 0, 0, _OFF_ARG1_LO)]
    for cmd in cmds:
        block += [_insn(_JEQ_K, 0, 1, cmd), _insn(_RET_K, 0, 0, eperm)]
    block.append(_insn(_RET_K, 0, 0, RET_ALLOW))
    prog += [_insn(_JEQ_K, 0, len(block), NR_IOCTL), *block]
    # socket: allow only the listed address families (argument 0)
    fams = list(ALLOWED_SOCKET_FAMILIES)
    block = [_insn(_LD_W_ABS, 0, 0, _OFF_ARG0_LO)]
    for fam in fams:
        block.append(_insn(_JEQ_K, 0, 1, fam))
        block.append(_insn(_RET_K, 0, 0, RET_ALLOW))
    block.append(_insn(_RET_K, 0, 0, _RET_ERRNO | errno.EAFNOSUPPORT))
    prog += [_insn(_JEQ_K, 0, len(block), NR_SOCKET), *block]
    prog.append(_insn(_RET_K, 0, 0, RET_ALLOW))
    if len(prog) > 4096:
        raise ValueError("seccomp program too long")
    return b"".join(prog)


PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SYS_SECCOMP = 317
SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_LOG = 2

WORKER_AUDIT_IDS = 1 << 31
"""Workers' audit ids lie in ``[2^31, 2^31 + 2^30)``: above any real user's uid, apart from
the container tier's (``[2^30, 2^31)``, :func:`dsec.privileged.seccomp_log.audit_id_of`)
and never the unset value (``2^32 - 1``)."""


def worker_audit_id(base: int, wid: int) -> int:
    """The loginuid of worker ``wid`` of a pool whose ids start at ``base`` (30 random bits
    per pool: two servers on one node, each with its own pools, do not share ids)."""
    return WORKER_AUDIT_IDS | ((base + wid) & ((1 << 30) - 1))


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install_filter(prog: bytes, log: bool = False) -> None:
    """Load ``prog`` as a seccomp filter on the calling thread (inherited by children);
    with ``log``, every call it refuses is also reported to the kernel's audit stream
    (``SECCOMP_FILTER_FLAG_LOG``, Linux 4.14+).

    Raises OSError when the kernel refuses it.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"PR_SET_NO_NEW_PRIVS: {os.strerror(err)}")
    if log:
        libc.syscall.restype = ctypes.c_long
        flags = ctypes.c_uint(SECCOMP_FILTER_FLAG_LOG)
        rc = libc.syscall(SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog))
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"seccomp(SECCOMP_FILTER_FLAG_LOG): {os.strerror(err)}")
        return
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"PR_SET_SECCOMP: {os.strerror(err)}")
