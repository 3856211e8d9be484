"""The node's content store: layer files by digest, their build slots, and remote layers.

This half of the layer store knows bytes, not names: it holds each layer once, under the
sha256 of its bytes, whoever made it and whatever images name it. Which images exist, who
owns them and who may use a layer is the image catalogue's (:mod:`dsec.layers.catalogue`),
which builds on this store; nothing here imports it. :class:`dsec.layers.store.LayerStore`
is the two together.

Glossary:
    layer: one read-only EROFS image file, named by the sha256 of its bytes
        (``sha256:<64 hex>``), with a kind (``base``, ``workspace``, ``toolkit``), an
        optional human name and free-form metadata (table ``layers``).
    remote layer: a layer whose bytes live in a blob store (``oci://``, ``file://``,
        ``http://``; table ``remote_layers``): mounted through the lazy FUSE server, which
        fetches chunks on first read, until :meth:`ContentStore.fetch_layer` downloads it.
    build slot: a build id with its lock held (:meth:`ContentStore.build_slot`); the
        build's files are ``tmp/<id>.erofs`` and ``scratch/layer-<id>/``, removed when the
        slot closes and, after a crash, when the store is next opened.

Layout on disk (``root`` is ``$DSEC_HOME/layers``, ``scratch`` is ``$DSEC_HOME/images``)::

    root/
      layers.db                    SQLite (WAL): tables ``layers`` and ``remote_layers``
                                   (the catalogue keeps ``images`` and ``layer_grants`` there)
      blobs/sha256/<hex>.erofs     the layers, mode 0444, never modified once published
      tmp/<build>.lock             held (flock) by a running build
      tmp/<build>.erofs            a layer being built or imported
      lazy/                        the lazy FUSE server's mount, socket and chunk cache
      .lock                        flock serialising publication and start-up repair
    scratch/
      layer-<build>/               a tarball extracted for a build, a built-in rootfs

A layer is built into ``tmp/``, fsynced, hashed and only then renamed into ``blobs/``
(same filesystem, so the rename is atomic): a half-built layer is never visible under a
digest. Building the same content twice gives the same digest and one file. Leftovers of a
crashed build (a ``tmp/`` entry whose lock nobody holds, a ``scratch/layer-*`` dir without a
live lock, a blob without a row) are removed when the store is opened.

Example::

    content = ContentStore(paths.layers, paths.scratch)
    info = content.build_layer(Path("./app"), "workspace", name="app")
    content.layer_path(info.digest)     # blobs/sha256/<hex>.erofs, to mount
    with content.build_slot() as build_id:
        work = content.scratch / f"layer-{build_id}"   # gone when the slot closes
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

from dsec.errors import InvalidRequest, LayerNotFound, SandboxError
from dsec.layers.blobstore import open_blob_store
from dsec.layers.erofs import is_erofs_file, mkfs_erofs
from dsec.layers.lazy import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_READAHEAD_CHUNKS,
    LazyServer,
)
from dsec.layers.tarball import extract_tarball
from dsec.models import LayerInfo, LayerKind
from dsec.privileged.mount import mount_points, umount_quiet

__all__ = ["DIGEST_RE", "ContentStore", "parse_digest"]

log = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_LAYER_KINDS: tuple[str, ...] = get_args(LayerKind)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS layers (
    digest     TEXT PRIMARY KEY,
    kind       TEXT NOT NULL,
    name       TEXT,
    size       INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    meta       TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS remote_layers (
    digest     TEXT PRIMARY KEY,
    source_url TEXT NOT NULL,
    size       INTEGER NOT NULL
);
"""


def parse_digest(ref: str) -> str:
    """The 64-hex part of ``sha256:<hex>``. Raises InvalidRequest for anything else."""
    m = DIGEST_RE.match(ref)
    if m is None:
        raise InvalidRequest(f"invalid layer digest {ref!r}: expected sha256:<64 hex>", ref=ref)
    return m.group(1)


def _now() -> datetime:
    return datetime.now(UTC)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rmtree_no_mounts(path: Path) -> None:
    """Remove a scratch tree, unmounting anything left mounted inside it first."""
    if not os.path.lexists(path):
        return
    for _ in range(64):
        mps = mount_points(path)
        if not mps:
            break
        umount_quiet(max(mps, key=lambda p: len(p.parts)))
    else:
        raise SandboxError(f"cannot unmount everything under {path}", path=str(path))
    shutil.rmtree(path, ignore_errors=True)


# --- the store -------------------------------------------------------------------------


class ContentStore:
    """Content-addressed EROFS layers (``blobs/sha256/<hex>.erofs``), their metadata in
    SQLite (``layers.db``, tables ``layers`` and ``remote_layers``), build slots, and remote
    layers served by the lazy FUSE server. No names of images, no owners: see
    :class:`dsec.layers.catalogue.ImageCatalogue`.

    Thread-safe: one SQLite connection (``check_same_thread=False``, WAL) behind a lock; the
    slow parts of a build (extraction, mkfs, hashing) run outside the lock, so builds in
    several threads proceed in parallel. Safe to open the same root from several processes
    (publication and start-up repair take an ``flock``, :meth:`exclusive`).

    Args:
        root: the store directory (``$DSEC_HOME/layers``); created if missing.
        scratch: where tarballs are extracted and built-in rootfs are assembled
            (``$DSEC_HOME/images``); created if missing.
    """

    def __init__(
        self,
        root: Path,
        scratch: Path,
        *,
        lazy_chunk_size: int | None = None,
        lazy_cache_bytes: int | None = None,
    ) -> None:
        self.root = Path(root)
        self._lazy_chunk_size = lazy_chunk_size or int(
            os.environ.get("DSEC_LAZY_CHUNK_SIZE", DEFAULT_CHUNK_SIZE)
        )
        self._lazy_cache_bytes = lazy_cache_bytes or int(
            os.environ.get("DSEC_LAZY_CACHE_BYTES", DEFAULT_CACHE_BYTES)
        )
        self._lazy: LazyServer | None = None
        self.scratch = Path(scratch)
        self._blobs = self.root / "blobs" / "sha256"
        self._tmp = self.root / "tmp"
        for d in (self.root, self._blobs, self._tmp, self.scratch):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._store_lock_fd = os.open(
            self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        self._db = sqlite3.connect(
            self.root / "layers.db", check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        with self.exclusive():
            self._db.executescript(_SCHEMA)
            self._clean_stale_builds()
            self._reconcile_blobs()
        if os.environ.get("DSEC_LAZY_PRESTART") == "1":
            self.prestart_lazy()

    # --- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Stop the lazy FUSE server (if started), close the database and the lock file. The
        store is unusable afterwards. Unmount EROFS mounts of remote layers first."""
        with self._lock:
            if self._lazy is not None:
                self._lazy.stop()
                self._lazy = None
            self._db.close()
            with contextlib.suppress(OSError):
                os.close(self._store_lock_fd)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the store against every other thread and process that opened it (a thread
        lock and an ``flock`` on ``root/.lock``): publication and start-up repair run under
        it, and so does the image catalogue's schema migration. Reentrant in one thread."""
        with self._lock:
            fcntl.flock(self._store_lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._store_lock_fd, fcntl.LOCK_UN)

    def _build_is_live(self, build_id: str) -> bool:
        """True if some process holds ``tmp/<build_id>.lock``."""
        return self._lock_is_held(self._tmp / f"{build_id}.lock")

    @staticmethod
    def _lock_is_held(lock_path: Path) -> bool:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _clean_stale_builds(self) -> None:
        """Remove temp files and scratch dirs of builds that crashed (nobody holds their lock)."""
        removed = 0
        for entry in list(self._tmp.iterdir()):
            if entry.name.startswith("."):  # a lock file not yet renamed into place
                if not self._lock_is_held(entry):
                    entry.unlink(missing_ok=True)
                continue
            build_id = entry.name.split(".", 1)[0]
            if entry.suffix == ".lock" or self._build_is_live(build_id):
                continue
            _rmtree_no_mounts(entry) if entry.is_dir() else entry.unlink(missing_ok=True)
            removed += 1
        for entry in list(self.scratch.glob("layer-*")):
            if not self._build_is_live(entry.name[len("layer-") :]):
                _rmtree_no_mounts(entry)
                removed += 1
        for lock in list(self._tmp.glob("*.lock")):
            if not self._build_is_live(lock.name[: -len(".lock")]):
                lock.unlink(missing_ok=True)
        if removed:
            log.warning("layer store: removed %d leftovers of interrupted builds", removed)

    def _reconcile_blobs(self) -> None:
        """Drop rows whose blob is gone and blobs that never got a row (crash mid-publish)."""
        with self._lock:
            rows = self._db.execute("SELECT digest FROM layers").fetchall()
        known = set()
        with self._lock:
            remote = {r["digest"] for r in self._db.execute("SELECT digest FROM remote_layers")}
        for row in rows:
            hex_ = row["digest"].split(":", 1)[1]
            if (self._blobs / f"{hex_}.erofs").is_file() or row["digest"] in remote:
                known.add(hex_)
            else:
                log.warning(
                    "layer store: blob of %s is missing; forgetting the layer", row["digest"]
                )
                with self._lock:
                    self._db.execute("DELETE FROM layers WHERE digest = ?", (row["digest"],))
        for blob in self._blobs.iterdir():
            hex_ = blob.name.removesuffix(".erofs")
            if hex_ not in known:
                log.warning("layer store: removing unregistered blob %s", blob.name)
                blob.unlink(missing_ok=True)

    @contextlib.contextmanager
    def build_slot(self) -> Iterator[str]:
        """A build id with its lock held, for a build that writes files here: its layer file
        is ``root/tmp/<id>.erofs`` (what :meth:`build_layer` makes) and its scratch files go
        under ``scratch/layer-<id>/``. Both are removed when the slot closes, and by the next
        open of the store after a crash (nobody holds the lock then)."""
        build_id = f"{os.getpid()}-{secrets.token_hex(8)}"
        pending = self._tmp / f".{build_id}.lock"
        fd = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(pending, self._tmp / f"{build_id}.lock")
            try:
                yield build_id
            finally:
                (self._tmp / f"{build_id}.erofs").unlink(missing_ok=True)
                _rmtree_no_mounts(self.scratch / f"layer-{build_id}")
                (self._tmp / f"{build_id}.lock").unlink(missing_ok=True)
        finally:
            os.close(fd)

    # --- layers --------------------------------------------------------------------------

    @staticmethod
    def _check_kind(kind: str) -> None:
        if kind not in _LAYER_KINDS:
            raise InvalidRequest(f"invalid layer kind {kind!r}: one of {', '.join(_LAYER_KINDS)}")

    @staticmethod
    def _check_label(name: str | None) -> None:
        if name is not None and (not name or len(name) > 256 or "\0" in name):
            raise InvalidRequest(f"invalid layer name {name!r}: 1-256 characters, no NUL")

    def _row_to_layer(self, row: sqlite3.Row) -> LayerInfo:
        return LayerInfo(
            digest=row["digest"],
            kind=row["kind"],
            name=row["name"],
            size=row["size"],
            created_at=datetime.fromisoformat(row["created_at"]),
            meta=json.loads(row["meta"]),
        )

    def _publish(
        self,
        tmp_file: Path,
        kind: LayerKind,
        name: str | None,
        meta: dict[str, Any] | None,
        *,
        known_hex: str | None = None,
    ) -> LayerInfo:
        """Hash ``tmp_file``, move it to ``blobs/`` (or drop it if known) and record the row.
        ``known_hex``: its sha256, already known (a file of the built-in cache, named by it)."""
        with open(tmp_file, "rb+") as f:
            os.fsync(f.fileno())
        hex_ = known_hex or _sha256_file(tmp_file)
        digest = f"sha256:{hex_}"
        size = tmp_file.stat().st_size
        blob = self._blobs / f"{hex_}.erofs"
        meta_json = json.dumps(meta or {}, sort_keys=True, default=str)
        with self.exclusive():
            if blob.is_file():
                tmp_file.unlink()
            else:
                os.chmod(tmp_file, 0o444)
                os.rename(tmp_file, blob)
                _fsync_dir(self._blobs)
            self._db.execute(
                "INSERT OR IGNORE INTO layers (digest, kind, name, size, created_at, meta) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (digest, kind, name, size, _now().isoformat(), meta_json),
            )
            if name is not None:  # a known layer built again under a name keeps the first name
                self._db.execute(
                    "UPDATE layers SET name = ? WHERE digest = ? AND name IS NULL", (name, digest)
                )
            row = self._db.execute("SELECT * FROM layers WHERE digest = ?", (digest,)).fetchone()
        return self._row_to_layer(row)

    def build_layer(
        self,
        source: Path,
        kind: LayerKind,
        *,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
        compress: str | None = "lz4",
    ) -> LayerInfo:
        """Build a layer from a directory or a tarball (``.tar``, ``.tar.gz``/``.tgz``, also
        bzip2/xz) and store it. Idempotent: the same content gives the same digest, one file.

        Tarballs are extracted with :func:`extract_tarball` (no escapes, devices dropped except
        overlay whiteouts) into ``scratch``. Takes ~10 ms for a small tree, ~1 s per 100 MB.

        Raises:
            InvalidRequest: ``source`` is missing or not a directory/tarball; bad kind or name.
            SandboxError: mkfs.erofs failed.
        """
        self._check_kind(kind)
        self._check_label(name)
        source = Path(source)
        if not source.exists():
            raise InvalidRequest(f"layer source {source} does not exist", path=str(source))
        with self.build_slot() as build_id:
            if source.is_dir():
                tree = source
            elif source.is_file():
                tree = self.scratch / f"layer-{build_id}" / "rootfs"
                tree.mkdir(parents=True)
                extract_tarball(source, tree)
            else:
                raise InvalidRequest(
                    f"{source} is neither a directory nor a tarball", path=str(source)
                )
            tmp_file = self._tmp / f"{build_id}.erofs"
            mkfs_erofs(tree, tmp_file, compress=compress)
            return self._publish(tmp_file, kind, name, meta)

    def import_layer_file(
        self,
        erofs_file: Path,
        kind: LayerKind,
        *,
        name: str | None = None,
        meta: dict[str, Any] | None = None,
    ) -> LayerInfo:
        """Adopt an already-built EROFS file as a layer. The file is *moved* into the store
        (copied then removed when it lives on another filesystem); its bytes are kept as they
        are, so its digest is its sha256. Build with :func:`mkfs_erofs` to get a per-layer
        UUID (overlayfs needs distinct UUIDs for ``xino``).

        Raises:
            InvalidRequest: the file does not exist or is not an EROFS image.
        """
        self._check_kind(kind)
        self._check_label(name)
        erofs_file = Path(erofs_file)
        if not erofs_file.is_file():
            raise InvalidRequest(f"{erofs_file} is not a file", path=str(erofs_file))
        if not is_erofs_file(erofs_file):
            raise InvalidRequest(f"{erofs_file} is not an EROFS image", path=str(erofs_file))
        with self.build_slot() as build_id:
            tmp_file = self._tmp / f"{build_id}.erofs"
            try:
                os.rename(erofs_file, tmp_file)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise SandboxError(f"cannot move {erofs_file} into the store: {e}") from e
                shutil.copyfile(erofs_file, tmp_file)
                erofs_file.unlink()
            return self._publish(tmp_file, kind, name, meta)

    def adopt_cached_layer(
        self, cached: Path, kind: LayerKind, *, name: str | None, meta: dict[str, Any]
    ) -> LayerInfo:
        """Publish a file of the machine-wide built-in cache (named ``...-<sha256>.erofs``,
        :mod:`dsec.layers.builtin_cache`) as a layer: hard-linked where the cache shares the
        store's filesystem, copied elsewhere; the file is left in the cache."""
        hex_ = cached.name.rsplit("-", 1)[1].removesuffix(".erofs")
        with self.build_slot() as build_id:
            tmp_file = self._tmp / f"{build_id}.erofs"
            try:
                os.link(cached, tmp_file)
            except OSError:
                shutil.copyfile(cached, tmp_file)
            return self._publish(tmp_file, kind, name, meta, known_hex=hex_)

    def layer_path(self, digest: str) -> Path:
        """The EROFS file of a layer to mount: the local blob if present, else (a remote
        layer) the file the lazy FUSE server serves, starting the server on first use.

        Raises:
            LayerNotFound: unknown layer, or a local layer whose file is gone.
            InvalidRequest: malformed digest.
            SandboxError: the lazy server cannot start.
        """
        hex_ = parse_digest(digest)
        self.get_layer(digest)
        path = self._blobs / f"{hex_}.erofs"
        if not path.is_file():
            remote = self.remote_source(digest)
            if remote is not None:
                return self._lazy_server().file_path(digest)
            raise LayerNotFound(
                f"layer {digest} is registered but its file is missing", digest=digest
            )
        return path

    def get_layer(self, digest: str) -> LayerInfo:
        """Metadata of one layer. Raises LayerNotFound (InvalidRequest if malformed)."""
        parse_digest(digest)
        with self._lock:
            row = self._db.execute("SELECT * FROM layers WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            raise LayerNotFound(f"no layer {digest}", digest=digest)
        return self._row_to_layer(row)

    def has_layer(self, digest: str) -> bool:
        """Whether the store knows the layer ``digest`` (local or remote); False for a
        malformed digest."""
        with self._lock:
            row = self._db.execute("SELECT 1 FROM layers WHERE digest = ?", (digest,)).fetchone()
        return row is not None

    def list_layers(self) -> list[LayerInfo]:
        """All layers, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM layers ORDER BY created_at, digest").fetchall()
        return [self._row_to_layer(r) for r in rows]

    # --- remote layers (blob stores, lazy loading) ----------------------------------------

    def add_remote_layer(
        self,
        digest: str,
        size: int,
        source_url: str,
        meta: dict[str, Any] | None = None,
        *,
        kind: LayerKind | None = None,
        name: str | None = None,
    ) -> LayerInfo:
        """Record a layer whose blob lives in the blob store at ``source_url`` (see
        :func:`dsec.layers.blobstore.open_blob_store`). No data is copied: a mount reads it
        on demand through the lazy FUSE server (:meth:`layer_path`), or :meth:`fetch_layer`
        downloads it. ``kind``/``name`` default to ``meta["kind"]``/``meta["name"]``, then
        ``base``/None. ``meta["chunk_table"]``: the digest of the layer's chunk table in the
        same store (:mod:`dsec.layers.chunktable`); on-demand reads are then checked chunk by
        chunk. Idempotent.

        Raises:
            InvalidRequest: malformed digest, size < 0, bad kind/name or URL scheme.
        """
        parse_digest(digest)
        meta = dict(meta or {})
        kind_ = kind or meta.get("kind") or "base"
        name_ = name if name is not None else meta.get("name")
        self._check_kind(kind_)
        self._check_label(name_)
        if size < 0:
            raise InvalidRequest(f"negative layer size {size}", digest=digest)
        open_blob_store(source_url)  # validates the URL (InvalidRequest for an unknown scheme)
        meta.setdefault("blob_store", source_url)
        meta_json = json.dumps(meta, sort_keys=True, default=str)
        with self.exclusive():
            self._db.execute(
                "INSERT OR IGNORE INTO layers (digest, kind, name, size, created_at, meta) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (digest, kind_, name_, int(size), _now().isoformat(), meta_json),
            )
            self._db.execute(
                "INSERT OR REPLACE INTO remote_layers (digest, source_url, size) VALUES (?, ?, ?)",
                (digest, source_url, int(size)),
            )
        table = meta.get("chunk_table")
        self._lazy_server().register(
            digest, int(size), source_url, chunk_table=table if isinstance(table, str) else None
        )
        return self.get_layer(digest)

    def remote_source(self, digest: str) -> str | None:
        """The blob store URL a remote layer was recorded with, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT source_url FROM remote_layers WHERE digest = ?", (digest,)
            ).fetchone()
        return None if row is None else str(row["source_url"])

    def is_local(self, digest: str) -> bool:
        """True if the layer's blob is on this node's disk (not served lazily)."""
        return (self._blobs / f"{parse_digest(digest)}.erofs").is_file()

    def fetch_layer(self, digest: str) -> LayerInfo:
        """Download a remote layer's whole blob into the store (the "full pull"): streamed to
        ``tmp/``, sha256 verified, fsynced, renamed into ``blobs/``. Afterwards
        :meth:`layer_path` returns the local file. No-op for a local layer.

        Raises:
            LayerNotFound: unknown layer or absent from its store. BlobDigestMismatch:
                corrupt blob (nothing kept). RegistryUnavailable: the store failed.
        """
        info = self.get_layer(digest)
        if self.is_local(digest):
            return info
        url = self.remote_source(digest)
        if url is None:
            raise LayerNotFound(f"layer {digest} has neither a file nor a blob store")
        store = open_blob_store(url)
        with self.build_slot() as build_id:
            tmp_file = self._tmp / f"{build_id}.erofs"
            store.fetch(digest, tmp_file)
            os.chmod(tmp_file, 0o444)
            with self.exclusive():
                blob = self._blobs / f"{parse_digest(digest)}.erofs"
                if not blob.is_file():
                    os.rename(tmp_file, blob)
                    _fsync_dir(self._blobs)
        close = getattr(store, "close", None)
        if close is not None:
            close()
        return info

    def _lazy_server(self) -> LazyServer:
        with self._lock:
            if self._lazy is None:
                readahead = os.environ.get("DSEC_LAZY_READAHEAD_CHUNKS")
                self._lazy = LazyServer(
                    self.root / "lazy",
                    chunk_size=self._lazy_chunk_size,
                    cache_bytes=self._lazy_cache_bytes,
                    readahead_chunks=(
                        int(readahead) if readahead is not None else DEFAULT_READAHEAD_CHUNKS
                    ),
                )
            return self._lazy

    def prestart_lazy(self) -> None:
        """Start the lazy FUSE server in the background now if a layer is served lazily,
        so the first sandbox of a remote image does not wait for it (~1 s). A node daemon
        calls this at start-up (``DSEC_LAZY_PRESTART=1`` does it when the store opens)."""
        with self._lock:
            rows = self._db.execute("SELECT digest FROM remote_layers").fetchall()
        if all(self.is_local(r["digest"]) for r in rows):
            return
        server = self._lazy_server()

        def start() -> None:
            try:
                server.ensure_running()
            except SandboxError as e:
                log.error("lazy layer server did not start: %s", e)

        threading.Thread(target=start, name="dsec-lazy-prestart", daemon=True).start()

    @property
    def lazy(self) -> LazyServer:
        """The node's lazy FUSE server client (created on first use, started on first
        mount of a remote layer)."""
        return self._lazy_server()

    def cached_fraction(self, digest: str) -> float:
        """Fraction (0..1) of a layer's bytes on this node: 1.0 for a local layer, the share
        of its chunks in the chunk cache for a remote one. For ``dsec image ls``."""
        info = self.get_layer(digest)
        if self.is_local(digest):
            return 1.0
        return self._lazy_server().cached_fraction(digest, info.size)

    def lazy_stats(self) -> dict[str, Any]:
        """On-demand loading counters: ``{"node": {...}, "layers": {digest: {...}},
        "running": bool}``. Per layer and node: ``bytes_fetched``, ``bytes_written`` (to the
        chunk cache), ``cache_hits``, ``cache_misses``, ``fetches``, ``fetch_seconds_total``
        / ``_max`` / ``_p50`` / ``_p99``, ``fetch_errors``, ``cache_write_errors``,
        ``prefetched_chunks``, ``cached_fraction``. Empty when the server is not running."""
        return self._lazy_server().stats()
