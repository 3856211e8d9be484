"""Pause and resume a container sandbox: freeze its cgroup, then give back its memory.

What pausing does, in order (measured on a cgroup v1 node, see ``docs/design/rl.md``; the
cgroup work itself is the driver's, :class:`dsec.privileged.cgroups.Cgroup`, on either layout):

1. **Freeze**: :meth:`~dsec.privileged.cgroups.Cgroup.freeze` (v1 ``freezer.state``, v2
   ``cgroup.freeze``) and wait until the kernel reports every task frozen (~0.1-0.3 ms for
   one container). Nothing in the sandbox runs after this, so
   nothing can refill what we reclaim next. A task stuck in uninterruptible sleep can keep
   the cgroup freezing: after ``freeze_timeout_s`` the cgroup is thawed again and
   :class:`~dsec.errors.SandboxError` is raised (the sandbox stays running, never half-paused).
2. **Reclaim** (:meth:`~dsec.privileged.cgroups.Cgroup.reclaim`): v1 writes
   ``memory.force_empty``; v2 asks ``memory.reclaim`` for all but a few MiB (kernels before
   5.19: lowers ``memory.high`` for a moment). Contrary to what one might fear, v1's
   force_empty works on a cgroup whose tasks are frozen: it loops the memcg reclaimer until
   nothing more can be freed and returns; it does not need the tasks to run. It drops the
   page cache charged to the sandbox (clean pages, e.g. its reads of the EROFS layers) in
   ~3 ms for 200 MB. If it fails (``EBUSY``/``EINTR``), the v1 fallback lowers
   ``memory.limit_in_bytes`` to what cannot be reclaimed (plus 4 MiB) and restores it.
   What stays resident: anonymous memory (heap, stacks) and ``shmem`` — which includes the
   files the sandbox wrote to its tmpfs upper layer — unless the node has compressed swap.
3. **Compressed swap**, where the node enables it: if zswap is enabled with an active swap
   device, or a zram device is an active swap, force_empty's reclaim (which may swap) also
   moves anonymous and shmem pages into compressed memory (v1: subject to the cgroup's
   ``memory.swappiness``; v2: ``memory.swap.max``, 0 while the sandbox runs, is lifted for
   the reclaim). If the node's only swap is an uncompressed disk, no page goes there (v1:
   the cgroup's swappiness is 0 for the reclaim; paused sandboxes must not thrash a disk). A node without swap (this one) keeps anonymous memory resident;
   :func:`compressed_swap_status` says which case applies and the report records it.

Resuming: optionally **prefetch** (``posix_fadvise(WILLNEED)`` on the file ranges mapped by the
sandbox's processes — executables and libraries — read from ``/proc/<pid>/maps`` and opened
through ``/proc/<pid>/map_files``, so mount namespaces do not matter; capped at
``prefetch_cap_bytes``), then thaw. The readahead is started before the thaw, so the first
instructions after it fault on memory rather than on the layer files.

Both calls run their blocking file writes in a worker thread and are idempotent (pausing a
frozen cgroup reclaims again; resuming a thawed one only prefetches).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import SandboxError, SandboxNotFound
from dsec.privileged.cgroups import Cgroup, MemoryCharge

__all__ = [
    "CompressedSwap",
    "MemoryStat",
    "PauseReport",
    "ResumeReport",
    "compressed_swap_status",
    "freeze",
    "memory_stat",
    "pause",
    "pause_sync",
    "resume",
    "resume_sync",
    "thaw",
]

_FREEZE_POLL_S = 0.0002
_LIMIT_SLACK_BYTES = 4 << 20
DEFAULT_PREFETCH_CAP_BYTES = 64 << 20
"""Most bytes of mapped files a resume asks the kernel to read ahead."""


MemoryStat = MemoryCharge
"""A cgroup's memory, bytes (:meth:`dsec.privileged.cgroups.Cgroup.memory_charge`; child
cgroups count)."""


@dataclass(frozen=True)
class CompressedSwap:
    """Whether paused sandboxes can push anonymous memory into compressed memory.

    Attributes:
        kind: ``"zswap"`` (enabled, in front of an active swap), ``"zram"`` (a zram device is
            an active swap), ``"disk"`` (only uncompressed swap: not used for pausing) or
            ``"none"`` (no active swap).
        detail: what was found, for the report.
    """

    kind: str
    detail: str

    @property
    def usable(self) -> bool:
        return self.kind in ("zswap", "zram")


@dataclass
class PauseReport:
    """What :func:`pause` did. Times in milliseconds; memory in bytes.

    ``held_fraction`` is ``after.usage / before.usage`` (the share of its running memory a
    paused sandbox still holds).
    """

    before: MemoryStat
    after: MemoryStat
    freeze_ms: float
    reclaim_ms: float
    total_ms: float
    # v1 "force_empty" | "limit"; v2 "memory.reclaim" | "memory.high"; "none" | "failed"
    reclaim_method: str
    compressed_swap: str  # CompressedSwap.kind
    was_frozen: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def held_fraction(self) -> float:
        return self.after.usage / self.before.usage if self.before.usage else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (for the API and the registry)."""
        d = asdict(self)
        d["held_fraction"] = round(self.held_fraction, 4)
        return d


@dataclass
class ResumeReport:
    """What :func:`resume` did. Times in milliseconds."""

    prefetch_ms: float
    thaw_ms: float
    total_ms: float
    prefetched_files: int
    prefetched_bytes: int
    was_frozen: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def memory_stat(cg: Cgroup) -> MemoryStat:
    """The cgroup's current memory (see :class:`MemoryStat`)."""
    try:
        return cg.memory_charge()
    except FileNotFoundError as e:
        raise SandboxNotFound(f"cgroup {cg.rel} does not exist", cgroup=cg.rel) from e


def compressed_swap_status(
    proc: Path = Path("/proc"), sysfs: Path = Path("/sys")
) -> CompressedSwap:
    """Detect zswap / zram swap on this node (reads ``/proc/swaps`` and
    ``/sys/module/zswap/parameters/enabled``)."""
    try:
        lines = (proc / "swaps").read_text().splitlines()[1:]
    except OSError:
        lines = []
    devices = [ln.split()[0] for ln in lines if ln.strip()]
    try:
        zswap_on = (sysfs / "module/zswap/parameters/enabled").read_text().strip() in ("Y", "1")
    except OSError:
        zswap_on = False
    zram = [d for d in devices if os.path.basename(d).startswith("zram")]
    if not devices:
        return CompressedSwap("none", "no active swap (/proc/swaps is empty)")
    if zram:
        return CompressedSwap("zram", f"zram swap active: {', '.join(zram)}")
    if zswap_on:
        return CompressedSwap("zswap", f"zswap enabled in front of {', '.join(devices)}")
    return CompressedSwap("disk", f"only uncompressed swap: {', '.join(devices)}")


def _ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 3)


def _not_frozen(cg: Cgroup, timeout_s: float) -> SandboxError:
    """The error of a freeze that did not complete (the cgroup was thawed again)."""
    return SandboxError(
        f"cgroup {cg.rel} did not freeze within {timeout_s} s (a task in "
        "uninterruptible sleep?); it was thawed again and keeps running",
        cgroup=cg.rel,
        timeout_s=timeout_s,
    )


def _wait_frozen(cg: Cgroup, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = _FREEZE_POLL_S
    while not cg.is_frozen():
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                cg.thaw()
            raise _not_frozen(cg, timeout_s)
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def pause_sync(cg: Cgroup, *, reclaim: bool = True, freeze_timeout_s: float = 5.0) -> PauseReport:
    """Blocking body of :func:`pause` (for callers already in a worker thread)."""
    if not cg.exists():
        raise SandboxNotFound(f"cgroup {cg.rel} does not exist", cgroup=cg.rel)
    t0 = time.perf_counter()
    before = memory_stat(cg)
    was_frozen = cg.is_frozen()
    cg.freeze()
    _wait_frozen(cg, freeze_timeout_s)
    freeze_ms = _ms(t0)
    swap = compressed_swap_status()
    notes: list[str] = []
    t1 = time.perf_counter()
    method = (
        cg.reclaim(swap_to=swap.kind, notes=notes, keep_bytes=_LIMIT_SLACK_BYTES)
        if reclaim
        else "none"
    )
    reclaim_ms = _ms(t1)
    after = memory_stat(cg)
    if not swap.usable and after.rss + after.shmem > 0:
        notes.append(
            f"{(after.rss + after.shmem) >> 20} MiB anonymous/shmem stays resident: {swap.detail}"
        )
    return PauseReport(
        before=before,
        after=after,
        freeze_ms=freeze_ms,
        reclaim_ms=reclaim_ms,
        total_ms=_ms(t0),
        reclaim_method=method,
        compressed_swap=swap.kind,
        was_frozen=was_frozen,
        notes=notes,
    )


async def pause(cg: Cgroup, *, reclaim: bool = True, freeze_timeout_s: float = 5.0) -> PauseReport:
    """Freeze every task of ``cg``, then reclaim its memory. See the module docstring.

    Args:
        cg: the sandbox's cgroup (its memory and freezing are used).
        reclaim: False only freezes (e.g. around a consistent ``pack_diff``).
        freeze_timeout_s: how long to wait for ``FROZEN``, seconds.

    Raises:
        SandboxNotFound: the cgroup does not exist.
        SandboxError: the tasks did not freeze in time (the cgroup is left thawed).
    """
    return await asyncio.to_thread(
        pause_sync, cg, reclaim=reclaim, freeze_timeout_s=freeze_timeout_s
    )


async def freeze(cg: Cgroup, *, freeze_timeout_s: float = 5.0) -> PauseReport:
    """Freeze only (no reclaim): the write in a worker thread (a v2 ``cgroup.freeze`` write
    takes the kernel's cgroup mutex), the wait for every task frozen on the event loop.
    Under load the wait is the long part, and a worker thread sleeping through it is one the
    files API cannot use (500 agents pausing between turns had the files API's reads wait
    1.6 s at p50 behind them). Same errors as :func:`pause`."""
    if not cg.exists():
        raise SandboxNotFound(f"cgroup {cg.rel} does not exist", cgroup=cg.rel)
    t0 = time.perf_counter()
    before = memory_stat(cg)
    was_frozen = cg.is_frozen()
    await asyncio.to_thread(cg.freeze)
    deadline = time.monotonic() + freeze_timeout_s
    delay = _FREEZE_POLL_S
    while not cg.is_frozen():
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                await asyncio.to_thread(cg.thaw)
            raise _not_frozen(cg, freeze_timeout_s)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.01)
    ms = _ms(t0)
    return PauseReport(
        before=before,
        after=before,
        freeze_ms=ms,
        reclaim_ms=0.0,
        total_ms=ms,
        reclaim_method="none",
        compressed_swap=compressed_swap_status().kind,
        was_frozen=was_frozen,
    )


async def thaw(cg: Cgroup) -> ResumeReport:
    """Thaw only (no prefetch: what a short pause left in memory is still there), waiting on
    the event loop as :func:`freeze` does."""
    if not cg.exists():
        raise SandboxNotFound(f"cgroup {cg.rel} does not exist", cgroup=cg.rel)
    t0 = time.perf_counter()
    was_frozen = cg.freeze_requested()
    await asyncio.to_thread(cg.thaw)
    deadline = time.monotonic() + 5.0
    while cg.freeze_requested():
        if time.monotonic() > deadline:
            raise SandboxError(f"cgroup {cg.rel} did not thaw", cgroup=cg.rel)
        await asyncio.sleep(_FREEZE_POLL_S)
    ms = _ms(t0)
    return ResumeReport(
        prefetch_ms=0.0,
        thaw_ms=ms,
        total_ms=ms,
        prefetched_files=0,
        prefetched_bytes=0,
        was_frozen=was_frozen,
    )


def _mapped_ranges(pid: int) -> list[tuple[str, int, int, tuple[int, int]]]:
    """(map_files entry, file offset, length, (dev, inode)) of each file-backed mapping."""
    out: list[tuple[str, int, int, tuple[int, int]]] = []
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        addr, _perms, offset, dev, inode = parts[:5]
        if inode == "0":
            continue
        start_s, _, end_s = addr.partition("-")
        start, end = int(start_s, 16), int(end_s, 16)
        major, _, minor = dev.partition(":")
        key = (int(major, 16) << 20 | int(minor, 16), int(inode))
        out.append((f"/proc/{pid}/map_files/{addr}", int(offset, 16), end - start, key))
    return out


def _prefetch(cg: Cgroup, cap_bytes: int) -> tuple[int, int]:
    seen: set[tuple[tuple[int, int], int]] = set()
    files: set[tuple[int, int]] = set()
    total = 0
    for pid in cg.procs():
        for entry, offset, length, key in _mapped_ranges(pid):
            if total >= cap_bytes:
                return len(files), total
            if (key, offset) in seen:
                continue
            seen.add((key, offset))
            length = min(length, cap_bytes - total)
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                continue
            finally:
                os.close(fd)
            files.add(key)
            total += length
    return len(files), total


def resume_sync(
    cg: Cgroup, prefetch: bool = True, *, prefetch_cap_bytes: int = DEFAULT_PREFETCH_CAP_BYTES
) -> ResumeReport:
    """Blocking body of :func:`resume`."""
    if not cg.exists():
        raise SandboxNotFound(f"cgroup {cg.rel} does not exist", cgroup=cg.rel)
    t0 = time.perf_counter()
    was_frozen = cg.freeze_requested()
    nfiles = nbytes = 0
    if prefetch:
        nfiles, nbytes = _prefetch(cg, prefetch_cap_bytes)
    prefetch_ms = _ms(t0)
    t1 = time.perf_counter()
    cg.thaw()
    deadline = time.monotonic() + 5.0
    while cg.freeze_requested():
        if time.monotonic() > deadline:
            raise SandboxError(f"cgroup {cg.rel} did not thaw", cgroup=cg.rel)
        time.sleep(_FREEZE_POLL_S)
    return ResumeReport(
        prefetch_ms=prefetch_ms,
        thaw_ms=_ms(t1),
        total_ms=_ms(t0),
        prefetched_files=nfiles,
        prefetched_bytes=nbytes,
        was_frozen=was_frozen,
    )


async def resume(
    cg: Cgroup, prefetch: bool = True, *, prefetch_cap_bytes: int = DEFAULT_PREFETCH_CAP_BYTES
) -> ResumeReport:
    """Prefetch the sandbox's mapped files (optional), then thaw its cgroup.

    Args:
        cg: the sandbox's cgroup.
        prefetch: start readahead of mapped executables/libraries before thawing.
        prefetch_cap_bytes: most bytes to read ahead.

    Raises:
        SandboxNotFound: the cgroup does not exist (the node lost the sandbox).
        SandboxError: the cgroup did not thaw.
    """
    return await asyncio.to_thread(resume_sync, cg, prefetch, prefetch_cap_bytes=prefetch_cap_bytes)
