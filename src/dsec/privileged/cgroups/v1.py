"""The cgroup v1 driver: one hierarchy per controller (``cpu``, ``cpuacct``, ``memory``,
``pids``, ``freezer``), a sandbox's cgroup being ``<mount>/<controller>/<rel>`` in each. Also
the *hybrid* layout (v1 controllers with an empty cgroup2 hierarchy beside them, as systemd's
legacy mode mounts it).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
from pathlib import Path

from dsec.privileged.cgroups.base import (
    NO_LIMIT_V1,
    Cgroup,
    CgroupUsage,
    LimitWrite,
    MemoryCharge,
    int_or_none,
    parse_flat_keyed,
)

__all__ = ["CONTROLLERS", "CgroupV1", "read_usage_v1"]

CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")
"""The hierarchies a dsec cgroup is made in."""

CPU_PERIOD_US = 100_000


@functools.cache
def _hierarchies(mount: str) -> tuple[str, ...]:
    """The mounted hierarchies under ``mount`` (not the symlinks of co-mounted controllers,
    e.g. cpu -> cpu,cpuacct), listed once."""
    try:
        names = sorted(os.listdir(mount))
    except OSError:
        return ()
    return tuple(n for n in names if not os.path.islink(f"{mount}/{n}"))


def read_usage_v1(memory: Path, cpuacct: Path, pids: Path) -> CgroupUsage:
    """The counters of a v1 cgroup from its ``memory``, ``cpuacct`` and ``pids``
    directories. Raises ``FileNotFoundError`` if it does not exist."""
    usage = int((memory / "memory.usage_in_bytes").read_text().strip())
    stat = parse_flat_keyed((memory / "memory.stat").read_text())
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    limit = int((memory / "memory.limit_in_bytes").read_text().strip())
    return CgroupUsage(
        cpu_usage_ns=int_or_none(cpuacct / "cpuacct.usage"),
        memory_used_bytes=max(0, usage - inactive),
        memory_cache_bytes=stat.get("total_cache", stat.get("cache", 0)),
        memory_limit_bytes=None if limit >= NO_LIMIT_V1 else limit,
        memory_peak_bytes=int_or_none(memory / "memory.max_usage_in_bytes"),
        pids=int_or_none(pids / "pids.current"),
        version=1,
    )


class CgroupV1(Cgroup):
    """A cgroup present in each of :data:`CONTROLLERS` at ``<root>/<controller>/<rel>``."""

    version = 1
    PIDS_HIERARCHY = "pids"

    def path(self, controller: str) -> Path:
        return self.root / controller / self.rel

    def dirs(self) -> dict[str, Path]:
        return {c: self.path(c) for c in CONTROLLERS}

    def _dir_str(self, hierarchy: str) -> str:
        return f"{self.root}/{hierarchy}/{self.rel}"

    def every_dir(self) -> list[Path]:
        found = _hierarchies(str(self.root)) or CONTROLLERS
        return [self.root / h / self.rel for h in found]

    def oci_path(self) -> str:
        return f"/{self.rel}"

    def exists(self) -> bool:
        return self.path("memory").is_dir()

    def create(self) -> None:
        for c in CONTROLLERS:
            self.path(c).mkdir(parents=True, exist_ok=True)

    def prefill_cpusets(self) -> None:
        cpuset = self.root / "cpuset"
        if not (cpuset / "cgroup.clone_children").exists():
            return
        here = cpuset / self.rel
        here.mkdir(parents=True, exist_ok=True)
        chain = [here, *[p for p in here.parents if p.is_relative_to(cpuset)]]
        for d in reversed(chain[:-1]):  # from the top: each takes its parent's when empty
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not (d / name).read_text().strip():
                    (d / name).write_text((d.parent / name).read_text().strip())
        (here / "cgroup.clone_children").write_text("1")

    def attach(self, pid: int) -> None:
        for c in CONTROLLERS:
            (self.path(c) / "cgroup.procs").write_text(str(pid))

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in (self.path("pids") / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def _kill_signal(self) -> bool:
        return False  # v1 has no cgroup.kill

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
            out.append(LimitWrite("cpu", "cpu.cfs_period_us", str(CPU_PERIOD_US)))
            quota = max(1000, int(cpu * CPU_PERIOD_US))
            out.append(LimitWrite("cpu", "cpu.cfs_quota_us", str(quota)))
        if memory_bytes is not None:
            mem = LimitWrite("memory", "memory.limit_in_bytes", str(memory_bytes))
            # no swap beyond the limit: memory+swap equals memory where the knob exists
            memsw = LimitWrite("memory", "memory.memsw.limit_in_bytes", str(memory_bytes))
            has_memsw = _has_memsw(str(self.root))
            if has_memsw and raising_memory:
                out.append(memsw)
            out.append(mem)
            if has_memsw and not raising_memory:
                out.append(memsw)
        if pids is not None:
            out.append(LimitWrite("pids", "pids.max", str(pids)))
        return out

    def set_cpu_shares(self, shares: int) -> None:
        fd = os.open(f"{self.root}/cpu/{self.rel}/cpu.shares", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, str(shares).encode())
        finally:
            os.close(fd)

    def cpu_shares(self) -> int:
        return int(self._read("cpu", "cpu.shares"))

    # --- reading -------------------------------------------------------------------------
    def _read(self, controller: str, name: str) -> str:
        return (self.path(controller) / name).read_text()

    def memory_limit(self) -> int | None:
        value = int(self._read("memory", "memory.limit_in_bytes").strip())
        return None if value >= NO_LIMIT_V1 else value

    def memory_charge(self) -> MemoryCharge:
        usage = int(self._read("memory", "memory.usage_in_bytes"))
        stat = parse_flat_keyed(self._read("memory", "memory.stat"))

        def pick(name: str) -> int:
            return stat.get(f"total_{name}", stat.get(name, 0))

        return MemoryCharge(
            usage=usage,
            cache=pick("cache"),
            rss=pick("rss"),
            shmem=pick("shmem"),
            mapped_file=pick("mapped_file"),
            swap=pick("swap"),
        )

    def usage(self) -> CgroupUsage:
        return read_usage_v1(self.path("memory"), self.path("cpuacct"), self.path("pids"))

    def oom_kills_file(self) -> Path:
        return self.path("memory") / "memory.oom_control"

    def oom_kills(self) -> int:
        try:
            return self.parse_oom_kills(self.oom_kills_file().read_text())
        except FileNotFoundError:
            return 0

    def memory_limit_hits(self) -> int:
        return int_or_none(self.path("memory") / "memory.failcnt") or 0

    def pids_max_events(self) -> int:
        try:
            return parse_flat_keyed((self.path("pids") / "pids.events").read_text()).get("max", 0)
        except (FileNotFoundError, ValueError):
            return 0

    def cpu_usage_ns(self) -> int | None:
        return int_or_none(self.path("cpuacct") / "cpuacct.usage")

    # --- freezing ------------------------------------------------------------------------
    def freeze(self) -> None:
        (self.path("freezer") / "freezer.state").write_text("FROZEN")

    def thaw(self) -> None:
        (self.path("freezer") / "freezer.state").write_text("THAWED")

    def is_frozen(self) -> bool:
        return self._read("freezer", "freezer.state").strip() == "FROZEN"

    def freeze_requested(self) -> bool:
        return self._read("freezer", "freezer.state").strip() != "THAWED"

    # --- reclaim -------------------------------------------------------------------------
    def reclaim(self, *, swap_to: str, notes: list[str], keep_bytes: int) -> str:
        swappiness = self.path("memory") / "memory.swappiness"
        old_swappiness: str | None = None
        if swap_to == "disk":
            # never page a paused sandbox out to an uncompressed disk
            with contextlib.suppress(OSError):
                old_swappiness = swappiness.read_text().strip()
                swappiness.write_text("0")
        try:
            try:
                (self.path("memory") / "memory.force_empty").write_text("0")
                return "force_empty"
            except OSError as e:
                name = errno.errorcode.get(e.errno or 0, str(e))
                notes.append(f"force_empty failed ({name}); lowered the limit")
            return self._reclaim_by_limit(notes, keep_bytes)
        finally:
            if old_swappiness is not None:
                with contextlib.suppress(OSError):
                    swappiness.write_text(old_swappiness)

    def _reclaim_by_limit(self, notes: list[str], keep_bytes: int) -> str:
        limit_file = self.path("memory") / "memory.limit_in_bytes"
        old = limit_file.read_text().strip()
        charge = self.memory_charge()
        target = charge.rss + charge.shmem + keep_bytes
        try:
            for _ in range(8):  # EBUSY: the kernel could not get below target; step up
                try:
                    limit_file.write_text(str(target))
                    return "limit"
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        notes.append(f"limit reclaim failed: {e}")
                        return "failed"
                    target = int(target * 1.25)
            notes.append("limit reclaim gave up (EBUSY)")
            return "failed"
        finally:
            limit_file.write_text(old)


@functools.cache
def _has_memsw(mount: str) -> bool:
    return os.path.exists(f"{mount}/memory/memory.memsw.limit_in_bytes")
