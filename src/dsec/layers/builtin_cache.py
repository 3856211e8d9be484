"""A machine-wide cache of built-in image layers, shared by every layer store on the machine.

A built-in image (``debian``, ``desktop``, ...) takes minutes to build and gives the same
layer wherever it is built from the same recipe. Several stores on one machine (several
``DSEC_HOME``s: test servers, a node and a build box, a reinstalled node) build it once when
``DSEC_BUILTIN_CACHE`` names a directory: the first store to need it builds it and leaves a
copy here, the others take that copy (a hard link when on the same filesystem), and a
process that finds another building it waits for that build instead of starting its own.

Layout::

    $DSEC_BUILTIN_CACHE/
      <name>-<key>-<sha256>.erofs    a built layer, mode 0444, never modified
      builtin-<name>-<key>.lock      held (flock) while a process builds or adopts it

Toolkit layers (:mod:`dsec.runtimes.fncall.toolkits`) are kept here the same way, as
``toolkit-<name>-<key>-<sha256>.erofs`` with the toolkit's own key.

``key`` is the recipe's digest: its name, kind, metadata (suite, packages, base layers) and
the source of the module that holds its builder, so a changed recipe or builder is never
served an old layer. Only recipes whose builder is dsec's own code are cached (a recipe a
test or an embedder registers at run time is built every time).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.layers.builtin import BuiltinImage

__all__ = ["ENV", "BuiltinCache", "flocked"]

log = logging.getLogger(__name__)

ENV = "DSEC_BUILTIN_CACHE"


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class BuiltinCache:
    """The directory of built layers (see the module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls) -> BuiltinCache | None:
        """The cache ``$DSEC_BUILTIN_CACHE`` names, or None when it is unset or empty."""
        where = os.environ.get(ENV, "").strip()
        return cls(Path(where)) if where else None

    @staticmethod
    def key(recipe: BuiltinImage, meta: dict[str, Any]) -> str | None:
        """The digest of ``recipe`` as built with ``meta``; None for a builder that is not
        dsec's own code (never cached)."""
        module = sys.modules.get(getattr(recipe.build_rootfs, "__module__", "") or "")
        if module is None or not module.__name__.startswith("dsec."):
            return None
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            return None
        h = hashlib.sha256()
        h.update(
            json.dumps(
                {
                    "name": recipe.name,
                    "kind": recipe.kind,
                    "base": recipe.base,
                    "meta": meta,
                    "builder": recipe.build_rootfs.__qualname__,
                },
                sort_keys=True,
                default=str,
            ).encode()
        )
        h.update(source.encode())
        return h.hexdigest()[:24]

    def find(self, name: str, key: str) -> Path | None:
        """The cached layer of ``name`` built from the recipe ``key``, if there is one."""
        for path in self.root.glob(f"{name}-{key}-*.erofs"):
            if path.is_file():
                return path
        return None

    def store(self, name: str, key: str, blob: Path) -> None:
        """Keep a copy of ``blob`` (a published layer, named ``<sha256>.erofs``) for other
        stores. Failure only costs them a build of their own."""
        hex_ = blob.name.removesuffix(".erofs")
        dest = self.root / f"{name}-{key}-{hex_}.erofs"
        if dest.exists():
            return
        tmp = self.root / f".{dest.name}.{os.getpid()}"
        try:
            try:
                os.link(blob, tmp)
            except OSError:
                shutil.copyfile(blob, tmp)
                os.chmod(tmp, 0o444)
            os.rename(tmp, dest)
            older = re.compile(rf"^{re.escape(name)}-[0-9a-f]{{16,24}}-[0-9a-f]{{64}}\.erofs$")
            for old in self.root.iterdir():  # builds of this image from other recipes
                if old != dest and older.match(old.name):
                    old.unlink(missing_ok=True)
        except OSError as e:
            log.warning("built-in cache %s: cannot keep %s: %s", self.root, name, e)
            tmp.unlink(missing_ok=True)
