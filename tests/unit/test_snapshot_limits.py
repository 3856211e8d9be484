"""pack_diff's limits on a plain upper directory (no mounts): apparent size of sparse files,
chunk-based packing of holes, directory depth and path length."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import InvalidRequest, QuotaExceeded
from dsec.layers.snapshot import MAX_PACK_DEPTH, pack_diff
from dsec.layers.store import LayerStore

MiB = 1 << 20


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LayerStore]:
    yield LayerStore(tmp_path / "layers", tmp_path / "scratch")
    # deep trees: pytest's own cleanup (recursive shutil.rmtree) would hit RecursionError
    subprocess.run(["rm", "-rf", "--one-file-system", str(tmp_path)], check=False)


def _bytes_read() -> int:
    """Bytes this process (and its reaped children) got from read-like calls: /proc/self/io
    ``rchar``."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _nest(top: Path, depth: int, name: str = "d") -> None:
    """``depth`` directories nested below ``top``, made by descriptors (no long paths)."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def _scratch_is_empty(store: LayerStore) -> bool:
    return not store.scratch.exists() or not any(store.scratch.iterdir())


def test_sparse_file_past_the_cap_is_refused_before_packing(
    tmp_path: Path, store: LayerStore
) -> None:
    upper = tmp_path / "upper"
    (upper / "root").mkdir(parents=True)
    with open(upper / "root/sparse", "wb") as f:
        f.truncate(8 << 30)  # 8 GiB apparent, nothing allocated
    assert os.stat(upper / "root/sparse").st_blocks == 0
    t0 = time.perf_counter()
    read0 = _bytes_read()
    with pytest.raises(QuotaExceeded) as exc:
        pack_diff(upper, store, compress=None, max_bytes=64 * MiB)
    read = _bytes_read() - read0
    elapsed = time.perf_counter() - t0
    print(f"refused an 8 GiB sparse file in {elapsed * 1000:.1f} ms, {read} bytes read")
    assert exc.value.details["limit"] == 64 * MiB
    assert exc.value.details["path"] == "/root/sparse"
    assert "sparse" in exc.value.message
    assert read < 4 * MiB  # no byte of the file was read (reading it up to the cap: 64 MiB)
    assert _scratch_is_empty(store)


def test_default_cap_is_the_upper_filesystem_size(tmp_path: Path, store: LayerStore) -> None:
    """``truncate -s`` past the disk (the QA's 1 TiB case): refused with no cap given."""
    upper = tmp_path / "upper"
    upper.mkdir()
    vfs = os.statvfs(upper)
    fs_bytes = vfs.f_blocks * vfs.f_frsize
    with open(upper / "huge", "wb") as f:
        f.truncate(fs_bytes + MiB)
    with pytest.raises(QuotaExceeded) as exc:
        pack_diff(upper, store)
    assert exc.value.details["limit"] == fs_bytes
    assert _scratch_is_empty(store)


def test_scrubbed_sparse_file_does_not_count(tmp_path: Path, store: LayerStore) -> None:
    upper = tmp_path / "upper"
    (upper / "tmp").mkdir(parents=True)
    (upper / "etc").mkdir()
    (upper / "etc/kept").write_text("kept\n")
    with open(upper / "tmp/sparse", "wb") as f:
        f.truncate(1 << 40)  # /tmp/* is in DEFAULT_SCRUB
    layer = pack_diff(upper, store, compress=None, max_bytes=MiB)
    assert layer.meta["pack_diff"]["bytes"] == 5


def test_sparse_file_under_the_cap_packs_small(tmp_path: Path, store: LayerStore) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    apparent = 64 * MiB
    with open(upper / "sparse", "wb") as f:
        f.truncate(apparent)
        f.seek(apparent // 2)
        f.write(b"MIDDLE")
    (upper / "data").write_bytes(os.urandom(100_000))
    t0 = time.perf_counter()
    layer = pack_diff(upper, store, compress=None, max_bytes=128 * MiB)
    elapsed = time.perf_counter() - t0
    stats = layer.meta["pack_diff"]
    print(f"64 MiB sparse: layer {layer.size} bytes in {elapsed * 1000:.0f} ms", stats)
    assert stats["chunked"] is True and stats["hole_bytes"] >= apparent - 2 * MiB
    assert stats["bytes"] == apparent + 100_000
    assert layer.size < 2 * MiB  # the plain image would be 64 MiB of zeros
    # a diff without holes keeps the plain (non-chunked) format
    (upper / "sparse").unlink()
    plain = pack_diff(upper, store, compress=None)
    assert plain.meta["pack_diff"]["chunked"] is False


def test_hard_links_count_once(tmp_path: Path, store: LayerStore) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    (upper / "a").write_bytes(b"x" * 600_000)
    os.link(upper / "a", upper / "b")
    layer = pack_diff(upper, store, compress=None, max_bytes=1_000_000)
    assert layer.meta["pack_diff"]["bytes"] == 600_000


def test_too_deep_trees_are_refused_with_a_typed_error(tmp_path: Path, store: LayerStore) -> None:
    upper = tmp_path / "upper"
    _nest(upper / "deep", MAX_PACK_DEPTH)  # /deep is level 1: MAX_PACK_DEPTH + 1 levels
    with pytest.raises(InvalidRequest) as exc:
        pack_diff(upper, store)
    assert exc.value.details["limit"] == MAX_PACK_DEPTH
    assert "/deep/d/d" in exc.value.message and len(exc.value.message) < 400
    # 500 levels of 11 bytes each: past PATH_MAX (at ~370 levels) before the depth limit
    upper2 = tmp_path / "upper2"
    _nest(upper2 / "root", 500, name="abcdefghij")
    with pytest.raises(InvalidRequest) as exc:
        pack_diff(upper2, store)
    assert exc.value.details["limit"] == 4096
    assert _scratch_is_empty(store)


def test_deep_trees_under_scrubbed_paths(tmp_path: Path, store: LayerStore) -> None:
    """mkfs.erofs walks scrubbed directories too: moderately deep ones pack (left out),
    too deep ones get the typed error instead of a mkfs crash."""
    upper = tmp_path / "upper"
    _nest(upper / "tmp/x", 900)
    _nest(upper / "srv", 50)
    layer = pack_diff(upper, store)
    assert layer.meta["pack_diff"]["dirs"] == 52  # /tmp, /srv, 50 levels; /tmp/x scrubbed
    assert layer.meta["pack_diff"]["scrubbed"] == 1
    _nest(upper / "tmp/y", MAX_PACK_DEPTH + 5)
    with pytest.raises(InvalidRequest) as exc:
        pack_diff(upper, store)
    assert "remove that tree" in exc.value.message
