"""Images and layers belong to API keys: the layer store's ownership rules, the migration of
a store made before owners, bounded extraction of uploaded contexts, and built-in images
built ahead of time with their progress visible.

The HTTP side (two keys against a real server) is in
tests/integration/test_image_owners_root.py.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import sqlite3
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dsec.errors import (
    Conflict,
    ImageNotFound,
    ImageNotReady,
    InvalidRequest,
    LayerNotFound,
    PayloadTooLarge,
)
from dsec.layers import BUILTIN_IMAGES, BuiltinImage, LayerStore, extract_tarball

A = "k" + "a" * 16
B = "k" + "b" * 16


def _tree(root: Path, text: str) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/motd").write_text(text)
    return root


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LayerStore]:
    s = LayerStore(tmp_path / "layers", tmp_path / "images")
    yield s
    s.close()


def test_a_keys_image_is_invisible_to_another_key(store: LayerStore, tmp_path: Path) -> None:
    mine = store.build_image(_tree(tmp_path / "a", "a\n"), "app:1", owner=A)
    assert mine.owner == A and not mine.shared
    assert store.get_image("app:1", A).layers == mine.layers
    with pytest.raises(ImageNotFound):
        store.get_image("app:1", B)
    with pytest.raises(ImageNotFound):
        store.get_image("app:1")  # not a system image either
    assert "app:1" not in {i.name for i in store.list_images(B)}
    assert "app:1" in {i.name for i in store.list_images(A)}
    with pytest.raises(ImageNotFound):
        store.resolve_layers(["app:1"], B)
    # its layer, named by digest, is as unknown to B as a digest that does not exist
    digest = mine.layers[-1]
    with pytest.raises(LayerNotFound):
        store.resolve_layers([digest], B)
    with pytest.raises(LayerNotFound):
        store.get_owned_layer(digest, B)
    with pytest.raises(ImageNotFound):
        store.get_image(digest, B)
    assert digest not in {x.digest for x in store.list_owned_layers(B)}
    assert [x.digest for x in store.resolve_layers([digest], A)] == [digest]
    # the same name for B is B's own image: no clash, no replacement of A's
    theirs = store.build_image(_tree(tmp_path / "b", "b\n"), "app:1", owner=B)
    assert theirs.layers != mine.layers
    assert store.get_image("app:1", A).layers == mine.layers
    with pytest.raises(ImageNotFound):
        store.remove_image("nope", A)
    store.remove_image("app:1", B)
    assert store.get_image("app:1", A).layers == mine.layers


def test_keys_cannot_replace_or_remove_system_images(store: LayerStore, tmp_path: Path) -> None:
    system = store.build_image(_tree(tmp_path / "s", "system\n"), "tools")  # the operator's
    assert system.owner == "system"
    trojan = _tree(tmp_path / "t", "trojan\n")
    for name in ("tools", "busybox", "debian"):  # stored, or built-in and not built yet
        with pytest.raises(Conflict, match="system image"):
            store.build_image(trojan, name, owner=B)
        with pytest.raises(Conflict):
            store.put_image(name, system.layers, owner=B)
    with pytest.raises(Conflict):
        store.remove_image("tools", B)
    assert store.get_image("tools", A).layers == system.layers  # every key sees it
    assert set(system.layers) <= {x.digest for x in store.list_owned_layers(A)}
    # an image of a key's own keeps its name when the operator later publishes the same name
    own = store.build_image(_tree(tmp_path / "o", "own\n"), "later", owner=A)
    store.build_image(_tree(tmp_path / "l", "system later\n"), "later")
    assert store.get_image("later", A).layers == own.layers
    assert store.get_image("later", B).layers != own.layers
    listed = [i for i in store.list_images(A) if i.name == "later"]
    assert [i.owner for i in listed] == [A]


def test_sharing_is_on_purpose_and_never_shadows(store: LayerStore, tmp_path: Path) -> None:
    img = store.build_image(_tree(tmp_path / "a", "a\n"), "env", owner=A)
    with pytest.raises(ImageNotFound):
        store.get_image(f"{A}/env", B)
    shared = store.share_image("env", A, True)
    assert shared.shared
    assert store.get_image(f"{A}/env", B).layers == img.layers
    assert store.resolve_layers([f"{A}/env"], B)[-1].digest == img.layers[-1]
    with pytest.raises(ImageNotFound):
        store.get_image("env", B)  # never under the bare name: it cannot shadow B's names
    store.share_image("env", A, False)
    with pytest.raises(ImageNotFound):
        store.get_image(f"{A}/env", B)
    with pytest.raises(ImageNotFound):
        store.share_image("env", B, True)


def test_snapshot_layers_are_granted_to_their_owner(store: LayerStore, tmp_path: Path) -> None:
    layer = store.build_layer(_tree(tmp_path / "a", "a\n"), "workspace")
    with pytest.raises(LayerNotFound):
        store.resolve_layers([layer.digest], A)  # built, but nobody was granted it
    store.grant_layers(A, [layer.digest])
    assert store.layer_visible(layer.digest, A) and not store.layer_visible(layer.digest, B)
    with pytest.raises(InvalidRequest):
        store.grant_layers(A, ["sha256:bad"])


def test_a_store_made_before_owners_is_migrated(tmp_path: Path) -> None:
    first = LayerStore(tmp_path / "layers", tmp_path / "images")
    kept = first.build_layer(_tree(tmp_path / "a", "a\n"), "base")
    loose = first.build_layer(_tree(tmp_path / "b", "b\n"), "workspace")
    first.close()
    db = sqlite3.connect(tmp_path / "layers" / "layers.db")
    db.executescript(
        """
        DROP TABLE images; DROP TABLE layer_grants;
        CREATE TABLE images (name TEXT PRIMARY KEY, layers TEXT NOT NULL,
            size INTEGER NOT NULL, created_at TEXT NOT NULL, meta TEXT NOT NULL DEFAULT '{}');
        """
    )
    db.execute(
        "INSERT INTO images VALUES (?, ?, 1, '2026-01-01T00:00:00+00:00', '{}')",
        ("legacy", json.dumps([kept.digest])),
    )
    db.commit()
    db.close()
    store = LayerStore(tmp_path / "layers", tmp_path / "images")
    try:
        image = store.get_image("legacy", A)
        assert image.owner == "system" and image.layers == [kept.digest]
        with pytest.raises(Conflict):
            store.put_image("legacy", [kept.digest], owner=B)
        assert store.layer_visible(kept.digest, B)
        assert not store.layer_visible(loose.digest, B)  # not named by any image: nobody's
    finally:
        store.close()


def _tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_extraction_is_bounded(tmp_path: Path) -> None:
    # 64 MiB of zeros compress to ~64 KiB: the bound is on what unpacks, not on the upload
    big = gzip.compress(_tar_of({"zeros": bytes(64 << 20)}), compresslevel=1)
    assert len(big) < 1 << 20
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(big)
    with pytest.raises(PayloadTooLarge, match="unpacks to more than"):
        extract_tarball(archive, tmp_path / "out", max_bytes=16 << 20)
    many = tmp_path / "many.tar"
    many.write_bytes(_tar_of({f"f{i}": b"" for i in range(50)}))
    with pytest.raises(PayloadTooLarge, match="more than 10 entries"):
        extract_tarball(many, tmp_path / "out2", max_members=10)
    assert extract_tarball(many, tmp_path / "out3", max_members=50)["members"] == 50


def test_builtins_build_ahead_with_progress(
    store: LayerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow(dest: Path) -> None:
        (dest / "etc").mkdir()
        (dest / "etc/slow").write_text("done\n")
        assert release.wait(30)

    monkeypatch.setitem(BUILTIN_IMAGES, "slowimg", BuiltinImage(name="slowimg", build_rootfs=slow))
    status = store.builtin_status("slowimg")
    assert status is not None and status[0] == "queued"
    thread = store.prebuild_builtins(["slowimg"])
    assert thread is not None
    for _ in range(200):
        status = store.builtin_status("slowimg")
        if status is not None and status[1] == "building its root filesystem":
            break
        threading.Event().wait(0.01)
    assert status is not None and status[0] == "building"
    assert status[1] == "building its root filesystem"

    # a create in the meantime gets a retryable answer that says how far the build got
    with pytest.raises(ImageNotReady) as info:
        asyncio.run(store.ensure_image("slowimg", A, wait_s=0.05))
    assert info.value.details["retry_after_s"] > 0
    assert info.value.details["phase"] == "building its root filesystem"
    release.set()
    thread.join(30)
    assert store.builtin_status("slowimg") is None  # stored: a plain system image now
    assert store.get_image("slowimg", B).owner == "system"
    assert store.prebuild_builtins(["slowimg"]) is None  # nothing left to build


def test_a_failed_builtin_says_why(store: LayerStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(dest: Path) -> None:
        raise RuntimeError("mirror unreachable")

    monkeypatch.setitem(
        BUILTIN_IMAGES, "brokenimg", BuiltinImage(name="brokenimg", build_rootfs=broken)
    )
    thread = store.prebuild_builtins(["brokenimg"])
    assert thread is not None
    thread.join(30)
    status = store.builtin_status("brokenimg")
    assert status is not None and status[0] == "failed" and "mirror unreachable" in status[1]


def test_a_builtin_built_from_an_older_recipe_is_rebuilt(
    store: LayerStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upgrading dsec changes a recipe (the code interpreter's server code, a package list):
    the stored image of the old recipe is rebuilt on its next use, not served stale."""
    builds: list[str] = []

    def rootfs(version: str) -> Any:
        def build(dest: Path) -> None:
            builds.append(version)
            (dest / "etc").mkdir()
            (dest / "etc/version").write_text(version)

        return build

    old = BuiltinImage(name="recipe", build_rootfs=rootfs("1"), meta={"recipe": "1"})
    monkeypatch.setitem(BUILTIN_IMAGES, "recipe", old)
    first = asyncio.run(store.ensure_image("recipe", A))
    assert asyncio.run(store.ensure_image("recipe", A)).layers == first.layers and builds == ["1"]
    new = BuiltinImage(name="recipe", build_rootfs=rootfs("2"), meta={"recipe": "2"})
    monkeypatch.setitem(BUILTIN_IMAGES, "recipe", new)
    second = asyncio.run(store.ensure_image("recipe", A))
    assert builds == ["1", "2"] and second.layers != first.layers
    assert second.meta["recipe"] == "2"
    assert asyncio.run(store.ensure_image("recipe", B)).layers == second.layers  # once
