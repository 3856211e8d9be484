"""``pack_diff``: turn a sandbox's overlay upper directory into a new workspace layer.

A sandbox's root filesystem is ``overlay(lowers = its image's layers, upper = a private
tmpfs dir)``. The upper holds exactly what the sandbox changed: new and modified files,
**whiteouts** (0:0 character devices) for deleted ones and **opaque** directories
(``trusted.overlay.opaque=y``) for directories deleted and re-created. ``mkfs.erofs`` keeps
both as they are (checked: device numbers and ``trusted.*`` xattrs survive), and overlayfs
honours whiteouts and opaque markers in *lower* layers as well, so::

    overlay(lowers = [*image_layers, packed_upper], upper = fresh tmpfs)

shows the same tree as the sandbox did. That is the whole restore path: ``Sandbox.create(image,
layers=[snapshot_digest])``. The new layer is content-addressed like any other (its digest is
the sha256 of the EROFS file), of kind ``workspace``.

Scrubbing: paths matching a scrub pattern are left out of the layer (``mkfs.erofs
--exclude-regex``; no copy of the upper is made), so they show whatever the lower layers
have — a file the sandbox created disappears, a file it modified reverts, a file it deleted
comes back. Patterns are absolute sandbox paths; ``*`` and ``?`` match within one path
component, ``**`` across components; a pattern also covers everything below what it matches
(``/tmp/*`` empties ``/tmp`` but keeps the directory). :data:`DEFAULT_SCRUB` (shell and REPL
histories, pip/npm/apt caches and lists, ``/tmp``, ``/var/tmp``, dsec's own helper files) applies
unless ``default_scrub=False``.

Secrets (a snapshot never carries the builder's credentials), three mechanisms:

1. dsec passes credentials as **environment variables** (sandbox or exec ``env``); those live
   in process memory and in the OCI bundle outside the root filesystem, never in the upper.
2. :data:`DEFAULT_SECRET_PATHS` (``~/.netrc``, ``~/.git-credentials``, ``~/.ssh/id_*``,
   ``~/.docker/config.json``, ``~/.pypirc``, ``~/.npmrc``, ``~/.aws``, ...) plus the caller's
   ``secret_paths`` are *always* scrubbed, whatever ``default_scrub`` says.
3. ``secret_values`` (e.g. the builder's token strings, which the edge knows from the
   sandbox's env): every regular file and symlink target that would enter the layer is scanned
   for them; a hit raises :class:`SecretInSnapshot` naming the paths (never the value) and no
   layer is created. Scanning reads the diff once (~10 ms per 100 MB from tmpfs).

Consistency: the caller freezes the sandbox while packing (``pause(cg, reclaim=False)`` then
``resume``), so no file changes under ``mkfs.erofs``. Failure leaves no partial layer: the image
is built in the store's scratch dir and only :meth:`LayerStore.import_layer_file` publishes it.

Limits (checked while walking the diff, before anything is read or written):

- **Apparent size.** A sparse file costs the sandbox nothing (``truncate -s 1T`` allocates no
  tmpfs pages) but ``mkfs.erofs`` reads every hole and an uncompressed image stores it as
  zeros. The total apparent size of the regular files that would be packed (each inode
  once) must not exceed ``max_bytes`` (default: the size of the filesystem holding the
  upper, i.e. the sandbox's ``disk_mb`` for its tmpfs upper), else :class:`QuotaExceeded`.
- **Holes stay small.** When the diff holds sparse files (>= 1 MiB of holes) and
  ``compress`` is None, the image is made chunk-based (``mkfs.erofs --chunksize``, 64 KiB
  chunks, supported by erofs-utils 1.5 and every kernel since 5.15): identical chunks are
  stored once, so all-zero chunks cost one chunk plus a 4-byte index entry each (a 300 MB
  sparse file packs to ~0.1 MB; mkfs still reads the holes, ~7 s per GB here). erofs-utils
  1.5 cannot record holes as such. With ``lz4`` zeros compress (~5 MB per GB, ~0.3 s per GB).
- **Depth and path length.** ``mkfs.erofs`` 1.5 recurses once per directory level (about
  4 KiB of stack each: it crashes near 1,930 levels under an 8 MiB stack) and builds host
  paths of at most ``PATH_MAX``. Directories nested deeper than :data:`MAX_PACK_DEPTH`
  levels, or a host path of 4,096 bytes or more, are refused with :class:`InvalidRequest`
  (scrub or remove them, e.g. with the files API's recursive remove). mkfs.erofs walks
  scrubbed directories too (it only leaves them out), so the limits apply there as well.

Stacked uppers: a sandbox made by a shared fork stacks on *frozen uppers* (its parent's
former writable layers, see :class:`dsec.contract.runtime.UpperForkable`). Its snapshot is still
one layer: :func:`merge_uppers` writes the frozen uppers and its own, bottom first, into one
upper directory of the same meaning (a copy: what a snapshot costs besides the pack), which
``pack_diff`` then packs.

Not supported (typed errors): ``metacopy`` uppers (their files hold no data; dsec does not
mount with ``metacopy=on``). ``redirect`` xattrs (``redirect_dir=on``) are kept and work when
the layer sits on the same lowers (``redirect_always_follow``). ``trusted.overlay.origin`` /
``impure`` xattrs are kept: overlayfs ignores them in lower layers.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from dsec.errors import (
    InvalidRequest,
    QuotaExceeded,
    SandboxError,
    SecretInSnapshot,
    Unsupported,
)
from dsec.layers.erofs import PCLUSTER_BYTES, normalize_superblock
from dsec.models import LayerInfo, LayerKind

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_SCRUB",
    "DEFAULT_SECRET_PATHS",
    "MAX_PACK_DEPTH",
    "DiffStats",
    "LayerImporter",
    "SecretInSnapshot",
    "merge_uppers",
    "pack_diff",
    "scrub_regex",
]

_HOMES = ("/root", "/home/*")

DEFAULT_SCRUB: tuple[str, ...] = (
    *(
        f"{h}/{f}"
        for h in _HOMES
        for f in (
            ".bash_history",
            ".ash_history",
            ".sh_history",
            ".zsh_history",
            ".history",
            ".python_history",
            ".node_repl_history",
            ".psql_history",
            ".mysql_history",
            ".sqlite_history",
            ".lesshst",
            ".viminfo",
            ".wget-hsts",
            ".cache/pip",
            ".cache/uv",
            ".npm/_cacache",
            ".npm/_logs",
        )
    ),
    "/var/cache/apt/archives/*.deb",
    "/var/cache/apt/archives/partial/*",
    "/var/cache/apt/*.bin",
    "/var/lib/apt/lists/*",
    "/var/log/apt/*",
    "/var/log/dpkg.log",
    "/tmp/*",
    "/var/tmp/*",
    "/.dsec",
    "/run/dsec",
    "/dev/.dsec-*",
)
"""Build leftovers left out of every snapshot unless ``default_scrub=False``."""

DEFAULT_SECRET_PATHS: tuple[str, ...] = tuple(
    f"{h}/{f}"
    for h in _HOMES
    for f in (
        ".netrc",
        ".git-credentials",
        ".ssh/id_*",
        ".docker/config.json",
        ".pypirc",
        ".npmrc",
        ".aws",
        ".config/gh/hosts.yml",
        ".kube/config",
    )
)
"""Credential files never packed, whatever the caller asks."""

_ERE_SPECIAL = set(".[]()*+?{}|^$\\")
_MKFS_TIMEOUT_S = 3600.0
_SCAN_CHUNK = 1 << 20

MAX_PACK_DEPTH = 1000
"""Deepest directory nesting (levels below the upper) ``pack_diff`` packs: half of where
``mkfs.erofs`` 1.5 overflows an 8 MiB stack (~1,930 levels, measured)."""
_PATH_MAX = 4096
"""Linux ``PATH_MAX`` (bytes, with the NUL): mkfs.erofs opens every entry by its host path."""
CHUNK_BYTES = 1 << 16
"""Chunk size of chunk-based images (made for uncompressed diffs with sparse files), bytes."""
_SPARSE_MIN_HOLE_BYTES = 1 << 20
"""Holes (apparent size minus allocated bytes) from which a diff is packed chunk-based."""


class LayerImporter(Protocol):
    """What ``pack_diff`` needs of :class:`dsec.layers.store.LayerStore`."""

    scratch: Path

    def import_layer_file(
        self,
        erofs_file: Path,
        kind: LayerKind,
        *,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> LayerInfo: ...


@dataclass
class DiffStats:
    """What went into a packed layer (excluding scrubbed paths). Sizes in bytes."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    bytes: int = 0
    hole_bytes: int = 0
    chunked: bool = False
    scrubbed: int = 0
    scan_ms: float = 0.0
    mkfs_ms: float = 0.0
    import_ms: float = 0.0
    total_ms: float = 0.0


def _glob_to_ere(pattern: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c in _ERE_SPECIAL:
            out.append("\\" + c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def scrub_regex(pattern: str) -> str:
    """The regular expression (POSIX ERE, also valid for Python ``re``) matching a scrub
    pattern's paths *relative to the layer root* (no leading ``/``), and everything below.

    Raises:
        InvalidRequest: not an absolute path, ``/`` itself, or contains ``..``, NUL or newline.
    """
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise InvalidRequest(f"scrub path {pattern!r} must be absolute", path=pattern)
    if any(c in pattern for c in "\0\n\r"):
        raise InvalidRequest(f"scrub path {pattern!r} contains a control character")
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    if not parts:
        raise InvalidRequest("scrubbing / would drop the whole snapshot", path=pattern)
    if ".." in parts:
        raise InvalidRequest(f"scrub path {pattern!r} contains '..'", path=pattern)
    return "^" + _glob_to_ere("/".join(parts)) + "(/.*)?$"


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _has_xattr(path: str, name: str) -> bool:
    try:
        os.getxattr(path, name, follow_symlinks=False)
        return True
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise


def _file_contains(path: str, needles: Sequence[bytes]) -> bool:
    if not needles:
        return False
    overlap = max(len(n) for n in needles) - 1
    tail = b""
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_SCAN_CHUNK):
            window = tail + chunk
            if any(n in window for n in needles):
                return True
            tail = window[-overlap:] if overlap > 0 else b""
    return False


def _short(rel: str, keep: int = 120) -> str:
    """``/rel``, cut in the middle when longer than ``keep`` characters (for messages)."""
    path = f"/{rel}"
    return path if len(path) <= keep else f"{path[: keep // 2]}...{path[-keep // 2 :]}"


def _check_pack_depth(rel: str, depth: int, verb: str, fix: str) -> None:
    """``InvalidRequest`` if directory ``rel`` sits ``depth`` levels down, past
    ``MAX_PACK_DEPTH`` (mkfs.erofs itself crashes on much deeper trees)."""
    if depth > MAX_PACK_DEPTH:
        raise InvalidRequest(
            f"{_short(rel)} is nested more than {MAX_PACK_DEPTH} directories "
            f"deep, more than a snapshot can {verb}; {fix}",
            path=_short(rel),
            limit=MAX_PACK_DEPTH,
        )


def _walk(
    upper: Path,
    excluded: re.Pattern[str],
    needles: Sequence[bytes],
    stats: DiffStats,
    max_bytes: int,
) -> list[str]:
    """Walk the upper (minus excluded paths); count, enforce the limits (apparent size,
    depth, path length) before reading any file, reject metacopy, find secret values."""
    hits: list[str] = []
    # (relative dir, its depth, scrubbed?): mkfs.erofs 1.5 walks scrubbed directories too
    # (it only leaves them out of the image), so they are walked for the limits alone
    stack: list[tuple[str, int, bool]] = [("", 0, False)]
    root = os.path.abspath(upper)
    root_len = len(os.fsencode(root))
    seen_inodes: set[int] = set()
    while stack:
        rel_dir, depth, in_scrubbed = stack.pop()
        abs_dir = os.path.join(root, rel_dir) if rel_dir else root
        with os.scandir(abs_dir) as it:
            for entry in it:
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                scrubbed = in_scrubbed or excluded.match(rel) is not None
                if scrubbed and not in_scrubbed:
                    stats.scrubbed += 1
                fix = "remove that tree" if scrubbed else "remove or scrub that tree"
                if root_len + 1 + len(os.fsencode(rel)) >= _PATH_MAX:
                    raise InvalidRequest(
                        f"{_short(rel)} is too deep to snapshot: its path on the node passes "
                        f"PATH_MAX ({_PATH_MAX} bytes); {fix}",
                        path=_short(rel),
                        limit=_PATH_MAX,
                    )
                if scrubbed:
                    if entry.is_dir(follow_symlinks=False):
                        _check_pack_depth(rel, depth + 1, "walk", fix)
                        stack.append((rel, depth + 1, True))
                    continue
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    _check_pack_depth(rel, depth + 1, "hold", fix)
                    stats.dirs += 1
                    if _has_xattr(entry.path, "trusted.overlay.opaque"):
                        stats.opaque_dirs += 1
                    stack.append((rel, depth + 1, False))
                elif stat.S_ISREG(st.st_mode):
                    stats.files += 1
                    if st.st_nlink > 1:
                        if st.st_ino in seen_inodes:
                            continue  # a hard link to a file already counted and scanned
                        seen_inodes.add(st.st_ino)
                    stats.bytes += st.st_size
                    stats.hole_bytes += max(0, st.st_size - st.st_blocks * 512)
                    if stats.bytes > max_bytes:
                        raise QuotaExceeded(
                            f"the snapshot would hold {stats.bytes} bytes or more of files "
                            f"(apparent size, holes of sparse files included; e.g. "
                            f"{_short(rel)} is {st.st_size} bytes), more than the limit of "
                            f"{max_bytes} bytes; remove, shrink or scrub large sparse files",
                            path=_short(rel),
                            size=stats.bytes,
                            limit=max_bytes,
                        )
                    if _has_xattr(entry.path, "trusted.overlay.metacopy"):
                        raise Unsupported(
                            f"/{rel} is an overlay metacopy file (no data in the upper); "
                            "pack_diff needs uppers made without metacopy=on",
                            path=f"/{rel}",
                        )
                    if _file_contains(entry.path, needles):
                        hits.append(f"/{rel}")
                elif stat.S_ISLNK(st.st_mode):
                    stats.symlinks += 1
                    target = os.fsencode(os.readlink(entry.path))
                    if any(n in target for n in needles):
                        hits.append(f"/{rel}")
                elif _is_whiteout(st):
                    stats.whiteouts += 1
    return hits


def _mkfs(
    upper: Path, dest: Path, regexes: Sequence[str], compress: str | None, chunked: bool = False
) -> None:
    mkfs = shutil.which("mkfs.erofs")
    if mkfs is None:
        raise SandboxError("mkfs.erofs not found: install the erofs-utils package")
    # the same flags as dsec.layers.erofs.mkfs_erofs (reproducible images), plus exclusions
    argv = [mkfs, "--quiet", "-Eforce-inode-extended"]
    if compress is not None:
        argv += [f"-z{compress}", f"-C{PCLUSTER_BYTES}"]
    elif chunked:
        argv += [f"--chunksize={CHUNK_BYTES}"]
    argv += [f"--exclude-regex={r}" for r in regexes]
    argv += [os.fspath(dest), os.path.abspath(upper)]
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    env["LC_ALL"] = "C"
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, env=env,
            timeout=_MKFS_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"mkfs.erofs timed out after {_MKFS_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).decode(errors="replace").strip()
        raise SandboxError(
            f"mkfs.erofs failed (exit {proc.returncode}): {err}",
            exit_code=proc.returncode,
            stderr=err,
        )
    normalize_superblock(dest)


def pack_diff(
    upper: Path,
    store: LayerImporter,
    *,
    name: str | None = None,
    scrub: Sequence[str] = (),
    meta: Mapping[str, Any] | None = None,
    default_scrub: bool = True,
    secret_paths: Sequence[str] = (),
    secret_values: Sequence[str | bytes] = (),
    compress: str | None = "lz4",
    max_bytes: int | None = None,
) -> LayerInfo:
    """Pack an overlay upper directory into a new content-addressed ``workspace`` layer.

    Args:
        upper: the overlay upperdir (``dsec.layers.rootfs.upper_dir(sandbox_dir)``).
        store: the node's layer store (only ``scratch`` and ``import_layer_file`` are used).
        name: the layer's human name (optional).
        scrub: extra paths/globs to leave out (see the module docstring).
        meta: stored with the layer (e.g. ``{"parents": [...], "sandbox_id": ...}``); a
            ``pack_diff`` entry with :class:`DiffStats` and the scrub list is added.
        default_scrub: also apply :data:`DEFAULT_SCRUB`.
        secret_paths: extra credential paths always left out (with
            :data:`DEFAULT_SECRET_PATHS`).
        secret_values: strings whose presence in any packed file refuses the snapshot.
        compress: ``"lz4"`` (default) or ``None``.
        max_bytes: the most bytes of files (apparent sizes, sparse holes included) the
            layer may hold: pass the sandbox's ``disk_mb * 2**20``. None: the size of the
            filesystem holding ``upper`` (for a tmpfs upper, its ``size=``, i.e. disk_mb).

    Returns:
        The new layer (an existing one if the identical content was packed before).

    Raises:
        InvalidRequest: ``upper`` is not a directory; a bad scrub pattern; an empty secret;
            a directory nested deeper than :data:`MAX_PACK_DEPTH` or a path too long.
        QuotaExceeded: the files' apparent size passes ``max_bytes``; nothing stored.
        SecretInSnapshot: a secret value was found (``details["paths"]``); nothing stored.
        Unsupported: the upper has metacopy files.
        SandboxError: mkfs.erofs failed; nothing stored.
    """
    t0 = time.perf_counter()
    upper = Path(upper)
    if not upper.is_dir():
        raise InvalidRequest(f"upper directory {upper} does not exist", path=str(upper))
    patterns = [*(DEFAULT_SCRUB if default_scrub else ()), *scrub]
    patterns += [*DEFAULT_SECRET_PATHS, *secret_paths]
    regexes = list(dict.fromkeys(scrub_regex(p) for p in patterns))
    excluded = re.compile("|".join(f"(?:{r})" for r in regexes))
    needles = [v.encode() if isinstance(v, str) else bytes(v) for v in secret_values]
    if any(len(n) < 4 for n in needles):
        raise InvalidRequest("secret values must be at least 4 bytes (shorter ones match noise)")
    if max_bytes is None:
        vfs = os.statvfs(upper)
        max_bytes = vfs.f_blocks * vfs.f_frsize
    stats = DiffStats()
    hits = _walk(upper, excluded, needles, stats, max_bytes)
    stats.chunked = compress is None and stats.hole_bytes >= _SPARSE_MIN_HOLE_BYTES
    stats.scan_ms = round((time.perf_counter() - t0) * 1000, 1)
    if hits:
        raise SecretInSnapshot(
            f"{len(hits)} file(s) in the snapshot contain a secret value of the builder "
            f"(first: {hits[0]}); scrub them or remove the secret, then snapshot again",
            paths=hits[:100],
        )
    store.scratch.mkdir(parents=True, exist_ok=True)
    tmp = store.scratch / f"pack-{secrets.token_hex(8)}.erofs"
    try:
        t1 = time.perf_counter()
        _mkfs(upper, tmp, regexes, compress, stats.chunked)
        stats.mkfs_ms = round((time.perf_counter() - t1) * 1000, 1)
        t2 = time.perf_counter()
        full_meta = dict(meta or {})
        full_meta["pack_diff"] = {
            "default_scrub": default_scrub,
            "scrub": list(scrub),
            "secret_paths": list(secret_paths),
            "secret_values_checked": len(needles),
            **asdict(stats),
        }
        info = store.import_layer_file(tmp, "workspace", name=name, meta=full_meta)
        stats.import_ms = round((time.perf_counter() - t2) * 1000, 1)
    finally:
        tmp.unlink(missing_ok=True)
    stats.total_ms = round((time.perf_counter() - t0) * 1000, 1)
    info.meta.setdefault("pack_diff", {}).update(
        {"mkfs_ms": stats.mkfs_ms, "import_ms": stats.import_ms, "total_ms": stats.total_ms}
    )
    return info


def merge_uppers(uppers: Sequence[Path], dest: Path) -> None:
    """Write into ``dest`` (which must not exist) one overlay upper directory that means what
    ``uppers`` (overlay upper directories, **bottom first**) mean stacked: the bottom one is
    copied, then each next one applied as overlayfs would read it above the others. An
    entry of the upper one replaces what is below (a whiteout stays a whiteout: it must hide
    the image's file too); a directory that is not opaque in both is merged, the upper's
    owner, mode and xattrs on it; an opaque directory replaces what is below. Copies keep
    owners, modes, times, xattrs (``trusted.overlay.*`` included) and device nodes (``cp
    -a``). The uppers must not change meanwhile (their sandboxes are frozen).

    Raises:
        SandboxError: a copy failed (``dest`` is removed).
    """
    if not uppers:
        raise InvalidRequest("nothing to merge")
    dest = Path(dest)
    try:
        _cp(["--no-target-directory", str(uppers[0]), str(dest)])
        for upper in uppers[1:]:
            _apply_upper(str(upper), str(dest))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _cp(args: list[str]) -> None:
    proc = subprocess.run(
        ["cp", "-a", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SandboxError(f"merging writable layers failed: {proc.stderr.strip()[-500:]}")


def _apply_upper(src: str, dst: str) -> None:
    """Apply upper directory ``src`` onto merged directory ``dst`` (see :func:`merge_uppers`)."""
    replace: list[str] = []
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        st = entry.stat(follow_symlinks=False)
        merge = (
            stat.S_ISDIR(st.st_mode)
            and not _has_xattr(entry.path, "trusted.overlay.opaque")
            and os.path.isdir(target)
            and not os.path.islink(target)
        )
        if merge:
            _apply_upper(entry.path, target)
            os.chown(target, st.st_uid, st.st_gid, follow_symlinks=False)
            shutil.copystat(entry.path, target, follow_symlinks=False)  # mode, times, xattrs
            continue
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.unlink(target)
        replace.append(entry.path)
    if replace:  # one cp per directory, not per entry
        _cp(["--target-directory", dst, "--", *replace])
