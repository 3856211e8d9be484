"""Chunk tables: per-piece SHA-256 digests of a layer blob, so that a lazily loaded layer
checks every range it fetches instead of trusting the blob store until a full download.

A layer's digest covers the whole blob, which a lazy mount never reads at once. The table
splits the blob into pieces of :data:`PIECE` bytes (the last one shorter) and lists the
SHA-256 of each. It is itself a content-addressed blob in the same store, named by the
layer's metadata (``meta["chunk_table"]`` = its digest), which travels with the layer
(``dsec image push`` publishes it in the manifest). The lazy server fetches the table once,
checks its digest, then checks each fetched chunk piece by piece: a mismatch is an I/O error
for the reader and nothing is cached (see :mod:`dsec.layers.lazy`).

Format (bytes): ``MAGIC`` (8) | blob size (u64 big-endian) | piece size (u32 big-endian) |
``ceil(size / piece)`` SHA-256 digests (32 bytes each). A 1 GiB layer has a 512 KiB table.

Example::

    table_digest, _ = publish_chunk_table(blob_store, Path("layer.erofs"))
    table = fetch_chunk_table(blob_store, table_digest, expected_size=layer_size)
    table.verify(offset, data)  # raises BlobDigestMismatch
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsec.errors import BlobDigestMismatch, InvalidRequest

__all__ = [
    "MAGIC",
    "MEDIA_TYPE",
    "PIECE",
    "ChunkTable",
    "build_chunk_table",
    "fetch_chunk_table",
    "publish_chunk_table",
]

MAGIC = b"DSECCT1\n"
MEDIA_TYPE = "application/vnd.dsec.chunktable.v1"
"""Media type of a chunk table in a dsec artifact manifest."""
PIECE = 64 << 10
"""Bytes per piece (64 KiB: the smallest lazy chunk size, so any chunk size that is a
multiple of it is checked exactly, without reading outside the chunk)."""
_HEADER = struct.Struct(">8sQI")
_MAX_TABLE_BYTES = 64 << 20  # a 128 TiB layer; anything larger is not a table


def build_chunk_table(path: Path, piece: int = PIECE) -> bytes:
    """The chunk table of the file at ``path`` (read once, sequentially)."""
    size = os.path.getsize(path)
    parts = [_HEADER.pack(MAGIC, size, piece)]
    with open(path, "rb", buffering=0) as f:
        while True:
            data = f.read(piece)
            if not data:
                break
            parts.append(hashlib.sha256(data).digest())
    return b"".join(parts)


def publish_chunk_table(store: Any, path: Path) -> tuple[str, int]:
    """Build the table of the layer file ``path`` and put it into the blob ``store``
    (anything with ``put(path, digest)``); returns the table's digest and size in bytes."""
    table = build_chunk_table(path)
    digest = f"sha256:{hashlib.sha256(table).hexdigest()}"
    with tempfile.NamedTemporaryFile(prefix=".chunktable-") as tmp:
        tmp.write(table)
        tmp.flush()
        store.put(Path(tmp.name), digest)
    return digest, len(table)


def fetch_chunk_table(store: Any, digest: str, expected_size: int) -> ChunkTable:
    """Read the table ``digest`` from the blob ``store`` and check it (see
    :meth:`ChunkTable.parse`). Raises LayerNotFound if the store lacks it."""
    size = int(store.stat(digest))
    if size > _MAX_TABLE_BYTES:
        raise InvalidRequest(f"chunk table {digest}: {size} bytes is not a table")
    return ChunkTable.parse(
        store.read_range(digest, 0, size), digest=digest, expected_size=expected_size
    )


@dataclass(frozen=True)
class ChunkTable:
    """A parsed chunk table of one blob of ``size`` bytes in pieces of ``piece`` bytes."""

    size: int
    piece: int
    digests: bytes  # 32 bytes per piece

    @classmethod
    def parse(cls, data: bytes, *, digest: str, expected_size: int) -> ChunkTable:
        """Check ``data`` against its ``digest`` and the layer's size, then parse it.

        Raises:
            BlobDigestMismatch: the bytes do not hash to ``digest``.
            InvalidRequest: not a chunk table, or one for a blob of another size.
        """
        actual = f"sha256:{hashlib.sha256(data).hexdigest()}"
        if actual != digest:
            raise BlobDigestMismatch(
                f"chunk table {digest}: content hashes to {actual}",
                expected=digest,
                actual=actual,
            )
        if len(data) < _HEADER.size or len(data) > _MAX_TABLE_BYTES:
            raise InvalidRequest(f"chunk table {digest}: {len(data)} bytes is not a table")
        magic, size, piece = _HEADER.unpack_from(data)
        if magic != MAGIC or piece <= 0:
            raise InvalidRequest(f"chunk table {digest}: bad header")
        n = -(-size // piece)
        if len(data) != _HEADER.size + 32 * n:
            raise InvalidRequest(f"chunk table {digest}: {n} pieces expected, size differs")
        if size != expected_size:
            raise InvalidRequest(
                f"chunk table {digest} describes {size} bytes, the layer has {expected_size}"
            )
        return cls(size=size, piece=piece, digests=data[_HEADER.size :])

    def verify(self, offset: int, data: bytes, *, what: str = "blob") -> None:
        """Check ``data`` read at ``offset``: it must start on a piece boundary and end on
        one (or at the end of the blob).

        Raises:
            BlobDigestMismatch: a piece hashes to something else (``details["offset"]`` is
                the piece's offset).
            InvalidRequest: the range is not aligned to pieces.
        """
        end = offset + len(data)
        if offset % self.piece or (end % self.piece and end != self.size) or end > self.size:
            raise InvalidRequest(
                f"{what}: range [{offset}, {end}) is not aligned to {self.piece}-byte pieces"
            )
        view = memoryview(data)
        for start in range(0, len(data), self.piece):
            index = (offset + start) // self.piece
            want = self.digests[32 * index : 32 * index + 32]
            got = hashlib.sha256(view[start : start + self.piece]).digest()
            if got != want:
                raise BlobDigestMismatch(
                    f"{what}: bytes at offset {offset + start} do not match the chunk table "
                    "(corrupted or tampered blob)",
                    offset=offset + start,
                    expected=want.hex(),
                    actual=got.hex(),
                )
