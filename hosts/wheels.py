"""Wheels for the guests, which have no network: dsec's dependencies and dsec itself.

* :func:`dependency_wheels`: a wheelhouse of what ``dsec[server]`` needs, plus pytest for the
  conformance suite (:data:`EXTRA_REQUIREMENTS`), pinned by the checkout's
  ``constraints.txt``, for the guest's Python. Cached machine-wide as
  ``$DSEC_HOSTS_CACHE/wheels-<key>`` (``key``: the dependency tables of ``pyproject.toml``,
  ``constraints.txt``, the Python version). The image builder installs it into the image's
  venv (:mod:`hosts.image`), so a guest installs only dsec.
* :func:`dsec_wheel`: a wheel of dsec built from a copy of the checkout's sources (the build
  writes nothing into the checkout), every run.

For the host's own Python version the wheelhouse is ``pip wheel`` (sdists are built here);
for another one (Debian 13's 3.13 when the host runs 3.11) it is ``pip download
--only-binary=:all: --python-version X``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from hosts.cache import cache_dir, flocked

__all__ = ["EXTRA_REQUIREMENTS", "dependency_wheels", "dsec_wheel", "requirements"]

log = logging.getLogger("hosts.wheels")

REPO = Path(__file__).resolve().parent.parent
EXTRAS = ("server",)
EXTRA_REQUIREMENTS = ("pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist")
"""Installed beside ``dsec[server]`` in the guest: what the conformance suite runs with
(``tests/conftest.py`` implements an xdist hook, so pytest needs the plugin to load it)."""
_TIMEOUT_S = 1800
_PLATFORMS = (
    "manylinux_2_36_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64",
)  # fmt: skip
"""Wheels a Debian 12 or 13 guest runs (glibc 2.36 and 2.41), for ``pip download``."""


def requirements() -> list[str]:
    """dsec's dependencies with the :data:`EXTRAS`, and :data:`EXTRA_REQUIREMENTS`."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return [*reqs, *EXTRA_REQUIREMENTS]


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    log.info("%s: %s", what, " ".join(cmd)[:300])
    proc = subprocess.run(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.decode(errors="replace").strip().splitlines()[-20:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def wheelhouse_key(python: str) -> str:
    """The digest a wheelhouse for Python ``python`` (``3.11``) is cached under."""
    h = hashlib.sha256()
    h.update(json.dumps([requirements(), python]).encode())
    h.update((REPO / "constraints.txt").read_bytes())
    return h.hexdigest()[:16]


def dependency_wheels(python: str) -> Path:
    """The cached wheelhouse of dsec's dependencies for Python ``python`` (built when
    missing; two runs wanting it at once build it once)."""
    cache = cache_dir()
    final = cache / f"wheels-{python}-{wheelhouse_key(python)}"
    with flocked(cache / f"{final.name}.lock"):
        if (final / ".complete").is_file():
            return final
        work = cache / f".{final.name}-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        try:
            with tempfile.NamedTemporaryFile("w", suffix=".txt") as reqs:
                reqs.write("\n".join(requirements()) + "\n")
                reqs.flush()
                common = ["-q", "-c", os.fspath(REPO / "constraints.txt"), "-r", reqs.name]
                here = f"{sys.version_info.major}.{sys.version_info.minor}"
                if python == here:
                    _pip(["wheel", "--wheel-dir", os.fspath(work), *common], "pip wheel")
                else:
                    _pip(
                        [
                            "download", "--dest", os.fspath(work), "--only-binary=:all:",
                            "--python-version", python,
                            *(f"--platform={p}" for p in _PLATFORMS), *common,
                        ],
                        f"pip download (Python {python})",
                    )  # fmt: skip
            (work / ".complete").write_text("")
            os.rename(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        prefix = f"wheels-{python}-"
        for old in cache.glob(f"{prefix}*"):
            if old.is_dir() and old != final:
                shutil.rmtree(old, ignore_errors=True)
                old.with_name(old.name + ".lock").unlink(missing_ok=True)
    return final


def _copy_source(dest: Path) -> None:
    """What a wheel of dsec is built from: ``pyproject.toml``, ``README.md``, ``src/``
    (``__pycache__`` and ``*.egg-info`` left out)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(REPO / "src", dest / "src", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for lic in REPO.glob("LICENSE*"):
        shutil.copy2(lic, dest / lic.name)


def dsec_wheel(dest: Path) -> Path:
    """A wheel of dsec from the checkout as it is now, into the directory ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hosts-src-") as tmp:
        source = Path(tmp) / "dsec"
        _copy_source(source)
        _pip(
            ["wheel", "-q", "--no-deps", "--wheel-dir", os.fspath(dest), os.fspath(source)],
            "pip wheel (dsec)",
        )
    wheels = sorted(dest.glob("dsec-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip wheel made no dsec wheel in {dest}")
    return wheels[-1]
