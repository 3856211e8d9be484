"""Build a layer *on top of* other layers: the changes a function makes to their merged tree.

:func:`build_over` mounts the lower layers (EROFS files, bottom first) read-only, stacks an
overlay with an empty upper directory on them and calls ``fn(merged_root)`` on the merged
tree; what ``fn`` changed is the upper directory, which :meth:`LayerStore.build_layer` turns
into a layer: new and modified files as they are, deletions as overlay whiteouts (0:0
character devices) and opaque directories (``trusted.overlay.opaque``), which ``mkfs.erofs``
keeps and overlayfs honours in lower layers too (see :mod:`dsec.layers.snapshot`). Stacked on
the same lowers the layer shows exactly the tree ``fn`` left.

Everything happens in a child process with a private mount namespace (``unshare --mount``):
its mounts vanish with it, whatever happens to the build. The overlay is mounted with
``redirect_dir=off`` (a renamed lower directory is copied, so the upper never depends on
redirects), ``metacopy=off`` (every changed file carries its data) and ``index=off``.
``fn`` is named by its import path (``module:function``), so it must be a module-level
function; it runs as root in the child and may chroot into the tree.

Example::

    upper = build_over(store.scratch / "build-x", [store.layer_path(d) for d in base.layers],
                       my_module.install_things)
    layer = store.build_layer(upper, "toolkit", name="things")
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dsec.errors import InvalidRequest, SandboxError

__all__ = ["BUILD_TIMEOUT_S", "build_over", "function_path"]

BUILD_TIMEOUT_S = 3600.0
"""Longest a build on top of layers may take, seconds."""


def function_path(fn: Callable[[Path], None]) -> str:
    """``module:qualname`` of a module-level function (what the build child imports).

    Raises:
        InvalidRequest: ``fn`` is a lambda, a closure or a method.
    """
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not qualname or "<" in qualname or "." in qualname:
        raise InvalidRequest(f"{fn!r} is not a module-level function (a build child imports it)")
    return f"{module}:{qualname}"


def _resolve(path: str) -> Callable[[Path], None]:
    module, _, name = path.partition(":")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{path} is not callable")
    return fn


def build_over(work: Path, lower_files: list[Path], fn: Callable[[Path], None]) -> Path:
    """Run ``fn(merged)`` over the layers ``lower_files`` (EROFS files, bottom first) and
    return the upper directory (``work/upper``) holding what it changed.

    ``work`` must not exist or be empty; the caller removes it after building the layer.
    Blocks for as long as ``fn`` runs (at most :data:`BUILD_TIMEOUT_S`).

    Raises:
        InvalidRequest: no lower layers, or ``fn`` is not a module-level function.
        SandboxError: the child failed (the tail of its output is in the message).
    """
    if not lower_files:
        raise InvalidRequest("a build on top of layers needs at least one lower layer")
    target = function_path(fn)
    work = Path(os.path.abspath(work))
    if work.exists() and any(work.iterdir()):
        raise SandboxError(f"{work} is not empty", path=str(work))
    for d in ("upper", "ovl-work", "merged"):
        (work / d).mkdir(parents=True, exist_ok=True)
    spec = {
        "work": str(work),
        "layers": [os.path.abspath(p) for p in lower_files],
        "fn": target,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        proc = subprocess.run(
            [
                *("unshare", "--mount", "--propagation", "private", "--"),
                *(sys.executable, "-m", "dsec.layers.overlay_build", json.dumps(spec)),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as e:
        raise SandboxError("unshare not found: install util-linux") from e
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"the build over layers timed out after {BUILD_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.decode(errors="replace").strip().splitlines()[-30:])
        raise SandboxError(
            f"the build over layers ({target}) failed (exit {proc.returncode}):\n{tail}",
            exit_code=proc.returncode,
        )
    shutil.rmtree(work / "ovl-work", ignore_errors=True)
    return work / "upper"


def _child(spec: dict[str, object]) -> None:
    """The build in its own mount namespace (``python -m dsec.layers.overlay_build SPEC``)."""
    from dsec.privileged.mount import mount, mount_erofs

    work = Path(str(spec["work"]))
    layers = [str(p) for p in spec["layers"]]  # type: ignore[attr-defined]
    lowers = []
    for i, f in enumerate(layers):
        mp = work / f"l{i}"
        mp.mkdir(exist_ok=True)
        mount_erofs(f, mp)  # from the file or a loop device, freed with the namespace
        lowers.append(str(mp))
    merged = work / "merged"
    opts = (
        f"lowerdir={':'.join(reversed(lowers))},upperdir={work / 'upper'},"
        f"workdir={work / 'ovl-work'},redirect_dir=off,metacopy=off,index=off"
    )
    mount("overlay", merged, "overlay", 0, opts)
    fn = _resolve(str(spec["fn"]))
    fn(merged)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
