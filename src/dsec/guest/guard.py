"""The guard of VM-tier commands: the container tier's protections, rendered for the guest agent.

A VM-tier sandbox's commands get, by default, what a container's processes get
(``dsec.runtimes.container.bundle`` and ``.seccomp`` are the one source of it): the same
capability bounding set, rlimits, masked and read-only paths, device list and seccomp filter,
plus ``no_new_privs``. The guest agent applies them (``agent.c``, "The guard"); this module
writes the two files it reads from the initramfs:

``/dsec/guard.policy``
    One rule a line (numbers decimal)::

        cap N                  keep capability N in the bounding set (all others dropped)
        rlimit RES SOFT HARD   setrlimit(); -1 = unlimited
        mask PATH              hide PATH (a file: /dev/null bound over it; a directory: an
                               empty read-only tmpfs)
        readonly PATH          bind PATH read-only onto itself
        dev NAME               a character device of the guest's /dev kept in the commands'
                               /dev (a tmpfs; /dev/pts and /dev/shm are added to it)

``/dsec/guard.bpf``
    The seccomp filter: the container tier's :data:`~dsec.runtimes.container.seccomp.RULES`
    compiled by libseccomp (as ``dsec_execd`` does on the host) into a ``struct
    sock_filter`` array, so the guest does not need libseccomp and compiles nothing.

Sandboxes created with ``full_guest=True`` skip the guard (``docs/design/microvm.md``).

Example::

    files = guard_files()          # {"dsec/guard.policy": b"...", "dsec/guard.bpf": b"..."}
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache

from dsec.contract.isolation import (
    ARCHITECTURES,
    CAPABILITIES,
    MASKED_PATHS,
    READONLY_PATHS,
    RLIMITS,
    RULES,
    SeccompRule,
)
from dsec.errors import TierUnavailable

__all__ = ["GUARD_DEVICES", "guard_files", "guard_policy_text", "seccomp_bpf"]

GUARD_DEVICES: tuple[str, ...] = ("null", "zero", "full", "random", "urandom", "tty")
"""Devices of the commands' /dev: the container tier's device allow list (``bundle.py``).
The vm tier adds ``tty1``, its display's console (the agent does, when ``dsec.tty=1``)."""

# libseccomp ABI (seccomp.h): actions and compare operators
_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_ACT_ERRNO = 0x00050000
_SCMP_CMP = {"eq": 4, "masked_eq": 7}
_SCMP_FLTATR_CTL_OPTIMIZE = 8  # 2: binary tree of syscall numbers (libseccomp >= 2.5)
_NR_SCMP_ERROR = -1


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _libseccomp() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        raise TierUnavailable(
            "building the VM guest's seccomp filter needs libseccomp (Debian: libseccomp2)",
            package="libseccomp2",
        )
    lib = ctypes.CDLL(name, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    return lib


def seccomp_bpf(rules: tuple[SeccompRule, ...] = RULES) -> bytes:
    """``rules`` compiled to a seccomp-BPF program (the bytes of ``struct sock_filter[]``).

    Same rules as ``dsec_execd``'s filter: default allow, each rule's action
    ``SCMP_ACT_ERRNO(errno)``, the architectures of :data:`ARCHITECTURES` (others are
    killed), syscalls this libseccomp does not know skipped. Laid out as a binary tree of
    syscall numbers (``SCMP_FLTATR_CTL_OPTIMIZE`` 2) instead of a chain: the guest attaches
    it once per command, and the kernel then runs it for every syscall number of every
    architecture (its per-filter cache of always-allowed syscalls): under TCG the chain cost
    ~3 ms per command, the tree well under 1 (docs/design/microvm.md). Raises
    :class:`~dsec.errors.TierUnavailable` without libseccomp, ``OSError`` if it fails.
    """
    lib = _libseccomp()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        if lib.seccomp_attr_set(ctx, _SCMP_FLTATR_CTL_OPTIMIZE, 2) < 0:
            raise OSError("this libseccomp cannot lay a filter out as a tree (needs >= 2.5)")
        for arch in ARCHITECTURES:
            token = lib.seccomp_arch_resolve_name(arch.encode())
            if token == 0:
                raise OSError(f"libseccomp does not know the architecture {arch}")
            rc = lib.seccomp_arch_add(ctx, token)
            if rc < 0 and rc != -17:  # EEXIST: the native architecture is there already
                raise OSError(-rc, f"seccomp_arch_add {arch}: {os.strerror(-rc)}")
        for r in rules:
            nr = lib.seccomp_syscall_resolve_name(r.syscall.encode())
            if nr == _NR_SCMP_ERROR:
                continue
            action = _SCMP_ACT_ERRNO | (r.errno & 0xFFFF)
            if r.arg is None:
                rc = lib.seccomp_rule_add_array(ctx, action, nr, 0, None)
            else:
                index, op, a, b = r.arg
                cmp = _ArgCmp(index, _SCMP_CMP[op], a, b)
                rc = lib.seccomp_rule_add_array(ctx, action, nr, 1, ctypes.byref(cmp))
            if rc < 0:
                raise OSError(-rc, f"seccomp_rule_add {r.syscall}: {os.strerror(-rc)}")
        fd = os.memfd_create("dsec-guard-bpf", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise OSError(-rc, f"seccomp_export_bpf: {os.strerror(-rc)}")
            size = os.lseek(fd, 0, os.SEEK_END)
            prog = os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    if not prog or len(prog) % 8:
        raise OSError(f"seccomp_export_bpf wrote {len(prog)} bytes, not a filter program")
    return prog


def guard_policy_text() -> str:
    """The ``/dsec/guard.policy`` file (format in the module docstring)."""
    lines = ["# generated by dsec.guest.guard from the container tier's policy; do not edit"]
    lines += [f"cap {n}" for n in sorted(CAPABILITIES.values())]
    lines += [f"rlimit {num} {soft} {hard}" for _, num, soft, hard in RLIMITS]
    lines += [f"mask {p}" for p in MASKED_PATHS]
    lines += [f"readonly {p}" for p in READONLY_PATHS]
    lines += [f"dev {d}" for d in GUARD_DEVICES]
    return "\n".join(lines) + "\n"


@cache
def guard_files() -> dict[str, bytes]:
    """The guard's initramfs files: path (no leading slash) -> contents."""
    return {
        "dsec/guard.policy": guard_policy_text().encode(),
        "dsec/guard.bpf": seccomp_bpf(),
    }
