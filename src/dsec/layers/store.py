"""The node's content-addressed layer store.

Glossary:
    layer: one read-only EROFS image file, named by the sha256 of its bytes
        (``sha256:<64 hex>``), with a kind (``base``, ``workspace``, ``toolkit``), an
        optional human name and free-form metadata.
    image: a name for an ordered list of layer digests, bottom first.
    owner: who an image or a layer belongs to: an API key's owner id (``k<16 hex>``), or
        :data:`SYSTEM` (``""``) for built-in images and images the operator published.

Ownership (many tenants share one node's store):

* An image name belongs to one owner. Each owner sees its own images and the system ones;
  its own name wins where both exist. A key can never create or replace an image under a
  system name (``Conflict``), nor see another owner's image (``ImageNotFound``), unless that
  owner *shared* it on purpose (:meth:`LayerStore.share_image`); a shared image is then
  named ``<owner>/<name>`` by everyone else, so it can never shadow a name of theirs.
* Layer files are content-addressed and stored once, whoever made them, but a digest is
  only usable by owners that were *granted* it (table ``layer_grants``): the owner of an
  image gets its layers, a build, pull or snapshot grants its layers to the caller, and
  system images grant theirs to everyone. Naming another owner's layer by digest gives
  ``LayerNotFound``, exactly as for a digest that does not exist.

Layout on disk (``root`` is ``$DSEC_HOME/layers``, ``scratch`` is ``$DSEC_HOME/images``)::

    root/
      layers.db                    SQLite (WAL): tables ``layers`` and ``images``
      blobs/sha256/<hex>.erofs     the layers, mode 0444, never modified once published
      tmp/<build>.lock             held (flock) by a running build
      tmp/<build>.erofs            a layer being built or imported
      .lock                        flock serialising publication and start-up repair
    scratch/
      layer-<build>/               a tarball extracted for a build, a built-in rootfs

A layer is built into ``tmp/``, fsynced, hashed and only then renamed into ``blobs/``
(same filesystem, so the rename is atomic): a half-built layer is never visible under a
digest. Building the same content twice gives the same digest and one file. Leftovers of a
crashed build (a ``tmp/`` entry whose lock nobody holds, a ``scratch/layer-*`` dir without a
live lock, a blob without a row) are removed when the store is opened.

Example::

    store = LayerStore(paths.layers, paths.scratch)
    info = store.build_layer(Path("./app"), "workspace", name="app")
    store.put_image("app", [*store.get_image("busybox").layers, info.digest])
    layers = store.resolve_layers(["app", "sha256:..."])   # bottom first
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import dsec.layers.builtin as builtin
from dsec.errors import (
    Conflict,
    ImageNotFound,
    ImageNotReady,
    InvalidRequest,
    LayerNotFound,
    SandboxError,
)
from dsec.images.reference import is_reference_name
from dsec.layers.blobstore import open_blob_store
from dsec.layers.builtin_cache import BuiltinCache, flocked
from dsec.layers.erofs import is_erofs_file, mkfs_erofs
from dsec.layers.lazy import (
    DEFAULT_CACHE_BYTES,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_READAHEAD_CHUNKS,
    LazyServer,
)
from dsec.layers.overlay_build import build_over
from dsec.layers.tarball import extract_tarball
from dsec.models import SYSTEM_OWNER, ImageInfo, LayerInfo, LayerKind
from dsec.privileged.mount import mount_points, umount_quiet

__all__ = ["DIGEST_RE", "SYSTEM", "LayerStore", "extract_tarball", "parse_digest"]
# extract_tarball lives in dsec.layers.tarball; it stays importable from here

log = logging.getLogger(__name__)

DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
_OWNER_ID_RE = re.compile(r"^k[0-9a-f]{16}$")
SYSTEM = SYSTEM_OWNER
"""The owner of built-in images and of images the operator published: visible to every key,
writable by none."""
_LAYER_KINDS: tuple[str, ...] = get_args(LayerKind)
_MAX_SYMLINK_HOPS = 40
_IMAGES_COLUMNS = """(
    owner      TEXT NOT NULL DEFAULT '',
    name       TEXT NOT NULL,
    layers     TEXT NOT NULL,
    size       INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    meta       TEXT NOT NULL DEFAULT '{}',
    shared     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner, name)
)"""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS layers (
    digest     TEXT PRIMARY KEY,
    kind       TEXT NOT NULL,
    name       TEXT,
    size       INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    meta       TEXT NOT NULL DEFAULT '{{}}'
);
CREATE TABLE IF NOT EXISTS remote_layers (
    digest     TEXT PRIMARY KEY,
    source_url TEXT NOT NULL,
    size       INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS images {_IMAGES_COLUMNS};
CREATE TABLE IF NOT EXISTS layer_grants (
    owner      TEXT NOT NULL,
    digest     TEXT NOT NULL,
    PRIMARY KEY (owner, digest)
);
"""

_MIGRATE_IMAGES_V1 = f"""
CREATE TABLE images_v2 {_IMAGES_COLUMNS};
INSERT INTO images_v2 (owner, name, layers, size, created_at, meta)
    SELECT '', name, layers, size, created_at, meta FROM images;
DROP TABLE images;
ALTER TABLE images_v2 RENAME TO images;
"""
"""A store made before images had owners: its images become system images (the operator's;
their names keep working for every key), and only their layers are granted to everyone."""


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


class LayerStore:
    """Content-addressed EROFS layers (``blobs/sha256/<hex>.erofs``) + metadata in SQLite
    (``layers.db``), plus images = named ordered lists of layer digests (bottom first).

    Thread-safe: one SQLite connection (``check_same_thread=False``, WAL) behind a lock; the
    slow parts of a build (extraction, mkfs, hashing) run outside the lock, so builds in
    several threads proceed in parallel. Safe to open the same root from several processes
    (publication and start-up repair take an ``flock``).

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
        self._inflight: dict[str, concurrent.futures.Future[ImageInfo]] = {}
        self._progress: dict[str, tuple[str, float]] = {}  # built-in -> (phase, started at)
        self._failed: dict[str, str] = {}  # built-in -> why its last build failed
        self._queued: set[str] = set()  # built-ins waiting for prebuild_builtins
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
        with self._process_lock():
            self._migrate()
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
    def _process_lock(self) -> Iterator[None]:
        with self._lock:
            fcntl.flock(self._store_lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._store_lock_fd, fcntl.LOCK_UN)

    def _migrate(self) -> None:
        """Create the tables; bring a store of an older dsec up to date (see
        :data:`_MIGRATE_IMAGES_V1`). Runs under the process lock."""
        columns = {r["name"] for r in self._db.execute("PRAGMA table_info(images)")}
        if columns and "owner" not in columns:
            self._db.executescript(f"BEGIN IMMEDIATE;{_MIGRATE_IMAGES_V1}COMMIT;")
            self._db.executescript(_SCHEMA)
            with self._db:
                for row in self._db.execute("SELECT layers FROM images").fetchall():
                    self._grant(SYSTEM, json.loads(row["layers"]))
            log.warning("layer store: images of an older dsec are now system images")
        else:
            self._db.executescript(_SCHEMA)

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
    def _build_slot(self) -> Iterator[str]:
        """A build id with its lock held; removes the build's temp files and scratch on exit."""
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
        with self._process_lock():
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
        with self._build_slot() as build_id:
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
        with self._build_slot() as build_id:
            tmp_file = self._tmp / f"{build_id}.erofs"
            try:
                os.rename(erofs_file, tmp_file)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise SandboxError(f"cannot move {erofs_file} into the store: {e}") from e
                shutil.copyfile(erofs_file, tmp_file)
                erofs_file.unlink()
            return self._publish(tmp_file, kind, name, meta)

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
        with self._process_lock():
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
        with self._build_slot() as build_id:
            tmp_file = self._tmp / f"{build_id}.erofs"
            store.fetch(digest, tmp_file)
            os.chmod(tmp_file, 0o444)
            with self._process_lock():
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

    def attach(self, ref: str, name: str | None, lazy: bool, owner: str) -> ImageInfo:
        """Take the image at ``ref`` from its registry as ``owner``'s image:
        :func:`dsec.layers.publish.attach_image`."""
        from dsec.layers.publish import attach_image

        return attach_image(self, ref, name, lazy, owner)

    def lazy_stats(self) -> dict[str, Any]:
        """On-demand loading counters: ``{"node": {...}, "layers": {digest: {...}},
        "running": bool}``. Per layer and node: ``bytes_fetched``, ``bytes_written`` (to the
        chunk cache), ``cache_hits``, ``cache_misses``, ``fetches``, ``fetch_seconds_total``
        / ``_max`` / ``_p50`` / ``_p99``, ``fetch_errors``, ``cache_write_errors``,
        ``prefetched_chunks``, ``cached_fraction``. Empty when the server is not running."""
        return self._lazy_server().stats()

    # --- ownership -----------------------------------------------------------------------

    def _grant(self, owner: str, digests: list[str]) -> None:
        """Let ``owner`` use ``digests`` by digest (idempotent). Caller holds ``_lock``."""
        self._db.executemany(
            "INSERT OR IGNORE INTO layer_grants (owner, digest) VALUES (?, ?)",
            [(owner, d) for d in dict.fromkeys(digests)],
        )

    def grant_layers(self, owner: str, digests: list[str]) -> None:
        """Let ``owner`` name ``digests`` (known layers) in its sandboxes and images: a
        snapshot grants its layer to the sandbox's owner, a migration the moved layers."""
        for d in digests:
            parse_digest(d)
        with self._lock:
            self._grant(owner, list(digests))

    def layer_visible(self, digest: str, owner: str) -> bool:
        """Whether ``owner`` may use the layer ``digest`` (granted to it or to everyone).
        :data:`SYSTEM` (the node itself, the operator) may use every layer it has."""
        if owner == SYSTEM:
            with self._lock:
                row = self._db.execute("SELECT 1 FROM layers WHERE digest = ?", (digest,))
                return row.fetchone() is not None
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM layer_grants WHERE digest = ? AND owner IN (?, ?) LIMIT 1",
                (digest, owner, SYSTEM),
            ).fetchone()
        return row is not None

    def get_owned_layer(self, digest: str, owner: str) -> LayerInfo:
        """:meth:`get_layer` as ``owner`` sees it: a layer it was not granted is
        ``LayerNotFound``, exactly like one that does not exist."""
        info = self.get_layer(digest)
        if not self.layer_visible(digest, owner):
            raise LayerNotFound(f"no layer {digest}", digest=digest)
        return info

    def list_owned_layers(self, owner: str) -> list[LayerInfo]:
        """The layers ``owner`` may use (its own grants and the system's), oldest first."""
        if owner == SYSTEM:
            return self.list_layers()
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM layers WHERE digest IN "
                "(SELECT digest FROM layer_grants WHERE owner IN (?, ?)) "
                "ORDER BY created_at, digest",
                (owner, SYSTEM),
            ).fetchall()
        return [self._row_to_layer(r) for r in rows]

    # --- images --------------------------------------------------------------------------

    def _row_to_image(self, row: sqlite3.Row) -> ImageInfo:
        owner = row["owner"]
        return ImageInfo(
            name=row["name"],
            layers=json.loads(row["layers"]),
            size=row["size"],
            created_at=datetime.fromisoformat(row["created_at"]),
            meta=json.loads(row["meta"]),
            owner="system" if owner == SYSTEM else owner,
            shared=bool(row["shared"]),
        )

    def _system_name(self, name: str) -> bool:
        """Whether ``name`` is a system image's (stored, or a built-in not yet built)."""
        if name in builtin.BUILTIN_IMAGES:
            return True
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM images WHERE owner = ? AND name = ?", (SYSTEM, name)
            ).fetchone()
        return row is not None

    def check_name_free(self, name: str, owner: str) -> None:
        """Raise ``Conflict`` if ``owner`` (a key) may not name an image ``name``: a system
        image's name (stored or built in) is read-only to keys; ``InvalidRequest`` for a
        malformed name."""
        self._check_image_name(name)
        if owner != SYSTEM and self._system_name(name):
            raise Conflict(
                f"{name!r} is a system image (built in or published by the operator); "
                "keys cannot replace it: choose another name",
                name=name,
            )

    @staticmethod
    def _check_image_name(name: str) -> None:
        """A local name (``[a-z0-9][a-z0-9._-]*`` with an optional ``:tag``) or, for images
        pulled by reference, the reference's familiar form (``host:port/repo:tag``)."""
        if (
            not isinstance(name, str)
            or name.startswith("sha256:")
            or not (_IMAGE_NAME_RE.match(name) or is_reference_name(name))
        ):
            raise InvalidRequest(
                f"invalid image name {name!r}: [a-z0-9][a-z0-9._-]* with an optional :tag",
                name=name,
            )

    def put_image(
        self,
        name: str,
        layers: list[str],
        *,
        meta: dict[str, Any] | None = None,
        owner: str = SYSTEM,
    ) -> ImageInfo:
        """Create or replace ``owner``'s image ``name`` = ``layers`` (digests, bottom first)
        and grant its layers to ``owner``. The caller has checked that ``owner`` may use
        the layers (:meth:`resolve_layers`).

        Raises:
            InvalidRequest: bad name (``[a-z0-9][a-z0-9._-]*`` with optional ``:tag``, not
                ``sha256:...``), empty or malformed layer list.
            Conflict: a key (not :data:`SYSTEM`) names a system image.
            LayerNotFound: a digest is not in the store.
        """
        self.check_name_free(name, owner)
        if not layers:
            raise InvalidRequest("an image needs at least one layer", name=name)
        infos = [self.get_layer(d) for d in layers]
        size = sum({i.digest: i.size for i in infos}.values())
        created = _now()
        meta = meta or {}
        with self._lock:
            shared_row = self._db.execute(
                "SELECT shared FROM images WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()
            self._db.execute(
                "INSERT OR REPLACE INTO images "
                "(owner, name, layers, size, created_at, meta, shared) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    owner,
                    name,
                    json.dumps(list(layers)),
                    size,
                    created.isoformat(),
                    json.dumps(meta, sort_keys=True, default=str),
                    int(shared_row["shared"]) if shared_row is not None else 0,
                ),
            )
            self._grant(owner, list(layers))
        return self.get_image(name, owner)

    def _known_names(self, owner: str) -> list[str]:
        with self._lock:
            stored = [
                r["name"]
                for r in self._db.execute(
                    "SELECT name FROM images WHERE owner IN (?, ?)", (owner, SYSTEM)
                ).fetchall()
            ]
        return sorted(set(stored) | set(builtin.BUILTIN_IMAGES))

    def _find_image(self, ref: str, owner: str) -> sqlite3.Row | None:
        """The row ``owner`` means by ``ref``: its own image, else the system's, else (for
        ``<owner id>/<name>``) another owner's image that is shared."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM images WHERE name = ? AND owner IN (?, ?) "
                "ORDER BY owner = ? DESC LIMIT 1",
                (ref, owner, SYSTEM, owner),
            ).fetchone()
            if row is not None:
                return row
            other, sep, name = ref.partition("/")
            if sep and _OWNER_ID_RE.match(other):
                return self._db.execute(
                    "SELECT * FROM images WHERE owner = ? AND name = ? AND (shared = 1 OR owner = ?)",
                    (other, name, owner),
                ).fetchone()
        return None

    def get_image(self, ref: str, owner: str = SYSTEM) -> ImageInfo:
        """The image ``owner`` means by ``ref`` (see the module docstring: its own, then the
        system's, then ``<owner id>/<name>`` of a shared image). ``sha256:<hex>`` names a
        single layer ``owner`` may use and gives a one-layer image.

        Raises:
            ImageNotFound: no such image visible to ``owner`` (built-ins not yet built
                included: see :meth:`ensure_image`), or no such layer for a digest.
        """
        if ref.startswith("sha256:"):
            try:
                layer = self.get_owned_layer(ref, owner)
            except LayerNotFound as e:
                raise ImageNotFound(f"no image or layer {ref}", image=ref) from e
            return ImageInfo(
                name=ref,
                layers=[ref],
                size=layer.size,
                created_at=layer.created_at,
                meta={"layer": True},
            )
        row = self._find_image(ref, owner)
        if row is None:
            raise ImageNotFound(f"no image {ref!r}", image=ref)
        return self._row_to_image(row)

    def list_images(self, owner: str | None = None) -> list[ImageInfo]:
        """The images ``owner`` sees (its own and the system's), by name; every stored
        image when ``owner`` is None (the node's own view)."""
        with self._lock:
            if owner is None:
                rows = self._db.execute("SELECT * FROM images ORDER BY name, owner").fetchall()
            else:
                rows = self._db.execute(
                    "SELECT * FROM images WHERE owner IN (?, ?) ORDER BY name, owner = ? DESC",
                    (owner, SYSTEM, owner),
                ).fetchall()
        out: dict[tuple[str, str], ImageInfo] = {}
        for r in rows:  # for one owner, its own image hides a system one of the same name
            key = (r["name"], r["owner"] if owner is None else "")
            out.setdefault(key, self._row_to_image(r))
        return list(out.values())

    def remove_image(self, name: str, owner: str = SYSTEM) -> None:
        """Forget ``owner``'s image ``name`` (its layers stay). Raises ImageNotFound, also
        for a system image asked by a key (keys cannot remove those)."""
        with self._lock:
            cur = self._db.execute("DELETE FROM images WHERE owner = ? AND name = ?", (owner, name))
        if cur.rowcount == 0:
            if owner != SYSTEM and self._system_name(name):
                raise Conflict(f"{name!r} is a system image: keys cannot remove it", name=name)
            raise ImageNotFound(f"no image {name!r}", image=name)

    def share_image(self, name: str, owner: str, shared: bool) -> ImageInfo:
        """Make ``owner``'s image ``name`` usable by every key as ``<owner>/<name>``
        (``shared=False`` takes that back). Raises ImageNotFound."""
        if owner == SYSTEM:
            raise InvalidRequest("system images are visible to every key already")
        with self._lock:
            cur = self._db.execute(
                "UPDATE images SET shared = ? WHERE owner = ? AND name = ?",
                (int(shared), owner, name),
            )
        if cur.rowcount == 0:
            raise ImageNotFound(f"no image {name!r}", image=name)
        return self.get_image(name, owner)

    def resolve_layers(self, refs: list[str], owner: str = SYSTEM) -> list[LayerInfo]:
        """Expand refs (``sha256:<hex>`` layers or image names, as ``owner`` sees them) into
        layers, bottom first.

        A layer that appears more than once is kept only at its topmost position (the lower
        copies are shadowed by it anyway, and overlayfs refuses the same lower twice).

        Raises:
            LayerNotFound: a digest is unknown or not granted to ``owner``. ImageNotFound: a
                name is unknown to ``owner``.
        """
        digests: list[str] = []
        for ref in refs:
            if ref.startswith("sha256:"):
                self.get_owned_layer(ref, owner)
                digests.append(ref)
            else:
                digests.extend(self.get_image(ref, owner).layers)
        last_index = {d: i for i, d in enumerate(digests)}
        return [self.get_layer(d) for i, d in enumerate(digests) if last_index[d] == i]

    # --- built-in images -------------------------------------------------------------------

    def _build_builtin(self, name: str) -> ImageInfo:
        with contextlib.suppress(ImageNotFound):
            done = self.get_image(name)  # another process or thread finished it meanwhile
            if not self._outdated(done):
                return done
        recipe = builtin.BUILTIN_IMAGES[name]
        base_layers: list[str] = []
        if recipe.base is not None:
            self._set_progress(name, f"waiting for its base image {recipe.base}")
            base_layers = list(self.ensure_image_sync(recipe.base).layers)
        meta = {**recipe.meta, "builtin": name}
        if recipe.base is not None:
            meta["base_layers"] = base_layers
        cache = BuiltinCache.from_env()
        key = cache.key(recipe, meta) if cache is not None else None
        lock = (  # machine-wide where a cache is shared, else this store's
            cache.root / f"builtin-{name}-{key}.lock"
            if cache is not None and key is not None
            else self.root / "locks" / f"builtin-{name}.lock"
        )
        self._set_progress(name, "waiting for another process building it")
        with flocked(lock):
            # one build per machine (a cache shared by several stores) or per store
            with contextlib.suppress(ImageNotFound):
                done = self.get_image(name)
                if not self._outdated(done):
                    return done
            if cache is not None and key is not None:
                cached = cache.find(name, key)
                if cached is not None:
                    layer = self.adopt_cached_layer(cached, recipe.kind, name=name, meta=meta)
                    log.info("image %s taken from the built-in cache %s", name, cache.root)
                    layers = [d for d in base_layers if d != layer.digest] + [layer.digest]
                    return self.put_image(name, layers, meta=meta)
            image, layer = self._build_builtin_now(name, recipe, meta, base_layers)
            if cache is not None and key is not None:
                cache.store(name, key, self._blobs / f"{layer.digest.split(':', 1)[1]}.erofs")
            return image

    def adopt_cached_layer(
        self, cached: Path, kind: LayerKind, *, name: str | None, meta: dict[str, Any]
    ) -> LayerInfo:
        """Publish a file of the machine-wide built-in cache (named ``...-<sha256>.erofs``,
        :mod:`dsec.layers.builtin_cache`) as a layer: hard-linked where the cache shares the
        store's filesystem, copied elsewhere; the file is left in the cache."""
        hex_ = cached.name.rsplit("-", 1)[1].removesuffix(".erofs")
        with self._build_slot() as build_id:
            tmp_file = self._tmp / f"{build_id}.erofs"
            try:
                os.link(cached, tmp_file)
            except OSError:
                shutil.copyfile(cached, tmp_file)
            return self._publish(tmp_file, kind, name, meta, known_hex=hex_)

    def _build_builtin_now(
        self,
        name: str,
        recipe: builtin.BuiltinImage,
        meta: dict[str, Any],
        base_layers: list[str],
    ) -> tuple[ImageInfo, LayerInfo]:
        started = time.monotonic()
        with self._build_slot() as build_id:
            if recipe.base is None:
                tree = self.scratch / f"layer-{build_id}" / "rootfs"
                tree.mkdir(parents=True)
                self._set_progress(name, "building its root filesystem")
                recipe.build_rootfs(tree)
            else:
                self._set_progress(name, f"building its layer on {recipe.base}")
                tree = build_over(
                    self.scratch / f"layer-{build_id}",
                    [self.layer_path(d) for d in base_layers],
                    recipe.build_rootfs,
                )
            self._set_progress(name, "making the EROFS layer")
            layer = self.build_layer(tree, recipe.kind, name=name, meta=meta)
        log.info(
            "built image %s in %.1f s: %s (%d bytes)",
            name,
            time.monotonic() - started,
            layer.digest,
            layer.size,
        )
        layers = [d for d in base_layers if d != layer.digest] + [layer.digest]
        return self.put_image(name, layers, meta=meta), layer

    def _set_progress(self, name: str, phase: str) -> None:
        with self._lock:
            started = self._progress.get(name, (phase, time.time()))[1]
            self._progress[name] = (phase, started)
        log.info("image %s: %s", name, phase)

    def builtin_status(self, name: str) -> tuple[str, str, float] | None:
        """For a built-in image not yet stored: ``(status, phase, seconds)``, where status is
        ``building`` (``phase`` says what it does, for ``seconds`` so far), ``queued`` or
        ``failed`` (``phase``: the error). None for a stored image or an unknown name."""
        if name not in builtin.BUILTIN_IMAGES:
            return None
        with self._lock:
            if name in self._inflight:
                phase, since = self._progress.get(name, ("starting", time.time()))
                return "building", phase, time.time() - since
            failed = self._failed.get(name)
            queued = name in self._queued
        if self._find_image(name, SYSTEM) is not None:
            return None
        if queued:
            return "queued", "waiting for the images ahead of it", 0.0
        if failed is not None:
            return "failed", failed, 0.0
        return "queued", "built on first use", 0.0

    def prebuild_builtins(self, names: list[str] | None = None) -> threading.Thread | None:
        """Build the built-in images that are not stored yet, one after the other, in a
        background thread (``dsec serve`` calls this at start so that no request waits for a
        build). Progress goes to the log and to :meth:`builtin_status`. Returns the thread,
        or None when nothing is missing."""
        missing = [
            n
            for n in (names if names is not None else list(builtin.BUILTIN_IMAGES))
            if n in builtin.BUILTIN_IMAGES and self._find_image(n, SYSTEM) is None
        ]
        if not missing:
            return None
        with self._lock:
            self._queued.update(missing)

        def run() -> None:
            for name in missing:
                with self._lock:
                    self._queued.discard(name)
                try:
                    self.ensure_image_sync(name)
                except Exception as e:  # the next request for it tries again
                    log.error("building built-in image %s failed: %s", name, e)

        thread = threading.Thread(target=run, name="dsec-prebuild", daemon=True)
        thread.start()
        return thread

    def _claim_builtin(self, name: str) -> tuple[concurrent.futures.Future[ImageInfo], bool]:
        """The in-flight build of ``name`` and whether the caller must run it (single-flight)."""
        with self._lock:
            fut = self._inflight.get(name)
            if fut is not None:
                return fut, False
            fut = concurrent.futures.Future()
            fut.set_running_or_notify_cancel()  # a waiter's cancel() can no longer cancel it
            self._inflight[name] = fut
            self._progress[name] = ("starting", time.time())
            self._failed.pop(name, None)
            return fut, True

    def _run_builtin(self, name: str, fut: concurrent.futures.Future[ImageInfo]) -> None:
        # Leave the in-flight table *before* completing the future: a caller woken by a
        # failure and retrying at once must start a new build, not get the failed one again.
        try:
            image = self._build_builtin(name)
        except BaseException as e:
            with self._lock:
                self._inflight.pop(name, None)
                self._progress.pop(name, None)
                self._failed[name] = str(getattr(e, "message", e))[:500]
            fut.set_exception(e)
        else:
            with self._lock:
                self._inflight.pop(name, None)
                self._progress.pop(name, None)
            fut.set_result(image)

    def _outdated(self, image: ImageInfo) -> bool:
        """A system image of a built-in recipe that has changed since it was built (its
        ``meta["recipe"]`` fingerprint; recipes without one count as ``"1"``), or whose
        base built-in has been rebuilt since (its layers are not the ones it was built on)."""
        recipe = builtin.BUILTIN_IMAGES.get(image.name)
        if recipe is None or image.owner != "system" or image.meta.get("builtin") != image.name:
            return False
        if str(image.meta.get("recipe", "1")) != str(recipe.meta.get("recipe", "1")):
            return True
        if recipe.base is None:
            return False
        base = self._find_image(recipe.base, SYSTEM)
        if base is None:
            return False  # built on first use; the layers recorded stay valid
        base_info = self._row_to_image(base)
        if self._outdated(base_info):
            return True
        return list(image.meta.get("base_layers") or []) != list(base_info.layers)

    def _lookup_or_claim(
        self, name: str, owner: str
    ) -> tuple[ImageInfo | None, concurrent.futures.Future[ImageInfo] | None, bool]:
        try:
            found = self.get_image(name, owner)
            if not self._outdated(found):
                return found, None, False
            log.info("built-in image %s was built from another recipe: rebuilding it", name)
        except ImageNotFound:
            if name not in builtin.BUILTIN_IMAGES:
                known = self._known_names(owner)
                raise ImageNotFound(
                    f"no image {name!r}; known images: {', '.join(known) or '(none)'}",
                    image=name,
                    known=known,
                ) from None
        fut, leader = self._claim_builtin(name)
        return None, fut, leader

    async def ensure_image(
        self, name: str, owner: str = SYSTEM, *, wait_s: float | None = None
    ) -> ImageInfo:
        """The image ``name`` as ``owner`` sees it, building a built-in (``busybox``,
        ``debian``) on first use.

        Concurrent callers of the same name share one build (single-flight), which runs in a
        worker thread, so the event loop stays responsive. Cancelling a waiter does not cancel
        the build. ``sha256:<hex>`` refs work as in :meth:`get_image`.

        Args:
            wait_s: longest wait for a built-in still being built, seconds (None: until it
                is done); past it ``ImageNotReady`` (retryable) says how far it got.

        Raises:
            ImageNotFound: unknown name (the message and ``details['known']`` list the names).
            ImageNotReady: the build did not finish within ``wait_s``.
            SandboxError: the build failed (the next call tries again).
        """
        image, fut, leader = self._lookup_or_claim(name, owner)
        if image is not None:
            return image
        assert fut is not None
        if leader:
            threading.Thread(
                target=self._run_builtin, args=(name, fut), name=f"dsec-build-{name}", daemon=True
            ).start()
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), wait_s)
        except TimeoutError:
            status = self.builtin_status(name)
            phase, seconds = (status[1], status[2]) if status is not None else ("building", 0.0)
            raise ImageNotReady(
                f"image {name!r} is being built ({phase}, {seconds:.0f} s so far); "
                "retry in a few seconds",
                image=name,
                phase=phase,
                elapsed_s=round(seconds, 1),
                retry_after_s=5,
            ) from None

    def ensure_image_sync(self, name: str, owner: str = SYSTEM) -> ImageInfo:
        """Blocking :meth:`ensure_image`, sharing its single-flight builds (for sync callers)."""
        image, fut, leader = self._lookup_or_claim(name, owner)
        if image is not None:
            return image
        assert fut is not None
        if leader:
            self._run_builtin(name, fut)
        return fut.result()

    def build_image(
        self,
        source: Path,
        name: str,
        kind: LayerKind = "workspace",
        base: str | None = None,
        *,
        owner: str = SYSTEM,
        meta: dict[str, Any] | None = None,
    ) -> ImageInfo:
        """Build one layer from ``source`` (a directory or tarball on this machine) and record
        ``owner``'s image ``name`` as ``base``'s layers (as ``owner`` sees ``base``) + that
        layer. A built-in ``base`` is built first if needed. The local CLI's
        ``dsec image build PATH --system`` (the operator) and API builds (an uploaded
        context, extracted by the edge) end here.

        Raises:
            InvalidRequest, ImageNotFound (``base``), Conflict (a system name), SandboxError.
        """
        self.check_name_free(name, owner)
        base_layers = self.ensure_image_sync(base, owner).layers if base is not None else []
        layer = self.build_layer(Path(source), kind, name=name, meta=meta or {})
        layers = [d for d in base_layers if d != layer.digest] + [layer.digest]
        image_meta: dict[str, Any] = {"base": base} if base is not None else {}
        return self.put_image(name, layers, meta=image_meta, owner=owner)
