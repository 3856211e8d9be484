"""The node's image catalogue: image names, their owners, and the built-in images.

This half of the layer store knows names, not bytes: an image is a name for an ordered list
of layer digests, and every layer it names lives in the content store
(:class:`dsec.layers.content.ContentStore`), which the catalogue is given and builds on;
the content store never calls back. :class:`dsec.layers.store.LayerStore` is the two
together.

Glossary:
    image: a name for an ordered list of layer digests, bottom first (table ``images``).
    owner: who an image or a layer belongs to: an API key's owner id (``k<16 hex>``), or
        :data:`SYSTEM` (``""``) for built-in images and images the operator published.
    grant: an owner's right to name a layer by digest (table ``layer_grants``).
    built-in image: a recipe of :data:`dsec.layers.builtin.BUILTIN_IMAGES` (``busybox``,
        ``debian``, ...), built into a system image the first time it is needed.

Ownership (many tenants share one node's store):

* An image name belongs to one owner. Each owner sees its own images and the system ones;
  its own name wins where both exist. A key can never create or replace an image under a
  system name (``Conflict``), nor see another owner's image (``ImageNotFound``), unless that
  owner *shared* it on purpose (:meth:`ImageCatalogue.share_image`); a shared image is then
  named ``<owner>/<name>`` by everyone else, so it can never shadow a name of theirs.
* Layer files are content-addressed and stored once, whoever made them, but a digest is
  only usable by owners that were *granted* it: the owner of an image gets its layers, a
  build, pull or snapshot grants its layers to the caller, and system images grant theirs
  to everyone. Naming another owner's layer by digest gives ``LayerNotFound``, exactly as
  for a digest that does not exist.

The catalogue's tables live in the content store's ``layers.db`` (its own connection);
it migrates them under the content store's lock (:meth:`ContentStore.exclusive`).

Example::

    images = ImageCatalogue(ContentStore(paths.layers, paths.scratch))
    layer = images.content.build_layer(Path("./app"), "workspace", name="app")
    images.put_image("app", [*images.get_image("busybox").layers, layer.digest], owner=key)
    images.resolve_layers(["app", "sha256:..."], key)   # layers bottom first, as key sees them
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
import sqlite3
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dsec.layers.builtin as builtin
from dsec.errors import (
    Conflict,
    ImageNotFound,
    ImageNotReady,
    InvalidRequest,
    LayerNotFound,
    SandboxError,
    Unsupported,
)
from dsec.images.reference import is_reference_name
from dsec.layers.builtin_cache import BuiltinCache, flocked
from dsec.layers.content import ContentStore, parse_digest
from dsec.layers.overlay_build import build_over
from dsec.models import SYSTEM_OWNER, ImageInfo, LayerInfo, LayerKind

__all__ = ["SYSTEM", "ImageCatalogue"]

log = logging.getLogger(__name__)

_IMAGE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}(:[A-Za-z0-9._-]{1,128})?$")
_OWNER_ID_RE = re.compile(r"^k[0-9a-f]{16}$")
SYSTEM = SYSTEM_OWNER
"""The owner of built-in images and of images the operator published: visible to every key,
writable by none."""
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


def _now() -> datetime:
    return datetime.now(UTC)


class ImageCatalogue:
    """Images (named ordered lists of layer digests, bottom first) by owner, the grants that
    let an owner name a layer, and the built-in images, over a :class:`ContentStore` that
    holds the layers.

    Thread-safe: its own SQLite connection to ``layers.db`` behind its own lock; it never
    calls the content store while holding that lock. Built-in images are built once per
    name at a time (single-flight, in a worker thread), once per machine where
    ``DSEC_BUILTIN_CACHE`` is shared (:mod:`dsec.layers.builtin_cache`).

    Args:
        content: the content store whose layers the images name; the catalogue does not
            close it.
    """

    def __init__(self, content: ContentStore) -> None:
        self.content = content
        self._lock = threading.RLock()
        self._inflight: dict[str, concurrent.futures.Future[ImageInfo]] = {}
        self._progress: dict[str, tuple[str, float]] = {}  # built-in -> (phase, started at)
        self._failed: dict[str, str] = {}  # built-in -> why its last build failed
        self._queued: set[str] = set()  # built-ins waiting for prebuild_builtins
        self._db = sqlite3.connect(
            content.root / "layers.db",
            check_same_thread=False,
            isolation_level=None,
            timeout=30.0,
        )
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA synchronous=NORMAL")
        with content.exclusive():
            self._migrate()

    def close(self) -> None:
        """Close the catalogue's database connection (not the content store)."""
        with self._lock:
            self._db.close()

    def _migrate(self) -> None:
        """Create the tables; bring a store of an older dsec up to date (see
        :data:`_MIGRATE_IMAGES_V1`). Runs under the content store's lock."""
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
            return self.content.has_layer(digest)
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM layer_grants WHERE digest = ? AND owner IN (?, ?) LIMIT 1",
                (digest, owner, SYSTEM),
            ).fetchone()
        return row is not None

    def get_owned_layer(self, digest: str, owner: str) -> LayerInfo:
        """:meth:`ContentStore.get_layer` as ``owner`` sees it: a layer it was not granted is
        ``LayerNotFound``, exactly like one that does not exist."""
        info = self.content.get_layer(digest)
        if not self.layer_visible(digest, owner):
            raise LayerNotFound(f"no layer {digest}", digest=digest)
        return info

    def list_owned_layers(self, owner: str) -> list[LayerInfo]:
        """The layers ``owner`` may use (its own grants and the system's), oldest first."""
        layers = self.content.list_layers()
        if owner == SYSTEM:
            return layers
        with self._lock:
            granted = {
                r["digest"]
                for r in self._db.execute(
                    "SELECT digest FROM layer_grants WHERE owner IN (?, ?)", (owner, SYSTEM)
                )
            }
        return [layer for layer in layers if layer.digest in granted]

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
        infos = [self.content.get_layer(d) for d in layers]
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
        return [self.content.get_layer(d) for i, d in enumerate(digests) if last_index[d] == i]

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
            else self.content.root / "locks" / f"builtin-{name}.lock"
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
                    layer = self.content.adopt_cached_layer(
                        cached, recipe.kind, name=name, meta=meta
                    )
                    log.info("image %s taken from the built-in cache %s", name, cache.root)
                    layers = [d for d in base_layers if d != layer.digest] + [layer.digest]
                    return self.put_image(name, layers, meta=meta)
            image, layer = self._build_builtin_now(name, recipe, meta, base_layers)
            if cache is not None and key is not None:
                cache.store(name, key, self.content.layer_path(layer.digest))
            return image

    def _build_builtin_now(
        self,
        name: str,
        recipe: builtin.BuiltinImage,
        meta: dict[str, Any],
        base_layers: list[str],
    ) -> tuple[ImageInfo, LayerInfo]:
        started = time.monotonic()
        with self.content.build_slot() as build_id:
            if recipe.base is None:
                tree = self.content.scratch / f"layer-{build_id}" / "rootfs"
                tree.mkdir(parents=True)
                self._set_progress(name, "building its root filesystem")
                recipe.build_rootfs(tree)
            else:
                self._set_progress(name, f"building its layer on {recipe.base}")
                tree = build_over(
                    self.content.scratch / f"layer-{build_id}",
                    [self.content.layer_path(d) for d in base_layers],
                    recipe.build_rootfs,
                )
            self._set_progress(name, "making the EROFS layer")
            layer = self.content.build_layer(tree, recipe.kind, name=name, meta=meta)
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
        except BaseException as err:
            e = _node_cannot_build(name, err)
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
            Unsupported: this node's tools could not build the built-in (``details``:
                ``image``, ``cause``; the next call tries again); other errors of the
                build as raised.
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
        layer = self.content.build_layer(Path(source), kind, name=name, meta=meta or {})
        layers = [d for d in base_layers if d != layer.digest] + [layer.digest]
        image_meta: dict[str, Any] = {"base": base} if base is not None else {}
        return self.put_image(name, layers, meta=image_meta, owner=owner)


def _node_cannot_build(name: str, err: BaseException) -> BaseException:
    """What a caller of the built-in image ``name`` is told when its build failed: a
    failure of the node's own tools (no debootstrap, no static busybox, apt failing) is
    ``Unsupported``, naming the image and the cause: this node cannot give it (a 422 the
    client can read, not a server error). Other errors are told as they are."""
    if type(err) is not SandboxError:
        return err
    return Unsupported(
        f"this node cannot build the built-in image {name!r}: {err.message}",
        image=name,
        cause=err.message,
    )
