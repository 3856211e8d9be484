"""The isolation policy: what a sandbox's processes may not do, on every tier that runs them.

One policy, enforced by three programs: the OCI runtime (crun/runc) for a container's PID 1
and everything it forks, ``dsec_execd`` for every command of the container tier's exec
server (both rendered by :mod:`dsec.runtimes.container.bundle` and
:mod:`dsec.runtimes.container.seccomp`), and the VM tiers' in-guest guard
(:mod:`dsec.guest.guard`). It sits at the bottom with the rest of the contract: nothing here
imports a tier, the edge or the server.

Seccomp. The policy is *default allow + deny list*: everything a normal Linux program
does keeps working; what containers never need, and what DSec saw agents abuse,
fails with ``EPERM`` (``ENOSYS`` for ``clone3``, so libc falls back to
``clone``, whose namespace flags *can* be inspected).

Denied, and why:
    * mount API (``mount``, ``umount2``, ``pivot_root``, ``fsopen``...,
      ``open_tree``, ``move_mount``, ``mount_setattr``): the rootfs is assembled
      by the edge; nothing inside may reshape it.
    * namespaces (``unshare``, ``setns``, ``clone``/``clone3`` with ``CLONE_NEW*``):
      no nested sandboxes or user-namespace tricks (a large kernel attack surface).
    * debugging other processes (``ptrace``, ``process_vm_readv/writev``, ``kcmp``,
      ``pidfd_getfd``).
    * kernel and node state (``kexec_*``, ``*_module``, ``reboot``, ``swapon/off``,
      ``acct``, ``quotactl*``, clock setting, ``syslog``, ``iopl``/``ioperm``...).
    * big attack surfaces rarely needed by workloads (``bpf``, ``perf_event_open``,
      ``userfaultfd``, ``io_uring_*``, ``keyctl``/``add_key``/``request_key``,
      ``open_by_handle_at``/``name_to_handle_at``, ``lookup_dcookie``).
    * ``ioctl`` requests that corrupt or reach across files and terminals:
      ``XFS_IOC_SWAPEXT`` (seen corrupting a filesystem), ``FICLONE``,
      ``FICLONERANGE``, ``FIDEDUPERANGE`` (share extents with other files),
      ``TIOCSTI`` (inject keystrokes into a terminal), ``TIOCLINUX``.
    * ``AF_VSOCK`` sockets (``EAFNOSUPPORT``): vsock is not separated by network
      namespaces, so inside a VM node (Firecracker, QEMU) a container could reach
      the hypervisor host's vsock services past every network rule.
    * ``socketcall`` (32-bit programs): it multiplexes every socket call with its
      arguments in memory, where the filter cannot see the family; 32-bit programs
      of any current libc call ``socket`` and friends directly.

``ioctl`` request numbers are 32-bit in the kernel, but a caller may pass them
sign-extended in a 64-bit register; the rules therefore compare the low 32 bits
only (``SCMP_CMP_MASKED_EQ`` with mask ``0xFFFFFFFF``).

Capabilities: Docker's default set minus ``NET_RAW`` (raw sockets: packet
spoofing, port scans; sandboxes have no network anyway), ``MKNOD`` (a device
node in the upper layer would be opened by host-side file operations; the
device cgroup denies device access inside anyway), ``AUDIT_WRITE`` (no auditd in
a sandbox) and ``SETFCAP`` (file capabilities are only a way to smuggle
privileges). Kept: ``CHOWN``, ``DAC_OVERRIDE``, ``FOWNER``, ``FSETID``, ``KILL``,
``SETGID``, ``SETUID``, ``SETPCAP``, ``NET_BIND_SERVICE``, ``SYS_CHROOT``: what
package managers, build tools and test suites run as root need.
"""

from __future__ import annotations

import errno
import resource
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ARCHITECTURES",
    "CAPABILITIES",
    "CLONE_NAMESPACE_FLAGS",
    "DENIED_IOCTLS",
    "DENIED_SOCKET_FAMILIES",
    "DENIED_SYSCALLS",
    "MASKED_PATHS",
    "READONLY_PATHS",
    "RLIMITS",
    "RULES",
    "SeccompRule",
]

# Architectures whose syscalls the filter understands; anything else is killed.
ARCHITECTURES: tuple[str, ...] = ("x86_64", "x86", "x32")

DENIED_SYSCALLS: tuple[str, ...] = (
    # mount API
    "mount", "umount", "umount2", "pivot_root", "fsopen", "fsconfig", "fsmount", "fspick",
    "open_tree", "move_mount", "mount_setattr",
    # namespaces
    "unshare", "setns",
    # other processes
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # kernel and node state
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "create_module", "query_module", "get_kernel_syms", "reboot", "swapon", "swapoff",
    "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "stime", "syslog", "iopl", "ioperm", "uselib", "vhangup", "nfsservctl",
    "_sysctl", "sysfs", "vm86", "vm86old", "lookup_dcookie",
    # big attack surfaces
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init",
    # socket calls whose address family the filter could not inspect (see AF_VSOCK)
    "socketcall",
)  # fmt: skip

# address families refused by socket(2) and socketpair(2)
DENIED_SOCKET_FAMILIES: dict[str, int] = {"AF_VSOCK": 40}

# ioctl request numbers (the kernel's 32-bit values).
DENIED_IOCTLS: dict[str, int] = {
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "FICLONE": 0x40049409,
    "FICLONERANGE": 0x4020940D,
    "FIDEDUPERANGE": 0xC0189436,
    "TIOCSTI": 0x5412,
    "TIOCLINUX": 0x541C,
}

# clone(2) flags that create namespaces: each one set is refused.
CLONE_NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWTIME": 0x00000080,
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SeccompRule:
    """One deny rule: ``syscall`` fails with ``errno`` (when ``arg`` matches, if given).

    ``arg`` is ``(index, op, a, b)``: ``op == "eq"`` matches ``arg == a``;
    ``op == "masked_eq"`` matches ``(arg & a) == b``.
    """

    syscall: str
    errno: int = errno.EPERM
    arg: tuple[int, Literal["eq", "masked_eq"], int, int] | None = None
    why: str = ""


def _build_rules() -> tuple[SeccompRule, ...]:
    rules = [SeccompRule(name) for name in DENIED_SYSCALLS]
    rules.append(SeccompRule("clone3", errno.ENOSYS, why="flags not inspectable; libc falls back"))
    for flag_name, flag in CLONE_NAMESPACE_FLAGS.items():
        rules.append(SeccompRule("clone", arg=(0, "masked_eq", flag, flag), why=flag_name))
    for ioctl_name, request in DENIED_IOCTLS.items():
        rules.append(SeccompRule("ioctl", arg=(1, "masked_eq", _MASK32, request), why=ioctl_name))
    for family_name, family in DENIED_SOCKET_FAMILIES.items():
        for call in ("socket", "socketpair"):
            rules.append(
                SeccompRule(
                    call,
                    errno.EAFNOSUPPORT,
                    arg=(0, "masked_eq", _MASK32, family),
                    why=family_name,
                )
            )
    return tuple(rules)


RULES: tuple[SeccompRule, ...] = _build_rules()


# name -> number (linux/capability.h)
CAPABILITIES: dict[str, int] = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_FSETID": 4,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_SETPCAP": 8,
    "CAP_NET_BIND_SERVICE": 10,
    "CAP_SYS_CHROOT": 18,
}

# (OCI name, resource number, soft, hard). -1 = unlimited.
RLIMITS: tuple[tuple[str, int, int, int], ...] = (
    ("RLIMIT_NOFILE", resource.RLIMIT_NOFILE, 4096, 16384),
    ("RLIMIT_CORE", resource.RLIMIT_CORE, 0, 0),  # no core dumps filling the upper layer
    ("RLIMIT_MSGQUEUE", resource.RLIMIT_MSGQUEUE, 819200, 819200),
)

MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/sysrq-trigger",
    "/proc/kmsg",
    "/proc/vmallocinfo",
    "/proc/pagetypeinfo",
    "/proc/slabinfo",
    "/proc/interrupts",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/sys/kernel/debug",
    "/sys/kernel/tracing",
)


READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
)
"""Never a masked path too: a read-only rebind on top of a mask (crun binds ``/dev/null``
there from the node's ``/dev``) propagated to the host's ``/dev/null`` and to every other
container's masks on hosts whose ``/dev`` is shared (systemd), doubling the mount table with
each container (:mod:`dsec.privileged.mountns`)."""
