"""What a guest gets on its second disk: dsec from this checkout, offline.

The guest has no network, so everything it installs or uses comes from here:

* ``wheels/``: a wheel of dsec built from the checkout as it is now
  (:func:`hosts.wheels.dsec_wheel`); its dependencies are in the image's venv already.
* ``images/``: the built-in image layers the checks use (``busybox``, ``debian``), taken from
  the machine-wide built-in cache the tests use (``DSEC_BUILTIN_CACHE``, built there if
  missing): the guest cannot debootstrap. The guest files them under the cache key its own
  dsec computes (``inguest.py``).
* ``tree/``: ``tests/``, ``benchmarks/hostprobe.py`` and ``pyproject.toml`` (pytest's
  configuration) for the conformance suite and the tests chosen with ``--tests``.
* ``inguest.py`` (run by the image's unit), ``config.json`` (what to check), ``out/`` (the
  guest's results, read back with ``debugfs``).

:func:`make_disk` turns the directory into an ext4 image (``mkfs.ext4 -d``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from hosts.wheels import dsec_wheel

__all__ = ["build_payload", "make_disk", "read_back"]

log = logging.getLogger("hosts.payload")

REPO = Path(__file__).resolve().parent.parent
CONFORMANCE_IMAGES = {"container": "busybox", "fncall": "debian"}
"""The image each tier's conformance tests use (``tests/conformance/conftest.py``)."""


def _layer_files(names: tuple[str, ...]) -> dict[str, Path]:
    """The EROFS file of each built-in image in ``names``, from the machine-wide built-in
    cache (built into it first when missing, as ``tests/warm_images.py`` does)."""
    from dsec.layers import builtin
    from dsec.layers.builtin_cache import ENV, BuiltinCache
    from dsec.layers.store import LayerStore

    default = "/var/cache/dsec-test-images"  # tests/warm_images.py's DEFAULT_CACHE
    cache = BuiltinCache.from_env() or BuiltinCache(Path(default))
    os.environ[ENV] = str(cache.root)
    found: dict[str, Path] = {}
    missing = []
    for name in names:
        recipe = builtin.BUILTIN_IMAGES[name]
        key = cache.key(recipe, {**recipe.meta, "builtin": name})
        path = cache.find(name, key) if key else None
        if path is None:
            missing.append(name)
        else:
            found[name] = path
    if missing:
        scratch = Path(tempfile.mkdtemp(prefix="hosts-store-", dir=cache.root))
        store = LayerStore(scratch / "layers", scratch / "images")
        try:
            for name in missing:
                log.info("building the built-in image %s (missing from %s)", name, cache.root)
                store.ensure_image_sync(name)
                recipe = builtin.BUILTIN_IMAGES[name]
                key = cache.key(recipe, {**recipe.meta, "builtin": name})
                path = cache.find(name, key) if key else None
                if path is None:
                    raise RuntimeError(f"built {name}, but {cache.root} has no copy of it")
                found[name] = path
        finally:
            store.close()
            shutil.rmtree(scratch, ignore_errors=True)
    return found


def _toolkit_files(layers: dict[str, Any], images: Path) -> dict[str, Any]:
    """The fncall toolkits (compilers, runtimes) already built over the ``debian`` layer the
    guest gets, linked into ``images``: the guest cannot apt-get them. A toolkit's key
    depends only on that layer and the toolkit's packages, so the guest's dsec computes the
    same one and finds them in its cache. Toolkits not built here are left out (their
    run_code tests then fail in the guest as they would on any offline node)."""
    from dsec.layers.builtin_cache import BuiltinCache
    from dsec.runtimes.fncall.toolkits import TOOLKITS, toolkit_key

    cache = BuiltinCache.from_env()
    if cache is None or "debian" not in layers:
        return {}
    base = ["sha256:" + layers["debian"]["sha256"]]
    found: dict[str, Any] = {}
    for name, kit in TOOLKITS.items():
        key = toolkit_key(base, kit.apt, kit.pip, kit.npm, kit.build_only)
        path = cache.find(f"toolkit-{name}", key)
        if path is not None:
            _link_or_copy(path, images / path.name)
            found[name] = {"file": f"images/{path.name}", "key": key}
    return found


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def build_payload(dest: Path, config: dict[str, Any], *, conformance: bool = True) -> None:
    """Fill ``dest`` (empty) with what the guest needs to check ``config``'s host: the
    layers of the images ``config["images"]`` names for its tiers (and those of the
    conformance suite's images, with ``conformance`` or tests in ``config["tests"]``)."""
    dest.mkdir(parents=True, exist_ok=True)
    names = {config["images"][t] for t in config["tiers"]}
    with_tree = conformance or bool(config.get("tests"))
    if with_tree:  # the tests' own images: busybox for the container tier, debian
        names |= {CONFORMANCE_IMAGES[t] for t in config["tiers"] if t in CONFORMANCE_IMAGES}
    dsec_wheel(dest / "wheels")
    images = dest / "images"
    images.mkdir()
    layers = {}
    for name, path in _layer_files(tuple(sorted(names))).items():
        _link_or_copy(path, images / f"{name}.erofs")
        digest = path.name.rsplit("-", 1)[1].removesuffix(".erofs")
        layers[name] = {"file": f"images/{name}.erofs", "sha256": digest}
    if with_tree:
        tree = dest / "tree"
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "evidence")
        shutil.copytree(REPO / "tests", tree / "tests", ignore=ignore)
        (tree / "benchmarks").mkdir(parents=True)
        shutil.copy2(REPO / "benchmarks/hostprobe.py", tree / "benchmarks/hostprobe.py")
        shutil.copy2(REPO / "pyproject.toml", tree / "pyproject.toml")
    shutil.copy2(Path(__file__).with_name("inguest.py"), dest / "inguest.py")
    (dest / "out").mkdir()
    toolkits = _toolkit_files(layers, images) if "fncall" in config["tiers"] else {}
    full = {
        **config,
        "layers": layers,
        "toolkits": toolkits,
        "conformance": conformance and config.get("conformance", True),
    }
    (dest / "config.json").write_text(json.dumps(full, indent=1))


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(root, f)).st_size
    return total


def make_disk(tree: Path, image: Path, spare_mb: int = 512) -> None:
    """``tree`` as an ext4 image (label ``dsec-payload``) with ``spare_mb`` MiB free for the
    guest's results. Without a journal: what the guest synced before it powered off is in
    place for ``debugfs`` (which does not replay a journal)."""
    size_mb = int(_tree_bytes(tree) * 1.15 / 2**20) + spare_mb
    proc = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-L", "dsec-payload",
         "-d", os.fspath(tree), os.fspath(image), f"{size_mb}M"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=600,
        check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"mkfs.ext4 -d {tree} failed: {proc.stderr.decode(errors='replace')}")


def read_back(image: Path, dest: Path) -> None:
    """Copy the guest's ``out/`` from the (no longer running) payload image to ``dest/out``
    (``debugfs rdump``: nothing is mounted)."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest / "out", ignore_errors=True)
    proc = subprocess.run(
        ["debugfs", "-R", f"rdump /out {dest}", os.fspath(image)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"debugfs rdump failed: {proc.stderr.decode(errors='replace')}")
