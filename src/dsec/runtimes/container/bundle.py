"""OCI bundle of one container sandbox: ``config.json`` and the exec server's policy.

Everything the container's security depends on is decided here, in one place,
and rendered twice: into the OCI runtime config (applied by crun/runc to the
container's PID 1) and into ``execd.policy`` (applied by ``dsec_execd`` to each
exec'd command). Both renderings read the same constants below.

Layout of a sandbox directory (``paths.sandboxes/<id>/``, on the tmpfs of
:func:`dsec.layers.rootfs.mount_sandbox_root`)::

    config.json     OCI runtime config (this module)
    rootfs/ upper/  overlay of the EROFS layers + tmpfs upper (dsec.layers.rootfs)
    boot_id         the sandbox's own boot id (bind-mounted over the kernel's)
    init.pid        the container init's host pid

The exec server's policy (this module's :func:`execd_policy_text`) is one file per install
and policy, ``paths.run/execd-<digest>.policy``; the state recover() needs is on the OCI
state's tmpfs (see ``ContainerRuntime._state_file``).

Capabilities, rlimits, masked and read-only paths: :mod:`dsec.contract.isolation`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
from pathlib import Path
from typing import Any

from dsec.contract.isolation import CAPABILITIES, MASKED_PATHS, READONLY_PATHS, RLIMITS
from dsec.runtimes.container.seccomp import execd_policy_lines, oci_seccomp

__all__ = [
    "BOOT_ID_PATH",
    "DEFAULT_PATH",
    "INIT_PATH_IN_CONTAINER",
    "cgroup_parent",
    "execd_policy_text",
    "oci_config",
]

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
"""Where Linux shows its boot id; a sandbox sees its own there (see :func:`oci_config`)."""

SUPERBLOCKS_NOTE = """Every superblock on the host registers a memcg-aware shrinker, and every
memory cgroup the kernel makes then allocates ``shrinker_info`` for all the shrinker ids the
host has had at once (a 520-byte unit, a kmalloc-1k object, per 64 ids; the count never goes
down until a reboot). A container with a tmpfs per masked directory, its own ``/dev/shm``,
``/dev``, ``/dev/pts``, ``/proc``, ``/sys``, mqueue and a writable layer made 12 superblocks:
at 5,000 live sandboxes each new sandbox's memory cgroup cost 1.1 MiB of unreclaimable slab
(the whole crowd: O(live^2)), and each 64 new ids made the kernel grow the info of every
memory cgroup on the host. Bind mounts make none: the masked directories under ``/sys`` are
binds of one empty directory (those under ``/proc`` stay a tmpfs each: see
:func:`masked_dirs`); ``/dev/shm`` is a directory of the container's ``/dev`` tmpfs (made by
the exec server when it attaches)."""


@functools.cache
def masked_dirs() -> tuple[str, ...]:
    """The :data:`MASKED_PATHS` under ``/sys`` that are directories on this host: masked by a
    bind of one empty directory. The others stay the OCI runtime's (files: a bind of
    ``/dev/null``; directories under ``/proc``: a tmpfs each, since runc, and maybe later
    crun, refuse a bind mount on a path of the container's procfs)."""
    return tuple(path for path in MASKED_PATHS if path.startswith("/sys/") and os.path.isdir(path))


DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Where the static init is bind-mounted (read-only) inside the container. /dev is a
# per-container tmpfs, so the mount point never lands in the writable layer.
INIT_PATH_IN_CONTAINER = "/dev/.dsec-init"

_CPU_PERIOD_US = 100_000


def cgroup_parent(home: Path) -> str:
    """The cgroup directory that holds this install's sandboxes, e.g. ``dsec-3f2a9c01d4``.

    Derived from ``DSEC_HOME`` so two installs on one node never share cgroups."""
    digest = hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:10]
    return f"dsec-{digest}"


def _device(major: int, minor: int | None, access: str = "rwm") -> dict[str, Any]:
    d: dict[str, Any] = {"allow": True, "type": "c", "major": major, "access": access}
    if minor is not None:
        d["minor"] = minor
    return d


def oci_config(
    *,
    rootfs: Path,
    init_binary: Path,
    hostname: str,
    cgroups_path: str,
    cpu: float,
    memory_mb: int,
    pids: int,
    env: dict[str, str],
    memsw: bool,
    cpu_shares: int | None = None,
    boot_id_file: Path | None = None,
    seccomp_bpf: bytes | None = None,
    mask_dir: Path | None = None,
) -> dict[str, Any]:
    """The OCI runtime config (``config.json``) of one sandbox.

    Args:
        rootfs: the assembled overlay root (absolute path on the host).
        init_binary: the static ``dsec_init`` on the host; bind-mounted read-only.
        hostname: the container's hostname.
        cgroups_path: the sandbox's cgroup as the OCI runtime names it
            (:meth:`dsec.privileged.cgroups.Cgroup.oci_path` of ``<parent>/<sandbox id>``, see
            :func:`cgroup_parent`; on v2 below dsec's base cgroup).
        cpu: CPU cores, enforced as a CFS quota over a 100 ms period.
        memory_mb: memory limit, MiB (also the memory+swap limit when ``memsw``).
        pids: maximum number of processes and threads.
        env: extra environment of the init process (exec'd commands get their own).
        memsw: whether the memory limit also bounds swap here
            (:meth:`~dsec.privileged.cgroups.Cgroup.accounts_swap`). The OCI ``memory.swap``
            is memory+swap: equal to the limit, v1 gets memsw = limit and v2 (crun and runc
            write ``swap - limit``) no swap at all.
        cpu_shares: the cgroup's ``cpu.shares`` (None: the kernel's default, 1024); on v2
            the OCI runtime maps it onto ``cpu.weight``.
        boot_id_file: a host file bound read-only over ``/proc/sys/kernel/random/boot_id``:
            the sandbox's own boot id (not the node's), renewed when it is rebooted by a
            filesystem-only pause.
        mask_dir: an empty read-only directory on the node: the masked directories
            (``/proc/acpi``, ``/sys/firmware``...) are bind mounts of it rather than a tmpfs
            each (see :data:`SUPERBLOCKS_NOTE`). None: the OCI runtime's tmpfs masks.
        seccomp_bpf: the seccomp policy already compiled (raw ``sock_filter`` array, from
            ``dsec_execd --bpf``: the same rules as :func:`oci_seccomp`), for crun: it is
            handed over in the ``run.oci.seccomp_bpf_data`` annotation instead of
            ``linux.seccomp``, and crun installs it without compiling the rules with
            libseccomp again for every container (~1 ms of CPU per ``crun run`` here). None:
            ``linux.seccomp`` (what every OCI runtime understands).
    """
    caps = sorted(CAPABILITIES)
    memory_bytes = memory_mb * 1024 * 1024
    memory: dict[str, Any] = {"limit": memory_bytes}
    if memsw:
        memory["swap"] = memory_bytes
    process_env = [f"PATH={DEFAULT_PATH}", f"HOSTNAME={hostname}", "HOME=/root"]
    process_env += [f"{k}={v}" for k, v in env.items()]
    config: dict[str, Any] = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [INIT_PATH_IN_CONTAINER],
            "env": process_env,
            "cwd": "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
                "inheritable": [],
                "ambient": [],
            },
            "rlimits": [
                {"type": name, "soft": soft, "hard": hard} for name, _, soft, hard in RLIMITS
            ],
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": hostname,
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            *(
                {
                    "destination": path,
                    "type": "bind",
                    "source": str(mask_dir),
                    "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
                }
                for path in (masked_dirs() if mask_dir is not None else ())
            ),
            {
                "destination": INIT_PATH_IN_CONTAINER,
                "type": "bind",
                "source": str(init_binary),
                "options": ["bind", "ro", "nosuid", "nodev"],
            },
            *(
                [
                    {
                        "destination": BOOT_ID_PATH,
                        "type": "bind",
                        "source": str(boot_id_file),
                        "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
                    }
                ]
                if boot_id_file is not None
                else []
            ),
        ],
        "linux": {
            "namespaces": [
                {"type": t} for t in ("pid", "mount", "ipc", "uts", "network", "cgroup")
            ],
            "cgroupsPath": cgroups_path,
            "resources": {
                "devices": [
                    {"allow": False, "access": "rwm"},
                    _device(1, 3),  # null
                    _device(1, 5),  # zero
                    _device(1, 7),  # full
                    _device(1, 8),  # random
                    _device(1, 9),  # urandom
                    _device(5, 0),  # tty
                    _device(5, 2),  # ptmx
                    _device(136, None),  # pts/*
                ],
                "memory": memory,
                "cpu": {
                    "quota": max(1000, int(cpu * _CPU_PERIOD_US)),
                    "period": _CPU_PERIOD_US,
                    **({"shares": cpu_shares} if cpu_shares else {}),
                },
                "pids": {"limit": pids},
            },
            "maskedPaths": [
                path for path in MASKED_PATHS if mask_dir is None or path not in masked_dirs()
            ],
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": oci_seccomp(),
            "rootfsPropagation": "private",
        },
    }
    if seccomp_bpf is not None:
        del config["linux"]["seccomp"]
        config["annotations"] = {
            "run.oci.seccomp_bpf_data": base64.b64encode(seccomp_bpf).decode("ascii")
        }
    return config


def execd_policy_text() -> str:
    """The policy file ``dsec_execd`` applies to each exec'd command (format in dsec_execd.c)."""
    lines = ["# generated by dsec.runtimes.container.bundle; do not edit"]
    lines += execd_policy_lines()
    lines += [f"cap {n}" for n in sorted(CAPABILITIES.values())]
    lines += [f"rlimit {num} {soft} {hard}" for _, num, soft, hard in RLIMITS]
    return "\n".join(lines) + "\n"
