"""The node agent's own cgroup: ``dsec serve`` weighted above every sandbox.

A node overcommitted tenfold is saturated whenever a few of its sandboxes work. The platform's
own small operations (an API file read, an exec's control path, a creation's set-up, the
port proxy) must not wait in the same CPU queue as its tenants' compile jobs, as kubelet's
``system-reserved`` and systemd's ``CPUWeight=`` keep a node's agents responsive. At start,
``dsec serve`` moves itself into :data:`SUPERVISOR_LEAF` with a CPU weight of
``DSEC_SUPERVISOR_CPU_WEIGHT`` (default 1000: ten times a default cgroup's 100), a sibling
of the cgroup holding every sandbox of the install (``dsec-<hash>``, weight 100): when both
want CPU, dsec gets ten parts to the sandboxes' one, whatever their number; when dsec is
idle the sandboxes get it all. Processes dsec starts later (the OCI runtime, exec servers
before they join their sandbox) begin there too.

* **v2**: ``<base>/dsec-supervisor`` (``base``: see :mod:`.layout`; a systemd-delegated
  service cgroup, ``DSEC_CGROUP_PARENT``, or the root). The leaf is also where
  :func:`~.layout.prepare` moves any other process of the base (the no-internal-processes
  rule), and it holds no controller of its own.
* **v1**: ``/dsec-supervisor`` in the ``cpu`` hierarchy only (``cpu.shares`` = weight x
  10.24); the other hierarchies (memory, pids...) keep dsec where it was.

:meth:`Supervisor.release`, at a clean exit, moves the process back where it came from and
removes the leaf when nothing is left in it (another ``dsec serve`` of another install may
share it). ``DSEC_SUPERVISOR_CGROUP=off`` leaves dsec where it was started.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from dsec.privileged.cgroups.layout import SUPERVISOR_LEAF, CgroupLayout, host_layout, prepare

__all__ = ["DEFAULT_WEIGHT", "Supervisor", "reserve"]

log = logging.getLogger(__name__)

DEFAULT_WEIGHT = 1000
"""The supervisor's CPU weight in v2 ``cpu.weight`` units (a default cgroup has 100)."""


@dataclass
class Supervisor:
    """Where :func:`reserve` put this process: ``leaf`` (the cgroup directories it was moved
    into) and ``came_from`` (the ones it left, to go back at :meth:`release`)."""

    leaf: list[Path] = field(default_factory=list)
    came_from: list[Path] = field(default_factory=list)
    weight: int = DEFAULT_WEIGHT
    note: str = ""

    def release(self) -> None:
        """Go back where the process came from and remove the leaf if it is empty (best
        effort: a delegated v2 base, which has controllers on, takes no process back; the
        leaf then stays for the next start, and systemd removes it with the service)."""
        pid = str(os.getpid())
        for d in self.came_from:
            with contextlib.suppress(OSError):
                (d / "cgroup.procs").write_text(pid)
        for d in self.leaf:
            with contextlib.suppress(OSError):
                d.rmdir()  # EBUSY while any process (another install's dsec) is in it


def _weight_from_env() -> int:
    raw = os.environ.get("DSEC_SUPERVISOR_CPU_WEIGHT", "").strip()
    if not raw:
        return DEFAULT_WEIGHT
    try:
        weight = int(raw)
    except ValueError:
        raise SystemExit(f"DSEC_SUPERVISOR_CPU_WEIGHT must be 1..10000, not {raw!r}") from None
    if not 1 <= weight <= 10_000:
        raise SystemExit(f"DSEC_SUPERVISOR_CPU_WEIGHT must be 1..10000, not {weight}")
    return weight


def _own_cgroups(proc_cgroup: Path = Path("/proc/self/cgroup")) -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"": "/x"}`` for v2, ``{"cpu,cpuacct": ...}``."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in proc_cgroup.read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                out[parts[1]] = parts[2]
    return out


def reserve(layout: CgroupLayout | None = None) -> Supervisor | None:
    """Move this process into the supervisor's cgroup with its weight (see the module's
    doc). None when off (``DSEC_SUPERVISOR_CGROUP=off``) or impossible (logged: dsec then
    runs where it was started)."""
    if os.environ.get("DSEC_SUPERVISOR_CGROUP", "on").strip().lower() in ("off", "0"):
        return None
    weight = _weight_from_env()
    layout = layout or host_layout()
    try:
        if layout.mode == "v2":
            return _reserve_v2(layout, weight)
        if layout.mode == "v1":
            return _reserve_v1(layout, weight)
    except OSError as e:
        log.warning("dsec's own cgroup: not reserved (%s); dsec runs where it was started", e)
    return None


def _reserve_v2(layout: CgroupLayout, weight: int) -> Supervisor:
    own = _own_cgroups().get("", "")
    leaf = layout.base_dir / SUPERVISOR_LEAF
    came_from = layout.mount / own.strip("/") if own.strip("/") else layout.mount
    with contextlib.suppress(FileExistsError):
        leaf.mkdir()
    if came_from != leaf:
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
    prepare(layout)  # the base's other processes into the leaf, controllers on below it
    (leaf / "cpu.weight").write_text(str(weight))
    back = [] if came_from in (leaf, layout.base_dir) else [came_from]
    return Supervisor(
        [leaf], back, weight, f"dsec runs in /{leaf.relative_to(layout.mount)}, cpu.weight {weight}"
    )


def _reserve_v1(layout: CgroupLayout, weight: int) -> Supervisor:
    cpu = layout.mount / "cpu"
    if not (cpu / "cpu.shares").exists():
        raise OSError(errno.ENOENT, "no v1 cpu hierarchy with cpu.shares")
    own = next((p for k, p in _own_cgroups().items() if "cpu" in k.split(",")), "/")
    leaf = cpu / SUPERVISOR_LEAF
    with contextlib.suppress(FileExistsError):
        leaf.mkdir()
    shares = max(2, min(262_144, weight * 1024 // 100))
    (leaf / "cpu.shares").write_text(str(shares))
    came_from = cpu / own.strip("/") if own.strip("/") else cpu
    if came_from != leaf:
        (leaf / "cgroup.procs").write_text(str(os.getpid()))
    return Supervisor(
        [leaf],
        [] if came_from == leaf else [came_from],
        weight,
        f"dsec runs in cpu:/{SUPERVISOR_LEAF}, cpu.shares {shares}",
    )
