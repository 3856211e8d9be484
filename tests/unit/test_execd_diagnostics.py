"""What an attach timeout says about an exec server that does not answer (no root needed;
the kernel stack is shown only to root)."""

from __future__ import annotations

import os
import subprocess
import time

from dsec.runtimes.container.execd import _where_is


def test_a_sleeping_process_is_shown_with_where_it_sleeps() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        where = _where_is(proc.pid)
        while ": S" not in where and time.monotonic() < deadline:
            time.sleep(0.02)
            where = _where_is(proc.pid)
        assert where.startswith(f"pid {proc.pid}: S"), where
        if os.geteuid() == 0:  # its kernel stack: where it waits
            assert "stack " in where and "nanosleep" in where and " < " in where, where
    finally:
        proc.kill()
        proc.wait()
    assert _where_is(proc.pid) == f"pid {proc.pid}: gone"
