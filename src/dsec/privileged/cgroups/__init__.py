"""cgroups for sandboxes, on both layouts a host may have.

* :mod:`.base` — :class:`Cgroup`, the contract (limits, usage, freeze, kill, reclaim,
  removal) every tier uses; nothing outside this package names a controller file;
* :mod:`.v2` — the unified hierarchy (``cpu.max``, ``memory.max``, ``cgroup.freeze``,
  ``cgroup.kill``, ``memory.reclaim``);
* :mod:`.v1` — one hierarchy per controller (and the hybrid layout);
* :mod:`.layout` — which one this host has, where dsec's subtree is, made ready once at
  node start.

Typical use::

    from dsec.privileged.cgroups import cgroup
    cg = cgroup("dsec-1a2b3c4d/sb-42")
    cg.create(); cg.set_memory(512 << 20); cg.attach(pid)
    ...
    cg.remove()
"""

from dsec.privileged.cgroups.base import (
    Cgroup,
    CgroupUsage,
    LimitWrite,
    MemoryCharge,
    parse_flat_keyed,
    shares_to_weight,
    weight_to_shares,
)
from dsec.privileged.cgroups.layout import (
    CGROUP_MOUNT,
    CgroupLayout,
    cgroup,
    detect_layout,
    host_layout,
    prepare,
    reset_layout,
)
from dsec.privileged.cgroups.v1 import CONTROLLERS, CgroupV1
from dsec.privileged.cgroups.v2 import CgroupV2

CGROUP_ROOT = CGROUP_MOUNT
"""Where the cgroup filesystems are mounted (tests of the v1 layout read it directly)."""


def list_children(parent: str) -> list[str]:
    """Names of the child cgroups of ``parent`` below dsec's subtree on this host."""
    return cgroup(parent).children()


__all__ = [
    "CGROUP_MOUNT",
    "CGROUP_ROOT",
    "CONTROLLERS",
    "Cgroup",
    "CgroupLayout",
    "CgroupUsage",
    "CgroupV1",
    "CgroupV2",
    "LimitWrite",
    "MemoryCharge",
    "cgroup",
    "detect_layout",
    "host_layout",
    "list_children",
    "parse_flat_keyed",
    "prepare",
    "reset_layout",
    "shares_to_weight",
    "weight_to_shares",
]
