"""Toolkit layers: Debian packages installed over an image, stored as one EROFS layer.

:func:`build_toolkit_image` is a pure function of (base layer digests, package list, suite):
the result is cached as the image ``fncall-<toolkit>:<key>`` where ``key`` hashes those
inputs, so a second call returns at once. The build:

1. in a child process with a private mount namespace (``unshare --mount``; every mount
   vanishes with it), mount the base EROFS layers, stack an overlay with an empty upper
   directory on disk, bind ``/dev`` and mount ``/proc`` in it;
2. ``chroot`` and ``apt-get install --no-install-recommends`` the packages (the base's apt
   sources; ``/etc/resolv.conf`` is lent for the build and removed);
3. drop apt caches and logs from the upper, then ``LayerStore.build_layer(upper,
   "toolkit")`` turns it into a layer (overlay whiteouts are kept, so deletions stack) and
   ``put_image`` records base + toolkit.

Reproducibility: inputs are fixed, but Debian's archive moves; point the base image's apt
sources at ``snapshot.debian.org`` for bit-identical rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from dsec.errors import ImageNotFound, SandboxError
from dsec.models import ImageInfo

log = logging.getLogger("dsec.fncall.toolkits")

__all__ = ["TOOLKITS", "build_toolkit_image", "toolkit_key"]

TOOLKITS: dict[str, tuple[str, ...]] = {
    "gcc": ("gcc", "g++", "libc6-dev"),
    "nodejs": ("nodejs",),
    "golang": ("golang-go",),
    "java": ("default-jdk-headless",),
}
"""Toolkit name -> Debian packages (bookworm)."""

_BUILD_TIMEOUT_S = 1800.0


def toolkit_key(base_layers: list[str], packages: tuple[str, ...]) -> str:
    """16 hex digits naming a toolkit build: sha256 of the inputs."""
    blob = json.dumps({"base": base_layers, "packages": sorted(packages), "v": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_toolkit_image(store: Any, base_image: str, toolkit: str) -> ImageInfo:
    """The image = ``base_image`` + the ``toolkit`` layer, building the layer if needed.

    Blocking (minutes on first use: apt downloads); call it from a worker thread.

    Args:
        store: a :class:`dsec.layers.LayerStore`.
        base_image: name of the base image (e.g. ``debian``); built first if it is built-in.
        toolkit: a key of :data:`TOOLKITS`.

    Raises:
        ImageNotFound: unknown toolkit. SandboxError: the build failed (apt output included).
    """
    packages = TOOLKITS.get(toolkit)
    if packages is None:
        raise ImageNotFound(f"no toolkit {toolkit!r}; known: {', '.join(sorted(TOOLKITS))}")
    base = store.ensure_image_sync(base_image)
    key = toolkit_key(list(base.layers), packages)
    name = f"fncall-{toolkit}:{key}"
    try:
        return store.get_image(name)
    except ImageNotFound:
        pass
    work = Path(store.scratch) / f"toolkit-{toolkit}-{key}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    upper = work / "upper"
    upper.mkdir(parents=True)
    (work / "ovl-work").mkdir()
    (work / "merged").mkdir()
    layer_files = [str(store.layer_path(d)) for d in base.layers]
    spec = {"work": str(work), "layers": layer_files, "packages": list(packages)}
    log.info("building toolkit %s (%s) over %s", toolkit, " ".join(packages), base_image)
    try:
        proc = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                sys.executable,
                "-m",
                "dsec.runtimes.fncall.toolkits",
                json.dumps(spec),
            ],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            raise SandboxError(
                f"building toolkit {toolkit} failed (exit {proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}",
                toolkit=toolkit,
            )
        for junk in (
            "var/lib/apt/lists",
            "var/cache/apt",
            "var/log",
            "var/cache/debconf",
            "tmp",
            "root",
        ):
            p = upper / junk
            if p.is_dir() and not p.is_symlink():
                for child in p.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        (upper / "etc" / "resolv.conf").unlink(missing_ok=True)
        layer = store.build_layer(
            upper,
            "toolkit",
            name=f"toolkit-{toolkit}",
            meta={"packages": list(packages), "base": base_image, "key": key},
        )
        return store.put_image(
            name,
            [*base.layers, layer.digest],
            meta={"toolkit": toolkit, "base": base_image},
        )
    except subprocess.TimeoutExpired as e:
        raise SandboxError(
            f"building toolkit {toolkit} timed out after {_BUILD_TIMEOUT_S} s"
        ) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build_in_namespace(spec: dict[str, Any]) -> None:
    """Runs as ``python -m dsec.runtimes.fncall.toolkits SPEC`` inside ``unshare --mount``."""
    from dsec.privileged.mount import MS_BIND, MS_RDONLY, MS_REC, mount

    work = Path(spec["work"])
    lowers = []
    for i, f in enumerate(spec["layers"]):
        mp = work / f"l{i}"
        mp.mkdir()
        mount(f, mp, "erofs", MS_RDONLY)
        lowers.append(str(mp))
    merged = work / "merged"
    opts = f"lowerdir={':'.join(reversed(lowers))},upperdir={work / 'upper'},workdir={work / 'ovl-work'}"
    mount("overlay", merged, "overlay", 0, opts)
    mount("/dev", merged / "dev", None, MS_BIND | MS_REC)
    mount("proc", merged / "proc", "proc", 0)
    resolv = merged / "etc" / "resolv.conf"
    if resolv.is_symlink():
        resolv.unlink()
    shutil.copyfile("/etc/resolv.conf", resolv)
    env = {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "DEBIAN_FRONTEND": "noninteractive",
        "LANG": "C.UTF-8",
        "HOME": "/root",
    }
    apt = ["apt-get", "-o", "Acquire::Retries=3", "-o", "APT::Sandbox::User=root"]
    for cmd in (
        [*apt, "update"],
        [*apt, "install", "-y", "--no-install-recommends", *spec["packages"]],
        [*apt, "clean"],
    ):
        subprocess.run(["chroot", str(merged), *cmd], env=env, check=True)


if __name__ == "__main__":
    _build_in_namespace(json.loads(sys.argv[1]))
