"""A sandbox's root filesystem: read-only layers under a private, size-capped writable upper.

Layout under a sandbox directory (short names keep the overlay option string small)::

    <sandbox_dir>/
      upper/          tmpfs, size = disk_mb MiB: the cap on what the sandbox can write
        data/         overlay upperdir (what the sandbox changed; whiteouts are 0:0 char devs)
        work/         overlay workdir
      rootfs/         overlay: lowerdir = layers (top first), upperdir, workdir

The upper is a tmpfs, so ``disk_mb`` is enforced by the kernel with no quota setup and the
upper vanishes with its mount. The price: written data lives in memory. Pages are charged
to the memory cgroup of the process that writes them (the sandbox), so a sandbox's disk
use counts against its memory limit, and on a node without swap those pages cannot be
reclaimed while the sandbox is paused. See ``docs/design/layers.md``.

The overlay names its directories ``/proc/self/fd/<n>`` (descriptors this process holds
for the time of the mount): the kernel shows the option strings as given in every
mountinfo, the sandbox's own ``/proc/mounts`` included, and host paths there would tell a
sandbox where ``DSEC_HOME`` is and its layers' mount names.

Overlay options: ``xino=auto`` (one ``st_dev`` for every file; needs distinct layer UUIDs,
which :func:`dsec.layers.erofs.mkfs_erofs` provides). ``volatile`` is not used: it only skips
``syncfs`` on the upper, which is a no-op on tmpfs anyway, and it makes the work dir
unusable for a remount.

Example::

    lowers = [mounts.acquire(l.digest, store.layer_path(l.digest)) for l in layers]
    root = assemble_rootfs(paths.sandboxes / sandbox_id, lowers, disk_mb=1024)
    ...
    teardown_rootfs(paths.sandboxes / sandbox_id)
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from pathlib import Path

from dsec.errors import InvalidRequest, SandboxError
from dsec.layers.mounts import is_mounted, mountinfo_entries
from dsec.privileged.mount import (
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    mount,
    umount,
    umount_quiet,
)

__all__ = [
    "INIT_DIR_SOURCE",
    "assemble_rootfs",
    "detach_rootfs",
    "freeze_upper",
    "frozen_data",
    "mount_init_dir",
    "mount_sandbox_root",
    "release_frozen",
    "release_init_dir",
    "release_sandbox_root",
    "rootfs_path",
    "teardown_rootfs",
    "upper_dir",
    "work_dir",
]

log = logging.getLogger(__name__)

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_MAX_TEARDOWN_ROUNDS = 256
BYTES_PER_INODE = 4096
"""tmpfs ``nr_inodes`` = disk size / this (at least 4096): bounds the kernel memory empty
files can pin, which ``size=`` alone does not count."""


SANDBOX_ROOT_SOURCE = "dsec-sandboxes"
"""The source name of the tmpfs :func:`mount_sandbox_root` mounts (as mountinfo shows it)."""


def _root_mounted(root: Path) -> bool:
    """Whether the tmpfs of :func:`mount_sandbox_root` (known by its source name) is mounted
    exactly at ``root``."""
    here = Path(os.path.abspath(root))
    return any(
        e.mountpoint == here and e.source == SANDBOX_ROOT_SOURCE for e in mountinfo_entries(root)
    )


def mount_sandbox_root(root: Path) -> bool:
    """Put the directory of the sandbox directories (``paths.sandboxes``) on a tmpfs of its
    own and say whether it is on tmpfs now. Idempotent: a tmpfs left by an earlier start (the
    server keeps its sandboxes across a restart) is used as it is.

    What a sandbox directory holds besides its mounts is a few small files written at each
    create (``config.json``, the boot id, the init's pid file) and removed at its teardown.
    On ext4 their creation, the directories' and the removal journal metadata: ~0.45 ms of
    every create + kill in a loop, against ~0.13 ms on tmpfs. A node reboot clears the
    tmpfs, and with it only directories of containers that died with the node.

    Mounted only over an empty directory: a non-empty one on another filesystem holds
    sandboxes of a dsec that predates this (they stay where they are, and so does the
    directory). ``nosuid,nodev,noexec``, mode 0700; the size cap is the kernel's default
    (half of memory), pages are used only as files are written.
    """
    root.mkdir(parents=True, exist_ok=True)
    if _root_mounted(root):
        return True
    if any(os.scandir(root)):
        log.info("%s holds sandboxes already: their directories stay on its filesystem", root)
        return False
    try:
        mount(SANDBOX_ROOT_SOURCE, root, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0700")
    except OSError as e:
        log.warning("cannot mount a tmpfs at %s (sandbox directories stay on disk): %s", root, e)
        return False
    return True


def release_sandbox_root(root: Path) -> None:
    """Unmount the tmpfs of :func:`mount_sandbox_root` if nothing is left in it (never
    lazily: a sandbox's mounts below it would be hidden, not gone)."""
    if not _root_mounted(root):
        return
    try:
        if any(os.scandir(root)):
            return  # sandboxes that outlive this server: the next start uses the tmpfs
        umount(root)
    except OSError as e:
        log.warning("cannot unmount the sandbox tmpfs %s: %s", root, e)


INIT_DIR_SOURCE = "dsec-init"
"""The source name of the tmpfs :func:`mount_init_dir` mounts."""


def mount_init_dir(where: Path, binary: Path) -> Path:
    """Put a copy of the containers' init ``binary`` alone on a small tmpfs at ``where``
    (with the empty :func:`mask_dir`) and return the copy's path (``where/init``). Idempotent: a tmpfs left by an earlier
    start is used again (a changed binary replaces the copy by a rename, so running inits
    keep theirs).

    Why: a container's mountinfo shows, for a bind mount, the source's path inside its
    filesystem; bound from ``$DSEC_HOME/bin`` on the node's disk, every sandbox read the
    node's ``DSEC_HOME`` (and its disk device) in ``/proc/mounts``. From here it reads
    ``/init`` on a tmpfs named ``dsec-init``. If the tmpfs cannot be mounted, ``binary``
    itself is returned (and the path shows)."""
    where.mkdir(mode=0o755, parents=True, exist_ok=True)
    here = Path(os.path.abspath(where))
    mounted = any(
        e.mountpoint == here and e.source == INIT_DIR_SOURCE for e in mountinfo_entries(where)
    )
    if not mounted:
        size = os.stat(binary).st_size * 3 + (1 << 20)  # a copy being replaced + slack
        try:
            mount(INIT_DIR_SOURCE, where, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
        except OSError as e:
            log.warning("cannot mount a tmpfs at %s (the init's path shows in sandboxes): %s",
                        where, e)  # fmt: skip
            return binary
    mask = mask_dir(where)
    mask.mkdir(mode=0o555, exist_ok=True)
    dest = where / "init"
    with open(binary, "rb") as f:
        data = f.read()
    try:
        with open(dest, "rb") as f:
            same = f.read() == data
    except FileNotFoundError:
        same = False
    if not same:
        tmp = where / ".init.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o555)
        os.rename(tmp, dest)
    return dest


def release_init_dir(where: Path) -> None:
    """Unmount :func:`mount_init_dir`'s tmpfs (running containers keep the init they were
    given: their bind mounts hold it)."""
    here = Path(os.path.abspath(where))
    if any(e.mountpoint == here and e.source == INIT_DIR_SOURCE for e in mountinfo_entries(where)):
        try:
            umount(where)
        except OSError as e:
            log.warning("cannot unmount %s: %s", where, e)


def rootfs_path(sandbox_dir: Path) -> Path:
    """Where the merged root filesystem is mounted."""
    return Path(sandbox_dir) / "rootfs"


def _upper_mount(sandbox_dir: Path) -> Path:
    return Path(sandbox_dir) / "upper"


def upper_dir(sandbox_dir: Path) -> Path:
    """The overlay upperdir: every file the sandbox created or changed, with whiteouts
    (0:0 character devices) for deletions. ``pack_diff`` turns this into a layer."""
    return _upper_mount(sandbox_dir) / "data"


def mask_dir(init_dir: Path) -> Path:
    """An empty read-only directory on the init's tmpfs (``where`` of
    :func:`mount_init_dir`): the containers' masked directories are bind mounts of it."""
    return Path(init_dir) / "mask"


def work_dir(sandbox_dir: Path) -> Path:
    """The overlay workdir (kernel scratch; never read it)."""
    return _upper_mount(sandbox_dir) / "work"


def _check_lower(path: Path) -> str:
    text = os.path.abspath(path)
    if any(c in text for c in ":,\\\n") or not os.path.isdir(text):
        raise InvalidRequest(
            f"lower layer {text!r} must be an existing directory without ':', ',' or '\\'",
            path=text,
        )
    return text


def _overlay_options(lowers: list[int], upper: int, work: int, *, shared: bool = False) -> str:
    """Overlay options naming its directories by descriptor (lowers top first); ``shared``:
    some lower is (or was) another overlay's upper (see :func:`assemble_rootfs`)."""
    lower = ":".join(f"/proc/self/fd/{fd}" for fd in lowers)
    options = (
        f"lowerdir={lower},upperdir=/proc/self/fd/{upper},workdir=/proc/self/fd/{work},xino=auto"
    )
    return options + (",index=off,metacopy=off" if shared else "")


def assemble_rootfs(
    sandbox_dir: Path,
    lowers: list[Path],
    disk_mb: int,
    *,
    nodev: bool = True,
    frozen_lowers: int = 0,
) -> Path:
    """Mount a sandbox's root filesystem and return its path (``sandbox_dir/rootfs``).

    Args:
        sandbox_dir: the sandbox's private directory (created if missing).
        lowers: mounted layer directories, **bottom first** (as images list them). A
            directory listed twice is kept only at its topmost position.
        disk_mb: size of the writable upper, MiB (tmpfs ``size=``).
        nodev: mount the overlay ``nodev`` (device nodes in layers or the upper cannot be
            opened through it; the runtime mounts its own ``/dev``).
        frozen_lowers: how many of the top ``lowers`` are *frozen uppers*: former upper
            directories of other sandboxes (shared forks), stacked as they are. overlayfs
            honours their whiteouts and opaque directories as lower layers; such a
            directory may still be the upper of its (paused) sandbox's overlay, which
            overlayfs allows only without an inodes index: the overlay is then mounted
            with ``index=off`` (and ``metacopy=off``: uppers are made without metacopy,
            so a former upper holds every file's data and needs no redirect).

    The merged root directory takes the owner and mode of the top layer's root. Takes
    ~0.3-0.5 ms. On any failure everything this call mounted is undone.

    Raises:
        InvalidRequest: no lowers, a lower is not a directory or has ``:``/``,`` in its
            path, ``disk_mb`` < 1, or the option string would exceed one page (too many or
            too long lower paths).
        SandboxError: ``sandbox_dir`` is already assembled, or a mount failed.
    """
    if not lowers:
        raise InvalidRequest("a root filesystem needs at least one layer")
    if disk_mb < 1:
        raise InvalidRequest(f"disk_mb must be >= 1, not {disk_mb}")
    lower_paths = [_check_lower(p) for p in lowers]
    # overlayfs refuses the same lower twice ("conflicting lowerdir path"); keeping only the
    # topmost copy of a repeated layer gives the same merged view
    last = {p: i for i, p in enumerate(lower_paths)}
    lower_paths = [p for i, p in enumerate(lower_paths) if last[p] == i]
    sandbox_dir = Path(os.path.abspath(sandbox_dir))
    upper_mnt, rootfs = _upper_mount(sandbox_dir), rootfs_path(sandbox_dir)
    data, work = upper_dir(sandbox_dir), work_dir(sandbox_dir)
    # the longest the options can be (descriptor numbers of up to 7 digits)
    longest = len(
        _overlay_options([9_999_999] * len(lower_paths), 9_999_999, 9_999_999, shared=True)
    )
    if longest >= _PAGE_SIZE:
        raise InvalidRequest(
            f"overlay options can be {longest} bytes, over the {_PAGE_SIZE}-byte page limit "
            f"({len(lower_paths)} layers): use fewer layers",
            layers=len(lower_paths),
        )
    sandbox_dir.mkdir(parents=True, exist_ok=True)
    if _mounted_on(upper_mnt, sandbox_dir) or _mounted_on(rootfs, sandbox_dir):
        raise SandboxError(f"{sandbox_dir} already has a root filesystem mounted")
    upper_mnt.mkdir(mode=0o700, exist_ok=True)
    rootfs.mkdir(mode=0o755, exist_ok=True)
    mounted: list[Path] = []
    try:
        nr_inodes = max(4096, disk_mb * (1 << 20) // BYTES_PER_INODE)
        mount(
            "dsec-upper",
            upper_mnt,
            "tmpfs",
            MS_NOSUID | MS_NODEV,
            f"size={disk_mb}m,nr_inodes={nr_inodes},mode=0755",
        )
        mounted.append(upper_mnt)
        data.mkdir()
        work.mkdir()
        top = os.stat(lower_paths[-1])
        os.chown(data, top.st_uid, top.st_gid)
        os.chmod(data, top.st_mode & 0o7777)
        fds: list[int] = []
        try:
            for name in [*reversed(lower_paths), str(data), str(work)]:
                fds.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            options = _overlay_options(fds[:-2], fds[-2], fds[-1], shared=frozen_lowers > 0)
            mount("dsec-rootfs", rootfs, "overlay", MS_NODEV if nodev else 0, options)
        finally:
            for fd in fds:
                os.close(fd)
        mounted.append(rootfs)
    except OSError as e:
        for mp in reversed(mounted):
            try:
                umount_quiet(mp)
            except OSError as undo_error:
                log.error("undo of %s failed: %s", mp, undo_error)
        for d in (rootfs, upper_mnt):
            if not is_mounted(d):
                shutil.rmtree(d, ignore_errors=True)
        raise SandboxError(
            f"cannot assemble the root filesystem in {sandbox_dir}: {e}",
            errno=e.errno,
            layers=len(lower_paths),
        ) from e
    return rootfs


def _mounted_on(path: Path, parent: Path) -> bool:
    """Whether something is mounted on ``path`` (a directory of ``parent``'s filesystem
    unless a mount covers it: the tmpfs upper and the overlay each have a device of their
    own). A missing ``path`` has nothing on it."""
    try:
        return os.stat(path).st_dev != os.stat(parent).st_dev
    except FileNotFoundError:
        return False


def detach_rootfs(sandbox_dir: Path) -> None:
    """Unmount ``sandbox_dir``'s root filesystem from the node's namespace (the overlay,
    then its upper), keeping the directory, so that :func:`assemble_rootfs` can mount a
    new one there. A container running on the old one keeps it (its own mount namespace
    holds it) until it moves off it; then it is gone. Idempotent.

    Raises:
        SandboxError: an unmount failed, or something else stays mounted there.
    """
    sandbox_dir = Path(os.path.abspath(sandbox_dir))
    for mp in (rootfs_path(sandbox_dir), _upper_mount(sandbox_dir)):
        try:
            while _mounted_on(mp, sandbox_dir):
                umount_quiet(mp)
        except OSError as e:
            raise SandboxError(f"cannot unmount {mp}: {e.strerror}", errno=e.errno) from e


def teardown_rootfs(sandbox_dir: Path) -> None:
    """Unmount everything under ``sandbox_dir`` (the overlay, then the tmpfs upper, and
    anything a runtime left mounted inside), deepest first, then remove ``sandbox_dir``.

    Idempotent and safe on a half-assembled directory. The upper's content is gone after
    this: pack it first if you want to keep it. Nothing is deleted while anything below
    ``sandbox_dir`` is still mounted.

    Raises:
        SandboxError: something stayed mounted (the directory is then left in place).
    """
    sandbox_dir = Path(os.path.abspath(sandbox_dir))
    if not sandbox_dir.exists():
        return
    clean = False
    try:  # the usual case, without scanning mountinfo: overlay, then the upper
        umount_quiet(rootfs_path(sandbox_dir))
        umount_quiet(_upper_mount(sandbox_dir))
        # nothing left on either (a second mount stacked there shows another device): the
        # node's table is not read, which costs O(live sandboxes) per kill
        clean = not _mounted_on(rootfs_path(sandbox_dir), sandbox_dir) and not _mounted_on(
            _upper_mount(sandbox_dir), sandbox_dir
        )
    except OSError as e:
        log.warning("teardown of %s: %s; unmounting all mounts below it", sandbox_dir, e)
    for _ in range(0 if clean else _MAX_TEARDOWN_ROUNDS):
        mps = [e.mountpoint for e in mountinfo_entries(sandbox_dir)]
        if not mps:
            break
        deepest = max(mps, key=lambda p: len(p.parts))
        try:
            umount_quiet(deepest)
        except OSError as e:
            raise SandboxError(f"cannot unmount {deepest}: {e.strerror}", errno=e.errno) from e
    else:
        if not clean:
            raise SandboxError(
                f"{sandbox_dir}: mounts remain after {_MAX_TEARDOWN_ROUNDS} unmounts"
            )
    try:
        shutil.rmtree(sandbox_dir)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise SandboxError(f"cannot remove {sandbox_dir}: {e}") from e


# --- frozen uppers (shared forks) ------------------------------------------------------


def frozen_data(frozen: Path) -> Path:
    """The directory of a frozen upper (made by :func:`freeze_upper` at ``frozen``) to stack
    as a lower layer: the former upper's ``data``."""
    return Path(frozen) / "data"


def freeze_upper(sandbox_dir: Path, frozen: Path) -> None:
    """Keep ``sandbox_dir``'s writable upper (its tmpfs) at ``frozen`` as well, read-only,
    so that it outlives the sandbox's own mounts: a bind of the tmpfs, remounted read-only
    (that bind only: the sandbox's overlay keeps its own view of the tmpfs). The caller has
    stopped every writer first (the sandbox is frozen) and never lets it write there again.
    ~0.1 ms; nothing is copied. Undo with :func:`release_frozen`.

    Raises:
        SandboxError: the upper is not mounted, or a mount failed (nothing is left).
    """
    upper = _upper_mount(Path(os.path.abspath(sandbox_dir)))
    frozen = Path(os.path.abspath(frozen))
    if not _mounted_on(upper, upper.parent):
        raise SandboxError(f"{sandbox_dir} has no writable upper to freeze")
    frozen.mkdir(mode=0o700, parents=True)
    try:
        mount(upper, frozen, None, MS_BIND)
        try:
            mount("none", frozen, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        except OSError:
            umount_quiet(frozen)
            raise
    except OSError as e:
        with contextlib.suppress(OSError):
            frozen.rmdir()
        raise SandboxError(f"cannot freeze the upper of {sandbox_dir}: {e}", errno=e.errno) from e


def release_frozen(frozen: Path) -> None:
    """Unmount a frozen upper of :func:`freeze_upper` and remove its directory (idempotent).
    Overlays that stack it hold the tmpfs by references of their own: call this when none
    is left, or its memory stays in use unseen until they are gone."""
    frozen = Path(os.path.abspath(frozen))
    if not frozen.exists():
        return
    try:
        while _mounted_on(frozen, frozen.parent):
            umount_quiet(frozen)
        frozen.rmdir()
    except FileNotFoundError:
        pass
    except OSError as e:
        raise SandboxError(f"cannot release the frozen layer {frozen}: {e}", errno=e.errno) from e
