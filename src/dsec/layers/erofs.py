"""Build EROFS images with ``mkfs.erofs`` (erofs-utils), reproducibly.

What "reproducible" means here: the same source tree (same names, bytes, modes, owners,
xattrs *and mtimes*) gives a byte-identical image, so a layer's sha256 names its content.
Per-file mtimes are part of the content on purpose: Python's ``.pyc`` validation, ``make``
and many other tools compare them, so flattening them would change behaviour.

The flags, and why:

* no ``-T``: in erofs-utils 1.5 (Debian 12) ``-T``/``SOURCE_DATE_EPOCH`` force *every* file's
  mtime to that value (there is no "fixed superblock time, keep file times" mode). We keep the
  file times and instead normalise the superblock afterwards (below). ``SOURCE_DATE_EPOCH`` is
  removed from mkfs's environment for the same reason.
* ``-Eforce-inode-extended``: compact (32-byte) inodes carry no mtime of their own and inherit
  the superblock build time; forcing extended inodes makes every mtime explicit, so rewriting
  the superblock time cannot change any file's time. Costs 32 bytes per inode (~0.3 MB for a
  Debian rootfs).
* no ``--all-root``: ownership is content (``/home/sandbox`` is uid 1000).
* ``-zlz4 -C131072``: LZ4 with up to 128 KiB physical clusters: fast to decompress, the
  ratio MACHINE.md measured (Debian minbase 206 MB -> 123 MB in 0.9 s). ``compress=None``
  stores data uncompressed.
* after mkfs, the superblock's build time is set to 0 and its UUID to one derived from the
  image's own hash (then the superblock CRC32C is recomputed). A *distinct* UUID per layer
  matters: overlayfs turns ``xino`` off when two lower layers share a UUID (or have a null
  one), and without ``xino`` files from different layers report different ``st_dev``.

Example::

    mkfs_erofs(Path("rootfs"), Path("layer.erofs"))            # lz4, 128 KiB clusters
    mkfs_erofs(Path("rootfs"), Path("plain.erofs"), compress=None)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import subprocess
import uuid
from pathlib import Path

from dsec.errors import InvalidRequest, SandboxError

__all__ = [
    "EROFS_MAGIC",
    "PCLUSTER_BYTES",
    "is_erofs_file",
    "mkfs_erofs",
    "normalize_superblock",
    "superblock_uuid",
]

EROFS_MAGIC = 0xE0F5E1E2
"""Little-endian magic at byte offset 1024 of every EROFS image."""

PCLUSTER_BYTES = 131072
"""Largest compressed physical cluster, bytes (mkfs ``-C``)."""

_SB_OFFSET = 1024
_OFF_CHECKSUM = 4
_OFF_FEATURE_COMPAT = 8
_OFF_BLKSZBITS = 12
_OFF_BUILD_TIME = 24
_OFF_BUILD_TIME_NSEC = 32
_OFF_UUID = 48
_FEATURE_COMPAT_SB_CHKSUM = 0x1
_COMPRESS_RE = re.compile(r"^[a-z0-9]{1,16}(,[0-9]{1,3})?$")
_MKFS_TIMEOUT_S = 3600.0


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC32C_TABLE = _crc32c_table()


def _crc32c_raw(data: bytes, crc: int = 0xFFFFFFFF) -> int:
    """CRC32C (Castagnoli) without the final inversion, as the kernel's ``crc32c()`` returns."""
    table = _CRC32C_TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc


def is_erofs_file(path: Path) -> bool:
    """True if ``path`` is a regular file starting with an EROFS superblock."""
    try:
        with open(path, "rb") as f:
            f.seek(_SB_OFFSET)
            head = f.read(4)
    except OSError:
        return False
    return len(head) == 4 and struct.unpack("<I", head)[0] == EROFS_MAGIC


def superblock_uuid(path: Path) -> uuid.UUID:
    """The filesystem UUID recorded in an EROFS image's superblock."""
    with open(path, "rb") as f:
        f.seek(_SB_OFFSET + _OFF_UUID)
        return uuid.UUID(bytes=f.read(16))


def _sha256_with_block0(path: Path, block0: bytes) -> bytes:
    """sha256 of the file with its first ``len(block0)`` bytes replaced by ``block0``."""
    h = hashlib.sha256(block0)
    with open(path, "rb") as f:
        f.seek(len(block0))
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()


def normalize_superblock(path: Path) -> None:
    """Make an EROFS image a pure function of its content, in place.

    Sets the superblock build time to 0 (every inode is extended, so no file inherits it),
    sets the UUID to the first 16 bytes of the sha256 of the image with time, UUID and
    checksum zeroed (version/variant bits set as a name-based UUID), and recomputes the
    superblock CRC32C when the image carries one.

    Raises:
        SandboxError: the file is not an EROFS image.
    """
    with open(path, "r+b") as f:
        f.seek(_SB_OFFSET)
        sb_head = f.read(16)
        if len(sb_head) < 16 or struct.unpack_from("<I", sb_head, 0)[0] != EROFS_MAGIC:
            raise SandboxError(f"{path} is not an EROFS image", path=str(path))
        blksz = 1 << sb_head[_OFF_BLKSZBITS]
        if blksz < 2 * _SB_OFFSET or blksz > 65536:
            raise SandboxError(f"{path}: unsupported EROFS block size {blksz}", path=str(path))
        f.seek(0)
        block0 = bytearray(f.read(blksz))
        if len(block0) != blksz:
            raise SandboxError(f"{path}: truncated EROFS image", path=str(path))
        sb = _SB_OFFSET
        struct.pack_into("<QI", block0, sb + _OFF_BUILD_TIME, 0, 0)
        block0[sb + _OFF_UUID : sb + _OFF_UUID + 16] = bytes(16)
        struct.pack_into("<I", block0, sb + _OFF_CHECKSUM, 0)
        content_hash = _sha256_with_block0(path, bytes(block0))
        fs_uuid = uuid.UUID(bytes=content_hash[:16], version=5)
        block0[sb + _OFF_UUID : sb + _OFF_UUID + 16] = fs_uuid.bytes
        (feature_compat,) = struct.unpack_from("<I", block0, sb + _OFF_FEATURE_COMPAT)
        if feature_compat & _FEATURE_COMPAT_SB_CHKSUM:
            crc = _crc32c_raw(bytes(block0[sb:blksz]))
            struct.pack_into("<I", block0, sb + _OFF_CHECKSUM, crc)
        f.seek(0)
        f.write(block0)
        f.flush()
        os.fsync(f.fileno())


def _mkfs_binary() -> str:
    found = shutil.which("mkfs.erofs")
    if found is None:
        raise SandboxError("mkfs.erofs not found: install the erofs-utils package")
    return found


def mkfs_erofs(source_dir: Path, dest_file: Path, *, compress: str | None = "lz4") -> None:
    """Build an EROFS image of ``source_dir`` at ``dest_file`` (overwritten), reproducibly.

    Args:
        source_dir: the tree to pack; owners, modes, xattrs, mtimes and device nodes are kept.
        dest_file: the image to write.
        compress: ``"lz4"`` (default), ``"lz4hc"`` or ``"lz4hc,<level>"`` (what the installed
            erofs-utils offers), or ``None`` for no compression. Compressed images use
            physical clusters of up to :data:`PCLUSTER_BYTES` (128 KiB).

    Raises:
        InvalidRequest: ``source_dir`` is not a directory or ``compress`` is malformed.
        SandboxError: mkfs.erofs failed (its stderr is in the message and ``details``).
    """
    if not source_dir.is_dir():
        raise InvalidRequest(f"{source_dir} is not a directory", path=str(source_dir))
    argv = [_mkfs_binary(), "--quiet", "-Eforce-inode-extended"]
    if compress is not None:
        if not _COMPRESS_RE.match(compress):
            raise InvalidRequest(f"invalid compressor {compress!r}", compress=compress)
        argv += [f"-z{compress}", f"-C{PCLUSTER_BYTES}"]
    argv += [os.fspath(dest_file), os.fspath(source_dir)]
    env = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    env["LC_ALL"] = "C"
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env=env,
            timeout=_MKFS_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"mkfs.erofs timed out after {_MKFS_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace").strip()
        stdout = proc.stdout.decode(errors="replace").strip()
        dest_file.unlink(missing_ok=True)
        raise SandboxError(
            f"mkfs.erofs failed (exit {proc.returncode}): {stderr or stdout}",
            argv=argv,
            stderr=stderr,
            exit_code=proc.returncode,
        )
    normalize_superblock(dest_file)
