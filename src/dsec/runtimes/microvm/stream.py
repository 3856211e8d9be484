"""Drop the RAM pages a template clone still shares with its template from a QEMU migration
stream, so that a suspend file holds only what the clone changed.

A clone maps the template RAM file privately (``share=off``); QEMU migrates every page of it.
:func:`diff_against_template` rewrites a stream written by ``migrate`` (QEMU 7.2 format,
precopy, no compression/xbzrle/multifd, no ``x-ignore-shared``) and leaves out each normal
page of block ``mem`` whose bytes equal the template file at the same offset. Loading the
result into a QEMU whose ``mem`` is the same template file mapped ``share=off`` gives the
clone's exact memory back; the untouched pages stay shared with the template's page cache.

Stream layout used here (migration/savevm.c, migration/ram.c)::

    magic "QEVM" u32 | version u32 | CONFIGURATION ... (copied as is)
    START  (0x01) section_id u32 | len u8 "ram" | instance u32 | version u32 | RAM setup | EOS
    PART   (0x02) section_id u32 | page records ... | EOS          (repeated)
    END    (0x03) section_id u32 | page records ... | EOS
    FOOTER (0x7e) section_id u32 after each section
    FULL   (0x04) device sections ... EOF (copied as is)

A page record is ``be64 offset|flags`` (+ ``len u8 idstr`` unless CONTINUE) then one byte
(ZERO) or one page (PAGE). Anything else raises :class:`StreamFormatError` (the caller
keeps the full stream).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import BinaryIO

__all__ = ["StreamFormatError", "diff_against_template"]

PAGE = 4096
_FLAG_ZERO, _FLAG_MEM_SIZE, _FLAG_PAGE, _FLAG_EOS, _FLAG_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
_FLAGS_MASK = PAGE - 1
_SEC_START, _SEC_PART, _SEC_END, _SEC_FULL, _SEC_FOOTER = 0x01, 0x02, 0x03, 0x04, 0x7E


_ZERO_PAGE = bytes(PAGE)


class StreamFormatError(ValueError):
    """The stream is not in the layout this module understands."""


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise StreamFormatError("stream ends early")
        return data

    def u8(self) -> int:
        return self.take(1)[0]

    def be32(self) -> int:
        return int(struct.unpack(">I", self.take(4))[0])

    def be64(self) -> int:
        return int(struct.unpack(">Q", self.take(8))[0])


def _find_ram_start(head: bytes) -> int:
    """Offset of the START section of ``ram`` in the stream's first bytes."""
    needle = b"\x03ram" + struct.pack(">II", 0, 4)
    i = head.find(needle)
    if i < 5 or head[i - 5] != _SEC_START:
        raise StreamFormatError("no RAM START section near the beginning")
    return i - 5


def diff_against_template(
    src: Path, dst: Path, template: Path, block: str = "mem"
) -> dict[str, int]:
    """Write ``src`` to ``dst`` without the pages of ``block`` equal to ``template``.

    Returns counts: ``pages``, ``dropped``, ``zero`` and the two sizes in bytes."""
    stats = {"pages": 0, "dropped": 0, "zero": 0}
    block_of: list[bytes] = [b""]  # the block of the last record: CONTINUE spans sections
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)  # guest RAM
    with open(src, "rb") as fin, os.fdopen(fd, "wb") as fout, open(template, "rb") as ftpl:
        tpl = mmap.mmap(ftpl.fileno(), 0, prot=mmap.PROT_READ)
        try:
            head = fin.read(1 << 16)
            if head[:8] != b"QEVM\x00\x00\x00\x03":
                raise StreamFormatError("not a QEMU migration stream (version 3)")
            start = _find_ram_start(head)
            fout.write(head[:start])
            fin.seek(start)
            r = _Reader(fin)
            # START section header + RAM setup (block list) + EOS
            header = r.take(1 + 4 + 1 + 3 + 4 + 4)
            ram_section = struct.unpack(">I", header[1:5])[0]
            fout.write(header)
            total = r.be64()
            if not total & _FLAG_MEM_SIZE:
                raise StreamFormatError("RAM setup without MEM_SIZE")
            fout.write(struct.pack(">Q", total))
            remaining = total & ~_FLAGS_MASK
            while remaining > 0:
                n = r.u8()
                name = r.take(n)
                used = r.be64()
                fout.write(bytes([n]) + name + struct.pack(">Q", used))
                if name == block.encode() and used > len(tpl):
                    raise StreamFormatError("template file smaller than the RAM block")
                remaining -= used
            _copy_records(r, fout, tpl, block, stats, block_of)  # setup ends with EOS too
            _copy_footer(r, fout, ram_section)
            while True:
                kind = r.u8()
                if kind in (_SEC_PART, _SEC_END):
                    section = r.be32()
                    if section != ram_section:
                        raise StreamFormatError(f"iterative section {section} is not RAM")
                    fout.write(bytes([kind]) + struct.pack(">I", section))
                    _copy_records(r, fout, tpl, block, stats, block_of)
                    _copy_footer(r, fout, ram_section)
                    continue
                # device state and the end of the stream: copied as they are
                fout.write(bytes([kind]))
                while chunk := fin.read(1 << 20):
                    fout.write(chunk)
                break
        finally:
            tpl.close()
    stats["src_bytes"] = src.stat().st_size
    stats["dst_bytes"] = dst.stat().st_size
    return stats


def _copy_footer(r: _Reader, fout: BinaryIO, section: int) -> None:
    kind = r.u8()
    if kind != _SEC_FOOTER or r.be32() != section:
        raise StreamFormatError("section footer missing")
    fout.write(bytes([kind]) + struct.pack(">I", section))


def _copy_records(
    r: _Reader,
    fout: BinaryIO,
    tpl: mmap.mmap,
    block: str,
    stats: dict[str, int],
    block_of: list[bytes],
) -> None:
    """Page records up to and including EOS; every kept record names its block (no
    CONTINUE), so dropping one never leaves the next without its block. ``block_of[0]``:
    the block of the last record read (QEMU's CONTINUE refers to it across sections)."""
    current = block_of[0]
    target = block.encode()
    while True:
        word = r.be64()
        flags = word & _FLAGS_MASK
        offset = word & ~_FLAGS_MASK
        if flags & _FLAG_EOS:
            fout.write(struct.pack(">Q", word))
            return
        if not flags & _FLAG_CONTINUE:
            current = r.take(r.u8())
            block_of[0] = current
        elif not current:
            raise StreamFormatError("CONTINUE record before any block")
        if flags & ~(_FLAG_CONTINUE | _FLAG_ZERO | _FLAG_PAGE) or not flags & (
            _FLAG_ZERO | _FLAG_PAGE
        ):
            raise StreamFormatError(f"unsupported RAM record flags {flags:#x}")
        payload = r.take(1) if flags & _FLAG_ZERO else r.take(PAGE)
        stats["pages"] += 1
        if flags & _FLAG_ZERO:
            stats["zero"] += 1
        same = payload if flags & _FLAG_PAGE else _ZERO_PAGE
        if current == target and tpl[offset : offset + PAGE] == same:
            stats["dropped"] += 1
            continue
        kept = (offset | (flags & ~_FLAG_CONTINUE)) & 0xFFFFFFFFFFFFFFFF
        fout.write(struct.pack(">Q", kept) + bytes([len(current)]) + current + payload)
