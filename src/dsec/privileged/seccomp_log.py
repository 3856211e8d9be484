"""The kernel's reports of system calls a seccomp filter refused, read by the edge.

A filter installed with ``SECCOMP_FILTER_FLAG_LOG`` (``dsec_execd``'s ``log`` argument)
makes the kernel emit one audit record of type 1326 (``AUDIT_SECCOMP``) for every call it
refuses (``/proc/sys/kernel/seccomp/actions_logged`` must name ``errno``, the default)::

    audit(1796641434.782:1): auid=1234567 uid=0 gid=0 ses=1 pid=15452 comm="python3"
    exe="/usr/bin/python3.11" sig=0 arch=c000003e syscall=101 compat=0 ip=0x... code=0x50001

``auid`` is the loginuid ``dsec_execd`` set for the sandbox (``auid=N``), inherited by every
command it starts and unchangeable without ``CAP_AUDIT_CONTROL`` (never kept): the record
names its sandbox even when the process is gone. ``pid`` is the node's pid; the pid inside
the sandbox and the command line are read from ``/proc`` while the process still runs.

Where the records are read: the audit netlink socket's multicast group
``AUDIT_NLGRP_READLOG``, a read-only listener (``CAP_AUDIT_READ``) that needs no auditd and
does not replace one; the kernel audit subsystem need not be enabled. The kernel log also
gets them without auditd, but rate-limited by printk (10 per 5 s for the whole node): not
used.

What can be lost, and how it shows: the kernel drops records past its backlog
(``audit_backlog_limit``, 64 by default on a node without auditd; kauditd drains the
queue at once, so only a burst of thousands in a few milliseconds loses some) and counts
them in ``/proc``-visible ``audit_lost``; a full receive buffer here (4 MiB) loses records
too, counted in :attr:`SeccompRecords.overruns`. A flooding process pays for its records
itself (the kernel formats them in its context).

Cost: nothing for the calls a filter allows (the flag is only read when a call is refused);
the listener sleeps until a record comes.

Landlock's refusals (Linux 6.15+, Landlock ABI 7) come on the same socket as records of
type 1423 (``AUDIT_LANDLOCK_ACCESS``: the domain's id and what it refused, no process) and,
at a domain's first refusal, 1424 (``AUDIT_LANDLOCK_DOMAIN``: the node pid of the process
that made the domain). Unlike seccomp's, they come only while the kernel's audit is
*enabled*: :func:`enable_kernel_audit` enables it, after a ``never,task`` rule so that no
process pays for system-call auditing (what auditd's default rules do too).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import logging
import os
import re
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from dsec.config import env_choice

__all__ = [
    "GUARD_OTHER_NR",
    "GuardLog",
    "LandlockDenial",
    "SeccompDenial",
    "SeccompRecords",
    "audit_id_of",
    "audit_on",
    "enable_kernel_audit",
    "kernel_audit_enabled",
    "parse_guard_log",
    "parse_landlock",
    "parse_record",
    "process_facts",
    "syscall_name",
]

log = logging.getLogger("dsec.audit")

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_SECCOMP = 1326
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424
_AUDIT_GET, _AUDIT_SET, _AUDIT_ADD_RULE = 1000, 1001, 1011
_NLMSG_ERROR = 2
_RCVBUF_BYTES = 4 << 20
_BATCH = 1024  # records read per wake-up at most (the loop gets control back between)
_NO_AUID = 4294967295


def audit_on() -> bool:
    """``DSEC_AUDIT`` (``on``, the default, or ``off``): does the node record refusals."""
    return env_choice("DSEC_AUDIT", ("on", "off")) == "on"


def audit_id_of(sandbox_id: str) -> int:
    """The loginuid of a sandbox's processes: 2^30 + 30 bits of a hash of its id (far above
    any real user's uid, never the unset value)."""
    h = int.from_bytes(hashlib.sha256(sandbox_id.encode()).digest()[:4], "big")
    return (1 << 30) | (h & ((1 << 30) - 1))


@dataclass(frozen=True)
class SeccompDenial:
    """Refusals of one system call to processes of one audit id, read in one batch:
    ``count`` of them, the first one's time (the kernel's coarse clock: Unix seconds, to a
    tick) and process (node pid, name, executable)."""

    auid: int
    ts: float
    syscall: int
    arch: int
    errno: int
    pid: int
    comm: str
    exe: str
    count: int = 1


_FIELD = re.compile(rb'(\w+)=("[^"]*"|\S+)')
_STAMP = re.compile(rb"audit\((\d+\.\d+):\d+\)")


def _text(raw: bytes) -> str:
    """A field value: quoted text, or hex (the kernel's form for odd characters)."""
    if raw.startswith(b'"'):
        return raw[1:-1].decode(errors="replace")
    try:
        return bytes.fromhex(raw.decode()).decode(errors="replace")
    except ValueError:
        return raw.decode(errors="replace")


def parse_record(payload: bytes) -> SeccompDenial | None:
    """One type-1326 record's text (``audit(...): auid=... syscall=...``), or None when it
    is not one of a filter's refusals."""
    fields = dict(_FIELD.findall(payload))
    try:
        code = int(fields.get(b"code", b"0"), 16)
        stamp = _STAMP.search(payload)
        return SeccompDenial(
            auid=int(fields[b"auid"]),
            ts=float(stamp.group(1)) if stamp else time.time(),
            syscall=int(fields[b"syscall"]),
            arch=int(fields.get(b"arch", b"0"), 16),
            errno=code & 0xFFFF if code & 0x7FFF0000 == 0x00050000 else 0,
            pid=int(fields[b"pid"]),
            comm=_text(fields.get(b"comm", b'""')),
            exe=_text(fields.get(b"exe", b'""')),
        )
    except (KeyError, ValueError):
        return None


GUARD_OTHER_NR = 1024
"""The guest agent's count slot for refusals of any other architecture (or number)."""


@dataclass(frozen=True)
class GuardLog:
    """What a VM's guest agent kept of its guard's seccomp refusals (``agent.c``, "the
    guard's refusals"; the guest kernel's own type-1326 records), as the host reads it:
    ``counts`` the exact number per x86-64 system call number since the sandbox began
    (:data:`GUARD_OTHER_NR`: other architectures), ``records`` the kept records numbered
    above the ``after`` asked for, with their numbers, ``next`` the next record's number and
    ``lost`` the times the agent's receive buffer overflowed. Pids are the guest's."""

    next: int
    total: int
    lost: int
    counts: dict[int, int]
    records: list[tuple[int, SeccompDenial]]


def parse_guard_log(args: list[bytes]) -> GuardLog:
    """The guest agent's answer to ``AUDIT`` (three args: ``"next total lost"``, the counts
    ``"nr=count ..."`` and the records, one ``"seq text"`` a line). Raises ValueError when
    it is not one."""
    if len(args) < 3:
        raise ValueError("the guest agent's audit answer has fewer than 3 parts")
    head = args[0].split()
    if len(head) < 3:
        raise ValueError(f"bad audit header {args[0][:80]!r}")
    counts: dict[int, int] = {}
    for item in args[1].split():
        nr, _, n = item.partition(b"=")
        counts[int(nr)] = int(n)
    records: list[tuple[int, SeccompDenial]] = []
    for line in args[2].splitlines():
        seq, _, text = line.partition(b" ")
        rec = parse_record(text)
        if seq.isdigit() and rec is not None:
            records.append((int(seq), rec))
    return GuardLog(int(head[0]), int(head[1]), int(head[2]), counts, records)


@dataclass(frozen=True)
class LandlockDenial:
    """One Landlock record: a refusal (``kind`` ``access``: ``blockers`` such as
    ``fs.write_file``, ``object`` the path or target) or a domain's first appearance
    (``domain``: ``pid`` the node pid of the process that made it). Domains are the
    kernel's 64-bit ids."""

    kind: str
    domain: int
    ts: float
    blockers: str = ""
    object: str = ""
    pid: int = 0


def parse_landlock(kind: int, payload: bytes) -> LandlockDenial | None:
    """A type-1423 or 1424 record's text, or None when it is not one we use (a domain's
    deallocation)."""
    fields = dict(_FIELD.findall(payload))
    stamp = _STAMP.search(payload)
    ts = float(stamp.group(1)) if stamp else time.time()
    try:
        domain = int(fields[b"domain"], 16)
        if kind == AUDIT_LANDLOCK_ACCESS:
            what = [
                f"{k.decode()}={_text(fields[k])}"
                for k in (b"path", b"name", b"opid", b"ocomm", b"daddr", b"dest", b"lport")
                if k in fields
            ]
            return LandlockDenial("access", domain, ts, _text(fields[b"blockers"]), " ".join(what))
        if kind == AUDIT_LANDLOCK_DOMAIN and fields.get(b"status") == b"allocated":
            return LandlockDenial("domain", domain, ts, pid=int(fields[b"pid"]))
    except (KeyError, ValueError):
        pass
    return None


def _audit_request(kind: int, body: bytes) -> int:
    """One request to the kernel's audit (root): 0 or the errno it answered."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT)
    try:
        sock.bind((0, 0))
        sock.settimeout(2.0)
        sock.send(struct.pack("=IHHII", 16 + len(body), kind, 1 | 4, 1, 0) + body)  # REQUEST|ACK
        for _ in range(4):
            data = sock.recv(65536)
            if struct.unpack_from("=H", data, 4)[0] == _NLMSG_ERROR:
                return -struct.unpack_from("=i", data, 16)[0]
        return 0
    finally:
        sock.close()


def kernel_audit_enabled() -> bool | None:
    """Is the kernel's audit enabled (None: it cannot be asked)."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT)
    except OSError:
        return None
    try:
        sock.bind((0, 0))
        sock.settimeout(2.0)
        sock.send(struct.pack("=IHHII", 16, _AUDIT_GET, 1, 1, 0))
        data = sock.recv(65536)
        if struct.unpack_from("=H", data, 4)[0] != _AUDIT_GET:
            return None
        return struct.unpack_from("=I", data, 20)[0] != 0  # struct audit_status.enabled
    except OSError:
        return None
    finally:
        sock.close()


def enable_kernel_audit() -> str | None:
    """Enable the kernel's audit (needed for Landlock's records), first adding a
    ``never,task`` rule: no task gets a system-call audit context, so no process pays for
    auditing. A node where it is enabled already (auditd) is left as it is. Returns why it
    is not enabled (None: it is). It stays enabled after the edge stops (other edges of the
    node may rely on it; disable it with ``auditctl -e 0``)."""
    state = kernel_audit_enabled()
    if state is None:
        return "the kernel's audit cannot be asked (no CONFIG_AUDIT or no CAP_AUDIT_CONTROL)"
    if state:
        return None
    # struct audit_rule_data: flags (AUDIT_FILTER_TASK), action (AUDIT_NEVER), no fields
    rule = struct.pack("=III", 1, 0, 0) + bytes(4 * 64 * 4) + struct.pack("=I", 0)
    err = _audit_request(_AUDIT_ADD_RULE, rule)
    if err not in (0, errno.EEXIST):
        return f"cannot add the never,task audit rule: {os.strerror(err)}"
    err = _audit_request(_AUDIT_SET, struct.pack("=10I", 1, 1, 0, 0, 0, 0, 0, 0, 0, 0))
    return f"cannot enable the kernel's audit: {os.strerror(err)}" if err else None


_names: dict[tuple[int, int], str] = {}
_libseccomp: list[ctypes.CDLL | None] = []  # loaded on first use: [library or None]


def _resolver() -> ctypes.CDLL | None:
    if not _libseccomp:
        found = ctypes.util.find_library("seccomp")
        lib = ctypes.CDLL(found) if found else None
        if lib is not None:
            fn = lib.seccomp_syscall_resolve_num_arch
            fn.restype = ctypes.c_void_p
            fn.argtypes = [ctypes.c_uint32, ctypes.c_int]
        _libseccomp.append(lib)
    return _libseccomp[0]


def syscall_name(arch: int, nr: int) -> str:
    """The name of system call ``nr`` of audit architecture ``arch`` (libseccomp's table;
    ``syscall_<nr>`` without it)."""
    key = (arch, nr)
    if key in _names:
        return _names[key]
    name = f"syscall_{nr}"
    lib = _resolver()
    if lib is not None:
        ptr = lib.seccomp_syscall_resolve_num_arch(arch, nr)
        if ptr:
            name = ctypes.string_at(ptr).decode()
            ctypes.CDLL(None).free(ctypes.c_void_p(ptr))
    if len(_names) < 4096:
        _names[key] = name
    return name


def process_facts(pid: int, auid: int) -> tuple[int | None, str | None]:
    """``(pid inside its sandbox, command line)`` of node process ``pid`` if it still runs
    and still carries ``auid`` (a reused pid is not taken for it); ``(None, None)`` else."""
    try:
        with open(f"/proc/{pid}/loginuid", "rb") as f:
            if int(f.read() or b"-1") != auid:
                return None, None
        with open(f"/proc/{pid}/status", "rb") as f:
            inner: int | None = None
            for line in f:
                if line.startswith(b"NSpid:"):
                    inner = int(line.split()[-1])
                    break
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).rstrip(b"\0").split(b"\0")
        cmdline = " ".join(a.decode(errors="replace") for a in argv if a) or None
        return inner, cmdline
    except (OSError, ValueError):
        return None, None


class SeccompRecords:
    """Listens to the kernel's seccomp records on the audit multicast group and hands them,
    grouped per batch by ``(auid, syscall)``, to ``deliver`` on the event loop."""

    def __init__(
        self,
        deliver: Callable[[list[SeccompDenial]], None],
        deliver_landlock: Callable[[list[LandlockDenial]], None] | None = None,
    ) -> None:
        self._deliver = deliver
        self._deliver_landlock = deliver_landlock
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.records = 0
        """Records read."""
        self.overruns = 0
        """Times the receive buffer overflowed (records were lost; how many is not known)."""

    def start(self) -> str | None:
        """Start listening; returns why it cannot (None: listening)."""
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT)
        except OSError as e:
            return f"no audit netlink socket: {e.strerror}"
        try:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, 33, _RCVBUF_BYTES)  # SO_RCVBUFFORCE
            sock.bind((0, AUDIT_NLGRP_READLOG))
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            return f"cannot join the audit log group (CAP_AUDIT_READ?): {e.strerror}"
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._on_readable)
        return None

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None

    def _on_readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        grouped: dict[tuple[int, int], SeccompDenial] = {}
        landlock: list[LandlockDenial] = []
        for _ in range(_BATCH):
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.overruns += 1
                    continue
                log.warning("audit socket: %s", e)
                break
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if length < 16:
                    break
                if kind == AUDIT_SECCOMP:
                    self.records += 1
                    rec = parse_record(data[off + 16 : off + length].rstrip(b"\0"))
                    if rec is not None and rec.auid != _NO_AUID:
                        key = (rec.auid, rec.syscall)
                        had = grouped.get(key)
                        grouped[key] = rec if had is None else replace(had, count=had.count + 1)
                elif (
                    kind in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN) and len(landlock) < 4096
                ):
                    ll = parse_landlock(kind, data[off + 16 : off + length].rstrip(b"\0"))
                    if ll is not None:
                        landlock.append(ll)
                off += (length + 3) & ~3
        if landlock and self._deliver_landlock is not None:
            try:
                self._deliver_landlock(landlock)
            except Exception:
                log.exception("delivering Landlock records failed")
        if grouped:
            try:
                self._deliver(list(grouped.values()))
            except Exception:
                log.exception("delivering seccomp records failed")
