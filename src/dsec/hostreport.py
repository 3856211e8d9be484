"""What this host gives dsec, in one report: ``dsec doctor``, ``dsec info`` and the ``host``
of ``GET /v1/node``.

The report (:class:`~dsec.models.HostReport`, plain data) has four parts:

* **Host**: kernel release, distribution (``/etc/os-release``), architecture, root or not;
* **Kernel features** dsec uses, each found or missing with what that means for dsec: EROFS
  (mounted from files, through loop devices, or not at all), overlayfs, FUSE, Landlock,
  seccomp, nftables, pidfd, openat2, KVM, KSM, free page reporting, QEMU, the OCI runtime,
  user namespaces;
* **cgroups**: the layout (:func:`dsec.privileged.cgroups.host_layout`) and the cgroup
  features dsec uses (``cgroup.kill``, ``memory.reclaim``, ``CLONE_INTO_CGROUP``);
* **Tiers**: whether each tier can run and why not. On a running node, from the tiers' own
  facts (:meth:`dsec.edge.agent.EdgeAgent.node_info`); elsewhere (``dsec doctor``) from the
  report itself (:func:`tier_blockers`, the same rules the node applies at its start).

Probes are cheap (file reads, a few system calls and ioctls, the tools' ``--version``) and
cached per process. Nothing is left behind: the EROFS probe mounts nothing that stays, and the
one probe that starts something, the OCI runtime's probe container (:func:`probe_oci`), only
runs when asked (``dsec doctor``) and removes its bundle, state and cgroup. Probes that read
files take ``root`` (tests give them a fake tree); what only the running kernel and the
installed tools can answer is gathered in :class:`LiveProbes` (tests give one).

Example::

    from dsec.hostreport import host_report, render
    print(render(host_report()))
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dsec.config import Paths
from dsec.models import HostCgroups, HostFeature, HostReport, HostTier
from dsec.tiers import TierTraits, tier_names, tier_traits

if TYPE_CHECKING:
    from dsec.privileged.cgroups import CgroupLayout
    from dsec.privileged.nodesetup import NodeReport

__all__ = [
    "LiveProbes",
    "cgroups_section",
    "erofs_feature",
    "host_report",
    "live_probes",
    "os_release",
    "overlay_feature",
    "probe_oci",
    "render",
    "tier_blockers",
    "tier_verdicts",
]

ROOT = Path("/")


KVM_GET_API_VERSION = 0xAE00
FUSE_PASSTHROUGH_SINCE = (6, 9)
QEMU_FREE_PAGE_REPORTING_SINCE = (5, 1)


def _release_tuple(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


# --- what only the running kernel and the tools answer ---------------------------------------


@dataclass
class LiveProbes:
    """What only the running kernel and the installed tools can answer (system calls, ioctls,
    ``--version``). :func:`live_probes` gathers them once per process; tests build one.

    Attributes:
        euid: the probing process's effective uid (most probes need root to mean much).
        pidfd_open, pidfd_send_signal: the system calls work (5.3+, 5.1+).
        openat2: the system call exists (5.6+).
        landlock_abi: the kernel's Landlock ABI (0: none).
        erofs_mode: how :mod:`dsec.privileged.mount` mounts EROFS here: ``file`` or ``loop``.
        erofs_reason: why (e.g. "this kernel cannot mount EROFS from a file: needs 6.12, ...").
        kvm_api: ``KVM_GET_API_VERSION`` of ``/dev/kvm`` (None: it cannot be opened).
        kvm_error: why ``/dev/kvm`` cannot be used.
        nftables: the kernel's nf_tables answers through libnftables (None: not probed).
        nftables_detail: what was found, or the error.
        qemu: the first line of ``qemu-system-x86_64 --version`` (None: not installed).
        oci_versions: installed OCI runtime -> the first line of its ``--version``.
    """

    euid: int
    pidfd_open: bool = False
    pidfd_send_signal: bool = False
    openat2: bool = False
    landlock_abi: int = 0
    erofs_mode: str = "file"
    erofs_reason: str = ""
    kvm_api: int | None = None
    kvm_error: str | None = None
    nftables: bool | None = None
    nftables_detail: str = ""
    qemu: str | None = None
    oci_versions: dict[str, str] = field(default_factory=dict)


def _first_line(argv: list[str]) -> str | None:
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=10, check=False, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = (proc.stdout or proc.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def _probe_pidfd() -> tuple[bool, bool]:
    try:
        fd = os.pidfd_open(os.getpid())
    except (OSError, AttributeError):
        return False, False
    try:
        signal.pidfd_send_signal(fd, 0)
        return True, True
    except (OSError, AttributeError):
        return True, False
    finally:
        os.close(fd)


def _probe_openat2() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # openat2(AT_FDCWD, "/", NULL how, 0): EINVAL if the call exists, ENOSYS if not
    libc.syscall(437, -100, b"/", None, 0)
    return ctypes.get_errno() != errno.ENOSYS


def _probe_kvm(dev: Path) -> tuple[int | None, str | None]:
    try:
        fd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        return None, f"{dev}: {e.strerror}"
    try:
        return int(fcntl.ioctl(fd, KVM_GET_API_VERSION)), None
    except OSError as e:
        return None, f"KVM_GET_API_VERSION: {e.strerror}"
    finally:
        os.close(fd)


def _probe_nftables(euid: int) -> tuple[bool | None, str]:
    if euid != 0:
        return None, "not probed (needs root)"
    try:
        from dsec.privileged.nft import Nftables, NftError
    except ImportError as e:  # pragma: no cover - part of dsec
        return False, str(e)
    try:
        nft = Nftables()
    except NftError as e:
        return False, str(e)
    try:
        nft.run("list tables")
        return True, "kernel nf_tables through libnftables"
    except NftError as e:
        return False, f"the kernel refuses nf_tables: {e}"
    finally:
        nft.close()


def _probe_erofs() -> tuple[str, str]:
    from dsec.privileged.mount import erofs_mount_mode, erofs_mount_reason

    return erofs_mount_mode(), erofs_mount_reason()


@functools.cache
def live_probes() -> LiveProbes:
    """This process's :class:`LiveProbes` (gathered once)."""
    from dsec.privileged.landlock import landlock_abi

    euid = os.geteuid()
    pidfd_open, pidfd_send = _probe_pidfd()
    kvm_api, kvm_error = _probe_kvm(Path("/dev/kvm"))
    nft_ok, nft_detail = _probe_nftables(euid)
    mode, reason = _probe_erofs()
    qemu_path = shutil.which("qemu-system-x86_64")
    return LiveProbes(
        euid=euid,
        pidfd_open=pidfd_open,
        pidfd_send_signal=pidfd_send,
        openat2=_probe_openat2(),
        landlock_abi=landlock_abi(),
        erofs_mode=mode,
        erofs_reason=reason,
        kvm_api=kvm_api,
        kvm_error=kvm_error,
        nftables=nft_ok,
        nftables_detail=nft_detail,
        qemu=_first_line([qemu_path, "--version"]) if qemu_path else None,
        oci_versions={
            name: _first_line([path, "--version"]) or name
            for name in ("crun", "runc")
            if (path := shutil.which(name))
        },
    )


def probe_oci(paths: Paths | None = None, preferred: str | None = None) -> NodeReport:
    """Start the container tier's probe container with crun (else runc) and say which works,
    changing nothing on the host (no hugetlb mount: ``dsec serve`` does that at start). The
    probe binary is built into ``$DSEC_HOME/bin`` when the home exists, else into a temporary
    directory removed afterwards. Needs root."""
    from dsec.errors import DsecError
    from dsec.privileged.nodesetup import NodeReport, probe_oci_runtimes
    from dsec.runtimes.container.native import build_native

    paths = paths or Paths.from_env()
    with contextlib.ExitStack() as stack:
        if paths.home.is_dir():
            bin_dir, state_dir = paths.bin, paths.run
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dsec-doctor-")))
            bin_dir, state_dir = tmp / "bin", tmp / "run"
        try:
            probe = build_native(bin_dir, "dsec_init")
        except DsecError as e:
            return NodeReport(None, None, reason=f"cannot build the probe: {e.message}")
        return probe_oci_runtimes(state_dir, probe, preferred)


# --- what files say ---------------------------------------------------------------------------


def os_release(root: Path = ROOT) -> str:
    """The distribution's ``PRETTY_NAME`` (``/etc/os-release``, else ``/usr/lib/os-release``)."""
    for rel in ("etc/os-release", "usr/lib/os-release"):
        text = _read(root / rel)
        if text is None:
            continue
        values: dict[str, str] = {}
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                values[key.strip()] = value.strip().strip("\"'")
        name = values.get("PRETTY_NAME") or " ".join(
            v for v in (values.get("NAME"), values.get("VERSION")) if v
        )
        if name:
            return name
    return "unknown (no /etc/os-release)"


def _filesystem(name: str, root: Path, release: str) -> tuple[bool | None, str]:
    """Is filesystem ``name`` in this kernel: registered (``/proc/filesystems``), a module
    that loads on first mount (``modules.dep``/``modules.builtin``), missing (the kernel's
    module list does not have it) or unknown (no module list)?"""
    text = _read(root / "proc/filesystems") or ""
    if any(line.split()[-1:] == [name] for line in text.splitlines()):
        return True, "available"
    moddir = root / "lib/modules" / release
    pattern = re.compile(rf"/{re.escape(name)}\.ko(\.[a-z]+)?\b")
    found_list = False
    for listing in ("modules.builtin", "modules.dep"):
        modules = _read(moddir / listing)
        if modules is None:
            continue
        found_list = True
        if pattern.search(modules):
            return True, "module (loaded on first mount)"
    return (False, "missing") if found_list else (None, "unknown")


def erofs_feature(
    root: Path = ROOT, release: str | None = None, live: LiveProbes | None = None
) -> HostFeature:
    """EROFS: mounted from the layer files (6.12+), through loop devices, or not at all."""
    release = release or os.uname().release
    state, _ = _filesystem("erofs", root, release)
    if live is None:
        mode, reason = _probe_erofs()
    else:
        mode, reason = live.erofs_mode, live.erofs_reason
    if state is False:
        return HostFeature(
            name="EROFS",
            available=False,
            value="none",
            note="this kernel has no EROFS (CONFIG_EROFS_FS): no layer can be mounted",
        )
    if mode == "file":
        return HostFeature(name="EROFS", available=True, value="file-backed mounts")
    if not (root / "dev/loop-control").exists():
        return HostFeature(
            name="EROFS",
            available=False,
            value="none",
            note=f"{reason}; and there is no /dev/loop-control for loop devices "
            "(CONFIG_BLK_DEV_LOOP)",
        )
    return HostFeature(name="EROFS", available=True, value="loop devices", note=reason)


def overlay_feature(root: Path = ROOT, release: str | None = None) -> HostFeature:
    """overlayfs: every sandbox's root filesystem (container, fncall) is an overlay."""
    state, value = _filesystem("overlay", root, release or os.uname().release)
    note = None
    if state is False:
        note = "sandboxes' root filesystems are overlays (CONFIG_OVERLAY_FS)"
    elif state is None:
        note = "not registered yet and no module list for this kernel: found at first mount"
    return HostFeature(name="overlayfs", available=state, value=value, note=note)


def _fuse_feature(root: Path, release: str) -> HostFeature:
    state, _ = _filesystem("fuse", root, release)
    have_dev = (root / "dev/fuse").exists()
    passthrough = _release_tuple(release) >= FUSE_PASSTHROUGH_SINCE
    if state is False or not have_dev:
        return HostFeature(
            name="FUSE",
            available=False,
            value="missing" if state is False else "no /dev/fuse",
            note="lazy layers cannot be mounted: dsec image pull --lazy",
        )
    return HostFeature(
        name="FUSE",
        available=True,
        value="available, passthrough-capable" if passthrough else "available",
        note="serves lazy layers: dsec image pull --lazy"
        + ("" if passthrough else "; no passthrough before 6.9"),
    )


_LANDLOCK_LATER = (
    (2, "REFER"),
    (3, "TRUNCATE"),
    (5, "IOCTL_DEV"),
    (6, "scopes of abstract sockets and signals"),
    (7, "audit records of their refusals (the audit's landlock category, Linux 6.15)"),
)


def _landlock_feature(abi: int) -> HostFeature:
    if abi <= 0:
        return HostFeature(
            name="Landlock",
            available=False,
            value="unavailable",
            note="fncall workers run without it, and a sandbox's commands are not kept out of "
            "each other's memory (/proc/<pid>/mem: docs/design/tenancy.md) on the container "
            "and fncall tiers (CONFIG_SECURITY_LANDLOCK, or 'landlock' missing from the lsm= "
            "boot parameter)",
        )
    lacking = [what for level, what in _LANDLOCK_LATER if abi < level]
    note = f"fncall workers go without {', '.join(lacking)}" if lacking else None
    return HostFeature(name="Landlock", available=True, value=f"ABI {abi}", note=note)


def _seccomp_feature(root: Path) -> HostFeature:
    text = _read(root / "proc/sys/kernel/seccomp/actions_avail")
    if text is None:
        return HostFeature(
            name="seccomp",
            available=False,
            value="no filters",
            note="kernel without CONFIG_SECCOMP_FILTER: sandboxes' system call filters",
        )
    actions = text.split()
    ok = {"errno", "allow"} <= set(actions)
    return HostFeature(
        name="seccomp",
        available=ok,
        value=f"filters; actions: {' '.join(actions)}",
        note=None if ok else "dsec's filters need the errno and allow actions",
    )


def _nftables_feature(live: LiveProbes) -> HostFeature:
    if live.nftables is None:
        value = live.nftables_detail
    else:
        value = live.nftables_detail if live.nftables else "missing"
    note = None
    if live.nftables is False:
        note = (
            f"{live.nftables_detail}: sandboxes with a network cannot be created "
            "(DSEC_NETWORK=off runs without)"
        )
    return HostFeature(name="nftables", available=live.nftables, value=value, note=note)


def _last_kvm_probe(paths: Paths | None) -> tuple[str, str] | None:
    """The VM tiers' last boot probe on this install (``$DSEC_HOME/bin/kvm-probe-*.json``:
    accelerator, reason), if they ran one."""
    if paths is None:
        return None
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        probes = sorted(paths.bin.glob("kvm-probe-*.json"), key=lambda p: p.stat().st_mtime)
        if probes:
            data = json.loads(probes[-1].read_text())
            return str(data["accel"]), str(data["reason"])
    return None


def _vm_accel(root: Path, live: LiveProbes, paths: Paths | None) -> str:
    """How the VM tiers run guests here: their last boot probe's verdict, else a forecast."""
    probe = _last_kvm_probe(paths)
    if probe is not None:
        return f"{probe[0].upper()}, {probe[1]}"
    if live.kvm_api is None:
        return "TCG, no usable /dev/kvm"
    if (root / "sys/module/kvm_pvm").exists():
        return "KVM if the guest boots under PVM, else TCG: the tier probes at its start"
    return "KVM"


def _kvm_feature(root: Path, live: LiveProbes, paths: Paths | None) -> HostFeature:
    notes: list[str] = []
    if (root / "sys/module/kvm_pvm").exists():
        notes.append("PVM host, kvm_pvm: guests that do not boot under it run on TCG")
    probe = _last_kvm_probe(paths)
    if probe is not None:
        notes.append(f"the VM tiers chose {probe[0].upper()}: {probe[1]}")
    if live.kvm_api is None:
        return HostFeature(
            name="KVM",
            available=False,
            value="no usable /dev/kvm" if not live.kvm_error else live.kvm_error,
            note="the VM tiers run on TCG (emulation: slower boots and commands)",
        )
    return HostFeature(
        name="KVM",
        available=True,
        value=f"/dev/kvm, API {live.kvm_api}",
        note="; ".join(notes) or None,
    )


def _ksm_feature(root: Path) -> HostFeature:
    run = _read(root / "sys/kernel/mm/ksm/run")
    if run is None:
        return HostFeature(
            name="KSM",
            available=False,
            value="missing",
            note="idle VMs do not share identical pages (CONFIG_KSM)",
        )
    running = run.strip() == "1"
    return HostFeature(
        name="KSM",
        available=True,
        value="ksmd running" if running else "ksmd stopped",
        note=None if running else "the VM tiers start it while they run",
    )


def _qemu_version(line: str | None) -> tuple[int, int] | None:
    m = re.search(r"version (\d+)\.(\d+)", line or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _qemu_feature(live: LiveProbes) -> HostFeature:
    if live.qemu is None:
        return HostFeature(
            name="QEMU",
            available=False,
            value="not installed",
            note="the VM tiers need qemu-system-x86_64 (Debian: qemu-system-x86)",
        )
    return HostFeature(name="QEMU", available=True, value=live.qemu)


def _free_page_reporting_feature(live: LiveProbes) -> HostFeature:
    version = _qemu_version(live.qemu)
    since = ".".join(map(str, QEMU_FREE_PAGE_REPORTING_SINCE))
    if version is None:
        return HostFeature(
            name="free page reporting",
            available=None if live.qemu else False,
            value="no QEMU" if live.qemu is None else "unknown QEMU version",
            note=f"virtio-balloon free-page-reporting needs QEMU {since}",
        )
    ok = version >= QEMU_FREE_PAGE_REPORTING_SINCE
    qemu = f"QEMU {version[0]}.{version[1]}"
    return HostFeature(
        name="free page reporting",
        available=ok,
        value=f"{qemu}: virtio-balloon free-page-reporting"
        if ok
        else f"{qemu} lacks virtio-balloon free-page-reporting",
        note="dsec's VMs do not use it yet" if ok else f"needs QEMU {since}",
    )


def _oci_feature(live: LiveProbes, oci: NodeReport | None) -> HostFeature:
    versions = ", ".join(live.oci_versions.values())
    if oci is None:
        if not live.oci_versions:
            return HostFeature(
                name="OCI runtime",
                available=False,
                value="none installed",
                note="the container tier needs crun or runc (Debian: crun)",
            )
        return HostFeature(
            name="OCI runtime",
            available=None,
            value=versions,
            note="not probed: the container tier starts a probe container at its start, "
            "dsec doctor as root does too",
        )
    if oci.oci_runtime is None:
        return HostFeature(
            name="OCI runtime",
            available=False,
            value=f"none works ({versions or 'none installed'})",
            note=oci.reason,
        )
    name = oci.oci_runtime_name or os.path.basename(oci.oci_runtime)
    version = live.oci_versions.get(name, name)
    took = f", probe container in {oci.probe_ms:.0f} ms" if oci.probe_ms is not None else ""
    return HostFeature(
        name="OCI runtime",
        available=True,
        value=f"{version}{took}",
        note=f"fell back: {oci.reason}" if oci.reason else None,
    )


def _userns_feature(root: Path) -> HostFeature:
    text = _read(root / "proc/sys/user/max_user_namespaces")
    note = "not needed: dsec runs as root, and sandboxes may not create them"
    try:
        most = int((text or "").strip())
    except ValueError:
        return HostFeature(name="user namespaces", available=None, value="unknown", note=note)
    restricted = _read(root / "proc/sys/kernel/apparmor_restrict_unprivileged_userns") or "0"
    unprivileged = (_read(root / "proc/sys/kernel/unprivileged_userns_clone") or "1").strip()
    value = f"available (at most {most})" if most > 0 else "disabled (max_user_namespaces=0)"
    if most > 0 and (restricted.strip() == "1" or unprivileged == "0"):
        value += "; unprivileged ones restricted"
    return HostFeature(name="user namespaces", available=most > 0, value=value, note=note)


def _mount_namespace_feature(root: Path) -> HostFeature:
    """How ``/`` propagates on this host and where the node keeps its mounts
    (:mod:`dsec.privileged.mountns`)."""
    from dsec.privileged import mountns

    propagation = mountns.root_propagation(str(root / "proc/1/mountinfo"))
    ns = mountns.current()
    if ns.own:
        value, note = ns.describe(), f"/ is {propagation} on the host"
    elif propagation == "shared" and ns.reason != "not entered (an in-process node)":
        value = f"the host's ({ns.reason})"
        note = (
            "/ is shared (systemd): sandbox mounts propagate to the host's table; "
            f"unset {mountns.MOUNT_NAMESPACE_ENV}=host"
        )
    else:
        value = f"/ is {propagation} on the host"
        note = "dsec serve keeps sandbox mounts in its own namespace"
    return HostFeature(name="mount namespace", available=True, value=value, note=note)


def _syscall_features(live: LiveProbes) -> list[HostFeature]:
    pidfd = live.pidfd_open and live.pidfd_send_signal
    calls = [
        n
        for n, ok in (
            ("pidfd_open", live.pidfd_open),
            ("pidfd_send_signal", live.pidfd_send_signal),
        )
        if ok
    ]
    return [
        HostFeature(
            name="pidfd",
            available=pidfd,
            value=", ".join(calls) if calls else "missing",
            note=None if pidfd else "kernel < 5.3: sandboxes' processes are tracked by pidfd",
        ),
        HostFeature(
            name="openat2",
            available=live.openat2,
            value="available" if live.openat2 else "missing",
            note=None
            if live.openat2
            else "kernel < 5.6: the files API resolves paths inside sandboxes with it",
        ),
    ]


# --- cgroups ----------------------------------------------------------------------------------


def cgroups_section(layout: CgroupLayout, release: str | None = None) -> HostCgroups:
    """The cgroups part of the report, from a detected layout."""
    kernel = _release_tuple(release or os.uname().release)
    v2 = layout.mode == "v2"
    feats = layout.features

    def v2_feature(name: str, since: tuple[int, int], meaning: str) -> HostFeature:
        if not v2:
            return HostFeature(name=name, available=False, value="cgroup v2 only", note=meaning)
        ok = bool(feats.get(name, kernel >= since))
        return HostFeature(
            name=name,
            available=ok,
            value="available" if ok else f"missing (kernel < {since[0]}.{since[1]})",
            note=None if ok else meaning,
        )

    clone_ok = v2 and kernel >= (5, 7)
    return HostCgroups(
        mode=layout.mode,
        description=layout.describe(),
        usable=layout.usable,
        base=f"/{layout.base}" if v2 else "",
        delegated=layout.delegated,
        controllers=list(layout.controllers),
        missing=list(layout.missing),
        reason=layout.reason,
        features=[
            v2_feature("cgroup.kill", (5, 14), "sandboxes are killed process by process"),
            v2_feature(
                "memory.reclaim", (5, 19), "paused sandboxes' memory is not pushed out early"
            ),
            HostFeature(
                name="CLONE_INTO_CGROUP",
                available=clone_ok,
                value="available"
                if clone_ok
                else ("cgroup v2 only" if not v2 else "missing (kernel < 5.7)"),
                note=None if clone_ok else "processes are moved into their cgroup after start",
            ),
        ],
    )


def _layout_for(root: Path) -> CgroupLayout:
    from dsec.privileged.cgroups import detect_layout, host_layout

    if root == ROOT:
        return host_layout()
    return detect_layout(root / "sys/fs/cgroup", root / "proc/self/cgroup")


# --- tiers ------------------------------------------------------------------------------------


def tier_blockers(
    cgroups: HostCgroups, features: Sequence[HostFeature], *, root: bool | None = True
) -> dict[str, str]:
    """Tiers this host rules out, each with why (a tier not named can run as far as the host
    goes). A feature counts only when known missing (``available is False``)."""
    by_name = {f.name: f for f in features}
    out: dict[str, str] = {}
    for tier in tier_names():  # what each needs: its traits (dsec.tiers)
        traits = tier_traits(tier) or TierTraits()
        reasons: list[str] = []
        if root is False:
            reasons.append("dsec runs its tiers as root")
        if traits.cgroups and not cgroups.usable:
            reasons.append(f"cgroups: {cgroups.reason or cgroups.description}")
        for name in traits.host_needs:
            f = by_name.get(name)
            if f is not None and f.available is False:
                reasons.append(f"{name}: {f.value}" + (f" ({f.note})" if f.note else ""))
        if reasons:
            out[tier] = "; ".join(reasons)
    return out


def _tier_note(tier: str, by_name: dict[str, HostFeature], vm_accel: str | None) -> str | None:
    traits = tier_traits(tier) or TierTraits()
    if traits.guest_kernel:
        return vm_accel
    if traits.host_note is not None:
        f = by_name.get(traits.host_note)
        return f.value if f is not None and f.available else None
    return None


def tier_verdicts(
    cgroups: HostCgroups,
    features: Sequence[HostFeature],
    *,
    root: bool | None = True,
    wanted: Sequence[str] | None = None,
    vm_accel: str | None = None,
) -> list[HostTier]:
    """Each tier's verdict from the report alone (no node running); ``vm_accel``: how the
    VM tiers would run guests (KVM, TCG), their note."""
    blocked = tier_blockers(cgroups, features, root=root)
    by_name = {f.name: f for f in features}
    return [
        HostTier(
            tier=tier,
            available=tier not in blocked,
            reason=blocked.get(tier) or _tier_note(tier, by_name, vm_accel),
            wanted=wanted is None or tier in wanted,
        )
        for tier in tier_names()
    ]


# --- the report -------------------------------------------------------------------------------


def host_report(
    *,
    root: Path = ROOT,
    release: str | None = None,
    paths: Paths | None = None,
    live: LiveProbes | None = None,
    layout: CgroupLayout | None = None,
    oci: NodeReport | None = None,
    wanted: Sequence[str] | None = None,
) -> HostReport:
    """The host report (see the module docstring).

    Args:
        root: where ``/proc``, ``/sys``, ``/etc``, ``/dev`` and ``/lib/modules`` are read.
        release: the kernel release (default ``uname -r``).
        paths: the install, for what its tiers found before (the VM tiers' KVM probe).
        live: the system-call and tool probes (default :func:`live_probes`).
        layout: the cgroup layout (default: this host's, or the one under ``root``).
        oci: the OCI runtime probe's result (default: this process's ``prepare_node``).
        wanted: the tiers the operator asked for (``DSEC_TIERS``; None: all).
    """
    from dsec.privileged.nodesetup import last_node_report

    release = release or os.uname().release
    live = live or live_probes()
    layout = layout or _layout_for(root)
    if oci is None:
        oci = last_node_report()
    cgroups = cgroups_section(layout, release)
    features = [
        erofs_feature(root, release, live),
        overlay_feature(root, release),
        _fuse_feature(root, release),
        _landlock_feature(live.landlock_abi),
        _seccomp_feature(root),
        _nftables_feature(live),
        *_syscall_features(live),
        _kvm_feature(root, live, paths),
        _ksm_feature(root),
        _free_page_reporting_feature(live),
        _qemu_feature(live),
        _oci_feature(live, oci),
        _userns_feature(root),
        _mount_namespace_feature(root),
    ]
    is_root = live.euid == 0
    return HostReport(
        kernel=release,
        distribution=os_release(root),
        architecture=platform.machine(),
        root=is_root,
        cgroups=cgroups,
        features=features,
        tiers=tier_verdicts(
            cgroups,
            features,
            root=is_root,
            wanted=wanted,
            vm_accel=_vm_accel(root, live, paths),
        ),
    )


# --- the renderer -----------------------------------------------------------------------------


def _line(name: str, value: str, note: str | None) -> str:
    return f" {name}: {value}" + (f" ({note})" if note else "")


def render(report: HostReport, *, short: bool = False) -> str:
    """The report as ``docker info`` prints its own: sections of ``name: value`` lines, a
    reason in parentheses for anything missing. ``short``: the host on one line and only
    what is missing (``dsec info``)."""
    cg = report.cgroups
    if short:
        lines = [
            f"host: {report.kernel}, {report.distribution}, cgroup {cg.description}",
        ]
        for f in [*report.features, *(cg.features if cg.mode == "v2" else [])]:
            if f.available is False:
                lines.append(f"missing: {f.name}: {f.value}" + (f" ({f.note})" if f.note else ""))
        return "\n".join(lines)
    lines = [
        "Host:",
        _line("Kernel", report.kernel, None),
        _line("Distribution", report.distribution, None),
        _line("Architecture", report.architecture, None),
        _line(
            "Running as",
            "root" if report.root else "not root",
            None if report.root else "most probes need root: they say unknown",
        ),
        "Kernel features:",
    ]
    for f in report.features:
        value = f.value if f.available is not None else f"unknown: {f.value}"
        lines.append(_line(f.name, value, f.note))
    lines.append("cgroups:")
    lines.append(_line("Layout", cg.description, None if cg.usable else "not usable"))
    if cg.mode == "v2":
        lines.append(_line("Base", cg.base, "delegated by systemd" if cg.delegated else None))
    lines.append(_line("Controllers", ", ".join(cg.controllers) or "none", None))
    if cg.missing:
        lines.append(_line("Missing", ", ".join(cg.missing), cg.reason))
    for f in cg.features:
        lines.append(_line(f.name, f.value, f.note))
    lines.append("Tiers:")
    for t in report.tiers:
        if t.wanted:
            lines.append(_line(t.tier, "available" if t.available else "unavailable", t.reason))
            continue
        why = "not in DSEC_TIERS"
        if t.reason and t.reason != "not enabled on this node":
            why += f"; it {'could' if t.available else 'could not'} run: {t.reason}"
        elif t.reason is None:
            why += f"; it {'could' if t.available else 'could not'} run"
        lines.append(_line(t.tier, "not enabled", why))
    return "\n".join(lines)
