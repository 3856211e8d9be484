"""``copy`` steps as layers built straight from the context files.

A ``copy`` does not run anything in the image: its layer is a directory tree written here
and packed with ``mkfs.erofs``. That is faster than copying into a sandbox and packing its
writable layer, and it keeps what a sandbox would lose: modification times, setuid bits,
exact directory modes and owners, and paths a snapshot scrubs (``/tmp``, ``/var/tmp``,
apt lists).

What the tree must get right is the *image below it*: overlayfs shows the topmost layer's
entry for a path, so a layer must not put a directory where the image has a symlink
(``/bin -> usr/bin`` on merged-usr systems: a ``/bin`` directory in the layer would hide
every binary), and a directory the layer only passes through must keep the image's mode
and owner (``/tmp`` is 1777; ``/home/app`` may belong to the app user). So every
destination is resolved inside the image first, following its symlinks with chroot
semantics, through a sandbox's file API (:class:`ImageFS`, one ``stat`` per path
component, memoised); each directory on the way that exists in the image is copied into
the tree with the image's metadata; directories the copy creates are root's, mode 0755
(the ``chown`` owner's with ``--chown``).

Semantics (Dockerfile ``COPY``/``ADD``): a source directory's *contents* go into the
destination (directories the copy creates take the source directory's mode; those the image
already has keep the image's mode and owner); a source file goes to the destination path itself unless the
destination ends with ``/`` or is a directory in the image; symlinks are copied as
symlinks (a source that is itself a symlink is followed inside the context); without
``chown`` everything belongs to root; ``chmod`` replaces every copied entry's mode;
``ADD`` unpacks a local tar archive (plain, gzip, bzip2, xz) into the destination, keeping
the archive's owners unless ``chown`` is given. Hard links become separate files;
extended attributes of the image's directories are not carried into the layer.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dsec.builds.context import BuildContext, ContextEntry
from dsec.errors import InvalidRequest
from dsec.models import FileInfo

__all__ = ["ImageFS", "LayerTree", "SourceEntry", "apply_chmod", "lookup_ids", "place_entries"]

_MAX_SYMLINK_HOPS = 40
StatFn = Callable[[str], Awaitable[FileInfo | None]]


class ImageFS:
    """Path resolution inside the image a step runs on. ``stat`` is ``lstat`` of an
    absolute path in the image (None: it does not exist); results are memoised."""

    def __init__(self, stat_fn: StatFn) -> None:
        self._stat_fn = stat_fn
        self._stats: dict[str, FileInfo | None] = {}
        self._dirs: dict[str, tuple[str, bool]] = {"/": ("/", True)}
        self.dir_info: dict[str, FileInfo] = {}
        """Metadata of the image's directories met while resolving, by real path."""

    async def stat(self, path: str) -> FileInfo | None:
        if path not in self._stats:
            info = await self._stat_fn(path)
            self._stats[path] = info
            if info is not None and info.type == "dir":
                self.dir_info[path] = info
        return self._stats[path]

    async def real_dir(self, path: str, hops: int = 0) -> tuple[str, bool]:
        """The real (symlink-free) path of the directory ``path`` names in the image, and
        whether it exists there. Raises ``InvalidRequest`` if a component is a file or
        symlinks loop."""
        path = _norm(path)
        got = self._dirs.get(path)
        if got is not None:
            return got
        parent, exists = await self.real_dir(posixpath.dirname(path), hops)
        candidate = posixpath.join(parent, posixpath.basename(path))
        if not exists:
            result = (candidate, False)
        else:
            info = await self.stat(candidate)
            if info is None:
                result = (candidate, False)
            elif info.type == "dir":
                result = (candidate, True)
            elif info.type == "symlink" and info.target is not None:
                if hops >= _MAX_SYMLINK_HOPS:
                    raise InvalidRequest(f"too many symlinks resolving {path} in the image")
                target = info.target
                base = "/" if target.startswith("/") else parent
                result = await self.real_dir(posixpath.join(base, target), hops + 1)
            else:
                raise InvalidRequest(f"{candidate} is not a directory in the image", path=candidate)
        self._dirs[path] = result
        return result


def _norm(path: str) -> str:
    p = posixpath.normpath("/" + path.lstrip("/"))
    return "/" + p.lstrip("/")


@dataclass(frozen=True)
class SourceEntry:
    """One thing to copy: ``rel`` is its path below the destination (``""``: the
    destination itself, for a copied directory). ``data`` reads a file's bytes."""

    rel: str
    type: str  # file | dir | symlink
    mode: int
    mtime: float
    uid: int = 0
    gid: int = 0
    linkname: str = ""
    data: Callable[[], bytes] | None = None


def context_entries(ctx: BuildContext, path: str) -> tuple[str, list[SourceEntry]]:
    """The entries a copy of context ``path`` brings, and whether the source is a ``dir``
    or a ``file``/``symlink`` (a source symlink is followed inside the context)."""
    entry = ctx.resolve(path) if path else ctx.entries.get("")
    if entry is None:
        raise InvalidRequest(f"{path!r} is not in the build context")

    def reader(e: ContextEntry) -> Callable[[], bytes]:
        return lambda: ctx.read(e)

    if entry.type != "dir":
        name = posixpath.basename(path) or posixpath.basename(entry.path)
        return entry.type, [
            SourceEntry(
                name,
                entry.type,
                entry.mode,
                entry.mtime,
                linkname=entry.linkname,
                data=reader(entry) if entry.type == "file" else None,
            )
        ]
    out = []
    for e in ctx.walk(entry.path):
        rel = posixpath.relpath(e.path, entry.path) if entry.path else e.path
        rel = "" if rel == "." else rel
        out.append(
            SourceEntry(
                rel,
                e.type,
                e.mode,
                e.mtime,
                linkname=e.linkname,
                data=reader(e) if e.type == "file" else None,
            )
        )
    return "dir", out


def tree_entries(root: Path) -> list[SourceEntry]:
    """The entries of an unpacked directory (an ``ADD`` archive), with its owners."""
    paths = [root]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        paths.extend(Path(dirpath) / n for n in [*dirnames, *sorted(filenames)])
    out = []
    for full in paths:
        st = full.lstat()
        rel = "" if full == root else full.relative_to(root).as_posix()
        if stat.S_ISDIR(st.st_mode):
            kind, link = "dir", ""
        elif stat.S_ISLNK(st.st_mode):
            kind, link = "symlink", os.readlink(full)
        elif stat.S_ISREG(st.st_mode):
            kind, link = "file", ""
        else:
            continue
        data = _file_reader(full) if kind == "file" else None
        out.append(
            SourceEntry(
                rel, kind, stat.S_IMODE(st.st_mode), st.st_mtime, st.st_uid, st.st_gid, link, data
            )
        )
    return out


def _file_reader(path: Path) -> Callable[[], bytes]:
    return path.read_bytes


def is_archive(data: bytes) -> bool:
    """Whether ``data`` is a tar archive (plain, gzip, bzip2 or xz), as ``ADD`` unpacks."""
    if len(data) >= 262 and data[257:262] == b"ustar":
        return True
    if data[:2] == b"\x1f\x8b" or data[:3] == b"BZh" or data[:6] == b"\xfd7zXZ\x00":
        import io

        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tf:
                tf.next()
            return True
        except (tarfile.TarError, EOFError, OSError):
            return False
    return False


# --- ownership and modes -------------------------------------------------------------------


def _ids(text: str) -> dict[str, int]:
    """``name -> the third field`` of passwd or group text (uid or gid)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[0] and not line.startswith("#"):
            try:
                out.setdefault(parts[0], int(parts[2]))
            except ValueError:
                continue
    return out


def lookup_ids(spec: str, passwd: str | None, group: str | None) -> tuple[int, int]:
    """``user[:group]`` (names or numbers) as ``(uid, gid)``, names looked up in the
    image's ``/etc/passwd`` / ``/etc/group`` text. A user without a group gives its uid as
    the gid too (Docker's rule). Raises ``InvalidRequest`` for an unknown name."""
    user, _, grp = spec.partition(":")
    if user.isdigit():
        uid = int(user)
    else:
        users = _ids(passwd or "")
        if user not in users:
            raise InvalidRequest(f"no user {user!r} in the image's /etc/passwd", user=user)
        uid = users[user]
    if not grp:
        return uid, uid
    if grp.isdigit():
        return uid, int(grp)
    groups = _ids(group or "")
    if grp not in groups:
        raise InvalidRequest(f"no group {grp!r} in the image's /etc/group", group=grp)
    return uid, groups[grp]


_WHO = {"u": 0o4700, "g": 0o2070, "o": 0o1007}


def apply_chmod(spec: str, mode: int, is_dir: bool) -> int:
    """``mode`` after ``chmod SPEC`` (octal, or symbolic clauses like ``u+x,go-w``)."""
    if spec.isdigit():
        return int(spec, 8) & 0o7777
    for clause in spec.split(","):
        i = 0
        who = ""
        while i < len(clause) and clause[i] in "ugoa":
            who += clause[i]
            i += 1
        if not who or "a" in who:
            who = "ugo"
        op, perms = clause[i], clause[i + 1 :]
        mask = 0
        for w in who:
            bits = _WHO[w]
            for p in perms:
                if p == "r":
                    mask |= bits & 0o444
                elif p == "w":
                    mask |= bits & 0o222
                elif p == "x" or (p == "X" and (is_dir or mode & 0o111)):
                    mask |= bits & 0o111
                elif p == "s" and w in "ug":
                    mask |= bits & 0o6000
                elif p == "t" and w == "o":
                    mask |= 0o1000
        if op == "+":
            mode |= mask
        elif op == "-":
            mode &= ~mask
        else:
            clear = 0
            for w in who:
                clear |= _WHO[w] & (0o7777 if w != "o" else 0o1007)
            mode = (mode & ~clear) | mask
    return mode & 0o7777


# --- the tree ------------------------------------------------------------------------------


@dataclass
class _Node:
    type: str
    mode: int
    uid: int
    gid: int
    mtime: float
    linkname: str = ""
    data: Callable[[], bytes] | None = None


@dataclass
class LayerTree:
    """What a copy layer holds, by absolute path in the image (``/`` is the root).

    Invariant (kept by :meth:`set`): every ancestor of a node is a directory node, so
    writing the tree never passes through a symlink it wrote itself (a symlink in the
    tree could point anywhere on this host)."""

    nodes: dict[str, _Node] = field(default_factory=dict)

    def set(self, path: str, node: _Node) -> None:
        """Put ``node`` at ``path``; the later entry wins: a non-directory replaces what was
        below ``path``, and a non-directory ancestor of ``path`` becomes a directory."""
        if node.type != "dir":
            prefix = path.rstrip("/") + "/"
            for p in [p for p in self.nodes if p.startswith(prefix)]:
                del self.nodes[p]
        parent = posixpath.dirname(path)
        while path != "/" and parent:
            above = self.nodes.get(parent)
            if above is not None and above.type != "dir":
                self.nodes[parent] = _Node("dir", 0o755, above.uid, above.gid, above.mtime)
            if parent == "/":
                break
            parent = posixpath.dirname(parent)
        self.nodes[path] = node

    def write(self, root: Path) -> None:
        """Materialise the tree under ``root`` (owners need root; mtimes and modes set
        after children are written). Refuses to write through a symlink."""
        root.mkdir(parents=True, exist_ok=True)
        real_root = os.path.realpath(root)
        dirs: list[tuple[Path, _Node]] = []
        for path in sorted(self.nodes, key=lambda p: (p.count("/"), p)):
            node = self.nodes[path]
            target = root if path == "/" else root / path.lstrip("/")
            parent_real = os.path.realpath(target.parent) if path != "/" else real_root
            expected = os.path.normpath(
                os.path.join(real_root, posixpath.dirname(path).lstrip("/"))
            )
            if path != "/" and parent_real != expected:
                raise InvalidRequest(f"copy layer: {path} would be written through a symlink")
            if node.type == "dir":
                if target.is_symlink() or (target.exists() and not target.is_dir()):
                    target.unlink()
                target.mkdir(exist_ok=True)
                dirs.append((target, node))
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            if node.type == "symlink":
                os.symlink(node.linkname, target)
            else:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(node.data() if node.data is not None else b"")
            _set_meta(target, node)
        for target, node in sorted(dirs, key=lambda t: len(t[0].parts), reverse=True):
            _set_meta(target, node)

    def __iter__(self) -> Iterator[str]:
        return iter(self.nodes)


def _set_meta(path: Path, node: _Node) -> None:
    link = node.type == "symlink"
    if os.geteuid() == 0:
        os.chown(path, node.uid, node.gid, follow_symlinks=False)
    if not link:
        os.chmod(path, node.mode & 0o7777)
    ns = int(node.mtime * 1_000_000_000)
    os.utime(path, ns=(ns, ns), follow_symlinks=False)


async def place_entries(
    fs: ImageFS,
    tree: LayerTree,
    dest: str,
    entries: list[SourceEntry],
    *,
    into_dir: bool,
    owner: tuple[int, int] | None,
    chmod: str | None,
    keep_owners: bool = False,
    root_dirs: frozenset[str] = frozenset(),
) -> None:
    """Add one source's ``entries`` to ``tree`` at ``dest`` (absolute; ``into_dir``: it is
    a directory the entries go into, else the single entry *is* ``dest``). Directories the
    copy creates are ``owner``'s (root's without one), mode 0755, except ``root_dirs``
    (real paths), which are root's, as a ``WORKDIR`` creates them."""
    now = time.time()
    created = owner or (0, 0)

    async def ensure_parents(real_dir: str) -> None:
        """The tree's ancestors of ``real_dir`` (itself included), with image metadata
        where the image has them."""
        chain = []
        p = real_dir
        while True:
            chain.append(p)
            if p == "/":
                break
            p = posixpath.dirname(p)
        for d in reversed(chain):
            existing = tree.nodes.get(d)
            if existing is not None and existing.type == "dir":
                continue
            info = fs.dir_info.get(d)
            if info is None and d == "/":
                info = await fs.stat("/")
            if info is not None:
                tree.set(d, _Node("dir", info.mode, info.uid, info.gid, info.mtime))
            elif d in root_dirs:
                tree.set(d, _Node("dir", 0o755, 0, 0, now))
            else:
                tree.set(d, _Node("dir", 0o755, created[0], created[1], now))

    def meta(e: SourceEntry) -> tuple[int, int, int]:
        mode = (
            apply_chmod(chmod, e.mode, e.type == "dir") if chmod and e.type != "symlink" else e.mode
        )
        if owner is not None:
            return mode, owner[0], owner[1]
        if keep_owners:
            return mode, e.uid, e.gid
        return mode, 0, 0

    dest = _norm(dest)
    for e in entries:
        if into_dir:
            image_path = dest if not e.rel else posixpath.join(dest, e.rel)
        else:
            image_path = dest
        if e.type == "dir":
            real, exists = await fs.real_dir(image_path)
            if exists or real in root_dirs:  # it keeps the image's (or WORKDIR's) metadata
                await ensure_parents(real)
                continue
            await ensure_parents(posixpath.dirname(real))
            mode, uid, gid = meta(e)
            tree.set(real, _Node("dir", mode, uid, gid, e.mtime))
            continue
        parent, _ = await fs.real_dir(posixpath.dirname(image_path))
        await ensure_parents(parent)
        name = posixpath.basename(image_path)
        if not name:
            raise InvalidRequest(f"cannot copy a file onto {image_path}")
        real = posixpath.join(parent, name)
        mode, uid, gid = meta(e)
        tree.set(real, _Node(e.type, mode, uid, gid, e.mtime, e.linkname, e.data))
