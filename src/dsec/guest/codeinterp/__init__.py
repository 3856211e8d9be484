"""dsec's code-interpreter server: E2B's code-interpreter API on port 49999 inside a sandbox.

The unmodified ``e2b-code-interpreter`` client (and smolagents' ``E2BExecutor``) talk to
it: ``POST /execute`` streams NDJSON lines, ``/contexts`` creates, lists, restarts and
removes stateful kernels (Python via ipykernel, bash and JavaScript via the small kernels
beside this file). See ``docs/code-interpreter.md``.

This package runs *inside* the sandbox, under the image's ``python3`` with Debian's
``python3-ipykernel``, ``python3-jupyter-client`` and ``python3-tornado``; it imports
nothing from dsec. It is installed into an image as the top-level package
``dsec_codeinterp`` (:func:`install_into`) and started with ``python3 -m dsec_codeinterp``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

__all__ = ["PACKAGE_NAME", "fingerprint", "install_into", "source_dir"]

PACKAGE_NAME = "dsec_codeinterp"
"""The top-level name this package has inside an image."""

_FILES = ("*.py", "*.js")


def source_dir() -> Path:
    """The directory holding the server's files (this package)."""
    return Path(__file__).resolve().parent


def install_into(site_dir: Path) -> Path:
    """Copy the server into ``site_dir/dsec_codeinterp`` (created; replaced if present).

    ``site_dir`` is a directory on the target Python's ``sys.path`` (in an image:
    ``/usr/lib/python3/dist-packages``). Returns the package directory.
    """
    dest = Path(site_dir) / PACKAGE_NAME
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for pattern in _FILES:
        for path in sorted(source_dir().glob(pattern)):
            shutil.copyfile(path, dest / path.name)
            (dest / path.name).chmod(0o644)
    dest.chmod(0o755)
    return dest


def fingerprint() -> str:
    """sha256 (16 hex digits) of the files :func:`install_into` copies: an image built with
    other server code is outdated."""
    import hashlib

    h = hashlib.sha256()
    for pattern in _FILES:
        for path in sorted(source_dir().glob(pattern)):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
