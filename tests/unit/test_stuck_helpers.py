"""What dsec says about a helper process that hangs: an exec server that does not answer
its attach, an OCI runtime past its timeout (no root needed; the kernel stack is shown only
to root)."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

import pytest
from tests.timing import budget

from dsec.errors import NodeBusy
from dsec.privileged.reaper import where_is


def test_a_sleeping_process_is_shown_with_where_it_sleeps() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        deadline = time.monotonic() + budget(5)
        where = where_is(proc.pid)
        while ": S" not in where and time.monotonic() < deadline:
            time.sleep(0.02)
            where = where_is(proc.pid)
        assert where.startswith(f"pid {proc.pid}: S"), where
        if os.geteuid() == 0:  # its kernel stack: where it waits
            assert "stack " in where and "nanosleep" in where and " < " in where, where
    finally:
        proc.kill()
        proc.wait()
    assert where_is(proc.pid) == f"pid {proc.pid}: gone"


def test_an_oci_runtime_that_hangs_is_killed_and_described(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`crun run` past its timeout: a retryable NodeBusy (503: nothing was created) naming
    the step (not subprocess's TimeoutExpired with the whole command line), and where it
    was stuck in the log."""
    import dsec.runtimes.container.runtime as container_runtime
    from dsec.config import Paths
    from dsec.layers.mounts import LayerMounts
    from dsec.runtimes.container.runtime import ContainerRuntime

    slow = tmp_path / "crun"
    slow.write_text("#!/bin/sh\nexec sleep 30\n")
    slow.chmod(0o755)
    monkeypatch.setattr(container_runtime, "_OCI_TIMEOUT_S", 0.3)
    rt = ContainerRuntime(Paths(tmp_path / "home"), LayerMounts(tmp_path / "m"))
    rt._oci = str(slow)
    with caplog.at_level(logging.WARNING, logger="dsec.runtimes.container.runtime"):
        with pytest.raises(NodeBusy) as info:
            rt._run_oci("run", "--detach", "sb-x")
    text = info.value.message
    assert info.value.http_status == 503 and info.value.details["retry_after_s"] > 0
    assert "crun run did not finish within 0.3 s" in text, text
    assert "sleep 30" not in text and "pid " not in text  # no command line, no host details
    assert "crun run timed out: pid " in caplog.text  # where it waited: for the operator
