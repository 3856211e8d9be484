"""E2B's user in the trees of built-in images: ``user`` (uid 1000, home ``/home/user``),
made from the ``sandbox`` user the ``debian`` tree has (:data:`dsec.layers.builtin.SANDBOX_UID`).

Steps of the ``desktop`` and ``code-interpreter`` recipes (:mod:`dsec.layers.desktop`,
:mod:`dsec.layers.code_interpreter`): :class:`RenameUser` and :class:`PasswordlessSudo`,
applied to a tree by :func:`rename_user` and :func:`passwordless_sudo`. Their ``repr`` is
part of each recipe's fingerprint: changing a field rebuilds the images that use it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PasswordlessSudo", "RenameUser", "passwordless_sudo", "rename_user"]


@dataclass(frozen=True)
class RenameUser:
    """Rename the base image's user ``old`` (uid 1000) to ``new`` with home ``home``."""

    old: str
    new: str
    home: str


@dataclass(frozen=True)
class PasswordlessSudo:
    """Let ``user`` run anything with ``sudo`` and no password (``/etc/sudoers.d/e2b-user``,
    0440), as E2B's templates do. A sandbox needs setuid programs for it (the E2B API creates
    its sandboxes so on the container tier)."""

    user: str


def rename_user(root: Path, step: RenameUser) -> None:
    """``old`` becomes ``new`` in passwd, group, shadow and gshadow of the tree at ``root``;
    the home directory is recreated at ``home`` from ``/etc/skel`` (owned by uid/gid 1000)."""
    for name in ("passwd", "group", "shadow", "gshadow"):
        path = root / "etc" / name
        if not path.exists():
            continue
        out = []
        for line in path.read_text().splitlines():
            fields = line.split(":")
            if fields and fields[0] == step.old:
                fields[0] = step.new
                if name == "passwd" and len(fields) >= 7:
                    fields[4] = step.new
                    fields[5] = step.home
            out.append(":".join(fields))
        mode = path.stat().st_mode & 0o7777
        path.write_text("\n".join(out) + "\n")
        os.chmod(path, mode)
    old_home = root / "home" / step.old
    if old_home.is_dir() and not old_home.is_symlink():
        shutil.rmtree(old_home)
    home = root / step.home.lstrip("/")
    if not home.exists():
        skel = root / "etc/skel"
        if skel.is_dir():
            shutil.copytree(skel, home, symlinks=True)
        else:
            home.mkdir(parents=True)
    os.chmod(home, 0o755)
    if os.geteuid() == 0:
        for dirpath, dirnames, filenames in os.walk(home):
            for entry in [*dirnames, *filenames]:
                os.chown(os.path.join(dirpath, entry), 1000, 1000, follow_symlinks=False)
        os.chown(home, 1000, 1000)


def passwordless_sudo(root: Path, step: PasswordlessSudo) -> None:
    """Write ``/etc/sudoers.d/e2b-user`` for ``step.user`` in the tree at ``root``."""
    sudoers = root / "etc/sudoers.d"
    sudoers.mkdir(parents=True, exist_ok=True)
    path = sudoers / "e2b-user"
    path.write_text(f"{step.user} ALL=(ALL:ALL) NOPASSWD: ALL\n")
    os.chmod(path, 0o440)
