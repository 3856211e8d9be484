"""Built-in images layered on another built-in (``BuiltinImage.base``, what ``desktop`` is):
the top layer holds only what its build changed over the base's merged tree (new files,
and deletions as whiteouts), the image is the base's layers + it, and it is rebuilt when
the base is (its recorded ``base_layers`` no longer match)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsec.layers import BUILTIN_IMAGES, BuiltinImage, LayerStore
from dsec.layers.overlay_build import build_over

pytestmark = [pytest.mark.root]

COUNTER = Path(os.environ.get("DSEC_LAYERED_TEST_COUNTER", "/tmp/dsec-layered-test-counter"))


def _base_rootfs(dest: Path) -> None:
    (dest / "etc").mkdir(parents=True)
    (dest / "etc/a").write_text("base a\n")
    (dest / "etc/gone").write_text("deleted by the top layer\n")
    (dest / "usr/share/doc").mkdir(parents=True)
    (dest / "usr/share/doc/readme").write_text("doc\n")


def top_build(root: Path) -> None:
    """The top layer's build (module level: the build child imports it)."""
    with COUNTER.open("a") as f:
        f.write("built\n")
    assert (root / "etc/a").read_text() == "base a\n"  # it sees the base's tree
    (root / "etc/b").write_text("top b\n")
    (root / "etc/gone").unlink()
    (root / "etc/a").write_text("changed a\n")
    shutil.rmtree(root / "usr/share/doc")


def report_tree(root: Path) -> None:
    """Write what the merged tree holds to ``root``'s report file (a check, run as a build)."""
    out = {
        "a": (root / "etc/a").read_text(),
        "b": (root / "etc/b").read_text(),
        "gone": (root / "etc/gone").exists(),
        "doc": (root / "usr/share/doc").exists(),
        "share": (root / "usr/share").is_dir(),
    }
    Path(os.environ["DSEC_LAYERED_TEST_REPORT"]).write_text(json.dumps(out))


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LayerStore]:
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts)")
    COUNTER.unlink(missing_ok=True)
    s = LayerStore(tmp_path / "layers", tmp_path / "scratch")
    monkeypatch.setitem(
        BUILTIN_IMAGES,
        "lbase",
        BuiltinImage(name="lbase", build_rootfs=_base_rootfs, meta={"recipe": "1"}),
    )
    monkeypatch.setitem(
        BUILTIN_IMAGES,
        "ltop",
        BuiltinImage(name="ltop", build_rootfs=top_build, kind="toolkit", base="lbase"),
    )
    try:
        yield s
    finally:
        s.close()
        COUNTER.unlink(missing_ok=True)


def test_layered_builtin(
    store: LayerStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    top = store.ensure_image_sync("ltop")
    base = store.get_image("lbase")
    assert top.layers[:-1] == base.layers and len(top.layers) == 2
    assert top.meta["base_layers"] == list(base.layers)
    assert store.get_layer(top.layers[-1]).kind == "toolkit"
    assert COUNTER.read_text().count("built") == 1

    # stacked on the base, the top layer shows exactly the tree its build left
    report = tmp_path / "report.json"
    monkeypatch.setenv("DSEC_LAYERED_TEST_REPORT", str(report))
    build_over(tmp_path / "check", [store.layer_path(d) for d in top.layers], report_tree)
    assert json.loads(report.read_text()) == {
        "a": "changed a\n",
        "b": "top b\n",
        "gone": False,
        "doc": False,
        "share": True,
    }
    assert store.ensure_image_sync("ltop").layers == top.layers  # cached: no new build
    assert COUNTER.read_text().count("built") == 1

    # the base's recipe changes: the base is rebuilt, and so is the image on it
    monkeypatch.setitem(BUILTIN_IMAGES["lbase"].meta, "recipe", "2")
    rebuilt = store.ensure_image_sync("ltop")
    new_base = store.get_image("lbase")
    assert new_base.layers != base.layers
    assert rebuilt.layers[:-1] == new_base.layers
    assert COUNTER.read_text().count("built") == 2
    assert list(store.scratch.iterdir()) == []
