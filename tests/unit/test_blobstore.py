"""Blob stores (dir, fs, http) and the lazy loader's parts that need no FUSE: chunk math,
the chunk cache (LRU bound, restart, disk full), single-flight fetches, bounded waits and
typed errors for corrupt, truncated or unreachable stores."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from tests.timing import budget

from dsec.errors import (
    BlobDigestMismatch,
    InvalidRequest,
    LayerNotFound,
    RegistryUnavailable,
    SandboxError,
)
from dsec.layers.blobserver import BlobHTTPServer, TokenBucket
from dsec.layers.blobstore import (
    BlobStore,
    HttpBlobStore,
    LocalDirStore,
    SharedFsStore,
    blob_store_schemes,
    open_blob_store,
    register_blob_store,
)
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.lazy import (
    ChunkCache,
    LazyLayer,
    cached_fraction,
    chunk_span,
    erofs_metadata_chunks,
)
from dsec.layers.store import LayerStore

KIB = 1024


def _blob(tmp_path: Path, size: int, name: str = "blob") -> tuple[Path, str]:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path, "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def dir_store(tmp_path: Path) -> LocalDirStore:
    return LocalDirStore(tmp_path / "store")


# --- chunk math ----------------------------------------------------------------------------


def test_chunk_span_covers_exactly_the_touched_chunks() -> None:
    assert list(chunk_span(0, 1, 100, 1000)) == [0]
    assert list(chunk_span(99, 2, 100, 1000)) == [0, 1]
    assert list(chunk_span(100, 100, 100, 1000)) == [1]
    assert list(chunk_span(950, 500, 100, 1000)) == [9]  # clipped to the file
    assert list(chunk_span(1000, 10, 100, 1000)) == []  # at the end
    assert list(chunk_span(5, 0, 100, 1000)) == []
    assert list(chunk_span(0, 1000, 100, 1001)) == list(range(10))
    with pytest.raises(InvalidRequest):
        chunk_span(0, 1, 0, 10)


def test_erofs_metadata_chunks_finds_root_inode(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "data").write_bytes(os.urandom(3 << 20))
    (src / "hello").write_text("hi\n")
    img = tmp_path / "img.erofs"
    mkfs_erofs(src, img, compress=None)
    size = img.stat().st_size
    head = img.read_bytes()[: 64 * KIB]
    chunks = erofs_metadata_chunks(head, 64 * KIB, size)
    assert chunks[0] == 0 and all(0 <= c < (size + 65535) // 65536 for c in chunks)
    assert erofs_metadata_chunks(b"\0" * 4096, 64 * KIB, size) == [0]  # not EROFS


# --- blob stores ---------------------------------------------------------------------------


def test_open_blob_store_schemes(tmp_path: Path) -> None:
    assert isinstance(open_blob_store(f"dir://{tmp_path}/a"), LocalDirStore)
    fs = open_blob_store(f"fs://{tmp_path}/b")
    assert isinstance(fs, SharedFsStore) and fs.url == f"fs://{tmp_path}/b"
    http = open_blob_store("http://127.0.0.1:9/x")
    assert isinstance(http, HttpBlobStore) and isinstance(http, BlobStore)
    for bad in ("ftp://x/y", "dir://relative", "nonsense"):
        with pytest.raises(InvalidRequest):
            open_blob_store(bad)
    assert {"dir", "fs", "http", "https", "oci"} <= set(blob_store_schemes())


def test_a_blob_store_is_added_by_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new scheme is a registration (or a package's ``dsec.blob_stores`` entry point), not
    an edit of :func:`open_blob_store`."""
    from dsec.layers import blobstore

    monkeypatch.setattr(blobstore, "_FACTORIES", dict(blobstore._FACTORIES))
    with pytest.raises(InvalidRequest, match="unknown blob store URL"):
        open_blob_store("mem://bucket")
    opened: list[str] = []

    def open_mem(url: str) -> BlobStore:
        opened.append(url)
        return LocalDirStore(tmp_path / "mem")

    register_blob_store("mem", open_mem)
    assert isinstance(open_blob_store("mem://bucket"), LocalDirStore)
    assert opened == ["mem://bucket"] and "mem" in blob_store_schemes()
    with pytest.raises(ValueError):
        register_blob_store("not a scheme", open_mem)


def test_dir_store_round_trip(tmp_path: Path, dir_store: LocalDirStore) -> None:
    path, digest = _blob(tmp_path, 300 * KIB)
    assert not dir_store.has(digest)
    with pytest.raises(LayerNotFound):
        dir_store.stat(digest)
    dir_store.put(path, digest)
    dir_store.put(path, digest)  # idempotent
    assert dir_store.has(digest) and dir_store.stat(digest) == 300 * KIB
    data = path.read_bytes()
    assert dir_store.read_range(digest, 1000, 5000) == data[1000:6000]
    assert dir_store.read_range(digest, 300 * KIB - 10, 100) == data[-10:]
    assert dir_store.fetch(digest, tmp_path / "out" / "copy") == 300 * KIB
    assert (tmp_path / "out" / "copy").read_bytes() == data


def test_put_refuses_wrong_digest(tmp_path: Path, dir_store: LocalDirStore) -> None:
    path, _ = _blob(tmp_path, 10 * KIB)
    wrong = "sha256:" + "0" * 64
    with pytest.raises(BlobDigestMismatch):
        dir_store.put(path, wrong)
    assert not dir_store.has(wrong)
    assert list((dir_store.root / "tmp").iterdir()) == []


def test_fetch_of_corrupt_blob_is_refused_and_leaves_nothing(
    tmp_path: Path, dir_store: LocalDirStore
) -> None:
    path, digest = _blob(tmp_path, 100 * KIB)
    dir_store.put(path, digest)
    blob = dir_store.blob_path(digest)
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:  # flip one byte (a fixed byte is already there 1 in 256 runs)
        f.seek(5000)
        byte = f.read(1)[0]
        f.seek(5000)
        f.write(bytes([byte ^ 0xFF]))
    dest = tmp_path / "dl" / "layer"
    with pytest.raises(BlobDigestMismatch):
        dir_store.fetch(digest, dest)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_http_store_ranges_fetch_and_not_found(tmp_path: Path, dir_store: LocalDirStore) -> None:
    path, digest = _blob(tmp_path, 700 * KIB)
    dir_store.put(path, digest)
    data = path.read_bytes()
    with BlobHTTPServer(dir_store.root) as srv:
        store = HttpBlobStore(srv.url)
        assert store.stat(digest) == 700 * KIB and store.has(digest)
        assert store.read_range(digest, 123, 4567) == data[123 : 123 + 4567]
        assert store.read_range(digest, 700 * KIB - 5, 100) == data[-5:]
        assert store.fetch(digest, tmp_path / "copy") == 700 * KIB
        assert (tmp_path / "copy").read_bytes() == data
        missing = "sha256:" + "1" * 64
        assert not store.has(missing)
        with pytest.raises(LayerNotFound):
            store.read_range(missing, 0, 10)
        store.close()


def test_http_truncated_transfer_is_an_error(tmp_path: Path, dir_store: LocalDirStore) -> None:
    path, digest = _blob(tmp_path, 2048 * KIB)
    dir_store.put(path, digest)
    with BlobHTTPServer(dir_store.root) as srv:
        srv.fail_after_bytes = 100 * KIB  # every connection is cut after 100 KiB in total
        store = HttpBlobStore(srv.url, timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable):
            store.read_range(digest, 0, 1024 * KIB)
        dest = tmp_path / "dl" / "copy"
        with pytest.raises(RegistryUnavailable):
            store.fetch(digest, dest)
        assert time.monotonic() - t0 < budget(20)  # each cut connection failed, none hung
        assert not dest.exists() and list(dest.parent.iterdir()) == []
        store.close()


def test_dead_server_fails_within_bounded_time(tmp_path: Path, dir_store: LocalDirStore) -> None:
    path, digest = _blob(tmp_path, 10 * KIB)
    dir_store.put(path, digest)
    srv = BlobHTTPServer(dir_store.root)
    store = HttpBlobStore(srv.url, timeout=1.0)
    assert store.read_range(digest, 0, 10) == path.read_bytes()[:10]
    srv.close()
    t0 = time.monotonic()
    with pytest.raises(RegistryUnavailable):
        store.read_range(digest, 0, 10)
    assert time.monotonic() - t0 < budget(12)  # refused or timed out (1 s), never hung
    store.close()


def test_token_bucket_limits_rate() -> None:
    bucket = TokenBucket(20e6)  # 20 MB/s
    t0 = time.monotonic()
    for _ in range(20):
        bucket.take(250_000)  # 5 MB in all
    elapsed = time.monotonic() - t0
    # 5 MB minus a 2 MB burst at 20 MB/s: >= 0.15 s (it throttles); the upper bound only says
    # it does not throttle far below the rate (2 s would be 2.5 MB/s on an idle machine)
    assert 0.15 < elapsed < budget(2.0)


# --- chunk cache ---------------------------------------------------------------------------


def test_chunk_cache_lru_eviction_and_restart(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "cache", max_bytes=3 * 100)
    for i in range(3):
        cache.put("a" * 64, i, bytes([i]) * 100)
    assert cache.get("a" * 64, 0) == b"\0" * 100  # 0 becomes most recently used
    cache.put("a" * 64, 3, b"3" * 100)  # evicts 1, the least recently used
    assert cache.get("a" * 64, 1) is None
    assert [cache.contains("a" * 64, i) for i in range(4)] == [True, False, True, True]
    assert cache.used_bytes == 300 and cache.evictions == 1 and cache.bytes_written == 400
    assert not (tmp_path / "cache" / ("a" * 64) / "1").exists()
    cache.put("a" * 64, 9, b"x" * 1000)  # larger than the bound: not cached
    assert not cache.contains("a" * 64, 9)
    (tmp_path / "cache" / ("a" * 64) / ".7.tmp").write_bytes(b"partial")
    again = ChunkCache(tmp_path / "cache", max_bytes=300)
    assert again.used_bytes == 300 and again.count("a" * 64) == 3
    assert not (tmp_path / "cache" / ("a" * 64) / ".7.tmp").exists()
    digest = "sha256:" + "a" * 64
    assert cached_fraction(tmp_path, digest, 10 * 100, 100) == 0.3  # 3 of 10 chunks
    again.drop()
    assert again.used_bytes == 0 and again.get("a" * 64, 0) is None


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (tmpfs)")
def test_chunk_cache_disk_full_is_a_clear_error(tmp_path: Path) -> None:
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True)
    try:
        (mnt / "filler").write_bytes(b"\0" * 200 * KIB)  # not the cache's: cannot be evicted
        cache = ChunkCache(mnt / "cache", max_bytes=10 << 20)
        with pytest.raises(SandboxError, match="cache disk full") as ei:
            cache.put("b" * 64, 0, b"y" * 128 * KIB)
        assert ei.value.details["errno"] == 28
        assert cache.used_bytes == 0 and list((mnt / "cache" / ("b" * 64)).iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# --- lazy layer reads ----------------------------------------------------------------------


class _CountingStore:
    """A BlobStore wrapper that counts range reads, can delay or truncate them."""

    def __init__(self, inner: LocalDirStore, *, delay: float = 0.0, truncate: bool = False):
        self.inner = inner
        self.url = inner.url
        self.delay = delay
        self.truncate = truncate
        self.calls: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def stat(self, digest: str) -> int:
        return self.inner.stat(digest)

    def has(self, digest: str) -> bool:
        return self.inner.has(digest)

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        with self._lock:
            self.calls.append((offset, length))
        time.sleep(self.delay)
        data = self.inner.read_range(digest, offset, length)
        return data[: len(data) // 2] if self.truncate else data

    def fetch(self, digest: str, dest: Path) -> int:
        return self.inner.fetch(digest, dest)

    def put(self, path: Path, digest: str) -> None:
        self.inner.put(path, digest)


def _lazy(
    tmp_path: Path, dir_store: LocalDirStore, size: int, **kw: object
) -> tuple[LazyLayer, _CountingStore, bytes]:
    path, digest = _blob(tmp_path, size)
    dir_store.put(path, digest)
    store = _CountingStore(
        dir_store,
        delay=float(kw.pop("delay", 0.0)),  # type: ignore[arg-type]
        truncate=bool(kw.pop("truncate", False)),
    )
    cache = ChunkCache(tmp_path / "cache", max_bytes=int(kw.pop("cache_bytes", 1 << 30)))  # type: ignore[call-overload]
    layer = LazyLayer(digest, size, store, cache, chunk_size=64 * KIB, **kw)  # type: ignore[arg-type]
    return layer, store, path.read_bytes()


def test_lazy_reads_fetch_only_touched_chunks_then_hit_cache(
    tmp_path: Path, dir_store: LocalDirStore
) -> None:
    layer, store, data = _lazy(tmp_path, dir_store, 1000 * KIB)
    assert layer.read(70 * KIB, 100) == data[70 * KIB : 70 * KIB + 100]  # chunk 1
    assert layer.read(60 * KIB, 10 * KIB) == data[60 * KIB : 70 * KIB]  # chunks 0 and 1
    assert layer.read(999 * KIB, 10 * KIB) == data[999 * KIB :]  # last, short chunk
    assert sorted(o // (64 * KIB) for o, _ in store.calls) == [0, 1, 15]
    assert store.calls[-1] == (15 * 64 * KIB, 1000 * KIB - 15 * 64 * KIB)
    s = layer.stats
    assert s.cache_misses == 3 and s.cache_hits == 1 and s.fetches == 3
    assert s.bytes_fetched == 2 * 64 * KIB + (1000 - 960) * KIB == s.bytes_written
    assert list(layer.touched) == [1, 0, 15]
    layer.close()


def test_concurrent_reads_of_one_chunk_share_one_fetch(
    tmp_path: Path, dir_store: LocalDirStore
) -> None:
    layer, store, data = _lazy(tmp_path, dir_store, 256 * KIB, delay=0.3)
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(layer.read(i * 1000, 100)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store.calls) == 1
    assert sorted(results) == sorted(data[i * 1000 : i * 1000 + 100] for i in range(8))
    layer.close()


def test_truncated_store_read_is_an_error_not_bad_data(
    tmp_path: Path, dir_store: LocalDirStore
) -> None:
    layer, _, _ = _lazy(tmp_path, dir_store, 200 * KIB, truncate=True)
    with pytest.raises(SandboxError, match="returned"):
        layer.read(0, 100)
    assert layer.stats.fetch_errors == 1 and layer.cache.used_bytes == 0
    layer.close()


def test_stalled_store_read_times_out(tmp_path: Path, dir_store: LocalDirStore) -> None:
    layer, _, _ = _lazy(tmp_path, dir_store, 200 * KIB, delay=3.0, read_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        layer.read(0, 100)
    assert time.monotonic() - t0 < budget(2.0)  # the 0.5 s read time-out, not the 3 s fetch
    layer.close()


def test_lazy_read_from_dead_http_server_is_an_error(
    tmp_path: Path, dir_store: LocalDirStore
) -> None:
    path, digest = _blob(tmp_path, 128 * KIB)
    dir_store.put(path, digest)
    srv = BlobHTTPServer(dir_store.root)
    store = HttpBlobStore(srv.url, timeout=1.0)
    layer = LazyLayer(digest, 128 * KIB, store, ChunkCache(tmp_path / "c"), chunk_size=64 * KIB)
    assert layer.read(0, 10) == path.read_bytes()[:10]
    srv.close()
    t0 = time.monotonic()
    with pytest.raises(RegistryUnavailable):
        layer.read(100 * KIB, 10)
    assert time.monotonic() - t0 < budget(12)  # refused or timed out (1 s), never hung
    assert layer.read(5, 5) == path.read_bytes()[5:10]  # cached chunk still served
    layer.close()
    store.close()


def test_cache_full_still_serves_reads(tmp_path: Path, dir_store: LocalDirStore) -> None:
    layer, _, data = _lazy(tmp_path, dir_store, 256 * KIB, cache_bytes=100 * KIB)
    for i in range(4):  # each chunk evicts the previous one
        assert layer.read(i * 64 * KIB, 10) == data[i * 64 * KIB : i * 64 * KIB + 10]
    assert layer.cache.used_bytes == 64 * KIB and layer.cache.evictions == 3
    layer.close()


def test_http_put_streams_and_verifies(tmp_path: Path, dir_store: LocalDirStore) -> None:
    path, digest = _blob(tmp_path, 1500 * KIB)
    with BlobHTTPServer(dir_store.root) as srv:
        store = HttpBlobStore(srv.url)
        store.put(path, digest)
        store.put(path, digest)  # idempotent
        assert dir_store.blob_path(digest).read_bytes() == path.read_bytes()
        with pytest.raises(BlobDigestMismatch):
            store.put(path, "sha256:" + "2" * 64)
        store.close()


# --- remote layers in the LayerStore (no FUSE needed) ---------------------------------------


def test_layer_store_remote_layer_full_fetch(tmp_path: Path, dir_store: LocalDirStore) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    img = tmp_path / "l.erofs"
    mkfs_erofs(src, img, compress=None)
    digest = "sha256:" + hashlib.sha256(img.read_bytes()).hexdigest()
    dir_store.put(img, digest)
    store = LayerStore(tmp_path / "layers", tmp_path / "images")
    with pytest.raises(InvalidRequest):
        store.add_remote_layer(digest, img.stat().st_size, "ftp://nowhere/x")
    info = store.add_remote_layer(
        digest, img.stat().st_size, dir_store.url, {"kind": "toolkit", "name": "t"}
    )
    assert (info.kind, info.name, info.meta["blob_store"]) == ("toolkit", "t", dir_store.url)
    assert store.remote_source(digest) == dir_store.url and not store.is_local(digest)
    assert store.cached_fraction(digest) == 0.0
    assert store.lazy_stats()["running"] is False
    store.close()
    store = LayerStore(tmp_path / "layers", tmp_path / "images")  # start-up repair keeps it
    assert store.get_layer(digest).digest == digest
    store.fetch_layer(digest)
    assert store.is_local(digest) and store.cached_fraction(digest) == 1.0
    assert store.layer_path(digest).read_bytes() == img.read_bytes()
    store.close()
