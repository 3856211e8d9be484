"""Which cgroup layout this host has, where dsec's subtree is, and the driver for it.

Found once per process (:func:`host_layout`) and made ready once at node start
(:func:`prepare`):

* **v2** (unified: ``/sys/fs/cgroup/cgroup.controllers`` exists; systemd's default, every
  current distribution and Kubernetes node). dsec's cgroups go under a *base* cgroup:
  ``DSEC_CGROUP_PARENT`` if set; else, when systemd started dsec with ``Delegate=yes``
  (its cgroup carries the ``trusted.delegate`` attribute), the service's own cgroup; else
  the hierarchy's root (dsec started from a shell makes and owns ``/dsec-<hash>``
  subtrees there, as container engines' cgroupfs drivers do). When the base holds dsec's
  own processes, :func:`prepare` moves them into the leaf ``<base>/dsec-supervisor`` so the
  base may hand controllers to sandboxes (the no-internal-processes rule).
* **v1** (one hierarchy per controller, ``/sys/fs/cgroup/memory/memory.limit_in_bytes``
  exists), the *hybrid* layout included (v1 controllers plus an empty cgroup2 hierarchy).
* **unsupported**: neither; e.g. systemd's legacy layout on a kernel built without
  ``CONFIG_MEMCG_V1`` (Debian's 6.12), where the memory controller is on neither side dsec
  can use. The reason says what to change.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dsec.privileged.cgroups.base import Cgroup
from dsec.privileged.cgroups.v1 import CONTROLLERS, CgroupV1
from dsec.privileged.cgroups.v2 import DELEGATED_CONTROLLERS, CgroupV2, enable_controllers

__all__ = [
    "CGROUP_MOUNT",
    "CgroupLayout",
    "cgroup",
    "detect_layout",
    "host_layout",
    "prepare",
    "reset_layout",
]

log = logging.getLogger(__name__)

CGROUP_MOUNT = Path("/sys/fs/cgroup")
SUPERVISOR_LEAF = "dsec-supervisor"
"""The leaf dsec moves its own processes into when they sit in the base cgroup."""

_V1_NEEDED = ("cpu", "cpuacct", "memory", "pids", "freezer")


@dataclass(frozen=True)
class CgroupLayout:
    """The host's cgroup layout as dsec uses it.

    Attributes:
        mode: ``v2``, ``v1`` (hybrid included) or ``unsupported``.
        mount: where the cgroup filesystem(s) are mounted.
        base: v2: dsec's base cgroup, relative to ``mount`` ("" = the root); v1: "".
        hybrid: v1 controllers with a cgroup2 hierarchy beside them.
        controllers: the controllers dsec can use (v2: the base's ``cgroup.controllers``;
            v1: the mounted hierarchies among those dsec needs).
        missing: controllers dsec needs that this host does not give it.
        delegated: v2: the base is a systemd-delegated cgroup (``Delegate=yes``).
        reason: why the layout is unsupported or incomplete (None when fine).
        features: layout features found (``cgroup.kill``, ``memory.reclaim``, ...).
    """

    mode: Literal["v1", "v2", "unsupported"]
    mount: Path = CGROUP_MOUNT
    base: str = ""
    hybrid: bool = False
    controllers: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    delegated: bool = False
    reason: str | None = None
    features: dict[str, bool] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        """Whether dsec can confine sandboxes with it (limits, freezing, killing)."""
        return self.mode != "unsupported" and not self.missing

    @property
    def base_dir(self) -> Path:
        return self.mount / self.base if self.base else self.mount

    def describe(self) -> str:
        """One line for ``dsec doctor``: e.g. ``v2 (unified), base /system.slice/dsec.service
        (delegated by systemd)``."""
        if self.mode == "unsupported":
            return f"unsupported: {self.reason}"
        if self.mode == "v1":
            text = "v1 (hybrid: v1 controllers + cgroup2)" if self.hybrid else "v1"
        else:
            text = f"v2 (unified), base /{self.base}"
            if self.delegated:
                text += " (delegated by systemd)"
        if self.missing:
            text += f"; missing controllers: {', '.join(self.missing)}"
        return text

    def cgroup(self, rel: str) -> Cgroup:
        """The cgroup ``rel`` below dsec's base, in this layout's driver."""
        if self.mode == "v2":
            return CgroupV2(rel, self.base_dir, self.base)
        return CgroupV1(rel, self.mount)


def _own_cgroup_v2(proc_self_cgroup: Path) -> str:
    """This process's v2 cgroup (``0::/path``), relative, or "" if none is listed."""
    with contextlib.suppress(OSError):
        for line in proc_self_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip().strip("/")
    return ""


def _delegated(d: Path) -> bool:
    for name in ("trusted.delegate", "user.delegate"):
        with contextlib.suppress(OSError):
            if os.getxattr(d, name) == b"1":
                return True
    return False


def detect_layout(
    mount: Path = CGROUP_MOUNT,
    proc_self_cgroup: Path = Path("/proc/self/cgroup"),
    parent: str | None = None,
) -> CgroupLayout:
    """The layout at ``mount`` (pure reads; nothing is created). ``parent`` overrides the v2
    base (default: ``DSEC_CGROUP_PARENT``)."""
    if parent is None:
        parent = os.environ.get("DSEC_CGROUP_PARENT")
    if (mount / "cgroup.controllers").exists():
        delegated = False
        if parent is not None:
            base = parent.strip("/")
        else:
            own = _own_cgroup_v2(proc_self_cgroup)
            if own.endswith("/" + SUPERVISOR_LEAF):
                # moved by prepare() (or a child of a process it moved): systemd marks the
                # unit's cgroup delegated, not the leaf dsec made in it
                own = own[: -len(SUPERVISOR_LEAF) - 1]
            delegated = bool(own) and _delegated(mount / own)
            base = own if delegated else ""
        base_dir = mount / base if base else mount
        try:
            have = tuple((base_dir / "cgroup.controllers").read_text().split())
        except OSError as e:
            return CgroupLayout(
                "unsupported", mount, base, reason=f"cannot read the base cgroup /{base}: {e}"
            )
        missing = tuple(c for c in DELEGATED_CONTROLLERS if c not in have)
        features = {
            "cgroup.kill": (mount / "cgroup.procs").exists() and _kernel_at_least(5, 14),
            "cgroup.freeze": _kernel_at_least(5, 2),
            "memory.reclaim": _kernel_at_least(5, 19),
            "memory.peak": _kernel_at_least(5, 19),
        }
        reason = None
        if missing:
            reason = (
                f"the v2 cgroup /{base} does not offer the {', '.join(missing)} controller(s)"
                + (
                    " (set Delegate=yes in dsec's systemd unit)"
                    if base
                    else " (enable them in /sys/fs/cgroup/cgroup.subtree_control)"
                )
            )
        return CgroupLayout(
            "v2",
            mount,
            base,
            controllers=have,
            missing=missing,
            delegated=delegated,
            reason=reason,
            features=features,
        )
    hierarchies = {p.name for p in mount.iterdir()} if mount.is_dir() else set()
    if (mount / "memory" / "memory.limit_in_bytes").exists():
        missing = tuple(c for c in _V1_NEEDED if not (mount / c / "cgroup.procs").exists())
        hybrid = (mount / "unified" / "cgroup.controllers").exists()
        return CgroupLayout(
            "v1",
            mount,
            "",
            hybrid=hybrid,
            controllers=tuple(c for c in _V1_NEEDED if c in hierarchies),
            missing=missing,
            reason=f"no v1 {', '.join(missing)} hierarchy" if missing else None,
            features={"cgroup.kill": False, "memory.force_empty": True},
        )
    if (mount / "unified" / "cgroup.controllers").exists() or hierarchies:
        reason = (
            "cgroup v1 (systemd's legacy layout) without a v1 memory controller: this kernel "
            "was built without CONFIG_MEMCG_V1, so memory sits on the cgroup2 hierarchy where "
            "dsec cannot use it beside v1; boot with systemd.unified_cgroup_hierarchy=1 "
            "(cgroup v2)"
        )
    else:
        reason = f"no cgroup filesystem is mounted at {mount}"
    return CgroupLayout("unsupported", mount, reason=reason, missing=("memory",))


@functools.cache
def _kernel_release() -> tuple[int, int]:
    parts = os.uname().release.split(".")
    try:
        return int(parts[0]), int(parts[1].split("-")[0])
    except (IndexError, ValueError):
        return (0, 0)


def _kernel_at_least(major: int, minor: int) -> bool:
    return _kernel_release() >= (major, minor)


_LAYOUT: CgroupLayout | None = None


def host_layout() -> CgroupLayout:
    """This host's layout, detected once per process."""
    global _LAYOUT
    if _LAYOUT is None:
        _LAYOUT = detect_layout()
    return _LAYOUT


def reset_layout(layout: CgroupLayout | None = None) -> None:
    """Forget (or replace, for tests) the detected layout."""
    global _LAYOUT
    _LAYOUT = layout


def cgroup(rel: str) -> Cgroup:
    """Cgroup ``rel`` below dsec's subtree on this host."""
    return host_layout().cgroup(rel)


def prepare(layout: CgroupLayout | None = None) -> list[str]:
    """Make dsec's v2 base able to hold sandboxes: controllers enabled from the hierarchy's
    root down to the base, dsec's own processes moved out of the base into
    :data:`SUPERVISOR_LEAF` if they are there. Idempotent; nothing to do on v1. Returns
    what it did, for the node's log."""
    layout = layout or host_layout()
    done: list[str] = []
    if layout.mode != "v2":
        return done
    parts = [p for p in layout.base.split("/") if p]
    levels = [layout.mount] + [layout.mount.joinpath(*parts[: i + 1]) for i in range(len(parts))]
    for d in levels:
        try:
            enable_controllers(d)
        except OSError as e:
            if e.errno != errno.EBUSY or d != layout.base_dir:
                raise
            moved = _move_own_processes(d)
            done.append(
                f"moved {moved} process(es) of dsec from /{layout.base} into "
                f"/{layout.base}/{SUPERVISOR_LEAF} (no internal processes on v2)"
            )
            enable_controllers(d)
    return done


def _move_own_processes(base_dir: Path) -> int:
    """Move every process of ``base_dir`` into its :data:`SUPERVISOR_LEAF`: they are dsec's
    (the base is its delegated cgroup or the one its operator named)."""
    leaf = base_dir / SUPERVISOR_LEAF
    with contextlib.suppress(FileExistsError):
        leaf.mkdir()
    moved = 0
    for _ in range(10):  # processes forked while moving land in the base: go again
        pids = (base_dir / "cgroup.procs").read_text().split()
        if not pids:
            break
        for pid in pids:
            try:
                (leaf / "cgroup.procs").write_text(pid)
                moved += 1
            except OSError as e:
                if e.errno not in (errno.ESRCH, errno.EINVAL):
                    raise
    return moved


def controllers_v1() -> tuple[str, ...]:
    """The v1 hierarchies a dsec cgroup is made in."""
    return CONTROLLERS
