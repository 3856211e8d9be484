"""The machine-wide cache of built-in layers (``DSEC_BUILTIN_CACHE``): several stores on one
machine build a built-in image once; a changed recipe is never served an old layer; a recipe
registered at run time is never cached. Needs mkfs.erofs and busybox-static, not root."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import dsec.layers.builtin as builtin
from dsec.layers import BUILTIN_IMAGES, BuiltinImage, LayerStore
from dsec.layers.builtin_cache import ENV, BuiltinCache


class CountingBusybox:
    """Wraps the real busybox builder (dsec's own code, so cacheable) and counts its runs."""

    def __init__(self) -> None:
        self.runs = 0
        self._lock = threading.Lock()

    def __call__(self, dest: Path) -> None:
        with self._lock:
            self.runs += 1
        builtin.build_busybox_rootfs(dest)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "cache"
    monkeypatch.setenv(ENV, str(d))
    return d


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingBusybox]:
    counter = CountingBusybox()
    # a recipe whose builder reports dsec's module, as the built-in recipes do
    counter.__module__ = "dsec.layers.builtin"
    counter.__qualname__ = "build_busybox_rootfs"
    recipe = BuiltinImage(name="busybox", build_rootfs=counter, meta={"builtin": "busybox"})
    monkeypatch.setitem(BUILTIN_IMAGES, "busybox", recipe)
    yield counter


def _store(root: Path) -> LayerStore:
    return LayerStore(root / "layers", root / "images")


def test_second_store_takes_the_cached_layer(
    tmp_path: Path, cache_dir: Path, counted: CountingBusybox
) -> None:
    first, second = _store(tmp_path / "a"), _store(tmp_path / "b")
    try:
        built = first.ensure_image_sync("busybox")
        taken = second.ensure_image_sync("busybox")
        assert counted.runs == 1
        assert taken.layers == built.layers
        digest = built.layers[0].split(":", 1)[1]
        blob = second.root / "blobs/sha256" / f"{digest}.erofs"
        assert blob.is_file() and blob.stat().st_nlink >= 2  # hard-linked, not copied
        cached = list(cache_dir.glob("busybox-*.erofs"))
        assert len(cached) == 1 and cached[0].name.endswith(f"{digest}.erofs")
        assert second.get_layer(built.layers[0]).kind == "base"
    finally:
        first.close()
        second.close()


def test_concurrent_stores_build_once(
    tmp_path: Path, cache_dir: Path, counted: CountingBusybox
) -> None:
    stores = [_store(tmp_path / f"s{i}") for i in range(3)]
    results: list[list[str]] = []
    try:
        threads = [
            threading.Thread(
                target=lambda s=s: results.append(s.ensure_image_sync("busybox").layers)
            )
            for s in stores
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert counted.runs == 1 and len(results) == 3 and len({tuple(r) for r in results}) == 1
    finally:
        for s in stores:
            s.close()


def test_changed_recipe_is_rebuilt(
    tmp_path: Path, cache_dir: Path, counted: CountingBusybox, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = _store(tmp_path / "a")
    try:
        s.ensure_image_sync("busybox")
    finally:
        s.close()
    changed = BuiltinImage(
        name="busybox", build_rootfs=counted, meta={"builtin": "busybox", "recipe": "2"}
    )
    monkeypatch.setitem(BUILTIN_IMAGES, "busybox", changed)
    s = _store(tmp_path / "b")
    try:
        s.ensure_image_sync("busybox")
    finally:
        s.close()
    assert counted.runs == 2
    assert len(list(cache_dir.glob("busybox-*.erofs"))) == 1  # the old recipe's copy is gone


def test_recipe_registered_at_run_time_is_not_cached(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[Path] = []

    def tiny(dest: Path) -> None:
        runs.append(dest)
        (dest / "hello").write_text("hi\n")

    monkeypatch.setitem(BUILTIN_IMAGES, "tiny", BuiltinImage(name="tiny", build_rootfs=tiny))
    assert BuiltinCache.key(BUILTIN_IMAGES["tiny"], {}) is None
    for name in ("a", "b"):
        s = _store(tmp_path / name)
        try:
            s.ensure_image_sync("tiny")
        finally:
            s.close()
    assert len(runs) == 2 and not list(cache_dir.glob("tiny-*"))


def test_key_follows_the_builder_module_source() -> None:
    recipe = BUILTIN_IMAGES["debian"]
    key = BuiltinCache.key(recipe, dict(recipe.meta))
    assert key is not None and len(key) == 24
    assert BuiltinCache.key(recipe, {**recipe.meta, "include": ["python3", "git"]}) != key
