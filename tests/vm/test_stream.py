"""The suspend-file rewriter (dsec.runtimes.microvm.stream) on hand-built QEMU streams: pages
equal to the template are dropped, the rest (and everything after the RAM sections) is kept,
CONTINUE records across sections resolve to the right block. No VM needed."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from dsec.runtimes.microvm.stream import PAGE, StreamFormatError, diff_against_template

ZERO, MEM_SIZE, PAGE_F, EOS, CONT = 0x02, 0x04, 0x08, 0x10, 0x20
RAM_ID = 2


def _rec(offset: int, flags: int, block: bytes | None, payload: bytes) -> bytes:
    out = struct.pack(">Q", offset | flags)
    if block is not None:
        out += bytes([len(block)]) + block
    return out + payload


def _footer() -> bytes:
    return b"\x7e" + struct.pack(">I", RAM_ID)


def _stream(blocks: dict[bytes, int], parts: list[bytes], tail: bytes) -> bytes:
    head = b"QEVM" + struct.pack(">I", 3) + b"\x07" + struct.pack(">I", 3) + b"pc\x00"
    start = b"\x01" + struct.pack(">I", RAM_ID) + b"\x03ram" + struct.pack(">II", 0, 4)
    start += struct.pack(">Q", sum(blocks.values()) | MEM_SIZE)
    for name, size in blocks.items():
        start += bytes([len(name)]) + name + struct.pack(">Q", size)
    start += struct.pack(">Q", EOS) + _footer()
    body = b"".join(
        bytes([0x02]) + struct.pack(">I", RAM_ID) + p + struct.pack(">Q", EOS) + _footer()
        for p in parts
    )
    return head + start + body + tail


def _pages(n: int, seed: int) -> list[bytes]:
    return [bytes([(seed + i) % 251 + 1]) * PAGE for i in range(n)]


def test_drops_pages_equal_to_the_template(tmp_path: Path) -> None:
    tpl_pages = _pages(4, 10)
    tpl_pages[3] = bytes(PAGE)  # a zero page in the template
    template = tmp_path / "tpl.ram"
    template.write_bytes(b"".join(tpl_pages))
    changed = b"\xee" * PAGE
    vga = b"\x55" * PAGE
    parts = [
        _rec(0, PAGE_F, b"mem", tpl_pages[0])  # same as template: dropped
        + _rec(PAGE, PAGE_F | CONT, None, changed)  # changed: kept
        + _rec(0, PAGE_F, b"vga", vga),  # another block: kept
        # CONTINUE at the start of a section refers to the last block (vga)
        _rec(PAGE, PAGE_F | CONT, None, vga)
        + _rec(2 * PAGE, ZERO, b"mem", b"\x00")  # zero over a non-zero template page: kept
        + _rec(3 * PAGE, ZERO | CONT, None, b"\x00")  # zero over zero: dropped
        + _rec(2 * PAGE, PAGE_F | CONT, None, tpl_pages[2]),  # same again: dropped
    ]
    tail = b"\x04" + struct.pack(">I", 9) + b"\x03cpu" + b"device state" + b"\x00"
    src, dst = tmp_path / "state", tmp_path / "state.diff"
    src.write_bytes(_stream({b"mem": 4 * PAGE, b"vga": 2 * PAGE}, parts, tail))

    stats = diff_against_template(src, dst, template)

    assert (stats["pages"], stats["dropped"], stats["zero"]) == (7, 3, 2)
    out = dst.read_bytes()
    assert dst.stat().st_mode & 0o077 == 0
    assert out.endswith(tail) and len(out) < len(src.read_bytes()) - 2 * PAGE
    assert tpl_pages[0] not in out and changed in out and out.count(vga) == 2
    # every kept record names its block: no CONTINUE flag survives
    expected_kept = (
        _rec(PAGE, PAGE_F, b"mem", changed)
        + _rec(0, PAGE_F, b"vga", vga)
        + struct.pack(">Q", EOS)
        + _footer()
        + b"\x02"
        + struct.pack(">I", RAM_ID)
        + _rec(PAGE, PAGE_F, b"vga", vga)
        + _rec(2 * PAGE, ZERO, b"mem", b"\x00")
    )
    assert expected_kept in out


def test_unknown_layouts_are_refused(tmp_path: Path) -> None:
    template = tmp_path / "tpl.ram"
    template.write_bytes(bytes(PAGE))
    src, dst = tmp_path / "state", tmp_path / "out"
    src.write_bytes(b"not a migration stream")
    with pytest.raises(StreamFormatError):
        diff_against_template(src, dst, template)
    # an xbzrle record (flag 0x40): not understood, refused rather than mangled
    src.write_bytes(_stream({b"mem": PAGE}, [_rec(0, 0x40, b"mem", b"\x00" * 8)], b"\x00"))
    with pytest.raises(StreamFormatError):
        diff_against_template(src, dst, template)
