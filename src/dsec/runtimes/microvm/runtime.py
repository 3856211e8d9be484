"""The ``microvm`` tier: QEMU ``-M microvm`` guests restored from per-image templates.

Glossary:
    guest artifacts: the kernel (ELF, PVH boot), initramfs and agent built by
        :mod:`dsec.guest.build` (once per node, cached under ``$DSEC_HOME/bin``).
    template: one pre-booted guest per (guest artifacts, layer digests, memory, vCPUs,
        accelerator). Its RAM is a file on /dev/shm (``memory-backend-file,share=on``); its
        device state a small migration stream (``x-ignore-shared``: RAM is not in it).
    clone: a sandbox. QEMU maps the template RAM file *privately* (``share=off``: pages are
        shared with every other clone until written, copy-on-write), starts with
        ``-incoming defer`` and loads the device state via QMP ``migrate-incoming``. The guest
        agent then sets the clock, reseeds the RNG, sets the hostname and resizes the writable
        layer. ~0.1 s to agent-ready against ~1.5 s for a cold boot under TCG.

Layout on disk (``tag`` = short hash of ``$DSEC_HOME``, so two nodes' state never collide)::

    $DSEC_HOME/microvm/sandboxes/<id>/  q.sock (QMP), a.sock (agent), qemu.log, console.log
                                        (cut to its newest half past console_max_kb)
    $DSEC_HOME/microvm/templates/<key>/ state (device state), meta.json, console.log
    /dev/shm/dsec-tpl-<tag>/<tier>-<key>.ram   template guest RAM
    cgroup v1 dsec-<tag>/microvm/<id>   cpu quota, memory limit (guest RAM + QEMU overhead)

Template RAM is host memory (guest RAM size per template) that outlives no server: ``close``
deletes the templates no sandbox directory of the tier still names (a live clone maps the
file, a suspended one is a difference from it), and ``start`` deletes what a crashed server
of this home left the same way. Both only when no other runtime of this home and tier is
live (each holds a shared ``flock`` on ``$DSEC_HOME/<tier>/templates.lock`` while started;
the one that gets it exclusively is alone). ``MicroVMConfig.keep_templates`` keeps them
instead (a restart then needs no cold boot).

State machine: see :mod:`dsec.contract.runtime`. ``pause`` stops the vCPUs (QMP ``stop``);
``resume`` continues them and resets the guest clock. Any exec or file call on a paused
sandbox resumes it first.

Accelerator: KVM only if a probe boot of the guest kernel under ``-accel kvm`` reaches the
guest init (on a PVM host it hangs and the probe times out), else TCG. The result is cached
per host kernel and QEMU version; ``$DSEC_VM_ACCEL=kvm|tcg`` skips the probe.

Example::

    rt = MicroVMRuntime(Paths.from_env())
    await rt.start()
    h = await rt.create(spec)                      # spec.layer_paths: EROFS files, bottom first
    r = await rt.exec(h, ExecRequest(cmd="uname -r"))
    await rt.destroy(h)
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec.config import Paths, host_memory_mb
from dsec.contract.runtime import Handle, OutputSink, RuntimeFacts, SandboxFiles, SandboxSpec
from dsec.errors import (
    CapabilityNotSupported,
    Conflict,
    DsecError,
    InvalidRequest,
    SandboxError,
    SandboxStopped,
    SandboxTimeout,
    TierUnavailable,
)
from dsec.guest.build import GuestArtifacts, ensure_guest_artifacts, host_tsc_khz
from dsec.models import ExecRequest, ExecResult
from dsec.privileged.cgroups import Cgroup, CgroupUsage, cgroup, host_layout, prepare
from dsec.privileged.seccomp_log import GuardLog
from dsec.runtimes.microvm.ksm import ksmd_acquire, ksmd_release
from dsec.runtimes.microvm.protocol import AgentClient, AgentOp, AgentStream, VMFiles
from dsec.runtimes.microvm.qemu import (
    QemuProcess,
    QMPClient,
    find_qemu,
    kill_and_wait,
    pid_alive,
    pidfd_readable,
    qemu_processes,
    wait_exit,
)
from dsec.runtimes.microvm.state import MicrovmState
from dsec.runtimes.microvm.stream import StreamFormatError, diff_against_template
from dsec.runtimes.usage import SandboxUsage, parse_meminfo, processes_cpu_ns

__all__ = ["SUSPEND_DIR", "MemorySnapshot", "MicroVMConfig", "MicroVMRuntime"]

SUSPEND_DIR = "suspend"
"""Sub-directory of a sandbox directory holding a suspended VM: ``state`` (RAM + devices),
``meta.json``."""

_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_READY_WALL_FACTOR = 10.0
"""A guest's wait for its agent (boot, restore) ends at this many times its CPU budget on the
wall clock, whatever QEMU spent (:func:`until_ready`)."""
_READY_POLL_S = 0.5

POOL_WARMUP_CMD = "true; echo warm | cat > /dev/null; ls / > /dev/null; cd /tmp && pwd > /dev/null"
"""What a warmed pool guest runs once before it is handed out (see MicroVMConfig.pool_warm)."""


async def until_ready(
    proc: QemuProcess, agent: AgentClient, timeout_s: float, what: str,
    first: Coroutine[Any, Any, None] | None = None,
) -> None:  # fmt: skip
    """Wait for the agent to answer ``first`` (default a ping), failing fast if QEMU exits
    (kernel panic, bad kernel, failed init).

    ``timeout_s`` is QEMU's own CPU time, not the wall clock's: a boot on a saturated
    host gets less CPU each second and takes longer without being stuck (a TCG cold
    boot of ~9 s took over 60 s beside a busy test run), so it fails only once QEMU has
    spent ``timeout_s`` of CPU without the agent answering, or after
    :data:`_READY_WALL_FACTOR` times ``timeout_s`` on the wall clock (a guest that
    waits on nothing uses no CPU)."""
    ceiling = timeout_s * _READY_WALL_FACTOR
    ping = asyncio.create_task(first if first is not None else agent.ping(ceiling))
    died = asyncio.create_task(wait_exit(proc.pid, ceiling))
    cpu0 = processes_cpu_ns([proc.pid])
    give_up = time.monotonic() + ceiling
    try:
        while True:
            done, _ = await asyncio.wait(
                {ping, died}, timeout=_READY_POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            if done:
                break
            spent_s = (processes_cpu_ns([proc.pid]) - cpu0) / 1e9
            if spent_s >= timeout_s or time.monotonic() >= give_up:
                raise SandboxTimeout(
                    f"the guest agent did not answer during {what}: QEMU spent "
                    f"{spent_s:.1f} s of CPU (its budget: {timeout_s:g} s)\n{proc.evidence()}"
                )
        if ping in done and ping.exception() is None:
            return
        if died in done and died.result():
            raise SandboxError(
                f"the guest stopped during {what} (kernel panic or failed init)\n{proc.evidence()}"
            )
        exc = ping.exception() if ping in done else None
        if exc is not None and not isinstance(exc, SandboxTimeout):
            raise SandboxError(f"{what}: {exc}\n{proc.evidence()}")
        raise SandboxTimeout(
            f"the guest agent was not ready {ceiling:.0f} s into {what}\n{proc.evidence()}"
        )
    finally:
        for task in (ping, died):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass
class MicroVMConfig:
    """Tunables of the microvm tier. Times in seconds, sizes in MiB."""

    # kernel start to agent ready, in QEMU's CPU time (8 parallel TCG boots: ~9 s each)
    cold_boot_timeout_s: float = 60.0
    restore_timeout_s: float = 30.0  # QEMU start to agent ready on a template clone, CPU time
    accel: str | None = None  # "kvm" | "tcg" | None: probe (or $DSEC_VM_ACCEL)
    kvm_probe_timeout_s: float = 8.0
    # TCG translation cache per QEMU, MiB. At 16 it fills while a clone runs its first commands
    # and QEMU flushes it (every later command translates again: 0.3-1 s each); 64 holds the
    # working set for ~2-4 MiB more private memory per idle clone. Touched as used.
    tb_size_mb: int = 64
    # transparent huge pages for QEMU's own memory under TCG (PR_SET_THP_DISABLE when off).
    # Its translation buffer and heaps are then charged by the 4 KiB page touched, not by the
    # 2 MiB; a clone's guest RAM is the template file (shmem), not affected. Under KVM QEMU
    # keeps THP (huge pages back the guest's private RAM there)
    tcg_thp: bool = False
    qemu_overhead_mb: int = 256  # cgroup memory limit = guest RAM + this
    # guest RAM = memory_mb + this + memory_mb/64: the guest kernel, agent and page tables;
    # the sandbox's commands are held to memory_mb by a cgroup inside the guest
    guest_reserve_mb: int = 96
    # guest RAM is sized for at least this much command memory, so that sandboxes asking for
    # less share one template (their limit is the guest cgroup's memory.max)
    min_guest_memory_mb: int = 256
    qemu_pids: int = 256  # cgroup pids limit around one QEMU (its threads)
    templates: bool = True  # False: every sandbox cold-boots with private RAM (no sharing)
    exec_grace_s: float = 10.0  # past an exec's timeout, how long before the agent counts as hung
    pool_size: int = 2  # pre-started QEMUs per recently used template
    # pool QEMUs are restored from the template and run POOL_WARMUP_CMD before they are handed
    # out: under TCG each QEMU translates guest code afresh, so a clone's first command costs
    # 0.3-1 s; a warmed clone answers its first command in ~10-50 ms. False: pool QEMUs wait
    # in -incoming defer and the restore happens at create.
    pool_warm: bool = True
    extra_kernel_args: list[str] = field(default_factory=list)
    # the emulated CPU under TCG: everything QEMU can emulate ("max") but ERMS, so that the
    # guest's memset/memcpy/page clearing use wide moves, not byte-wise `rep movsb/stosb`
    # (each byte is one loop turn of translated code). Under KVM the CPU is always "host".
    tcg_cpu: str = "max,-erms"
    shm_dir: Path = Path("/dev/shm")  # template RAM goes to <shm_dir>/dsec-tpl-<tag>/
    # KSM: guest RAM marked mergeable (memory backend merge=on) and the whole QEMU process
    # (PR_SET_MEMORY_MERGE by the launcher). Merging happens only while ksmd runs.
    ksm: bool = True
    # turn ksmd on at start (/sys/kernel/mm/ksm/run=1, pages_to_scan below) and put the
    # previous values back at close. Off: ksmd is node policy (node setup sets it).
    ksmd: bool = False
    ksm_pages_to_scan: int = 1000  # pages per ksmd wake-up (every sleep_millisecs, 20 ms)
    # how RAM + device state go to and from files (suspend, memory fork): "fd" (QEMU writes
    # the file itself, fd passed over QMP) or "exec" (a `cat` child through a pipe)
    snapshot_transport: str = "fd"
    # template clones: leave the pages still equal to the template out of suspend and fork
    # files (restored over the template RAM file, share=off: those pages stay shared)
    snapshot_diff: bool = True
    suspend_timeout_s: float = 120.0  # writing or loading one memory state file
    # False: close() deletes the templates (RAM on /dev/shm: guest RAM each) no sandbox of
    # this home still needs and start() those a crashed server left; True keeps them for the
    # next start of this home (tests that start many runtimes on one home; faster restarts)
    keep_templates: bool = False
    # a running sandbox's console.log (the guest's serial console, which QEMU appends to) is
    # cut to its newest half when it passes this, checked every watch_interval_s: a guest
    # that writes its console as fast as it can (~450 KB/s under TCG) adds at most that
    # much per interval above the cap
    console_max_kb: int = 1024
    watch_interval_s: float = 5.0


@dataclass
class Template:
    """One template's files: ``dir`` (device state, meta.json; the vm tier's disk) and ``ram``."""

    key: str
    dir: Path
    ram: Path
    state: Path


@dataclass
class MemorySnapshot:
    """A running sandbox's RAM + device state (and, on the vm tier, a frozen copy of its
    disk) in ``dir``, for :meth:`MicroVMRuntime.create_from_memory`."""

    dir: Path
    state: Path
    state_bytes: int
    parent_id: str
    source: dict[str, Any]  # the parent's handle state: the machine's shape (layers, RAM, vCPUs)
    ram_backing: Path | None = None  # the template RAM file the state is a difference from


@dataclass
class _Pooled:
    """A QEMU started ahead of demand for one template: waiting in ``-incoming defer``, or
    (``restored``) already restored from the template and warmed up, waiting for ``setup``."""

    name: str
    proc: QemuProcess
    qmp: QMPClient
    agent: AgentClient
    restored: bool = False


@dataclass
class _VM:
    """Live connections to one sandbox's QEMU (rebuilt from Handle.state after a restart)."""

    id: str
    pid: int
    dir: Path
    qmp: QMPClient | None = None
    agent: AgentClient | None = None
    paused: bool = False
    dead: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ending: bool = False  # this runtime is ending the QEMU (suspend): its exit is no death
    watch: asyncio.Task[None] | None = None  # _watch: the QEMU's exit, the console's size


class MicroVMRuntime:
    """:class:`dsec.contract.runtime.Runtime` (and ``Pausable``) for the ``microvm`` tier."""

    tier = "microvm"
    machine = "microvm"

    def __init__(self, paths: Paths | None = None, config: MicroVMConfig | None = None) -> None:
        self.paths = paths or Paths.from_env()
        self.config = config or MicroVMConfig()
        self.tag = hashlib.sha256(str(self.paths.home.resolve()).encode()).hexdigest()[:8]
        self.root = self.paths.home / self.tier
        self.sandbox_root = self.root / "sandboxes"
        self.template_root = self.root / "templates"
        self.cgroup_prefix = f"dsec-{self.tag}/{self.tier}"
        # template RAM files of this node (both VM tiers); ``home`` in it names $DSEC_HOME so
        # that a later start can delete the files of a DSEC_HOME that no longer exists
        self.shm_dir = self.config.shm_dir / f"dsec-tpl-{self.tag}"
        # QEMUs are named dsec:<qemu_tag>:<name>; per tier so tiers never touch each other's
        self.qemu_tag = f"{self.tag}-{self.tier}"
        self.artifacts: GuestArtifacts | None = None
        self.accel: str = "tcg"
        self.accel_reason: str = "not started"
        self.qemu: str | None = None
        self._unavailable: str | None = "not started"
        self._live: dict[str, _VM] = {}
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._tsc_khz: int | None = None
        self.last_create: dict[str, float] = {}
        # template key -> pre-started QEMUs waiting for migrate-incoming
        self._pool: dict[str, list[_Pooled]] = {}
        self._pool_tasks: set[asyncio.Task[None]] = set()
        self._restore_locks: dict[str, asyncio.Lock] = {}
        self._ksmd_held = False
        self._templates_lock: int | None = None  # fd with a shared flock while started
        self._exit_listener: Callable[[str, str], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def facts(self) -> RuntimeFacts:
        return RuntimeFacts(
            available=self._unavailable is None,
            reason=self._unavailable
            or f"QEMU {self.machine}, {self.accel.upper()} ({self.accel_reason})",
            max_cpu=float(os.cpu_count() or 1),
            max_memory_mb=host_memory_mb() // 2,
        )

    async def start(self) -> None:
        """Find QEMU, build the guest artifacts (first start: a few seconds), probe KVM.

        A missing dependency leaves the tier unavailable (``capabilities().reason`` says what
        to install) instead of raising; ``create`` then raises :class:`TierUnavailable`.
        """
        for d in (self.sandbox_root, self.template_root, self.paths.bin):
            d.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self._prepare_shm)
        try:
            self.qemu = find_qemu()
            self.artifacts = await asyncio.to_thread(ensure_guest_artifacts, self.paths.bin)
            self._tsc_khz = await asyncio.to_thread(host_tsc_khz)
            await self._choose_accel()
            await self._kill_stale_helpers()
            await asyncio.to_thread(self._hold_templates)
            if self.config.ksmd and not self._ksmd_held:
                self._ksmd_held = ksmd_acquire(self.config.ksm_pages_to_scan)
            await asyncio.to_thread(self._check_cgroups)
            self._unavailable = None
        except TierUnavailable as e:
            self._unavailable = e.message
        except DsecError as e:
            self._unavailable = f"guest build failed: {e.message}"

    def _check_cgroups(self) -> None:
        """Each QEMU runs in a cgroup of its own (CPU quota, memory, pids): the host's layout
        must have them, and dsec's base is made ready for them (v2: controllers enabled down
        to it, the server moved into a leaf; idempotent, as root only)."""
        layout = host_layout()
        if not layout.usable:
            raise TierUnavailable(f"QEMU processes need cgroups: {layout.reason}")
        if os.geteuid() == 0:
            try:
                prepare(layout)
            except OSError as e:
                raise TierUnavailable(f"cannot prepare dsec's cgroups: {e}") from e

    def _prepare_shm(self) -> None:
        """Make this node's template RAM directory; delete those of vanished DSEC_HOMEs
        (test servers remove their home, not /dev/shm: each template holds up to guest RAM)."""
        with contextlib.suppress(OSError):
            for d in self.config.shm_dir.glob("dsec-tpl-*"):
                with contextlib.suppress(OSError):
                    home = (d / "home").read_text()
                    if d != self.shm_dir and not Path(home).is_dir():
                        shutil.rmtree(d, ignore_errors=True)
        self._ensure_shm_dir()

    def _ensure_shm_dir(self) -> None:
        self.shm_dir.mkdir(mode=0o700, exist_ok=True)
        marker = self.shm_dir / "home"
        if not marker.exists():
            marker.write_text(str(self.paths.home.resolve()))

    def _hold_templates(self) -> None:
        """Take this runtime's shared lock on the home's templates; alone (no other live
        runtime of this home and tier), first delete the templates a crashed one left."""
        if self._templates_lock is not None:
            return
        fd = os.open(self.root / "templates.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            if not self.config.keep_templates and _flock_alone(fd):
                self._release_unused_templates()
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        self._templates_lock = fd

    def _let_go_of_templates(self) -> None:
        """Drop the lock taken at start; alone, delete the templates no sandbox needs."""
        fd, self._templates_lock = self._templates_lock, None
        if fd is None:
            return
        try:
            if not self.config.keep_templates and _flock_alone(fd):
                self._release_unused_templates()
        finally:
            os.close(fd)

    def _release_unused_templates(self) -> None:
        """Delete every template of this tier (RAM file and directory) that no sandbox
        directory names: a live clone maps its RAM file, a suspended or forked one loads a
        difference from it and the vm tier's clones' disks are overlays over its disk. Runs
        with the templates lock held exclusively (no other runtime of this home is live)."""
        needed: set[str] = set()
        if self.sandbox_root.is_dir():
            for d in self.sandbox_root.iterdir():
                key = self._saved_state(d.name).get("template")
                if key and not d.name.startswith("pool-"):
                    needed.add(str(key))
        prefix = f"{self.tier}-"
        with contextlib.suppress(OSError):
            for ram in self.shm_dir.glob(f"{prefix}*.ram"):
                if ram.name[len(prefix) : -len(".ram")] not in needed:
                    with contextlib.suppress(FileNotFoundError):
                        ram.unlink()
        if self.template_root.is_dir():
            for d in self.template_root.iterdir():
                if d.name not in needed:
                    shutil.rmtree(d, ignore_errors=True)

    async def close(self) -> None:
        """Stop the pool; drop connections. Sandbox VMs keep running (``recover()`` reattaches).
        Templates no sandbox needs are deleted (unless ``keep_templates`` or another runtime
        of this home is live)."""
        await self.drain_pool()
        for vm in list(self._live.values()):
            await self._unwatch(vm)
            await self._disconnect(vm)
        self._live.clear()
        await asyncio.to_thread(self._let_go_of_templates)
        if self._ksmd_held:
            ksmd_release()
            self._ksmd_held = False
        # our cgroup parents, if no sandbox is left in them (the kernel refuses otherwise)
        for rel in (self.cgroup_prefix, self.cgroup_prefix.split("/")[0]):
            with contextlib.suppress(OSError):
                cgroup(rel).remove_if_empty()

    # ------------------------------------------------------------------ accelerator

    async def _choose_accel(self) -> None:
        forced = self.config.accel or os.environ.get("DSEC_VM_ACCEL")
        if forced:
            if forced not in ("kvm", "tcg"):
                raise InvalidRequest(f"DSEC_VM_ACCEL must be kvm or tcg, not {forced!r}")
            self.accel, self.accel_reason = forced, "forced by configuration"
            return
        if not os.access("/dev/kvm", os.R_OK | os.W_OK):
            self.accel, self.accel_reason = "tcg", "no usable /dev/kvm"
            return
        assert self.artifacts is not None
        qemu_version = subprocess.run(
            [self.qemu or "qemu-system-x86_64", "--version"], capture_output=True, text=True
        ).stdout
        probe_key = hashlib.sha256(
            f"{platform.release()}\0{qemu_version}\0{self.artifacts.key}".encode()
        ).hexdigest()[:16]
        cache = self.paths.bin / f"kvm-probe-{probe_key}.json"
        if cache.exists():
            data = json.loads(cache.read_text())
            self.accel, self.accel_reason = data["accel"], data["reason"]
            return
        ok, detail = await self._probe_kvm()
        self.accel = "kvm" if ok else "tcg"
        self.accel_reason = f"KVM probe: {detail}"
        cache.write_text(json.dumps({"accel": self.accel, "reason": self.accel_reason}))

    async def _probe_kvm(self) -> tuple[bool, str]:
        """Boot the guest kernel under KVM with no layers: init fails fast and says so on the
        console. Seeing that line means KVM runs this guest."""
        assert self.artifacts is not None and self.qemu is not None
        d = self.root / f"kvm-probe-{os.getpid()}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        try:
            argv = [
                self.qemu, "-M", "microvm,x-option-roms=off,pit=off,pic=off,isa-serial=on,rtc=on",
                "-accel", "kvm", "-cpu", "host", "-smp", "1", "-m", "128", "-nodefaults",
                "-no-user-config", "-nographic", "-no-reboot", "-display", "none",
                "-kernel", str(self.artifacts.vmlinux), "-initrd", str(self.artifacts.initramfs),
                "-append", "console=ttyS0 panic=-1 dsec.layers=0",
                "-chardev", f"file,id=con,path={d}/console.log", "-serial", "chardev:con",
            ]  # fmt: skip
            proc = QemuProcess.launch(self.artifacts.agent, [], argv, d, ksm=False)
            exited = await wait_exit(proc.pid, self.config.kvm_probe_timeout_s)
            if not exited:
                await kill_and_wait(proc.pid)
            console = (
                (d / "console.log").read_text(errors="replace")
                if (d / "console.log").exists()
                else ""
            )
            if "dsec-init:" in console:
                return True, "the guest booted under KVM"
            if not exited:
                return (
                    False,
                    f"the guest did not boot under KVM within {self.config.kvm_probe_timeout_s:.0f} s (PVM host?); using TCG",
                )
            errors = [ln for ln in proc.log.read_text(errors="replace").splitlines() if ln.strip()]
            return False, "QEMU refused KVM: " + (errors[0] if errors else "exit without output")
        finally:
            shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ QEMU command line

    def guest_ram_mb(self, memory_mb: int) -> int:
        """Guest RAM for a sandbox of ``memory_mb`` MiB: the commands get ``memory_mb`` (a
        cgroup in the guest), the guest kernel and agent the reserve on top (MiB). Sizes
        below ``min_guest_memory_mb`` get the RAM of that size (one template for all)."""
        sized = max(memory_mb, self.config.min_guest_memory_mb)
        return sized + self.config.guest_reserve_mb + sized // 64

    def _vcpus(self, cpu: float) -> int:
        return max(1, min(math.ceil(cpu), os.cpu_count() or 1))

    # virtio transport: "device" (virtio-mmio, microvm) or "pci" (q35)
    _virtio_bus = "device"

    def _kernel_image(self) -> Path:
        """The kernel QEMU loads: the uncompressed ELF (PVH entry, fastest boot)."""
        assert self.artifacts is not None
        return self.artifacts.vmlinux

    async def _sandbox_devices(self, d: Path, spec: SandboxSpec, tpl: Template | None) -> list[str]:
        """Extra QEMU arguments for the machine in directory ``d`` (the vm tier adds its disk
        and display). ``tpl``: the template the machine is restored from (None: it boots)."""
        return []

    def _template_key_extra(self, spec: SandboxSpec) -> list[Any]:
        """What else a template depends on (the vm tier: the writable disk's size)."""
        return []

    def _discard_files(self, name: str) -> None:
        """Remove what the machine named ``name`` (sandbox id or pool name) keeps outside its
        directory (the vm tier: its writable disk). Idempotent."""

    def _template_complete(self, t: Template) -> bool:
        """Whether every file of template ``t`` is present."""
        return (t.dir / "meta.json").exists() and t.ram.exists() and t.state.exists()

    def _setup_disk_mb(self, spec: SandboxSpec) -> int:
        """Writable-layer size the agent applies after boot/restore (tmpfs remount), MiB."""
        return spec.disk_mb

    def _kernel_args(self, n_layers: int, disk_mb: int) -> str:
        args = ["console=ttyS0", "quiet", "panic=-1", "cryptomgr.notests", "random.trust_cpu=on",
                "8250.nr_uarts=1", f"dsec.layers={n_layers}", f"dsec.disk_mb={disk_mb}"]  # fmt: skip
        # no AppArmor/IMA in the guest: nothing loads a policy there, and their hooks run on
        # every exec and open (Landlock, Yama and BPF stay available to the sandbox)
        args.append("lsm=landlock,yama,bpf")
        # an idle guest must not wake its vCPU (every wake-up is a QEMU timer, a vCPU kick and
        # a guest tick or two: host CPU per idle VM, benchmarks/vm.py --only idle):
        # - nowatchdog: no soft/hard lockup watchdog hrtimer (every 4 s);
        # - vm.compaction_proactiveness=0: kcompactd sleeps until asked, not every 500 ms
        args += ["nowatchdog", "sysctl.vm.compaction_proactiveness=0"]
        if self.accel == "tcg":
            # - tsc=reliable: no clocksource watchdog (every 500 ms): QEMU's TSC follows the
            #   host's monotonic clock
            args.append("tsc=reliable")
            if self._tsc_khz:
                args.append(f"tsc_early_khz={self._tsc_khz}")
            # Under TCG every guest instruction is emulated, and an exec round trip is mostly
            # the guest kernel creating and tearing down a process (docs/design/microvm.md):
            # - mitigations=off: the emulated CPU does not speculate, so Meltdown/Spectre
            #   workarounds buy nothing; page-table isolation alone doubles the cost of every
            #   syscall (each CR3 switch flushes QEMU's soft TLB): fork+exec 2x faster;
            # - init_on_alloc=0: no zeroing of every slab and page allocation (pages mapped
            #   to user space are still zeroed); the guest's memory is one sandbox's own;
            # - clearcpuid=rep_good: page clearing and copying by unrolled 8-byte moves, not
            #   `rep stosq/movsq`, which TCG runs one iteration per loop turn.
            # Together with tcg_cpu: echo round trip -12% (benchmarks/vm.py, A/B).
            # - dsec.bpf_jit=0: the agent turns the BPF JIT off. Each guarded command attaches
            #   the seccomp filter; JIT-compiling it, and QEMU translating the fresh code, cost
            #   more under TCG than interpreting it for a command's lifetime.
            args += ["mitigations=off", "init_on_alloc=0", "clearcpuid=rep_good", "dsec.bpf_jit=0"]
        return " ".join(args + self.config.extra_kernel_args)

    def _accel_args(self) -> list[str]:
        """-accel/-cpu: KVM with the host CPU, else TCG with :attr:`MicroVMConfig.tcg_cpu`."""
        if self.accel == "kvm":
            return ["-accel", "kvm", "-cpu", "host"]
        return ["-accel", f"tcg,tb-size={self.config.tb_size_mb}", "-cpu", self.config.tcg_cpu]

    def _launch(self, cgroup_procs: list[Path], argv: list[str], dir: Path) -> QemuProcess:
        """Start QEMU ``argv`` through the launcher (:meth:`QemuProcess.launch`): mergeable
        for KSM if configured, and under TCG without transparent huge pages
        (:attr:`MicroVMConfig.tcg_thp`)."""
        assert self.artifacts is not None
        thp = self.accel != "tcg" or self.config.tcg_thp
        return QemuProcess.launch(
            self.artifacts.agent, cgroup_procs, argv, dir, self.config.ksm, thp
        )

    def _machine_args(self) -> list[str]:
        """-M/-cpu/-accel for this tier (the vm tier overrides)."""
        return [
            "-M",
            "microvm,x-option-roms=off,pit=off,pic=off,isa-serial=on,rtc=on,memory-backend=mem",
            *self._accel_args(),
        ]

    def _argv(
        self, name: str, dir: Path, layer_paths: list[str], memory_mb: int, vcpus: int, disk_mb: int,
        ram: Path | None, share: bool, incoming: bool, extra: list[str] | None = None,
    ) -> list[str]:  # fmt: skip
        assert self.artifacts is not None and self.qemu is not None
        ram_mb = self.guest_ram_mb(memory_mb)
        mem = f"memory-backend-ram,id=mem,size={ram_mb}M"
        if ram is not None:
            mem = f"memory-backend-file,id=mem,size={ram_mb}M,mem-path={ram},share={'on' if share else 'off'}"
        mem += f",merge={'on' if self.config.ksm else 'off'}"
        argv = [
            self.qemu, "-name", f"dsec:{self.qemu_tag}:{name}", *self._machine_args(),
            "-smp", str(vcpus), "-m", f"{ram_mb}M", "-object", mem,
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-display", "none",
            "-kernel", str(self._kernel_image()), "-initrd", str(self.artifacts.initramfs),
            "-append", self._kernel_args(len(layer_paths), disk_mb),
            "-chardev", f"file,id=con,path={dir}/console.log,append=on", "-serial", "chardev:con",
            "-chardev", f"socket,id=agent,path={dir}/a.sock,server=on,wait=off",
            "-device", f"virtio-serial-{self._virtio_bus},max_ports=2",
            "-device", "virtserialport,chardev=agent,name=agent",
            "-qmp", f"unix:{dir}/q.sock,server=on,wait=off",
        ]  # fmt: skip
        for i, p in enumerate(layer_paths):
            argv += [
                "-drive", f"file={str(p).replace(',', ',,')},if=none,id=l{i},format=raw,readonly=on,cache=none,aio=threads",
                "-device", f"virtio-blk-{self._virtio_bus},drive=l{i},serial=layer{i}",
            ]  # fmt: skip
        argv += extra or []
        if incoming:
            argv += ["-incoming", "defer"]
        return argv

    # ------------------------------------------------------------------ templates

    def _template_key(self, spec: SandboxSpec, vcpus: int) -> str:
        assert self.artifacts is not None
        blob = json.dumps([self.artifacts.key, spec.layer_digests, vcpus, self.accel,
                           self._machine_args(), self.tier, self.config.extra_kernel_args,
                           self.guest_ram_mb(spec.memory_mb), self._kernel_args(len(spec.layer_paths), 0),
                           *self._template_key_extra(spec)])  # fmt: skip
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def _template_paths(self, key: str) -> Template:
        d = self.template_root / key
        return Template(
            key=key,
            dir=d,
            ram=self.shm_dir / f"{self.tier}-{key}.ram",
            state=d / "state",
        )

    def templates(self) -> list[str]:
        """Keys of the templates ready on this node."""
        if not self.template_root.is_dir():
            return []
        return sorted(p.name for p in self.template_root.iterdir() if (p / "meta.json").exists())

    def remove_templates(self) -> None:
        """Delete every template of this tier (its RAM file on /dev/shm and its directory)."""
        if self.template_root.is_dir():
            for d in self.template_root.iterdir():
                t = self._template_paths(d.name)
                with contextlib.suppress(FileNotFoundError):
                    t.ram.unlink()
                shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            for ram in self.shm_dir.glob(f"{self.tier}-*.ram"):
                ram.unlink()
        if self.shm_dir.is_dir() and not any(self.shm_dir.glob("*.ram")):
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    async def _ensure_template(self, spec: SandboxSpec, vcpus: int) -> tuple[Template, bool]:
        """The template for this spec, cold-booting and snapshotting it if needed.

        Returns (template, built_now)."""
        key = self._template_key(spec, vcpus)
        t = self._template_paths(key)
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if self._template_complete(t):
                return t, False
            await self._build_template(t, spec, vcpus)
            return t, True

    async def _build_template(self, t: Template, spec: SandboxSpec, vcpus: int) -> None:
        assert self.artifacts is not None
        shutil.rmtree(t.dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            t.ram.unlink()
        t.dir.mkdir(parents=True)
        self._ensure_shm_dir()
        name = f"tpl-{t.key}"
        extra = await self._sandbox_devices(t.dir, spec, None)
        argv = self._argv(
            name, t.dir, spec.layer_paths, spec.memory_mb, vcpus, spec.disk_mb, t.ram, True, False,
            extra,
        )  # fmt: skip
        proc = self._launch([], argv, t.dir)
        qmp: QMPClient | None = None
        agent: AgentClient | None = None
        ok = False
        try:
            qmp = await QMPClient.connect(str(t.dir / "q.sock"), pid=proc.pid)
            agent = await AgentClient.connect(str(t.dir / "a.sock"))
            await until_ready(proc, agent, self.config.cold_boot_timeout_s, "cold boot")
            await qmp.execute("migrate-set-capabilities",
                              capabilities=[{"capability": "x-ignore-shared", "state": True}])  # fmt: skip
            tmp = t.dir / "state.tmp"
            await qmp.execute("migrate", uri=f"exec:cat > {tmp}")
            await qmp.wait_migration(60.0)
            os.rename(tmp, t.state)
            os.chmod(t.ram, 0o600)  # guest memory: root only
            (t.dir / "meta.json").write_text(json.dumps({
                "layers": spec.layer_digests, "memory_mb": spec.memory_mb, "vcpus": vcpus,
                "accel": self.accel, "guest": self.artifacts.key, "created": time.time(),
            }))  # fmt: skip
            ok = True
        finally:
            if agent is not None:
                await agent.close()
            if qmp is not None:
                await qmp.close()
            await kill_and_wait(proc.pid)
            if not ok:
                evidence = proc.evidence()
                shutil.rmtree(t.dir, ignore_errors=True)
                with contextlib.suppress(FileNotFoundError):
                    t.ram.unlink()
                if evidence:
                    (self.root / "last-failed-boot.log").write_text(evidence)

    # ------------------------------------------------------------------ pool

    async def _prepare_incoming(self, qmp: QMPClient) -> None:
        await qmp.execute("migrate-set-capabilities",
                          capabilities=[{"capability": "x-ignore-shared", "state": True}])  # fmt: skip

    def _take_pooled(self, key: str) -> _Pooled | None:
        pool = self._pool.get(key) or []
        while pool:
            p = pool.pop(0)
            if pid_alive(p.proc.pid) and not p.agent.closed:
                return p
            self._spawn_bg(self._discard_pooled(p))
        return None

    def _spawn_bg(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._pool_tasks.add(task)
        task.add_done_callback(self._pool_tasks.discard)

    def _refill_pool(self, tpl: Template, spec: SandboxSpec, vcpus: int) -> None:
        if self.config.pool_size <= 0:
            return
        pool = self._pool.setdefault(tpl.key, [])
        starting = sum(1 for t in self._pool_tasks if t.get_name() == f"pool-{tpl.key}")
        for _ in range(self.config.pool_size - len(pool) - starting):
            task = asyncio.create_task(self._start_pooled(tpl, spec, vcpus), name=f"pool-{tpl.key}")
            self._pool_tasks.add(task)
            task.add_done_callback(self._pool_tasks.discard)

    async def _start_pooled(self, tpl: Template, spec: SandboxSpec, vcpus: int) -> None:
        assert self.artifacts is not None
        name = f"pool-{os.urandom(6).hex()}"
        d = self.sandbox_root / name
        d.mkdir(parents=True)
        try:
            extra = await self._sandbox_devices(d, spec, tpl)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            self._discard_files(name)
            raise
        argv = self._argv(
            name, d, spec.layer_paths, spec.memory_mb, vcpus, spec.disk_mb, tpl.ram, False, True,
            extra,
        )  # fmt: skip
        proc = self._launch([], argv, d)
        try:
            qmp = await QMPClient.connect(str(d / "q.sock"), pid=proc.pid)
            agent = await AgentClient.connect(str(d / "a.sock"))
            await self._prepare_incoming(qmp)
            if self.config.pool_warm:
                await qmp.execute("migrate-incoming", uri=f"exec:cat {tpl.state}")
                await until_ready(proc, agent, self.config.restore_timeout_s, "restore")
                await self._warm_up(agent)
        except BaseException:
            await kill_and_wait(proc.pid)
            shutil.rmtree(d, ignore_errors=True)
            self._discard_files(name)
            raise
        self._pool.setdefault(tpl.key, []).append(
            _Pooled(name, proc, qmp, agent, restored=self.config.pool_warm)
        )

    async def _warm_up(self, agent: AgentClient) -> None:
        """Run :data:`POOL_WARMUP_CMD` in a restored pool guest so that QEMU has translated the
        guest's exec, fork, pipe and file paths before a user's first command. An image
        without /bin/sh just skips it."""
        with contextlib.suppress(DsecError):
            await agent.exec_raw(
                ["/bin/sh", "-c", POOL_WARMUP_CMD], env={"PATH": _DEFAULT_PATH}, cwd="/",
                user=None, stdin=b"", timeout_s=20.0, max_output_bytes=4096, grace_s=5.0,
            )  # fmt: skip
            await agent.request(AgentOp.STAT, [b"/"], 10.0)

    async def _discard_pooled(self, p: _Pooled) -> None:
        await p.agent.close()
        await p.qmp.close()
        await kill_and_wait(p.proc.pid)
        shutil.rmtree(p.proc.dir, ignore_errors=True)
        self._discard_files(p.name)

    async def pool_settled(self) -> None:
        """Wait until the pre-started QEMUs being launched are up (benchmarks, tests)."""
        tasks = [t for t in self._pool_tasks if t.get_name().startswith("pool-")]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def drain_pool(self) -> None:
        """Stop every pre-started QEMU (close() does this too)."""
        for t in list(self._pool_tasks):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        for pool in self._pool.values():
            for p in pool:
                await self._discard_pooled(p)
        self._pool.clear()

    async def _kill_stale_helpers(self) -> None:
        """Pool and template QEMUs left by a previous edge process of this node."""
        adopted = set()
        if self.sandbox_root.is_dir():
            for d in self.sandbox_root.iterdir():
                adopted.add(self._saved_state(d.name).get("qemu_name"))
        for name, pid in qemu_processes(self.qemu_tag).items():
            if name.startswith(("pool-", "tpl-")) and name not in adopted:
                await kill_and_wait(pid)
        if self.sandbox_root.is_dir():
            for d in self.sandbox_root.glob("pool-*"):
                shutil.rmtree(d, ignore_errors=True)
        for name in self._stale_pool_names(adopted):
            self._discard_files(name)

    def _stale_pool_names(self, adopted: set[Any]) -> list[str]:
        """Pool machine names with files outside their directory and no sandbox using them."""
        return []

    # ------------------------------------------------------------------ create / destroy

    def _cgroup(self, sandbox_id: str) -> Cgroup:
        return cgroup(f"{self.cgroup_prefix}/{sandbox_id}")

    def _make_cgroup(self, sandbox_id: str, cpu: float, memory_mb: int) -> Cgroup:
        """The sandbox's host cgroup (created if missing): CPU quota ``cpu`` cores, memory =
        guest RAM for ``memory_mb`` MiB + QEMU overhead, the QEMU pids limit."""
        cg = self._cgroup(sandbox_id)
        cg.create()
        cg.set_cpu(cpu)
        cg.set_memory((self.guest_ram_mb(memory_mb) + self.config.qemu_overhead_mb) << 20)
        cg.set_pids(self.config.qemu_pids)
        return cg

    def _check_spec(self, spec: SandboxSpec) -> None:
        if self._unavailable is not None:
            raise TierUnavailable(f"the {self.tier} tier is unavailable: {self._unavailable}")
        if not spec.layer_paths:
            raise InvalidRequest("a microvm needs at least one layer")
        for p in spec.layer_paths:
            if not Path(p).is_file():
                raise SandboxError(f"layer file {p} does not exist")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,70}", spec.id) or spec.id.startswith(
            ("pool-", "tpl-")
        ):
            raise InvalidRequest(f"bad sandbox id {spec.id!r}")
        if len(str(self.sandbox_root / spec.id / "a.sock")) > 107:
            raise InvalidRequest("DSEC_HOME is too long for unix socket paths under it")

    async def create(self, spec: SandboxSpec) -> Handle:
        """Boot a sandbox: clone the (image, memory, vCPUs) template, building it first if
        needed. On any failure the half-made sandbox is destroyed before the error is raised."""
        self._check_spec(spec)
        t0 = time.perf_counter()
        vcpus = self._vcpus(spec.cpu)
        d = self.sandbox_root / spec.id
        if d.exists():
            raise SandboxError(f"sandbox directory {d} already exists")
        d.mkdir(mode=0o700, parents=True)
        st = MicrovmState(
            dir=str(d), pid=0, accel=self.accel, vcpus=vcpus, memory_mb=spec.memory_mb,
            disk_mb=spec.disk_mb, workdir=spec.workdir, env=dict(spec.env), user=spec.user,
            hostname=spec.hostname, template=None, cpu=spec.cpu, pids=spec.pids,
            layer_paths=list(spec.layer_paths), full_guest=spec.full_guest,
        )  # fmt: skip
        handle = Handle.of(spec.id, st)
        try:
            async with asyncio.timeout(
                self.config.cold_boot_timeout_s + self.config.restore_timeout_s + 90
            ):
                template_built = False
                tpl: Template | None = None
                if self.config.templates:
                    tpl, template_built = await self._ensure_template(spec, vcpus)
                t1 = time.perf_counter()
                cg = self._make_cgroup(spec.id, spec.cpu, spec.memory_mb)
                assert self.artifacts is not None
                pooled = self._take_pooled(tpl.key) if tpl is not None else None
                if pooled is not None:
                    # adopt a pre-started QEMU: rename its directory, move it into the cgroup
                    os.rmdir(d)
                    os.rename(pooled.proc.dir, d)
                    proc = QemuProcess(
                        pooled.proc.pid, d, d / "qemu.log", d / "console.log", pooled.proc.popen
                    )
                    cg.attach(proc.pid)
                    qemu_name = pooled.name
                else:
                    procs = cg.procs_files()
                    argv = self._argv(
                        spec.id, d, spec.layer_paths, spec.memory_mb, vcpus, spec.disk_mb,
                        tpl.ram if tpl else None, False, tpl is not None,
                        await self._sandbox_devices(d, spec, tpl),
                    )  # fmt: skip
                    proc = self._launch(procs, argv, d)
                    qemu_name = spec.id
                st.pid, st.qemu_name = proc.pid, qemu_name
                st.template = tpl.key if tpl else None
                handle.keep(st)
                (d / "handle.json").write_text(json.dumps({"id": spec.id, **handle.state}))
                vm = self._register(_VM(id=spec.id, pid=proc.pid, dir=d))
                if pooled is not None:
                    vm.qmp, vm.agent = pooled.qmp, pooled.agent
                else:
                    try:
                        vm.qmp = await QMPClient.connect(str(d / "q.sock"), pid=proc.pid)
                    except SandboxError as e:
                        raise SandboxError(f"{e.message}\n{proc.evidence()}") from e
                    vm.agent = await AgentClient.connect(str(d / "a.sock"))
                t_qmp = time.perf_counter()
                if tpl is not None:
                    if pooled is None:
                        await self._prepare_incoming(vm.qmp)
                    if pooled is None or not pooled.restored:
                        await vm.qmp.execute("migrate-incoming", uri=f"exec:cat {tpl.state}")
                    t_mig = time.perf_counter()
                    # the first request after the restore sets clock, RNG, hostname, disk size
                    await until_ready(proc, vm.agent, self.config.restore_timeout_s, "restore",
                                            vm.agent.setup(spec.hostname, self._setup_disk_mb(spec),
                                                           pids=spec.pids, memory_mb=spec.memory_mb,
                                                           full_guest=spec.full_guest,
                                                           new_sandbox=True,
                                                           timeout_s=self._ready_ceiling_s))  # fmt: skip
                    self._refill_pool(tpl, spec, vcpus)
                else:
                    await until_ready(proc, vm.agent, self.config.cold_boot_timeout_s, "cold boot")
                    await vm.agent.setup(
                        spec.hostname, self._setup_disk_mb(spec), pids=spec.pids,
                        memory_mb=spec.memory_mb, full_guest=spec.full_guest, new_sandbox=True,
                    )  # fmt: skip
                t_ready = time.perf_counter()
                t2 = t_ready
                self.last_create = {
                    "template_build_s": (t1 - t0) if template_built else 0.0,
                    "boot_s": t2 - t1,
                    "total_s": t2 - t0,
                    "restored": float(tpl is not None),
                    "qemu_start_s": t_qmp - t1,
                    "pooled": float(pooled is not None),
                    "prewarmed": float(pooled is not None and pooled.restored),
                    "agent_ready_s": t_ready - t1,
                }
                if tpl is not None:
                    self.last_create["migrate_call_s"] = t_mig - t_qmp
                return handle
        except BaseException as e:
            await self.destroy(handle)
            if isinstance(e, TimeoutError) and not isinstance(e, DsecError):
                raise SandboxTimeout("microvm creation did not finish in time") from e
            raise

    async def destroy(self, handle: Handle) -> None:
        """Kill QEMU, remove its cgroup and every file of the sandbox. Idempotent."""
        vm = self._live.pop(handle.id, None)
        if vm is not None:
            await self._unwatch(vm)
            await self._disconnect(vm)
        st = handle.typed(MicrovmState)
        name = st.qemu_name or handle.id
        pids = {st.pid}
        pids |= {p for i, p in qemu_processes(self.qemu_tag).items() if i in (handle.id, name)}
        for pid in pids - {0}:
            if _is_our_qemu(pid, self.qemu_tag, handle.id) or _is_our_qemu(
                pid, self.qemu_tag, name
            ):
                await kill_and_wait(pid)
        await asyncio.to_thread(self._remove_cgroup, handle.id)
        d = self.sandbox_root / handle.id
        await asyncio.to_thread(shutil.rmtree, d, True)
        for machine in {handle.id, name}:
            self._discard_files(machine)

    def _remove_cgroup(self, sandbox_id: str) -> None:
        cg = self._cgroup(sandbox_id)
        if cg.exists():
            cg.remove()

    async def _disconnect(self, vm: _VM) -> None:
        if vm.agent is not None:
            await vm.agent.close()
            vm.agent = None
        if vm.qmp is not None:
            await vm.qmp.close()
            vm.qmp = None

    # ------------------------------------------------------------------ watching

    def on_exit(self, listener: Callable[[str, str], None]) -> None:
        """:class:`dsec.contract.runtime.ExitReporting`: ``listener(sandbox_id, why)`` is called
        when a sandbox's QEMU ends without this runtime ending it (a guest kernel panic or
        power-off, QEMU killed or crashed, an unresponsive guest this runtime stopped)."""
        self._exit_listener = listener

    def _register(self, vm: _VM) -> _VM:
        """``vm`` is this sandbox's live machine: watched until it ends or is let go."""
        self._live[vm.id] = vm
        vm.watch = asyncio.create_task(self._watch(vm), name=f"dsec-{self.tier}-watch-{vm.id}")
        return vm

    async def _unwatch(self, vm: _VM) -> None:
        task, vm.watch = vm.watch, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _watch(self, vm: _VM) -> None:
        """Until ``vm``'s QEMU exits, keep its console log under ``console_max_kb``; then,
        unless this runtime ended it (destroy, suspend), the sandbox is dead: QEMU reaped,
        its cgroup removed, the listener told why."""
        try:
            fd = os.pidfd_open(vm.pid)
        except OSError:
            fd = -1  # gone already
        console = vm.dir / "console.log"
        try:
            while fd >= 0 and not await pidfd_readable(fd, self.config.watch_interval_s):
                await asyncio.to_thread(bound_console, console, self.config.console_max_kb << 10)
        finally:
            if fd >= 0:
                os.close(fd)
        if vm.ending or self._live.get(vm.id) is not vm:
            return
        why = await asyncio.to_thread(_end_seen_on_console, console)
        why = why or vm.dead or "its QEMU exited"
        vm.dead = why
        with contextlib.suppress(OSError, DsecError):  # _on_lost may be doing the same
            await self._disconnect(vm)
            await wait_exit(vm.pid, 1.0)  # reaped if ours
            await asyncio.to_thread(self._remove_cgroup, vm.id)
        if self._exit_listener is not None:
            self._exit_listener(vm.id, why)

    # ------------------------------------------------------------------ connections

    async def _vm(self, handle: Handle, resume: bool = True) -> _VM:
        """The live VM of ``handle`` (reconnecting after a restart), resumed if paused."""
        vm = self._live.get(handle.id)
        if vm is None and self.is_suspended(handle):
            await self._restore_suspended(handle)  # transparent: any call restores it
            vm = self._live.get(handle.id)
        if vm is None:
            if not await self.recover(handle):
                raise SandboxStopped(f"sandbox {handle.id} is not running")
            vm = self._live[handle.id]
        if vm.dead:
            raise SandboxStopped(f"sandbox {handle.id} stopped: {vm.dead}")
        if vm.agent is None or vm.agent.closed:
            await self._on_lost(vm, "the guest agent connection was lost")
        if resume and vm.paused:
            await self.resume(handle)
        return vm

    async def _on_lost(self, vm: _VM, why: str) -> None:
        """The agent is gone or unresponsive: kill QEMU so nothing leaks; the sandbox is dead."""
        evidence = QemuProcess(
            vm.pid, vm.dir, vm.dir / "qemu.log", vm.dir / "console.log"
        ).evidence(1500)
        vm.dead = why
        await self._disconnect(vm)
        if pid_alive(vm.pid):
            await kill_and_wait(vm.pid)
        await asyncio.to_thread(self._remove_cgroup, vm.id)
        raise SandboxStopped(f"sandbox {vm.id}: {why}; QEMU was stopped\n{evidence}".strip())

    async def recover(self, handle: Handle) -> bool:
        """Reattach to a running QEMU after an edge restart (QMP + agent sockets). A suspended
        sandbox (state file on disk, no QEMU) counts as recovered: the next call restores it."""
        saved = MicrovmState.model_validate(self._saved_state(handle.id))
        st = handle.typed(MicrovmState)
        for k in ("pid", "qemu_name"):  # the pid changes when a suspended sandbox is restored
            if k in saved.model_fields_set:
                setattr(st, k, getattr(saved, k))
        handle.keep(st)
        if self.is_suspended(handle):
            return True
        pid = st.pid
        d = self._sandbox_dir(handle)
        if not pid or not _is_our_qemu(pid, self.qemu_tag, st.qemu_name or handle.id):
            return False
        vm = _VM(id=handle.id, pid=pid, dir=d)
        try:
            vm.qmp = await QMPClient.connect(str(d / "q.sock"), timeout_s=5.0, pid=pid)
            status = await vm.qmp.execute("query-status")
            vm.paused = not bool(status.get("running"))
            vm.agent = await AgentClient.connect(str(d / "a.sock"), timeout_s=5.0)
            if not vm.paused:
                await vm.agent.ping(5.0)
        except DsecError:
            await self._disconnect(vm)
            return False
        self._register(vm)
        return True

    async def alive(self, handle: Handle) -> bool:
        vm = self._live.get(handle.id)
        if vm is None:
            return await self.recover(handle)
        if vm.dead:
            return False
        if not pid_alive(vm.pid):
            return False
        if vm.paused:
            return True
        try:
            assert vm.agent is not None
            await vm.agent.ping(5.0)
            return True
        except DsecError:
            return False

    # ------------------------------------------------------------------ exec / files

    async def exec(
        self, handle: Handle, req: ExecRequest, sink: OutputSink | None = None
    ) -> ExecResult:
        vm = await self._vm(handle)
        assert vm.agent is not None
        st = handle.typed(MicrovmState)
        # no HOME here: the agent sets the user's home from the guest's /etc/passwd unless
        # the sandbox's or the request's env names one
        env = {"PATH": _DEFAULT_PATH, "HOSTNAME": st.hostname}
        env.update(st.env)
        env.update(req.env)
        stdin = req.stdin.encode() if req.stdin is not None else b""
        if req.stdin_b64 is not None:
            try:
                stdin = base64.b64decode(req.stdin_b64, validate=True)
            except ValueError as e:
                raise InvalidRequest(f"stdin_b64 is not base64: {e}") from e
        try:
            return await vm.agent.exec(
                req.argv(), env=env, cwd=req.cwd or st.workdir, user=req.user or st.user,
                stdin=stdin, timeout_s=req.timeout_s, max_output_bytes=req.max_output_bytes, sink=sink,
                grace_s=self.config.exec_grace_s,
            )  # fmt: skip
        except SandboxTimeout:
            await self._check_responsive(vm)
            raise
        except SandboxError as e:
            if vm.agent is None or vm.agent.closed or not pid_alive(vm.pid):
                await self._on_lost(vm, f"the VM stopped during exec ({e.message.splitlines()[0]})")
            raise

    async def _check_responsive(self, vm: _VM) -> None:
        try:
            assert vm.agent is not None
            await vm.agent.ping(3.0)
        except DsecError:
            await self._on_lost(vm, "the guest agent stopped answering")

    def files(self, handle: Handle) -> SandboxFiles:
        async def client() -> AgentClient:
            vm = await self._vm(handle)
            assert vm.agent is not None
            return vm.agent

        return VMFiles(client)

    async def connect_port(self, handle: Handle, port: int) -> AgentStream:
        """``PortConnectable``: a TCP connection to ``127.0.0.1:port`` in the guest, carried
        by the guest agent over its virtio-serial channel (no network device at all)."""
        vm = await self._vm(handle)
        assert vm.agent is not None
        return await vm.agent.open_tcp(port)

    # ------------------------------------------------------------------ usage

    def _disk_usage(self, handle: Handle) -> tuple[int | None, int | None]:
        """``(used, total)`` bytes of the writable layer as the host sees it. The microvm's is
        a tmpfs in guest RAM (its pages count as guest memory): only its size is known."""
        return None, handle.typed(MicrovmState).disk_mb << 20

    async def usage(self, handle: Handle) -> SandboxUsage:
        """:class:`dsec.contract.runtime.Measurable`: CPU and host memory from the QEMU process's
        cgroup (under TCG the guest's CPU is the host CPU QEMU burns), the guest's memory from
        its ``/proc/meminfo`` while it runs (a paused guest cannot answer: then what QEMU
        holds), and the writable layer. A suspended sandbox has no process: zeros."""
        group = self._cgroup(handle.id)
        vm = self._live.get(handle.id)

        def host() -> CgroupUsage | None:
            try:
                return group.usage()
            except FileNotFoundError:
                return None

        cg = await asyncio.to_thread(host)
        if cg is None and not self.is_suspended(handle):
            raise SandboxStopped(f"sandbox {handle.id} has no QEMU cgroup on this node")
        guest: dict[str, int] = {}
        agent = vm.agent if vm is not None and not vm.dead and not vm.paused else None
        if agent is not None and not agent.closed:
            with contextlib.suppress(DsecError):
                raw = await VMFiles(lambda: agent, op_timeout_s=2.0).read("/proc/meminfo", 1 << 16)
                guest = parse_meminfo(raw.decode("utf-8", "replace"))
        used, total = await asyncio.to_thread(self._disk_usage, handle)
        host_mem = cg.memory_used_bytes if cg is not None else 0
        limit = handle.typed(MicrovmState).memory_mb << 20 or None
        source = f"qemu cgroup v{cg.version}" if cg is not None else "suspended"
        if "MemTotal" in guest and "MemAvailable" in guest:
            mem_used = max(0, guest["MemTotal"] - guest["MemAvailable"])
            cache = guest.get("Cached", 0) + guest.get("Buffers", 0)
            source += " + guest /proc/meminfo"
        else:
            mem_used, cache = host_mem, cg.memory_cache_bytes if cg is not None else 0
        return SandboxUsage(
            cpu_usage_ns=(cg.cpu_usage_ns or 0) if cg is not None else 0,
            memory_used_bytes=mem_used,
            memory_cache_bytes=cache,
            memory_limit_bytes=limit,
            disk_used_bytes=used,
            disk_total_bytes=total,
            pids=None,
            source=source,
            host_memory_bytes=host_mem,
        )

    # ------------------------------------------------------------------ audit

    async def guard_log(self, handle: Handle, after: int) -> GuardLog | None:
        """:class:`dsec.contract.runtime.GuardAudited`: the guard's seccomp refusals the guest
        agent kept (``agent.c``, "the guard's refusals"). A paused, suspended or stopped
        sandbox cannot answer (None: read again when it runs; the guest keeps them)."""
        vm = self._live.get(handle.id)
        agent = vm.agent if vm is not None and not vm.dead and not vm.paused else None
        if agent is None or agent.closed:
            return None
        try:
            return await agent.guard_log(after)
        except DsecError:  # an agent older than the op (a template built before it)
            return None

    # ------------------------------------------------------------------ pause

    async def pause(self, handle: Handle) -> dict[str, Any]:
        """Stop the vCPUs (QMP ``stop``). Guest memory stays resident. (A suspended sandbox
        stays suspended.)"""
        if handle.id not in self._live and self.is_suspended(handle):
            return {"mode": "suspended", "notes": ["already suspended to a file"]}
        vm = await self._vm(handle, resume=False)
        async with vm.lock:
            if not vm.paused:
                assert vm.qmp is not None
                await vm.qmp.execute("stop")
                vm.paused = True
        return {"mode": "vcpus-stopped", "paused_at": time.time()}

    async def resume(self, handle: Handle) -> None:
        """Continue the vCPUs and reset the guest clock (it lags by the paused time); a
        suspended sandbox is restored from its state file."""
        vm = self._live.get(handle.id)
        if vm is None:
            vm = await self._vm(handle, resume=False)  # restores a suspended one
        async with vm.lock:
            if not vm.paused:
                return
            assert vm.qmp is not None and vm.agent is not None
            await vm.qmp.execute("cont")
            vm.paused = False
            await vm.agent.setup(handle.typed(MicrovmState).hostname, 0)

    # ------------------------------------------------------------------ suspend, memory fork

    @property
    def _ready_ceiling_s(self) -> float:
        """The wall-clock bound of the first request to a restored guest (its set-up):
        :func:`until_ready` around it bounds it by QEMU's CPU time, a loaded host's wall
        clock must not end it sooner."""
        return self.config.restore_timeout_s * _READY_WALL_FACTOR

    def _sandbox_dir(self, handle: Handle) -> Path:
        return Path(handle.typed(MicrovmState).dir or self.sandbox_root / handle.id)

    def is_suspended(self, handle: Handle) -> bool:
        """True if the sandbox's RAM and device state are in a file and no QEMU runs for it."""
        return (self._sandbox_dir(handle) / SUSPEND_DIR / "meta.json").exists()

    def _check_restorable(self, state: MicrovmState) -> None:
        if not state.layer_paths or not state.vcpus:
            raise CapabilityNotSupported(
                "this sandbox was created before memory snapshots existed (its handle lacks "
                "the machine description); recreate it to suspend or memory-fork it",
                tier=self.tier,
            )

    def _save_handle(self, handle: Handle) -> None:
        d = self._sandbox_dir(handle)
        tmp = d / "handle.json.tmp"
        tmp.write_text(json.dumps({"id": handle.id, **handle.state}))
        os.rename(tmp, d / "handle.json")

    async def _write_state(self, qmp: QMPClient, dest: Path) -> int:
        """Write the stopped VM's RAM and device state to ``dest`` (QMP ``migrate``, every
        RAM page: zero pages as a flag). Returns the file size in bytes."""
        tmp = dest.with_name(dest.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        await qmp.execute("migrate-set-capabilities",
                          capabilities=[{"capability": "x-ignore-shared", "state": False}])  # fmt: skip
        # QEMU's default migration bandwidth cap (128 MiB/s) would throttle a local file
        await qmp.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
        timeout = self.config.suspend_timeout_s
        if self.config.snapshot_transport == "fd":
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                await qmp.send_fd("dsec-state", fd)
            finally:
                os.close(fd)
            await qmp.execute("migrate", uri="fd:dsec-state")
            await qmp.wait_migration(timeout)
            os.rename(tmp, dest)
        elif self.config.snapshot_transport == "exec":
            # the shell renames the file only once cat has written all of it: QEMU reports
            # "completed" before its exec child has drained the pipe
            q_tmp, q_dest = shlex.quote(str(tmp)), shlex.quote(str(dest))
            await qmp.execute("migrate", uri=f"exec:cat > {q_tmp} && mv {q_tmp} {q_dest}")
            await qmp.wait_migration(timeout)
            deadline = time.monotonic() + timeout
            while not await asyncio.to_thread(dest.exists):
                if time.monotonic() > deadline:
                    raise SandboxTimeout(f"memory state file {dest} not complete in {timeout} s")
                await asyncio.sleep(0.005)
        else:
            raise InvalidRequest(
                f"snapshot_transport must be fd or exec, not {self.config.snapshot_transport!r}"
            )
        return os.stat(dest).st_size

    async def _diff_state(self, state: Path, st: MicrovmState) -> tuple[Path | None, int]:
        """Shrink ``state`` of a template clone to the pages that differ from its template
        (:mod:`dsec.runtimes.microvm.stream`). Returns (template RAM file the state now
        depends on, or None if it was left whole; the file size in bytes)."""
        key = st.template
        if not self.config.snapshot_diff or not key:
            return None, os.stat(state).st_size
        ram = self._template_paths(key).ram
        if not await asyncio.to_thread(ram.exists):
            return None, os.stat(state).st_size
        tmp = state.with_name(state.name + ".diff")
        try:
            await asyncio.to_thread(diff_against_template, state, tmp, ram)
        except (StreamFormatError, OSError) as e:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            (state.parent / "diff-skipped.txt").write_text(str(e))
            return None, os.stat(state).st_size
        os.rename(tmp, state)
        return ram, os.stat(state).st_size

    async def _load_state(self, proc: QemuProcess, qmp: QMPClient, state: Path) -> None:
        """Load ``state`` into a QEMU waiting in ``-incoming defer`` and wait until the guest
        runs again (QEMU exits on a bad stream: SandboxError with its log)."""
        await qmp.execute("migrate-set-capabilities",
                          capabilities=[{"capability": "x-ignore-shared", "state": False}])  # fmt: skip
        if self.config.snapshot_transport == "fd":
            fd = os.open(state, os.O_RDONLY | os.O_CLOEXEC)
            try:
                await qmp.send_fd("dsec-state", fd)
            finally:
                os.close(fd)
            await qmp.execute("migrate-incoming", uri="fd:dsec-state")
        else:
            await qmp.execute("migrate-incoming", uri=f"exec:cat {shlex.quote(str(state))}")
        deadline = time.monotonic() + self.config.suspend_timeout_s
        delay = 0.002
        while True:
            try:
                status: dict[str, Any] = await qmp.execute("query-status", timeout_s=10.0) or {}
            except SandboxError as e:
                if not pid_alive(proc.pid):
                    raise SandboxError(
                        f"QEMU exited while loading {state.name}\n{proc.evidence()}"
                    ) from e
                raise
            if status.get("running"):
                return
            if status.get("status") == "paused":
                # the state was written from stopped vCPUs, so QEMU keeps them stopped
                migration: dict[str, Any] = await qmp.execute("query-migrate") or {}
                if migration.get("status") == "completed":
                    await qmp.execute("cont")
                    return
            if status.get("status") in ("internal-error", "guest-panicked", "shutdown", "io-error"):
                raise SandboxError(f"loading {state.name} left the VM {status.get('status')}\n"
                                   f"{proc.evidence()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise SandboxTimeout(
                    f"loading {state.name} did not finish in {self.config.suspend_timeout_s} s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def _start_from_state(
        self, name: str, d: Path, st: MicrovmState, state: Path, cg: Cgroup,
        ram_backing: Path | None = None,
    ) -> tuple[QemuProcess, QMPClient, AgentClient]:  # fmt: skip
        """A new QEMU (same machine as ``st`` describes, private RAM, in cgroup ``cg``) that
        loads ``state`` and runs. Killed again on any failure."""
        assert self.artifacts is not None
        self._check_restorable(st)  # the machine is known
        assert st.vcpus is not None
        if ram_backing is not None and not await asyncio.to_thread(ram_backing.exists):
            raise SandboxError(
                f"the template RAM file {ram_backing} this memory state is a difference from "
                "is gone (templates were removed); the state cannot be restored"
            )
        for sock in ("q.sock", "a.sock"):
            with contextlib.suppress(FileNotFoundError):
                (d / sock).unlink()
        extra = await self._restore_devices(d, name)
        procs = cg.procs_files()
        argv = self._argv(
            name, d, list(st.layer_paths), st.memory_mb, st.vcpus, st.disk_mb, ram_backing, False,
            True, extra,
        )  # fmt: skip
        proc = self._launch(procs, argv, d)
        qmp: QMPClient | None = None
        agent: AgentClient | None = None
        try:
            try:
                qmp = await QMPClient.connect(str(d / "q.sock"), pid=proc.pid)
            except SandboxError as e:
                raise SandboxError(f"{e.message}\n{proc.evidence()}") from e
            agent = await AgentClient.connect(str(d / "a.sock"))
            await self._load_state(proc, qmp, state)
            return proc, qmp, agent
        except BaseException:
            if agent is not None:
                await agent.close()
            if qmp is not None:
                await qmp.close()
            await kill_and_wait(proc.pid)
            raise

    async def _restore_devices(self, d: Path, name: str) -> list[str]:
        """Extra QEMU arguments of a machine restored from a state file (the vm tier: its
        existing disk and the display)."""
        return []

    async def _freeze_disk(self, handle: Handle, dest_dir: Path) -> None:
        """Copy what the stopped VM keeps on a host disk into ``dest_dir`` (the vm tier's
        writable disk; the microvm's writable layer is in guest RAM)."""

    async def _adopt_disk(self, src_dir: Path, name: str) -> None:
        """Give the machine ``name`` its own copy of the disk frozen in ``src_dir``."""

    async def suspend(self, handle: Handle) -> dict[str, Any]:
        """Write RAM + device state to ``<sandbox dir>/suspend/state`` and end QEMU (host
        memory freed). The sandbox stays paused; resume or any exec/file call restores it.

        Returns PauseReport fields: memory before (QEMU PSS) and after (0), bytes."""
        if handle.id not in self._live and self.is_suspended(handle):
            return {"method": "suspended", "notes": ["already suspended to a file"]}
        self._check_restorable(handle.typed(MicrovmState))
        t0 = time.perf_counter()
        vm = await self._vm(handle, resume=False)
        async with vm.lock:
            assert vm.qmp is not None
            if vm.agent is not None and vm.agent.in_flight:
                raise Conflict(
                    f"sandbox {handle.id} has {vm.agent.in_flight} requests in flight; "
                    "suspend it once they are done (they would be lost with the VM process)"
                )
            before = self.memory_of(handle)
            sdir = vm.dir / SUSPEND_DIR
            shutil.rmtree(sdir, ignore_errors=True)
            sdir.mkdir(mode=0o700)
            was_paused = vm.paused
            try:
                if not was_paused:
                    await vm.qmp.execute("stop")
                full_size = await self._write_state(vm.qmp, sdir / "state")
                ram_backing, size = await self._diff_state(
                    sdir / "state", handle.typed(MicrovmState)
                )
            except BaseException:
                shutil.rmtree(sdir, ignore_errors=True)
                if not was_paused and vm.qmp is not None:
                    with contextlib.suppress(DsecError):
                        await vm.qmp.execute("cont")
                raise
            t_written = time.perf_counter()
            (sdir / "meta.json").write_text(json.dumps({
                "suspended_at": time.time(), "state_bytes": size, "pid": vm.pid,
                "transport": self.config.snapshot_transport,
                "ram_backing": str(ram_backing) if ram_backing else None,
            }))  # fmt: skip
            vm.ending = True
            with contextlib.suppress(DsecError):
                await vm.qmp.execute("quit", timeout_s=5.0)
            await self._disconnect(vm)
            if not await wait_exit(vm.pid, 10.0):
                await kill_and_wait(vm.pid)
            self._live.pop(handle.id, None)
            st = handle.typed(MicrovmState)
            st.pid = 0
            handle.keep(st)
            self._save_handle(handle)
        t1 = time.perf_counter()
        return {
            "method": "suspended-to-file",
            "memory_before_bytes": before["pss"],
            "memory_after_bytes": 0,
            "duration_ms": (t1 - t0) * 1000,
            "state_bytes": size,
            "full_state_bytes": full_size,
            "write_ms": round((t_written - t0) * 1000, 1),
            "transport": self.config.snapshot_transport,
        }

    async def _restore_suspended(self, handle: Handle) -> None:
        """Start a new QEMU from the sandbox's suspend file (same directory, cgroup, name and
        disk), reset the guest clock and reseed its RNG; then delete the file."""
        lock = self._restore_locks.setdefault(handle.id, asyncio.Lock())
        async with lock:
            if handle.id in self._live or not self.is_suspended(handle):
                return
            t0 = time.perf_counter()
            saved = self._saved_state(handle.id)
            st = MicrovmState.model_validate(
                {**handle.state, **{k: v for k, v in saved.items() if k != "id"}}
            )
            self._check_restorable(st)
            d = self._sandbox_dir(handle)
            name = st.qemu_name or handle.id
            cg = self._make_cgroup(handle.id, st.cpu or 1.0, st.memory_mb)
            meta = json.loads(await asyncio.to_thread((d / SUSPEND_DIR / "meta.json").read_text))
            backing = Path(meta["ram_backing"]) if meta.get("ram_backing") else None
            proc, qmp, agent = await self._start_from_state(
                name, d, st, d / SUSPEND_DIR / "state", cg, backing
            )
            try:
                await until_ready(proc, agent, self.config.restore_timeout_s, "resume",
                                        agent.setup(st.hostname, 0,
                                                    timeout_s=self._ready_ceiling_s))  # fmt: skip
            except BaseException:
                await agent.close()
                await qmp.close()
                await kill_and_wait(proc.pid)
                raise
            st.pid = proc.pid
            st.last_restore_ms = round((time.perf_counter() - t0) * 1000, 1)
            handle.keep(st)
            self._save_handle(handle)
            self._register(_VM(id=handle.id, pid=proc.pid, dir=d, qmp=qmp, agent=agent))
            shutil.rmtree(d / SUSPEND_DIR, ignore_errors=True)

    async def memory_snapshot(self, handle: Handle, *, portable: bool = False) -> MemorySnapshot:
        """Capture the running sandbox's RAM + device state (and the vm tier's disk) for
        memory forks. The vCPUs stop for the time of the write, then continue.

        ``portable`` (migration to another node): the state keeps every RAM page (it is not
        made a difference from this node's template RAM file) and the vm tier's disk copy is
        made standalone (no backing file of this node), so any node with the same layers,
        QEMU and accelerator can load it."""
        self._check_restorable(handle.typed(MicrovmState))
        vm = await self._vm(handle)
        snap_dir = self.root / "forks" / f"{handle.id}-{os.urandom(4).hex()}"
        snap_dir.mkdir(mode=0o700, parents=True)
        async with vm.lock:
            assert vm.qmp is not None and vm.agent is not None
            was_paused = vm.paused
            try:
                if not was_paused:
                    await vm.qmp.execute("stop")
                await self._write_state(vm.qmp, snap_dir / "state")
                await self._freeze_disk(handle, snap_dir)
            except BaseException:
                shutil.rmtree(snap_dir, ignore_errors=True)
                raise
            finally:
                if not was_paused and vm.qmp is not None:
                    with contextlib.suppress(DsecError):
                        await vm.qmp.execute("cont")
            if not was_paused:
                with contextlib.suppress(DsecError):  # the clock lags by the stop
                    await vm.agent.setup(handle.typed(MicrovmState).hostname, 0)
        # the vCPUs run again: shrinking the file does not hold up the parent
        if portable:
            try:
                await _standalone_disk(snap_dir / "disk.qcow2")
            except BaseException:
                shutil.rmtree(snap_dir, ignore_errors=True)
                raise
            ram_backing, size = None, os.stat(snap_dir / "state").st_size
        else:
            ram_backing, size = await self._diff_state(
                snap_dir / "state", handle.typed(MicrovmState)
            )
        return MemorySnapshot(
            dir=snap_dir, state=snap_dir / "state", state_bytes=size, parent_id=handle.id,
            source=dict(handle.state), ram_backing=ram_backing,
        )  # fmt: skip

    async def create_from_memory(self, snapshot: MemorySnapshot, spec: SandboxSpec) -> Handle:
        """A new sandbox ``spec.id`` resuming ``snapshot``: the parent's processes and memory,
        its own copy of the disk, its own clock, RNG seed, hostname and limits."""
        self._check_spec(spec)
        src = MicrovmState.model_validate(snapshot.source)
        if self.guest_ram_mb(spec.memory_mb) != self.guest_ram_mb(src.memory_mb):
            raise InvalidRequest("a memory fork has the parent's memory size")
        t0 = time.perf_counter()
        d = self.sandbox_root / spec.id
        if d.exists():
            raise SandboxError(f"sandbox directory {d} already exists")
        d.mkdir(mode=0o700, parents=True)
        st = MicrovmState(
            dir=str(d), pid=0, accel=self.accel, vcpus=src.vcpus, memory_mb=spec.memory_mb,
            disk_mb=src.disk_mb, workdir=spec.workdir, env=dict(spec.env), user=spec.user,
            hostname=spec.hostname, template=src.template, cpu=spec.cpu, pids=spec.pids,
            layer_paths=list(src.layer_paths), qemu_name=spec.id,
            forked_from=snapshot.parent_id, full_guest=spec.full_guest,
        )  # fmt: skip
        handle = Handle.of(spec.id, st)
        try:
            async with asyncio.timeout(
                self.config.suspend_timeout_s + self.config.restore_timeout_s
            ):
                cg = self._make_cgroup(spec.id, spec.cpu, spec.memory_mb)
                await self._adopt_disk(snapshot.dir, spec.id)
                self._save_handle(handle)
                proc, qmp, agent = await self._start_from_state(
                    spec.id, d, st, snapshot.state, cg, snapshot.ram_backing
                )
                st.pid = proc.pid
                handle.keep(st)
                self._save_handle(handle)
                self._register(_VM(id=spec.id, pid=proc.pid, dir=d, qmp=qmp, agent=agent))
                await until_ready(proc, agent, self.config.restore_timeout_s, "fork",
                                        agent.setup(spec.hostname, self._setup_disk_mb(spec),
                                                    pids=spec.pids, memory_mb=spec.memory_mb,
                                                    full_guest=spec.full_guest,
                                                    new_sandbox=True,
                                                    timeout_s=self._ready_ceiling_s))  # fmt: skip
        except BaseException as e:
            await self.destroy(handle)
            if isinstance(e, TimeoutError) and not isinstance(e, DsecError):
                raise SandboxTimeout("memory fork did not finish in time") from e
            raise
        self.last_create = {"total_s": time.perf_counter() - t0, "forked": 1.0}
        return handle

    async def drop_memory_snapshot(self, snapshot: MemorySnapshot) -> None:
        """Delete a capture made by :meth:`memory_snapshot` (children keep their own copies)."""
        await asyncio.to_thread(shutil.rmtree, snapshot.dir, True)

    # ------------------------------------------------------------------ orphans

    async def list_orphans(self, known: set[str]) -> list[str]:
        """Sandboxes of this tier that exist (a QEMU or a directory) but the registry lost."""
        ids = {i for i in qemu_processes(self.qemu_tag) if not i.startswith(("tpl-", "pool-"))}
        if self.sandbox_root.is_dir():
            ids |= {
                p.name
                for p in self.sandbox_root.iterdir()
                if p.is_dir() and not p.name.startswith("pool-")
            }
        return sorted(ids - known)

    async def destroy_orphan(self, sandbox_id: str) -> None:
        await self.destroy(Handle(id=sandbox_id, state=self._saved_state(sandbox_id)))

    def _saved_state(self, sandbox_id: str) -> dict[str, Any]:
        """The handle state written at create (``handle.json``), or {}."""
        with contextlib.suppress(OSError, ValueError):
            data: dict[str, Any] = json.loads(
                (self.sandbox_root / sandbox_id / "handle.json").read_text()
            )
            return data
        return {}

    # ------------------------------------------------------------------ metrics

    def memory_of(self, handle: Handle) -> dict[str, int]:
        """Host memory of the sandbox's QEMU in bytes: rss, pss, private (from smaps_rollup)."""
        pid = handle.typed(MicrovmState).pid
        out = {"rss": 0, "pss": 0, "private": 0}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in ("Rss", "Pss"):
                    out[k.lower()] = int(v.split()[0]) * 1024
                elif k in ("Private_Clean", "Private_Dirty"):
                    out["private"] += int(v.split()[0]) * 1024
        return out


async def _standalone_disk(disk: Path) -> None:
    """Rewrite the qcow2 overlay ``disk`` (if there is one) with its backing chain folded in
    (``qemu-img convert``: only allocated, non-zero clusters are written)."""
    if not await asyncio.to_thread(disk.exists):
        return
    flat = disk.with_name(disk.name + ".flat")
    proc = await asyncio.create_subprocess_exec(
        "qemu-img", "convert", "-q", "-O", "qcow2", str(disk), str(flat),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    if proc.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            flat.unlink()
        raise SandboxError(
            f"qemu-img convert of {disk.name} failed: {err.decode(errors='replace')}"
        )
    os.rename(flat, disk)


def bound_console(path: Path, max_bytes: int) -> bool:
    """If the console log ``path`` is longer than ``max_bytes``, cut it to its newest half
    (from a line start, after a line saying how much was dropped). True if it was cut.

    QEMU appends to it (``O_APPEND``), so its later writes land after what is kept; a write
    between the read of the tail and the truncation is lost, one between the truncation and
    the rewrite lands before the kept tail."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size <= max_bytes:
            return False
        keep = max_bytes // 2
        tail = os.pread(fd, keep, size - keep)
        cut = tail.find(b"\n")
        if 0 <= cut < len(tail) - 1:
            tail = tail[cut + 1 :]
        note = f"[dsec: {size - len(tail)} older bytes of this console were dropped]\n"
        os.ftruncate(fd, 0)
        os.write(fd, note.encode() + tail)
        return True
    finally:
        os.close(fd)


def _end_seen_on_console(path: Path) -> str | None:
    """Why the guest ended, from the last lines of its console (the kernel prints these at
    KERN_EMERG, so even a ``quiet`` console shows them), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 16384))
            tail = f.read()
    except OSError:
        return None
    if b"Kernel panic" in tail:
        return "the guest kernel panicked"
    if b"reboot: Power down" in tail:
        return "the guest powered off"
    if b"reboot: Restarting system" in tail:
        return "the guest rebooted"
    return None


def _flock_alone(fd: int) -> bool:
    """True if ``fd``'s file could be locked exclusively (nobody else holds it), then held
    so until closed or downgraded. A shared lock this process held on ``fd`` is dropped
    first (flock converts by unlocking), so a False leaves ``fd`` unlocked."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_our_qemu(pid: int, tag: str, sandbox_id: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"dsec:{tag}:{sandbox_id}".encode() in argv and pid_alive(pid)
