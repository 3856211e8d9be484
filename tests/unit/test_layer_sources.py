"""The same behaviour checks against every :class:`~dsec.layers.source.LayerSource`: the
node's real store and the in-memory one the test edge runs on, so the fake cannot drift
from the rules it stands in for (ownership, system images, sharing, grants)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.errors import Conflict, ImageNotFound, LayerNotFound
from dsec.layers.source import LayerSource
from dsec.layers.store import LayerStore
from dsec.models import SYSTEM_OWNER
from dsec.testing import FAKE_BUSYBOX, MemoryLayers

A = "k" + "a" * 16
B = "k" + "b" * 16


@pytest.fixture(params=["LayerStore", "MemoryLayers"])
def source(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LayerSource]:
    if request.param == "MemoryLayers":
        yield MemoryLayers()
        return
    store = LayerStore(tmp_path / "layers", tmp_path / "images")
    store.put_image("busybox", [store.build_layer(_tree(tmp_path / "bb", "bb"), "base").digest])
    yield store
    store.close()


def _tree(root: Path, text: str) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/motd").write_text(text)
    return root


def test_is_a_layer_source(source: LayerSource) -> None:
    assert isinstance(source, LayerSource)


def test_owned_images_and_layers(source: LayerSource, tmp_path: Path) -> None:
    mine = source.build_image(_tree(tmp_path / "a", "a"), "app:1", base="busybox", owner=A)
    assert mine.owner == A and source.get_image("app:1", A).layers == mine.layers
    for lookup in (lambda: source.get_image("app:1", B), lambda: source.get_image("app:1")):
        with pytest.raises(ImageNotFound):
            lookup()
    top = mine.layers[-1]
    with pytest.raises(LayerNotFound):
        source.resolve_layers([top], B)
    assert top not in {x.digest for x in source.list_owned_layers(B)}
    assert [x.digest for x in source.resolve_layers(["app:1"], A)] == mine.layers
    assert "app:1" not in {i.name for i in source.list_images(B)}
    source.grant_layers(B, [top])
    assert source.resolve_layers([top], B)[-1].digest == top
    # system names are read-only to keys, and visible to all
    with pytest.raises(Conflict):
        source.build_image(_tree(tmp_path / "t", "t"), "busybox", owner=B)
    with pytest.raises(Conflict):
        source.remove_image("busybox", B)
    assert source.get_image("busybox", B).owner == "system"
    source.remove_image("app:1", A)
    with pytest.raises(ImageNotFound):
        source.get_image("app:1", A)


def test_sharing_names_the_owner(source: LayerSource, tmp_path: Path) -> None:
    img = source.build_image(_tree(tmp_path / "a", "a"), "env", owner=A)
    with pytest.raises(ImageNotFound):
        source.get_image(f"{A}/env", B)
    source.share_image("env", A, True)
    assert source.get_image(f"{A}/env", B).layers == img.layers
    with pytest.raises(ImageNotFound):
        source.get_image("env", B)
    with pytest.raises(ImageNotFound):
        source.share_image("env", B, True)


def test_the_system_sees_every_layer(source: LayerSource, tmp_path: Path) -> None:
    img = source.build_image(_tree(tmp_path / "a", "a"), "priv", owner=A)
    assert source.resolve_layers([img.layers[-1]], SYSTEM_OWNER)[-1].digest == img.layers[-1]


def test_memory_layers_keep_what_they_were_given(tmp_path: Path) -> None:
    layers = MemoryLayers(system_images=("busybox", "debian"))
    assert {i.name for i in layers.list_images(A)} == {"busybox", "debian"}
    assert layers.get_image("busybox").layers == [FAKE_BUSYBOX]
    built = layers.build_layer(_tree(tmp_path / "x", "hello"), "workspace")
    assert layers.files_of(built.digest)["/etc/motd"].data == b"hello"
