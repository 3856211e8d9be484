"""Evidence of cheating on the fncall tier (root): a ``dsec serve`` with the fncall tier; each
test makes a sandbox attempt one thing its worker's seccomp filter refuses and finds exactly
that record in ``sb.audit()``. The worker was forked before its sandbox existed: its records
carry the worker's own audit id, which the edge maps to the sandbox that claimed it."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.integration.test_audit_root import _wait_for

import dsec.errors as E
from dsec import Sandbox
from dsec.privileged.landlock import landlock_abi
from dsec.server import BackgroundServer

pytestmark = [
    pytest.mark.root,
    pytest.mark.debian,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, cgroups, audit)"),
]

PTRACE_AND_LINGER = (
    "import ctypes, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall(101, 0, 0, 0, 0)\n"  # ptrace(PTRACE_TRACEME): refused by the filter
    "time.sleep(2)\n"
)
"""Tries ptrace once, then stays: its record can name its pid and command line."""


@pytest.fixture(scope="module")
def server(shared_layers: Path) -> Iterator[BackgroundServer]:
    home = Path(f"/tmp/dsec-audit-fncall-{os.getpid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    (home / "layers").symlink_to(shared_layers, target_is_directory=True)
    try:
        with BackgroundServer(home, tiers=["fncall"]) as srv:
            yield srv
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _create(server: BackgroundServer) -> Sandbox:
    return Sandbox.create(tier="fncall", image="debian", url=server.url, api_key=server.api_key)


def test_clean_fncall_sandbox_has_no_evidence(server: BackgroundServer) -> None:
    with _create(server) as sb:
        assert sb.commands.run("echo hi; ls / > /dev/null; python3 -c 'import subprocess'").ok
        rep = sb.audit()
        assert rep.enabled and not rep.evidence and rep.total == 0, rep
        assert rep.sources["syscall"], rep.sources


def test_fncall_refused_syscalls_are_recorded(server: BackgroundServer) -> None:
    with _create(server) as sb, _create(server) as neighbour:
        assert sb.commands.run("echo before").ok
        assert sb.commands.run("unshare -n true").exit_code != 0
        rep = _wait_for(sb, "syscall.unshare")
        assert rep.evidence
        assert {k for k in rep.counts if k.startswith("syscall.")} == {"syscall.unshare"}, rep
        entry = next(e for e in rep.entries if e.kind == "unshare")
        assert entry.category == "syscall" and "seccomp" in entry.detail
        assert entry.comm == "unshare" and entry.exe == "/usr/bin/unshare"
        assert entry.seq == 2  # after the call that tried

        # a process still running: its pid inside the worker and its command line
        sb.files.write("/work/linger.py", PTRACE_AND_LINGER.encode())
        assert sb.commands.run(["python3", "/work/linger.py"]).ok
        rep = _wait_for(sb, "syscall.ptrace")
        ptrace = next(e for e in rep.entries if e.kind == "ptrace")
        assert ptrace.comm == "python3" and ptrace.pid is not None and ptrace.pid > 1
        assert ptrace.cmdline == "python3 /work/linger.py"

        # a socket family the filter refuses (AF_PACKET)
        code = "import socket\ntry:\n socket.socket(17, 3, 0)\nexcept OSError as e: print(e.errno)"
        assert sb.commands.run(["python3", "-c", code]).stdout.strip() == "97"
        assert _wait_for(sb, "syscall.socket").counts["syscall.socket"] == 1

        # the neighbour's record is clean, and another key does not see the audit at all
        assert neighbour.audit().total == 0
        other = server.keys.create_key("audit-fncall-other")
        with pytest.raises(E.SandboxNotFound):
            Sandbox.connect(sb.id, url=server.url, api_key=other).audit()


@pytest.mark.skipif(landlock_abi() < 7, reason="Landlock's audit records need Linux 6.15+")
def test_fncall_landlock_refusal_is_recorded(server: BackgroundServer) -> None:
    """A device node made in the scratch (the worker's Landlock domain allows making none,
    before the capability check would refuse it): the kernel's Landlock record names the
    worker's domain, whose maker (the agent) names the sandbox."""
    with _create(server) as sb:
        code = (
            "import os, stat\n"
            "try:\n os.mknod('/tmp/evidence', stat.S_IFCHR | 0o600, os.makedev(1, 3))\n"
            "except OSError as e: print(e.errno)"
        )
        assert sb.commands.run(["python3", "-c", code]).stdout.strip() == "13"  # EACCES
        rep = _wait_for(sb, "landlock.fs.make_char")
        assert rep.sources["landlock"], rep.sources
        assert rep.evidence and rep.counts == {"landlock.fs.make_char": 1}, rep.counts
        (entry,) = rep.entries
        assert entry.category == "landlock" and "path=/tmp" in entry.detail, entry  # its directory


RED_TEAM = """\
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.syscall(321, 0, 0, 0)                       # bpf
libc.syscall(250, 0, 0, 0, 0, 0)                 # keyctl
libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0)
libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)    # clone(CLONE_NEWUSER)
libc.syscall(435, 0, 0)                          # clone3: the libc fallback, no evidence
libc.syscall(246, 0, 0, 0, 0)                    # kexec_load
libc.syscall(175, 0, 0, 0)                       # init_module
libc.syscall(425, 1, 0)                          # io_uring_setup
libc.syscall(298, 0, 0, -1, -1, 0)               # perf_event_open
libc.ioctl(0, 0x5412, b'x')                      # TIOCSTI
a = os.open('/work/a', os.O_CREAT | os.O_RDWR)
b = os.open('/work/b', os.O_CREAT | os.O_RDWR)
libc.ioctl(b, 0x40049409, a)                     # FICLONE
libc.ioctl(a, 0xC0C0586D, 0)                     # XFS_IOC_SWAPEXT
for family in (17, 40):                          # AF_PACKET, AF_VSOCK
    try:
        socket.socket(family, socket.SOCK_RAW if family == 17 else socket.SOCK_STREAM)
    except OSError:
        pass
libc.sethostname(b'x', 1)
try:
    os.mknod('/work/dev', 0o20666, os.makedev(1, 3))  # Landlock: never MAKE_CHAR
except OSError:
    pass
print('done')
"""
"""The seccomp and Landlock attempts of ``tests/security/test_fncall_escape.py``, in one
program: each refused one must leave its evidence."""


def test_fncall_red_team_attempts_each_leave_evidence(server: BackgroundServer) -> None:
    with _create(server) as sb:
        sb.files.write("/work/red_team.py", RED_TEAM.encode())
        assert sb.commands.run(["python3", "/work/red_team.py"]).stdout == "done\n"
        expected = {
            f"syscall.{name}": 1
            for name in (
                "bpf", "keyctl", "setns", "clone", "kexec_load", "init_module",
                "io_uring_setup", "perf_event_open", "sethostname",
            )
        }  # fmt: skip
        expected |= {"syscall.ioctl": 3, "syscall.socket": 2}
        if landlock_abi() >= 7:
            expected["landlock.fs.make_char"] = 1
        rep = _wait_for(sb, "syscall.sethostname")
        deadline = time.monotonic() + 10
        while rep.counts != expected and time.monotonic() < deadline:
            time.sleep(0.05)
            rep = sb.audit()
        assert rep.counts == expected, rep.counts
        assert all(e.comm == "python3" for e in rep.entries if e.category == "syscall")
