"""bound_console: a VM's console log cut to its newest half past the cap (no VM needed)."""

from __future__ import annotations

import os
from pathlib import Path

from dsec.runtimes.microvm.runtime import bound_console


def test_cut_keeps_the_newest_lines_and_appends_after_them(tmp_path: Path) -> None:
    log = tmp_path / "console.log"
    log.write_bytes(b"".join(b"line %05d\n" % i for i in range(10000)))  # 110,000 bytes
    qemu = os.open(log, os.O_WRONLY | os.O_APPEND)  # a writer that opened it before the cut
    assert not bound_console(log, 200_000)
    assert bound_console(log, 16384)
    text = log.read_text()
    assert len(text) <= 16384 // 2 + 100
    first, second, *_ = text.splitlines()
    assert first.startswith("[dsec: ") and "older bytes of this console were dropped" in first
    assert second.startswith("line ") and text.endswith("line 09999\n")
    # it goes on after the kept tail
    os.write(qemu, b"later\n")
    os.close(qemu)
    assert log.read_text().endswith("line 09999\nlater\n")
    assert not bound_console(tmp_path / "missing.log", 10)
