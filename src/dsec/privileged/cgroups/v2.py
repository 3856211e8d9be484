"""The cgroup v2 driver: one unified hierarchy, a sandbox's cgroup one directory
``<base>/<rel>`` with ``cpu.max``, ``cpu.weight``, ``memory.max``/``memory.swap.max``,
``pids.max``, ``cgroup.freeze``, ``cgroup.kill``, ``memory.reclaim`` and the ``*.stat`` /
``memory.events`` counters.

The no-internal-processes rule: a cgroup that hands controllers to its children holds no
process itself. dsec keeps it by enabling controllers in a parent only when it makes a child
there, and by never putting a process into a cgroup that has children (sandboxes and
workers are leaves; :mod:`dsec.privileged.cgroups.layout` moves dsec itself into a leaf of
its own when it was started inside the cgroup it must manage).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from pathlib import Path

from dsec.privileged.cgroups.base import (
    Cgroup,
    CgroupUsage,
    LimitWrite,
    MemoryCharge,
    int_or_none,
    parse_flat_keyed,
    shares_to_weight,
    weight_to_shares,
)

__all__ = ["DELEGATED_CONTROLLERS", "CgroupV2", "enable_controllers", "read_usage_v2"]

DELEGATED_CONTROLLERS = ("cpu", "memory", "pids")
"""Controllers dsec enables for its children (freezing and killing are core v2 files)."""

CPU_PERIOD_US = 100_000


def read_usage_v2(d: Path) -> CgroupUsage:
    """The counters of the v2 cgroup at directory ``d``. Raises ``FileNotFoundError`` if it
    does not exist."""
    cpu = parse_flat_keyed((d / "cpu.stat").read_text())
    current = int((d / "memory.current").read_text().strip())
    stat = parse_flat_keyed((d / "memory.stat").read_text())
    limit = (d / "memory.max").read_text().strip()
    return CgroupUsage(
        cpu_usage_ns=cpu.get("usage_usec", 0) * 1000,
        memory_used_bytes=max(0, current - stat.get("inactive_file", 0)),
        memory_cache_bytes=stat.get("file", 0),
        memory_limit_bytes=None if limit == "max" else int(limit),
        memory_peak_bytes=int_or_none(d / "memory.peak"),
        pids=int_or_none(d / "pids.current"),
        version=2,
    )


def enable_controllers(d: Path, wanted: tuple[str, ...] = DELEGATED_CONTROLLERS) -> list[str]:
    """Enable ``wanted`` controllers (those ``d`` has) for ``d``'s children. Returns the
    ones it could not enable because ``d`` does not have them. Raises ``OSError`` EBUSY when
    ``d`` holds processes (the no-internal-processes rule)."""
    try:
        have = set((d / "cgroup.controllers").read_text().split())
        on = set((d / "cgroup.subtree_control").read_text().split())
    except FileNotFoundError:
        raise
    missing = [c for c in wanted if c not in have]
    todo = [c for c in wanted if c in have and c not in on]
    if todo:
        (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in todo))
    return missing


@functools.cache
def _file_exists(path: str) -> bool:
    return os.path.exists(path)


class CgroupV2(Cgroup):
    """A cgroup of the unified hierarchy at ``<root>/<rel>``; ``root`` is dsec's base
    cgroup's directory and ``oci_base`` its path inside the hierarchy (for OCI runtimes)."""

    version = 2
    PIDS_HIERARCHY = ""

    def __init__(self, rel: str, root: Path, oci_base: str = "") -> None:
        super().__init__(rel, root)
        self.oci_base = "/" + oci_base.strip("/") if oci_base.strip("/") else ""

    def child(self, name: str) -> Cgroup:
        return CgroupV2(f"{self.rel}/{name}", self.root, self.oci_base)

    @property
    def dir(self) -> Path:
        return self.root / self.rel

    def dirs(self) -> dict[str, Path]:
        return {"": self.dir}

    def _dir_str(self, hierarchy: str) -> str:
        return f"{self.root}/{self.rel}"

    def every_dir(self) -> list[Path]:
        return [self.dir]

    def oci_path(self) -> str:
        return f"{self.oci_base}/{self.rel}"

    def exists(self) -> bool:
        return (self.dir / "cgroup.procs").exists()

    def create(self) -> None:
        parent = self.root
        for part in self.rel.split("/"):
            child = parent / part
            if not child.is_dir():
                enable_controllers(parent)
                with contextlib.suppress(FileExistsError):
                    child.mkdir()
            parent = child

    def enable_child_controllers(self) -> None:
        enable_controllers(self.dir)

    def attach(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in (self.dir / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def populated(self) -> bool:
        try:
            return (
                parse_flat_keyed((self.dir / "cgroup.events").read_text()).get("populated", 0) == 1
            )
        except FileNotFoundError:
            return False

    def nest_pids_writes(self) -> list[LimitWrite]:
        return [LimitWrite("", "cgroup.subtree_control", "+pids")]

    def _kill_signal(self) -> bool:
        try:
            (self.dir / "cgroup.kill").write_text("1")  # 5.14+: the whole subtree, atomically
        except FileNotFoundError:
            return False
        return True

    # --- limits --------------------------------------------------------------------------
    def limit_writes(
        self,
        *,
        cpu: float | None = None,
        memory_bytes: int | None = None,
        pids: int | None = None,
        raising_memory: bool = True,
    ) -> list[LimitWrite]:
        out: list[LimitWrite] = []
        if cpu is not None:
            quota = max(1000, int(cpu * CPU_PERIOD_US))
            out.append(LimitWrite("", "cpu.max", f"{quota} {CPU_PERIOD_US}"))
        if memory_bytes is not None:
            out.append(LimitWrite("", "memory.max", str(memory_bytes)))
            # no swap for a running sandbox (v1's memsw == limit); a pause may lift it
            if (
                _file_exists(str(self.root / "memory.swap.max"))
                or (self.dir / "memory.swap.max").exists()
            ):
                out.append(LimitWrite("", "memory.swap.max", "0"))
        if pids is not None:
            out.append(LimitWrite("", "pids.max", str(pids)))
        return out

    def set_cpu_shares(self, shares: int) -> None:
        fd = os.open(f"{self.root}/{self.rel}/cpu.weight", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(shares_to_weight(shares)).encode())
        finally:
            os.close(fd)

    def cpu_shares(self) -> int:
        return weight_to_shares(int((self.dir / "cpu.weight").read_text()))

    # --- reading -------------------------------------------------------------------------
    def memory_limit(self) -> int | None:
        value = (self.dir / "memory.max").read_text().strip()
        return None if value == "max" else int(value)

    def memory_charge(self) -> MemoryCharge:
        stat = parse_flat_keyed((self.dir / "memory.stat").read_text())
        return MemoryCharge(
            usage=int((self.dir / "memory.current").read_text()),
            cache=stat.get("file", 0),
            rss=stat.get("anon", 0),
            shmem=stat.get("shmem", 0),
            mapped_file=stat.get("file_mapped", 0),
            swap=int_or_none(self.dir / "memory.swap.current") or 0,
        )

    def usage(self) -> CgroupUsage:
        return read_usage_v2(self.dir)

    def oom_kills_file(self) -> Path:
        return self.dir / "memory.events"

    def oom_kills(self) -> int:
        try:
            return self.parse_oom_kills(self.oom_kills_file().read_text())
        except FileNotFoundError:
            return 0

    def memory_limit_hits(self) -> int:
        try:
            events = parse_flat_keyed((self.dir / "memory.events").read_text())
        except (FileNotFoundError, ValueError):
            return 0
        return events.get("max", 0) + events.get("oom", 0)

    def pids_max_events(self) -> int:
        try:
            return parse_flat_keyed((self.dir / "pids.events").read_text()).get("max", 0)
        except (FileNotFoundError, ValueError):
            return 0

    def cpu_usage_ns(self) -> int | None:
        try:
            return parse_flat_keyed((self.dir / "cpu.stat").read_text()).get("usage_usec", 0) * 1000
        except FileNotFoundError:
            return None

    # --- freezing ------------------------------------------------------------------------
    def freeze(self) -> None:
        (self.dir / "cgroup.freeze").write_text("1")

    def thaw(self) -> None:
        (self.dir / "cgroup.freeze").write_text("0")

    def is_frozen(self) -> bool:
        return parse_flat_keyed((self.dir / "cgroup.events").read_text()).get("frozen", 0) == 1

    def freeze_requested(self) -> bool:
        return (self.dir / "cgroup.freeze").read_text().strip() == "1"

    # --- reclaim -------------------------------------------------------------------------
    def reclaim(self, *, swap_to: str, notes: list[str], keep_bytes: int) -> str:
        swap_max = self.dir / "memory.swap.max"
        old_swap: str | None = None
        if swap_to in ("zram", "zswap"):
            with contextlib.suppress(OSError):  # compressed swap: let anonymous memory go
                old_swap = swap_max.read_text().strip()
                swap_max.write_text("max")
        try:
            charge = self.memory_charge()
            amount = max(0, charge.usage - min(keep_bytes, charge.usage))
            if amount == 0:
                return "memory.reclaim"
            try:
                (self.dir / "memory.reclaim").write_text(str(amount))
                return "memory.reclaim"
            except OSError as e:
                if e.errno == errno.EAGAIN:  # reclaimed what could be; the rest stays
                    return "memory.reclaim"
                if e.errno not in (errno.ENOENT, errno.EINVAL):
                    notes.append(f"memory.reclaim failed: {e}")
                    return "failed"
                notes.append("no memory.reclaim (kernel < 5.19); lowered memory.high")
            return self._reclaim_by_high(notes, keep_bytes)
        finally:
            if old_swap is not None:
                with contextlib.suppress(OSError):
                    swap_max.write_text(old_swap)

    def _reclaim_by_high(self, notes: list[str], keep_bytes: int) -> str:
        """memory.high below the charge reclaims in the writer's context and, unlike
        memory.max, never calls the OOM killer."""
        high = self.dir / "memory.high"
        try:
            old = high.read_text().strip()
            charge = self.memory_charge()
            high.write_text(str(charge.rss + charge.shmem + keep_bytes))
        except OSError as e:
            notes.append(f"memory.high reclaim failed: {e}")
            return "failed"
        finally:
            with contextlib.suppress(OSError, UnboundLocalError):
                high.write_text(old)
        return "memory.high"
