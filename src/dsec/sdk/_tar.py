"""Packing local files for upload: a directory as one tar archive (``files.upload_dir``,
image build contexts)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

from dsec.errors import InvalidRequest

__all__ = ["build_context", "tar_directory"]


def tar_directory(root: Path) -> bytes:
    """The contents of the local directory ``root`` as an uncompressed PAX tar (names
    relative to ``root``, sorted). Regular files, directories and symlinks are packed;
    other file types are skipped."""
    if not root.is_dir():
        raise InvalidRequest(f"not a local directory: {root}", path=str(root))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in [*sorted(dirnames), *sorted(filenames)]:
                full = Path(dirpath) / name
                rel = full.relative_to(root).as_posix()
                if full.is_symlink() or full.is_file() or full.is_dir():
                    tar.add(full, arcname=rel, recursive=False)
    return buf.getvalue()


def build_context(path: Path) -> bytes:
    """An image build context from a local ``path``: a directory is packed with
    :func:`tar_directory`; a tar archive (plain or compressed) is sent as it is."""
    if path.is_dir():
        return tar_directory(path)
    if not path.is_file():
        raise InvalidRequest(f"build context {path} is neither a directory nor a file")
    if not tarfile.is_tarfile(path):
        raise InvalidRequest(f"build context {path} is not a tar archive")
    return path.read_bytes()
