"""Chunk tables: per-piece digests that let lazily loaded layers check each fetched range."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from dsec.errors import BlobDigestMismatch, InvalidRequest
from dsec.layers.blobstore import LocalDirStore
from dsec.layers.chunktable import (
    PIECE,
    ChunkTable,
    build_chunk_table,
    fetch_chunk_table,
    publish_chunk_table,
)


def _blob(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "layer.bin"
    path.write_bytes(data)
    return path, data


def _table(path: Path) -> ChunkTable:
    raw = build_chunk_table(path)
    return ChunkTable.parse(
        raw, digest="sha256:" + hashlib.sha256(raw).hexdigest(), expected_size=path.stat().st_size
    )


def test_verify_accepts_the_blob_and_catches_one_flipped_byte(tmp_path: Path) -> None:
    size = 5 * PIECE + 123  # a short last piece
    path, data = _blob(tmp_path, size)
    table = _table(path)
    assert (table.size, table.piece, len(table.digests)) == (size, PIECE, 32 * 6)
    table.verify(0, data)  # the whole blob
    table.verify(2 * PIECE, data[2 * PIECE : 4 * PIECE])  # an aligned range
    table.verify(5 * PIECE, data[5 * PIECE :])  # the short tail
    bad = bytearray(data[2 * PIECE : 4 * PIECE])
    bad[PIECE + 7] ^= 1
    with pytest.raises(BlobDigestMismatch) as e:
        table.verify(2 * PIECE, bytes(bad))
    assert e.value.details["offset"] == 3 * PIECE
    with pytest.raises(InvalidRequest):  # a truncated tail ends inside a piece
        table.verify(5 * PIECE, data[5 * PIECE : -1])


def test_misaligned_ranges_are_refused(tmp_path: Path) -> None:
    path, data = _blob(tmp_path, 3 * PIECE)
    table = _table(path)
    with pytest.raises(InvalidRequest):
        table.verify(1, data[1:PIECE])
    with pytest.raises(InvalidRequest):
        table.verify(0, data[: PIECE + 1])
    with pytest.raises(InvalidRequest):  # past the end
        table.verify(2 * PIECE, data[2 * PIECE :] + b"x" * PIECE)


def test_parse_refuses_bad_tables(tmp_path: Path) -> None:
    path, _ = _blob(tmp_path, 2 * PIECE)
    raw = build_chunk_table(path)
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    with pytest.raises(BlobDigestMismatch):  # bytes that are not the named table
        ChunkTable.parse(raw[:-1] + bytes([raw[-1] ^ 1]), digest=digest, expected_size=2 * PIECE)
    with pytest.raises(InvalidRequest):  # a table of another blob size
        ChunkTable.parse(raw, digest=digest, expected_size=2 * PIECE + 1)
    for junk in (b"", b"not a table at all", raw[:-32]):
        d = "sha256:" + hashlib.sha256(junk).hexdigest()
        with pytest.raises(InvalidRequest):
            ChunkTable.parse(junk, digest=d, expected_size=2 * PIECE)


def test_publish_and_fetch_through_a_blob_store(tmp_path: Path) -> None:
    path, data = _blob(tmp_path, 3 * PIECE + 5)
    store = LocalDirStore(tmp_path / "blobs")
    digest, size = publish_chunk_table(store, path)
    assert store.stat(digest) == size == 16 + 32 * 4 + 4
    table = fetch_chunk_table(store, digest, len(data))
    table.verify(0, data)
    assert publish_chunk_table(store, path) == (digest, size)  # idempotent
