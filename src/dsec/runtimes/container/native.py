"""Build the static C helpers on first use.

``dsec_init`` (the container's PID 1), ``dsec_execd`` (the exec server), ``dsec_launch``
(runs the OCI runtime in the launch namespace, :mod:`dsec.privileged.launchns`) and
``fncall_spawn`` (what a fncall worker's command execs through) ship as C sources in
``dsec/native/``. They are compiled on the node, statically
(``cc -O2 -static``: no shared libraries are loaded after the exec server has
entered the container's mount namespace), into ``paths.bin`` under a name that
carries a hash of the source and flags, so an upgrade never runs a stale binary
and several versions can coexist.

Needs: a C compiler (Debian: ``gcc``), static glibc (``libc6-dev``) and, for the
exec server, ``libseccomp-dev`` (``libseccomp.a`` + ``seccomp.h``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from dsec.errors import SandboxError

__all__ = ["NATIVE_SOURCES", "build_native"]

NATIVE_DIR = Path(__file__).resolve().parents[2] / "native"

_FREESTANDING = (
    "-nostdlib",
    "-fno-stack-protector",
    "-fno-builtin",
    "-fno-tree-loop-distribute-patterns",  # no memcpy/memset calls made up for loops
    "-fno-asynchronous-unwind-tables",
)
"""For a helper written without libc (its own ``_start`` and system calls): a few kilobytes
that exec in a tenth of a static glibc binary's time."""

# name -> (source file, extra compiler arguments: libraries, ...)
NATIVE_SOURCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dsec_init": ("dsec_init.c", ()),
    "dsec_execd": ("dsec_execd.c", ("-lseccomp",)),
    "dsec_launch": ("dsec_launch.c", ()),
    "fncall_spawn": ("fncall_spawn.c", _FREESTANDING),
}

_CFLAGS = ("-O2", "-static", "-Wall", "-Wl,-z,now")
_lock = threading.Lock()


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    raise SandboxError(
        "no C compiler found to build the container tier's helpers (install 'gcc')",
        missing="gcc",
    )


def build_native(bin_dir: Path, name: str) -> Path:
    """The compiled helper ``name`` in ``bin_dir``, building it if needed.

    Returns the path of an executable named ``<name>-<hash>``. Raises
    :class:`SandboxError` naming the missing compiler or library on failure.
    """
    if name not in NATIVE_SOURCES:
        raise ValueError(f"unknown native helper {name!r}")
    source_name, libs = NATIVE_SOURCES[name]
    source = NATIVE_DIR / source_name
    text = source.read_bytes()
    digest = hashlib.sha256(text + repr((_CFLAGS, libs)).encode()).hexdigest()[:16]
    out = bin_dir / f"{name}-{digest}"
    if out.exists():
        return out
    with _lock:
        if out.exists():
            return out
        cc = _compiler()
        bin_dir.mkdir(parents=True, exist_ok=True)
        tmp = bin_dir / f".{out.name}.{os.getpid()}.tmp"
        cmd = [cc, *_CFLAGS, "-o", str(tmp), str(source), *libs]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            err = proc.stderr.strip()
            if "seccomp.h" in err or "-lseccomp" in err:
                raise SandboxError(
                    f"building {name} needs libseccomp (install 'libseccomp-dev'): {err[-500:]}",
                    missing="libseccomp-dev",
                )
            if "-lc" in err or "crt1.o" in err or "stdio.h" in err:
                raise SandboxError(
                    f"building {name} needs static glibc (install 'libc6-dev'): {err[-500:]}",
                    missing="libc6-dev",
                )
            raise SandboxError(f"building {name} with {cc} failed: {err[-1000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
        return out
