"""What one ``dsec serve`` holds on its node, as a snapshot to compare over time.

Nothing may grow with the number of sandboxes a server has created and destroyed:
zombies (``pid_max`` is 32768 here), processes, threads, file descriptors, mounts,
cgroups, network namespaces, files. :func:`server_footprint` measures all of them for one
server process and its ``DSEC_HOME``; :meth:`ServerFootprint.growth` says what grew
between two snapshots. Used by the leak test (``tests/integration/test_no_leaks_root.py``)
and the soak benchmark (``benchmarks/soak.py``)::

    before = server_footprint(srv.proc.pid, srv.home)
    ...  # thousands of create / exec / kill cycles
    after = server_footprint(srv.proc.pid, srv.home)
    assert not after.growth(before, threads=8, fds=16)
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsec.privileged.cgroups import host_layout
from dsec.privileged.loop import attached_loops
from dsec.privileged.reaper import child_pids, proc_stat

__all__ = ["ServerFootprint", "install_cgroups", "machine_tasks", "server_footprint"]

_SANDBOX_FS = ("overlay", "erofs", "nsfs", "tmpfs")


@dataclass
class ServerFootprint:
    """One snapshot (counts and, for what must return to its baseline, the names).

    ``zombies``: pids of zombie children of the server process; ``descendants``: every
    process below it (children, grandchildren...), zombies included; ``threads`` and
    ``fds`` of the server process; ``mounts``: overlay/erofs/fuse/nsfs/tmpfs mount points
    under its home; ``cgroups``: cgroup directories of this install (relative to the cgroup
    mount: per hierarchy on v1, below dsec's base cgroup on v2); ``netns``: pinned network
    namespace files and the network manager's per-sandbox records; ``links``: host network interfaces of this install (the host
    ends of sandboxes' veth pairs); ``sandbox_dirs``: entries of
    ``$DSEC_HOME/sandboxes``; ``oci_state``: containers in crun's/runc's state directories
    (``--root``) of this install; ``loop_devices``: loop devices bound to files under its
    home (layers mounted through loop devices); ``machine_tasks``: tasks (processes +
    threads, i.e. pids in use) on the whole machine.
    """

    zombies: list[int] = field(default_factory=list)
    descendants: int = 0
    threads: int = 0
    fds: int = 0
    mounts: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    sandbox_dirs: list[str] = field(default_factory=list)
    oci_state: list[str] = field(default_factory=list)
    loop_devices: list[str] = field(default_factory=list)
    machine_tasks: int = 0

    def counts(self) -> dict[str, int]:
        """Every field as a number (lists by their length)."""
        return {k: len(v) if isinstance(v, list) else int(v) for k, v in asdict(self).items()}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def growth(
        self,
        baseline: ServerFootprint,
        *,
        threads: int = 0,
        fds: int = 0,
        descendants: int = 0,
    ) -> dict[str, Any]:
        """What this snapshot holds beyond ``baseline``, allowing the given fixed slack for
        thread, fd and descendant counts (pools that size themselves on demand). Empty if
        nothing leaked. Zombies get no slack; mounts, cgroups, namespaces and sandbox dirs
        none either (compared by count, since warm pools replace their workers' cgroups
        with new names; the new names are reported). Zombies are those not already in
        ``baseline`` (a server inside a long test process may start beside zombies that are
        not its own; the leak tests check that a served baseline has none)."""
        out: dict[str, Any] = {}
        new_zombies = sorted(set(self.zombies) - set(baseline.zombies))
        if new_zombies:
            out["zombies"] = new_zombies
        for name in (
            "mounts",
            "cgroups",
            "netns",
            "links",
            "sandbox_dirs",
            "oci_state",
            "loop_devices",
        ):
            now, then = getattr(self, name), getattr(baseline, name)
            if len(now) > len(then):  # by count: warm pools rename their workers' cgroups
                out[name] = sorted(set(now) - set(then))
        for name, slack in (("threads", threads), ("fds", fds), ("descendants", descendants)):
            grew = getattr(self, name) - getattr(baseline, name)
            if grew > slack:
                out[name] = f"{getattr(baseline, name)} -> {getattr(self, name)} (slack {slack})"
        return out


def _descendants(pid: int) -> int:
    n, todo = 0, child_pids(pid)
    while todo:
        p = todo.pop()
        n += 1
        todo.extend(child_pids(p))
    return n


def install_cgroups(home: Path) -> list[str]:
    """Every cgroup directory of the install at ``home``, relative to the cgroup mount: on v1
    in every hierarchy (``<hierarchy>/<path>``), on v2 below dsec's base cgroup
    (``<base>/<path>``). Each tier's parent is named ``dsec-<sha256(home)>...``."""
    digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()
    out: list[str] = []
    layout = host_layout()
    # where dsec's top-level cgroups are: each v1 hierarchy's root, or the v2 base
    for h in sorted(layout.cgroup("").every_dir()):
        try:
            tops = [p for p in h.iterdir() if p.is_dir() and p.name.startswith("dsec-")]
        except OSError:
            continue
        for top in tops:
            tag = top.name[5:].split("-", 1)[0]
            if len(tag) < 8 or not digest.startswith(tag):
                continue
            for dirpath, dirnames, _ in os.walk(top):
                out.append(os.path.relpath(dirpath, layout.mount))
                dirnames.sort()
    return sorted(out)


def machine_tasks() -> int:
    """Tasks (processes and threads: each holds a pid) on the machine, from /proc/loadavg."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return 0


def _mounts_under(home: Path, pid: int | None = None) -> list[str]:
    """Sandbox mounts under ``home`` in the mount namespace of ``pid`` (``dsec serve`` keeps
    its own: :mod:`dsec.privileged.mountns`), else of this process."""
    prefix = str(home.resolve()) + "/"
    out: list[str] = []
    try:
        f = open(f"/proc/{pid}/mountinfo" if pid else "/proc/self/mountinfo")
    except OSError:  # the server is gone: its namespace with it
        return []
    with f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split(" ")
            fstype = right.split(" ", 1)[0]
            mountpoint = fields[4] if len(fields) > 4 else ""
            if mountpoint.startswith(prefix) and (
                fstype in _SANDBOX_FS or fstype.startswith("fuse")
            ):
                out.append(f"{fstype} {mountpoint}")
    return sorted(out)


def _loops_under(home: Path) -> list[str]:
    """Loop devices bound to files under ``home`` (EROFS layers mounted through loop
    devices, :mod:`dsec.privileged.loop`), as ``/dev/loopN <file>``."""
    prefix = str(home.resolve()) + "/"
    return sorted(f"{d} {f}" for d, f in attached_loops().items() if f.startswith(prefix))


def _install_links(home: Path) -> list[str]:
    """Host interfaces named after this install's network manager (``dsv<tag>...``, the
    tag from its state directory ``$DSEC_HOME/net``; see dsec.network.manager)."""
    tag = hashlib.sha256(str((home / "net").resolve()).encode()).hexdigest()[:4]
    return [n for n in _listdir(Path("/sys/class/net")) if n.startswith(f"dsv{tag}")]


def _oci_state(home: Path) -> list[str]:
    """Container state entries of this install's OCI runtimes and the container tier's
    state files: ``/dev/shm/<cgroup parent>/{crun,runc,sandbox-state}`` and
    ``$DSEC_HOME/run/{crun,runc}`` (dsec.runtimes.container)."""
    parent = "dsec-" + hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:10]
    out: list[str] = []
    for base in (Path("/dev/shm") / parent, home / "run"):
        for name in ("crun", "runc", "sandbox-state"):  # sandbox-state: their state.json
            out.extend(f"{base / name}/{n}" for n in _listdir(base / name))
    return out


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def server_footprint(pid: int, home: Path) -> ServerFootprint:
    """Measure server process ``pid`` (root: its fds and the cgroup tree are read)."""
    zombies = []
    for child in child_pids(pid):
        st = proc_stat(child)
        if st is not None and st.state == "Z":
            zombies.append(child)
    try:
        threads = len(os.listdir(f"/proc/{pid}/task"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        threads = fds = 0
    return ServerFootprint(
        zombies=sorted(zombies),
        descendants=_descendants(pid),
        threads=threads,
        fds=fds,
        mounts=_mounts_under(home, pid),
        cgroups=install_cgroups(home),
        netns=[
            *(f"netns/{n}" for n in _listdir(home / "net" / "netns")),
            *(f"records/{n}" for n in _listdir(home / "net" / "records")),
        ],
        links=_install_links(home),
        sandbox_dirs=_listdir(home / "sandboxes"),
        oci_state=_oci_state(home),
        loop_devices=_loops_under(home),
        machine_tasks=machine_tasks(),
    )
