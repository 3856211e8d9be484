"""How a runtime measures one sandbox: raw counters read from the kernel, never resuming it.

Every tier reports a :class:`SandboxUsage` through the :class:`~dsec.contract.runtime.Measurable`
ability; the edge turns two of them into rates (:meth:`dsec.edge.agent.EdgeAgent.sandbox_metrics`).
This module holds the readers and their parsers, each a pure function of file contents so the
unit tests feed them text:

* cgroups, both layouts: **v1** (one hierarchy per controller: ``cpuacct.usage``,
  ``memory.usage_in_bytes``/``memory.stat``/``memory.limit_in_bytes``, ``pids.current``) and
  **v2** (one unified hierarchy: ``cpu.stat`` ``usage_usec``, ``memory.current``/``memory.stat``/
  ``memory.max``/``memory.peak``, ``pids.current``), read by the cgroup drivers
  (:meth:`dsec.privileged.cgroups.Cgroup.usage`); :func:`read_cgroup` reads a cgroup of dsec's
  subtree in this host's layout, and the types and parsers are re-exported here;
* network interfaces: ``/sys/class/net/<if>/statistics/*`` of a host-side veth (its receive
  is the sandbox's transmit) and ``/proc/net/dev`` tables;
* ``/proc/meminfo`` (a VM guest's memory) and ``statvfs`` (a writable layer's fill).

Memory follows the container engines' convention: *used* is the working set, the charged
memory minus the inactive file cache (what the sandbox would keep under pressure); *cache* is
the page cache charged to it (tmpfs files included). Sizes are bytes, CPU time nanoseconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from dsec.privileged.cgroups import CGROUP_MOUNT, CgroupUsage, CgroupV1, cgroup, parse_flat_keyed
from dsec.privileged.cgroups.v2 import read_usage_v2

__all__ = [
    "CGROUP_ROOT",
    "CgroupUsage",
    "NetCounters",
    "SandboxUsage",
    "disk_usage",
    "parse_flat_keyed",
    "parse_meminfo",
    "parse_net_dev",
    "parse_proc_stat_cpu",
    "processes_cpu_ns",
    "read_cgroup",
    "read_cgroup_v1",
    "read_cgroup_v2",
    "read_veth_counters",
]

CGROUP_ROOT = CGROUP_MOUNT


@dataclass(frozen=True)
class NetCounters:
    """Traffic of a sandbox as the sandbox sees it: ``rx`` arrived, ``tx`` sent."""

    rx_bytes: int = 0
    tx_bytes: int = 0
    rx_packets: int = 0
    tx_packets: int = 0


@dataclass(frozen=True)
class SandboxUsage:
    """Raw counters of one sandbox at one instant (monotonic counters are cumulative).

    Attributes:
        cpu_usage_ns: CPU time the sandbox consumed since it started, nanoseconds (VM tiers:
            the host CPU its QEMU process used).
        memory_used_bytes: its working set, bytes (VM tiers: the guest's used memory when the
            guest answers, else what QEMU holds on the host).
        memory_cache_bytes: page cache charged to it, bytes.
        memory_limit_bytes: its memory limit, bytes (None: none known).
        memory_peak_bytes: the highest charge seen, bytes, where the kernel keeps it.
        disk_used_bytes, disk_total_bytes: its writable layer's fill and size, bytes.
        net: its traffic; None when the sandbox has no network.
        pids: processes (threads) in it now, where counted.
        source: where the numbers come from, e.g. ``cgroup v1``.
        host_memory_bytes: VM tiers: memory the QEMU process holds on the host, bytes.
    """

    cpu_usage_ns: int
    memory_used_bytes: int
    memory_cache_bytes: int = 0
    memory_limit_bytes: int | None = None
    memory_peak_bytes: int | None = None
    disk_used_bytes: int | None = None
    disk_total_bytes: int | None = None
    net: NetCounters | None = None
    pids: int | None = None
    source: str = ""
    host_memory_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


# --- parsers (pure) -----------------------------------------------------------------------
def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes by field name (``MemTotal``, ``MemAvailable``, ``Cached``...)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[key.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


def parse_net_dev(text: str) -> dict[str, NetCounters]:
    """``/proc/net/dev`` as counters by interface name (as that namespace sees them)."""
    out: dict[str, NetCounters] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if not sep or "|" in line:
            continue
        fields = rest.split()
        if len(fields) < 10:
            continue
        try:
            rx_bytes, rx_packets = int(fields[0]), int(fields[1])
            tx_bytes, tx_packets = int(fields[8]), int(fields[9])
        except ValueError:
            continue
        out[name.strip()] = NetCounters(rx_bytes, tx_bytes, rx_packets, tx_packets)
    return out


def parse_proc_stat_cpu(text: str, ticks_per_s: int) -> int:
    """CPU time in ``/proc/<pid>/stat``, nanoseconds: the process's own user and system time
    plus that of the children it waited for (``utime stime cutime cstime``)."""
    rest = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
    ticks = sum(int(x) for x in rest[11:15])  # fields 14-17 of proc(5), after pid and comm
    return ticks * 1_000_000_000 // ticks_per_s


# --- readers ------------------------------------------------------------------------------
def read_cgroup_v1(rel: str, root: Path = CGROUP_ROOT) -> CgroupUsage:
    """The counters of v1 cgroup ``rel`` (``cpuacct``, ``memory``, ``pids`` hierarchies under
    ``root``). Raises ``FileNotFoundError`` if it does not exist."""
    return CgroupV1(rel, root).usage()


def read_cgroup_v2(rel: str, root: Path = CGROUP_ROOT) -> CgroupUsage:
    """The counters of v2 cgroup ``rel`` of the unified hierarchy mounted at ``root``. Raises
    ``FileNotFoundError`` if it does not exist."""
    return read_usage_v2(root / rel.strip("/"))


def read_cgroup(rel: str, root: Path | None = None) -> CgroupUsage:
    """The counters of cgroup ``rel`` of dsec's subtree (``cgroup(rel).usage()``, in this
    host's layout). With ``root``, a cgroup filesystem mounted elsewhere (tests): read in
    whichever layout ``rel`` exists there, v1 (``root/memory/rel``) or v2
    (``root/rel/memory.current``). Raises ``FileNotFoundError`` if it does not exist."""
    if root is None:
        return cgroup(rel).usage()
    rel = rel.strip("/")
    if (root / "memory" / rel / "memory.usage_in_bytes").exists():
        return read_cgroup_v1(rel, root)
    if (root / rel / "memory.current").exists():
        return read_cgroup_v2(rel, root)
    raise FileNotFoundError(f"no cgroup {rel} under {root}")


def processes_cpu_ns(pids: list[int]) -> int:
    """CPU time of a group of processes, nanoseconds: each one's own time plus what its
    waited-for children used. Summed over every live process of a group (``cgroup.procs``)
    this counts each CPU second once: a reaped process's time lives in its reaper's
    counters. Processes that exit while being read are skipped."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            total += parse_proc_stat_cpu(Path(f"/proc/{pid}/stat").read_text(), ticks)
        except (OSError, ValueError, IndexError):
            continue
    return total


def read_veth_counters(
    host_ifname: str, sys_class_net: Path = Path("/sys/class/net")
) -> NetCounters:
    """The sandbox's traffic from the host end of its veth pair: what the host end receives
    the sandbox sent. Raises ``FileNotFoundError`` if the interface is gone."""
    stats = sys_class_net / host_ifname / "statistics"

    def get(name: str) -> int:
        return int((stats / name).read_text().strip())

    return NetCounters(
        rx_bytes=get("tx_bytes"),
        tx_bytes=get("rx_bytes"),
        rx_packets=get("tx_packets"),
        tx_packets=get("rx_packets"),
    )


def disk_usage(paths: list[str | os.PathLike[str]]) -> tuple[int, int]:
    """``(used, total)`` bytes summed over the filesystems at ``paths`` (a sandbox's writable
    tmpfs mounts). Raises ``OSError`` if one is gone."""
    used = total = 0
    for p in paths:
        st = os.statvfs(p)
        total += st.f_blocks * st.f_frsize
        used += (st.f_blocks - st.f_bfree) * st.f_frsize
    return used, total
