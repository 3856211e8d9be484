"""cgroup v1 control for sandboxes (this node runs cgroup v1: cpu, cpuacct, memory, pids, freezer...).

A sandbox's cgroup is ``<controller>/<parent>/<name>`` in every controller listed in
:data:`CONTROLLERS`. Values are plain integers; units are in each setter's name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("cpu", "cpuacct", "memory", "pids", "freezer")


class CgroupV1:
    """One cgroup, present in each of :data:`CONTROLLERS`, at relative path ``rel``."""

    def __init__(self, rel: str, root: Path = CGROUP_ROOT) -> None:
        self.rel = rel.strip("/")
        self.root = root

    def path(self, controller: str) -> Path:
        return self.root / controller / self.rel

    def exists(self) -> bool:
        return self.path("memory").is_dir()

    def create(self) -> None:
        for c in CONTROLLERS:
            self.path(c).mkdir(parents=True, exist_ok=True)

    def _write(self, controller: str, name: str, value: str | int) -> None:
        (self.path(controller) / name).write_text(str(value))

    def _read(self, controller: str, name: str) -> str:
        return (self.path(controller) / name).read_text()

    def set_cpu(self, cores: float, period_us: int = 100_000) -> None:
        self._write("cpu", "cpu.cfs_period_us", period_us)
        self._write("cpu", "cpu.cfs_quota_us", max(1000, int(cores * period_us)))

    def set_memory(self, limit_bytes: int) -> None:
        self._write("memory", "memory.limit_in_bytes", limit_bytes)
        # no swap on a dsec node by default; keep memsw equal when the knob exists
        with contextlib.suppress(OSError):
            self._write("memory", "memory.memsw.limit_in_bytes", limit_bytes)

    def set_pids(self, max_pids: int) -> None:
        self._write("pids", "pids.max", max_pids)

    def attach(self, pid: int) -> None:
        """Move ``pid`` into this cgroup in every controller."""
        for c in CONTROLLERS:
            self._write(c, "cgroup.procs", pid)

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in self._read("pids", "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def memory_usage(self) -> int:
        return int(self._read("memory", "memory.usage_in_bytes"))

    def memory_stat(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self._read("memory", "memory.stat").splitlines():
            k, _, v = line.partition(" ")
            out[k] = int(v)
        return out

    def oom_kills(self) -> int:
        try:
            for line in self._read("memory", "memory.oom_control").splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except FileNotFoundError:
            pass
        return 0

    def cpu_usage_ns(self) -> int:
        return int(self._read("cpuacct", "cpuacct.usage"))

    def freeze(self) -> None:
        self._write("freezer", "freezer.state", "FROZEN")

    def thaw(self) -> None:
        self._write("freezer", "freezer.state", "THAWED")

    def freezer_state(self) -> str:
        return self._read("freezer", "freezer.state").strip()

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the cgroup until it is empty. A frozen cgroup is thawed
        after the signals are queued (frozen tasks only die once thawed; signalling first
        means no user code runs in between)."""
        if not self.exists():
            return
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.procs()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                if self.freezer_state() != "THAWED":
                    self.thaw()
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.rel} still has processes {pids}")
            time.sleep(0.005)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove the cgroup from every controller (idempotent)."""
        self.kill_all(timeout_s)
        for c in CONTROLLERS:
            p = self.path(c)
            deadline = time.monotonic() + timeout_s
            while p.exists():
                try:
                    p.rmdir()
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        break
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.005)


def list_children(parent: str, controller: str = "memory", root: Path = CGROUP_ROOT) -> list[str]:
    base = root / controller / parent.strip("/")
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir())
