"""Read text off a VGA text-mode screenshot, with a font learned from the screen itself.

No OCR dependency: :func:`learn_glyphs` takes a screenshot where known characters sit at
known cells and records each character's cell bitmap; :func:`read_screen` then maps every
cell of another screenshot to the nearest learned glyph. Works for QEMU's 720x400 text mode
(80x25 cells of 9x16 pixels).
"""

from __future__ import annotations

import struct
import zlib

Pixels = list[list[tuple[int, int, int]]]
CELL_W, CELL_H = 9, 16


def decode_png(data: bytes) -> Pixels:
    """Decode an 8-bit RGB/RGBA, non-interlaced PNG into rows of (r, g, b)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and interlace == 0 and color in (2, 6), (depth, color, interlace)
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
    raw = zlib.decompress(idat)
    stride = width * channels
    rows: list[bytearray] = []
    prev = bytearray(stride)
    off = 0
    for _ in range(height):
        ftype, line = raw[off], bytearray(raw[off + 1 : off + 1 + stride])
        off += 1 + stride
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 0xFF
            elif ftype == 2:
                line[i] = (line[i] + b) & 0xFF
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        rows.append(line)
        prev = line
    return [[(r[i], r[i + 1], r[i + 2]) for i in range(0, stride, channels)] for r in rows]


def cell_bitmap(px: Pixels, row: int, col: int) -> tuple[bool, ...]:
    """Foreground mask of one text cell (bright pixels)."""
    y0, x0 = row * CELL_H, col * CELL_W
    return tuple(
        max(px[y][x]) > 100 for y in range(y0, y0 + CELL_H) for x in range(x0, x0 + CELL_W)
    )


def learn_glyphs(px: Pixels, text: str, row: int = 0) -> dict[tuple[bool, ...], str]:
    """Glyph table from a screen showing ``text`` from (row, 0) on, wrapping at 80 columns."""
    table: dict[tuple[bool, ...], str] = {}
    for i, ch in enumerate(text):
        table.setdefault(cell_bitmap(px, row + i // 80, i % 80), ch)
    return table


def read_screen(px: Pixels, glyphs: dict[tuple[bool, ...], str]) -> list[str]:
    """Every text row of the screen, each cell mapped to the nearest learned glyph."""
    rows, cols = len(px) // CELL_H, len(px[0]) // CELL_W
    known = list(glyphs.items())
    out = []
    for r in range(rows):
        line = []
        for c in range(cols):
            bm = cell_bitmap(px, r, c)
            ch = glyphs.get(bm)
            if ch is None:
                dist, ch = min(
                    (sum(a != b for a, b in zip(bm, g, strict=True)), v) for g, v in known
                )
                if dist > 6:
                    ch = "?"
            line.append(ch)
        out.append("".join(line).rstrip())
    return out
