"""The launch mount namespace: where the OCI runtime makes containers, without the mounts of
every other sandbox.

Why. An OCI runtime makes a container's mount namespace by copying the namespace it runs in,
reads that copy's ``/proc/self/mountinfo`` and, after ``pivot_root``, detaches the old
root with everything under it: each pass is O(mounts), under the kernel's global mount
lock. Run from the node's namespace, which holds an overlay and an upper tmpfs for each live
sandbox, a creation cost grew with the live count: ``crun run`` took 16 ms on an empty node
and 315 ms with 3,000 idle sandboxes (a ``perf`` profile: two thirds of crun's time in
``seq_read_iter`` of mountinfo, then ``copy_mnt_ns`` and ``umount_tree``).

What. At start the container tier makes one *launch* namespace (:func:`open_launch_namespace`):
a copy of the node's with every mount under the sandboxes' directory (and the network's
namespace pins) detached, private, pinned at ``$DSEC_HOME/run/launchns/ns``. Each creation
clones the new sandbox's root mount (``open_tree(OPEN_TREE_CLONE)``: a detached copy, the
same overlay) and runs the OCI runtime through ``dsec_launch`` (``dsec/native``), which joins
the launch namespace, attaches the clone at the same path, runs the runtime and detaches the
clone when it returns: the runtime copies the host's few dozen mounts and one sandbox root,
whatever the live count. The node's namespace keeps every sandbox's mounts for dsec's own
file access, as before. Anything the runtime opens by path must be visible there: files on
the node's disks and tmpfs mounts made before the namespace (the sandboxes' tmpfs, the init's
tmpfs, ``/dev/shm``); a network namespace is given as ``/proc/self/fd/N`` (see
:meth:`LaunchNamespace.command`).

``DSEC_LAUNCH_NAMESPACE=off`` runs the OCI runtime from the node's namespace (as before);
so does a host without ``unshare(1)`` or ``open_tree(2)`` (Linux < 5.2), with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsec.privileged.mount import MNT_DETACH, open_tree_clone, umount
from dsec.privileged.mountns import _is_mount_point, _private_dir, pin_attempts

__all__ = ["LaunchNamespace", "open_launch_namespace"]

log = logging.getLogger(__name__)

# run in the new namespace by unshare(1): detach every mount below the given directories
_PRUNE = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
def unescape(s):
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and s[i + 1 : i + 4].isdigit():
            out.append(chr(int(s[i + 1 : i + 4], 8))); i += 4
        else:
            out.append(s[i]); i += 1
    return "".join(out)
dirs = [d.rstrip("/") + "/" for d in sys.argv[1:]]
with open("/proc/self/mountinfo") as f:
    mps = [unescape(line.split(" ")[4]) for line in f]
for mp in sorted({m for m in mps if any(m.startswith(d) for d in dirs)}, key=len):
    libc.umount2(mp.encode(), 2)  # MNT_DETACH: its submounts go with it
"""


@dataclass
class LaunchNamespace:
    """A pinned launch namespace and the ``dsec_launch`` helper that enters it."""

    pin: Path
    launcher: Path

    def command(self, oci_cmd: list[str], rootfs: Path) -> tuple[list[str], int]:
        """``oci_cmd`` run in the launch namespace with ``rootfs`` (a mount point of the
        node's namespace) attached at the same path: ``(argv, fd)``; pass ``fd`` to the child
        (``pass_fds``) and close it after starting it. Raises ``OSError`` if the root cannot
        be cloned."""
        fd = open_tree_clone(rootfs)
        return [str(self.launcher), str(self.pin), str(fd), str(rootfs), "--", *oci_cmd], fd

    def close(self) -> None:
        """Unpin the namespace: it goes once no process runs in it; the pin's private
        directory mount goes too (idempotent)."""
        for mounted in (self.pin, self.pin.parent):
            with contextlib.suppress(OSError):
                umount(mounted, MNT_DETACH)
        with contextlib.suppress(OSError):
            self.pin.unlink()
        with contextlib.suppress(OSError):
            self.pin.parent.rmdir()


def open_launch_namespace(
    run_dir: Path, launcher: Path, prune: list[Path]
) -> LaunchNamespace | None:
    """Make (again) this node's launch namespace from the current one, with every mount
    below the ``prune`` directories detached; pinned under ``run_dir``. None (logged) when
    switched off or impossible: the OCI runtime then runs from the node's namespace."""
    if os.environ.get("DSEC_LAUNCH_NAMESPACE", "on").strip().lower() in ("off", "0"):
        return None
    if os.geteuid() != 0:
        return None
    pin = run_dir / "launchns" / "ns"
    try:
        _private_dir(pin.parent)
        if _is_mount_point(pin):  # a previous start's: this one's replaces it
            umount(pin, MNT_DETACH)
        pin.touch()
        command = [
            "unshare",
            f"--mount={pin}",
            "--propagation",
            "private",
            "--",
            sys.executable,
            "-I",
            "-S",
            "-c",
            _PRUNE,
            *(str(p) for p in prune),
        ]
        for cpu in pin_attempts():  # the pin's bind is refused when the ids are out of order
            on_cpu = [] if cpu is None else ["taskset", "--cpu-list", str(cpu)]
            proc = subprocess.run(
                [*on_cpu, *command],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if proc.returncode == 0 or "Invalid argument" not in proc.stderr:
                break
        if proc.returncode != 0:
            raise OSError(errno.EIO, (proc.stderr or "").strip()[-300:] or "unshare failed")
        ns = LaunchNamespace(pin, launcher)
        # the kernel has open_tree (5.2+): probe on the pin's own directory mount
        _, fd = ns.command(["true"], pin.parent)
        os.close(fd)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning(
            "no launch namespace (%s): containers are made from the node's namespace, "
            "their creation slows as sandboxes accumulate",
            e,
        )
        LaunchNamespace(pin, launcher).close()
        return None
    return ns
