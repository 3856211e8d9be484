"""Node setup for the container tier: make the OCI runtime work, report kernel features.

Call :func:`prepare_node` once when the edge starts (it is idempotent). It

1. fixes the *hybrid cgroup* trap: on a cgroup-v1 node whose ``hugetlb`` controller
   sits on the cgroup2 hierarchy, crun 1.8 refuses every container ("cgroups in
   hybrid mode not supported, drop all controllers from cgroupv2"). Mounting
   ``hugetlb`` as its own v1 hierarchy (``/sys/fs/cgroup/hugetlb``) moves it off
   cgroup2. This is a host change, so it happens only here, explicitly, and is
   logged;
2. checks with a tiny probe container that crun can start containers, and falls
   back to runc (with a warning saying why) when it cannot;
3. reports kernel features for the capability table: EROFS mountable from a
   regular file, overlayfs, seccomp filters, pidfd, openat2.

:func:`probe_oci_runtimes` is step 2 alone, changing nothing on the host (``dsec doctor``);
:func:`last_node_report` is what the node's host report (:mod:`dsec.hostreport`) shows.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec.config import Paths
from dsec.privileged.cgroups import cgroup, host_layout
from dsec.privileged.mount import erofs_file_mount_supported, mount

__all__ = [
    "NodeReport",
    "kernel_features",
    "last_node_report",
    "mount_hugetlb_v1",
    "prepare_node",
    "probe_oci_runtime",
    "probe_oci_runtimes",
]

log = logging.getLogger(__name__)

_REPORTS: dict[tuple[str, str | None], NodeReport] = {}
_LAST: list[NodeReport] = []  # the latest prepare_node() result of this process


@dataclass
class NodeReport:
    """What :func:`prepare_node` found and did.

    Attributes:
        oci_runtime: absolute path of the OCI runtime to use, or None if none works.
        oci_runtime_name: ``crun`` or ``runc`` (or None).
        reason: why the preferred runtime is not used, or why none works.
        hugetlb_mounted: True if this call mounted the hugetlb v1 hierarchy.
        features: kernel feature name -> available.
        probe_ms: how long the successful probe container took, milliseconds.
    """

    oci_runtime: str | None
    oci_runtime_name: str | None
    reason: str | None = None
    hugetlb_mounted: bool = False
    features: dict[str, bool] = field(default_factory=dict)
    probe_ms: float | None = None


def _cgroup2_controllers() -> set[str]:
    unified = host_layout().mount / "unified" / "cgroup.controllers"
    try:
        return set(unified.read_text().split())
    except OSError:
        return set()


def _is_cgroup_v1_node() -> bool:
    return host_layout().mode == "v1"


def mount_hugetlb_v1() -> bool:
    """Mount ``hugetlb`` as a v1 hierarchy if it sits on cgroup2 of a v1 node.

    Returns True if it mounted it now, False if nothing was needed.
    """
    if not _is_cgroup_v1_node() or "hugetlb" not in _cgroup2_controllers():
        return False
    target = host_layout().mount / "hugetlb"
    target.mkdir(exist_ok=True)
    mount("cgroup", target, "cgroup", 0, "hugetlb")
    log.warning(
        "node setup: mounted the hugetlb cgroup as a v1 hierarchy at %s (crun needs it)", target
    )
    return True


def oci_timeout_s(default: float = 30.0) -> float:
    """How long one OCI runtime command (``crun run``/``delete``, the probe) may take,
    seconds: ``DSEC_OCI_TIMEOUT_S`` when set (raise it on emulated or very slow hosts, where
    a probe container alone can take over 10 s), else ``default``."""
    try:
        value = float(os.environ.get("DSEC_OCI_TIMEOUT_S") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def probe_oci_runtime(
    runtime: str, probe_binary: Path, state_dir: Path, timeout_s: float | None = None
) -> str | None:
    """Run ``probe_binary --probe`` in a minimal container; None if it worked, else the error.
    ``timeout_s``: default :func:`oci_timeout_s` (10 s unless ``DSEC_OCI_TIMEOUT_S``).

    The probe's rootfs is an empty directory with /proc, a /dev tmpfs and the (static)
    binary bind-mounted in. Its cgroup is ``dsec-probe/<id>`` in dsec's subtree (on v2 below
    dsec's base cgroup), removed afterwards with ``dsec-probe`` once no other probe uses it.
    """
    if timeout_s is None:
        timeout_s = oci_timeout_s(10.0)
    state_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="probe-", dir=state_dir) as tmp:
        bundle = Path(tmp)
        for d in ("rootfs/proc", "rootfs/dev"):
            (bundle / d).mkdir(parents=True)
        cid = f"dsec-probe-{os.getpid()}-{time.monotonic_ns()}"
        probe_parent = cgroup("dsec-probe")
        probe_cgroup = probe_parent.child(cid)
        config = {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": ["/probe", "--probe"],
                "cwd": "/",
                "env": ["PATH=/"],
                "noNewPrivileges": True,
            },
            "root": {"path": "rootfs", "readonly": False},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {
                    "destination": "/dev",
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "mode=755"],
                },
                {
                    "destination": "/probe",
                    "type": "bind",
                    "source": str(probe_binary),
                    "options": ["bind", "ro"],
                },
            ],
            "linux": {
                "namespaces": [{"type": t} for t in ("pid", "mount", "ipc", "uts", "network")],
                "cgroupsPath": probe_cgroup.oci_path(),
            },
        }
        (bundle / "config.json").write_text(json.dumps(config))
        root = bundle / "state"
        cmd = [runtime, "--root", str(root), "run", "--bundle", str(bundle), cid]
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{runtime}: {e}"
        finally:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [runtime, "--root", str(root), "delete", "--force", cid],
                    capture_output=True,
                    timeout=timeout_s,
                    check=False,
                )
            with contextlib.suppress(OSError, TimeoutError):
                probe_cgroup.remove()  # every hierarchy the OCI runtime made it in
            probe_parent.remove_if_empty()  # kept while another probe runs: fine
        if proc.returncode != 0:
            return (proc.stderr or proc.stdout).strip() or f"exit status {proc.returncode}"
        return None


def kernel_features(scratch: Path | None = None) -> dict[str, bool]:
    """Kernel features the container tier relies on (name -> available). ``scratch`` is no
    longer used (the EROFS probe needs no image)."""
    filesystems = Path("/proc/filesystems").read_text()
    feats = {
        "overlay": "\toverlay" in filesystems,
        "erofs": "\terofs" in filesystems,
        "seccomp": False,
        "pidfd": hasattr(os, "pidfd_open"),
        "openat2": False,
        "cgroup_v1": _is_cgroup_v1_node(),
        "erofs_file_mount": False,
        "erofs_loop": False,
    }
    with contextlib.suppress(OSError):
        feats["seccomp"] = "errno" in Path("/proc/sys/kernel/seccomp/actions_avail").read_text()
    if feats["pidfd"]:
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError:
            feats["pidfd"] = False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    # openat2(AT_FDCWD, "/", NULL how, 0) -> EINVAL if the syscall exists, ENOSYS if not
    libc.syscall(437, -100, b"/", None, 0)
    feats["openat2"] = ctypes.get_errno() != 38
    # dsec.privileged.mount's kernel probe (once per process, shared with `dsec doctor`):
    # without file-backed mounts, EROFS layers are mounted through loop devices (erofs_loop)
    feats["erofs_file_mount"] = feats["erofs"] and erofs_file_mount_supported()
    feats["erofs_loop"] = os.path.exists("/dev/loop-control")
    return feats


def probe_oci_runtimes(
    state_dir: Path, probe_binary: Path, preferred: str | None = None
) -> NodeReport:
    """Which OCI runtime starts a probe container here (crun, else runc; or ``preferred``),
    changing nothing on the host (``dsec doctor``; :func:`prepare_node` after its setup).
    The probe's bundle, state and cgroup are removed afterwards."""
    report = NodeReport(oci_runtime=None, oci_runtime_name=None)
    candidates = [preferred] if preferred else ["crun", "runc"]
    reasons: list[str] = []
    for name in candidates:
        path = shutil.which(name) if name else None
        if path is None:
            reasons.append(f"{name}: not installed")
            continue
        t0 = time.monotonic()
        err = probe_oci_runtime(path, probe_binary, state_dir)
        if err is None:
            report.oci_runtime, report.oci_runtime_name = path, os.path.basename(path)
            report.probe_ms = (time.monotonic() - t0) * 1000.0
            break
        reasons.append(f"{name}: {err}")
        if name == "crun" and not preferred:
            log.warning(
                "node setup: crun cannot start containers here (%s); falling back to runc", err
            )
    if reasons:
        report.reason = "; ".join(reasons)
    return report


def last_node_report() -> NodeReport | None:
    """The latest :func:`prepare_node` result of this process (None: it has not run), for
    the node's host report."""
    return _LAST[-1] if _LAST else None


def prepare_node(
    paths: Paths | Path, probe_binary: Path | None = None, preferred: str | None = None
) -> NodeReport:
    """Make this node able to run containers and say with which OCI runtime.

    Idempotent; a successful result is remembered for the life of the process (the edge and
    the container runtime both call this at start).

    Args:
        paths: the install's :class:`~dsec.config.Paths` (the probe runs under ``paths.run``),
            or a bare scratch directory.
        probe_binary: a static executable that exits 0 when run as ``X --probe``; default:
            the container tier's ``dsec_init``, built on first use.
        preferred: ``crun``/``runc`` or a path; default crun, falling back to runc.
    """
    state_dir = paths.run if isinstance(paths, Paths) else Path(paths)
    key = (str(state_dir), preferred)
    cached = _REPORTS.get(key)
    if cached is not None:
        return cached
    if probe_binary is None:
        from dsec.runtimes.container.native import build_native  # the probe is the tier's init

        bin_dir = paths.bin if isinstance(paths, Paths) else state_dir / "bin"
        probe_binary = build_native(bin_dir, "dsec_init")
    hugetlb_mounted = False
    try:
        hugetlb_mounted = mount_hugetlb_v1()
    except OSError as e:
        log.warning("node setup: could not mount the hugetlb v1 hierarchy: %s", e)
    features = kernel_features(state_dir)
    report = probe_oci_runtimes(state_dir, probe_binary, preferred)
    report.hugetlb_mounted, report.features = hugetlb_mounted, features
    _LAST[:] = [report]
    if report.oci_runtime is None:
        log.error("node setup: no OCI runtime works: %s", report.reason)
    else:
        _REPORTS[key] = report
    return report
