"""Root tests of lazily loaded layers: EROFS mounted from a file served by the node's FUSE
server, data fetched in chunks from a blob store behind a loopback HTTP range server.

Every test uses its own DSEC_HOME-like directory and asserts that nothing stays mounted
under it and that the FUSE server process is gone after ``LayerStore.close()``.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.timing import budget

from dsec.errors import BlobDigestMismatch
from dsec.layers.blobserver import BlobHTTPServer
from dsec.layers.blobstore import LocalDirStore
from dsec.layers.chunktable import publish_chunk_table
from dsec.layers.erofs import mkfs_erofs
from dsec.layers.mounts import LayerMounts, mountinfo_entries
from dsec.layers.store import LayerStore
from dsec.privileged.mount import umount

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (FUSE and EROFS mounts)"),
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="needs /dev/fuse"),
]

KIB = 1024
CHUNK = 256 * KIB


def _mounts_under(home: Path) -> list[str]:
    return [
        f"{e.fstype} {e.mountpoint}"
        for e in mountinfo_entries()
        if str(e.mountpoint).startswith(f"{home}/") or e.source.startswith(f"{home}/")
    ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is as good as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    leftovers = _mounts_under(tmp_path)
    for e in sorted(mountinfo_entries(tmp_path), key=lambda e: -len(e.mountpoint.parts)):
        os.system(f"umount -l {e.mountpoint} 2>/dev/null")
    assert leftovers == []


@pytest.fixture
def remote(home: Path) -> Iterator[tuple[BlobHTTPServer, str, int, bytes]]:
    """A 4 MiB-data EROFS layer published to a dir store served over loopback HTTP."""
    src = home / "src"
    (src / "dir").mkdir(parents=True)
    big = os.urandom(4 << 20)
    (src / "big").write_bytes(big)
    (src / "dir" / "hello").write_text("hello from a lazy layer\n")
    img = home / "layer.erofs"
    mkfs_erofs(src, img, compress=None)
    digest = "sha256:" + hashlib.sha256(img.read_bytes()).hexdigest()
    blobs = LocalDirStore(home / "blobs")
    blobs.put(img, digest)
    with BlobHTTPServer(blobs.root) as srv:
        yield srv, digest, img.stat().st_size, big


def _settled(store: LayerStore, digest: str, quiet_s: float = 0.3) -> dict[str, Any]:
    """The layer's counters once no request has changed them for ``quiet_s`` (a warm-up's
    last requests are in), waiting at most ``budget(10)``."""
    deadline = time.monotonic() + budget(10)
    last = store.lazy_stats()["layers"][digest]
    still_since = time.monotonic()
    while time.monotonic() - still_since < quiet_s:
        assert time.monotonic() < deadline, f"the layer's reads never settled: {last}"
        time.sleep(0.05)
        now = store.lazy_stats()["layers"][digest]
        if now != last:
            last, still_since = now, time.monotonic()
    return last


def _store(home: Path) -> LayerStore:
    return LayerStore(home / "layers", home / "images", lazy_chunk_size=CHUNK)


def test_lazy_mount_fetches_only_touched_chunks_and_second_start_prefetches(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    srv, digest, size, big = remote
    store = _store(home)
    mounts = LayerMounts(home / "mnt")
    info = store.add_remote_layer(digest, size, srv.url, {"kind": "base", "name": "lazy"})
    assert info.digest == digest and info.kind == "base" and info.name == "lazy"
    assert not store.is_local(digest) and store.cached_fraction(digest) == 0.0
    path = store.layer_path(digest)
    assert path.name == f"{digest[7:]}.erofs" and path.stat().st_size == size
    pid = store.lazy.stats()["pid"]
    mp = mounts.acquire(digest, path)
    assert (mp / "dir" / "hello").read_text() == "hello from a lazy layer\n"
    with open(mp / "big", "rb") as f:
        f.seek(2 << 20)
        assert f.read(1000) == big[(2 << 20) : (2 << 20) + 1000]
    stats = store.lazy_stats()
    layer = stats["layers"][digest]
    chunks = -(-size // CHUNK)
    assert 0 < layer["bytes_fetched"] <= 6 * CHUNK < size  # metadata + the touched chunks
    assert layer["cache_misses"] >= 1 and layer["cached_chunks"] < chunks
    assert stats["node"]["bytes_fetched"] == layer["bytes_fetched"]
    assert 0 < store.cached_fraction(digest) < 0.5
    store.lazy.flush_records()
    record = home / "layers" / "lazy" / "records" / f"{digest[7:]}.json"
    assert record.is_file()
    mounts.release(digest)
    store.close()
    assert not _pid_alive(pid)
    assert _mounts_under(home) == []

    # second start, cold chunk cache: the record is prefetched without any read
    store = _store(home)
    store.lazy.drop_cache()
    store.layer_path(digest)
    deadline = time.monotonic() + budget(10)
    while time.monotonic() < deadline:
        layer = store.lazy_stats()["layers"].get(digest, {})
        if layer.get("prefetched_chunks", 0) >= 2 and layer.get("cached_chunks", 0) >= 2:
            break
        time.sleep(0.05)
    assert layer["prefetched_chunks"] >= 2 and layer["cache_misses"] == 0
    mp = mounts.acquire(digest, store.layer_path(digest))
    assert (mp / "dir" / "hello").read_text() == "hello from a lazy layer\n"
    layer = store.lazy_stats()["layers"][digest]
    # served from the chunk cache: by the reader's own reads, or ahead of them by the mount's
    # warm-up into the page cache; never fetched
    assert layer["cache_hits"] >= 1 or layer["warmed_bytes"] > 0, layer
    assert layer["cache_misses"] == 0
    mounts.release(digest)
    store.close()
    assert _mounts_under(home) == []


def test_full_fetch_makes_layer_local_and_refuses_corrupt_blob(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    srv, digest, size, _ = remote
    store = _store(home)
    store.add_remote_layer(digest, size, srv.url)
    blob = LocalDirStore(home / "blobs").blob_path(digest)
    os.chmod(blob, 0o644)
    original = blob.read_bytes()
    with open(blob, "r+b") as f:
        f.seek(size // 2)
        f.write(b"corrupt!")
    with pytest.raises(BlobDigestMismatch):
        store.fetch_layer(digest)
    assert not store.is_local(digest)
    assert list((home / "layers" / "tmp").glob("*.erofs")) == []
    blob.write_bytes(original)
    store.fetch_layer(digest)
    assert store.is_local(digest) and store.cached_fraction(digest) == 1.0
    assert store.layer_path(digest).parent == home / "layers" / "blobs" / "sha256"
    store.close()
    reopened = _store(home)  # the remote row and local blob survive a restart
    assert reopened.is_local(digest) and reopened.remote_source(digest) == srv.url
    reopened.close()


def test_dead_store_gives_eio_within_bounded_time(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    srv, digest, size, _ = remote
    store = _store(home)
    store.add_remote_layer(digest, size, srv.url)
    mounts = LayerMounts(home / "mnt")
    mp = mounts.acquire(digest, store.layer_path(digest))
    assert (mp / "dir" / "hello").exists()
    srv.close()
    t0 = time.monotonic()
    with pytest.raises(OSError) as ei, open(mp / "big", "rb") as f:
        f.seek(3 << 20)
        f.read(1000)
    assert ei.value.errno == errno.EIO
    assert time.monotonic() - t0 < budget(25)  # the bounded wait, not a hung reader
    assert store.lazy_stats()["layers"][digest]["fetch_errors"] >= 1
    mounts.release(digest)
    store.close()


def test_stale_fuse_mount_of_a_killed_server_is_cleaned(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    srv, digest, size, _ = remote
    store = _store(home)
    store.add_remote_layer(digest, size, srv.url)
    mounts = LayerMounts(home / "mnt")
    mounts.acquire(digest, store.layer_path(digest))
    pid = store.lazy.stats()["pid"]
    os.kill(pid, 9)  # the server dies without unmounting
    deadline = time.monotonic() + budget(5)
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(e.fstype.startswith("fuse") for e in mountinfo_entries(home / "layers"))
    restarted = LayerMounts(home / "mnt")
    restarted.adopt_existing()  # the EROFS mount over the dead FUSE file is dropped
    assert restarted.mounted() == {}
    store.close()  # detaches the stale FUSE mount
    assert _mounts_under(home) == []
    store = _store(home)
    mp = restarted.acquire(digest, store.layer_path(digest))  # a new server serves again
    assert (mp / "dir" / "hello").read_text() == "hello from a lazy layer\n"
    restarted.release(digest)
    store.close()


def test_mount_warms_recorded_chunks_into_page_cache(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    """A mount of a layer with a start record reads the recorded chunks into the page cache
    of the FUSE file (counted as ``warmed_bytes``, not as reads), so the readers of the next
    start find them in memory: their reads never reach the server."""
    srv, digest, size, big = remote
    store = _store(home)
    mounts = LayerMounts(home / "mnt")
    store.add_remote_layer(digest, size, srv.url, {"kind": "base", "name": "lazy"})
    mp = mounts.acquire(digest, store.layer_path(digest))
    with open(mp / "big", "rb") as f:  # the first start reads 1 MiB in the middle
        f.seek(2 << 20)
        assert f.read(1 << 20) == big[2 << 20 : 3 << 20]
    store.lazy.flush_records()
    mounts.release(digest)
    first = store.lazy_stats()["layers"][digest]
    assert first["warmed_bytes"] == 0  # no record yet at the first mount
    fuse_file = store.layer_path(digest)
    # forget the FUSE file's pages (what a page cache drop or memory pressure does)
    fd = os.open(fuse_file, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

    record = json.loads((home / "layers" / "lazy" / "records" / f"{digest[7:]}.json").read_text())
    expected = sum(min(CHUNK, size - i * CHUNK) for i in record["chunks"])
    assert expected >= 1 << 20, record  # the 1 MiB read and the metadata
    mp = mounts.acquire(digest, fuse_file)  # second start: EROFS opens the file
    deadline = time.monotonic() + budget(30)  # a wait: as long as a busy machine needs
    layer = store.lazy_stats()["layers"][digest]
    last, still_since = -1, time.monotonic()
    while time.monotonic() < deadline and layer["warmed_bytes"] < expected:
        if layer["warmed_bytes"] != last:  # settled for 0.5 s: what was not cached is warm
            last, still_since = layer["warmed_bytes"], time.monotonic()
        elif last > 0 and time.monotonic() - still_since > 0.5:
            break
        time.sleep(0.05)
        layer = store.lazy_stats()["layers"][digest]
    # the recorded chunks were warmed, except what was already cached (the mount's own read of
    # the superblock with the kernel's readahead around it; on a loaded machine, pages the
    # fadvise could not drop yet): that they are all in memory now is what the read below
    # shows. And not much more: the kernel may carry a warm-up's readahead on past the end of
    # a run of recorded chunks, by up to one warm-up step (2 windows, 256 KiB) per run, but a
    # warm-up that read the layer (4 MiB of data) rather than its record fails this
    chunks = sorted(record["chunks"])
    runs = 1 + sum(1 for a, b in itertools.pairwise(chunks) if b != a + 1)
    assert 0 < layer["warmed_bytes"] <= expected + runs * (256 << 10), (
        layer["warmed_bytes"],
        expected,
        chunks,
    )
    reads_before = _settled(store, digest)["reads"]  # after the warm-up's last requests
    with open(mp / "big", "rb") as f:
        f.seek(2 << 20)
        assert f.read(1 << 20) == big[2 << 20 : 3 << 20]
    after = store.lazy_stats()["layers"][digest]
    # without the warm-up this 1 MiB read is 8+ FUSE reads (128 KiB each); with it, none, or
    # one or two for pages the kernel reclaimed meanwhile (a loaded machine)
    assert after["reads"] - reads_before <= 2, (reads_before, after)
    assert after["cache_misses"] == first["cache_misses"]
    mounts.release(digest)
    store.close()
    assert _mounts_under(home) == []


def test_server_outlives_its_starter_and_is_adopted(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    """The node's server runs in its own session: when the process that started it dies (a
    killed ``dsec serve``), layers mounted from it keep reading; the next store adopts the
    server instead of starting a second one, keeps it while a layer is mounted and stops it
    once nothing is."""
    srv, digest, size, big = remote
    script = f"""
import os
from pathlib import Path
from dsec.layers.mounts import LayerMounts
from dsec.layers.store import LayerStore
store = LayerStore(Path({str(home / "layers")!r}), Path({str(home / "images")!r}),
                   lazy_chunk_size={CHUNK})
store.add_remote_layer({digest!r}, {size}, {srv.url!r}, {{"kind": "base", "name": "lazy"}})
mp = LayerMounts(Path({str(home / "mnt")!r})).acquire({digest!r}, store.layer_path({digest!r}))
print(mp, store.lazy.stats()["pid"], flush=True)
os.kill(os.getpid(), 9)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == -9, out.stderr
    mp_text, pid_text = out.stdout.split()
    mp, pid = Path(mp_text), int(pid_text)
    try:
        assert _pid_alive(pid)
        with open(mp / "big", "rb") as f:  # chunks not read before are fetched now
            f.seek(3 << 20)
            assert f.read(4096) == big[3 << 20 : (3 << 20) + 4096]
        store = _store(home)
        store.layer_path(digest)  # adopts: no second server on the same mount point
        assert store.lazy.pid == pid and store.lazy_stats()["pid"] == pid
        store.close()  # a layer is still mounted: the server stays
        assert _pid_alive(pid)
        assert (mp / "dir" / "hello").read_text() == "hello from a lazy layer\n"
    finally:
        umount(mp)
    store = _store(home)
    store.layer_path(digest)
    assert store.lazy.pid == pid
    store.close()  # nothing mounted any more: stopped
    deadline = time.monotonic() + budget(5)
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pid_alive(pid)
    assert _mounts_under(home) == []


def test_chunk_table_refuses_a_corrupted_range(
    home: Path, remote: tuple[BlobHTTPServer, str, int, bytes]
) -> None:
    """With a chunk table, a range of the blob that was altered in the store reads as EIO
    (after one more fetch), is counted, and is never cached; the rest of the layer reads."""
    srv, digest, size, big = remote
    image = (home / "layer.erofs").read_bytes()
    table, _ = publish_chunk_table(LocalDirStore(home / "blobs"), home / "layer.erofs")
    at = image.index(big[3 << 20 : (3 << 20) + 4096])  # where big's 4th MiB lies in the blob
    blob = home / "blobs" / "sha256" / digest[7:]
    damaged = bytearray(image)
    damaged[at + 100] ^= 0xFF
    blob.write_bytes(bytes(damaged))
    store = _store(home)
    mounts = LayerMounts(home / "mnt")
    meta = {"kind": "base", "name": "lazy", "chunk_table": table}
    store.add_remote_layer(digest, size, srv.url, meta)
    mp = mounts.acquire(digest, store.layer_path(digest))
    try:
        assert (mp / "dir" / "hello").read_text() == "hello from a lazy layer\n"
        with open(mp / "big", "rb") as f:
            f.seek(1 << 20)
            assert f.read(4096) == big[1 << 20 : (1 << 20) + 4096]  # an intact range
            f.seek(3 << 20)
            with pytest.raises(OSError) as e:
                f.read(4096)
            assert e.value.errno == errno.EIO
        layer = store.lazy_stats()["layers"][digest]
        assert layer["integrity_errors"] >= 2  # each fetch and its one retry (the kernel retries)
        bad_chunk = at // CHUNK
        assert not (home / "layers" / "lazy" / "cache" / digest[7:] / str(bad_chunk)).exists()
    finally:
        mounts.release(digest)
        store.close()
    assert _mounts_under(home) == []
