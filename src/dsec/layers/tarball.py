"""Safe extraction of untrusted tarballs into a directory (build contexts, OCI layers,
uploads): no member escapes the directory, links and symlinks resolve inside it."""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tarfile
from pathlib import Path

from dsec.errors import InvalidRequest, PayloadTooLarge

__all__ = ["extract_tarball"]

log = logging.getLogger(__name__)

_MAX_SYMLINK_HOPS = 40


def _member_parts(name: str, tar_path: Path) -> list[str]:
    """Split a member name into components; leading '/' and '.' are dropped, '..' is refused."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(
            f"tarball {tar_path} has a member escaping its root: {name!r}", member=name
        )
    return parts


def _resolve_dir_in_root(root: Path, parts: list[str], member: str) -> Path:
    """Resolve directory components inside ``root`` as if ``root`` were ``/``.

    Symlinks met on the way are followed with chroot semantics (an absolute target restarts
    at ``root``; ``..`` never climbs above it), so a member like ``bin/x`` under a symlink
    ``bin -> /usr/bin`` lands in ``root/usr/bin/x`` and can never escape. Missing
    directories are created (mode 0755). Returns the resolved, symlink-free directory.
    """
    resolved: list[str] = []
    todo = list(parts)
    hops = 0
    while todo:
        comp = todo.pop(0)
        if comp in ("", "."):
            continue
        if comp == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, comp)
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            os.mkdir(candidate, 0o755)
            resolved.append(comp)
            continue
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_SYMLINK_HOPS:
                raise InvalidRequest(f"too many symlinks resolving tar member {member!r}")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            todo = target.split("/") + todo
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise InvalidRequest(
                f"tar member {member!r}: {'/'.join([*resolved, comp])} is not a directory"
            )
        resolved.append(comp)
    return root.joinpath(*resolved)


def _clear_path(path: Path, new_is_dir: bool) -> None:
    """Make room for a new entry at ``path`` (later members replace earlier ones)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if not new_is_dir:
            shutil.rmtree(path)
    else:
        os.unlink(path)


def _apply_xattrs(path: Path, member: tarfile.TarInfo) -> None:
    for key, value in member.pax_headers.items():
        if not key.startswith("SCHILY.xattr."):
            continue
        attr = key[len("SCHILY.xattr.") :]
        try:
            os.setxattr(path, attr, value.encode("utf-8", "surrogateescape"), follow_symlinks=False)
        except OSError as e:
            log.warning("tar member %s: cannot set xattr %s: %s", member.name, attr, e)


def _apply_meta(path: Path, member: tarfile.TarInfo, *, is_link: bool = False) -> None:
    if os.geteuid() == 0:
        os.chown(path, member.uid, member.gid, follow_symlinks=False)
    if not is_link:
        os.chmod(path, member.mode & 0o7777)
    _apply_xattrs(path, member)
    mtime_ns = int(member.mtime * 1_000_000_000)
    os.utime(path, ns=(mtime_ns, mtime_ns), follow_symlinks=False)


def extract_tarball(
    tar_path: Path,
    dest: Path,
    *,
    max_bytes: int | None = None,
    max_members: int | None = None,
) -> dict[str, int]:
    """Extract a (optionally gzip/bzip2/xz-compressed) tarball into ``dest``, safely.

    Keeps modes (including setuid and sticky bits), numeric owners (when running as root),
    symlinks (targets verbatim, never followed while writing), hard links, FIFOs, mtimes and
    ``SCHILY.xattr`` extended attributes. Refuses members with ``..`` components; leading
    ``/`` is stripped; paths through symlinks resolve inside ``dest`` (chroot semantics).
    Character and block devices are skipped, except the 0:0 character device overlayfs uses
    as a whiteout. Later members replace earlier ones, as tar does.

    ``max_bytes`` / ``max_members`` bound what an untrusted archive may unpack to (regular
    file data, bytes; entries): a compressed archive can expand a thousandfold.

    Returns:
        Counts: ``members``, ``skipped_devices``, ``bytes`` (regular file data).

    Raises:
        InvalidRequest: not a readable tarball, or a member would escape ``dest``.
        PayloadTooLarge: over ``max_bytes`` or ``max_members`` (what was unpacked stays in
            ``dest`` for the caller to remove).
    """
    dest.mkdir(parents=True, exist_ok=True)
    counts = {"members": 0, "skipped_devices": 0, "bytes": 0}
    dirs: dict[Path, tarfile.TarInfo] = {}
    try:
        tf = tarfile.open(tar_path, mode="r|*")
    except (tarfile.TarError, OSError) as e:
        raise InvalidRequest(
            f"{tar_path} is not a readable tarball: {e}", path=str(tar_path)
        ) from e
    with tf:
        try:
            for member in tf:
                counts["members"] += 1
                if max_members is not None and counts["members"] > max_members:
                    raise PayloadTooLarge(
                        f"the archive has more than {max_members} entries",
                        limit_entries=max_members,
                    )
                if member.isreg() and max_bytes is not None:
                    if counts["bytes"] + member.size > max_bytes:
                        raise PayloadTooLarge(
                            f"the archive unpacks to more than {max_bytes} bytes",
                            limit_bytes=max_bytes,
                        )
                parts = _member_parts(member.name, tar_path)
                if not parts:  # "./": the root directory itself
                    if member.isdir():
                        dirs[dest] = member
                    continue
                parent = _resolve_dir_in_root(dest, parts[:-1], member.name)
                target = parent / parts[-1]
                if member.isdir():
                    _clear_path(target, new_is_dir=True)
                    if not target.exists():
                        os.mkdir(target, 0o700)
                    dirs[target] = member
                elif member.isreg():
                    _clear_path(target, new_is_dir=False)
                    src = tf.extractfile(member)
                    if src is None:
                        raise InvalidRequest(f"tar member {member.name!r} has no data")
                    fd = os.open(
                        target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600
                    )
                    with os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
                    counts["bytes"] += member.size
                    _apply_meta(target, member)
                elif member.issym():
                    _clear_path(target, new_is_dir=False)
                    os.symlink(member.linkname, target)
                    _apply_meta(target, member, is_link=True)
                elif member.islnk():
                    link_parts = _member_parts(member.linkname, tar_path)
                    if not link_parts:
                        raise InvalidRequest(f"tar member {member.name!r}: hard link to the root")
                    link_parent = _resolve_dir_in_root(dest, link_parts[:-1], member.linkname)
                    source = link_parent / link_parts[-1]
                    try:
                        src_st = os.lstat(source)
                    except FileNotFoundError as e:
                        raise InvalidRequest(
                            f"tar member {member.name!r}: hard link target {member.linkname!r} "
                            "is not in the archive before it"
                        ) from e
                    if stat.S_ISDIR(src_st.st_mode):
                        raise InvalidRequest(
                            f"tar member {member.name!r}: hard link to a directory"
                        )
                    if source == target:
                        continue
                    _clear_path(target, new_is_dir=False)
                    os.link(source, target, follow_symlinks=False)
                elif member.ischr() or member.isblk():
                    if member.ischr() and member.devmajor == 0 and member.devminor == 0:
                        _clear_path(target, new_is_dir=False)
                        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))
                        _apply_meta(target, member)
                    else:
                        counts["skipped_devices"] += 1
                elif member.isfifo():
                    _clear_path(target, new_is_dir=False)
                    os.mkfifo(target, 0o600)
                    _apply_meta(target, member)
                else:
                    log.debug("tar member %s of type %r skipped", member.name, member.type)
        except (tarfile.TarError, EOFError) as e:
            raise InvalidRequest(f"{tar_path}: corrupt tarball: {e}", path=str(tar_path)) from e
    # Directory metadata last (a read-only directory must not block its children), deepest first.
    for path, member in sorted(dirs.items(), key=lambda kv: len(kv[0].parts), reverse=True):
        _apply_meta(path, member)
    return counts
