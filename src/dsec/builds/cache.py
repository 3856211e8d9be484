"""The build cache: which layer a build step made, per owner, keyed by what the step is.

A step's key is the sha256 of ``(version, the digests of the layers it runs on, its
canonical form)``: the filesystem below it (Docker's chain-ID rule: a step rebuilt into a
different layer changes the key of every step above it, even if its instruction did not
change) and everything else that decides its result, and nothing more. Canonical forms: for ``run`` the command, the environment (``env`` and ``arg`` values in
effect), working directory, user and network; for ``apt_install`` / ``pip_install`` the
packages, environment, working directory and network; for ``copy`` the sources as written,
the destination, ``chown``/``chmod``, and the digest of the copied content (paths, types,
modes, link targets and bytes; not modification times); for a ``workdir`` that creates its
directory, the path. The instruction text, Dockerfile line numbers, comments and steps that
only change the image config (``cmd``, ``label``, ...) are not in any key. So an unchanged
step on unchanged layers is a hit; a changed one misses, makes a new layer, and so every
step after it misses too. A step that changed nothing adds no layer and so does not change
the keys above it.

The index (:class:`BuildCache`) is a small SQLite file of the node (next to the layer
store by default): table ``build_cache(owner, key, layer, step, created_at, used_at)``,
primary key ``(owner, key)``. It survives restarts. A lookup is answered only for the
owner that recorded it, and only if the layer still exists in the store and is still
granted to that owner (:meth:`LayerStore.get_owned_layer`); an entry failing that check is
deleted and the step rebuilt. ``layer`` is NULL for a step that changed nothing (a hit
then adds no layer).

Example::

    cache = BuildCache(store.root / "build-cache.db", store)
    key = step_key(stack, planned.canonical)
    hit = cache.lookup(owner, key)            # None, or CacheHit(layer="sha256:..." | None)
    cache.record(owner, key, layer.digest, "RUN make")
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.errors import LayerNotFound

if TYPE_CHECKING:
    from dsec.layers.store import LayerStore

__all__ = ["CACHE_KEY_VERSION", "BuildCache", "CacheHit", "step_key"]

log = logging.getLogger(__name__)

CACHE_KEY_VERSION = 2
"""Bumped whenever what a step key means changes (old entries then simply miss)."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS build_cache (
    owner      TEXT NOT NULL,
    key        TEXT NOT NULL,
    layer      TEXT,
    step       TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    used_at    REAL NOT NULL,
    PRIMARY KEY (owner, key)
);
"""


def _digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


def step_key(layers: list[str], canonical: dict[str, Any]) -> str:
    """The key of a filesystem step with ``canonical`` form run on ``layers`` (digests,
    bottom first: the base image's and the build's so far)."""
    return _digest({"v": CACHE_KEY_VERSION, "layers": list(layers), "step": canonical})


@dataclass(frozen=True)
class CacheHit:
    """A usable cache entry: ``layer`` to stack (None: the step changed nothing)."""

    key: str
    layer: str | None


class BuildCache:
    """The per-owner step cache (see the module docstring). Thread-safe.

    Args:
        path: the SQLite file (created if missing).
        store: the layer store the cached layers live in (validity checks).
    """

    def __init__(self, path: Path, store: LayerStore) -> None:
        self.path = Path(path)
        self.store = store
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=30.0
        )
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _usable(self, owner: str, layer: str) -> bool:
        try:
            self.store.get_owned_layer(layer, owner)
        except LayerNotFound:
            return False
        return self.store.is_local(layer) or self.store.remote_source(layer) is not None

    def lookup(self, owner: str, key: str) -> CacheHit | None:
        """``owner``'s entry for ``key`` if its layer is still there and still ``owner``'s;
        a stale entry is deleted (None)."""
        with self._lock:
            row = self._db.execute(
                "SELECT layer FROM build_cache WHERE owner = ? AND key = ?", (owner, key)
            ).fetchone()
        if row is None:
            return None
        layer = row["layer"]
        if layer is not None and not self._usable(owner, layer):
            log.info("build cache: %s of %s is gone or no longer granted; rebuilding", layer, owner)
            self.forget(owner, key)
            return None
        with self._lock:
            self._db.execute(
                "UPDATE build_cache SET used_at = ? WHERE owner = ? AND key = ?",
                (time.time(), owner, key),
            )
        return CacheHit(key, layer)

    def record(self, owner: str, key: str, layer: str | None, step: str = "") -> None:
        """Remember that ``owner``'s step ``key`` made ``layer`` (None: nothing changed)."""
        now = time.time()
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO build_cache (owner, key, layer, step, created_at, used_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (owner, key, layer, step[:1000], now, now),
            )

    def forget(self, owner: str, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM build_cache WHERE owner = ? AND key = ?", (owner, key))

    def entries(self, owner: str) -> list[dict[str, Any]]:
        """``owner``'s entries, newest first (``key``, ``layer``, ``step``, times)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT key, layer, step, created_at, used_at FROM build_cache WHERE owner = ? "
                "ORDER BY created_at DESC",
                (owner,),
            ).fetchall()
        return [dict(r) for r in rows]

    def prune(self, unused_for_s: float) -> int:
        """Delete entries not used for ``unused_for_s`` seconds; returns how many."""
        with self._lock:
            cur = self._db.execute(
                "DELETE FROM build_cache WHERE used_at < ?", (time.time() - unused_for_s,)
            )
        return int(cur.rowcount)
