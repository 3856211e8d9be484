"""The ``container`` tier: an OCI bundle run by crun (or runc) over layered EROFS.

One sandbox is::

    overlay rootfs (EROFS layers, tmpfs upper capped at disk_mb)   dsec.layers.rootfs
    OCI container: pid/mount/ipc/uts/net/cgroup namespaces,        bundle.oci_config
        cgroup limits under <dsec-HASH>/<sandbox id> (v1 or v2),
        seccomp deny list, minimal capabilities, no_new_privs,
        PID 1 = dsec_init (static, bind-mounted read-only)
    dsec_execd: exec server in the host pid namespace             execd.ExecServer
    host-side file access confined with openat2(RESOLVE_IN_ROOT)  files.RootedFiles

Creation: acquire layer mounts -> assemble the overlay -> write config.json ->
spawn the exec server -> ``crun run --detach`` -> attach the exec server. Exec never goes
through the OCI runtime (``crun exec`` costs ~7 ms; the exec server ~1 ms; see
``docs/design/container.md``).

Example::

    rt = ContainerRuntime(Paths.from_env(), LayerMounts(paths.layer_mounts))
    await rt.start()
    handle = await rt.create(spec)
    result = await rt.exec(handle, ExecRequest(cmd="echo hi"))
    await rt.destroy(handle)
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.config import Paths, host_memory_mb
from dsec.contract.runtime import Handle, OutputSink, RuntimeFacts, SandboxFiles, SandboxSpec
from dsec.errors import (
    CapabilityNotSupported,
    Conflict,
    DsecError,
    InvalidRequest,
    NodeBusy,
    PayloadTooLarge,
    SandboxError,
    SandboxNotFound,
    SandboxStopped,
    TierUnavailable,
)
from dsec.layers.mounts import LayerMounts
from dsec.layers.rootfs import (
    assemble_rootfs,
    detach_rootfs,
    freeze_upper,
    frozen_data,
    mask_dir,
    mount_init_dir,
    mount_sandbox_root,
    release_frozen,
    release_init_dir,
    release_sandbox_root,
    rootfs_path,
    teardown_rootfs,
    upper_dir,
)
from dsec.models import ExecRequest, ExecResult, LayerInfo, SnapshotRequest
from dsec.privileged.cgroups import Cgroup, cgroup, host_layout, prepare
from dsec.privileged.fileattr import set_immutable
from dsec.privileged.launchns import LaunchNamespace, open_launch_namespace
from dsec.privileged.mount import mounts_below_root, open_tree_clone
from dsec.privileged.netns import NetnsSockets
from dsec.privileged.nodesetup import NodeReport, oci_timeout_s, prepare_node
from dsec.privileged.reaper import REAPER, reap_pid, where_are
from dsec.privileged.seccomp_log import audit_id_of, audit_on
from dsec.runtimes.sockets import connect_socket

if TYPE_CHECKING:
    from dsec.contract.streams import PortStream
from dsec.runtimes.container import pause as pausing
from dsec.runtimes.container.bundle import (
    DEFAULT_PATH,
    cgroup_parent,
    execd_policy_text,
    oci_config,
)
from dsec.runtimes.container.execd import ExecServer, InteractiveExecution, TerminalSize
from dsec.runtimes.container.files import RootedFiles
from dsec.runtimes.container.native import build_native
from dsec.runtimes.container.pool import PoolConfig, WarmPool
from dsec.runtimes.container.state import ContainerLimits, ContainerState
from dsec.runtimes.container.users import ResolvedUser, resolve_user
from dsec.runtimes.container.watch import WatchHub
from dsec.runtimes.usage import (
    NetCounters,
    SandboxUsage,
    disk_usage,
    processes_cpu_ns,
    read_veth_counters,
)

__all__ = ["ContainerRuntime"]

log = logging.getLogger(__name__)

_OCI_TIMEOUT_S = oci_timeout_s()
"""How long one OCI runtime command may take, seconds (``DSEC_OCI_TIMEOUT_S``, default 30)."""
_USER_DB_MAX_BYTES = 4 << 20


@dataclass
class _Live:
    """What the runtime keeps in memory for a running sandbox."""

    server: ExecServer | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: int = 0  # commands running (exec and interactive processes)
    busy_since: int = 0  # bumped at each idle -> busy switch: a stale boost timer sees it
    paused: int = 0  # bumped at each pause and resume: a stale reclaim timer sees it
    reclaimed: bool = False  # the memory of its current pause was given back
    disk_full: int = 0  # times its writable layer was found full (after a command, a sample)
    disk_was_full: bool = False  # ... and whether it still was at the last look


@dataclass
class _Warm:
    """A container of the warm pool: made under its own id, which its cgroups keep when it is
    claimed (its directory and OCI state take the sandbox's)."""

    id: str
    state: ContainerState
    live: _Live


# (layer digests, layer files, writable layer MiB, hostname, setuid allowed, CPU group, layer
# mount scope): what a running container keeps
_PoolKey = tuple[tuple[str, ...], tuple[str, ...], int, str, bool, str, str]
_GROUP_PREFIX = "key-"
"""Names the cgroup of a CPU share group (a key's sandboxes) under the install's parent:
``<dsec-HASH>/key-<owner>/<sandbox>``; sandbox ids never start with it."""
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
GROUP_LINGER_S = 30.0
"""How long an emptied CPU share group's cgroup stays for the key's next sandbox."""
_WARM_PREFIX = "wp-"
_POOL_HOSTNAME = "sandbox"
"""The hostname the edge gives sandboxes that are not forks (``EdgeAgent._spec``): the pool
key whose warm containers a shared fork's children are made from."""
_WARM_NICE = 10  # niceness of the OCI runtime making a warm container (its init: until claimed)


_BOOT_ID_FILE = "boot_id"


def _new_boot_id(sandbox_dir: Path) -> Path:
    """Write a new random boot id (a UUID, as the kernel's) into ``sandbox_dir``'s file that
    is bound over the sandbox's ``/proc/sys/kernel/random/boot_id``; in place, so the bind
    mount shows it at once. The file is then made immutable: crun's read-only rebind of
    ``/proc/sys`` leaves a writable copy of the bind on top, and a sandbox's root could write
    the node's file (and fill the node-wide sandbox tmpfs through it); an immutable file
    refuses every writer without ``CAP_LINUX_IMMUTABLE``, which sandboxes never hold."""
    path = sandbox_dir / _BOOT_ID_FILE
    set_immutable(path, False)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o444)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{uuid.uuid4()}\n".encode(), 0)
    finally:
        os.close(fd)
    set_immutable(path, True)
    return path


class _RerootFailed(Exception):
    """A claimed warm container could not be moved onto a fork child's root (it is
    destroyed; the child is made fresh instead). Internal: never reaches a caller of the
    runtime, so it is no class of the documented error tree (:mod:`dsec.errors`)."""


def _kill_all_but(cg: Cgroup, keep: int | None, timeout_s: float = 5.0) -> None:
    """SIGKILL every process of ``cg`` but ``keep`` (host pid), frozen while it is done (no
    process forks past it), and wait until they are gone."""
    cg.freeze()
    try:
        for pid in cg.procs():
            if pid != keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        cg.thaw()
    deadline = time.monotonic() + timeout_s
    while any(pid != keep for pid in cg.procs()):
        if time.monotonic() > deadline:
            raise SandboxError("processes of the sandbox did not die in time")
        time.sleep(0.01)


def _proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None if gone/zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2 :].split()
    if not rest or rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


CgroupMounts = tuple[dict[str, tuple[str, str]], tuple[str, str] | None]


def _cgroup_mounts() -> CgroupMounts:
    """v1 hierarchies (each controller or ``name=``) -> (mountpoint, root), and cgroup2's."""
    v1: dict[str, tuple[str, str]] = {}
    v2: tuple[str, str] | None = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.rstrip("\n").partition(" - ")
            fields, rest = left.split(" "), right.split(" ")
            if len(rest) < 3 or len(fields) < 5:
                continue
            if rest[0] == "cgroup2":
                v2 = (fields[4], fields[3])
            elif rest[0] == "cgroup":
                for opt in rest[2].split(","):
                    if (opt not in ("rw", "ro") and "=" not in opt) or opt.startswith("name="):
                        v1[opt] = (fields[4], fields[3])
    return v1, v2


CONFINING_V1 = frozenset({"cpu", "cpuacct", "cpuset", "memory", "pids", "freezer", "devices"})
"""The v1 controllers that confine or account a sandbox's processes (limits, freezing,
killing, device access): an exec server joins the container's cgroup in these hierarchies
only. The others (blkio, hugetlb, net_cls, net_prio, perf_event, rdma, misc, name=systemd)
set nothing for a sandbox, and each ``cgroup.procs`` write holds the kernel's cgroup_mutex
through an RCU grace period: 5 writes where the container's init needed 12."""


def cgroup_procs_files(
    pid: int, mounts: CgroupMounts | None = None, *, confining_only: bool = False
) -> list[Path]:
    """The ``cgroup.procs`` files (host paths) of every cgroup ``pid`` is in
    (``confining_only``: on v1, of the hierarchies of :data:`CONFINING_V1` only).

    ``mounts``: a cached :func:`_cgroup_mounts` result (parsing mountinfo costs ~0.5 ms)."""
    v1, v2 = mounts if mounts is not None else _cgroup_mounts()
    out: list[Path] = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if confining_only and ctrls and not CONFINING_V1.intersection(ctrls.split(",")):
            continue
        mnt = v2 if ctrls == "" else v1.get(ctrls.split(",")[0])
        if mnt is None:
            continue
        mountpoint, root = mnt
        if root != "/" and path.startswith(root):
            path = path[len(root) :]
        f = Path(mountpoint + path.rstrip("/")) / "cgroup.procs"
        if f.exists():
            out.append(f)
    return out


class ContainerRuntime:
    """:class:`~dsec.contract.runtime.Runtime` of the ``container`` tier (crun or runc).

    Args:
        paths: the node's directories (``DSEC_HOME``).
        layer_mounts: reference-counted EROFS mounts, per key (see ``layers/mounts.py``).
        oci_runtime: ``crun``, ``runc`` or a path; default: crun, runc if crun cannot work.
        pool: the warm pool's sizes (default :meth:`PoolConfig.from_env`; see ``pool.py``).
        idle_cpu_shares: the ``cpu.shares`` of a sandbox with no command running (default
            ``DSEC_IDLE_CPU_SHARES`` or 2; 0: off, every sandbox keeps its full weight). While
            a command runs a sandbox has ``1024 x cpu`` shares: under contention an idle
            crowd's background processes yield to the sandboxes that work. Its CFS quota
            (the ``cpu`` limit) holds either way.
    """

    tier = "container"

    def __init__(
        self,
        paths: Paths,
        layer_mounts: LayerMounts,
        *,
        oci_runtime: str | None = None,
        network: Any = None,
        pool: PoolConfig | None = None,
        idle_cpu_shares: int | None = None,
    ) -> None:
        self.paths = paths
        self.network = network  # a dsec.network.NetworkManager, or None (loopback only)
        self.layer_mounts = layer_mounts
        self._preferred = oci_runtime
        self.cgroup_parent = cgroup_parent(paths.home)
        self.node: NodeReport | None = None
        self._oci: str | None = None
        self._unavailable: str | None = "not started"
        self._init_bin: Path | None = None
        self._init_dir = self.paths.run / "container-init"  # mount_init_dir's tmpfs
        self._execd_bin: Path | None = None
        self.log_denials = audit_on()
        """Commands' seccomp refusals go to the kernel's audit stream (``DSEC_AUDIT``)."""
        self.log_landlock = False
        """Commands' own Landlock domains log nothing (see docs/cheating.md)."""
        self._live: dict[str, _Live] = {}
        self._launch: LaunchNamespace | None = None  # where crun runs (privileged/launchns.py)
        self._groups: dict[str, set[str]] = {}  # CPU share group -> its sandboxes (warm too)
        self._group_shares: dict[str, int] = {}  # CPU share group -> the shares it was given
        self._group_linger: dict[str, asyncio.TimerHandle] = {}  # emptied groups, until removed
        self._cgroup_mounts: CgroupMounts | None = None
        self._memsw = False  # the memory limit also bounds swap (found at start)
        self._state_base_cached: Path | None = None
        self._policy_file: Path | None = None
        self._bpf_file: Path | None = None  # the policy's compiled seccomp program
        self._seccomp_bpf: bytes | None = None  # the policy compiled once, handed to crun
        self._node_size: tuple[float, int] | None = None  # (cores, MiB) of this node
        self._watch_hub = WatchHub()
        """The node's one inotify instance, shared by every directory watch (``watch.py``)."""
        # sandbox id -> the layers we hold for it, (scope, digest)
        self._acquired: dict[str, list[tuple[str, str]]] = {}
        self._netns_sockets: NetnsSockets | None = None  # made on the first port connection
        self.pool: WarmPool[_PoolKey, SandboxSpec, _Warm] = WarmPool(
            pool or PoolConfig.from_env(), make=self._make_warm, discard=self._discard_warm
        )
        self._warm_ids: set[str] = set()  # warm containers, made and not claimed
        self.pause_reclaim_after_s = _reclaim_after_from_env()
        """A paused sandbox's memory is reclaimed once it has been paused this long
        (``DSEC_PAUSE_RECLAIM_AFTER_S``, default 5; 0: at once, as part of the pause). An
        agent's sandbox paused while its model thinks for a few seconds keeps its page cache
        (reclaimed, every command after it read its programs from the layers again: 500
        agents pausing between turns ran their commands 2-3x slower than without pauses)."""
        self._reclaims: set[asyncio.Task[None]] = set()
        # frozen uppers (shared forks): id -> the sandboxes that stack on it or have it as
        # their frozen writable layer; released when none is left
        self._frozen_refs: dict[str, set[str]] = {}
        self.exec_boost, self.exec_boost_s = _exec_boost_from_env()
        """A command starting in an idle sandbox runs at ``exec_boost`` times the sandbox's
        weight for its first ``exec_boost_s`` seconds (``DSEC_EXEC_BOOST``, default 8, 1 for
        none; ``DSEC_EXEC_BOOST_MS``, default 200)."""
        self.idle_cpu_shares = (
            idle_cpu_shares if idle_cpu_shares is not None else _idle_shares_from_env()
        )

    # ------------------------------------------------------------------ node
    @property
    def state_root(self) -> Path:
        """The OCI runtime's state directory (``--root``) for this install.

        On a tmpfs when one is safely usable (``/dev/shm/<cgroup parent>/``): crun writes a
        few files per container there, and on ext4 their inode allocation cost ~5 ms of each
        creation here. Falls back to ``paths.run``."""
        name = os.path.basename(self._oci or self._preferred or "crun")
        return self._state_base() / name

    def _state_roots(self) -> list[Path]:
        """Every place a container of this install may have state (for orphan scans)."""
        bases = [self._state_base(), self.paths.run]
        return [b / n for b in dict.fromkeys(bases) for n in ("crun", "runc")]

    def _state_base(self, *, make: bool = False) -> Path:
        """Where the OCI and sandbox state go. Only :meth:`start` makes the tmpfs directory
        (``make``): a runtime that is only asked (orphan scans, a runtime never started)
        leaves nothing in ``/dev/shm``."""
        if self._state_base_cached is None or make:
            self._state_base_cached = (
                _private_tmpfs_dir(self.cgroup_parent, make=make) or self.paths.run
            )
        return self._state_base_cached

    @property
    def oci_runtime(self) -> str | None:
        """Path of the OCI runtime in use (None until :meth:`start`, or if none works)."""
        return self._oci

    def facts(self) -> RuntimeFacts:
        if self._node_size is None:  # read once: asked twice per create (/proc/meminfo)
            self._node_size = (float(os.cpu_count() or 1), host_memory_mb())
        return RuntimeFacts(
            available=self._unavailable is None,
            reason=self._unavailable,
            max_cpu=self._node_size[0],
            max_memory_mb=self._node_size[1],
            network_ready=self.network is not None and bool(self.network.started),
            sink_sees_all_output=True,
            # the teardown SIGKILLs the init first thing: the sandbox's processes are gone
            # within the kill's own millisecond
            teardown_in_background=True,
        )

    async def start(self) -> None:
        """Build the native helpers and prepare the node (idempotent). Never raises for an
        unusable node: the capability table then says why."""
        self.paths.ensure()
        self._state_base(make=True)
        await asyncio.to_thread(mount_sandbox_root, self.paths.sandboxes)
        try:
            init = await asyncio.to_thread(build_native, self.paths.bin, "dsec_init")
            # bound into every container from a tmpfs of its own: no host path in its mountinfo
            self._init_bin = await asyncio.to_thread(mount_init_dir, self._init_dir, init)
            self._execd_bin = await asyncio.to_thread(build_native, self.paths.bin, "dsec_execd")
            launcher = await asyncio.to_thread(build_native, self.paths.bin, "dsec_launch")
        except SandboxError as e:
            self._unavailable = e.message
            log.error("container tier unavailable: %s", e.message)
            return
        layout = host_layout()
        # (v1 without cpuacct or freezer still runs containers, as it always has)
        if layout.mode == "unsupported" or (layout.mode == "v2" and not layout.usable):
            self._unavailable = (
                f"the container tier needs cgroups to confine sandboxes: {layout.reason}"
            )
            log.error("container tier unavailable: %s", self._unavailable)
            return
        try:  # v2: dsec's base able to hold sandboxes (before the OCI runtime's probe)
            for note in await asyncio.to_thread(prepare, layout):
                log.info("container tier: %s", note)
        except OSError as e:
            self._unavailable = f"the container tier cannot prepare its cgroups: {e}"
            log.error("container tier unavailable: %s", self._unavailable)
            return
        init_bin = self._init_bin
        self.node = await asyncio.to_thread(prepare_node, self.paths, init_bin, self._preferred)
        self._oci = self.node.oci_runtime
        self._cgroup_mounts = _cgroup_mounts()  # after node setup (it may mount hugetlb)
        try:  # the install's parent: v2 asks it whether swap is accounted
            parent = cgroup(self.cgroup_parent)
            await asyncio.to_thread(parent.create)
            await asyncio.to_thread(parent.prefill_cpusets)
            self._memsw = parent.accounts_swap()
        except OSError as e:
            log.warning("container tier: cgroup %s: %s", self.cgroup_parent, e)
        # one policy file per install and policy version, shared by every exec server
        policy = execd_policy_text()
        digest = hashlib.sha256(policy.encode()).hexdigest()[:16]
        self._policy_file = self.paths.run / f"execd-{digest}.policy"
        if not self._policy_file.exists():
            _replace_file(self._policy_file, policy.encode())
        # the policy compiled once: crun gets the program in each config, every exec server
        # installs it from the file instead of compiling the same rules at its start
        assert self._execd_bin is not None
        bpf = await asyncio.to_thread(_compile_seccomp, self._execd_bin, self._policy_file)
        self._seccomp_bpf = None
        self._bpf_file = None
        if bpf is not None:
            self._bpf_file = self._policy_file.with_name(f"{self._policy_file.stem}.bpf")
            _replace_file(self._bpf_file, bpf)
            if self._oci is not None and os.path.basename(self._oci) == "crun":
                self._seccomp_bpf = bpf
        if self._oci is None:
            self._unavailable = f"no working OCI runtime: {self.node.reason}"
            log.error("container tier unavailable: %s", self._unavailable)
            return
        # last: what the OCI runtime opens by path must be there before the copy
        prune = [self.paths.sandboxes]
        if self.network is not None:
            prune.append(self.network.netns_dir)
        if self._launch is not None:
            self._launch.close()
        self._launch = await asyncio.to_thread(
            open_launch_namespace, self.paths.run, launcher, prune
        )
        self._unavailable = None
        log.info(
            "container tier: %s (%s)", self._oci, self.node.reason or "preferred runtime works"
        )

    async def close(self) -> None:
        """Stop talking to the sandboxes (they keep running; :meth:`recover` finds them).
        Warm containers of the pool are destroyed."""
        await self.pool.close()
        # a warm container is never recovered (no registry row names it): one the pool could
        # not discard (a kill that failed under load) or whose making failed half-way is
        # destroyed from what the node shows, so nothing of it outlives the runtime
        for wid in self._leftover_warm():
            try:
                await self.destroy_orphan(wid)
            except Exception as e:
                log.warning("warm container %s left after close: %s", wid, e)
        for task in list(self._reclaims):
            task.cancel()
        if self._launch is not None:
            self._launch.close()
            self._launch = None
        self._watch_hub.close()
        if self._netns_sockets is not None:
            self._netns_sockets.close()
            self._netns_sockets = None
        for live in list(self._live.values()):
            if live.server is not None:
                with contextlib.suppress(Exception):
                    await live.server.close()
        self._live.clear()
        # the per-install parent cgroup and state dirs go once no sandbox is left in them
        parent = cgroup(self.cgroup_parent)
        for timer in self._group_linger.values():
            timer.cancel()
        self._group_linger.clear()
        for name in parent.children():
            if name.startswith(_GROUP_PREFIX):
                with contextlib.suppress(OSError):
                    parent.child(name).remove_if_empty()
        self._groups.clear()
        self._group_shares.clear()
        parent.remove_if_empty()
        for root in self._state_roots():
            with contextlib.suppress(OSError):
                root.rmdir()
        if self._state_base() != self.paths.run:
            with contextlib.suppress(OSError):
                (self._state_base() / "sandbox-state").rmdir()
            with contextlib.suppress(OSError):
                self._state_base().rmdir()
        release_sandbox_root(self.paths.sandboxes)
        if self._init_bin is not None:
            release_init_dir(self._init_dir)

    # ------------------------------------------------------------------ helpers
    def _sandbox_dir(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id in (".", ".."):
            raise InvalidRequest(f"invalid sandbox id {sandbox_id!r}")
        return self.paths.sandboxes / sandbox_id

    def _cgroup_rel(self, sandbox_id: str, group: str = "") -> str:
        if group:
            return f"{self.cgroup_parent}/{group}/{sandbox_id}"
        return f"{self.cgroup_parent}/{sandbox_id}"

    # ------------------------------------------------------------------ CPU share groups
    def _join_group(self, sandbox_id: str, group: str, weight: int) -> None:
        """Count ``sandbox_id`` in CPU share group ``group`` (a key's sandboxes), making its
        cgroup (``<parent>/<group>``) with ``weight`` when it is the first, and setting the
        weight when the operator changed it. On the loop: :meth:`_leave_group` removes the
        group's cgroup only once no sandbox counts in it."""
        if not group:
            return
        members = self._groups.get(group)
        shares = max(2, min(262_144, weight * 1024 // 100))
        lingering = self._group_linger.pop(group, None)
        if lingering is not None:  # emptied a moment ago: its cgroup is still there
            lingering.cancel()
            members = self._groups[group] = set()
        if members is None:
            cg = cgroup(f"{self.cgroup_parent}/{group}")
            cg.create()
            cg.enable_child_controllers()  # v2: its sandboxes get the controllers
            cg.set_cpu_shares(shares)
            members = self._groups[group] = set()
            self._group_shares[group] = shares
        elif self._group_shares.get(group) != shares:
            with contextlib.suppress(OSError):
                cgroup(f"{self.cgroup_parent}/{group}").set_cpu_shares(shares)
                self._group_shares[group] = shares
        members.add(sandbox_id)

    def _leave_group(self, sandbox_id: str, group: str) -> None:
        """Stop counting ``sandbox_id`` in ``group``; the last one out removes its cgroup
        :data:`GROUP_LINGER_S` later if no sandbox joined meanwhile (a key creating and
        killing one sandbox at a time would otherwise make and remove it each time: cgroup
        mkdir and rmdir in every v1 hierarchy, each under the kernel's cgroup_mutex)."""
        members = self._groups.get(group)
        if members is None:
            return
        members.discard(sandbox_id)
        if members:
            return
        del self._groups[group]
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._drop_group(group)
            return
        self._group_linger[group] = loop.call_later(GROUP_LINGER_S, self._drop_group, group)

    def _drop_group(self, group: str) -> None:
        self._group_linger.pop(group, None)
        if group in self._groups:  # joined again meanwhile
            return
        self._group_shares.pop(group, None)
        with contextlib.suppress(OSError):
            cgroup(f"{self.cgroup_parent}/{group}").remove_if_empty()

    def _require_available(self) -> tuple[str, Path, Path]:
        if self._unavailable is not None or not (self._oci and self._init_bin and self._execd_bin):
            raise TierUnavailable(f"the container tier is unavailable: {self._unavailable}")
        return self._oci, self._init_bin, self._execd_bin

    def _oci_cmd(self, *args: str) -> list[str]:
        assert self._oci is not None
        if args and args[0] == "run":
            # no session keyring per container: joining one by name scans them all (O(live
            # sandboxes)), and the sandboxes' seccomp policy refuses the keyring calls
            args = ("run", "--no-new-keyring", *args[1:])
        return [self._oci, "--root", str(self.state_root), *args]

    def _run_oci(
        self,
        *args: str,
        nice: int = 0,
        launch_root: Path | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> subprocess.CompletedProcess[str]:
        """Run the OCI runtime with ``args``. ``nice``: a warm container of the pool's
        refill, which yields the CPU to requests: the runtime's niceness is raised as soon
        as it is started (before, a ``nice`` program was exec'd in front of it: one more
        process start for every warm container). ``launch_root``: a new container's root,
        run in the launch namespace with it (:mod:`dsec.privileged.launchns`) when the node
        has one. ``pass_fds``: descriptors the runtime inherits."""
        cmd = self._oci_cmd(*args)
        tree_fd: int | None = None
        if launch_root is not None and self._launch is not None:
            cmd, tree_fd = self._launch.command(cmd, launch_root)
            pass_fds = (*pass_fds, tree_fd)
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                pass_fds=pass_fds,
            )
        finally:
            if tree_fd is not None:
                os.close(tree_fd)
        with proc:
            if nice:
                with contextlib.suppress(OSError):  # it may have exited already
                    os.setpriority(os.PRIO_PROCESS, proc.pid, nice)
            try:
                out, err = proc.communicate(timeout=_OCI_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                where = where_are(proc.pid)  # e.g. a kernel lock it or its child waits on
                proc.terminate()  # dsec_launch: kills the runtime, detaches the root, exits
                try:
                    proc.communicate(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()
                log.warning("%s %s timed out: %s", os.path.basename(cmd[0]), args[0], where)
                raise NodeBusy(  # where it waited: in the log only (kernel internals)
                    f"{os.path.basename(cmd[0])} {args[0]} did not finish within "
                    f"{_OCI_TIMEOUT_S:g} s: the node is overloaded; nothing was created, retry",
                    retry_after_s=5,
                ) from None
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _read_rootfs_file(self, rootfs: Path, path: str) -> str | None:
        try:
            return RootedFiles(rootfs).read_now(path, _USER_DB_MAX_BYTES).decode(errors="replace")
        except DsecError as e:
            if isinstance(e, PayloadTooLarge):
                raise InvalidRequest(f"the sandbox's {path} is too large to parse") from e
            return None

    def _resolve_user(self, rootfs: Path, spec: str | None) -> ResolvedUser:
        if spec is None or spec in ("0", "0:0"):
            return ResolvedUser(0, 0, "root", "/root")  # no need to read /etc/passwd
        passwd = self._read_rootfs_file(rootfs, "/etc/passwd")
        group = self._read_rootfs_file(rootfs, "/etc/group")
        return resolve_user(spec, passwd, group)

    def _state_file(self, sandbox_id: str) -> Path:
        """Where ``sandbox_id``'s ``state.json`` is: on the private tmpfs of the OCI state
        (``/dev/shm/<cgroup parent>/sandbox-state/<id>.json``) when there is one, else in
        its sandbox directory. On ext4 each rewrite of the file (a rename over the old one)
        made ext4 flush the new data first (``auto_da_alloc``): ~3 ms of every create under
        load. A node reboot clears the tmpfs, but also every container it describes."""
        base = self._state_base()
        if base == self.paths.run:
            return self._sandbox_dir(sandbox_id) / "state.json"
        self._sandbox_dir(sandbox_id)  # validates the id
        return base / "sandbox-state" / f"{sandbox_id}.json"

    def _write_state(self, sandbox_id: str, state: ContainerState) -> None:
        path = self._state_file(sandbox_id)
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state.dump()))
        os.replace(tmp, path)

    def _drop_state(self, sandbox_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._state_file(sandbox_id).unlink()

    def _load_state(self, handle: Handle) -> ContainerState:
        """The sandbox's state: its handle's (parsed once), else its ``state.json`` (not
        kept in the handle), else an empty one."""
        if handle.state:
            return handle.typed(ContainerState)
        # the tmpfs file, or the sandbox directory's (a sandbox made by an older dsec)
        for path in dict.fromkeys(
            (self._state_file(handle.id), self._sandbox_dir(handle.id) / "state.json")
        ):
            try:
                return ContainerState.model_validate_json(path.read_text())
            except (OSError, ValueError):
                continue
        return ContainerState()

    def _cgroup_of(self, sandbox_id: str, state: ContainerState) -> str:
        """The sandbox's cgroup (relative): its state's, else the default path of its id."""
        return state.cgroup or self._cgroup_rel(sandbox_id)

    # ------------------------------------------------------------------ create
    async def create(self, spec: SandboxSpec) -> Handle:
        """Create and start one sandbox. ~15-25 ms on an idle node (see the design doc)."""
        self._require_available()
        if len(spec.layer_paths) != len(spec.layer_digests) or not spec.layer_paths:
            raise InvalidRequest("a container needs at least one layer (paths and digests paired)")
        sandbox_dir = self._sandbox_dir(spec.id)
        if sandbox_dir.exists() or spec.id in self._live:
            raise InvalidRequest(f"sandbox {spec.id} already exists on this node")
        if spec.network is not None:
            self._require_network()  # before a warm container is spent on it
        # the pool's containers have the hostname of a sandbox that is not a fork: a spec
        # that asks for its own (a packed fork's child, stacked on a layer made for its
        # group alone) is made fresh, and its claim makes no pool key (each such key had
        # the pool make warm containers nobody would claim, up to the pool's limit)
        if not spec.id.startswith(_WARM_PREFIX) and spec.hostname == _POOL_HOSTNAME:
            warm = self.pool.take(_pool_key(spec, self.layer_mounts.scope_of(spec.owner)), spec)
            if warm is not None:
                return await self._claim(warm, spec, sandbox_dir)
        return await self._create_fresh(spec, sandbox_dir)

    async def _create_fresh(
        self, spec: SandboxSpec, sandbox_dir: Path, frozen: list[str] | None = None
    ) -> Handle:
        live = _Live()
        self._live[spec.id] = live
        async with live.lock:
            try:
                handle = await self._create(
                    spec, sandbox_dir, live, frozen or [], new_machine_id=bool(frozen)
                )
            except BaseException as e:
                try:
                    await self._destroy(Handle(spec.id), keep_live=True)
                except Exception as cleanup_error:  # keep the original error
                    log.error("cleanup of half-created %s failed: %s", spec.id, cleanup_error)
                self._live.pop(spec.id, None)
                self._leave_group(spec.id, _group_dir(spec.cpu_group))
                if isinstance(e, DsecError | asyncio.CancelledError):
                    raise
                raise SandboxError(f"creating sandbox {spec.id} failed: {e}") from e
        return handle

    async def _create(
        self,
        spec: SandboxSpec,
        sandbox_dir: Path,
        live: _Live,
        frozen: list[str],
        *,
        new_machine_id: bool = False,
    ) -> Handle:
        """Create ``spec`` in ``sandbox_dir``; ``frozen``: frozen uppers (ids, bottom first)
        stacked above the layers (shared forks); ``new_machine_id``: a non-empty
        ``/etc/machine-id`` of the root gets a new random id (a fork's child is another
        machine than its parent)."""
        oci, init_bin, execd_bin = self._require_available()
        t0 = time.monotonic()
        os.makedirs(sandbox_dir, mode=0o700)
        self._acquired[spec.id] = []
        lowers: list[Path] = []
        # the owner's own mounts (page cache) of the layers, or the node's: see layers/mounts.py
        scope = self.layer_mounts.scope_of(spec.owner)
        for digest, layer_file in zip(spec.layer_digests, spec.layer_paths, strict=True):
            lowers.append(self.layer_mounts.acquire(digest, Path(layer_file), scope))
            self._acquired[spec.id].append((scope, digest))
        for fid in frozen:
            self._hold_frozen(fid, spec.id)
            lowers.append(frozen_data(self._frozen_dir(fid)))
        group = _group_dir(spec.cpu_group)
        self._join_group(spec.id, group, spec.cpu_group_weight)
        state = ContainerState(
            oci_runtime=oci,
            state_root=str(self.state_root),
            cgroup=self._cgroup_rel(spec.id, group),
            cpu_group=group,
            layers=list(spec.layer_digests),
            layer_paths=list(spec.layer_paths),
            layer_scope=scope,
            hostname=spec.hostname,
            env=dict(spec.env),
            user=spec.user,
            workdir=spec.workdir,
            limits=_limits_of(spec),
            allow_setuid=spec.allow_setuid,
            disk_mb=spec.disk_mb,
            frozen=list(frozen),  # held (released at destroy)
            frozen_lowers=list(frozen),  # stacked, bottom first
            auid=audit_id_of(spec.id) if self.log_denials else None,
        )
        self._write_state(spec.id, state)  # destroy_orphan needs it from here on
        rootfs = assemble_rootfs(sandbox_dir, lowers, spec.disk_mb, frozen_lowers=len(frozen))
        if new_machine_id and (self._read_rootfs_file(rootfs, "/etc/machine-id") or "").strip():
            RootedFiles(rootfs).replace_now("/etc/machine-id", f"{uuid.uuid4().hex}\n".encode())
        t_rootfs = time.monotonic()
        default_user = self._resolve_user(rootfs, spec.user)
        state.uid, state.gid = default_user.uid, default_user.gid
        netns: str | None = None
        if spec.network is not None:
            netns = await self._attach_network(spec, state, rootfs)
        config = oci_config(
            rootfs=rootfs,
            init_binary=init_bin,
            hostname=spec.hostname,
            cgroups_path=cgroup(state.cgroup).oci_path(),
            cpu=spec.cpu,
            memory_mb=spec.memory_mb,
            pids=spec.pids,
            env=spec.env,
            memsw=self._memsw,
            # the highest weight while it starts: crun's set-up inside the cgroup and the
            # exec server's attach are the platform's work, not the tenant's (no tenant code
            # runs yet). At the idle weight (2) beside 40 sandboxes running commands a create
            # took up to 29 s; at the full weight (1024) beside 500 agents' commands (with
            # their exec boost) crun run took 0.3-1.4 s and the creation rate fell to 6/s.
            # Set to the idle weight once the server answers.
            cpu_shares=START_SHARES if self.idle_cpu_shares else None,
            boot_id_file=_new_boot_id(sandbox_dir),
            seccomp_bpf=self._seccomp_bpf,
            # binds, not a tmpfs each: fewer superblocks (bundle.SUPERBLOCKS_NOTE)
            mask_dir=mask_dir(self._init_dir) if init_bin.parent == self._init_dir else None,
        )
        netns_fd: int | None = None
        if netns is not None:
            if self._launch is not None:  # its pin is not in the launch namespace: by fd
                netns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
                netns = f"/proc/self/fd/{netns_fd}"
            for ns in config["linux"]["namespaces"]:
                if ns["type"] == "network":
                    ns["path"] = netns
        (sandbox_dir / "config.json").write_text(json.dumps(config))
        # the exec server starts (and loads its seccomp program) while the OCI runtime works
        assert self._policy_file is not None
        live.server = ExecServer.spawn(
            execd_bin,
            self._policy_file,
            bpf_file=self._bpf_file,
            allow_setuid=spec.allow_setuid,
            audit_id=state.auid,
        )
        pid_file = sandbox_dir / "init.pid"
        try:
            proc = await asyncio.get_running_loop().run_in_executor(
                _blocking_executor(),  # not asyncio's default executor (6 threads here)
                functools.partial(
                    self._run_oci,
                    nice=_WARM_NICE if spec.id.startswith(_WARM_PREFIX) else 0,
                    launch_root=rootfs,
                    pass_fds=(netns_fd,) if netns_fd is not None else (),
                ),
                "run",
                "--detach",
                "--pid-file",
                str(pid_file),
                "--bundle",
                str(sandbox_dir),
                spec.id,
            )
        finally:
            if netns_fd is not None:
                os.close(netns_fd)
        t_oci = time.monotonic()
        if proc.returncode != 0:
            detail = (proc.stderr or "").strip()[-1000:] or f"exit status {proc.returncode}"
            raise SandboxError(f"{os.path.basename(oci)} could not start the container: {detail}")
        init_pid = int(pid_file.read_text().strip())
        start_time = _proc_start_time(init_pid)
        if start_time is None:
            raise SandboxError("the container's init exited right after start")
        state.init_pid, state.init_start = init_pid, start_time
        # the init leads its own session and comes back to the edge (a subreaper) once
        # crun's monitor exits: announce it, so that it is reaped whenever it dies
        REAPER.expect(init_pid, start_time)
        await live.server.attach(
            init_pid, cgroup_procs_files(init_pid, self._cgroup_mounts, confining_only=True)
        )
        self._weigh_state(spec.id, state, active=False)  # no command runs yet
        if not spec.id.startswith(_WARM_PREFIX):  # a warm one is labelled when claimed
            _label_cgroup(state.cgroup, spec.id)
        t_end = time.monotonic()
        state.create_ms = {
            "rootfs": round((t_rootfs - t0) * 1000, 2),
            "oci_run": round((t_oci - t_rootfs) * 1000, 2),
            "exec_server": round((t_end - t_oci) * 1000, 2),
            "total": round((t_end - t0) * 1000, 2),
        }
        self._write_state(spec.id, state)
        return Handle.of(spec.id, state)

    def _require_network(self) -> Any:
        if self.network is None:
            raise CapabilityNotSupported(
                "networking is not enabled on this node (the network manager did not start)"
            )
        return self.network

    async def _attach_network(
        self, spec: SandboxSpec, state: ContainerState, rootfs: Path, netns: str | None = None
    ) -> str:
        """Set up ``spec``'s network (in the existing namespace ``netns``, else a new one)
        and its ``/etc/resolv.conf``; returns the namespace's pinned path."""
        assert spec.network is not None
        net = await self._require_network().setup(spec.id, spec.network, netns=netns)
        state.network = True
        self._write_state(spec.id, state)
        # a few bytes: written on the loop (a thread hop cost more than the write); a
        # symlink in the image is replaced with our file
        RootedFiles(rootfs).replace_now("/etc/resolv.conf", net.resolv_conf.encode())
        return str(net.netns_path)

    # ------------------------------------------------------------------ warm pool
    async def _make_warm(self, template: SandboxSpec) -> _Warm:
        """One warm container for ``template``'s pool key: no environment, default user."""
        wid = f"{_WARM_PREFIX}{secrets.token_hex(8)}"
        spec = dataclasses.replace(
            template, id=wid, env={}, user=None, workdir="/", labels={}, network=None
        )
        self._warm_ids.add(wid)
        try:
            handle = await self._create_fresh(spec, self._sandbox_dir(wid))
        except BaseException:
            self._warm_ids.discard(wid)
            raise
        live = self._live.pop(wid)
        return _Warm(wid, handle.typed(ContainerState), live)

    def _leftover_warm(self) -> list[str]:
        """Warm containers this runtime made and did not discard or hand out, and warm
        directories a failed make left."""
        left = set(self._warm_ids)
        with contextlib.suppress(OSError):
            left.update(
                d.name for d in self.paths.sandboxes.iterdir() if d.name.startswith(_WARM_PREFIX)
            )
        return sorted(left)

    async def _discard_warm(self, warm: _Warm) -> None:
        self._live[warm.id] = warm.live
        try:
            await self.destroy(Handle.of(warm.id, warm.state))
        finally:
            self._warm_ids.discard(warm.id)

    async def _claim(
        self, warm: _Warm, spec: SandboxSpec, sandbox_dir: Path, frozen: list[str] | None = None
    ) -> Handle:
        """Make warm container ``warm`` sandbox ``spec.id``: rename its directory and OCI
        state, label its cgroups, set its limits, record its environment, user and workdir.
        O(1) in the live count, ~0.3 ms. ``frozen``: a shared fork's child, moved onto a
        root stacked on these frozen layers (:meth:`_reroot`, ~1-2 ms more)."""
        t0 = time.monotonic()
        state = warm.state.model_copy(deep=True)
        live = warm.live
        self._warm_ids.discard(warm.id)
        group = state.cpu_group
        self._join_group(spec.id, group, spec.cpu_group_weight)
        self._leave_group(warm.id, group)
        self._live[spec.id] = live
        self._acquired[spec.id] = self._acquired.pop(warm.id, [])
        renamed = False
        async with live.lock:
            try:
                if live.server is None or not live.server.alive:
                    raise SandboxError("the warm container's exec server is gone")
                _set_limits(cgroup(state.cgroup), state.limits, spec)
                if state.init_pid is not None:
                    with contextlib.suppress(OSError):  # made at the refill's niceness
                        os.setpriority(os.PRIO_PROCESS, state.init_pid, 0)
                os.rename(self._sandbox_dir(warm.id), sandbox_dir)
                renamed = True
                # the cgroups keep the warm container's name and are labelled with the
                # sandbox's id. Renaming them takes the kernel's cgroup_mutex, which a
                # container being made on the node holds through an RCU grace period (each
                # cgroup.procs write of crun and of the exec server): a claim that met the
                # pool's refill waited 3-27 ms in the rename, half of sequential creates
                _label_cgroup(state.cgroup, spec.id)
                oci_root = Path(state.state_root or self.state_root)
                with contextlib.suppress(FileNotFoundError):
                    os.rename(oci_root / warm.id, oci_root / spec.id)
                if frozen is not None:  # before the user is looked up in its /etc/passwd
                    await self._reroot(spec, state, sandbox_dir, live, frozen)
                user = self._resolve_user(rootfs_path(sandbox_dir), spec.user)
                state.env, state.user, state.workdir = dict(spec.env), spec.user, spec.workdir
                state.uid, state.gid = user.uid, user.gid
                state.limits, state.warm_id = _limits_of(spec), warm.id
                ms = round((time.monotonic() - t0) * 1000, 2)
                state.create_ms = {"claim": ms, "total": ms, **(state.reroot_ms or {})}
                state.reroot_ms = None
                self._write_state(spec.id, state)
                self._drop_state(warm.id)
                if spec.network is not None:
                    # the warm container's own namespace (only lo in it) gets the veth,
                    # addresses, routes and filter a new one would have had before crun
                    await self._attach_network(
                        spec, state, rootfs_path(sandbox_dir), f"/proc/{state.init_pid}/ns/net"
                    )
                    total = round((time.monotonic() - t0) * 1000, 2)
                    state.create_ms = {"claim": ms, "network": total - ms, "total": total}
                    self._write_state(spec.id, state)
            except BaseException as e:
                # under whichever name it has now: destroy it, the create fails
                name = spec.id if renamed else warm.id
                if name != spec.id:
                    self._acquired[warm.id] = self._acquired.pop(spec.id, [])
                    self._live[warm.id] = self._live.pop(spec.id)
                try:
                    await self._destroy(Handle.of(name, state), keep_live=False)
                    self._drop_state(warm.id)
                except Exception as cleanup_error:
                    log.error("cleanup of claimed %s failed: %s", name, cleanup_error)
                self._live.pop(spec.id, None)
                self._leave_group(warm.id, group)
                self._leave_group(spec.id, group)
                if isinstance(e, DsecError | asyncio.CancelledError | _RerootFailed):
                    raise
                raise SandboxError(f"creating sandbox {spec.id} failed: {e}") from e
        return Handle.of(spec.id, state)

    async def _reroot(
        self,
        spec: SandboxSpec,
        state: ContainerState,
        sandbox_dir: Path,
        live: _Live,
        frozen: list[str],
    ) -> None:
        """Move a claimed warm container onto a new root: the image's layers it stands on,
        the frozen layers ``frozen`` (bottom first) and a fresh writable layer of
        ``spec.disk_mb``, i.e. what :meth:`_create` would mount for a shared fork's child.

        The warm root's mounts leave the node's namespace, the new root is mounted in their
        place (so the files API, snapshots and teardown find it where they always do), gets
        a new ``/etc/machine-id`` where it has one, and a detached clone of it is handed to
        the exec server, which moves the container's mounts (``/proc``, ``/dev``, ``/sys``,
        the init's binary) onto it and ``pivot_root``-s the container (its init and itself)
        into it, detaching the old root, and sets the hostname. Nothing of the warm root
        stays reachable: nothing ran there but the init, which holds no file, and its
        last mounts go with the pivot. Raises :class:`_RerootFailed`."""
        assert live.server is not None
        t0 = time.monotonic()
        try:
            mounted = self.layer_mounts.mounted(state.layer_scope)
            lowers = [mounted[d] for d in state.layers]  # the warm container holds them
            for fid in frozen:
                self._hold_frozen(fid, spec.id)
                state.frozen = [*state.frozen, fid]  # released at destroy
            state.frozen_lowers = list(frozen)
            state.disk_mb = spec.disk_mb
            self._write_state(spec.id, state)
            if state.init_pid is None:
                raise KeyError("init_pid")
            mounts = mounts_below_root(state.init_pid)
            detach_rootfs(sandbox_dir)
            rootfs = assemble_rootfs(
                sandbox_dir,
                [*lowers, *(frozen_data(self._frozen_dir(f)) for f in frozen)],
                spec.disk_mb,
                frozen_lowers=len(frozen),
            )
            if (self._read_rootfs_file(rootfs, "/etc/machine-id") or "").strip():
                RootedFiles(rootfs).replace_now("/etc/machine-id", f"{uuid.uuid4().hex}\n".encode())
            t_mount = time.monotonic()
            fd = open_tree_clone(rootfs)
            try:
                await live.server.reroot(fd, spec.hostname, mounts)
            finally:
                os.close(fd)
        except (DsecError, OSError, KeyError) as e:
            detail = e.message if isinstance(e, DsecError) else str(e)
            raise _RerootFailed(
                f"the warm container could not take the fork's root: {detail}"
            ) from e
        state.hostname = spec.hostname
        t_end = time.monotonic()
        state.reroot_ms = {
            "rootfs": round((t_mount - t0) * 1000, 2),
            "pivot": round((t_end - t_mount) * 1000, 2),
        }

    async def _start_server(
        self,
        sandbox_id: str,
        init_pid: int,
        *,
        allow_setuid: bool = False,
        audit_id: int | None = None,
    ) -> ExecServer:
        _, _, execd_bin = self._require_available()
        assert self._policy_file is not None
        return await ExecServer.start(
            execd_bin,
            init_pid,
            self._policy_file,
            cgroup_procs_files(init_pid, self._cgroup_mounts, confining_only=True),
            bpf_file=self._bpf_file,
            allow_setuid=allow_setuid,
            audit_id=audit_id,
        )

    # ------------------------------------------------------------------ audit
    def audit_id(self, handle: Handle) -> int | None:
        """:class:`dsec.contract.runtime.Audited`: the loginuid the sandbox's commands carry."""
        return self._load_state(handle).auid

    def limit_counters(self, handle: Handle) -> dict[str, int]:
        """:class:`dsec.contract.runtime.Audited`: OOM kills and refused forks of its cgroup, and
        how often its writable layer was found full (:meth:`_look_at_disk`)."""
        cg = self._cgroup(handle)
        counters = {"oom_kill": cg.oom_kills(), "pids_max": cg.pids_max_events()}
        live = self._live.get(handle.id)
        if live is not None:
            counters["disk_full"] = self._look_at_disk(handle.id, live)
        return counters

    def _look_at_disk(self, sandbox_id: str, live: _Live) -> int:
        """Count a full writable layer (no block left of its ``disk_mb``): once per time it
        fills up, seen after a command or when the audit samples (a tmpfs that filled and
        emptied again between two looks is not seen). One statfs(2) of the sandbox's tmpfs,
        a few microseconds. Returns the count."""
        try:
            st = os.statvfs(upper_dir(self._sandbox_dir(sandbox_id)).parent)
        except OSError:
            return live.disk_full
        full = st.f_blocks > 0 and st.f_bavail == 0
        if full and not live.disk_was_full:
            live.disk_full += 1
        live.disk_was_full = full
        return live.disk_full

    # ------------------------------------------------------------------ exec
    async def exec(
        self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
    ) -> ExecResult:
        """Run one command in the sandbox (see :class:`dsec.models.ExecRequest`)."""
        server, env_list, cwd, user, oom_file = await self._exec_context(handle, req)
        if req.stdin is not None and req.stdin_b64 is not None:
            raise InvalidRequest("give stdin or stdin_b64, not both")
        stdin: bytes | None = None
        if req.stdin is not None:
            stdin = req.stdin.encode()
        elif req.stdin_b64 is not None:
            try:
                stdin = base64.b64decode(req.stdin_b64, validate=True)
            except (binascii.Error, ValueError) as e:
                raise InvalidRequest(f"stdin_b64 is not valid base64: {e}") from e
        oom_before = _oom_kills(oom_file)
        self._busy(handle, +1)
        try:
            out = await server.run(
                req.argv(),
                env_list,
                cwd,
                user.uid,
                user.gid,
                user.groups,
                stdin,
                req.timeout_s,
                req.max_output_bytes,
                sink,
            )
        except (SandboxStopped, SandboxError) as e:
            if server.closed_by_edge:  # destroyed (killed, TTL) while the command ran
                raise SandboxStopped(
                    f"sandbox {handle.id} was stopped while the command ran"
                ) from None
            await self._explain_exec_failure(handle, e)
            raise
        finally:
            self._busy(handle, -1)
            live = self._live.get(handle.id)
            if live is not None:
                self._look_at_disk(handle.id, live)
        oom_after = _oom_kills(oom_file)
        return ExecResult(
            stdout=out.stdout.decode("utf-8", errors="replace"),
            stderr=out.stderr.decode("utf-8", errors="replace"),
            exit_code=out.exit_code,
            signal=out.signal,
            timed_out=out.timed_out,
            stdout_truncated=out.stdout_truncated,
            stderr_truncated=out.stderr_truncated,
            duration_ms=out.duration_ms,
            oom_killed=_killed_by_oom(out.exit_code, out.signal, oom_before, oom_after),
        )

    async def _explain_exec_failure(self, handle: Handle, e: DsecError) -> None:
        """Turn an exec server failure into ``SandboxStopped`` (sandbox gone) or ``SandboxError``."""
        if not await self.alive(handle):
            raise SandboxStopped(f"sandbox {handle.id} stopped while running the command") from None
        if isinstance(e, SandboxStopped):
            raise SandboxError(f"the exec server of {handle.id} went away") from None

    async def _exec_context(
        self, handle: Handle, req: ExecRequest
    ) -> tuple[ExecServer, list[str], str, ResolvedUser, str]:
        """The live exec server (recovered if needed), environment, cwd, user and the file
        that counts the sandbox's OOM kills (:meth:`Cgroup.oom_kills_file`) for running
        ``req`` in the sandbox."""
        state = self._load_state(handle)
        live = self._live.get(handle.id)
        if live is None or live.server is None or not live.server.alive:
            if not await self.alive(handle):
                raise SandboxStopped(f"sandbox {handle.id} is not running")
            if not await self.recover(handle):
                if await self.alive(handle):
                    # init lives but no exec server can start: the sandbox's own processes
                    # exhaust its pids or memory limit (e.g. a fork bomb in its own session)
                    raise Conflict(
                        f"sandbox {handle.id} runs but cannot start commands: its own "
                        "processes exhaust its process or memory limit; kill the sandbox"
                    )
                raise SandboxStopped(f"sandbox {handle.id} is not running")
            live = self._live[handle.id]
        server = live.server
        assert server is not None
        user_spec = req.user if req.user is not None else state.user
        user = self._resolve_user(rootfs_path(self._sandbox_dir(handle.id)), user_spec)
        env = {
            "PATH": DEFAULT_PATH,
            "HOSTNAME": state.hostname,
            "HOME": user.home,
        }
        env.update(state.env)
        env.update(req.env)
        cwd = req.cwd or state.workdir
        oom_file = _oom_kills_file(self._cgroup_of(handle.id, state))
        return server, [f"{k}={v}" for k, v in env.items()], cwd, user, oom_file

    async def start_process(
        self,
        handle: Handle,
        req: ExecRequest,
        *,
        stdin: bool,
        pty: TerminalSize | None,
    ) -> ContainerProcess:
        """Start ``req`` and return while it runs (interactive processes, e.g. for E2B).

        ``stdin``: keep its stdin open for writes (else it reads EOF; ``req.stdin`` is
        ignored). ``pty``: run it on a new terminal of that size (cols x rows) instead of
        pipes. ``req.timeout_s`` (seconds) kills its process group.
        """
        server, env_list, cwd, user, oom_file = await self._exec_context(handle, req)
        oom_before = _oom_kills(oom_file)
        self._busy(handle, +1)
        try:
            execution = await server.start_process(
                req.argv(),
                env_list,
                cwd,
                user.uid,
                user.gid,
                user.groups,
                stdin=stdin,
                pty=pty,
                timeout_s=req.timeout_s,
                max_output_bytes=req.max_output_bytes,
            )
        except BaseException as e:
            self._busy(handle, -1)
            if isinstance(e, SandboxStopped | SandboxError):
                await self._explain_exec_failure(handle, e)
            raise
        return ContainerProcess(self, handle, execution, oom_file, oom_before)

    def _busy(self, handle: Handle, delta: int) -> None:
        """Count a command starting (+1) or ending (-1); on the first start and the last
        end, switch the sandbox's ``cpu.shares`` between its full and its idle weight."""
        live = self._live.get(handle.id)
        if live is None or not self.idle_cpu_shares:
            return
        before = live.active
        live.active = max(0, before + delta)
        if (before == 0) == (live.active == 0):
            return
        if not live.active or self.exec_boost <= 1:
            self._weigh(handle, active=bool(live.active))
            return
        # a command starting after a pause of the sandbox gets a multiple of its weight for
        # its first moments: short commands (ls, echo, a file test) finish within them and
        # pass the long ones still running, as a feedback scheduler would have them
        live.busy_since += 1
        self._weigh(handle, active=True, boost=self.exec_boost)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._weigh(handle, active=True)
            return
        loop.call_later(self.exec_boost_s, self._unboost, handle, live, live.busy_since)

    def _unboost(self, handle: Handle, live: _Live, generation: int) -> None:
        """The boost of :meth:`_busy` is over: the sandbox's plain weight, if it still runs
        the commands that earned the boost (else the idle switch already set the weight)."""
        if live.active and live.busy_since == generation and self._live.get(handle.id) is live:
            self._weigh(handle, active=True)

    def _weigh(self, handle: Handle, *, active: bool, boost: float = 1.0) -> None:
        """Set the sandbox's full (``active``, times ``boost``) or idle CPU shares (v2: the
        ``cpu.weight`` they map to). Also full while it is killed or frozen: its processes
        must get the CPU to exit or reach the freezer (at 2 shares on a busy node they did
        not within 5 s, and the kill left cgroups)."""
        if self.idle_cpu_shares:
            self._weigh_state(handle.id, self._load_state(handle), active=active, boost=boost)

    def _weigh_state(
        self, sandbox_id: str, state: ContainerState, *, active: bool, boost: float = 1.0
    ) -> None:
        """:meth:`_weigh` of the sandbox whose state is ``state``."""
        if not self.idle_cpu_shares:
            return
        if active:
            cpu = state.limits.cpu if state.limits.cpu is not None else 1.0
            shares = _full_shares(cpu * boost)
        else:
            shares = self.idle_cpu_shares
        with contextlib.suppress(OSError):  # a sandbox going away: nothing to weigh
            cgroup(self._cgroup_of(sandbox_id, state)).set_cpu_shares(shares)

    def files(self, handle: Handle) -> SandboxFiles:
        """File access confined to the sandbox's root; new files belong to its default user."""
        state = self._load_state(handle)
        sandbox_dir = self._sandbox_dir(handle.id)
        if not sandbox_dir.exists():
            raise SandboxNotFound(f"sandbox {handle.id} has no root filesystem on this node")
        return RootedFiles(
            rootfs_path(sandbox_dir),
            (state.uid, state.gid),
            watch_hub=self._watch_hub,
        )

    # ------------------------------------------------------------------ ports
    async def connect_port(self, handle: Handle, port: int) -> PortStream:
        """``PortConnectable``: a TCP connection to ``127.0.0.1:port`` inside the container,
        from a socket made in its network namespace (the init's ``/proc/<pid>/ns/net``):
        works with or without a network policy, and needs no route from the node."""
        state = self._load_state(handle)
        pid, start = state.init_pid, state.init_start
        if pid is None or start is None:
            raise SandboxStopped(f"sandbox {handle.id} is not running", sandbox_id=handle.id)
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            raise SandboxStopped(
                f"sandbox {handle.id} is not running", sandbox_id=handle.id
            ) from None
        try:
            if _proc_start_time(pid) != start:  # the pid was reused: not our namespace
                raise SandboxStopped(f"sandbox {handle.id} is not running", sandbox_id=handle.id)
            if self._netns_sockets is None:
                self._netns_sockets = NetnsSockets()
            sock = await self._netns_sockets.socket(fd)
        finally:
            os.close(fd)
        return await connect_socket(sock, port)

    # ------------------------------------------------------------------ liveness
    async def alive(self, handle: Handle) -> bool:
        """True while the container's init runs (the very process, not a reused pid)."""
        state = self._load_state(handle)
        pid, start = state.init_pid, state.init_start
        if pid is None or start is None:
            return False
        return _proc_start_time(pid) == start

    async def recover(self, handle: Handle) -> bool:
        """After an edge restart: re-take the layer references and start a new exec server.
        Returns False (touching nothing) if the container is gone."""
        state = self._load_state(handle)
        if self._unavailable is not None or not await self.alive(handle):
            return False
        # the init is our child again if it was reparented to this process (an in-process
        # server restarted, or this process is the subreaper above the old edge)
        init_pid, init_start = state.init_pid, state.init_start
        assert init_pid is not None and init_start is not None  # alive
        REAPER.expect(init_pid, init_start)
        if handle.id not in self._acquired:
            acquired: list[tuple[str, str]] = []
            scope = state.layer_scope  # none: made by an older dsec
            for digest, layer_file in zip(state.layers, state.layer_paths, strict=False):
                try:
                    self.layer_mounts.acquire(digest, Path(layer_file), scope)
                except DsecError as e:
                    log.warning("recover %s: layer %s: %s", handle.id, digest, e)
                    continue
                acquired.append((scope, digest))
            self._acquired[handle.id] = acquired
            for fid in state.frozen:
                self._frozen_refs.setdefault(fid, set()).add(handle.id)
        group = state.cpu_group
        if group:
            self._groups.setdefault(group, set()).add(handle.id)
        live = self._live.setdefault(handle.id, _Live())
        async with live.lock:
            if live.server is None or not live.server.alive:
                if live.server is not None:
                    await live.server.close()
                # the new server joins the sandbox's cgroups: at the idle weight it would
                # hardly run on a busy node
                self._weigh_state(handle.id, state, active=True)
                try:
                    live.server = await self._start_server(
                        handle.id,
                        init_pid,
                        allow_setuid=state.allow_setuid,
                        audit_id=state.auid,
                    )
                except (SandboxError, NodeBusy) as e:
                    log.warning("recover %s: %s", handle.id, e)
                    return False
                finally:
                    self._weigh_state(handle.id, state, active=live.active > 0)
        handle.keep(state)
        return True

    # ------------------------------------------------------------------ destroy
    async def destroy(self, handle: Handle) -> None:
        """Kill everything of the sandbox and free its resources. Idempotent; works on a
        half-created sandbox and with an empty ``handle.state``."""
        live = self._live.get(handle.id)
        if live is not None:
            async with live.lock:
                await self._destroy(handle, keep_live=False)
        else:
            await self._destroy(handle, keep_live=False)

    async def _destroy(self, handle: Handle, *, keep_live: bool, keep_frozen: bool = False) -> None:
        sandbox_dir = self._sandbox_dir(handle.id)
        state = self._load_state(handle)
        cg = cgroup(self._cgroup_of(handle.id, state))
        self._weigh_state(handle.id, state, active=True)  # dying tasks need the CPU to exit
        # a paused sandbox: its processes (and the exec server, which closing below waits
        # for) sit in the freezer and ignore SIGKILL until thawed: kill, then thaw
        with contextlib.suppress(OSError):
            if cg.exists() and cg.freeze_requested():
                await asyncio.to_thread(cg.kill_all)
        live = self._live.get(handle.id)
        server = live.server if live is not None else None
        if live is not None:
            live.server = None
        if not keep_live:
            self._live.pop(handle.id, None)
        errors: list[str] = []
        loop = asyncio.get_running_loop()
        # the init's SIGKILL (in the teardown thread) ends the pid namespace and every
        # command in it, while the exec server exits on its socket's EOF: in parallel
        teardown = loop.run_in_executor(
            _blocking_executor(), self._kill_and_clean, handle.id, state, sandbox_dir, errors
        )
        try:
            if server is not None:  # closes its socket before the loop runs again
                await server.close()
        finally:
            await teardown
        if self.network is not None and state.network:
            try:
                await self.network.teardown(handle.id)
            except DsecError as e:
                errors.append(str(e))
        for scope, digest in self._acquired.pop(handle.id, []):
            try:
                self.layer_mounts.release(digest, scope)
            except DsecError as e:
                errors.append(str(e))
        if not keep_frozen:
            for fid in state.frozen:
                try:
                    self._drop_frozen(fid, handle.id)
                except DsecError as e:
                    errors.append(str(e))
        if not keep_live:
            self._leave_group(handle.id, state.cpu_group)
        if errors:
            raise SandboxError(f"destroying {handle.id} left something behind: {'; '.join(errors)}")

    def _kill_and_clean(
        self, sandbox_id: str, state: ContainerState, sandbox_dir: Path, errors: list[str]
    ) -> None:
        oci = state.oci_runtime or self._oci
        root = state.state_root or str(self.state_root)
        pid, start = state.init_pid, state.init_start
        if pid is not None and start is not None and _proc_start_time(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        oci_state = Path(root) / sandbox_id
        if pid is not None and start is not None and reap_pid(pid, start):
            # the init is gone, and with it the pid namespace, every process and mount of
            # the container: what `crun delete` would do besides (cgroups, its state
            # directory) is done here without forking the OCI runtime (~5-10 ms per kill)
            shutil.rmtree(oci_state, ignore_errors=True)
        elif oci and oci_state.exists():
            try:
                proc = subprocess.run(
                    [oci, "--root", root, "delete", "--force", sandbox_id],
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=_OCI_TIMEOUT_S,
                    check=False,
                )
                if proc.returncode != 0 and "does not exist" not in proc.stderr:
                    log.warning("%s delete %s: %s", oci, sandbox_id, proc.stderr.strip())
            except (OSError, subprocess.TimeoutExpired) as e:
                log.warning("%s delete %s: %s", oci, sandbox_id, e)
            if (Path(root) / sandbox_id).exists():
                shutil.rmtree(Path(root) / sandbox_id, ignore_errors=True)
        if pid is not None:
            reap_pid(pid, start)
        rel = self._cgroup_of(sandbox_id, state)
        # a sandbox claimed by an older dsec, which renamed the v1 cgroups: cgroup2 kept the
        # warm id
        warm_rel = state.cgroup_warm
        for r in (rel, warm_rel) if warm_rel is not None else (rel,):
            try:  # what is left is killed; every hierarchy the OCI runtime populated
                cgroup(r).remove()
            except (OSError, TimeoutError) as e:
                errors.append(f"cgroup {r}: {e}")
        set_immutable(sandbox_dir / _BOOT_ID_FILE, False)  # else the directory stays
        try:
            teardown_rootfs(sandbox_dir)
        except DsecError as e:
            errors.append(str(e))
        if not errors:  # else kept: what a later orphan scan destroys it from
            self._drop_state(sandbox_id)

    # ------------------------------------------------------------------ pause, snapshot
    def _cgroup(self, handle: Handle) -> Cgroup:
        return cgroup(self._cgroup_of(handle.id, self._load_state(handle)))

    async def pause(self, handle: Handle) -> dict[str, Any]:
        """Freeze the sandbox, then reclaim its page cache (see ``pause.py``): at once when
        :attr:`pause_reclaim_after_s` is 0, else once it has stayed paused that long (a short
        pause keeps what the next command needs). Returns :class:`dsec.models.PauseReport`
        fields."""
        self._weigh(handle, active=True)  # every task must run to reach the freezer
        delay = self.pause_reclaim_after_s
        live = self._live.get(handle.id)
        if delay > 0:
            rep = await pausing.freeze(self._cgroup(handle))
        else:
            rep = await pausing.pause(self._cgroup(handle))
        if live is not None:
            live.reclaimed = delay <= 0
        notes = list(rep.notes)
        if delay > 0 and live is not None:
            live.paused += 1
            asyncio.get_running_loop().call_later(
                delay, self._reclaim_paused, handle, live, live.paused
            )
            notes.append(f"its memory is reclaimed once it has been paused for {delay:g} s")
        return {
            "memory_before_bytes": rep.before.usage,
            "memory_after_bytes": rep.after.usage,
            "duration_ms": rep.total_ms,
            "method": f"freeze+{rep.reclaim_method}" if delay <= 0 else "freeze",
            "notes": notes,
        }

    def _reclaim_paused(self, handle: Handle, live: _Live, generation: int) -> None:
        """The pause of :meth:`pause` has lasted :attr:`pause_reclaim_after_s`: reclaim the
        sandbox's memory, unless it was resumed (or paused again, or is gone) meanwhile."""
        if live.paused != generation or self._live.get(handle.id) is not live:
            return

        async def reclaim() -> None:
            try:
                async with live.lock:  # not while it is being destroyed
                    if live.paused == generation and self._live.get(handle.id) is live:
                        await pausing.pause(self._cgroup(handle))  # frozen: reclaims only
                        live.reclaimed = True
            except DsecError as e:  # gone meanwhile: nothing to give back
                log.debug("reclaim of paused %s: %s", handle.id, e.message)

        task = asyncio.get_running_loop().create_task(reclaim())
        self._reclaims.add(task)
        task.add_done_callback(self._reclaims.discard)

    async def resume(self, handle: Handle) -> None:
        live = self._live.get(handle.id)
        if live is not None:
            live.paused += 1  # a reclaim still to come is void
        if live is not None and not live.reclaimed:
            await pausing.thaw(self._cgroup(handle))  # its memory is all there: no prefetch
        else:
            await pausing.resume(self._cgroup(handle), prefetch=True)
        if live is not None:
            live.reclaimed = False
        self._weigh(handle, active=live is not None and live.active > 0)

    async def pause_filesystem(self, handle: Handle) -> dict[str, Any]:
        """Filesystem-only pause (E2B's ``keep_memory=False``): every process of the sandbox
        but its init is killed (the exec server with the commands it runs, then whatever
        else is left in its cgroup), the sandbox gets a new boot id, and it is paused as by
        :meth:`pause`. Its files stay; the next command runs in what looks like a freshly
        booted system. Also on a paused sandbox (it is thawed for the kill)."""
        state = self._load_state(handle)
        cg = self._cgroup(handle)
        if cg.freeze_requested():  # paused: its processes must run to die
            await asyncio.to_thread(cg.thaw)
        live = self._live.get(handle.id)
        if live is not None and live.server is not None:
            await live.server.close()  # kills its commands' process groups and reaps them
            live.server = None
        await asyncio.to_thread(_kill_all_but, cg, state.init_pid)
        sandbox_dir = self._sandbox_dir(handle.id)
        if (sandbox_dir / _BOOT_ID_FILE).exists():
            _new_boot_id(sandbox_dir)
        report = await self.pause(handle)
        report["method"] = f"filesystem+{report['method']}"
        return report

    async def snapshot(
        self, handle: Handle, store: Any, req: SnapshotRequest, meta: dict[str, Any]
    ) -> LayerInfo:
        """``pack_diff``: the writable layer, frozen for a consistent view, as a new layer."""
        from dsec.layers.snapshot import merge_uppers, pack_diff

        cg = self._cgroup(handle)
        was_frozen = cg.is_frozen()
        if not was_frozen:
            self._weigh(handle, active=True)  # every task must run to reach the freezer
            await pausing.pause(cg, reclaim=False)
        state = self._load_state(handle)
        frozen = list(state.frozen_lowers)
        merged: Path | None = None
        try:
            upper = upper_dir(self._sandbox_dir(handle.id))
            max_bytes: int | None = None
            if frozen:  # a shared fork's stack: its frozen uppers and its own, as one layer
                merged = Path(store.scratch) / f"merge-{handle.id}-{secrets.token_hex(4)}"
                uppers = [*(frozen_data(self._frozen_dir(f)) for f in frozen), upper]
                await asyncio.to_thread(merge_uppers, uppers, merged)
                upper = merged
                disk_mb = state.disk_mb
                max_bytes = disk_mb * (len(frozen) + 1) << 20 if disk_mb else None
            return await asyncio.to_thread(
                pack_diff,
                upper,
                store,
                scrub=req.scrub,
                default_scrub=req.default_scrub,
                meta=meta,
                secret_values=req.secret_values,
                compress="lz4" if req.compress else None,
                max_bytes=max_bytes,
            )
        finally:
            if merged is not None:
                await asyncio.to_thread(shutil.rmtree, merged, True)
            if not was_frozen:
                await pausing.resume(cg, prefetch=False)
                live = self._live.get(handle.id)
                self._weigh(handle, active=live is not None and live.active > 0)

    # ------------------------------------------------------------------ shared forks
    def _frozen_root(self) -> Path:
        return self.paths.run / "frozen"

    def _frozen_dir(self, fid: str) -> Path:
        return self._frozen_root() / fid

    def _hold_frozen(self, fid: str, sandbox_id: str) -> None:
        if not self._frozen_dir(fid).is_dir():
            raise SandboxError(f"frozen layer {fid} is gone from this node")
        self._frozen_refs.setdefault(fid, set()).add(sandbox_id)

    def _drop_frozen(self, fid: str, sandbox_id: str) -> None:
        """``sandbox_id`` no longer uses frozen layer ``fid``: released with the last user."""
        users = self._frozen_refs.get(fid)
        if users is not None:
            users.discard(sandbox_id)
            if users:
                return
            del self._frozen_refs[fid]
        release_frozen(self._frozen_dir(fid))

    def frozen_layers(self) -> dict[str, int]:
        """Frozen layers on this node: id -> how many sandboxes hold it (for tests and
        ``doctor``-like reports)."""
        return {fid: len(users) for fid, users in self._frozen_refs.items()}

    def upper_frozen(self, handle: Handle) -> bool:
        """Whether the sandbox's writable layer was frozen by :meth:`freeze_upper` (it must
        then be restarted by :meth:`restart_on_frozen`, never thawed)."""
        return bool(self._load_state(handle).upper_frozen)

    async def freeze_upper(self, handle: Handle) -> None:
        """Freeze the sandbox's processes (cgroup freezer; no memory reclaim) and keep its
        writable layer as a frozen layer (a read-only bind of its tmpfs: nothing copied,
        ~0.2 ms). Idempotent: a second fork of a parent whose layer is frozen shares it."""
        state = self._load_state(handle)
        if state.upper_frozen:
            return
        cg = self._cgroup(handle)
        if not cg.is_frozen():
            self._weigh(handle, active=True)  # every task must run to reach the freezer
            await pausing.pause(cg, reclaim=False)
        fid = f"fz-{secrets.token_hex(8)}"
        freeze_upper(self._sandbox_dir(handle.id), self._frozen_dir(fid))
        self._frozen_refs.setdefault(fid, set()).add(handle.id)
        state.upper_frozen = fid
        state.frozen = [*state.frozen, fid]
        self._write_state(handle.id, state)
        handle.keep(state)

    async def create_forked(self, parent: Handle, spec: SandboxSpec) -> Handle:
        """Create ``spec`` over the frozen layers of ``parent`` (its frozen writable layer on
        top of those it stacks itself). A warm container of the image's pool key is claimed
        and moved onto that root (:meth:`_reroot`: ~2 ms instead of a ``crun run``); without
        one, or if the move fails (then logged), a fresh container is made."""
        self._require_available()
        pstate = self._load_state(parent)
        fid = pstate.upper_frozen
        if not fid:
            raise Conflict(f"sandbox {parent.id}'s writable layer is not frozen")
        sandbox_dir = self._sandbox_dir(spec.id)
        if sandbox_dir.exists() or spec.id in self._live:
            raise InvalidRequest(f"sandbox {spec.id} already exists on this node")
        if spec.network is not None:
            self._require_network()
        frozen = [*pstate.frozen_lowers, fid]
        if not spec.id.startswith(_WARM_PREFIX):
            # the pool's containers of the image have the hostname of a sandbox that is not
            # a fork; the move gives the child its own
            template = dataclasses.replace(spec, hostname=_POOL_HOSTNAME)
            key = _pool_key(template, self.layer_mounts.scope_of(spec.owner))
            warm = self.pool.take(key, template)
            if warm is not None:
                try:
                    return await self._claim(warm, spec, sandbox_dir, frozen)
                except _RerootFailed as e:  # the warm container is gone: a fresh one
                    log.warning("fork child %s from the pool: %s; made fresh", spec.id, e)
        return await self._create_fresh(spec, sandbox_dir, frozen)

    async def restart_on_frozen(self, handle: Handle, spec: SandboxSpec) -> Handle:
        """Start a sandbox whose writable layer was frozen again, on a fresh writable layer
        over the frozen one (same id, hostname, limits and network policy; a new boot id;
        every process of before is gone). On failure the sandbox is destroyed."""
        state = self._load_state(handle)
        fid = state.upper_frozen
        if not fid:
            raise Conflict(f"sandbox {handle.id}'s writable layer is not frozen")
        frozen = [*state.frozen_lowers, fid]
        live = self._live.setdefault(handle.id, _Live())
        async with live.lock:
            try:
                await self._destroy(Handle.of(handle.id, state), keep_live=True, keep_frozen=True)
                return await self._create(spec, self._sandbox_dir(handle.id), live, frozen)
            except BaseException as e:
                try:
                    await self._destroy(Handle(handle.id), keep_live=False, keep_frozen=True)
                except Exception as cleanup_error:
                    log.error("cleanup of restarted %s failed: %s", handle.id, cleanup_error)
                self._live.pop(handle.id, None)
                for f in state.frozen:
                    with contextlib.suppress(DsecError):
                        self._drop_frozen(f, handle.id)
                if isinstance(e, DsecError | asyncio.CancelledError):
                    raise
                raise SandboxError(f"restarting sandbox {handle.id} failed: {e}") from e

    async def network_update(self, handle: Handle, policy: Any) -> None:
        if self.network is None or not self._load_state(handle).network:
            raise CapabilityNotSupported(
                f"sandbox {handle.id} was created without networking (network=None); "
                "networking cannot be added to a running sandbox"
            )
        await self.network.update(handle.id, policy)

    async def network_stats(self, handle: Handle) -> dict[str, Any]:
        if self.network is None or not self._load_state(handle).network:
            return {"enabled": False}
        return {"enabled": True, **await self.network.stats(handle.id)}

    # ------------------------------------------------------------------ usage
    async def usage(self, handle: Handle) -> SandboxUsage:
        """:class:`dsec.contract.runtime.Measurable`: the sandbox's cgroup (v1 or v2), the fill of
        its writable tmpfs and, with a network, the counters of its veth (a frozen sandbox
        is read as it is)."""
        state = self._load_state(handle)
        rel = self._cgroup_of(handle.id, state)
        ifname: str | None = None
        if state.network and self.network is not None:
            with contextlib.suppress(DsecError):
                ifname = self.network.network(handle.id).host_ifname
        upper = upper_dir(self._sandbox_dir(handle.id)).parent

        def read() -> SandboxUsage:
            sandbox_cg = cgroup(rel)
            try:
                cg = sandbox_cg.usage()
            except FileNotFoundError:
                raise SandboxStopped(f"sandbox {handle.id} has no cgroup on this node") from None
            try:
                used, total = disk_usage([upper])
            except OSError:
                used, total = 0, 0
            net: NetCounters | None = None
            if state.network:
                try:
                    net = read_veth_counters(ifname) if ifname else NetCounters()
                except (OSError, ValueError):
                    net = NetCounters()
            cpu_ns = cg.cpu_usage_ns
            if cpu_ns is None:  # a node without cpuacct: the processes' own counters
                cpu_ns = processes_cpu_ns(sandbox_cg.procs())
            return SandboxUsage(
                cpu_usage_ns=cpu_ns,
                memory_used_bytes=cg.memory_used_bytes,
                memory_cache_bytes=cg.memory_cache_bytes,
                memory_limit_bytes=cg.memory_limit_bytes,
                memory_peak_bytes=cg.memory_peak_bytes,
                disk_used_bytes=used,
                disk_total_bytes=total,
                net=net,
                pids=cg.pids,
                source=f"cgroup v{cg.version}",
            )

        return await asyncio.to_thread(read)

    # ------------------------------------------------------------------ orphans
    async def reconciled(self) -> None:
        """Unmount the layers no recovered sandbox stacks (:class:`Reconciling`): those of
        sandboxes lost while the edge was down, adopted at :func:`dsec.node.build_runtimes`
        with no user."""
        n = await asyncio.to_thread(self.layer_mounts.unmount_unused)
        if n:
            log.info("container tier: unmounted %d layer mounts no sandbox uses", n)
        root = self._frozen_root()
        for d in sorted(root.iterdir()) if root.is_dir() else []:
            if d.name not in self._frozen_refs:
                log.info("container tier: releasing frozen layer %s no sandbox uses", d.name)
                try:
                    await asyncio.to_thread(release_frozen, d)
                except DsecError as e:
                    log.warning("%s", e)

    async def list_orphans(self, known: set[str]) -> list[str]:
        """Sandboxes of this install on this node that ``known`` does not list: a sandbox
        directory, an OCI runtime state entry or a cgroup under this install's parent."""
        found: set[str] = set()
        if self.paths.sandboxes.is_dir():  # shared with other tiers: only ours count
            found.update(
                p.name
                for p in self.paths.sandboxes.iterdir()
                if _is_container_dir(p, self._state_file(p.name))
            )
        state_dir = self._state_base() / "sandbox-state"
        if self._state_base() != self.paths.run and state_dir.is_dir():
            found.update(p.name[: -len(".json")] for p in state_dir.glob("*.json"))
        for root in self._state_roots():
            if root.is_dir():
                found.update(p.name for p in root.iterdir() if p.is_dir())
        parent = cgroup(self.cgroup_parent)
        for name in parent.children():
            if name.startswith(_GROUP_PREFIX):  # a CPU share group: its sandboxes
                found.update(parent.child(name).children())
            else:
                found.add(name)
        # a claimed sandbox's cgroups have the warm id (and, made by an older dsec, cgroup2's)
        for sid in known:
            st = self._load_state(Handle(sid))
            for cg in (st.cgroup, st.cgroup_warm):
                if cg:
                    found.discard(cg.rsplit("/", 1)[-1])
        return sorted(found - known - set(self._live) - self._warm_ids)

    async def destroy_orphan(self, sandbox_id: str) -> None:
        """Destroy an unknown sandbox from what the node shows (its state.json if any)."""
        handle = Handle(sandbox_id)
        state = self._load_state(handle)
        if not state.oci_runtime:
            for root in self._state_roots():
                if (root / sandbox_id).exists():
                    state.oci_runtime = shutil.which(root.name)
                    state.state_root = str(root)
        await self._destroy(Handle.of(sandbox_id, state), keep_live=False)


class ContainerProcess:
    """A process started by :meth:`ContainerRuntime.start_process`.

    Implements ``dsec.e2b.interactive.InteractiveProcess``: read output until ``None``,
    then :meth:`wait` for the :class:`ExecResult` (its stdout/stderr are empty: they
    were streamed).
    """

    def __init__(
        self,
        runtime: ContainerRuntime,
        handle: Handle,
        execution: InteractiveExecution,
        oom_file: str,
        oom_before: int,
    ) -> None:
        self._runtime = runtime
        self._handle = handle
        self._execution = execution
        self._oom_file = oom_file
        self._oom_before = oom_before
        self._counted = True  # counts as a running command for the CPU weight

    def _done(self) -> None:
        if self._counted:
            self._counted = False
            self._runtime._busy(self._handle, -1)

    async def read_output(self) -> tuple[str, bytes] | None:
        """The next ``(stream, bytes)`` (``stdout``, ``stderr`` or ``pty``), ``None`` at the end."""
        return await self._execution.read_output()

    async def write_stdin(self, data: bytes) -> None:
        """Write ``data`` to stdin (terminal input with a pty); ``Conflict`` once closed."""
        await self._execution.write_stdin(data)

    async def close_stdin(self) -> None:
        """Close stdin (EOF; with a pty: ^D). Idempotent."""
        await self._execution.close_stdin()

    async def signal(self, signum: int) -> None:
        """Send ``signum`` to the process group; a no-op once it exited."""
        await self._execution.signal(signum)

    async def resize(self, size: TerminalSize) -> None:
        """Resize its terminal; ``CapabilityNotSupported`` if it has none."""
        if not self._execution.has_pty:
            raise CapabilityNotSupported("the process has no terminal (start it with a pty)")
        self._execution.resize(size)

    async def wait(self) -> ExecResult:
        """Wait for exit. ``SandboxStopped`` if the sandbox went away meanwhile."""
        try:
            out = await self._execution.wait()
        except (SandboxStopped, SandboxError) as e:
            self._done()
            if self._execution.server_closed_by_edge:
                raise SandboxStopped(
                    f"sandbox {self._handle.id} was stopped while the process ran"
                ) from None
            await self._runtime._explain_exec_failure(self._handle, e)
            raise
        self._done()
        return ExecResult(
            exit_code=out.exit_code,
            signal=out.signal,
            timed_out=out.timed_out,
            stdout_truncated=out.stdout_truncated,
            stderr_truncated=out.stderr_truncated,
            duration_ms=out.duration_ms,
            oom_killed=_killed_by_oom(
                out.exit_code, out.signal, self._oom_before, _oom_kills(self._oom_file)
            ),
        )

    def close(self) -> None:
        """Kill the process if it still runs and drop its output."""
        self._execution.close()
        self._done()


def _killed_by_oom(
    exit_code: int | None, signo: int | None, oom_before: int, oom_after: int
) -> bool:
    """Whether the OOM killer ended this command. The sandbox's memory cgroup counts every
    OOM kill in it, including those of background processes (a hog left running would
    otherwise mark every later command), so a kill counts for the command only if the command
    itself died of SIGKILL, or exited 137 (how a shell reports a child killed by SIGKILL)."""
    if oom_after <= oom_before:
        return False
    return signo == signal.SIGKILL or exit_code == 128 + signal.SIGKILL


def _env_number(name: str, default: float) -> float:
    """The number ``$name`` gives (``default`` when unset); a node started with a malformed
    one stops with a message naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError as e:
        raise SystemExit(f"invalid {name}={raw!r}: {e}") from e


def _idle_shares_from_env() -> int:
    value = int(_env_number("DSEC_IDLE_CPU_SHARES", 2))
    return 0 if value <= 0 else max(2, value)


def _reclaim_after_from_env() -> float:
    return max(0.0, _env_number("DSEC_PAUSE_RECLAIM_AFTER_S", 5.0))


def _exec_boost_from_env() -> tuple[float, float]:
    boost = _env_number("DSEC_EXEC_BOOST", 8.0)
    ms = _env_number("DSEC_EXEC_BOOST_MS", 200.0)
    return max(1.0, boost), max(0.0, ms) / 1000


def _replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a temporary file of this process, renamed over it."""
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


START_SHARES = 262_144
"""A starting container's ``cpu.shares`` (the most v1 allows; v2: ``cpu.weight`` 10000),
until its exec server answers: among its key's sandboxes it goes first (the key's own weight
bounds it against other keys)."""


def _full_shares(cpu: float) -> int:
    """The ``cpu.shares`` of a sandbox of ``cpu`` cores while it works (1024 per core)."""
    return max(2, min(262_144, int(1024 * cpu)))


def _compile_seccomp(execd_bin: Path, policy_file: Path) -> bytes | None:
    """The seccomp policy compiled to BPF by the exec server's own compiler (libseccomp,
    the same rules as ``linux.seccomp``), or None (logged) if that fails: crun then
    compiles ``linux.seccomp`` itself."""
    try:
        proc = subprocess.run(
            [str(execd_bin), "--bpf", str(policy_file)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_OCI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("compiling the seccomp policy failed: %s", e)
        return None
    # a program is a whole number of 8-byte instructions, at most BPF_MAXINSNS (4096)
    if proc.returncode != 0 or not proc.stdout or len(proc.stdout) % 8 or len(proc.stdout) > 32768:
        log.warning(
            "compiling the seccomp policy failed: %s", proc.stderr.decode(errors="replace")[-300:]
        )
        return None
    return proc.stdout


def _pool_key(spec: SandboxSpec, layer_scope: str) -> _PoolKey:
    # allow_setuid is fixed when the exec server starts: a warm container has the template's;
    # so is its cgroup, under its CPU group's, and its root, stacked on its scope's layer
    # mounts (a key's pool never hands out a container on another key's page cache)
    return (
        tuple(spec.layer_digests),
        tuple(spec.layer_paths),
        spec.disk_mb,
        spec.hostname,
        spec.allow_setuid,
        _group_dir(spec.cpu_group),
        layer_scope,
    )


def _group_dir(cpu_group: str) -> str:
    """The cgroup directory of a CPU share group ("" for none, or a name no cgroup may
    have)."""
    if not cpu_group or not _GROUP_NAME.fullmatch(cpu_group):
        return ""
    return _GROUP_PREFIX + cpu_group


_CGROUP_LABEL = "trusted.dsec.sandbox"
"""The extended attribute of a container's cgroups that names its sandbox, in every
hierarchy: ``getfattr -n trusted.dsec.sandbox <cgroup>``. A claimed warm container's
cgroups keep the warm id as their name; a fresh one's are named by the sandbox's id too."""


def _label_cgroup(rel: str, sandbox_id: str) -> None:
    """Label cgroup ``rel`` with ``sandbox_id`` in every hierarchy (:data:`_CGROUP_LABEL`).
    A kernfs attribute write: no cgroup lock, ~5 us each."""
    cgroup(rel).label(_CGROUP_LABEL, sandbox_id.encode())


def _limits_of(spec: SandboxSpec) -> ContainerLimits:
    """The limits ``spec`` asks for."""
    return ContainerLimits(cpu=spec.cpu, memory_mb=spec.memory_mb, pids=spec.pids)


def _set_limits(cg: Cgroup, current: ContainerLimits, spec: SandboxSpec) -> None:
    """Write ``spec``'s CPU, memory and pids limits into ``cg`` where they differ from
    ``current`` (the values the container has; the driver keeps v1's memory+swap limit
    never below the memory limit, and v2 without swap)."""
    if current.cpu != spec.cpu:
        cg.set_cpu(spec.cpu)
    had = current.memory_mb
    if had != spec.memory_mb:  # the current limit is known: not read again
        raising = spec.memory_mb > had if had is not None else None
        cg.set_memory(spec.memory_mb * 1024 * 1024, raising=raising)
    if current.pids != spec.pids:
        cg.set_pids(spec.pids)


def _private_tmpfs_dir(name: str, *, make: bool) -> Path | None:
    """``/dev/shm/<name>``, checked to be ours, if /dev/shm is a tmpfs; ``make``: create it
    (0700) if missing (else a missing one is returned as it will be)."""
    shm = Path("/dev/shm")
    try:
        with open("/proc/self/mountinfo") as f:
            if not any(line.split(" ")[4] == str(shm) and " - tmpfs " in line for line in f):
                return None
        path = shm / name
        if make:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        elif not os.path.lexists(path):
            return path
        st = os.lstat(path)
    except OSError:
        return None
    # /dev/shm is world-writable: refuse anything someone else planted
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        log.warning("not using %s for OCI state: not a private directory of ours", path)
        return None
    return path


def _is_container_dir(sandbox_dir: Path, state_file: Path) -> bool:
    """Whether a sandbox directory was made by this tier (other tiers share ``sandboxes/``);
    ``state_file``: where its state is (tmpfs or in the directory)."""
    for path in dict.fromkeys((state_file, sandbox_dir / "state.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        return isinstance(state, dict) and "oci_runtime" in state
    return (sandbox_dir / "config.json").is_file()


_BLOCKING_WORKERS = 16
_blocking_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _blocking_executor() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for the runtime's blocking work (``crun run``, teardown: kill, cgroup
    removal, unmounts; syscalls and child waits that release the GIL). asyncio's default
    executor has ``cpus + 4`` threads, 6 on this 2-core node: it capped a job's parallel
    kill at 6 teardowns in flight, and file transfers queued behind creations and kills."""
    global _blocking_pool
    if _blocking_pool is None:
        _blocking_pool = concurrent.futures.ThreadPoolExecutor(
            _BLOCKING_WORKERS, thread_name_prefix="dsec-teardown"
        )
    return _blocking_pool


@functools.lru_cache(maxsize=4096)
def _oom_kills_file(rel: str) -> str:
    """The file counting cgroup ``rel``'s OOM kills (v1 ``memory.oom_control``, v2
    ``memory.events``); asked at every exec, built once per sandbox."""
    return str(cgroup(rel).oom_kills_file())


def _oom_kills(oom_file: str) -> int:
    """The cgroup's ``oom_kill`` counter, read from :func:`_oom_kills_file` (0 if
    unreadable)."""
    try:
        fd = os.open(oom_file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    return Cgroup.parse_oom_kills(data.decode(errors="replace"))
