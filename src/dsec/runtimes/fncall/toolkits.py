"""Toolkit layers: packages installed over an image, stored as one EROFS layer.

A :class:`Toolkit` names Debian packages, and optionally pinned PyPI and npm packages (the
registries are reachable when a toolkit is built, never from a running worker).
:func:`build_toolkit_image` is a pure function of (base layer digests, toolkit contents,
suite): the result is cached as the image ``fncall-<toolkit>:<key>`` where ``key`` hashes
those inputs, so a second call returns at once. The build:

1. in a child process with a private mount namespace (``unshare --mount``; every mount
   vanishes with it), mount the base EROFS layers, stack an overlay with an empty upper
   directory on disk, bind ``/dev`` and mount ``/proc`` in it;
2. ``chroot`` and ``apt-get install --no-install-recommends`` the packages (the base's apt
   sources; ``/etc/resolv.conf`` is lent for the build and removed); then, if the toolkit
   has them, ``pip install`` of the pinned PyPI packages (wheels only) with the image's
   ``python3`` (Debian's pip puts them in ``/usr/local/lib/python3.X/dist-packages``) and
   ``npm install`` of the pinned npm packages into :data:`NODE_MODULES_PREFIX`
   (``node_modules`` there, found through ``NODE_PATH``); then the toolkit's
   ``build_only`` packages are purged;
3. drop apt/pip/npm caches and logs from the upper, then ``LayerStore.build_layer(upper,
   "toolkit")`` turns it into a layer (overlay whiteouts are kept, so deletions stack) and
   ``put_image`` records base + toolkit.

Toolkits compose: one language's pool may stack several (``LanguageSpec.toolkits``), each
built over the image of the ones before it, so a heavy library set is a layer of its own
that only the pools asking for it carry.

Reproducibility: inputs are fixed, but Debian's archive moves; point the base image's apt
sources at ``snapshot.debian.org`` for bit-identical rebuilds. PyPI and npm packages are
pinned to exact versions (npm's transitive dependencies are resolved at build time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.errors import ImageNotFound, SandboxError
from dsec.layers.builtin_cache import BuiltinCache, flocked
from dsec.models import ImageInfo

log = logging.getLogger("dsec.fncall.toolkits")

__all__ = ["NODE_MODULES_PREFIX", "TOOLKITS", "Toolkit", "build_toolkit_image", "toolkit_key"]

NODE_MODULES_PREFIX = "/usr/local/lib/dsec-node"
"""npm packages of a toolkit go to ``<prefix>/node_modules`` (``NODE_PATH`` of nodejs)."""


@dataclass(frozen=True)
class Toolkit:
    """What one toolkit layer installs.

    ``apt``: Debian (bookworm) package names. ``pip``: ``name==version`` requirements,
    installed with the image's ``/usr/bin/python3`` under ``/usr/local`` (``apt`` must
    provide ``python3-pip``). ``npm``: ``name@version`` specs, installed into
    :data:`NODE_MODULES_PREFIX` (``apt`` must provide ``npm``).
    """

    apt: tuple[str, ...]
    pip: tuple[str, ...] = ()
    npm: tuple[str, ...] = ()
    build_only: tuple[str, ...] = ()
    """Debian packages installed for the build and purged (with what only they pulled in)
    before the layer is made: ``npm`` (60 MB of ``node-*`` packages no program needs)."""


SANDBOXFUSION_PYTHON: tuple[str, ...] = (
    # SandboxFusion's runtime/python/requirements.txt, its versions; see docs/sandboxfusion.md
    # for the ones left out (GPU frameworks, GUI toolkits, sdist-only or conflicting pins)
    "requests==2.31.0",
    "requests-toolbelt==1.0.0",
    "numpy==1.26.3",
    "pandas==2.2.0",
    "scipy==1.11.4",
    "matplotlib==3.8.2",
    "seaborn==0.13.2",
    "scikit-learn==1.4.0",
    "statsmodels==0.14.1",
    "pillow==10.2.0",
    "lxml==5.1.0",
    "beautifulsoup4==4.12.3",
    "bs4==0.0.2",
    "openpyxl==3.1.2",
    "xlrd==2.0.1",
    "XlsxWriter==3.1.9",
    "xlwt==1.3.0",
    "toml==0.10.2",
    "Flask==3.0.1",
    "Werkzeug==3.0.1",
    "Django==5.0.1",
    "pytest==7.4.4",
    "pytest-mock==3.12.0",
    "coverage==7.4.0",
    "shapely==2.0.2",
    "plotly==5.18.0",
    "pycryptodome==3.20.0",
    "pycryptodomex==3.20.0",
    "cryptography==42.0.5",
    "PyJWT==2.8.0",
    "psutil==5.9.8",
    "jsonlines==4.0.0",
    "tabulate==0.9.0",
    "colorama==0.4.4",
    "Faker==25.1.0",
    "pydantic==2.6.4",
    "python-docx==1.1.2",
    "PyPDF2==3.0.1",
    "APScheduler==3.10.4",
    "astor==0.8.1",
    "absl-py==2.1.0",
    "nltk==3.8.1",
    "gmpy2==2.1.5",
    "xarray==2023.6.0",
    "pulp==2.8.0",
)
"""The Python libraries of the ``python-runtime`` toolkit (pinned)."""

SANDBOXFUSION_NODE: tuple[str, ...] = (
    # SandboxFusion's runtime/node/package.json (the packages code calls with require();
    # jest/babel/puppeteer are for its jest and typescript modes, which dsec does not run)
    "lodash@4.17.21",
    "js-md5@0.7.3",
    "random-seed@0.3.0",
    "seedrandom@3.0.5",
    "commander@12.1.0",
    "jsdom@24.1.0",
)
"""The npm packages of the ``nodejs`` toolkit (pinned)."""

TOOLKITS: dict[str, Toolkit] = {
    "gcc": Toolkit(("gcc", "g++", "libc6-dev")),
    "nodejs": Toolkit(("nodejs",), npm=SANDBOXFUSION_NODE, build_only=("npm",)),
    "golang": Toolkit(("golang-go",)),
    "java": Toolkit(("default-jdk-headless", "libjavatuples-java")),
    "rust": Toolkit(("rustc",)),
    "python-runtime": Toolkit(("python3-pip",), pip=SANDBOXFUSION_PYTHON),
}
"""Toolkit name -> what it installs."""

_BUILD_TIMEOUT_S = 1800.0


def toolkit_key(
    base_layers: list[str],
    packages: tuple[str, ...],
    pip: tuple[str, ...] = (),
    npm: tuple[str, ...] = (),
    build_only: tuple[str, ...] = (),
) -> str:
    """16 hex digits naming a toolkit build: sha256 of the inputs (order-free).

    A toolkit with Debian packages only hashes as it did before PyPI and npm packages
    existed, so its cached layers stay valid.
    """
    doc: dict[str, Any] = {"base": base_layers, "packages": sorted(packages), "v": 1}
    if pip or npm or build_only:
        doc["pip"], doc["npm"] = sorted(pip), sorted(npm)
    if build_only:
        doc["build_only"] = sorted(build_only)
    blob = json.dumps(doc, sort_keys=True)
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
    kit = TOOLKITS.get(toolkit)
    if kit is None:
        raise ImageNotFound(f"no toolkit {toolkit!r}; known: {', '.join(sorted(TOOLKITS))}")
    packages = kit.apt
    base = store.ensure_image_sync(base_image)
    key = toolkit_key(list(base.layers), packages, kit.pip, kit.npm, kit.build_only)
    name = f"fncall-{toolkit}:{key}"
    try:
        return store.get_image(name)
    except ImageNotFound:
        pass
    cache = BuiltinCache.from_env()  # the machine-wide cache, where configured
    lock_dir = cache.root if cache is not None else Path(store.root) / "locks"
    with flocked(lock_dir / f"toolkit-{toolkit}-{key}.lock"):  # one build at a time per key
        try:
            return store.get_image(name)
        except ImageNotFound:
            pass
        layer_meta = {
            "packages": list(packages),
            "pip": list(kit.pip),
            "npm": list(kit.npm),
            "base": base_image,
            "key": key,
        }
        cached = cache.find(f"toolkit-{toolkit}", key) if cache is not None else None
        if cached is not None:
            layer = store.adopt_cached_layer(
                cached, "toolkit", name=f"toolkit-{toolkit}", meta=layer_meta
            )
            log.info("toolkit %s taken from the built-in cache %s", toolkit, cached.parent)
            return store.put_image(
                name, [*base.layers, layer.digest], meta={"toolkit": toolkit, "base": base_image}
            )
        image = _build(store, base, base_image, toolkit, kit, key, name, layer_meta)
        if cache is not None:
            cache.store(f"toolkit-{toolkit}", key, Path(store.layer_path(image.layers[-1])))
        return image


def _build(
    store: Any,
    base: ImageInfo,
    base_image: str,
    toolkit: str,
    kit: Toolkit,
    key: str,
    name: str,
    layer_meta: dict[str, Any],
) -> ImageInfo:
    packages = kit.apt
    work = Path(store.scratch) / f"toolkit-{toolkit}-{key}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    upper = work / "upper"
    upper.mkdir(parents=True)
    (work / "ovl-work").mkdir()
    (work / "merged").mkdir()
    layer_files = [str(store.layer_path(d)) for d in base.layers]
    spec = {
        "work": str(work),
        "layers": layer_files,
        "packages": list(packages),
        "pip": list(kit.pip),
        "npm": list(kit.npm),
        "build_only": list(kit.build_only),
    }
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
            "var/cache/pip",
        ):
            p = upper / junk
            if p.is_dir() and not p.is_symlink():
                for child in p.iterdir():
                    if child.is_dir() and not child.is_symlink():
                        shutil.rmtree(child, ignore_errors=True)
                    else:
                        child.unlink(missing_ok=True)
        (upper / "etc" / "resolv.conf").unlink(missing_ok=True)
        layer = store.build_layer(upper, "toolkit", name=f"toolkit-{toolkit}", meta=layer_meta)
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
    from dsec.privileged.mount import MS_BIND, MS_REC, mount, mount_erofs

    work = Path(spec["work"])
    lowers = []
    for i, f in enumerate(spec["layers"]):
        mp = work / f"l{i}"
        mp.mkdir()
        mount_erofs(f, mp)  # from the file or a loop device, freed with the namespace
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
    build_only = list(spec.get("build_only") or [])
    for cmd in (
        [*apt, "update"],
        [*apt, "install", "-y", "--no-install-recommends", *spec["packages"], *build_only],
        [*apt, "clean"],
    ):
        subprocess.run(["chroot", str(merged), *cmd], env=env, check=True)
    if spec.get("pip") or spec.get("npm"):
        # the node's CA bundle, lent like resolv.conf: it may trust a proxy the image does not
        host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
        if host_ca.is_file():
            shutil.copyfile(host_ca, merged / "tmp" / "dsec-build-ca.crt")
            ca = "/tmp/dsec-build-ca.crt"
            env |= {"PIP_CERT": ca, "SSL_CERT_FILE": ca, "NODE_EXTRA_CA_CERTS": ca}
            env["npm_config_cafile"] = ca
    if spec.get("pip"):
        pip = ["/usr/bin/python3", "-m", "pip", "install", "--no-cache-dir"]
        # Debian marks its python "externally managed"; this is an image build, not a host
        pip += ["--break-system-packages", "--no-warn-script-location", "--only-binary=:all:"]
        subprocess.run(["chroot", str(merged), *pip, *spec["pip"]], env=env, check=True)
    if spec.get("npm"):
        npm = ["npm", "install", "--no-audit", "--no-fund", "--omit=dev", "--no-save"]
        npm += ["--prefix", NODE_MODULES_PREFIX, "--cache", "/tmp/npm-cache"]
        subprocess.run(
            ["chroot", str(merged), "mkdir", "-p", NODE_MODULES_PREFIX], env=env, check=True
        )
        subprocess.run(["chroot", str(merged), *npm, *spec["npm"]], env=env, check=True)
    if build_only:
        purge = [*apt, "purge", "-y", "--autoremove", *build_only]
        subprocess.run(["chroot", str(merged), *purge], env=env, check=True)


if __name__ == "__main__":
    _build_in_namespace(json.loads(sys.argv[1]))
