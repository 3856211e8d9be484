"""The contract every cgroup driver keeps: one sandbox's (or worker's) cgroup, whatever the
host's layout.

A :class:`Cgroup` is named by ``rel``, a path relative to the subtree dsec owns (see
:class:`~dsec.privileged.cgroups.layout.CgroupLayout`); a driver turns it into one directory
(v2, the unified hierarchy) or one per controller (v1). Callers never build a controller path
themselves: limits, usage, freezing, killing and removal go through these methods, and code
that must write cgroup files by descriptor (the fncall zygote makes worker cgroups with
``mkdirat``) asks :meth:`Cgroup.limit_writes` which files to write.

Units are in each method's name: bytes, cores, nanoseconds. The CPU *shares* of
:meth:`Cgroup.set_cpu_shares` are v1's ``cpu.shares`` scale (2 to 262144, 1024 = one core's
worth); the v2 driver maps them onto ``cpu.weight`` (1 to 10000) the way systemd and runc do.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

__all__ = [
    "Cgroup",
    "CgroupUsage",
    "LimitWrite",
    "MemoryCharge",
    "parse_flat_keyed",
    "shares_to_weight",
    "weight_to_shares",
]

NO_LIMIT_V1 = 1 << 60
"""A v1 memory limit at or above this is "no limit" (the kernel reports ~2^63 rounded to pages)."""


@dataclass(frozen=True)
class CgroupUsage:
    """What one cgroup has charged. ``memory_limit_bytes`` None: unlimited; ``cpu_usage_ns``
    None: the cgroup is not in a CPU accounting hierarchy (v1 without ``cpuacct``)."""

    cpu_usage_ns: int | None
    memory_used_bytes: int
    memory_cache_bytes: int
    memory_limit_bytes: int | None
    memory_peak_bytes: int | None
    pids: int | None
    version: int


@dataclass(frozen=True)
class MemoryCharge:
    """A cgroup's memory by kind, bytes, the same on both layouts: ``usage`` all charged,
    ``cache`` page cache (tmpfs included), ``rss`` anonymous, ``shmem`` shared memory and
    tmpfs, ``mapped_file`` mapped page cache, ``swap`` swapped out."""

    usage: int
    cache: int
    rss: int
    shmem: int
    mapped_file: int
    swap: int

    def mib(self) -> dict[str, float]:
        """The same numbers in MiB, rounded to 0.1, for logs and tables."""
        return {k: round(v / (1 << 20), 1) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class LimitWrite:
    """One file write that sets a limit: ``file`` in the cgroup's directory of hierarchy
    ``hierarchy`` (a v1 controller name, or ``""`` for the v2 unified hierarchy)."""

    hierarchy: str
    file: str
    value: str


def parse_flat_keyed(text: str) -> dict[str, int]:
    """``key value`` lines (``memory.stat``, ``cpu.stat``, ``memory.events``) as a dict;
    lines that are not two fields of which the second an integer are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            with contextlib.suppress(ValueError):
                out[parts[0]] = int(parts[1])
    return out


def shares_to_weight(shares: int) -> int:
    """v1 ``cpu.shares`` (2 to 262144) to v2 ``cpu.weight`` (1 to 10000), as runc and systemd map
    them: 2 → 1, 1024 → 39, 262144 → 10000."""
    shares = min(max(shares, 2), 262144)
    return 1 + ((shares - 2) * 9999) // 262142


def weight_to_shares(weight: int) -> int:
    """The least v1 ``cpu.shares`` that :func:`shares_to_weight` maps onto ``weight``:
    1 → 2, 39 → 999, 10000 → 262144 (the mapping is many-to-one; this is its inverse on
    weights)."""
    weight = min(max(weight, 1), 10000)
    return 2 + -(-(weight - 1) * 262142 // 9999)


def int_or_none(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def rmdir_waiting(path: Path, timeout_s: float) -> None:
    """Remove an (empty) cgroup directory, waiting out EBUSY while its last processes exit.
    Missing is fine."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return
        except OSError as e:
            if e.errno == errno.ENOENT:
                return
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class Cgroup(ABC):
    """One cgroup at ``rel`` below dsec's subtree. Cheap to construct: nothing is touched
    until a method is called."""

    version: ClassVar[int]
    PROCS_FILE: ClassVar[str] = "cgroup.procs"
    """The file in each of :meth:`dirs` a pid is written to to move that process in (a
    process writes ``0`` for itself)."""
    PIDS_HIERARCHY: ClassVar[str]
    """The hierarchy (a key of :meth:`dirs`) that holds ``pids.max``."""

    def __init__(self, rel: str, root: Path) -> None:
        self.rel = rel.strip("/")
        self.root = root
        """The directory ``rel`` is relative to: v1, the mount of all hierarchies
        (``/sys/fs/cgroup``); v2, dsec's base cgroup's directory."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.rel!r})"

    # --- where it is ---------------------------------------------------------------------
    @abstractmethod
    def dirs(self) -> dict[str, Path]:
        """The cgroup's directory in each hierarchy dsec uses (hierarchy name -> path)."""

    @abstractmethod
    def every_dir(self) -> list[Path]:
        """Every directory the cgroup may have, including hierarchies dsec does not use but
        an OCI runtime populates (v1 crun makes ``net_cls``, ``devices``, ...): what removal
        and labelling cover."""

    @abstractmethod
    def oci_path(self) -> str:
        """The cgroup as an OCI ``linux.cgroupsPath`` (absolute in the hierarchy)."""

    def child(self, name: str) -> Cgroup:
        return type(self)(f"{self.rel}/{name}", self.root)

    @abstractmethod
    def exists(self) -> bool: ...

    def procs_files(self) -> list[Path]:
        """The :data:`PROCS_FILE` of every hierarchy of :meth:`dirs`: what a launcher that
        joins the cgroup itself before ``exec`` writes its pid to."""
        return [d / self.PROCS_FILE for d in self.dirs().values()]

    def children(self) -> list[str]:
        """Names of the child cgroups (from the first hierarchy)."""
        for d in self.dirs().values():
            try:
                return sorted(p.name for p in d.iterdir() if p.is_dir())
            except OSError:
                return []
        return []

    # --- life ----------------------------------------------------------------------------
    @abstractmethod
    def create(self) -> None:
        """Make the cgroup (and missing parents) with the controllers dsec uses."""

    def enable_child_controllers(self) -> None:
        """Let child cgroups made without this driver (``mkdirat`` on a descriptor of one of
        :meth:`dirs`, as the fncall zygote makes its workers) have the controllers dsec uses.
        v2: enables them in this cgroup's ``cgroup.subtree_control`` (it may then hold no
        process: the no-internal-processes rule); v1: nothing to do (every hierarchy's
        children have its controller)."""
        return None

    @abstractmethod
    def attach(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the cgroup."""

    @abstractmethod
    def procs(self) -> list[int]:
        """The processes directly in the cgroup (not its children's)."""

    def populated(self) -> bool:
        """Whether any process is in the cgroup or below it."""
        return bool(self.procs())

    def procs_below(self) -> list[int]:
        """The processes in the cgroup and in every cgroup below it (from the pids
        hierarchy: a fncall worker's commands have pids cgroups of their own there)."""
        out: list[int] = []
        top = self.dirs().get(self.PIDS_HIERARCHY)
        if top is None:
            return out
        for d, _subdirs, _files in os.walk(top):
            try:
                with open(f"{d}/{self.PROCS_FILE}") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                continue
        return out

    @abstractmethod
    def _kill_signal(self) -> bool:
        """Send SIGKILL to every process in the cgroup and its descendants in one step where
        the kernel can (v2 ``cgroup.kill``); False when it cannot and pids must be
        signalled one by one."""

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until it is empty. A frozen cgroup is thawed
        after the signals are queued (frozen tasks only die once thawed; signalling first
        means no user code runs in between)."""
        if not self.exists():
            return
        deadline = time.monotonic() + timeout_s
        killed_at_once = False
        while True:
            if not killed_at_once:
                try:
                    killed_at_once = self._kill_signal()
                except OSError:
                    killed_at_once = False
            try:
                pids = self.procs()
                if not pids and not (killed_at_once and self.populated()):
                    return
            except OSError as e:  # removed meanwhile by another party (its files: ENODEV)
                if e.errno in (errno.ENOENT, errno.ENODEV):
                    return
                raise
            if not killed_at_once:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                if self.is_frozen():
                    self.thaw()
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.rel} still has processes {pids}")
            time.sleep(0.005)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left, then remove the cgroup, its children first (in any hierarchy:
        a fncall worker's command cgroups exist in the pids one only), from every hierarchy
        (idempotent)."""
        names: set[str] = set()
        for d in self.every_dir():
            # the entries' types from the directory listing itself: a stat of each of a
            # cgroup's ~30 files in 11 v1 hierarchies halved the rate of a job kill
            with contextlib.suppress(OSError), os.scandir(d) as entries:
                names.update(e.name for e in entries if e.is_dir(follow_symlinks=False))
        for name in sorted(names):
            self.child(name).remove(timeout_s)
        self.kill_all(timeout_s)
        for d in self.every_dir():
            rmdir_waiting(d, timeout_s)

    def remove_if_empty(self) -> bool:
        """Remove the cgroup from every hierarchy if nothing is in it (no process, no child
        cgroup: the kernel refuses the removal otherwise); never kills. For shared parents
        (an install's ``dsec-<hash>``, the OCI probe's) that others may still use. Returns
        whether it is gone."""
        gone = True
        for d in self.every_dir():
            try:
                d.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                gone = False
        return gone

    # --- limits --------------------------------------------------------------------------
    @abstractmethod
    def limit_writes(
        self,
        *,
        cpu: float | None = None,
        memory_bytes: int | None = None,
        pids: int | None = None,
        raising_memory: bool = True,
    ) -> list[LimitWrite]:
        """The writes, in order, that set the given limits (None: leave it). v1 writes the
        memory+swap limit beside the memory limit, raised first and lowered last, so
        ``raising_memory`` says which way the memory limit moves."""

    def nest_pids_writes(self) -> list[LimitWrite]:
        """The writes in this cgroup that give its child cgroups a ``pids.max`` of their own
        (v2: the pids controller in ``cgroup.subtree_control``, after which the cgroup may
        hold no process itself; v1: none, every child has it)."""
        return []

    def _dir_str(self, hierarchy: str) -> str:
        """The cgroup's directory in ``hierarchy`` as a string (the limit setters' paths:
        pathlib joins cost ~5-10 us each, a warm-pool claim makes several)."""
        return str(self.dirs()[hierarchy])

    def _apply(self, writes: list[LimitWrite]) -> None:
        # the flags of Path.write_text (a cgroup file system ignores O_CREAT and O_TRUNC on
        # its files; tests' plain-file stand-ins need them)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        for w in writes:
            fd = os.open(f"{self._dir_str(w.hierarchy)}/{w.file}", flags, 0o644)
            try:
                os.write(fd, w.value.encode())
            finally:
                os.close(fd)

    def set_cpu(self, cores: float) -> None:
        self._apply(self.limit_writes(cpu=cores))

    def set_memory(self, limit_bytes: int, *, raising: bool | None = None) -> None:
        """Set the memory limit. ``raising``: whether it goes up from the current limit, when
        the caller knows (saves reading the current limit); None: read it."""
        if raising is None:
            current = self.memory_limit()
            raising = current is not None and limit_bytes >= current
        self._apply(self.limit_writes(memory_bytes=limit_bytes, raising_memory=raising))

    def set_pids(self, max_pids: int) -> None:
        self._apply(self.limit_writes(pids=max_pids))

    def prefill_cpusets(self) -> None:
        """Make the cgroups below this one start with their parent's CPUs and memory nodes
        (v1 ``cpuset``: ``cgroup.clone_children``), so that an OCI runtime making a
        container's cgroup finds them set and does not write them: each such write in a
        v1 cpuset checks every sibling and rebuilds the scheduler domains, O(live
        sandboxes). v2 and hosts without a v1 cpuset hierarchy: nothing to do."""
        return None

    def accounts_swap(self) -> bool:
        """Whether a memory limit set here also bounds swap (v1 ``memory.memsw.*``, v2
        ``memory.swap.max``): what an OCI config's ``memory.swap`` needs. Ask an existing
        cgroup (v2 knows only from one that has the memory controller)."""
        return len(self.limit_writes(memory_bytes=1 << 30)) > 1

    @abstractmethod
    def set_cpu_shares(self, shares: int) -> None:
        """The cgroup's relative CPU weight in v1 ``cpu.shares`` units (2 to 262144)."""

    @abstractmethod
    def cpu_shares(self) -> int:
        """The cgroup's relative CPU weight in v1 ``cpu.shares`` units: v1 exactly; v2 the
        ``cpu.weight`` as :func:`weight_to_shares` (``set_cpu_shares(s)`` reads back as
        ``weight_to_shares(shares_to_weight(s))``)."""

    # --- reading -------------------------------------------------------------------------
    @abstractmethod
    def memory_limit(self) -> int | None:
        """The memory limit, bytes (None: no limit)."""

    @abstractmethod
    def memory_charge(self) -> MemoryCharge: ...

    @abstractmethod
    def usage(self) -> CgroupUsage:
        """Raises ``FileNotFoundError`` when the cgroup does not exist."""

    @abstractmethod
    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this cgroup (0 if it is gone)."""

    @abstractmethod
    def oom_kills_file(self) -> Path:
        """The file :meth:`oom_kills` parses (to open once and re-read cheaply)."""

    @staticmethod
    def parse_oom_kills(text: str) -> int:
        """The ``oom_kill`` count of ``memory.oom_control`` (v1) or ``memory.events`` (v2)."""
        return parse_flat_keyed(text).get("oom_kill", 0)

    @abstractmethod
    def memory_limit_hits(self) -> int:
        """Times a charge in this cgroup ran into its memory limit (v1 ``memory.failcnt``;
        v2 ``memory.events``' ``max`` plus ``oom``; 0 if it is gone). Counted before the
        kernel reclaims or kills, so it already shows when the OOM killer's own count, which
        the kernel adds after sending its SIGKILL, may not yet."""

    @abstractmethod
    def pids_max_events(self) -> int:
        """Forks the pids limit refused in this cgroup (``pids.events``' ``max``; 0 if it is
        gone or the kernel does not count them)."""

    @abstractmethod
    def cpu_usage_ns(self) -> int | None: ...

    # --- freezing ------------------------------------------------------------------------
    @abstractmethod
    def freeze(self) -> None:
        """Ask the kernel to freeze the cgroup; :meth:`is_frozen` says when it is."""

    @abstractmethod
    def thaw(self) -> None: ...

    @abstractmethod
    def is_frozen(self) -> bool:
        """True once every task is frozen (not while freezing)."""

    @abstractmethod
    def freeze_requested(self) -> bool:
        """True if the cgroup was asked to freeze (frozen or freezing)."""

    # --- memory reclaim ------------------------------------------------------------------
    @abstractmethod
    def reclaim(self, *, swap_to: str, notes: list[str], keep_bytes: int) -> str:
        """Push the cgroup's memory out (page cache dropped, anonymous memory to swap where
        ``swap_to`` is ``zram``/``zswap``; never to an uncompressed ``disk`` swap).
        ``keep_bytes``: what may stay (the limit fallback's slack). Returns the method
        used: ``memory.reclaim``, ``force_empty``, ``limit`` or ``failed``; appends to
        ``notes`` why a method was not used."""

    # --- labels --------------------------------------------------------------------------
    def label(self, name: str, value: bytes) -> None:
        """Set extended attribute ``name`` on every directory of the cgroup (a kernfs write,
        no cgroup lock); hierarchies without it, or without xattr support, are skipped."""
        for d in self.every_dir():
            with contextlib.suppress(OSError):
                os.setxattr(d, name, value)
