"""On-demand (lazy) loading of EROFS layers from a blob store, through FUSE.

A *remote* layer is one the layer store knows (digest, size, blob store URL) but whose bytes
are not on this node. Instead of downloading it before a sandbox can start, the node mounts
EROFS from a file served by a FUSE filesystem, one file per remote layer; a read of that file
fetches the fixed-size *chunks* it covers from the blob store (HTTP range reads, or
``pread`` on a shared filesystem) on first use and keeps them in a local chunk cache.

Glossary:
    chunk: bytes ``[i * chunk_size, (i + 1) * chunk_size)`` of a layer blob (the last one is
        shorter). The unit of fetching, caching, eviction and prefetch. Default 1 MiB.
    chunk cache: ``<state>/cache/<hex>/<i>``, one file per chunk, bounded in bytes
        (``cache_bytes``), least recently used chunks evicted first.
    start record: ``<state>/records/<hex>.json``, the chunks the first start of a layer read
        (first ``record_seconds`` after its first read), in first-touch order. Later starts
        prefetch them in the background.
    metadata: EROFS superblock (chunk 0) and the chunk holding the root inode (from the
        superblock's ``meta_blkaddr``/``root_nid``), fetched when a layer is registered.

One FUSE server per node: a child process (``python -m dsec.layers.lazy``) mounted at
``<state>/mnt``, started by :class:`LazyServer` on first use and stopped by
:meth:`LazyServer.stop` (``LayerStore.close``). It dies with its parent
(``PR_SET_PDEATHSIG``); libfuse unmounts on SIGTERM. A FUSE mount left behind by a killed
server (reads fail with ENOTCONN) is detached when the next server starts. The server
answers a tiny JSON-lines control protocol on ``<state>/ctl.sock`` (``ping``, ``stats``,
``warm``, ``flush``, ``drop_cache``).

Failure semantics: every read has a bounded wait (``read_timeout`` s, default 20 s) for its
chunks; the blob store retries a lost connection (~3 tries, <= ~10 s) and then the read
fails with EIO. A sandbox never hangs on a dead store. A cache disk that fills (ENOSPC) is
logged and counted (``cache_write_errors``); the read is still served from memory.

Example::

    server = LazyServer(Path("/var/lib/dsec/layers/lazy"))
    server.register(digest, size, "http://127.0.0.1:8080")
    erofs_file = server.file_path(digest)     # starts the server on first use
    mount_erofs(erofs_file, "/mnt/x")       # or through a loop device (no direct I/O)
    server.stats()["layers"][digest]["bytes_fetched"]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsec.errors import BlobDigestMismatch, DsecError, InvalidRequest, SandboxError
from dsec.layers.blobstore import BlobStore, open_blob_store
from dsec.layers.chunktable import PIECE, ChunkTable, fetch_chunk_table

__all__ = [
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_CHUNK_SIZE",
    "ChunkCache",
    "LayerStats",
    "LazyLayer",
    "LazyServer",
    "LazyStatsCollector",
    "cached_fraction",
    "chunk_span",
    "erofs_metadata_chunks",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 1 << 20
"""Bytes per chunk (1 MiB; see docs/design/lazy.md for the 256 KiB-4 MiB measurements)."""
DEFAULT_CACHE_BYTES = 20 << 30
"""Chunk cache bound, bytes (20 GiB)."""
DEFAULT_READ_TIMEOUT = 20.0
"""Seconds a FUSE read waits for its chunks before failing with EIO."""
DEFAULT_RECORD_SECONDS = 60.0
"""How long after its first read a layer's first start is recorded, seconds."""
DEFAULT_READAHEAD_CHUNKS = 0
"""Chunks fetched ahead of a sequential reader (off: on the benchmark it fetched 40% more
bytes for no speed-up at 100 MB/s; worth turning on for high-latency stores)."""
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_EROFS_SB_OFFSET = 1024
_EROFS_MAGIC = 0xE0F5E1E2
_PREFETCH_WORKERS = 4


def _hex_of(digest: str) -> str:
    m = _DIGEST_RE.match(digest)
    if m is None:
        raise InvalidRequest(f"invalid layer digest {digest!r}", digest=digest)
    return m.group(1)


def chunk_span(offset: int, length: int, chunk_size: int, file_size: int) -> range:
    """Indexes of the chunks that bytes ``[offset, offset + length)`` touch, clipped to the
    file (``file_size`` bytes). Empty for a read at or past the end or of length 0."""
    if chunk_size <= 0:
        raise InvalidRequest(f"chunk size must be positive, not {chunk_size}")
    end = min(offset + length, file_size)
    if offset < 0 or offset >= end:
        return range(0)
    return range(offset // chunk_size, (end - 1) // chunk_size + 1)


def chunk_count(file_size: int, chunk_size: int) -> int:
    """Number of chunks of a file of ``file_size`` bytes."""
    return (file_size + chunk_size - 1) // chunk_size


def erofs_metadata_chunks(head: bytes, chunk_size: int, file_size: int) -> list[int]:
    """The chunks holding EROFS metadata worth fetching up front, from the image's first
    chunk ``head``: chunk 0 (superblock) and the chunk of the root inode
    (``meta_blkaddr * block_size + root_nid * 32``). ``[0]`` if ``head`` is not EROFS."""
    if len(head) < _EROFS_SB_OFFSET + 44:
        return [0]
    magic, _, _, blkszbits, _, root_nid = struct.unpack_from("<IIIBBH", head, _EROFS_SB_OFFSET)
    if magic != _EROFS_MAGIC or not 9 <= blkszbits <= 16:
        return [0]
    (meta_blkaddr,) = struct.unpack_from("<I", head, _EROFS_SB_OFFSET + 40)
    root_off = (meta_blkaddr << blkszbits) + root_nid * 32
    chunks = {0}
    if 0 <= root_off < file_size:
        chunks.add(root_off // chunk_size)
    return sorted(chunks)


def cached_fraction(state_dir: Path, digest: str, size: int, chunk_size: int) -> float:
    """Fraction (0..1) of a remote layer's chunks present in the node's chunk cache under
    ``state_dir`` (no server needed). 1.0 for an empty layer."""
    total = chunk_count(size, chunk_size)
    if total == 0:
        return 1.0
    d = Path(state_dir) / "cache" / _hex_of(digest)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return 0.0
    present = sum(1 for n in names if n.isdigit() and int(n) < total)
    return min(1.0, present / total)


# --- chunk cache ---------------------------------------------------------------------------

_MAX_OPEN_CHUNKS = 256


@dataclass
class _OpenChunk:
    """An open chunk file shared by readers; closed once retired and unused."""

    fd: int
    users: int = 0
    retired: bool = False


class ChunkCache:
    """Chunks on local disk, ``<root>/<hex>/<index>``, bounded by ``max_bytes`` with LRU
    eviction. Thread-safe. Chunks are written to a temp file and renamed, so a crash never
    leaves a partial chunk under its name. The LRU order survives restarts approximately
    (rebuilt from file mtimes; a hit touches the file at most once a minute).

    Args:
        root: cache directory, created if missing.
        max_bytes: bound on the bytes of all cached chunks.
    """

    def __init__(self, root: Path, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[str, int], int] = OrderedDict()  # key -> bytes
        # open chunk files, most recently used last: keeping them open keeps the kernel's
        # readahead state, so the 128 KiB FUSE reads of one chunk do not each wait on disk
        self._fds: OrderedDict[tuple[str, int], _OpenChunk] = OrderedDict()
        self.used_bytes = 0
        self.bytes_written = 0
        self.evictions = 0
        self._load()

    def _load(self) -> None:
        found: list[tuple[float, tuple[str, int], int]] = []
        for layer_dir in self.root.iterdir():
            if not layer_dir.is_dir():
                continue
            for entry in os.scandir(layer_dir):
                if entry.name.isdigit():
                    st = entry.stat()
                    found.append((st.st_mtime, (layer_dir.name, int(entry.name)), st.st_size))
                else:  # a temp file of a write cut short
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
        for _, key, size in sorted(found):
            self._lru[key] = size
            self.used_bytes += size

    def _path(self, hex_: str, index: int) -> Path:
        return self.root / hex_ / str(index)

    def get(
        self, hex_: str, index: int, offset: int = 0, length: int | None = None
    ) -> bytes | None:
        """The cached chunk (or ``length`` bytes of it from ``offset``), or None. A hit
        becomes the most recently used."""
        try:
            with self._lock:
                if (hex_, index) not in self._lru:
                    return None
                self._lru.move_to_end((hex_, index))
                oc = self._acquire_fd((hex_, index))
            try:
                if length is None:
                    length = os.fstat(oc.fd).st_size - offset
                return os.pread(oc.fd, length, offset)
            finally:
                self._release_fd(oc)
        except FileNotFoundError:  # evicted meanwhile
            with self._lock:
                size = self._lru.pop((hex_, index), None)
                if size is not None:
                    self.used_bytes -= size
            return None

    def _acquire_fd(self, key: tuple[str, int]) -> _OpenChunk:
        """The open chunk file, opened if needed, with one more user (lock held)."""
        oc = self._fds.get(key)
        if oc is None:
            oc = _OpenChunk(os.open(self._path(*key), os.O_RDONLY | os.O_CLOEXEC))
            self._fds[key] = oc
            while len(self._fds) > _MAX_OPEN_CHUNKS:
                _, old = self._fds.popitem(last=False)
                self._retire(old)
        else:
            self._fds.move_to_end(key)
        oc.users += 1
        return oc

    def _release_fd(self, oc: _OpenChunk) -> None:
        with self._lock:
            oc.users -= 1
            if oc.retired and oc.users == 0:
                os.close(oc.fd)

    @staticmethod
    def _retire(oc: _OpenChunk) -> None:
        """Close an fd no longer cached, now or when its last reader is done (lock held)."""
        oc.retired = True
        if oc.users == 0:
            os.close(oc.fd)

    def contains(self, hex_: str, index: int) -> bool:
        """True if the chunk is cached (does not change the LRU order)."""
        with self._lock:
            return (hex_, index) in self._lru

    def count(self, hex_: str) -> int:
        """How many chunks of the layer are cached."""
        with self._lock:
            return sum(1 for h, _ in self._lru if h == hex_)

    def _evict_for(self, need: int) -> None:
        """Evict least recently used chunks until ``need`` more bytes fit (lock held)."""
        while self._lru and self.used_bytes + need > self.max_bytes:
            (h, i), size = self._lru.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1
            oc = self._fds.pop((h, i), None)
            if oc is not None:
                self._retire(oc)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(h, i))

    def put(self, hex_: str, index: int, data: bytes) -> int:
        """Store a chunk, evicting LRU chunks to stay under ``max_bytes``. A chunk larger
        than the whole bound is not cached.

        Returns:
            bytes written to disk (0 if already cached or too large).

        Raises:
            SandboxError: the cache disk is full (ENOSPC/EDQUOT even after evicting) or
                unwritable; ``details['errno']`` says which. Nothing partial is left.
        """
        if len(data) > self.max_bytes:
            return 0
        with self._lock:
            if (hex_, index) in self._lru:
                return 0
            self._evict_for(len(data))
        d = self.root / hex_
        tmp = d / f".{index}.{secrets.token_hex(4)}"
        for attempt in range(2):
            try:
                d.mkdir(exist_ok=True)
                with open(tmp, "wb") as f:
                    f.write(data)
                os.rename(tmp, self._path(hex_, index))
                break
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                if e.errno in (errno.ENOSPC, errno.EDQUOT) and attempt == 0:
                    with self._lock:  # make real room: drop a quarter of the cache, then retry
                        self._evict_for(len(data) + self.used_bytes // 4 + 1)
                    continue
                raise SandboxError(
                    f"chunk cache {self.root}: cannot write a chunk of {len(data)} bytes: "
                    f"{e.strerror}" + (" (cache disk full)" if e.errno == errno.ENOSPC else ""),
                    errno=e.errno,
                    path=str(self.root),
                ) from e
        written = len(data)
        with self._lock:
            if (hex_, index) not in self._lru:
                self._lru[(hex_, index)] = len(data)
                self.used_bytes += len(data)
            self.bytes_written += written
            self._evict_for(0)
        return written

    def close(self) -> None:
        """Close the cached chunk file descriptors (the cache stays on disk)."""
        with self._lock:
            for oc in self._fds.values():
                self._retire(oc)
            self._fds.clear()

    def drop(self, hex_: str | None = None) -> None:
        """Remove every cached chunk (of one layer if ``hex_``)."""
        with self._lock:
            for key in [k for k in self._lru if hex_ is None or k[0] == hex_]:
                self.used_bytes -= self._lru.pop(key)
                oc = self._fds.pop(key, None)
                if oc is not None:
                    self._retire(oc)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path(*key))


# --- one lazily loaded layer ---------------------------------------------------------------


@dataclass
class LayerStats:
    """Counters of one lazily served layer (bytes, counts, seconds)."""

    bytes_fetched: int = 0
    bytes_written: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    fetches: int = 0
    fetch_seconds_total: float = 0.0
    fetch_seconds_max: float = 0.0
    fetch_errors: int = 0
    cache_write_errors: int = 0
    prefetched_chunks: int = 0
    reads: int = 0
    warmed_bytes: int = 0  # read into the kernel's page cache by mount warm-ups
    integrity_errors: int = 0  # fetched chunks that did not match the chunk table
    last_error: str | None = None
    fetch_latencies: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly counters (the latency samples are summarised, not listed)."""
        out = asdict(self)
        lat = sorted(out.pop("fetch_latencies"))
        out["fetch_seconds_p50"] = lat[len(lat) // 2] if lat else 0.0
        out["fetch_seconds_p99"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else 0.0
        return out


class LazyLayer:
    """Reads of one remote layer, served from the chunk cache or fetched from its blob store.

    Concurrent reads of a missing chunk share one fetch (single-flight). Each read waits at
    most ``read_timeout`` seconds for its chunks, then raises.

    Args:
        digest: ``sha256:<hex>`` of the layer blob.
        size: blob size in bytes.
        store: where the blob lives.
        cache: the node's chunk cache.
        chunk_size: bytes per chunk.
        read_timeout: seconds a read waits for a chunk.
        readahead_chunks: when a read continues a sequential run (the chunk before it was
            read), fetch this many following chunks in the background (0 = off).
        chunk_table: digest of the layer's chunk table in ``store``
            (:mod:`dsec.layers.chunktable`): every fetched chunk is checked against it, and a
            chunk that does not match is fetched once more, then refused (EIO for the
            reader, nothing cached). None: chunks are not checked.
    """

    def __init__(
        self,
        digest: str,
        size: int,
        store: BlobStore,
        cache: ChunkCache,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        readahead_chunks: int = 0,
        chunk_table: str | None = None,
    ) -> None:
        self.digest = digest
        self.hex = _hex_of(digest)
        self.size = int(size)
        self.store = store
        self.cache = cache
        self.chunk_size = int(chunk_size)
        self.read_timeout = read_timeout
        self.readahead_chunks = readahead_chunks
        self._nchunks = chunk_count(self.size, self.chunk_size)
        self.stats = LayerStats()
        self.touched: dict[int, None] = {}  # first-touch order of chunks read (not prefetch)
        self._lock = threading.Lock()
        self._inflight: dict[int, concurrent.futures.Future[bytes]] = {}
        self._fetch_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=16, thread_name_prefix=f"dsec-lazy-{self.hex[:8]}"
        )
        self.chunk_table = chunk_table
        self._table: ChunkTable | None = None
        self._table_lock = threading.Lock()

    def _checked(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` from the store, checked against the chunk table
        (one more fetch on a mismatch: a damaged transfer is not a damaged blob)."""
        for attempt in (1, 2):
            data = self.store.read_range(self.digest, offset, length)
            if len(data) != length:
                raise SandboxError(
                    f"layer {self.digest} at {offset}: store returned {len(data)} of "
                    f"{length} bytes",
                    digest=self.digest,
                )
            if self.chunk_table is None:
                return data
            try:
                self._load_table().verify(offset, data, what=f"layer {self.digest}")
                return data
            except BlobDigestMismatch:
                with self._lock:
                    self.stats.integrity_errors += 1
                if attempt == 2:
                    raise
                log.warning(
                    "layer %s at %d: chunk table mismatch, fetching again", self.digest, offset
                )
        raise AssertionError("unreachable")

    def _load_table(self) -> ChunkTable:
        """The layer's chunk table, fetched and checked once."""
        assert self.chunk_table is not None
        with self._table_lock:
            if self._table is None:
                self._table = fetch_chunk_table(self.store, self.chunk_table, self.size)
            return self._table

    def close(self) -> None:
        """Stop the fetch threads (in-flight fetches finish)."""
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)

    def _fetch(self, index: int) -> bytes:
        offset = index * self.chunk_size
        length = min(self.chunk_size, self.size - offset)
        t0 = time.monotonic()
        try:
            data = self._checked(offset, length)
        except BaseException as e:
            with self._lock:
                self.stats.fetch_errors += 1
                self.stats.last_error = str(e)
            raise
        dt = time.monotonic() - t0
        with self._lock:
            self.stats.fetches += 1
            self.stats.bytes_fetched += len(data)
            self.stats.fetch_seconds_total += dt
            self.stats.fetch_seconds_max = max(self.stats.fetch_seconds_max, dt)
            if len(self.stats.fetch_latencies) < 100_000:
                self.stats.fetch_latencies.append(dt)
        try:
            written = self.cache.put(self.hex, index, data)
        except SandboxError as e:
            log.error("%s", e)
            written = 0
            with self._lock:
                self.stats.cache_write_errors += 1
                self.stats.last_error = str(e)
        with self._lock:
            self.stats.bytes_written += written
        return data

    def _chunk_future(self, index: int) -> tuple[concurrent.futures.Future[bytes], bool]:
        """The in-flight fetch of a chunk, starting one if none; and whether we started it."""
        with self._lock:
            fut = self._inflight.get(index)
            if fut is not None:
                return fut, False
            fut = self._fetch_pool.submit(self._fetch, index)
            self._inflight[index] = fut
        fut.add_done_callback(functools.partial(self._forget, index))
        return fut, True

    def _forget(self, index: int, _fut: object = None) -> None:
        with self._lock:
            self._inflight.pop(index, None)

    def chunk(
        self, index: int, *, prefetch: bool = False, start: int = 0, length: int | None = None
    ) -> bytes:
        """One chunk (or ``length`` bytes of it from ``start``), from the cache or fetched
        (deduplicated), waiting <= ``read_timeout`` seconds.

        Raises:
            TimeoutError after ``read_timeout`` s, or the store's error
            (RegistryUnavailable, LayerNotFound) after its own retries.
        """
        data = self.cache.get(self.hex, index, start, length)
        with self._lock:
            if not prefetch:
                self.touched.setdefault(index, None)
            if data is not None:
                if not prefetch:
                    self.stats.cache_hits += 1
                return data
            if not prefetch:
                self.stats.cache_misses += 1
            else:
                self.stats.prefetched_chunks += 1
        fut, _ = self._chunk_future(index)
        try:
            whole = fut.result(timeout=self.read_timeout)
            return whole[start:] if length is None else whole[start : start + length]
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.stats.fetch_errors += 1
                self.stats.last_error = f"chunk {index}: no data after {self.read_timeout} s"
            raise TimeoutError(
                f"layer {self.digest} chunk {index}: no data after {self.read_timeout} s"
            ) from None

    def read(self, offset: int, length: int, *, warm: bool = False) -> bytes:
        """Bytes ``[offset, offset + length)`` clipped to the layer. Misses of several chunks
        are fetched in parallel. ``warm``: a mount warm-up's read, counted as
        ``warmed_bytes`` and not as a reader's (no hit/miss, not recorded as touched)."""
        span = chunk_span(offset, length, self.chunk_size, self.size)
        with self._lock:
            if warm:
                self.stats.warmed_bytes += max(0, min(length, self.size - offset))
            else:
                self.stats.reads += 1
        if not span:
            return b""
        ahead = range(0)
        if self.readahead_chunks and span[0] > 0 and span[0] - 1 in self.touched:
            # sequential reading: fetch the next chunks in the background as well
            ahead = range(span[-1] + 1, min(span[-1] + 1 + self.readahead_chunks, self._nchunks))
        if len(span) > 1 or ahead:  # start all missing fetches before waiting on the first
            for i in (*span, *ahead):
                if not self.cache.contains(self.hex, i):
                    self._chunk_future(i)
        end = min(offset + length, self.size)
        parts = []
        for i in span:
            lo = max(offset, i * self.chunk_size)
            hi = min(end, (i + 1) * self.chunk_size)
            parts.append(
                self.chunk(i, prefetch=warm, start=lo - i * self.chunk_size, length=hi - lo)
            )
        return parts[0] if len(parts) == 1 else b"".join(parts)


# --- the FUSE server (child process) ---------------------------------------------------------


class _LazyFS:
    """The FUSE filesystem: ``/<hex>.erofs`` for each layer registered under
    ``<state>/layers/<hex>.json``. Built on mfusepy (libfuse3, multi-threaded)."""

    def __init__(
        self,
        state: Path,
        cache: ChunkCache,
        *,
        chunk_size: int,
        read_timeout: float,
        record_seconds: float,
        readahead_chunks: int = 0,
    ) -> None:
        self.state = state
        self.readahead_chunks = readahead_chunks
        self.cache = cache
        self.chunk_size = chunk_size
        self.read_timeout = read_timeout
        self.record_seconds = record_seconds
        self.layers: dict[str, LazyLayer] = {}  # hex -> layer
        self._stores: dict[str, BlobStore] = {}
        self._recording: dict[str, float] = {}  # hex -> recording deadline (monotonic)
        self._lock = threading.Lock()
        self._prefetch_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=_PREFETCH_WORKERS, thread_name_prefix="dsec-lazy-prefetch"
        )
        self.started = time.time_ns()
        # warm on mount: see _warm_on_open; DSEC_LAZY_WARM_ON_MOUNT=0 turns it off
        self.warm_on_mount = os.environ.get("DSEC_LAZY_WARM_ON_MOUNT", "1") != "0"
        self._warming: set[str] = set()
        # prefetch threads that have issued warm-ups: the FUSE requests a warm-up causes
        # carry the thread id, possibly after the warm-up returned (readahead is asynchronous)
        self._warm_tids: set[int] = set()
        (state / "records").mkdir(exist_ok=True)

    # layer table -------------------------------------------------------------------------

    def layer(self, hex_: str) -> LazyLayer | None:
        """The layer with this hex, loading its registration file on first use."""
        with self._lock:
            lay = self.layers.get(hex_)
            if lay is not None:
                return lay
            try:
                reg = json.loads((self.state / "layers" / f"{hex_}.json").read_text())
            except (FileNotFoundError, ValueError):
                return None
            url = reg["url"]
            store = self._stores.get(url)
            if store is None:
                store = self._stores[url] = open_blob_store(url)
            lay = LazyLayer(
                reg["digest"],
                reg["size"],
                store,
                self.cache,
                chunk_size=self.chunk_size,
                read_timeout=self.read_timeout,
                readahead_chunks=self.readahead_chunks,
                chunk_table=reg.get("chunk_table"),
            )
            self.layers[hex_] = lay
        self._start(lay)
        return lay

    def _record_path(self, hex_: str) -> Path:
        return self.state / "records" / f"{hex_}.json"

    def _start(self, lay: LazyLayer) -> None:
        """Prefetch metadata, then either the start record's chunks or begin recording."""
        self._prefetch_pool.submit(self._prefetch_metadata, lay)
        chunks = self._read_record(lay)
        if chunks is None:
            with self._lock:
                self._recording[lay.hex] = time.monotonic() + self.record_seconds
            return
        log.info("layer %s: prefetching %d recorded chunks", lay.digest, len(chunks))
        for i in chunks:
            self._prefetch_pool.submit(self._prefetch_one, lay, i)

    def _prefetch_metadata(self, lay: LazyLayer) -> None:
        try:
            head = lay.chunk(0, prefetch=True)
            for i in erofs_metadata_chunks(head, lay.chunk_size, lay.size):
                lay.chunk(i, prefetch=True)
        except (DsecError, OSError) as e:
            log.warning("layer %s: metadata prefetch failed: %s", lay.digest, e)

    def _prefetch_one(self, lay: LazyLayer, index: int) -> None:
        if lay.cache.contains(lay.hex, index):
            return
        try:
            lay.chunk(index, prefetch=True)
        except (DsecError, OSError) as e:
            log.debug("layer %s: prefetch of chunk %d failed: %s", lay.digest, index, e)

    def _read_record(self, lay: LazyLayer) -> list[int] | None:
        """The chunks a start of ``lay`` reads, in first-touch order, from its start record:
        None if there is no readable record yet, [] if it was made with another chunk size."""
        try:
            rec = json.loads(self._record_path(lay.hex).read_text())
            if rec["chunk_size"] != lay.chunk_size:
                return []
            return [int(i) for i in rec["chunks"]]
        except (FileNotFoundError, ValueError, KeyError):
            return None

    def _warm_on_open(self, lay: LazyLayer) -> None:
        """EROFS opens a layer's file once per mount: each mount is a start. Bring the chunks
        the layer's starts read into the kernel's page cache of the FUSE file, ahead of the
        readers and in large requests, so that the readers' EROFS reads are served from
        memory instead of each going through this process (on a warm node this is what stands
        between a lazy layer and a local one). The same prefetch fetches recorded chunks that
        are not cached yet. One warm-up per layer at a time; pages already cached cost
        nothing."""
        if not self.warm_on_mount:
            return
        with self._lock:
            if lay.hex in self._warming:
                return
            self._warming.add(lay.hex)
        self._prefetch_pool.submit(self._warm, lay)

    def _readahead_bytes(self) -> int:
        """The kernel's readahead window of the FUSE mount (its bdi's ``read_ahead_kb``)."""
        try:
            dev = os.stat(self.state / "mnt").st_dev
            knob = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
            with open(knob) as f:
                return max(4, int(f.read())) << 10
        except (OSError, ValueError):
            return 128 << 10

    def _warm(self, lay: LazyLayer) -> None:
        try:
            chunks = sorted(self._read_record(lay) or [])
            if not chunks:
                return
            # opening our own file comes back to open() and finds the warm-up running
            with self._lock:
                self._warm_tids.add(threading.get_native_id())
            fd = os.open(self.state / "mnt" / f"{lay.hex}.erofs", os.O_RDONLY | os.O_CLOEXEC)
            try:
                # WILLNEED starts asynchronous readahead (FUSE READs served by the other
                # threads) but the kernel caps one call at this file's readahead window:
                # step by it. SEQUENTIAL doubles the window of this fd only (half the FUSE
                # requests; the readers' window is unchanged).
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                step = 2 * self._readahead_bytes()
                for i in chunks:
                    start = i * lay.chunk_size
                    end = min(start + lay.chunk_size, lay.size)
                    for off in range(start, end, step):
                        os.posix_fadvise(fd, off, min(step, end - off), os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
            log.info("layer %s: warming %d recorded chunks", lay.digest, len(chunks))
        except OSError as e:
            log.warning("layer %s: warm-up failed: %s", lay.digest, e)
        finally:
            with self._lock:
                self._warming.discard(lay.hex)

    def flush_records(self, *, final: bool = False) -> None:
        """Write the start record of each layer still recording; stop those past their
        window (or all if ``final``)."""
        now = time.monotonic()
        with self._lock:
            items = list(self._recording.items())
        for hex_, deadline in items:
            lay = self.layers.get(hex_)
            if lay is None:
                continue
            with lay._lock:
                chunks = list(lay.touched)
            if chunks:
                path = self._record_path(hex_)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"chunk_size": lay.chunk_size, "chunks": chunks}))
                os.rename(tmp, path)
            if final or now >= deadline:
                with self._lock:
                    self._recording.pop(hex_, None)

    def stats(self) -> dict[str, Any]:
        """Per-layer and node totals (see :class:`LayerStats`), plus cache figures."""
        with self._lock:
            layers = dict(self.layers)
        per = {}
        for lay in layers.values():
            with lay._lock:
                d = lay.stats.as_dict()
            d["size"] = lay.size
            d["cached_chunks"] = self.cache.count(lay.hex)
            d["chunks"] = chunk_count(lay.size, lay.chunk_size)
            d["cached_fraction"] = d["cached_chunks"] / d["chunks"] if d["chunks"] else 1.0
            per[lay.digest] = d
        keys = (
            "bytes_fetched",
            "bytes_written",
            "cache_hits",
            "cache_misses",
            "fetches",
            "fetch_seconds_total",
            "fetch_errors",
            "cache_write_errors",
            "prefetched_chunks",
            "reads",
            "warmed_bytes",
            "integrity_errors",
        )
        node: dict[str, Any] = {k: sum(d[k] for d in per.values()) for k in keys}
        node["fetch_seconds_max"] = max((d["fetch_seconds_max"] for d in per.values()), default=0)
        node["cache_used_bytes"] = self.cache.used_bytes
        node["cache_max_bytes"] = self.cache.max_bytes
        node["cache_evictions"] = self.cache.evictions
        node["chunk_size"] = self.chunk_size
        return {"node": node, "layers": per, "pid": os.getpid()}

    # FUSE operations (mfusepy calls these from its worker threads) ------------------------

    def _path_hex(self, path: str) -> str | None:
        m = re.fullmatch(r"/([0-9a-f]{64})\.erofs", path)
        return m.group(1) if m else None

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if path == "/":
            return {
                "st_mode": stat.S_IFDIR | 0o555,
                "st_nlink": 2,
                "st_mtime": self.started,
                "st_ctime": self.started,
                "st_atime": self.started,
            }
        hex_ = self._path_hex(path)
        lay = self.layer(hex_) if hex_ else None
        if lay is None:
            raise OSError(errno.ENOENT, path)
        return {
            "st_mode": stat.S_IFREG | 0o444,
            "st_nlink": 1,
            "st_size": lay.size,
            "st_blocks": (lay.size + 511) // 512,
            "st_mtime": self.started,
            "st_ctime": self.started,
            "st_atime": self.started,
        }

    def readdir(self, path: str, fh: int) -> list[str]:
        if path != "/":
            raise OSError(errno.ENOTDIR, path)
        names = [p.stem for p in (self.state / "layers").glob("*.json")]
        return [".", "..", *(f"{n}.erofs" for n in sorted(names))]

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, path)
        hex_ = self._path_hex(path)
        lay = self.layer(hex_) if hex_ else None
        if lay is None:
            raise OSError(errno.ENOENT, path)
        self._warm_on_open(lay)
        return 0

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        hex_ = self._path_hex(path)
        lay = self.layer(hex_) if hex_ else None
        if lay is None:
            raise OSError(errno.ENOENT, path)
        try:
            return lay.read(offset, size, warm=self._from_warm_up())
        except (DsecError, OSError) as e:  # TimeoutError is an OSError
            log.error("read %s at %d+%d: %s", lay.digest, offset, size, e)
            raise OSError(errno.EIO, str(e)) from e

    def _from_warm_up(self) -> bool:
        """Whether the FUSE request being served comes from a warm-up of this server (the
        kernel puts the thread id of the task that caused it in the request)."""
        if not self._warm_tids:
            return False
        import mfusepy

        return mfusepy.fuse_get_context()[2] in self._warm_tids

    def statfs(self, path: str) -> dict[str, int]:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_namemax": 255}


def _control_loop(sock: socket.socket, fs: _LazyFS) -> None:
    """Answer JSON-lines requests on the control socket (one request per connection)."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(10)
                req = json.loads(conn.makefile("r").readline() or "{}")
                op = req.get("op")
                resp: dict[str, Any]
                if op == "ping":
                    resp = {"ok": True, "pid": os.getpid()}
                elif op == "stats":
                    resp = {"ok": True, **fs.stats()}
                elif op == "warm":
                    resp = {"ok": fs.layer(_hex_of(req["digest"])) is not None}
                elif op == "flush":
                    fs.flush_records()
                    resp = {"ok": True}
                elif op == "drop_cache":
                    fs.cache.drop()
                    resp = {"ok": True}
                else:
                    resp = {"ok": False, "error": f"unknown op {op!r}"}
            except Exception as e:
                resp = {"ok": False, "error": str(e)}
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(resp).encode() + b"\n")


def serve_forever(
    state: Path,
    *,
    chunk_size: int,
    cache_bytes: int,
    read_timeout: float,
    record_seconds: float,
    readahead_chunks: int = 0,
) -> None:
    """Run the node's FUSE server in this process (blocks until unmounted or SIGTERM)."""
    import mfusepy

    mnt = state / "mnt"
    cache = ChunkCache(state / "cache", cache_bytes)
    fs = _LazyFS(
        state,
        cache,
        chunk_size=chunk_size,
        read_timeout=read_timeout,
        record_seconds=record_seconds,
        readahead_chunks=readahead_chunks,
    )
    ops = type("LazyOps", (mfusepy.Operations,), {"use_ns": True})()
    for name in ("getattr", "readdir", "open", "read", "statfs"):
        setattr(ops, name, getattr(fs, name))
    sock_path = state / "ctl.sock"
    sock_path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    sock.listen(16)
    threading.Thread(target=_control_loop, args=(sock, fs), daemon=True).start()

    def flusher() -> None:
        while True:
            time.sleep(1.0)
            try:
                fs.flush_records()
            except OSError as e:
                log.warning("cannot write start records: %s", e)

    threading.Thread(target=flusher, daemon=True).start()
    try:
        mfusepy.FUSE(
            ops,
            str(mnt),
            foreground=True,
            ro=True,
            allow_other=True,
            fsname="dsec-lazy",
            subtype="dsec-lazy",
            kernel_cache=True,
            attr_timeout=3600,
            entry_timeout=3600,
            negative_timeout=0,
        )
    finally:
        fs.flush_records(final=True)
        cache.close()
        sock.close()
        sock_path.unlink(missing_ok=True)


# --- the client side: start, register, stop ------------------------------------------------


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _fuse_mount_at(mnt: Path) -> bool:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" ")
            if len(fields) > 4 and fields[4] == str(mnt):
                return True
    return False


class LazyServer:
    """Client of the node's lazy FUSE server: registers remote layers, starts the server on
    first use, reads its stats, stops it. Thread-safe.

    Args:
        state: the server's state directory (``$DSEC_HOME/layers/lazy``); holds ``mnt/``,
            ``layers/``, ``cache/``, ``records/``, ``ctl.sock`` and ``server.log``.
        chunk_size: bytes per chunk (default 1 MiB; 64 KiB-16 MiB).
        cache_bytes: chunk cache bound in bytes.
        read_timeout: seconds a FUSE read waits for data before EIO.
        record_seconds: length of a first start's recording window.
        readahead_chunks: chunks fetched ahead of a sequential reader (0 = off).
    """

    def __init__(
        self,
        state: Path,
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        record_seconds: float = DEFAULT_RECORD_SECONDS,
        readahead_chunks: int = DEFAULT_READAHEAD_CHUNKS,
    ) -> None:
        if not (64 << 10) <= chunk_size <= (16 << 20) or chunk_size % PIECE:
            raise InvalidRequest(
                f"chunk size {chunk_size}: a multiple of 64 KiB from 64 KiB to 16 MiB"
            )
        self.state = Path(os.path.abspath(state))
        self.mountpoint = self.state / "mnt"
        self.chunk_size = chunk_size
        self.cache_bytes = cache_bytes
        self.read_timeout = read_timeout
        self.record_seconds = record_seconds
        self.readahead_chunks = readahead_chunks
        for d in (self.state, self.state / "layers", self.state / "cache", self.mountpoint):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._adopted_pid: int | None = None  # a server another process started

    # registration -------------------------------------------------------------------------

    def register(self, digest: str, size: int, url: str, chunk_table: str | None = None) -> None:
        """Make ``<mnt>/<hex>.erofs`` serve the blob ``digest`` (``size`` bytes) from the
        store at ``url``, each fetched chunk checked against the chunk table ``chunk_table``
        (a digest in the same store) if given. Idempotent; atomic (temp file + rename)."""
        hex_ = _hex_of(digest)
        if chunk_table is not None:
            _hex_of(chunk_table)  # InvalidRequest for a malformed digest
        reg = self.state / "layers" / f"{hex_}.json"
        tmp = reg.with_suffix(f".{secrets.token_hex(4)}.tmp")
        doc = {"digest": digest, "size": int(size), "url": url, "chunk_table": chunk_table}
        tmp.write_text(json.dumps(doc))
        os.rename(tmp, reg)

    def unregister(self, digest: str) -> None:
        """Forget a layer (its cached chunks and start record too). Do it only while the
        layer is not mounted."""
        hex_ = _hex_of(digest)
        (self.state / "layers" / f"{hex_}.json").unlink(missing_ok=True)
        (self.state / "records" / f"{hex_}.json").unlink(missing_ok=True)
        shutil.rmtree(self.state / "cache" / hex_, ignore_errors=True)

    def file_path(self, digest: str) -> Path:
        """The FUSE-served file of a registered layer; starts the server if needed and asks it
        to fetch the layer's metadata.

        Raises:
            SandboxError: the server cannot start (no /dev/fuse, mfusepy/libfuse3 missing).
        """
        hex_ = _hex_of(digest)
        self.ensure_running()
        with contextlib.suppress(SandboxError):
            self._request({"op": "warm", "digest": digest})
        return self.mountpoint / f"{hex_}.erofs"

    def cached_fraction(self, digest: str, size: int) -> float:
        """Fraction of the layer's chunks in the chunk cache (0..1)."""
        return cached_fraction(self.state, digest, size, self.chunk_size)

    # process ------------------------------------------------------------------------------

    def _request(self, req: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(timeout)
                s.connect(str(self.state / "ctl.sock"))
                s.sendall(json.dumps(req).encode() + b"\n")
                line = s.makefile("r").readline()
        except OSError as e:
            raise SandboxError(f"lazy layer server at {self.state} is not answering: {e}") from e
        resp: dict[str, Any] = json.loads(line or '{"ok": false, "error": "no answer"}')
        if not resp.get("ok"):
            raise SandboxError(f"lazy layer server: {resp.get('error')}")
        return resp

    def running(self) -> bool:
        """True if the server this object started or adopted is alive."""
        if self._proc is not None:
            return self._proc.poll() is None
        return self._adopted_pid is not None and _pid_alive(self._adopted_pid)

    @property
    def pid(self) -> int | None:
        """The server's pid (started or adopted), or None."""
        if self._proc is not None:
            return self._proc.pid
        return self._adopted_pid

    def _adopt(self) -> bool:
        """Take over a server that already serves this state directory (one started by a
        ``dsec serve`` that has since exited or been killed: the server outlives it, so the
        sandboxes reading its layers keep working). True if there is one (lock held)."""
        if not (self.state / "ctl.sock").exists() or not _fuse_mount_at(self.mountpoint):
            return False
        try:
            resp = self._request({"op": "ping"}, timeout=2.0)
            os.statvfs(self.mountpoint)
        except (SandboxError, OSError):
            return False
        pid = resp.get("pid")
        if not isinstance(pid, int) or not _pid_alive(pid):
            return False
        self._proc, self._adopted_pid = None, pid
        log.info("lazy layers: adopted the running server (pid %d)", pid)
        return True

    def mounted_layers(self) -> list[str]:
        """Mount points of EROFS mounts of this server's files (sandboxes' layers), from the
        file or through a loop device bound to it."""
        from dsec.layers.mounts import mountinfo_entries

        prefix = f"{self.mountpoint}/"
        return [
            str(e.mountpoint)
            for e in mountinfo_entries()
            if e.fstype == "erofs" and e.source_file.startswith(prefix)
        ]

    def _reachable(self) -> bool:
        """True if a server (ours or another process's, e.g. ``dsec serve``) answers."""
        if self.running():
            return True
        if not (self.state / "ctl.sock").exists():
            return False
        try:
            self._request({"op": "ping"}, timeout=2.0)
        except SandboxError:
            return False
        return True

    def clean_stale(self, *, force: bool = False) -> None:
        """Detach a FUSE mount left at the mountpoint by a server that died (``statvfs``
        fails with ENOTCONN); with ``force``, whatever FUSE mount is there (after stopping our
        own server). A live server of another process is left alone."""
        if not _fuse_mount_at(self.mountpoint):
            return
        if not force:
            try:
                os.statvfs(self.mountpoint)
                return  # alive: another process's server (e.g. ``dsec serve``) owns it
            except OSError:
                pass
        if _fuse_mount_at(self.mountpoint):
            log.warning("lazy layers: detaching stale FUSE mount at %s", self.mountpoint)
            from dsec.privileged.mount import MNT_DETACH, umount

            with contextlib.suppress(OSError):
                umount(self.mountpoint, MNT_DETACH)

    def ensure_running(self) -> None:
        """Start the server if it is not running (detaching a stale mount first); waits
        until it serves (<= 15 s). Raises SandboxError if it cannot start."""
        with self._lock:
            if self.running() or self._adopt():
                return
            self.clean_stale()
            if not os.path.exists("/dev/fuse"):
                raise SandboxError("lazy layers need /dev/fuse (FUSE kernel module)")
            logf = open(self.state / "server.log", "ab")
            cmd = [
                sys.executable,
                "-m",
                "dsec.layers.lazy",
                "--state",
                str(self.state),
                "--chunk-size",
                str(self.chunk_size),
                "--cache-bytes",
                str(self.cache_bytes),
                "--read-timeout",
                str(self.read_timeout),
                "--record-seconds",
                str(self.record_seconds),
                "--readahead-chunks",
                str(self.readahead_chunks),
            ]
            try:
                # its own session, no parent-death signal: the server is the node's and
                # outlives the process that started it (see stop)
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=logf,
                    close_fds=True,
                    start_new_session=True,
                )
                self._adopted_pid = None
            finally:
                logf.close()
            deadline = time.monotonic() + 15.0
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if _fuse_mount_at(self.mountpoint):
                    with contextlib.suppress(SandboxError):
                        self._request({"op": "ping"}, timeout=1.0)
                        self._set_fuse_readahead()
                        return
                time.sleep(0.02)
            tail = (self.state / "server.log").read_bytes()[-2000:].decode(errors="replace")
            self._stop_locked()
            raise SandboxError(
                f"lazy layer server did not start (log {self.state / 'server.log'}): {tail}"
            )

    def _set_fuse_readahead(self) -> None:
        """Set the kernel's readahead window for the FUSE files to
        ``DSEC_LAZY_FUSE_READAHEAD_KB`` KiB if set (default: the kernel's 128 KiB). 1024 gives
        1 MiB FUSE requests (8x fewer) but on the benchmark it fetched chunks past the start
        record on warm starts and once stalled a warm start (16.8 s vs 2.2 s), so it is off.
        Files opened later (EROFS mounts) pick the window up at open."""
        kib = os.environ.get("DSEC_LAZY_FUSE_READAHEAD_KB")
        if not kib:
            return
        dev = os.stat(self.mountpoint).st_dev
        knob = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
        try:
            knob.write_text(kib)
        except OSError as e:
            log.warning("cannot set FUSE readahead (%s): %s", knob, e)

    def stats(self) -> dict[str, Any]:
        """``{"node": {...}, "layers": {digest: {...}}}`` from the node's server (bytes,
        counts, seconds), whichever process runs it; empty counters if none answers."""
        if not self._reachable():
            return {"node": {}, "layers": {}, "running": False}
        resp = self._request({"op": "stats"})
        resp.pop("ok", None)
        resp["running"] = True
        return resp

    def flush_records(self) -> None:
        """Ask the server to write its start records now."""
        if self._reachable():
            self._request({"op": "flush"})

    def drop_cache(self) -> None:
        """Empty the chunk cache (server running or not)."""
        if self._reachable():
            self._request({"op": "drop_cache"})
        else:
            ChunkCache(self.state / "cache", self.cache_bytes).drop()

    def stop(self, timeout: float = 10.0, *, force: bool = False) -> None:
        """Stop the server this object started or adopted (SIGTERM: libfuse unmounts) and
        make sure nothing stays mounted, unless EROFS mounts of its files remain (sandboxes
        still running on its layers, e.g. across a ``dsec serve`` restart): then the server is
        left running for them and the next store adopts it. ``force`` stops it anyway (its
        mounts then fail with EIO/ENOTCONN)."""
        with self._lock:
            if not force and self.running():
                busy = self.mounted_layers()
                if busy:
                    log.info(
                        "lazy layers: %d layer mounts in use, the server (pid %s) keeps running",
                        len(busy),
                        self.pid,
                    )
                    self._proc, self._adopted_pid = None, None
                    return
            self._stop_locked(timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop whatever server serves this state directory, started here or not, mounts or
        not (operators' and tests' clean-up: the layers' EROFS mounts then fail)."""
        with self._lock:
            if not self.running():
                self._adopt()
            self._stop_locked(timeout)
            self.clean_stale(force=True)

    def _stop_locked(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        adopted, self._adopted_pid = self._adopted_pid, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        elif adopted is not None and _pid_alive(adopted):
            with contextlib.suppress(ProcessLookupError):
                os.kill(adopted, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while _pid_alive(adopted) and time.monotonic() < deadline:
                time.sleep(0.02)
            with contextlib.suppress(ProcessLookupError):
                os.kill(adopted, signal.SIGKILL)
        elif proc is None and adopted is None:
            return
        self.clean_stale(force=True)


_METRIC_FIELDS = (
    ("bytes_fetched", "dsec_lazy_bytes_fetched", "Bytes fetched from blob stores"),
    ("bytes_written", "dsec_lazy_bytes_written", "Bytes written to the local chunk cache"),
    ("cache_hits", "dsec_lazy_cache_hits", "Chunk reads served from the chunk cache"),
    ("cache_misses", "dsec_lazy_cache_misses", "Chunk reads that had to fetch"),
    ("fetches", "dsec_lazy_fetches", "Chunk fetches from blob stores"),
    ("fetch_seconds_total", "dsec_lazy_fetch_seconds", "Seconds spent fetching chunks"),
    ("fetch_errors", "dsec_lazy_fetch_errors", "Chunk fetches that failed or timed out"),
    ("prefetched_chunks", "dsec_lazy_prefetched_chunks", "Chunks fetched ahead of reads"),
    ("warmed_bytes", "dsec_lazy_warmed_bytes", "Bytes read into page cache by mount warm-ups"),
    ("integrity_errors", "dsec_lazy_integrity_errors", "Fetched chunks refused by the chunk table"),
)


class LazyStatsCollector:
    """Prometheus collector of on-demand loading counters, per layer (``layer`` label = the
    digest's first 16 hex) and per node, computed at scrape time from ``stats`` (a
    ``LayerStore.lazy_stats``-shaped callable). Counters restart with the FUSE server."""

    def __init__(self, node: str, stats: Callable[[], dict[str, Any]]) -> None:
        self._node = node
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        try:
            stats = self._stats()
        except (DsecError, OSError) as e:
            log.warning("lazy layer stats unavailable: %s", e)
            return
        layers: dict[str, dict[str, Any]] = stats.get("layers", {})
        for key, name, doc in _METRIC_FIELDS:
            fam = CounterMetricFamily(name, doc, labels=["node", "layer"])
            for digest, d in layers.items():
                fam.add_metric([self._node, digest[7:23]], float(d.get(key, 0)))
            yield fam
        frac = GaugeMetricFamily(
            "dsec_lazy_cached_fraction",
            "Fraction of a remote layer's chunks in the chunk cache",
            labels=["node", "layer"],
        )
        for digest, d in layers.items():
            frac.add_metric([self._node, digest[7:23]], float(d.get("cached_fraction", 0)))
        yield frac
        node = stats.get("node", {})
        used = GaugeMetricFamily(
            "dsec_lazy_cache_used_bytes", "Bytes in the chunk cache", labels=["node"]
        )
        used.add_metric([self._node], float(node.get("cache_used_bytes", 0)))
        yield used


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsec.layers.lazy", description=__doc__)
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    p.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT)
    p.add_argument("--record-seconds", type=float, default=DEFAULT_RECORD_SECONDS)
    p.add_argument("--readahead-chunks", type=int, default=DEFAULT_READAHEAD_CHUNKS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    serve_forever(
        args.state,
        chunk_size=args.chunk_size,
        cache_bytes=args.cache_bytes,
        read_timeout=args.read_timeout,
        record_seconds=args.record_seconds,
        readahead_chunks=args.readahead_chunks,
    )
    return 0


def iter_lazy_sources(state: Path) -> Iterator[str]:
    """Digests registered with the lazy server under ``state``."""
    for p in (Path(state) / "layers").glob("*.json"):
        yield f"sha256:{p.stem}"


if __name__ == "__main__":
    sys.exit(_main())
