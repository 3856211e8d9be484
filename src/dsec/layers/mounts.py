"""Reference-counted, read-only mounts of EROFS layers, one per layer and *scope*.

A scope is who shares a mount, and so its page cache. By default (``DSEC_LAYER_SHARING=key``)
each API key is a scope of its own: a layer used by sandboxes of two keys is mounted twice,
two EROFS superblocks, each with its own page cache, and shared among one key's sandboxes.
Sandboxes without an owner (embedded use) share one scope, ``""``. A key's sandbox cannot
learn from its page cache (``mincore``, read timings after ``fadvise(DONTNEED)``) what another
key's sandboxes read (``docs/design/tenancy.md``, "Page cache between keys").
``DSEC_LAYER_SHARING=node`` makes every sandbox use the one scope ``""``: each layer mounted
once per node, less memory when many keys use one image, and the page cache a channel between
keys. :meth:`LayerMounts.scope_of` maps an owner to its scope.

Mountpoints: ``mount_root/<first 16 hex of the digest>`` in scope ``""``, and
``mount_root/<scope>-<first 16 hex>`` in a key's scope (:func:`mount_name`; the scope is the
first 12 hex digits of the SHA-256 of the owner id, :func:`scope_name`). Each is mounted by
:func:`dsec.privileged.mount.mount_erofs`: straight from its file (``mount(2)`` with fstype
``erofs`` and the file path as the source; kernels since 6.12; every such mount is a
superblock of its own, read with ``directio`` where the kernel has it, so the file's own page
cache holds nothing a key could time) or, on older kernels, files on tmpfs/overlayfs, or with
``DSEC_EROFS_MOUNT=loop``, from a read-only AUTOCLEAR loop device bound to the file (source
``/dev/loopN``). Every mount of one loop device is one superblock, so a key's scope gets loop
devices of its own (``attach_loop(share=False)``); scope ``""`` shares the device bound to the
file, if any, and each device is freed by the kernel when its last mount goes. Sandboxes stack
these mountpoints with overlayfs (see :mod:`dsec.layers.rootfs`).

Reference counting: :meth:`LayerMounts.acquire` mounts on first use in a scope and counts
users; :meth:`LayerMounts.release` unmounts when the count drops to zero. Overlayfs keeps its
own private clone of each lower mount, so unmounting a layer that a live overlay still stacks
is harmless to that overlay (the filesystem stays alive until the overlay goes); the count
only decides when the mountpoint disappears.

Remote layers: ``erofs_file`` may be a file served by the lazy FUSE server
(:mod:`dsec.layers.lazy`, ``<lazy>/mnt/<hex>.erofs``); the mount is the same (without
``directio``: the FUSE file's page cache, which the lazy server warms, is shared by every
scope). If that server died, :meth:`LayerMounts.adopt_existing` unmounts such layers instead
of adopting them.

Restarts: the mounts outlive the edge process. :meth:`LayerMounts.adopt_existing` reads
``/proc/self/mountinfo`` and takes over the EROFS mounts found under ``mount_root`` with
refcount 0, in the scope their name says (:func:`parse_mount_name`); the edge re-acquires for
every sandbox it reconciles, in the scope the sandbox was made in, and :meth:`unmount_unused`
then drops the rest. A loop-backed mount is recognised by its device's backing file
(``/sys/block/loopN/loop/backing_file``, :attr:`MountEntry.source_file`).

Mount flags: ``MS_RDONLY | MS_NODEV | MS_NOSUID`` (overlayfs decides exec/suid/device
semantics through its own mount; these only restrict direct access to the mountpoint).

Example::

    mounts = LayerMounts(paths.layer_mounts)
    scope = mounts.scope_of(owner)       # "" with DSEC_LAYER_SHARING=node or no owner
    lower = mounts.acquire(info.digest, store.layer_path(info.digest), scope)
    ...
    mounts.release(info.digest, scope)
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dsec.config import env_choice
from dsec.errors import InvalidRequest, SandboxError
from dsec.privileged.loop import loop_backing_file
from dsec.privileged.mount import MNT_DETACH, MS_NODEV, MS_NOSUID, MS_RDONLY, mount_erofs, umount

__all__ = [
    "LAYER_SHARING_ENV",
    "LayerMounts",
    "LayerSharing",
    "MountEntry",
    "is_mounted",
    "layer_sharing_setting",
    "mount_name",
    "mountinfo_entries",
    "parse_mount_name",
    "scope_name",
]

log = logging.getLogger(__name__)

_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_BLOB_NAME_RE = re.compile(r"^([0-9a-f]{64})\.erofs$")
_NAME_HEX = 16
_SCOPE_HEX = 12
_MOUNT_NAME_RE = re.compile(rf"^(?:([0-9a-f]{{{_SCOPE_HEX}}})-)?([0-9a-f]{{{_NAME_HEX}}})$")
_LAYER_MOUNT_FLAGS = MS_RDONLY | MS_NODEV | MS_NOSUID

LAYER_SHARING_ENV = "DSEC_LAYER_SHARING"
"""Environment variable: ``key`` (default: a layer mount, and its page cache, per API key)
or ``node`` (one per node, shared by every key). Read when a :class:`LayerMounts` is made."""

LayerSharing = Literal["key", "node"]


def layer_sharing_setting() -> LayerSharing:
    """``DSEC_LAYER_SHARING`` as set (``key`` if unset or unknown, with a warning)."""
    return "node" if env_choice(LAYER_SHARING_ENV, ("key", "node")) == "node" else "key"


def scope_name(owner: str) -> str:
    """The scope of ``owner``'s layer mounts when each key has its own: the first 12 hex
    digits of the SHA-256 of the owner id (``""`` for no owner: the shared scope)."""
    if not owner:
        return ""
    return hashlib.sha256(owner.encode()).hexdigest()[:_SCOPE_HEX]


def mount_name(digest: str, scope: str = "") -> str:
    """The name of layer ``digest``'s mountpoint in ``scope``: ``<16 hex>`` in the shared
    scope, ``<scope>-<16 hex>`` in a key's.

    Raises:
        InvalidRequest: malformed digest or scope.
    """
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidRequest(f"invalid layer digest {digest!r}", digest=digest)
    name = f"{scope}-{m.group(1)[:_NAME_HEX]}" if scope else m.group(1)[:_NAME_HEX]
    if _MOUNT_NAME_RE.match(name) is None:
        raise InvalidRequest(f"invalid layer mount scope {scope!r}", scope=scope)
    return name


def parse_mount_name(name: str) -> tuple[str, str] | None:
    """``(scope, first 16 hex of the digest)`` of a mountpoint name :func:`mount_name` made,
    None for any other name."""
    m = _MOUNT_NAME_RE.match(name)
    return (m.group(1) or "", m.group(2)) if m else None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class MountEntry:
    """One line of ``/proc/self/mountinfo``: where, what filesystem type, from what source."""

    mountpoint: Path
    fstype: str
    source: str

    @property
    def source_file(self) -> str:
        """The file behind the mount: ``source``, or for a loop device (``/dev/loopN``) the
        file bound to it (read from sysfs at each access)."""
        return loop_backing_file(self.source) or self.source


def _escape(path: str) -> str:
    """A path as mountinfo spells it (space, tab, newline and backslash as octal escapes)."""
    return (
        path.replace("\\", "\\134")
        .replace(" ", "\\040")
        .replace("\t", "\\011")
        .replace("\n", "\\012")
    )


def mountinfo_entries(under: str | os.PathLike[str] | None = None) -> list[MountEntry]:
    """Mounts of this mount namespace, in mount order; only those at or below ``under`` if
    given. Filters on the escaped text before parsing, so a scan of thousands of mounts
    costs about a millisecond."""
    prefix = _escape(os.path.abspath(under).rstrip("/")) if under is not None else None
    out: list[MountEntry] = []
    with open("/proc/self/mountinfo") as f:
        text = f.read()
    for line in text.splitlines():
        fields = line.split(" ", 5)
        if len(fields) < 6:
            continue
        mp = fields[4]
        if prefix is not None and not (mp == prefix or mp.startswith(prefix + "/")):
            continue
        _, _, right = fields[5].partition(" - ")
        rest = right.split(" ", 2)
        if len(rest) < 2:
            continue
        out.append(MountEntry(Path(_unescape(mp)), rest[0], _unescape(rest[1])))
    return out


def is_mounted(path: Path) -> bool:
    """True if something is mounted at ``path`` (a different device than its parent's, or a
    bind mount of the same device, which only mountinfo shows)."""
    try:
        st, parent = os.stat(path), os.stat(os.path.dirname(os.path.abspath(path)))
    except (FileNotFoundError, NotADirectoryError):
        return False
    if st.st_dev != parent.st_dev or st.st_ino == parent.st_ino:
        return True
    return any(e.mountpoint == Path(os.path.abspath(path)) for e in mountinfo_entries(path))


@dataclass
class _Layer:
    mountpoint: Path
    refcount: int


class LayerMounts:
    """Each layer mounted read-only once per scope (see the module doc), from its file (or a
    loop device bound to it), reference-counted. Thread-safe.

    Args:
        mount_root: directory holding one mountpoint per layer and scope
            (``$DSEC_HOME/mnt/layers``); created if missing.
        sharing: ``key`` (a scope per owner) or ``node`` (one scope); default
            ``DSEC_LAYER_SHARING`` (:func:`layer_sharing_setting`).
    """

    def __init__(self, mount_root: Path, *, sharing: LayerSharing | None = None) -> None:
        self.mount_root = Path(os.path.abspath(mount_root))
        self.mount_root.mkdir(parents=True, exist_ok=True)
        self.sharing: LayerSharing = sharing or layer_sharing_setting()
        self._lock = threading.Lock()
        self._layers: dict[tuple[str, str], _Layer] = {}  # (scope, digest) -> its mount

    def scope_of(self, owner: str) -> str:
        """The scope of ``owner``'s sandboxes: ``""`` (shared) for no owner or with
        ``sharing="node"``, else :func:`scope_name`."""
        return "" if self.sharing == "node" else scope_name(owner)

    def _mounts_at(self, mountpoint: Path) -> list[MountEntry]:
        """Mounts stacked exactly on ``mountpoint``; cheap (one stat) when there are none."""
        try:
            st, root = os.stat(mountpoint), os.stat(self.mount_root)
        except FileNotFoundError:
            return []
        if st.st_dev == root.st_dev:  # a plain directory (layers never share the root's device)
            return []
        return [e for e in mountinfo_entries(mountpoint) if e.mountpoint == mountpoint]

    def acquire(self, digest: str, erofs_file: Path, scope: str = "") -> Path:
        """Mount the layer in ``scope`` if needed and count one more user. Returns its
        mountpoint.

        Takes ~0.2 ms for a first mount (~0.5 ms through a loop device), microseconds after.

        Raises:
            InvalidRequest: malformed digest or scope.
            SandboxError: the mount failed (not an EROFS image, no loop device free) or
                another layer already sits at this mountpoint.
        """
        mountpoint = self.mount_root / mount_name(digest, scope)
        with self._lock:
            entry = self._layers.get((scope, digest))
            if entry is not None:
                entry.refcount += 1
                return entry.mountpoint
            source = os.path.abspath(erofs_file)
            existing = self._mounts_at(mountpoint)
            if existing:  # mounted before we were told (restart without adopt_existing)
                top = existing[-1]
                if top.fstype != "erofs" or not _same_layer(top.source_file, digest):
                    raise SandboxError(
                        f"{mountpoint} already holds {top.fstype} from {top.source}, "
                        f"not layer {digest}",
                        mountpoint=str(mountpoint),
                    )
            else:
                mountpoint.mkdir(mode=0o755, exist_ok=True)
                try:
                    mount_erofs(source, mountpoint, _LAYER_MOUNT_FLAGS, own_device=bool(scope))
                except OSError as e:
                    _rmdir_quiet(mountpoint)
                    raise SandboxError(
                        f"cannot mount layer {digest} from {source}: {e.strerror}",
                        digest=digest,
                        errno=e.errno,
                    ) from e
            self._layers[(scope, digest)] = _Layer(mountpoint, 1)
            return mountpoint

    def release(self, digest: str, scope: str = "") -> None:
        """Count one user less of the layer in ``scope``; unmount (and remove the mountpoint)
        when none is left.

        Releasing a layer this object does not know is logged and ignored (teardown after a
        restart must not fail on it).

        Raises:
            SandboxError: the unmount failed; the layer stays known with refcount 0 and
                :meth:`unmount_unused` retries.
        """
        with self._lock:
            entry = self._layers.get((scope, digest))
            if entry is None:
                log.warning(
                    "release of layer %s (scope %r) that is not mounted here", digest, scope
                )
                return
            entry.refcount = max(0, entry.refcount - 1)
            if entry.refcount == 0:
                self._unmount((scope, digest), entry)

    def refcount(self, digest: str, scope: str = "") -> int:
        """Current number of users of the layer in ``scope`` (0 if unknown or adopted and
        unused)."""
        with self._lock:
            entry = self._layers.get((scope, digest))
            return entry.refcount if entry is not None else 0

    def mounted(self, scope: str = "") -> dict[str, Path]:
        """Layers mounted and known here in ``scope``, digest -> mountpoint."""
        with self._lock:
            return {d: e.mountpoint for (s, d), e in self._layers.items() if s == scope}

    def scopes(self) -> set[str]:
        """The scopes that have a layer mounted and known here."""
        with self._lock:
            return {s for s, _ in self._layers}

    def adopt_existing(self) -> None:
        """Take over EROFS mounts already under ``mount_root`` (after an edge restart), with
        refcount 0, each in the scope its name says. Mounts whose name is no layer
        mountpoint's, or whose source (or, for a loop device, its backing file) is not the
        store blob (``<64 hex>.erofs``) the name says, are unmounted; empty leftover
        mountpoint directories are removed."""
        with self._lock:
            for entry in mountinfo_entries(self.mount_root):
                if entry.mountpoint.parent != self.mount_root:
                    continue
                source = entry.source_file
                m = _BLOB_NAME_RE.match(os.path.basename(source))
                digest = f"sha256:{m.group(1)}" if m else None
                parsed = parse_mount_name(entry.mountpoint.name)
                if (
                    entry.fstype != "erofs"
                    or digest is None
                    or parsed is None
                    or parsed[1] != digest[7 : 7 + _NAME_HEX]
                ):
                    log.warning("unmounting stray %s mount at %s", entry.fstype, entry.mountpoint)
                    _umount_all(entry.mountpoint)
                    continue
                if not _source_alive(source):
                    # a lazily served layer whose FUSE server died: every read would fail
                    log.warning("unmounting layer %s: its source %s is gone", digest, source)
                    _umount_all(entry.mountpoint)
                    continue
                self._layers.setdefault((parsed[0], digest), _Layer(entry.mountpoint, 0))
            known = {e.mountpoint for e in self._layers.values()}
            for child in self.mount_root.iterdir():
                if child not in known and child.is_dir() and not child.is_symlink():
                    _rmdir_quiet(child)

    def unmount_unused(self) -> int:
        """Unmount every layer with refcount 0, in every scope. Returns how many were
        unmounted."""
        with self._lock:
            idle = [(k, e) for k, e in self._layers.items() if e.refcount == 0]
            for key, entry in idle:
                self._unmount(key, entry)
            return len(idle)

    def close(self, *, force: bool = False) -> None:
        """Unmount unused layers and forget all. Layers still in use stay mounted (their
        sandboxes may outlive this process; a restarted edge adopts them) unless ``force``."""
        with self._lock:
            for key, entry in list(self._layers.items()):
                if entry.refcount == 0 or force:
                    try:
                        self._unmount(key, entry)
                    except SandboxError as e:
                        log.error("%s", e)
            self._layers.clear()

    def _unmount(self, key: tuple[str, str], entry: _Layer) -> None:
        """Unmount one layer of one scope (caller holds the lock) and forget it."""
        try:
            _umount_all(entry.mountpoint)
        except OSError as e:
            raise SandboxError(
                f"cannot unmount layer {key[1]} at {entry.mountpoint}: {e.strerror}",
                digest=key[1],
            ) from e
        _rmdir_quiet(entry.mountpoint)
        self._layers.pop(key, None)


def _same_layer(source: str, digest: str) -> bool:
    m = _BLOB_NAME_RE.match(os.path.basename(source))
    return m is not None and f"sha256:{m.group(1)}" == digest


def _source_alive(source: str) -> bool:
    """False if a mount's source file is gone or sits on a dead FUSE mount (ENOTCONN).
    ``statvfs`` because FUSE always asks the server for it (``stat`` may be cached)."""
    try:
        os.stat(source)
        os.statvfs(source)
    except OSError:
        return False
    return True


def _umount_all(mountpoint: Path) -> None:
    """Unmount every mount stacked on ``mountpoint``; lazily detach a busy one."""
    for _ in range(16):
        try:
            umount(mountpoint)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOENT):
                return
            if e.errno != errno.EBUSY:
                raise
            umount(mountpoint, MNT_DETACH)
    raise OSError(errno.EBUSY, f"{mountpoint}: still mounted after 16 unmounts")


def _rmdir_quiet(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EBUSY):
            log.warning("cannot remove %s: %s", path, e)
